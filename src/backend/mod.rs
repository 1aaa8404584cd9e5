//! The Backend trait: the coarse operations a decoder needs. Model code is written once over it; the
//! CPU backend is the reference every other backend is tested against.

pub mod cpu;
pub mod gpu;
pub mod kv_pool;

use crate::sampling::{Adjustment, Cut, LogPartition};
use crate::quant::QuantMatrix;
use crate::Result;

/// Rotary embedding parameters shared by every layer: `inv_freq[i]` rotates the pair
/// `(x[i], x[i + r/2])` of each head by `position * inv_freq[i]` (the "rotate half" layout), where
/// r = 2 · inv_freq.len() is the rotated part of the head: all of it, or its first dimensions
/// (partial rotary, Qwen3.5); the rest passes through.
#[derive(Debug, Clone)]
pub struct Rope {
    pub head_dim: usize,
    pub inv_freq: Vec<f32>,
}

/// One cache's saved pieces to write back (`Backend::restore_kv`), each with the position it
/// starts at.
pub struct KvRestore<'a, C> {
    pub cache: &'a mut C,
    pub pieces: Vec<(&'a C, usize)>,
}

/// Shape of one attention call: `num_heads` query heads share `num_kv_heads` key/value heads.
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

/// A projection `x · weightᵀ (+ bias)`.
pub struct Proj<'a, B: Backend + ?Sized> {
    pub weight: &'a B::Weight,
    pub bias: Option<&'a B::Tensor>,
}

/// Qwen3's per-head RMSNorm weights for q and k (None for Llama), with the norm's epsilon.
pub struct QkNorms<'a, B: Backend + ?Sized> {
    pub q: Option<&'a B::Tensor>,
    pub k: Option<&'a B::Tensor>,
    pub eps: f32,
}

impl<B: Backend + ?Sized> Clone for QkNorms<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend + ?Sized> Copy for QkNorms<'_, B> {}

/// A gated MLP `down(silu(gate(x)) * up(x))`: one expert of a mixture of experts.
pub struct GatedMlp<B: Backend + ?Sized> {
    pub gate: B::Weight,
    pub up: B::Weight,
    pub down: B::Weight,
}

/// The shared expert of a mixture-of-experts layer (Qwen3.5-MoE): its MLP, and the `[T, 1]`
/// logits of the sigmoid gate that scales its output.
pub struct SharedExpert<'a, B: Backend + ?Sized> {
    pub mlp: &'a GatedMlp<B>,
    pub gate_logits: &'a B::Tensor,
}

/// One expert's matrices on the host, as a checkpoint gives them, before a backend takes a layer's
/// experts with [`Backend::upload_experts`].
pub type HostMlp = GatedMlp<cpu::CpuBackend>;

/// How a token's router logits choose its experts: softmax over every expert, the `top_k`
/// largest probabilities (ties to the lower index), renormalised to sum to one when `normalize`.
#[derive(Debug, Clone, Copy)]
pub struct Routing {
    pub top_k: usize,
    pub normalize: bool,
}

/// Shape of a Gated DeltaNet layer: `key_heads` query/key heads of `key_dim`, each serving
/// `value_heads / key_heads` consecutive value heads of `value_dim`.
#[derive(Debug, Clone, Copy)]
pub struct DeltaShape {
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
}

impl DeltaShape {
    /// Channels of the concatenated q | k | v.
    pub fn qkv_width(&self) -> usize {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }

    pub fn state_len(&self) -> usize {
        self.value_heads * self.key_dim * self.value_dim
    }
}

/// The weights of a Gated DeltaNet layer that its recurrence reads: the conv1d taps `[1, C·K]`,
/// A_log and dt_bias `[Hv]`.
pub struct DeltaWeights<'a, B: Backend + ?Sized> {
    pub conv1d: &'a B::Tensor,
    pub a_log: &'a B::Tensor,
    pub dt_bias: &'a B::Tensor,
}

impl<B: Backend + ?Sized> Clone for DeltaWeights<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B: Backend + ?Sized> Copy for DeltaWeights<'_, B> {}

