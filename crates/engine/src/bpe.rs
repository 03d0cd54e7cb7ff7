//! A small, deterministic byte-level BPE trainer (Sennrich et al. 2016, GPT-2's byte
//! alphabet) for synthetic checkpoints. Pre-tokenisation is the `tokenizers` crate's own
//! ByteLevel pre-tokenizer, so the merges learned here are the ones it applies at encode time.

use std::collections::HashMap;

use serde_json::{json, Value};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

use crate::tokenizer::byte_encoder;

/// Special tokens appended after the learned vocabulary.
pub const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

pub struct Bpe {
    /// token strings (GPT-2 byte alphabet), id = index
    pub vocab: Vec<String>,
    pub merges: Vec<(String, String)>,
}

/// Splits text into byte-level pre-tokens, exactly as the tokenizer will.
pub fn pre_tokenize(text: &str) -> Vec<String> {
    let mut pts = PreTokenizedString::from(text);
    let bl = ByteLevel::new(false, false, true);
    if bl.pre_tokenize(&mut pts).is_err() {
        return Vec::new();
    }
    pts.get_splits(OffsetReferential::Original, OffsetType::Byte)
        .into_iter()
        .map(|(s, _, _)| s.to_string())
        .collect()
}

/// Learns merges until `vocab_size` (including the specials) or no pair occurs twice.
pub fn train(texts: &[&str], vocab_size: usize) -> Bpe {
    let enc = byte_encoder();
    let mut vocab: Vec<String> = (0..256).map(|b| enc[b].to_string()).collect();
    let id_of: HashMap<char, u32> = (0..256).map(|b| (enc[b], b as u32)).collect();
    let mut words: HashMap<String, u64> = HashMap::new();
    for t in texts {
        for line in t.lines() {
            for w in pre_tokenize(line) {
                *words.entry(w).or_insert(0) += 1;
            }
        }
    }
    let mut words: Vec<(Vec<u32>, u64)> = {
        let mut v: Vec<(String, u64)> = words.into_iter().collect();
        v.sort();
        v.into_iter()
            .map(|(w, c)| (w.chars().map(|ch| id_of[&ch]).collect(), c))
            .collect()
    };
    let mut merges = Vec::new();
    let target = vocab_size.saturating_sub(SPECIALS.len());
    while vocab.len() < target {
        let mut pairs: HashMap<(u32, u32), u64> = HashMap::new();
        for (w, c) in &words {
            for p in w.windows(2) {
                *pairs.entry((p[0], p[1])).or_insert(0) += c;
            }
        }
        let best = pairs
            .into_iter()
            .filter(|&(_, c)| c >= 2)
            .max_by(|a, b| a.1.cmp(&b.1).then(b.0.cmp(&a.0)));
        let Some(((a, b), _)) = best else { break };
        let new_id = vocab.len() as u32;
        vocab.push(format!("{}{}", vocab[a as usize], vocab[b as usize]));
        merges.push((vocab[a as usize].clone(), vocab[b as usize].clone()));
        for (w, _) in words.iter_mut() {
            let mut i = 0;
            let mut out = Vec::with_capacity(w.len());
            while i < w.len() {
                if i + 1 < w.len() && w[i] == a && w[i + 1] == b {
                    out.push(new_id);
                    i += 2;
                } else {
                    out.push(w[i]);
                    i += 1;
                }
            }
            *w = out;
        }
    }
    Bpe { vocab, merges }
}

impl Bpe {
    /// Total ids including the specials.
    pub fn len(&self) -> usize {
        self.vocab.len() + SPECIALS.len()
    }
    pub fn is_empty(&self) -> bool {
        self.vocab.is_empty()
    }

    /// `tokenizer.json` in the format of the `tokenizers` library (as Qwen's, but with the
    /// plain ByteLevel pre-tokenizer).
    pub fn to_json(&self) -> Value {
        let vocab: serde_json::Map<String, Value> = self
            .vocab
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), json!(i)))
            .collect();
        let added: Vec<Value> = SPECIALS
            .iter()
            .enumerate()
            .map(|(i, s)| {
                json!({"id": self.vocab.len() + i, "content": s, "single_word": false,
                       "lstrip": false, "rstrip": false, "normalized": false, "special": true})
            })
            .collect();
        let merges: Vec<Value> = self.merges.iter().map(|(a, b)| json!([a, b])).collect();
        json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": {"type": "NFC"},
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true},
            "post_processor": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true},
            "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                      "ignore_merges": false, "vocab": vocab, "merges": merges}
        })
    }
}
