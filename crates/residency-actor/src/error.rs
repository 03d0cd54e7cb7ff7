//! Why a swap step failed, decided where it failed: a [`Fault`] (the engine's categories,
//! which the workers turn into gRPC statuses) and what happened, in words.

use moelane_engine::error::Fault;

/// A failed PREPARE, COMMIT, RELEASE, ABORT or REGISTER, or a counter sample.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{what}")]
pub struct SwapError {
    pub fault: Fault,
    pub what: String,
}

impl SwapError {
    pub fn new(fault: Fault, what: impl Into<String>) -> Self {
        SwapError {
            fault,
            what: what.into(),
        }
    }

    /// The epochs of a message and a tier do not line up (not newer, superseded, another
    /// coordinator's): the message is refused, nothing changes.
    pub fn epoch(what: impl Into<String>) -> Self {
        Self::new(Fault::EpochMismatch, what)
    }

    /// The tier could not be reached, or did not answer.
    pub fn unavailable(what: impl Into<String>) -> Self {
        Self::new(Fault::Unavailable, what)
    }

    /// The request itself was wrong (a move out of range, a bad map).
    pub fn invalid(what: impl Into<String>) -> Self {
        Self::new(Fault::BadRequest, what)
    }

    /// An invariant broke (a poisoned lock, a map that does not validate after a move).
    pub fn internal(what: impl Into<String>) -> Self {
        Self::new(Fault::Internal, what)
    }

    /// The same fault, its text prefixed with where it happened.
    pub fn context(self, at: impl std::fmt::Display) -> Self {
        SwapError {
            fault: self.fault,
            what: format!("{at}: {}", self.what),
        }
    }
}

impl From<moelane_engine::Error> for SwapError {
    fn from(e: moelane_engine::Error) -> Self {
        SwapError::new(e.fault(), e.to_string())
    }
}
