//! Model directories: config, weights, generation defaults; and the architectures built from them.

pub mod config;
pub mod qwen3;
pub mod safetensors;
pub mod synthetic;
pub mod weights;

use std::path::Path;

use serde_json::Value;

pub use config::{Architecture, ModelConfig};
pub use weights::{LoadProgress, WeightSource};

use crate::backend::{Backend, StepOutput, StepResult};
use crate::{Error, Result};

/// A model bound to a backend with its own KV cache: what the engine drives.
pub trait LanguageModel: Send {
    fn config(&self) -> &ModelConfig;
    /// Runs `tokens` at positions `start_pos..` and returns the last position's logits, or only
    /// their argmax (computed where the logits are). Positions from `start_pos` on are overwritten;
    /// earlier ones must come from earlier calls.
    fn step(&mut self, tokens: &[u32], start_pos: usize, want: StepOutput) -> Result<StepResult>;

    fn forward(&mut self, tokens: &[u32], start_pos: usize) -> Result<Vec<f32>> {
        match self.step(tokens, start_pos, StepOutput::Logits)? {
            StepResult::Logits(l) => Ok(l),
            _ => Err(Error::Device("the backend did not return logits".into())),
        }
    }

    /// The greedy next token: the largest of the first `limit` logits.
    fn forward_greedy(&mut self, tokens: &[u32], start_pos: usize, limit: usize) -> Result<u32> {
        match self.step(tokens, start_pos, StepOutput::Argmax { limit })? {
            StepResult::Token(t) => Ok(t),
            _ => Err(Error::Device("the backend did not return a token".into())),
        }
    }

    /// The `k` largest of the first `limit` logits as (id, logit), largest first.
    fn forward_top_k(&mut self, tokens: &[u32], start_pos: usize, k: usize, limit: usize) -> Result<Vec<(u32, f32)>> {
        match self.step(tokens, start_pos, StepOutput::TopK { k, limit })? {
            StepResult::Candidates(c) => Ok(c),
            _ => Err(Error::Device("the backend did not return candidates".into())),
        }
    }
    fn backend_description(&self) -> String;
}

pub struct Bound<B: Backend> {
    backend: B,
    model: qwen3::Qwen3<B>,
    cache: Vec<B::KvCache>,
    /// Positions the cache was made for. A replayed decode step writes where its device-side
    /// position says, unchecked, so every step is held within this before it reaches a backend.
    ctx_size: usize,
    /// Forward passes so far: decode steps are recorded only once everything they touch exists.
    passes: usize,
    /// False once the backend failed to record a decode step: later steps run without a graph.
    recordable: bool,
}

impl<B: Backend> Bound<B> {
    pub fn load(
        backend: B,
        config: ModelConfig,
        source: &dyn WeightSource,
        ctx_size: usize,
        progress: &mut dyn FnMut(LoadProgress),
    ) -> Result<Self> {
        let model = qwen3::Qwen3::load(config, source, &backend, progress)?;
        let cache = model.new_cache(&backend, ctx_size)?;
        Ok(Bound { backend, model, cache, ctx_size, passes: 0, recordable: true })
    }
}

impl<B: Backend> LanguageModel for Bound<B> {
    fn config(&self) -> &ModelConfig {
        &self.model.config
    }

    fn step(&mut self, tokens: &[u32], start_pos: usize, want: StepOutput) -> Result<StepResult> {
        if tokens.is_empty() {
            return Err(Error::InvalidRequest("no tokens to run".into()));
        }
        let ctx = self.ctx_size;
        if start_pos.checked_add(tokens.len()).is_none_or(|end| end > ctx) {
            return Err(Error::ContextOverflow(format!(
                "{} tokens at position {start_pos} go past the context of {ctx} positions",
                tokens.len()
            )));
        }
        // Checked here for every path: a replayed decode step reads its token on the device.
        let vocab = self.model.config.vocab_size;
        if let Some(bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::InvalidRequest(format!("token id {bad} is outside the model's vocabulary of {vocab}")));
        }
        let (b, model, cache) = (&self.backend, &self.model, &mut self.cache);
        if let ([token], true) = (tokens, self.passes > 0 && self.recordable) {
            if let Some(out) = b.replay_decode(*token, start_pos, want)? {
                return Ok(out);
            }
            let mut step = || model.forward(b, tokens, start_pos, cache);
            match b.record_decode(*token, start_pos, model.config.vocab_size, want, &mut step) {
                Ok(Some(out)) => return Ok(out),
                Ok(None) => {}
                // The driver could not record this step (nothing ran): run it, and the later
                // ones, without a graph. Errors of the request itself are returned.
                Err(Error::Device(_) | Error::Unsupported(_)) => self.recordable = false,
                Err(e) => return Err(e),
            }
        }
        self.passes += 1;
        let logits = model.forward(b, tokens, start_pos, cache)?;
        Ok(match want {
            StepOutput::Logits => StepResult::Logits(b.to_host(&logits)?),
            StepOutput::Argmax { limit } => StepResult::Token(b.argmax(&logits, limit)?),
            StepOutput::TopK { k, limit } => StepResult::Candidates(b.top_k(&logits, k, limit)?),
        })
    }

    fn backend_description(&self) -> String {
        self.backend.describe()
    }
}

/// Sampling defaults and stop ids from `generation_config.json` (all optional).
#[derive(Debug, Clone, Default)]
pub struct GenerationDefaults {
    pub eos_token_ids: Vec<u32>,
    pub temperature: Option<f32>,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
}

impl GenerationDefaults {
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("generation_config.json");
        if !path.exists() {
            return Ok(Self::default());
        }
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let json: Value =
            serde_json::from_str(&text).map_err(|e| Error::bad_file(&path, format!("not valid JSON: {e}")))?;
        let num = |k: &str| json.get(k).and_then(Value::as_f64).map(|v| v as f32);
        // do_sample = false means the checkpoint's authors want greedy decoding by default.
        let greedy = json.get("do_sample").and_then(Value::as_bool) == Some(false);
        Ok(GenerationDefaults {
            eos_token_ids: config::token_ids(json.get("eos_token_id"), "eos_token_id")
                .map_err(|e| Error::bad_file(&path, e.to_string()))?,
            temperature: if greedy { Some(0.0) } else { num("temperature") },
            top_k: json.get("top_k").and_then(Value::as_u64).map(|v| v as usize),
            top_p: num("top_p"),
            min_p: num("min_p"),
            repetition_penalty: num("repetition_penalty"),
        })
    }
}
