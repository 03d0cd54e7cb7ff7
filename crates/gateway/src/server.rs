//! HTTP routes: `POST /v1/completions`, `POST /v1/chat/completions` (streaming as
//! server-sent events in OpenAI's chunk format, or whole), `GET /v1/models`, `/health`,
//! `/ready`, `GET /v1/stats` (each lane's counters), `POST /admin/drain` and
//! `POST /admin/canary` (one greedy token through one named lane, drained or not).
//! Requests are parsed and validated into a [`ValidRequest`] before anything is queued.
//!
//! A request that fails before its first token is retried on another lane (bounded attempts
//! within a deadline); one that fails after tokens were sent ends with an OpenAI error
//! object, never with a finish reason it did not reach. A lane stream that ends without a
//! finish event is a failure, not a finish.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::StreamExt;
use kameo::actor::ActorRef;
use moelane_proto::lane::GenerateRequest;
use moelane_telemetry::names as n;
use moelane_text::chat::{ChatMessage, ChatTemplate};
use moelane_text::detok::Detokenizer;
use moelane_text::tokenizer::Tokenizer;
use serde_json::{json, Value};
use tracing::Instrument as _;

use crate::error::ApiError;
use crate::lane::{EventStream, LaneError};
use crate::registry::{InFlight, ListLanes, Pick, Registry, Report, SetDrain};
use moelane_proto::Category;

/// What the gateway serves.
#[derive(Clone, Debug)]
pub struct GatewayConfig {
    /// The model name clients send (`model` field) and /v1/models lists.
    pub model_name: String,
    /// Context length of the model, in tokens.
    pub max_context: usize,
    /// Largest request body accepted, in bytes.
    pub max_body: usize,
    /// Default `max_tokens` of /v1/completions (OpenAI's is 16).
    pub default_completion_tokens: usize,
    /// `temperature` and `top_p` of a request that does not set them: the model's
    /// generation_config.json (`do_sample: false` is 0, greedy), else OpenAI's 1 and 1.
    pub default_temperature: f32,
    pub default_top_p: f32,
    /// `top_k` of a request that does not set it: the model's generation_config.json (0: none).
    pub default_top_k: u32,
    /// Most lanes one request is tried on before its first token.
    pub max_attempts: usize,
    /// No new attempt starts later than this after the request arrived.
    pub retry_deadline: std::time::Duration,
    /// A request's whole body must arrive within this (408 past it).
    pub body_timeout: std::time::Duration,
    /// How long a streaming client may go without reading before its answer is cut and its
    /// generation cancelled.
    pub stream_stall: std::time::Duration,
    /// Most generations (a request's `n` choices each) one client may have in flight at this
    /// gateway; past it a 429 `rate_limit_exceeded` with `Retry-After`. 0: no bound (the
    /// lanes still share their batch and queue fairly among clients).
    pub max_client_requests: usize,
    /// Most bytes of kept responses (`previous_response_id`, `GET /v1/responses/{id}`), as
    /// JSON; past it the oldest are dropped. 0: nothing is kept.
    pub responses_store_bytes: usize,
}

/// The gateway's stopping state: draining (nothing new is taken: /ready says 503) and, once
/// the grace period is over, abort (requests still running end with an error).
pub struct Shutdown {
    /// How long a streaming client may go without taking an event ([`put`]).
    stall: std::time::Duration,
    draining: std::sync::atomic::AtomicBool,
    abort: tokio::sync::watch::Sender<bool>,
    /// Requests being answered (whole or streamed), for the drain's wait.
    active: std::sync::atomic::AtomicUsize,
}

impl Default for Shutdown {
    fn default() -> Self {
        Shutdown {
            stall: std::time::Duration::from_secs(60),
            draining: false.into(),
            abort: tokio::sync::watch::channel(false).0,
            active: 0.into(),
        }
    }
}

impl Shutdown {
    pub fn start_drain(&self) {
        self.draining.store(true, Ordering::SeqCst);
        metrics::gauge!(n::DRAINING).set(1.0);
    }
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }
    /// Ends every request still running with an error (the grace period is over).
    pub fn abort(&self) {
        self.abort.send_replace(true);
    }
    /// Whether [`Shutdown::abort`] was called.
    pub fn is_aborted(&self) -> bool {
        *self.abort.borrow()
    }
    /// Resolves once [`Shutdown::abort`] was called.
    pub fn aborted(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.abort.subscribe();
        async move {
            let _ = rx.wait_for(|a| *a).await;
        }
    }
    /// Requests being answered now.
    pub fn active(&self) -> usize {
        self.active.load(Ordering::SeqCst)
    }
    pub(crate) fn enter(self: &Arc<Self>) -> ActiveGuard {
        self.active.fetch_add(1, Ordering::SeqCst);
        ActiveGuard(self.clone(), None)
    }
}

/// Counts one request being answered while alive, and holds its client's places.
pub(crate) struct ActiveGuard(Arc<Shutdown>, Option<ClientSlot>);

impl ActiveGuard {
    /// Holds the client's places until the request's answer ends.
    pub(crate) fn hold(&mut self, slot: Option<ClientSlot>) {
        self.1 = slot;
    }
}

/// Whom a request is accounted to: `key:I` (the I-th API key) where the gateway has keys,
/// else `ip:ADDRESS` (an IPv6 client's /64), else empty. Set by the API key check.
#[derive(Clone, Debug, Default)]
pub(crate) struct Client(pub(crate) String);

/// The client of `req`, as the API key check named it.
pub(crate) fn client_of(req: &Request) -> String {
    req.extensions()
        .get::<Client>()
        .map(|c| c.0.clone())
        .unwrap_or_default()
}

/// Accounts validated request `vr` to `client`: its `n` places of the client's bound, held by
/// `active` until the answer ends (a 429 past the bound), and its client named to the lane.
pub(crate) fn account(
    st: &AppState,
    active: &mut ActiveGuard,
    vr: &mut ValidRequest,
    client: String,
) -> Result<(), ApiError> {
    active.hold(st.clients.take(&client, vr.n, st.cfg.max_client_requests)?);
    vr.client = client;
    Ok(())
}

/// Generations each client has in flight at this gateway (`--max-client-requests`).
#[derive(Debug, Default)]
pub(crate) struct ClientSlots {
    held: std::sync::Mutex<std::collections::HashMap<String, usize>>,
}

/// A client's `n` places, given back when dropped.
pub(crate) struct ClientSlot {
    slots: Arc<ClientSlots>,
    client: String,
    n: usize,
}

impl ClientSlots {
    /// Takes `n` places for `client` if it holds fewer than `max - n` (None when `max` is
    /// 0: no bound).
    pub(crate) fn take(
        self: &Arc<Self>,
        client: &str,
        n: usize,
        max: usize,
    ) -> Result<Option<ClientSlot>, ApiError> {
        if max == 0 {
            return Ok(None);
        }
        if n > max {
            return Err(ApiError::bad(
                format!(
                    "n = {n} choices is more than the {max} generations a client may have in \
                     flight at once"
                ),
                Some("n"),
            ));
        }
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        let h = held.entry(client.to_string()).or_default();
        if *h + n > max {
            let now = *h;
            if now == 0 {
                held.remove(client);
            }
            return Err(ApiError::RateLimited(format!(
                "this client has {now} generations in flight, at most {max} at once: retry when \
                 one ends"
            )));
        }
        *h += n;
        Ok(Some(ClientSlot {
            slots: self.clone(),
            client: client.to_string(),
            n,
        }))
    }
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut held = self.slots.held.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(h) = held.get_mut(&self.client) {
            *h = h.saturating_sub(self.n);
            if *h == 0 {
                held.remove(&self.client);
            }
        }
    }
}

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The secrets the gateway's listeners accept.
#[derive(Clone, Debug, Default)]
pub struct Auth {
    /// Keys of the OpenAI API (`--api-key-file`); None: the API is open.
    pub api_keys: Option<Arc<moelane_proto::auth::Keys>>,
    /// The admin token (`--admin-token-file`); None: the admin listener is loopback-only.
    pub admin: Option<Arc<moelane_proto::auth::Keys>>,
    /// Which browser pages may call the listeners, and the names they answer to
    /// (`--allowed-origin`, `--allowed-host`).
    pub browsers: crate::browser::Browsers,
}

pub struct AppState {
    pub cfg: GatewayConfig,
    pub auth: Auth,
    /// Bytes of the vocabulary's longest token: a text of N bytes holds at least N / this.
    max_token_bytes: usize,
    /// Requests being rendered and tokenised at once (one per core).
    pub(crate) tokenizing: tokio::sync::Semaphore,
    /// Large bodies (over [`BIG_BODY`]) held parsed at once, from their parse to the end of
    /// their validation (one per core): a JSON tree takes ~10x its text, so this bounds what
    /// many large bodies at once can hold.
    pub(crate) parsing: tokio::sync::Semaphore,
    pub tokenizer: Arc<Tokenizer>,
    /// The grammar compiler of structured output (none: the tokenizer has no end-of-sequence
    /// token to end an answer with).
    pub grammars: Option<moelane_text::grammar::Grammars>,
    pub template: ChatTemplate,
    pub registry: ActorRef<Registry>,
    pub shutdown: Arc<Shutdown>,
    /// Generations in flight per client, against `cfg.max_client_requests`.
    pub(crate) clients: Arc<ClientSlots>,
    /// Kept responses (`previous_response_id`), at most `cfg.responses_store_bytes`.
    pub responses: crate::responses::Store,
    next_id: AtomicU64,
}

impl AppState {
    pub fn new(
        cfg: GatewayConfig,
        tokenizer: Tokenizer,
        template: ChatTemplate,
        registry: ActorRef<Registry>,
    ) -> Self {
        let max_token_bytes = (0..tokenizer.vocab_size() as u32)
            .map(|t| tokenizer.token_bytes(t).len())
            .max()
            .unwrap_or(1)
            .max(1);
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        let tokenizer = Arc::new(tokenizer);
        let grammars = tokenizer.eos_ids.first().map(|&eos| {
            // the vocabulary's trie built now, off the request path
            let g = moelane_text::grammar::Grammars::new(tokenizer.clone(), eos);
            g.warm();
            g
        });
        let responses = crate::responses::Store::new(cfg.responses_store_bytes);
        let stall = cfg.stream_stall;
        AppState {
            grammars,
            cfg,
            auth: Auth::default(),
            max_token_bytes,
            tokenizing: tokio::sync::Semaphore::new(cores),
            parsing: tokio::sync::Semaphore::new(cores),
            tokenizer,
            template,
            registry,
            shutdown: Arc::new(Shutdown {
                stall,
                ..Shutdown::default()
            }),
            clients: Default::default(),
            responses,
            next_id: AtomicU64::new(1),
        }
    }

    /// With these secrets required (see [`Access`]).
    pub fn with_auth(mut self, auth: Auth) -> Self {
        self.auth = auth;
        self
    }
}

/// The listener a route is served on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Listener {
    /// `--listen`: the API clients use.
    Public,
    /// `--admin-listen`: operators and their tools (loopback unless an admin token is set).
    Admin,
}

/// Who may call a route.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Anyone who reaches the port (liveness and readiness probes).
    Open,
    /// A client presenting one of the `--api-key-file` keys (everyone when none is set).
    ApiKey,
    /// An operator presenting the `--admin-token-file` token (everyone who reaches the admin
    /// listener when none is set: it then binds loopback only).
    AdminToken,
}

/// One HTTP route: where it is served, who may call it, and its handler.
pub struct Route {
    pub listener: Listener,
    pub method: &'static str,
    pub path: &'static str,
    pub access: Access,
    handler: fn() -> axum::routing::MethodRouter<Arc<AppState>>,
}

/// Every HTTP route the gateway serves. A route is served only through this table, so none
/// exists without a policy (docs/SECURITY.md lists it; a test checks each entry).
pub fn routes() -> Vec<Route> {
    use Access::*;
    use Listener::*;
    let r = |listener, method, path, access, handler| Route {
        listener,
        method,
        path,
        access,
        handler,
    };
    vec![
        r(Public, "POST", "/v1/completions", ApiKey, || {
            post(completions)
        }),
        r(Public, "POST", "/v1/chat/completions", ApiKey, || {
            post(chat_completions)
        }),
        r(Public, "POST", "/v1/messages", ApiKey, || {
            post(crate::anthropic::messages)
        }),
        r(Public, "POST", "/v1/messages/count_tokens", ApiKey, || {
            post(crate::anthropic::count_tokens)
        }),
        r(Public, "POST", "/v1/responses", ApiKey, || {
            post(crate::responses::responses)
        }),
        r(Public, "GET", "/v1/responses/{id}", ApiKey, || {
            get(crate::responses::retrieve)
        }),
        r(
            Public,
            "GET",
            "/v1/responses/{id}/input_items",
            ApiKey,
            || get(crate::responses::list_input_items),
        ),
        r(Public, "DELETE", "/v1/responses/{id}", ApiKey, || {
            axum::routing::delete(crate::responses::delete)
        }),
        r(Public, "GET", "/v1/models", ApiKey, || get(models)),
        r(Public, "GET", "/v1/models/{*model}", ApiKey, || get(model)),
        r(Public, "GET", "/v1/stats", ApiKey, || get(stats)),
        r(Public, "GET", "/metrics", ApiKey, || {
            get(moelane_telemetry::metrics_page)
        }),
        r(Public, "GET", "/health", Open, || get(|| async { "ok" })),
        r(Public, "GET", "/ready", Open, || get(ready)),
        r(Admin, "POST", "/admin/drain", AdminToken, || post(drain)),
        r(Admin, "POST", "/admin/canary", AdminToken, || post(canary)),
        r(Admin, "GET", "/v1/stats", AdminToken, || get(stats)),
        r(Admin, "GET", "/metrics", AdminToken, || {
            get(moelane_telemetry::metrics_page)
        }),
        r(Admin, "GET", "/health", Open, || get(|| async { "ok" })),
    ]
}

/// The router of one listener: its routes from [`routes`], each behind its access check.
pub fn router_for(state: Arc<AppState>, listener: Listener) -> Router {
    let mut router = Router::new();
    for route in routes().into_iter().filter(|r| r.listener == listener) {
        let mut m = (route.handler)();
        if route.access != Access::Open {
            m = m.route_layer(axum::middleware::from_fn_with_state(
                (state.clone(), route.access),
                require,
            ));
        }
        router = router.route(route.path, m);
    }
    let router = router
        .fallback(|req: Request| async move {
            ApiError::NotFound(format!("{} {}", req.method(), req.uri().path()))
        })
        .method_not_allowed_fallback(|req: Request| async move {
            ApiError::MethodNotAllowed(format!("{} {}", req.method(), req.uri().path()))
        })
        .with_state(state.clone())
        .layer(axum::middleware::from_fn(refuse_encoded_bodies))
        .layer(axum::middleware::from_fn_with_state(
            state,
            crate::browser::guard,
        ));
    // (Anthropic's routes are public: there its errors are in its shape)
    let router = if listener == Listener::Public {
        router.layer(axum::middleware::from_fn(
            crate::anthropic::errors_in_its_shape,
        ))
    } else {
        router
    };
    router
        .layer(axum::middleware::from_fn(count_requests))
        .layer(axum::middleware::from_fn(limit_headers))
}

