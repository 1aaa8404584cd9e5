//! The OpenAI sampling surface end to end on a random-weight model (tests/fixtures/models/chat_tiny),
//! so that only the constraint can make an answer valid: JSON schemas, any JSON object, Lark
//! grammars, tool calls held to their schemas, logit_bias, logprobs, and the errors of bad input.

use atlas::api::{chat_completion, ChatRequest};
use atlas::sampling::SamplingParams;
use atlas::{Engine, EngineOptions, Error, GenerateRequest};
use serde_json::{json, Value};

fn engine() -> Engine {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/chat_tiny");
    Engine::load(&EngineOptions::new(dir), &mut |_| {}).unwrap()
}

/// One chat completion's answer text.
fn answer(engine: &mut Engine, extra: Value) -> Result<(String, String), Error> {
    let mut req = json!({"messages": [{"role": "user", "content": "Answer in JSON."}], "max_tokens": 600});
    for (k, v) in extra.as_object().unwrap() {
        req[k] = v.clone();
    }
    let response = chat_completion(engine, &ChatRequest::from_json(&req)?, &mut |_| true)?;
    let choice = &response["choices"][0];
    let text = choice["message"]["content"].as_str().unwrap_or_default().to_string();
    Ok((text, choice["finish_reason"].as_str().unwrap_or_default().to_string()))
}

/// Whether `v` satisfies `schema`, for the keywords these tests use (type, properties, required,
/// additionalProperties false, enum, const, minimum/maximum, minLength/maxLength, pattern-free
/// strings, items, minItems/maxItems, anyOf).
fn valid(v: &Value, schema: &Value) -> Result<(), String> {
    let fail = |why: &str| Err(format!("{v} against {schema}: {why}"));
    if let Some(options) = schema.get("anyOf").and_then(Value::as_array) {
        return if options.iter().any(|s| valid(v, s).is_ok()) { Ok(()) } else { fail("no anyOf branch") };
    }
    if let Some(values) = schema.get("enum").and_then(Value::as_array) {
        if !values.contains(v) {
            return fail("not in enum");
        }
    }
    if let Some(c) = schema.get("const") {
        if c != v {
            return fail("not the const");
        }
    }
    let ty = schema.get("type").and_then(Value::as_str);
    let ok_type = match ty {
        None => true,
        Some("object") => v.is_object(),
        Some("array") => v.is_array(),
        Some("string") => v.is_string(),
        Some("integer") => v.is_i64() || v.is_u64(),
        Some("number") => v.is_number(),
        Some("boolean") => v.is_boolean(),
        Some("null") => v.is_null(),
        Some(other) => return fail(&format!("type {other} unknown to the test")),
    };
    if !ok_type {
        return fail("wrong type");
    }
    let num = |k: &str| schema.get(k).and_then(Value::as_f64);
    if let Some(x) = v.as_f64() {
        if num("minimum").is_some_and(|m| x < m) || num("maximum").is_some_and(|m| x > m) {
            return fail("out of bounds");
        }
    }
    if let Some(s) = v.as_str() {
        let n = s.chars().count() as f64;
        if num("minLength").is_some_and(|m| n < m) || num("maxLength").is_some_and(|m| n > m) {
            return fail("length out of bounds");
        }
    }
    if let Some(items) = v.as_array() {
        let n = items.len() as f64;
        if num("minItems").is_some_and(|m| n < m) || num("maxItems").is_some_and(|m| n > m) {
            return fail("item count out of bounds");
        }
        if let Some(item_schema) = schema.get("items") {
            items.iter().try_for_each(|item| valid(item, item_schema))?;
        }
    }
    if let Some(obj) = v.as_object() {
        let props = schema.get("properties").and_then(Value::as_object);
        for key in schema.get("required").and_then(Value::as_array).into_iter().flatten() {
            if !obj.contains_key(key.as_str().unwrap_or_default()) {
                return fail(&format!("missing required {key}"));
            }
        }
        for (key, value) in obj {
            match props.and_then(|p| p.get(key)) {
                Some(s) => valid(value, s)?,
                None if schema.get("additionalProperties") == Some(&json!(false)) => return fail(&format!("extra key {key}")),
                None => {}
            }
        }
    }
    Ok(())
}

fn object(props: Value, required: &[&str]) -> Value {
    json!({"type": "object", "properties": props, "required": required, "additionalProperties": false})
}

