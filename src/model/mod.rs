//! Model directories: config, weights, generation defaults; and the architectures built from them.

pub mod config;
mod loader;
pub mod mlp;
pub mod qwen3;
pub mod qwen3_5;
pub mod safetensors;
pub mod synthetic;
pub mod weights;

use std::path::Path;

use serde_json::Value;

pub use config::{Architecture, ModelConfig};
pub use weights::{LoadProgress, WeightSource};

use crate::backend::{Backend, Capability, StepOutput, StepResult};
use crate::sampling::Adjustment;
use crate::{Error, Result};

/// A model bound to a backend with its own KV cache: what the engine drives.
pub trait LanguageModel: Send {
    fn config(&self) -> &ModelConfig;
    /// Runs `tokens` at positions `start_pos..` and returns the last position's logits, or only
    /// their argmax (computed where the logits are). Positions from `start_pos` on are overwritten;
    /// earlier ones must come from earlier calls.
    fn step(&mut self, tokens: &[u32], start_pos: usize, want: StepOutput) -> Result<StepResult> {
        self.step_with(tokens, start_pos, want, &mut || Ok(None))
    }

    /// `step`, with `meanwhile` run on the host while the device works on the step (a grammar's
    /// next mask is computed there); a mask it returns is set, as by `set_token_mask`, before the
    /// step's token or candidates are chosen.
    fn step_with(&mut self, tokens: &[u32], start_pos: usize, want: StepOutput, meanwhile: &mut Meanwhile<'_>) -> Result<StepResult>;

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

    /// See `Backend::set_token_mask`: Ok(false) where the backend cannot (the caller then masks
    /// the logits on the host).
    fn set_token_mask(&mut self, mask: Option<&[u32]>) -> Result<bool>;
    /// See `Backend::set_logit_adjustments`: Ok(false) where the backend cannot.
    fn set_logit_adjustments(&mut self, list: &[Adjustment]) -> Result<bool>;
    fn backend_description(&self) -> String;
    /// Whether a step may start at any cached position. Recurrent layers (Gated DeltaNet) keep
    /// one state for the positions so far: they continue from its end or start again at 0.
    fn can_rewind(&self) -> bool;
    /// Whether the model has recurrent layers, whose state a saved piece must carry to be resumed
    /// from (see `save`).
    fn is_recurrent(&self) -> bool {
        !self.can_rewind()
    }

    /// Copies positions `start..end` of the cache out: every attention layer's keys and values,
    /// and with `with_state` every recurrent layer's state, which must then be at `end` (the
    /// last step ended there). The copy lives on the model's device until dropped.
    fn save(&mut self, start: usize, end: usize, with_state: bool) -> Result<SavedCache>;
    /// Writes saved pieces back, in order; they must follow one another from the first's start
    /// (positions before it are the cache's own). A model with recurrent layers needs the last
    /// piece's state, and continues from its end.
    fn restore(&mut self, pieces: &[&SavedCache]) -> Result<()>;
    /// See `Backend::free_memory`.
    fn free_memory(&self) -> Option<usize>;
}

/// A piece of a sequence's cache copied out of a model (`LanguageModel::save`): what the prefix
/// cache keeps. Only the model that saved it can read it back.
pub struct SavedCache {
    pub start: usize,
    pub end: usize,
    /// The recurrent layers' state at `end` is in it.
    pub has_state: bool,
    /// Device (or host) memory it holds.
    pub bytes: usize,
    layers: Box<dyn std::any::Any + Send>,
}

/// One layer's part of a `SavedCache`.
enum SavedLayer<B: Backend> {
    Kv(B::KvCache),
    State { conv: B::Tensor, state: B::Tensor },
    /// A recurrent layer saved without its state.
    Skipped,
}

/// Host work overlapped with a step; see `LanguageModel::step_with`.
pub type Meanwhile<'a> = dyn FnMut() -> Result<Option<Vec<u32>>> + 'a;

/// What one layer remembers of earlier positions.
pub enum LayerCache<B: Backend> {
    /// Keys and values of every position (attention layers).
    Attention(B::KvCache),
    /// A Gated DeltaNet layer's last `conv_kernel - 1` inputs to its convolution `[1, (K-1)·C]`
    /// and its delta-rule state `[1, value_heads·key_dim·value_dim]`.
    Recurrent { conv: B::Tensor, state: B::Tensor },
}

impl<B: Backend> LayerCache<B> {
    pub fn kv(&mut self) -> Result<&mut B::KvCache> {
        match self {
            LayerCache::Attention(kv) => Ok(kv),
            LayerCache::Recurrent { .. } => Err(Error::InvalidArgument("an attention layer got a recurrent cache".into())),
        }
    }