/// A request whose body is compressed (`Content-Encoding: gzip`, ...) gets a 415 naming the
/// encoding, not a "malformed JSON" about bytes it never meant as JSON. `identity` (and no
/// header) is read as before.
async fn refuse_encoded_bodies(req: Request, next: axum::middleware::Next) -> Response {
    let headers = req.headers().get_all(axum::http::header::CONTENT_ENCODING);
    for value in headers.iter() {
        let value = String::from_utf8_lossy(value.as_bytes());
        let coded = value
            .split(',')
            .map(str::trim)
            .find(|e| !e.is_empty() && !e.eq_ignore_ascii_case("identity"));
        if let Some(e) = coded {
            let e: String = e.chars().take(64).collect();
            return ApiError::UnsupportedEncoding(e).into_response();
        }
    }
    next.run(req).await
}

/// Most bytes of request headers (names and values) a request may carry: past it a 431 with
/// an OpenAI error body. (Past hyper's own limits, ~400 KB of head or more than 100 headers,
/// hyper answers 431 itself, without a body.)
pub const MAX_HEADER_BYTES: usize = 32 << 10;

async fn limit_headers(req: Request, next: axum::middleware::Next) -> Response {
    let bytes: usize = req
        .headers()
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len())
        .sum();
    if bytes > MAX_HEADER_BYTES {
        return ApiError::HeadersTooLarge(bytes).into_response();
    }
    next.run(req).await
}

/// The public API's router.
pub fn router(state: Arc<AppState>) -> Router {
    router_for(state, Listener::Public)
}

/// The admin listener's router.
pub fn admin_router(state: Arc<AppState>) -> Router {
    router_for(state, Listener::Admin)
}

/// The credential of a request: `Authorization: Bearer K`, or `x-api-key: K` (the header
/// Anthropic's clients send).
fn credential(req: &Request) -> Option<&str> {
    let h = req.headers();
    h.get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(moelane_proto::auth::bearer)
        .or_else(|| h.get("x-api-key").and_then(|v| v.to_str().ok()))
}

/// The check of a route's [`Access`] (an `Open` route has none): the secret it needs, if the
/// deployment set one, or a 401 saying what is missing.
async fn require(
    State((st, access)): State<(Arc<AppState>, Access)>,
    req: Request,
    next: axum::middleware::Next,
) -> Response {
    let keys = match access {
        Access::Open => None,
        Access::ApiKey => st.auth.api_keys.as_deref(),
        Access::AdminToken => st.auth.admin.as_deref(),
    };
    let matched = keys
        .zip(credential(&req))
        .and_then(|(k, c)| k.which(c.as_bytes()));
    let mut req = req;
    if access == Access::ApiKey {
        // whom the request is accounted to: its key where there are keys, else its address
        let client = match (matched, req.extensions().get::<crate::listen::Peer>()) {
            (Some(i), _) => format!("key:{i}"),
            (None, Some(p)) => format!("ip:{}", p.client()),
            (None, None) => String::new(),
        };
        req.extensions_mut().insert(Client(client));
    }
    if keys.is_some() {
        let refused = match (credential(&req), access) {
            (Some(_), _) if matched.is_some() => None,
            (_, Access::AdminToken) => Some(
                "the admin endpoints need the admin token: Authorization: Bearer TOKEN \
                 (--admin-token-file)",
            ),
            (None, _) => Some("You didn't provide an API key: send Authorization: Bearer YOUR_KEY"),
            (Some(_), _) => Some("Incorrect API key provided"),
        };
        if let Some(why) = refused {
            return ApiError::Unauthorized(why.into()).into_response();
        }
    }
    next.run(req).await
}

/// Counts requests by matched route and status code (unmatched paths share one label).
async fn count_requests(req: Request, next: axum::middleware::Next) -> Response {
    let route = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "unmatched".into());
    let r = next.run(req).await;
    metrics::counter!(n::HTTP_REQUESTS, "route" => route, "code" => r.status().as_u16().to_string())
        .increment(1);
    r
}

/// Publishes each lane's health (the active checker's last answer and the breaker: 1 when
/// the lane takes requests), drain state and requests in flight on each scrape.
pub fn register_metrics(st: Arc<AppState>) {
    moelane_telemetry::add_collector(Box::new(move || {
        let st = st.clone();
        Box::pin(async move {
            let Ok(list) = lanes(&st).await else {
                return;
            };
            for (info, _) in list {
                let up = info.state == "up";
                let l = info.name.clone();
                metrics::gauge!(n::LANE_UP, "lane" => l.clone()).set(up as u8 as f64);
                metrics::gauge!(n::LANE_DRAINING, "lane" => l.clone())
                    .set(info.draining as u8 as f64);
                metrics::gauge!(n::LANE_INFLIGHT, "lane" => l).set(info.inflight as f64);
            }
        })
    }));
}

/// The request's span: the root of its trace.
pub(crate) fn request_span(chat: bool) -> tracing::Span {
    let name = if chat {
        "POST /v1/chat/completions"
    } else {
        "POST /v1/completions"
    };
    tracing::info_span!(
        "request",
        otel.name = name,
        otel.kind = "server",
        http.route = if chat {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        },
        moelane.request_id = tracing::field::Empty,
        moelane.lane = tracing::field::Empty,
        gen_ai.usage.input_tokens = tracing::field::Empty,
        gen_ai.usage.output_tokens = tracing::field::Empty,
        moelane.finish_reason = tracing::field::Empty,
    )
}

/// Per-request latency bookkeeping: first token, gaps between tokens, totals at the end.
/// A request's timing and token counts, recorded once per request however many choices
/// (`n`) it has: its first token (of any choice) after its arrival, each choice's gaps
/// between tokens, and at its end its duration, its prompt once and every choice's tokens.
pub(crate) struct Timing {
    t0: Instant,
    last: Option<Instant>,
    route: &'static str,
    /// Whether the request's first token was recorded (shared by its choices).
    first: Arc<std::sync::atomic::AtomicBool>,
}

impl Timing {
    pub(crate) fn new(chat: bool) -> Self {
        Self::since(chat, Instant::now())
    }

    /// A request's timing from its arrival at `t0`.
    pub(crate) fn since(chat: bool, t0: Instant) -> Self {
        Timing {
            t0,
            last: None,
            route: if chat {
                "/v1/chat/completions"
            } else {
                "/v1/completions"
            },
            first: Default::default(),
        }
    }

    /// The timing of one choice (or one attempt at it) of this request.
    pub(crate) fn choice(&self) -> Timing {
        Timing {
            t0: self.t0,
            last: None,
            route: self.route,
            first: self.first.clone(),
        }
    }

    pub(crate) fn token(&mut self) {
        let now = Instant::now();
        match self.last {
            None => {
                if !self.first.swap(true, std::sync::atomic::Ordering::Relaxed) {
                    metrics::histogram!(n::TIME_TO_FIRST_TOKEN)
                        .record((now - self.t0).as_secs_f64())
                }
            }
            Some(l) => metrics::histogram!(n::INTER_TOKEN_LATENCY).record((now - l).as_secs_f64()),
        }
        self.last = Some(now);
    }

    /// The request ended: once per request (every choice's tokens in `completion`).
    pub(crate) fn done(&self, prompt: usize, completion: usize, finish: &str) {
        metrics::histogram!(n::REQUEST_DURATION, "route" => self.route)
            .record(self.t0.elapsed().as_secs_f64());
        metrics::counter!(n::GENERATED_TOKENS).increment(completion as u64);
        metrics::counter!(n::PROMPT_TOKENS).increment(prompt as u64);
        let span = tracing::Span::current();
        span.record("gen_ai.usage.output_tokens", completion);
        span.record("moelane.finish_reason", finish);
    }
}

/// A request after parsing and validation: tokenised, clamped, checked.
#[derive(Clone, Debug)]
pub struct ValidRequest {
    pub chat: bool,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub temperature: f32,
    pub top_p: f32,
    /// 0: no top-k.
    pub top_k: u32,
    pub seed: u64,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// Choices asked (`n`), each its own generation with seed `seed + i`.
    pub n: usize,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub logit_bias: std::collections::HashMap<u32, f32>,
    /// `Some(k)`: each token's log-probability and the k most likely tokens'.
    pub logprobs: Option<u32>,
    /// Completions' `echo`: the prompt's text, put before each choice's text.
    pub echo: Option<String>,
    /// `echo` with `logprobs`: the prompt's log-probabilities lead each choice's.
    pub prompt_logprobs: bool,
    /// The grammar every choice follows (`response_format`), as llguidance's JSON.
    pub grammar: Option<String>,
    /// The tools declared (name, parameters' schema) and how the answer may call them.
    pub tools: Vec<(String, Value)>,
    pub tool_mode: ToolMode,
    /// The grammar leaves the text free (strict tools in `auto` mode: only calls are
    /// constrained), so the answer may start inside a thinking block the prompt opened.
    pub free_grammar: bool,
    /// The template knows a thinking block: `<think>...</think>` becomes `reasoning_content`.
    pub think: bool,
    /// The prompt opened the thinking block: the answer starts inside it.
    pub in_reasoning: bool,
    /// The family's reasoning and tool-call markup (the template's).
    pub markup: moelane_text::agent::Markup,
    /// Whom the request is accounted to ([`Client`]; empty: anonymous).
    pub client: String,
}

impl ValidRequest {
    /// Whether the answer is split into content, reasoning and calls.
    pub(crate) fn splits(&self) -> bool {
        self.chat && (self.think || self.tool_mode != ToolMode::Off)
    }

    /// The splitter of this request's answer. A grammar (a forced call, a schema) writes
    /// from the first token and never closes a thinking block, so then the answer does not
    /// start in one even where the prompt opened it; a forced answer is only calls.
    pub(crate) fn splitter(&self) -> moelane_text::agent::Splitter {
        let s = moelane_text::agent::Splitter::new(
            self.markup.clone(),
            self.tool_mode != ToolMode::Off,
            self.think,
            self.in_reasoning && (self.grammar.is_none() || self.free_grammar),
        )
        .tools(&self.tools);
        match self.tool_mode {
            ToolMode::Required | ToolMode::Named(_) => s.forced(),
            _ => s,
        }
    }

    /// The text token `t` adds to the answer: its bytes, none for a special token unless it
    /// is one of the markup's markers the splitter reads (harmony's `<|channel|>`...).
    pub fn token_text<'a>(&self, st: &'a AppState, t: u32) -> &'a [u8] {
        let bytes = st.tokenizer.token_bytes(t);
        if !st.tokenizer.is_special(t)
            || (self.splits() && std::str::from_utf8(bytes).is_ok_and(|s| self.markup.marks(s)))
        {
            bytes
        } else {
            &[]
        }
    }

    /// A whole answer's parts.
    /// The answer `text`'s parts, and whether it ended inside a tool call (one it cut is
    /// not whole).
    pub(crate) fn split_answer(&self, text: &str) -> (Vec<moelane_text::agent::Part>, bool) {
        let mut s = self.splitter();
        let mut parts = s.push(text);
        let cut = s.in_call();
        parts.extend(s.finish());
        (moelane_text::agent::merge(parts), cut)
    }
}

/// A body over this many bytes is parsed off the async runtime and under a turn of
/// [`AppState::parsing`].
pub(crate) const BIG_BODY: usize = 256 << 10;

/// The request body as a JSON object (an admin call's: small, no turn kept).
pub(crate) async fn read_json(st: &AppState, body: Body) -> Result<Value, ApiError> {
    Ok(read_json_turn(st, body).await?.0)
}

/// The request body as a JSON object and, for a large body, its turn of
/// [`AppState::parsing`]: the caller drops it once the request is validated (the tree
/// dropped).
pub(crate) async fn read_json_turn(
    st: &AppState,
    body: Body,
) -> Result<(Value, Option<tokio::sync::SemaphorePermit<'_>>), ApiError> {
    let bytes = read_bytes(st, body).await?;
    if bytes.len() <= BIG_BODY {
        return Ok((parse_json(&bytes)?, None));
    }
    let turn = st
        .parsing
        .acquire()
        .await
        .map_err(|_| ApiError::Unavailable("the gateway is stopping".into()))?;
    let v = tokio::task::spawn_blocking(move || parse_json(&bytes))
        .await
        .map_err(|e| ApiError::Internal(format!("parsing the request: {e}")))??;
    Ok((v, Some(turn)))
}

async fn read_bytes(st: &AppState, body: Body) -> Result<Bytes, ApiError> {
    // a Content-Length over the limit is refused before any byte of the body is read (or a
    // `100 Continue` sent)
    if axum::body::HttpBody::size_hint(&body).lower() > st.cfg.max_body as u64 {
        return Err(ApiError::TooLarge(st.cfg.max_body));
    }
    // the whole body within the deadline: a client sending it a byte at a time is cut off
    let read = tokio::time::timeout(
        st.cfg.body_timeout,
        axum::body::to_bytes(body, st.cfg.max_body),
    );
    let bytes: Bytes = match read.await {
        Err(_) => {
            return Err(ApiError::RequestTimeout(format!(
                "the request body did not arrive within {:.0} s",
                st.cfg.body_timeout.as_secs_f64()
            )))
        }
        Ok(Err(e)) if format!("{e:?}").contains("LengthLimitError") => {
            return Err(ApiError::TooLarge(st.cfg.max_body))
        }
        Ok(Err(e)) => {
            return Err(ApiError::bad(
                format!("reading the request body: {e}"),
                None,
            ))
        }
        Ok(Ok(b)) => b,
    };
    Ok(bytes)
}

/// A request body as a JSON object. A string's lone UTF-16 surrogate escape (`"\ud83d"`, what
/// a client writes after cutting a string inside an emoji) is read as U+FFFD, as Python's and
/// JavaScript's JSON readers take it, rather than refusing the body.
fn parse_json(bytes: &[u8]) -> Result<Value, ApiError> {
    let v: Value = match serde_json::from_slice(bytes) {
        Ok(v) => v,
        Err(e) => match without_lone_surrogates(bytes) {
            Some(fixed) => serde_json::from_slice(&fixed),
            None => Err(e),
        }
        .map_err(|e| ApiError::bad(format!("malformed JSON body: {e}"), None))?,
    };
    if !v.is_object() {
        return Err(ApiError::bad(
            "the request body must be a JSON object",
            None,
        ));
    }
    Ok(v)
}

/// `bytes` with every `\uXXXX` escape of a lone surrogate (a high one not followed by a low
/// one, or a low one alone) replaced by `\ufffd`; None when there is none.
fn without_lone_surrogates(bytes: &[u8]) -> Option<Vec<u8>> {
    let hex = |at: usize| -> Option<u16> {
        let h = bytes.get(at..at + 4)?;
        u16::from_str_radix(std::str::from_utf8(h).ok()?, 16).ok()
    };
    // the escape `\uXXXX` at i (i at the backslash): its code unit
    let unit = |i: usize| -> Option<u16> {
        (bytes.get(i) == Some(&b'\\') && bytes.get(i + 1) == Some(&b'u'))
            .then(|| hex(i + 2))
            .flatten()
    };
    let mut out = Vec::with_capacity(bytes.len());
    let mut changed = false;
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] != b'\\' {
            out.push(bytes[i]);
            i += 1;
            continue;
        }
        match unit(i) {
            Some(0xD800..=0xDBFF)
                if unit(i + 6).is_some_and(|l| (0xDC00..=0xDFFF).contains(&l)) =>
            {
                out.extend_from_slice(&bytes[i..i + 12]);
                i += 12;
            }
            Some(0xD800..=0xDFFF) => {
                out.extend_from_slice(b"\\ufffd");
                changed = true;
                i += 6;
            }
            // any other escape (`\\` included) is copied whole, so its second byte is never
            // read as the start of an escape
            _ => {
                out.extend_from_slice(&bytes[i..(i + 2).min(bytes.len())]);
                i += 2;
            }
        }
    }
    changed.then_some(out)
}

