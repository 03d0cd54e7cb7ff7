//! The Anthropic Messages API (`POST /v1/messages`), on the same validation, lanes, grammars
//! and answer splitting as the OpenAI routes: a Messages request is translated into a chat
//! request (system, text, `tool_use` and `tool_result` blocks, `tools` with `input_schema`,
//! `tool_choice` auto / any / tool / none, `thinking`), and the answer comes back as content
//! blocks (`text`, `thinking`, `tool_use` with its `input` object) with Anthropic's stop
//! reasons, whole or as its stream of events.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Request, State};
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Json;
use moelane_text::agent::Part;
use serde_json::{json, Value};
use tracing::Instrument as _;

use crate::error::ApiError;
use crate::relay::{relay_parts, PartSink};
use crate::server::{
    generate_request, off_runtime, put, random_id, read_json_turn, shutting_down,
    validate_off_runtime, whole_choice, AppState, Tries, ValidRequest,
};

/// An error in Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`).
fn error_response(e: ApiError) -> Response {
    let status = e.status();
    let kind = kind_of(status);
    let mut r = (
        status,
        Json(json!({"type": "error", "error": {"type": kind, "message": e.message()}})),
    )
        .into_response();
    // the headers the OpenAI error carries (Retry-After on a 429, WWW-Authenticate on a 401)
    r.headers_mut().extend(e.extra_headers());
    r
}

/// An error of the chat route's checks as this API names the fields: `stop_sequences` for
/// `stop`, `tool_choice` of type any for `required`, `output_config.format` for
/// `response_format`.
fn in_its_names(e: ApiError) -> ApiError {
    match e {
        ApiError::BadRequest {
            message,
            param: Some(p),
        } => {
            let (name, message) = match p {
                "stop" => (
                    "stop_sequences",
                    message.replace("`stop`", "`stop_sequences`").replace(
                        "a string or a list of up to 4 strings",
                        "a list of up to 4 strings",
                    ),
                ),
                "tool_choice" => (
                    p,
                    message.replace("`tool_choice: required`", "`tool_choice` of type any"),
                ),
                "response_format" => (
                    "output_config.format",
                    message.replace("response_format", "output_config.format"),
                ),
                _ => (p, message),
            };
            ApiError::bad(message, Some(name))
        }
        e => e,
    }
}

/// Anthropic's error type for a status.
fn kind_of(status: axum::http::StatusCode) -> &'static str {
    match status.as_u16() {
        400 | 405 | 408 | 414 | 431 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 => "overloaded_error",
        _ => "api_error",
    }
}

/// Errors answered on the Messages routes in Anthropic's shape even where they are made
/// before its handlers (a refused key, a wrong method, the body limit): an OpenAI-shaped
/// error body there is rewritten, its status and headers kept.
pub(crate) async fn errors_in_its_shape(req: Request, next: axum::middleware::Next) -> Response {
    let ours = req.uri().path().starts_with("/v1/messages");
    let r = next.run(req).await;
    if !ours || r.status().is_success() || r.status().is_informational() {
        return r;
    }
    let (mut parts, body) = r.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, 1 << 20).await else {
        // (no error of ours is this long: messages are cut)
        let body = json!({"type": "error", "error": {"type": kind_of(parts.status),
                                                     "message": "the error was too long to send"}});
        parts.headers.remove(axum::http::header::CONTENT_LENGTH);
        return Response::from_parts(parts, axum::body::Body::from(body.to_string()));
    };
    let v: Option<Value> = serde_json::from_slice(&bytes).ok();
    match v {
        Some(v) if v["type"] != "error" && v["error"]["message"].is_string() => {
            let body = json!({"type": "error", "error": {"type": kind_of(parts.status),
                                                         "message": v["error"]["message"]}});
            parts.headers.remove(axum::http::header::CONTENT_LENGTH);
            Response::from_parts(parts, axum::body::Body::from(body.to_string()))
        }
        _ => Response::from_parts(parts, axum::body::Body::from(bytes)),
    }
}

fn bad(m: impl Into<String>) -> ApiError {
    ApiError::bad(m, Some("messages"))
}

