//! The one mapping from gateway errors to (HTTP status, OpenAI-style JSON body).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use moelane_proto::Category;
use serde_json::json;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{message}")]
    BadRequest {
        message: String,
        param: Option<&'static str>,
    },
    /// A 400 with its own code (`previous_response_not_found`).
    #[error("{message}")]
    Invalid {
        message: String,
        param: &'static str,
        code: &'static str,
    },
    #[error("The model `{0}` does not exist")]
    UnknownModel(String),
    /// The prompt (and what it asks to write) does not fit the context: the message, and the
    /// request field to name (`messages`; `prompt` and `input` on the endpoints that take
    /// those: [`ApiError::for_field`]).
    #[error("{0}")]
    ContextLength(String, &'static str),
    #[error("request body exceeds {0} bytes")]
    TooLarge(usize),
    #[error("the request's headers hold {0} bytes, more than the {max} accepted", max = crate::server::MAX_HEADER_BYTES)]
    HeadersTooLarge(usize),
    #[error("{0}")]
    Overloaded(String),
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    Internal(String),
    #[error("no route {0}")]
    NotFound(String),
    /// A thing the path names (a kept response) that is not there: the message, and the
    /// code (`response_not_found`).
    #[error("{0}")]
    NoSuch(String, &'static str),
    #[error("{0}")]
    RequestTimeout(String),
    #[error("{0}: this path does not take that method")]
    MethodNotAllowed(String),
    /// No credential, or one that is not a configured key.
    #[error("{0}")]
    Unauthorized(String),
    /// The client has as many generations in flight as it may (`--max-client-requests`).
    #[error("{0}")]
    RateLimited(String),
    /// A body sent with a `Content-Encoding` the gateway does not read (it names it).
    #[error(
        "the request body is sent with Content-Encoding `{0}`, which this server does not \
         read: send the JSON uncompressed (identity)"
    )]
    UnsupportedEncoding(String),
}

impl ApiError {
    pub fn bad(message: impl Into<String>, param: Option<&'static str>) -> Self {
        ApiError::BadRequest {
            message: message.into(),
            param,
        }
    }

    /// From a lane error category.
    pub fn from_lane(category: Category, message: String) -> Self {
        match category {
            // a grammar that could not go on mid-answer (the lane's scheduler says so first)
            Category::BadRequest if message.starts_with("the request's grammar") => {
                ApiError::bad(message, Some("response_format"))
            }
            Category::BadRequest => ApiError::bad(message, None),
            Category::ContextOverflow => ApiError::context(message),
            Category::Overloaded => ApiError::Overloaded(message),
            Category::Unavailable
            | Category::Timeout
            | Category::EpochMismatch
            | Category::NotResident => ApiError::Unavailable(message),
            Category::Internal => ApiError::Internal(message),
        }
    }

    /// A context-length error naming `messages` (chat's field).
    pub fn context(message: String) -> ApiError {
        ApiError::ContextLength(message, "messages")
    }

    /// This error as the endpoint whose prompt is `field` gives it (`prompt`, `input`).
    pub fn for_field(self, field: &'static str) -> ApiError {
        match self {
            ApiError::ContextLength(m, _) => ApiError::ContextLength(m, field),
            e => e,
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest { .. }
            | ApiError::Invalid { .. }
            | ApiError::ContextLength(..) => StatusCode::BAD_REQUEST,
            ApiError::UnknownModel(_) | ApiError::NotFound(_) | ApiError::NoSuch(..) => {
                StatusCode::NOT_FOUND
            }
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ApiError::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::RequestTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::HeadersTooLarge(_) => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            ApiError::UnsupportedEncoding(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::Overloaded(_) | ApiError::RateLimited(_) => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The OpenAI error object.
    pub fn body(&self) -> serde_json::Value {
        let (kind, code, param) = match self {
            ApiError::BadRequest { param, .. } => ("invalid_request_error", None, *param),
            ApiError::Invalid { param, code, .. } => {
                ("invalid_request_error", Some(*code), Some(*param))
            }
            ApiError::UnknownModel(_) => (
                "invalid_request_error",
                Some("model_not_found"),
                Some("model"),
            ),
            ApiError::ContextLength(_, field) => (
                "invalid_request_error",
                Some("context_length_exceeded"),
                Some(*field),
            ),
            ApiError::TooLarge(_) => ("invalid_request_error", Some("request_too_large"), None),
            ApiError::HeadersTooLarge(_) => {
                ("invalid_request_error", Some("headers_too_large"), None)
            }
            ApiError::UnsupportedEncoding(_) => (
                "invalid_request_error",
                Some("unsupported_content_encoding"),
                None,
            ),
            ApiError::Overloaded(_) => ("rate_limit_error", Some("overloaded"), None),
            ApiError::RateLimited(_) => ("rate_limit_error", Some("rate_limit_exceeded"), None),
            ApiError::Unavailable(_) => ("server_error", Some("unavailable"), None),
            ApiError::Internal(_) => ("server_error", None, None),
            ApiError::NotFound(_) => ("invalid_request_error", Some("not_found"), None),
            ApiError::NoSuch(_, code) => ("invalid_request_error", Some(*code), None),
            ApiError::Unauthorized(_) => ("invalid_request_error", Some("invalid_api_key"), None),
            ApiError::RequestTimeout(_) => ("invalid_request_error", Some("timeout"), None),
            ApiError::MethodNotAllowed(_) => {
                ("invalid_request_error", Some("method_not_allowed"), None)
            }
        };
        json!({"error": {"message": self.message(), "type": kind, "param": param, "code": code}})
    }

    /// The message as answered: at most [`MESSAGE_BYTES`] (a message may quote what the
    /// client sent, which can be megabytes), the cut said.
    pub fn message(&self) -> String {
        let mut m = self.to_string();
        if m.len() > MESSAGE_BYTES {
            let mut at = MESSAGE_BYTES;
            while !m.is_char_boundary(at) {
                at -= 1;
            }
            let cut = m.len() - at;
            m.truncate(at);
            m.push_str(&format!("... ({cut} more bytes)"));
        }
        m
    }
}

/// The longest error message answered, in bytes.
pub const MESSAGE_BYTES: usize = 2048;

impl ApiError {
    /// The headers the error's response carries besides its body.
    pub fn extra_headers(&self) -> axum::http::HeaderMap {
        let mut h = axum::http::HeaderMap::new();
        match self {
            ApiError::Unauthorized(_) => {
                h.insert(
                    axum::http::header::WWW_AUTHENTICATE,
                    axum::http::HeaderValue::from_static("Bearer"),
                );
            }
            // one of the client's own generations (or the lane's) ends within seconds, usually
            ApiError::RateLimited(_) | ApiError::Overloaded(_) => {
                h.insert(
                    axum::http::header::RETRY_AFTER,
                    axum::http::HeaderValue::from_static("1"),
                );
            }
            _ => {}
        }
        h
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status(), axum::Json(self.body())).into_response();
        r.headers_mut().extend(self.extra_headers());
        r
    }
}