/// What a network may need beyond the dense decoder, asked of a backend before a model is loaded
/// onto it, so that a backend without it is refused at load (and `--device auto` moves on).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capability {
    MixtureOfExperts,
    /// Gated DeltaNet layers: conv1d with state, the gated delta rule, gated RMSNorm.
    GatedDeltaNet,
    /// Attention output gated by sigmoid (Qwen3.5's full-attention layers).
    SigmoidGate,
    /// Rotary embedding of only the first dimensions of each head.
    PartialRotary,
    /// Attention heads of this many values.
    HeadDim(usize),
}

impl std::fmt::Display for Capability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Capability::MixtureOfExperts => write!(f, "mixture-of-experts layers"),
            Capability::GatedDeltaNet => write!(f, "Gated DeltaNet layers"),
            Capability::SigmoidGate => write!(f, "sigmoid-gated attention"),
            Capability::PartialRotary => write!(f, "partial rotary embeddings"),
            Capability::HeadDim(d) => write!(f, "attention heads of {d} values"),
        }
    }
}

/// What a decode step hands back to the host.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StepOutput {
    /// Every logit, for sampling on the host.
    Logits,
    /// Every logit of every position of the step, `[T, vocab]` row-major (scoring a text).
    AllLogits,
    /// Only the index of the largest logit among the first `limit` (greedy decoding).
    Argmax { limit: usize },
    /// That index for every position of the step (greedy verification of drafted tokens).
    ArgmaxEach { limit: usize },
    /// The `k` largest logits among the first `limit`, as (id, logit), largest first (top-k
    /// sampling), with their log-partition at `temperature` when Some; every logit instead (as
    /// the choice sees them: adjusted, the mask applied) when `cut` does not fall among them.
    TopK { k: usize, limit: usize, temperature: Option<f32>, cut: Option<Cut> },
    /// The id the uniform `u` picks from the softmax at `temperature` of the first `limit`
    /// (plain temperature sampling; see `sampling::draw_in_order`).
    Draw { limit: usize, temperature: f32, u: f32 },
}

#[derive(Debug, Clone, PartialEq)]
pub enum StepResult {
    Logits(Vec<f32>),
    Token(u32),
    /// One token per position of the step (`StepOutput::ArgmaxEach`).
    Tokens(Vec<u32>),
    Candidates(Vec<(u32, f32)>, Option<LogPartition>),
}

/// The result of a TopK step from `best`, the k largest of `logits` already taken (see
/// `StepOutput::TopK`): the log-partition added when asked for, or every logit when the cut
/// falls past the k. `logits` are those `best` came from (adjusted where the backend adjusts
/// them in place).
pub fn candidates_result<B: Backend + ?Sized>(
    b: &B,
    logits: &B::Tensor,
    best: Vec<(u32, f32)>,
    limit: usize,
    temperature: Option<f32>,
    cut: Option<Cut>,
) -> Result<StepResult> {
    let Some(t) = temperature else { return Ok(StepResult::Candidates(best, None)) };
    let partition = b.log_partition(logits, limit, t)?;
    if cut.is_some_and(|c| !c.falls_within(&best, t, partition)) {
        return Ok(StepResult::Logits(b.chosen_logits(logits)?));
    }
    Ok(StepResult::Candidates(best, Some(partition)))
}

pub trait Backend: Send + Sync {
    /// Activations: a row-major `[rows, cols]` matrix with f32 semantics, one row per token.
    type Tensor: Send + Sync;
    /// A weight matrix `[out_features, in_features]` in its stored format.
    type Weight: Send + Sync;
    /// Keys and values of one layer for every cached position.
    type KvCache: Send;
    /// The routed experts of one mixture-of-experts layer (the CPU: a [`GatedMlp`] per expert; a
    /// GPU: every expert of a projection in one buffer, for kernels that pick experts on the device).
    type Experts: Send + Sync;

    /// A short human-readable description ("cpu (2 threads)").
    fn describe(&self) -> String;
    /// Bytes of device memory free now; None where it cannot be told (the host's memory).
    fn free_memory(&self) -> Option<usize> {
        None
    }

