//! Model directories: config, weights, generation defaults; and the architectures built from them.

pub mod config;
mod loader;
pub mod mlp;
pub mod qwen3;
pub mod qwen3_5;
mod qwen3_5_mtp;
pub mod safetensors;
pub mod synthetic;
pub mod weights;

use std::collections::HashMap;
use std::path::Path;

use serde_json::Value;

pub use config::{Architecture, ModelConfig};
pub use weights::{LoadProgress, WeightSource};

use crate::backend::kv_pool;
use crate::backend::{AttentionShape, Backend, Capability, KvRestore, QkNorms, Rope, StepOutput, StepResult};
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
    /// See `Backend::steps_round_alike`.
    fn steps_round_alike(&self) -> bool {
        true
    }

    /// Copies positions `start..end` of the cache out: every attention layer's keys and values,
    /// and with `with_state` every recurrent layer's state, which must then be at `end` (the
    /// last step ended there). The copy lives on the model's device until dropped.
    fn save(&mut self, start: usize, end: usize, with_state: bool) -> Result<SavedCache>;
    /// Writes saved pieces back, in order; they must follow one another from the first's start
    /// (positions before it are the cache's own). A model with recurrent layers needs the last
    /// piece's state, and continues from its end.
    fn restore(&mut self, pieces: &[&SavedCache]) -> Result<()>;
    /// Keeps only the positions before `end` of the last step, which ran from before `end` and
    /// was a checked one (`StepOutput::ArgmaxEach`): the cache is then as if the step had stopped
    /// at `end`. Later positions are overwritten anyway; a model with recurrent layers takes them
    /// back to their states at `end`, running only the recurrences again over the kept tokens.
    fn keep_until(&mut self, end: usize) -> Result<()>;
    /// See `Backend::free_memory`.
    fn free_memory(&self) -> Option<usize>;

    /// Sequences the model keeps caches for (see `set_slots`); the calls above act on the
    /// selected one.
    fn slots(&self) -> usize {
        1
    }
    /// Makes room for `n` sequences, each with its own cache: keys and values in blocks of the
    /// shared KV pool, taken as the sequence grows; recurrent states allocated now, so that a
    /// device that cannot hold them says so at load. Slot 0 keeps what it holds.
    fn set_slots(&mut self, n: usize) -> Result<()> {
        if n == 1 {
            return Ok(());
        }
        Err(Error::Unsupported(format!("{n} sequences at once on {}", self.backend_description())))
    }
    /// The sequence that `step`, `save` and `restore` act on from now on.
    fn select(&mut self, slot: usize) -> Result<()> {
        if slot == 0 {
            return Ok(());
        }
        Err(Error::InvalidArgument(format!("sequence slot {slot} of 1")))
    }
    /// One decode step of several sequences together (distinct slots, one token each): each
    /// row's result is what `step` of that slot alone gives, bit for bit where the backend's
    /// kernels are batch-invariant (see `Backend::linear`). The token mask and logit adjustments
    /// must be off.
    fn step_batch(&mut self, rows: &[BatchRow]) -> Result<Vec<StepResult>> {
        step_one_by_one(self, rows)
    }
    /// The sequence in the selected slot takes no further steps for now: batching stops
    /// waiting for it, and its KV blocks may go to other sequences (see `claim`).
    fn finish(&mut self) {}
    /// The selected slot is in use again: its blocks stay its own. Returns whether they went to
    /// other sequences since `finish` (its cache is then empty: its engine starts again from the
    /// prefix cache).
    fn claim(&mut self) -> bool {
        false
    }
    /// Takes the KV blocks the selected slot needs for positions `0..end` before a step
    /// (`Backend::reserve_kv`), from idle slots (`finish`) when the pool has none free;
    /// `Error::CacheFull`, nothing run, when even that leaves too few.
    fn reserve(&mut self, _end: usize) -> Result<()> {
        Ok(())
    }
    /// Sizes the KV pool that every slot takes its blocks from at about `bytes` (whole blocks,
    /// at least one per attention layer); each slot's cache starts empty. Returns the bytes.
    fn set_kv_cache_bytes(&mut self, _bytes: usize) -> Result<usize> {
        Ok(0)
    }
    /// KV blocks in use, blocks in the pool, and bytes a block (all layers' blocks count).
    fn kv_usage(&self) -> Option<KvUsage> {
        None
    }

    /// Whether the model's own multi-token-prediction head is loaded (see `draft`).
    fn can_draft(&self) -> bool {
        false
    }
    /// Whether the selected slot's steps keep what `draft` needs (their final hidden states; a
    /// recorded single-token step copies its own out).
    fn set_drafting(&mut self, _on: bool) {}
    /// Up to `k` tokens guessed by the multi-token-prediction head to follow `next`, the token
    /// chosen for position `pos` by the selected slot's last step (which ended at `pos`): each
    /// the largest of the first `limit` logits, until one whose probability is below `p_min`.
    /// The head's cache is first brought up to `pos` (`k = 0` does only that). Empty when that
    /// step kept nothing to draft from.
    fn draft(&mut self, _next: u32, _pos: usize, _k: usize, _limit: usize, _p_min: f32) -> Result<Vec<u32>> {
        Ok(Vec::new())
    }
}

/// `step_batch` as single steps, slot by slot (the same results).
fn step_one_by_one<M: LanguageModel + ?Sized>(model: &mut M, rows: &[BatchRow]) -> Result<Vec<StepResult>> {
    let mut out = Vec::with_capacity(rows.len());
    for row in rows {
        model.select(row.slot)?;
        out.push(model.step(&[row.token], row.pos, row.want)?);
    }
    Ok(out)
}

/// What the KV pool holds (`LanguageModel::kv_usage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvUsage {
    pub used_blocks: usize,
    pub blocks: usize,
    pub block_bytes: usize,
}