/// A `text` block's text (a 400 naming `what` when it has none).
fn text_of_block(b: &Value, what: &str) -> Result<String, ApiError> {
    b["text"]
        .as_str()
        .map(String::from)
        .ok_or_else(|| bad(format!("{what}: a text block's `text` must be a string")))
}

/// A string field of a block (a 400 naming it when it is not one).
fn str_field<'a>(b: &'a Value, k: &str, at: &str) -> Result<&'a str, ApiError> {
    b[k].as_str()
        .ok_or_else(|| bad(format!("{at}.{k} must be a string")))
}

/// The text of a `content` that is a string or a list of blocks (`text` blocks only).
fn text_blocks(c: &Value, what: &str) -> Result<String, ApiError> {
    match c {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => blocks
            .iter()
            .map(|b| match b["type"].as_str() {
                Some("text") => text_of_block(b, what),
                Some(t) => Err(bad(format!("{what}: a {t:?} block is not supported here"))),
                None => Err(bad(format!("{what}: a block without a type"))),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(|v| v.concat()),
        Value::Null => Ok(String::new()),
        x => Err(bad(format!(
            "{what} must be a string or a list of blocks, got {x}"
        ))),
    }
}

/// A Messages request as the chat request the OpenAI route validates.
fn to_chat(v: &Value) -> Result<Value, ApiError> {
    to_chat_for(v, false)
}

/// [`to_chat`]; `counting`: for count_tokens, where `max_tokens` is not the answer's bound
/// (a thinking budget is not checked against it).
fn to_chat_for(v: &Value, counting: bool) -> Result<Value, ApiError> {
    let max_tokens = v
        .get("max_tokens")
        .filter(|m| !m.is_null())
        .ok_or_else(|| ApiError::bad("`max_tokens` is required", Some("max_tokens")))?;
    let mut msgs = Vec::new();
    match v.get("system") {
        None | Some(Value::Null) => {}
        Some(s) => msgs.push(json!({"role": "system", "content": text_blocks(s, "system")?})),
    }
    let list = v
        .get("messages")
        .and_then(|m| m.as_array())
        .ok_or_else(|| bad("`messages` must be a list"))?;
    // the ids of the previous message's tool_use blocks: the next message answers each with
    // a tool_result; every tool_use id of the conversation, which none may reuse
    let mut uses: Vec<String> = Vec::new();
    let mut every_use: std::collections::HashSet<String> = std::collections::HashSet::new();
    for (i, m) in list.iter().enumerate() {
        let role = m["role"].as_str().unwrap_or_default();
        if role != "user" && role != "assistant" {
            return Err(bad(format!(
                "messages[{i}].role must be user or assistant, got {role:?}"
            )));
        }
        let blocks = match &m["content"] {
            Value::String(s) => vec![json!({"type": "text", "text": s})],
            Value::Array(b) => b.clone(),
            x => {
                return Err(bad(format!(
                    "messages[{i}].content must be a string or blocks, got {x}"
                )))
            }
        };
        // as Anthropic's API: every message holds something, except a last assistant
        // message (the start of the answer)
        let last_assistant = role == "assistant" && i + 1 == list.len();
        let empty = match &m["content"] {
            Value::String(t) => t.trim().is_empty(),
            _ => blocks.is_empty(),
        };
        if empty && !last_assistant {
            return Err(bad(format!(
                "messages[{i}]: a {role} message must have non-empty content"
            )));
        }
        let prev_uses = std::mem::take(&mut uses);
        // the previous message's tool_use ids, each to be answered once, here, before any
        // other block (as Anthropic's API requires)
        let mut unanswered: std::collections::HashSet<&str> =
            prev_uses.iter().map(String::as_str).collect();
        if !prev_uses.is_empty() && role != "user" {
            return Err(bad(format!(
                "messages[{i}]: the previous message's tool_use blocks must be answered by \
                 tool_result blocks in a user message right after it"
            )));
        }
        let (mut text, mut calls, mut thinking) = (String::new(), Vec::new(), String::new());
        let mut other_before = false;
        for (j, b) in blocks.iter().enumerate() {
            let at = format!("messages[{i}].content[{j}]");
            let kind = b["type"].as_str();
            if kind != Some("tool_result") {
                other_before = true;
            }
            match kind {
                Some("text") => {
                    let t = text_of_block(b, &at)?;
                    // an empty or blank text block, but at the end of a last assistant
                    // message (the answer's start)
                    if t.trim().is_empty() && !last_assistant {
                        return Err(bad(format!(
                            "{at}: text content blocks must hold non-whitespace text"
                        )));
                    }
                    text.push_str(&t);
                }
                Some("thinking") if role == "assistant" => {
                    thinking.push_str(b["thinking"].as_str().unwrap_or_default())
                }
                Some("redacted_thinking") if role == "assistant" => {}
                Some("tool_use") if role == "assistant" => {
                    let input = match b.get("input") {
                        None | Some(Value::Null) => json!({}),
                        Some(i @ Value::Object(_)) => i.clone(),
                        Some(_) => return Err(bad(format!("{at}.input must be an object"))),
                    };
                    let id = str_field(b, "id", &at)?.to_string();
                    let name = str_field(b, "name", &at)?;
                    if id.is_empty() || name.is_empty() {
                        return Err(bad(format!(
                            "{at}: a tool_use needs a non-empty id and name"
                        )));
                    }
                    if !every_use.insert(id.clone()) {
                        return Err(bad(format!("{at}: tool_use id {id:?} is used twice")));
                    }
                    uses.push(id.clone());
                    calls.push(json!({
                        "id": id, "type": "function",
                        "function": {"name": name, "arguments": input.to_string()}}))
                }
                Some("tool_result") if role == "user" => {
                    // results first, each its own tool turn, then the user's text
                    let mut content = text_blocks(&b["content"], &at)?;
                    match &b["is_error"] {
                        Value::Null | Value::Bool(false) => {}
                        Value::Bool(true) => content = format!("Error: {content}"),
                        x => return Err(bad(format!("{at}.is_error must be a boolean, got {x}"))),
                    }
                    let id = str_field(b, "tool_use_id", &at)?;
                    if other_before {
                        return Err(bad(format!(
                            "{at}: tool_result blocks must come first in a message"
                        )));
                    }
                    if !unanswered.remove(id) {
                        return Err(bad(if prev_uses.iter().any(|u| u == id) {
                            format!("{at}: tool_use_id {id:?} is answered twice")
                        } else {
                            format!(
                                "{at}: tool_use_id {id:?} answers no tool_use block of the \
                                 previous message"
                            )
                        }));
                    }
                    msgs.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
                }
                Some(t) => {
                    return Err(bad(format!(
                        "{at}: a {t:?} block is not supported in a {role} message"
                    )))
                }
                None => return Err(bad(format!("{at}: a block without a type"))),
            }
        }
        if let Some(id) = prev_uses.iter().find(|u| unanswered.contains(u.as_str())) {
            return Err(bad(format!(
                "messages[{i}]: tool_use {id:?} of the previous message has no tool_result here"
            )));
        }
        if role == "assistant" {
            let mut a = json!({"role": "assistant", "content": text});
            if !calls.is_empty() {
                a["tool_calls"] = Value::Array(calls);
            }
            if !thinking.is_empty() {
                a["reasoning_content"] = json!(thinking);
            }
            msgs.push(a);
        } else if !text.is_empty() || !blocks.iter().any(|b| b["type"] == "tool_result") {
            msgs.push(json!({"role": "user", "content": text}));
        }
    }
    let mut out = json!({"model": v.get("model").cloned().unwrap_or(Value::Null), "messages": msgs,
                         "max_tokens": max_tokens});
    // Anthropic's temperature runs from 0 to 1 (OpenAI's to 2)
    if let Some(t) = v.get("temperature").filter(|t| !t.is_null()) {
        if !t.as_f64().is_some_and(|x| (0.0..=1.0).contains(&x)) {
            return Err(ApiError::bad(
                format!("temperature: must be a number from 0 to 1, got {t}"),
                Some("temperature"),
            ));
        }
    }
    for k in ["temperature", "top_p", "top_k", "stream"] {
        if let Some(x) = v.get(k) {
            out[k] = x.clone();
        }
    }
    if let Some(s) = v.get("stop_sequences").filter(|s| !s.is_null()) {
        out["stop"] = s.clone();
    }
    let tools = match v.get("tools") {
        None | Some(Value::Null) => None,
        Some(Value::Array(t)) => Some(t),
        Some(x) => {
            return Err(ApiError::bad(
                format!("`tools` must be a list, got {x}"),
                Some("tools"),
            ))
        }
    };
    if let Some(tools) = tools {
        let mut t = Vec::new();
        for (i, tool) in tools.iter().enumerate() {
            if tool
                .get("type")
                .and_then(|x| x.as_str())
                .is_some_and(|x| x != "custom")
            {
                return Err(ApiError::bad(
                    format!(
                        "tools[{i}]: server tools ({}) are not supported",
                        tool["type"]
                    ),
                    Some("tools"),
                ));
            }
            t.push(json!({"type": "function", "function": {"name": tool["name"], "description": tool.get("description").cloned().unwrap_or(Value::Null),
                          "parameters": tool.get("input_schema").cloned().unwrap_or(Value::Null),
                          "strict": tool.get("strict").cloned().unwrap_or(Value::Null)}}));
        }
        out["tools"] = Value::Array(t);
    }
    if let Some(c) = v.get("tool_choice").filter(|c| !c.is_null()) {
        out["tool_choice"] = match c["type"].as_str() {
            Some("auto") => json!("auto"),
            Some("any") => json!("required"),
            Some("none") => json!("none"),
            Some("tool") => json!({"type": "function", "function": {"name": c["name"]}}),
            _ => {
                return Err(ApiError::bad(
                    format!(
                        "tool_choice.type must be auto, any, tool or none, got {}",
                        c["type"]
                    ),
                    Some("tool_choice"),
                ))
            }
        };
        match c.get("disable_parallel_tool_use") {
            None | Some(Value::Null) | Some(Value::Bool(false)) => {}
            Some(Value::Bool(true)) => out["parallel_tool_calls"] = json!(false),
            Some(x) => {
                return Err(ApiError::bad(
                    format!("tool_choice.disable_parallel_tool_use must be a boolean, got {x}"),
                    Some("tool_choice"),
                ))
            }
        }
    }
    // structured output: output_config.format (a JSON schema)
    if let Some(f) = v
        .get("output_config")
        .and_then(|o| o.get("format"))
        .filter(|f| !f.is_null())
    {
        if f["type"].as_str() != Some("json_schema") {
            return Err(ApiError::bad(
                format!(
                    "output_config.format.type must be json_schema, got {}",
                    f["type"]
                ),
                Some("response_format"),
            ));
        }
        out["response_format"] = json!({"type": "json_schema",
            "json_schema": {"name": "output", "schema": f.get("schema").cloned().unwrap_or(Value::Null)}});
    }
    if v.get("thinking")
        .is_some_and(|t| !t.is_null() && !t["type"].is_string())
    {
        return Err(ApiError::bad(
            "`thinking` must be an object with a `type` (enabled or disabled)",
            Some("thinking"),
        ));
    }
    match v.get("thinking").and_then(|t| t["type"].as_str()) {
        // the two names families' templates read (Qwen3's and GLM's; DeepSeek's)
        Some(kind @ ("enabled" | "adaptive")) => {
            // as Anthropic checks it: at least 1,024 and below max_tokens (the budget is a
            // target there too; here the template's thinking switch is what it turns on)
            if kind == "enabled" {
                let budget = &v["thinking"]["budget_tokens"];
                let Some(b) = budget.as_u64() else {
                    return Err(ApiError::bad(
                        format!("thinking.budget_tokens: a whole number is required, got {budget}"),
                        Some("thinking"),
                    ));
                };
                let bound = if counting {
                    u64::MAX
                } else {
                    max_tokens.as_u64().unwrap_or(0)
                };
                if b < 1024 || b >= bound {
                    return Err(ApiError::bad(
                        format!(
                            "thinking.budget_tokens: must be at least 1024 and less than \
                             max_tokens ({max_tokens}), got {b}"
                        ),
                        Some("thinking"),
                    ));
                }
            }
            out["chat_template_kwargs"] = json!({"enable_thinking": true, "thinking": true})
        }
        Some("disabled") => {
            out["chat_template_kwargs"] = json!({"enable_thinking": false, "thinking": false})
        }
        Some(t) => {
            return Err(ApiError::bad(
                format!("thinking.type: {t:?} is not one of enabled, adaptive, disabled"),
                Some("thinking"),
            ))
        }
        None => {}
    }
    for (k, what) in [
        ("mcp_servers", "MCP servers"),
        ("container", "code execution containers"),
    ] {
        if v.get(k).is_some_and(|x| !x.is_null()) {
            return Err(ApiError::bad(
                format!("`{k}`: {what} are not supported by this server; leave it out"),
                Some(k),
            ));
        }
    }
    Ok(out)
}

/// Anthropic's stop reason for a finish (`tool_use` when the answer ended with calls).
/// (`calls`: the answer has calls, all whole: a stop sequence that cut one is the reason)
fn stop_reason(finish: &str, calls: bool, stop_string: Option<&str>) -> (&'static str, Value) {
    match (finish, calls, stop_string) {
        ("length", _, _) => ("max_tokens", Value::Null),
        (_, true, _) => ("tool_use", Value::Null),
        (_, _, Some(s)) => ("stop_sequence", json!(s)),
        _ => ("end_turn", Value::Null),
    }
}

/// A tool call as a `tool_use` block: its arguments parsed back into the `input` object (an
/// `input` must be an object: arguments that are not one become `{}`, whole or streamed).
fn tool_use(st: &AppState, name: &str, arguments: &str) -> Value {
    let input: Value = serde_json::from_str(arguments)
        .ok()
        .filter(Value::is_object)
        .unwrap_or_else(|| json!({}));
    json!({"type": "tool_use", "id": format!("toolu_{:024x}", random_id(st) >> 32), "name": name, "input": input})
}

/// `POST /v1/messages`.
pub(crate) async fn messages(State(st): State<Arc<AppState>>, req: Request) -> Response {
    async {
        match handle(st, req).await {
            Ok(r) => r,
            Err(e) => error_response(e),
        }
    }
    .instrument(tracing::info_span!("POST /v1/messages"))
    .await
}

/// `POST /v1/messages/count_tokens`: the input tokens a Messages request takes (its system,
/// messages and tools rendered through the chat template, as `/v1/messages` renders them),
/// as `{"input_tokens": N}`; nothing is generated, and no lane is asked.
pub(crate) async fn count_tokens(State(st): State<Arc<AppState>>, req: Request) -> Response {
    async {
        let r: Result<Response, ApiError> = async {
            let (mut v, turn) = read_json_turn(&st, req.into_body()).await?;
            if let Some(o) = v.as_object_mut() {
                // what is counted is the prompt: the answer's bound does not change it (the
                // rest is checked as /v1/messages checks it)
                o.insert("max_tokens".into(), json!(1));
                o.remove("stream");
            }
            let chat = off_runtime(move || to_chat_for(&v, true)).await?;
            let vr = validate_off_runtime(&st, chat, true)
                .await
                .map_err(in_its_names)?;
            drop(turn);
            Ok(Json(json!({"input_tokens": vr.prompt.len()})).into_response())
        }
        .await;
        r.unwrap_or_else(error_response)
    }
    .instrument(tracing::info_span!("POST /v1/messages/count_tokens"))
    .await
}

async fn handle(st: Arc<AppState>, req: Request) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let mut active = st.shutdown.enter();
    let client = crate::server::client_of(&req);
    let (v, turn) = read_json_turn(&st, req.into_body()).await?;
    let chat = off_runtime(move || to_chat(&v)).await?;
    let mut vr = validate_off_runtime(&st, chat, true)
        .await
        .map_err(in_its_names)?;
    drop(turn);
    crate::server::account(&st, &mut active, &mut vr, client)?;
    let id = format!("msg_{:032x}", random_id(&st));
    let greq = generate_request(&vr, &id);
    let deadline = arrived + st.cfg.retry_deadline;
    let model = st.cfg.model_name.clone();
    if !vr.stream {
        let c = tokio::select! {
            r = whole_choice(&st, &vr, &greq, deadline, true) => r?,
            _ = st.shutdown.aborted() => return Err(shutting_down()),
        };
        let (parts, cut) = vr.split_answer(&c.text);
        let mut content = Vec::new();
        let mut calls = false;
        for p in parts {
            match p {
                Part::Content(t) => content.push(json!({"type": "text", "text": t})),
                Part::Reasoning(t) => {
                    content.push(json!({"type": "thinking", "thinking": t, "signature": ""}))
                }
                Part::Call { name, arguments } => {
                    calls = true;
                    content.push(tool_use(&st, &name, &arguments));
                }
                // merged into calls
                Part::CallStart { .. } | Part::CallArgs(_) | Part::CallEnd => {}
            }
        }
        let cut = cut && c.stop_hit.is_some();
        let (reason, seq) = stop_reason(&c.finish, calls && !cut, c.stop_hit.as_deref());
        return Ok(Json(json!({"id": id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": seq,
            "usage": {"input_tokens": vr.prompt.len(), "output_tokens": c.completion}}))
        .into_response());
    }
    crate::relay::open_stream(
        &st,
        &greq,
        deadline,
        active,
        |err| vec![event("error", error_event(err))],
        move |st, lane, events, tries, tx| async move {
            stream(&st, &vr, &id, &lane, events, &tx, tries).await
        },
    )
    .await
}

/// The block being streamed: its index and kind.
#[derive(PartialEq)]
enum Open {
    None,
    Text,
    Thinking,
    /// A tool_use block whose input streams.
    Tool,
}

/// The content blocks of a stream: the one open (text or thinking), its index, and whether
/// a call was made.
struct Blocks<'a> {
    st: &'a AppState,
    tx: &'a tokio::sync::mpsc::Sender<SseEvent>,
    index: usize,
    open: Open,
    calls: bool,
}

