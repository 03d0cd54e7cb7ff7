//! What an agent reads out of a model's answer: reasoning (between the family's thinking
//! markers), tool calls (the family's call markup), and the content around them.
//! [`Splitter`] does it as the text streams in, holding back only what could still be the
//! start of a marker, so a streamed answer gives the same parts as the whole one.
//!
//! Each family writes calls its own way ([`Style`]), chosen from the checkpoint
//! ([`Markup::detect`]: the template's markers, else config.json's `model_type`):
//! - Hermes, as Qwen uses it: `<tool_call>{"name": .., "arguments": {..}}</tool_call>`;
//! - DeepSeek V3: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`, the
//!   arguments in a fenced JSON block, `<｜tool▁call▁end｜><｜tool▁calls▁end｜>`;
//! - GLM-4.5: `<tool_call>NAME` then `<arg_key>K</arg_key><arg_value>V</arg_value>` pairs
//!   (a declared string parameter's value is its text; others JSON when they parse as JSON,
//!   else a string);
//! - gpt-oss's harmony messages: `<|channel|>analysis<|message|>..<|end|>` is reasoning,
//!   `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{..}<|call|>` a
//!   call, other channels (`final`) content;
//! - Kimi K2: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0`
//!   `<|tool_call_argument_begin|>{..}<|tool_call_end|><|tool_calls_section_end|>`;
//! - Mistral: `[TOOL_CALLS]` then, with its v3 tokenizers (Mixtral 8x22B), a JSON array of
//!   `{"name": .., "arguments": {..}}` objects, or, with v11 and later, `NAME[ARGS]{..}` (v13:
//!   `NAME[CALL_ID]ID[ARGS]{..}`), each call after its own `[TOOL_CALLS]`. Nothing closes
//!   them but the end of their JSON. Both are read whichever the template writes.
//!
//! All but harmony and Mistral think between `<think>` and `</think>`; Mistral's reasoning
//! models between `[THINK]` and `[/THINK]`.
//!
//! A call streams: once its head is read (the name, up to where its arguments start), the
//! name is given ([`Part::CallStart`]), then its arguments as they are written
//! ([`Part::CallArgs`], through [`JsonOut`], so they always add up to one JSON object), then
//! [`Part::CallEnd`].

use serde_json::Value;

/// How a family writes its calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Style {
    Hermes,
    DeepSeek,
    Glm,
    Harmony,
    Kimi,
    /// Mistral's v3 tokenizers: `[TOOL_CALLS]` and an array of calls.
    Mistral,
    /// Mistral's v11 and later: `[TOOL_CALLS]NAME[ARGS]{..}`, a marker a call.
    MistralArgs,
}

impl Style {
    /// Mistral's, whose calls have no closing marker.
    pub fn is_mistral(self) -> bool {
        matches!(self, Style::Mistral | Style::MistralArgs)
    }
}

/// The markers of one family's reasoning and tool calls.
#[derive(Clone, Debug, PartialEq)]
pub struct Markup {
    pub style: Style,
    pub think_open: &'static str,
    pub think_close: &'static str,
    /// What opens and closes one call (harmony: a message's header and its ends, see
    /// [`HARMONY`]).
    pub call_open: &'static str,
    pub call_close: &'static str,
    /// Markers around a group of calls, dropped from the content (DeepSeek's).
    pub frame: &'static [&'static str],
}

/// Hermes / Qwen: `<think>...</think>` and `<tool_call>\n{"name": .., "arguments": {..}}\n</tool_call>`.
pub const HERMES: Markup = Markup {
    style: Style::Hermes,
    think_open: "<think>",
    think_close: "</think>",
    call_open: "<tool_call>",
    call_close: "</tool_call>",
    frame: &[],
};

const DS_CALLS_BEGIN: &str = "<｜tool▁calls▁begin｜>";
const DS_CALLS_END: &str = "<｜tool▁calls▁end｜>";
const DS_SEP: &str = "<｜tool▁sep｜>";

/// DeepSeek V3.
pub const DEEPSEEK_V3: Markup = Markup {
    style: Style::DeepSeek,
    think_open: "<think>",
    think_close: "</think>",
    call_open: "<｜tool▁call▁begin｜>",
    call_close: "<｜tool▁call▁end｜>",
    frame: &[DS_CALLS_BEGIN, DS_CALLS_END],
};

/// GLM-4.5 (glm4_moe).
pub const GLM45: Markup = Markup {
    style: Style::Glm,
    think_open: "<think>",
    think_close: "</think>",
    call_open: "<tool_call>",
    call_close: "</tool_call>",
    frame: &[],
};

const KIMI_SECTION_BEGIN: &str = "<|tool_calls_section_begin|>";
const KIMI_SECTION_END: &str = "<|tool_calls_section_end|>";
const KIMI_ARG: &str = "<|tool_call_argument_begin|>";

/// Kimi K2 (a DeepseekV3ForCausalLM checkpoint whose config.json says `kimi_k2`): calls as
/// `functions.NAME:INDEX` then the JSON arguments, in a section of calls.
pub const KIMI_K2: Markup = Markup {
    style: Style::Kimi,
    think_open: "<think>",
    think_close: "</think>",
    call_open: "<|tool_call_begin|>",
    call_close: "<|tool_call_end|>",
    frame: &[KIMI_SECTION_BEGIN, KIMI_SECTION_END],
};

const M_CALLS: &str = "[TOOL_CALLS]";
const M_ARGS: &str = "[ARGS]";
const M_CALL_ID: &str = "[CALL_ID]";

/// Mistral, v3 tokenizers (Mixtral 8x22B): `[TOOL_CALLS] [{"name": .., "arguments": {..}}]`.
/// (`call_close` is empty: a call ends where its JSON does.)
pub const MISTRAL: Markup = Markup {
    style: Style::Mistral,
    think_open: "[THINK]",
    think_close: "[/THINK]",
    call_open: M_CALLS,
    call_close: "",
    frame: &[],
};

/// Mistral, v11 and later tokenizers: `[TOOL_CALLS]NAME[ARGS]{..}`.
pub const MISTRAL_ARGS: Markup = Markup {
    style: Style::MistralArgs,
    ..MISTRAL
};

const H_START: &str = "<|start|>";
const H_CHANNEL: &str = "<|channel|>";
const H_MESSAGE: &str = "<|message|>";
const H_END: &str = "<|end|>";
const H_CALL: &str = "<|call|>";
const H_RETURN: &str = "<|return|>";

/// gpt-oss's harmony format: a message's header opens at `<|start|>` or `<|channel|>` and
/// ends at `<|message|>`; its body ends at `<|end|>`, `<|call|>` or `<|return|>` (or where the
/// next header starts, or at the end of the answer: `<|call|>` and `<|return|>` end it).
pub const HARMONY: Markup = Markup {
    style: Style::Harmony,
    think_open: "<|channel|>analysis",
    think_close: H_END,
    call_open: H_CHANNEL,
    call_close: H_CALL,
    frame: &[H_START, H_MESSAGE, H_RETURN],
};

impl Markup {
    /// The markup of a checkpoint: from its template's markers where they tell, else from
    /// config.json's `model_type`; Hermes when neither does.
    pub fn detect(template: &str, model_type: Option<&str>) -> Markup {
        if template.contains(H_CHANNEL) && template.contains(H_MESSAGE) {
            HARMONY
        } else if template.contains(KIMI_K2.call_open) {
            KIMI_K2
        } else if template.contains(DEEPSEEK_V3.call_open) {
            DEEPSEEK_V3
        } else if template.contains("<arg_key>") {
            GLM45
        } else if template.contains(M_CALLS) && template.contains(M_ARGS) {
            MISTRAL_ARGS
        } else if template.contains(M_CALLS) {
            MISTRAL
        } else if template.contains(HERMES.call_open) {
            HERMES
        } else {
            match model_type {
                Some("gpt_oss") => HARMONY,
                Some("deepseek_v3") => DEEPSEEK_V3,
                Some("kimi_k2") => KIMI_K2,
                Some("glm4_moe") => GLM45,
                _ => HERMES,
            }
        }
    }

    /// Whether `text` (a special token's) is one of this markup's markers: such tokens
    /// reach the splitter although special tokens are otherwise left out of the text.
    pub fn marks(&self, text: &str) -> bool {
        if text.is_empty() {
            return false;
        }
        [
            self.think_open,
            self.think_close,
            self.call_open,
            self.call_close,
        ]
        .contains(&text)
            || self.frame.contains(&text)
            || (self.style == Style::Harmony && text == H_CHANNEL)
            || (self.style == Style::Kimi && text == KIMI_ARG)
            || (self.style.is_mistral() && (text == M_ARGS || text == M_CALL_ID))
    }

    /// A fresh id for a call this markup's model made: Mistral's templates take only nine
    /// letters and digits (as its own tools write them), the others OpenAI's `call_` and 24
    /// hex digits. `random`: the randomness it is made from.
    pub fn call_id(&self, random: u128) -> String {
        if self.style.is_mistral() {
            base62_9(random as u64)
        } else {
            format!("call_{:024x}", random >> 32)
        }
    }

    /// Whether a template that is `source` has a thinking block in this markup.
    pub fn thinks_in(&self, source: &str) -> bool {
        match self.style {
            Style::Harmony => source.contains("analysis"),
            _ => source.contains(self.think_open),
        }
    }
}

/// Nine letters and digits from `n`.
fn base62_9(mut n: u64) -> String {
    const DIGITS: &[u8; 62] = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
    (0..9)
        .map(|_| {
            let c = DIGITS[(n % 62) as usize] as char;
            n /= 62;
            c
        })
        .collect()
}

/// Whether `id` is a call id as Mistral's templates take it: nine letters and digits.
fn mistral_shaped(id: &str) -> bool {
    id.len() == 9 && id.bytes().all(|b| b.is_ascii_alphanumeric())
}

/// Nine letters and digits made from `id` and `salt` (FNV-1a of their bytes).
fn mistral_hashed(id: &str, salt: u32) -> String {
    let h = id
        .bytes()
        .chain(salt.to_le_bytes().into_iter().filter(|_| salt > 0))
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        });
    base62_9(h)
}

/// A call id as Mistral's templates take it (nine letters and digits; they refuse any
/// other): the id itself where it is one, else nine made from it, the same each time.
pub fn mistral_call_id(id: &str) -> String {
    if mistral_shaped(id) {
        id.to_string()
    } else {
        mistral_hashed(id, 0)
    }
}

/// The call ids of one chat (`ids`, in order) as Mistral's templates take them: each
/// distinct id its own nine letters and digits ([`mistral_call_id`]), and no two ids the
/// same nine (one made from an id that meets another's is made again, salted), so each call
/// and the result that answers it still pair up, and no two calls merge.
pub fn mistral_id_map<'a>(
    ids: impl IntoIterator<Item = &'a str>,
) -> std::collections::HashMap<String, String> {
    let ids: Vec<&str> = ids.into_iter().collect();
    let mut used: std::collections::HashSet<String> = ids
        .iter()
        .filter(|i| mistral_shaped(i))
        .map(|i| i.to_string())
        .collect();
    let mut map = std::collections::HashMap::new();
    for id in ids {
        if map.contains_key(id) {
            continue;
        }
        // (an id already of nine is in `used` from the start: it keeps its nine)
        let mut nine = mistral_call_id(id);
        let mut salt = 0;
        while !mistral_shaped(id) && !used.insert(nine.clone()) {
            salt += 1;
            nine = mistral_hashed(id, salt);
        }
        map.insert(id.to_string(), nine);
    }
    map
}

/// One part of an answer, in order.
#[derive(Clone, Debug, PartialEq)]
pub enum Part {
    Content(String),
    Reasoning(String),
    /// A whole tool call: its function's name and its arguments as JSON text. [`merge`]
    /// makes one of each streamed call; [`Splitter`] gives one whole only for a call not in
    /// its family's usual shape (read at its close; one that does not parse then is given
    /// back as content, markup and all).
    Call {
        name: String,
        arguments: String,
    },
    /// A streamed call starts: its name is read. Its arguments follow as [`Part::CallArgs`]
    /// pieces (their concatenation is always one valid JSON object: see [`Splitter`]), then
    /// [`Part::CallEnd`].
    CallStart {
        name: String,
    },
    CallArgs(String),
    CallEnd,
}

/// Where the call being read is.
enum CallSt {
    /// Its head (the name, up to where the arguments start) is not read yet: the body is
    /// held.
    Head,
    /// Not in the family's usual shape: read whole at its close.
    Whole,
    /// Its arguments, streamed.
    Args(JsonOut),
    /// GLM's argument pairs, streamed a pair at a time: how many were given, and how many
    /// bytes of the pending pair were searched for its end.
    Pairs { n: usize, seen: usize },
    /// The arguments ended: the rest of the body up to the close is dropped.
    Tail,
}

/// Where a Mistral call list is (Mistral's calls have no closing marker: they end where
/// their JSON does).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Mis {
    /// Right after `[TOOL_CALLS]`: an array of calls (v3) or one named call (v11) follows.
    Open,
    /// In the array where a call's object or the array's end is expected (`first`: no call
    /// of this marker's was read yet).
    Item { first: bool },
    /// A call (its head, then its arguments, in [`Splitter::call`]); `named`: v11's;
    /// `first`: the marker's first.
    Call { named: bool, first: bool },
    /// The rest of an array call's object after its arguments: `depth` containers open, in
    /// a string, after a backslash in one.
    Rest { depth: usize, s: bool, esc: bool },
    /// After an array call's object: `,` or the array's end.
    Next,
    /// An array item not in the usual head shape (keys in another order, arguments as a
    /// string), read whole: as [`Mis::Rest`], and the marker's first or not.
    Obj {
        depth: usize,
        s: bool,
        esc: bool,
        first: bool,
    },
}

/// Follows a JSON text's nesting over `text` from (`depth`, in a string, after a backslash):
/// where the container that was open at `depth` 1 closes (the byte after it), if it does.
fn skip_json(text: &str, depth: &mut usize, s: &mut bool, esc: &mut bool) -> Option<usize> {
    for (i, c) in text.char_indices() {
        if *esc {
            *esc = false;
        } else if *s {
            *esc = c == '\\';
            *s = c != '"';
        } else {
            match c {
                '"' => *s = true,
                '{' | '[' => *depth += 1,
                '}' | ']' => *depth = depth.saturating_sub(1),
                _ => {}
            }
            if *depth == 0 {
                return Some(i + c.len_utf8());
            }
        }
    }
    None
}

/// What a call's head says so far.
#[derive(Debug, PartialEq)]
enum Head {
    More,
    Whole,
    /// The name, and where the arguments start in the body.
    Start(String, usize),
}

/// Most bytes of a call's body searched for its head: a call whose arguments do not start
/// within them is read whole.
const HEAD_MAX: usize = 4096;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Content,
    Reasoning,
    Call,
    /// A harmony message's header (up to `<|message|>`).
    Header,
}

