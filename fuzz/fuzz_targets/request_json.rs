//! The gateway's request validation: a body of /v1/chat/completions or /v1/completions,
//! parsed, the chat rendered by the checkpoint's template, the prompt tokenised and every
//! parameter checked: an OpenAI error or a valid request, never a panic. The input is sent
//! twice: as the raw body, and as the text of a well-formed body's messages, prompt and stop
//! strings (where random bytes would rarely reach past the JSON parser).
#![no_main]
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use moelane_gateway::registry::Registry;
use moelane_gateway::server::validate_body;
use moelane_gateway::{AppState, GatewayConfig};
use serde_json::json;

struct Fixture {
    st: AppState,
    _rt: tokio::runtime::Runtime,
    _dir: tempfile::TempDir,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        use kameo::actor::Spawn;
        let dir = tempfile::tempdir().expect("temp dir");
        let p = moelane_engine::synth::Preset::by_name("tiny").expect("tiny");
        moelane_engine::synth::generate(&p, 1, dir.path()).expect("generate tiny");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let registry = {
            let _g = rt.enter();
            Registry::spawn(Registry::default())
        };
        let st = AppState::new(
            GatewayConfig {
                model_name: "tiny".into(),
                max_context: 2048,
                max_body: 1 << 20,
                default_completion_tokens: 16,
                default_temperature: 1.0,
                default_top_p: 1.0,
                default_top_k: 0,
                max_attempts: 3,
                retry_deadline: std::time::Duration::from_secs(10),
                body_timeout: std::time::Duration::from_secs(2),
                max_client_requests: 0,
                responses_store_bytes: 0,
                stream_stall: std::time::Duration::from_secs(60),
            },
            moelane_text::tokenizer::Tokenizer::from_file(&dir.path().join("tokenizer.json"))
                .expect("tokenizer"),
            moelane_text::chat::ChatTemplate::from_dir(dir.path()).expect("template"),
            registry,
        );
        Fixture {
            st,
            _rt: rt,
            _dir: dir,
        }
    })
}

fuzz_target!(|data: &[u8]| {
    let st = &fixture().st;
    let _ = validate_body(st, data, true);
    let _ = validate_body(st, data, false);
    let text = String::from_utf8_lossy(data);
    let n = data.first().copied().unwrap_or(0);
    let chat = json!({"model": "tiny", "messages": [
        {"role": "system", "content": text},
        {"role": if n % 2 == 0 { "user" } else { "assistant" }, "content": [{"type": "text", "text": text}]},
        {"role": "user", "content": text}],
        "max_tokens": (n as u64) * 16, "stop": [text], "logprobs": n % 3 == 0, "top_logprobs": n % 25,
        "n": n % 20, "logit_bias": {text.to_string(): n as i64 - 128}, "seed": n});
    let _ = validate_body(st, chat.to_string().as_bytes(), true);
    // agent fields: the text as a tool's name and parameter, as a schema when it parses
    let schema: serde_json::Value =
        serde_json::from_slice(data).unwrap_or_else(|_| json!({"type": "object"}));
    let choice = match n % 4 {
        0 => json!("auto"),
        1 => json!("required"),
        2 => json!({"type": "function", "function": {"name": text}}),
        _ => json!("none"),
    };
    let agent = json!({"model": "tiny", "max_tokens": 8,
        "messages": [{"role": "user", "content": text},
                     {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function",
                        "function": {"name": text, "arguments": text}}]},
                     {"role": "tool", "tool_call_id": text, "content": text}],
        "tools": [{"type": "function", "function": {"name": text, "parameters": schema}},
                  {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                     "properties": {text.to_string(): {"type": "string"}}}}}],
        "tool_choice": choice, "parallel_tool_calls": n % 2 == 0,
        "chat_template_kwargs": {"enable_thinking": n % 3 == 0},
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}});
    let _ = validate_body(st, agent.to_string().as_bytes(), true);
    let completion = json!({"model": "tiny", "prompt": text, "echo": n % 2 == 0, "logprobs": n % 7,
        "max_tokens": n, "frequency_penalty": (n as f64 - 128.0) / 32.0});
    let _ = validate_body(st, completion.to_string().as_bytes(), false);
});
