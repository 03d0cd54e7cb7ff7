//! Reading a checkpoint's side files (config.json, tokenizer.json, chat templates, the
//! shard index) with a bound: each must be a regular file no larger than its kind allows, so
//! a link to `/dev/zero`, a FIFO or a file of many gigabytes is refused, naming the file,
//! before anything is read, instead of taking the process's memory or blocking it forever.

use std::io::Read;
use std::path::Path;

/// The most a JSON config (config.json, generation_config.json, tokenizer_config.json, a chat
/// template) may hold: 64 MiB.
pub const CONFIG_LIMIT: u64 = 64 << 20;
/// The most a vocabulary file (tokenizer.json, tiktoken.model) or a shard index may hold:
/// 1 GiB (released ones hold tens of MiB).
pub const VOCAB_LIMIT: u64 = 1 << 30;

/// The bytes of `path`, a regular file (links followed) of at most `limit` bytes; an
/// `InvalidData` error saying what it is otherwise. The read itself is bounded too, so a file
/// that grows while it is read is refused as well.
pub fn read_bounded(path: &Path, limit: u64) -> std::io::Result<Vec<u8>> {
    let bad = |what: String| std::io::Error::new(std::io::ErrorKind::InvalidData, what);
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(bad(if meta.is_dir() {
            "is a directory, not a file".into()
        } else {
            "is not a regular file (a device, a FIFO or a socket)".into()
        }));
    }
    if meta.len() > limit {
        return Err(bad(format!(
            "is {} bytes, more than the {limit} such a file may hold",
            meta.len()
        )));
    }
    let mut out = Vec::with_capacity(meta.len() as usize);
    std::fs::File::open(path)?
        .take(limit + 1)
        .read_to_end(&mut out)?;
    if out.len() as u64 > limit {
        return Err(bad(format!(
            "grew past the {limit} bytes such a file may hold"
        )));
    }
    Ok(out)
}

/// As [`read_bounded`], as UTF-8 text.
pub fn read_bounded_text(path: &Path, limit: u64) -> std::io::Result<String> {
    String::from_utf8(read_bounded(path, limit)?).map_err(|e| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("is not UTF-8 text ({e})"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_regular_files_within_the_bound_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("config.json");
        std::fs::write(&f, b"{}").unwrap();
        assert_eq!(read_bounded(&f, 2).unwrap(), b"{}");
        let e = read_bounded(&f, 1).unwrap_err().to_string();
        assert!(e.contains("2 bytes") && e.contains("1"), "{e}");
        // a device (a link to /dev/zero would be the same) and a directory: refused unread
        let e = read_bounded(Path::new("/dev/zero"), CONFIG_LIMIT).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        let e = read_bounded(dir.path(), CONFIG_LIMIT).unwrap_err();
        assert!(e.to_string().contains("directory"), "{e}");
        #[cfg(unix)]
        {
            let link = dir.path().join("tokenizer.json");
            std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
            let e = read_bounded(&link, VOCAB_LIMIT).unwrap_err();
            assert!(e.to_string().contains("not a regular file"), "{e}");
        }
        let e = read_bounded_text(&f, 1).unwrap_err();
        assert!(e.to_string().contains("bytes"), "{e}");
    }
}
