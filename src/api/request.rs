//! OpenAI chat-completions requests: parsed from JSON, checked, and normalised for the chat
//! template. Every field that would change the output is either honoured or refused with an error
//! that names it; fields that cannot change the output (user, metadata, ...) are accepted.

use serde_json::{Map, Value};

use crate::grammar::GrammarSpec;
use crate::{Error, Result};

#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    Auto,
    None,
    Required,
    Function(String),
}

/// Sampling fields the request set; unset ones fall back to the model's generation_config.json.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SamplingOverrides {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    /// Token id → bias in [-100, 100].
    pub logit_bias: Vec<(u32, f32)>,
    pub seed: Option<u64>,
}

#[derive(Debug, Clone)]
pub struct ChatRequest {
    /// Messages ready for the chat template (text parts joined, tool-call arguments as objects).
    pub messages: Value,
    pub tools: Option<Value>,
    pub tool_choice: ToolChoice,
    pub parallel_tool_calls: bool,
    pub max_tokens: Option<usize>,
    pub sampling: SamplingOverrides,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// Extra template variables (chat_template_kwargs, enable_thinking from reasoning_effort).
    pub template_kwargs: Map<String, Value>,
    pub model: Option<String>,
    /// What the answer must parse as: `response_format` (json_object, json_schema) or the
    /// `grammar` extension field (Lark).
    pub grammar: Option<GrammarSpec>,
    /// `Some(n)` with `logprobs: true`: each token's log-probability and `top_logprobs` (n) alternatives.
    pub logprobs: Option<usize>,
    /// Choices to generate for the one prompt (`n`), one after the other, each sampled on its
    /// own: choice i with `seed + i` when a seed is given.
    pub n: usize,
}

/// OpenAI's limit on `top_logprobs`.
pub const MAX_TOP_LOGPROBS: usize = 20;
/// The most choices (`n`) one request may ask for: they run one after the other on one sequence,
/// so a larger `n` would hold the model for that many answers.
pub const MAX_CHOICES: usize = 16;

/// Keys accepted without effect: they never change the generated text.
const INERT_KEYS: [&str; 5] = ["user", "metadata", "store", "service_tier", "prompt_cache_key"];

/// Every generated piece is matched against every stop string, and `model` is copied into every
/// streamed chunk: both are bounded so that one request cannot slow or bloat every token.
pub const MAX_STOP_STRINGS: usize = 64;
pub const MAX_STOP_BYTES: usize = 1024;
pub const MAX_MODEL_NAME_BYTES: usize = 256;

impl ChatRequest {
    pub fn from_json_str(text: &str) -> Result<Self> {
        let json: Value =
            serde_json::from_str(text).map_err(|e| Error::InvalidRequest(format!("request is not valid JSON: {e}")))?;
        Self::from_json(&json)
    }

