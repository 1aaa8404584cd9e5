//! OpenAI chat completions over the engine: a request JSON in, `chat.completion.chunk`s out while
//! generating, and the final `chat.completion` (with usage and llama.cpp-style timings); and text
//! completions (completion.rs). [`prepare`] and [`run`] take either, for the C ABI and the server.

pub mod completion;
pub mod request;
mod tool_grammar;

use std::cell::RefCell;

use serde_json::{json, Map, Value};

pub use completion::{prepare_completion, run_completion, CompletionRequest, PreparedCompletion};
pub use request::{ChatRequest, SamplingOverrides, ToolChoice};

use crate::chat::output::{Delta, OutputParser};
use crate::engine::{Engine, FinishReason, Frontend, GenerateRequest};
use crate::grammar::GrammarSpec;
use crate::sampling::{SamplingParams, TokenLogprob};
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

/// Receives each streamed chunk as JSON text; returns false to cancel the request.
pub type ChunkSink<'a> = &'a mut dyn FnMut(&str) -> bool;

/// Requests larger than this are refused before they are parsed (hosts may choose another limit).
pub const DEFAULT_MAX_REQUEST_BYTES: usize = 8 << 20;

/// A request rendered and tokenized, ready for the engine: the work that needs no engine lock.
pub struct PreparedChat {
    request: ChatRequest,
    model: String,
    prompt: Vec<u32>,
    parser: OutputParser,
}

impl PreparedChat {
    pub fn prompt_tokens(&self) -> usize {
        self.prompt.len()
    }
}

/// The two OpenAI endpoints Atlas serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`
    Chat,
    /// `/v1/completions`
    Text,
}

impl Endpoint {
    pub fn name(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat completion",
            Endpoint::Text => "text completion",
        }
    }
}

/// A request of either endpoint, parsed and tokenized.
pub enum Prepared {
    Chat(PreparedChat),
    Text(PreparedCompletion),
}

impl Prepared {
    /// Makes the request stream its chunks (so that a host's callback sees every token and can
    /// cancel); returns whether its client asked for a stream.
    pub fn stream_always(&mut self) -> bool {
        match self {
            Prepared::Chat(p) => std::mem::replace(&mut p.request.stream, true),
            Prepared::Text(p) => p.stream_always(),
        }
    }
}

/// Parses and prepares a request for `endpoint` (no engine needed).
pub fn prepare(front: &Frontend, endpoint: Endpoint, request_json: &str) -> Result<Prepared> {
    Ok(match endpoint {
        Endpoint::Chat => Prepared::Chat(prepare_chat(front, ChatRequest::from_json_str(request_json)?)?),
        Endpoint::Text => Prepared::Text(prepare_completion(front, CompletionRequest::from_json_str(request_json)?)?),
    })
}

/// Runs a prepared request of either endpoint.
pub fn run(engine: &mut Engine, prepared: Prepared, on_chunk: ChunkSink) -> Result<Value> {
    match prepared {
        Prepared::Chat(p) => run_chat(engine, p, on_chunk),
        Prepared::Text(p) => run_completion(engine, p, on_chunk),
    }
}

