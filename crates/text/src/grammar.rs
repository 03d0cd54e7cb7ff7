//! Constrained decoding (structured output) through llguidance: a grammar (an llguidance
//! `TopLevelGrammar` as JSON: a JSON schema, a Lark grammar, a regex) compiled against this
//! checkpoint's tokenizer into a [`Constraint`], which masks each step's logits to the tokens
//! the grammar allows next and follows the tokens picked.
//!
//! The tokenizer environment is built once per tokenizer ([`Grammars`]), from the same token
//! bytes the detokeniser uses; special tokens are marked as llguidance expects, so a grammar
//! never produces a control token as text.

use std::sync::{Arc, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};

use crate::tokenizer::Tokenizer;

/// Most bytes of grammar (JSON) one request may carry.
pub const MAX_GRAMMAR_BYTES: usize = 256 << 10;

/// llguidance's view of a [`Tokenizer`]: its token trie, and its encoder for the text a
/// grammar forces.
struct Env {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        // forced text is plain text: special-token spellings in it stay text. Forced bytes
        // may end inside a character (a marker such as DeepSeek's `<｜`): its valid text
        // through the tokenizer, the bytes after through the trie (never U+FFFD in their place)
        let valid = match std::str::from_utf8(s) {
            Ok(t) => t,
            Err(e) => std::str::from_utf8(&s[..e.valid_up_to()]).unwrap_or_default(),
        };
        let mut ids = self.tokenizer.encode_plain(valid).unwrap_or_default();
        if valid.len() < s.len() {
            ids.extend(self.trie.greedy_tokenize(&s[valid.len()..]));
        }
        ids
    }
}

/// The grammar compiler of one tokenizer: built on first use (a trie of the whole
/// vocabulary), then shared by every request.
pub struct Grammars {
    tokenizer: Arc<Tokenizer>,
    eos: u32,
    factory: Arc<OnceLock<Result<Arc<ParserFactory>, String>>>,
}

/// The grammar compiler of `t`: the trie of its whole vocabulary (special tokens marked, so
/// text never matches them), ending at `eos`.
fn build_factory(t: &Arc<Tokenizer>, eos: u32) -> Result<Arc<ParserFactory>, String> {
    let words: Vec<Vec<u8>> = (0..t.vocab_size() as u32)
        .map(|i| {
            let b = t.token_bytes(i);
            if t.is_special(i) {
                // llguidance's mark of a special token: never matched as text
                let mut m = Vec::with_capacity(b.len() + 1);
                m.push(TokTrie::SPECIAL_TOKEN_MARKER);
                m.extend_from_slice(b);
                m
            } else {
                b.to_vec()
            }
        })
        .collect();
    let info = TokRxInfo::new(words.len() as u32, eos);
    let env: TokEnv = Arc::new(Env {
        trie: TokTrie::from(&info, &words),
        tokenizer: t.clone(),
    });
    let mut f =
        ParserFactory::new_simple(&env).map_err(|e| format!("the grammar compiler: {e}"))?;
    f.set_stderr_log_level(0);
    // errors name what failed, without the parser's state and the grammar (a client's
    // error message is no place for a dump of them)
    f.limits_mut().verbose_errors = false;
    Ok(Arc::new(f))
}

impl Grammars {
    /// Grammars over `tokenizer`, ending at `eos` (the model's first end-of-sequence id).
    pub fn new(tokenizer: Arc<Tokenizer>, eos: u32) -> Grammars {
        Grammars {
            tokenizer,
            eos,
            factory: Arc::new(OnceLock::new()),
        }
    }

    /// Builds the trie of the vocabulary on a thread of its own now, so the first request
    /// with a grammar does not wait for it (about half a second at 150k tokens).
    pub fn warm(&self) {
        let (cell, tokenizer, eos) = (self.factory.clone(), self.tokenizer.clone(), self.eos);
        let _ = std::thread::Builder::new()
            .name("moelane-grammar-trie".into())
            .spawn(move || {
                cell.get_or_init(|| build_factory(&tokenizer, eos));
            });
    }

    fn factory(&self) -> Result<Arc<ParserFactory>, String> {
        self.factory
            .get_or_init(|| build_factory(&self.tokenizer, self.eos))
            .clone()
    }