    pub fn recurrent(&mut self) -> Result<(&mut B::Tensor, &mut B::Tensor)> {
        match self {
            LayerCache::Recurrent { conv, state } => Ok((conv, state)),
            LayerCache::Attention(_) => Err(Error::InvalidArgument("a recurrent layer got a KV cache".into())),
        }
    }
}

/// One architecture's network, loaded onto a backend.
pub trait Network<B: Backend>: Send + Sync {
    fn config(&self) -> &ModelConfig;
    /// A fresh cache per layer for `capacity` positions (recurrent states start at zero).
    fn new_cache(&self, b: &B, capacity: usize) -> Result<Vec<LayerCache<B>>>;
    /// Runs `tokens` at positions `start_pos..` and returns the logits of the last one
    /// (`[1, vocab_size]`, on the backend), or of every one (`[T, vocab_size]`). The cache must
    /// hold positions `0..start_pos`.
    fn forward(&self, b: &B, tokens: &[u32], start_pos: usize, cache: &mut [LayerCache<B>], rows: LogitRows) -> Result<B::Tensor>;
}

/// Whose logits a forward pass computes: the last position's (generation), or every position's
/// (scoring a text: perplexity, KL divergence).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitRows {
    Last,
    All,
}

impl LogitRows {
    /// The rows of the final hidden states `x` `[T, H]` that go on to the head.
    fn of<B: Backend>(self, b: &B, x: B::Tensor) -> Result<B::Tensor> {
        match self {
            LogitRows::Last => b.last_row(&x),
            LogitRows::All => Ok(x),
        }
    }
}

/// What `config` needs of a backend beyond the dense decoder.
pub fn required_capabilities(config: &ModelConfig) -> Vec<Capability> {
    let mut caps = vec![Capability::HeadDim(config.head_dim)];
    if config.moe.is_some() {
        caps.push(Capability::MixtureOfExperts);
    }
    if config.hybrid.is_some() {
        caps.extend([Capability::GatedDeltaNet, Capability::SigmoidGate]);
    }
    if config.rotary_dim != config.head_dim {
        caps.push(Capability::PartialRotary);
    }
    caps
}

fn load_network<B: Backend + 'static>(
    config: ModelConfig,
    source: &dyn WeightSource,
    backend: &B,
    progress: &mut dyn FnMut(LoadProgress),
) -> Result<Box<dyn Network<B>>> {
    if let Some(cap) = required_capabilities(&config).into_iter().find(|c| !backend.supports(*c)) {
        return Err(Error::Unsupported(format!("{cap} on {} (a {} model)", backend.describe(), config.arch.name())));
    }
    Ok(match config.arch {
        Architecture::Llama | Architecture::Qwen3 | Architecture::Qwen3Moe => {
            Box::new(qwen3::Qwen3::load(config, source, backend, progress)?)
        }
        Architecture::Qwen35 | Architecture::Qwen35Moe => Box::new(qwen3_5::Qwen35::load(config, source, backend, progress)?),
    })
}

pub struct Bound<B: Backend> {
    backend: B,
    model: Box<dyn Network<B>>,
    cache: Vec<LayerCache<B>>,
    /// The position the recurrent states have reached (None after a failed step: they must
    /// start again). Models without recurrent layers ignore it.
    recurrent_at: Option<usize>,
    recurrent: bool,
    /// Positions the cache was made for. A replayed decode step writes where its device-side
    /// position says, unchecked, so every step is held within this before it reaches a backend.
    ctx_size: usize,
    /// Forward passes so far: decode steps are recorded only once everything they touch exists.
    passes: usize,
    /// False once the backend failed to record a decode step: later steps run without a graph.
    recordable: bool,
}

