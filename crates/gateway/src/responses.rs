//! The OpenAI Responses API (`POST /v1/responses`), on the chat route's validation, lanes,
//! grammars and answer splitting: `input` (a string, or message, `function_call` and
//! `function_call_output` items), `instructions`, `tools` (functions), `tool_choice`,
//! `text.format` (JSON schema) are translated into a chat request, and the answer comes back
//! as output items (`reasoning`, `message` with `output_text`, `function_call`), whole or as
//! its stream of events. A response is kept (`store`, default true, as OpenAI's) in the
//! gateway's memory with the conversation it ends, for `previous_response_id` and
//! `GET` / `DELETE /v1/responses/{id}`: [`Store`], bounded in bytes (past the bound the
//! owner holding the most loses its oldest first).

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
    generate_request, now_secs, put, random_id, read_json_turn, shutting_down,
    validate_off_runtime, whole_choice, AppState, Tries, ValidRequest,
};

/// Kept responses: each one's conversation (the chat messages it ends with its answer, its
/// `instructions` left out, as OpenAI does not carry them over) and its response object, for
/// `previous_response_id` and `GET` / `DELETE /v1/responses/{id}`. In this gateway's memory
/// only (a restart or another gateway does not have them). Each is held as its JSON text, so
/// the bound is the bytes held (plus a small fixed cost an entry); past it the owner holding
/// the most bytes loses its oldest first (one busy key cannot push out the others'; on a
/// gateway without keys that is plain oldest first). Where the gateway has API keys a response
/// is visible only with the key that made it; an open gateway's ids (128 random bits) are
/// their own secret.
pub struct Store {
    inner: std::sync::Mutex<Kept>,
    /// Most bytes kept (0: nothing is stored).
    pub(crate) cap: usize,
}

#[derive(Default)]
struct Kept {
    map: std::collections::HashMap<String, Stored>,
    owners: std::collections::HashMap<String, Owned>,
    bytes: usize,
}

/// One owner's share: its bytes, how many of its responses are kept, and its ids oldest
/// first (deleted ones are skipped when met, and pruned when they are most of it).
#[derive(Default)]
struct Owned {
    bytes: usize,
    live: usize,
    order: std::collections::VecDeque<String>,
}

struct Stored {
    owner: String,
    /// The conversation's chat messages, as a JSON array.
    messages: Arc<str>,
    /// The response object, as JSON.
    response: Arc<str>,
    bytes: usize,
}

/// What an entry costs beyond its texts (its map and queue slots, its id twice).
const ENTRY_BYTES: usize = 160;

