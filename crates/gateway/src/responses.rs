//! The OpenAI Responses API (`POST /v1/responses`), on the chat route's validation, lanes,
//! grammars and answer splitting: `input` (a string, or message, `function_call` and
//! `function_call_output` items), `instructions`, `tools` (functions), `tool_choice`,
//! `text.format` (JSON schema) are translated into a chat request, and the answer comes back
//! as output items (`reasoning`, `message` with `output_text`, `function_call`), whole or as
//! its stream of events. Nothing is stored: `previous_response_id` and `store: true` beyond
//! the request are refused.

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
    validate_off_runtime, whole_choice, AppState, ToolMode, Tries, ValidRequest,
};

fn bad(m: impl Into<String>, param: &'static str) -> ApiError {
    ApiError::bad(m, Some(param))
}

/// The text of an input item's content: a string, or `input_text` / `output_text` parts.
fn content_text(c: &Value, at: &str) -> Result<String, ApiError> {
    match c {
        Value::String(s) => Ok(s.clone()),
        Value::Null => Ok(String::new()),
        Value::Array(parts) => parts
            .iter()
            .map(|p| match p["type"].as_str() {
                Some("input_text" | "output_text" | "text") => {
                    Ok(p["text"].as_str().unwrap_or_default().to_string())
                }
                t => Err(bad(format!("{at}: a {t:?} part is not supported"), "input")),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(|v| v.concat()),
        x => Err(bad(
            format!("{at} must be a string or parts, got {x}"),
            "input",
        )),
    }
}

/// A Responses request as the chat request the OpenAI chat route validates.
fn to_chat(v: &Value) -> Result<Value, ApiError> {
    if v.get("previous_response_id").is_some_and(|x| !x.is_null()) {
        return Err(bad(
            "`previous_response_id` needs stored responses, which this server does not keep; \
             send the whole conversation in `input`",
            "previous_response_id",
        ));
    }
    let mut msgs = Vec::new();
    match v.get("instructions") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => msgs.push(json!({"role": "system", "content": s})),
        Some(x) => {
            return Err(bad(
                format!("`instructions` must be a string, got {x}"),
                "instructions",
            ))
        }
    }
    match v.get("input") {
        Some(Value::String(s)) => msgs.push(json!({"role": "user", "content": s})),
        Some(Value::Array(items)) => {
            for (i, it) in items.iter().enumerate() {
                let at = format!("input[{i}]");
                match it["type"].as_str() {
                    None | Some("message") => {
                        let role = it["role"].as_str().unwrap_or_default();
                        if !["user", "assistant", "system", "developer"].contains(&role) {
                            return Err(bad(format!("{at}.role {role:?} is not user, assistant, system or developer"), "input"));
                        }
                        let text = content_text(&it["content"], &at)?;
                        // consecutive assistant text and calls make one assistant turn
                        msgs.push(json!({"role": role, "content": text}));
                    }
                    Some("function_call") => {
                        let call = json!({"id": it["call_id"], "type": "function",
                            "function": {"name": it["name"], "arguments": it["arguments"].as_str().unwrap_or("{}")}});
                        match msgs.last_mut() {
                            Some(m) if m["role"] == "assistant" => {
                                if !m["tool_calls"].is_array() {
                                    m["tool_calls"] = json!([]);
                                }
                                if let Some(a) = m["tool_calls"].as_array_mut() {
                                    a.push(call);
                                }
                            }
                            _ => msgs.push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
                        }
                    }
                    Some("function_call_output") => msgs.push(json!({"role": "tool",
                        "tool_call_id": it["call_id"], "content": content_text(&it["output"], &at)?})),
                    Some("reasoning") => {}
                    Some(t) => return Err(bad(format!("{at}: an item of type {t:?} is not supported"), "input")),
                }
            }
        }
        _ => return Err(bad("`input` must be a string or a list of items", "input")),
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
    Ok(out)
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

/// The response object: `status` completed, or incomplete at max_output_tokens.
fn response(
    st: &AppState,
    id: &str,
    vr: &ValidRequest,
    output: Vec<Value>,
    finish: Option<&str>,
    completion: usize,
) -> Value {
    let (status, incomplete) = match finish {
        None => ("in_progress", Value::Null),
        Some("length") => ("incomplete", json!({"reason": "max_output_tokens"})),
        Some(_) => ("completed", Value::Null),
    };
    json!({"id": id, "object": "response", "created_at": now_secs(), "status": status, "model": st.cfg.model_name,
        "output": output, "incomplete_details": incomplete, "error": null, "instructions": null,
        "parallel_tool_calls": true, "tool_choice": if vr.tool_mode == ToolMode::Off { "none" } else { "auto" },
        "tools": [], "temperature": vr.temperature, "top_p": vr.top_p, "metadata": {},
        "usage": {"input_tokens": vr.prompt.len(), "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": vr.prompt.len() + completion}})
}

/// `POST /v1/responses`.
pub(crate) async fn responses(State(st): State<Arc<AppState>>, req: Request) -> Response {
    handle(st, req)
        .instrument(tracing::info_span!("POST /v1/responses"))
        .await
        .unwrap_or_else(|e| e.for_field("input").into_response())
}

async fn handle(st: Arc<AppState>, req: Request) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let mut active = st.shutdown.enter();
    let client = crate::server::client_of(&req);
    let (v, turn) = read_json_turn(&st, req.into_body()).await?;
    let chat = to_chat(&v)?;
    drop(v);
    let mut vr = validate_off_runtime(&st, chat, true).await?;
    drop(turn);
    crate::server::account(&st, &mut active, &mut vr, client)?;
    let id = format!("resp_{}", hex(&st));
    let greq = generate_request(&vr, &id);
    let deadline = arrived + st.cfg.retry_deadline;
    if !vr.stream {
        let c = tokio::select! {
            r = whole_choice(&st, &vr, &greq, deadline, true) => r?,
            _ = st.shutdown.aborted() => return Err(shutting_down()),
        };
        let (parts, _) = vr.split_answer(&c.text);
        let output = items(&st, parts);
        return Ok(Json(response(
            &st,
            &id,
            &vr,
            output,
            Some(&c.finish),
            c.completion,
        ))
        .into_response());
    }
    crate::relay::open_stream(
        &st,
        &greq,
        deadline,
        active,
        move |st, lane, events, tries, tx| async move {
            stream(&st, &vr, &id, &lane, events, &tx, tries).await
        },
    )
    .await
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
        let Some((i, text)) = self.text.take() else {
            return true;
        };
        let item_id = self.output[i]["id"].clone();
        let part = json!({"type": "output_text", "text": text, "annotations": []});
        self.output[i]["content"] = json!([part]);
        self.output[i]["status"] = json!("completed");
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
    id: &str,
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
    let created = response(st, id, vr, Vec::new(), None, 0);
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
            json!({"code": "server_error", "message": err.to_string(), "param": null}),
        )
        .await;
        return;
    }
    if !(w.close_text().await && w.close_reasoning().await && w.close_call().await) {
        return;
    }
    let fin = end.finish.unwrap_or_else(|| "stop".into());
    let done = response(
        st,
        id,
        vr,
        std::mem::take(&mut w.output),
        Some(&fin),
        end.completion,
    );
    let kind = if fin == "length" {
        "response.incomplete"
    } else {
        "response.completed"
    };
    w.emit(kind, json!({"response": done})).await;
}
