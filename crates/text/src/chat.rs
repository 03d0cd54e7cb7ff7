//! Chat templates: `chat_template.jinja`, else `chat_template.json`'s or
//! `tokenizer_config.json`'s `chat_template` (a string, or a list of named templates:
//! "tool_use" for a request with tools where the list has one, or where
//! `additional_chat_templates/tool_use.jinja` is, else "default", as transformers chooses),
//! rendered with minijinja
//! the way transformers' `apply_chat_template` renders them with Jinja2: blocks trimmed
//! (`trim_blocks`, `lstrip_blocks`), Python's string methods, `tojson` as Python's
//! `json.dumps` writes (`", "` and `": "`, no HTML escaping, `indent`), `raise_exception`,
//! `strftime_now`, dictionaries in their insertion order, lists and dicts printed as Python's
//! `repr`; a call's `arguments` sent as JSON text are given to the template as the object
//! they hold (templates iterate them). Not matched: Python's `%` string formatting (an error
//! here). ChatML when the checkpoint has none. [`crate::templates`] holds templates of each
//! family.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::agent::Markup;

/// ChatML, the format Qwen models use.
pub const CHATML: &str = "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("chat template: {0}")]
    Template(String),
}

/// One chat message, with the fields agent turns carry (absent, not null, when unset, as
/// templates test them with `is defined`).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
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

/// The instructions one render of a chat template may run ([`ChatTemplate::new`]).
pub const TEMPLATE_FUEL: u64 = 100_000_000;

