//! Tokenizer: `tokenizer.json` through the `tokenizers` crate, plus the raw bytes of each
//! token (byte-level BPE tokens often hold part of a UTF-8 character; the gateway joins
//! bytes, never strings, so it can hold back an incomplete character).

use std::path::Path;

/// A tokenizer failure, naming the file.
#[derive(Debug, thiserror::Error)]
#[error("{path}: tokenizer: {reason}")]
pub struct Error {
    pub path: std::path::PathBuf,
    pub reason: String,
}

pub type Result<T> = std::result::Result<T, Error>;

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// `bytes[id]`: the bytes token `id` stands for.
    bytes: Vec<Vec<u8>>,
    pub eos_ids: Vec<u32>,
    pub special: Vec<bool>,
}

/// GPT-2's byte-to-unicode table, inverted: char -> byte.
fn byte_decoder() -> std::collections::HashMap<char, u8> {
    let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    bs.iter()
        .zip(&cs)
        .filter_map(|(&b, &c)| char::from_u32(c).map(|c| (c, b as u8)))
        .collect()
}

/// GPT-2's byte-to-unicode table: byte -> char.
pub fn byte_encoder() -> Vec<char> {
    let mut out = vec![' '; 256];
    for (c, b) in byte_decoder() {
        out[b as usize] = c;
    }
    out
}

impl Tokenizer {
    pub fn from_file(path: &Path) -> Result<Self> {
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| Error {
            path: path.into(),
            reason: e.to_string(),
        })?;
        Ok(Self::from_inner(inner))
    }

    fn from_inner(inner: tokenizers::Tokenizer) -> Self {
        let n = inner.get_vocab_size(true);
        let dec = byte_decoder();
        let mut bytes = vec![Vec::new(); n];
        let mut special = vec![false; n];
        let added = inner.get_added_tokens_decoder();
        for id in 0..n as u32 {
            if let Some(a) = added.get(&id) {
                bytes[id as usize] = a.content.as_bytes().to_vec();
                special[id as usize] = a.special;
                continue;
            }
            let Some(tok) = inner.id_to_token(id) else {
                continue;
            };
            // byte-level BPE: every char maps to one byte
            if let Some(b) = tok
                .chars()
                .map(|c| dec.get(&c).copied())
                .collect::<Option<Vec<u8>>>()
            {
                bytes[id as usize] = b;
            } else if let Some(hex) = tok.strip_prefix("<0x").and_then(|t| t.strip_suffix('>')) {
                // sentencepiece byte fallback
                bytes[id as usize] = u8::from_str_radix(hex, 16)
                    .map(|b| vec![b])
                    .unwrap_or_default();
            } else {
                bytes[id as usize] = tok.replace('\u{2581}', " ").into_bytes();
            }
        }
        let eos_ids = ["<|im_end|>", "<|endoftext|>", "</s>", "<|eot_id|>"]
            .iter()
            .filter_map(|t| inner.token_to_id(t))
            .collect();
        Tokenizer {
            inner,
            bytes,
            eos_ids,
            special,
        }
    }

    pub fn vocab_size(&self) -> usize {
        self.bytes.len()
    }

    /// Encodes text; special tokens written in the text (e.g. `<|im_start|>`) are recognised.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.inner
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| Error {
                path: "tokenizer.json".into(),
                reason: e.to_string(),
            })
    }

    /// The raw bytes of a token (empty for an unknown id).
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.bytes.get(id as usize).map_or(&[], |b| b.as_slice())
    }

    pub fn is_special(&self, id: u32) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }

    /// Decodes ids to text, invalid UTF-8 replaced by U+FFFD.
    pub fn decode_lossy(&self, ids: &[u32]) -> String {
        let mut b = Vec::new();
        for &i in ids {
            b.extend_from_slice(self.token_bytes(i));
        }
        String::from_utf8_lossy(&b).into_owned()
    }

    pub fn token_to_id(&self, t: &str) -> Option<u32> {
        self.inner.token_to_id(t)
    }
}