/// What a marker does.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Act {
    Think,
    Call,
    /// Dropped; the mode stays.
    Drop,
    /// Back to content (the reasoning or the call ends).
    Close,
    /// A harmony header starts (ending what was open).
    Header,
    /// A harmony header ends: its message's body starts.
    Body,
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
    /// Harmony: the header of the message being read, its markers included.
    head: String,
    calls: bool,
    think: bool,
    /// Only calls may be written (a forced call): text between them is the grammar's
    /// separator, not content.
    forced: bool,
    call: CallSt,
    /// The name of the call being read.
    name: String,
    /// Per tool, its parameters whose values are strings (GLM writes them as raw text).
    /// (each with whether it may also be null)
    texts: Vec<(String, Vec<(String, bool)>)>,
    /// Mistral: where its call list is.
    mis: Mis,
    /// Mistral: what was read after `[TOOL_CALLS]` before its first call began (given back
    /// as text, marker and all, if no call follows), and where a list's `[` is in it (read
    /// again if no call follows: it may open another marker).
    taken: String,
    bracket: Option<usize>,
    /// Mistral: an array item not in the usual shape, read whole to its closing brace.
    obj: String,
    /// The containers left open, and whether in a string, where a call's arguments stopped
    /// being JSON (what follows is skipped from there).
    args_left: (usize, bool),
}

impl Splitter {
    /// `calls`: tool-call markup is parsed (the request has tools); `think`: reasoning
    /// markers are; `in_reasoning`: the prompt opened the thinking block itself, so the answer
    /// starts inside it.
    pub fn new(m: Markup, calls: bool, think: bool, in_reasoning: bool) -> Splitter {
        Splitter {
            mode: if think && in_reasoning && m.style != Style::Harmony {
                Mode::Reasoning
            } else {
                Mode::Content
            },
            m,
            buf: String::new(),
            scanned: 0,
            head: String::new(),
            calls,
            think,
            forced: false,
            call: CallSt::Head,
            name: String::new(),
            texts: Vec::new(),
            mis: Mis::Open,
            taken: String::new(),
            bracket: None,
            obj: String::new(),
            args_left: (0, false),
        }
    }

    /// The request's tools (name, parameters' schema): GLM's values of string parameters
    /// are read as the raw text they are (as its template writes them), never as JSON (a
    /// zip code `94107` stays a string).
    pub fn tools(mut self, tools: &[(String, Value)]) -> Splitter {
        self.texts = tools
            .iter()
            .map(|(n, p)| (n.clone(), text_props(p)))
            .collect();
        self
    }

    /// Whether `key` of tool `name` is a string parameter: `Some(nullable)`.
    fn is_text(&self, name: &str, key: &str) -> Option<bool> {
        self.texts
            .iter()
            .filter(|(n, _)| n == name)
            .flat_map(|(_, keys)| keys.iter())
            .find(|(k, _)| k == key)
            .map(|(_, nullable)| *nullable)
    }

    /// Whether a call (or a harmony header) is open in what was read: an answer ended here
    /// cuts it.
    pub fn in_call(&self) -> bool {
        matches!(self.mode, Mode::Call | Mode::Header)
    }

    /// Drops the text between calls: the answer is only calls (a forced call).
    pub fn forced(mut self) -> Splitter {
        self.forced = true;
        self
    }

    /// The markers that may open or close something in the current mode.
    fn markers(&self) -> Vec<(&'static str, Act)> {
        let mut v = Vec::new();
        if self.m.style == Style::Harmony {
            if self.mode == Mode::Header {
                v.push((H_MESSAGE, Act::Body));
                return v;
            }
            v.extend([(H_START, Act::Header), (H_CHANNEL, Act::Header)]);
            let end = if self.mode == Mode::Content {
                Act::Drop
            } else {
                Act::Close
            };
            v.extend([(H_END, end), (H_CALL, end), (H_RETURN, end)]);
            return v;
        }
        match self.mode {
            Mode::Content => {
                if self.think {
                    v.push((self.m.think_open, Act::Think));
                }
                if self.calls {
                    v.push((self.m.call_open, Act::Call));
                    v.extend(self.m.frame.iter().map(|f| (*f, Act::Drop)));
                }
            }
            Mode::Reasoning => v.push((self.m.think_close, Act::Close)),
            Mode::Call => v.push((self.m.call_close, Act::Close)),
            Mode::Header => v.push((H_MESSAGE, Act::Body)),
        }
        v
    }

    /// Takes more text; returns the parts now complete.
    pub fn push(&mut self, text: &str) -> Vec<Part> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            if self.mode == Mode::Call && self.m.style.is_mistral() {
                if self.mistral(false, &mut out) {
                    return out;
                }
                continue;
            }
            if self.mode == Mode::Call && self.read_json_call(&mut out) {
                return out;
            }
            let markers = self.markers();
            // search only what was not searched yet (and a marker's length before it)
            let longest = markers.iter().map(|m| m.0.len()).max().unwrap_or(0);
            let mut from = self.scanned.saturating_sub(longest);
            while !self.buf.is_char_boundary(from) {
                from -= 1;
            }
            let found = markers
                .iter()
                .filter_map(|(mk, act)| self.buf[from..].find(mk).map(|at| (from + at, *mk, *act)))
                .min_by_key(|x| (x.0, std::cmp::Reverse(x.1.len())));
            match found {
                Some((at, mk, act)) => {
                    let before: String = self.buf.drain(..at).collect();
                    self.buf.drain(..mk.len());
                    self.scanned = 0;
                    self.act(before, mk, act, &mut out);
                }
                None => {
                    if self.mode == Mode::Call {
                        // read what cannot be the start of a closing marker
                        let keep = markers
                            .iter()
                            .map(|mk| partial_suffix(&self.buf, mk.0))
                            .max()
                            .unwrap_or(0);
                        let buf = std::mem::take(&mut self.buf);
                        let used = self.read_call(&buf[..buf.len() - keep], false, &mut out);
                        self.buf = buf;
                        self.buf.drain(..used);
                    }
                    if matches!(self.mode, Mode::Call | Mode::Header) {
                        // (a started call holds at most a pair and a marker's start: its
                        // bounds are read_call's)
                        let held = self.mode == Mode::Header
                            || matches!(self.call, CallSt::Head | CallSt::Whole);
                        // (what could be a closing marker's start is not the body's yet)
                        let keep = markers
                            .iter()
                            .map(|mk| partial_suffix(&self.buf, mk.0))
                            .max()
                            .unwrap_or(0);
                        if held && self.buf.len() - keep > MAX_CALL_BYTES {
                            // never closed within bounds: its first MAX_CALL_BYTES, as the
                            // text the model wrote, then the rest read as content
                            let cut = floor_boundary(&self.buf, MAX_CALL_BYTES);
                            let body: String = self.buf.drain(..cut).collect();
                            out.push(Part::Content(self.unclosed(&body)));
                            self.mode = Mode::Content;
                            self.call = CallSt::Head;
                            self.scanned = 0;
                            continue;
                        }
                        self.scanned = self.buf.len();
                        return out; // a call not streamed is given out whole at its close
                    }
                    // keep what could still be a marker's start
                    let keep = markers
                        .iter()
                        .map(|mk| partial_suffix(&self.buf, mk.0))
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

    /// What marker `mk` found after `before` does.
    fn act(&mut self, before: String, mk: &str, act: Act, out: &mut Vec<Part>) {
        let held = self.mode == Mode::Header
            || (self.mode == Mode::Call && matches!(self.call, CallSt::Head | CallSt::Whole));
        if held && before.len() > MAX_CALL_BYTES {
            // past the bound as a stream would have read it: the first MAX_CALL_BYTES as
            // text, the rest and the marker read again as content
            let cut = floor_boundary(&before, MAX_CALL_BYTES);
            out.push(Part::Content(self.unclosed(&before[..cut])));
            self.buf.insert_str(0, &format!("{}{mk}", &before[cut..]));
            self.mode = Mode::Content;
            self.call = CallSt::Head;
            self.scanned = 0;
            return;
        }
        if act == Act::Body {
            self.head.push_str(&before);
            self.head.push_str(mk);
            self.mode = self.body_mode();
            return;
        }
        if self.mode == Mode::Call {
            self.close_call(before, out);
        } else {
            self.emit(before, out);
        }
        match act {
            Act::Think => self.mode = Mode::Reasoning,
            Act::Call => self.mode = Mode::Call,
            Act::Drop => {}
            Act::Close => self.mode = Mode::Content,
            Act::Header => {
                self.mode = Mode::Header;
                self.head = mk.to_string();
            }
            Act::Body => {}
        }
    }

    /// Harmony: what the message whose header was read is.
    fn body_mode(&self) -> Mode {
        let (channel, to) = harmony_header(&self.head);
        if to.is_some() && self.calls {
            Mode::Call
        } else if channel == Some("analysis") && self.think {
            Mode::Reasoning
        } else {
            Mode::Content
        }
    }

    /// A call (or harmony header) that never closed, as the text the model wrote.
    fn unclosed(&self, body: &str) -> String {
        match (self.m.style, self.mode) {
            (Style::Harmony, _) | (_, Mode::Header) => format!("{}{body}", self.head),
            _ => format!("{}{body}", self.m.call_open),
        }
    }

    /// The end of the answer: whatever is held back, as what it is (an unclosed call's
    /// markup is given back as content; harmony's last call is whole, as `<|call|>` ends
    /// the answer).
    pub fn finish(&mut self) -> Vec<Part> {
        let mut out = Vec::new();
        // (what a Mistral list leaves is read again as content, which may open another)
        while self.mode == Mode::Call && self.m.style.is_mistral() {
            self.mistral(true, &mut out);
            let rest = std::mem::take(&mut self.buf);
            out.extend(self.push(&rest));
        }
        let rest = std::mem::take(&mut self.buf);
        self.scanned = 0;
        let started = matches!(
            self.call,
            CallSt::Args(_) | CallSt::Pairs { .. } | CallSt::Tail
        );
        match self.mode {
            // a started call ends with the answer (harmony's last call always does)
            Mode::Call if started || self.m.style == Style::Harmony => {
                self.close_call(rest, &mut out)
            }
            // (a forced answer cut before a call's arguments began: no content either)
            Mode::Call | Mode::Header if self.forced => {}
            Mode::Call | Mode::Header => out.push(Part::Content(self.unclosed(&rest))),
            _ => self.emit(rest, &mut out),
        }
        self.mode = Mode::Content;
        self.call = CallSt::Head;
        out
    }

    /// Reads a Mistral call list from what is held (`fin`: the answer ended there): true
    /// while it waits for more text, false once the list ended (the mode is content again,
    /// what is held not read yet).
    fn mistral(&mut self, fin: bool, out: &mut Vec<Part>) -> bool {
        loop {
            // blanks between the list's pieces are read as they come (never held and searched
            // again): kept to give back while no call began, dropped after
            if matches!(self.mis, Mis::Open | Mis::Item { .. } | Mis::Next) {
                let blank = self.buf.len() - self.buf.trim_start().len();
                let ws: String = self.buf.drain(..blank).collect();
                if matches!(self.mis, Mis::Open | Mis::Item { first: true }) {
                    self.taken.push_str(&ws);
                }
            }
            let next = self.buf.chars().next();
            match self.mis {
                Mis::Open => match next {
                    None if !fin => return true,
                    None => return self.mistral_none(out),
                    Some('[') => {
                        self.bracket = Some(self.taken.len());
                        self.taken.extend(self.buf.drain(..1));
                        self.mis = Mis::Item { first: true };
                    }
                    // one call's object without the list around it
                    Some('{') => self.mis = Mis::Item { first: true },
                    Some(_) => {
                        self.mis = Mis::Call {
                            named: true,
                            first: true,
                        }
                    }
                },
                Mis::Item { first } => match next {
                    None if !fin => return true,
                    Some('{') => {
                        self.mis = Mis::Call {
                            named: false,
                            first,
                        };
                    }
                    // (an empty list: no call, nothing to give back)
                    Some(']') => {
                        self.buf.drain(..1);
                        return self.mistral_end();
                    }
                    _ if first => return self.mistral_none(out),
                    _ => return self.mistral_end(),
                },
                Mis::Call { named, first } => {
                    let buf = std::mem::take(&mut self.buf);
                    let used = self.read_call(&buf, fin, out);
                    self.buf = buf;
                    self.buf.drain(..used);
                    match std::mem::replace(&mut self.call, CallSt::Head) {
                        CallSt::Head if !fin => return true,
                        // an array item of another shape: read whole
                        CallSt::Head | CallSt::Whole if !named => {
                            self.obj.clear();
                            self.mis = Mis::Obj {
                                depth: 0,
                                s: false,
                                esc: false,
                                first,
                            };
                        }
                        CallSt::Head | CallSt::Whole if first => return self.mistral_none(out),
                        CallSt::Head | CallSt::Whole => return self.mistral_end(),
                        CallSt::Args(j) if !fin => {
                            self.call = CallSt::Args(j);
                            self.taken.clear();
                            return true;
                        }
                        CallSt::Args(mut j) => {
                            let close = j.close();
                            if !close.is_empty() {
                                out.push(Part::CallArgs(close));
                            }
                            out.push(Part::CallEnd);
                            return self.mistral_end();
                        }
                        CallSt::Tail | CallSt::Pairs { .. } => {
                            out.push(Part::CallEnd);
                            self.taken.clear();
                            if named {
                                return self.mistral_end();
                            }
                            // the call's object, and what its arguments left open
                            let (open, s) = std::mem::take(&mut self.args_left);
                            self.mis = Mis::Rest {
                                depth: 1 + open,
                                s,
                                esc: false,
                            };
                        }
                    }
                }
                Mis::Obj {
                    mut depth,
                    mut s,
                    mut esc,
                    first,
                } => {
                    let end = skip_json(&self.buf, &mut depth, &mut s, &mut esc);
                    let upto = end.unwrap_or(self.buf.len());
                    self.obj.extend(self.buf.drain(..upto));
                    let parsed = match end {
                        Some(_) => parse_call(&self.obj),
                        None if fin || self.obj.len() > MAX_CALL_BYTES => None,
                        None => {
                            self.mis = Mis::Obj {
                                depth,
                                s,
                                esc,
                                first,
                            };
                            return true;
                        }
                    };
                    match parsed {
                        Some(call) => {
                            out.push(call);
                            self.taken.clear();
                            self.bracket = None;
                            self.mis = Mis::Next;
                        }
                        // not a call: its text read again as content
                        None => {
                            let obj = std::mem::take(&mut self.obj);
                            self.buf.insert_str(0, &obj);
                            return if first {
                                self.mistral_none(out)
                            } else {
                                self.mistral_end()
                            };
                        }
                    }
                }
                Mis::Rest {
                    mut depth,
                    mut s,
                    mut esc,
                } => {
                    let end = skip_json(&self.buf, &mut depth, &mut s, &mut esc);
                    match end {
                        Some(e) => {
                            self.buf.drain(..e);
                            self.mis = Mis::Next;
                        }
                        None => {
                            self.buf.clear();
                            if fin {
                                return self.mistral_end();
                            }
                            self.mis = Mis::Rest { depth, s, esc };
                            return true;
                        }
                    }
                }
                Mis::Next => match next {
                    None if !fin => return true,
                    Some(',') => {
                        self.buf.drain(..1);
                        self.mis = Mis::Item { first: false };
                    }
                    Some(']') => {
                        self.buf.drain(..1);
                        return self.mistral_end();
                    }
                    _ => return self.mistral_end(),
                },
            }
        }
    }

    /// A Mistral list ends: back to content, what is held read as that.
    fn mistral_end(&mut self) -> bool {
        self.mode = Mode::Content;
        self.mis = Mis::Open;
        self.call = CallSt::Head;
        self.taken.clear();
        self.bracket = None;
        self.obj.clear();
        self.args_left = (0, false);
        self.scanned = 0;
        false
    }

    /// `[TOOL_CALLS]` not followed by a call: the marker and what was read after it, as
    /// text (a list's `[` and what followed it read again: it may open another marker).
    fn mistral_none(&mut self, out: &mut Vec<Part>) -> bool {
        let mut taken = std::mem::take(&mut self.taken);
        if let Some(at) = self.bracket {
            self.buf.insert_str(0, &taken[at..]);
            taken.truncate(at);
        }
        let text = format!("{M_CALLS}{taken}");
        self.mistral_end();
        self.emit(text, out);
        false
    }

    /// A call's head is read before its close is searched for, and then its JSON arguments
    /// up to their end: a closing marker inside a JSON string is text of the arguments, not
    /// the call's end. True when all that is held went into arguments still open.
    fn read_json_call(&mut self, out: &mut Vec<Part>) -> bool {
        if matches!(self.call, CallSt::Head) {
            // up to the first closing marker (or what could be one's start): a head holds none
            let markers = self.markers();
            let upto = markers
                .iter()
                .filter_map(|(mk, _)| self.buf.find(mk))
                .min()
                .unwrap_or_else(|| {
                    let keep = markers
                        .iter()
                        .map(|mk| partial_suffix(&self.buf, mk.0))
                        .max()
                        .unwrap_or(0);
                    self.buf.len() - keep
                });
            let buf = std::mem::take(&mut self.buf);
            let used = self.read_call(&buf[..upto], false, out);
            self.buf = buf;
            self.buf.drain(..used);
            if used > 0 {
                self.scanned = 0;
            }
        }
        if !matches!(self.call, CallSt::Args(_)) {
            return false;
        }
        let buf = std::mem::take(&mut self.buf);
        let used = self.read_call(&buf, false, out);
        self.buf = buf;
        self.buf.drain(..used);
        self.scanned = 0;
        matches!(self.call, CallSt::Args(_))
    }

    /// Reads what of a call's body `text` can be read now (`fin`: the body is whole);
    /// returns how many of its bytes were used.
    fn read_call(&mut self, text: &str, fin: bool, out: &mut Vec<Part>) -> usize {
        let mut used = 0;
        loop {
            let rest = &text[used..];
            match &mut self.call {
                CallSt::Head => match self.head(rest, fin) {
                    Head::More => return used,
                    Head::Whole => {
                        self.call = CallSt::Whole;
                        return used;
                    }
                    Head::Start(name, at) => {
                        self.name.clone_from(&name);
                        out.push(Part::CallStart { name });
                        used += at;
                        self.call = if self.m.style == Style::Glm {
                            out.push(Part::CallArgs("{".into()));
                            CallSt::Pairs { n: 0, seen: 0 }
                        } else {
                            CallSt::Args(JsonOut::new())
                        };
                    }
                },
                CallSt::Whole => return used,
                CallSt::Args(j) => {
                    let (got, took) = j.read(rest);
                    if !got.is_empty() {
                        out.push(Part::CallArgs(got));
                    }
                    if j.ended() {
                        // where the text is left when it stopped being JSON
                        let left = if j.st == J::Failed {
                            (j.stack.len(), j.in_str)
                        } else {
                            (0, false)
                        };
                        let close = j.close();
                        if !close.is_empty() {
                            out.push(Part::CallArgs(close));
                        }
                        self.call = CallSt::Tail;
                        self.args_left = left;
                    }
                    return used + took;
                }
                CallSt::Pairs { n, seen } => {
                    let n = *n;
                    // the pending pair ends at its value's end marker: while it is not in
                    // what came since the last search, the pair is not whole
                    let mut from = (*seen).min(rest.len()).saturating_sub(GLM_END.len());
                    while !rest.is_char_boundary(from) {
                        from -= 1;
                    }
                    let got = if !fin && !rest[from..].contains(GLM_END) {
                        Ok(None)
                    } else {
                        glm_pair(rest)
                    };
                    match got {
                        Ok(Some((key, value, len))) if len <= MAX_CALL_BYTES => {
                            let value = glm_value(self.is_text(&self.name, key.trim()), value);
                            let comma = if n > 0 { "," } else { "" };
                            out.push(Part::CallArgs(format!(
                                "{comma}{}:{value}",
                                Value::String(key.trim().to_string())
                            )));
                            self.call = CallSt::Pairs { n: n + 1, seen: 0 };
                            used += len;
                        }
                        Ok(None) if rest.len() <= MAX_CALL_BYTES => {
                            self.call = CallSt::Pairs {
                                n,
                                seen: rest.len(),
                            };
                            return used;
                        }
                        // not a pair, or one past MAX_CALL_BYTES: the arguments end here
                        _ => {
                            out.push(Part::CallArgs("}".into()));
                            self.call = CallSt::Tail;
                            return text.len();
                        }
                    }
                }
                CallSt::Tail => return text.len(),
            }
        }
    }

    /// A call closed (or the answer ended in it) after `body`: the rest of it read, then the
    /// call ended (its arguments closed to valid JSON), or read whole.
    fn close_call(&mut self, body: String, out: &mut Vec<Part>) {
        let used = self.read_call(&body, true, out);
        match std::mem::replace(&mut self.call, CallSt::Head) {
            CallSt::Head | CallSt::Whole => out.push(self.call_part(&body[used..])),
            CallSt::Args(mut j) => {
                let close = j.close();
                if !close.is_empty() {
                    out.push(Part::CallArgs(close));
                }
                out.push(Part::CallEnd);
            }
            CallSt::Pairs { .. } => {
                out.push(Part::CallArgs("}".into()));
                out.push(Part::CallEnd);
            }
            CallSt::Tail => out.push(Part::CallEnd),
        }
    }

    /// What a call's body so far says of its head (`fin`: the body is whole).
    fn head(&self, text: &str, fin: bool) -> Head {
        let mut cut = text.len().min(HEAD_MAX);
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        let t = &text[..cut];
        let h = match self.m.style {
            Style::Hermes => hermes_head(t),
            Style::DeepSeek => deepseek_head(t),
            Style::Kimi => kimi_head(t),
            Style::Glm => glm_head(t),
            Style::Mistral | Style::MistralArgs => match self.mis {
                Mis::Call { named: true, .. } => mistral_head(t),
                _ => hermes_head(t),
            },
            Style::Harmony => {
                let to = harmony_header(&self.head).1.unwrap_or_default();
                args_start(to.strip_prefix("functions.").unwrap_or(to), t, 0)
            }
        };
        match h {
            Head::More if fin || text.len() > HEAD_MAX => Head::Whole,
            h => h,
        }
    }

    fn emit(&mut self, text: String, out: &mut Vec<Part>) {
        match self.mode {
            Mode::Content if self.forced => {}
            Mode::Content if !text.is_empty() => out.push(Part::Content(text)),
            Mode::Reasoning if !text.is_empty() => out.push(Part::Reasoning(text)),
            _ => {}
        }
    }

    /// A closed call's body as a call, or as the text the model wrote.
    fn call_part(&self, body: &str) -> Part {
        let parsed = match self.m.style {
            Style::Hermes | Style::Mistral | Style::MistralArgs => parse_call(body),
            Style::DeepSeek => parse_deepseek(body),
            Style::Glm => parse_glm(body, &|n, k| self.is_text(n, k)),
            Style::Harmony => parse_harmony(&self.head, body),
            Style::Kimi => parse_kimi(body),
        };
        parsed.unwrap_or_else(|| {
            Part::Content(match self.m.style {
                Style::Harmony => format!("{}{body}", self.head),
                _ => format!("{}{body}{}", self.m.call_open, self.m.call_close),
            })
        })
    }
}

/// The largest character boundary of `s` at or below `at`.
fn floor_boundary(s: &str, at: usize) -> usize {
    let mut cut = at.min(s.len());
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    cut
}

/// The length of the longest suffix of `s` that is a proper prefix of `marker`.
fn partial_suffix(s: &str, marker: &str) -> usize {
    (1..marker.len().min(s.len() + 1))
        .rev()
        .find(|&n| s.is_char_boundary(s.len() - n) && marker.starts_with(&s[s.len() - n..]))
        .unwrap_or(0)
}

/// A cursor over a call's head: each step fails with [`Head::More`] at the end of the text
/// and [`Head::Whole`] where the text is not the head's shape.
struct Cur<'a> {
    t: &'a str,
    i: usize,
}

impl Cur<'_> {
    fn ws(&mut self) {
        let rest = &self.t[self.i..];
        self.i += rest.len() - rest.trim_start().len();
    }