/// One sequence's token in a batched decode step (`LanguageModel::step_batch`).
#[derive(Debug, Clone, Copy)]
pub struct BatchRow {
    pub slot: usize,
    pub token: u32,
    pub pos: usize,
    pub want: StepOutput,
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
    /// and its delta-rule state `[1, value_heads·key_dim·value_dim]`; during a checked step, what
    /// it takes to go back into it; and, by step length, where checked steps keep their inputs
    /// (made at the first step of that length, then the same memory: a recorded checked step
    /// writes there at every replay).
    Recurrent { conv: B::Tensor, state: B::Tensor, checkpoint: Option<Checkpoint<B>>, kept: HashMap<usize, [B::Tensor; 3]> },
}

/// A recurrent layer's states before a checked step (`StepOutput::ArgmaxEach`, drafted tokens)
/// and that step's inputs to its recurrence: the states after any of the step's tokens follow
/// from them by running the recurrence again over the kept tokens, not the network
/// (`Network::rewind_recurrent`).
pub struct Checkpoint<B: Backend> {
    conv: B::Tensor,
    state: B::Tensor,
    /// Set once the step's inputs to the convolution `[T, C]`, and `a` and `b` `[T, Hv]`, are in
    /// the layer's `kept` tensors for T: T.
    inputs: Option<usize>,
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
            LayerCache::Recurrent { conv, state, .. } => Ok((conv, state)),
            LayerCache::Attention(_) => Err(Error::InvalidArgument("a recurrent layer got a KV cache".into())),
        }
    }

    pub fn new_recurrent(conv: B::Tensor, state: B::Tensor) -> Self {
        LayerCache::Recurrent { conv, state, checkpoint: None, kept: HashMap::new() }
    }

    /// Keeps a recurrent layer's inputs of a step of `rows` tokens where a checkpoint waits for
    /// them (a checked step of one sequence): copies them into its kept tensors for that length.
    pub fn keep_step_inputs(&mut self, b: &B, rows: usize, inputs: [B::Tensor; 3]) -> Result<()> {
        let LayerCache::Recurrent { checkpoint: Some(c), kept, .. } = self else { return Ok(()) };
        match kept.get_mut(&rows) {
            Some(tensors) => {
                for (x, to) in inputs.iter().zip(tensors) {
                    b.restore_tensor(x, to)?;
                }
            }
            None => {
                let [qkv, a, beta] = &inputs;
                kept.insert(rows, [b.save_tensor(qkv)?, b.save_tensor(a)?, b.save_tensor(beta)?]);
            }
        }
        c.inputs = Some(rows);
        Ok(())
    }

    /// Whether a checked step of `rows` tokens can be recorded: a recurrent layer has its kept
    /// tensors for that length (made by an earlier step: a recording must not allocate them).
    fn kept_for(&self, rows: usize) -> bool {
        match self {
            LayerCache::Recurrent { kept, .. } => kept.contains_key(&rows),
            LayerCache::Attention(_) => true,
        }
    }

    /// After a replayed checked step of `rows` tokens: its inputs are in the kept tensors the
    /// recording wrote (as `keep_step_inputs` left them when it was recorded).
    fn step_inputs_kept(&mut self, rows: usize) {
        if let LayerCache::Recurrent { checkpoint: Some(c), kept, .. } = self {
            if kept.contains_key(&rows) {
                c.inputs = Some(rows);
            }
        }
    }

    /// Puts a recurrent layer's states back as they were before its checked step, and returns
    /// that step's inputs (see `Checkpoint`).
    pub fn back_to_checkpoint(&mut self, b: &B) -> Result<[B::Tensor; 3]> {
        let LayerCache::Recurrent { conv, state, checkpoint, kept } = self else {
            return Err(Error::InvalidArgument("a recurrent layer got a KV cache".into()));
        };
        let Some(Checkpoint { conv: conv_before, state: state_before, inputs: Some(rows) }) = checkpoint.take() else {
            return Err(Error::InvalidArgument("no checked step of this layer to go back into".into()));
        };
        let Some([qkv, a, beta]) = kept.get(&rows) else {
            return Err(Error::InvalidArgument(format!("no kept inputs of a checked step of {rows} tokens")));
        };
        b.restore_tensor(&conv_before, conv)?;
        b.restore_tensor(&state_before, state)?;
        Ok([b.rows(qkv, 0, rows)?, b.rows(a, 0, rows)?, b.rows(beta, 0, rows)?])
    }

    /// Before a checked step: copies a recurrent layer's states to go back to.
    fn set_checkpoint(&mut self, b: &B) -> Result<()> {
        if let LayerCache::Recurrent { conv, state, checkpoint, .. } = self {
            *checkpoint = Some(Checkpoint { conv: b.save_tensor(conv)?, state: b.save_tensor(state)?, inputs: None });
        }
        Ok(())
    }

    fn drop_checkpoint(&mut self) {
        if let LayerCache::Recurrent { checkpoint, .. } = self {
            *checkpoint = None;
        }
    }
}