    pub fn from_json(json: &Value) -> Result<Self> {
        let obj = json.as_object().ok_or_else(|| bad("the request must be a JSON object"))?;
        let mut req = ChatRequest {
            messages: Value::Null,
            tools: None,
            tool_choice: ToolChoice::Auto,
            parallel_tool_calls: true,
            max_tokens: None,
            sampling: SamplingOverrides::default(),
            stop: Vec::new(),
            stream: false,
            include_usage: false,
            template_kwargs: Map::new(),
            model: None,
            grammar: None,
            logprobs: None,
            n: 1,
        };
        let mut lark = None;
        let (mut want_logprobs, mut top_logprobs) = (false, None);
        let mut tool_choice = None;
        let mut reasoning_effort = None;
        for (key, v) in obj {
            if v.is_null() {
                continue;
            }
            let s = &mut req.sampling;
            match key.as_str() {
                "messages" => req.messages = messages(v)?,
                "tools" => req.tools = tools(v)?,
                "tool_choice" => tool_choice = Some(v),
                "parallel_tool_calls" => req.parallel_tool_calls = boolean(key, v)?,
                "max_tokens" | "max_completion_tokens" => req.max_tokens = Some(count(key, v)?),
                "temperature" => s.temperature = Some(number(key, v)?),
                "top_p" => s.top_p = Some(number(key, v)?),
                "top_k" => s.top_k = Some(top_k(v)?),
                "min_p" => s.min_p = Some(number(key, v)?),
                "repeat_penalty" | "repetition_penalty" => s.repetition_penalty = Some(number(key, v)?),
                "presence_penalty" => s.presence_penalty = Some(number(key, v)?),
                "frequency_penalty" => s.frequency_penalty = Some(number(key, v)?),
                "seed" => s.seed = Some(v.as_i64().ok_or_else(|| bad("seed must be an integer"))? as u64),
                "stop" => req.stop = stop(v)?,
                "stream" => req.stream = boolean(key, v)?,
                "stream_options" => req.include_usage = stream_options(v)?,
                "chat_template_kwargs" => {
                    let m = v.as_object().ok_or_else(|| bad("chat_template_kwargs must be an object"))?;
                    req.template_kwargs.extend(m.clone());
                }
                "reasoning_effort" => reasoning_effort = Some(v.as_str().ok_or_else(|| bad("reasoning_effort must be a string"))?),
                "model" => req.model = Some(model_name(v)?),
                "n" => match v.as_u64() {
                    Some(n) if (1..=MAX_CHOICES as u64).contains(&n) => req.n = n as usize,
                    _ => return Err(bad(&format!("n must be an integer from 1 to {MAX_CHOICES}"))),
                },
                "logprobs" => want_logprobs = boolean(key, v)?,
                "top_logprobs" => match v.as_u64() {
                    Some(n) if n as usize <= MAX_TOP_LOGPROBS => top_logprobs = Some(n as usize),
                    _ => return Err(bad(&format!("top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}"))),
                },
                "logit_bias" => s.logit_bias = logit_bias(v)?,
                "response_format" => req.grammar = response_format(v)?,
                "grammar" => lark = Some(v.as_str().ok_or_else(|| bad("grammar must be a string (a Lark grammar)"))?),
                "modalities" if v == &serde_json::json!(["text"]) => {}
                "modalities" => return Err(Error::Unsupported("output modalities other than [\"text\"]".into())),
                k if INERT_KEYS.contains(&k) => {}
                other => return Err(Error::Unsupported(format!("request field {other:?}"))),
            }
        }
        if req.messages.is_null() {
            return Err(bad("messages is required"));
        }
        req.logprobs = match (want_logprobs, top_logprobs) {
            (true, n) => Some(n.unwrap_or(0)),
            (false, Some(_)) => return Err(bad("top_logprobs needs logprobs: true")),
            (false, None) => None,
        };
        if let Some(text) = lark {
            if req.grammar.is_some() {
                return Err(bad("grammar and a JSON response_format exclude each other"));
            }
            req.grammar = Some(GrammarSpec::Lark(text.to_string()));
        }
        if let Some(tc) = tool_choice {
            req.tool_choice = parse_tool_choice(tc, req.tools.as_ref())?;
        }
        match reasoning_effort {
            Some("none") => {
                req.template_kwargs.insert("enable_thinking".into(), Value::Bool(false));
            }
            Some(effort @ ("minimal" | "low" | "medium" | "high")) => {
                req.template_kwargs.insert("reasoning_effort".into(), Value::String(effort.into()));
            }
            Some(other) => return Err(bad(&format!("reasoning_effort {other:?} (none, minimal, low, medium, high)"))),
            None => {}
        }
        Ok(req)
    }
}

fn bad(msg: &str) -> Error {
    Error::InvalidRequest(msg.to_string())
}

fn number(key: &str, v: &Value) -> Result<f32> {
    v.as_f64().map(|x| x as f32).ok_or_else(|| bad(&format!("{key} must be a number")))
}

fn count(key: &str, v: &Value) -> Result<usize> {
    match v.as_u64() {
        Some(n) if n > 0 => Ok(n as usize),
        _ => Err(bad(&format!("{key} must be a positive integer"))),
    }
}

fn top_k(v: &Value) -> Result<usize> {
    // -1 and 0 both mean "no top-k" in vLLM and llama.cpp.
    match v.as_i64() {
        Some(k) if k <= 0 => Ok(0),
        Some(k) => Ok(k as usize),
        None => Err(bad("top_k must be an integer")),
    }
}