    fn lit(&mut self, l: &str) -> Result<(), Head> {
        let rest = &self.t[self.i..];
        if rest.starts_with(l) {
            self.i += l.len();
            Ok(())
        } else if l.starts_with(rest) {
            Err(Head::More)
        } else {
            Err(Head::Whole)
        }
    }

    /// A JSON string.
    fn string(&mut self) -> Result<String, Head> {
        let from = self.i;
        self.lit("\"")?;
        let mut esc = false;
        for (k, c) in self.t[self.i..].char_indices() {
            if esc {
                esc = false;
            } else if c == '\\' {
                esc = true;
            } else if c == '"' {
                let end = self.i + k + 1;
                let s = serde_json::from_str(&self.t[from..end]).map_err(|_| Head::Whole)?;
                self.i = end;
                return Ok(s);
            }
        }
        Err(Head::More)
    }
}

/// Where a call's arguments start: after blanks, at `{` (else the call is read whole).
fn args_start(name: &str, t: &str, at: usize) -> Head {
    if !valid_name(name) {
        return Head::Whole;
    }
    let rest = t[at..].trim_start();
    match rest.chars().next() {
        None => Head::More,
        Some('{') => Head::Start(name.to_string(), t.len() - rest.len()),
        Some(_) => Head::Whole,
    }
}

/// Hermes: `{"name": "NAME", "arguments": {` (or `"parameters"`).
fn hermes_head(t: &str) -> Head {
    let mut c = Cur { t, i: 0 };
    let head = (|| {
        c.ws();
        c.lit("{")?;
        c.ws();
        if c.string()? != "name" {
            return Err(Head::Whole);
        }
        c.ws();
        c.lit(":")?;
        c.ws();
        let name = c.string()?;
        c.ws();
        c.lit(",")?;
        c.ws();
        let key = c.string()?;
        if key != "arguments" && key != "parameters" {
            return Err(Head::Whole);
        }
        c.ws();
        c.lit(":")?;
        Ok(args_start(&name, t, c.i))
    })();
    head.unwrap_or_else(|h| h)
}

/// Mistral v11: `NAME[ARGS]{` (v13: `NAME[CALL_ID]ID[ARGS]{`).
fn mistral_head(t: &str) -> Head {
    let body = t.trim_start();
    let Some(open) = body.find('[') else {
        // the name so far
        return if body.is_empty() || valid_name(body) {
            Head::More
        } else {
            Head::Whole
        };
    };
    let name = &body[..open];
    if !valid_name(name) || name.contains(']') {
        return Head::Whole;
    }
    let mut rest = &body[open..];
    if let Some(id) = rest.strip_prefix(M_CALL_ID) {
        match id.find('[') {
            None => return Head::More,
            Some(i) => rest = &id[i..],
        }
    }
    match rest.strip_prefix(M_ARGS) {
        Some(args) => args_start(name, t, t.len() - args.len()),
        None if M_ARGS.starts_with(rest) || M_CALL_ID.starts_with(rest) => Head::More,
        None => Head::Whole,
    }
}

/// DeepSeek V3: `function<｜tool▁sep｜>NAME` then an optional ```` ```json ```` fence before
/// `{`; V3.1: `NAME<｜tool▁sep｜>{`.
fn deepseek_head(t: &str) -> Head {
    let Some(sep) = t.find(DS_SEP) else {
        return Head::More;
    };
    let kind = t[..sep].trim();
    let from = sep + DS_SEP.len();
    if !(kind.is_empty() || kind == "function") {
        return args_start(kind, t, from);
    }
    let rest = t[from..].trim_start();
    let Some(end) = rest.find(|c: char| c.is_whitespace() || c == '`') else {
        return Head::More;
    };
    let name = &rest[..end];
    let mut c = Cur {
        t,
        i: t.len() - rest.len() + end,
    };
    c.ws();
    if t[c.i..].starts_with('`') {
        if let Err(h) = c.lit("```") {
            return h;
        }
        // the fence's language: `json`, or none
        let lang = &t[c.i..];
        if lang.starts_with("json") {
            c.i += 4;
        } else if "json".starts_with(lang) {
            return Head::More;
        }
    }
    args_start(name, t, c.i)
}

/// Kimi K2: `functions.NAME:INDEX<|tool_call_argument_begin|>{`.
fn kimi_head(t: &str) -> Head {
    let Some(at) = t.find(KIMI_ARG) else {
        return Head::More;
    };
    let head = t[..at].trim();
    let head = head.strip_prefix("functions.").unwrap_or(head);
    let name = match head.rsplit_once(':') {
        Some((n, i)) if !i.is_empty() && i.bytes().all(|b| b.is_ascii_digit()) => n,
        _ => head,
    };
    args_start(name, t, at + KIMI_ARG.len())
}

/// GLM-4.5: `NAME` then the first `<arg_key>` (where the pairs start).
fn glm_head(t: &str) -> Head {
    match t.find("<arg_key>") {
        None => Head::More,
        Some(at) if valid_name(t[..at].trim()) => Head::Start(t[..at].trim().to_string(), at),
        Some(_) => Head::Whole,
    }
}

/// `t` after `tag`: `Ok(Some(rest))`; `Ok(None)` while `t` is still the start of `tag`;
/// `Err` when it is something else.
fn after_tag<'a>(t: &'a str, tag: &str) -> Result<Option<&'a str>, ()> {
    match t.strip_prefix(tag) {
        Some(rest) => Ok(Some(rest)),
        None if tag.starts_with(t) => Ok(None),
        None => Err(()),
    }
}

/// What ends a GLM argument's value.
const GLM_END: &str = "</arg_value>";

/// One GLM pair at the start of `s` (after blanks): `Ok(Some((key, value, bytes used)))`,
/// `Ok(None)` when it is not whole yet, `Err` when `s` is not a pair.
fn glm_pair(s: &str) -> Result<Option<(&str, &str, usize)>, ()> {
    let Some(r) = after_tag(s.trim_start(), "<arg_key>")? else {
        return Ok(None);
    };
    let Some((key, r)) = r.split_once("</arg_key>") else {
        return Ok(None);
    };
    let Some(r) = after_tag(r.trim_start(), "<arg_value>")? else {
        return Ok(None);
    };
    let Some((value, r)) = r.split_once(GLM_END) else {
        return Ok(None);
    };
    Ok(Some((key, value, s.len() - r.len())))
}

/// A function name as a call may give it: no spaces, no markup.
fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 256
        && !n.contains(|c: char| c.is_whitespace() || c == '<' || c == '>' || c == '`')
}

/// A call's body: `{"name": "...", "arguments": {...}}` (arguments as an object, or as a
/// string holding JSON); its arguments given back as JSON text.
pub fn parse_call(body: &str) -> Option<Part> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
        None | Some(Value::Null) => "{}".to_string(),
        Some(Value::String(s)) => json_arguments(s)?,
        Some(a) if a.is_object() => a.to_string(),
        Some(_) => return None,
    };
    Some(Part::Call { name, arguments })
}

/// Arguments written as JSON text: an object (nothing: no arguments).
fn json_arguments(text: &str) -> Option<String> {
    let t = text.trim();
    if t.is_empty() {
        return Some("{}".into());
    }
    serde_json::from_str::<Value>(t)
        .ok()
        .filter(Value::is_object)
        .map(|v| v.to_string())
}