    /// Whether the ops behind `cap` run here. The ops below that have a default body (an
    /// Unsupported error) are what a backend without the capability lacks.
    fn supports(&self, cap: Capability) -> bool {
        matches!(cap, Capability::HeadDim(_))
    }
    /// Whether a step of several tokens gives each position the bits a one-token step gives it.
    /// The CPU's kernels do; a GPU's prefill GEMMs, attention and chunked recurrences add in
    /// another order than its decode kernels.
    fn steps_round_alike(&self) -> bool {
        true
    }

    fn upload_weight(&self, w: Box<dyn QuantMatrix>) -> Result<Self::Weight>;
    /// One layer's `count` routed experts: `expert(n)` hands over expert n's matrices (gate and up
    /// `[I, H]`, down `[H, I]`, the same shapes for every n); it is called once for each n, in order.
    fn upload_experts(&self, count: usize, expert: &mut dyn FnMut(usize) -> Result<HostMlp>) -> Result<Self::Experts>;
    /// A 1-row tensor (norm weights, biases).
    fn upload_vector(&self, v: &[f32]) -> Result<Self::Tensor>;
    /// Keys and values of caches made from now on come from one pool of `blocks` blocks of
    /// `kv_pool::KV_BLOCK` positions of `kv_width` values (allocated now, so that a device that
    /// cannot hold it says so at once); caches made before keep their pool until dropped.
    fn set_kv_pool(&self, kv_width: usize, blocks: usize) -> Result<()>;
    /// Bytes of one block of keys and values of `kv_width` values a position.
    fn kv_block_bytes(&self, kv_width: usize) -> usize;
    /// Blocks in use and blocks in all of the pool; None before `set_kv_pool`.
    fn kv_pool_usage(&self) -> Option<(usize, usize)>;
    /// An empty cache of the pool, for `capacity` positions (it may grow past that on backends
    /// that can). It takes blocks as positions are written, or at `reserve_kv`.
    fn new_kv_cache(&self, kv_width: usize, capacity: usize) -> Result<Self::KvCache>;
    /// Takes the blocks `cache` needs for positions `0..positions` (`Error::CacheFull`, nothing
    /// taken, when the pool has too few free).
    fn reserve_kv(&self, cache: &mut Self::KvCache, positions: usize) -> Result<()>;
    fn to_host(&self, x: &Self::Tensor) -> Result<Vec<f32>>;

