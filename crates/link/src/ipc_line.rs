//! The `ipc` link's handshake lines (crates/link/src/ipc.rs; built in every build so that
//! the parsing is tested without a GPU): `ipc1:<pid>:<layers>:<rows>:<k>:<hidden>:
//! <experts>:<handle>`, the sender's process id, the mailbox's shape and the CUDA IPC handle
//! of the sender's box (128 hex digits).

use moelane_engine::tier::BoxLayout;
use moelane_engine::{Error, Result};

/// Hex of a handle (128 digits), as it travels in a handshake line.
pub fn handle_hex(h: &[u8; 64]) -> String {
    h.iter().map(|b| format!("{b:02x}")).collect()
}

/// A handle from [`handle_hex`]'s digits.
pub fn handle_from_hex(s: &str) -> Result<[u8; 64]> {
    let b = s.as_bytes();
    if b.len() != 128 || !b.iter().all(u8::is_ascii_hexdigit) {
        return Err(Error::Invalid(format!(
            "an IPC handle is 128 hex digits, got {} characters",
            s.len()
        )));
    }
    let mut h = [0u8; 64];
    for (i, c) in b.chunks(2).enumerate() {
        let t = std::str::from_utf8(c).map_err(|_| Error::Invalid("IPC handle".into()))?;
        h[i] = u8::from_str_radix(t, 16).map_err(|_| Error::Invalid("IPC handle".into()))?;
    }
    Ok(h)
}

/// The shape a handshake line names (checked), before anything is opened.
pub fn line_layout(text: &str) -> Result<BoxLayout> {
    parse_line(text, "parameters").map(|(_, l, _)| l)
}

/// The handshake's line: `ipc1:<pid>:<layers>:<rows>:<k>:<hidden>:<experts>:<handle>`, this
/// process's id and the buffer's handle.
pub fn line(l: &BoxLayout, handle: &[u8; 64]) -> String {
    format!(
        "ipc1:{}:{}:{}:{}:{}:{}:{}",
        std::process::id(),
        l.layers,
        l.cap_rows,
        l.k,
        l.hidden,
        l.experts,
        handle_hex(handle)
    )
}

/// Reads a [`line`] (`what` names it in errors): the peer's pid, the shape (checked) and
/// the handle.
pub fn parse_line(text: &str, what: &str) -> Result<(u32, BoxLayout, [u8; 64])> {
    let bad = || {
        Error::Invalid(format!(
            "ipc link {what} {:?}: expected ipc1:<pid>:<layers>:<rows>:<k>:<hidden>:<experts>:<handle>",
            short(text)
        ))
    };
    let parts: Vec<&str> = text.trim().split(':').collect();
    let [tag, pid, layers, rows, k, hidden, experts, handle] = parts[..] else {
        return Err(bad());
    };
    if tag != "ipc1" {
        return Err(Error::Invalid(format!(
            "ipc link {what}: version {tag:?}, this build speaks ipc1"
        )));
    }
    let n = |v: &str| v.parse::<usize>().map_err(|_| bad());
    let pid = pid.parse::<u32>().map_err(|_| bad())?;
    let layout = BoxLayout {
        layers: n(layers)?,
        cap_rows: n(rows)?,
        k: n(k)?,
        hidden: n(hidden)?,
        experts: n(experts)?,
    };
    layout.check()?;
    Ok((pid, layout, handle_from_hex(handle)?))
}

fn short(s: &str) -> String {
    s.chars().take(48).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> BoxLayout {
        BoxLayout {
            layers: 40,
            cap_rows: 512,
            k: 6,
            hidden: 1024,
            experts: 384,
        }
    }

    #[test]
    fn a_line_round_trips_and_hostile_lines_are_refused_by_name() {
        let mut h = [0u8; 64];
        for (i, b) in h.iter_mut().enumerate() {
            *b = (i * 7) as u8;
        }
        assert_eq!(handle_from_hex(&handle_hex(&h)).unwrap(), h);
        let text = line(&shape(), &h);
        let (pid, l, got) = parse_line(&text, "offer").unwrap();
        assert_eq!((pid, l, got), (std::process::id(), shape(), h));
        assert_eq!(line_layout(&text).unwrap(), shape());
        let hex = handle_hex(&h);
        for (bad, says) in [
            ("".to_string(), "expected ipc1"),
            ("ipc2:1:40:512:6:1024:384:00".to_string(), "version"),
            (format!("ipc1:x:40:512:6:1024:384:{hex}"), "expected ipc1"),
            (format!("ipc1:1:40:512:0:1024:384:{hex}"), "layers 1..=4096"),
            (format!("ipc1:1:40:4294967296:6:1024:384:{hex}"), "rows x k"),
            (
                format!("ipc1:1:40:512:6:1024:384:{}", "g".repeat(128)),
                "128 hex digits",
            ),
            ("ipc1:1:40:512:6:1024:384:abc".to_string(), "128 hex digits"),
            (
                format!("ipc1:1:40:512:6:1024:384:{hex}:extra"),
                "expected ipc1",
            ),
            ("ipc1:1:-1:512:6:1024:384:00".to_string(), "expected ipc1"),
        ] {
            let e = parse_line(&bad, "offer").expect_err(&bad).to_string();
            assert!(e.contains(says), "{bad:?}: {e}");
        }
    }
}
