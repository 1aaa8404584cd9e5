//! The engine: one loaded model with its tokenizer, chat template and KV cache. It turns a prompt
//! into tokens and text, reusing the cached prefix of the previous request.

pub mod batch;
mod draft;
mod frontend;
pub mod prefix;
mod stop;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

pub use frontend::{check_fits, Frontend};
pub use prefix::PrefixCache;
pub use stop::{StopMatcher, StopOutcome};

use crate::backend::cpu::{CpuBackend, CpuKernels};
use crate::backend::{Backend, StepOutput, StepResult};
use crate::backend::gpu::{cuda, hip, GpuBackend};
use crate::chat::ChatTemplate;
use crate::gguf::GgufStore;
use crate::grammar::{GrammarSpec, GrammarVocab};
use crate::model::safetensors::SafetensorsStore;
use crate::model::synthetic::SyntheticSource;
use crate::model::{required_capabilities, BatchRow, Bound, GenerationDefaults, LanguageModel, LoadProgress, Meanwhile, ModelConfig, SavedCache, WeightSource};
use crate::sampling::{Adjustment, DeviceChoice, Sampler, SamplingParams, TokenLogprob};
use crate::tokenizer::{Detokenizer, Tokenizer};
use crate::{Error, Result};

pub use crate::cache::{cache_dir, create_private_dir};
pub use batch::BatchStats;

/// Where the model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Auto,
    Cpu,
    Cuda,
    Hip,
}

impl std::str::FromStr for Device {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Device::Auto),
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda),
            "hip" | "rocm" => Ok(Device::Hip),
            other => Err(Error::InvalidArgument(format!("device {other:?} (expected auto, cpu, cuda or hip)"))),
        }
    }
}

#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// A Hugging Face model directory or a GGUF file.
    pub model_dir: PathBuf,
    pub device: Device,
    /// Maximum prompt + generated tokens; None: the model's limit, capped at 4096 (as llama.cpp).
    pub ctx_size: Option<usize>,
    /// CPU threads; 0 uses every core.
    pub threads: usize,
    /// Memory for the prefix cache (see `prefix`), in bytes; 0 turns it off. None: half the
    /// device memory free after the load, or `DEFAULT_HOST_PREFIX_CACHE` on the CPU.
    pub prefix_cache_bytes: Option<usize>,
    /// The KV pool that every sequence's keys and values come from, in bytes (see
    /// `backend::kv_pool`). None: room for `parallel` sequences of the whole context, within half
    /// the device memory free after the load (and at least one whole context where that fits).
    pub kv_cache_bytes: Option<usize>,
    /// Speculative decoding of greedy requests: up to this many tokens drafted by prompt lookup
    /// (see `draft`), else by the model's multi-token-prediction head (at most
    /// `draft::HEAD_DRAFT_MAX` of them; the head is loaded only when this is not 0), and
    /// checked in one step; 0 turns it off.
    pub draft_max: usize,
    /// The head's guesses stop at the first whose probability is below this (a wrong guess
    /// costs a longer check, and on recurrent models a step run again).
    pub draft_p_min: f32,
    /// Sequences decoded together (see `Engine::split`), their caches from one pool
    /// (`kv_cache_bytes`); 0: as many as a quarter of the device memory free after the load
    /// holds caches of the whole context for, at most `batch::MAX_ROWS` (1 on the CPU).
    pub parallel: usize,
    /// Prompt positions that one step of a model shared by several sequences (`parallel` over
    /// one) reads at most: a longer prompt takes several steps, and the others' decode steps run
    /// between them, so their streams keep flowing while it is read. 0: a prompt in one step.
    pub prefill_chunk: usize,
    /// How the CPU multiplies block-format weights (ignored on a GPU). Default: `Auto`, the
    /// integer kernels (inputs rounded to 8 bits, as llama.cpp).
    pub cpu_kernels: CpuKernels,
}

/// `EngineOptions::prefill_chunk` unless given: a piece costs an H200 about 27 ms of an 8B
/// model's time, and prefill per token is as fast as for longer pieces.
pub const DEFAULT_PREFILL_CHUNK: usize = 512;

/// The most sequence slots a model takes (`EngineOptions::parallel`).
pub const MAX_PARALLEL: usize = 64;
/// See `EngineOptions::draft_p_min`: llama.cpp's default for its draft models' guesses.
pub const DEFAULT_DRAFT_P_MIN: f32 = 0.75;

/// The prefix cache's budget where the model runs in host memory.
pub const DEFAULT_HOST_PREFIX_CACHE: usize = 2 << 30;

impl EngineOptions {
    pub fn new(model_dir: impl Into<PathBuf>) -> Self {
        EngineOptions { model_dir: model_dir.into(), device: Device::Auto, ctx_size: None, threads: 0, prefix_cache_bytes: None, kv_cache_bytes: None, draft_max: 0, draft_p_min: DEFAULT_DRAFT_P_MIN, parallel: 1, prefill_chunk: DEFAULT_PREFILL_CHUNK, cpu_kernels: CpuKernels::Auto }
    }
}

/// What was loaded and where, for load reports and `atlas info`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LoadReport {
    pub model_dir: String,
    pub architecture: String,
    pub device: String,
    pub ctx_size: usize,
    pub vocab_size: usize,
    pub has_tokenizer: bool,
    pub has_chat_template: bool,
    /// Parts of the checkpoint a text engine does not use (a vision tower, MTP weights).
    pub unused: Vec<String>,
    /// What the load changed from what was asked (a ctx_size past the model's positions).
    pub notes: Vec<String>,
    /// The prefix cache's budget in bytes.
    pub prefix_cache_bytes: usize,
    /// The KV pool's bytes (see `EngineOptions::kv_cache_bytes`).
    pub kv_cache_bytes: usize,
    /// Sequences decoded together (see `Engine::parallel`).
    pub parallel: usize,
    pub load_ms: f64,
}

/// One generation: prompt tokens in, new tokens and text out.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    /// None: up to the end of the context.
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    /// Keep going past end-of-sequence tokens (for benchmarks and verification).
    pub ignore_eos: bool,
    /// What the output must parse as (masks the logits before every choice).
    pub grammar: Option<GrammarSpec>,
    /// `Some(n)`: each new token's log-probability and the n most likely alternatives'.
    pub logprobs: Option<usize>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    Stop,
    Length,
}