fn boolean(key: &str, v: &Value) -> Result<bool> {
    v.as_bool().ok_or_else(|| bad(&format!("{key} must be true or false")))
}

fn stop(v: &Value) -> Result<Vec<String>> {
    let list = match v {
        Value::String(s) => vec![s.clone()],
        Value::Array(items) => items
            .iter()
            .map(|s| s.as_str().map(str::to_string).ok_or_else(|| bad("stop must be a string or a list of strings")))
            .collect::<Result<_>>()?,
        _ => return Err(bad("stop must be a string or a list of strings")),
    };
    if list.iter().any(String::is_empty) {
        return Err(bad("stop strings must not be empty"));
    }
    if list.len() > MAX_STOP_STRINGS {
        return Err(bad(&format!("stop has {} strings (at most {MAX_STOP_STRINGS})", list.len())));
    }
    if let Some(long) = list.iter().find(|s| s.len() > MAX_STOP_BYTES) {
        return Err(bad(&format!("a stop string of {} bytes (at most {MAX_STOP_BYTES})", long.len())));
    }
    Ok(list)
}

/// OpenAI's `logit_bias`: an object from token ids (as strings) to biases in [-100, 100].
fn logit_bias(v: &Value) -> Result<Vec<(u32, f32)>> {
    let obj = v.as_object().ok_or_else(|| bad("logit_bias must be an object from token ids to numbers"))?;
    obj.iter()
        .map(|(id, bias)| {
            let id = id.parse::<u32>().map_err(|_| bad(&format!("logit_bias key {id:?} is not a token id")))?;
            let bias = bias.as_f64().ok_or_else(|| bad(&format!("logit_bias of token {id} must be a number")))? as f32;
            if !(-100.0..=100.0).contains(&bias) {
                return Err(bad(&format!("logit_bias of token {id} must be in [-100, 100], got {bias}")));
            }
            Ok((id, bias))
        })
        .collect()
}

/// `response_format`: text, json_object (any object, or llama.cpp's `schema` beside it) or
/// json_schema ({name, schema, strict}).
fn response_format(v: &Value) -> Result<Option<GrammarSpec>> {
    let kind = v.get("type").and_then(Value::as_str).ok_or_else(|| bad("response_format needs a type"))?;
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(match v.get("schema") {
            Some(schema) if !schema.is_null() => GrammarSpec::JsonSchema(schema.clone()),
            _ => GrammarSpec::JsonObject,
        })),
        "json_schema" => {
            let spec = v.get("json_schema").ok_or_else(|| bad("response_format json_schema needs a json_schema object"))?;
            match spec.get("schema") {
                Some(schema) if schema.is_object() || schema.is_boolean() => Ok(Some(GrammarSpec::JsonSchema(schema.clone()))),
                Some(_) => Err(bad("response_format.json_schema.schema must be a JSON schema (an object)")),
                None => Ok(Some(GrammarSpec::JsonObject)),
            }
        }
        other => Err(bad(&format!("response_format type {other:?} (text, json_object or json_schema)"))),
    }
}

fn model_name(v: &Value) -> Result<String> {
    let name = v.as_str().ok_or_else(|| bad("model must be a string"))?;
    if name.len() > MAX_MODEL_NAME_BYTES {
        return Err(bad(&format!("model is {} bytes long (at most {MAX_MODEL_NAME_BYTES})", name.len())));
    }
    Ok(name.to_string())
}

fn stream_options(v: &Value) -> Result<bool> {
    let obj = v.as_object().ok_or_else(|| bad("stream_options must be an object"))?;
    match obj.get("include_usage") {
        None | Some(Value::Null) => Ok(false),
        Some(x) => boolean("stream_options.include_usage", x),
    }
}