impl<B: Backend + 'static> Bound<B> {
    pub fn load(
        backend: B,
        config: ModelConfig,
        source: &dyn WeightSource,
        ctx_size: usize,
        progress: &mut dyn FnMut(LoadProgress),
    ) -> Result<Self> {
        let model = load_network(config, source, &backend, progress)?;
        let cache = model.new_cache(&backend, ctx_size)?;
        let recurrent = cache.iter().any(|c| matches!(c, LayerCache::Recurrent { .. }));
        Ok(Bound { backend, model, cache, recurrent_at: Some(0), recurrent, ctx_size, passes: 0, recordable: true })
    }

    /// Recurrent states continue only from where they are; position 0 starts them again.
    fn prepare_recurrent(&mut self, start_pos: usize) -> Result<()> {
        if !self.recurrent {
            return Ok(());
        }
        if start_pos == 0 && self.recurrent_at != Some(0) {
            self.cache = self.model.new_cache(&self.backend, self.ctx_size)?;
        } else if self.recurrent_at != Some(start_pos) {
            return Err(Error::InvalidArgument(format!(
                "a step at position {start_pos}, but the recurrent layers' state is {}",
                self.recurrent_at.map_or("lost after a failed step".to_string(), |p| format!("at position {p}"))
            )));
        }
        self.recurrent_at = None;
        Ok(())
    }
}

impl<B: Backend + 'static> LanguageModel for Bound<B> {
    fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    fn can_rewind(&self) -> bool {
        !self.recurrent
    }

    fn step_with(&mut self, tokens: &[u32], start_pos: usize, want: StepOutput, meanwhile: &mut Meanwhile<'_>) -> Result<StepResult> {
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
        let vocab = self.model.config().vocab_size;
        if let Some(bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::InvalidRequest(format!("token id {bad} is outside the model's vocabulary of {vocab}")));
        }
        self.prepare_recurrent(start_pos)?;
        let end = start_pos + tokens.len();
        let out = self.run_step(tokens, start_pos, want, meanwhile)?;
        self.recurrent_at = Some(end);
        Ok(out)
    }

    fn set_token_mask(&mut self, mask: Option<&[u32]>) -> Result<bool> {
        supported(self.backend.set_token_mask(mask))
    }

    fn set_logit_adjustments(&mut self, list: &[Adjustment]) -> Result<bool> {
        supported(self.backend.set_logit_adjustments(list))
    }

    fn backend_description(&self) -> String {
        self.backend.describe()
    }

    fn free_memory(&self) -> Option<usize> {
        self.backend.free_memory()
    }

    fn save(&mut self, start: usize, end: usize, with_state: bool) -> Result<SavedCache> {
        if start >= end || end > self.ctx_size {
            return Err(Error::InvalidArgument(format!("save: positions {start}..{end} in a context of {}", self.ctx_size)));
        }
        let with_state = with_state && self.recurrent;
        if with_state && self.recurrent_at != Some(end) {
            return Err(Error::InvalidArgument(format!("save: a state at position {end}, but the recurrent layers are elsewhere")));
        }
        let b = &self.backend;
        let mut bytes = 0;
        let mut layers = Vec::with_capacity(self.cache.len());
        for layer in &self.cache {
            layers.push(match layer {
                LayerCache::Attention(kv) => {
                    let saved = b.save_kv(kv, start, end - start)?;
                    bytes += b.kv_bytes(&saved);
                    SavedLayer::<B>::Kv(saved)
                }
                LayerCache::Recurrent { conv, state } if with_state => {
                    let (conv, state) = (b.save_tensor(conv)?, b.save_tensor(state)?);
                    bytes += b.tensor_bytes(&conv) + b.tensor_bytes(&state);
                    SavedLayer::State { conv, state }
                }
                LayerCache::Recurrent { .. } => SavedLayer::Skipped,
            });
        }
        Ok(SavedCache { start, end, has_state: with_state, bytes, layers: Box::new(layers) })
    }

    fn restore(&mut self, pieces: &[&SavedCache]) -> Result<()> {
        let Some(last) = pieces.last() else { return Ok(()) };
        if pieces.windows(2).any(|w| w[0].end != w[1].start) || last.end > self.ctx_size {
            return Err(Error::InvalidArgument("restore: the saved pieces do not follow one another".into()));
        }
        if self.recurrent && !last.has_state {
            return Err(Error::InvalidArgument("restore: a model with recurrent layers needs a saved state".into()));
        }
        // A half-written cache is no state to continue from.
        self.recurrent_at = None;
        for piece in pieces {
            let layers = piece
                .layers
                .downcast_ref::<Vec<SavedLayer<B>>>()
                .filter(|l| l.len() == self.cache.len())
                .ok_or_else(|| Error::InvalidArgument("restore: the pieces were saved by another model".into()))?;
            for (saved, live) in layers.iter().zip(&mut self.cache) {
                match (saved, live) {
                    (SavedLayer::Kv(saved), LayerCache::Attention(kv)) => self.backend.restore_kv(saved, kv, piece.start)?,
                    (SavedLayer::State { conv, state }, LayerCache::Recurrent { conv: c, state: s }) => {
                        self.backend.restore_tensor(conv, c)?;
                        self.backend.restore_tensor(state, s)?;
                    }
                    (SavedLayer::Skipped, LayerCache::Recurrent { .. }) => {}
                    _ => return Err(Error::InvalidArgument("restore: the pieces were saved by another model".into())),
                }
            }
        }
        self.recurrent_at = Some(last.end);
        Ok(())
    }
}