/// A body of `/v1/chat/completions` (`chat`) or `/v1/completions` parsed and validated as
/// the routes do before anything is queued: the chat rendered, the prompt tokenised, every
/// parameter checked. For the fuzz target of request validation (fuzz/).
pub fn validate_body(st: &AppState, body: &[u8], chat: bool) -> Result<ValidRequest, ApiError> {
    validate(st, &parse_json(body)?, chat)
}

fn num(v: &Value, key: &'static str) -> Result<Option<f64>, ApiError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => n
            .as_f64()
            .map(Some)
            .ok_or_else(|| ApiError::bad(format!("`{key}` is not a number"), Some(key))),
        Some(other) => Err(ApiError::bad(
            format!("`{key}` must be a number, got {other}"),
            Some(key),
        )),
    }
}

/// An optional boolean field, `default` when absent or null.
fn flag(v: &Value, key: &'static str, default: bool) -> Result<bool, ApiError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(x) => Err(ApiError::bad(
            format!("`{key}` must be a boolean, got {x}"),
            Some(key),
        )),
    }
}

fn text_of(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Null => Some(String::new()),
        // content parts: [{"type":"text","text":"..."}]
        Value::Array(parts) => parts
            .iter()
            .map(|p| {
                match (
                    p.get("type").and_then(|t| t.as_str()),
                    p.get("text").and_then(|t| t.as_str()),
                ) {
                    (Some("text") | None, Some(t)) => Some(t.to_string()),
                    _ => None,
                }
            })
            .collect::<Option<Vec<_>>>()
            .map(|v| v.concat()),
        _ => None,
    }
}

/// 128 bits from the operating system's random source (a counter mixed with the time only if
/// that fails, which it does not on Linux).
pub(crate) fn random_id(st: &AppState) -> u128 {
    let mut b = [0u8; 16];
    match getrandom::fill(&mut b) {
        Ok(()) => u128::from_le_bytes(b),
        Err(_) => {
            let n = st.next_id.fetch_add(1, Ordering::Relaxed) as u128;
            (n << 64)
                ^ SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos())
        }
    }
}

/// Tokenises `text`, refusing first, without tokenising, a text that holds more tokens than
/// the context for certain. No token is longer than the vocabulary's longest, and a
/// tokenizer's normaliser shrinks a character at most from 4 UTF-8 bytes to 1, so a text of
/// N bytes holds at least N / (4 x longest) tokens.
fn encode_bounded(st: &AppState, text: &str) -> Result<Vec<u32>, ApiError> {
    encode_bounded_check(st, text)?;
    st.tokenizer
        .encode(text)
        .map_err(|e| ApiError::Internal(e.to_string()))
}

/// [`encode_bounded`]'s check alone.
fn encode_bounded_check(st: &AppState, text: &str) -> Result<(), ApiError> {
    let ctx = st.cfg.max_context;
    let least = text.len() / (4 * st.max_token_bytes.max(1));
    if least >= ctx {
        return Err(ApiError::context(format!(
            "This model's maximum context length is {ctx} tokens; the prompt is {} bytes, at \
             least {least} tokens",
            text.len()
        )));
    }
    Ok(())
}

/// A chat rendered by the template and tokenised, where only the template's own markers
/// become control tokens. A special token's text inside any string of the client's (a
/// message's content or reasoning, a tool call's name or arguments, a tool's description or
/// schema, a template kwarg; keys included) would otherwise forge a turn or a role
/// (`<|im_end|>` typed by a user): when one holds such text, the chat is rendered again with
/// each occurrence replaced by a marker of a random nonce, the template's text between the
/// markers is tokenised with control tokens recognised, and each marker's text as plain
/// text. Chats without such text tokenise as one string, as transformers does.
fn encode_chat(
    st: &AppState,
    msgs: &[ChatMessage],
    tools: Option<&Value>,
    kwargs: &serde_json::Map<String, Value>,
) -> Result<Vec<u32>, ApiError> {
    let render = |m: &[ChatMessage], t: Option<&Value>, k: &serde_json::Map<String, Value>| {
        st.template
            .render_with(m, t, k)
            .map_err(|e| ApiError::bad(e.to_string(), Some("messages")))
    };
    // the client's strings with their token texts replaced by markers: none replaced, the
    // chat is as sent (the common case: one string, as transformers tokenises it)
    let mut mask = Mask {
        tok: &st.tokenizer,
        open: format!("~~{}:", random_id(st) as u64),
        marks: Vec::new(),
    };
    let masked_msgs: Vec<ChatMessage> = msgs.iter().map(|m| mask.message(m)).collect();
    let masked_tools = tools.map(|t| mask.value(t, true));
    let masked_kwargs: serde_json::Map<String, Value> = kwargs
        .iter()
        .map(|(k, v)| (mask.str(k, true), mask.value(v, true)))
        .collect();
    let text = render(msgs, tools, kwargs)?;
    if mask.marks.is_empty() {
        return encode_bounded(st, &text);
    }
    // the size check on the chat as sent first
    encode_bounded_check(st, &text)?;
    let masked = render(&masked_msgs, masked_tools.as_ref(), &masked_kwargs)?;
    let mut ids = Vec::new();
    let mut rest = masked.as_str();
    while let Some(at) = rest.find(&mask.open) {
        ids.extend(encode_piece(st, &rest[..at], false)?);
        let after = &rest[at + mask.open.len()..];
        // a marker is `~~NONCE:I~~`; the template printed it whole unless it cut the string
        let mark = after
            .find(MARK_CLOSE)
            .and_then(|end| Some((after[..end].parse::<usize>().ok()?, end)))
            .and_then(|(i, end)| Some((mask.marks.get(i)?, end)));
        let Some((text, end)) = mark else {
            return Err(ApiError::bad(
                "the chat holds control-token text and this model's chat template cuts the \
                 string that holds it, so it cannot be sent as plain text",
                Some("messages"),
            ));
        };
        ids.extend(encode_piece(st, text, true)?);
        rest = &after[end + MARK_CLOSE.len()..];
    }
    ids.extend(encode_piece(st, rest, false)?);
    Ok(ids)
}

/// The end of [`Mask`]'s markers.
const MARK_CLOSE: &str = "~~";

/// The client's strings with each token text that must stay plain replaced by a marker
/// (`~~NONCE:I~~`, I indexing `marks`, one index per distinct text, so equal strings stay
/// equal): ASCII digits and punctuation, so that what a template does to a string (JSON
/// escaping, case) leaves it whole, and a random nonce, so that no client text can pose as
/// one.
struct Mask<'a> {
    tok: &'a Tokenizer,
    open: String,
    marks: Vec<String>,
}

impl Mask<'_> {
    fn str(&mut self, s: &str, strict: bool) -> String {
        let mut out = String::with_capacity(s.len());
        let mut rest = s;
        loop {
            let found = if strict {
                self.tok.find_added_at(rest)
            } else {
                self.tok.find_special_at(rest)
            };
            let Some((at, t)) = found else { break };
            let i = match self.marks.iter().position(|m| m == t) {
                Some(i) => i,
                None => {
                    self.marks.push(t.to_string());
                    self.marks.len() - 1
                }
            };
            out.push_str(&rest[..at]);
            out.push_str(&format!("{}{i}{MARK_CLOSE}", self.open));
            rest = &rest[at + t.len()..];
        }
        out.push_str(rest);
        out
    }

    fn value(&mut self, v: &Value, strict: bool) -> Value {
        match v {
            Value::String(s) => Value::String(self.str(s, strict)),
            Value::Array(a) => Value::Array(a.iter().map(|x| self.value(x, strict)).collect()),
            Value::Object(o) => Value::Object(
                o.iter()
                    .map(|(k, x)| (self.str(k, strict), self.value(x, strict)))
                    .collect(),
            ),
            other => other.clone(),
        }
    }

    /// A message masked: strict (any added token's text plain) but for an assistant turn's
    /// content, reasoning and calls, the model's own writing sent back, where a template
    /// parses the family's markup (`<think>`, `<tool_call>`: added tokens not marked special)
    /// and only special tokens' text is plain; names and ids are always strict.
    fn message(&mut self, m: &ChatMessage) -> ChatMessage {
        let strict = m.role != "assistant";
        ChatMessage {
            role: m.role.clone(),
            content: self.str(&m.content, strict),
            tool_calls: m.tool_calls.as_ref().map(|c| self.value(c, strict)),
            tool_call_id: m.tool_call_id.as_deref().map(|t| self.str(t, true)),
            name: m.name.as_deref().map(|t| self.str(t, true)),
            reasoning_content: m.reasoning_content.as_deref().map(|t| self.str(t, strict)),
        }
    }
}

/// One piece of a rendered chat: the template's (special tokens recognised) or a user's
/// content (`plain`: as written).
fn encode_piece(st: &AppState, piece: &str, plain: bool) -> Result<Vec<u32>, ApiError> {
    if piece.is_empty() {
        return Ok(Vec::new());
    }
    let r = if plain {
        st.tokenizer.encode_plain(piece)
    } else {
        st.tokenizer.encode(piece)
    };
    r.map_err(|e| ApiError::Internal(e.to_string()))
}

/// The request's prompt as token ids: the chat messages rendered by the template, or the
/// completion's `prompt` (a string, one string in a list, or token ids inside the vocabulary).
fn prompt_tokens(st: &AppState, v: &Value, chat: bool) -> Result<Vec<u32>, ApiError> {
    Ok(if chat {
        let msgs = v
            .get("messages")
            .and_then(|m| m.as_array())
            .ok_or_else(|| ApiError::bad("`messages` must be an array", Some("messages")))?;
        if msgs.is_empty() {
            return Err(ApiError::bad("`messages` is empty", Some("messages")));
        }
        // a template writes at least a token a message: a chat of more messages than the
        // context has positions cannot fit, and is refused before it is copied and rendered
        if msgs.len() > st.cfg.max_context {
            return Err(ApiError::context(format!(
                "This model's maximum context length is {} tokens; the chat has {} messages",
                st.cfg.max_context,
                msgs.len()
            )));
        }
        let mut out = Vec::with_capacity(msgs.len());
        for (i, m) in msgs.iter().enumerate() {
            let role = m.get("role").and_then(|r| r.as_str()).ok_or_else(|| {
                ApiError::bad(format!("messages[{i}].role is missing"), Some("messages"))
            })?;
            if !["system", "developer", "user", "assistant", "tool"].contains(&role) {
                return Err(ApiError::bad(
                    format!(
                        "messages[{i}].role {role:?} is not one of system, developer, user, \
                         assistant, tool"
                    ),
                    Some("messages"),
                ));
            }
            // (an assistant's may be left out or null: its calls, or its reasoning, are the
            // turn; anyone else's is required, as OpenAI's API has it)
            if role != "assistant" && m.get("content").is_none_or(Value::is_null) {
                return Err(ApiError::bad(
                    format!("messages[{i}].content is required on a {role} message"),
                    Some("messages"),
                ));
            }
            if role == "tool" && m.get("tool_call_id").is_none_or(Value::is_null) {
                return Err(ApiError::bad(
                    format!("messages[{i}].tool_call_id is required on a tool message"),
                    Some("messages"),
                ));
            }
            let content = match m.get("content") {
                None if role == "assistant" => Some(String::new()),
                c => c.and_then(text_of),
            }
            .ok_or_else(|| {
                ApiError::bad(
                    format!("messages[{i}].content must be a string or text parts"),
                    Some("messages"),
                )
            })?;
            // ids are strings (templates compare and print them as text)
            if !matches!(
                m.get("tool_call_id"),
                None | Some(Value::Null | Value::String(_))
            ) {
                return Err(ApiError::bad(
                    format!("messages[{i}].tool_call_id must be a string"),
                    Some("messages"),
                ));
            }
            let field = |k: &str| m.get(k).and_then(|x| x.as_str()).map(String::from);
            let tool_calls = match m.get("tool_calls") {
                None | Some(Value::Null) => None,
                Some(Value::Array(calls)) if role == "assistant" => {
                    for (j, c) in calls.iter().enumerate() {
                        if c["function"]["name"].as_str().is_none() {
                            let what = if c["function"]["name"].is_null() {
                                "is missing"
                            } else {
                                "must be a string"
                            };
                            return Err(ApiError::bad(
                                format!("messages[{i}].tool_calls[{j}].function.name {what}"),
                                Some("messages"),
                            ));
                        }
                        if !matches!(c.get("id"), None | Some(Value::Null | Value::String(_))) {
                            return Err(ApiError::bad(
                                format!("messages[{i}].tool_calls[{j}].id must be a string"),
                                Some("messages"),
                            ));
                        }
                    }
                    Some(Value::Array(calls.clone()))
                }
                Some(_) => {
                    return Err(ApiError::bad(
                        format!("messages[{i}].tool_calls must be a list, on an assistant message"),
                        Some("messages"),
                    ))
                }
            };
            out.push(ChatMessage {
                role: role.to_string(),
                content,
                tool_calls,
                tool_call_id: field("tool_call_id"),
                name: field("name"),
                reasoning_content: field("reasoning_content"),
            });
        }
        let mut kwargs = match v.get("chat_template_kwargs") {
            None | Some(Value::Null) => serde_json::Map::new(),
            Some(Value::Object(o)) => o.clone(),
            Some(_) => {
                return Err(ApiError::bad(
                    "`chat_template_kwargs` must be an object",
                    Some("chat_template_kwargs"),
                ))
            }
        };
        // OpenAI's `reasoning_effort` reaches the template as the variable of that name
        // (gpt-oss's template writes it into its system message)
        match v.get("reasoning_effort") {
            None | Some(Value::Null) => {}
            Some(Value::String(e))
                if ["minimal", "low", "medium", "high"].contains(&e.as_str()) =>
            {
                kwargs
                    .entry("reasoning_effort")
                    .or_insert_with(|| Value::String(e.clone()));
            }
            Some(x) => {
                return Err(ApiError::bad(
                    format!("`reasoning_effort` must be minimal, low, medium or high, got {x}"),
                    Some("reasoning_effort"),
                ))
            }
        }
        let tools = v
            .get("tools")
            .filter(|t| t.as_array().is_some_and(|a| !a.is_empty()));
        // as the render will see them (escapes undone), for encode_chat's look for markers
        for m in &mut out {
            if let Some(calls) = m.tool_calls.as_mut() {
                moelane_text::chat::call_arguments_as_objects(calls);
            }
        }
        encode_chat(st, &out, tools, &kwargs)?
    } else {
        match v.get("prompt") {
            Some(Value::String(s)) => encode_bounded(st, s)?,
            Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
                encode_bounded(st, a[0].as_str().unwrap_or_default())?
            }
            Some(Value::Array(a)) if a.iter().all(|x| x.is_u64()) => {
                // (checked as written: an id past u32 is named as the client sent it)
                let vocab = st.tokenizer.vocab_size() as u64;
                if let Some(bad) = a.iter().filter_map(|x| x.as_u64()).find(|&t| t >= vocab) {
                    return Err(ApiError::bad(
                        format!("token id {bad} is outside the vocabulary of {vocab} tokens"),
                        Some("prompt"),
                    ));
                }
                a.iter()
                    .filter_map(|x| x.as_u64())
                    .map(|x| x as u32)
                    .collect()
            }
            Some(Value::Array(_)) => {
                return Err(ApiError::bad(
                    "`prompt` must be a string, one string in a list, or a list of token ids",
                    Some("prompt"),
                ))
            }
            None | Some(Value::Null) => {
                return Err(ApiError::bad("`prompt` is required", Some("prompt")))
            }
            Some(_) => {
                return Err(ApiError::bad(
                    "`prompt` must be a string, one string in a list, or a list of token ids",
                    Some("prompt"),
                ))
            }
        }
    })
}

