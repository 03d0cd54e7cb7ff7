//! moelane-text: what the gateway and the engine share about text: the tokenizer and the
//! raw bytes of each token, an incremental detokeniser that never splits a UTF-8 character,
//! stop strings, and chat templates (Jinja, rendered with minijinja; ChatML by default).

pub mod chat;
pub mod detok;
pub mod tokenizer;