/// Twenty schemas: nested objects, arrays, enums, bounded numbers, required and optional keys.
fn schemas() -> Vec<Value> {
    let short = json!({"type": "string", "maxLength": 8});
    let small = json!({"type": "integer", "minimum": -50, "maximum": 50});
    vec![
        object(json!({"name": short}), &["name"]),
        object(json!({"age": small}), &["age"]),
        object(json!({"ok": {"type": "boolean"}}), &["ok"]),
        object(json!({"color": {"enum": ["red", "green", "blue"]}}), &["color"]),
        object(json!({"name": short, "age": small}), &["name", "age"]),
        object(json!({"name": short, "nick": short}), &["name"]),
        object(json!({"tags": {"type": "array", "items": short, "maxItems": 3}}), &["tags"]),
        object(json!({"tags": {"type": "array", "items": small, "minItems": 1, "maxItems": 4}}), &["tags"]),
        object(json!({"point": object(json!({"x": small, "y": small}), &["x", "y"])}), &["point"]),
        object(json!({"user": object(json!({"name": short, "admin": {"type": "boolean"}}), &["name"])}), &["user"]),
        object(json!({"score": {"type": "number", "minimum": 0, "maximum": 1}}), &["score"]),
        object(json!({"level": {"type": "integer", "minimum": 1, "maximum": 5}}), &["level"]),
        object(json!({"unit": {"const": "kg"}, "value": small}), &["unit", "value"]),
        object(json!({"id": {"anyOf": [small, short]}}), &["id"]),
        object(json!({"maybe": {"anyOf": [short, {"type": "null"}]}}), &["maybe"]),
        object(json!({"rows": {"type": "array", "maxItems": 2, "items": object(json!({"k": short, "v": small}), &["k", "v"])}}), &["rows"]),
        object(json!({"code": {"type": "string", "minLength": 2, "maxLength": 4}}), &["code"]),
        object(json!({"a": {"enum": [1, 2, 3]}, "b": {"enum": ["x", "y"]}, "c": {"type": "boolean"}}), &["a", "b", "c"]),
        object(json!({"deep": object(json!({"deeper": object(json!({"leaf": small}), &["leaf"])}), &["deeper"])}), &["deep"]),
        json!({"type": "array", "items": {"enum": ["up", "down"]}, "minItems": 1, "maxItems": 5}),
    ]
}

#[test]
fn json_schema_answers_always_validate() {
    let mut engine = engine();
    for (i, schema) in schemas().into_iter().enumerate() {
        let format = json!({"type": "json_schema", "json_schema": {"name": format!("s{i}"), "schema": schema, "strict": true}});
        // Sampled (seeded) and greedy: the random weights alone would write neither.
        for sampling in [json!({"temperature": 1.0, "seed": i}), json!({"temperature": 0.0})] {
            let mut extra = json!({"response_format": format});
            extra.as_object_mut().unwrap().extend(sampling.as_object().unwrap().clone());
            let (text, finish) = answer(&mut engine, extra).unwrap();
            assert_eq!(finish, "stop", "schema {i}: the answer did not end: {text:?}");
            let value: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("schema {i}: {text:?} is not JSON: {e}"));
            valid(&value, &schema).unwrap_or_else(|e| panic!("schema {i}: {e}"));
        }
    }
    // Without a constraint the same model writes no JSON.
    let (free, _) = answer(&mut engine, json!({"temperature": 1.0, "seed": 1, "max_tokens": 40})).unwrap();
    assert!(serde_json::from_str::<Value>(&free).is_err(), "the random model wrote JSON on its own: {free:?}");
}

#[test]
fn json_object_and_lark_grammars_constrain_the_answer() {
    let mut engine = engine();
    // Any object may nest without end, so an answer may run out of tokens; every finished one parses.
    let mut finished = 0;
    for seed in 0..5 {
        let (text, finish) = answer(&mut engine, json!({"response_format": {"type": "json_object"}, "temperature": 0.7, "seed": seed})).unwrap();
        if finish == "stop" {
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
            assert!(v.is_object(), "{text:?}");
            finished += 1;
        }
    }
    assert!(finished >= 3, "{finished} of 5 json_object answers ended");
    let grammar = r#"start: ("yes" | "no") " " NUM
NUM: /[0-9]{1,3}/"#;
    for seed in 0..5 {
        let (text, finish) = answer(&mut engine, json!({"grammar": grammar, "temperature": 1.0, "seed": seed})).unwrap();
        assert_eq!(finish, "stop");
        let (word, num) = text.split_once(' ').unwrap_or_else(|| panic!("{text:?}"));
        assert!(["yes", "no"].contains(&word) && (1..=3).contains(&num.len()) && num.bytes().all(|b| b.is_ascii_digit()), "{text:?}");
    }
}