/// Parameters of the OpenAI API that are not built yet: a 400 naming them when set to
/// anything but their neutral value, rather than an answer that silently ignores them.
fn refuse_unbuilt(v: &Value) -> Result<(), ApiError> {
    let neutral = |k: &str, ok: &dyn Fn(&Value) -> bool| match v.get(k) {
        None | Some(Value::Null) => true,
        Some(x) => ok(x),
    };
    let not_yet = |k: &'static str, what: &str| -> Result<(), ApiError> {
        Err(ApiError::bad(
            format!("`{k}` is not supported by this server yet ({what}); leave it out"),
            Some(k),
        ))
    };
    if !neutral("best_of", &|x| x == 1) {
        return not_yet("best_of", "several candidates per answer");
    }
    if !neutral("suffix", &|x| x == "") {
        return not_yet("suffix", "insertion");
    }
    // vLLM's sampling extensions that are not built (top_k is)
    if !neutral("min_p", &|x| x.as_f64() == Some(0.0)) {
        return not_yet(
            "min_p",
            "a floor on a token's probability relative to the top one",
        );
    }
    if !neutral("repetition_penalty", &|x| x.as_f64() == Some(1.0)) {
        return not_yet(
            "repetition_penalty",
            "presence_penalty and frequency_penalty are built",
        );
    }
    // the API's functions before tools
    if !neutral("functions", &|x| x.as_array().is_some_and(|a| a.is_empty())) {
        return not_yet(
            "functions",
            "the legacy form of `tools`: send them as tools",
        );
    }
    if !neutral("function_call", &|x| x == "none") {
        return not_yet("function_call", "the legacy form of `tool_choice`");
    }
    // answers in other forms than text
    if !neutral("modalities", &|x| {
        x.as_array().is_some_and(|a| a.iter().all(|m| m == "text"))
    }) {
        return not_yet("modalities", "answers are text only: [\"text\"]");
    }
    if !neutral("audio", &|_| false) {
        return not_yet("audio", "answers are text only");
    }
    if !neutral("web_search_options", &|_| false) {
        return not_yet("web_search_options", "the model has no web search");
    }
    Ok(())
}

/// How a request's answer may call its tools.
#[derive(Clone, Debug, PartialEq)]
pub enum ToolMode {
    /// No tools, or `tool_choice: none`: the answer is text.
    Off,
    /// `auto`: the model chooses; calls it writes are parsed.
    Auto,
    /// `required`: one or more calls, nothing else (a grammar makes it so).
    Required,
    /// One call of this function (a grammar makes it so).
    Named(String),
}

/// Most tools one request may declare.
pub const MAX_TOOLS: usize = 128;

/// Most calls a forced answer (`tool_choice: required`) may make at once.
pub const MAX_PARALLEL_CALLS: usize = 8;

/// `tools` and `tool_choice`: each tool a function with a name (letters, digits, `_`, `-`;
/// 64 at most) and a JSON schema of its parameters; the mode the choice asks for.
/// The tools a request declares: each one's name and parameters' schema.
type Tools = Vec<(String, Value)>;

/// The request's tools, how the answer may call them, and whether any is `strict` (its calls
/// must be valid even where the model chooses to call).
fn tools_of(v: &Value, chat: bool) -> Result<(Tools, ToolMode, bool), ApiError> {
    let mut strict = false;
    let tools = match v.get("tools") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) if !chat && !a.is_empty() => {
            return Err(ApiError::bad(
                "`tools` belongs to /v1/chat/completions",
                Some("tools"),
            ))
        }
        Some(Value::Array(a)) if a.len() > MAX_TOOLS => {
            return Err(ApiError::bad(
                format!("{} tools, at most {MAX_TOOLS}", a.len()),
                Some("tools"),
            ))
        }
        Some(Value::Array(a)) => {
            let mut out: Vec<(String, Value)> = Vec::with_capacity(a.len());
            for (i, t) in a.iter().enumerate() {
                let bad = |m: String| ApiError::bad(format!("tools[{i}]: {m}"), Some("tools"));
                if t.get("type").and_then(|x| x.as_str()) != Some("function") {
                    return Err(bad("`type` must be \"function\"".into()));
                }
                let f = &t["function"];
                let name = f["name"].as_str().unwrap_or_default();
                if name.is_empty()
                    || name.len() > 64
                    || !name
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
                {
                    return Err(bad(format!(
                        "function.name {name:?} must be 1 to 64 letters, digits, _ or -"
                    )));
                }
                if out.iter().any(|(n, _)| n == name) {
                    return Err(bad(format!("function {name:?} is declared twice")));
                }
                strict |= match f.get("strict") {
                    None | Some(Value::Null) => false,
                    Some(Value::Bool(b)) => *b,
                    Some(x) => {
                        return Err(bad(format!("function.strict must be a boolean, got {x}")))
                    }
                };
                let params = match f.get("parameters") {
                    None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
                    // arguments are an object: a schema of anything else could not be met
                    Some(Value::Object(p)) if p.get("type").is_some_and(|t| t != "object") => {
                        return Err(bad(format!(
                            "function.parameters must describe an object (\"type\": \"object\"), got type {}",
                            p["type"]
                        )))
                    }
                    Some(p @ Value::Object(_)) => p.clone(),
                    Some(x) => {
                        return Err(bad(format!(
                            "function.parameters must be a JSON schema object, got {x}"
                        )))
                    }
                };
                out.push((name.to_string(), params));
            }
            out
        }
        Some(x) => {
            return Err(ApiError::bad(
                format!("`tools` must be a list, got {x}"),
                Some("tools"),
            ))
        }
    };
    let bad = |m: String| ApiError::bad(m, Some("tool_choice"));
    let mode = match v.get("tool_choice") {
        None | Some(Value::Null) if tools.is_empty() => ToolMode::Off,
        None | Some(Value::Null) => ToolMode::Auto,
        Some(Value::String(c)) => match c.as_str() {
            "none" => ToolMode::Off,
            "auto" if tools.is_empty() => ToolMode::Off,
            "auto" => ToolMode::Auto,
            "required" if tools.is_empty() => {
                return Err(bad("`tool_choice: required` needs `tools`".into()))
            }
            "required" => ToolMode::Required,
            other => {
                return Err(bad(format!(
                    "`tool_choice` must be none, auto, required or a function, got {other:?}"
                )))
            }
        },
        Some(c @ Value::Object(_)) => {
            let name = match (c.get("type").and_then(Value::as_str), c["function"]["name"].as_str()) {
                (Some("function"), Some(n)) => n,
                _ => {
                    return Err(bad(format!(
                        "`tool_choice` as an object must be {{\"type\": \"function\", \"function\": {{\"name\": NAME}}}}, got {c}"
                    )))
                }
            };
            if !tools.iter().any(|(n, _)| n == name) {
                return Err(bad(format!(
                    "`tool_choice` names function {name:?}, which is not among `tools`"
                )));
            }
            ToolMode::Named(name.to_string())
        }
        Some(x) => {
            return Err(bad(format!(
                "`tool_choice` must be a string or an object, got {x}"
            )))
        }
    };
    Ok((tools, mode, strict))
}

/// `response_format`: none or `text` (no grammar), `json_object` (any JSON object) or
/// `json_schema` (`{"json_schema": {"name", "schema", "strict"}}`: an answer valid against the
/// schema), compiled here so that a schema the grammar compiler refuses is a 400 naming why.
fn response_format(st: &AppState, v: &Value) -> Result<Option<String>, ApiError> {
    let bad = |m: String| ApiError::bad(m, Some("response_format"));
    let rf = match v.get("response_format") {
        None | Some(Value::Null) => return Ok(None),
        Some(rf) => rf,
    };
    let schema = match rf.get("type").and_then(|t| t.as_str()) {
        Some("text") => return Ok(None),
        Some("json_object") => json!({"type": "object"}),
        Some("json_schema") => {
            let js = rf.get("json_schema").ok_or_else(|| {
                bad("`response_format.json_schema` is required for type json_schema".into())
            })?;
            match js.get("schema") {
                Some(s @ Value::Object(_)) => s.clone(),
                // OpenAI's default when no schema is given: any JSON object
                None | Some(Value::Null) => json!({"type": "object"}),
                Some(Value::Bool(true)) => json!({}),
                Some(x) => {
                    return Err(bad(format!(
                        "`response_format.json_schema.schema` must be a JSON schema object, got {x}"
                    )))
                }
            }
        }
        _ => {
            return Err(bad(format!(
                "`response_format.type` must be text, json_object or json_schema, got {}",
                rf.get("type").unwrap_or(&Value::Null)
            )))
        }
    };
    let grammar = moelane_text::grammar::json_schema_grammar(&schema);
    let g = st.grammars.as_ref().ok_or_else(|| {
        bad(
            "this model's tokenizer has no end-of-sequence token to end a structured answer with"
                .into(),
        )
    })?;
    g.check(&grammar).map_err(|e| {
        bad(format!(
            "`response_format`: the schema cannot be used: {}",
            grammar_reason(&e)
        ))
    })?;
    Ok(Some(grammar))
}

/// What a client is told of a grammar compiler's refusal: its first line, at most 300
/// characters. The rest may print the grammar the server built around the client's schema
/// (the tools' calls in Lark), which is internal.
pub(crate) fn grammar_reason(e: &str) -> String {
    let line = e
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("");
    let mut out: String = line.chars().take(300).collect();
    if out.len() < line.len() {
        out.push_str("...");
    }
    if out == "NoExtensionBias" || out.is_empty() {
        // llguidance's word for a schema no answer can ever complete
        out = "no answer can satisfy it (a schema that refers to itself with no way to end)".into();
    }
    out
}

/// Most choices one request may ask (`n`).
pub const MAX_N: usize = 16;

fn penalty(v: &Value, k: &'static str) -> Result<f32, ApiError> {
    match num(v, k)? {
        None => Ok(0.0),
        Some(p) if (-2.0..=2.0).contains(&p) => Ok(p as f32),
        Some(p) => Err(ApiError::bad(
            format!("{k} {p} is outside [-2, 2]"),
            Some(k),
        )),
    }
}

/// `logit_bias`: `{"token id": bias}`, ids inside the vocabulary, biases in [-100, 100].
fn logit_bias(st: &AppState, v: &Value) -> Result<std::collections::HashMap<u32, f32>, ApiError> {
    let bad = |m: String| ApiError::bad(m, Some("logit_bias"));
    let o = match v.get("logit_bias") {
        None | Some(Value::Null) => return Ok(Default::default()),
        Some(Value::Object(o)) => o,
        Some(x) => return Err(bad(format!("`logit_bias` must be an object, got {x}"))),
    };
    if o.len() > 1024 {
        return Err(bad(format!(
            "`logit_bias` has {} entries, at most 1024",
            o.len()
        )));
    }
    o.iter()
        .map(|(k, b)| {
            let t = k
                .parse::<u32>()
                .ok()
                .filter(|&t| (t as usize) < st.tokenizer.vocab_size())
                .ok_or_else(|| {
                    bad(format!(
                        "logit_bias key {k:?} is not a token id below {}",
                        st.tokenizer.vocab_size()
                    ))
                })?;
            let b = b
                .as_f64()
                .filter(|b| (-100.0..=100.0).contains(b))
                .ok_or_else(|| {
                    bad(format!(
                        "logit_bias {k}: {b} is not a number in [-100, 100]"
                    ))
                })?;
            Ok((t, b as f32))
        })
        .collect()
}

/// Log-probabilities asked, as the most likely tokens to list (`Some(0)`: the picked token's
/// alone). Chat: `logprobs: true` and `top_logprobs` 0..=20; completions: `logprobs` 0..=5.
fn logprobs_asked(v: &Value, chat: bool) -> Result<Option<u32>, ApiError> {
    if chat {
        let on = flag(v, "logprobs", false)?;
        let top = match num(v, "top_logprobs")? {
            None => 0,
            Some(k) if k.fract() == 0.0 && (0.0..=20.0).contains(&k) => k as u32,
            Some(k) => {
                return Err(ApiError::bad(
                    format!("top_logprobs must be an integer in 0..=20, got {k}"),
                    Some("top_logprobs"),
                ))
            }
        };
        if top > 0 && !on {
            return Err(ApiError::bad(
                "top_logprobs needs logprobs: true",
                Some("top_logprobs"),
            ));
        }
        Ok(on.then_some(top))
    } else {
        // the legacy integer; a boolean as some clients send it (true: the picked token's)
        match v.get("logprobs") {
            Some(Value::Bool(false)) => return Ok(None),
            Some(Value::Bool(true)) => return Ok(Some(0)),
            _ => {}
        }
        match num(v, "logprobs")? {
            None => Ok(None),
            Some(k) if k.fract() == 0.0 && (0.0..=5.0).contains(&k) => Ok(Some(k as u32)),
            Some(k) => Err(ApiError::bad(
                format!("logprobs must be an integer in 0..=5, got {k}"),
                Some("logprobs"),
            )),
        }
    }
}

