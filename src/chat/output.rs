//! Splits a model's streamed answer into reasoning, content and tool calls.
//!
//! Qwen3 models think inside `<think>…</think>` and call tools with `<tool_call>…</tool_call>`
//! blocks, holding either JSON (`{"name": …, "arguments": {…}}`, Qwen3) or XML
//! (`<function=NAME><parameter=KEY>value</parameter></function>`, Qwen3.5/3.6 and Qwen3-Coder).
//! Text is held back while it could still be the start of a tag, so markup never leaks into
//! content; a block that does not parse is handed back as plain content.

use serde_json::{Map, Value};

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const CALL_OPEN: &str = "<tool_call>";
const CALL_CLOSE: &str = "</tool_call>";

/// Length of the longest suffix of `text` that is a proper prefix of one of `needles`: the part of
/// a streamed text that must be held back because the next piece may complete a needle.
pub fn partial_suffix_len(text: &str, needles: &[&str]) -> usize {
    let mut best = 0;
    for s in needles {
        for len in (best + 1..s.len().min(text.len() + 1)).rev() {
            if s.is_char_boundary(len) && text.is_char_boundary(text.len() - len) && text.ends_with(&s[..len]) {
                best = len;
                break;
            }
        }
    }
    best
}

#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments as a JSON object text, as OpenAI's `function.arguments`.
    pub arguments: String,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Delta {
    Content(String),
    Reasoning(String),
    ToolCall(ToolCall),
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    Content,
    Reasoning,
    ToolCall,
}

#[derive(Clone)]
pub struct OutputParser {
    mode: Mode,
    pending: String,
    /// Drop whitespace at the start of the next content or reasoning text.
    skip_ws: bool,
    /// A `<think>` only opens reasoning before any content.
    content_started: bool,
    parse_tools: bool,
    /// Whitespace that stood before the open tool call: restored if the call does not parse.
    ws_before_call: String,
    /// Parameter types from the tools' JSON schemas, to keep string parameters strings (XML form).
    string_params: Vec<(String, String)>,
}

impl OutputParser {
    /// `in_reasoning`: the prompt already opened `<think>` (the template ends with it).
    /// `in_tool_call`: the prompt already opened `<tool_call>` (tool_choice required); `prefix` is
    /// any call text the prompt already holds after it. `tools`: the request's tool list, or None
    /// when tool calls are not to be parsed.
    pub fn new(in_reasoning: bool, tools: Option<&Value>) -> Self {
        OutputParser {
            mode: if in_reasoning { Mode::Reasoning } else { Mode::Content },
            pending: String::new(),
            skip_ws: true,
            content_started: false,
            parse_tools: tools.is_some(),
            ws_before_call: String::new(),
            string_params: tools.map(string_parameters).unwrap_or_default(),
        }
    }

    /// Starts inside a tool call whose text so far is `prefix` (the prompt forced it).
    pub fn start_in_tool_call(&mut self, prefix: &str) {
        self.mode = Mode::ToolCall;
        self.pending = prefix.to_string();
    }

    pub fn push(&mut self, text: &str) -> Vec<Delta> {
        self.pending.push_str(text);
        let mut out = Vec::new();
        loop {
            let progressed = match self.mode {
                Mode::Reasoning => self.step_reasoning(&mut out),
                Mode::Content => self.step_content(&mut out),
                Mode::ToolCall => self.step_tool_call(&mut out),
            };
            if !progressed {
                return out;
            }
        }
    }