#[derive(Debug, Clone)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    pub prompt_tokens: usize,
    /// Prompt tokens whose keys and values were reused from the previous request.
    pub cached_tokens: usize,
    pub prompt_ms: f64,
    pub decode_ms: f64,
    /// Tokens drafted for speculative decoding, and how many of them the model confirmed.
    pub draft_tokens: usize,
    pub draft_accepted: usize,
    /// One per token of `tokens` when the request asked for them: log-softmax of the model's
    /// logits (after a grammar's mask; before biases, penalties, temperature and truncation).
    pub logprobs: Vec<TokenLogprob>,
}

pub struct Engine {
    model: Box<dyn LanguageModel>,
    front: Frontend,
    /// Tokens whose keys and values are in the cache, in order.
    cached: Vec<u32>,
    /// Pieces of earlier requests' caches, for prompts that begin as theirs did; shared by the
    /// engines of one model (`parallel`).
    prefix: Arc<Mutex<PrefixCache>>,
    /// The model and its decode queue, when this engine is one slot of several.
    batch: Option<Arc<batch::Shared>>,
    /// See `EngineOptions::draft_max`.
    draft_max: usize,
    draft_p_min: f32,
    /// See `EngineOptions::prefill_chunk`.
    prefill_chunk: usize,
    default_seed: Option<u64>,
    report: LoadReport,
    /// The vocabulary for constrained decoding, read at the first request that needs it.
    grammar_vocab: Option<Arc<GrammarVocab>>,
}

impl Engine {
    /// Loads a Hugging Face model directory (config.json + safetensors) or a GGUF file.
    pub fn load(opts: &EngineOptions, progress: &mut dyn FnMut(LoadProgress)) -> Result<Self> {
        let parts = match model_format(&opts.model_dir)? {
            ModelFormat::HfDirectory => hf_parts(&opts.model_dir)?,
            ModelFormat::Gguf(file) => gguf_parts(&file)?,
        };
        Self::from_parts(parts, opts, progress)
    }

    /// A random-weight model of a real shape (`qwen3-8b`, ...) in `format` ("bf16" or "fp8") for
    /// benchmarks; no tokenizer.
    pub fn load_synthetic(
        name: &str,
        format: &str,
        opts: &EngineOptions,
        progress: &mut dyn FnMut(LoadProgress),
    ) -> Result<Self> {
        let source = SyntheticSource::new(name, format)?;
        let parts = Parts {
            config: source.config().clone(),
            defaults: GenerationDefaults::default(),
            tokenizer: None,
            template: None,
            store: Box::new(source),
            unused: Vec::new(),
        };
        let mut opts = opts.clone();
        opts.model_dir = PathBuf::from(format!("synthetic:{name}:{format}"));
        Self::from_parts(parts, &opts, progress)
    }

    fn from_parts(parts: Parts, opts: &EngineOptions, progress: &mut dyn FnMut(LoadProgress)) -> Result<Self> {
        let start = Instant::now();
        let path = &opts.model_dir;
        let Parts { mut config, defaults, tokenizer, template, store, mut unused } = parts;
        let (ctx_size, mut notes) = resolve_ctx(opts.ctx_size, &config)?;
        // The multi-token-prediction head costs memory: loaded only to draft with.
        if let Some(hybrid) = config.hybrid.as_mut().filter(|h| h.mtp_layers > 0) {
            if opts.draft_max > 0 && store.contains("mtp.fc.weight") {
                unused.retain(|u| !u.starts_with(MTP_HEAD));
                notes.push(format!("{MTP_HEAD} loaded: drafts up to {} tokens a step", opts.draft_max.min(draft::HEAD_DRAFT_MAX)));
            } else {
                hybrid.mtp_layers = 0;
            }
        }
        let mut model = bind(opts, config, store.as_ref(), ctx_size, progress)?;
        let parallel = match opts.parallel {
            0 => default_parallel(model.as_ref(), ctx_size),
            n if n > MAX_PARALLEL => {
                return Err(Error::InvalidArgument(format!("parallel {n}: at most {MAX_PARALLEL} sequences at once")));
            }
            n => n,
        };
        model.set_slots(parallel)?;
        let kv_cache_bytes = set_kv_pool(model.as_mut(), opts.kv_cache_bytes, parallel, ctx_size, &mut notes)?;
        let prefix_cache_bytes = opts.prefix_cache_bytes.unwrap_or_else(|| model.free_memory().map_or(DEFAULT_HOST_PREFIX_CACHE, |free| free / 2));
        let report = LoadReport {
            model_dir: path.display().to_string(),
            architecture: model.config().arch.name().to_string(),
            device: model.backend_description(),
            ctx_size,
            vocab_size: model.config().vocab_size,
            has_tokenizer: tokenizer.is_some(),
            has_chat_template: template.is_some(),
            unused,
            notes,
            prefix_cache_bytes,
            kv_cache_bytes,
            parallel,
            load_ms: start.elapsed().as_secs_f64() * 1e3,
        };
        let front = Frontend::new(report.model_dir.clone(), tokenizer, template, defaults, ctx_size);
        let prefix = Arc::new(Mutex::new(PrefixCache::new(prefix_cache_bytes)));
        Ok(Engine {
            model,
            front,
            cached: Vec::new(),
            prefix,
            batch: None,
            draft_max: opts.draft_max,
            draft_p_min: opts.draft_p_min,
            prefill_chunk: opts.prefill_chunk,
            default_seed: None,
            report,
            grammar_vocab: None,
        })
    }

    /// One engine per sequence slot of the model (`EngineOptions::parallel`, allocated at the
    /// load), to be used from as many threads at once: their decode steps run together (see
    /// `batch`), and they share the prefix cache. One slot gives this engine back.
    pub fn split(self) -> Result<Vec<Engine>> {
        let n = self.report.parallel;
        if n <= 1 {
            return Ok(vec![self]);
        }
        let Engine { model, front, prefix, draft_max, draft_p_min, prefill_chunk, default_seed, report, grammar_vocab, .. } = self;
        let shared = batch::Shared::new(model);
        (0..n)
            .map(|slot| {
                Ok(Engine {
                    model: Box::new(batch::SlotModel::new(&shared, slot)?),
                    front: front.clone(),
                    cached: Vec::new(),
                    prefix: prefix.clone(),
                    batch: Some(shared.clone()),
                    draft_max,
                    draft_p_min,
                    prefill_chunk,
                    default_seed,
                    report: report.clone(),
                    grammar_vocab: grammar_vocab.clone(),
                })
            })
            .collect()
    }

