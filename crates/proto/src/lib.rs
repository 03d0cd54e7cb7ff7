//! moelane-proto: the gRPC contracts of proto/, generated once, here (tonic + prost).
//! Depends on nothing of ours. Errors crossing gRPC carry a category in the
//! `moelane-error` metadata key; callers match on [`Category`], never on message text.

pub mod auth;
pub mod tls;

pub mod lane {
    tonic::include_proto!("moelane.lane.v1");
}

pub mod control {
    tonic::include_proto!("moelane.control.v1");
}

/// The primary-sidecar protocol version this build speaks. Raise it when REGISTER, the swap
/// messages or the data-plane frames change meaning; raise [`MIN_PROTOCOL`] with it when the
/// old meaning is no longer understood.
pub const PROTOCOL: u32 = 1;
/// The oldest protocol version this build still speaks.
pub const MIN_PROTOCOL: u32 = 1;
/// This build's version, as REGISTER and Health carry it.
pub const BUILD: &str = env!("CARGO_PKG_VERSION");

/// Whether a peer speaking `theirs` can pair with this build; the refusal names both.
pub fn check_protocol(peer: &str, theirs: u32, their_build: &str) -> Result<(), String> {
    if (MIN_PROTOCOL..=PROTOCOL).contains(&theirs) {
        return Ok(());
    }
    let build = if their_build.is_empty() {
        "an unversioned build".to_string()
    } else {
        format!("build {their_build}")
    };
    Err(format!(
        "the {peer} ({build}) speaks primary-sidecar protocol {theirs}; this moelane {BUILD} \
         speaks {MIN_PROTOCOL}..={PROTOCOL}: upgrade the older side (a lane's primary and \
         sidecar must speak a common version)"
    ))
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

    /// The category of a status (from metadata; else from its code). A status without the
    /// metadata did not come from a moelane service's own answer but from the connection
    /// (tonic reports a broken HTTP/2 stream, "h2 protocol error", as `Unknown`): the peer
    /// is unavailable, not failing.
    pub fn of(s: &tonic::Status) -> Category {
        if let Some(v) = s
            .metadata()
            .get("moelane-error")
            .and_then(|v| v.to_str().ok())
        {
            return Category::parse(v);
        }
        match s.code() {
            tonic::Code::Unavailable | tonic::Code::Cancelled | tonic::Code::Unknown => {
                Category::Unavailable
            }
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
        // a stream the connection broke (no moelane metadata): the peer is unavailable
        let broken =
            tonic::Status::unknown("h2 protocol error: error reading a body from connection");
        assert_eq!(Category::of(&broken), Category::Unavailable);
        assert_eq!(
            Category::of(&tonic::Status::internal(
                "failed to decode Protobuf message"
            )),
            Category::Internal
        );
    }
}

#[cfg(test)]
mod protocol_tests {
    use super::*;

    #[test]
    fn peers_outside_the_range_are_refused_naming_both_sides() {
        assert!(check_protocol("sidecar", PROTOCOL, BUILD).is_ok());
        assert!(check_protocol("sidecar", MIN_PROTOCOL, "0.0.1").is_ok());
        let e = check_protocol("sidecar", 0, "").expect_err("unversioned");
        assert!(e.contains("unversioned") && e.contains("protocol 0"), "{e}");
        let e = check_protocol("primary", PROTOCOL + 1, "9.9.9").expect_err("newer");
        assert!(e.contains("9.9.9") && e.contains(BUILD), "{e}");
    }
}