impl Store {
    pub fn new(cap: usize) -> Self {
        Store {
            inner: Default::default(),
            cap,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Kept> {
        // a panic while holding it leaves nothing half-written that matters: go on
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whom a kept response belongs to: the API key that made it, none on an open gateway
    /// (there the client is an address, which changes).
    fn owner(client: &str) -> &str {
        if client.starts_with("key:") {
            client
        } else {
            ""
        }
    }

    fn publish(k: &Kept) {
        metrics::gauge!(moelane_telemetry::names::RESPONSES_STORED).set(k.map.len() as f64);
        metrics::gauge!(moelane_telemetry::names::RESPONSES_STORED_BYTES).set(k.bytes as f64);
    }

    /// Takes entry `id` out of `k` (its owner's share too).
    fn take(k: &mut Kept, id: &str) -> Option<Stored> {
        let s = k.map.remove(id)?;
        k.bytes -= s.bytes;
        if let Some(o) = k.owners.get_mut(&s.owner) {
            o.bytes -= s.bytes;
            o.live -= 1;
            if o.live == 0 {
                k.owners.remove(&s.owner);
            } else if o.order.len() > 2 * o.live + 64 {
                let map = &k.map;
                o.order.retain(|i| map.contains_key(i));
            }
        }
        Some(s)
    }

    /// Keeps response `id`, the conversation `messages` it ends; past the bound, drops the
    /// oldest of the owner holding the most. False (nothing kept) when this one alone is
    /// over the bound.
    fn put(&self, id: &str, client: &str, messages: &[Value], response: &Value) -> bool {
        let owner = Self::owner(client);
        let messages: Arc<str> = Value::from(messages.to_vec()).to_string().into();
        let response: Arc<str> = response.to_string().into();
        let bytes = messages.len() + response.len() + 2 * id.len() + owner.len() + ENTRY_BYTES;
        if bytes > self.cap {
            return false;
        }
        let mut dropped = Vec::new();
        let mut k = self.lock();
        while k.bytes + bytes > self.cap {
            let Some(big) = k
                .owners
                .iter()
                .max_by_key(|(_, o)| o.bytes)
                .map(|(n, _)| n.clone())
            else {
                break;
            };
            let Some(old) = k.owners.get_mut(&big).and_then(|o| o.order.pop_front()) else {
                // (a share with bytes has ids; this keeps the loop finite regardless)
                k.owners.remove(&big);
                continue;
            };
            dropped.extend(Self::take(&mut k, &old));
        }
        k.bytes += bytes;
        let o = k.owners.entry(owner.to_string()).or_default();
        o.bytes += bytes;
        o.live += 1;
        o.order.push_back(id.to_string());
        k.map.insert(
            id.to_string(),
            Stored {
                owner: owner.to_string(),
                messages,
                response,
                bytes,
            },
        );
        Self::publish(&k);
        drop(k);
        // the dropped texts are freed after the lock
        drop(dropped);
        true
    }

    /// A kept response's conversation and response object (JSON texts), if `client` may see
    /// it.
    fn get(&self, id: &str, client: &str) -> Option<(Arc<str>, Arc<str>)> {
        let k = self.lock();
        k.map
            .get(id)
            .filter(|s| s.owner == Self::owner(client))
            .map(|s| (s.messages.clone(), s.response.clone()))
    }

    fn delete(&self, id: &str, client: &str) -> bool {
        let mut k = self.lock();
        if k.map.get(id).is_none_or(|s| s.owner != Self::owner(client)) {
            return false;
        }
        let gone = Self::take(&mut k, id);
        Self::publish(&k);
        drop(k);
        drop(gone);
        true
    }

    /// Responses kept, and their bytes.
    pub fn len_bytes(&self) -> (usize, usize) {
        let k = self.lock();
        (k.map.len(), k.bytes)
    }
}

fn not_found(id: &str) -> ApiError {
    ApiError::NoSuch(
        format!("Response with id '{}' not found", short(id)),
        "response_not_found",
    )
}

/// The chat message an answer's output items make: its text, its reasoning (as
/// `reasoning_content`, which reasoning models' templates render back) and its function calls,
/// under the call ids the client was given (a later `function_call_output` names them).
fn as_message(output: &[Value]) -> Value {
    let mut text = String::new();
    let mut reasoning = String::new();
    let mut calls = Vec::new();
    for o in output {
        match o["type"].as_str() {
            Some("message") => {
                for p in o["content"].as_array().into_iter().flatten() {
                    text.push_str(p["text"].as_str().unwrap_or_default());
                }
            }
            Some("reasoning") => {
                for p in o["content"].as_array().into_iter().flatten() {
                    reasoning.push_str(p["text"].as_str().unwrap_or_default());
                }
            }
            Some("function_call") => calls.push(json!({"id": o["call_id"], "type": "function",
                "function": {"name": o["name"], "arguments": o["arguments"]}})),
            _ => {}
        }
    }
    let mut m = if calls.is_empty() {
        json!({"role": "assistant", "content": text})
    } else {
        // as a function_call input item makes it (no text: null content)
        let content = if text.is_empty() {
            Value::Null
        } else {
            json!(text)
        };
        json!({"role": "assistant", "content": content, "tool_calls": calls})
    };
    if !reasoning.is_empty() {
        m["reasoning_content"] = json!(reasoning);
    }
    m
}

fn bad(m: impl Into<String>, param: &'static str) -> ApiError {
    ApiError::bad(m, Some(param))
}

/// The text of an input item's content: a string, or `input_text` / `output_text` parts.
fn content_text(c: &Value, at: &str) -> Result<String, ApiError> {
    match c {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => parts
            .iter()
            .enumerate()
            .map(|(j, p)| match p["type"].as_str() {
                Some("input_text" | "output_text" | "text") => match &p["text"] {
                    Value::String(t) => Ok(t.clone()),
                    x => Err(bad(
                        format!("{at}[{j}].text must be a string, got {x}"),
                        "input",
                    )),
                },
                Some(t) => Err(bad(
                    format!("{at}[{j}]: a part of type {t:?} is not supported (text only)"),
                    "input",
                )),
                None => Err(bad(format!("{at}[{j}] has no `type`"), "input")),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(|v| v.concat()),
        Value::Null => Err(bad(format!("{at} is required"), "input")),
        x => Err(bad(
            format!("{at} must be a string or parts, got {x}"),
            "input",
        )),
    }
}

/// At most 64 characters of a client's id, for an error message.
fn short(id: &str) -> String {
    match id.char_indices().nth(64) {
        Some((i, _)) => format!("{}...", &id[..i]),
        None => id.to_string(),
    }
}

/// A string field of an input item (named in the error when missing or not a string).
fn item_str<'a>(it: &'a Value, key: &str, at: &str) -> Result<&'a str, ApiError> {
    match &it[key] {
        Value::String(s) => Ok(s),
        Value::Null => Err(bad(format!("{at}.{key} is required"), "input")),
        x => Err(bad(
            format!("{at}.{key} must be a string, got {x}"),
            "input",
        )),
    }
}

/// The request's fields that would change the answer and that this gateway does not do: a
/// 400 naming the field rather than an answer that silently ignores it.
fn refuse_unsupported(v: &Value) -> Result<(), ApiError> {
    let set = |k: &str| v.get(k).is_some_and(|x| !x.is_null() && *x != json!(false));
    for (k, why) in [
        (
            "background",
            "`background` responses are not supported: send the request without it (the \
             response is answered when it is done, or streamed with `stream`)",
        ),
        (
            "conversation",
            "`conversation` objects are not supported: chain turns with \
             `previous_response_id`, or send the whole conversation as `input`",
        ),
        (
            "prompt",
            "stored prompt templates (`prompt`) are not supported: send the text as \
             `instructions` and `input`",
        ),
        (
            "max_tool_calls",
            "`max_tool_calls` is not supported: leave it out (the answer's calls are not capped)",
        ),
    ] {
        if set(k) {
            return Err(bad(why, k));
        }
    }
    if v.get("top_logprobs")
        .is_some_and(|x| x.as_u64() != Some(0) && !x.is_null())
    {
        return Err(bad(
            "log probabilities are not returned by /v1/responses (`top_logprobs`): use \
             /v1/chat/completions with `logprobs`",
            "top_logprobs",
        ));
    }
    if let Some(inc) = v.get("include").filter(|x| !x.is_null()) {
        let Some(list) = inc.as_array() else {
            return Err(bad(
                format!("`include` must be a list, got {inc}"),
                "include",
            ));
        };
        // what is asked that changes the answer's content; the others (encrypted reasoning,
        // search results, image URLs) are things this gateway has none of
        if let Some(x) = list
            .iter()
            .find(|x| x.as_str().is_some_and(|s| s.contains("logprobs")))
        {
            return Err(bad(
                format!(
                    "`include` {x} is not supported: /v1/responses returns no log \
                     probabilities (use /v1/chat/completions with `logprobs`)"
                ),
                "include",
            ));
        }
    }
    match v.get("truncation") {
        None | Some(Value::Null) => {}
        Some(t) if t == "disabled" => {}
        Some(t) => {
            return Err(bad(
                format!(
                    "`truncation` {t} is not supported (only \"disabled\": an input past the \
                     context is a 400, nothing is dropped from it)"
                ),
                "truncation",
            ))
        }
    }
    Ok(())
}

/// A 32-bit setting as a client wrote it: the shortest decimal that reads back as that f32
/// (0.7, not 0.699999988079071).
fn short_float(x: f32) -> Value {
    format!("{x}")
        .parse::<f64>()
        .map_or(Value::Null, |f| json!(f))
}

/// What the response object repeats of the request's settings (tools, tool_choice,
/// parallel_tool_calls, max_output_tokens, text, reasoning, truncation, user), as sent or
/// their defaults.
fn settings(v: &Value) -> serde_json::Map<String, Value> {
    let or = |k: &str, d: Value| v.get(k).filter(|x| !x.is_null()).cloned().unwrap_or(d);
    let mut m = serde_json::Map::new();
    m.insert("tools".into(), or("tools", json!([])));
    m.insert("tool_choice".into(), or("tool_choice", json!("auto")));
    m.insert(
        "parallel_tool_calls".into(),
        or("parallel_tool_calls", json!(true)),
    );
    m.insert(
        "max_output_tokens".into(),
        or("max_output_tokens", Value::Null),
    );
    m.insert(
        "text".into(),
        or("text", json!({"format": {"type": "text"}})),
    );
    m.insert(
        "reasoning".into(),
        or("reasoning", json!({"effort": null, "summary": null})),
    );
    m.insert("truncation".into(), json!("disabled"));
    m.insert("user".into(), or("user", Value::Null));
    m
}

/// `metadata`: at most 16 string pairs, keys up to 64 characters, values up to 512.
fn metadata(v: &Value) -> Result<Value, ApiError> {
    let m = match v.get("metadata") {
        None | Some(Value::Null) => return Ok(json!({})),
        Some(Value::Object(m)) => m,
        Some(x) => {
            return Err(bad(
                format!("`metadata` must be an object, got {x}"),
                "metadata",
            ))
        }
    };
    if m.len() > 16 {
        return Err(bad(
            format!("`metadata` holds {} pairs; at most 16", m.len()),
            "metadata",
        ));
    }
    for (k, x) in m {
        let ok = k.chars().count() <= 64 && x.as_str().is_some_and(|s| s.chars().count() <= 512);
        if !ok {
            return Err(bad(
                format!(
                    "`metadata` holds {:?}: keys are strings of up to 64 characters, values \
                     strings of up to 512",
                    short(k)
                ),
                "metadata",
            ));
        }
    }
    Ok(Value::Object(m.clone()))
}

/// A Responses request as the chat request the OpenAI chat route validates, and the
/// conversation it continues (`prior`, a kept response's) with its input added, without its
/// `instructions`.
fn to_chat(v: &Value, prior: &[Value]) -> Result<(Value, Vec<Value>), ApiError> {
    let system = match v.get("instructions") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(json!({"role": "system", "content": s})),
        Some(x) => {
            return Err(bad(
                format!("`instructions` must be a string, got {x}"),
                "instructions",
            ))
        }
    };
    let mut msgs = prior.to_vec();
    // the calls a function_call_output may answer: those of the kept conversation and of
    // this input
    let mut calls: std::collections::HashSet<String> = prior
        .iter()
        .flat_map(|m| m["tool_calls"].as_array().into_iter().flatten())
        .filter_map(|c| c["id"].as_str().map(str::to_string))
        .collect();
    match v.get("input") {
        Some(Value::String(s)) => msgs.push(json!({"role": "user", "content": s})),
        Some(Value::Array(items)) if items.is_empty() => {
            return Err(bad("`input` is empty", "input"))
        }
        Some(Value::Array(items)) => {
            for (i, it) in items.iter().enumerate() {
                let at = format!("input[{i}]");
                if !it.is_object() {
                    return Err(bad(
                        format!("{at} must be an item (an object), got {it}"),
                        "input",
                    ));
                }
                match it["type"].as_str() {
                    None if it.get("type").is_some_and(|t| !t.is_null()) => {
                        return Err(bad(format!("{at}.type must be a string"), "input"))
                    }
                    None | Some("message") => {
                        let role = it["role"].as_str().unwrap_or_default();
                        if !["user", "assistant", "system", "developer"].contains(&role) {
                            return Err(bad(format!("{at}.role {role:?} is not user, assistant, system or developer"), "input"));
                        }
                        let text = content_text(&it["content"], &format!("{at}.content"))?;
                        // consecutive assistant text and calls make one assistant turn
                        msgs.push(json!({"role": role, "content": text}));
                    }
                    Some("function_call") => {
                        let id = item_str(it, "call_id", &at)?;
                        let (name, arguments) =
                            (item_str(it, "name", &at)?, item_str(it, "arguments", &at)?);
                        calls.insert(id.to_string());
                        let call = json!({"id": id, "type": "function",
                            "function": {"name": name, "arguments": arguments}});
                        match msgs.last_mut() {
                            Some(m) if m["role"] == "assistant" => {
                                if !m["tool_calls"].is_array() {
                                    m["tool_calls"] = json!([]);
                                }
                                if let Some(a) = m["tool_calls"].as_array_mut() {
                                    a.push(call);
                                }
                            }
                            _ => msgs.push(
                                json!({"role": "assistant", "content": null, "tool_calls": [call]}),
                            ),
                        }
                    }
                    Some("function_call_output") => {
                        let id = item_str(it, "call_id", &at)?;
                        if !calls.contains(id) {
                            return Err(bad(
                                format!(
                                    "{at}: no function call with call_id {:?} comes before this \
                                     output",
                                    short(id)
                                ),
                                "input",
                            ));
                        }
                        msgs.push(json!({"role": "tool", "tool_call_id": id,
                            "content": content_text(&it["output"], &format!("{at}.output"))?}));
                    }
                    Some("reasoning") => {}
                    Some(t) => {
                        return Err(bad(
                            format!("{at}: an item of type {t:?} is not supported"),
                            "input",
                        ))
                    }
                }
            }
        }
        _ => return Err(bad("`input` must be a string or a list of items", "input")),
    }
    let convo = msgs.clone();
    if let Some(sys) = system {
        msgs.insert(0, sys);
    }
    let mut out =
        json!({"model": v.get("model").cloned().unwrap_or(Value::Null), "messages": msgs});
    if let Some(m) = v.get("max_output_tokens").filter(|m| !m.is_null()) {
        out["max_tokens"] = m.clone();
    }
    for k in [
        "temperature",
        "top_p",
        "stream",
        "parallel_tool_calls",
        "seed",
    ] {
        if let Some(x) = v.get(k) {
            out[k] = x.clone();
        }
    }
    if let Some(tools) = v.get("tools").and_then(|t| t.as_array()) {
        let mut t = Vec::new();
        for (i, tool) in tools.iter().enumerate() {
            if tool["type"].as_str() != Some("function") {
                return Err(bad(
                    format!(
                        "tools[{i}]: only function tools are supported, got {}",
                        tool["type"]
                    ),
                    "tools",
                ));
            }
            t.push(
                json!({"type": "function", "function": {"name": tool["name"],
                "description": tool.get("description").cloned().unwrap_or(Value::Null),
                "parameters": tool.get("parameters").cloned().unwrap_or(Value::Null),
                "strict": tool.get("strict").cloned().unwrap_or(Value::Null)}}),
            );
        }
        out["tools"] = Value::Array(t);
    }
    match v.get("tool_choice") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => out["tool_choice"] = json!(s),
        Some(c) if c["type"] == "function" => {
            out["tool_choice"] = json!({"type": "function", "function": {"name": c["name"]}})
        }
        Some(c) => {
            return Err(bad(
                format!("`tool_choice` {c} is not supported"),
                "tool_choice",
            ))
        }
    }
    if let Some(e) = v.get("reasoning").and_then(|r| r.get("effort")) {
        if !e.is_null() {
            out["reasoning_effort"] = e.clone();
        }
    }
    if let Some(f) = v
        .get("text")
        .and_then(|t| t.get("format"))
        .filter(|f| !f.is_null())
    {
        out["response_format"] = match f["type"].as_str() {
            Some("text") => json!({"type": "text"}),
            Some("json_object") => json!({"type": "json_object"}),
            Some("json_schema") => json!({"type": "json_schema",
                "json_schema": {"name": f["name"], "schema": f.get("schema").cloned().unwrap_or(Value::Null)}}),
            _ => {
                return Err(bad(
                    format!("text.format.type {} is not supported", f["type"]),
                    "text",
                ))
            }
        };
    }
    Ok((out, convo))
}

fn hex(st: &AppState) -> String {
    format!("{:032x}", random_id(st))
}

/// The output items of an answer's parts.
fn items(st: &AppState, parts: Vec<Part>) -> Vec<Value> {
    let mut out = Vec::new();
    let mut text = String::new();
    let flush = |text: &mut String, out: &mut Vec<Value>| {
        if !text.is_empty() {
            out.push(json!({"type": "message", "id": format!("msg_{}", hex(st)), "status": "completed", "role": "assistant",
                "content": [{"type": "output_text", "text": std::mem::take(text), "annotations": []}]}));
        }
    };
    for p in parts {
        match p {
            Part::Content(t) => text.push_str(&t),
            Part::Reasoning(t) => {
                flush(&mut text, &mut out);
                out.push(json!({"type": "reasoning", "id": format!("rs_{}", hex(st)),
                    "summary": [], "content": [{"type": "reasoning_text", "text": t}]}));
            }
            Part::Call { name, arguments } => {
                flush(&mut text, &mut out);
                out.push(function_call(st, &name, &arguments));
            }
            // merged into calls
            Part::CallStart { .. } | Part::CallArgs(_) | Part::CallEnd => {}
        }
    }
    flush(&mut text, &mut out);
    out
}

fn function_call(st: &AppState, name: &str, arguments: &str) -> Value {
    json!({"type": "function_call", "id": format!("fc_{}", hex(st)), "call_id": format!("call_{:024x}", random_id(st) >> 32),
           "name": name, "arguments": arguments, "status": "completed"})
}

/// What a response object repeats of its request, and where it is kept.
struct Echo {
    id: String,
    metadata: Value,
    /// The request's settings as sent ([`settings`]).
    settings: serde_json::Map<String, Value>,
    previous: Option<String>,
    instructions: Value,
    /// Kept with this conversation once it completes (None: `store: false`).
    keep: Option<Vec<Value>>,
    client: String,
}

impl Echo {
    /// Keeps the finished response `r` with its conversation and answer.
    fn keep(&mut self, st: &AppState, r: &Value) {
        if let Some(mut convo) = self.keep.take() {
            convo.push(as_message(r["output"].as_array().map_or(&[], |o| o)));
            if !st.responses.put(&self.id, &self.client, &convo, r) {
                tracing::warn!(
                    id = %self.id,
                    "response not kept: alone it is over --responses-store-mb"
                );
            }
        }
    }
}

/// The response object: `status` completed, or incomplete at max_output_tokens.
fn response(
    st: &AppState,
    e: &Echo,
    vr: &ValidRequest,
    mut output: Vec<Value>,
    finish: Option<&str>,
    completion: usize,
) -> Value {
    let (status, incomplete) = match finish {
        None => ("in_progress", Value::Null),
        Some("length") => ("incomplete", json!({"reason": "max_output_tokens"})),
        Some(_) => ("completed", Value::Null),
    };
    // the item the bound cut is incomplete too
    if status == "incomplete" {
        if let Some(last) = output.last_mut().filter(|o| o["type"] == "message") {
            last["status"] = json!("incomplete");
        }
    }
    let mut r = json!({"id": e.id, "object": "response", "created_at": now_secs(), "status": status, "model": st.cfg.model_name,
        "output": output, "incomplete_details": incomplete, "error": null, "instructions": e.instructions,
        "previous_response_id": e.previous, "store": e.keep.is_some(),
        "temperature": short_float(vr.temperature), "top_p": short_float(vr.top_p), "metadata": e.metadata,
        "usage": {"input_tokens": vr.prompt.len(), "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": vr.prompt.len() + completion}});
    if let Some(o) = r.as_object_mut() {
        o.extend(e.settings.clone());
    }
    r
}

/// `POST /v1/responses`.
pub(crate) async fn responses(State(st): State<Arc<AppState>>, req: Request) -> Response {
    handle(st, req)
        .instrument(tracing::info_span!("POST /v1/responses"))
        .await
        .unwrap_or_else(|e| {
            // what the chat route's checks name is named as this route's fields are
            let e = match e {
                ApiError::BadRequest {
                    message,
                    param: Some(p),
                } => match p {
                    "messages" => {
                        ApiError::bad(message.replace("`messages`", "`input`"), Some("input"))
                    }
                    "max_tokens" | "max_completion_tokens" => ApiError::bad(
                        message.replace(p, "max_output_tokens"),
                        Some("max_output_tokens"),
                    ),
                    "reasoning_effort" => ApiError::bad(
                        message.replace(p, "reasoning.effort"),
                        Some("reasoning.effort"),
                    ),
                    _ => ApiError::bad(message, Some(p)),
                },
                e => e.for_field("input"),
            };
            e.into_response()
        })
}

async fn handle(st: Arc<AppState>, req: Request) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let mut active = st.shutdown.enter();
    let client = crate::server::client_of(&req);
    let (v, turn) = read_json_turn(&st, req.into_body()).await?;
    let previous = match v.get("previous_response_id") {
        None | Some(Value::Null) => None,
        Some(Value::String(p)) => Some(p.clone()),
        Some(x) => {
            return Err(bad(
                format!("`previous_response_id` must be a string, got {x}"),
                "previous_response_id",
            ))
        }
    };
    let store = match v.get("store") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(x) => return Err(bad(format!("`store` must be a boolean, got {x}"), "store")),
    };
    let prior: Vec<Value> = match &previous {
        None => Vec::new(),
        Some(p) => match st.responses.get(p, &client) {
            Some((m, _)) => serde_json::from_str(&m)
                .map_err(|e| ApiError::Internal(format!("a kept conversation: {e}")))?,
            None => {
                return Err(ApiError::Invalid {
                    message: format!(
                        "Previous response with id '{}' not found (responses are kept in \
                         this gateway's memory, the oldest dropped past --responses-store-mb)",
                        short(p)
                    ),
                    param: "previous_response_id",
                    code: "previous_response_not_found",
                })
            }
        },
    };
    // converted (and the request's tree dropped) off the runtime: a large body takes a while
    let (chat, convo, instructions, metadata, settings) = crate::server::off_runtime(move || {
        refuse_unsupported(&v)?;
        let (chat, convo) = to_chat(&v, &prior)?;
        let instructions = v.get("instructions").cloned().unwrap_or(Value::Null);
        Ok((chat, convo, instructions, metadata(&v)?, settings(&v)))
    })
    .await?;
    let mut vr = validate_off_runtime(&st, chat, true).await?;
    drop(turn);
    crate::server::account(&st, &mut active, &mut vr, client.clone())?;
    let mut echo = Echo {
        id: format!("resp_{}", hex(&st)),
        metadata,
        settings,
        previous,
        instructions,
        keep: (store && st.responses.cap > 0).then_some(convo),
        client,
    };
    // the lane's request id is not the response's: a kept response's id reaches its
    // conversation (alone, on a gateway without keys), and lanes log their request ids
    let greq = generate_request(&vr, &format!("respgen_{}", hex(&st)));
    let deadline = arrived + st.cfg.retry_deadline;
    if !vr.stream {
        let c = tokio::select! {
            r = whole_choice(&st, &vr, &greq, deadline, true) => r?,
            _ = st.shutdown.aborted() => return Err(shutting_down()),
        };
        let (parts, _) = vr.split_answer(&c.text);
        let output = items(&st, parts);
        let r = response(&st, &echo, &vr, output, Some(&c.finish), c.completion);
        echo.keep(&st, &r);
        return Ok(Json(r).into_response());
    }
    crate::relay::open_stream(
        &st,
        &greq,
        deadline,
        active,
        |err| {
            let e = json!({"type": "error", "sequence_number": 0, "code": err.body()["error"]["code"],
                           "message": err.message(), "param": null});
            vec![SseEvent::default().event("error").data(e.to_string())]
        },
        move |st, lane, events, tries, tx| async move {
            stream(&st, &vr, echo, &lane, events, &tx, tries).await
        },
    )
    .await
}

