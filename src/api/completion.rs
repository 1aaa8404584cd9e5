//! OpenAI text completions (`POST /v1/completions`): a prompt string or token array in, the
//! continuation out, as `text_completion` objects (streamed chunks, then the whole answer).
//!
//! The fields both endpoints share (sampling, stop, stream, model, logit_bias, response_format,
//! grammar) are parsed by the chat request's parser, so they mean the same in both. `suffix` asks
//! for fill-in-the-middle with the tokenizer's `<|fim_prefix|>`, `<|fim_suffix|>` and
//! `<|fim_middle|>` tokens (Qwen coder models), prefix-suffix-middle order.

use std::cell::RefCell;

use serde_json::{json, Map, Value};

use super::{random_id, request::ChatRequest, sampling, ChunkSink};
use crate::engine::{check_fits, Engine, FinishReason, Frontend, GenerateRequest};
use crate::sampling::TokenLogprob;
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

/// OpenAI's default `max_tokens` for text completions.
const DEFAULT_MAX_TOKENS: usize = 16;
/// The legacy endpoint's limit on `logprobs`.
const MAX_LOGPROBS: usize = 5;
const FIM: [&str; 3] = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"];

#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

#[derive(Debug, Clone)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    pub echo: bool,
    pub suffix: Option<String>,
    /// `logprobs: n`: each token's log-probability and the n most likely alternatives.
    pub logprobs: Option<usize>,
    /// The shared fields (its messages are a placeholder).
    pub options: ChatRequest,
}

impl CompletionRequest {
    pub fn from_json_str(text: &str) -> Result<Self> {
        let json: Value = serde_json::from_str(text).map_err(|e| bad(&format!("request is not valid JSON: {e}")))?;
        Self::from_json(&json)
    }

    pub fn from_json(json: &Value) -> Result<Self> {
        let obj = json.as_object().ok_or_else(|| bad("the request must be a JSON object"))?;
        let mut shared = Map::new();
        let (mut prompt, mut echo, mut suffix, mut logprobs) = (None, false, None, None);
        for (key, v) in obj {
            match key.as_str() {
                _ if v.is_null() => {}
                "prompt" => prompt = Some(parse_prompt(v)?),
                "echo" => echo = v.as_bool().ok_or_else(|| bad("echo must be true or false"))?,
                "suffix" => suffix = Some(v.as_str().ok_or_else(|| bad("suffix must be a string"))?.to_string()),
                "logprobs" => match v.as_u64() {
                    Some(n) if n as usize <= MAX_LOGPROBS => logprobs = Some(n as usize),
                    _ => return Err(bad(&format!("logprobs must be an integer from 0 to {MAX_LOGPROBS}"))),
                },
                "best_of" if v.as_u64() == Some(1) => {}
                "best_of" => return Err(Error::Unsupported("best_of other than 1".into())),
                "messages" | "tools" | "tool_choice" | "parallel_tool_calls" | "chat_template_kwargs" | "reasoning_effort"
                | "top_logprobs" => return Err(bad(&format!("{key} belongs to chat completions (/v1/chat/completions)"))),
                _ => {
                    shared.insert(key.clone(), v.clone());
                }
            }
        }
        let prompt = prompt.ok_or_else(|| bad("prompt is required"))?;
        if echo && logprobs.is_some() {
            return Err(Error::Unsupported("echo with logprobs (the prompt's log-probabilities)".into()));
        }
        shared.insert("messages".into(), json!([{"role": "user", "content": "-"}]));
        let options = ChatRequest::from_json(&Value::Object(shared))?;
        Ok(CompletionRequest { prompt, echo, suffix, logprobs, options })
    }
}

fn bad(msg: &str) -> Error {
    Error::InvalidRequest(msg.to_string())
}

/// A string, a list of one string, or a list of token ids.
fn parse_prompt(v: &Value) -> Result<Prompt> {
    let many = || Error::Unsupported("several prompts in one request (one choice per request)".into());
    match v {
        Value::String(s) => Ok(Prompt::Text(s.clone())),
        Value::Array(items) => match items.as_slice() {
            [Value::String(s)] => Ok(Prompt::Text(s.clone())),
            [Value::String(_), ..] | [Value::Array(_), ..] => Err(many()),
            ids => ids
                .iter()
                .map(|id| id.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| bad("prompt must be a string or a list of token ids")))
                .collect::<Result<Vec<u32>>>()
                .map(Prompt::Tokens),
        },
        _ => Err(bad("prompt must be a string or a list of token ids")),
    }
}