/// One architecture's network, loaded onto a backend.
pub trait Network<B: Backend>: Send + Sync {
    fn config(&self) -> &ModelConfig;
    /// A fresh cache per layer for `capacity` positions (recurrent states start at zero).
    fn new_cache(&self, b: &B, capacity: usize) -> Result<Vec<LayerCache<B>>>;
    /// Runs `tokens`, the tokens of each sequence of `seqs` in turn (`len` each, at positions
    /// `start_pos..` of its own cache, which must hold `0..start_pos`), and returns the logits
    /// of each sequence's last position (`[seqs, vocab_size]`, on the backend) or of every
    /// position (`[T, vocab_size]`).
    fn forward(&self, b: &B, tokens: &[u32], seqs: &mut [Seq<'_, B>], rows: LogitRows) -> Result<B::Tensor>;
    /// The multi-token-prediction head, where the network has one loaded.
    fn draft_head(&self) -> Option<&dyn DraftHead<B>> {
        None
    }
    /// Takes the recurrent layers of `cache` back to their states after the first `keep` tokens
    /// of its last step, a checked one (see `Checkpoint`). Networks without recurrent layers have
    /// nothing to do.
    fn rewind_recurrent(&self, _b: &B, _cache: &mut [LayerCache<B>], _keep: usize) -> Result<()> {
        Ok(())
    }
}

/// A network's multi-token-prediction head (Qwen3.5 / 3.6 `mtp.*`, see `qwen3_5_mtp`): it
/// drafts tokens for speculative decoding from the network's final hidden states.
/// Its layers' caches follow the network's own in `Network::new_cache`.
pub trait DraftHead<B: Backend> {
    /// `Network::forward` (the same logits) that also returns every position's final hidden
    /// state, `[T, H]`.
    fn forward_hidden(&self, b: &B, tokens: &[u32], seqs: &mut [Seq<'_, B>], rows: LogitRows) -> Result<(B::Tensor, B::Tensor)>;
    /// The head's layer `depth` (modulo its layers) over `hidden` (`[T, H]`: hidden states of
    /// positions `seq.start_pos..`, the network's or the head's own), each row with the token
    /// that follows its position (`next`); returns the head's hidden states `[T, H]`, whose
    /// logits guess the token after that, and which are fed back with it for the next guess.
    fn draft_step(&self, b: &B, hidden: &B::Tensor, next: &[u32], seq: &mut Seq<'_, B>, depth: usize) -> Result<B::Tensor>;
    /// The network's head on `x` `[T, H]`: `[T, vocab]`.
    fn draft_logits(&self, b: &B, x: &B::Tensor) -> Result<B::Tensor>;
}

/// One sequence of a forward pass: `len` tokens at `start_pos..` of `cache` (one per layer).
pub struct Seq<'a, B: Backend> {
    pub start_pos: usize,
    pub len: usize,
    pub cache: &'a mut [LayerCache<B>],
}

/// Runs `f` on each sequence's rows of `inputs` (in the order of `seqs`) and stacks what it
/// returns: the ops of a batched step that read a sequence's own cache (attention, recurrences).
fn per_seq<B: Backend, const N: usize>(
    b: &B,
    inputs: [B::Tensor; N],
    seqs: &mut [Seq<'_, B>],
    mut f: impl FnMut([B::Tensor; N], &mut Seq<'_, B>) -> Result<B::Tensor>,
) -> Result<B::Tensor> {
    if let [seq] = seqs {
        return f(inputs, seq);
    }
    let mut outs = Vec::with_capacity(seqs.len());
    let mut row = 0;
    for (i, seq) in seqs.iter_mut().enumerate() {
        let part: Vec<B::Tensor> = inputs.iter().map(|x| b.rows(x, row, seq.len)).collect::<Result<_>>()?;
        let part: [B::Tensor; N] = part.try_into().map_err(|_| Error::InvalidArgument("per_seq: input count".into()))?;
        b.sequence_row(i);
        let out = f(part, seq);
        b.sequence_row(0);
        outs.push(out?);
        row += seq.len;
    }
    b.stack_rows(&outs)
}

/// A layer's rotary attention (`Backend::rotary_attention`) for each sequence of a step, over its
/// own cache `layer`: a batch of one token each in one pass of the backend.
#[allow(clippy::too_many_arguments)]
fn rotary_attention<B: Backend>(
    b: &B,
    [q, k, v]: [B::Tensor; 3],
    norms: QkNorms<'_, B>,
    rope: &Rope,
    seqs: &mut [Seq<'_, B>],
    layer: usize,
    shape: AttentionShape,
) -> Result<B::Tensor> {
    if seqs.len() > 1 && seqs.iter().all(|s| s.len == 1) {
        let positions: Vec<usize> = seqs.iter().map(|s| s.start_pos).collect();
        let mut caches = seqs.iter_mut().map(|s| s.cache[layer].kv()).collect::<Result<Vec<_>>>()?;
        return b.rotary_attention_rows(q, k, &v, norms, rope, &mut caches, &positions, shape);
    }
    per_seq(b, [q, k, v], seqs, |[q, k, v], seq| b.rotary_attention(q, k, &v, norms, rope, seq.cache[layer].kv()?, seq.start_pos, shape))
}

/// Whose logits a forward pass computes: each sequence's last position's (generation), or every
/// position's (scoring a text: perplexity, KL divergence).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitRows {
    Last,
    All,
}

impl LogitRows {
    /// The rows of the final hidden states `x` `[T, H]` that go on to the head.
    fn of<B: Backend>(self, b: &B, x: B::Tensor, seqs: &[Seq<'_, B>]) -> Result<B::Tensor> {
        if self == LogitRows::All || seqs.iter().all(|s| s.len == 1) {
            return Ok(x);
        }
        if let [_] = seqs {
            return b.last_row(&x);
        }
        let mut end = 0;
        let mut last = Vec::with_capacity(seqs.len());
        for s in seqs {
            end += s.len;
            last.push(b.rows(&x, end - 1, 1)?);
        }
        b.stack_rows(&last)
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

/// One sequence's cache in a `Bound` model.
struct Slot<B: Backend> {
    cache: Vec<LayerCache<B>>,
    /// The position the recurrent states have reached (None after a failed step: they must
    /// start again). Models without recurrent layers ignore it.
    recurrent_at: Option<usize>,
    /// See `LanguageModel::set_drafting`.
    drafting: bool,
    /// The last step's final hidden states, until the drafting head has read them.
    held: Option<Held<B>>,
    /// Where recorded steps of T tokens leave their final hidden states `[T, H]`, by T (made
    /// before the first recording, which must not allocate them): `held` is then a view of one,
    /// read before the next replay.
    recorded_hidden: HashMap<usize, B::Tensor>,
    /// Positions whose keys and values the cache holds: a step starts at or before it.
    filled: usize,
    /// Finished (`LanguageModel::finish`) and not claimed since: its blocks may go to others.
    idle: bool,
    /// Its blocks went to others while it was idle (`LanguageModel::claim` says so once).
    lost: bool,
    /// The positions of the last step where it was a checked one of a model with recurrent
    /// layers, whose caches then hold a `Checkpoint` (see `LanguageModel::keep_until`).
    checked: Option<std::ops::Range<usize>>,
}

impl<B: Backend> Slot<B> {
    fn new(cache: Vec<LayerCache<B>>) -> Self {
        Slot { cache, recurrent_at: Some(0), drafting: false, held: None, recorded_hidden: HashMap::new(), filled: 0, idle: false, lost: false, checked: None }
    }

    /// After a recorded step of `tokens` at `start_pos`: the drafting head's rows are the
    /// recording's hidden states (with a head; else none).
    fn hold_recorded(&mut self, b: &B, with_head: bool, tokens: &[u32], start_pos: usize) -> Result<()> {
        self.held = match self.recorded_hidden.get(&tokens.len()).filter(|_| with_head) {
            Some(hidden) => Some(Held { hidden: b.rows(hidden, 0, tokens.len())?, start: start_pos, tokens: tokens.to_vec() }),
            None => None,
        };
        Ok(())
    }

    /// Frees the checkpoints of the last checked step: another step or a restore changes the states.
    fn forget_checked(&mut self) {
        self.checked = None;
        self.cache.iter_mut().for_each(LayerCache::drop_checkpoint);
    }
}

/// A step's final hidden states `[T, H]`, of positions `start..start + tokens.len()`, and the
/// tokens it ran: the drafting head pairs each row with the token at the next position.
struct Held<B: Backend> {
    hidden: B::Tensor,
    start: usize,
    tokens: Vec<u32>,
}

impl<B: Backend> Held<B> {
    fn end(&self) -> usize {
        self.start + self.tokens.len()
    }
}

pub struct Bound<B: Backend> {
    backend: B,
    model: Box<dyn Network<B>>,
    slots: Vec<Slot<B>>,
    /// The slot `step`, `save` and `restore` act on.
    current: usize,
    recurrent: bool,
    /// Positions each cache was made for. A replayed decode step writes where its device-side
    /// position says, unchecked, so every step is held within this before it reaches a backend.
    ctx_size: usize,
    /// Forward passes so far: decode steps are recorded only once everything they touch exists.
    passes: usize,
    /// False once the backend failed to record a decode step: later steps run without a graph.
    recordable: bool,
    /// The same for checked steps of one sequence (several tokens).
    checked_recordable: bool,
    costs: StepCosts,
}

/// Seconds per token of recent batched decode steps and of recent single ones, as running
/// averages. Where a batch costs more per token than single steps do (weights whose kernels take
/// one token at a time gain nothing from a batch, and single steps replay a recorded graph), its
/// rows run as single steps, with the same results, once `MEASURED_BATCHES` batches have been
/// timed; every `RETRY_BATCH`-th batch is run as one again, in case that changed.
#[derive(Default)]
struct StepCosts {
    batched: Option<f64>,
    single: Option<f64>,
    /// Batched steps timed.
    batches: u32,
    /// Batches run as single steps since the last batched step.
    unbatched: u32,
}

const MEASURED_BATCHES: u32 = 8;
const RETRY_BATCH: u32 = 64;

impl StepCosts {
    fn note(average: &mut Option<f64>, seconds_per_token: f64) {
        *average = Some(average.map_or(seconds_per_token, |a| 0.8 * a + 0.2 * seconds_per_token));
    }

    /// Whether the next batch runs as single steps.
    fn unbatch(&mut self) -> bool {
        let measured = self.batches >= MEASURED_BATCHES;
        let cheaper_alone = measured && matches!((self.batched, self.single), (Some(b), Some(s)) if b > s);
        if cheaper_alone && self.unbatched < RETRY_BATCH {
            self.unbatched += 1;
            return true;
        }
        self.unbatched = 0;
        false
    }
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
        // A pool for one sequence of the whole context, as each slot had its own cache before
        // pools (the engine sizes it for its sequences: `set_kv_cache_bytes`).
        let c = model.config();
        let blocks = kv_pool::blocks_for(ctx_size)
            .checked_mul(c.attention_layers().max(1))
            .filter(|_| ctx_size <= i32::MAX as usize)
            .ok_or_else(|| Error::InvalidArgument(format!("a context of {ctx_size} positions: the kernels take positions as 32-bit integers")))?;
        backend.set_kv_pool(c.kv_width(), blocks)?;
        let cache = model.new_cache(&backend, ctx_size)?;
        let recurrent = cache.iter().any(|c| matches!(c, LayerCache::Recurrent { .. }));
        let slots = vec![Slot::new(cache)];
        Ok(Bound { backend, model, slots, current: 0, recurrent, ctx_size, passes: 0, recordable: true, checked_recordable: true, costs: StepCosts::default() })
    }

    /// The checks every step makes of one sequence's tokens before they reach a backend.
    fn check_step(&self, tokens: &[u32], start_pos: usize) -> Result<()> {
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
        Ok(())
    }

    /// Takes the KV blocks `slot` needs for positions `0..end`, taking back those of idle
    /// slots when the pool has too few free (see `LanguageModel::reserve`).
    fn reserve_slot(&mut self, slot: usize, end: usize) -> Result<()> {
        match self.try_reserve(slot, end) {
            Err(Error::CacheFull(_)) if self.reclaim(slot)? > 0 => self.try_reserve(slot, end),
            other => other,
        }
        .map_err(|e| match e {
            Error::CacheFull(why) => Error::CacheFull(format!(
                "{why} (other sequences hold the rest: a larger kv_cache_bytes, or fewer sequences at once, makes room)"
            )),
            e => e,
        })
    }

    fn try_reserve(&mut self, slot: usize, end: usize) -> Result<()> {
        let b = &self.backend;
        for layer in &mut self.slots[slot].cache {
            if let LayerCache::Attention(kv) = layer {
                b.reserve_kv(kv, end)?;
            }
        }
        Ok(())
    }

    /// Empties the caches of idle slots other than `keep`, giving their blocks back to the pool;
    /// returns how many it emptied.
    fn reclaim(&mut self, keep: usize) -> Result<usize> {
        let mut emptied = 0;
        for i in 0..self.slots.len() {
            let slot = &self.slots[i];
            if i == keep || !slot.idle || slot.filled == 0 {
                continue;
            }
            // The recorded steps point at the old caches' block tables.
            let cache = self.model.new_cache(&self.backend, self.ctx_size)?;
            let slot = &mut self.slots[i];
            *slot = Slot { drafting: slot.drafting, recorded_hidden: std::mem::take(&mut slot.recorded_hidden), lost: true, idle: true, ..Slot::new(cache) };
            emptied += 1;
        }
        Ok(emptied)
    }

    /// The checks of a step of `slot` at `start_pos`, then its blocks: a failure changes nothing.
    fn prepare_step(&mut self, slot: usize, start_pos: usize, end: usize) -> Result<()> {
        self.slots[slot].idle = false;
        let filled = self.slots[slot].filled;
        if start_pos > filled {
            return Err(Error::InvalidArgument(format!(
                "a step at position {start_pos}, but the cache holds only the {filled} positions before it"
            )));
        }
        self.prepare_recurrent(slot, start_pos)?;
        if let Err(e) = self.reserve_slot(slot, end) {
            // Nothing ran: the recurrent state is still at start_pos.
            self.slots[slot].recurrent_at = Some(start_pos);
            return Err(e);
        }
        // Positions from start_pos on are rewritten; until the step succeeds they hold nothing.
        self.slots[slot].filled = start_pos;
        self.slots[slot].forget_checked();
        Ok(())
    }

    /// Recurrent states continue only from where they are; position 0 starts them again.
    fn prepare_recurrent(&mut self, slot: usize, start_pos: usize) -> Result<()> {
        if !self.recurrent {
            return Ok(());
        }
        let at = self.slots[slot].recurrent_at;
        if start_pos == 0 && at != Some(0) {
            self.slots[slot].cache = self.model.new_cache(&self.backend, self.ctx_size)?;
        } else if at != Some(start_pos) {
            return Err(Error::InvalidArgument(format!(
                "a step at position {start_pos}, but the recurrent layers' state is {}",
                at.map_or("lost after a failed step".to_string(), |p| format!("at position {p}"))
            )));
        }
        self.slots[slot].recurrent_at = None;
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

    fn steps_round_alike(&self) -> bool {
        self.backend.steps_round_alike()
    }

    fn step_with(&mut self, tokens: &[u32], start_pos: usize, want: StepOutput, meanwhile: &mut Meanwhile<'_>) -> Result<StepResult> {
        self.check_step(tokens, start_pos)?;
        let end = start_pos + tokens.len();
        self.prepare_step(self.current, start_pos, end)?;
        let checked = self.recurrent && matches!(want, StepOutput::ArgmaxEach { .. });
        if checked {
            let slot = &mut self.slots[self.current];
            if let Err(e) = slot.cache.iter_mut().try_for_each(|layer| layer.set_checkpoint(&self.backend)) {
                slot.forget_checked();
                // Nothing ran: the recurrent state is still at start_pos.
                slot.recurrent_at = Some(start_pos);
                return Err(e);
            }
        }
        let began = std::time::Instant::now();
        let out = self.run_step(tokens, start_pos, want, meanwhile)?;
        if tokens.len() == 1 {
            StepCosts::note(&mut self.costs.single, began.elapsed().as_secs_f64());
        }
        let slot = &mut self.slots[self.current];
        (slot.recurrent_at, slot.filled) = (Some(end), end);
        slot.checked = checked.then_some(start_pos..end);
        Ok(out)
    }

    fn keep_until(&mut self, end: usize) -> Result<()> {
        let slot = &mut self.slots[self.current];
        if self.recurrent {
            let Some(step) = slot.checked.take().filter(|s| s.start < end && end <= s.end && slot.recurrent_at == Some(s.end)) else {
                slot.forget_checked();
                return Err(Error::InvalidArgument(format!("keep_until {end}: the last step was not a checked one through position {end}")));
            };
            if end < step.end {
                // A failure leaves the states somewhere in between: they must start again.
                slot.recurrent_at = None;
                self.model.rewind_recurrent(&self.backend, &mut slot.cache, end - step.start)?;
            }
            slot.forget_checked();
            slot.recurrent_at = Some(end);
        }
        slot.filled = slot.filled.min(end);
        if let Some(held) = &mut slot.held {
            // The drafting head catches up from the kept positions only.
            held.tokens.truncate(end.saturating_sub(held.start));
            if held.tokens.is_empty() {
                slot.held = None;
            }
        }
        Ok(())
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
        let slot = &self.slots[self.current];
        if end > slot.filled {
            return Err(Error::InvalidArgument(format!("save: positions {start}..{end}, but the cache holds {}", slot.filled)));
        }
        let with_state = with_state && self.recurrent;
        if with_state && slot.recurrent_at != Some(end) {
            return Err(Error::InvalidArgument(format!("save: a state at position {end}, but the recurrent layers are elsewhere")));
        }
        let b = &self.backend;
        let attention: Vec<&B::KvCache> = slot.cache.iter().filter_map(|l| if let LayerCache::Attention(kv) = l { Some(kv) } else { None }).collect();
        let mut saved_kv = b.save_kv(&attention, start, end - start)?.into_iter();
        let mut bytes = 0;
        let mut layers = Vec::with_capacity(slot.cache.len());
        for layer in &slot.cache {
            layers.push(match layer {
                LayerCache::Attention(_) => {
                    let saved = saved_kv.next().ok_or_else(|| Error::Device("save_kv returned fewer copies than caches".into()))?;
                    bytes += b.kv_bytes(&saved);
                    SavedLayer::<B>::Kv(saved)
                }
                LayerCache::Recurrent { conv, state, .. } if with_state => {
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
        let first = pieces[0].start;
        if first > self.slots[self.current].filled {
            return Err(Error::InvalidArgument(format!(
                "restore: pieces from position {first}, but the cache holds only {}",
                self.slots[self.current].filled
            )));
        }
        self.slots[self.current].idle = false;
        self.reserve_slot(self.current, last.end)?;
        let slot = &mut self.slots[self.current];
        // A half-written cache is no state to continue from.
        slot.recurrent_at = None;
        slot.forget_checked();
        slot.filled = first;
        slot.held = None;
        let other_model = || Error::InvalidArgument("restore: the pieces were saved by another model".into());
        let saved: Vec<&Vec<SavedLayer<B>>> = pieces
            .iter()
            .map(|piece| piece.layers.downcast_ref::<Vec<SavedLayer<B>>>().filter(|l| l.len() == slot.cache.len()))
            .collect::<Option<_>>()
            .ok_or_else(other_model)?;
        let mut restores = Vec::new();
        for (i, live) in slot.cache.iter_mut().enumerate() {
            match live {
                LayerCache::Attention(cache) => {
                    let pieces = pieces.iter().zip(&saved).map(|(piece, layers)| match &layers[i] {
                        SavedLayer::Kv(kv) => Ok((kv, piece.start)),
                        _ => Err(other_model()),
                    });
                    restores.push(KvRestore { cache, pieces: pieces.collect::<Result<_>>()? });
                }
                LayerCache::Recurrent { conv: c, state: s, .. } => {
                    if saved.iter().any(|layers| matches!(layers[i], SavedLayer::Kv(_))) {
                        return Err(other_model());
                    }
                    // The last piece's state is the one at its end (checked above to be there).
                    if let Some(SavedLayer::State { conv, state }) = saved.last().map(|layers| &layers[i]) {
                        self.backend.restore_tensor(conv, c)?;
                        self.backend.restore_tensor(state, s)?;
                    }
                }
            }
        }
        self.backend.restore_kv(&mut restores)?;
        (slot.recurrent_at, slot.filled) = (Some(last.end), last.end);
        Ok(())
    }

    fn slots(&self) -> usize {
        self.slots.len()
    }

    fn set_slots(&mut self, n: usize) -> Result<()> {
        if n == 0 {
            return Err(Error::InvalidArgument("a model for no sequences".into()));
        }
        self.backend.plan_sequences(n);
        self.slots.truncate(n);
        while self.slots.len() < n {
            let cache = self.model.new_cache(&self.backend, self.ctx_size).map_err(|e| {
                Error::Device(format!("the cache of sequence {} of {n} does not fit: {e}", self.slots.len() + 1))
            })?;
            self.slots.push(Slot::new(cache));
        }
        self.current = self.current.min(n - 1);
        Ok(())
    }

    fn finish(&mut self) {
        self.slots[self.current].idle = true;
    }

    fn claim(&mut self) -> bool {
        let slot = &mut self.slots[self.current];
        slot.idle = false;
        std::mem::take(&mut slot.lost)
    }

    fn reserve(&mut self, end: usize) -> Result<()> {
        self.reserve_slot(self.current, end)
    }

    fn set_kv_cache_bytes(&mut self, bytes: usize) -> Result<usize> {
        let c = self.model.config();
        let (width, layers) = (c.kv_width(), c.attention_layers().max(1));
        let block = self.backend.kv_block_bytes(width).max(1);
        let blocks = (bytes / block).max(layers);
        // The old caches and pool go first: their memory is the new pool's.
        for slot in &mut self.slots {
            slot.cache = Vec::new();
        }
        self.backend.set_kv_pool(width, blocks)?;
        for i in 0..self.slots.len() {
            self.slots[i] = Slot::new(self.model.new_cache(&self.backend, self.ctx_size)?);
        }
        Ok(blocks * block)
    }

    fn kv_usage(&self) -> Option<KvUsage> {
        let (used_blocks, blocks) = self.backend.kv_pool_usage()?;
        Some(KvUsage { used_blocks, blocks, block_bytes: self.backend.kv_block_bytes(self.model.config().kv_width()) })
    }

    fn select(&mut self, slot: usize) -> Result<()> {
        if slot >= self.slots.len() {
            return Err(Error::InvalidArgument(format!("sequence slot {slot} of {}", self.slots.len())));
        }
        self.current = slot;
        Ok(())
    }

    fn step_batch(&mut self, rows: &[BatchRow]) -> Result<Vec<StepResult>> {
        if rows.len() == 1 || self.costs.unbatch() {
            return step_one_by_one(self, rows);
        }
        if !rows.is_sorted_by_key(|r| r.slot) {
            // Rows by slot: a set of slots decoding together then has one recording, whatever
            // order its tokens arrived in (each row's result does not depend on its place).
            let mut order: Vec<usize> = (0..rows.len()).collect();
            order.sort_by_key(|&i| rows[i].slot);
            let sorted: Vec<BatchRow> = order.iter().map(|&i| rows[i]).collect();
            let mut out: Vec<Option<StepResult>> = rows.iter().map(|_| None).collect();
            for (i, result) in order.into_iter().zip(self.step_batch(&sorted)?) {
                out[i] = Some(result);
            }
            return Ok(out.into_iter().flatten().collect());
        }
        let began = std::time::Instant::now();
        let mut taken = vec![false; self.slots.len()];
        for row in rows {
            if row.slot >= taken.len() || std::mem::replace(&mut taken[row.slot], true) {
                return Err(Error::InvalidArgument(format!("step_batch: slot {} missing or twice", row.slot)));
            }
            if matches!(row.want, StepOutput::AllLogits | StepOutput::ArgmaxEach { .. }) {
                return Err(Error::InvalidArgument("step_batch: one output per sequence".into()));
            }
            self.check_step(&[row.token], row.pos)?;
        }
        for row in rows {
            self.prepare_step(row.slot, row.pos, row.pos + 1)?;
        }
        self.passes += 1;
        let tokens: Vec<u32> = rows.iter().map(|r| r.token).collect();
        let (b, model, slots) = (&self.backend, &self.model, &mut self.slots);
        let mut forward = || {
            let mut caches: Vec<Option<&mut Slot<B>>> = slots.iter_mut().map(Some).collect();
            let mut seqs: Vec<Seq<'_, B>> = rows
                .iter()
                .map(|r| {
                    let slot = caches[r.slot].take().ok_or_else(|| Error::InvalidArgument("step_batch: slot twice".into()))?;
                    Ok(Seq { start_pos: r.pos, len: 1, cache: &mut slot.cache })
                })
                .collect::<Result<_>>()?;
            model.forward(b, &tokens, &mut seqs, LogitRows::Last) // [rows, vocab]
        };
        // Each set of slots decoding together has its own recording (it points at their caches).
        let mut recorded = None;
        if self.recordable {
            let (key, positions): (Vec<usize>, Vec<usize>) = rows.iter().map(|r| (r.slot, r.pos)).unzip();
            recorded = match b.replay_batch(&key, &tokens, &positions)? {
                Some(logits) => Some(logits),
                None => match b.record_batch(&key, &tokens, &positions, model.config().vocab_size, &mut forward) {
                    Ok(logits) => logits,
                    // As in run_step: the driver could not record (nothing ran).
                    Err(Error::Device(_) | Error::Unsupported(_)) => {
                        self.recordable = false;
                        None
                    }
                    Err(e) => return Err(e),
                },
            };
        }
        let logits = match recorded {
            Some(logits) => logits,
            None => forward()?,
        };
        let mut out = Vec::with_capacity(rows.len());
        let first = rows.first().map(|r| r.want);
        match first {
            // Greedy rows alike (the common case): one download for all their choices.
            Some(StepOutput::Argmax { limit }) if rows.iter().all(|r| Some(r.want) == first) => {
                out.extend(b.argmax_rows(&logits, limit)?.into_iter().map(StepResult::Token));
            }
            _ => {
                for (i, row) in rows.iter().enumerate() {
                    out.push(choose(b, &b.rows(&logits, i, 1)?, row.want)?);
                }
            }
        }
        for row in rows {
            let slot = &mut self.slots[row.slot];
            (slot.recurrent_at, slot.filled) = (Some(row.pos + 1), row.pos + 1);
            slot.held = None;
        }
        StepCosts::note(&mut self.costs.batched, began.elapsed().as_secs_f64() / rows.len() as f64);
        self.costs.batches = self.costs.batches.saturating_add(1);
        Ok(out)
    }

    fn can_draft(&self) -> bool {
        self.model.draft_head().is_some()
    }

    fn set_drafting(&mut self, on: bool) {
        let slot = &mut self.slots[self.current];
        slot.drafting = on && self.model.draft_head().is_some();
        if !slot.drafting {
            slot.held = None;
        }
    }

    fn draft(&mut self, next: u32, pos: usize, k: usize, limit: usize, p_min: f32) -> Result<Vec<u32>> {
        if self.model.draft_head().is_none() {
            return Ok(Vec::new());
        }
        // The head's cache takes positions up to pos + k.
        self.reserve_slot(self.current, (pos + k + 1).min(self.ctx_size))?;
        let Some(head) = self.model.draft_head() else { return Ok(Vec::new()) };
        let b = &self.backend;
        let slot = &mut self.slots[self.current];
        // The hidden state of position pos - 1 is where the drafts start from.
        let Some(held) = slot.held.take().filter(|h| h.start < pos && pos <= h.end()) else { return Ok(Vec::new()) };
        let mut g = catch_up(b, head, &mut slot.cache, &held, pos, next)?; // [rows, H]
        let mut drafts = Vec::with_capacity(k);
        // The head's guess after position pos - 1 + depth, fed back for the next.
        for depth in 0..k {
            let last = b.last_row(&g)?;
            let logits = head.draft_logits(b, &last)?;
            let Some(&(best, value)) = b.top_k(&logits, 1, limit)?.first() else { break };
            if p_min > 0.0 && (value - b.log_partition(&logits, limit, 1.0)?.raw).exp() < p_min {
                break;
            }
            drafts.push(best);
            if depth + 1 == k || pos + depth >= self.ctx_size {
                break;
            }
            let mut seq = Seq { start_pos: pos + depth, len: 1, cache: &mut slot.cache };
            g = head.draft_step(b, &last, &drafts[depth..], &mut seq, depth + 1)?;
        }
        Ok(drafts)
    }
}

/// Runs the drafting head over `held`'s rows up to position `pos` (each with the token that
/// followed it; `next` at `pos`), writing its cache there; returns its hidden states.
fn catch_up<B: Backend>(b: &B, head: &dyn DraftHead<B>, cache: &mut [LayerCache<B>], held: &Held<B>, pos: usize, next: u32) -> Result<B::Tensor> {
    let len = pos - held.start;
    let rows = b.rows(&held.hidden, 0, len)?;
    let following: Vec<u32> = held.tokens[1..len].iter().copied().chain([next]).collect();
    let mut seq = Seq { start_pos: held.start, len, cache };
    head.draft_step(b, &rows, &following, &mut seq, 0)
}

impl<B: Backend + 'static> Bound<B> {
    /// Queues the step (a recorded decode graph where one fits), runs `meanwhile` while the
    /// device works, sets the mask it returns, then makes the choice.
    fn run_step(&mut self, tokens: &[u32], start_pos: usize, want: StepOutput, meanwhile: &mut Meanwhile<'_>) -> Result<StepResult> {
        let vocab = self.model.config().vocab_size;
        let every_row = matches!(want, StepOutput::AllLogits | StepOutput::ArgmaxEach { .. });
        let current = self.current;
        let head = self.model.draft_head().filter(|_| self.slots[current].drafting);
        if let Some(head) = head {
            // The previous step's last rows pair with this step's first token.
            let slot = &mut self.slots[current];
            if let Some(held) = slot.held.take().filter(|h| h.end() == start_pos) {
                catch_up(&self.backend, head, &mut slot.cache, &held, start_pos, tokens[0])?;
            }
        }
        if let ([token], true) = (tokens, self.passes > 0 && self.recordable && !every_row) {
            let (b, model) = (&self.backend, &self.model);
            let slot = &mut self.slots[current];
            if head.is_some() && !slot.recorded_hidden.contains_key(&1) {
                slot.recorded_hidden.insert(1, b.upload_vector(&vec![0.0; model.config().hidden_size])?);
            }
            let (cache, recorded_hidden) = (&mut slot.cache, &mut slot.recorded_hidden);
            let mut seqs = [Seq { start_pos, len: 1, cache }];
            // Each slot has its own recordings (they point at its caches), one keeping the
            // final hidden state for the drafting head and one not.
            let key = 2 * current + usize::from(head.is_some());
            let queued = b.replay_decode(key, *token, start_pos, want)? || {
                let mut step = || match head {
                    Some(head) => {
                        let (hidden, logits) = head.forward_hidden(b, tokens, &mut seqs, LogitRows::Last)?;
                        keep_hidden(b, recorded_hidden, 1, hidden)?;
                        Ok(logits)
                    }
                    None => model.forward(b, tokens, &mut seqs, LogitRows::Last),
                };
                match b.record_decode(key, *token, start_pos, vocab, want, &mut step) {
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
                self.slots[current].hold_recorded(&self.backend, head.is_some(), tokens, start_pos)?;
                let mask_changed = set_mask(&self.backend, meanwhile)?;
                return self.backend.recorded_output(want, mask_changed);
            }
        }
        if let (StepOutput::ArgmaxEach { limit }, true) = (want, tokens.len() > 1 && self.passes > 0 && self.checked_recordable) {
            if let Some(logits) = self.recorded_checked_step(tokens, start_pos)? {
                set_mask(&self.backend, meanwhile)?;
                return Ok(StepResult::Tokens(self.backend.argmax_rows(&logits, limit)?));
            }
        }
        let head = self.model.draft_head().filter(|_| self.slots[current].drafting);
        self.passes += 1;
        let (b, model) = (&self.backend, &self.model);
        let slot = &mut self.slots[current];
        let rows = if every_row { LogitRows::All } else { LogitRows::Last };
        let logits = match head {
            Some(head) => {
                let mut seqs = [Seq { start_pos, len: tokens.len(), cache: &mut slot.cache }];
                let (hidden, logits) = head.forward_hidden(b, tokens, &mut seqs, rows)?;
                if matches!(want, StepOutput::ArgmaxEach { .. }) && !slot.recorded_hidden.contains_key(&tokens.len()) {
                    // Where later checked steps of this length, recorded, leave theirs.
                    slot.recorded_hidden.insert(tokens.len(), b.save_tensor(&hidden)?);
                }
                slot.held = Some(Held { hidden, start: start_pos, tokens: tokens.to_vec() });
                logits
            }
            None => {
                slot.held = None;
                let mut seqs = [Seq { start_pos, len: tokens.len(), cache: &mut slot.cache }];
                model.forward(b, tokens, &mut seqs, rows)?
            }
        };
        set_mask(b, meanwhile)?;
        choose(b, &logits, want)
    }

    /// A checked step of one sequence (`ArgmaxEach`, the drafts' check) as a recorded pass, one
    /// recording per slot, drafting head and step length (they point at that slot's caches and
    /// kept tensors): replayed, or recorded now. Its logits `[T, vocab]`, valid until the next
    /// recording; None where the backend records none (the step has not run). A recording the
    /// driver refuses turns such recordings off for this model (nothing ran).
    fn recorded_checked_step(&mut self, tokens: &[u32], start_pos: usize) -> Result<Option<B::Tensor>> {
        let (b, model, current) = (&self.backend, &self.model, self.current);
        let head = model.draft_head().filter(|_| self.slots[current].drafting);
        let slot = &self.slots[current];
        // The first step of this length runs as it is, making what the recording writes into.
        if !slot.cache.iter().all(|layer| layer.kept_for(tokens.len())) || (head.is_some() && !slot.recorded_hidden.contains_key(&tokens.len())) {
            return Ok(None);
        }
        // Never a batch's key (a batch's are its slots).
        let key = [usize::MAX, 2 * current + usize::from(head.is_some()), tokens.len()];
        let positions: Vec<usize> = (start_pos..start_pos + tokens.len()).collect();
        let mut logits = b.replay_batch(&key, tokens, &positions)?;
        if logits.is_none() {
            let slot = &mut self.slots[current];
            let (cache, recorded_hidden) = (&mut slot.cache, &mut slot.recorded_hidden);
            let mut forward = || {
                let mut seqs = [Seq { start_pos, len: tokens.len(), cache: &mut *cache }];
                match head {
                    Some(head) => {
                        let (hidden, logits) = head.forward_hidden(b, tokens, &mut seqs, LogitRows::All)?;
                        keep_hidden(b, recorded_hidden, tokens.len(), hidden)?;
                        Ok(logits)
                    }
                    None => model.forward(b, tokens, &mut seqs, LogitRows::All),
                }
            };
            logits = match b.record_batch(&key, tokens, &positions, model.config().vocab_size, &mut forward) {
                Ok(logits) => logits,
                Err(Error::Device(_) | Error::Unsupported(_)) => {
                    self.checked_recordable = false;
                    None
                }
                Err(e) => return Err(e),
            };
        }
        if logits.is_some() {
            self.passes += 1;
            let slot = &mut self.slots[current];
            slot.cache.iter_mut().for_each(|layer| layer.step_inputs_kept(tokens.len()));
            slot.hold_recorded(b, head.is_some(), tokens, start_pos)?;
        }
        Ok(logits)
    }
}

/// Copies a recorded step's final hidden states `[T, H]` to where its replays leave them
/// (`Slot::recorded_hidden`, made before the recording).
fn keep_hidden<B: Backend>(b: &B, recorded_hidden: &mut HashMap<usize, B::Tensor>, rows: usize, hidden: B::Tensor) -> Result<()> {
    let to = recorded_hidden.get_mut(&rows).ok_or_else(|| Error::InvalidArgument(format!("no room for the hidden states of a recorded step of {rows} tokens")))?;
    b.restore_tensor(&hidden, to)
}

/// What `want` asks of a step's logits.
fn choose<B: Backend>(b: &B, logits: &B::Tensor, want: StepOutput) -> Result<StepResult> {
    Ok(match want {
        StepOutput::Logits | StepOutput::AllLogits => StepResult::Logits(b.to_host(logits)?),
        StepOutput::Argmax { limit } => StepResult::Token(b.argmax(logits, limit)?),
        StepOutput::ArgmaxEach { limit } => StepResult::Tokens(b.argmax_rows(logits, limit)?),
        StepOutput::Draw { limit, temperature, u } => StepResult::Token(b.draw(logits, limit, temperature, u)?),
        StepOutput::TopK { k, limit, temperature, cut } => {
            let best = b.top_k(logits, k, limit)?;
            crate::backend::candidates_result(b, logits, best, limit, temperature, cut)?
        }
    })
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