/// The `{id}` of a path (a segment that is not UTF-8 is a 400 naming it).
type PathId = Result<axum::extract::Path<String>, axum::extract::rejection::PathRejection>;

/// A kept response's id and the client asking for it.
fn asked(id: PathId, req: &Request) -> Result<(String, String), ApiError> {
    let axum::extract::Path(id) = id.map_err(|e| ApiError::bad(e.body_text(), None))?;
    Ok((id, crate::server::client_of(req)))
}

/// `GET /v1/responses/{id}`: a kept response.
pub(crate) async fn retrieve(
    State(st): State<Arc<AppState>>,
    id: PathId,
    req: Request,
) -> Result<Response, ApiError> {
    let (id, client) = asked(id, &req)?;
    let (_, r) = st
        .responses
        .get(&id, &client)
        .ok_or_else(|| not_found(&id))?;
    Ok((
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        r.to_string(),
    )
        .into_response())
}

/// The input items of a kept conversation (its chat messages but the answer's own, the
/// last): user, system and developer messages as `message` items of `input_text`,
/// assistant turns as a `message` of `output_text` and a `function_call` item per call,
/// tool results as `function_call_output` items. Ids are the response's and the item's
/// place, the same on every listing.
fn input_items(id: &str, convo: &[Value]) -> Vec<Value> {
    let tail = id.strip_prefix("resp_").unwrap_or(id);
    let mut out = Vec::new();
    let text_of = |c: &Value| -> String {
        match c {
            Value::String(t) => t.clone(),
            Value::Array(parts) => parts
                .iter()
                .filter_map(|p| p["text"].as_str())
                .collect::<Vec<_>>()
                .concat(),
            _ => String::new(),
        }
    };
    let n = convo.len().saturating_sub(1);
    for m in &convo[..n] {
        let role = m["role"].as_str().unwrap_or_default();
        match role {
            "assistant" => {
                let text = text_of(&m["content"]);
                if !text.is_empty() {
                    out.push(
                        json!({"type": "message", "role": "assistant", "status": "completed",
                        "content": [{"type": "output_text", "text": text, "annotations": []}]}),
                    );
                }
                for c in m["tool_calls"].as_array().into_iter().flatten() {
                    out.push(json!({"type": "function_call", "status": "completed",
                        "call_id": c["id"], "name": c["function"]["name"],
                        "arguments": c["function"]["arguments"]}));
                }
            }
            "tool" => out.push(
                json!({"type": "function_call_output", "status": "completed",
                "call_id": m["tool_call_id"], "output": text_of(&m["content"])}),
            ),
            _ => out.push(
                json!({"type": "message", "role": role, "status": "completed",
                "content": [{"type": "input_text", "text": text_of(&m["content"])}]}),
            ),
        }
    }
    for (i, it) in out.iter_mut().enumerate() {
        let kind = match it["type"].as_str() {
            Some("function_call") => "fc",
            Some("function_call_output") => "fco",
            _ => "msg",
        };
        it["id"] = json!(format!("{kind}_{tail}_{i}"));
    }
    out
}