/// A completion request tokenized, ready for the engine.
pub struct PreparedCompletion {
    request: CompletionRequest,
    model: String,
    prompt: Vec<u32>,
    /// The prompt as text, for `echo`.
    prompt_text: String,
}

impl PreparedCompletion {
    pub fn prompt_tokens(&self) -> usize {
        self.prompt.len()
    }

    pub(super) fn stream_always(&mut self) -> bool {
        std::mem::replace(&mut self.request.options.stream, true)
    }
}

/// Tokenizes the prompt (with the fill-in-the-middle tokens around a `suffix`); one that cannot fit
/// the context with room for `max_tokens` is refused here.
pub fn prepare_completion(front: &Frontend, request: CompletionRequest) -> Result<PreparedCompletion> {
    let tok = front.tokenizer()?;
    let new_tokens = request.options.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS);
    let (prompt, prompt_text) = match (&request.prompt, &request.suffix) {
        (Prompt::Text(text), None) => (front.encode_prompt(text, new_tokens)?, text.clone()),
        (Prompt::Text(text), Some(suffix)) => {
            if FIM.iter().any(|t| tok.token_to_id(t).is_none()) {
                return Err(Error::Unsupported("suffix: this model's tokenizer has no fill-in-the-middle tokens".into()));
            }
            let fim = format!("{}{text}{}{suffix}{}", FIM[0], FIM[1], FIM[2]);
            (front.encode_prompt(&fim, new_tokens)?, text.clone())
        }
        (Prompt::Tokens(ids), suffix) => {
            if suffix.is_some() {
                return Err(bad("suffix needs a text prompt"));
            }
            if ids.is_empty() {
                return Err(bad("the prompt is empty"));
            }
            if let Some(id) = ids.iter().find(|&&id| id as usize >= tok.vocab_size()) {
                return Err(bad(&format!("prompt token {id} is outside the vocabulary of {}", tok.vocab_size())));
            }
            check_fits(ids.len(), new_tokens, front.ctx_size())?;
            (ids.clone(), tok.decode(ids, false)?)
        }
    };
    let model = request.options.model.clone().unwrap_or_else(|| front.model_name());
    Ok(PreparedCompletion { request, model, prompt, prompt_text })
}