/// Renders the conversation with the model's template and tokenizes it. A prompt that cannot fit
/// the context (with room for `max_tokens`, or one token) is refused here.
pub fn prepare_chat(front: &Frontend, mut request: ChatRequest) -> Result<PreparedChat> {
    let use_tools = request.tools.is_some() && request.tool_choice != ToolChoice::None;
    let tools = request.tools.as_ref().filter(|_| use_tools);
    let mut prompt = front.template()?.render(&request.messages, tools, true, &request.template_kwargs)?;
    let in_reasoning = prompt.trim_end().ends_with("<think>");
    let mut parser = OutputParser::new(in_reasoning, tools);
    if let Some(forced) = forced_call_prefix(&request.tool_choice, &prompt) {
        if in_reasoning {
            prompt.push_str("\n</think>\n\n");
            parser = OutputParser::new(false, tools);
        }
        prompt.push_str("<tool_call>");
        prompt.push_str(&forced);
        parser.start_in_tool_call(&forced);
    }
    // A forced call's arguments always follow its schema; other calls when a function is strict
    // (unless a response_format already constrains the answer).
    let forced = matches!(request.tool_choice, ToolChoice::Required | ToolChoice::Function(_));
    if let Some(t) = tools.filter(|_| forced || request.grammar.is_none()) {
        let xml = prompt.contains("<function=");
        if let Some(g) = tool_grammar::tool_call_grammar(&request.tool_choice, t, xml, request.parallel_tool_calls) {
            request.grammar = Some(GrammarSpec::Lark(g));
        }
    }
    let tokens = front.encode_prompt(&prompt, request.max_tokens.unwrap_or(1))?;
    let model = request.model.clone().unwrap_or_else(|| front.model_name());
    Ok(PreparedChat { request, model, prompt: tokens, parser })
}

/// Renders, tokenizes and runs one chat completion (see [`run_chat`]).
pub fn chat_completion(engine: &mut Engine, request: &ChatRequest, on_chunk: ChunkSink) -> Result<Value> {
    let prepared = prepare_chat(&engine.frontend().clone(), request.clone())?;
    run_chat(engine, prepared, on_chunk)
}

/// Runs one prepared chat completion: its `n` choices one after the other, the later ones from
/// the prompt that the first left in the cache. With `stream: true` in the request each chunk goes
/// to `on_chunk` (the returned response is the same answer, whole). A cancelled request returns
/// Error::Cancelled.
pub fn run_chat(engine: &mut Engine, prepared: PreparedChat, on_chunk: ChunkSink) -> Result<Value> {
    let PreparedChat { request, model, prompt, parser } = prepared;
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let mut stream = Stream {
        id: random_id("chatcmpl-"),
        created,
        model,
        enabled: request.stream,
        sink: on_chunk,
    };
    let tokenizer = request.logprobs.map(|_| engine.frontend().tokenizer().cloned()).transpose()?;
    let mut choices = Vec::with_capacity(request.n);
    let mut generations = Vec::with_capacity(request.n);
    for index in 0..request.n {
        let gen = GenerateRequest {
            prompt: prompt.clone(),
            max_tokens: request.max_tokens,
            sampling: choice_sampling(sampling(engine.default_sampling(), &request.sampling), index),
            stop: request.stop.clone(),
            ignore_eos: false,
            grammar: request.grammar.clone(),
            logprobs: request.logprobs,
        };
        let (choice, generation) = chat_choice(engine, &request, &gen, parser.clone(), tokenizer.as_ref(), &mut stream.at(index))?;
        choices.push(choice);
        generations.push(generation);
    }
    let usage = usage(&generations);
    if request.include_usage {
        stream.send_usage(&usage)?;
    }
    Ok(json!({
        "id": stream.id,
        "object": "chat.completion",
        "created": stream.created,
        "model": stream.model,
        "choices": choices,
        "usage": usage,
        "timings": timings(&generations),
    }))
}