    /// How decode steps were batched (all zero for an engine that is not one of `parallel`'s).
    pub fn batch_stats(&self) -> BatchStats {
        self.batch.as_ref().map(|b| b.stats()).unwrap_or_default()
    }

    /// The tokenizer, template and limits, shared: usable while the engine runs a request.
    pub fn frontend(&self) -> &Frontend {
        &self.front
    }

    /// The name responses carry in `model`: the model directory's name.
    pub fn model_name(&self) -> String {
        self.front.model_name()
    }

    pub fn report(&self) -> &LoadReport {
        &self.report
    }

    pub fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    pub fn ctx_size(&self) -> usize {
        self.front.ctx_size()
    }

    pub fn defaults(&self) -> &GenerationDefaults {
        self.front.defaults()
    }

    pub fn tokenizer(&self) -> Result<&Tokenizer> {
        self.front.tokenizer()
    }

    pub fn template(&self) -> Result<&ChatTemplate> {
        self.front.template()
    }

    /// Forgets the cached prefix (after a failure that may have left it half-written), and tells
    /// batching not to wait for this engine's sequence (a panic may have skipped that).
    pub fn reset_cache(&mut self) {
        self.cached.clear();
        self.model.finish();
    }

    /// The seed of requests that set none (None: a fresh random seed each time).
    pub fn set_default_seed(&mut self, seed: Option<u64>) {
        self.default_seed = seed;
    }

    /// Sampling settings from generation_config.json, the starting point of every request.
    pub fn default_sampling(&self) -> SamplingParams {
        let d = self.front.defaults();
        let base = SamplingParams::default();
        SamplingParams {
            temperature: d.temperature.unwrap_or(base.temperature),
            top_k: d.top_k.unwrap_or(base.top_k),
            top_p: d.top_p.unwrap_or(base.top_p),
            min_p: d.min_p.unwrap_or(base.min_p),
            repetition_penalty: d.repetition_penalty.unwrap_or(base.repetition_penalty),
            seed: self.default_seed,
            ..base
        }
    }

    /// See `Backend::set_token_mask` (benchmarks drive it directly); Ok(false) where the backend
    /// cannot.
    pub fn set_token_mask(&mut self, mask: Option<&[u32]>) -> Result<bool> {
        self.model.set_token_mask(mask)
    }

    /// The vocabulary for constrained decoding, read once.
    fn grammar_vocab(&mut self) -> Result<Arc<GrammarVocab>> {
        if let Some(v) = &self.grammar_vocab {
            return Ok(v.clone());
        }
        let vocab = Arc::new(GrammarVocab::new(self.front.tokenizer()?, self.config().vocab_size, self.eos_ids())?);
        self.grammar_vocab = Some(vocab.clone());
        Ok(vocab)
    }

    /// End-of-sequence ids: generation_config.json's, else config.json's.
    pub fn eos_ids(&self) -> &[u32] {
        let defaults = self.front.defaults();
        if defaults.eos_token_ids.is_empty() {
            &self.model.config().eos_token_ids
        } else {
            &defaults.eos_token_ids
        }
    }

    /// Logits of the last prompt position (`[vocab_size]`), computed from an empty cache.
    pub fn logits(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        self.forward(tokens, 0)
    }

    /// Logits of every position of `tokens` (`tokens.len()` rows of `vocab_size`, row-major),
    /// computed from an empty cache in one pass: what scoring a text (perplexity, KL divergence)
    /// needs.
    pub fn logits_all(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        self.forward_all(tokens, 0)
    }

    /// As [`Engine::forward`], with the logits of every position of `tokens` (`tokens.len()` rows
    /// of `vocab_size`).
    pub fn forward_all(&mut self, tokens: &[u32], start_pos: usize) -> Result<Vec<f32>> {
        self.prepare_forward(tokens, start_pos)?;
        let logits = match self.model.step(tokens, start_pos, StepOutput::AllLogits)? {
            StepResult::Logits(l) => l,
            _ => return Err(Error::Device("the backend did not return logits".into())),
        };
        self.cached.extend_from_slice(tokens);
        Ok(logits)
    }

    /// Runs `tokens` at positions `start_pos..` on top of the first `start_pos` cached tokens and
    /// returns the last logits (benchmarks drive the model through this).
    pub fn forward(&mut self, tokens: &[u32], start_pos: usize) -> Result<Vec<f32>> {
        self.prepare_forward(tokens, start_pos)?;
        let logits = self.model.forward(tokens, start_pos)?;
        self.cached.extend_from_slice(tokens);
        Ok(logits)
    }

    /// As [`Engine::forward`], but returns only the greedy next token (the argmax over every logit),
    /// computed where the logits are: on a GPU only the id crosses to the host.
    pub fn forward_greedy(&mut self, tokens: &[u32], start_pos: usize) -> Result<u32> {
        self.forward_greedy_masked(tokens, start_pos, &mut || Ok(None))
    }

    /// The greedy choice after every position of `tokens` at `start_pos..` (what checking
    /// drafted tokens computes).
    pub fn forward_greedy_each(&mut self, tokens: &[u32], start_pos: usize) -> Result<Vec<u32>> {
        self.prepare_forward(tokens, start_pos)?;
        let chosen = match self.model.step(tokens, start_pos, StepOutput::ArgmaxEach { limit: usize::MAX })? {
            StepResult::Tokens(t) => t,
            _ => return Err(Error::Device("the backend did not return a token per position".into())),
        };
        self.cached.extend_from_slice(tokens);
        Ok(chosen)
    }

    /// As [`Engine::forward_greedy`], with `mask` run while the device works on the step: the
    /// token mask it returns (see `set_token_mask`) is in force for this choice and later ones.
    pub fn forward_greedy_masked(&mut self, tokens: &[u32], start_pos: usize, mask: &mut Meanwhile<'_>) -> Result<u32> {
        self.prepare_forward(tokens, start_pos)?;
        let token = match self.model.step_with(tokens, start_pos, StepOutput::Argmax { limit: usize::MAX }, mask)? {
            StepResult::Token(t) => t,
            _ => return Err(Error::Device("the backend did not return a token".into())),
        };
        self.cached.extend_from_slice(tokens);
        Ok(token)
    }

