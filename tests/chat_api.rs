//! OpenAI chat completions end to end on the tiny chat fixture (random weights, real tokenizer and
//! template): streaming equals the whole answer, cancellation and errors leave the model usable,
//! seeds reproduce, and several threads (eight agents holding conversations) share one model through the C ABI.

use std::ffi::{c_char, c_void, CStr, CString};
use std::path::PathBuf;

use atlas::api::{chat_completion, random_id, ChatRequest};
use atlas::ffi::{atlas_chat_completion, atlas_load, atlas_string_free, atlas_unload, AtlasModel, AtlasStatus};
use atlas::{Device, Engine, EngineOptions, Error};
use serde_json::{json, Value};

fn model_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/chat_tiny")
}

fn engine() -> Engine {
    let opts = EngineOptions { device: Device::Cpu, ctx_size: Some(512), ..EngineOptions::new(model_dir()) };
    Engine::load(&opts, &mut |_| {}).unwrap()
}

fn request(extra: Value) -> ChatRequest {
    let mut r = json!({"messages": [{"role": "user", "content": "Hi there"}], "temperature": 0, "max_tokens": 30});
    for (k, v) in extra.as_object().unwrap() {
        r[k] = v.clone();
    }
    ChatRequest::from_json(&r).unwrap()
}

fn run(engine: &mut Engine, req: &ChatRequest) -> (Value, Vec<Value>) {
    let mut chunks = Vec::new();
    let resp = chat_completion(engine, req, &mut |c| {
        chunks.push(serde_json::from_str(c).unwrap());
        true
    })
    .unwrap();
    (resp, chunks)
}

/// Concatenates the streamed deltas into a message like the non-streamed one.
fn assemble(chunks: &[Value]) -> (Value, Option<String>) {
    let (mut content, mut reasoning) = (String::new(), String::new());
    let mut finish = None;
    for c in chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        let Some(choice) = c["choices"].get(0) else { continue };
        if let Some(t) = choice["delta"]["content"].as_str() {
            content.push_str(t);
        }
        if let Some(t) = choice["delta"]["reasoning_content"].as_str() {
            reasoning.push_str(t);
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
    }
    (json!({"content": content, "reasoning": reasoning}), finish)
}