/// One choice of a chat completion, streamed as choice `stream.index`: its entry of `choices`,
/// and the generation it came from.
fn chat_choice(
    engine: &mut Engine,
    request: &ChatRequest,
    gen: &GenerateRequest,
    mut parser: OutputParser,
    tokenizer: Option<&Tokenizer>,
    stream: &mut ChoiceStream<'_, '_>,
) -> Result<(Value, crate::Generation)> {
    let mut answer = Answer::default();
    stream.send(json!({"role": "assistant", "content": ""}), None)?;
    // Text and log-probabilities both stream as they come: the two callbacks share the stream.
    let (stream_cell, failed) = (RefCell::new(stream), RefCell::new(None));
    let result = engine.generate_with_logprobs(
        gen,
        &mut |piece| {
            let deltas = parser.push(piece);
            let sent = answer.absorb(deltas, &mut stream_cell.borrow_mut(), request.parallel_tool_calls);
            sent.map_err(|e| *failed.borrow_mut() = Some(e)).is_ok()
        },
        &mut |lp| {
            let Some(tok) = tokenizer else { return true };
            let sent = logprob_entry(tok, lp).and_then(|e| stream_cell.borrow_mut().send_logprobs(&json!({"content": [e]})));
            sent.map_err(|e| *failed.borrow_mut() = Some(e)).is_ok()
        },
    );
    let stream = stream_cell.into_inner();
    let generation = match (result, failed.into_inner()) {
        (_, Some(e)) | (Err(e), None) => return Err(e),
        (Ok(g), None) => g,
    };
    answer.absorb(parser.finish(), stream, request.parallel_tool_calls)?;

    let finish_reason = if !answer.tool_calls.is_empty() {
        "tool_calls"
    } else {
        match generation.finish_reason {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    };
    let logprobs = match tokenizer {
        Some(tok) => {
            let content = generation.logprobs.iter().map(|lp| logprob_entry(tok, lp)).collect::<Result<Vec<_>>>()?;
            Some(json!({ "content": content }))
        }
        None => None,
    };
    stream.send_final(finish_reason, &timings(std::slice::from_ref(&generation)))?;

    let mut message = Map::new();
    message.insert("role".into(), json!("assistant"));
    let content = (!answer.content.is_empty() || answer.tool_calls.is_empty()).then(|| answer.content.clone());
    message.insert("content".into(), json!(content));
    if !answer.reasoning.is_empty() {
        message.insert("reasoning_content".into(), json!(answer.reasoning));
    }
    if !answer.tool_calls.is_empty() {
        message.insert("tool_calls".into(), Value::Array(answer.tool_calls.clone()));
    }
    let choice = json!({"index": stream.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason});
    Ok((choice, generation))
}

/// The sampling of choice `index` of a request: its own seed (`seed + index`) when one is given,
/// so that the choices differ and each is reproducible.
pub(crate) fn choice_sampling(mut params: SamplingParams, index: usize) -> SamplingParams {
    params.seed = params.seed.map(|s| s.wrapping_add(index as u64));
    params
}

/// OpenAI's `usage` of a request's choices: the prompt counted once (as is its reuse from the
/// prefix cache, by the first choice), the completions of all.
pub(crate) fn usage(generations: &[crate::Generation]) -> Value {
    let prompt_tokens = generations.first().map_or(0, |g| g.prompt_tokens);
    let cached_tokens = generations.first().map_or(0, |g| g.cached_tokens);
    let completion_tokens: usize = generations.iter().map(|g| g.tokens.len()).sum();
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    })
}

/// `prefix` and 128 random bits in hex: the ids of responses (`chatcmpl-...`) and tool calls
/// (`call_...`), unique across requests, threads and processes. The bits come from the operating
/// system (getrandom); should that fail, from std's randomly keyed SipHash over a process-wide
/// counter, the time and the process id.
pub fn random_id(prefix: &str) -> String {
    let mut bytes = [0u8; 16];
    if getrandom::fill(&mut bytes).is_err() {
        use std::hash::{BuildHasher, Hasher};
        use std::sync::atomic::{AtomicU64, Ordering};
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let state = std::collections::hash_map::RandomState::new();
        for (i, half) in bytes.chunks_mut(8).enumerate() {
            let mut h = state.build_hasher();
            h.write_u64(n);
            h.write_u128(nanos);
            h.write_u32(std::process::id());
            h.write_usize(i);
            half.copy_from_slice(&h.finish().to_le_bytes());
        }
    }
    let mut id = String::with_capacity(prefix.len() + 32);
    id.push_str(prefix);
    for b in bytes {
        id.push_str(&format!("{b:02x}"));
    }
    id
}