    /// Compiles `grammar` (an llguidance `TopLevelGrammar` as JSON) into a fresh constraint,
    /// or says what is wrong with it.
    pub fn compile(&self, grammar: &str) -> Result<Constraint, String> {
        if grammar.len() > MAX_GRAMMAR_BYTES {
            return Err(format!(
                "the grammar is {} bytes, at most {MAX_GRAMMAR_BYTES}",
                grammar.len()
            ));
        }
        let g: TopLevelGrammar =
            serde_json::from_str(grammar).map_err(|e| format!("not a grammar: {e}"))?;
        let parser = self
            .factory()?
            .create_parser(g)
            .map_err(|e| e.to_string())?;
        let m = Matcher::new(Ok(parser));
        if let Some(e) = m.get_error() {
            return Err(e);
        }
        Ok(Constraint(Box::new(m)))
    }

    /// Compiles `grammar` and makes its first mask, as a request's first step will: a
    /// grammar that compiles but that no answer can satisfy (a schema `$ref` to itself) or
    /// whose first mask fails is refused here, before the request is queued.
    pub fn check(&self, grammar: &str) -> Result<(), String> {
        let mask = self.compile(grammar)?.next_mask()?;
        if mask.0.is_zero() {
            return Err("no token can begin an answer".into());
        }
        Ok(())
    }
}

/// The JSON of a grammar that holds the answer to `schema` (compact: no whitespace between
/// tokens, as a random model could otherwise write spaces forever).
pub fn json_schema_grammar(schema: &serde_json::Value) -> String {
    let mut schema = schema.clone();
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance")
            .or_insert_with(|| serde_json::json!({"whitespace_flexible": false}));
    }
    serde_json::to_string(&TopLevelGrammar::from_json_schema(schema)).unwrap_or_default()
}

/// The JSON of a grammar given in Lark syntax.
pub fn lark_grammar(lark: &str) -> String {
    serde_json::to_string(&TopLevelGrammar::from_lark(lark.to_string())).unwrap_or_default()
}

/// One request's grammar state: which tokens may come next.
#[derive(Clone)]
pub struct Constraint(Box<Matcher>);

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Constraint")
    }
}

/// The tokens a grammar allows next: computed from the tokens followed so far
/// ([`Constraint::next_mask`]), so it can be made while the step that yields the logits runs,
/// then applied to them ([`Mask::apply`]).
#[derive(Clone)]
pub struct Mask(llguidance::toktrie::SimpleVob);

impl std::fmt::Debug for Mask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Mask({} ids)", self.0.len())
    }
}

impl Mask {
    /// Whether token `id` may come next.
    pub fn allows(&self, id: u32) -> bool {
        (id as usize) < self.0.len() && self.0.is_allowed(id)
    }

    /// Sets every logit the mask does not allow to -inf; an error when no token the model
    /// can produce (a finite logit) is left.
    pub fn apply(&self, logits: &mut [f32]) -> Result<(), String> {
        let (words, n) = (self.0.as_slice(), self.0.len());
        let mut any = false;
        // a word of 32 ids at a time: none allowed (most of a row where JSON's punctuation
        // comes next) is a fill, all allowed (inside a string) only a look for a live logit
        for (c, chunk) in logits.chunks_mut(32).enumerate() {
            let base = c * 32;
            // ids past the tokenizer's vocabulary (a padded head) are never allowed
            let live = match n.saturating_sub(base) {
                0 => 0,
                k if k >= 32 => u32::MAX,
                k => (1u32 << k) - 1,
            };
            let w = words.get(c).copied().unwrap_or(0) & live;
            if w == 0 {
                chunk.fill(f32::NEG_INFINITY);
            } else if w == u32::MAX && chunk.len() == 32 {
                any = any || chunk.iter().any(|l| *l > f32::NEG_INFINITY);
            } else {
                // (no branch per id: a mixed word's bits are unpredictable)
                for (b, l) in chunk.iter_mut().enumerate() {
                    let keep = (w >> b) & 1 == 1;
                    any |= keep & (*l > f32::NEG_INFINITY);
                    *l = if keep { *l } else { f32::NEG_INFINITY };
                }
            }
        }
        if !any {
            return Err("the grammar allows no token the model can produce here".into());
        }
        Ok(())
    }
}

impl Constraint {
    /// Sets every logit the grammar does not allow next to -inf (only end-of-sequence once
    /// the grammar is complete).
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
        self.next_mask()?.apply(logits)
    }

    /// The tokens the grammar allows next (only end-of-sequence once it is complete).
    pub fn next_mask(&mut self) -> Result<Mask, String> {
        self.0
            .compute_mask_or_eos()
            .map(Mask)
            .map_err(|e| e.to_string())
    }

    /// Follows the token picked.
    pub fn consume(&mut self, token: u32) -> Result<(), String> {
        self.0.consume_token(token).map_err(|e| e.to_string())
    }

    /// Whether the grammar is complete (only end-of-sequence may follow).
    pub fn is_done(&self) -> bool {
        self.0.is_stopped()
    }
}