#[test]
fn streamed_answer_equals_whole_answer() {
    let mut e = engine();
    let (whole, none) = run(&mut e, &request(json!({})));
    assert!(none.is_empty(), "chunks without stream: true");
    let (resp, chunks) = run(&mut e, &request(json!({"stream": true, "stream_options": {"include_usage": true}})));
    assert_eq!(whole["choices"], resp["choices"]);
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let (streamed, finish) = assemble(&chunks);
    let msg = &resp["choices"][0]["message"];
    assert_eq!(streamed["content"], msg["content"].as_str().unwrap_or(""));
    assert_eq!(streamed["reasoning"], msg["reasoning_content"].as_str().unwrap_or(""));
    assert_eq!(finish.as_deref(), resp["choices"][0]["finish_reason"].as_str());
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"], resp["usage"]);
    assert_eq!(resp["usage"]["completion_tokens"], 30);
    assert_eq!(resp["choices"][0]["finish_reason"], "length");
    assert!(resp["timings"]["predicted_per_second"].as_f64().unwrap() > 0.0);
    // The second request reused the first one's prompt from the cache.
    assert!(resp["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() > 0);
}

#[test]
fn seeds_reproduce_and_differ() {
    let mut e = engine();
    let sampled = |e: &mut Engine, seed: u64| {
        let r = request(json!({"temperature": 1.0, "seed": seed}));
        run(e, &r).0["choices"][0]["message"].clone()
    };
    let a = sampled(&mut e, 11);
    assert_eq!(a, sampled(&mut e, 11));
    assert_ne!(a, sampled(&mut e, 12));
}

/// `n` choices: choice i is what a lone request with seed + i answers, the stream carries every
/// choice's chunks under its index (and its own final chunk), usage counts the prompt once and all
/// the completions. Greedy choices are all the same answer.
#[test]
fn several_choices_each_answer_as_their_own_request() {
    let mut e = engine();
    let lone = |e: &mut Engine, seed: u64| run(e, &request(json!({"temperature": 1.0, "seed": seed, "max_tokens": 12}))).0;
    let want: Vec<Value> = (0..3).map(|i| lone(&mut e, 40 + i)).collect();
    let req = request(json!({"temperature": 1.0, "seed": 40, "max_tokens": 12, "n": 3, "stream": true, "stream_options": {"include_usage": true}}));
    let (resp, chunks) = run(&mut e, &req);
    let choices = resp["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    for (i, (got, lone)) in choices.iter().zip(&want).enumerate() {
        assert_eq!(got["index"], i);
        assert_eq!(got["message"], lone["choices"][0]["message"], "choice {i}");
        assert_eq!(got["finish_reason"], lone["choices"][0]["finish_reason"], "choice {i}");
        let mine: Vec<Value> = chunks.iter().filter(|c| c["choices"].get(0).is_some_and(|ch| ch["index"] == i)).cloned().collect();
        let (streamed, finish) = assemble(&mine);
        assert_eq!(streamed["content"], got["message"]["content"].as_str().unwrap_or(""), "choice {i} streamed");
        assert_eq!(finish.as_deref(), got["finish_reason"].as_str());
        assert!(mine.last().unwrap()["timings"]["predicted_n"].as_u64().is_some(), "choice {i}: its final chunk has its timings");
    }
    assert_ne!(choices[0]["message"], choices[1]["message"]);
    let completion: u64 = want.iter().map(|w| w["usage"]["completion_tokens"].as_u64().unwrap()).sum();
    assert_eq!(resp["usage"]["completion_tokens"], completion);
    assert_eq!(resp["usage"]["prompt_tokens"], want[0]["usage"]["prompt_tokens"]);
    assert_eq!(resp["timings"]["predicted_n"], completion);
    assert_eq!(chunks.last().unwrap()["usage"], resp["usage"]);

    let greedy = run(&mut e, &request(json!({"n": 2, "max_tokens": 8}))).0;
    assert_eq!(greedy["choices"][0]["message"], greedy["choices"][1]["message"]);
}

#[test]
fn cancel_and_errors_leave_the_model_usable() {
    let mut e = engine();
    let (before, _) = run(&mut e, &request(json!({})));
    let mut seen = 0;
    let err = chat_completion(&mut e, &request(json!({"stream": true})), &mut |_| {
        seen += 1;
        seen < 3
    })
    .unwrap_err();
    assert!(matches!(err, Error::Cancelled));
    let err = chat_completion(&mut e, &request(json!({"max_tokens": 100_000})), &mut |_| true).unwrap_err();
    assert!(matches!(err, Error::ContextOverflow(_)), "{err}");
    let (after, _) = run(&mut e, &request(json!({})));
    assert_eq!(before["choices"], after["choices"]);
}

#[test]
fn stop_strings_end_the_answer() {
    let mut e = engine();
    let (full, _) = run(&mut e, &request(json!({"max_tokens": 40})));
    let text = full["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    // Stop at a piece taken from the middle of the greedy answer.
    let chars: Vec<char> = text.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let (cut, _) = run(&mut e, &request(json!({"max_tokens": 40, "stop": [stop.clone()]})));
    let got = cut["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(got, text[..text.find(&stop).unwrap()].trim_end());
    assert_eq!(cut["choices"][0]["finish_reason"], "stop");
}

#[test]
fn tools_render_and_answers_stay_well_formed() {
    let mut e = engine();
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    for choice in [json!("auto"), json!("required"), json!({"type": "function", "function": {"name": "get_weather"}})] {
        let (resp, chunks) = run(&mut e, &request(json!({"tools": tools, "tool_choice": choice, "stream": true})));
        let msg = &resp["choices"][0]["message"];
        assert!(msg["content"].is_string() || msg["tool_calls"].is_array(), "{resp}");
        let (streamed, _) = assemble(&chunks);
        assert_eq!(streamed["content"], msg["content"].as_str().unwrap_or(""));
    }
}

struct Sink(Vec<String>);

unsafe extern "C" fn collect(chunk: *const c_char, user: *mut c_void) -> i32 {
    let sink = &mut *(user as *mut Sink);
    sink.0.push(CStr::from_ptr(chunk).to_string_lossy().into_owned());
    0
}

fn ffi_chat(model: *mut AtlasModel, req: &str) -> (i32, Option<Value>) {
    let req = CString::new(req).unwrap();
    let (mut resp, mut err): (*mut c_char, *mut c_char) = (std::ptr::null_mut(), std::ptr::null_mut());
    let mut sink = Sink(Vec::new());
    // SAFETY: NUL-terminated request, a callback that gets `sink` (alive for the call) and
    // out-pointers to locals.
    let rc = unsafe {
        atlas_chat_completion(model, req.as_ptr(), Some(collect), &mut sink as *mut Sink as *mut c_void, &mut resp, &mut err)
    };
    // SAFETY: a non-null response is a NUL-terminated string the library returned.
    let out = (!resp.is_null()).then(|| serde_json::from_str(&unsafe { CStr::from_ptr(resp) }.to_string_lossy()).unwrap());
    // SAFETY: strings the library returned (or null), each freed once.
    unsafe {
        atlas_string_free(resp);
        atlas_string_free(err);
    }
    (rc, out)
}

#[derive(Clone, Copy)]
struct Handle(*mut AtlasModel);
// SAFETY: the C ABI documents that a model handle may be used from any thread.
unsafe impl Send for Handle {}
// SAFETY: as above.
unsafe impl Sync for Handle {}

#[test]
fn four_threads_share_one_model() {
    let opts = CString::new(json!({"model": model_dir(), "device": "cpu", "ctx_size": 512}).to_string()).unwrap();
    let mut model = std::ptr::null_mut();
    // SAFETY: NUL-terminated options and an out-pointer to a local.
    let rc = unsafe { atlas_load(opts.as_ptr(), &mut model, std::ptr::null_mut()) };
    assert_eq!(rc, AtlasStatus::Ok as i32);
    let handle = Handle(model);
    let req = |i: usize| {
        json!({"messages": [{"role": "user", "content": format!("question {i}")}], "temperature": 0.8,
               "seed": i, "max_tokens": 12, "stream": i.is_multiple_of(2)})
        .to_string()
    };
    let expected: Vec<Value> = (0..12).map(|i| ffi_chat(handle.0, &req(i)).1.unwrap()["choices"].clone()).collect();
    std::thread::scope(|s| {
        for t in 0..4 {
            let expected = &expected;
            s.spawn(move || {
                let h = handle;
                for round in 0..3 {
                    let i = (t * 3 + round) % 12;
                    let (rc, resp) = ffi_chat(h.0, &req(i));
                    assert_eq!(rc, 0);
                    assert_eq!(resp.unwrap()["choices"], expected[i], "thread {t} request {i}");
                }
            });
        }
    });
    // SAFETY: a handle atlas_load returned, unloaded once.
    unsafe { atlas_unload(handle.0) };
}

fn load_ffi(options: Value) -> Handle {
    let opts = CString::new(options.to_string()).unwrap();
    let mut model = std::ptr::null_mut();
    // SAFETY: NUL-terminated options and an out-pointer to a local.
    let rc = unsafe { atlas_load(opts.as_ptr(), &mut model, std::ptr::null_mut()) };
    assert_eq!(rc, AtlasStatus::Ok as i32);
    Handle(model)
}

/// One turn of an agent's conversation, as it grows: what the history holds so far.
struct Turn {
    answer: Value,
    prompt_tokens: u64,
    completion_tokens: u64,
    cached_tokens: u64,
}

/// One agent's conversation of `turns` turns on `handle`, each re-sending the history with the
/// previous answer.
fn agent_conversation(handle: Handle, agent: usize, turns: usize) -> Vec<Turn> {
    let system = "You are a coding agent: plan, call tools, check, answer.";
    let mut messages = vec![json!({"role": "system", "content": system})];
    let mut out = Vec::new();
    for turn in 0..turns {
        let task = format!("Agent {agent}, step {turn}: the test {} fails with this log. ", agent * 7 + turn).repeat(3);
        messages.push(json!({"role": "user", "content": task}));
        let req = json!({"messages": messages, "temperature": 0.7, "seed": agent * 10 + turn, "max_tokens": 16, "stream": turn % 2 == 1});
        let (rc, resp) = ffi_chat(handle.0, &req.to_string());
        assert_eq!(rc, 0, "agent {agent} turn {turn}");
        let resp = resp.unwrap();
        let usage = |k: &str| resp["usage"][k].as_u64().unwrap();
        messages.push(json!({"role": "assistant", "content": resp["choices"][0]["message"]["content"].clone()}));
        out.push(Turn {
            answer: resp["choices"].clone(),
            prompt_tokens: usage("prompt_tokens"),
            completion_tokens: usage("completion_tokens"),
            cached_tokens: resp["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap(),
        });
    }
    out
}

/// Eight agents, four turns each, on one model of eight sequence slots from eight threads at
/// once (their decode steps batched): every answer is the one the same conversation gets alone
/// on a model of one slot without a prefix cache, and every turn starts from the previous turn's
/// history (its full 256-position blocks at least), whichever agent or slot ran in between.
#[test]
fn eight_agents_share_one_model_through_the_c_abi() {
    let options = |extra: Value| {
        let mut o = json!({"model": model_dir(), "device": "cpu", "ctx_size": 1024});
        o.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        o
    };
    let alone = load_ffi(options(json!({"prefix_cache_bytes": 0})));
    let expected: Vec<Vec<Value>> = (0..8).map(|agent| agent_conversation(alone, agent, 4).into_iter().map(|t| t.answer).collect()).collect();
    let shared = load_ffi(options(json!({"parallel": 8})));
    std::thread::scope(|s| {
        for agent in 0..8 {
            let expected = &expected;
            s.spawn(move || {
                let turns = agent_conversation(shared, agent, 4);
                for (i, pair) in turns.windows(2).enumerate() {
                    let history = pair[0].prompt_tokens + pair[0].completion_tokens - 1;
                    assert!(pair[1].cached_tokens >= history / 256 * 256, "agent {agent} turn {}: {} cached of {history}", i + 1, pair[1].cached_tokens);
                }
                assert!(turns[2].prompt_tokens >= 512, "agent {agent}: histories too short to fill blocks");
                let answers: Vec<Value> = turns.into_iter().map(|t| t.answer).collect();
                assert_eq!(&answers, &expected[agent], "agent {agent}");
            });
        }
    });
    // SAFETY: handles atlas_load returned, each unloaded once.
    unsafe {
        atlas_unload(alone.0);
        atlas_unload(shared.0);
    }
}

/// Ids are 128 random bits: 10,000 from the generator itself on four threads (the response and
/// tool-call ids of as many requests) never repeat, and neither do those of real requests made
/// within the same second through the C ABI, whose streamed chunks carry their response's id.
#[test]
fn response_ids_never_repeat() {
    let ids: Vec<String> = std::thread::scope(|s| {
        let threads: Vec<_> = (0..4)
            .map(|t| s.spawn(move || (0..2500).map(|_| random_id(if t % 2 == 0 { "chatcmpl-" } else { "call_" })).collect::<Vec<_>>()))
            .collect();
        threads.into_iter().flat_map(|t| t.join().unwrap()).collect()
    });
    let mut seen = std::collections::HashSet::new();
    for id in &ids {
        let hex = id.strip_prefix("chatcmpl-").or_else(|| id.strip_prefix("call_")).unwrap();
        assert!(hex.len() == 32 && hex.bytes().all(|b| b.is_ascii_hexdigit()), "{id}");
        assert!(seen.insert(hex.to_string()), "{id} repeats");
    }
    assert_eq!(seen.len(), 10_000);

    let opts = CString::new(json!({"model": model_dir(), "device": "cpu", "ctx_size": 256}).to_string()).unwrap();
    let mut model = std::ptr::null_mut();
    // SAFETY: NUL-terminated options and an out-pointer to a local.
    let rc = unsafe { atlas_load(opts.as_ptr(), &mut model, std::ptr::null_mut()) };
    assert_eq!(rc, AtlasStatus::Ok as i32);
    let req = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0, "stream": true}).to_string();
    let mut request_ids = std::collections::HashSet::new();
    for _ in 0..10 {
        let req = CString::new(req.as_str()).unwrap();
        let (mut resp, mut err): (*mut c_char, *mut c_char) = (std::ptr::null_mut(), std::ptr::null_mut());
        let mut sink = Sink(Vec::new());
        // SAFETY: as in ffi_chat.
        let rc = unsafe { atlas_chat_completion(model, req.as_ptr(), Some(collect), &mut sink as *mut Sink as *mut c_void, &mut resp, &mut err) };
        assert_eq!(rc, 0);
        // SAFETY: on success the response is a NUL-terminated string the library returned.
        let text = unsafe { CStr::from_ptr(resp) }.to_string_lossy().into_owned();
        // SAFETY: strings the library returned (or null), each freed once.
        unsafe {
            atlas_string_free(resp);
            atlas_string_free(err);
        }
        let resp: Value = serde_json::from_str(&text).unwrap();
        let id = resp["id"].as_str().unwrap().to_string();
        assert!(id.starts_with("chatcmpl-") && id.len() == 9 + 32, "{id}");
        assert!(!sink.0.is_empty());
        for chunk in &sink.0 {
            assert_eq!(serde_json::from_str::<Value>(chunk).unwrap()["id"], json!(id));
        }
        assert!(request_ids.insert(id.clone()), "{id} repeats");
        assert!(!seen.contains(&id["chatcmpl-".len()..]), "{id} repeats");
    }
    // SAFETY: a handle atlas_load returned, unloaded once.
    unsafe { atlas_unload(model) };
}

/// A ctx_size past the model's positions (Lemonade sizes it from free memory) is clamped to them,
/// and the load report says so, through the C ABI too.
#[test]
fn a_context_past_the_model_is_clamped_with_a_note() {
    let opts = EngineOptions { device: Device::Cpu, ctx_size: Some(4096), ..EngineOptions::new(model_dir()) };
    let engine = Engine::load(&opts, &mut |_| {}).unwrap();
    assert_eq!(engine.report().ctx_size, 1024);
    assert_eq!(engine.report().notes, ["ctx_size 4096 clamped to the model's max_position_embeddings 1024"]);
    let fits = Engine::load(&EngineOptions { ctx_size: Some(512), ..opts }, &mut |_| {}).unwrap();
    assert!(fits.report().notes.is_empty() && fits.report().ctx_size == 512);

    let opts = CString::new(json!({"model": model_dir(), "device": "cpu", "ctx_size": 100000}).to_string()).unwrap();
    let mut model = std::ptr::null_mut();
    // SAFETY: NUL-terminated options and an out-pointer to a local.
    assert_eq!(unsafe { atlas_load(opts.as_ptr(), &mut model, std::ptr::null_mut()) }, AtlasStatus::Ok as i32);
    let mut info: *mut c_char = std::ptr::null_mut();
    // SAFETY: a loaded model and out-pointers to locals; the string is freed below.
    assert_eq!(unsafe { atlas::ffi::atlas_model_info(model, &mut info, std::ptr::null_mut()) }, 0);
    // SAFETY: atlas_model_info returned a NUL-terminated string, freed once read.
    let text = unsafe { CStr::from_ptr(info) }.to_str().unwrap().to_string();
    // SAFETY: as above.
    unsafe { atlas_string_free(info) };
    let info: Value = serde_json::from_str(&text).unwrap();
    assert_eq!((info["ctx_size"].as_u64(), info["notes"][0].as_str().map(|n| n.contains("clamped"))), (Some(1024), Some(true)));
    // SAFETY: the model came from atlas_load and is not used afterwards.
    unsafe { atlas_unload(model) };
}
