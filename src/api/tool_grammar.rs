//! Tool calls held to their functions' `parameters` schemas: a Lark grammar (llguidance's syntax)
//! for what the model writes, in the tool-call format its template taught it:
//!
//! ```text
//! JSON (Qwen3)          <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>
//! XML (Qwen3.5/3.6)     <tool_call>\n<function=f>\n<parameter=p>\nvalue\n</parameter>\n...</function>\n</tool_call>
//! ```
//!
//! A forced call (`tool_choice` "required" or a named function) continues the prompt's forced
//! prefix (see `forced_call_prefix`): the grammar covers the rest of the call, and more calls when
//! parallel calls are allowed. With `tool_choice` "auto" and a function marked `"strict": true`,
//! the answer is free text in which every `<tool_call>` opens a constrained call.

use serde_json::{json, Value};

use super::request::ToolChoice;
use crate::grammar::bounded_whitespace;

const CLOSE: &str = "</tool_call>";

struct Function<'a> {
    name: &'a str,
    /// The arguments' schema (an object schema; `{"type": "object"}` when the tool gives none).
    parameters: Value,
}

fn functions(tools: &Value) -> Vec<Function<'_>> {
    tools
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| {
            let f = t.get("function").unwrap_or(t);
            let parameters = f.get("parameters").filter(|p| p.is_object()).cloned().unwrap_or_else(|| json!({"type": "object"}));
            Some(Function { name: f.get("name")?.as_str()?, parameters })
        })
        .collect()
}

/// Whether any function asks for strict arguments.
fn any_strict(tools: &Value) -> bool {
    tools.as_array().into_iter().flatten().any(|t| t.get("function").unwrap_or(t).get("strict") == Some(&json!(true)))
}