    fn prepare_forward(&mut self, tokens: &[u32], start_pos: usize) -> Result<()> {
        if start_pos > self.cached.len() {
            return Err(Error::InvalidArgument(format!(
                "start position {start_pos} is past the {} cached tokens",
                self.cached.len()
            )));
        }
        check_fits(start_pos, tokens.len(), self.ctx_size())?;
        self.cached.truncate(start_pos);
        Ok(())
    }

    /// Renders a conversation with the model's template and tokenizes it, leaving room for
    /// `new_tokens` (None: at least one).
    pub fn chat_prompt(
        &self,
        messages: &serde_json::Value,
        tools: Option<&serde_json::Value>,
        kwargs: &serde_json::Map<String, serde_json::Value>,
        new_tokens: Option<usize>,
    ) -> Result<Vec<u32>> {
        let text = self.template()?.render(messages, tools, true, kwargs)?;
        self.front.encode_prompt(&text, new_tokens.unwrap_or(1))
    }

    /// Generates up to `max_tokens` tokens. With a tokenizer, `on_text` receives each piece of new
    /// text (never part of a UTF-8 character or of a stop string); it returns false to cancel.
    /// Only ids the tokenizer can decode are ever chosen.
    pub fn generate(&mut self, req: &GenerateRequest, on_text: &mut dyn FnMut(&str) -> bool) -> Result<Generation> {
        self.generate_with_logprobs(req, on_text, &mut |_| true)
    }

    /// As `generate`, and each new token's log-probabilities (when the request asks for them) go
    /// to `on_logprob` as the token is chosen; a false from either callback cancels.
    pub fn generate_with_logprobs(
        &mut self,
        req: &GenerateRequest,
        on_text: &mut dyn FnMut(&str) -> bool,
        on_logprob: &mut dyn FnMut(&TokenLogprob) -> bool,
    ) -> Result<Generation> {
        let vocab_limit = self.front.tokenizer().map_or(usize::MAX, Tokenizer::vocab_size);
        self.run(req, Some(vocab_limit), on_text, on_logprob)
    }

    /// Token ids only, over every one of the model's `vocab_size` logits and without detokenizing,
    /// as transformers' own generate does: the reference for verification.
    pub fn generate_raw(&mut self, req: &GenerateRequest) -> Result<Generation> {
        self.run(req, None, &mut |_| true, &mut |_| true)
    }

    /// `vocab_limit`: None for raw ids without text; Some(n) to choose among ids below n and stream text.
    fn run(
        &mut self,
        req: &GenerateRequest,
        vocab_limit: Option<usize>,
        on_text: &mut dyn FnMut(&str) -> bool,
        on_logprob: &mut dyn FnMut(&TokenLogprob) -> bool,
    ) -> Result<Generation> {
        let result = self.decode(req, vocab_limit, on_text, on_logprob);
        self.model.finish();
        // A grammar's last mask and the biases must not outlive their request, whatever happened.
        let mut cleared = Ok(true);
        if req.grammar.is_some() {
            cleared = cleared.and(self.model.set_token_mask(None));
        }
        if req.sampling.adjusts_logits() {
            cleared = cleared.and(self.model.set_logit_adjustments(&[]));
        }
        if let (Ok(_), Err(e)) = (&result, cleared) {
            return Err(e);
        }
        result
    }