/// `GET /v1/responses/{id}/input_items`: the items a kept response answered, earlier turns'
/// included, a page at a time (`limit` 1 to 100, default 20; `order` desc, the default, or
/// asc; `after` / `before` an item id of the list).
pub(crate) async fn list_input_items(
    State(st): State<Arc<AppState>>,
    id: PathId,
    req: Request,
) -> Result<Json<Value>, ApiError> {
    let q = axum::extract::Query::<Vec<(String, String)>>::try_from_uri(req.uri())
        .map_err(|e| ApiError::bad(format!("the query: {}", e.body_text()), None))?
        .0;
    let (id, client) = asked(id, &req)?;
    let (convo, _) = st
        .responses
        .get(&id, &client)
        .ok_or_else(|| not_found(&id))?;
    let (mut limit, mut asc, mut after, mut before) = (20usize, false, None, None);
    let mut seen = std::collections::HashSet::new();
    for (k, v) in &q {
        let known = ["limit", "order", "after", "before"];
        if let Some(&name) = known.iter().find(|n| **n == k.as_str()) {
            if !seen.insert(name) {
                return Err(bad(format!("{name} is given more than once"), name));
            }
        }
        match k.as_str() {
            "limit" => {
                limit = v
                    .parse::<usize>()
                    .ok()
                    .filter(|l| (1..=100).contains(l))
                    .ok_or_else(|| {
                        bad(
                            format!("limit must be an integer in 1..=100, got {:?}", short(v)),
                            "limit",
                        )
                    })?
            }
            "order" => {
                asc = match v.as_str() {
                    "asc" => true,
                    "desc" => false,
                    _ => {
                        return Err(bad(
                            format!("order must be asc or desc, got {:?}", short(v)),
                            "order",
                        ))
                    }
                }
            }
            "after" => after = Some(v.clone()),
            "before" => before = Some(v.clone()),
            // what else OpenAI takes (`include`) changes nothing here
            _ => {}
        }
    }
    let convo: Vec<Value> = serde_json::from_str(&convo)
        .map_err(|e| ApiError::Internal(format!("a kept conversation: {e}")))?;
    let mut items = input_items(&id, &convo);
    if !asc {
        items.reverse();
    }
    let at = |cursor: &Option<String>, name: &'static str| -> Result<Option<usize>, ApiError> {
        cursor
            .as_ref()
            .map(|c| {
                items
                    .iter()
                    .position(|it| it["id"] == c.as_str())
                    .ok_or_else(|| {
                        bad(
                            format!("{name}: no item {:?} in this response's input", short(c)),
                            name,
                        )
                    })
            })
            .transpose()
    };
    let lo = at(&after, "after")?.map_or(0, |i| i + 1);
    let hi = at(&before, "before")?.unwrap_or(items.len()).max(lo);
    let page: Vec<Value> = items[lo..hi].iter().take(limit).cloned().collect();
    let has_more = hi - lo > page.len();
    Ok(Json(json!({
        "object": "list",
        "first_id": page.first().map(|i| i["id"].clone()),
        "last_id": page.last().map(|i| i["id"].clone()),
        "has_more": has_more,
        "data": page,
    })))
}