/// DeepSeek V3's call body: `function<｜tool▁sep｜>NAME\n```json\n{..}\n```` (or V3.1's
/// `NAME<｜tool▁sep｜>{..}`).
fn parse_deepseek(body: &str) -> Option<Part> {
    let (kind, rest) = body.split_once(DS_SEP)?;
    let kind = kind.trim();
    let (name, args) = if kind.is_empty() || kind == "function" {
        let rest = rest.trim_start();
        let end = rest
            .find(|c: char| c.is_whitespace() || c == '`')
            .unwrap_or(rest.len());
        rest.split_at(end)
    } else {
        (kind, rest)
    };
    if !valid_name(name) {
        return None;
    }
    let a = args.trim();
    let a = a
        .strip_prefix("```json")
        .or_else(|| a.strip_prefix("```"))
        .unwrap_or(a);
    let a = a.strip_suffix("```").unwrap_or(a);
    Some(Part::Call {
        name: name.to_string(),
        arguments: json_arguments(a)?,
    })
}

/// Kimi K2's call body: `functions.NAME:INDEX<|tool_call_argument_begin|>{..}` (the prefix
/// and the index as the model writes them; only the name is kept).
fn parse_kimi(body: &str) -> Option<Part> {
    let (head, args) = body.split_once(KIMI_ARG)?;
    let head = head.trim();
    let head = head.strip_prefix("functions.").unwrap_or(head);
    let name = match head.rsplit_once(':') {
        Some((n, i)) if !i.is_empty() && i.bytes().all(|b| b.is_ascii_digit()) => n,
        _ => head,
    };
    if !valid_name(name) {
        return None;
    }
    Some(Part::Call {
        name: name.to_string(),
        arguments: json_arguments(args)?,
    })
}

/// A GLM value: for a string parameter (`text`: `Some(nullable)`) the raw text (`null` for
/// the text `null` where the parameter may be null, as GLM's template writes a None), else
/// JSON where it parses as JSON, else the text itself.
fn glm_value(text: Option<bool>, v: &str) -> Value {
    match text {
        Some(true) if v == "null" => Value::Null,
        Some(_) => Value::String(v.to_string()),
        None => serde_json::from_str(v).unwrap_or_else(|_| Value::String(v.to_string())),
    }
}

/// Whether a property's schema says its value is a string: `Some(nullable)` for `type`
/// string (or `["string", "null"]`), or a `const` or an `enum` of strings only.
fn text_schema(s: &Value) -> Option<bool> {
    match s.get("type") {
        Some(Value::String(t)) => (t == "string").then_some(false),
        Some(Value::Array(ts)) => {
            let has = |n: &str| ts.iter().any(|t| t == n);
            (has("string") && ts.iter().all(|t| t == "string" || t == "null")).then(|| has("null"))
        }
        Some(_) => None,
        None => {
            let strings = s.get("const").is_some_and(Value::is_string)
                || s.get("enum")
                    .and_then(Value::as_array)
                    .is_some_and(|e| !e.is_empty() && e.iter().all(Value::is_string));
            strings.then_some(false)
        }
    }
}

/// The properties of a tool's parameters whose values are strings (and whether each may be
/// null).
fn text_props(params: &Value) -> Vec<(String, bool)> {
    params
        .get("properties")
        .and_then(Value::as_object)
        .map(|p| {
            p.iter()
                .filter_map(|(k, s)| text_schema(s).map(|n| (k.clone(), n)))
                .collect()
        })
        .unwrap_or_default()
}

/// GLM-4.5's call body: `NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>...`; each
/// value as [`glm_value`] reads it (`text(name, key)`: a string parameter).
fn parse_glm(body: &str, text: &dyn Fn(&str, &str) -> Option<bool>) -> Option<Part> {
    let body = body.trim();
    let end = body.find("<arg_key>").unwrap_or(body.len());
    let name = body[..end].trim();
    if !valid_name(name) {
        return None;
    }
    let mut rest = &body[end..];
    let mut args = serde_json::Map::new();
    while !rest.is_empty() {
        let r = rest.strip_prefix("<arg_key>")?;
        let (k, r) = r.split_once("</arg_key>")?;
        let r = r.trim_start().strip_prefix("<arg_value>")?;
        let (v, r) = r.split_once("</arg_value>")?;
        args.insert(k.trim().to_string(), glm_value(text(name, k.trim()), v));
        rest = r.trim_start();
    }
    Some(Part::Call {
        name: name.to_string(),
        arguments: Value::Object(args).to_string(),
    })
}

/// A harmony header's channel and recipient (`to=...`), each up to a space or a marker.
fn harmony_header(head: &str) -> (Option<&str>, Option<&str>) {
    fn word(s: &str) -> &str {
        let end = s
            .find(|c: char| c.is_whitespace() || c == '<')
            .unwrap_or(s.len());
        &s[..end]
    }
    let channel = head
        .find(H_CHANNEL)
        .map(|i| word(&head[i + H_CHANNEL.len()..]));
    let to = head
        .find("to=")
        .map(|i| word(&head[i + 3..]))
        .filter(|w| !w.is_empty());
    (channel, to)
}