    /// Positions `start..start + len` of each cache, copied out into caches of their own (a block
    /// of the prefix cache, every attention layer at once). Bit-exact: restoring them gives back
    /// the same keys and values.
    fn save_kv(&self, caches: &[&Self::KvCache], start: usize, len: usize) -> Result<Vec<Self::KvCache>>;
    /// Writes saved pieces (from `save_kv`) back, every cache's at once: each piece's positions
    /// from its start on; positions past them are left to be overwritten by later steps.
    fn restore_kv(&self, restores: &mut [KvRestore<'_, Self::KvCache>]) -> Result<()>;
    /// Bytes `cache` holds (what a saved block costs the prefix cache's budget).
    fn kv_bytes(&self, cache: &Self::KvCache) -> usize;
    /// Bytes `x` holds.
    fn tensor_bytes(&self, x: &Self::Tensor) -> usize;
    /// A copy of `x` (a recurrent state saved for later).
    fn save_tensor(&self, x: &Self::Tensor) -> Result<Self::Tensor>;
    /// Copies `saved` into `x`, which keeps its storage (recorded decode steps point at it).
    fn restore_tensor(&self, saved: &Self::Tensor, x: &mut Self::Tensor) -> Result<()>;

    /// Rows of `table` for each token: `[tokens.len(), table.cols]`.
    fn embed(&self, table: &Self::Weight, tokens: &[u32]) -> Result<Self::Tensor>;
    /// RMSNorm over consecutive groups of `weight.len()` values (a whole row, or one head).
    fn rms_norm(&self, x: &Self::Tensor, weight: &Self::Tensor, eps: f32) -> Result<Self::Tensor>;
    /// `x [T, in] · wᵀ [in, out] (+ bias) -> [T, out]`.
    fn linear(&self, x: &Self::Tensor, w: &Self::Weight, bias: Option<&Self::Tensor>) -> Result<Self::Tensor>;
    /// Rotates every head of every row; row t is at position `start_pos + t`.
    fn rope(&self, x: &mut Self::Tensor, rope: &Rope, start_pos: usize) -> Result<()>;
    /// Writes `k`, `v` (`[T, kv_heads*head_dim]`) into the cache at `start_pos..start_pos+T`, then
    /// causal attention of `q` (`[T, heads*head_dim]`) over positions `0..=start_pos+t`.
    fn attention(
        &self,
        q: &Self::Tensor,
        k: &Self::Tensor,
        v: &Self::Tensor,
        cache: &mut Self::KvCache,
        start_pos: usize,
        shape: AttentionShape,
    ) -> Result<Self::Tensor>;
    /// `silu(gate) * up`, elementwise.
    fn silu_mul(&self, gate: &Self::Tensor, up: &Self::Tensor) -> Result<Self::Tensor>;
    /// `x += y`.
    fn add_assign(&self, x: &mut Self::Tensor, y: &Self::Tensor) -> Result<()>;
    /// The last row of `x` as a `[1, cols]` tensor.
    fn last_row(&self, x: &Self::Tensor) -> Result<Self::Tensor>;
    /// Rows `start..start + len` of `x`: one sequence's part of a batched step. A GPU gives a
    /// view of `x` (it must not outlive `x`), the CPU a copy; nothing may rely on either.
    fn rows(&self, x: &Self::Tensor, start: usize, len: usize) -> Result<Self::Tensor>;
    /// The rows of `parts`, in order, as one tensor (their widths agree).
    fn stack_rows(&self, parts: &[Self::Tensor]) -> Result<Self::Tensor>;

    /// `residual += x · wᵀ (+ bias)`: a projection feeding the residual stream. Backends fuse it.
    fn linear_add(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        bias: Option<&Self::Tensor>,
        residual: &mut Self::Tensor,
    ) -> Result<()> {
        let y = self.linear(x, w, bias)?;
        self.add_assign(residual, &y)
    }

    /// `rms_norm(x) · wᵢᵀ (+ biasᵢ)` for each projection of the same input (q, k and v). Backends fuse
    /// the norm into the products and launch once.
    fn norm_linears<const N: usize>(
        &self,
        x: &Self::Tensor,
        norm: &Self::Tensor,
        eps: f32,
        projs: [Proj<'_, Self>; N],
    ) -> Result<[Self::Tensor; N]> {
        let xn = self.rms_norm(x, norm, eps)?;
        let out = projs.iter().map(|p| self.linear(&xn, p.weight, p.bias)).collect::<Result<Vec<_>>>()?;
        out.try_into().map_err(|_| crate::Error::InvalidArgument("norm_linears: projection count".into()))
    }

    /// The gated MLP's first half on the normalised input:
    /// `silu(rms_norm(x) · gateᵀ + gate_bias) * (rms_norm(x) · upᵀ + up_bias)`. Backends fuse it.
    fn norm_silu_gate_up(
        &self,
        x: &Self::Tensor,
        norm: &Self::Tensor,
        eps: f32,
        gate: Proj<'_, Self>,
        up: Proj<'_, Self>,
    ) -> Result<Self::Tensor> {
        let xn = self.rms_norm(x, norm, eps)?;
        let g = self.linear(&xn, gate.weight, gate.bias)?;
        let u = self.linear(&xn, up.weight, up.bias)?;
        self.silu_mul(&g, &u)
    }

    /// Qwen3's per-head RMSNorm (when `norm` is given), then rotary embedding. Backends fuse it.
    fn norm_rope(&self, x: &mut Self::Tensor, norm: Option<&Self::Tensor>, eps: f32, rope: &Rope, start_pos: usize) -> Result<()> {
        if let Some(w) = norm {
            *x = self.rms_norm(x, w, eps)?;
        }
        self.rope(x, rope, start_pos)
    }

    /// A layer's attention from its projections: q/k norms, rotary embedding, the KV-cache append
    /// and causal attention (see [`Backend::attention`]). Backends fuse the steps before attention.
    #[allow(clippy::too_many_arguments)]
    fn rotary_attention(
        &self,
        mut q: Self::Tensor,
        mut k: Self::Tensor,
        v: &Self::Tensor,
        norms: QkNorms<'_, Self>,
        rope: &Rope,
        cache: &mut Self::KvCache,
        start_pos: usize,
        shape: AttentionShape,
    ) -> Result<Self::Tensor> {
        self.norm_rope(&mut q, norms.q, norms.eps, rope, start_pos)?;
        self.norm_rope(&mut k, norms.k, norms.eps, rope, start_pos)?;
        self.attention(&q, &k, v, cache, start_pos, shape)
    }

    /// [`Backend::rotary_attention`] of one token of each of several sequences: row i of q, k and
    /// v is the token of the sequence whose cache is `caches[i]`, at `positions[i]`. Each row gets
    /// the bits it gets alone. Backends run the rows in one pass.
    #[allow(clippy::too_many_arguments)]
    fn rotary_attention_rows(
        &self,
        q: Self::Tensor,
        k: Self::Tensor,
        v: &Self::Tensor,
        norms: QkNorms<'_, Self>,
        rope: &Rope,
        caches: &mut [&mut Self::KvCache],
        positions: &[usize],
        shape: AttentionShape,
    ) -> Result<Self::Tensor> {
        rotary_attention_one_by_one(self, q, k, v, norms, rope, caches, positions, shape)
    }

    /// Causal depthwise convolution over time, then SiLU: `out[t, c] = silu(Σ_j w[c, j] · x[t−K+1+j, c])`
    /// for `x [T, C]` and `weight [1, C·K]` (channel-major, oldest tap first), where positions
    /// before `t = 0` come from `state [1, (K−1)·C]` (the previous K−1 inputs, oldest first),
    /// which is then replaced by the last K−1 inputs.
    fn conv1d_silu(&self, _x: &Self::Tensor, _weight: &Self::Tensor, _state: &mut Self::Tensor) -> Result<Self::Tensor> {
        Err(crate::Error::Unsupported(format!("Gated DeltaNet convolutions on {}", self.describe())))
    }

    /// The gated delta rule over `qkv [T, 2·Hk·dk + Hv·dv]` (q | k | v after the convolution):
    /// q and k L2-normalised per head (and q scaled by dk^-1/2), β = sigmoid(b), g = −exp(A_log) ·
    /// softplus(a + dt_bias) from `a`, `b [T, Hv]`, then per value head with S `[dk, dv]` from
    /// `state [1, Hv·dk·dv]` (updated): S ← exp(g)·S; S ← S + k ⊗ β(v − Sᵀk); o = Sᵀq.
    /// Returns `o [T, Hv·dv]`.
    #[allow(clippy::too_many_arguments)]
    fn gated_delta_rule(
        &self,
        _qkv: &Self::Tensor,
        _a: &Self::Tensor,
        _b: &Self::Tensor,
        _a_log: &Self::Tensor,
        _dt_bias: &Self::Tensor,
        _state: &mut Self::Tensor,
        _shape: DeltaShape,
    ) -> Result<Self::Tensor> {
        Err(crate::Error::Unsupported(format!("the gated delta rule on {}", self.describe())))
    }

    /// [`Backend::conv1d_silu`] then [`Backend::gated_delta_rule`] for one token of each of
    /// several sequences: row i of `qkv`, `a` and `b` is the token of the sequence whose conv and
    /// delta-rule states are `states[i]`. Each row gets the bits it gets alone. Backends run the
    /// rows in one pass.
    #[allow(clippy::too_many_arguments)]
    fn delta_net_rows(
        &self,
        qkv: &Self::Tensor,
        a: &Self::Tensor,
        b: &Self::Tensor,
        weights: DeltaWeights<'_, Self>,
        states: &mut [(&mut Self::Tensor, &mut Self::Tensor)],
        shape: DeltaShape,
    ) -> Result<Self::Tensor> {
        let mut outs = Vec::with_capacity(states.len());
        for (i, (conv, state)) in states.iter_mut().enumerate() {
            let x = self.conv1d_silu(&self.rows(qkv, i, 1)?, weights.conv1d, conv)?;
            let (a, b) = (self.rows(a, i, 1)?, self.rows(b, i, 1)?);
            outs.push(self.gated_delta_rule(&x, &a, &b, weights.a_log, weights.dt_bias, state, shape)?);
        }
        self.stack_rows(&outs)
    }

    /// RMSNorm over groups of `weight.len()` values of `x`, times `weight`, times `silu(z)`.
    fn gated_rms_norm(&self, _x: &Self::Tensor, _z: &Self::Tensor, _weight: &Self::Tensor, _eps: f32) -> Result<Self::Tensor> {
        Err(crate::Error::Unsupported(format!("gated RMSNorm on {}", self.describe())))
    }

    /// `x *= sigmoid(gate)`, elementwise; a `[T, 1]` gate scales each row.
    fn sigmoid_gate(&self, _x: &mut Self::Tensor, _gate: &Self::Tensor) -> Result<()> {
        Err(crate::Error::Unsupported(format!("sigmoid gates on {}", self.describe())))
    }

    /// A mixture of experts on normalised input `xn [T, H]` with router logits `[T, E]`, added to
    /// `residual [T, H]`: each token's chosen experts' outputs, weighted by their routing
    /// probabilities, summed in expert order, then added (one launch fewer than a separate add).
    fn moe_add(
        &self,
        _xn: &Self::Tensor,
        _router_logits: &Self::Tensor,
        _experts: &Self::Experts,
        _routing: Routing,
        _residual: &mut Self::Tensor,
    ) -> Result<()> {
        Err(crate::Error::Unsupported(format!("mixture-of-experts layers on {}", self.describe())))
    }

    /// A whole mixture-of-experts block on the residual stream: `x += moe(rms_norm(x))`, with the
    /// shared expert when there is one (`x += sigmoid(gate) · shared(rms_norm(x))`). The default
    /// composes the ops above; a GPU runs a one-token step in four launches.
    #[allow(clippy::too_many_arguments)]
    fn moe_block_add(
        &self,
        x: &mut Self::Tensor,
        norm: &Self::Tensor,
        eps: f32,
        router_logits: &Self::Tensor,
        experts: &Self::Experts,
        shared: Option<SharedExpert<'_, Self>>,
        routing: Routing,
    ) -> Result<()> {
        compose_moe_block(self, x, norm, eps, router_logits, experts, shared, routing)
    }

    /// From now on `argmax` and `top_k` (recorded decode steps too) consider only the ids whose
    /// bit is set in `mask` (bit i of word i / 32: a grammar's allowed tokens), until a call with
    /// None. Backends without it say Unsupported, and the caller masks logits on the host.
    fn set_token_mask(&self, _mask: Option<&[u32]>) -> Result<()> {
        Err(crate::Error::Unsupported(format!("token masks on {}", self.describe())))
    }

    /// From now on `argmax`, `top_k` and `draw` (recorded decode steps too) first make these
    /// adjustments to the values (a request's `logit_bias` and penalties, one entry per id), until
    /// a call with none. Backends without it say Unsupported, and the caller adjusts on the host.
    fn set_logit_adjustments(&self, _list: &[Adjustment]) -> Result<()> {
        Err(crate::Error::Unsupported(format!("logit adjustments on {}", self.describe())))
    }

    /// Index of the largest of the first `limit` values of a `[1, n]` tensor (lowest index on ties).
    fn argmax(&self, x: &Self::Tensor, limit: usize) -> Result<u32> {
        let values = self.to_host(x)?;
        Ok(crate::sampling::argmax(&values[..limit.min(values.len())]))
    }

    /// `argmax` of each row of a `[T, n]` tensor (verifying drafted tokens).
    fn argmax_rows(&self, x: &Self::Tensor, limit: usize) -> Result<Vec<u32>>;

    /// The `k` largest of the first `limit` values of a `[1, n]` tensor as (index, value), largest
    /// first, ties by index.
    fn top_k(&self, x: &Self::Tensor, k: usize, limit: usize) -> Result<Vec<(u32, f32)>> {
        Ok(crate::sampling::top_k(&self.to_host(x)?, k, limit))
    }

    /// The id a uniform `u` in [0, 1) picks from the softmax at `temperature` of the first `limit`
    /// values of a `[1, n]` tensor (adjusted, masked), walking the ids in order
    /// (`sampling::draw_in_order`).
    fn draw(&self, x: &Self::Tensor, limit: usize, temperature: f32, u: f32) -> Result<u32> {
        Ok(crate::sampling::draw_in_order(&self.chosen_logits(x)?, limit, temperature, u))
    }

    /// The log-partition of the first `limit` values of a `[1, n]` tensor, over the ids the token
    /// mask allows and adjusted, as the last `argmax` or `top_k` of `x` saw them.
    fn log_partition(&self, x: &Self::Tensor, limit: usize, temperature: f32) -> Result<LogPartition> {
        Ok(LogPartition::of(&self.chosen_logits(x)?, limit, temperature))
    }

    /// The values of a `[1, n]` tensor as the last `argmax` or `top_k` of it saw them: adjusted,
    /// ids outside the token mask at -inf.
    fn chosen_logits(&self, x: &Self::Tensor) -> Result<Vec<f32>> {
        self.to_host(x)
    }

    /// The model keeps `sequences` sequences and decodes them side by side (set at load). A
    /// backend may then pick kernels that are faster for several tokens a launch (the GPU's
    /// matrix-core bf16 GEMV): they still give each token the bits it gets alone, but those may
    /// differ in the last bits from what a single-sequence model's kernels give.
    fn plan_sequences(&self, _sequences: usize) {}

    /// Decode steps (one token) can be recorded once and replayed, as a CUDA/HIP graph, when the
    /// backend supports it, one recording per `key` (a sequence slot: each points at its own
    /// caches). `replay_decode` queues the step recorded under `key` for (token, pos) and returns
    /// true, or false when none is; `recorded_output` then hands back its output.
    fn replay_decode(&self, _key: usize, _token: u32, _pos: usize, _want: StepOutput) -> Result<bool> {
        Ok(false)
    }

    /// Queues `step` (the model's decode step, returning `[1, vocab]` logits) while recording it
    /// under `key` (replacing that key's recording, keeping the others'), with token and position
    /// read from device memory so the recording fits every later step. Returns false, without
    /// running `step`, where recording is not supported.
    fn record_decode(
        &self,
        _key: usize,
        _token: u32,
        _pos: usize,
        _vocab: usize,
        _want: StepOutput,
        _step: &mut dyn FnMut() -> Result<Self::Tensor>,
    ) -> Result<bool> {
        Ok(false)
    }

    /// A batched step (one token of each of several sequences: `Network::forward` over them) can
    /// be recorded and replayed as a single step can, one recording per `key` (the sequences'
    /// slots in row order: each points at its own caches). `replay_batch` queues the pass
    /// recorded under `key` for these tokens and positions and returns its logits `[rows,
    /// vocab]` (valid until the next recording), or None when none is recorded.
    fn replay_batch(&self, _key: &[usize], _tokens: &[u32], _pos: &[usize]) -> Result<Option<Self::Tensor>> {
        Ok(None)
    }

    /// Queues `forward` (returning `[rows, vocab]` logits) while recording it under `key`, with
    /// tokens and positions read from device memory, and returns its logits as `replay_batch`
    /// does; None, without running `forward`, where recording is not supported.
    fn record_batch(
        &self,
        _key: &[usize],
        _tokens: &[u32],
        _pos: &[usize],
        _vocab: usize,
        _forward: &mut dyn FnMut() -> Result<Self::Tensor>,
    ) -> Result<Option<Self::Tensor>> {
        Ok(None)
    }

    /// The ops that follow act on the `row`-th sequence of a batched step (a recording reads
    /// that sequence's position from device memory).
    fn sequence_row(&self, _row: usize) {}

    /// The output of the step just replayed or recorded. `mask_changed`: the token mask was set
    /// after the step was queued, so a choice the recording made is made again.
    fn recorded_output(&self, _want: StepOutput, _mask_changed: bool) -> Result<StepResult> {
        Err(crate::Error::Unsupported(format!("recorded decode steps on {}", self.describe())))
    }
}

/// [`Backend::moe_block_add`] from the smaller ops. The shared expert's gate scales its hidden
/// activations before `down` (a linear map: the same as scaling its output), so that `down` adds
/// into `x`.
#[allow(clippy::too_many_arguments)]
pub fn compose_moe_block<B: Backend + ?Sized>(
    b: &B,
    x: &mut B::Tensor,
    norm: &B::Tensor,
    eps: f32,
    router_logits: &B::Tensor,
    experts: &B::Experts,
    shared: Option<SharedExpert<'_, B>>,
    routing: Routing,
) -> Result<()> {
    let xn = b.rms_norm(x, norm, eps)?; // [T, H]
    let hidden = match &shared {
        Some(s) => {
            let (gate, up) = (Proj { weight: &s.mlp.gate, bias: None }, Proj { weight: &s.mlp.up, bias: None });
            let mut h = b.norm_silu_gate_up(x, norm, eps, gate, up)?; // [T, I_shared]
            b.sigmoid_gate(&mut h, s.gate_logits)?; // h *= sigmoid([T, 1])
            Some(h)
        }
        None => None,
    };
    b.moe_add(&xn, router_logits, experts, routing, x)?; // x += Σ routed experts
    match (hidden, shared) {
        (Some(h), Some(s)) => b.linear_add(&h, &s.mlp.down, None, x), // x += down(h)
        _ => Ok(()),
    }
}

/// [`Backend::rotary_attention_rows`] as one `rotary_attention` per row, each told its row of a
/// recorded step (`sequence_row`), then stacked.
#[allow(clippy::too_many_arguments)]
pub fn rotary_attention_one_by_one<B: Backend + ?Sized>(
    b: &B,
    q: B::Tensor,
    k: B::Tensor,
    v: &B::Tensor,
    norms: QkNorms<'_, B>,
    rope: &Rope,
    caches: &mut [&mut B::KvCache],
    positions: &[usize],
    shape: AttentionShape,
) -> Result<B::Tensor> {
    if caches.len() != positions.len() {
        return Err(crate::Error::InvalidArgument(format!("{} caches for {} positions", caches.len(), positions.len())));
    }
    let mut outs = Vec::with_capacity(caches.len());
    for (i, (cache, &pos)) in caches.iter_mut().zip(positions).enumerate() {
        let (qi, ki, vi) = (b.rows(&q, i, 1)?, b.rows(&k, i, 1)?, b.rows(v, i, 1)?);
        b.sequence_row(i);
        let out = b.rotary_attention(qi, ki, &vi, norms, rope, cache, pos, shape);
        b.sequence_row(0);
        outs.push(out?);
    }
    b.stack_rows(&outs)
}

/// Sets to -inf every value whose bit is clear in `mask` (bit i of word i / 32; ids past the mask
/// are not allowed): how a token mask applies to logits on the host.
pub fn apply_token_mask(values: &mut [f32], mask: &[u32]) {
    let words = mask.iter().copied().chain(std::iter::repeat(0));
    for (chunk, word) in values.chunks_mut(32).zip(words) {
        if word == u32::MAX {
            continue;
        }
        for (bit, v) in chunk.iter_mut().enumerate() {
            if word >> bit & 1 == 0 {
                *v = f32::NEG_INFINITY;
            }
        }
    }
}
