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

/// One chat message.
#[derive(Clone, Debug, Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
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
        let t = self
            .env
            .get_template("chat")
            .map_err(|e| ChatError::Template(e.to_string()))?;
        t.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => self.bos,
            eos_token => self.eos,
            tools => minijinja::Value::UNDEFINED,
        })
        .map_err(|e| ChatError::Template(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chatml_default_and_python_methods() {
        let t = ChatTemplate::new(CHATML.into(), String::new(), String::new()).unwrap();
        let s = t
            .render(&[ChatMessage {
                role: "user".into(),
                content: "hi".into(),
            }])
            .unwrap();
        assert_eq!(s, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
        // templates from the hub use Python string methods and namespace()
        let src = "{%- set ns = namespace(n=0) %}{%- for m in messages %}{%- if m.content.startswith('x') %}{%- set ns.n = ns.n + 1 %}{%- endif %}{{ m.content.strip() }}{%- endfor %}|{{ ns.n }}";
        let t = ChatTemplate::new(src.into(), String::new(), String::new()).unwrap();
        let s = t
            .render(&[
                ChatMessage {
                    role: "user".into(),
                    content: " xa ".into(),
                },
                ChatMessage {
                    role: "user".into(),
                    content: "xb".into(),
                },
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
