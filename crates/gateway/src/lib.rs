//! The gateway: an OpenAI-compatible HTTP API (axum) over one or many lanes. It templates and
//! tokenises requests (moelane-text), picks a lane through a kameo registry actor (least
//! in-flight among healthy lanes: active health checks plus a circuit breaker per lane),
//! retries a request on another lane before its first token, streams tokens back as server-sent events with
//! incremental UTF-8-safe detokenisation, and maps every error to OpenAI's JSON in one place
//! (as TGI's router does). It reaches lanes through the [`lane::Lane`] trait only.

pub mod anthropic;
pub mod browser;
pub mod discovery;
pub mod error;
pub mod handoff;
pub mod lane;
pub mod listen;
pub mod registry;
mod relay;
pub mod responses;
pub mod server;

pub use server::{admin_router, router, AppState, GatewayConfig, Shutdown};
