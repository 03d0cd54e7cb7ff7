//! moelane-proto: the gRPC contracts of proto/, generated once, here (tonic + prost).
//! Depends on nothing of ours. Errors crossing gRPC carry a category in the
//! `moelane-error` metadata key; callers match on [`Category`], never on message text.

pub mod lane {
    tonic::include_proto!("moelane.lane.v1");
}

pub mod control {
    tonic::include_proto!("moelane.control.v1");
}

/// Error categories carried across gRPC.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Category {
    Unavailable,
    Timeout,
    EpochMismatch,
    NotResident,
    Overloaded,
    BadRequest,
    ContextOverflow,
    Internal,
}

impl Category {
    pub fn as_str(self) -> &'static str {
        match self {
            Category::Unavailable => "unavailable",
            Category::Timeout => "timeout",
            Category::EpochMismatch => "epoch_mismatch",
            Category::NotResident => "not_resident",
            Category::Overloaded => "overloaded",
            Category::BadRequest => "bad_request",
            Category::ContextOverflow => "context_overflow",
            Category::Internal => "internal",
        }
    }

    pub fn parse(s: &str) -> Category {
        match s {
            "unavailable" => Category::Unavailable,
            "timeout" => Category::Timeout,
            "epoch_mismatch" => Category::EpochMismatch,
            "not_resident" => Category::NotResident,
            "overloaded" => Category::Overloaded,
            "bad_request" => Category::BadRequest,
            "context_overflow" => Category::ContextOverflow,
            _ => Category::Internal,
        }
    }

    fn code(self) -> tonic::Code {
        match self {
            Category::Unavailable => tonic::Code::Unavailable,
            Category::Timeout => tonic::Code::DeadlineExceeded,
            Category::Overloaded => tonic::Code::ResourceExhausted,
            Category::BadRequest | Category::ContextOverflow => tonic::Code::InvalidArgument,
            Category::EpochMismatch | Category::NotResident => tonic::Code::FailedPrecondition,
            Category::Internal => tonic::Code::Internal,
        }
    }

    /// A status carrying this category.
    pub fn status(self, msg: impl Into<String>) -> tonic::Status {
        let mut s = tonic::Status::new(self.code(), msg);
        if let Ok(v) = self.as_str().parse() {
            s.metadata_mut().insert("moelane-error", v);
        }
        s
    }

    /// The category of a status (from metadata; else from its code).
    pub fn of(s: &tonic::Status) -> Category {
        if let Some(v) = s
            .metadata()
            .get("moelane-error")
            .and_then(|v| v.to_str().ok())
        {
            return Category::parse(v);
        }
        match s.code() {
            tonic::Code::Unavailable | tonic::Code::Cancelled => Category::Unavailable,
            tonic::Code::DeadlineExceeded => Category::Timeout,
            tonic::Code::ResourceExhausted => Category::Overloaded,
            tonic::Code::InvalidArgument => Category::BadRequest,
            _ => Category::Internal,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn category_survives_a_status() {
        for c in [
            Category::Unavailable,
            Category::Timeout,
            Category::EpochMismatch,
            Category::NotResident,
            Category::Overloaded,
            Category::BadRequest,
            Category::ContextOverflow,
            Category::Internal,
        ] {
            assert_eq!(Category::of(&c.status("x")), c);
        }
    }
}