/// A Lark string literal.
fn lit(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

/// `%json {schema}`, at most one whitespace character between two tokens: tool calls are
/// written compactly (`{"name": "f", "arguments": {"a": 1}}`), and a model that drifts into
/// whitespace gets no room to.
fn json_of(schema: &Value) -> String {
    format!("%json {}", bounded_whitespace(schema.clone(), 1))
}

/// The JSON body of a call to any of the functions: `{"name": ..., "arguments": {...}}`.
fn json_call(fs: &[Function<'_>]) -> String {
    let options: Vec<Value> = fs
        .iter()
        .map(|f| {
            json!({"type": "object", "properties": {"name": {"const": f.name}, "arguments": f.parameters},
                   "required": ["name", "arguments"], "additionalProperties": false})
        })
        .collect();
    json_of(&json!({"anyOf": options}))
}

/// Rules for the XML form of function `i`: `fn_i` matches `NAME>\n` + its parameters +
/// `</function>\n</tool_call>` (what follows `<function=`); `params_i` the parameters alone.
/// Parameters come in the schema's order, each required one present; string values are raw text
/// (an enum's values, at most `maxLength` characters, or anything up to `</parameter>`), the
/// others JSON.
fn xml_rules(i: usize, f: &Function<'_>, out: &mut Vec<String>) {
    let props = f.parameters.get("properties").and_then(Value::as_object);
    let required: Vec<&str> = f.parameters.get("required").and_then(Value::as_array).into_iter().flatten().filter_map(Value::as_str).collect();
    let mut seq = Vec::new();
    for (j, (key, schema)) in props.into_iter().flatten().enumerate() {
        let value = if schema.get("type") == Some(&json!("string")) {
            match (schema.get("enum").and_then(Value::as_array), schema.get("maxLength").and_then(Value::as_u64)) {
                (Some(values), _) => {
                    let alts: Vec<String> = values.iter().filter_map(Value::as_str).map(|v| lit(&format!("{v}\n</parameter>\n"))).collect();
                    format!("({})", alts.join(" | "))
                }
                (None, Some(n)) => format!("/(?s:.{{0,{n}}})/ {}", lit("\n</parameter>\n")),
                (None, None) => format!("raw_{i}_{j}"),
            }
        } else {
            format!("{} {}", json_of(schema), lit("\n</parameter>\n"))
        };
        if value.starts_with("raw_") {
            out.push(format!("raw_{i}_{j}[lazy]: /(?s:.*)\\n<\\/parameter>\\n/"));
        }
        out.push(format!("p_{i}_{j}: {} {value}", lit(&format!("<parameter={key}>\n"))));
        let optional = if required.contains(&key.as_str()) { "" } else { "?" };
        seq.push(format!("p_{i}_{j}{optional}"));
    }
    out.push(format!("params_{i}: {}", if seq.is_empty() { "\"\"".to_string() } else { seq.join(" ") }));
    out.push(format!("fn_{i}: {} params_{i} {}", lit(&format!("{}>\n", f.name)), lit(&format!("</function>\n{CLOSE}"))));
}

/// The grammar of the answer, or None when nothing constrains the calls.
pub fn tool_call_grammar(choice: &ToolChoice, tools: &Value, xml: bool, parallel: bool) -> Option<String> {
    let fs = functions(tools);
    if fs.is_empty() || *choice == ToolChoice::None {
        return None;
    }
    let mut rules = Vec::new();
    if xml {
        for (i, f) in fs.iter().enumerate() {
            xml_rules(i, f, &mut rules);
        }
    }
    let any_fn = (0..fs.len()).map(|i| format!("fn_{i}")).collect::<Vec<_>>().join(" | ");
    // One whole call after `<tool_call>`, in either format.
    let call = if xml { format!("{} ({any_fn})", lit("\n<function=")) } else { format!("{} {} {}", lit("\n"), json_call(&fs), lit(&format!("\n{CLOSE}"))) };
    rules.push(format!("call: {call}"));
    let more = if parallel { format!(" ({} call)*", lit("\n<tool_call>")) } else { String::new() };
    let start = match choice {
        // The prompt ends inside the first call: `<tool_call>\n` (JSON) or `<tool_call>\n<function=` (XML).
        ToolChoice::Required if xml => format!("({any_fn}){more}"),
        ToolChoice::Required => format!("{} {}{more}", json_call(&fs), lit(&format!("\n{CLOSE}"))),
        // ... or after the function's name: `"arguments": ` (JSON) or `<function=NAME>\n` (XML).
        ToolChoice::Function(name) => {
            let i = fs.iter().position(|f| f.name == name)?;
            if xml {
                format!("params_{i} {}{more}", lit(&format!("</function>\n{CLOSE}")))
            } else {
                format!("{} {}{more}", json_of(&fs[i].parameters), lit(&format!("}}\n{CLOSE}")))
            }
        }
        ToolChoice::Auto if any_strict(tools) => {
            rules.push("head[lazy]: TEXT \"<tool_call>\"".into());
            rules.push("TEXT: /(?s:.*)/".into());
            rules.push("TAIL: /(?s:.*)/ & ~/(?s:.*)<tool_call>(?s:.*)/".into());
            "(head call)* TAIL".into()
        }
        ToolChoice::Auto | ToolChoice::None => return None,
    };
    rules.insert(0, format!("start: {start}"));
    Some(rules.join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools(strict: bool) -> Value {
        json!([{"type": "function", "function": {"name": "get_weather", "strict": strict, "parameters": {"type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}, "days": {"type": "integer"}},
            "required": ["city"], "additionalProperties": false}}}])
    }

    #[test]
    fn grammars_exist_for_forced_and_strict_calls_only() {
        for xml in [false, true] {
            assert!(tool_call_grammar(&ToolChoice::Required, &tools(false), xml, true).is_some());
            assert!(tool_call_grammar(&ToolChoice::Function("get_weather".into()), &tools(false), xml, false).is_some());
            assert!(tool_call_grammar(&ToolChoice::Function("nope".into()), &tools(false), xml, false).is_none());
            assert!(tool_call_grammar(&ToolChoice::Auto, &tools(false), xml, true).is_none());
            assert!(tool_call_grammar(&ToolChoice::Auto, &tools(true), xml, true).is_some());
            assert!(tool_call_grammar(&ToolChoice::None, &tools(true), xml, true).is_none());
        }
        let g = tool_call_grammar(&ToolChoice::Required, &tools(false), true, false).unwrap();
        assert!(g.contains("p_0_0 p_0_1? p_0_2?"), "{g}");
    }
}