pub(crate) fn validate(st: &AppState, v: &Value, chat: bool) -> Result<ValidRequest, ApiError> {
    let model = v
        .get("model")
        .and_then(|m| m.as_str())
        .ok_or_else(|| match v.get("model") {
            None | Some(Value::Null) => ApiError::bad("`model` is required", Some("model")),
            Some(x) => ApiError::bad(format!("`model` must be a string, got {x}"), Some("model")),
        })?;
    if model != st.cfg.model_name {
        return Err(ApiError::UnknownModel(model.to_string()));
    }
    let n = match num(v, "n")? {
        None => 1,
        Some(n) if n.fract() == 0.0 && (1.0..=MAX_N as f64).contains(&n) => n as usize,
        Some(n) => {
            return Err(ApiError::bad(
                format!("n must be an integer in 1..={MAX_N}, got {n}"),
                Some("n"),
            ))
        }
    };
    refuse_unbuilt(v)?;
    let (presence_penalty, frequency_penalty) = (
        penalty(v, "presence_penalty")?,
        penalty(v, "frequency_penalty")?,
    );
    let logit_bias = logit_bias(st, v)?;
    let logprobs = logprobs_asked(v, chat)?;
    let echo = match v.get("echo") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Bool(true)) if !chat => true,
        Some(Value::Bool(true)) => {
            return Err(ApiError::bad(
                "`echo` belongs to /v1/completions",
                Some("echo"),
            ))
        }
        Some(x) => {
            return Err(ApiError::bad(
                format!("`echo` must be a boolean, got {x}"),
                Some("echo"),
            ))
        }
    };
    // the tools checked before the template renders them (a template may choke on a bad
    // entry, with a message about itself rather than the entry)
    let (tools, tool_mode, strict) = tools_of(v, chat)?;
    let prompt = prompt_tokens(st, v, chat)?;
    if prompt.is_empty() {
        return Err(ApiError::bad(
            "the prompt is empty",
            Some(if chat { "messages" } else { "prompt" }),
        ));
    }
    let ctx = st.cfg.max_context;
    if prompt.len() >= ctx {
        return Err(ApiError::context(format!(
            "This model's maximum context length is {ctx} tokens; the prompt has {} tokens",
            prompt.len()
        )));
    }
    let room = ctx - prompt.len();
    let asked = match num(v, "max_completion_tokens")?.or(num(v, "max_tokens")?) {
        // 0 with `echo`: the prompt alone (and its log-probabilities), as evaluators ask
        Some(x) if (x < 1.0 && !(echo && x == 0.0)) || x.fract() != 0.0 => {
            return Err(ApiError::bad(
                format!(
                    "max_tokens must be a positive integer{}, got {x}",
                    if chat { "" } else { " (0 only with echo)" }
                ),
                Some("max_tokens"),
            ))
        }
        Some(x) if x > room as f64 => {
            // an integer as written (past f64's 53 bits too), else the number in full
            let written = ["max_completion_tokens", "max_tokens"]
                .iter()
                .find_map(|k| v.get(*k).and_then(|n| n.as_u64()))
                .map_or_else(|| x.to_string(), |n| n.to_string());
            return Err(ApiError::context(format!("This model's maximum context length is {ctx} tokens; the prompt has {} tokens and max_tokens is {written}", prompt.len())));
        }
        Some(x) => Some(x as usize),
        None => None,
    };
    let max_tokens = match asked {
        Some(m) => m,
        None if chat => room,
        None => st.cfg.default_completion_tokens.min(room),
    };
    let temperature = num(v, "temperature")?.unwrap_or(st.cfg.default_temperature as f64);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::bad(
            format!("temperature {temperature} is outside [0, 2]"),
            Some("temperature"),
        ));
    }
    let top_p = num(v, "top_p")?.unwrap_or(st.cfg.default_top_p as f64);
    // the lane samples in f32: a value that rounds to 0 there is refused here, by name
    if !(top_p > 0.0 && top_p <= 1.0 && (top_p as f32) > 0.0) {
        return Err(ApiError::bad(
            format!("top_p {top_p} is outside (0, 1] (or rounds to 0 as a 32-bit float)"),
            Some("top_p"),
        ));
    }
    // vLLM's extension (and Anthropic's field): 0 and -1 are no top-k
    let top_k = match num(v, "top_k")? {
        None => st.cfg.default_top_k,
        Some(k) if k.fract() == 0.0 && k >= -1.0 => k.clamp(0.0, u32::MAX as f64) as u32,
        Some(k) => {
            return Err(ApiError::bad(
                format!("top_k must be an integer, -1 or more (0 and -1: no top-k), got {k}"),
                Some("top_k"),
            ))
        }
    };
    let seed = match v.get("seed") {
        None | Some(Value::Null) => None,
        // every integer a client may send, exactly (negative ones as their 64 bits)
        Some(x) => Some(x.as_u64().or(x.as_i64().map(|i| i as u64)).ok_or_else(|| {
            ApiError::bad(
                format!("seed must be an integer between -2^63 and 2^64 - 1, got {x}"),
                Some("seed"),
            )
        })?),
    };
    let seed = match seed {
        Some(s) => s,
        None => SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0),
    };
    let stop = match v.get("stop") {
        None | Some(Value::Null) => vec![],
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) if a.len() <= 4 && a.iter().all(|x| x.is_string()) => a
            .iter()
            .filter_map(|x| x.as_str().map(String::from))
            .collect(),
        Some(_) => {
            return Err(ApiError::bad(
                "`stop` must be a string or a list of up to 4 strings",
                Some("stop"),
            ))
        }
    };
    let stream = match v.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ApiError::bad("`stream` must be a boolean", Some("stream"))),
    };
    // a non-boolean include_usage is refused; stream_options on a call that does not stream
    // is ignored (OpenAI refuses it, but clients send it there and vLLM users met that)
    let include_usage = match v.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(o @ Value::Object(_)) => {
            let on = flag(o, "include_usage", false).map_err(|_| {
                ApiError::bad(
                    "`stream_options.include_usage` must be a boolean",
                    Some("stream_options"),
                )
            })?;
            on && stream
        }
        Some(x) => {
            return Err(ApiError::bad(
                format!("`stream_options` must be an object, got {x}"),
                Some("stream_options"),
            ))
        }
    };
    let echo = echo.then(|| st.tokenizer.decode_lossy(&prompt));
    if !tools.is_empty() && !st.template.takes_tools() {
        return Err(ApiError::bad(
            "this model's chat template does not render tools, so the model would never see \
             them; leave `tools` out",
            Some("tools"),
        ));
    }
    // `parallel_tool_calls` (default true): up to MAX_PARALLEL_CALLS calls, else one
    let parallel = flag(v, "parallel_tool_calls", true)?;
    // the tools' grammar as llguidance's JSON, checked to compile
    let compiled = |lark: String| -> Result<String, ApiError> {
        let grammar = moelane_text::grammar::lark_grammar(&lark);
        let g = st.grammars.as_ref().ok_or_else(|| {
            ApiError::bad(
                "this model's tokenizer has no end-of-sequence token to end a constrained answer with",
                Some("tool_choice"),
            )
        })?;
        g.check(&grammar).map_err(|e| {
            ApiError::bad(
                format!(
                    "the tools' parameter schemas cannot be used: {}",
                    grammar_reason(&e)
                ),
                Some("tools"),
            )
        })?;
        Ok(grammar)
    };
    // each constrained tool's parameters checked alone, as `response_format` is: a schema
    // that compiles inside the calls' grammar may still admit no answer (`{"$ref": "#"}`),
    // which would otherwise fail partway through the answer, or never, under `max_tokens`
    let constrained: Vec<&(String, Value)> = match &tool_mode {
        ToolMode::Named(n) => tools.iter().filter(|(t, _)| t == n).collect(),
        ToolMode::Required => tools.iter().collect(),
        ToolMode::Auto if strict && v.get("response_format").is_none_or(Value::is_null) => {
            tools.iter().collect()
        }
        _ => Vec::new(),
    };
    if let (Some(g), false) = (st.grammars.as_ref(), constrained.is_empty()) {
        for (name, params) in constrained {
            let grammar = moelane_text::grammar::json_schema_grammar(params);
            g.check(&grammar).map_err(|e| {
                ApiError::bad(
                    format!(
                        "`tools`: the parameters of tool `{}` cannot be used: {}",
                        name,
                        grammar_reason(&e)
                    ),
                    Some("tools"),
                )
            })?;
        }
    }
    // a forced call is a grammar of calls; `auto` with strict tools a grammar of free text
    // whose calls, once begun, are valid (where the family's calls begin with a text marker);
    // otherwise response_format's, if any
    let mut free_grammar = false;
    let grammar = match &tool_mode {
        ToolMode::Required | ToolMode::Named(_) => {
            let chosen: Vec<(String, Value)> = match &tool_mode {
                ToolMode::Named(n) => tools.iter().filter(|(t, _)| t == n).cloned().collect(),
                _ => tools.clone(),
            };
            let most = if parallel && tool_mode == ToolMode::Required {
                MAX_PARALLEL_CALLS
            } else {
                1
            };
            let special = |t: &str| {
                st.tokenizer
                    .token_to_id(t)
                    .filter(|&i| st.tokenizer.is_special(i))
            };
            Some(compiled(moelane_text::agent::calls_grammar(
                &st.template.markup,
                &chosen,
                most,
                &special,
            ))?)
        }
        ToolMode::Auto if strict && v.get("response_format").is_none_or(Value::is_null) => {
            let most = if parallel { MAX_PARALLEL_CALLS } else { 1 };
            match moelane_text::agent::auto_calls_grammar(&st.template.markup, &tools, most) {
                Some(lark) => {
                    free_grammar = true;
                    Some(compiled(lark)?)
                }
                None => None,
            }
        }
        _ => response_format(st, v)?,
    };
    // the prompt's tail: a template that opens the thinking block itself
    let in_reasoning = chat && st.template.thinks() && {
        let tail = st
            .tokenizer
            .decode_lossy(&prompt[prompt.len().saturating_sub(8)..]);
        st.template.markup.style != moelane_text::agent::Style::Harmony
            && tail.trim_end().ends_with(st.template.markup.think_open)
    };
    Ok(ValidRequest {
        tools,
        tool_mode,
        free_grammar,
        think: chat && st.template.thinks(),
        in_reasoning,
        markup: st.template.markup.clone(),
        client: String::new(),
        prompt_logprobs: echo.is_some() && logprobs.is_some(),
        grammar,
        n,
        presence_penalty,
        frequency_penalty,
        logit_bias,
        logprobs,
        echo,
        chat,
        prompt,
        max_tokens,
        temperature: temperature as f32,
        top_p: top_p as f32,
        top_k,
        seed,
        stop,
        stream,
        include_usage,
    })
}

pub(crate) fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// How a lane error before the first token is handled: `None`, not retried (the request is
/// at fault); `Some(true)`, retried on another lane and counted against this lane's breaker;
/// `Some(false)`, retried without blame (the lane is busy or mid-swap).
fn retry_class(c: Category) -> Option<bool> {
    match c {
        Category::Unavailable | Category::Timeout | Category::Internal => Some(true),
        Category::Overloaded | Category::EpochMismatch | Category::NotResident => Some(false),
        Category::BadRequest | Category::ContextOverflow => None,
    }
}

/// Tells the breaker how a request went on `lane` (without waiting for it).
async fn report(st: &AppState, lane: &str, ok: bool) {
    let _ = st
        .registry
        .tell(Report {
            lane: lane.to_string(),
            ok,
        })
        .await;
}

/// One request's tries: the lanes it went to, and whether it blamed one (a request blames
/// one lane at most: one that fails everywhere, by its own fault, must not eject every lane
/// it was tried on).
#[derive(Default)]
pub(crate) struct Tries {
    lanes: Vec<String>,
    blamed: bool,
}

impl Tries {
    /// Whether another lane may be tried: attempts left, and the first or within `deadline`.
    pub(crate) fn more(&self, st: &AppState, deadline: Instant) -> bool {
        self.lanes.len() < st.cfg.max_attempts.max(1)
            && (self.lanes.is_empty() || Instant::now() < deadline)
    }

    /// Counts a failure of category `c` against `lane`'s breaker, when it is the lane's
    /// fault and this request blamed none yet.
    pub(crate) async fn blame(&mut self, st: &AppState, lane: &str, c: Category) {
        if retry_class(c) == Some(true) && !self.blamed {
            self.blamed = true;
            report(st, lane, false).await;
        }
    }
}

/// How long a streamed request waits for its first event (its lane opened, the first token
/// or the prompt's log-probabilities in) before its response's headers are sent anyway: past
/// it the client sees a live stream (a [`WAITING`] comment now, keep-alive comments every 15 s)
/// while the request waits on a full lane, and a failure is an error event, not a status.
pub(crate) const HEAD_START: std::time::Duration = std::time::Duration::from_secs(5);

/// The SSE comment a stream starts with when its first event is later than [`HEAD_START`].
pub(crate) const WAITING: &str = "waiting for a place on a lane";

/// A lane's error as the client sees it: naming the lane where the lane failed, not where
/// the request was at fault or the lanes were full (the client needs no internal address to
/// fix its request or to wait: a 429 says when to come back in its Retry-After).
pub(crate) fn lane_err(lane: &str, e: &LaneError) -> ApiError {
    match e.category {
        Category::BadRequest | Category::ContextOverflow | Category::Overloaded => {
            ApiError::from_lane(e.category, e.message.clone())
        }
        _ => ApiError::from_lane(e.category, format!("lane {lane}: {}", e.message)),
    }
}

fn no_lane() -> ApiError {
    ApiError::Unavailable(
        "no lane is available (none healthy, all draining, or none registered)".into(),
    )
}

pub(crate) fn stream_ended() -> LaneError {
    LaneError {
        category: Category::Unavailable,
        message: "the lane's stream ended before the request finished (the lane stopped or \
                  the connection to it was lost)"
            .into(),
    }
}

/// Sends `greq` to a lane and waits for its first event (a token or a finish), retrying on
/// other lanes while the failure is the lane's or its load's, at most `max_attempts` lanes,
/// none started past `deadline`. Returns the lane's guard and its events, the first one
/// included.
pub(crate) async fn open(
    st: &AppState,
    greq: &GenerateRequest,
    deadline: Instant,
    tries: &mut Tries,
) -> Result<(InFlight, EventStream), ApiError> {
    let mut last: Option<ApiError> = None;
    while tries.more(st, deadline) {
        let picked = st
            .registry
            .ask(Pick {
                exclude: tries.lanes.clone(),
            })
            .await
            .map_err(|e| ApiError::Internal(format!("registry: {e}")))?;
        let Some(inflight) = picked else {
            break;
        };
        let name = inflight.lane.name().to_string();
        tries.lanes.push(name.clone());
        let attempt = async {
            let mut s = inflight.lane.generate(greq.clone()).await?;
            match s.next().await {
                Some(Ok(ev)) => Ok((s, ev)),
                Some(Err(e)) => Err(e),
                None => Err(stream_ended()),
            }
        };
        match attempt.await {
            Ok((s, first)) => {
                report(st, &name, true).await;
                let events = futures::stream::once(async move { Ok(first) })
                    .chain(s)
                    .boxed();
                return Ok((inflight, events));
            }
            Err(e) => {
                if retry_class(e.category).is_none() {
                    report(st, &name, true).await;
                    return Err(ApiError::from_lane(e.category, e.message));
                }
                tries.blame(st, &name, e.category).await;
                metrics::counter!(n::REQUEST_RETRIES, "reason" => e.category.as_str()).increment(1);
                tracing::warn!(lane = %name, error = %e.message, "request failed before its first token; trying another lane");
                last = Some(lane_err(&name, &e));
            }
        }
    }
    Err(last.unwrap_or_else(no_lane))
}

async fn completions(State(st): State<Arc<AppState>>, req: Request) -> Response {
    handle(st, req, false)
        .instrument(request_span(false))
        .await
        .unwrap_or_else(|e| e.for_field("prompt").into_response())
}

async fn chat_completions(State(st): State<Arc<AppState>>, req: Request) -> Response {
    handle(st, req, true)
        .instrument(request_span(true))
        .await
        .unwrap_or_else(|e| e.into_response())
}