#[test]
fn bad_schemas_and_grammars_are_invalid_requests_and_the_model_stays_usable() {
    let mut engine = engine();
    for extra in [
        json!({"grammar": "start: undefined_rule"}),
        json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}, "required": ["a"]}}}}),
        json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "integer", "minimum": 5, "maximum": 1}}}}),
    ] {
        let err = answer(&mut engine, extra.clone()).unwrap_err();
        assert!(matches!(err, Error::InvalidRequest(_)), "{extra}: {err}");
    }
    let err = answer(&mut engine, json!({"logit_bias": {"100000": 1}})).unwrap_err();
    assert!(err.to_string().contains("outside the vocabulary"), "{err}");
    let schema = object(json!({"ok": {"type": "boolean"}}), &["ok"]);
    let (text, finish) = answer(&mut engine, json!({"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}})).unwrap();
    assert_eq!(finish, "stop");
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    assert!(v == json!({"ok": true}) || v == json!({"ok": false}), "{text:?}");
    // Whitespace between JSON tokens comes in bounded runs (this random model loves newlines).
    let longest = text.split(|c: char| !c.is_whitespace()).map(str::len).max().unwrap_or(0);
    assert!(longest <= atlas::grammar::JSON_WHITESPACE_RUN, "{text:?}");
}

#[test]
fn logit_bias_steers_and_bans_tokens() {
    let mut engine = engine();
    let id = |engine: &Engine, text: &str| engine.tokenizer().unwrap().encode(text).unwrap()[0];
    // A bias of 100 makes "a" the only choice; -100 removes the greedy choice.
    let a = id(&engine, "a");
    let (text, _) = answer(&mut engine, json!({"logit_bias": {a.to_string(): 100}, "max_tokens": 8, "temperature": 1.0, "seed": 3})).unwrap();
    assert_eq!(text, "aaaaaaaa");
    // Greedy ids straight from the engine: banning the first one changes the first choice.
    let prompt = engine.tokenizer().unwrap().encode("hello").unwrap();
    let mut req = GenerateRequest { prompt, max_tokens: Some(4), sampling: SamplingParams::default(), stop: vec![], ignore_eos: true, grammar: None, logprobs: None };
    let plain = engine.generate(&req, &mut |_| true).unwrap().tokens;
    req.sampling.logit_bias = vec![(plain[0], -100.0)];
    let banned = engine.generate(&req, &mut |_| true).unwrap().tokens;
    assert_ne!(banned[0], plain[0]);
}

#[test]
fn penalties_made_by_the_backend_choose_what_the_host_sampler_chooses() {
    // Penalties and biases are adjustments the backend makes before its choice, updated as the
    // output grows; a request with logprobs samples on the host from every logit instead (its
    // log-probabilities are of the model's own distribution). Both pick the same tokens.
    let mut engine = engine();
    let prompt = engine.tokenizer().unwrap().encode("hello hello world, the cat and the hat").unwrap();
    let plain = GenerateRequest { prompt, max_tokens: Some(24), sampling: SamplingParams::default(), stop: vec![], ignore_eos: true, grammar: None, logprobs: None };
    let unpenalised = engine.generate(&plain, &mut |_| true).unwrap().tokens;
    for sampling in [
        SamplingParams { repetition_penalty: 1.8, ..Default::default() },
        SamplingParams { presence_penalty: 1.5, frequency_penalty: 0.8, ..Default::default() },
        SamplingParams { temperature: 0.9, repetition_penalty: 1.3, frequency_penalty: 0.4, logit_bias: vec![(7, 3.0)], seed: Some(5), ..Default::default() },
        SamplingParams { temperature: 1.1, seed: Some(9), ..Default::default() },
    ] {
        let req = GenerateRequest { sampling, ..plain.clone() };
        let on_backend = engine.generate(&req, &mut |_| true).unwrap();
        let on_host = engine.generate(&GenerateRequest { logprobs: Some(0), ..req.clone() }, &mut |_| true).unwrap();
        assert_eq!(on_backend.tokens, on_host.tokens, "{:?}", req.sampling);
        assert_eq!(on_host.logprobs.len(), on_host.tokens.len());
        if req.sampling.temperature == 0.0 {
            assert_ne!(on_backend.tokens, unpenalised, "{:?} changed nothing", req.sampling);
        }
    }
}

/// A tool-aware template in the style of Qwen3's (JSON calls) or Qwen3.5's (XML calls: its
/// instructions show `<function=`, which is how Atlas tells the formats apart).
fn template(xml: bool) -> String {
    let how = if xml { "<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>" } else { "<tool_call>\n{\"name\": NAME, \"arguments\": ARGS}\n</tool_call>" };
    format!(
        "{{%- if tools %}}<|im_start|>system\nTools: {{% for t in tools %}}{{{{ t | tojson }}}}{{% endfor %}}\nCall them as {how}<|im_end|>\n{{% endif %}}\
         {{%- for m in messages %}}<|im_start|>{{{{ m.role }}}}\n{{{{ m.content }}}}<|im_end|>\n{{% endfor %}}\
         {{%- if add_generation_prompt %}}<|im_start|>assistant\n{{% endif %}}"
    )
}

#[test]
fn forced_and_strict_tool_calls_follow_the_parameters_schema_in_both_formats() {
    use atlas::api::{prepare_chat, run_chat};
    use atlas::chat::ChatTemplate;
    use atlas::engine::Frontend;
    let mut engine = engine();
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/chat_tiny");
    let tokenizer = atlas::tokenizer::Tokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
    let parameters = json!({"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": false});
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "strict": true, "parameters": parameters}},
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 6}}, "required": ["zone"], "additionalProperties": false}}}]);
    for xml in [false, true] {
        let chat_template = ChatTemplate::new(&template(xml), None, Some("<|im_end|>".into())).unwrap();
        let front = Frontend::new("chat_tiny".into(), Some(tokenizer.clone()), Some(chat_template), engine.frontend().defaults().clone(), 1024);
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        for (choice, seed) in [(json!("required"), 1), (json!("required"), 2), (named.clone(), 3), (named, 4)] {
            let what = format!("{} tool_choice {choice} seed {seed}", if xml { "xml" } else { "json" });
            let req = json!({"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": tools, "tool_choice": choice,
                             "parallel_tool_calls": false, "temperature": 1.0, "seed": seed, "max_tokens": 300});
            let prepared = prepare_chat(&front, ChatRequest::from_json(&req).unwrap()).unwrap();
            let response = run_chat(&mut engine, prepared, &mut |_| true).unwrap_or_else(|e| panic!("{what}: {e}"));
            let choice0 = &response["choices"][0];
            assert_eq!(choice0["finish_reason"], "tool_calls", "{what}: {response}");
            let call = &choice0["message"]["tool_calls"][0]["function"];
            let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
            let schema = if call["name"] == "get_weather" { &parameters } else { &tools[1]["function"]["parameters"] };
            valid(&args, schema).unwrap_or_else(|e| panic!("{what}: {e}"));
        }
        // "auto" with a strict function: free text, and any call it makes is held to the schema.
        let req = json!({"messages": [{"role": "user", "content": "Hi"}], "tools": tools, "max_tokens": 30, "temperature": 1.0, "seed": 9});
        let prepared = prepare_chat(&front, ChatRequest::from_json(&req).unwrap()).unwrap();
        let response = run_chat(&mut engine, prepared, &mut |_| true).unwrap();
        for call in response["choices"][0]["message"]["tool_calls"].as_array().into_iter().flatten() {
            let args: Value = serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
            if call["function"]["name"] == "get_weather" {
                valid(&args, &parameters).unwrap();
            }
        }
    }
}

