//! Tokenizer: `tokenizer.json` through the `tokenizers` crate, plus the raw bytes of each
//! token (byte-level BPE tokens often hold part of a UTF-8 character; the gateway joins
//! bytes, never strings, so it can hold back an incomplete character). A checkpoint that
//! ships a tiktoken vocabulary instead (`tiktoken.model`: Kimi K2) is converted when loaded
//! into the same byte-level BPE (see [`tiktoken`]).

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
    /// The same tokenizer with special tokens read as plain text (for what users wrote).
    plain: tokenizers::Tokenizer,
    /// The text of every special token, longest first, and their finder
    /// ([`Tokenizer::find_special_at`]).
    special_texts: Vec<String>,
    special_finder: Finder,
    /// The text of every added token, special or not (DeepSeek's `<｜User｜>` and Qwen's
    /// `<think>` are added tokens marked not special), longest first, and their finder
    /// ([`Tokenizer::find_added_at`]).
    added_texts: Vec<String>,
    added_finder: Finder,
    /// `bytes[id]`: the bytes token `id` stands for.
    bytes: Vec<Vec<u8>>,
    /// One past the largest id the vocabulary gives a token (its added tokens included):
    /// what a model's embedding must cover ([`Tokenizer::id_bound`]).
    id_bound: u64,
    pub eos_ids: Vec<u32>,
    pub special: Vec<bool>,
}

/// The most token ids a tokenizer's tables are made for (16.7M, the config's own bound on
/// `vocab_size`): a vocabulary naming ids beyond it is refused by [`Tokenizer::id_bound`]'s
/// callers, and its tables stop there.
const MAX_IDS: usize = 1 << 24;

/// How token texts are found in a client's string: one automaton over all of them (time
/// linear in the string, however many texts share a first character: DeepSeek-V3 has ~800
/// beginning with `<`), or, where it cannot be built, a scan from each position whose
/// character begins some text (`firsts`, sorted).
enum Finder {
    Automaton(aho_corasick::AhoCorasick),
    Scan(Vec<char>),
}

impl Finder {
    /// Over `texts` (longest first).
    fn new(texts: &[String]) -> Finder {
        aho_corasick::AhoCorasick::builder()
            .match_kind(aho_corasick::MatchKind::LeftmostLongest)
            .build(texts)
            .map(Finder::Automaton)
            .unwrap_or_else(|_| {
                let mut firsts: Vec<char> = texts.iter().filter_map(|t| t.chars().next()).collect();
                firsts.sort_unstable();
                firsts.dedup();
                Finder::Scan(firsts)
            })
    }
}

/// The first of `texts` (longest first) in `text` and where it starts, the longest where
/// several start there.
fn first_of<'a>(texts: &'a [String], finder: &Finder, text: &str) -> Option<(usize, &'a str)> {
    match finder {
        Finder::Automaton(ac) => ac.find(text).and_then(|m| {
            texts
                .get(m.pattern().as_usize())
                .map(|t| (m.start(), t.as_str()))
        }),
        Finder::Scan(firsts) => text
            .char_indices()
            .filter(|(_, c)| firsts.binary_search(c).is_ok())
            .find_map(|(i, _)| {
                texts
                    .iter()
                    .find(|t| text[i..].starts_with(t.as_str()))
                    .map(|t| (i, t.as_str()))
            }),
    }
}

/// `t` with every added token marked special, so that `set_encode_special_tokens` makes all
/// of them plain text (it leaves added tokens marked not special matched, and those can be
/// turn markers: DeepSeek's `<｜User｜>`); `t` itself where the round trip through its
/// JSON fails.
fn every_added_token_special(t: &tokenizers::Tokenizer) -> tokenizers::Tokenizer {
    let redone = t.to_string(false).ok().and_then(|s| {
        let mut v: serde_json::Value = serde_json::from_str(&s).ok()?;
        for a in v.get_mut("added_tokens")?.as_array_mut()? {
            if let Some(o) = a.as_object_mut() {
                o.insert("special".into(), serde_json::Value::Bool(true));
            }
        }
        v.to_string().parse::<tokenizers::Tokenizer>().ok()
    });
    redone.unwrap_or_else(|| t.clone())
}