struct Out {
    id: String,
    created: u64,
}

/// A generated token's log-probabilities, as the lane sent them.
#[derive(Clone, Debug)]
struct Lp {
    token: u32,
    /// None: the prompt's first token (nothing before it to predict it from).
    logprob: Option<f32>,
    top: Vec<(u32, f32)>,
}

impl Lp {
    fn of(ev: &moelane_proto::lane::GenerateEvent) -> Option<Lp> {
        Some(Lp {
            token: ev.token?,
            logprob: Some(ev.logprob?),
            top: ev
                .top_logprobs
                .iter()
                .map(|t| (t.token, t.logprob))
                .collect(),
        })
    }

    /// The prompt's first token (nothing before it: no log-probability), where the
    /// request asks for the prompt's.
    fn lead(vr: &ValidRequest) -> Vec<Lp> {
        let first = vr.prompt.first().filter(|_| vr.prompt_logprobs);
        first
            .map(|&token| Lp {
                token,
                logprob: None,
                top: Vec::new(),
            })
            .into_iter()
            .collect()
    }

    /// The prompt log-probabilities an event carries (the lane sends them a chunk at a
    /// time, before the first token).
    fn prompt_part(ev: &moelane_proto::lane::GenerateEvent) -> impl Iterator<Item = Lp> + '_ {
        ev.prompt_logprobs.iter().map(|p| Lp {
            token: p.token,
            logprob: Some(p.logprob),
            top: p
                .top_logprobs
                .iter()
                .map(|t| (t.token, t.logprob))
                .collect(),
        })
    }
}

/// A token as completions' `logprobs` name it: its text, or `bytes:\xNN...` where its bytes
/// are not UTF-8 by themselves (as OpenAI writes them), so that two such tokens differ.
fn token_name(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(t) => t.to_string(),
        Err(_) => {
            let mut s = String::from("bytes:");
            for b in bytes {
                s.push_str(&format!("\\x{b:02x}"));
            }
            s
        }
    }
}

/// Completions' `logprobs` of the prompt (offsets from 0) followed by the answer's (offsets
/// from the echoed text's end), as a stream sends them.
fn join_logprobs(a: Value, b: Value) -> Value {
    let mut out = a;
    for k in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        if let (Some(x), Some(y)) = (out[k].as_array_mut(), b[k].as_array()) {
            x.extend(y.iter().cloned());
        }
    }
    out
}

/// Where each token of a completion starts in its text, in characters of that text as it is
/// decoded (`from_utf8_lossy`: an invalid run of bytes one U+FFFD), fed a token at a time:
/// a token that starts inside a character an earlier token began is at that character; one
/// after bytes that never became a character is after their U+FFFD. The same whether the
/// text is streamed or whole.
pub(crate) struct Offsets {
    /// Characters decoded for good before `tail`.
    done: usize,
    /// The bytes of a character not whole yet (at most 3).
    tail: Vec<u8>,
}

impl Offsets {
    /// Offsets counted from `base` characters (the echoed prompt's, before an answer).
    pub(crate) fn from(base: usize) -> Offsets {
        Offsets {
            done: base,
            tail: Vec::new(),
        }
    }

    /// The offset of the next token, whose text is `bytes`.
    pub(crate) fn next(&mut self, bytes: &[u8]) -> usize {
        let start = self.tail.len();
        let mut w = std::mem::take(&mut self.tail);
        w.extend_from_slice(bytes);
        let at = self.done + char_at(&w, start);
        let cut = w.len() - incomplete_tail(&w);
        self.done += String::from_utf8_lossy(&w[..cut]).chars().count();
        self.tail = w.split_off(cut);
        at
    }
}

/// The index, among the characters `b` decodes to (an invalid run, or an unfinished
/// character at the end, one character), of the one that holds byte `at` (the count of all
/// of them at the end).
fn char_at(b: &[u8], at: usize) -> usize {
    let (mut pos, mut idx) = (0, 0);
    for chunk in b.utf8_chunks() {
        for c in chunk.valid().chars() {
            pos += c.len_utf8();
            if at < pos {
                return idx;
            }
            idx += 1;
        }
        if !chunk.invalid().is_empty() {
            pos += chunk.invalid().len();
            if at < pos {
                return idx;
            }
            idx += 1;
        }
    }
    idx
}

/// How many bytes at the end of `b` begin a character that more bytes could still finish.
fn incomplete_tail(b: &[u8]) -> usize {
    let mut rest = b;
    loop {
        match std::str::from_utf8(rest) {
            Ok(_) => return 0,
            Err(e) => match e.error_len() {
                None => return rest.len() - e.valid_up_to(),
                Some(n) => rest = &rest[e.valid_up_to() + n..],
            },
        }
    }
}

/// `lps` in the shape of the endpoint: chat's `{"content": [{token, logprob, bytes,
/// top_logprobs}]}`, or completions' `{tokens, token_logprobs, top_logprobs, text_offset}`
/// (each token's offset from `offsets`, fed the token's text as `text_of` gives it).
fn render_logprobs(
    st: &AppState,
    chat: bool,
    lps: &[Lp],
    offsets: &mut Offsets,
    text_of: &dyn Fn(u32) -> Vec<u8>,
) -> Value {
    let text = |t: u32| String::from_utf8_lossy(st.tokenizer.token_bytes(t)).into_owned();
    if chat {
        let entry = |t: u32, lp: f32| json!({"token": text(t), "logprob": lp, "bytes": st.tokenizer.token_bytes(t)});
        let content: Vec<Value> = lps
            .iter()
            .map(|l| {
                let mut e = entry(l.token, 0.0);
                e["logprob"] = json!(l.logprob);
                e["top_logprobs"] =
                    Value::Array(l.top.iter().map(|&(t, lp)| entry(t, lp)).collect());
                e
            })
            .collect();
        json!({"content": content})
    } else {
        let offsets: Vec<usize> = lps
            .iter()
            .map(|l| offsets.next(&text_of(l.token)))
            .collect();
        let name = |t: u32| token_name(st.tokenizer.token_bytes(t));
        json!({
            "tokens": lps.iter().map(|l| name(l.token)).collect::<Vec<_>>(),
            "token_logprobs": lps.iter().map(|l| l.logprob).collect::<Vec<_>>(),
            "top_logprobs": lps.iter().map(|l| match l.logprob {
                None => Value::Null,
                Some(_) => Value::Object(l.top.iter().map(|&(t, lp)| (name(t), json!(lp))).collect()),
            }).collect::<Vec<_>>(),
            "text_offset": offsets,
        })
    }
}

impl Out {
    #[allow(clippy::too_many_arguments)]
    fn chunk(
        &self,
        st: &AppState,
        chat: bool,
        index: usize,
        text: Option<&str>,
        finish: Option<&str>,
        first: bool,
        logprobs: Value,
    ) -> Value {
        if chat {
            let mut delta = json!({});
            if first {
                delta["role"] = json!("assistant");
                delta["content"] = json!("");
            }
            if let Some(t) = text {
                delta["content"] = json!(t);
            }
            json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": st.cfg.model_name,
                   "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]})
        } else {
            json!({"id": self.id, "object": "text_completion", "created": self.created, "model": st.cfg.model_name,
                   "choices": [{"index": index, "text": text.unwrap_or(""), "logprobs": logprobs, "finish_reason": finish}]})
        }
    }
}

fn usage(p: usize, c: usize) -> Value {
    json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c})
}

/// Sends `ev` to a streaming client unless it left, the drain's grace period ended first (a
/// client that stops reading must not hold the drain), or the client took nothing for the
/// stall bound (`--stream-stall-timeout`: one that stops reading must not hold its slot and
/// generation either); after the abort, only what fits in the channel goes. False: the
/// stream is over, the caller cancels the generation.
pub(crate) async fn put(
    tx: &tokio::sync::mpsc::Sender<SseEvent>,
    ev: SseEvent,
    sd: &Shutdown,
) -> bool {
    if sd.is_aborted() {
        return tx.try_send(ev).is_ok();
    }
    tokio::select! {
        r = tokio::time::timeout(sd.stall, tx.send(ev)) => match r {
            Ok(sent) => sent.is_ok(),
            Err(_) => {
                tracing::warn!(
                    stall_s = sd.stall.as_secs_f64(),
                    "a streaming client read nothing for the stall bound: its answer is cut"
                );
                false
            }
        },
        _ = sd.aborted() => false,
    }
}

pub(crate) fn shutting_down() -> ApiError {
    ApiError::Unavailable(
        "the gateway is shutting down and its grace period is over; the request was cut".into(),
    )
}

/// The finish reason a client sees for a lane's, or the error of a request the lane
/// cancelled (the gateway cancels by dropping a stream and never sees this: a `cancelled`
/// comes from someone's Cancel call, and the answer was cut).
pub(crate) fn finish_of(lane: &str) -> Result<String, LaneError> {
    if lane == "cancelled" {
        Err(LaneError {
            category: Category::Unavailable,
            message: "the request was cancelled on the lane (a Cancel call) before it finished"
                .into(),
        })
    } else {
        Ok(lane.to_string())
    }
}

/// One choice of a whole answer.
pub(crate) struct Choice {
    pub(crate) text: String,
    pub(crate) completion: usize,
    pub(crate) finish: String,
    /// The stop string that ended it, if one did.
    pub(crate) stop_hit: Option<String>,
    lps: Vec<Lp>,
    /// The prompt's log-probabilities, when asked (echo with logprobs).
    prompt_lps: Vec<Lp>,
}

/// A tool call as the OpenAI API gives it, with a fresh id.
pub(crate) fn tool_call(st: &AppState, index: Option<usize>, name: &str, arguments: &str) -> Value {
    let mut c = json!({"id": st.template.markup.call_id(random_id(st)), "type": "function",
                       "function": {"name": name, "arguments": arguments}});
    if let Some(i) = index {
        c["index"] = json!(i);
    }
    c
}

/// A chat answer's message: its text split into content, reasoning and tool calls when the
/// request asks for that (`finish` becomes `tool_calls` when the answer ended with calls).
/// (`stopped`: a stop string ended the answer, which then stays `stop` where it cut a call:
/// that call is not whole)
fn chat_message(
    st: &AppState,
    vr: &ValidRequest,
    text: &str,
    finish: &mut String,
    stopped: bool,
) -> Value {
    use moelane_text::agent::Part;
    if !vr.splits() {
        return json!({"role": "assistant", "content": text});
    }
    let (parts, cut) = vr.split_answer(text);
    let (mut content, mut reasoning, mut calls) = (String::new(), String::new(), Vec::new());
    for p in parts {
        match p {
            Part::Content(t) => content.push_str(&t),
            Part::Reasoning(t) => reasoning.push_str(&t),
            Part::Call { name, arguments } => calls.push(tool_call(st, None, &name, &arguments)),
            // merged into calls
            Part::CallStart { .. } | Part::CallArgs(_) | Part::CallEnd => {}
        }
    }
    let mut m = json!({"role": "assistant", "content": content});
    if !reasoning.is_empty() {
        m["reasoning_content"] = json!(reasoning);
    }
    if !calls.is_empty() {
        if content.trim().is_empty() {
            m["content"] = Value::Null;
        }
        m["tool_calls"] = Value::Array(calls);
        if finish == "stop" && !(stopped && cut) {
            *finish = "tool_calls".into();
        }
    }
    m
}

/// Counts a stream that ended in an error after its 200 (its status said success).
pub(crate) fn count_cut(err: &ApiError) {
    let reason = match err {
        ApiError::Unavailable(_) => "unavailable",
        ApiError::Overloaded(_) => "overloaded",
        ApiError::Internal(_) => "internal",
        _ => "other",
    };
    metrics::counter!(n::STREAMS_CUT, "reason" => reason).increment(1);
}

/// The lane request of a validated request, under id `id`.
pub(crate) fn generate_request(vr: &ValidRequest, id: &str) -> GenerateRequest {
    GenerateRequest {
        request_id: id.to_string(),
        prompt: vr.prompt.clone(),
        // `max_tokens` 0 (the prompt alone, with echo): the lane makes one token, not shown
        max_tokens: vr.max_tokens.max(1) as u32,
        temperature: vr.temperature,
        top_p: vr.top_p,
        top_k: vr.top_k,
        seed: vr.seed,
        stop_token_ids: vec![],
        // the prompt's log-probabilities with a one-token answer (how evaluators score a
        // continuation, dropping the answer's entry): the answer is listed even where it is
        // the end of sequence
        ignore_eos: vr.prompt_logprobs && vr.max_tokens <= 1,
        presence_penalty: vr.presence_penalty,
        frequency_penalty: vr.frequency_penalty,
        logit_bias: vr.logit_bias.clone(),
        logprobs: vr.logprobs.is_some(),
        top_logprobs: vr.logprobs.unwrap_or(0),
        grammar: vr.grammar.clone().unwrap_or_default(),
        client: vr.client.clone(),
        prompt_logprobs: vr.prompt_logprobs,
    }
}

/// The lane request of choice `i`: its own id and seed (`n` choices are `n` generations).
fn choice_request(greq: &GenerateRequest, i: usize) -> GenerateRequest {
    let mut g = greq.clone();
    if i > 0 {
        g.request_id = format!("{}-{i}", greq.request_id);
        g.seed = greq.seed.wrapping_add(i as u64);
    }
    g
}

/// One choice of a non-streamed answer: the lane's tokens detokenised into one text (stop
/// strings cut it, which cancels the request on the lane). Nothing reaches the client before
/// the end, so a lane lost midway is retried from the start on another (within the attempts
/// and the deadline); a request that cannot finish gets an error, never a finish reason it
/// did not reach.
pub(crate) async fn whole_choice(
    st: &AppState,
    vr: &ValidRequest,
    greq: &GenerateRequest,
    deadline: Instant,
    chat: bool,
) -> Result<Choice, ApiError> {
    let timing = Timing::new(chat);
    let r = choice_whole(st, vr, greq, deadline, &timing).await;
    match &r {
        Ok(c) => timing.done(vr.prompt.len(), c.completion, &c.finish),
        Err(_) => timing.done(vr.prompt.len(), 0, "error"),
    }
    r
}