/// Runs one prepared text completion: its `n` choices one after the other (as chat completions
/// run theirs); with `stream: true` each `text_completion` chunk goes to `on_chunk`; the whole
/// answer is returned.
pub fn run_completion(engine: &mut Engine, prepared: PreparedCompletion, on_chunk: ChunkSink) -> Result<Value> {
    let PreparedCompletion { request, model, prompt, prompt_text } = prepared;
    let options = &request.options;
    let id = random_id("cmpl-");
    let created = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let object = |choices: Value| json!({"id": id, "object": "text_completion", "created": created, "model": model, "choices": choices});
    let mut send = |chunk: Value| -> Result<()> {
        if options.stream && !on_chunk(&chunk.to_string()) {
            return Err(Error::Cancelled);
        }
        Ok(())
    };
    let tokenizer = request.logprobs.map(|_| engine.tokenizer().cloned()).transpose()?;
    let mut choices = Vec::with_capacity(options.n);
    let mut generations = Vec::with_capacity(options.n);
    for index in 0..options.n {
        let piece = |text: &str| object(json!([{"text": text, "index": index, "logprobs": null, "finish_reason": null}]));
        let mut text = String::new();
        if request.echo {
            text.push_str(&prompt_text);
            send(piece(&prompt_text))?;
        }
        let gen = GenerateRequest {
            prompt: prompt.clone(),
            max_tokens: Some(options.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS)),
            sampling: super::choice_sampling(sampling(engine.default_sampling(), &options.sampling), index),
            stop: options.stop.clone(),
            ignore_eos: false,
            grammar: options.grammar.clone(),
            logprobs: request.logprobs,
        };
        // Text and each token's log-probabilities stream as they come (a chunk of its own per
        // token, its text_offset counted from the start of the answer); both callbacks share the
        // stream.
        let start = if request.echo { prompt_text.len() } else { 0 };
        let (sender, failed, offset) = (RefCell::new(&mut send), RefCell::new(None), RefCell::new(start));
        let generation = engine.generate_with_logprobs(
            &gen,
            &mut |p| (sender.borrow_mut())(piece(p)).map_err(|e| *failed.borrow_mut() = Some(e)).is_ok(),
            &mut |lp| {
                let Some(tok) = tokenizer.as_ref().filter(|_| options.stream) else { return true };
                let mut at = offset.borrow_mut();
                let chunk = legacy_logprobs(tok, std::slice::from_ref(lp), *at).and_then(|(entry, end)| {
                    *at = end;
                    (sender.borrow_mut())(object(json!([{"text": "", "index": index, "logprobs": entry, "finish_reason": null}])))
                });
                chunk.map_err(|e| *failed.borrow_mut() = Some(e)).is_ok()
            },
        );
        let generation = match (generation, failed.into_inner()) {
            (_, Some(e)) | (Err(e), None) => return Err(e),
            (Ok(g), None) => g,
        };
        text.push_str(&generation.text);
        let finish_reason = match generation.finish_reason {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        };
        let logprobs = match &tokenizer {
            Some(tok) => legacy_logprobs(tok, &generation.logprobs, start)?.0,
            None => Value::Null,
        };
        // Streamed, the log-probabilities went out token by token.
        send(object(json!([{"text": "", "index": index, "logprobs": null, "finish_reason": finish_reason}])))?;
        choices.push(json!({"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish_reason}));
        generations.push(generation);
    }
    let usage = super::usage(&generations);
    if options.include_usage {
        let mut last = object(json!([]));
        last["usage"] = usage.clone();
        send(last)?;
    }
    let mut answer = object(Value::Array(choices));
    answer["usage"] = usage;
    answer["timings"] = super::timings(&generations);
    Ok(answer)
}

/// The legacy endpoint's logprobs: parallel lists of token texts, their log-probabilities, their
/// top alternatives (text → log-probability) and their offsets in the answer's text, the first at
/// `start`; and the offset past the last token's text.
fn legacy_logprobs(tok: &Tokenizer, logprobs: &[TokenLogprob], start: usize) -> Result<(Value, usize)> {
    let (mut tokens, mut values, mut tops, mut offsets) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut offset = start;
    for t in logprobs {
        let text = tok.decode(&[t.token], false)?;
        offsets.push(offset);
        offset += text.len();
        tokens.push(text);
        values.push(t.logprob.max(f32::MIN));
        let mut top = Map::new();
        for &(id, lp) in &t.top {
            top.insert(tok.decode(&[id], false)?, json!(lp.max(f32::MIN)));
        }
        tops.push(Value::Object(top));
    }
    Ok((json!({"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}), offset))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: Value) -> Result<CompletionRequest> {
        CompletionRequest::from_json(&v)
    }

    #[test]
    fn prompts_and_fields_are_understood() {
        let r = parse(json!({"prompt": "Once", "max_tokens": 5, "temperature": 0.3, "stop": ["\n"],
                             "suffix": "end", "logprobs": 2, "stream": true, "best_of": 1})).unwrap();
        assert_eq!(r.prompt, Prompt::Text("Once".into()));
        assert!(!r.echo && r.options.stream);
        assert!(parse(json!({"prompt": "Once", "echo": true})).unwrap().echo);
        assert_eq!((r.suffix.as_deref(), r.logprobs), (Some("end"), Some(2)));
        assert_eq!((r.options.max_tokens, r.options.sampling.temperature), (Some(5), Some(0.3)));
        assert_eq!(parse(json!({"prompt": ["one"]})).unwrap().prompt, Prompt::Text("one".into()));
        assert_eq!(parse(json!({"prompt": [1, 2, 3]})).unwrap().prompt, Prompt::Tokens(vec![1, 2, 3]));
    }

    #[test]
    fn what_completions_cannot_take_is_refused() {
        for (req, unsupported) in [
            (json!({}), false),
            (json!({"prompt": 5}), false),
            (json!({"prompt": [1, -2]}), false),
            (json!({"prompt": "x", "messages": []}), false),
            (json!({"prompt": "x", "logprobs": 6}), false),
            (json!({"prompt": ["a", "b"]}), true),
            (json!({"prompt": "x", "best_of": 3}), true),
            (json!({"prompt": "x", "echo": true, "logprobs": 1}), true),
        ] {
            let err = parse(req.clone()).unwrap_err();
            assert_eq!(matches!(err, Error::Unsupported(_)), unsupported, "{req}: {err}");
        }
    }
}