    fn decode(
        &mut self,
        req: &GenerateRequest,
        vocab_limit: Option<usize>,
        on_text: &mut dyn FnMut(&str) -> bool,
        on_logprob: &mut dyn FnMut(&TokenLogprob) -> bool,
    ) -> Result<Generation> {
        if req.prompt.is_empty() {
            return Err(Error::InvalidRequest("the prompt is empty".into()));
        }
        req.sampling.validate().map_err(Error::InvalidRequest)?;
        let vocab = self.config().vocab_size;
        if let Some((id, _)) = req.sampling.logit_bias.iter().find(|(id, _)| *id as usize >= vocab) {
            return Err(Error::InvalidRequest(format!("logit_bias names token {id}, outside the vocabulary of {vocab}")));
        }
        let mut constraint = match &req.grammar {
            Some(spec) => Some(self.grammar_vocab()?.constraint(spec)?),
            None => None,
        };
        let ctx_size = self.ctx_size();
        let max_tokens = match req.max_tokens {
            Some(n) => n,
            None => ctx_size.saturating_sub(req.prompt.len()).max(1),
        };
        check_fits(req.prompt.len(), max_tokens, ctx_size)?;
        let front = self.front.clone();
        let text_tokenizer = vocab_limit.and(front.tokenizer().ok());
        let mut detok = Detokenizer::new(true);
        let mut stops = StopMatcher::new(req.stop.clone());

        let prompt = &req.prompt;
        let t0 = Instant::now();
        let reuse = self.reuse_prefix(prompt)?;
        // The choice is made where the logits are when it can be (greedy: the argmax; plain
        // temperature: a draw with the sampler's uniform number; top-k, and top-p / min-p whose
        // cut falls among the 64 best: those candidates and the log-partition), after the
        // request's adjustments (logit_bias, penalties, updated as the output grows) and a
        // grammar's mask of allowed tokens are sent there, the mask computed while the device runs
        // the step. A top-k past 64, and logprobs of adjusted logits, sample from every logit on
        // the host, adjusted and masked there.
        let mut sampler = Sampler::new(req.sampling.clone(), vocab_limit.unwrap_or(usize::MAX), prompt);
        let mut choice = sampler.device_choice(req.logprobs);
        if constraint.is_some() && choice.is_some() && !self.model.set_token_mask(None)? {
            choice = None;
        }
        if req.sampling.adjusts_logits() && choice.is_some() && !self.model.set_logit_adjustments(sampler.adjustments().list())? {
            choice = None;
        }
        if choice.is_some() {
            sampler.adjust_on_device();
        }
        let mut adjustments_sent = sampler.adjustments().version();
        let limit = sampler.vocab_limit();
        // Speculative decoding takes plain greedy requests: their choice depends on the logits
        // alone (no grammar, no adjustments that change as the output grows), so the sampler
        // and constraint need not see the drafted tokens.
        let speculate = self.draft_max > 0
            && choice == Some(DeviceChoice::Argmax)
            && constraint.is_none()
            && req.logprobs.is_none()
            && !req.sampling.adjusts_logits();
        // The next token, and its log-probabilities when the request asks for them.
        let mut next_token = |model: &mut Box<dyn LanguageModel>, tokens: &[u32], pos: usize| -> Result<(u32, Option<TokenLogprob>)> {
            if choice.is_some() && sampler.adjustments().version() != adjustments_sent {
                model.set_logit_adjustments(sampler.adjustments().list())?;
                adjustments_sent = sampler.adjustments().version();
            }
            let want = match choice {
                None => StepOutput::Logits,
                Some(DeviceChoice::Argmax) => StepOutput::Argmax { limit },
                Some(DeviceChoice::Draw { temperature }) => StepOutput::Draw { limit, temperature, u: sampler.uniform() },
                Some(DeviceChoice::TopK { k, temperature, cut }) => StepOutput::TopK { k, limit, temperature, cut },
            };
            let mut host_mask = None;
            let result = model.step_with(tokens, pos, want, &mut || {
                let Some(c) = constraint.as_mut() else { return Ok(None) };
                let words = c.allowed()?;
                if choice.is_some() {
                    return Ok(Some(words));
                }
                host_mask = Some(words);
                Ok(None)
            })?;
            let (token, logprob) = match result {
                StepResult::Token(token) => (token, None),
                StepResult::Tokens(_) => return Err(Error::Device("the backend returned a token per position".into())),
                StepResult::Candidates(best, partition) => {
                    let token = sampler
                        .sample_candidates(&best, partition)
                        .ok_or_else(|| Error::Device("the device's candidates do not settle the top-p / min-p cut".into()))?;
                    let lp = req.logprobs.zip(partition).map(|(top, z)| TokenLogprob::from_candidates(&best, z.raw, token, top));
                    (token, lp)
                }
                // Every logit: a host choice, or a top-p / min-p cut past the device's candidates
                // (those logits come adjusted and masked; the sampler adjusts them no more).
                StepResult::Logits(mut logits) => {
                    if let Some(words) = &host_mask {
                        crate::backend::apply_token_mask(&mut logits, words);
                    }
                    let before = req.logprobs.map(|_| logits.clone());
                    let token = sampler.sample(&mut logits);
                    (token, before.zip(req.logprobs).map(|(logits, top)| TokenLogprob::new(&logits, limit, token, top)))
                }
            };
            if let Some(c) = constraint.as_mut() {
                c.accept(token)?;
            }
            sampler.accept(token);
            Ok((token, logprob))
        };
        let mut history = prompt.clone();
        // The model's own drafting head reads every step of such a request, prompt included.
        let head_drafts = speculate && self.model.can_draft();
        self.model.set_drafting(head_drafts);
        // A failed step may leave the cache (recurrent states above all) part-written: forget it.
        let start = self.prefill_in_pieces(prompt).inspect_err(|_| self.cached.clear())?;
        let (mut next, mut next_logprob) = next_token(&mut self.model, &prompt[start..], start).inspect_err(|_| self.cached.clear())?;
        self.cached.extend_from_slice(&prompt[start..]);
        self.save_prefix();
        let prompt_ms = t0.elapsed().as_secs_f64() * 1e3;

        let t1 = Instant::now();
        let mut out = Generation {
            tokens: Vec::new(),
            text: String::new(),
            finish_reason: FinishReason::Length,
            prompt_tokens: prompt.len(),
            cached_tokens: reuse,
            prompt_ms,
            decode_ms: 0.0,
            draft_tokens: 0,
            draft_accepted: 0,
            logprobs: Vec::new(),
        };
        // Tokens chosen and already run (confirmed drafts), before the one chosen last.
        let mut confirmed = std::collections::VecDeque::new();
        let mut stopped_by_string = false;
        while out.tokens.len() < max_tokens {
            if let Some(token) = confirmed.pop_front() {
                next = token;
            }
            history.push(next);
            if !req.ignore_eos && self.eos_ids().contains(&next) {
                out.finish_reason = FinishReason::Stop;
                break;
            }
            out.tokens.push(next);
            if let Some(lp) = next_logprob.take() {
                if !on_logprob(&lp) {
                    return Err(Error::Cancelled);
                }
                out.logprobs.push(lp);
            }
            if let Some(tok) = text_tokenizer {
                let piece = detok.push(tok, next)?;
                stopped_by_string = emit(&mut stops, &piece, &mut out.text, on_text)?;
                if stopped_by_string {
                    out.finish_reason = FinishReason::Stop;
                    break;
                }
            }
            if out.tokens.len() == max_tokens {
                break;
            }
            if !confirmed.is_empty() {
                continue;
            }
            let pos = self.cached.len();
            let room = max_tokens - out.tokens.len() - 1;
            let drafts = if speculate { self.drafts(&history, next, pos, room, limit, head_drafts).inspect_err(|_| self.cached.clear())? } else { Vec::new() };
            if drafts.is_empty() {
                (next, next_logprob) = next_token(&mut self.model, &[next], pos).inspect_err(|_| self.cached.clear())?;
                self.cached.push(history[history.len() - 1]);
                continue;
            }
            let run = [&[next][..], &drafts].concat();
            let (kept, following) = verify(self.model.as_mut(), &run, pos, limit).inspect_err(|_| self.cached.clear())?;
            self.cached.extend_from_slice(&run[..=kept]);
            out.draft_tokens += drafts.len();
            out.draft_accepted += kept;
            confirmed.extend(drafts[..kept].iter().chain([&following]));
            next = following;
        }
        if let (Some(tok), false) = (text_tokenizer, stopped_by_string) {
            let tail = detok.finish(tok)?;
            if emit(&mut stops, &tail, &mut out.text, on_text)? {
                out.finish_reason = FinishReason::Stop;
            } else {
                release(&stops.flush(), &mut out.text, on_text)?;
            }
        }
        self.save_prefix();
        out.decode_ms = t1.elapsed().as_secs_f64() * 1e3;
        Ok(out)
    }

