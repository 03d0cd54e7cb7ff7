//! What an agent reads out of a model's answer: reasoning (between the family's thinking
//! markers), tool calls (the family's call markup holding `{"name": ..., "arguments": ...}`),
//! and the content around them. [`Splitter`] does it as the text streams in, holding back
//! only what could still be the start of a marker, so a streamed answer gives the same parts
//! as the whole one.
//!
//! The markup is Hermes' as Qwen uses it (`<tool_call>{...}</tool_call>`, `<think>...</think>`),
//! the format of the families whose templates write it.

/// The markers of one family's reasoning and tool calls.
#[derive(Clone, Debug, PartialEq)]
pub struct Markup {
    pub think_open: &'static str,
    pub think_close: &'static str,
    pub call_open: &'static str,
    pub call_close: &'static str,
}

/// Hermes / Qwen: `<think>...</think>` and `<tool_call>\n{"name": .., "arguments": {..}}\n</tool_call>`.
pub const HERMES: Markup = Markup {
    think_open: "<think>",
    think_close: "</think>",
    call_open: "<tool_call>",
    call_close: "</tool_call>",
};

/// One part of an answer, in order.
#[derive(Clone, Debug, PartialEq)]
pub enum Part {
    Content(String),
    Reasoning(String),
    /// A whole tool call: its function's name and its arguments as JSON text (a call whose
    /// body does not parse is given back as content, markup and all).
    Call {
        name: String,
        arguments: String,
    },
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Content,
    Reasoning,
    Call,
}

/// Most bytes of one call's body: past it, what the model wrote is given back as text (a
/// call that never closes must not grow without bound, nor be searched again and again).
pub const MAX_CALL_BYTES: usize = 1 << 20;

/// Splits a streamed answer into [`Part`]s.
pub struct Splitter {
    m: Markup,
    mode: Mode,
    /// Text not yet given out: a possible marker's start, or a call's body.
    buf: String,
    /// Bytes of `buf` already searched for the closing marker without finding it.
    scanned: usize,
    calls: bool,
    think: bool,
    /// Only calls may be written (a forced call): text between them is the grammar's
    /// separator, not content.
    forced: bool,
}

impl Splitter {
    /// `calls`: tool-call markup is parsed (the request has tools); `think`: reasoning
    /// markers are; `in_reasoning`: the prompt opened the thinking block itself, so the answer
    /// starts inside it.
    pub fn new(m: Markup, calls: bool, think: bool, in_reasoning: bool) -> Splitter {
        Splitter {
            m,
            mode: if think && in_reasoning {
                Mode::Reasoning
            } else {
                Mode::Content
            },
            buf: String::new(),
            scanned: 0,
            calls,
            think,
            forced: false,
        }
    }

    /// Drops the text between calls: the answer is only calls (a forced call).
    pub fn forced(mut self) -> Splitter {
        self.forced = true;
        self
    }

