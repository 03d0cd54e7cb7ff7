//! Chat templates: `chat_template.jinja` or `tokenizer_config.json`'s `chat_template`
//! (a string, or a list of named templates: "default" is used), rendered with minijinja
//! and Python-compatible string methods; ChatML when the checkpoint has none.

use std::path::Path;

use serde::Serialize;

/// ChatML, the format Qwen models use.
pub const CHATML: &str = "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("chat template: {0}")]
    Template(String),
}

/// One chat message, with the fields agent turns carry (absent, not null, when unset, as
/// templates test them with `is defined`).
#[derive(Clone, Debug, Default, Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant turn's calls, as the client sent them (`[{id, type, function: {name,
    /// arguments}}]`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// A tool turn: the call it answers, and the tool's name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An assistant turn's reasoning, when the client sends it back.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

impl ChatMessage {
    /// A plain message.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            ..Default::default()
        }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    pub source: String,
    bos: String,
    eos: String,
}

fn token_text(v: Option<&serde_json::Value>) -> String {
    match v {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Object(o)) => o
            .get("content")
            .and_then(|c| c.as_str())
            .unwrap_or_default()
            .to_string(),
        _ => String::new(),
    }
}

impl ChatTemplate {
    /// Finds the template of a checkpoint directory.
    pub fn from_dir(dir: &Path) -> Result<Self, ChatError> {
        let cfg: Option<serde_json::Value> = std::fs::read(dir.join("tokenizer_config.json"))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok());
        let mut src = std::fs::read_to_string(dir.join("chat_template.jinja")).ok();
        if src.is_none() {
            src = match cfg.as_ref().and_then(|c| c.get("chat_template")) {
                Some(serde_json::Value::String(s)) => Some(s.clone()),
                Some(serde_json::Value::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .or(list.first())
                    .and_then(|t| t.get("template").and_then(|t| t.as_str()).map(String::from)),
                _ => None,
            };
        }
        let bos = token_text(cfg.as_ref().and_then(|c| c.get("bos_token")));
        let eos = token_text(cfg.as_ref().and_then(|c| c.get("eos_token")));
        Self::new(src.unwrap_or_else(|| CHATML.to_string()), bos, eos)
    }

    pub fn new(source: String, bos: String, eos: String) -> Result<Self, ChatError> {
        let mut env = minijinja::Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template_owned("chat", source.clone())
            .map_err(|e| ChatError::Template(e.to_string()))?;
        Ok(ChatTemplate {
            env,
            source,
            bos,
            eos,
        })
    }

    /// Renders messages, with the assistant's turn opened.
    pub fn render(&self, messages: &[ChatMessage]) -> Result<String, ChatError> {
        self.render_with(messages, None, &serde_json::Map::new())
    }

    /// Renders messages with `tools` (OpenAI's `[{type: function, function: {name,
    /// description, parameters}}]`) and the template's own variables (`kwargs`, e.g. Qwen3's
    /// `enable_thinking`), as transformers' `apply_chat_template` passes them.
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, ChatError> {
        let t = self
            .env
            .get_template("chat")
            .map_err(|e| ChatError::Template(e.to_string()))?;
        let mut ctx: std::collections::BTreeMap<String, minijinja::Value> = kwargs
            .iter()
            .map(|(k, v)| (k.clone(), minijinja::Value::from_serialize(v)))
            .collect();
        ctx.insert(
            "messages".into(),
            minijinja::Value::from_serialize(messages),
        );
        ctx.insert("add_generation_prompt".into(), true.into());
        ctx.insert("bos_token".into(), self.bos.clone().into());
        ctx.insert("eos_token".into(), self.eos.clone().into());
        ctx.insert(
            "tools".into(),
            tools.map_or(
                minijinja::Value::UNDEFINED,
                minijinja::Value::from_serialize,
            ),
        );
        t.render(ctx)
            .map_err(|e| ChatError::Template(e.to_string()))
    }

    /// Whether the template knows the tool turns (it reads `tools`).
    pub fn takes_tools(&self) -> bool {
        self.source.contains("tools")
    }

    /// Whether the template knows a thinking block (`<think>`).
    pub fn thinks(&self) -> bool {
        self.source.contains("<think>")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chatml_default_and_python_methods() {
        let t = ChatTemplate::new(CHATML.into(), String::new(), String::new()).unwrap();
        let s = t.render(&[ChatMessage::new("user", "hi")]).unwrap();
        assert_eq!(s, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
        // templates from the hub use Python string methods and namespace()
        let src = "{%- set ns = namespace(n=0) %}{%- for m in messages %}{%- if m.content.startswith('x') %}{%- set ns.n = ns.n + 1 %}{%- endif %}{{ m.content.strip() }}{%- endfor %}|{{ ns.n }}";
        let t = ChatTemplate::new(src.into(), String::new(), String::new()).unwrap();
        let s = t
            .render(&[
                ChatMessage::new("user", " xa "),
                ChatMessage::new("user", "xb"),
            ])
            .unwrap();
        assert_eq!(s, "xaxb|1");
        // a template that raises gives an error, not a panic
        let t = ChatTemplate::new(
            "{{ raise_exception('no system role') }}".into(),
            String::new(),
            String::new(),
        )
        .unwrap();
        assert!(t.render(&[]).is_err());
    }
}