/// A compiled chat template.
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    pub source: String,
    /// A checkpoint's template named "tool_use" (beside its "default", the `source`): the
    /// one rendered when a request has tools.
    pub tool_use: Option<String>,
    bos: String,
    eos: String,
    /// The family's reasoning and tool-call markup, chosen from the template (and the
    /// checkpoint's `model_type`).
    pub markup: Markup,
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
        // a file that is there but cannot be read (not a regular file, too large, not UTF-8)
        // or is not JSON is an error naming it, not a silent default
        let side = |name: &str| -> Result<Option<String>, ChatError> {
            let path = dir.join(name);
            match crate::files::read_bounded_text(&path, crate::files::CONFIG_LIMIT) {
                Ok(t) => Ok(Some(t)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(ChatError::Template(format!("{}: {e}", path.display()))),
            }
        };
        let json_file = |name: &str| -> Result<Option<serde_json::Value>, ChatError> {
            match side(name)? {
                None => Ok(None),
                Some(t) => serde_json::from_str(&t)
                    .map(Some)
                    .map_err(|e| ChatError::Template(format!("{}: {e}", dir.join(name).display()))),
            }
        };
        let cfg = json_file("tokenizer_config.json")?;
        let mut src = side("chat_template.jinja")?;
        // a processor's `chat_template.json` (`{"chat_template": ...}`), else the tokenizer's
        let json = json_file("chat_template.json")?;
        let listed = json
            .as_ref()
            .and_then(|j| j.get("chat_template"))
            .or_else(|| cfg.as_ref().and_then(|c| c.get("chat_template")));
        // newer transformers write named templates beside the default one, as files
        let mut tool_use = side("additional_chat_templates/tool_use.jinja")?;
        if src.is_none() {
            src = match listed {
                Some(serde_json::Value::String(s)) => Some(s.clone()),
                Some(serde_json::Value::Array(list)) => {
                    let named = |name: &str| {
                        list.iter()
                            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some(name))
                            .and_then(|t| t.get("template")?.as_str().map(String::from))
                    };
                    tool_use = tool_use.or_else(|| named("tool_use"));
                    named("default").or_else(|| {
                        list.first()
                            .and_then(|t| t.get("template")?.as_str().map(String::from))
                    })
                }
                None | Some(serde_json::Value::Null) => None,
                Some(other) => {
                    let kind = match other {
                        serde_json::Value::Bool(_) => "a boolean",
                        serde_json::Value::Number(_) => "a number",
                        _ => "an object",
                    };
                    return Err(ChatError::Template(format!(
                        "chat_template is {kind}: a template is a string, or a list of \
                         {{\"name\", \"template\"}}"
                    )));
                }
            };
        }
        if src.as_deref().is_some_and(|s| s.trim().is_empty()) {
            return Err(ChatError::Template(
                "the chat template is empty: every chat would render no prompt".into(),
            ));
        }
        let bos = token_text(cfg.as_ref().and_then(|c| c.get("bos_token")));
        let eos = token_text(cfg.as_ref().and_then(|c| c.get("eos_token")));
        let model_type: Option<String> = json_file("config.json")
            .ok()
            .flatten()
            .and_then(|c| c.get("model_type")?.as_str().map(String::from));
        let src = src.unwrap_or_else(|| {
            // said once at load: transformers refuses such a chat, a server that guesses
            // must say what it guessed
            eprintln!(
                "moelane: {} has no chat template (chat_template.jinja, chat_template.json or \
                 tokenizer_config.json's chat_template): chats are rendered as ChatML",
                dir.display()
            );
            CHATML.to_string()
        });
        let mut t = Self::new(src, bos, eos)?;
        if let Some(tools) = tool_use {
            t = t.with_tool_use(tools)?;
        }
        t.markup = Markup::detect(
            t.tool_use.as_ref().unwrap_or(&t.source),
            model_type.as_deref(),
        );
        Ok(t)
    }

    /// The template `source` rendered for requests with tools (a checkpoint's "tool_use"
    /// template); the markup is then its.
    pub fn with_tool_use(mut self, source: String) -> Result<Self, ChatError> {
        self.env
            .add_template_owned("tool_use", source.clone())
            .map_err(|e| ChatError::Template(format!("the \"tool_use\" template: {e}")))?;
        self.markup = Markup::detect(&source, None);
        self.tool_use = Some(source);
        Ok(self)
    }

    /// A template from its source; the markup from its markers alone.
    pub fn new(source: String, bos: String, eos: String) -> Result<Self, ChatError> {
        let mut env = minijinja::Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        // as transformers sets up Jinja2 for chat templates
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        // a template is a program from the checkpoint: one render runs at most this many
        // instructions (a real chat of a model's whole context takes a few million), so a
        // template that loops without end fails its request instead of holding a core
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.add_filter("tojson", tojson);
        // lists and dicts print as Python's repr (`{'a': [True, None]}`), as in Jinja2
        env.set_formatter(|out, state, value| match value.kind() {
            minijinja::value::ValueKind::Seq | minijinja::value::ValueKind::Map => {
                let mut text = String::new();
                py_repr(value, &mut text, 0);
                out.write_str(&text).map_err(minijinja::Error::from)
            }
            _ => minijinja::escape_formatter(out, state, value),
        });
        env.add_function("strftime_now", |fmt: String| strftime(&fmt, now_secs()));
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
            markup: Markup::detect(&source, None),
            source,
            tool_use: None,
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
        self.render_full(messages, tools, kwargs, true)
    }

    /// [`ChatTemplate::render_with`], the assistant's turn opened or not
    /// (`add_generation_prompt`).
    pub fn render_full(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        kwargs: &serde_json::Map<String, serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        let name = match (tools, &self.tool_use) {
            (Some(_), Some(_)) => "tool_use",
            _ => "chat",
        };
        let t = self
            .env
            .get_template(name)
            .map_err(|e| ChatError::Template(e.to_string()))?;
        let mut ctx: std::collections::BTreeMap<String, minijinja::Value> = kwargs
            .iter()
            .map(|(k, v)| (k.clone(), minijinja::Value::from_serialize(v)))
            .collect();
        let mut msgs = serde_json::to_value(messages)
            .map_err(|e| ChatError::Template(format!("the messages: {e}")))?;
        arguments_as_objects(&mut msgs);
        if self.markup.style.is_mistral() {
            mistral_ids(&mut msgs);
        }
        ctx.insert("messages".into(), minijinja::Value::from_serialize(&msgs));
        ctx.insert("add_generation_prompt".into(), add_generation_prompt.into());
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
        self.tool_use.is_some() || self.source.contains("tools")
    }

    /// Whether the template knows a thinking block (`<think>`, harmony's analysis channel).
    pub fn thinks(&self) -> bool {
        self.markup.thinks_in(&self.source)
    }
}

