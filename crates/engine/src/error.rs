//! Errors of the engine: every variant names what was wrong (file, tensor, layer, expert).

use std::path::PathBuf;

/// Every failure the engine can report.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("GPU: {0}")]
    Gpu(String),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: invalid JSON: {reason}")]
    Json { path: PathBuf, reason: String },
    #[error("{path}: unsupported architecture {found:?} (moelane loads qwen3_moe)")]
    UnsupportedArchitecture { path: PathBuf, found: String },
    #[error("config: field `{field}` = {value}: {reason}")]
    Config {
        field: &'static str,
        value: String,
        reason: String,
    },
    #[error("{file}: not a valid safetensors file: {reason}")]
    BadSafetensors { file: PathBuf, reason: String },
    #[error("checkpoint: tensor `{tensor}` is missing (looked in {looked_in})")]
    MissingTensor { tensor: String, looked_in: String },
    #[error("{file}: tensor `{tensor}` has shape {found:?}, expected {expected:?}")]
    WrongShape {
        file: PathBuf,
        tensor: String,
        found: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error("{file}: tensor `{tensor}` has dtype {found}, expected one of bf16, f16, f32")]
    WrongDtype {
        file: PathBuf,
        tensor: String,
        found: String,
    },
    #[error("{path}: tokenizer: {reason}")]
    Tokenizer { path: PathBuf, reason: String },
    #[error(transparent)]
    Text(#[from] moelane_text::tokenizer::Error),
    #[error("rowmap: {0}")]
    Rowmap(String),
    #[error("expert {expert} of layer {layer} is not resident in the {tier} tier")]
    NotResident {
        layer: usize,
        expert: usize,
        tier: &'static str,
    },
    #[error("KV cache full: needs {needed} blocks, {free} free of {total}")]
    KvFull {
        needed: usize,
        free: usize,
        total: usize,
    },
    #[error("sequence of {len} tokens exceeds the context of {max} tokens")]
    ContextOverflow { len: usize, max: usize },
    #[error("token id {id} is outside the vocabulary of {vocab}")]
    BadToken { id: u32, vocab: usize },
    #[error("expert {expert} of layer {layer}: checksum {found:016x} does not match the expected {expected:016x}")]
    Checksum {
        layer: usize,
        expert: usize,
        found: u64,
        expected: u64,
    },
    #[error("expert tier failed: {0}")]
    Tier(String),
    #[error("moelane was built without the `cuda` feature")]
    NotCompiledWithCuda,
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}