    /// End of generation: releases what was held back. An unfinished tool call becomes content.
    pub fn finish(&mut self) -> Vec<Delta> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.pending);
        match self.mode {
            Mode::Reasoning => self.emit(&mut out, rest.trim_end(), true),
            Mode::Content => self.emit(&mut out, rest.trim_end(), false),
            Mode::ToolCall => {
                self.skip_ws = false;
                let raw = format!("{}{CALL_OPEN}{rest}", self.ws_before_call);
                self.emit(&mut out, raw.trim_end(), false)
            }
        }
        out
    }

    fn emit(&mut self, out: &mut Vec<Delta>, text: &str, reasoning: bool) {
        let text = if self.skip_ws { text.trim_start() } else { text };
        if text.is_empty() {
            return;
        }
        self.skip_ws = false;
        if reasoning {
            out.push(Delta::Reasoning(text.to_string()));
        } else {
            self.content_started = true;
            out.push(Delta::Content(text.to_string()));
        }
    }

    /// Emits everything but trailing whitespace and a possible partial tag.
    fn emit_safe(&mut self, out: &mut Vec<Delta>, tags: &[&str], reasoning: bool) {
        let hold = partial_suffix_len(&self.pending, tags);
        let safe_end = self.pending[..self.pending.len() - hold].trim_end().len();
        let text: String = self.pending.drain(..safe_end).collect();
        self.emit(out, &text, reasoning);
    }

    fn step_reasoning(&mut self, out: &mut Vec<Delta>) -> bool {
        match self.pending.find(THINK_CLOSE) {
            Some(at) => {
                let before = self.pending[..at].to_string();
                self.pending.drain(..at + THINK_CLOSE.len());
                self.emit(out, before.trim_end(), true);
                self.mode = Mode::Content;
                self.skip_ws = true;
                true
            }
            None => {
                self.emit_safe(out, &[THINK_CLOSE], true);
                false
            }
        }
    }

    fn step_content(&mut self, out: &mut Vec<Delta>) -> bool {
        let think = (!self.content_started).then(|| self.pending.find(THINK_OPEN)).flatten();
        let think = think.filter(|&at| self.pending[..at].trim().is_empty());
        let call = self.parse_tools.then(|| self.pending.find(CALL_OPEN)).flatten();
        match (think, call) {
            (Some(at), c) if c.is_none_or(|c| at < c) => {
                self.pending.drain(..at + THINK_OPEN.len());
                self.mode = Mode::Reasoning;
                self.skip_ws = true;
                true
            }
            (_, Some(at)) => {
                let before = self.pending[..at].to_string();
                self.pending.drain(..at + CALL_OPEN.len());
                let text = before.trim_end();
                self.ws_before_call = if self.skip_ws && text.trim_start().is_empty() {
                    String::new()
                } else {
                    before[text.len()..].to_string()
                };
                self.emit(out, text, false);
                self.mode = Mode::ToolCall;
                true
            }
            _ => {
                let mut tags = Vec::new();
                if !self.content_started {
                    tags.push(THINK_OPEN);
                }
                if self.parse_tools {
                    tags.push(CALL_OPEN);
                }
                self.emit_safe(out, &tags, false);
                false
            }
        }
    }

    fn step_tool_call(&mut self, out: &mut Vec<Delta>) -> bool {
        let Some(at) = self.pending.find(CALL_CLOSE) else { return false };
        let body: String = self.pending[..at].to_string();
        self.pending.drain(..at + CALL_CLOSE.len());
        self.mode = Mode::Content;
        match parse_tool_call(&body, &self.string_params) {
            Some(call) => {
                out.push(Delta::ToolCall(call));
                self.skip_ws = true;
            }
            None => {
                self.skip_ws = false;
                let raw = format!("{}{CALL_OPEN}{body}{CALL_CLOSE}", self.ws_before_call);
                self.emit(out, &raw, false);
            }
        }
        true
    }
}

/// Parses the text between `<tool_call>` and `</tool_call>` in either format.
pub fn parse_tool_call(body: &str, string_params: &[(String, String)]) -> Option<ToolCall> {
    let body = body.trim();
    if body.starts_with("<function=") {
        parse_xml_call(body, string_params)
    } else {
        parse_json_call(body)
    }
}

fn parse_json_call(body: &str) -> Option<ToolCall> {
    let v: Value = serde_json::from_str(body).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    if name.is_empty() {
        return None;
    }
    let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
        None | Some(Value::Null) => "{}".to_string(),
        Some(Value::String(s)) => {
            // Some models put the arguments in a JSON string; it must still be a JSON object.
            let inner: Value = serde_json::from_str(s).ok()?;
            inner.is_object().then(|| inner.to_string())?
        }
        Some(obj @ Value::Object(_)) => obj.to_string(),
        Some(_) => return None,
    };
    Some(ToolCall { name, arguments })
}

fn parse_xml_call(body: &str, string_params: &[(String, String)]) -> Option<ToolCall> {
    let rest = body.strip_prefix("<function=")?;
    let (name, mut rest) = rest.split_once('>')?;
    let name = name.trim().to_string();
    if name.is_empty() {
        return None;
    }
    let mut args = Map::new();
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix("</function>") {
            return after.trim().is_empty().then(|| ToolCall { name, arguments: Value::Object(args).to_string() });
        }
        let after_open = rest.strip_prefix("<parameter=")?;
        let (key, after_key) = after_open.split_once('>')?;
        let end = after_key.find("</parameter>")?;
        let raw = after_key[..end].strip_prefix('\n').unwrap_or(&after_key[..end]);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        let key = key.trim().to_string();
        let is_string = string_params.iter().any(|(f, p)| *f == name && *p == key);
        let value = if is_string {
            Value::String(raw.to_string())
        } else {
            serde_json::from_str(raw).unwrap_or_else(|_| Value::String(raw.to_string()))
        };
        args.insert(key, value);
        rest = &after_key[end + "</parameter>".len()..];
    }
}