/// One entry of OpenAI's `logprobs.content`: the token's text, log-probability, UTF-8 bytes and
/// the top alternatives. A token that is part of a character decodes to U+FFFD (its bytes too).
fn logprob_entry(tok: &Tokenizer, t: &TokenLogprob) -> Result<Value> {
    let entry = |id: u32, logprob: f32| -> Result<Value> {
        let text = tok.decode(&[id], false)?;
        // -inf (a token the grammar excluded) has no JSON number: the smallest f32 stands for it.
        let lp = if logprob.is_finite() { logprob } else { f32::MIN };
        Ok(json!({"token": text, "logprob": lp, "bytes": text.as_bytes()}))
    };
    let mut e = entry(t.token, t.logprob)?;
    let top = t.top.iter().map(|&(id, lp)| entry(id, lp)).collect::<Result<Vec<_>>>()?;
    e["top_logprobs"] = Value::Array(top);
    Ok(e)
}

/// llama.cpp-style `timings` of a request's choices (the work of all of them: prompt tokens read
/// and reused, tokens generated, and the time each took): what was reused (`cache_n`), prompt and
/// generation speed, and speculative decoding's drafted and confirmed tokens when it ran.
pub(crate) fn timings(generations: &[crate::Generation]) -> Value {
    let sum = |f: &dyn Fn(&crate::Generation) -> usize| generations.iter().map(f).sum::<usize>();
    let sum_ms = |f: &dyn Fn(&crate::Generation) -> f64| generations.iter().map(f).sum::<f64>();
    let cache_n = sum(&|g| g.cached_tokens);
    let prompt_n = sum(&|g| g.prompt_tokens - g.cached_tokens);
    let predicted_n = sum(&|g| g.tokens.len());
    let (prompt_ms, decode_ms) = (sum_ms(&|g| g.prompt_ms), sum_ms(&|g| g.decode_ms));
    let mut t = json!({
        "cache_n": cache_n,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n.max(1) as f64,
        "prompt_per_second": per_second(prompt_n, prompt_ms),
        "predicted_n": predicted_n,
        "predicted_ms": decode_ms,
        "predicted_per_token_ms": decode_ms / predicted_n.max(1) as f64,
        "predicted_per_second": per_second(predicted_n, decode_ms),
    });
    let (drafted, accepted) = (sum(&|g| g.draft_tokens), sum(&|g| g.draft_accepted));
    if drafted > 0 {
        t["draft_n"] = json!(drafted);
        t["draft_n_accepted"] = json!(accepted);
    }
    t
}

fn per_second(n: usize, ms: f64) -> f64 {
    if ms > 0.0 {
        n as f64 * 1e3 / ms
    } else {
        0.0
    }
}

fn sampling(base: SamplingParams, o: &SamplingOverrides) -> SamplingParams {
    SamplingParams {
        temperature: o.temperature.unwrap_or(base.temperature),
        top_k: o.top_k.unwrap_or(base.top_k),
        top_p: o.top_p.unwrap_or(base.top_p),
        min_p: o.min_p.unwrap_or(base.min_p),
        repetition_penalty: o.repetition_penalty.unwrap_or(base.repetition_penalty),
        presence_penalty: o.presence_penalty.unwrap_or(base.presence_penalty),
        frequency_penalty: o.frequency_penalty.unwrap_or(base.frequency_penalty),
        logit_bias: o.logit_bias.clone(),
        seed: o.seed.or(base.seed),
    }
}

/// The text the prompt gets after `<tool_call>` when a call is required. The tool syntax is the
/// one the template taught the model: XML when its instructions show `<function=`, else JSON.
fn forced_call_prefix(choice: &ToolChoice, prompt: &str) -> Option<String> {
    let xml = prompt.contains("<function=");
    match (choice, xml) {
        (ToolChoice::Required, false) => Some("\n".into()),
        (ToolChoice::Required, true) => Some("\n<function=".into()),
        (ToolChoice::Function(name), false) => {
            Some(format!("\n{{\"name\": {}, \"arguments\": ", Value::String(name.clone())))
        }
        (ToolChoice::Function(name), true) => Some(format!("\n<function={name}>\n")),
        _ => None,
    }
}