    /// The markers that may open or close something in the current mode.
    fn markers(&self) -> Vec<&'static str> {
        match self.mode {
            Mode::Content => {
                let mut v = Vec::new();
                if self.think {
                    v.push(self.m.think_open);
                }
                if self.calls {
                    v.push(self.m.call_open);
                }
                v
            }
            Mode::Reasoning => vec![self.m.think_close],
            Mode::Call => vec![self.m.call_close],
        }
    }

    /// Takes more text; returns the parts now complete.
    pub fn push(&mut self, text: &str) -> Vec<Part> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            let markers = self.markers();
            // search only what was not searched yet (and a marker's length before it)
            let longest = markers.iter().map(|m| m.len()).max().unwrap_or(0);
            let mut from = self.scanned.saturating_sub(longest);
            while !self.buf.is_char_boundary(from) {
                from -= 1;
            }
            let found = markers
                .iter()
                .filter_map(|mk| self.buf[from..].find(mk).map(|at| (from + at, *mk)))
                .min_by_key(|x| x.0);
            match found {
                Some((at, mk)) => {
                    let before: String = self.buf.drain(..at).collect();
                    self.buf.drain(..mk.len());
                    self.scanned = 0;
                    self.emit(before, &mut out);
                    self.mode = match (self.mode, mk) {
                        (Mode::Content, m) if m == self.m.think_open => Mode::Reasoning,
                        (Mode::Content, _) => Mode::Call,
                        (Mode::Reasoning, _) | (Mode::Call, _) => Mode::Content,
                    };
                }
                None => {
                    if self.mode == Mode::Call {
                        if self.buf.len() > MAX_CALL_BYTES {
                            // never closed within bounds: what the model wrote, as text
                            let body = std::mem::take(&mut self.buf);
                            out.push(Part::Content(format!("{}{body}", self.m.call_open)));
                            self.mode = Mode::Content;
                            self.scanned = 0;
                            continue;
                        }
                        self.scanned = self.buf.len();
                        return out; // a call is given out whole
                    }
                    // keep what could still be a marker's start
                    let keep = markers
                        .iter()
                        .map(|mk| partial_suffix(&self.buf, mk))
                        .max()
                        .unwrap_or(0);
                    let cut = self.buf.len() - keep;
                    let now: String = self.buf[..cut].to_string();
                    self.buf.drain(..cut);
                    self.emit(now, &mut out);
                    return out;
                }
            }
        }
    }

    /// The end of the answer: whatever is held back, as what it is (an unclosed call's
    /// markup is given back as content).
    pub fn finish(&mut self) -> Vec<Part> {
        let rest = std::mem::take(&mut self.buf);
        self.scanned = 0;
        let mut out = Vec::new();
        match self.mode {
            Mode::Call => {
                // the call never closed: what the model wrote, as text
                let text = format!("{}{rest}", self.m.call_open);
                out.push(Part::Content(text));
            }
            _ => self.emit(rest, &mut out),
        }
        self.mode = Mode::Content;
        out
    }

    fn emit(&mut self, text: String, out: &mut Vec<Part>) {
        match self.mode {
            Mode::Content if self.forced => {}
            Mode::Content if !text.is_empty() => out.push(Part::Content(text)),
            Mode::Reasoning if !text.is_empty() => out.push(Part::Reasoning(text)),
            Mode::Call => out.push(parse_call(&text).unwrap_or_else(|| {
                Part::Content(format!("{}{text}{}", self.m.call_open, self.m.call_close))
            })),
            _ => {}
        }
    }
}

/// The length of the longest suffix of `s` that is a proper prefix of `marker`.
fn partial_suffix(s: &str, marker: &str) -> usize {
    (1..marker.len().min(s.len() + 1))
        .rev()
        .find(|&n| s.is_char_boundary(s.len() - n) && marker.starts_with(&s[s.len() - n..]))
        .unwrap_or(0)
}

/// A call's body: `{"name": "...", "arguments": {...}}` (arguments as an object, or as a
/// string holding JSON); its arguments given back as JSON text.
pub fn parse_call(body: &str) -> Option<Part> {
    let v: serde_json::Value = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
        None | Some(serde_json::Value::Null) => "{}".to_string(),
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(a) => a.to_string(),
    };
    Some(Part::Call { name, arguments })
}

/// Splits a whole answer at once.
pub fn split_whole(
    m: Markup,
    calls: bool,
    think: bool,
    in_reasoning: bool,
    text: &str,
) -> Vec<Part> {
    let mut s = Splitter::new(m, calls, think, in_reasoning);
    let mut parts = s.push(text);
    parts.extend(s.finish());
    merge(parts)
}

/// Joins neighbouring content (and reasoning) parts.
pub fn merge(parts: Vec<Part>) -> Vec<Part> {
    let mut out: Vec<Part> = Vec::new();
    for p in parts {
        match (out.last_mut(), p) {
            (Some(Part::Content(a)), Part::Content(b)) => a.push_str(&b),
            (Some(Part::Reasoning(a)), Part::Reasoning(b)) => a.push_str(&b),
            (_, p) => out.push(p),
        }
    }
    out
}