/// Normalises messages for the template: text parts joined, `developer` read as `system`,
/// tool-call arguments parsed into objects (templates iterate over them).
fn messages(v: &Value) -> Result<Value> {
    let list = v.as_array().ok_or_else(|| bad("messages must be an array"))?;
    if list.is_empty() {
        return Err(bad("messages must not be empty"));
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let obj = m.as_object().ok_or_else(|| bad(&format!("messages[{i}] must be an object")))?;
        let role = obj.get("role").and_then(Value::as_str).ok_or_else(|| bad(&format!("messages[{i}] has no role")))?;
        let role = match role {
            "developer" => "system",
            r @ ("system" | "user" | "assistant" | "tool") => r,
            other => return Err(bad(&format!("messages[{i}].role {other:?} (system, developer, user, assistant, tool)"))),
        };
        let mut msg = Map::new();
        msg.insert("role".into(), Value::String(role.into()));
        let content = content_text(obj.get("content"), i)?;
        let tool_calls = match obj.get("tool_calls") {
            None | Some(Value::Null) => None,
            Some(tc) if role == "assistant" => Some(assistant_tool_calls(tc, i)?),
            Some(_) => return Err(bad(&format!("messages[{i}]: only assistant messages carry tool_calls"))),
        };
        match (&content, &tool_calls) {
            (None, None) => return Err(bad(&format!("messages[{i}] has no content"))),
            // Templates expect a string; an assistant turn that only calls tools has empty content.
            (None, Some(_)) => msg.insert("content".into(), Value::String(String::new())),
            (Some(c), _) => msg.insert("content".into(), Value::String(c.clone())),
        };
        if let Some(tc) = tool_calls {
            msg.insert("tool_calls".into(), tc);
        }
        for key in ["name", "tool_call_id", "reasoning_content"] {
            if let Some(val) = obj.get(key).filter(|x| !x.is_null()) {
                let text = val.as_str().ok_or_else(|| bad(&format!("messages[{i}].{key} must be a string")))?;
                msg.insert(key.into(), Value::String(text.into()));
            }
        }
        out.push(Value::Object(msg));
    }
    Ok(Value::Array(out))
}

fn content_text(v: Option<&Value>, i: usize) -> Result<Option<String>> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, p) in parts.iter().enumerate() {
                match p.get("type").and_then(Value::as_str) {
                    Some("text") => texts.push(
                        p.get("text")
                            .and_then(Value::as_str)
                            .ok_or_else(|| bad(&format!("messages[{i}].content[{j}] has no text")))?,
                    ),
                    Some(other) => {
                        return Err(Error::Unsupported(format!("messages[{i}].content[{j}] of type {other:?} (text only)")))
                    }
                    None => return Err(bad(&format!("messages[{i}].content[{j}] has no type"))),
                }
            }
            Ok(Some(texts.join("\n")))
        }
        Some(_) => Err(bad(&format!("messages[{i}].content must be a string or an array of text parts"))),
    }
}

fn assistant_tool_calls(v: &Value, i: usize) -> Result<Value> {
    let list = v.as_array().ok_or_else(|| bad(&format!("messages[{i}].tool_calls must be an array")))?;
    let mut out = Vec::with_capacity(list.len());
    for (j, call) in list.iter().enumerate() {
        let at = format!("messages[{i}].tool_calls[{j}]");
        let f = call.get("function").ok_or_else(|| bad(&format!("{at} has no function")))?;
        let name = f.get("name").and_then(Value::as_str).ok_or_else(|| bad(&format!("{at}.function has no name")))?;
        let arguments = match f.get("arguments") {
            None | Some(Value::Null) => Value::Object(Map::new()),
            Some(Value::String(s)) => serde_json::from_str(s)
                .map_err(|e| bad(&format!("{at}.function.arguments is not valid JSON: {e}")))?,
            Some(obj @ Value::Object(_)) => obj.clone(),
            Some(_) => return Err(bad(&format!("{at}.function.arguments must be a JSON string"))),
        };
        let mut c = Map::new();
        if let Some(id) = call.get("id").and_then(Value::as_str) {
            c.insert("id".into(), Value::String(id.into()));
        }
        c.insert("type".into(), Value::String("function".into()));
        let function = serde_json::json!({"name": name, "arguments": arguments});
        c.insert("function".into(), function);
        out.push(Value::Object(c));
    }
    Ok(Value::Array(out))
}