/// The answer as it accumulates; the final message is built from the same deltas that were
/// streamed, so the two always agree.
#[derive(Default)]
struct Answer {
    content: String,
    reasoning: String,
    tool_calls: Vec<Value>,
}

impl Answer {
    fn absorb(&mut self, deltas: Vec<Delta>, stream: &mut ChoiceStream, parallel: bool) -> Result<()> {
        for d in deltas {
            match d {
                Delta::Content(t) => {
                    self.content.push_str(&t);
                    stream.send(json!({"content": t}), None)?;
                }
                Delta::Reasoning(t) => {
                    self.reasoning.push_str(&t);
                    stream.send(json!({"reasoning_content": t}), None)?;
                }
                Delta::ToolCall(_) if !parallel && !self.tool_calls.is_empty() => {}
                Delta::ToolCall(call) => {
                    let index = self.tool_calls.len();
                    let id = random_id("call_");
                    let head = json!({"index": index, "id": id, "type": "function",
                                      "function": {"name": call.name, "arguments": ""}});
                    stream.send(json!({"tool_calls": [head]}), None)?;
                    let args = json!({"index": index, "function": {"arguments": call.arguments}});
                    stream.send(json!({"tool_calls": [args]}), None)?;
                    self.tool_calls.push(json!({"id": id, "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments}}));
                }
            }
        }
        Ok(())
    }
}

struct Stream<'a> {
    id: String,
    created: u64,
    model: String,
    enabled: bool,
    sink: ChunkSink<'a>,
}

impl<'a> Stream<'a> {
    /// The stream as choice `index` sends its chunks.
    fn at<'s>(&'s mut self, index: usize) -> ChoiceStream<'s, 'a> {
        ChoiceStream { stream: self, index }
    }

    fn chunk(&self, choices: Value) -> Map<String, Value> {
        let mut m = Map::new();
        m.insert("id".into(), json!(self.id));
        m.insert("object".into(), json!("chat.completion.chunk"));
        m.insert("created".into(), json!(self.created));
        m.insert("model".into(), json!(self.model));
        m.insert("choices".into(), choices);
        m
    }

    fn emit(&mut self, chunk: Map<String, Value>) -> Result<()> {
        if self.enabled && !(self.sink)(&Value::Object(chunk).to_string()) {
            return Err(Error::Cancelled);
        }
        Ok(())
    }

    /// The request's usage, after every choice: a chunk without choices.
    fn send_usage(&mut self, usage: &Value) -> Result<()> {
        let mut c = self.chunk(json!([]));
        c.insert("usage".into(), usage.clone());
        self.emit(c)
    }
}

/// The chunks of one choice of a stream.
struct ChoiceStream<'s, 'a> {
    stream: &'s mut Stream<'a>,
    index: usize,
}

impl ChoiceStream<'_, '_> {
    fn emit(&mut self, choice: Value, extra: Option<(&str, &Value)>) -> Result<()> {
        let mut c = self.stream.chunk(json!([choice]));
        if let Some((key, value)) = extra {
            c.insert(key.into(), value.clone());
        }
        self.stream.emit(c)
    }

    fn send(&mut self, delta: Value, finish_reason: Option<&str>) -> Result<()> {
        self.emit(json!({"index": self.index, "delta": delta, "finish_reason": finish_reason}), None)
    }

    /// A token's log-probabilities, in a chunk of their own as the token is chosen.
    fn send_logprobs(&mut self, logprobs: &Value) -> Result<()> {
        self.emit(json!({"index": self.index, "delta": {}, "logprobs": logprobs, "finish_reason": null}), None)
    }

    fn send_final(&mut self, finish_reason: &str, timings: &Value) -> Result<()> {
        self.emit(json!({"index": self.index, "delta": {}, "finish_reason": finish_reason}), Some(("timings", timings)))
    }
}
