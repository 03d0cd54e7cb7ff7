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
    #[error("{path}: unsupported architecture {found:?} (moelane loads qwen3_moe, mixtral, qwen2_moe, glm4_moe, deepseek_v3 and kimi_k2, gpt_oss)")]
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
    /// A link to the other tier failed; the link, nearest the failure, says how.
    #[error("{link} link: {what}")]
    Link {
        link: &'static str,
        fault: Fault,
        what: String,
    },
    /// The cold tier answered, but not what was asked (a mismatched tag or length).
    #[error("cold tier: {0}")]
    ColdReply(String),
    /// A request was tagged with a map epoch the tier does not hold.
    #[error("request tagged epoch {got}, this tier serves {serves}")]
    EpochMismatch { got: u64, serves: String },
    /// The map puts picks in the cold tier but no cold tier is attached.
    #[error("layer {layer}: {picks} cold picks but no cold tier is attached")]
    NoColdTier { layer: usize, picks: usize },
    /// A request the engine or a tier cannot take as it stands (wrong counts, rows, sizes).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// An invariant of the engine broke: a bug, never the caller's input.
    #[error("internal error: {0}")]
    Internal(String),
    #[error("this moelane was built without CUDA: build it with `cargo build --release --features cuda`")]
    NotCompiledWithCuda,
}

/// What kind of failure an [`Error`] is, decided where it happened: the workers map it once
/// onto the gRPC and HTTP categories, and retries and re-routing match on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fault {
    /// A peer is gone or cannot be reached: worth retrying elsewhere.
    Unavailable,
    /// A peer did not answer within its deadline.
    Timeout,
    /// A message was tagged with a map epoch the receiver does not hold.
    EpochMismatch,
    /// An expert is not resident where the map says.
    NotResident,
    /// No room (KV blocks, slots) for the work now.
    Overloaded,
    /// The caller's input was wrong.
    BadRequest,
    /// The sequence is longer than the model's context.
    ContextOverflow,
    /// A bug or a broken file: retrying will not help.
    Internal,
}

pub type Result<T> = std::result::Result<T, Error>;

impl Fault {
    /// Every fault, for tests and tables.
    pub const ALL: [Fault; 8] = [
        Fault::Unavailable,
        Fault::Timeout,
        Fault::EpochMismatch,
        Fault::NotResident,
        Fault::Overloaded,
        Fault::BadRequest,
        Fault::ContextOverflow,
        Fault::Internal,
    ];

    /// The fault's name in the control protocol's error vocabulary (the `moelane-error`
    /// metadata of a gRPC status, the gateway's error types): the workers map a fault onto
    /// a gRPC category by this name.
    pub fn name(self) -> &'static str {
        match self {
            Fault::Unavailable => "unavailable",
            Fault::Timeout => "timeout",
            Fault::EpochMismatch => "epoch_mismatch",
            Fault::NotResident => "not_resident",
            Fault::Overloaded => "overloaded",
            Fault::BadRequest => "bad_request",
            Fault::ContextOverflow => "context_overflow",
            Fault::Internal => "internal",
        }
    }

    /// The fault of a protocol name ([`Fault::name`]); an unknown name reads as Internal.
    pub fn from_name(name: &str) -> Fault {
        Fault::ALL
            .into_iter()
            .find(|f| f.name() == name)
            .unwrap_or(Fault::Internal)
    }

    /// The fault as one byte on the wire (a link's error reply carries it).
    pub fn code(self) -> u8 {
        match self {
            Fault::Unavailable => 1,
            Fault::Timeout => 2,
            Fault::EpochMismatch => 3,
            Fault::NotResident => 4,
            Fault::Overloaded => 5,
            Fault::BadRequest => 6,
            Fault::ContextOverflow => 7,
            Fault::Internal => 8,
        }
    }

    /// The fault of a wire byte; an unknown byte (a newer peer) reads as Unavailable.
    pub fn from_code(c: u8) -> Fault {
        Fault::ALL
            .into_iter()
            .find(|f| f.code() == c)
            .unwrap_or(Fault::Unavailable)
    }
}

impl Error {
    /// The kind of failure, set where it happened.
    pub fn fault(&self) -> Fault {
        match self {
            Error::Link { fault, .. } => *fault,
            Error::ColdReply(_) | Error::NoColdTier { .. } => Fault::Unavailable,
            Error::EpochMismatch { .. } => Fault::EpochMismatch,
            Error::NotResident { .. } => Fault::NotResident,
            Error::KvFull { .. } => Fault::Overloaded,
            Error::ContextOverflow { .. } => Fault::ContextOverflow,
            Error::BadToken { .. } | Error::Invalid(_) => Fault::BadRequest,
            Error::Gpu(_)
            | Error::Io { .. }
            | Error::Json { .. }
            | Error::UnsupportedArchitecture { .. }
            | Error::Config { .. }
            | Error::BadSafetensors { .. }
            | Error::MissingTensor { .. }
            | Error::WrongShape { .. }
            | Error::WrongDtype { .. }
            | Error::Tokenizer { .. }
            | Error::Text(_)
            | Error::Rowmap(_)
            | Error::Checksum { .. }
            | Error::Internal(_) => Fault::Internal,
            // a GPU asked of a build without one: the request, not the server, is at fault
            Error::NotCompiledWithCuda => Fault::BadRequest,
        }
    }

    /// A link failure of `fault`'s kind on the `link` link.
    pub fn link(link: &'static str, fault: Fault, what: impl Into<String>) -> Self {
        Error::Link {
            link,
            fault,
            what: what.into(),
        }
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}