fn event(kind: &str, v: Value) -> SseEvent {
    SseEvent::default().event(kind).data(v.to_string())
}

impl Blocks<'_> {
    async fn put(&self, kind: &str, v: Value) -> bool {
        put(self.tx, event(kind, v), &self.st.shutdown).await
    }

    /// Closes the open text or thinking block.
    async fn close(&mut self) -> bool {
        if self.open == Open::None {
            return true;
        }
        self.open = Open::None;
        let i = self.index;
        self.index += 1;
        self.put(
            "content_block_stop",
            json!({"type": "content_block_stop", "index": i}),
        )
        .await
    }

    /// Sends the parts as block events; false when the client left.
    async fn blocks(&mut self, parts: Vec<Part>) -> bool {
        for p in moelane_text::agent::as_streamed(parts) {
            let kind = match &p {
                Part::Content(_) => Open::Text,
                Part::Reasoning(_) => Open::Thinking,
                Part::Call { .. } | Part::CallStart { .. } => Open::None,
                Part::CallArgs(_) | Part::CallEnd => Open::Tool,
            };
            if self.open != kind && !self.close().await {
                return false;
            }
            let ok = match p {
                Part::CallStart { name } => {
                    self.calls = true;
                    let mut block = tool_use(self.st, &name, "{}");
                    block["input"] = json!({});
                    self.open = Open::Tool;
                    self.put(
                        "content_block_start",
                        json!({"type": "content_block_start", "index": self.index, "content_block": block}),
                    )
                    .await
                }
                Part::CallArgs(a) => {
                    self.put(
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": self.index,
                            "delta": {"type": "input_json_delta", "partial_json": a}}),
                    )
                    .await
                }
                // the tool_use block closes
                Part::CallEnd => self.close().await,
                // whole calls come as streamed ones (as_streamed)
                Part::Call { .. } => true,
                Part::Content(t) | Part::Reasoning(t) => {
                    let text = kind == Open::Text;
                    let started = self.open != Open::None
                        || self.put("content_block_start", json!({"type": "content_block_start", "index": self.index,
                            "content_block": if text { json!({"type": "text", "text": ""}) } else { json!({"type": "thinking", "thinking": ""}) }})).await;
                    self.open = kind;
                    let delta = if text {
                        json!({"type": "text_delta", "text": t})
                    } else {
                        json!({"type": "thinking_delta", "thinking": t})
                    };
                    started
                        && self.put("content_block_delta", json!({"type": "content_block_delta", "index": self.index, "delta": delta})).await
                }
            };
            if !ok {
                return false;
            }
        }
        true
    }
}