/// One choice of `request`'s, whole (its timing's end is the request's to record).
async fn choice_whole(
    st: &AppState,
    vr: &ValidRequest,
    greq: &GenerateRequest,
    deadline: Instant,
    request: &Timing,
) -> Result<Choice, ApiError> {
    let mut tries = Tries::default();
    loop {
        let mut timing = request.choice();
        let (inflight, mut events) = open(st, greq, deadline, &mut tries).await?;
        let lane = inflight.lane.name().to_string();
        let mut det = Detokenizer::new(vr.stop.clone());
        let mut text = vr.echo.clone().unwrap_or_default();
        let mut lps = Vec::new();
        let mut prompt_lps = Lp::lead(vr);
        let mut completion = 0usize;
        let mut finish: Option<String> = None;
        let mut failed: Option<LaneError> = None;
        while let Some(ev) = events.next().await {
            let ev = match ev {
                Ok(ev) => ev,
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            };
            if vr.prompt_logprobs {
                prompt_lps.extend(Lp::prompt_part(&ev));
            }
            if vr.max_tokens == 0 && (ev.token.is_some() || !ev.finish_reason.is_empty()) {
                // the prompt alone: the lane's one token is not part of the answer
                finish = Some("length".into());
                break;
            }
            if let Some(t) = ev.token {
                timing.token();
                completion += 1;
                lps.extend(Lp::of(&ev));
                let bytes = vr.token_text(st, t);
                if !bytes.is_empty() {
                    text.push_str(&det.push(bytes));
                }
                if det.stopped() {
                    finish = Some("stop".into());
                    break; // dropping the stream cancels the request on the lane
                }
            }
            if !ev.finish_reason.is_empty() {
                match finish_of(&ev.finish_reason) {
                    Ok(f) => finish = Some(f),
                    Err(e) => failed = Some(e),
                }
                break;
            }
        }
        drop(events);
        drop(inflight);
        if let Some(f) = finish {
            text.push_str(&det.finish());
            return Ok(Choice {
                text,
                completion,
                finish: f,
                stop_hit: det.stop_hit().map(String::from),
                lps,
                prompt_lps,
            });
        }
        let e = failed.unwrap_or_else(stream_ended);
        tries.blame(st, &lane, e.category).await;
        if retry_class(e.category).is_none() || !tries.more(st, deadline) {
            metrics::counter!(n::STREAMS_CUT, "reason" => e.category.as_str()).increment(1);
            return Err(lane_err(&lane, &e));
        }
        metrics::counter!(n::REQUEST_RETRIES, "reason" => e.category.as_str()).increment(1);
        tracing::warn!(lane = %lane, error = %e.message, "lane lost before the whole answer was sent; starting over on another lane");
    }
}

/// A non-streamed answer: `n` choices generated side by side, in the completion or chat
/// completion shape; usage counts the prompt once and every choice's tokens.
#[allow(clippy::too_many_arguments)]
async fn whole_response(
    st: &AppState,
    vr: &ValidRequest,
    greq: &GenerateRequest,
    deadline: Instant,
    out: &Out,
    chat: bool,
    timing: &Timing,
) -> Result<Response, ApiError> {
    let choices = futures::future::try_join_all((0..vr.n).map(|i| async move {
        choice_whole(st, vr, &choice_request(greq, i), deadline, timing).await
    }))
    .await;
    let choices = match choices {
        Ok(c) => c,
        Err(e) => {
            timing.done(vr.prompt.len(), 0, "error");
            return Err(e);
        }
    };
    let completion: usize = choices.iter().map(|c| c.completion).sum();
    timing.done(vr.prompt.len(), completion, &choices[0].finish);
    let echoed = vr.echo.as_ref().map_or(0, |e| e.chars().count());
    let body: Vec<Value> = choices
        .into_iter()
        .enumerate()
        .map(|(i, mut c)| {
            let lps = if vr.logprobs.is_some() {
                let answer = render_logprobs(st, chat, &c.lps, &mut Offsets::from(echoed), &|t| {
                    vr.token_text(st, t).to_vec()
                });
                if vr.prompt_logprobs {
                    // the prompt's own log-probabilities start at its first character
                    let prompt =
                        render_logprobs(st, false, &c.prompt_lps, &mut Offsets::from(0), &|t| {
                            st.tokenizer.token_bytes(t).to_vec()
                        });
                    join_logprobs(prompt, answer)
                } else {
                    answer
                }
            } else {
                Value::Null
            };
            if chat {
                let stopped = c.stop_hit.is_some();
                let message = chat_message(st, vr, &c.text, &mut c.finish, stopped);
                json!({"index": i, "message": message, "logprobs": lps, "finish_reason": c.finish})
            } else {
                json!({"index": i, "text": c.text, "logprobs": lps, "finish_reason": c.finish})
            }
        })
        .collect();
    let body = json!({"id": out.id, "object": if chat { "chat.completion" } else { "text_completion" }, "created": out.created,
                      "model": st.cfg.model_name, "choices": body, "usage": usage(vr.prompt.len(), completion)});
    Ok(Json(body).into_response())
}

/// A streamed choice's text as chunks: as it comes, or split into content, reasoning and
/// tool-call deltas (a call's first delta has its index among the choice's calls, its id and
/// name; its arguments follow in pieces under the same index).
struct StreamSplit {
    splitter: Option<moelane_text::agent::Splitter>,
    calls: usize,
    chat: bool,
    /// The answer ended inside a call.
    cut: bool,
}

impl StreamSplit {
    fn chunks(
        &mut self,
        st: &AppState,
        out: &Out,
        index: usize,
        text: &str,
        end: bool,
    ) -> Vec<Value> {
        use moelane_text::agent::Part;
        let Some(sp) = &mut self.splitter else {
            return if text.is_empty() {
                Vec::new()
            } else {
                vec![out.chunk(st, self.chat, index, Some(text), None, false, Value::Null)]
            };
        };
        let mut parts = sp.push(text);
        if end {
            self.cut = sp.in_call();
            parts.extend(sp.finish());
        }
        moelane_text::agent::as_streamed(parts)
            .filter_map(|p| {
                let delta = match p {
                    Part::Content(t) => json!({"content": t}),
                    Part::Reasoning(t) => json!({"reasoning_content": t}),
                    Part::CallStart { name } => {
                        self.calls += 1;
                        json!({"tool_calls": [tool_call(st, Some(self.calls - 1), &name, "")]})
                    }
                    Part::CallArgs(a) => {
                        json!({"tool_calls": [{"index": self.calls.saturating_sub(1), "function": {"arguments": a}}]})
                    }
                    Part::CallEnd | Part::Call { .. } => return None,
                };
                Some(json!({"id": out.id, "object": "chat.completion.chunk", "created": out.created, "model": st.cfg.model_name,
                       "choices": [{"index": index, "delta": delta, "logprobs": null, "finish_reason": null}]}))
            })
            .collect()
    }
}

/// How one streamed choice ended.
struct Streamed {
    completion: usize,
    finish: Option<String>,
    failed: Option<ApiError>,
    /// The client left: nothing more is sent.
    left: bool,
}

/// Relays one choice's lane events as SSE chunks of `index` (the first with the role, then
/// text pieces with their tokens' log-probabilities, then the finish).
#[allow(clippy::too_many_arguments)]
async fn relay_choice(
    st: &AppState,
    vr: &ValidRequest,
    out: &Out,
    index: usize,
    lane: &str,
    mut events: EventStream,
    tx: &tokio::sync::mpsc::Sender<SseEvent>,
    mut tries: Tries,
    chat: bool,
    request: &Timing,
) -> Streamed {
    let mut timing = request.choice();
    let mut det = Detokenizer::new(vr.stop.clone());
    let mut r = Streamed {
        completion: 0,
        finish: None,
        failed: None,
        left: false,
    };
    let send = |v: Value| SseEvent::default().data(v.to_string());
    let mut sent_chars = 0usize;
    let first = match (chat, &vr.echo) {
        (true, _) => Some(out.chunk(st, true, index, None, None, true, Value::Null)),
        // with the prompt's log-probabilities, once they come
        (false, Some(_)) if vr.prompt_logprobs => None,
        (false, Some(e)) => {
            sent_chars = e.chars().count();
            Some(out.chunk(st, false, index, Some(e), None, false, Value::Null))
        }
        (false, None) => None,
    };
    if let Some(c) = first {
        if !put(tx, send(c), &st.shutdown).await {
            r.left = true;
            return r;
        }
    }
    let mut lps: Vec<Lp> = Vec::new();
    // the answer's offsets: from the echoed prompt's end (set when it is sent)
    let mut offsets = Offsets::from(sent_chars);
    let text_of = |t: u32| vr.token_text(st, t).to_vec();
    let mut pending_echo = (!chat && vr.prompt_logprobs).then(|| Lp::lead(vr));
    let mut split = StreamSplit {
        splitter: vr.splits().then(|| vr.splitter()),
        calls: 0,
        chat,
        cut: false,
    };
    let mut aborted = std::pin::pin!(st.shutdown.aborted());
    loop {
        let next = tokio::select! {
            ev = events.next() => ev,
            _ = &mut aborted => {
                r.failed = Some(shutting_down());
                break;
            }
            // a client that leaves while no token comes (its sequence waits, preempted or
            // queued): the lane request is dropped, which cancels it, and its places freed
            _ = tx.closed() => {
                r.left = true;
                return r;
            }
        };
        let ev = match next {
            Some(Ok(ev)) => ev,
            Some(Err(e)) => {
                tries.blame(st, lane, e.category).await;
                r.failed = Some(lane_err(lane, &e));
                break;
            }
            None => {
                let e = stream_ended();
                tries.blame(st, lane, e.category).await;
                r.failed = Some(lane_err(lane, &e));
                break;
            }
        };
        // the echo goes once the prompt's log-probabilities are all in (or the answer starts)
        if let Some(p) = pending_echo.as_mut() {
            p.extend(Lp::prompt_part(&ev));
            if p.len() >= vr.prompt.len() || ev.token.is_some() || !ev.finish_reason.is_empty() {
                let echo = vr.echo.clone().unwrap_or_default();
                sent_chars = echo.chars().count();
                let mut c = out.chunk(st, false, index, Some(&echo), None, false, Value::Null);
                c["choices"][0]["logprobs"] =
                    render_logprobs(st, false, p, &mut Offsets::from(0), &|t| {
                        st.tokenizer.token_bytes(t).to_vec()
                    });
                offsets = Offsets::from(sent_chars);
                pending_echo = None;
                if !put(tx, send(c), &st.shutdown).await {
                    r.left = true;
                    return r;
                }
            }
        }
        if vr.max_tokens == 0 && (ev.token.is_some() || !ev.finish_reason.is_empty()) {
            // the prompt alone: the lane's one token is not part of the answer
            r.finish = Some("length".into());
            break;
        }
        if let Some(t) = ev.token {
            timing.token();
            r.completion += 1;
            lps.extend(Lp::of(&ev));
            let piece = det.push(vr.token_text(st, t));
            let mut chunks = split.chunks(st, out, index, &piece, false);
            if let Some(first) = chunks.first_mut() {
                if vr.logprobs.is_some() {
                    first["choices"][0]["logprobs"] =
                        render_logprobs(st, chat, &lps, &mut offsets, &text_of);
                }
                lps.clear();
            }
            let mut gone = false;
            for c in chunks {
                if !put(tx, send(c), &st.shutdown).await {
                    gone = true;
                    break;
                }
            }
            if gone {
                if st.shutdown.is_aborted() {
                    r.failed = Some(shutting_down());
                    break;
                }
                r.left = true;
                return r;
            }
            if det.stopped() {
                r.finish = Some("stop".into());
                break;
            }
        }
        if !ev.finish_reason.is_empty() {
            match finish_of(&ev.finish_reason) {
                Ok(f) => r.finish = Some(f),
                Err(e) => r.failed = Some(lane_err(lane, &e)),
            }
            break;
        }
    }
    drop(events);
    if r.failed.is_some() {
        return r;
    }
    // what the detokeniser (and the splitter) held back, with the log-probabilities of
    // tokens not yet sent
    let tail = det.finish();
    let mut chunks = split.chunks(st, out, index, &tail, true);
    if chunks.is_empty() && !lps.is_empty() {
        chunks.push(out.chunk(st, chat, index, Some(""), None, false, Value::Null));
    }
    if let Some(first) = chunks.first_mut() {
        if vr.logprobs.is_some() {
            first["choices"][0]["logprobs"] =
                render_logprobs(st, chat, &lps, &mut offsets, &text_of);
        }
    }
    for c in chunks {
        if !put(tx, send(c), &st.shutdown).await {
            r.left = true;
            return r;
        }
    }
    // (an answer a stop string ended inside a call stays `stop`: that call is not whole)
    if split.calls > 0
        && r.finish.as_deref() == Some("stop")
        && !(split.cut && det.stop_hit().is_some())
    {
        r.finish = Some("tool_calls".into());
    }
    if let Some(f) = &r.finish {
        let mut last = out.chunk(
            st,
            chat,
            index,
            if chat { None } else { Some("") },
            Some(f),
            false,
            Value::Null,
        );
        if vr.include_usage {
            last["usage"] = Value::Null;
        }
        if !put(tx, send(last), &st.shutdown).await {
            r.left = true;
        }
    }
    r
}

/// [`validate`] off the async runtime (which answers /health and every stream): rendering,
/// tokenising and compiling grammars take CPU in proportion to the request, at most one
/// request per core at a time.
pub(crate) async fn validate_off_runtime(
    st: &Arc<AppState>,
    v: Value,
    chat: bool,
) -> Result<ValidRequest, ApiError> {
    let _turn = st
        .tokenizing
        .acquire()
        .await
        .map_err(|_| ApiError::Unavailable("the gateway is stopping".into()))?;
    let st2 = st.clone();
    tokio::task::spawn_blocking(move || validate(&st2, &v, chat))
        .await
        .map_err(|e| ApiError::Internal(format!("validating the request: {e}")))?
}

/// Runs `f` (a conversion of a request's tree, which takes a while on a large body, and the
/// drop of what it moved in) on the blocking pool, off the runtime that serves every other
/// connection.
pub(crate) async fn off_runtime<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::Internal(format!("converting the request: {e}")))?
}