/// The Lark grammar of an answer that is only tool calls (1 to `most`), each naming one of
/// `tools` (`(name, JSON schema of its parameters)`) with arguments valid against its schema.
pub fn calls_grammar(m: &Markup, tools: &[(String, serde_json::Value)], most: usize) -> String {
    let alts: Vec<serde_json::Value> = tools
        .iter()
        .map(|(name, params)| {
            let mut params = params.clone();
            if !params.is_object() {
                params = serde_json::json!({"type": "object"});
            }
            serde_json::json!({"type": "object", "properties": {
                "name": {"const": name},
                "arguments": params},
                "required": ["name", "arguments"], "additionalProperties": false})
        })
        .collect();
    let schema = serde_json::json!({"anyOf": alts, "x-guidance": {"whitespace_flexible": false}});
    let lit = |s: &str| serde_json::to_string(s).unwrap_or_default();
    // one call, then up to most - 1 more, each on its own line
    let more = " (\"\\n\" call)?".repeat(most.max(1) - 1);
    format!(
        "start: call{more}\ncall: {} \"\\n\" %json {} \"\\n\" {}\n",
        lit(m.call_open),
        schema,
        lit(m.call_close),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str, args: &str) -> Part {
        Part::Call {
            name: name.into(),
            arguments: args.into(),
        }
    }

    #[test]
    fn a_whole_answer_splits_into_reasoning_calls_and_content() {
        let text = "<think>\nweather first\n</think>\n\nLet me check.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"time\", \"arguments\": {}}\n</tool_call>";
        let parts = split_whole(HERMES, true, true, false, text);
        assert_eq!(
            parts,
            vec![
                Part::Reasoning("\nweather first\n".into()),
                Part::Content("\n\nLet me check.".into()),
                call("get_weather", "{\"city\":\"Paris\"}"),
                Part::Content("\n".into()),
                call("time", "{}"),
            ]
        );
        // without tools the markup stays text; without thinking the markers too
        assert_eq!(
            split_whole(HERMES, false, false, false, text),
            vec![Part::Content(text.into())]
        );
    }

    #[test]
    fn streaming_in_any_pieces_gives_the_whole_answers_parts() {
        let text = "<think>ok</think>A<tool_call>{\"name\": \"f\", \"arguments\": {\"x\": 1}}</tool_call>B<tool_ca";
        let whole = split_whole(HERMES, true, true, false, text);
        for step in 1..8 {
            let mut s = Splitter::new(HERMES, true, true, false);
            let mut parts = Vec::new();
            let chars: Vec<char> = text.chars().collect();
            for piece in chars.chunks(step) {
                parts.extend(s.push(&piece.iter().collect::<String>()));
            }
            parts.extend(s.finish());
            assert_eq!(merge(parts), whole, "pieces of {step}");
        }
        // the unfinished marker at the end is text
        assert_eq!(whole.last(), Some(&Part::Content("B<tool_ca".into())));
    }

    #[test]
    fn a_long_unclosed_call_is_bounded_and_forced_answers_drop_separators() {
        let mut s = Splitter::new(HERMES, true, false, false);
        let mut parts = s.push("<tool_call>");
        let chunk = "a".repeat(4096);
        for _ in 0..(MAX_CALL_BYTES / 4096 + 2) {
            parts.extend(s.push(&chunk));
        }
        parts.extend(s.push("tail"));
        parts.extend(s.finish());
        let text: String = merge(parts)
            .into_iter()
            .map(|p| match p {
                Part::Content(t) => t,
                other => panic!("{other:?}"),
            })
            .collect();
        assert!(text.starts_with("<tool_call>aaa") && text.ends_with("tail"));
        let forced = "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>\n<tool_call>{\"name\": \"g\", \"arguments\": {}}</tool_call>";
        let mut s = Splitter::new(HERMES, true, false, false).forced();
        let mut parts = s.push(forced);
        parts.extend(s.finish());
        assert_eq!(parts, vec![call("f", "{}"), call("g", "{}")]);
    }

    #[test]
    fn a_call_that_does_not_parse_or_close_is_given_back_as_text() {
        let bad = "<tool_call>not json</tool_call>";
        assert_eq!(
            split_whole(HERMES, true, false, false, bad),
            vec![Part::Content(bad.into())]
        );
        let open = "x<tool_call>{\"name\": \"f\"";
        assert_eq!(
            split_whole(HERMES, true, false, false, open),
            vec![Part::Content(open.into())]
        );
        // a prompt that opened the thinking block: the answer starts in it
        assert_eq!(
            split_whole(HERMES, false, true, true, "hmm</think>yes"),
            vec![Part::Reasoning("hmm".into()), Part::Content("yes".into())]
        );
    }
}