/// `DELETE /v1/responses/{id}`: forgets a kept response.
pub(crate) async fn delete(
    State(st): State<Arc<AppState>>,
    id: PathId,
    req: Request,
) -> Result<Json<Value>, ApiError> {
    let (id, client) = asked(id, &req)?;
    if !st.responses.delete(&id, &client) {
        return Err(not_found(&id));
    }
    Ok(Json(
        json!({"id": id, "object": "response", "deleted": true}),
    ))
}

/// The stream's writer: numbered events, the output items so far.
struct Events<'a> {
    st: &'a AppState,
    tx: &'a tokio::sync::mpsc::Sender<SseEvent>,
    seq: u64,
    output: Vec<Value>,
    /// The open message item (its index in `output`) and its text so far.
    text: Option<(usize, String)>,
    /// The open reasoning item and its text so far.
    reasoning: Option<(usize, String)>,
    /// The function call whose arguments are streaming, and its arguments so far.
    call: Option<(usize, String)>,
}

impl Events<'_> {
    async fn emit(&mut self, kind: &str, mut v: Value) -> bool {
        v["type"] = json!(kind);
        v["sequence_number"] = json!(self.seq);
        self.seq += 1;
        put(
            self.tx,
            SseEvent::default().event(kind).data(v.to_string()),
            &self.st.shutdown,
        )
        .await
    }

    /// Closes the open reasoning item.
    async fn close_reasoning(&mut self) -> bool {
        let Some((i, text)) = self.reasoning.take() else {
            return true;
        };
        let item_id = self.output[i]["id"].clone();
        self.output[i]["content"] = json!([{"type": "reasoning_text", "text": text}]);
        let item = self.output[i].clone();
        self.emit(
            "response.reasoning_text.done",
            json!({"item_id": item_id, "output_index": i, "content_index": 0, "text": text}),
        )
        .await
            && self
                .emit(
                    "response.output_item.done",
                    json!({"output_index": i, "item": item}),
                )
                .await
    }

    /// Ends the function call whose arguments were streaming.
    async fn close_call(&mut self) -> bool {
        let Some((i, args)) = self.call.take() else {
            return true;
        };
        self.output[i]["arguments"] = json!(args);
        self.output[i]["status"] = json!("completed");
        let id = self.output[i]["id"].clone();
        let done = self.output[i].clone();
        self.emit(
            "response.function_call_arguments.done",
            json!({"item_id": id, "output_index": i, "arguments": args}),
        )
        .await
            && self
                .emit(
                    "response.output_item.done",
                    json!({"output_index": i, "item": done}),
                )
                .await
    }

    /// Closes the open message item.
    async fn close_text(&mut self) -> bool {
        self.close_text_as("completed").await
    }

    /// Closes the open message item with `status` (`incomplete`: the answer's bound cut it).
    async fn close_text_as(&mut self, status: &str) -> bool {
        let Some((i, text)) = self.text.take() else {
            return true;
        };
        let item_id = self.output[i]["id"].clone();
        let part = json!({"type": "output_text", "text": text, "annotations": []});
        self.output[i]["content"] = json!([part]);
        self.output[i]["status"] = json!(status);
        let item = self.output[i].clone();
        self.emit("response.output_text.done", json!({"item_id": item_id, "output_index": i, "content_index": 0, "text": text})).await
            && self.emit("response.content_part.done", json!({"item_id": item_id, "output_index": i, "content_index": 0, "part": part})).await
            && self.emit("response.output_item.done", json!({"output_index": i, "item": item})).await
    }

    async fn parts(&mut self, parts: Vec<Part>) -> bool {
        for p in moelane_text::agent::as_streamed(parts) {
            let ok = match p {
                Part::Content(t) => {
                    if !(self.close_reasoning().await && self.close_call().await) {
                        return false;
                    }
                    if self.text.is_none() {
                        let item = json!({"type": "message", "id": format!("msg_{}", hex(self.st)), "status": "in_progress",
                                          "role": "assistant", "content": []});
                        self.output.push(item.clone());
                        let i = self.output.len() - 1;
                        self.text = Some((i, String::new()));
                        if !(self.emit("response.output_item.added", json!({"output_index": i, "item": item})).await
                            && self.emit("response.content_part.added", json!({"item_id": self.output[i]["id"], "output_index": i,
                                "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}})).await)
                        {
                            return false;
                        }
                    }
                    let Some((i, text)) = self.text.as_mut() else {
                        return false;
                    };
                    text.push_str(&t);
                    let i = *i;
                    self.emit(
                        "response.output_text.delta",
                        json!({"item_id": self.output[i]["id"], "output_index": i,
                        "content_index": 0, "delta": t}),
                    )
                    .await
                }
                Part::Reasoning(t) => {
                    if !(self.close_text().await && self.close_call().await) {
                        return false;
                    }
                    if self.reasoning.is_none() {
                        let item = json!({"type": "reasoning", "id": format!("rs_{}", hex(self.st)),
                                          "summary": [], "content": []});
                        self.output.push(item.clone());
                        let i = self.output.len() - 1;
                        self.reasoning = Some((i, String::new()));
                        if !self
                            .emit(
                                "response.output_item.added",
                                json!({"output_index": i, "item": item}),
                            )
                            .await
                        {
                            return false;
                        }
                    }
                    let Some((i, text)) = self.reasoning.as_mut() else {
                        return false;
                    };
                    text.push_str(&t);
                    let i = *i;
                    self.emit(
                        "response.reasoning_text.delta",
                        json!({"item_id": self.output[i]["id"], "output_index": i, "content_index": 0, "delta": t}),
                    )
                    .await
                }
                Part::CallStart { name } => {
                    if !(self.close_text().await
                        && self.close_reasoning().await
                        && self.close_call().await)
                    {
                        return false;
                    }
                    let mut item = function_call(self.st, &name, "");
                    item["status"] = json!("in_progress");
                    self.output.push(item.clone());
                    let i = self.output.len() - 1;
                    self.call = Some((i, String::new()));
                    self.emit(
                        "response.output_item.added",
                        json!({"output_index": i, "item": item}),
                    )
                    .await
                }
                Part::CallArgs(a) => {
                    let Some((i, args)) = self.call.as_mut() else {
                        continue;
                    };
                    args.push_str(&a);
                    let i = *i;
                    let id = self.output[i]["id"].clone();
                    self.emit(
                        "response.function_call_arguments.delta",
                        json!({"item_id": id, "output_index": i, "delta": a}),
                    )
                    .await
                }
                Part::CallEnd => self.close_call().await,
                // whole calls come as streamed ones (as_streamed)
                Part::Call { .. } => true,
            };
            if !ok {
                return false;
            }
        }
        true
    }
}

impl PartSink for Events<'_> {
    fn send(&mut self, parts: Vec<Part>) -> impl std::future::Future<Output = bool> + Send {
        self.parts(parts)
    }
    fn closed(&self) -> impl std::future::Future<Output = ()> + Send + '_ {
        self.tx.closed()
    }
}

/// Relays a lane's events as the Responses stream: response.created, output items with their
/// deltas, response.completed (or response.incomplete at max_output_tokens); an `error` event
/// when the answer is cut.
async fn stream(
    st: &AppState,
    vr: &ValidRequest,
    mut echo: Echo,
    lane: &str,
    events: crate::lane::EventStream,
    tx: &tokio::sync::mpsc::Sender<SseEvent>,
    tries: Tries,
) {
    let mut w = Events {
        st,
        tx,
        seq: 0,
        output: Vec::new(),
        text: None,
        reasoning: None,
        call: None,
    };
    let created = response(st, &echo, vr, Vec::new(), None, 0);
    if !(w
        .emit("response.created", json!({"response": created}))
        .await
        && w.emit("response.in_progress", json!({"response": created}))
            .await)
    {
        return;
    }
    let end = relay_parts(st, vr, lane, events, tries, &mut w).await;
    if end.left {
        return;
    }
    if let Some(err) = end.failed {
        w.emit(
            "error",
            json!({"code": "server_error", "message": err.message(), "param": null}),
        )
        .await;
        return;
    }
    let fin = end.finish.unwrap_or_else(|| "stop".into());
    // the item the bound cut is incomplete, in its own event as in the response
    let last = if fin == "length" {
        "incomplete"
    } else {
        "completed"
    };
    if !(w.close_text_as(last).await && w.close_reasoning().await && w.close_call().await) {
        return;
    }
    let done = response(
        st,
        &echo,
        vr,
        std::mem::take(&mut w.output),
        Some(&fin),
        end.completion,
    );
    echo.keep(st, &done);
    let kind = if fin == "length" {
        "response.incomplete"
    } else {
        "response.completed"
    };
    w.emit(kind, json!({"response": done})).await;
}