/// A harmony call: the recipient in `head` (`functions.NAME`), the arguments in the body.
fn parse_harmony(head: &str, body: &str) -> Option<Part> {
    let to = harmony_header(head).1?;
    let name = to.strip_prefix("functions.").unwrap_or(to);
    if !valid_name(name) {
        return None;
    }
    Some(Part::Call {
        name: name.to_string(),
        arguments: json_arguments(body)?,
    })
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

/// The parts with each whole call as a streamed one (its start, its arguments, its end):
/// what a stream's writer takes, so it writes every call one way.
pub fn as_streamed(parts: Vec<Part>) -> impl Iterator<Item = Part> {
    parts.into_iter().flat_map(|p| match p {
        Part::Call { name, arguments } => vec![
            Part::CallStart { name },
            Part::CallArgs(arguments),
            Part::CallEnd,
        ],
        p => vec![p],
    })
}

/// Joins neighbouring content (and reasoning) parts, and each streamed call's pieces into
/// one [`Part::Call`].
pub fn merge(parts: Vec<Part>) -> Vec<Part> {
    let mut out: Vec<Part> = Vec::new();
    let mut open = false;
    for p in parts {
        match (out.last_mut(), p) {
            (_, Part::CallStart { name }) => {
                out.push(Part::Call {
                    name,
                    arguments: String::new(),
                });
                open = true;
            }
            (Some(Part::Call { arguments, .. }), Part::CallArgs(a)) if open => {
                arguments.push_str(&a)
            }
            (_, Part::CallArgs(_)) => {}
            (_, Part::CallEnd) => open = false,
            (Some(Part::Content(a)), Part::Content(b)) => a.push_str(&b),
            (Some(Part::Reasoning(a)), Part::Reasoning(b)) => a.push_str(&b),
            (_, p) => {
                open = false;
                out.push(p)
            }
        }
    }
    out
}

/// The `call` rule (and a `call_N` per tool) of `tools` in markup `m`, each call beginning
/// with `open` (the markup's call marker, or nothing where a rule before it wrote it).
fn call_rules(
    m: &Markup,
    tools: &[(String, Value)],
    special: &dyn Fn(&str) -> Option<u32>,
    open: &str,
) -> String {
    let mut rules = String::new();
    if matches!(m.style, Style::Hermes | Style::Mistral) {
        // every tool's schema inside one (the call's JSON names the tool): a schema whose
        // `$ref`s point into itself moves under the one schema's `$defs`
        let mut defs = serde_json::Map::new();
        let alts: Vec<Value> = tools
            .iter()
            .enumerate()
            .map(|(i, (name, params))| {
                let params = if !params.is_object() {
                    serde_json::json!({"type": "object"})
                } else if has_refs(params) {
                    hoist(params, &format!("tool{i}"), &mut defs)
                } else {
                    params.clone()
                };
                serde_json::json!({"type": "object", "properties": {
                    "name": {"const": name},
                    "arguments": params},
                    "required": ["name", "arguments"], "additionalProperties": false})
            })
            .collect();
        let mut schema =
            serde_json::json!({"anyOf": alts, "x-guidance": {"whitespace_flexible": false}});
        if !defs.is_empty() {
            schema["$defs"] = Value::Object(defs);
        }
        if m.style == Style::Mistral {
            // an object of the array that `calls_grammar` writes around the calls
            rules.push_str(&format!("call: %json {schema}\n"));
        } else {
            rules.push_str(&format!(
                "call: {} \"\\n\" %json {} \"\\n\" {}\n",
                if open.is_empty() {
                    String::new()
                } else {
                    lit(open)
                },
                schema,
                lit(m.call_close),
            ));
        }
    } else {
        let mut alts = Vec::new();
        for (i, (name, params)) in tools.iter().enumerate() {
            let args = compact_schema(params, serde_json::json!({"type": "object"}));
            let body = match m.style {
                Style::DeepSeek => format!(
                    "{} %json {} {}",
                    lit(&format!("{open}function{DS_SEP}{name}\n```json\n")),
                    args,
                    lit(&format!("\n```{}", m.call_close))
                ),
                Style::Kimi => format!(
                    "{} %json {} {}",
                    harmony_items(&format!("{open}functions.{name}:0{KIMI_ARG}"), special),
                    args,
                    harmony_items(m.call_close, special)
                ),
                Style::MistralArgs => format!(
                    "{} {} {} %json {}",
                    mistral_item(open, special),
                    lit(name),
                    mistral_item(M_ARGS, special),
                    args
                ),
                Style::Harmony => format!(
                    "{} %json {}",
                    harmony_items(
                        &format!(
                            "{H_CHANNEL}commentary to=functions.{name} <|constrain|>json{H_MESSAGE}"
                        ),
                        special
                    ),
                    args
                ),
                _ => format!(
                    "{} {} {}",
                    lit(&format!("{open}{name}\n")),
                    glm_args(params),
                    lit(m.call_close)
                ),
            };
            rules.push_str(&format!("call_{i}: {body}\n"));
            alts.push(format!("call_{i}"));
        }
        rules.push_str(&format!("call: {}\n", alts.join(" | ")));
    }
    rules
}

/// Whether a schema holds a `$ref` (or definitions one may name).
fn has_refs(v: &Value) -> bool {
    match v {
        Value::Object(o) => {
            o.contains_key("$ref")
                || o.contains_key("$defs")
                || o.contains_key("definitions")
                || o.values().any(has_refs)
        }
        Value::Array(a) => a.iter().any(has_refs),
        _ => false,
    }
}

/// Tool schema `params` moved into `defs` under names starting `tag` (itself as
/// `{tag}_root`, its `$defs` and `definitions` as `{tag}_$defs_NAME` and
/// `{tag}_definitions_NAME`), each local `$ref` rewritten
/// to point where its target went, so the references resolve inside a larger schema as they
/// did alone; returns the reference to it.
fn hoist(params: &Value, tag: &str, defs: &mut serde_json::Map<String, Value>) -> Value {
    fn rewrite(v: &mut Value, tag: &str) {
        match v {
            Value::Object(o) => {
                if let Some(Value::String(r)) = o.get_mut("$ref") {
                    if let Some(pointer) = r.strip_prefix('#') {
                        let named = ["$defs", "definitions"].iter().find_map(|k| {
                            pointer
                                .strip_prefix(&format!("/{k}/"))
                                .map(|rest| (k, rest))
                        });
                        *r = match named {
                            Some((k, rest)) => format!("#/$defs/{tag}_{k}_{rest}"),
                            None => format!("#/$defs/{tag}_root{pointer}"),
                        };
                    }
                }
                for x in o.values_mut() {
                    rewrite(x, tag);
                }
            }
            Value::Array(a) => a.iter_mut().for_each(|x| rewrite(x, tag)),
            _ => {}
        }
    }
    let mut root = params.clone();
    let mut own = Vec::new();
    if let Some(o) = root.as_object_mut() {
        for k in ["$defs", "definitions"] {
            if let Some(Value::Object(d)) = o.remove(k) {
                own.extend(
                    d.into_iter()
                        .map(|(name, s)| (format!("{tag}_{k}_{name}"), s)),
                );
            }
        }
    }
    rewrite(&mut root, tag);
    for (name, mut s) in own {
        rewrite(&mut s, tag);
        defs.insert(name, s);
    }
    defs.insert(format!("{tag}_root"), root);
    serde_json::json!({"$ref": format!("#/$defs/{tag}_root")})
}

/// A regex matching `s` literally.
fn regex_lit(s: &str) -> String {
    s.chars()
        .map(|c| {
            if "\\.+*?()|[]{}^$#&-~".contains(c) {
                format!("\\{c}")
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// The Lark grammar of a free answer whose tool calls, once begun, are valid (`tool_choice:
/// auto` with `strict` tools): any text up to the family's call marker, then a call naming
/// one of `tools` with arguments valid against its schema, up to `most` times, then any
/// text without the marker. The text is free (reasoning included), so an answer without a
/// call is what the model would write unconstrained. Only for families whose calls begin
/// with a text marker (Hermes, GLM: `<tool_call>`); None for the others.
pub fn auto_calls_grammar(m: &Markup, tools: &[(String, Value)], most: usize) -> Option<String> {
    if !matches!(m.style, Style::Hermes | Style::Glm) {
        return None;
    }
    let rules = call_rules(m, tools, &|_| None, "");
    let marker = regex_lit(m.call_open);
    let mut calls = String::new();
    for _ in 0..most.max(1) {
        calls = format!("(pre call {calls})?");
    }
    Some(format!(
        "start: {calls} TAIL\npre[lazy]: /(?s:.*){marker}/\nTAIL: /(?s:.*)/ & ~/(?s:.*){marker}(?s:.*)/\n{rules}"
    ))
}

/// A schema as a grammar's `%json` takes it: an object schema (anything else: any object),
/// compact (a random model could otherwise write spaces forever).
fn compact_schema(params: &Value, fallback: Value) -> Value {
    let mut s = if params.is_object() {
        params.clone()
    } else {
        fallback
    };
    if let Some(o) = s.as_object_mut() {
        o.insert(
            "x-guidance".into(),
            serde_json::json!({"whitespace_flexible": false}),
        );
    }
    s
}

/// A Lark string literal.
fn lit(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

/// GLM's argument pairs of a tool whose parameters are `params`: each property in declared
/// order (required ones always, the others optionally), its value JSON valid against the
/// property's schema (which the parser reads back as that value).
fn glm_args(params: &Value) -> String {
    let required: Vec<&str> = params
        .get("required")
        .and_then(|r| r.as_array())
        .map(|r| r.iter().filter_map(|x| x.as_str()).collect())
        .unwrap_or_default();
    let mut keys: Vec<(String, Value)> = params
        .get("properties")
        .and_then(|p| p.as_object())
        .map(|p| p.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
        .unwrap_or_default();
    for r in &required {
        if !keys.iter().any(|(k, _)| k == r) {
            keys.push((r.to_string(), serde_json::json!({})));
        }
    }
    let mut out = Vec::new();
    for (k, s) in keys {
        // a string's raw text, else the value as JSON
        let value = glm_text(&s).unwrap_or_else(|| {
            let mut s = compact_schema(&s, serde_json::json!({}));
            // the definitions a property's `$ref` may point at
            for defs in ["$defs", "definitions"] {
                if let (Some(d), Some(o)) = (params.get(defs), s.as_object_mut()) {
                    o.insert(defs.into(), d.clone());
                }
            }
            format!("%json {s}")
        });
        let one = format!(
            "{} {value} {}",
            lit(&format!("<arg_key>{k}</arg_key>\n<arg_value>")),
            lit("</arg_value>\n")
        );
        out.push(if required.contains(&k.as_str()) {
            one
        } else {
            format!("({one})?")
        });
    }
    out.join(" ")
}

/// A string parameter's value as GLM writes it, raw text, as Lark items: a `const` or an
/// `enum` as its literals, else text without `<` within the schema's `minLength` /
/// `maxLength`, or matching its `pattern` (taken as anchored, as llguidance takes JSON
/// schemas' patterns). `format` is not enforced on raw text. None: not a string parameter.
fn glm_text(s: &Value) -> Option<String> {
    // (not a string parameter: no raw text)
    text_schema(s)?;
    if let Some(c) = s.get("const").and_then(Value::as_str) {
        return Some(lit(c));
    }
    if let Some(e) = s.get("enum").and_then(Value::as_array) {
        let alts: Vec<String> = e.iter().filter_map(Value::as_str).map(lit).collect();
        if !alts.is_empty() {
            return Some(format!("({})", alts.join(" | ")));
        }
    }
    if let Some(p) = s.get("pattern").and_then(Value::as_str) {
        let p = p.strip_prefix('^').unwrap_or(p);
        let p = match p.strip_suffix('$') {
            Some(q) if !q.ends_with('\\') => q,
            _ => p,
        };
        return Some(format!("/{}/", slashes_escaped(p)));
    }
    let min = s.get("minLength").and_then(Value::as_u64).unwrap_or(0);
    let rep = match s.get("maxLength").and_then(Value::as_u64) {
        Some(max) => format!("{{{min},{}}}", max.max(min)),
        None if min > 0 => format!("{{{min},}}"),
        None => "*".into(),
    };
    Some(format!("/[^<]{rep}/"))
}

/// A regex with each `/` not already escaped written `\/` (inside a Lark `/.../`).
fn slashes_escaped(p: &str) -> String {
    let mut out = String::new();
    let mut escaped = false;
    for c in p.chars() {
        if c == '/' && !escaped {
            out.push('\\');
        }
        escaped = c == '\\' && !escaped;
        out.push(c);
    }
    out
}

/// A Mistral marker (`[TOOL_CALLS]`, `[ARGS]`) as a Lark item: its special token by id
/// where the vocabulary has it as one (llguidance names only `<...>` tokens), else text.
fn mistral_item(marker: &str, special: &dyn Fn(&str) -> Option<u32>) -> String {
    match special(marker) {
        Some(id) => format!("<[{id}]>"),
        None => lit(marker),
    }
}

/// Harmony's text `t` as Lark items: each `<|...|>` marker that is a special token of the
/// vocabulary (`special`) as that token, the text around as string literals.
fn harmony_items(t: &str, special: &dyn Fn(&str) -> Option<u32>) -> String {
    let mut items = Vec::new();
    let mut text = String::new();
    let mut rest = t;
    while let Some(at) = rest.find("<|") {
        let Some(len) = rest[at..].find("|>").map(|e| e + 2) else {
            break;
        };
        let marker = &rest[at..at + len];
        text.push_str(&rest[..at]);
        if special(marker).is_some() {
            if !text.is_empty() {
                items.push(lit(&std::mem::take(&mut text)));
            }
            items.push(marker.to_string());
        } else {
            text.push_str(marker);
        }
        rest = &rest[at + len..];
    }
    text.push_str(rest);
    if !text.is_empty() {
        items.push(lit(&text));
    }
    items.join(" ")
}

/// The Lark grammar of an answer that is only tool calls (1 to `most`) in markup `m`, each
/// naming one of `tools` (`(name, JSON schema of its parameters)`) with arguments valid
/// against its schema. `special` says which marker texts are special tokens of the
/// vocabulary: harmony's are then written as those tokens (gpt-oss's vocabulary has them),
/// else as text.
pub fn calls_grammar(
    m: &Markup,
    tools: &[(String, Value)],
    most: usize,
    special: &dyn Fn(&str) -> Option<u32>,
) -> String {
    let rules = call_rules(m, tools, special, m.call_open);
    if m.style == Style::Mistral {
        // `[TOOL_CALLS] [` the calls' objects `, `-separated `]`, as the v3 template writes
        // them
        let more = format!(" ({} call)?", lit(", ")).repeat(most.max(1) - 1);
        return format!(
            "start: {} {} call{more} {}\n{rules}",
            mistral_item(M_CALLS, special),
            lit(" ["),
            lit("]")
        );
    }
    let (open, sep, close) = match m.style {
        Style::Hermes | Style::Glm => ("", "\n", ""),
        // (each call opens with its own `[TOOL_CALLS]`)
        Style::MistralArgs | Style::Mistral => ("", "", ""),
        Style::DeepSeek => (DS_CALLS_BEGIN, "", DS_CALLS_END),
        Style::Harmony => ("", "<|call|><|start|>assistant", ""),
        Style::Kimi => (KIMI_SECTION_BEGIN, "", KIMI_SECTION_END),
    };
    let sep = if sep.is_empty() {
        String::new()
    } else if m.style == Style::Harmony {
        format!("{} ", harmony_items(sep, special))
    } else {
        format!("{} ", lit(sep))
    };
    // one call, then up to most - 1 more
    let more = format!(" ({sep}call)?").repeat(most.max(1) - 1);
    // (a frame's `<|...|>` markers that are special tokens written as those tokens, as
    // harmony's: Kimi's section markers)
    let open = if open.is_empty() {
        String::new()
    } else {
        format!("{} ", harmony_items(open, special))
    };
    let close = if close.is_empty() {
        String::new()
    } else {
        format!(" {}", harmony_items(close, special))
    };
    format!("start: {open}call{more}{close}\n{rules}")
}

/// Where [`JsonOut`] is in the value it reads.
#[derive(Clone, Copy, Debug, PartialEq)]
enum J {
    /// A value is expected (`true`: right after `[`, so `]` may come).
    Value(bool),
    /// Right after `{`: a key or `}`.
    ObjFirst,
    /// After a comma in an object: a key.
    KeyNext,
    /// Inside a key (`true`: after a backslash).
    Key(bool),
    /// After a key: its colon.
    Colon,
    /// Inside a string value.
    Str,
    /// Inside a string value's escape sequence (held in `esc`).
    Esc,
    Num,
    Lit,
    /// After a value inside a container: a comma or the container's end.
    After,
    Done,
    Failed,
}

/// One JSON value read as the model writes it and given out as it comes: whitespace outside
/// strings dropped, and only so far as what was given can still be closed to valid JSON (a
/// comma and the key after it, a number, a literal or an escape sequence are held until they
/// are whole). Where the text stops being JSON, or ends first, [`JsonOut::close`] gives what
/// closes the value, so what was given plus that always parses (with serde_json: nesting
/// past [`JSON_DEPTH`] and a key or number past [`HELD_MAX`] bytes end it too; a number out
/// of f64's range, which serde_json refuses, is given as the largest finite one of its sign
/// and the value goes on).
struct JsonOut {
    /// Open containers, innermost last: true for an object.
    stack: Vec<bool>,
    st: J,
    /// Read but not given yet.
    held: String,
    /// Where the number or literal being read starts in `held`.
    from: usize,
    /// An escape sequence being read.
    esc: String,
    /// It stopped being JSON inside a string.
    in_str: bool,
}

/// Deepest nesting [`JsonOut`] follows (serde_json refuses past 128).
const JSON_DEPTH: usize = 100;

/// Most bytes [`JsonOut`] holds back (a key, a number): past them the value ends.
const HELD_MAX: usize = 1 << 16;

impl JsonOut {
    fn new() -> JsonOut {
        JsonOut {
            stack: Vec::new(),
            st: J::Value(false),
            held: String::new(),
            from: 0,
            esc: String::new(),
            in_str: false,
        }
    }

    /// The value is whole, or what came stopped being JSON: nothing more is read.
    fn ended(&self) -> bool {
        matches!(self.st, J::Done | J::Failed)
    }

    /// Reads `text`; returns what can be given now.
    #[cfg(test)]
    fn feed(&mut self, text: &str) -> String {
        self.read(text).0
    }

    /// Reads `text` until the value ends; returns what can be given now and how many bytes
    /// of `text` the value took (a character where it stopped being JSON is not one of them).
    fn read(&mut self, text: &str) -> (String, usize) {
        let mut out = String::new();
        for (i, c) in text.char_indices() {
            if self.ended() {
                return (out, i);
            }
            self.step(c, &mut out);
            if self.st == J::Failed {
                return (out, i);
            }
        }
        (out, text.len())
    }

    /// What closes the value given so far (a number that the end of the text completes is
    /// given first); nothing more is read after.
    fn close(&mut self) -> String {
        let mut out = String::new();
        match self.st {
            J::Num if json_number(&self.held[self.from..]) => {
                out.push_str(&number_out(&self.held, self.from));
            }
            J::Str | J::Esc => out.push('"'),
            J::Failed if self.in_str => out.push('"'),
            _ => {}
        }
        self.held.clear();
        while let Some(obj) = self.stack.pop() {
            out.push(if obj { '}' } else { ']' });
        }
        self.st = J::Done;
        out
    }

    fn give(&mut self, s: &str, out: &mut String) {
        out.push_str(&self.held);
        self.held.clear();
        out.push_str(s);
    }

    fn fail(&mut self) {
        self.in_str = matches!(self.st, J::Str | J::Esc);
        self.st = J::Failed;
    }

    fn after_value(&mut self) {
        self.st = if self.stack.is_empty() {
            J::Done
        } else {
            J::After
        };
    }

    fn step(&mut self, c: char, out: &mut String) {
        let ws = matches!(c, ' ' | '\t' | '\n' | '\r');
        let deep = matches!(self.st, J::Value(_))
            && matches!(c, '{' | '[')
            && self.stack.len() >= JSON_DEPTH;
        if deep || self.held.len() > HELD_MAX {
            self.fail();
            return;
        }
        match self.st {
            J::Value(first) => match c {
                _ if ws => {}
                '{' => {
                    self.give("{", out);
                    self.stack.push(true);
                    self.st = J::ObjFirst;
                }
                '[' => {
                    self.give("[", out);
                    self.stack.push(false);
                    self.st = J::Value(true);
                }
                ']' if first => {
                    self.give("]", out);
                    self.stack.pop();
                    self.after_value();
                }
                '"' => {
                    self.give("\"", out);
                    self.st = J::Str;
                }
                '-' | '0'..='9' => {
                    self.from = self.held.len();
                    self.held.push(c);
                    self.st = J::Num;
                }
                't' | 'f' | 'n' => {
                    self.from = self.held.len();
                    self.held.push(c);
                    self.st = J::Lit;
                }
                _ => self.fail(),
            },
            J::ObjFirst | J::KeyNext => match c {
                _ if ws => {}
                '}' if self.st == J::ObjFirst => {
                    self.give("}", out);
                    self.stack.pop();
                    self.after_value();
                }
                '"' => {
                    self.from = self.held.len();
                    self.held.push('"');
                    self.st = J::Key(false);
                }
                _ => self.fail(),
            },
            J::Key(escaped) => {
                if (c as u32) < 0x20 {
                    // a raw control character, written as its escape
                    if escaped {
                        self.fail();
                    } else {
                        self.held.push_str(&control_escape(c));
                    }
                    return;
                }
                self.held.push(c);
                self.st = if escaped {
                    J::Key(false)
                } else if c == '\\' {
                    J::Key(true)
                } else if c == '"' {
                    // a key is given whole: its escapes checked
                    if serde_json::from_str::<String>(&self.held[self.from..]).is_ok() {
                        J::Colon
                    } else {
                        J::Failed
                    }
                } else {
                    J::Key(false)
                };
            }
            J::Colon => match c {
                _ if ws => {}
                ':' => {
                    self.held.push(':');
                    self.st = J::Value(false);
                }
                _ => self.fail(),
            },
            J::Str => match c {
                '"' => {
                    out.push('"');
                    self.after_value();
                }
                '\\' => {
                    self.esc = "\\".into();
                    self.st = J::Esc;
                }
                // a raw control character (not JSON), written as its escape
                c if (c as u32) < 0x20 => out.push_str(&control_escape(c)),
                c => out.push(c),
            },
            J::Esc => {
                self.esc.push(c);
                match escape_state(&self.esc) {
                    Some(true) => {
                        out.push_str(&self.esc);
                        self.esc.clear();
                        self.st = J::Str;
                    }
                    Some(false) => {}
                    None => self.fail(),
                }
            }
            J::Num => {
                if matches!(c, '0'..='9' | '.' | 'e' | 'E' | '+' | '-') {
                    self.held.push(c);
                } else if json_number(&self.held[self.from..]) {
                    let held = std::mem::take(&mut self.held);
                    out.push_str(&number_out(&held, self.from));
                    self.after_value();
                    self.step(c, out);
                } else {
                    self.fail();
                }
            }
            J::Lit => {
                self.held.push(c);
                let lit = &self.held[self.from..];
                if ["true", "false", "null"].contains(&lit) {
                    let held = std::mem::take(&mut self.held);
                    out.push_str(&held);
                    self.after_value();
                } else if !["true", "false", "null"].iter().any(|l| l.starts_with(lit)) {
                    self.fail();
                }
            }
            J::After => match (c, self.stack.last()) {
                _ if ws => {}
                (',', Some(true)) => {
                    self.held.push(',');
                    self.st = J::KeyNext;
                }
                (',', Some(false)) => {
                    self.held.push(',');
                    self.st = J::Value(false);
                }
                ('}', Some(true)) | (']', Some(false)) => {
                    self.give(if c == '}' { "}" } else { "]" }, out);
                    self.stack.pop();
                    self.after_value();
                }
                _ => self.fail(),
            },
            J::Done | J::Failed => {}
        }
    }
}

/// An escape sequence read so far (`\` and what follows): `Some(true)` whole, `Some(false)`
/// not yet, `None` not JSON. A `\u` high surrogate must be followed by its low one.
fn escape_state(e: &str) -> Option<bool> {
    let b = e.as_bytes();
    match b.get(1) {
        None => Some(false),
        Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => Some(true),
        Some(b'u') => {
            let hex = |s: &[u8]| s.iter().all(u8::is_ascii_hexdigit);
            let unit = |s: &[u8]| u16::from_str_radix(std::str::from_utf8(s).ok()?, 16).ok();
            if b.len() <= 6 {
                if !hex(&b[2..]) {
                    return None;
                }
                if b.len() < 6 {
                    return Some(false);
                }
                return match unit(&b[2..6])? {
                    0xd800..=0xdbff => Some(false),
                    0xdc00..=0xdfff => None,
                    _ => Some(true),
                };
            }
            // the low surrogate after a high one
            let want = b"\\u";
            let tail = &b[6..];
            if tail.len() <= 2 {
                return want.starts_with(tail).then_some(false);
            }
            if !hex(&tail[2..]) {
                return None;
            }
            if tail.len() < 6 {
                return Some(false);
            }
            match unit(&tail[2..6])? {
                0xdc00..=0xdfff => Some(true),
                _ => None,
            }
        }
        Some(_) => None,
    }
}

/// A control character as a JSON escape.
fn control_escape(c: char) -> String {
    match c {
        '\n' => "\\n".into(),
        '\r' => "\\r".into(),
        '\t' => "\\t".into(),
        c => format!("\\u{:04x}", c as u32),
    }
}

/// Whether `s` is a JSON number.
fn json_number(s: &str) -> bool {
    let b = s.as_bytes();
    let mut i = 0;
    if b.get(i) == Some(&b'-') {
        i += 1;
    }
    // the digits from `i` on: how many
    let digits = |i: &mut usize| {
        let at = *i;
        while b.get(*i).is_some_and(u8::is_ascii_digit) {
            *i += 1;
        }
        *i - at
    };
    match b.get(i) {
        Some(b'0') => i += 1,
        Some(b'1'..=b'9') => {
            digits(&mut i);
        }
        _ => return false,
    }
    if b.get(i) == Some(&b'.') {
        i += 1;
        if digits(&mut i) == 0 {
            return false;
        }
    }
    if matches!(b.get(i), Some(b'e' | b'E')) {
        i += 1;
        if matches!(b.get(i), Some(b'+' | b'-')) {
            i += 1;
        }
        if digits(&mut i) == 0 {
            return false;
        }
    }
    i == b.len()
}

/// A whole JSON number's text as [`JsonOut`] gives it: itself, or, past f64's range (which
/// serde_json, and so every reader of the arguments here, refuses), the largest finite
/// number of its sign, so the rest of the arguments and the calls after it are kept.
fn number_out(held: &str, from: usize) -> String {
    let n = &held[from..];
    // (serde_json's own reading: near the edge it rounds differently from `str::parse`)
    if serde_json::from_str::<f64>(n).is_ok() {
        return held.to_string();
    }
    let max = if n.starts_with('-') {
        "-1.7976931348623157e308"
    } else {
        "1.7976931348623157e308"
    };
    format!("{}{max}", &held[..from])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A seeded generator of numbers below its argument.
    fn xorshift(mut state: u64) -> impl FnMut(usize) -> usize {
        move |n| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n as u64) as usize
        }
    }

    fn call(name: &str, args: &str) -> Part {
        Part::Call {
            name: name.into(),
            arguments: args.into(),
        }
    }

    /// The parts of `text` streamed in pieces of every size from 1 to 8 characters, and cut
    /// in two at every character boundary: each the same as the whole text's.
    fn streams_like_whole(m: &Markup, text: &str, forced: bool) -> Vec<Part> {
        let new = || {
            let s = Splitter::new(m.clone(), true, true, false);
            if forced {
                s.forced()
            } else {
                s
            }
        };
        let run = |pieces: Vec<String>| {
            let mut s = new();
            let mut parts = Vec::new();
            for p in pieces {
                parts.extend(s.push(&p));
            }
            parts.extend(s.finish());
            merge(parts)
        };
        let whole = run(vec![text.to_string()]);
        let chars: Vec<char> = text.chars().collect();
        for step in 1..=8 {
            let pieces = chars.chunks(step).map(|c| c.iter().collect()).collect();
            assert_eq!(run(pieces), whole, "pieces of {step}");
        }
        for (at, _) in text.char_indices() {
            let pieces = vec![text[..at].to_string(), text[at..].to_string()];
            assert_eq!(run(pieces), whole, "cut at {at}");
        }
        whole
    }

    #[test]
    fn random_texts_of_marker_pieces_stream_as_they_split_whole_in_every_family() {
        // seeded: texts strung from markers, their fragments and call bodies, in any order
        let pieces = [
            "<think>",
            "</think>",
            "<tool_call>",
            "</tool_call>",
            "<｜tool▁calls▁begin｜>",
            "<｜tool▁call▁begin｜>",
            "<｜tool▁sep｜>",
            "<｜tool▁call▁end｜>",
            "<｜tool▁calls▁end｜>",
            "<|start|>",
            "<|channel|>",
            "<|message|>",
            "<|tool_calls_section_begin|>",
            "<|tool_call_begin|>",
            "functions.f:0",
            "<|tool_call_argument_begin|>",
            "<|tool_call_end|>",
            "<|tool_calls_section_end|>",
            "<|end|>",
            "<|call|>",
            "<|return|>",
            "<arg_key>",
            "</arg_key>",
            "<arg_value>",
            "</arg_value>",
            "analysis",
            "final",
            " to=functions.f",
            "commentary",
            "function",
            "f\n",
            "```json\n",
            "\n```",
            "{\"name\": \"f\", \"arguments\": {}}",
            "{\"a\": 1}",
            "{\"name\": \"f\", \"arguments\": ",
            "{\"b\": \"",
            "\\",
            "\"",
            ",",
            ":",
            "[",
            "]",
            "-1.5e3",
            "tru",
            "{",
            "}",
            "<",
            "<|",
            "<｜",
            "|",
            "｜",
            "▁",
            "x",
            " ",
            "\n",
            "é",
            "🙂",
            "[TOOL_CALLS]",
            "[ARGS]",
            "[CALL_ID]",
            "[THINK]",
            "[/THINK]",
            " [",
            "f",
            "a1B2c3D4e",
            ", \"id\": \"a1B2c3D4e\"}",
            "{\"name\": \"f\", \"arguments\": {}, \"id\": [\"]\"]}",
        ];
        let mut next = xorshift(0x9e37_79b9_7f4a_7c15u64);
        for round in 0..1400 {
            let text: String = (0..1 + next(24))
                .map(|_| pieces[next(pieces.len())])
                .collect();
            let m = [
                &HERMES,
                &DEEPSEEK_V3,
                &GLM45,
                &HARMONY,
                &KIMI_K2,
                &MISTRAL,
                &MISTRAL_ARGS,
            ][round % 7];
            for (calls, think, open, forced) in [
                (true, true, false, false),
                (true, false, true, true),
                (false, true, true, false),
            ] {
                let new = || {
                    let s = Splitter::new(m.clone(), calls, think, open);
                    if forced {
                        s.forced()
                    } else {
                        s
                    }
                };
                let run = |cuts: &[usize]| {
                    let mut s = new();
                    let mut parts = Vec::new();
                    let mut from = 0;
                    for &c in cuts.iter().chain([text.len()].iter()) {
                        parts.extend(s.push(&text[from..c]));
                        from = c;
                    }
                    parts.extend(s.finish());
                    merge(parts)
                };
                let whole = run(&[]);
                let bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
                let mut cuts: Vec<usize> =
                    (0..next(6)).map(|_| bounds[next(bounds.len())]).collect();
                cuts.sort_unstable();
                assert_eq!(run(&cuts), whole, "{:?} {text:?} cut at {cuts:?}", m.style);
                // every call's arguments are a JSON object
                for p in &whole {
                    if let Part::Call { arguments, .. } = p {
                        let v: Result<Value, _> = serde_json::from_str(arguments);
                        assert!(
                            v.as_ref().is_ok_and(Value::is_object),
                            "{:?} {text:?}: {arguments:?}",
                            m.style
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn json_out_gives_valid_json_in_any_pieces_and_the_same_value_when_whole() {
        let whole = [
            r#"{}"#,
            r#"{"a": 1, "b": [true, false, null, -0.5, 2e10, 1E-3], "c": {"d": []}}"#,
            r#"{"s": "line\nnext \"quoted\" \\ \/ \u00e9 \ud83d\ude42 é🙂", "t": ""}"#,
            "{ \"k\\\"ey\" :\n\t[ [ ], { } , \"x\" ] }",
        ];
        for w in whole {
            let mut j = JsonOut::new();
            let mut out = j.feed(w);
            assert!(j.ended(), "{w}");
            out.push_str(&j.close());
            let got: Value = serde_json::from_str(&out).expect(&out);
            assert_eq!(got, serde_json::from_str::<Value>(w).expect(w), "{w}");
            // compact: no blank outside strings
            assert!(!out.contains(": ") && !out.contains(", "), "{out}");
        }
        // a raw control character in a string is written as its escape
        let mut j = JsonOut::new();
        let mut out = j.feed("{\"a\": \"x\ny\t\u{1}");
        out.push_str(&j.close());
        assert_eq!(out, r#"{"a":"x\ny\t\u0001"}"#);
        // cut anywhere, or broken anywhere: what was given plus the close parses, and the
        // pieces do not change it
        let mut next = xorshift(0x2545_f491_4f6c_dd1du64);
        let bits = [
            "{", "}", "[", "]", "\"", "\\", "\\u", "d83d", "\\ude42", "00e9", ":", ",", " ", "\n",
            "1", "-", ".", "e", "true", "fal", "null", "x", "é", "\"k\":",
        ];
        for _ in 0..3000 {
            let text: String = std::iter::once("{")
                .chain((0..next(20)).map(|_| bits[next(bits.len())]))
                .collect();
            let run = |cuts: &[usize]| {
                let mut j = JsonOut::new();
                let mut out = String::new();
                let mut from = 0;
                for &c in cuts.iter().chain([text.len()].iter()) {
                    out.push_str(&j.feed(&text[from..c]));
                    from = c;
                }
                out.push_str(&j.close());
                out
            };
            let one = run(&[]);
            let v: Value =
                serde_json::from_str(&one).unwrap_or_else(|e| panic!("{text:?}: {one:?}: {e}"));
            assert!(v.is_object(), "{text:?}: {one:?}");
            let bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
            let mut cuts: Vec<usize> = (0..next(5)).map(|_| bounds[next(bounds.len())]).collect();
            cuts.sort_unstable();
            assert_eq!(run(&cuts), one, "{text:?} cut at {cuts:?}");
        }
    }

    #[test]
    fn arguments_stay_parseable_and_bounded_on_hostile_text() {
        let hermes = |args: &str| {
            split_whole(
                HERMES,
                true,
                false,
                false,
                &format!("<tool_call>{{\"name\": \"f\", \"arguments\": {args}</tool_call>after"),
            )
        };
        // nesting past serde_json's limit, a number out of f64's range: still one object
        for args in [
            format!("{{\"a\": {}", "[".repeat(300)),
            "{\"a\": 1e999}".to_string(),
            "{\"a\": -1e309, \"b\": 2}".to_string(),
        ] {
            let parts = hermes(&args);
            let Part::Call { arguments, .. } = &parts[0] else {
                panic!("{parts:?}")
            };
            let v: Value = serde_json::from_str(arguments).expect(arguments);
            assert!(v.is_object(), "{arguments}");
            assert_eq!(parts[1], Part::Content("after".into()));
        }
        // past f64's range: the largest finite number of its sign, and what follows kept
        // (the keys after it, the calls after it), whole and in pieces
        let Part::Call { arguments, .. } = &hermes(
            "{\"a\": -1e309, \"b\": 42423e6442, \"c\": 1e-999, \"d\": 1.7976931348623158e308}",
        )[0] else {
            panic!()
        };
        assert_eq!(
            serde_json::from_str::<Value>(arguments).unwrap(),
            serde_json::json!({"a": -f64::MAX, "b": f64::MAX, "c": 0.0, "d": f64::MAX}),
            "{arguments}"
        );
        let list = "[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {\"n\": 4e6442, \"m\": 1}}, {\"name\": \"g\", \"arguments\": {\"k\": 1e400}}]";
        assert_eq!(
            streams_like_whole(&MISTRAL, list, false),
            vec![
                call("f", "{\"n\":1.7976931348623157e308,\"m\":1}"),
                call("g", "{\"k\":1.7976931348623157e308}")
            ]
        );
        // a key that never ends holds at most HELD_MAX bytes
        let mut j = JsonOut::new();
        j.feed("{\"");
        let chunk = "k".repeat(1 << 12);
        for _ in 0..((2 * HELD_MAX) >> 12) {
            j.feed(&chunk);
        }
        assert!(
            j.ended() && j.held.len() <= HELD_MAX + 1,
            "{}",
            j.held.len()
        );
        assert_eq!(j.close(), "}");
    }

    #[test]
    fn a_long_glm_value_streams_in_linear_time_and_is_bounded() {
        // a value of nearly 1 MiB in pieces of 4 bytes: each piece searched once
        let t = std::time::Instant::now();
        let mut s = Splitter::new(GLM45, true, false, false);
        let mut parts = s.push("<tool_call>write\n<arg_key>text</arg_key><arg_value>");
        let piece = "abcd";
        let n = MAX_CALL_BYTES / 4 - 1024;
        for _ in 0..n {
            parts.extend(s.push(piece));
        }
        parts.extend(s.push("</arg_value></tool_call>after"));
        parts.extend(s.finish());
        // (searching the whole pair again at each piece took ~13 s)
        assert!(t.elapsed().as_secs() < 5, "{:?}", t.elapsed());
        let merged = merge(parts);
        let Part::Call { arguments, .. } = &merged[0] else {
            panic!("{:?}", &merged[0])
        };
        assert_eq!(arguments.len(), "{\"text\":\"\"}".len() + 4 * n);
        // past MAX_CALL_BYTES the arguments end there, streamed and whole alike, and the
        // text after the call's close (its marker cut across pieces) is kept
        let text = format!(
            "<tool_call>write\n<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>text</arg_key><arg_value>{}</arg_value></tool_call>After the call.",
            "b".repeat(MAX_CALL_BYTES + 10)
        );
        let want = vec![
            call("write", "{\"a\":1}"),
            Part::Content("After the call.".into()),
        ];
        assert_eq!(split_whole(GLM45, true, false, false, &text), want);
        let mut s = Splitter::new(GLM45, true, false, false);
        let cut = text.len() - "all>After the call.".len();
        let mut parts = Vec::new();
        for piece in text.as_bytes()[..cut].chunks(4096) {
            parts.extend(s.push(std::str::from_utf8(piece).unwrap()));
        }
        parts.extend(s.push(&text[cut..]));
        parts.extend(s.finish());
        assert_eq!(merge(parts), want);
    }

    #[test]
    fn a_closing_marker_inside_the_arguments_json_is_text() {
        for (m, text, args) in [
            (
                HERMES,
                r#"<tool_call>{"name": "f", "arguments": {"x": "a</tool_call>b", "</tool_call>": 1}}</tool_call>after"#,
                r#"{"x":"a</tool_call>b","</tool_call>":1}"#,
            ),
            (
                DEEPSEEK_V3,
                "<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"x\": \"<｜tool▁call▁end｜>\"}\n```<｜tool▁call▁end｜>after",
                r#"{"x":"<｜tool▁call▁end｜>"}"#,
            ),
            (
                HARMONY,
                r#"<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"x": "<|call|><|end|><|start|>"}<|call|>"#,
                r#"{"x":"<|call|><|end|><|start|>"}"#,
            ),
        ] {
            let mut want = vec![call("f", args)];
            if m.style != Style::Harmony {
                want.push(Part::Content("after".into()));
            }
            assert_eq!(streams_like_whole(&m, text, false), want, "{:?}", m.style);
        }
        // where the JSON breaks, the marker closes the call as before
        let text = r#"<tool_call>{"name": "f", "arguments": {"x": 1 </tool_call>after"#;
        assert_eq!(
            streams_like_whole(&HERMES, text, false),
            vec![call("f", r#"{"x":1}"#), Part::Content("after".into())]
        );
    }

    #[test]
    fn a_body_past_the_bound_reads_the_same_whole_and_in_pieces() {
        // a call read whole (its head is not Hermes' usual shape), a harmony header: past
        // MAX_CALL_BYTES the first MAX_CALL_BYTES are text and the rest is read as content,
        // whether the closing marker comes in one piece or cut, and a call after it still parses
        let long = "x".repeat(MAX_CALL_BYTES + 100);
        for (m, text) in [
            (
                HERMES,
                format!("<tool_call>{{\"name\": \"f\", \"arguments\": \"{{\\\"a\\\": \\\"{long}\\\"}}\"}}</tool_call>mid<tool_call>{{\"name\": \"g\", \"arguments\": {{}}}}</tool_call>"),
            ),
            (
                HARMONY,
                format!("<|channel|>x{long}<|message|>mid<|channel|>commentary to=functions.g<|message|>{{}}<|call|>"),
            ),
        ] {
            let whole = split_whole(m.clone(), true, false, false, &text);
            assert_eq!(whole.last(), Some(&call("g", "{}")), "{:?}", m.style);
            assert!(matches!(&whole[0], Part::Content(t) if t.len() > MAX_CALL_BYTES));
            for piece in [4096, 4093, 7] {
                let mut s = Splitter::new(m.clone(), true, false, false);
                let mut parts = Vec::new();
                let mut at = 0;
                while at < text.len() {
                    let end = floor_boundary(&text, at + piece).max(at + 1);
                    let end = (at..=text.len().min(end + 3))
                        .find(|&e| e >= end && text.is_char_boundary(e))
                        .unwrap_or(text.len());
                    parts.extend(s.push(&text[at..end]));
                    at = end;
                }
                parts.extend(s.finish());
                assert_eq!(merge(parts), whole, "{:?} pieces of {piece}", m.style);
            }
        }
    }

    #[test]
    fn calls_stream_their_arguments_in_pieces_in_every_family() {
        let args = r#"{"path": "src/main.rs", "text": "fn main() {}\n"}"#;
        let glm = "<tool_call>write\n<arg_key>path</arg_key>\n<arg_value>src/main.rs</arg_value>\n<arg_key>text</arg_key>\n<arg_value>fn main() {}\n</arg_value>\n</tool_call>";
        for (m, text) in [
            (HERMES, format!("<tool_call>\n{{\"name\": \"write\", \"arguments\": {args}}}\n</tool_call>")),
            (DEEPSEEK_V3, format!("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>write\n```json\n{args}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")),
            (KIMI_K2, format!("<|tool_calls_section_begin|><|tool_call_begin|>functions.write:0<|tool_call_argument_begin|>{args}<|tool_call_end|><|tool_calls_section_end|>")),
            (HARMONY, format!("<|channel|>commentary to=functions.write <|constrain|>json<|message|>{args}<|call|>")),
            (GLM45, glm.to_string()),
            (MISTRAL, format!("[TOOL_CALLS] [{{\"name\": \"write\", \"arguments\": {args}}}]")),
            (MISTRAL_ARGS, format!("[TOOL_CALLS]write[ARGS]{args}")),
        ] {
            let mut s = Splitter::new(m.clone(), true, true, false);
            let mut parts = Vec::new();
            for c in text.chars() {
                parts.extend(s.push(&c.to_string()));
            }
            parts.extend(s.finish());
            let starts = parts.iter().filter(|p| matches!(p, Part::CallStart { .. })).count();
            let pieces = parts.iter().filter(|p| matches!(p, Part::CallArgs(_))).count();
            assert_eq!(starts, 1, "{:?}", m.style);
            assert!(pieces >= 3, "{:?}: {parts:?}", m.style);
            assert_eq!(parts.last(), Some(&Part::CallEnd), "{:?}", m.style);
            let merged = merge(parts);
            assert_eq!(merged.len(), 1, "{:?}: {merged:?}", m.style);
            let Part::Call { name, arguments } = &merged[0] else {
                panic!("{merged:?}")
            };
            assert_eq!(name, "write");
            assert_eq!(
                serde_json::from_str::<Value>(arguments).unwrap(),
                serde_json::json!({"path": "src/main.rs", "text": "fn main() {}\n"}),
                "{:?}",
                m.style
            );
        }
    }

    #[test]
    fn the_markup_is_chosen_from_the_template_then_the_model_type() {
        assert_eq!(Markup::detect("<|channel|>x<|message|>", None), HARMONY);
        assert_eq!(
            Markup::detect("{{ '<｜tool▁call▁begin｜>' }}", None),
            DEEPSEEK_V3
        );
        assert_eq!(
            Markup::detect("<tool_call>{{ n }}<arg_key>", Some("qwen3_moe")),
            GLM45
        );
        assert_eq!(Markup::detect("<tool_call>", Some("glm4_moe")), HERMES);
        assert_eq!(Markup::detect("", Some("glm4_moe")), GLM45);
        assert_eq!(Markup::detect("", Some("gpt_oss")), HARMONY);
        assert_eq!(Markup::detect("", Some("deepseek_v3")), DEEPSEEK_V3);
        assert_eq!(Markup::detect("", None), HERMES);
        assert_eq!(
            Markup::detect("{{ '<|tool_call_begin|>' }}", Some("deepseek_v3")),
            KIMI_K2
        );
        assert_eq!(Markup::detect("", Some("kimi_k2")), KIMI_K2);
        assert_eq!(
            Markup::detect("{{ '[TOOL_CALLS] [' }}", Some("mixtral")),
            MISTRAL
        );
        assert_eq!(
            Markup::detect("[TOOL_CALLS]{{ n }}[ARGS]", Some("mixtral")),
            MISTRAL_ARGS
        );
        assert!(MISTRAL_ARGS.marks(M_ARGS) && MISTRAL.marks(M_CALL_ID) && !MISTRAL.marks(""));
        assert!(!HERMES.marks(M_ARGS));
        assert!(KIMI_K2.marks(KIMI_ARG) && KIMI_K2.marks(KIMI_SECTION_END));
        assert!(HARMONY.marks("<|channel|>") && DEEPSEEK_V3.marks(DS_CALLS_END));
        assert!(!HERMES.marks("<|im_end|>"));
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
        let whole = streams_like_whole(&HERMES, text, false);
        assert_eq!(whole, split_whole(HERMES, true, true, false, text));
        // the unfinished marker at the end is text
        assert_eq!(whole.last(), Some(&Part::Content("B<tool_ca".into())));
    }

    #[test]
    fn deepseek_calls_split_whole_and_streamed() {
        let text = "<think>plan</think>Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        assert_eq!(
            streams_like_whole(&DEEPSEEK_V3, text, false),
            vec![
                Part::Reasoning("plan".into()),
                Part::Content("Sure.".into()),
                call("get_weather", "{\"city\":\"Paris\"}"),
                Part::Content("\n".into()),
                call("now", "{}"),
            ]
        );
        // V3.1's shorter form; arguments that stop being JSON end where they stop
        assert_eq!(
            split_whole(
                DEEPSEEK_V3,
                true,
                false,
                false,
                "<｜tool▁call▁begin｜>f<｜tool▁sep｜>{\"a\": [1]}<｜tool▁call▁end｜>"
            ),
            vec![call("f", "{\"a\":[1]}")]
        );
        let bad =
            "<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"a\": [1, oops\n```<｜tool▁call▁end｜>";
        assert_eq!(
            split_whole(DEEPSEEK_V3, true, false, false, bad),
            vec![call("f", "{\"a\":[1]}")]
        );
        // arguments that are not an object: text
        let bad =
            "<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n[1]\n```<｜tool▁call▁end｜>";
        assert_eq!(
            split_whole(DEEPSEEK_V3, true, false, false, bad),
            vec![Part::Content(bad.into())]
        );
    }

    #[test]
    fn kimi_calls_split_whole_and_streamed() {
        let text = "<think>plan</think>On it.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|><|tool_call_begin|>functions.now:1<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>";
        assert_eq!(
            streams_like_whole(&KIMI_K2, text, false),
            vec![
                Part::Reasoning("plan".into()),
                Part::Content("On it.".into()),
                call("get_weather", "{\"city\":\"Paris\"}"),
                call("now", "{}"),
            ]
        );
        // a name without the prefix or the index is still a name; a body without its
        // argument marker or with a bad name is text; arguments that stop being JSON end
        // where they stop
        for (text, args) in [
            ("<|tool_call_begin|>f<|tool_call_argument_begin|>{\"a\": [1]}<|tool_call_end|>", "{\"a\":[1]}"),
            ("<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"a\": \"x\", oops<|tool_call_end|>", "{\"a\":\"x\"}"),
        ] {
            assert_eq!(split_whole(KIMI_K2, true, false, false, text), vec![call("f", args)]);
        }
        for bad in [
            "<|tool_call_begin|>functions.f:0 {}<|tool_call_end|>",
            "<|tool_call_begin|>two words:0<|tool_call_argument_begin|>{}<|tool_call_end|>",
        ] {
            assert_eq!(
                split_whole(KIMI_K2, true, false, false, bad),
                vec![Part::Content(bad.into())],
                "{bad}"
            );
        }
    }

    #[test]
    fn glm_calls_split_whole_and_streamed() {
        let text = "<think>hm</think>\nOK<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>opts</arg_key>\n<arg_value>{\"metric\": true}</arg_value>\n</tool_call><tool_call>now\n</tool_call>";
        assert_eq!(
            streams_like_whole(&GLM45, text, false),
            vec![
                Part::Reasoning("hm".into()),
                Part::Content("\nOK".into()),
                call(
                    "get_weather",
                    "{\"city\":\"Paris\",\"days\":3,\"opts\":{\"metric\":true}}"
                ),
                call("now", "{}"),
            ]
        );
        let bad = "<tool_call>two words\n</tool_call>";
        assert_eq!(
            split_whole(GLM45, true, false, false, bad),
            vec![Part::Content(bad.into())],
        );
        // pairs are given whole: one that is cut or broken ends the arguments
        for cut in [
            "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value><arg_key>b</arg_key>\n</tool_call>",
            "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>junk<arg_key>b</arg_key><arg_value>2</arg_value></tool_call>",
            "<tool_call>f\n<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>b</arg_key><arg_value>2",
        ] {
            assert_eq!(
                streams_like_whole(&GLM45, cut, false),
                vec![call("f", "{\"a\":1}")],
                "{cut}"
            );
        }
    }

    #[test]
    fn glm_string_parameters_are_raw_text_whole_and_streamed() {
        let tools = [(
            "ship".to_string(),
            serde_json::json!({"type": "object", "properties": {
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "mode": {"enum": ["air", "sea"]},
                "count": {"type": "integer"},
                "note": {"type": ["string", "null"]},
                "label": {"type": "string"}}}),
        )];
        let text = "<tool_call>ship\n<arg_key>zip</arg_key>\n<arg_value>94107</arg_value>\n<arg_key>mode</arg_key>\n<arg_value>air</arg_value>\n<arg_key>count</arg_key>\n<arg_value>3</arg_value>\n<arg_key>note</arg_key>\n<arg_value>null</arg_value>\n<arg_key>label</arg_key>\n<arg_value>null</arg_value>\n</tool_call>";
        // a nullable string's `null` is null, a string's the text
        let want = call(
            "ship",
            r#"{"zip":"94107","mode":"air","count":3,"note":null,"label":"null"}"#,
        );
        let run = |chunk: usize| {
            let mut s = Splitter::new(GLM45, true, true, false).tools(&tools);
            let chars: Vec<char> = text.chars().collect();
            let mut parts = Vec::new();
            for c in chars.chunks(chunk) {
                parts.extend(s.push(&c.iter().collect::<String>()));
            }
            parts.extend(s.finish());
            merge(parts)
        };
        for chunk in [1, 3, 7, text.len()] {
            assert_eq!(run(chunk), vec![want.clone()], "pieces of {chunk}");
        }
        // a tool not declared: values as JSON where they parse
        let mut s = Splitter::new(GLM45, true, true, false).tools(&tools);
        let mut parts = s.push(
            "<tool_call>other\n<arg_key>zip</arg_key><arg_value>94107</arg_value></tool_call>",
        );
        parts.extend(s.finish());
        assert_eq!(merge(parts), vec![call("other", r#"{"zip":94107}"#)]);
        // the grammar forces the same shapes: the pattern, the enum's literals
        let g = calls_grammar(&GLM45, &tools, 1, &|_| None);
        assert!(g.contains("/[0-9]{5}/"), "{g}");
        assert_eq!(slashes_escaped(r"a\/b/c\\/d"), r"a\/b\/c\\\/d");
        assert!(g.contains("(\"air\" | \"sea\")"), "{g}");
        assert!(
            g.contains("<arg_key>note</arg_key>\\n<arg_value>\" /[^<]*/"),
            "{g}"
        );
    }

    #[test]
    fn harmony_channels_split_whole_and_streamed() {
        let text = "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>";
        assert_eq!(
            streams_like_whole(&HARMONY, text, false),
            vec![
                Part::Reasoning("Need weather.".into()),
                call("get_weather", "{\"city\":\"Paris\"}"),
            ]
        );
        // the recipient in the role's header; the last call's <|call|> left out (it ends
        // the answer, as an end-of-sequence token); then a final answer
        let text = "<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}";
        assert_eq!(
            streams_like_whole(&HARMONY, text, false),
            vec![call("f", "{}")]
        );
        let text = "<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final<|message|>The answer.<|return|>";
        assert_eq!(
            streams_like_whole(&HARMONY, text, false),
            vec![
                Part::Reasoning("think".into()),
                Part::Content("The answer.".into())
            ]
        );
        // text outside any message is content; a call whose body is not an object is text
        let bad = "<|channel|>commentary to=functions.f<|message|>nope";
        assert_eq!(
            split_whole(HARMONY, true, true, false, &format!("hi {bad}")),
            vec![Part::Content(format!("hi {bad}"))]
        );
        let cut = "<|channel|>commentary to=functions.f<|message|>{\"q\": \"a\\nb";
        assert_eq!(
            streams_like_whole(&HARMONY, cut, false),
            vec![call("f", "{\"q\":\"a\\nb\"}")]
        );
        // without tools a call's message is content
        assert_eq!(
            split_whole(
                HARMONY,
                false,
                true,
                false,
                "<|channel|>commentary to=functions.f<|message|>{}<|call|>"
            ),
            vec![Part::Content("{}".into())]
        );
    }

    #[test]
    fn forced_answers_in_each_family_are_only_calls() {
        for (m, text) in [
            (HERMES, "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>\n<tool_call>\n{\"name\": \"g\", \"arguments\": {}}\n</tool_call>"),
            (DEEPSEEK_V3, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"a\":1}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>g\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
            (KIMI_K2, "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"a\":1}<|tool_call_end|><|tool_call_begin|>functions.g:1<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>"),
            (GLM45, "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>\n<tool_call>g\n</tool_call>"),
            (HARMONY, "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"a\":1}<|call|><|start|>assistant<|channel|>commentary to=functions.g <|constrain|>json<|message|>{}"),
        ] {
            assert_eq!(
                streams_like_whole(&m, text, true),
                vec![call("f", "{\"a\":1}"), call("g", "{}")],
                "{:?}",
                m.style
            );
        }
    }

    #[test]
    fn a_tools_refs_move_with_it_into_the_hermes_call_schema() {
        let tools = [(
            "ship".to_string(),
            serde_json::json!({"type": "object", "properties": {
                "to": {"$ref": "#/$defs/Addr"}, "back": {"$ref": "#/definitions/Addr"},
                "self": {"$ref": "#"}, "same": {"$ref": "#/properties/to"}},
                "$defs": {"Addr": {"type": "object", "properties": {"up": {"$ref": "#/$defs/Addr"}}}},
                "definitions": {"Addr": {"type": "string"}}}),
        )];
        let g = calls_grammar(&HERMES, &tools, 1, &|_| None);
        let json = g.split(" %json ").nth(1).unwrap();
        let json = &json[..json.rfind(" \"\\n\"").unwrap()];
        let v: Value = serde_json::from_str(json).unwrap();
        let defs = &v["$defs"];
        let root = &defs["tool0_root"];
        assert_eq!(
            v["anyOf"][0]["properties"]["arguments"]["$ref"],
            "#/$defs/tool0_root"
        );
        assert_eq!(root["properties"]["to"]["$ref"], "#/$defs/tool0_$defs_Addr");
        assert_eq!(
            root["properties"]["back"]["$ref"],
            "#/$defs/tool0_definitions_Addr"
        );
        assert_eq!(root["properties"]["self"]["$ref"], "#/$defs/tool0_root");
        assert_eq!(
            root["properties"]["same"]["$ref"],
            "#/$defs/tool0_root/properties/to"
        );
        assert!(root.get("$defs").is_none() && root.get("definitions").is_none());
        assert_eq!(
            defs["tool0_$defs_Addr"]["properties"]["up"]["$ref"],
            "#/$defs/tool0_$defs_Addr"
        );
        assert_eq!(defs["tool0_definitions_Addr"]["type"], "string");
    }

    #[test]
    fn calls_grammars_name_each_tool_in_the_familys_markup() {
        let tools = vec![
            (
                "get_weather".to_string(),
                serde_json::json!({"type": "object", "properties": {"city": {"type": "string"},
                    "days": {"type": "integer"}}, "required": ["city"]}),
            ),
            ("now".to_string(), serde_json::json!(null)),
        ];
        let g = calls_grammar(&GLM45, &tools, 2, &|_| None);
        assert!(g.starts_with("start: call (\"\\n\" call)?\n"), "{g}");
        // a string parameter is raw text, as GLM's template writes it; others JSON
        assert!(g.contains("call_0: \"<tool_call>get_weather\\n\" \"<arg_key>city</arg_key>\\n<arg_value>\" /[^<]*/ \"</arg_value>\\n\""), "{g}");
        assert!(
            g.contains("\"<arg_key>days</arg_key>\\n<arg_value>\" %json {\"type\":\"integer\""),
            "{g}"
        );
        assert!(g.contains(")?"), "the optional days: {g}");
        let g = calls_grammar(&DEEPSEEK_V3, &tools, 1, &|_| None);
        assert!(
            g.starts_with("start: \"<｜tool▁calls▁begin｜>\" call \"<｜tool▁calls▁end｜>\"\n"),
            "{g}"
        );
        // Kimi K2: its markers as its vocabulary's control tokens, or as text
        let g = calls_grammar(&KIMI_K2, &tools, 2, &|_| None);
        assert!(g.starts_with("start: \"<|tool_calls_section_begin|>\" call (call)? \"<|tool_calls_section_end|>\"\n"), "{g}");
        assert!(g.contains("call_0: \"<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>\" %json {"), "{g}");
        let g = calls_grammar(&KIMI_K2, &tools, 1, &|_| Some(0));
        assert!(
            g.starts_with("start: <|tool_calls_section_begin|> call <|tool_calls_section_end|>\n"),
            "{g}"
        );
        assert!(g.contains("call_1: <|tool_call_begin|> \"functions.now:0\" <|tool_call_argument_begin|> %json {\"type\":\"object\""), "{g}");
        assert!(
            g.contains("} <|tool_call_end|>\ncall: call_0 | call_1"),
            "{g}"
        );
        let g = calls_grammar(&HARMONY, &tools, 2, &|_| None);
        assert!(g.contains("\"<|channel|>commentary to=functions.now <|constrain|>json<|message|>\" %json {\"type\":\"object\""), "{g}");
        assert!(g.contains("(\"<|call|><|start|>assistant\" call)?"), "{g}");
        // with gpt-oss's vocabulary the markers are its control tokens
        let g = calls_grammar(&HARMONY, &tools, 2, &|t| {
            (t != "<|constrain|>").then_some(0)
        });
        assert!(g.contains("call_1: <|channel|> \"commentary to=functions.now <|constrain|>json\" <|message|> %json {"), "{g}");
        assert!(
            g.contains("(<|call|> <|start|> \"assistant\" call)?"),
            "{g}"
        );
    }

    #[test]
    fn mistral_grammars_write_its_list_and_its_markers_as_tokens() {
        let tools = vec![(
            "get_weather".to_string(),
            serde_json::json!({"type": "object", "properties": {"city": {"type": "string"}}}),
        )];
        // v3: one array, `[TOOL_CALLS]` by its id where the vocabulary has it as a token
        let g = calls_grammar(&MISTRAL, &tools, 3, &|_| None);
        assert!(
            g.starts_with("start: \"[TOOL_CALLS]\" \" [\" call (\", \" call)? (\", \" call)? \"]\"\ncall: %json {"),
            "{g}"
        );
        assert!(g.contains("\"name\":{\"const\":\"get_weather\"}"), "{g}");
        let g = calls_grammar(&MISTRAL, &tools, 1, &|t| (t == M_CALLS).then_some(5));
        assert!(g.starts_with("start: <[5]> \" [\" call \"]\"\n"), "{g}");
        // v11: each call its own marker, the name, `[ARGS]`
        let g = calls_grammar(&MISTRAL_ARGS, &tools, 2, &|t| match t {
            M_CALLS => Some(5),
            M_ARGS => Some(32),
            _ => None,
        });
        assert!(g.starts_with("start: call (call)?\n"), "{g}");
        assert!(
            g.contains("call_0: <[5]> \"get_weather\" <[32]> %json {"),
            "{g}"
        );
        // each grammar's answer reads back as its calls
        for (m, text) in [
            (MISTRAL, "[TOOL_CALLS] [{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Oslo\"}}, {\"name\":\"get_weather\",\"arguments\":{}}]"),
            (MISTRAL_ARGS, "[TOOL_CALLS]get_weather[ARGS]{\"city\":\"Oslo\"}[TOOL_CALLS]get_weather[ARGS]{}"),
        ] {
            assert_eq!(
                streams_like_whole(&m, text, true),
                vec![
                    call("get_weather", "{\"city\":\"Oslo\"}"),
                    call("get_weather", "{}")
                ],
                "{:?}",
                m.style
            );
        }
    }

    #[test]
    fn mistral_calls_split_whole_and_streamed() {
        // v3: an array; a call's other keys (the id its template writes) are passed over
        let text = "Let me look.[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}, \"id\": \"a1B2c3D4e\"}, {\"name\": \"now\", \"arguments\": {}}]";
        assert_eq!(
            streams_like_whole(&MISTRAL, text, false),
            vec![
                Part::Content("Let me look.".into()),
                call("get_weather", "{\"city\":\"Paris\"}"),
                call("now", "{}"),
            ]
        );
        // v11 and v13 (a call id before the arguments), in one answer, text after
        let text = "[THINK]which city?[/THINK][TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}[TOOL_CALLS]now[CALL_ID]Zz9Yy8Xx7[ARGS]{} done";
        assert_eq!(
            streams_like_whole(&MISTRAL_ARGS, text, false),
            vec![
                Part::Reasoning("which city?".into()),
                call("get_weather", "{\"city\":\"Paris\"}"),
                call("now", "{}"),
                Part::Content(" done".into()),
            ]
        );
        // a `[` after the marker that opens no list is read again: another marker
        assert_eq!(
            streams_like_whole(&MISTRAL_ARGS, "[TOOL_CALLS][TOOL_CALLS]f[ARGS]{}", false),
            vec![Part::Content(M_CALLS.into()), call("f", "{}")]
        );
        assert_eq!(
            streams_like_whole(&MISTRAL, "[TOOL_CALLS] [THINK]hm[/THINK]ok", false),
            vec![
                Part::Content("[TOOL_CALLS] ".into()),
                Part::Reasoning("hm".into()),
                Part::Content("ok".into())
            ]
        );
        // items of another shape read whole (keys in another order, arguments as a
        // string); arguments that stop being JSON are closed there, and the next call read
        assert_eq!(
            streams_like_whole(
                &MISTRAL,
                "[TOOL_CALLS] [{\"arguments\": {\"a\": \"}\"}, \"name\": \"f\"}, {\"name\": \"g\", \"arguments\": \"{\\\"b\\\": 2}\"}, {\"name\": \"h\", \"arguments\": {\"c\": x}}, {\"name\": \"i\", \"arguments\": {}}]",
                false
            ),
            vec![
                call("f", "{\"a\":\"}\"}"),
                call("g", "{\"b\":2}"),
                call("h", "{}"),
                call("i", "{}")
            ]
        );
        assert_eq!(
            streams_like_whole(&MISTRAL, "[TOOL_CALLS] [{\"x\": 1}] rest", false),
            vec![Part::Content("[TOOL_CALLS] [{\"x\": 1}] rest".into())]
        );
        // an object without its list is read too
        assert_eq!(
            streams_like_whole(
                &MISTRAL_ARGS,
                "[TOOL_CALLS] {\"name\": \"f\", \"arguments\": {\"a\": 1}} ok",
                false
            ),
            vec![call("f", "{\"a\":1}"), Part::Content("ok".into())]
        );
        // either markup reads either form
        assert_eq!(
            split_whole(
                MISTRAL,
                true,
                false,
                false,
                "[TOOL_CALLS]f[ARGS]{\"a\": [1]}"
            ),
            vec![call("f", "{\"a\":[1]}")]
        );
        // a marker that no call follows is text, marker and all; so is a list cut before
        // its first call
        for bad in [
            "[TOOL_CALLS] not a call",
            "[TOOL_CALLS] [1, 2]",
            "[TOOL_CALLS] [{\"name\": \"f\"",
            "[TOOL_CALLS]get weather[ARGS]{}",
            "[TOOL_CALLS]f[OTHER]{}",
            "[TOOL_CALLS]",
        ] {
            assert_eq!(
                streams_like_whole(&MISTRAL, bad, false),
                vec![Part::Content(bad.into())],
                "{bad}"
            );
        }
        // an answer cut inside the arguments: the call, its JSON closed
        assert_eq!(
            streams_like_whole(
                &MISTRAL,
                "[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {\"s\": \"ab",
                false
            ),
            vec![call("f", "{\"s\":\"ab\"}")]
        );
        // a second marker after a bad one still opens a call
        assert_eq!(
            split_whole(
                MISTRAL_ARGS,
                true,
                false,
                false,
                "[TOOL_CALLS]x y [TOOL_CALLS]f[ARGS]{}"
            ),
            vec![Part::Content("[TOOL_CALLS]x y ".into()), call("f", "{}")]
        );
        // blanks after the marker, streamed a character at a time, are read once each (a
        // model writing spaces for its whole answer costs linear time), and given back
        let mut sp = Splitter::new(MISTRAL, true, false, false);
        let mut parts = sp.push(M_CALLS);
        let t0 = std::time::Instant::now();
        for _ in 0..200_000 {
            parts.extend(sp.push(" "));
        }
        parts.extend(sp.push("x"));
        parts.extend(sp.finish());
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(10),
            "{:?}",
            t0.elapsed()
        );
        assert_eq!(
            merge(parts),
            vec![Part::Content(format!("{M_CALLS}{}x", " ".repeat(200_000)))]
        );
        // without tools the markup is text
        assert_eq!(
            split_whole(MISTRAL, false, false, false, "[TOOL_CALLS]f[ARGS]{}"),
            vec![Part::Content("[TOOL_CALLS]f[ARGS]{}".into())]
        );
    }

    /// Through llguidance on a vocabulary where `[TOOL_CALLS]` is a control token, as
    /// Mistral's are: a forced answer must begin with that token (by id), never with the
    /// marker spelled out in text pieces.
    #[test]
    fn a_forced_mistral_answer_begins_with_its_control_token() {
        use crate::grammar::{lark_grammar, Grammars};
        let tok = std::sync::Arc::new(crate::tokenizer::tests::sentencepiece_with(&[M_CALLS]));
        let id = tok.token_to_id(M_CALLS).expect("the control token");
        assert!(tok.is_special(id));
        let tools = vec![("f".to_string(), serde_json::json!({"type": "object"}))];
        let special = |t: &str| tok.token_to_id(t).filter(|&i| tok.is_special(i));
        let lark = calls_grammar(&MISTRAL, &tools, 1, &special);
        assert!(lark.starts_with(&format!("start: <[{id}]> ")), "{lark}");
        let g = Grammars::new(tok.clone(), 2);
        let mut c = g.compile(&lark_grammar(&lark)).expect("compiles");
        let first = c.next_mask().expect("a mask");
        let allowed: Vec<u32> = (0..tok.vocab_size() as u32)
            .filter(|&i| first.allows(i))
            .collect();
        assert_eq!(allowed, vec![id]);
        c.consume(id).expect("follows");
        assert!(!c.next_mask().expect("a mask").allows(id));
    }

    #[test]
    fn mistral_call_ids_are_nine_letters_and_digits_the_same_each_time() {
        assert_eq!(mistral_call_id("a1B2c3D4e"), "a1B2c3D4e");
        for id in [
            "call_0123456789abcdef01234567",
            "toolu_1",
            "",
            "é",
            "a1B2c3D4_",
        ] {
            let m = mistral_call_id(id);
            assert!(
                m.len() == 9 && m.bytes().all(|b| b.is_ascii_alphanumeric()),
                "{id}: {m}"
            );
            assert_eq!(mistral_call_id(id), m);
        }
        assert_ne!(mistral_call_id("call_1"), mistral_call_id("call_2"));
        // in one chat no two ids share nine: an id already of nine keeps it, one whose nine
        // would meet it gets others
        let taken = mistral_call_id("call_1");
        let map = mistral_id_map(["call_1", taken.as_str(), "call_1", "x"]);
        assert_eq!(map[taken.as_str()], taken);
        assert_ne!(map["call_1"], taken);
        assert!(mistral_shaped(&map["call_1"]) && mistral_shaped(&map["x"]));
        assert_eq!(map.len(), 3);
        assert_eq!(mistral_id_map(["call_1"])["call_1"], taken);
        let fresh = MISTRAL.call_id(0x1234_5678_9abc_def0_1234_5678_9abc_def0);
        assert!(fresh.len() == 9 && fresh.bytes().all(|b| b.is_ascii_alphanumeric()));
        assert!(HERMES.call_id(7).starts_with("call_"));
    }

    #[test]
    fn a_long_unclosed_call_is_bounded_and_forced_answers_drop_separators() {
        for (m, open) in [(HERMES, "<tool_call>"), (HARMONY, "<|channel|>x")] {
            let mut s = Splitter::new(m, true, false, false);
            let mut parts = s.push(open);
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
            assert!(text.starts_with(&format!("{open}aaa")) && text.ends_with("tail"));
        }
        let forced = "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>\n<tool_call>{\"name\": \"g\", \"arguments\": {}}</tool_call>";
        let mut s = Splitter::new(HERMES, true, false, false).forced();
        let mut parts = s.push(forced);
        parts.extend(s.finish());
        assert_eq!(merge(parts), vec![call("f", "{}"), call("g", "{}")]);
        // a forced answer cut inside a call's head: no markup comes back as content
        let cut = "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>\n<tool_call>{\"name\": \"lo";
        let mut s = Splitter::new(HERMES, true, false, false).forced();
        let mut parts = s.push(cut);
        parts.extend(s.finish());
        assert_eq!(merge(parts), vec![call("f", "{}")]);
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