/// The ids of `text` through `t`, special tokens added by no template.
///
/// The tokenizers crate panics where a pre-tokenizer's regular expression gives up on a text
/// (Oniguruma's retry limit, reached by a catastrophic pattern such as `(a+)+$` on a long run
/// of `a`): that is an error of this text through this tokenizer, returned as one, not a
/// panic of the caller (it holds no lock while it matches, so the tokenizer stays usable).
fn ids(t: &tokenizers::Tokenizer, text: &str) -> Result<Vec<u32>> {
    let failed = |reason: String| Error {
        path: "tokenizer.json".into(),
        reason,
    };
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| t.encode(text, false)))
        .map_err(|p| {
            let why = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            failed(format!("its pre-tokenizer failed on this text: {why}"))
        })?
        .map(|e| e.get_ids().to_vec())
        .map_err(|e| failed(e.to_string()))
}

/// Whether a decoder reads its tokens through GPT-2's byte table (ByteLevel, alone or in a
/// sequence).
fn decodes_byte_level(d: &tokenizers::DecoderWrapper) -> bool {
    match d {
        tokenizers::DecoderWrapper::ByteLevel(_) => true,
        tokenizers::DecoderWrapper::Sequence(s) => s.get_decoders().iter().any(decodes_byte_level),
        _ => false,
    }
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
    /// A checkpoint directory's tokenizer: `tokenizer.json`, else `tiktoken.model` (with
    /// `tokenizer_config.json`'s special tokens and the pre-tokenizer pattern of the
    /// checkpoint's `tokenization_*.py`).
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let json = dir.join("tokenizer.json");
        if json.exists() || !dir.join(tiktoken::MODEL_FILE).exists() {
            return Self::from_file(&json);
        }
        let inner = tiktoken::load(dir)?;
        Ok(Self::from_inner(inner))
    }

    /// Whether `dir` holds a tokenizer [`Tokenizer::from_dir`] reads.
    pub fn exists_in(dir: &Path) -> bool {
        dir.join("tokenizer.json").exists() || dir.join(tiktoken::MODEL_FILE).exists()
    }

    pub fn from_file(path: &Path) -> Result<Self> {
        let bytes =
            crate::files::read_bounded(path, crate::files::VOCAB_LIMIT).map_err(|e| Error {
                path: path.into(),
                reason: e.to_string(),
            })?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| Error {
            path: path.into(),
            reason: e.to_string(),
        })?;
        Ok(Self::from_inner(inner))
    }

    fn from_inner(inner: tokenizers::Tokenizer) -> Self {
        // ids need not be dense: the tables reach the largest (a count would stop short)
        let id_bound = inner
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |&m| m as u64 + 1);
        let n = (id_bound as usize).min(MAX_IDS);
        let dec = byte_decoder();
        // A vocabulary is byte-level (GPT-2's table: each char one byte) where its decoder
        // says so; a sentencepiece one (Llama, Mistral, Mixtral: `▁` for a space, `<0xNN>`
        // byte pieces, the rest UTF-8 text) has another decoder. Read per token, "é" would be
        // byte 0xE9 in a sentencepiece vocabulary, not its two UTF-8 bytes. Without a decoder,
        // each token is read as whichever it can be.
        let byte_level = inner.get_decoder().map(decodes_byte_level);
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
            if let Some(b) = (byte_level != Some(false))
                .then(|| {
                    tok.chars()
                        .map(|c| dec.get(&c).copied())
                        .collect::<Option<Vec<u8>>>()
                })
                .flatten()
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
        let eos_ids = ["<|im_end|>", "<|endoftext|>", "</s>", "<|eot_id|>", "[EOS]"]
            .iter()
            .filter_map(|t| inner.token_to_id(t))
            .collect();
        let texts = |special_only: bool| {
            let mut t: Vec<String> = added
                .values()
                .filter(|a| (a.special || !special_only) && !a.content.is_empty())
                .map(|a| a.content.clone())
                .collect();
            t.sort_by(|a, b| b.len().cmp(&a.len()).then(a.cmp(b)));
            t.dedup();
            let finder = Finder::new(&t);
            (t, finder)
        };
        let (special_texts, special_finder) = texts(true);
        let (added_texts, added_finder) = texts(false);
        let mut plain = every_added_token_special(&inner);
        plain.set_encode_special_tokens(true);
        Tokenizer {
            inner,
            plain,
            special_texts,
            special_finder,
            added_texts,
            added_finder,
            bytes,
            id_bound,
            eos_ids,
            special,
        }
    }

    pub fn vocab_size(&self) -> usize {
        self.bytes.len()
    }

    /// One past the largest token id the vocabulary names (added tokens included).
    pub fn id_bound(&self) -> u64 {
        self.id_bound
    }

    /// Refused, saying why, when this tokenizer can give ids a model of `vocab_size`
    /// embedding rows does not have (a smaller tokenizer is fine: released models pad their
    /// embedding past it).
    pub fn check_fits(&self, vocab_size: usize) -> Result<()> {
        if self.id_bound > vocab_size as u64 {
            return Err(Error {
                path: "tokenizer.json".into(),
                reason: format!(
                    "its tokens reach id {}, beyond the model's vocab_size of {vocab_size} \
                     (config.json): the model has no embedding for them",
                    self.id_bound - 1
                ),
            });
        }
        Ok(())
    }

    /// Encodes text; special tokens written in the text (e.g. `<|im_start|>`) are recognised.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        ids(&self.inner, text)
    }

    /// Encodes text as written: a special token's text in it (`<|im_end|>` typed by a user) is
    /// plain text, never the control token.
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>> {
        ids(&self.plain, text)
    }

    /// The first special token's text found in `text`, if any.
    pub fn find_special<'a>(&'a self, text: &str) -> Option<&'a str> {
        self.find_special_at(text).map(|(_, t)| t)
    }

    /// The first special token's text in `text` and where it starts (the longest where
    /// several start there), if any.
    pub fn find_special_at<'a>(&'a self, text: &str) -> Option<(usize, &'a str)> {
        first_of(&self.special_texts, &self.special_finder, text)
    }

    /// As [`Tokenizer::find_special_at`], for any added token's text, special or not.
    pub fn find_added_at<'a>(&'a self, text: &str) -> Option<(usize, &'a str)> {
        first_of(&self.added_texts, &self.added_finder, text)
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

/// tiktoken vocabularies (`tiktoken.model`: one `base64(token bytes) rank` per line, as
/// Kimi K2 ships it) as a byte-level BPE of the `tokenizers` crate: every token keeps its rank
/// as its id; the merges are derived from the ranks (each token of two or more bytes is made
/// by every split of it into two tokens of the vocabulary, the splits of lower-ranked tokens
/// first), and a piece that is itself a token is taken whole (`ignore_merges`), as tiktoken
/// encodes. The pre-tokenizer's pattern is the checkpoint's own: the `pat_str` of its
/// `tokenization_*.py` (raw triple-quoted strings joined by `|`); special tokens come from
/// `tokenizer_config.json`'s `added_tokens_decoder`, and the ids of the reserved range past
/// the ranks that it does not name are `<|reserved_token_ID|>`.
pub mod tiktoken {
    use std::collections::HashMap;
    use std::path::Path;

    use super::{byte_encoder, Error, Result};

    pub const MODEL_FILE: &str = "tiktoken.model";

    /// Ids reserved for special tokens after the ranks (Kimi's `num_reserved_special_tokens`).
    pub const RESERVED: usize = 256;

    fn err(path: &Path, reason: impl Into<String>) -> Error {
        Error {
            path: path.into(),
            reason: reason.into(),
        }
    }

    /// Standard base64 (with or without padding) to bytes; None on any other character.
    pub fn base64(s: &str) -> Option<Vec<u8>> {
        let val = |c: u8| -> Option<u32> {
            Some(match c {
                b'A'..=b'Z' => (c - b'A') as u32,
                b'a'..=b'z' => (c - b'a') as u32 + 26,
                b'0'..=b'9' => (c - b'0') as u32 + 52,
                b'+' => 62,
                b'/' => 63,
                _ => return None,
            })
        };
        let s = s.trim_end_matches('=').as_bytes();
        let mut out = Vec::with_capacity(s.len() * 3 / 4);
        let (mut acc, mut bits) = (0u32, 0);
        for &c in s {
            acc = (acc << 6) | val(c)?;
            bits += 6;
            if bits >= 8 {
                bits -= 8;
                out.push((acc >> bits) as u8);
                acc &= (1 << bits) - 1;
            }
        }
        Some(out)
    }

    /// The ranks of a `tiktoken.model` file: `ranks[i]` the bytes of the token of rank i.
    /// Refused, naming the line, when a line is malformed, a rank repeats or skips, or a
    /// token repeats.
    pub fn read_ranks(path: &Path) -> Result<Vec<Vec<u8>>> {
        let text = crate::files::read_bounded_text(path, crate::files::VOCAB_LIMIT)
            .map_err(|e| err(path, e.to_string()))?;
        let mut ranks: Vec<Vec<u8>> = Vec::new();
        let mut seen: HashMap<Vec<u8>, usize> = HashMap::new();
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let bad = |what: &str| err(path, format!("line {}: {what}", i + 1));
            let mut it = line.split_whitespace();
            let (Some(tok), Some(rank), None) = (it.next(), it.next(), it.next()) else {
                return Err(bad("not `base64 rank`"));
            };
            let bytes = base64(tok).ok_or_else(|| bad("the token is not base64"))?;
            let rank: usize = rank.parse().map_err(|_| bad("the rank is not a number"))?;
            if rank != ranks.len() {
                return Err(bad(&format!(
                    "rank {rank} where {} comes next",
                    ranks.len()
                )));
            }
            if bytes.is_empty() {
                return Err(bad("an empty token"));
            }
            if let Some(other) = seen.insert(bytes.clone(), rank) {
                return Err(bad(&format!("the token of rank {other} again")));
            }
            ranks.push(bytes);
        }
        if ranks.is_empty() {
            return Err(err(path, "no tokens"));
        }
        Ok(ranks)
    }

    /// The merges that make every token of two or more bytes from two tokens, ordered by the
    /// rank of the token they make, then by the ranks of its two parts.
    pub fn merges(ranks: &[Vec<u8>]) -> Vec<(usize, usize)> {
        let id: HashMap<&[u8], usize> = ranks
            .iter()
            .enumerate()
            .map(|(i, b)| (b.as_slice(), i))
            .collect();
        let mut out = Vec::new();
        for t in ranks.iter().filter(|t| t.len() > 1) {
            let mut local: Vec<(usize, usize)> = (1..t.len())
                .filter_map(|k| Some((*id.get(&t[..k])?, *id.get(&t[k..])?)))
                .collect();
            local.sort_unstable();
            out.extend(local);
        }
        out
    }

    /// The pre-tokenizer pattern of a checkpoint's `tokenization_*.py`: the raw
    /// triple-quoted strings of its `pat_str = "|".join([...])`, joined by `|`.
    pub fn pattern(dir: &Path) -> Result<String> {
        let mut files: Vec<_> = std::fs::read_dir(dir)
            .map_err(|e| err(dir, e.to_string()))?
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("tokenization") && n.ends_with(".py"))
            })
            .collect();
        files.sort();
        for f in files {
            let Ok(src) = crate::files::read_bounded_text(&f, crate::files::CONFIG_LIMIT) else {
                continue;
            };
            let Some(at) = src.find("pat_str") else {
                continue;
            };
            if let Some(parts) = raw_strings_of_list(&src[at..]) {
                return Ok(parts.join("|"));
            }
        }
        Err(err(
            dir,
            "a tiktoken.model without tokenizer.json needs its pre-tokenizer pattern: no \
             tokenization_*.py with a `pat_str = \"|\".join([r\"\"\"...\"\"\", ...])` found",
        ))
    }

    /// The raw triple-quoted strings (`r"""..."""`) of the first Python list in `src`, up to
    /// its closing `]` (brackets inside the strings are theirs); None when the list holds
    /// anything else or does not close.
    fn raw_strings_of_list(src: &str) -> Option<Vec<&str>> {
        let open = src.find('[')?;
        let mut rest = &src[open + 1..];
        let mut parts = Vec::new();
        loop {
            rest = rest.trim_start_matches(|c: char| c.is_whitespace() || c == ',');
            if rest.starts_with(']') {
                return (!parts.is_empty()).then_some(parts);
            }
            let body = rest.strip_prefix("r\"\"\"")?;
            let end = body.find("\"\"\"")?;
            parts.push(&body[..end]);
            rest = &body[end + 3..];
        }
    }

    /// Standard base64 with padding (a `tiktoken.model` token's form).
    pub fn to_base64(bytes: &[u8]) -> String {
        const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
        for c in bytes.chunks(3) {
            let v = (c[0] as u32) << 16
                | (*c.get(1).unwrap_or(&0) as u32) << 8
                | *c.get(2).unwrap_or(&0) as u32;
            for k in 0..4 {
                out.push(if k <= c.len() {
                    A[(v >> (18 - 6 * k)) as usize & 63] as char
                } else {
                    '='
                });
            }
        }
        out
    }

    /// Writes `tok`'s vocabulary into `dir` as a tiktoken checkpoint would ship it: the
    /// tokens before its first special one as `tiktoken.model` (their ids as ranks), the
    /// specials in `tokenizer_config.json`'s `added_tokens_decoder`, and `pattern` (the
    /// alternatives of its pre-tokenizer) as the `pat_str` of `tokenization_moelane.py`. For
    /// tests: the tokenizer read back must encode as `tok` when `pattern` is its own.
    pub fn write(tok: &super::Tokenizer, dir: &Path, pattern: &[&str]) -> std::io::Result<()> {
        let base = (0..tok.vocab_size() as u32)
            .take_while(|&i| !tok.is_special(i))
            .count() as u32;
        let mut model = String::new();
        for i in 0..base {
            model.push_str(&format!("{} {i}\n", to_base64(tok.token_bytes(i))));
        }
        std::fs::write(dir.join(MODEL_FILE), model)?;
        let mut added = serde_json::Map::new();
        for i in base..tok.vocab_size() as u32 {
            let content = String::from_utf8_lossy(tok.token_bytes(i)).into_owned();
            added.insert(
                i.to_string(),
                serde_json::json!({"content": content, "special": tok.is_special(i)}),
            );
        }
        let cfg_path = dir.join("tokenizer_config.json");
        let mut cfg: serde_json::Value =
            crate::files::read_bounded(&cfg_path, crate::files::CONFIG_LIMIT)
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok())
                .unwrap_or_else(|| serde_json::json!({}));
        if let Some(o) = cfg.as_object_mut() {
            o.insert("added_tokens_decoder".into(), added.into());
        }
        std::fs::write(&cfg_path, cfg.to_string())?;
        let mut py = String::from("class Tokenizer:\n    pat_str = \"|\".join(\n        [\n");
        for p in pattern {
            py.push_str(&format!("            r\"\"\"{p}\"\"\",\n"));
        }
        py.push_str("        ]\n    )\n");
        std::fs::write(dir.join("tokenization_moelane.py"), py)
    }

    /// GPT-2's pre-tokenizer pattern, as alternatives (the one a byte-level `tokenizer.json`
    /// with `use_regex` applies).
    pub const GPT2_PATTERN: [&str; 6] = [
        r"'s|'t|'re|'ve|'m|'ll|'d",
        r" ?\p{L}+",
        r" ?\p{N}+",
        r" ?[^\s\p{L}\p{N}]+",
        r"\s+(?!\S)",
        r"\s+",
    ];

    /// The tokenizer of a directory holding `tiktoken.model` (see the module comment).
    pub fn load(dir: &Path) -> Result<tokenizers::Tokenizer> {
        let model = dir.join(MODEL_FILE);
        let ranks = read_ranks(&model)?;
        let pat = pattern(dir)?;
        let enc = byte_encoder();
        let name = |b: &[u8]| -> String { b.iter().map(|&x| enc[x as usize]).collect() };
        let mut vocab = serde_json::Map::with_capacity(ranks.len());
        for (i, b) in ranks.iter().enumerate() {
            vocab.insert(name(b), serde_json::json!(i));
        }
        let merges: Vec<serde_json::Value> = merges(&ranks)
            .into_iter()
            .map(|(a, b)| serde_json::json!([name(&ranks[a]), name(&ranks[b])]))
            .collect();
        // special tokens: tokenizer_config.json's, the rest of the reserved range named
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: serde_json::Value =
            match crate::files::read_bounded(&cfg_path, crate::files::CONFIG_LIMIT) {
                Ok(b) => serde_json::from_slice(&b).map_err(|e| err(&cfg_path, e.to_string()))?,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => serde_json::json!({}),
                Err(e) => return Err(err(&cfg_path, e.to_string())),
            };
        // id -> (content, special)
        let mut specials: std::collections::BTreeMap<usize, (String, bool)> = Default::default();
        if let Some(m) = cfg.get("added_tokens_decoder").and_then(|v| v.as_object()) {
            for (k, v) in m {
                let id: usize = k.parse().map_err(|_| {
                    err(
                        &cfg_path,
                        format!("added_tokens_decoder: id {k:?} is not a number"),
                    )
                })?;
                let content = v.get("content").and_then(|c| c.as_str()).ok_or_else(|| {
                    err(&cfg_path, format!("added_tokens_decoder {id}: no content"))
                })?;
                if id < ranks.len() {
                    return Err(err(
                        &cfg_path,
                        format!(
                            "added token {content:?} has id {id}, inside the {} ranks",
                            ranks.len()
                        ),
                    ));
                }
                let special = v.get("special").and_then(|b| b.as_bool()).unwrap_or(true);
                specials.insert(id, (content.to_string(), special));
            }
        }
        // the reserved range after the ranks (256 ids, or up to the last one named), the ids
        // it does not name called `<|reserved_token_ID|>`
        let last = specials
            .keys()
            .next_back()
            .map_or(0, |&l| l + 1)
            .max(ranks.len() + RESERVED);
        if last - ranks.len() > 1 << 16 {
            return Err(err(
                &cfg_path,
                format!("added token id {} is far past the ranks", last - 1),
            ));
        }
        for id in ranks.len()..last {
            specials
                .entry(id)
                .or_insert_with(|| (format!("<|reserved_token_{id}|>"), true));
        }
        let added: Vec<serde_json::Value> = specials
            .iter()
            .map(|(id, (c, special))| {
                serde_json::json!({"id": id, "content": c, "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": special})
            })
            .collect();
        let spec = serde_json::json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pat}, "behavior": "Isolated", "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}
            ]},
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": false, "byte_fallback": false, "ignore_merges": true,
                "vocab": vocab, "merges": merges}
        });
        let tok = spec
            .to_string()
            .parse::<tokenizers::Tokenizer>()
            .map_err(|e| err(&model, format!("building its BPE: {e}")))?;
        // the `tokenizers` crate numbers added tokens in turn: a repeated or ordinary content
        // would shift every later special id, so each must have kept its own
        for (&id, (c, _)) in &specials {
            if tok.token_to_id(c) != Some(id as u32) {
                return Err(err(
                    &cfg_path,
                    format!("added token {c:?} (id {id}) repeats another token: its id would move"),
                ));
            }
        }
        Ok(tok)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::tiktoken::{base64, to_base64};

    /// A tokenizer.json in the shape Mistral and Mixtral ship (sentencepiece BPE with byte
    /// fallback: `▁` prepended and for spaces, `<0xNN>` byte pieces, a Replace / ByteFallback
    /// / Fuse / Strip decoder), with a few accented pieces.
    fn sentencepiece() -> super::Tokenizer {
        sentencepiece_with(&[])
    }

    /// [`sentencepiece`] with more special tokens (control tokens such as Mistral's
    /// `[TOOL_CALLS]`), numbered after its pieces.
    pub(crate) fn sentencepiece_with(specials: &[&str]) -> super::Tokenizer {
        let mut vocab = serde_json::Map::new();
        for (i, t) in ["<unk>", "<s>", "</s>"].iter().enumerate() {
            vocab.insert(t.to_string(), i.into());
        }
        for b in 0..256usize {
            vocab.insert(format!("<0x{b:02X}>"), (3 + b).into());
        }
        let pieces = [
            "\u{2581}",
            "c",
            "a",
            "f",
            "é",
            "n",
            "i",
            "ñ",
            "o",
            "Ā",
            "\u{2581}c",
            "\u{2581}ca",
            "\u{2581}caf",
            "\u{2581}café",
            "\u{2581}n",
            "\u{2581}ni",
            "\u{2581}niñ",
            "\u{2581}niño",
        ];
        for (i, p) in pieces.iter().enumerate() {
            vocab.insert(p.to_string(), (259 + i).into());
        }
        let merges = [
            "\u{2581} c",
            "\u{2581}c a",
            "\u{2581}ca f",
            "\u{2581}caf é",
            "\u{2581} n",
            "\u{2581}n i",
            "\u{2581}ni ñ",
            "\u{2581}niñ o",
        ];
        let special = |id: usize, c: &str| {
            serde_json::json!({"id": id, "content": c, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true})
        };
        let mut added = vec![special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")];
        for (i, c) in specials.iter().enumerate() {
            let id = 259 + pieces.len() + i;
            vocab.insert(c.to_string(), id.into());
            added.push(special(id, c));
        }
        let spec = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": added,
            "normalizer": {"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": "\u{2581}"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}]},
            "pre_tokenizer": null,
            "post_processor": null,
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
            "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>",
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                "vocab": vocab, "merges": merges}
        });
        super::Tokenizer::from_inner(spec.to_string().parse().unwrap())
    }

    /// A vocabulary whose ids have a gap (a token of the model's vocabulary far past the
    /// rest) is measured by its largest id, not its count: a model whose vocab_size stops
    /// short of it is refused, and the token's bytes are there.
    #[test]
    fn a_tokenizer_is_measured_by_its_largest_id() {
        let t = sentencepiece();
        let n = t.vocab_size();
        t.check_fits(n).unwrap();
        let mut v: serde_json::Value =
            serde_json::from_str(&t.inner.to_string(false).unwrap()).unwrap();
        let far = n + 100;
        v["model"]["vocab"]["\u{2581}far"] = serde_json::json!(far);
        let t = super::Tokenizer::from_inner(v.to_string().parse().unwrap());
        assert_eq!(t.id_bound(), far as u64 + 1);
        let e = t.check_fits(n + 1).unwrap_err().to_string();
        assert!(
            e.contains(&format!("id {far}")) && e.contains("vocab_size"),
            "{e}"
        );
        t.check_fits(far + 1).unwrap();
        assert_eq!(t.token_bytes(far as u32), b" far");
    }

    /// A pre-tokenizer regex that gives up on a text (Oniguruma's retry limit: `(a+)+$` on a
    /// long run of `a` then `!`) is an error of that text, not a panic; the tokenizer goes on
    /// encoding other texts.
    #[test]
    fn a_regex_that_gives_up_is_an_error_of_the_text() {
        let t = sentencepiece();
        let mut v: serde_json::Value =
            serde_json::from_str(&t.inner.to_string(false).unwrap()).unwrap();
        v["pre_tokenizer"] = serde_json::json!({"type": "Split",
            "pattern": {"Regex": "(a+)+$"}, "behavior": "Isolated", "invert": false});
        let t = super::Tokenizer::from_inner(v.to_string().parse().unwrap());
        let e = t.encode(&format!("{}!", "a".repeat(60))).unwrap_err();
        assert!(e.to_string().contains("pre-tokenizer failed"), "{e}");
        assert!(!t.encode("ab").unwrap().is_empty());
    }

    /// Token texts are found leftmost first, the longest of those starting there, by the
    /// automaton and by the scan alike, among hundreds sharing a first character.
    #[test]
    fn token_texts_are_found_leftmost_then_longest() {
        let mut texts: Vec<String> = (0..800).map(|i| format!("<|t{i}|>")).collect();
        texts.extend(["<|t1", "<|t12|>x", "ab"].map(String::from));
        texts.sort_by(|a, b| b.len().cmp(&a.len()).then(a.cmp(b)));
        let mut firsts: Vec<char> = texts.iter().filter_map(|t| t.chars().next()).collect();
        firsts.sort_unstable();
        firsts.dedup();
        let auto = super::Finder::new(&texts);
        assert!(matches!(auto, super::Finder::Automaton(_)));
        let scan = super::Finder::Scan(firsts);
        for (text, want) in [
            ("xx <|t12|>x yy", Some((3, "<|t12|>x"))),
            ("xx <|t12|> yy", Some((3, "<|t12|>"))),
            ("<|t1 <|t799|>", Some((0, "<|t1"))),
            ("<<<<| ab", Some((6, "ab"))),
            ("\u{e9}<|t5|>", Some((2, "<|t5|>"))),
            ("<|t|> <|", None),
        ] {
            for f in [&auto, &scan] {
                assert_eq!(super::first_of(&texts, f, text), want, "{text}");
            }
        }
        // many near misses: found where it is, after them
        let text = format!("{}<|t42|>", "<|t4".repeat(100_000));
        assert_eq!(
            super::first_of(&texts, &auto, &text),
            Some((text.len() - 7, "<|t42|>"))
        );
    }

    /// An added token marked not special (DeepSeek's turn markers are) is found by
    /// `find_added_at`, not `find_special_at`; `encode` makes it its token, `encode_plain`
    /// never does.
    #[test]
    fn added_tokens_not_marked_special_are_plain_text_in_encode_plain() {
        let t = sentencepiece();
        let mut v: serde_json::Value =
            serde_json::from_str(&t.inner.to_string(false).unwrap()).unwrap();
        let id = t.vocab_size();
        v["added_tokens"]
            .as_array_mut()
            .unwrap()
            .push(serde_json::json!({
            "id": id, "content": "<\u{ff5c}User\u{ff5c}>", "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": false}));
        let t = super::Tokenizer::from_inner(v.to_string().parse().unwrap());
        let marker = "<\u{ff5c}User\u{ff5c}>";
        let text = format!("hi {marker} x");
        assert_eq!(t.find_added_at(&text), Some((3, marker)));
        assert_eq!(t.find_special_at(&text), None);
        let id = id as u32;
        assert!(t.encode(&text).unwrap().contains(&id));
        let plain = t.encode_plain(&text).unwrap();
        assert!(!plain.contains(&id) && plain.len() > 3, "{plain:?}");
    }

    #[test]
    fn a_sentencepiece_vocabulary_gives_utf8_bytes_not_gpt2_bytes() {
        let t = sentencepiece();
        let id = |s: &str| t.inner.token_to_id(s).unwrap();
        // pieces whose characters are also in GPT-2's byte table
        assert_eq!(t.token_bytes(id("é")), "é".as_bytes());
        assert_eq!(t.token_bytes(id("ñ")), "ñ".as_bytes());
        assert_eq!(t.token_bytes(id("Ā")), "Ā".as_bytes());
        assert_eq!(t.token_bytes(id("\u{2581}café")), " café".as_bytes());
        assert_eq!(t.token_bytes(id("<0xC3>")), [0xC3]);
        // a text's tokens put together are the text (the prepended space included), and a
        // character not in the vocabulary comes back through its byte pieces
        let text = "café niño ü";
        let ids = t.inner.encode(text, false).unwrap().get_ids().to_vec();
        let joined: Vec<u8> = ids
            .iter()
            .flat_map(|&i| t.token_bytes(i).to_vec())
            .collect();
        assert_eq!(String::from_utf8(joined).unwrap(), format!(" {text}"));
    }

    #[test]
    fn base64_round_trips_every_length_and_refuses_other_characters() {
        for n in 0..40usize {
            let b: Vec<u8> = (0..n).map(|i| (i * 37 + 11) as u8).collect();
            assert_eq!(base64(&to_base64(&b)).as_deref(), Some(b.as_slice()), "{n}");
        }
        assert_eq!(to_base64(b"Man"), "TWFu");
        assert_eq!(to_base64(b"Ma"), "TWE=");
        assert_eq!(base64("TWE"), Some(b"Ma".to_vec()));
        assert_eq!(base64("TW!u"), None);
    }
}
