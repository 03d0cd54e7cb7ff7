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
        // forced text is plain text: special-token spellings in it stay text
        self.tokenizer
            .encode_plain(&String::from_utf8_lossy(s))
            .unwrap_or_default()
    }
}

/// The grammar compiler of one tokenizer: built on first use (a trie of the whole
/// vocabulary), then shared by every request.
pub struct Grammars {
    tokenizer: Arc<Tokenizer>,
    eos: u32,
    factory: OnceLock<Result<Arc<ParserFactory>, String>>,
}

impl Grammars {
    /// Grammars over `tokenizer`, ending at `eos` (the model's first end-of-sequence id).
    pub fn new(tokenizer: Arc<Tokenizer>, eos: u32) -> Grammars {
        Grammars {
            tokenizer,
            eos,
            factory: OnceLock::new(),
        }
    }

    fn factory(&self) -> Result<Arc<ParserFactory>, String> {
        self.factory
            .get_or_init(|| {
                let t = &self.tokenizer;
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
                let info = TokRxInfo::new(words.len() as u32, self.eos);
                let env: TokEnv = Arc::new(Env {
                    trie: TokTrie::from(&info, &words),
                    tokenizer: t.clone(),
                });
                let mut f = ParserFactory::new_simple(&env)
                    .map_err(|e| format!("the grammar compiler: {e}"))?;
                f.set_stderr_log_level(0);
                Ok(Arc::new(f))
            })
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

impl Constraint {
    /// Sets every logit the grammar does not allow next to -inf (only end-of-sequence once
    /// the grammar is complete).
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
        let allowed = self.0.compute_mask_or_eos().map_err(|e| e.to_string())?;
        let n = allowed.len();
        let mut any = false;
        for (i, l) in logits.iter_mut().enumerate() {
            // ids past the tokenizer's vocabulary (a padded head) are never allowed
            if i < n && allowed.is_allowed(i as TokenId) {
                any |= *l > f32::NEG_INFINITY;
            } else {
                *l = f32::NEG_INFINITY;
            }
        }
        if !any {
            return Err("the grammar allows no token the model can produce here".into());
        }
        Ok(())
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