#[test]
fn logprobs_are_the_log_softmax_of_the_logits() {
    let mut engine = engine();
    let prompt = engine.tokenizer().unwrap().encode("The logprobs").unwrap();
    let limit = engine.tokenizer().unwrap().vocab_size();
    for temperature in [0.0, 0.9] {
        let sampling = SamplingParams { temperature, seed: Some(5), ..Default::default() };
        let req = GenerateRequest { prompt: prompt.clone(), max_tokens: Some(6), sampling, stop: vec![], ignore_eos: true, grammar: None, logprobs: Some(5) };
        let generation = engine.generate(&req, &mut |_| true).unwrap();
        assert_eq!(generation.logprobs.len(), generation.tokens.len());
        let mut seq = prompt.clone();
        for (lp, &token) in generation.logprobs.iter().zip(&generation.tokens) {
            let logits = engine.logits(&seq).unwrap();
            let logits = &logits[..limit];
            let max = logits.iter().fold(f64::NEG_INFINITY, |m, &l| m.max(l as f64));
            let log_total = max + logits.iter().map(|&l| (l as f64 - max).exp()).sum::<f64>().ln();
            assert_eq!(lp.token, token);
            assert!((lp.logprob as f64 - (logits[token as usize] as f64 - log_total)).abs() < 1e-4, "{lp:?}");
            assert_eq!(lp.top.len(), 5);
            assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1), "top_logprobs out of order: {lp:?}");
            for &(id, l) in &lp.top {
                assert!((l as f64 - (logits[id as usize] as f64 - log_total)).abs() < 1e-4);
            }
            if temperature == 0.0 {
                assert_eq!(lp.top[0].0, token, "greedy takes the most likely token");
            }
            seq.push(token);
        }
    }
    // Through the API: one entry per token, top_logprobs in order, each streamed in a chunk of its
    // own as its token is chosen.
    let mut chunks = Vec::new();
    let req = json!({"messages": [{"role": "user", "content": "Hi"}], "logprobs": true, "top_logprobs": 3,
                     "max_tokens": 4, "temperature": 0.0, "stream": true});
    let response = chat_completion(&mut engine, &ChatRequest::from_json(&req).unwrap(), &mut |c| {
        chunks.push(c.to_string());
        true
    })
    .unwrap();
    let content = response["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len() as u64, response["usage"]["completion_tokens"].as_u64().unwrap());
    for entry in content {
        let top = entry["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        assert_eq!(entry["logprob"], top[0]["logprob"], "greedy: {entry}");
        assert!(entry["bytes"].is_array());
    }
    let streamed: Vec<Value> = chunks.iter().map(|c| serde_json::from_str::<Value>(c).unwrap())
        .filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array().cloned()).flatten().collect();
    // (JSON text and back may move a float's last bit.)
    let same = |a: &Value, b: &Value| a["token"] == b["token"] && (a["logprob"].as_f64().unwrap() - b["logprob"].as_f64().unwrap()).abs() < 1e-6;
    assert!(streamed.len() == content.len() && streamed.iter().zip(content).all(|(a, b)| same(a, b)), "streamed {streamed:?}, answer {content:?}");
}