    /// Tokens to check after `next` (chosen for position `pos`), at most `room`: prompt lookup's
    /// where the text repeats, else the model's drafting head's (with `head`). The head reads
    /// every step either way, so that its own cache stays whole.
    fn drafts(&mut self, history: &[u32], next: u32, pos: usize, room: usize, limit: usize, head: bool) -> Result<Vec<u32>> {
        let found = draft::ngram_draft(history, self.draft_max.min(room));
        if !head {
            return Ok(found);
        }
        let k = if found.is_empty() { self.draft_max.min(room).min(draft::HEAD_DRAFT_MAX) } else { 0 };
        let guessed = self.model.draft(next, pos, k, limit, self.draft_p_min)?;
        Ok(if found.is_empty() { guessed } else { found })
    }

    /// Makes the cache hold the longest prefix of `prompt` it can without computing it (the
    /// previous request's, else the prefix cache's pieces), always short of the last prompt
    /// token, which is run for its logits; returns its length.
    fn reuse_prefix(&mut self, prompt: &[u32]) -> Result<usize> {
        // While this slot was idle, other sequences may have taken its KV blocks.
        if self.model.claim() {
            self.cached.clear();
        }
        let limit = prompt.len() - 1;
        let common = common_prefix(&self.cached, prompt).min(limit);
        // Recurrent layers hold one state for all cached tokens: usable only to continue them.
        let live = if common < self.cached.len() && !self.model.can_rewind() { 0 } else { common };
        let prefix = self.prefix.clone();
        let mut prefix = lock(&prefix);
        let hit = prefix.lookup(prompt, limit, self.model.is_recurrent()).filter(|h| h.depth > live);
        let Some(hit) = hit else {
            self.cached.truncate(live);
            return Ok(live);
        };
        // Positions below `common` hold the same tokens already: only the pieces past them move
        // (and the last, which holds a recurrent state).
        let pieces = prefix.pieces(&hit, common.min(hit.depth - 1));
        if let Err(e) = self.model.restore(&pieces) {
            self.cached.clear();
            return Err(e);
        }
        self.cached = prompt[..hit.depth].to_vec();
        Ok(hit.depth)
    }

    /// Runs a prompt but its last stretch in pieces, and returns where that stretch starts (the
    /// caller runs it for the logits). An engine of a shared model (`split`) reads at most
    /// `prefill_chunk` positions a step: each piece takes the model in turn, so the other
    /// sequences' decode steps run between pieces. A model with recurrent layers ends pieces
    /// every `PrefixCache::state_every` positions too, saving the state at each: a later prompt
    /// that agrees with this one only so far resumes there.
    ///
    /// Where a step of several tokens rounds differently from a one-token step (a GPU) and the
    /// cache may end anywhere (a model without recurrent layers reuses any cached prefix), the
    /// last stretch is the last prompt token alone: the logits that choose the first token are
    /// then the same whether the prompt before it came from the cache (which leaves only that
    /// token to run) or not, at the cost of one more step. A recurrent model resumes only where
    /// a state was saved, and runs the same pieces from there as the first time.
    fn prefill_in_pieces(&mut self, prompt: &[u32]) -> Result<usize> {
        let mut start = self.cached.len();
        let (budget, every) = {
            let prefix = lock(&self.prefix);
            (prefix.budget(), prefix.state_every())
        };
        let states = self.model.is_recurrent() && budget > 0;
        let chunk = if self.batch.is_some() && self.prefill_chunk > 0 { self.prefill_chunk } else { usize::MAX };
        let pieces_end = if self.model.steps_round_alike() || self.model.is_recurrent() { prompt.len() } else { prompt.len() - 1 };
        loop {
            let boundary = if states { (start / every + 1) * every } else { usize::MAX };
            let end = boundary.min(start.saturating_add(chunk)).min(pieces_end);
            if end >= prompt.len() || end == start {
                return Ok(start);
            }
            self.model.step(&prompt[start..end], start, StepOutput::Argmax { limit: usize::MAX })?;
            self.cached.extend_from_slice(&prompt[start..end]);
            if end == boundary {
                self.save_prefix();
            }
            start = end;
        }
    }

    /// Offers what the cache holds to the prefix cache. A piece that cannot be saved (no memory
    /// left on the device) is simply not kept: the request goes on.
    fn save_prefix(&mut self) {
        let mut prefix = lock(&self.prefix);
        if prefix.budget() > 0 && !self.cached.is_empty() {
            let _ = prefix.save(self.model.as_mut(), &self.cached);
        }
    }

}

/// The prefix cache; a panic while it was held leaves at worst pieces that are not found.
fn lock(prefix: &Mutex<PrefixCache>) -> std::sync::MutexGuard<'_, PrefixCache> {
    prefix.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs `run` (the token chosen last, then drafts) at `pos` and keeps the drafts the model would
/// have chosen itself: returns how many, and its choice after the last of them. The cache then
/// ends after the kept drafts (`LanguageModel::keep_until`: a model with recurrent layers goes
/// back into the step's states).
fn verify(model: &mut dyn LanguageModel, run: &[u32], pos: usize, limit: usize) -> Result<(usize, u32)> {
    let chosen = match model.step(run, pos, StepOutput::ArgmaxEach { limit })? {
        StepResult::Tokens(t) if t.len() == run.len() => t,
        _ => return Err(Error::Device("the backend did not return a token per position".into())),
    };
    let kept = draft::accepted(&run[1..], &chosen);
    model.keep_until(pos + kept + 1)?;
    Ok((kept, chosen[kept]))
}

/// Passes `piece` through the stop matcher and hands the releasable text to `on_text`.
/// Returns whether a stop string ended the text; a false from `on_text` cancels.
fn emit(stops: &mut StopMatcher, piece: &str, text: &mut String, on_text: &mut dyn FnMut(&str) -> bool) -> Result<bool> {
    let (released, stopped) = match stops.push(piece) {
        StopOutcome::Continue(t) => (t, false),
        StopOutcome::Stopped(t) => (t, true),
    };
    release(&released, text, on_text)?;
    Ok(stopped)
}