fn tools(v: &Value) -> Result<Option<Value>> {
    let list = v.as_array().ok_or_else(|| bad("tools must be an array"))?;
    for (i, t) in list.iter().enumerate() {
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(Error::Unsupported(format!("tools[{i}]: only type \"function\" tools")));
        }
        let name = t.get("function").and_then(|f| f.get("name")).and_then(Value::as_str);
        if name.is_none_or(str::is_empty) {
            return Err(bad(&format!("tools[{i}].function has no name")));
        }
    }
    Ok((!list.is_empty()).then(|| v.clone()))
}

fn tool_names(tools: Option<&Value>) -> Vec<&str> {
    tools
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|t| t.get("function")?.get("name")?.as_str())
        .collect()
}

fn parse_tool_choice(v: &Value, tools: Option<&Value>) -> Result<ToolChoice> {
    let choice = match v {
        Value::String(s) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            other => return Err(bad(&format!("tool_choice {other:?} (auto, none, required, or a function)"))),
        },
        Value::Object(o) => {
            let name = o.get("function").and_then(|f| f.get("name")).and_then(Value::as_str);
            ToolChoice::Function(name.ok_or_else(|| bad("tool_choice.function.name is missing"))?.to_string())
        }
        _ => return Err(bad("tool_choice must be a string or an object")),
    };
    let names = tool_names(tools);
    match &choice {
        ToolChoice::Required if names.is_empty() => Err(bad("tool_choice \"required\" needs tools")),
        ToolChoice::Function(n) if !names.contains(&n.as_str()) => Err(bad(&format!("tool_choice names {n:?}, which is not in tools"))),
        _ => Ok(choice),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<ChatRequest> {
        ChatRequest::from_json(&v)
    }

    fn tools() -> Value {
        json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    }

    #[test]
    fn full_request_is_understood() {
        let r = parse(json!({
            "model": "m", "messages": [
                {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                    "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "42"}],
            "tools": tools(), "tool_choice": {"type": "function", "function": {"name": "f"}},
            "max_completion_tokens": 5, "temperature": 0.5, "top_k": -1, "stop": "END", "seed": 3,
            "stream": true, "stream_options": {"include_usage": true}, "reasoning_effort": "none",
            "chat_template_kwargs": {"foo": 1}, "n": 3, "user": "u"}))
        .unwrap();
        assert_eq!(r.messages[0], json!({"role": "system", "content": "a\nb"}));
        assert_eq!(r.messages[2]["tool_calls"][0]["function"]["arguments"], json!({"x": 1}));
        assert_eq!(r.messages[2]["content"], json!(""));
        assert_eq!(r.messages[3]["tool_call_id"], json!("c1"));
        assert_eq!(r.tool_choice, ToolChoice::Function("f".into()));
        assert_eq!((r.max_tokens, r.sampling.top_k, r.sampling.seed), (Some(5), Some(0), Some(3)));
        assert_eq!(r.stop, vec!["END"]);
        assert!(r.stream && r.include_usage);
        assert_eq!(r.template_kwargs["enable_thinking"], json!(false));
        assert_eq!(r.template_kwargs["foo"], json!(1));
        assert_eq!(r.n, 3);
        let m = json!([{"role": "user", "content": "hi"}]);
        for n in [json!(0), json!(17), json!(1.5), json!("2")] {
            let err = parse(json!({"messages": m, "n": n})).unwrap_err();
            assert!(matches!(err, Error::InvalidRequest(_)) && err.to_string().contains("from 1 to 16"), "{n}: {err}");
        }
    }

    #[test]
    fn output_changing_fields_we_do_not_support_are_refused() {
        let m = json!([{"role": "user", "content": "hi"}]);
        for (field, value) in [
            ("modalities", json!(["text", "audio"])),
            ("frobnicate", json!(1)),
        ] {
            let err = parse(json!({"messages": m, field: value})).unwrap_err();
            assert!(matches!(err, Error::Unsupported(_)), "{field}: {err}");
        }
        let err = parse(json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})).unwrap_err();
        assert!(err.to_string().contains("image_url"));
    }

    #[test]
    fn output_constraints_and_logit_bias_are_understood() {
        let m = json!([{"role": "user", "content": "x"}]);
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let cases = [
            (json!({"type": "text"}), None),
            (json!({"type": "json_object"}), Some(GrammarSpec::JsonObject)),
            (json!({"type": "json_object", "schema": schema}), Some(GrammarSpec::JsonSchema(schema.clone()))),
            (json!({"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": true}}),
                Some(GrammarSpec::JsonSchema(schema.clone()))),
        ];
        for (format, want) in cases {
            let r = parse(json!({"messages": m, "response_format": format, "modalities": ["text"]})).unwrap();
            assert_eq!(r.grammar, want, "{format}");
        }
        let r = parse(json!({"messages": m, "grammar": "start: \"yes\" | \"no\""})).unwrap();
        assert_eq!(r.grammar, Some(GrammarSpec::Lark("start: \"yes\" | \"no\"".into())));
        let r = parse(json!({"messages": m, "logprobs": true, "top_logprobs": 5})).unwrap();
        assert_eq!(r.logprobs, Some(5));
        assert_eq!(parse(json!({"messages": m, "logprobs": true})).unwrap().logprobs, Some(0));
        assert_eq!(parse(json!({"messages": m, "logprobs": false})).unwrap().logprobs, None);
        let r = parse(json!({"messages": m, "logit_bias": {"15": -100, "7": 2.5}})).unwrap();
        assert_eq!(r.sampling.logit_bias, vec![(15, -100.0), (7, 2.5)]);
        for (field, value, why) in [
            ("logit_bias", json!({"x": 1}), "not a token id"),
            ("logit_bias", json!({"3": 101}), "[-100, 100]"),
            ("logit_bias", json!([1]), "must be an object"),
            ("response_format", json!({"type": "yaml"}), "yaml"),
            ("response_format", json!({"type": "json_schema", "json_schema": {"schema": "x"}}), "must be a JSON schema"),
            ("grammar", json!(5), "Lark"),
            ("top_logprobs", json!(21), "0 to 20"),
        ] {
            let err = parse(json!({"messages": m, field: value})).unwrap_err();
            assert!(matches!(err, Error::InvalidRequest(_)) && err.to_string().contains(why), "{field}: {err}");
        }
        let both = parse(json!({"messages": m, "grammar": "start: \"a\"", "response_format": {"type": "json_object"}}));
        assert!(both.unwrap_err().to_string().contains("exclude each other"));
    }

    #[test]
    fn malformed_requests_name_the_problem() {
        let cases = [
            (json!([]), "must be a JSON object"),
            (json!({}), "messages is required"),
            (json!({"messages": []}), "must not be empty"),
            (json!({"messages": [{"role": "wizard", "content": "x"}]}), "wizard"),
            (json!({"messages": [{"role": "user"}]}), "no content"),
            (json!({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}), "temperature"),
            (json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}), "max_tokens"),
            (json!({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}), "needs tools"),
            (json!({"messages": [{"role": "user", "content": "x"}], "tools": tools(),
                    "tool_choice": {"type": "function", "function": {"name": "g"}}}), "\"g\""),
            (json!({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function":
                    {"name": "f", "arguments": "{oops"}}]}]}), "not valid JSON"),
            (json!({"messages": [{"role": "user", "content": "x"}], "stop": vec!["s"; MAX_STOP_STRINGS + 1]}),
                "at most 64"),
            (json!({"messages": [{"role": "user", "content": "x"}], "stop": "s".repeat(MAX_STOP_BYTES + 1)}),
                "at most 1024"),
            (json!({"messages": [{"role": "user", "content": "x"}], "model": "m".repeat(MAX_MODEL_NAME_BYTES + 1)}),
                "at most 256"),
        ];
        for (req, needle) in cases {
            let err = parse(req.clone()).unwrap_err().to_string();
            assert!(err.contains(needle), "{req}: {err}");
        }
        assert!(ChatRequest::from_json_str("{not json").unwrap_err().to_string().contains("not valid JSON"));
    }
}