impl<B: Backend + 'static> Bound<B> {
    /// Queues the step (a recorded decode graph where one fits), runs `meanwhile` while the
    /// device works, sets the mask it returns, then makes the choice.
    fn run_step(&mut self, tokens: &[u32], start_pos: usize, want: StepOutput, meanwhile: &mut Meanwhile<'_>) -> Result<StepResult> {
        let vocab = self.model.config().vocab_size;
        let every_row = matches!(want, StepOutput::AllLogits | StepOutput::ArgmaxEach { .. });
        if let ([token], true) = (tokens, self.passes > 0 && self.recordable && !every_row) {
            let (b, model, cache) = (&self.backend, &self.model, &mut self.cache);
            let queued = b.replay_decode(*token, start_pos, want)? || {
                let mut step = || model.forward(b, tokens, start_pos, cache, LogitRows::Last);
                match b.record_decode(*token, start_pos, vocab, want, &mut step) {
                    Ok(recorded) => recorded,
                    // The driver could not record this step (nothing ran): run it, and the
                    // later ones, without a graph. Errors of the request itself are returned.
                    Err(Error::Device(_) | Error::Unsupported(_)) => {
                        self.recordable = false;
                        false
                    }
                    Err(e) => return Err(e),
                }
            };
            if queued {
                let mask_changed = set_mask(&self.backend, meanwhile)?;
                return self.backend.recorded_output(want, mask_changed);
            }
        }
        self.passes += 1;
        let (b, model, cache) = (&self.backend, &self.model, &mut self.cache);
        let rows = if every_row { LogitRows::All } else { LogitRows::Last };
        let logits = model.forward(b, tokens, start_pos, cache, rows)?;
        set_mask(b, meanwhile)?;
        Ok(match want {
            StepOutput::Logits | StepOutput::AllLogits => StepResult::Logits(b.to_host(&logits)?),
            StepOutput::Argmax { limit } => StepResult::Token(b.argmax(&logits, limit)?),
            StepOutput::ArgmaxEach { limit } => StepResult::Tokens(b.argmax_rows(&logits, limit)?),
            StepOutput::Draw { limit, temperature, u } => StepResult::Token(b.draw(&logits, limit, temperature, u)?),
            StepOutput::TopK { k, limit, temperature, cut } => {
                let best = b.top_k(&logits, k, limit)?;
                crate::backend::candidates_result(b, &logits, best, limit, temperature, cut)?
            }
        })
    }
}

/// Runs `meanwhile` and sets the mask it returns; whether it did.
fn set_mask<B: Backend>(b: &B, meanwhile: &mut Meanwhile<'_>) -> Result<bool> {
    match meanwhile()? {
        Some(mask) => b.set_token_mask(Some(&mask)).map(|()| true),
        None => Ok(false),
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

/// Ok(false) for an Unsupported error: the caller then does the work on the host.
fn supported(r: Result<()>) -> Result<bool> {
    match r {
        Ok(()) => Ok(true),
        Err(Error::Unsupported(_)) => Ok(false),
        Err(e) => Err(e),
    }
}