async fn handle(st: Arc<AppState>, req: Request, chat: bool) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let mut active = st.shutdown.enter();
    let client = client_of(&req);
    let (v, turn) = read_json_turn(&st, req.into_body()).await?;
    let mut vr = validate_off_runtime(&st, v, chat).await?;
    drop(turn);
    account(&st, &mut active, &mut vr, client)?;
    let span = tracing::Span::current();
    span.record("gen_ai.usage.input_tokens", vr.prompt.len());
    let out = Out {
        // 128 random bits: an id names a request on the lane (its cancel among others), so
        // it must not be guessable from another one
        id: format!(
            "{}-{:032x}",
            if chat { "chatcmpl" } else { "cmpl" },
            random_id(&st)
        ),
        created: now_secs(),
    };
    span.record("moelane.request_id", out.id.as_str());
    let greq = generate_request(&vr, &out.id);
    let deadline = arrived + st.cfg.retry_deadline;
    let timing = Timing::since(chat, arrived);
    let aborted = st.shutdown.aborted();
    if !vr.stream {
        return tokio::select! {
            r = whole_response(&st, &vr, &greq, deadline, &out, chat, &timing) => r,
            _ = aborted => Err(shutting_down()),
        };
    }
    // every choice's lane opened (first event in) before the stream starts, so that a failure
    // is still a plain HTTP error; a request still waiting after HEAD_START (queued on a full
    // lane) gets its headers then, and a comment, so that proxies and clients with read
    // timeouts see it alive: a failure from there on is an error event
    let opens = {
        let opens = (0..vr.n).map(|i| {
            let (st, greq) = (st.clone(), choice_request(&greq, i));
            async move {
                let mut tries = Tries::default();
                let (inflight, events) = open(&st, &greq, deadline, &mut tries).await?;
                Ok::<_, ApiError>((inflight, events, tries))
            }
        });
        futures::future::try_join_all(opens)
    };
    let mut opens = Box::pin(opens);
    let early = crate::relay::within_head_start(&st, &mut opens).await?;
    let prompt_tokens = vr.prompt.len();
    // Streaming: a task relays lane events into SSE chunks; when the client leaves, the
    // channel closes, the task ends and drops the lane streams, which cancels the requests.
    let (tx, rx) = tokio::sync::mpsc::channel::<SseEvent>(64);
    if early.is_none() {
        let _ = tx.try_send(SseEvent::default().comment(WAITING));
    }
    let st2 = st.clone();
    let relay = async move {
        let _active = active;
        let (st, vr, out, tx, timing) = (&st2, &vr, &out, &tx, &timing);
        let send = |v: Value| SseEvent::default().data(v.to_string());
        let opened = match crate::relay::opened(st, early, opens, tx).await {
            Some(Ok(o)) => o,
            // the client left while its request waited
            None => {
                timing.done(prompt_tokens, 0, "cancelled");
                return;
            }
            Some(Err(err)) => {
                timing.done(prompt_tokens, 0, "error");
                count_cut(&err);
                let err = if chat { err } else { err.for_field("prompt") };
                put(tx, send(err.body()), &st.shutdown).await;
                put(tx, SseEvent::default().data("[DONE]"), &st.shutdown).await;
                return;
            }
        };
        if let Some((inflight, _, _)) = opened.first() {
            tracing::Span::current().record("moelane.lane", inflight.lane.name());
        }
        let ends = futures::future::join_all(opened.into_iter().enumerate().map(
            |(i, (inflight, events, tries))| async move {
                let lane = inflight.lane.name().to_string();
                let r = relay_choice(st, vr, out, i, &lane, events, tx, tries, chat, timing).await;
                drop(inflight);
                r
            },
        ))
        .await;
        let finish = match ends.iter().find(|e| e.failed.is_some() || e.left) {
            Some(e) if e.left => "cancelled",
            Some(_) => "error",
            None => ends
                .first()
                .and_then(|e| e.finish.as_deref())
                .unwrap_or("error"),
        };
        timing.done(
            prompt_tokens,
            ends.iter().map(|e| e.completion).sum(),
            finish,
        );
        if ends.iter().any(|e| e.left) {
            return;
        }
        let completion: usize = ends.iter().map(|e| e.completion).sum();
        if let Some(err) = ends.into_iter().find_map(|e| e.failed) {
            // an error object, as OpenAI's API sends mid-stream (its clients raise on it),
            // and no finish: the client must not take a cut answer for a whole one
            count_cut(&err);
            let err = if chat { err } else { err.for_field("prompt") };
            put(tx, send(err.body()), &st.shutdown).await;
            put(tx, SseEvent::default().data("[DONE]"), &st.shutdown).await;
            return;
        }
        if vr.include_usage {
            let u = json!({"id": out.id, "object": if chat { "chat.completion.chunk" } else { "text_completion" }, "created": out.created,
                           "model": st.cfg.model_name, "choices": [], "usage": usage(prompt_tokens, completion)});
            put(tx, send(u), &st.shutdown).await;
        }
        put(tx, SseEvent::default().data("[DONE]"), &st.shutdown).await;
    };
    // the request's span lives until the last chunk is sent
    tokio::spawn(relay.instrument(span));
    let stream =
        tokio_stream::wrappers::ReceiverStream::new(rx).map(Ok::<_, std::convert::Infallible>);
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response())
}

async fn models(State(st): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_object(&st)]}))
}

/// The served model as `/v1/models` lists it.
fn model_object(st: &AppState) -> Value {
    json!({"id": st.cfg.model_name, "object": "model", "created": 0, "owned_by": "moelane",
           "max_model_len": st.cfg.max_context})
}

/// `GET /v1/models/{model}` (the OpenAI clients' `models.retrieve`; a name may hold `/`): the
/// served model, or a 404 naming the one asked for.
async fn model(
    State(st): State<Arc<AppState>>,
    name: Result<axum::extract::Path<String>, axum::extract::rejection::PathRejection>,
) -> Result<Json<Value>, ApiError> {
    let axum::extract::Path(name) =
        name.map_err(|e| ApiError::bad(e.body_text(), Some("model")))?;
    if name == st.cfg.model_name {
        Ok(Json(model_object(&st)))
    } else {
        Err(ApiError::UnknownModel(name))
    }
}

async fn lanes(
    st: &AppState,
) -> Result<Vec<(crate::registry::LaneInfo, Arc<dyn crate::lane::Lane>)>, ApiError> {
    st.registry
        .ask(ListLanes)
        .await
        .map_err(|e| ApiError::Internal(format!("registry: {e}")))
}

async fn ready(State(st): State<Arc<AppState>>) -> Response {
    if st.shutdown.draining() {
        return (StatusCode::SERVICE_UNAVAILABLE, "draining").into_response();
    }
    let Ok(list) = lanes(&st).await else {
        return (StatusCode::SERVICE_UNAVAILABLE, "registry down").into_response();
    };
    if list.iter().any(|(info, _)| info.state == "up") {
        return (StatusCode::OK, "ready").into_response();
    }
    (StatusCode::SERVICE_UNAVAILABLE, "no healthy lane").into_response()
}

async fn stats(State(st): State<Arc<AppState>>) -> Result<Json<Value>, ApiError> {
    let list = lanes(&st).await?;
    // every lane at once, each bounded: a lane that does not answer says so
    let answers =
        futures::future::join_all(list.iter().map(|(_, lane)| {
            tokio::time::timeout(std::time::Duration::from_secs(2), lane.stats())
        }))
        .await;
    let mut out = Vec::new();
    for ((info, _), answer) in list.into_iter().zip(answers) {
        let answer = answer.unwrap_or_else(|_| {
            Err(LaneError {
                category: Category::Timeout,
                message: "no stats answer within 2 s".into(),
            })
        });
        let s = match answer {
            Ok(s) => {
                let load = s.load.unwrap_or_default();
                json!({"running": load.running, "waiting": load.waiting, "kv_blocks_used": load.kv_blocks_used, "kv_blocks_total": load.kv_blocks_total,
                       "steps": s.steps, "tokens_generated": s.tokens_generated, "prompt_tokens": s.prompt_tokens,
                       "requests_finished": s.requests_finished, "requests_cancelled": s.requests_cancelled, "requests_failed": s.requests_failed,
                       "layers": s.layers.iter().map(|l| json!({"hot_picks": l.hot_picks, "cold_picks": l.cold_picks, "wait_ns": l.wait_ns})).collect::<Vec<_>>()})
            }
            Err(e) => json!({"error": e.message}),
        };
        out.push(json!({"lane": info.name, "state": info.state, "source": info.source, "draining": info.draining,
                        "inflight": info.inflight, "failures": info.failures, "ejections": info.ejections,
                        "down_reason": info.down_reason, "map_epoch": info.map_epoch, "build": info.build,
                        "healthy": info.healthy, "incarnation": info.incarnation, "degraded": info.degraded, "stats": s}));
    }
    Ok(Json(json!({"lanes": out})))
}

async fn drain(State(st): State<Arc<AppState>>, req: Request) -> Result<Json<Value>, ApiError> {
    let v = read_json(&st, req.into_body()).await?;
    let lane = match v.get("lane") {
        Some(Value::String(l)) => l.clone(),
        None | Some(Value::Null) => return Err(ApiError::bad("`lane` is required", Some("lane"))),
        Some(_) => {
            return Err(ApiError::bad(
                "`lane` must be a string (the lane's name, as /admin/lanes lists it)",
                Some("lane"),
            ))
        }
    };
    // absent: drain; anything but a boolean is refused (an undrain of the wrong type must
    // not drain)
    let draining = match v.get("drain") {
        None => true,
        Some(Value::Bool(d)) => *d,
        Some(x) => {
            return Err(ApiError::bad(
                format!("`drain` must be true or false, got {x}"),
                Some("drain"),
            ))
        }
    };
    let found = st
        .registry
        .ask(SetDrain {
            lane: lane.clone(),
            draining,
        })
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))?;
    if !found {
        return Err(ApiError::bad(format!("no lane {lane:?}"), Some("lane")));
    }
    Ok(Json(json!({"lane": lane, "draining": draining})))
}

/// `POST /admin/canary {"lane": NAME, "prompt"?: TEXT, "max_tokens"?: N}`: a greedy
/// generation (1 token by default, at most 64) through that lane only, whatever its drain or
/// health state: the full path (gateway, primary, sidecar) of a lane a rollout just restarted,
/// before it gets traffic. 200 with the tokens and the time, or the lane's error.
async fn canary(State(st): State<Arc<AppState>>, req: Request) -> Result<Json<Value>, ApiError> {
    let v = read_json(&st, req.into_body()).await?;
    let name = v
        .get("lane")
        .and_then(|l| l.as_str())
        .ok_or_else(|| ApiError::bad("`lane` is required", Some("lane")))?
        .to_string();
    let prompt = v
        .get("prompt")
        .and_then(|p| p.as_str())
        .unwrap_or("The quick brown fox");
    let max_tokens = match num(&v, "max_tokens")? {
        Some(x) if !(1.0..=64.0).contains(&x) || x.fract() != 0.0 => {
            return Err(ApiError::bad(
                format!("max_tokens must be an integer in 1..=64, got {x}"),
                Some("max_tokens"),
            ))
        }
        Some(x) => x as u32,
        None => 1,
    };
    let lane = lanes(&st)
        .await?
        .into_iter()
        .find(|(i, _)| i.name == name)
        .map(|(_, l)| l)
        .ok_or_else(|| ApiError::bad(format!("no lane {name:?}"), Some("lane")))?;
    let ids = st
        .tokenizer
        .encode(prompt)
        .map_err(|e| ApiError::Internal(e.to_string()))?;
    if ids.is_empty() {
        return Err(ApiError::bad("the canary prompt is empty", Some("prompt")));
    }
    let greq = GenerateRequest {
        request_id: format!("canary-{:032x}", random_id(&st)),
        prompt: ids,
        max_tokens,
        temperature: 0.0,
        top_p: 1.0,
        seed: 0,
        stop_token_ids: vec![],
        ignore_eos: true,
        ..Default::default()
    };
    let t0 = Instant::now();
    let run = async {
        let mut events = lane.generate(greq).await?;
        let mut tokens = Vec::new();
        while let Some(ev) = events.next().await {
            let ev = ev?;
            tokens.extend(ev.token);
            if !ev.finish_reason.is_empty() {
                return Ok((tokens, ev.finish_reason));
            }
        }
        Err(stream_ended())
    };
    let (tokens, finish) = tokio::time::timeout(std::time::Duration::from_secs(60), run)
        .await
        .map_err(|_| ApiError::Unavailable(format!("lane {name}: no canary answer within 60 s")))?
        .map_err(|e: LaneError| {
            ApiError::from_lane(e.category, format!("lane {name}: {}", e.message))
        })?;
    Ok(Json(
        json!({"lane": name, "ok": true, "tokens": tokens, "finish_reason": finish,
                    "seconds": t0.elapsed().as_secs_f64()}),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lone_surrogate_escapes_read_as_the_replacement_character_and_pairs_as_they_are() {
        let read = |s: &str| parse_json(s.as_bytes()).map(|v| v["a"].clone());
        assert_eq!(read(r#"{"a": "x\ud83dy"}"#).ok(), Some(json!("x\u{fffd}y")));
        assert_eq!(read(r#"{"a": "\udc00"}"#).ok(), Some(json!("\u{fffd}")));
        // a high one at the very end, and one before a second high one
        assert_eq!(
            read(r#"{"a": "\ud800\ud83d\ude00"}"#).ok(),
            Some(json!("\u{fffd}😀"))
        );
        // a pair, and an escaped backslash followed by text that looks like an escape
        assert_eq!(read(r#"{"a": "\ud83d\ude00"}"#).ok(), Some(json!("😀")));
        assert_eq!(read(r#"{"a": "\\ud800"}"#).ok(), Some(json!("\\ud800")));
        // what is broken otherwise stays a 400
        assert!(read(r#"{"a": "\ud800"#).is_err());
        assert!(read(r#"{"a": "\uzz00"}"#).is_err());
    }

    #[test]
    fn text_offsets_are_where_each_token_starts_in_the_decoded_text_when_tokens_split_characters() {
        // が + a lone lead byte | ない | a stray continuation | き | の + half of 三 | the
        // rest of 三 | ている | 日
        let toks: Vec<&[u8]> = vec![
            b"\xe3\x81\x8c\xe5",
            "ない".as_bytes(),
            b"\xbe",
            "き".as_bytes(),
            b"\xe3\x81\xae\xe4\xb8",
            b"\x89",
            "ている".as_bytes(),
            "日".as_bytes(),
        ];
        let all: Vec<u8> = toks.concat();
        let text = String::from_utf8_lossy(&all).into_owned();
        assert_eq!(text, "が�ない�きの三ている日");
        let mut o = Offsets::from(0);
        let got: Vec<usize> = toks.iter().map(|t| o.next(t)).collect();
        // ない at 2 (after が and the lone byte's U+FFFD), 三's second half at 三 (7),
        // ている right after it
        assert_eq!(got, [0, 2, 4, 5, 6, 7, 8, 11]);
        let chars: Vec<char> = text.chars().collect();
        for (t, &at) in toks.iter().zip(&got) {
            if let Ok(s) = std::str::from_utf8(t) {
                let here: String = chars[at..at + s.chars().count()].iter().collect();
                assert_eq!(here, s);
            }
        }
        // a base (the echoed prompt's characters) shifts them all; an unfinished character at
        // the end is one character
        let mut o = Offsets::from(5);
        assert_eq!(o.next(b"a\xe4"), 5);
        assert_eq!(o.next(b"\xb8"), 6);
        assert_eq!(o.next(b""), 7);
        // every split of a text into tokens of 1..4 bytes gives offsets that index its chars
        let text = "ä€𝄞x\u{80}漢字 ok";
        let b = text.as_bytes();
        for step in 1..=4 {
            let mut o = Offsets::from(0);
            let mut pos = 0;
            while pos < b.len() {
                let end = (pos + step).min(b.len());
                let at = o.next(&b[pos..end]);
                // the character holding the token's first byte
                assert_eq!(
                    at,
                    text[..]
                        .char_indices()
                        .take_while(|(i, _)| *i <= pos)
                        .count()
                        - 1
                );
                pos = end;
            }
        }
    }

    #[test]
    fn a_client_holds_at_most_its_bound_and_gets_places_back_as_answers_end() {
        let slots = Arc::new(ClientSlots::default());
        assert!(slots.take("a", 9, 0).unwrap().is_none(), "0: no bound");
        let a1 = slots.take("a", 2, 3).unwrap();
        let e = slots.take("a", 2, 3).err().expect("a past its bound");
        assert_eq!(e.status(), StatusCode::TOO_MANY_REQUESTS);
        assert!(e.to_string().contains("2 generations in flight"), "{e}");
        let b = slots.take("b", 3, 3).unwrap();
        let a2 = slots.take("a", 1, 3).unwrap();
        assert!(slots.take("a", 1, 3).is_err());
        drop(a1);
        let a3 = slots.take("a", 2, 3).unwrap();
        let n = slots.take("c", 4, 3).err().expect("n over the bound");
        assert_eq!(n.status(), StatusCode::BAD_REQUEST);
        drop((a2, a3, b));
        assert!(slots.held.lock().unwrap().is_empty(), "every place back");
    }
}