/// Every call id of the messages (an assistant's `tool_calls[].id`, a tool turn's
/// `tool_call_id`; one left out or null as the empty id) as Mistral's templates take them:
/// nine letters and digits ([`crate::agent::mistral_id_map`]: an id of another form, one
/// from another model's turn or a client's own, is mapped to nine the same way in both
/// places, and no two ids of the chat to the same nine).
fn mistral_ids(messages: &mut serde_json::Value) {
    use serde_json::Value;
    let Some(list) = messages.as_array_mut() else {
        return;
    };
    // the id slots of the chat: a tool turn's, and each call's
    let slot_of = |v: &Value| match v {
        Value::String(s) => s.clone(),
        _ => String::new(),
    };
    let mut ids = Vec::new();
    for m in list.iter() {
        if m["role"] == "tool" {
            ids.push(slot_of(&m["tool_call_id"]));
        }
        for c in m["tool_calls"].as_array().into_iter().flatten() {
            ids.push(slot_of(&c["id"]));
        }
    }
    let map = crate::agent::mistral_id_map(ids.iter().map(String::as_str));
    let nine = |v: &Value| Value::String(map.get(&slot_of(v)).cloned().unwrap_or_default());
    for m in list.iter_mut() {
        if m["role"] == "tool" {
            let id = nine(&m["tool_call_id"]);
            m["tool_call_id"] = id;
        }
        if let Some(calls) = m.get_mut("tool_calls").and_then(Value::as_array_mut) {
            for c in calls.iter_mut().filter(|c| c.is_object()) {
                let id = nine(&c["id"]);
                c["id"] = id;
            }
        }
    }
}

/// Each assistant call's `function.arguments` sent as JSON text holding an object, as that
/// object (templates iterate the arguments or write them with `tojson`).
fn arguments_as_objects(messages: &mut serde_json::Value) {
    let Some(list) = messages.as_array_mut() else {
        return;
    };
    for m in list {
        if let Some(calls) = m.get_mut("tool_calls") {
            call_arguments_as_objects(calls);
        }
    }
}

/// As the render does to each message: one turn's calls (`[{function: {arguments}}]`) with
/// arguments sent as JSON text holding an object made that object. The gateway applies it
/// before it looks for control-token text in them, so that text behind JSON escapes
/// (`\u003c|im_end|>`) is seen as the template will print it.
pub fn call_arguments_as_objects(calls: &mut serde_json::Value) {
    let Some(calls) = calls.as_array_mut() else {
        return;
    };
    for c in calls {
        let Some(f) = c.get_mut("function").and_then(|f| f.as_object_mut()) else {
            continue;
        };
        let parsed = match f.get("arguments") {
            Some(serde_json::Value::String(s)) => serde_json::from_str::<serde_json::Value>(s).ok(),
            _ => None,
        };
        if let Some(obj @ serde_json::Value::Object(_)) = parsed {
            f.insert("arguments".into(), obj);
        }
    }
}

/// Jinja's `tojson` as transformers defines it: Python's `json.dumps(x, ensure_ascii=False,
/// indent=None, separators=None, sort_keys=False)`, no HTML escaping.
fn tojson(
    v: minijinja::Value,
    kwargs: minijinja::value::Kwargs,
) -> Result<minijinja::Value, minijinja::Error> {
    let indent: Option<i64> = kwargs.get("indent")?;
    let ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort: Option<bool> = kwargs.get("sort_keys")?;
    let seps: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let mut j = serde_json::to_value(&v).map_err(|e| {
        minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, e.to_string())
    })?;
    if sort == Some(true) {
        sort_keys(&mut j);
    }
    let indent = indent.map(|n| " ".repeat(n.clamp(0, 64) as usize));
    let (item, key) = match seps.as_deref() {
        Some([a, b]) => (a.clone(), b.clone()),
        _ if indent.is_some() => (",".to_string(), ": ".to_string()),
        _ => (", ".to_string(), ": ".to_string()),
    };
    let mut out = String::new();
    py_dumps(
        &j,
        &PyStyle {
            indent,
            item,
            key,
            ascii: ascii == Some(true),
        },
        0,
        &mut out,
    );
    Ok(minijinja::Value::from(out))
}

fn sort_keys(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(o) => {
            let mut items: Vec<(String, serde_json::Value)> =
                std::mem::take(o).into_iter().collect();
            items.sort_by(|a, b| a.0.cmp(&b.0));
            for (k, mut x) in items {
                sort_keys(&mut x);
                o.insert(k, x);
            }
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(sort_keys),
        _ => {}
    }
}

struct PyStyle {
    indent: Option<String>,
    item: String,
    key: String,
    ascii: bool,
}