/// Appends `piece` to the answer and streams it; a false from `on_text` cancels.
fn release(piece: &str, text: &mut String, on_text: &mut dyn FnMut(&str) -> bool) -> Result<()> {
    text.push_str(piece);
    if !piece.is_empty() && !on_text(piece) {
        return Err(Error::Cancelled);
    }
    Ok(())
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// The context to allocate, and a note when it is not what was asked. A ctx_size past the
/// model's positions is clamped to them, as llama.cpp does: hosts such as Lemonade size the
/// context from free memory, not from the model.
fn resolve_ctx(requested: Option<usize>, config: &ModelConfig) -> Result<(usize, Vec<String>)> {
    let max = config.max_position_embeddings;
    match requested {
        Some(0) => Err(Error::InvalidArgument("ctx_size must be greater than zero".into())),
        Some(n) if n > max => Ok((max, vec![format!("ctx_size {n} clamped to the model's max_position_embeddings {max}")])),
        Some(n) => Ok((n, Vec::new())),
        None => Ok((max.min(4096), Vec::new())),
    }
}

/// Everything a model file or directory provides, before it is bound to a device.
struct Parts {
    config: ModelConfig,
    defaults: GenerationDefaults,
    tokenizer: Option<Tokenizer>,
    template: Option<ChatTemplate>,
    store: Box<dyn WeightSource>,
    /// What the checkpoint holds that the engine leaves unused, for the load report.
    unused: Vec<String>,
}

/// The two layouts a model comes in.
pub enum ModelFormat {
    /// config.json, *.safetensors, tokenizer.json, ... in one directory.
    HfDirectory,
    /// One GGUF file (given directly, or the only .gguf in a directory without config.json).
    Gguf(PathBuf),
}

pub fn model_format(path: &Path) -> Result<ModelFormat> {
    if path.is_file() {
        return if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) {
            Ok(ModelFormat::Gguf(path.to_path_buf()))
        } else {
            Err(Error::bad_file(path, "not a model: expected a directory with config.json or a .gguf file"))
        };
    }
    if !path.is_dir() {
        return Err(Error::bad_file(path, "model not found"));
    }
    if path.join("config.json").exists() {
        return Ok(ModelFormat::HfDirectory);
    }
    let ggufs: Vec<PathBuf> = std::fs::read_dir(path)
        .map_err(|e| Error::io(path, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")))
        .collect();
    match ggufs.as_slice() {
        [one] => Ok(ModelFormat::Gguf(one.clone())),
        [] => Err(Error::bad_file(path, "not a model directory (no config.json and no .gguf file)")),
        _ => Err(Error::bad_file(path, "several .gguf files here: name the one to load")),
    }
}

/// How the load report names the `mtp.*` tensors.
const MTP_HEAD: &str = "multi-token-prediction head";

fn hf_parts(dir: &Path) -> Result<Parts> {
    let tokenizer_path = dir.join("tokenizer.json");
    let store = SafetensorsStore::open_dir(dir)?;
    let unused = [("model.visual.", "vision tower (text only)"), ("mtp.", MTP_HEAD)]
        .iter()
        .filter_map(|(prefix, what)| match store.count_prefixed(prefix) {
            0 => None,
            n => Some(format!("{what}: {n} tensors {prefix}*")),
        })
        .collect();
    Ok(Parts {
        config: ModelConfig::from_file(&dir.join("config.json"))?,
        defaults: GenerationDefaults::from_dir(dir)?,
        tokenizer: tokenizer_path.exists().then(|| Tokenizer::from_file(&tokenizer_path)).transpose()?,
        template: ChatTemplate::from_model_dir(dir)?,
        store: Box::new(store),
        unused,
    })
}

fn gguf_parts(file: &Path) -> Result<Parts> {
    let store = GgufStore::open(file)?;
    let config = store.config()?;
    let special = store.special_tokens();
    let template = store
        .chat_template()
        .map(|t| ChatTemplate::new(&t, special.bos_token.clone(), special.eos_token.clone()))
        .transpose()?;
    let defaults = GenerationDefaults { eos_token_ids: config.eos_token_ids.clone(), ..GenerationDefaults::default() };
    Ok(Parts {
        tokenizer: Some(Tokenizer::from_inner(store.tokenizer()?)),
        config,
        defaults,
        template,
        store: Box::new(store),
        unused: Vec::new(),
    })
}

fn bind(
    opts: &EngineOptions,
    config: ModelConfig,
    store: &dyn WeightSource,
    ctx_size: usize,
    progress: &mut dyn FnMut(LoadProgress),
) -> Result<Box<dyn LanguageModel>> {
    let cpu = |config, progress: &mut dyn FnMut(LoadProgress)| -> Result<Box<dyn LanguageModel>> {
        Ok(Box::new(Bound::load(CpuBackend::with_kernels(opts.threads, opts.cpu_kernels)?, config, store, ctx_size, progress)?))
    };
    match opts.device {
        Device::Cpu => cpu(config, progress),
        Device::Cuda => Ok(Box::new(Bound::load(GpuBackend::cuda()?, config, store, ctx_size, progress)?)),
        Device::Hip => Ok(Box::new(Bound::load(GpuBackend::hip()?, config, store, ctx_size, progress)?)),
        // An AMD GPU, else an NVIDIA one, else the CPU; the load report says which. A runtime whose
        // library opens but finds no device just means "try the next one"; a GPU that lacks an
        // op the model needs is checked before any weight moves, and the CPU runs it instead.
        Device::Auto => {
            let hip = if hip::available() { GpuBackend::hip() } else { Err(Error::Device("no HIP runtime found".into())) };
            let gpu = hip.or_else(|hip_err| {
                let cuda = if cuda::available() { GpuBackend::cuda() } else { Err(Error::Device("no CUDA driver found".into())) };
                let reason = |e: Error| match e {
                    Error::Device(m) => m,
                    other => other.to_string(),
                };
                cuda.map_err(|cuda_err| format!("HIP: {}; CUDA: {}", reason(hip_err), reason(cuda_err)))
            });
            let missing = gpu.as_ref().ok().and_then(|g| required_capabilities(&config).into_iter().find(|c| !g.supports(*c)));
            match (gpu, missing) {
                (Ok(gpu), None) => Ok(Box::new(Bound::load(gpu, config, store, ctx_size, progress)?)),
                (Ok(gpu), Some(cap)) => {
                    let note = format!("{} has no {cap} yet", gpu.describe());
                    drop(gpu);
                    Ok(Box::new(Noted { inner: cpu(config, progress)?, note }))
                }
                (Err(why), _) => Ok(Box::new(Noted { inner: cpu(config, progress)?, note: why })),
            }
        }
    }
}

/// A model that runs somewhere other than the user might expect, with the reason in its
/// description (the load report's `device`).
struct Noted {
    inner: Box<dyn LanguageModel>,
    note: String,
}

impl LanguageModel for Noted {
    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }
    fn step_with(&mut self, tokens: &[u32], start_pos: usize, want: StepOutput, meanwhile: &mut Meanwhile<'_>) -> Result<StepResult> {
        self.inner.step_with(tokens, start_pos, want, meanwhile)
    }
    fn set_token_mask(&mut self, mask: Option<&[u32]>) -> Result<bool> {
        self.inner.set_token_mask(mask)
    }
    fn set_logit_adjustments(&mut self, list: &[Adjustment]) -> Result<bool> {
        self.inner.set_logit_adjustments(list)
    }
    fn backend_description(&self) -> String {
        format!("{} (not the GPU: {})", self.inner.backend_description(), self.note)
    }
    fn can_rewind(&self) -> bool {
        self.inner.can_rewind()
    }
    fn steps_round_alike(&self) -> bool {
        self.inner.steps_round_alike()
    }
    fn save(&mut self, start: usize, end: usize, with_state: bool) -> Result<SavedCache> {
        self.inner.save(start, end, with_state)
    }
    fn restore(&mut self, pieces: &[&SavedCache]) -> Result<()> {
        self.inner.restore(pieces)
    }
    fn keep_until(&mut self, end: usize) -> Result<()> {
        self.inner.keep_until(end)
    }
    fn free_memory(&self) -> Option<usize> {
        self.inner.free_memory()
    }
    fn slots(&self) -> usize {
        self.inner.slots()
    }
    fn set_slots(&mut self, n: usize) -> Result<()> {
        self.inner.set_slots(n)
    }
    fn select(&mut self, slot: usize) -> Result<()> {
        self.inner.select(slot)
    }
    fn finish(&mut self) {
        self.inner.finish()
    }
    fn claim(&mut self) -> bool {
        self.inner.claim()
    }
    fn reserve(&mut self, end: usize) -> Result<()> {
        self.inner.reserve(end)
    }
    fn set_kv_cache_bytes(&mut self, bytes: usize) -> Result<usize> {
        self.inner.set_kv_cache_bytes(bytes)
    }
    fn kv_usage(&self) -> Option<crate::model::KvUsage> {
        self.inner.kv_usage()
    }
    fn step_batch(&mut self, rows: &[BatchRow]) -> Result<Vec<StepResult>> {
        self.inner.step_batch(rows)
    }
    fn can_draft(&self) -> bool {
        self.inner.can_draft()
    }
    fn set_drafting(&mut self, on: bool) {
        self.inner.set_drafting(on)
    }
    fn draft(&mut self, next: u32, pos: usize, k: usize, limit: usize, p_min: f32) -> Result<Vec<u32>> {
        self.inner.draft(next, pos, k, limit, p_min)
    }
}

/// Sizes the model's KV pool (`EngineOptions::kv_cache_bytes`) and notes what it holds when
/// that is less than every sequence's whole context; returns its bytes.
fn set_kv_pool(model: &mut dyn LanguageModel, asked: Option<usize>, parallel: usize, ctx_size: usize, notes: &mut Vec<String>) -> Result<usize> {
    let Some(usage) = model.kv_usage() else { return Ok(0) };
    let per_sequence = crate::backend::kv_pool::blocks_for(ctx_size) * model.config().attention_layers().max(1) * usage.block_bytes;
    let bytes = match asked {
        Some(bytes) => bytes,
        None => {
            let want = per_sequence.saturating_mul(parallel);
            match model.free_memory() {
                // The load's own pool (one whole context) is free again once replaced.
                Some(free) => {
                    let available = free + usage.blocks * usage.block_bytes;
                    want.min(available / 2).max(per_sequence.min(available * 9 / 10))
                }
                None => want,
            }
        }
    };
    let bytes = model.set_kv_cache_bytes(bytes)?;
    let contexts = bytes as f64 / per_sequence.max(1) as f64;
    if contexts < parallel as f64 {
        notes.push(format!(
            "the KV cache ({:.1} GiB) holds {contexts:.2} whole contexts of {ctx_size} positions for {parallel} sequences: they share it, and a request that finds it full is refused",
            bytes as f64 / (1u64 << 30) as f64
        ));
    }
    Ok(bytes)
}

/// `EngineOptions::parallel` = 0: as many sequences as a quarter of the free device memory holds
/// caches for (keys and values in bf16, recurrent states in f32), within 1..=`batch::MAX_ROWS`.
fn default_parallel(model: &dyn LanguageModel, ctx_size: usize) -> usize {
    let Some(free) = model.free_memory() else { return 1 };
    let c = model.config();
    let attention = c.attention_layers();
    let recurrent = match &c.hybrid {
        Some(h) => {
            let state = h.value_heads * h.key_head_dim * h.value_head_dim + (h.conv_kernel - 1) * h.conv_dim();
            (c.num_layers.saturating_sub(attention - h.mtp_layers)) * state * 4
        }
        None => 0,
    };
    let per_slot = (attention * ctx_size * c.kv_width() * 2 * 2 + recurrent).max(1);
    (free / 4 / per_slot).clamp(1, batch::MAX_ROWS)
}

/// Where `atlas setup` puts the default model (SmolLM2-135M-Instruct, Q4_1 GGUF): in `cache_dir()`,
/// else (no cache directory at all) in `.cache/atlas` under the current directory, which only the
/// command-line tool, run by the user from a directory of theirs, ever uses.
pub fn default_model_path() -> PathBuf {
    cache_dir().unwrap_or_else(|| PathBuf::from(".cache").join("atlas")).join("SmolLM2-135M-Instruct.Q4_1.gguf")
}

#[cfg(test)]
mod default_model_tests {
    #[test]
    fn the_default_model_is_the_q4_1_smollm2_file() {
        assert!(super::default_model_path().ends_with("SmolLM2-135M-Instruct.Q4_1.gguf"));
    }
}