#[test]
fn every_constrained_answer_is_a_sentence_of_its_grammar() {
    use atlas::grammar::{GrammarSpec, GrammarVocab};
    let mut engine = engine();
    let prompt = engine.tokenizer().unwrap().encode("Give me JSON").unwrap();
    let vocab = GrammarVocab::new(engine.tokenizer().unwrap(), engine.config().vocab_size, engine.eos_ids()).unwrap();
    for (i, schema) in schemas().into_iter().enumerate().take(8) {
        let spec = GrammarSpec::JsonSchema(schema);
        // Top-k sampling takes the device path (the mask goes to the backend), temperature alone the host path.
        for sampling in [SamplingParams { temperature: 1.0, top_k: 40, seed: Some(i as u64), ..Default::default() },
                         SamplingParams { temperature: 1.0, seed: Some(i as u64), ..Default::default() }] {
            let req = GenerateRequest { prompt: prompt.clone(), max_tokens: Some(300), sampling, stop: vec![], ignore_eos: false,
                                        grammar: Some(spec.clone()), logprobs: None };
            let generation = engine.generate(&req, &mut |_| true).unwrap();
            // llguidance's own check: a fresh matcher takes every chosen token and accepts the end.
            let mut check = vocab.constraint(&spec).unwrap();
            for &t in &generation.tokens {
                check.accept(t).unwrap_or_else(|e| panic!("schema {i}: token {t} refused: {e}"));
            }
            assert!(check.is_accepting(), "schema {i}: {:?} is not complete", generation.text);
        }
    }
}