/// A JSON string as Python writes it (`ensure_ascii`: non-ASCII as `\uXXXX`).
fn py_string(s: &str, ascii: bool, out: &mut String) {
    let quoted = serde_json::to_string(s).unwrap_or_default();
    if !ascii {
        out.push_str(&quoted);
        return;
    }
    for c in quoted.chars() {
        if c.is_ascii() {
            out.push(c);
        } else {
            let mut buf = [0u16; 2];
            for u in c.encode_utf16(&mut buf) {
                out.push_str(&format!("\\u{u:04x}"));
            }
        }
    }
}

fn py_dumps(v: &serde_json::Value, st: &PyStyle, depth: usize, out: &mut String) {
    let newline = |out: &mut String, d: usize| {
        if let Some(ind) = &st.indent {
            out.push('\n');
            out.push_str(&ind.repeat(d));
        }
    };
    match v {
        serde_json::Value::String(s) => py_string(s, st.ascii, out),
        serde_json::Value::Array(a) if !a.is_empty() => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(&st.item);
                }
                newline(out, depth + 1);
                py_dumps(x, st, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        serde_json::Value::Object(o) if !o.is_empty() => {
            out.push('{');
            for (i, (k, x)) in o.iter().enumerate() {
                if i > 0 {
                    out.push_str(&st.item);
                }
                newline(out, depth + 1);
                py_string(k, st.ascii, out);
                out.push_str(&st.key);
                py_dumps(x, st, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// Most bytes one printed list or dict may take (a template could print a namespace that
/// holds itself): past it, the rest is left out.
const MAX_REPR_BYTES: usize = 1 << 20;

/// A value as Python's `repr` writes it: strings quoted (single quotes unless the text holds
/// one and no double quote), lists and dicts with their items' reprs. Nesting past 64 levels
/// is cut (`...`), and so is what comes past [`MAX_REPR_BYTES`].
fn py_repr(v: &minijinja::Value, out: &mut String, depth: usize) {
    use minijinja::value::ValueKind;
    if out.len() > MAX_REPR_BYTES {
        return;
    }
    if depth > 64 {
        out.push_str("...");
        return;
    }
    match v.kind() {
        ValueKind::String => {
            let s = v.as_str().unwrap_or_default();
            let q = if s.contains('\'') && !s.contains('"') {
                '"'
            } else {
                '\''
            };
            out.push(q);
            for c in s.chars() {
                match c {
                    '\\' => out.push_str("\\\\"),
                    '\n' => out.push_str("\\n"),
                    '\r' => out.push_str("\\r"),
                    '\t' => out.push_str("\\t"),
                    c if c == q => {
                        out.push('\\');
                        out.push(c);
                    }
                    c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                        out.push_str(&format!("\\x{:02x}", c as u32))
                    }
                    c => out.push(c),
                }
            }
            out.push(q);
        }
        ValueKind::Seq | ValueKind::Map => {
            let map = v.kind() == ValueKind::Map;
            out.push(if map { '{' } else { '[' });
            for (i, x) in v.try_iter().into_iter().flatten().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(&x, out, depth + 1);
                if map {
                    out.push_str(": ");
                    py_repr(&v.get_item(&x).unwrap_or_default(), out, depth + 1);
                }
            }
            out.push(if map { '}' } else { ']' });
        }
        ValueKind::None | ValueKind::Undefined => out.push_str("None"),
        ValueKind::Bool => out.push_str(if v.is_true() { "True" } else { "False" }),
        _ => out.push_str(&v.to_string()),
    }
}

fn now_secs() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// `strftime_now(format)`: the time now (UTC) as Python's `strftime` writes it, for the
/// directives templates use (`%Y %y %m %d %e %H %M %S %b %B %a %A %j %%`; others as written).
fn strftime(fmt: &str, secs: i64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    // the civil date of a day count (Howard Hinnant's algorithm)
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let before = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334][(m - 1) as usize];
    let yday = before + d + i64::from(leap && m > 2);
    let wday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let month = MONTHS[(m - 1) as usize];
    let mut out = String::new();
    let mut it = fmt.chars();
    while let Some(c) = it.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match it.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('e') => out.push_str(&format!("{d:>2}")),
            Some('H') => out.push_str(&format!("{:02}", rem / 3600)),
            Some('M') => out.push_str(&format!("{:02}", rem / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", rem % 60)),
            Some('B') => out.push_str(month),
            Some('b') => out.push_str(&month[..3]),
            Some('A') => out.push_str(DAYS[wday]),
            Some('a') => out.push_str(&DAYS[wday][..3]),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('%') => out.push('%'),
            Some(o) => {
                out.push('%');
                out.push(o);
            }
            None => out.push('%'),
        }
    }
    out
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
        // a template that would loop for ever (10^15 iterations) runs out of fuel: an error
        // in about a second, not a core held
        let t = ChatTemplate::new(
            "{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}x{% endfor %}{% endfor %}{% endfor %}".into(),
            String::new(),
            String::new(),
        )
        .unwrap();
        let t0 = std::time::Instant::now();
        let e = t.render(&[]).unwrap_err();
        assert!(t0.elapsed().as_secs() < 60, "{:?}", t0.elapsed());
        eprintln!("{e} after {:?}", t0.elapsed());
        // a real chat of a few thousand messages renders well inside it
        let many: Vec<ChatMessage> = (0..4000)
            .map(|i| {
                ChatMessage::new(
                    if i % 2 == 0 { "user" } else { "assistant" },
                    "some words here",
                )
            })
            .collect();
        let q = ChatTemplate::new(
            crate::templates::QWEN3_MOE.into(),
            String::new(),
            String::new(),
        )
        .unwrap();
        assert!(q.render(&many).is_ok());
    }

    /// A `tokenizer_config.json` whose `chat_template` is a list, as Mixtral 8x22B Instruct
    /// ships one: "tool_use" renders requests with tools (its markup is the checkpoint's),
    /// "default" the others; call ids of any form reach Mistral's template as the nine
    /// letters and digits it demands, a call and its result still naming one.
    #[test]
    fn a_list_of_named_templates_renders_tool_use_for_tools_and_mistral_ids_fit() {
        let tool_use = "{%- for m in messages -%}\
            {%- if m.tool_calls -%}[TOOL_CALLS] [{%- for c in m.tool_calls -%}\
            {%- if c.id | length != 9 -%}{{ raise_exception('ids of 9') }}{%- endif -%}\
            {\"name\": {{ c.function.name | tojson }}, \"arguments\": {{ c.function.arguments | tojson }}, \"id\": \"{{ c.id }}\"}\
            {%- endfor -%}]\
            {%- elif m.role == 'tool' -%}\
            {%- if m.tool_call_id | length != 9 -%}{{ raise_exception('ids of 9') }}{%- endif -%}\
            [TOOL_RESULTS] {\"content\": {{ m.content | tojson }}, \"call_id\": \"{{ m.tool_call_id }}\"}[/TOOL_RESULTS]\
            {%- else -%}{%- if tools -%}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif -%}\
            [INST] {{ m.content }}[/INST]{%- endif -%}{%- endfor -%}";
        let dir = std::env::temp_dir().join(format!("moelane-chat-list-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = serde_json::json!({"bos_token": "<s>", "eos_token": "</s>", "chat_template": [
            {"name": "default", "template": "{%- for m in messages -%}[INST] {{ m.content }}[/INST]{%- endfor -%}"},
            {"name": "tool_use", "template": tool_use}]});
        std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).unwrap();
        std::fs::write(dir.join("config.json"), r#"{"model_type": "mixtral"}"#).unwrap();
        let t = ChatTemplate::from_dir(&dir).unwrap();
        // the same as newer transformers save them: the default as chat_template.jinja, the
        // others under additional_chat_templates/; or a processor's chat_template.json
        let files = dir.join("files");
        std::fs::create_dir_all(files.join("additional_chat_templates")).unwrap();
        std::fs::write(files.join("config.json"), r#"{"model_type": "mixtral"}"#).unwrap();
        std::fs::write(
            files.join("tokenizer_config.json"),
            r#"{"eos_token": "</s>"}"#,
        )
        .unwrap();
        std::fs::write(
            files.join("chat_template.json"),
            serde_json::json!({"chat_template": cfg["chat_template"][0]["template"]}).to_string(),
        )
        .unwrap();
        std::fs::write(
            files.join("additional_chat_templates/tool_use.jinja"),
            tool_use,
        )
        .unwrap();
        let f = ChatTemplate::from_dir(&files).unwrap();
        // a template file that is there but broken is an error naming it
        std::fs::write(files.join("chat_template.json"), "{not json").unwrap();
        let e = ChatTemplate::from_dir(&files)
            .err()
            .expect("refused")
            .to_string();
        assert!(e.contains("chat_template.json"), "{e}");
        // a template of the wrong JSON type, or an empty one, is refused, not replaced by
        // ChatML; a template file that is not a regular file is refused unread
        for (bad, says) in [
            (serde_json::json!({"chat_template": 5}), "a number"),
            (serde_json::json!({"chat_template": {"a": 1}}), "an object"),
            (serde_json::json!({"chat_template": "  "}), "empty"),
        ] {
            std::fs::write(files.join("chat_template.json"), bad.to_string()).unwrap();
            let e = ChatTemplate::from_dir(&files)
                .err()
                .expect("refused")
                .to_string();
            assert!(e.contains(says), "{says}: {e}");
        }
        std::fs::remove_file(files.join("chat_template.json")).unwrap();
        #[cfg(unix)]
        {
            std::os::unix::fs::symlink("/dev/zero", files.join("chat_template.jinja")).unwrap();
            let e = ChatTemplate::from_dir(&files)
                .err()
                .expect("refused")
                .to_string();
            assert!(
                e.contains("chat_template.jinja") && e.contains("regular file"),
                "{e}"
            );
        }
        std::fs::remove_dir_all(&dir).ok();
        assert_eq!((&f.source, &f.tool_use), (&t.source, &t.tool_use));
        assert_eq!(f.markup, crate::agent::MISTRAL);
        assert_eq!(t.markup, crate::agent::MISTRAL);
        assert!(t.takes_tools());
        let ask = [ChatMessage::new("user", "hi")];
        let none = serde_json::Map::new();
        assert_eq!(t.render(&ask).unwrap(), "[INST] hi[/INST]");
        let tools = serde_json::json!([{"type": "function", "function": {"name": "f"}}]);
        let with = t.render_with(&ask, Some(&tools), &none).unwrap();
        assert!(
            with.starts_with("[AVAILABLE_TOOLS] [{\"type\": \"function\""),
            "{with}"
        );
        let mut call = ChatMessage::new("assistant", "");
        call.tool_calls = Some(serde_json::json!([{"id": "call_0123456789abcdef01234567",
            "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]));
        let mut result = ChatMessage::new("tool", "2");
        result.tool_call_id = Some("call_0123456789abcdef01234567".into());
        let s = t
            .render_with(&[ask[0].clone(), call, result], Some(&tools), &none)
            .unwrap();
        let id = crate::agent::mistral_call_id("call_0123456789abcdef01234567");
        assert!(
            s.contains(&format!("\"arguments\": {{\"a\": 1}}, \"id\": \"{id}\"}}]"))
                && s.contains(&format!("\"call_id\": \"{id}\"}}[/TOOL_RESULTS]")),
            "{s}"
        );
    }

    #[test]
    fn tojson_writes_like_python_and_dates_like_strftime() {
        let src = "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ 'é<' | tojson(ensure_ascii=true) }}|{{ x | tojson(sort_keys=true, separators=[',', ':']) }}";
        let t = ChatTemplate::new(src.into(), String::new(), String::new()).unwrap();
        let mut kw = serde_json::Map::new();
        kw.insert(
            "x".into(),
            serde_json::json!({"b": [1, "a<'>&"], "a": {}, "c": []}),
        );
        assert_eq!(
            t.render_full(&[], None, &kw, false).unwrap(),
            "{\"b\": [1, \"a<'>&\"], \"a\": {}, \"c\": []}|{\n  \"b\": [\n    1,\n    \"a<'>&\"\n  ],\n  \"a\": {},\n  \"c\": []\n}|\"\\u00e9<\"|{\"a\":{},\"b\":[1,\"a<'>&\"],\"c\":[]}"
        );
        assert_eq!(
            strftime("%Y-%m-%d %H:%M:%S %a %b %j %%", 1_709_210_096),
            "2024-02-29 12:34:56 Thu Feb 060 %"
        );
        assert_eq!(strftime("%d %B %Y", 0), "01 January 1970");
        // a namespace that holds itself prints within bounds
        let src = "{% set ns = namespace(a=1) %}{% set ns.b = ns %}{% set ns.c = ns %}{{ [ns] }}";
        let t = ChatTemplate::new(src.into(), String::new(), String::new()).unwrap();
        if let Ok(s) = t.render(&[]) {
            assert!(s.len() < 2 * MAX_REPR_BYTES, "{}", s.len());
        }
    }
}
