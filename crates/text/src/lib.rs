//! moelane-text: what the gateway and the engine share about text: the tokenizer and the
//! raw bytes of each token, an incremental detokeniser that never splits a UTF-8 character,
//! stop strings, chat templates (Jinja, rendered with minijinja; ChatML by default), and the
//! grammars of constrained decoding (llguidance).

pub mod agent;
pub mod chat;
pub mod detok;
pub mod files;
pub mod grammar;
pub mod templates;
pub mod tokenizer;
