//! A hostile chat template (a model file carries its own: tokenizer_config.json,
//! chat_template.jinja or GGUF metadata), compiled with `ChatTemplate::new` and rendered over a
//! fixed conversation with tools. Loops, huge outputs and recursion must end in an error, quickly
//! (before the render's deadline).
#![no_main]

use std::sync::OnceLock;

use atlas::chat::ChatTemplate;
use libfuzzer_sys::fuzz_target;
use serde_json::{json, Map, Value};

fn conversation() -> &'static (Value, Value, Map<String, Value>) {
    static C: OnceLock<(Value, Value, Map<String, Value>)> = OnceLock::new();
    C.get_or_init(|| {
        let messages = json!([
            {"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "What's the weather in Paris? ünïcödé \u{1F600}"},
            {"role": "assistant", "content": "", "reasoning_content": "Let me check.",
             "tool_calls": [{"id": "c1", "type": "function",
                             "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21.5}"},
            {"role": "assistant", "content": "It is 21.5 °C."},
            {"role": "user", "content": "Thanks"}
        ]);
        let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                           "required": ["city"]}}}]);
        let mut kwargs = Map::new();
        kwargs.insert("enable_thinking".into(), Value::Bool(false));
        (messages, tools, kwargs)
    })
}

fuzz_target!(|data: &[u8]| {
    let Ok(source) = std::str::from_utf8(data) else { return };
    let Ok(template) = ChatTemplate::new(source, Some("<s>".into()), Some("</s>".into())) else { return };
    let (messages, tools, kwargs) = conversation();
    for result in [template.render(messages, Some(tools), true, kwargs), template.render(messages, None, false, &Map::new())] {
        // A render past its deadline is handled (the request fails, the thread is abandoned), but
        // for the fuzzer it is a timeout: a way around the fuel to be found and closed.
        if let Err(e) = result {
            assert!(!e.to_string().contains("ran longer than"), "{e}");
        }
    }
});