/// (function, parameter) pairs whose schema type is "string".
fn string_parameters(tools: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for tool in tools.as_array().into_iter().flatten() {
        let f = tool.get("function").unwrap_or(tool);
        let Some(name) = f.get("name").and_then(Value::as_str) else { continue };
        let props = f.get("parameters").and_then(|p| p.get("properties")).and_then(Value::as_object);
        for (key, schema) in props.into_iter().flatten() {
            if schema.get("type").and_then(Value::as_str) == Some("string") {
                out.push((name.to_string(), key.clone()));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tools() -> Value {
        json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}])
    }

    /// Feeds `text` split at every byte boundary (two pieces) and in one piece; all must agree.
    fn parse_all_splits(text: &str, in_reasoning: bool) -> Vec<Delta> {
        let whole = merge(run(&[text], in_reasoning));
        for cut in 1..text.len() {
            if !text.is_char_boundary(cut) {
                continue;
            }
            let split = merge(run(&[&text[..cut], &text[cut..]], in_reasoning));
            assert_eq!(split, whole, "split at byte {cut} of {text:?}");
        }
        let bytewise: Vec<&str> = (0..text.len())
            .filter(|&i| text.is_char_boundary(i))
            .map(|i| {
                let end = (i + 1..=text.len()).find(|&j| text.is_char_boundary(j)).unwrap();
                &text[i..end]
            })
            .collect();
        assert_eq!(merge(run(&bytewise, in_reasoning)), whole, "char by char");
        whole
    }

    fn run(pieces: &[&str], in_reasoning: bool) -> Vec<Delta> {
        let t = tools();
        let mut p = OutputParser::new(in_reasoning, Some(&t));
        let mut out: Vec<Delta> = pieces.iter().flat_map(|x| p.push(x)).collect();
        out.extend(p.finish());
        out
    }

    /// Joins consecutive deltas of the same kind, so splits compare equal.
    fn merge(deltas: Vec<Delta>) -> Vec<Delta> {
        let mut out: Vec<Delta> = Vec::new();
        for d in deltas {
            match (out.last_mut(), d) {
                (Some(Delta::Content(a)), Delta::Content(b)) => a.push_str(&b),
                (Some(Delta::Reasoning(a)), Delta::Reasoning(b)) => a.push_str(&b),
                (_, d) => out.push(d),
            }
        }
        out
    }

    fn call(name: &str, args: Value) -> Delta {
        Delta::ToolCall(ToolCall { name: name.into(), arguments: args.to_string() })
    }

    #[test]
    fn reasoning_then_content() {
        let got = parse_all_splits("<think>\nLet me see.\n</think>\n\nParis é 中文.", false);
        assert_eq!(got, vec![Delta::Reasoning("Let me see.".into()), Delta::Content("Paris é 中文.".into())]);
    }

    #[test]
    fn prompt_opened_reasoning() {
        let got = parse_all_splits("hmm\n</think>\n\nHi", true);
        assert_eq!(got, vec![Delta::Reasoning("hmm".into()), Delta::Content("Hi".into())]);
    }

    #[test]
    fn json_tool_calls_several_per_turn() {
        let text = "I'll check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Zürich\", \"days\": 2}}\n</tool_call>";
        let got = parse_all_splits(text, false);
        assert_eq!(
            got,
            vec![
                Delta::Content("I'll check.".into()),
                call("get_weather", json!({"city": "Paris"})),
                call("get_weather", json!({"city": "Zürich", "days": 2})),
            ]
        );
    }

    #[test]
    fn xml_tool_call_uses_schema_types() {
        let text = "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";
        let got = parse_all_splits(text, false);
        assert_eq!(got, vec![call("get_weather", json!({"city": "42", "days": 3}))]);
    }

    #[test]
    fn malformed_calls_come_back_as_content() {
        let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {oops}\n</tool_call>";
        let got = merge(run(&[text], false));
        assert_eq!(got, vec![Delta::Content(text.into())]);
        let unfinished = "ok <tool_call>\n{\"name\": \"x\"";
        assert_eq!(merge(run(&[unfinished], false)), vec![Delta::Content(unfinished.into())]);
        for bad in ["<function=>\n</function>", "[1,2]", "{\"name\": 3}", "<function=f>\n<parameter=a>1"] {
            assert_eq!(parse_tool_call(bad, &[]), None, "{bad}");
        }
    }

    #[test]
    fn without_tools_markup_is_plain_content() {
        let mut p = OutputParser::new(false, None);
        let mut got = p.push("<tool_call>{\"name\": \"f\"}</tool_call>");
        got.extend(p.finish());
        assert_eq!(merge(got), vec![Delta::Content("<tool_call>{\"name\": \"f\"}</tool_call>".into())]);
    }

    #[test]
    fn think_after_content_is_content() {
        let got = parse_all_splits("Answer: <think> is a tag", false);
        assert_eq!(got, vec![Delta::Content("Answer: <think> is a tag".into())]);
    }

    #[test]
    fn forced_tool_call_prefix() {
        let t = tools();
        let mut p = OutputParser::new(false, Some(&t));
        p.start_in_tool_call("\n{\"name\": \"get_weather\", \"arguments\": ");
        let mut got = p.push("{\"city\": \"Oslo\"}}\n</tool_call>");
        got.extend(p.finish());
        assert_eq!(got, vec![call("get_weather", json!({"city": "Oslo"}))]);
    }
}
