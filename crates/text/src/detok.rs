//! Incremental detokenisation over bytes. Byte-level BPE tokens often end inside a UTF-8
//! character: hold the incomplete tail back until its bytes arrive, emit U+FFFD for bytes
//! that can never form a character, and never fail. The concatenation of everything emitted
//! equals `String::from_utf8_lossy` of all the bytes (the non-streamed text).
//!
//! Stop strings are matched on the decoded text; text that could still become a stop string
//! is held back too, so a stop string never reaches the client.

/// Streaming UTF-8 decoder with stop strings.
#[derive(Debug, Default)]
pub struct Detokenizer {
    pending: Vec<u8>,
    /// decoded text not yet emitted (held back for stop-string matching)
    held: String,
    stops: Vec<String>,
    stopped: bool,
    /// The stop string that ended the stream.
    hit: Option<String>,
}

impl Detokenizer {
    pub fn new(stops: Vec<String>) -> Self {
        Detokenizer {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            ..Default::default()
        }
    }

    /// Whether a stop string was seen (nothing more will be emitted).
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// The stop string that ended the stream (the earliest in the text), once stopped.
    pub fn stop_hit(&self) -> Option<&str> {
        self.hit.as_deref()
    }

    fn decode_pending(&mut self, flush: bool) {
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    self.held.push_str(s);
                    self.pending.clear();
                    return;
                }
                Err(e) => {
                    let good = e.valid_up_to();
                    // SAFETY-free: from_utf8 said these bytes are valid
                    if let Ok(s) = std::str::from_utf8(&self.pending[..good]) {
                        self.held.push_str(s);
                    }
                    match e.error_len() {
                        Some(bad) => {
                            self.held.push('\u{FFFD}');
                            self.pending.drain(..good + bad);
                        }
                        None => {
                            // incomplete character at the end
                            self.pending.drain(..good);
                            if flush {
                                self.held.push('\u{FFFD}');
                                self.pending.clear();
                            }
                            return;
                        }
                    }
                }
            }
        }
    }

    /// Adds a token's bytes; returns the text that can be emitted now.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        if self.stopped {
            return String::new();
        }
        self.pending.extend_from_slice(bytes);
        self.decode_pending(false);
        self.release(false)
    }

    /// End of stream: emits everything still held (incomplete bytes become U+FFFD).
    pub fn finish(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        self.decode_pending(true);
        self.release(true)
    }

    fn release(&mut self, all: bool) -> String {
        // a complete stop string: emit up to it, then stop
        if let Some((pos, stop)) = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()).map(|p| (p, s)))
            .min_by_key(|x| x.0)
        {
            self.hit = Some(stop.clone());
            let out = self.held[..pos].to_string();
            self.held.clear();
            self.pending.clear();
            self.stopped = true;
            return out;
        }
        if all || self.stops.is_empty() {
            return std::mem::take(&mut self.held);
        }
        // hold back the longest suffix that is a prefix of some stop string
        let mut keep = 0;
        for s in &self.stops {
            for (i, _) in self.held.char_indices() {
                let suffix = &self.held[i..];
                if s.starts_with(suffix) {
                    keep = keep.max(suffix.len());
                    break;
                }
            }
        }
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(chunks: &[&[u8]], stops: &[&str]) -> (Vec<String>, bool) {
        let mut d = Detokenizer::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out: Vec<String> = chunks.iter().map(|c| d.push(c)).collect();
        out.push(d.finish());
        (out, d.stopped())
    }

    #[test]
    fn holds_back_incomplete_characters() {
        let s = "日本語".as_bytes();
        let (out, _) = run(&[&s[..1], &s[1..4], &s[4..]], &[]);
        assert_eq!(out, vec!["", "日", "本語", ""]);
    }

    #[test]
    fn invalid_bytes_become_replacement_and_join_equals_lossy() {
        // seeded random byte streams cut at random places
        let mut x: u64 = 12345;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let pool: Vec<u8> = "aé日本😀 "
            .bytes()
            .chain([0xff, 0xc3, 0xe6, 0x80])
            .collect();
        for _ in 0..2000 {
            let n = (next() % 24) as usize;
            let bytes: Vec<u8> = (0..n)
                .map(|_| pool[(next() % pool.len() as u64) as usize])
                .collect();
            let mut chunks = Vec::new();
            let mut i = 0;
            while i < bytes.len() {
                let k = 1 + (next() % 4) as usize;
                chunks.push(&bytes[i..(i + k).min(bytes.len())]);
                i += k;
            }
            let (out, _) = run(&chunks, &[]);
            assert_eq!(out.concat(), String::from_utf8_lossy(&bytes), "{bytes:?}");
        }
    }

    #[test]
    fn stop_strings_are_never_emitted() {
        let (out, stopped) = run(&[b"Hello", b" wor", b"ld", b"!!"], &["world"]);
        assert_eq!(out.concat(), "Hello ");
        assert!(stopped);
        // a prefix of the stop string that does not complete is released at the end
        let (out, stopped) = run(&[b"ab", b"c"], &["cd"]);
        assert_eq!(out, vec!["ab", "", "c"]);
        assert!(!stopped);
    }
}