impl PartSink for Blocks<'_> {
    fn send(&mut self, parts: Vec<Part>) -> impl std::future::Future<Output = bool> + Send {
        self.blocks(parts)
    }
    fn closed(&self) -> impl std::future::Future<Output = ()> + Send + '_ {
        self.tx.closed()
    }
}

/// The `error` event of a stream that cannot go on.
fn error_event(err: &ApiError) -> Value {
    let kind = match err {
        ApiError::Unavailable(_) | ApiError::Overloaded(_) => "overloaded_error",
        // the request's own fault (a grammar that cannot go on, a context a lane refused)
        ApiError::BadRequest { .. } | ApiError::Invalid { .. } | ApiError::ContextLength(..) => {
            "invalid_request_error"
        }
        _ => "api_error",
    };
    json!({"type": "error", "error": {"type": kind, "message": err.message()}})
}

/// Relays a lane's events as Anthropic's stream: message_start, content blocks (start,
/// deltas, stop), message_delta with the stop reason and usage, message_stop; an `error`
/// event if the answer is cut.
async fn stream(
    st: &AppState,
    vr: &ValidRequest,
    id: &str,
    lane: &str,
    events: crate::lane::EventStream,
    tx: &tokio::sync::mpsc::Sender<SseEvent>,
    tries: Tries,
) {
    let start = json!({"type": "message_start", "message": {"id": id, "type": "message", "role": "assistant",
        "model": st.cfg.model_name, "content": [], "stop_reason": null, "stop_sequence": null,
        "usage": {"input_tokens": vr.prompt.len(), "output_tokens": 0}}});
    let mut b = Blocks {
        st,
        tx,
        index: 0,
        open: Open::None,
        calls: false,
    };
    if !b.put("message_start", start).await {
        return;
    }
    let end = relay_parts(st, vr, lane, events, tries, &mut b).await;
    if end.left {
        return;
    }
    if let Some(err) = end.failed {
        b.put("error", error_event(&err)).await;
        return;
    }
    if !b.close().await {
        return;
    }
    let (reason, seq) = stop_reason(
        end.finish.as_deref().unwrap_or("stop"),
        b.calls && !(end.cut && end.stop_hit.is_some()),
        end.stop_hit.as_deref(),
    );
    let delta = json!({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
        "usage": {"output_tokens": end.completion}});
    if b.put("message_delta", delta).await {
        b.put("message_stop", json!({"type": "message_stop"})).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(body: Value) -> String {
        match to_chat(&body) {
            Ok(c) => panic!("accepted: {c}"),
            Err(e) => e.message(),
        }
    }

    #[test]
    fn messages_follow_anthropics_rules_on_content_and_tool_results() {
        let call = json!({"role": "assistant", "content": [
            {"type": "text", "text": "looking"},
            {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Oslo"}}]});
        let answer = |id: &str| {
            json!({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": id, "content": "-3C"}]})
        };
        let req = |msgs: Vec<Value>| json!({"model": "m", "max_tokens": 4, "messages": msgs});
        let ask = json!({"role": "user", "content": "weather in Oslo?"});
        // a result answering the previous message's call: the chat's tool turn
        let c = to_chat(&req(vec![ask.clone(), call.clone(), answer("toolu_1")])).unwrap();
        assert_eq!(c["messages"][2]["role"], "tool");
        assert_eq!(c["messages"][2]["tool_call_id"], "toolu_1");
        // temperature runs from 0 to 1 here
        let mut hot = req(vec![ask.clone()]);
        hot["temperature"] = json!(1.5);
        assert!(refused(hot.clone()).contains("from 0 to 1"));
        hot["temperature"] = json!(1.0);
        to_chat(&hot).unwrap();
        // a result naming no call of the previous message
        let e = refused(req(vec![ask.clone(), call.clone(), answer("toolu_2")]));
        assert!(
            e.contains("messages[2].content[0]") && e.contains("toolu_2"),
            "{e}"
        );
        // nor of an earlier one
        let e = refused(req(vec![
            ask.clone(),
            call.clone(),
            answer("toolu_1"),
            json!({"role": "assistant", "content": "done"}),
            answer("toolu_1"),
        ]));
        assert!(e.contains("messages[4]"), "{e}");
        // a call id used twice in one message
        let twice = json!({"role": "assistant", "content": [
            {"type": "tool_use", "id": "t", "name": "a", "input": {}},
            {"type": "tool_use", "id": "t", "name": "b", "input": {}}]});
        let e = refused(req(vec![ask.clone(), twice]));
        assert!(e.contains("used twice"), "{e}");
        // every call answered, once each, results before anything else, right after it
        let two = json!({"role": "assistant", "content": [
            {"type": "tool_use", "id": "u1", "name": "a", "input": {}},
            {"type": "tool_use", "id": "u2", "name": "b", "input": {}}]});
        let result = |id: &str| json!({"type": "tool_result", "tool_use_id": id, "content": "ok"});
        let user = |blocks: Vec<Value>| json!({"role": "user", "content": blocks});
        let text = json!({"type": "text", "text": "and?"});
        to_chat(&req(vec![
            ask.clone(),
            two.clone(),
            user(vec![result("u2"), result("u1"), text.clone()]),
        ]))
        .unwrap();
        for (msgs, what) in [
            (
                vec![ask.clone(), two.clone(), ask.clone()],
                "has no tool_result",
            ),
            (
                vec![ask.clone(), two.clone(), user(vec![result("u1")])],
                "\"u2\"",
            ),
            (
                vec![
                    ask.clone(),
                    two.clone(),
                    user(vec![result("u1"), result("u1"), result("u2")]),
                ],
                "answered twice",
            ),
            (
                vec![
                    ask.clone(),
                    two.clone(),
                    user(vec![text.clone(), result("u1"), result("u2")]),
                ],
                "come first",
            ),
            (
                vec![
                    ask.clone(),
                    two.clone(),
                    json!({"role": "assistant", "content": "x"}),
                ],
                "right after",
            ),
            (
                vec![ask.clone(), call.clone(), answer("toolu_1"), call.clone()],
                "used twice",
            ),
        ] {
            let e = refused(req(msgs));
            assert!(e.contains(what), "{what}: {e}");
        }
        let mut bad_err = answer("toolu_1");
        bad_err["content"][0]["is_error"] = json!("yes");
        assert!(refused(req(vec![ask.clone(), call.clone(), bad_err])).contains("is_error"));
        let mut no_id = call.clone();
        no_id["content"][1]["id"] = json!("");
        assert!(refused(req(vec![ask.clone(), no_id])).contains("non-empty id"));
        // blank text: refused but at the end of a last assistant message
        for blank in [json!("   "), json!([{"type": "text", "text": ""}])] {
            let e = refused(req(vec![json!({"role": "user", "content": blank})]));
            assert!(e.contains("messages[0]"), "{e}");
            to_chat(&req(vec![
                ask.clone(),
                json!({"role": "assistant", "content": blank}),
            ]))
            .unwrap();
        }
        // empty content: refused but for a last assistant message (the answer's start)
        for empty in [json!([]), json!("")] {
            let e = refused(req(vec![json!({"role": "user", "content": empty})]));
            assert!(e.contains("messages[0]") && e.contains("non-empty"), "{e}");
            let e = refused(req(vec![
                ask.clone(),
                json!({"role": "assistant", "content": empty}),
                ask.clone(),
            ]));
            assert!(e.contains("messages[1]"), "{e}");
            to_chat(&req(vec![
                ask.clone(),
                json!({"role": "assistant", "content": empty}),
            ]))
            .unwrap();
        }
    }
}
