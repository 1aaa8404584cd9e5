//! The reference backend: plain Rust, f32 accumulation, fixed summation order. Rows of a product
//! are spread over the backend's own threads (`workers`); every output element is computed by
//! one thread in one order, so results do not depend on the thread count. GGUF block-format
//! weights are repacked on upload (quant::interleaved) and take integer dot products against an
//! 8-bit copy of the input unless the f32 reference is asked for (`CpuKernels`; see quant::q8dot).

mod workers;

use std::sync::Arc;

use workers::Workers;

use super::kv_pool::{BlockList, KvPool, KV_BLOCK};
use super::{AttentionShape, Backend, Capability, DeltaShape, GatedMlp, KvRestore, Proj, Rope, Routing};
use crate::quant::interleaved::{InterleavedMatrix, GROUP};
use crate::quant::q8dot::{self, DotKernel, Q8Block};
use crate::quant::{dot, dots, QuantMatrix};
use crate::sampling::Adjustment;
use crate::{Error, Result};

#[derive(Debug, Clone)]
pub struct CpuTensor {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl CpuTensor {
    pub fn new(rows: usize, cols: usize, data: Vec<f32>) -> Self {
        debug_assert_eq!(data.len(), rows * cols);
        CpuTensor { rows, cols, data }
    }

    fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
}

/// A layer's keys and values, a position a row of `width` values, rows `stride` apart: one cache
/// line more than the width, so that a head's keys at successive positions do not all fall in
/// the same L1 set (a width of 1024 floats would put them 4 KiB apart, an attention pass over
/// eight of them then evicting its own lines).
pub struct CpuKvCache {
    width: usize,
    keys: Vec<f32>,
    values: Vec<f32>,
    /// The pool's blocks this cache counts against (`Backend::set_kv_pool`: the host's memory
    /// grows with the vectors, but a pool of the size asked limits the positions all sequences
    /// hold together, as on a GPU). None for a saved piece.
    blocks: Option<BlockList>,
}

impl CpuKvCache {
    fn stride(&self) -> usize {
        self.width + 16
    }

    fn positions(&self) -> usize {
        self.keys.len() / self.stride()
    }
}

/// How the CPU multiplies block-format weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpuKernels {
    /// Integer dot products on the fastest instructions this CPU has, unless the environment
    /// variable `ATLAS_CPU_KERNELS` names another choice: 3-4x the reference's speed. The
    /// inputs' rounding to 8 bits changes some answers of small models (SmolLM2-135M answers
    /// "What is the capital of France?" with French landmarks, as llama.cpp's build does too).
    Auto,
    /// The AVX2 kernel even where AVX-512 VNNI's is faster (an error on a CPU without AVX2).
    Avx2,
    /// Integer dot products in plain Rust (the same results as Auto's, slower).
    Scalar,
    /// Every weight widened to f32 a row at a time: the oracle the others are tested against.
    Reference,
}

/// The environment variable that overrides `CpuKernels::Auto`.
pub const CPU_KERNELS_ENV: &str = "ATLAS_CPU_KERNELS";

impl std::str::FromStr for CpuKernels {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(CpuKernels::Auto),
            "avx2" => Ok(CpuKernels::Avx2),
            "scalar" => Ok(CpuKernels::Scalar),
            "reference" => Ok(CpuKernels::Reference),
            _ => Err(Error::InvalidArgument(format!("CPU kernels {s:?}: expected auto, avx2, scalar or reference"))),
        }
    }
}

impl CpuKernels {
    /// The integer kernel to use (None: the f32 reference).
    fn resolve(self) -> Result<Option<DotKernel>> {
        let choice = match (self, std::env::var(CPU_KERNELS_ENV)) {
            (CpuKernels::Auto, Ok(v)) if !v.is_empty() => v.parse().map_err(|e: Error| Error::InvalidArgument(format!("{CPU_KERNELS_ENV}: {e}")))?,
            _ => self,
        };
        Ok(match choice {
            CpuKernels::Auto => Some(DotKernel::detect()),
            CpuKernels::Avx2 if DotKernel::available().contains(&DotKernel::Avx2) => Some(DotKernel::Avx2),
            CpuKernels::Avx2 => return Err(Error::InvalidArgument("CPU kernels avx2: this CPU lacks AVX2 or F16C".into())),
            CpuKernels::Scalar => Some(DotKernel::Scalar),
            CpuKernels::Reference => None,
        })
    }
}

pub struct CpuBackend {
    workers: Workers,
    /// The integer kernel for block formats; None: the f32 reference for every weight.
    dot: Option<DotKernel>,
    /// See `Backend::set_token_mask`.
    token_mask: std::sync::Mutex<Option<Vec<u32>>>,
    /// See `Backend::set_logit_adjustments`.
    logit_adjust: std::sync::Mutex<Vec<Adjustment>>,
    /// See `Backend::set_kv_pool`: the width it is for, and its books.
    kv_pool: std::sync::Mutex<Option<(usize, Arc<KvPool>)>>,
}

impl CpuBackend {
    /// The f32 reference for every product; `threads == 0` uses every core.
    pub fn new(threads: usize) -> Result<Self> {
        Self::with_kernels(threads, CpuKernels::Reference)
    }

    pub fn with_kernels(threads: usize, kernels: CpuKernels) -> Result<Self> {
        let workers = Workers::new(threads)?;
        let dot = kernels.resolve()?;
        Ok(CpuBackend { workers, dot, token_mask: std::sync::Mutex::new(None), logit_adjust: std::sync::Mutex::new(Vec::new()), kv_pool: std::sync::Mutex::new(None) })
    }

    /// `linear`, taking the input's 8-bit copy from `quantized` (made there on first use): the
    /// products of one input share it.
    fn linear_sharing(&self, x: &CpuTensor, w: &dyn QuantMatrix, bias: Option<&CpuTensor>, quantized: &mut Option<Vec<Vec<Q8Block>>>) -> Result<CpuTensor> {
        let (n, k, t) = (w.rows(), w.cols(), x.rows);
        if x.cols != k {
            return Err(Error::InvalidArgument(format!("linear: input width {} but weight has {k} columns", x.cols)));
        }
        if t == 0 {
            return Ok(CpuTensor::new(0, n, Vec::new()));
        }
        let mut out = match (self.dot, w.as_interleaved()) {
            (Some(kernel), Some(packed)) => self.integer_linear(kernel, packed, quantized.get_or_insert_with(|| self.quantized(kernel, x))),
            _ => self.reference_linear(w, x),
        };
        if let Some(b) = bias {
            for row in out.chunks_exact_mut(n) {
                for (v, bv) in row.iter_mut().zip(&b.data) {
                    *v += bv;
                }
            }
        }
        Ok(CpuTensor::new(t, n, out))
    }

    /// Each row of `x` quantised to 8 bits for `kernel`.
    fn quantized(&self, kernel: DotKernel, x: &CpuTensor) -> Vec<Vec<Q8Block>> {
        let mut inputs: Vec<Vec<Q8Block>> = vec![Vec::new(); x.rows];
        self.workers.for_each(&mut inputs, || (), |_, tok, q| q8dot::quantize_input(kernel, x.row(tok), q));
        inputs
    }

    /// `x · wᵀ` on the integer kernel, for `inputs` = `x` quantised: two groups of eight rows a
    /// task, every token's products of a group in one pass; `[T, N]`.
    fn integer_linear(&self, kernel: DotKernel, w: &InterleavedMatrix, inputs: &[Vec<Q8Block>]) -> Vec<f32> {
        let (n, t) = (w.rows(), inputs.len());
        // [group][token][row of the group]
        let mut by_group = vec![0f32; w.groups() * t * GROUP];
        self.workers.for_each(&mut by_group.chunks_mut(2 * t * GROUP).collect::<Vec<_>>(), || (), |_, chunk, out| {
            q8dot::dot_groups(kernel, w, 2 * chunk..2 * chunk + out.len() / (t * GROUP), inputs, out);
        });
        if t == 1 {
            by_group.truncate(n);
            return by_group;
        }
        let mut out = vec![0f32; t * n];
        self.workers.for_each(&mut out.chunks_mut(n).collect::<Vec<_>>(), || (), |_, tok, row| {
            for (g, part) in row.chunks_mut(GROUP).enumerate() {
                part.copy_from_slice(&by_group[(g * t + tok) * GROUP..][..part.len()]);
            }
        });
        out
    }

    /// `x · wᵀ` with each weight row widened to f32 once and used for every token; `[T, N]`.
    fn reference_linear(&self, w: &dyn QuantMatrix, x: &CpuTensor) -> Vec<f32> {
        let (n, k, t) = (w.rows(), w.cols(), x.rows);
        // Work on the transposed output [n, t] so each thread owns whole weight rows.
        let mut out_t = vec![0f32; n * t];
        self.workers.for_each(&mut out_t.chunks_mut(t * 16).collect::<Vec<_>>(), || vec![0f32; k], |row_buf, chunk, out| {
            for (i, o) in out.chunks_exact_mut(t).enumerate() {
                w.dequant_row(chunk * 16 + i, row_buf);
                for (tok, slot) in o.iter_mut().enumerate() {
                    *slot = dot(row_buf, x.row(tok));
                }
            }
        });
        if t == 1 {
            return out_t;
        }
        let mut out = vec![0f32; t * n];
        // Sixteen tokens a task: each weight row's sixteen outputs are one cache line of out_t.
        self.workers.for_each(&mut out.chunks_mut(16 * n).collect::<Vec<_>>(), || (), |_, chunk, rows| {
            let first = chunk * 16;
            for (j, col) in out_t.chunks_exact(t).enumerate() {
                for (i, v) in col[first..first + rows.len() / n].iter().enumerate() {
                    rows[i * n + j] = *v;
                }
            }
        });
        out
    }

    /// The logits as argmax and top_k see them: adjusted, the token mask applied.
    fn masked(&self, x: &CpuTensor) -> Vec<f32> {
        let mut values = x.data.clone();
        for a in self.logit_adjust.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            if let Some(v) = values.get_mut(a.id as usize) {
                *v = a.apply(*v);
            }
        }
        if let Some(mask) = self.token_mask.lock().unwrap_or_else(|p| p.into_inner()).as_deref() {
            crate::backend::apply_token_mask(&mut values, mask);
        }
        values
    }
}

/// A thread's scratch space in `attention`: the scores of each query of a tile, and one KV head's
/// keys and values copied out of the cache (`head`), position after position.
#[derive(Default)]
struct HeadScratch {
    scores: Vec<Vec<f32>>,
    head: Option<usize>,
    keys: Vec<f32>,
    values: Vec<f32>,
}

/// One query row's view of a layer's cache: `visible` positions of width-wide rows, its head's
/// columns at `offset`, scores scaled by `scale`.
struct Query<'a> {
    q: &'a [f32],
    offset: usize,
    visible: usize,
    scale: f32,
}

/// softmax(q · keysᵀ · scale) · values for each of a tile of query rows of one head (cache rows
/// `width` apart), into `outs`. The tile goes through the positions SPAN at a time, each span's
/// keys and values used by every query while they are in cache: a long prompt's queries read
/// their head's cache a tile at a time, not each alone. Every query's arithmetic is the one it has
/// alone (each score its own dot; each output adds the positions in order, four a step), so a
/// token gets the same bits in any tile, prompt or decode step. WIDE: inlined into
/// `attend_wide`, whose AVX2 its key products use.
#[inline(always)]
fn attend<const WIDE: bool>(queries: &[Query], keys: &[f32], values: &[f32], width: usize, scores: &mut [Vec<f32>], outs: &mut [&mut [f32]]) {
    let last = queries.iter().map(|q| q.visible).max().unwrap_or(0);
    // Plain loops, not iterator adapters: a closure would not inherit attend_wide's features.
    for s in scores.iter_mut() {
        s.clear();
    }
    for start in (0..last).step_by(SPAN) {
        for (query, s) in queries.iter().zip(scores.iter_mut()) {
            key_scores::<WIDE>(query, keys, width, start..(start + SPAN).min(query.visible), s);
        }
    }
    for s in scores.iter_mut() {
        let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for v in s.iter_mut() {
            *v = (*v - max).exp();
            sum += *v;
        }
        for v in s.iter_mut() {
            *v /= sum;
        }
    }
    for o in outs.iter_mut() {
        o.fill(0.0);
    }
    for start in (0..last).step_by(SPAN) {
        for ((query, s), o) in queries.iter().zip(scores.iter()).zip(outs.iter_mut()) {
            weighted_values(query.offset, values, width, s, start..(start + SPAN).min(s.len()), o);
        }
    }
}

/// Queries of one head that `attend` takes together.
const TILE: usize = 4;

/// Positions a tile of queries takes together (a multiple of eight): 128 KiB of keys at a head
/// size of 128, which stay in L2 while the tile's queries use them.
const SPAN: usize = 256;

/// The scaled scores of `positions` (starting at a multiple of eight), appended to `scores`.
#[inline(always)]
fn key_scores<const WIDE: bool>(query: &Query, keys: &[f32], width: usize, positions: std::ops::Range<usize>, scores: &mut Vec<f32>) {
    let d = query.q.len();
    let key = |p: usize| &keys[p * width + query.offset..][..d];
    // Eight keys a call: eight chains of adds in flight, not four (each add waits on the last).
    let mut p = positions.start;
    while p + 8 <= positions.end {
        let eight = [key(p), key(p + 1), key(p + 2), key(p + 3), key(p + 4), key(p + 5), key(p + 6), key(p + 7)];
        #[cfg(target_arch = "x86_64")]
        // SAFETY: WIDE only inside attend_wide, which needs AVX2.
        let products = if WIDE { unsafe { crate::quant::dots_avx(query.q, eight) } } else { dots(query.q, eight) };
        #[cfg(not(target_arch = "x86_64"))]
        let products = dots(query.q, eight);
        for s in products {
            scores.push(s * query.scale);
        }
        p += 8;
    }
    for p in p..positions.end {
        scores.push(dot(query.q, key(p)) * query.scale);
    }
}

/// `o += Σ weights[p] · value(p)` over `positions` (starting at a multiple of four): the positions
/// before the last multiple of four of all the weights four a step, added as a tree first (so
/// that each accumulator waits on one add a step, not four), the rest one by one. Sixty-four
/// outputs at a time stay in registers.
#[inline(always)]
fn weighted_values(offset: usize, values: &[f32], width: usize, weights: &[f32], positions: std::ops::Range<usize>, o: &mut [f32]) {
    let d = o.len();
    let value = |p: usize| &values[p * width + offset..][..d];
    let full = weights.len() / 4 * 4;
    let (grouped, single) = (positions.start..positions.end.min(full), positions.start.max(full)..positions.end);
    let mut at = 0;
    while at < d {
        let n = (d - at).min(BLOCK);
        let mut acc = [0f32; BLOCK];
        acc[..n].copy_from_slice(&o[at..at + n]);
        if n == BLOCK {
            let block = |p: usize| -> &[f32; BLOCK] { value(p)[at..at + BLOCK].try_into().expect("a block") };
            for p in grouped.clone().step_by(4) {
                let (w, v) = ([weights[p], weights[p + 1], weights[p + 2], weights[p + 3]], [block(p), block(p + 1), block(p + 2), block(p + 3)]);
                for i in 0..BLOCK {
                    acc[i] += (w[0] * v[0][i] + w[1] * v[1][i]) + (w[2] * v[2][i] + w[3] * v[3][i]);
                }
            }
        } else {
            for p in grouped.clone().step_by(4) {
                let w = [weights[p], weights[p + 1], weights[p + 2], weights[p + 3]];
                let v = [&value(p)[at..], &value(p + 1)[at..], &value(p + 2)[at..], &value(p + 3)[at..]];
                for (i, acc) in acc[..n].iter_mut().enumerate() {
                    *acc += (w[0] * v[0][i] + w[1] * v[1][i]) + (w[2] * v[2][i] + w[3] * v[3][i]);
                }
            }
        }
        for p in single.clone() {
            for (acc, vv) in acc[..n].iter_mut().zip(&value(p)[at..]) {
                *acc += weights[p] * vv;
            }
        }
        o[at..at + n].copy_from_slice(&acc[..n]);
        at += n;
    }
}

/// Outputs of one head that `weighted_values` keeps in registers (eight AVX registers).
const BLOCK: usize = 64;

#[cfg(target_arch = "x86_64")]
fn attend_wide_available() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
}

/// `attend` compiled for AVX2: its loops in 8-wide registers, the same operations in the same
/// order (Rust never fuses a multiply and an add by itself), so the same bits.
///
/// # Safety
/// The CPU must support AVX2 (`attend_wide_available`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn attend_wide(queries: &[Query], keys: &[f32], values: &[f32], width: usize, scores: &mut [Vec<f32>], outs: &mut [&mut [f32]]) {
    attend::<true>(queries, keys, values, width, scores, outs)
}

fn same_shape(a: &CpuTensor, b: &CpuTensor, op: &str) -> Result<()> {
    if (a.rows, a.cols) != (b.rows, b.cols) {
        return Err(Error::InvalidArgument(format!(
            "{op}: shapes [{}, {}] and [{}, {}] differ",
            a.rows, a.cols, b.rows, b.cols
        )));
    }
    Ok(())
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn softplus(x: f32) -> f32 {
    // As torch: linear above 20, where exp would only add rounding.
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// `x / sqrt(Σx² + 1e-6) · scale`, the L2 normalisation of the delta rule's q and k.
fn l2_normalized(x: &[f32], scale: f32) -> Vec<f32> {
    let inv = 1.0 / (dot(x, x) + 1e-6).sqrt();
    x.iter().map(|v| v * inv * scale).collect()
}

/// One value head's slice of every token's output row `[T, heads·dv]`, for a task that owns it.
struct HeadRows<'a> {
    rows: Vec<&'a mut [f32]>,
}

impl HeadRows<'_> {
    fn token(&mut self, t: usize) -> &mut [f32] {
        self.rows[t]
    }
}

fn out_heads(out: &mut [f32], t: usize, heads: usize, dv: usize) -> Vec<HeadRows<'_>> {
    let mut per_head: Vec<HeadRows<'_>> = (0..heads).map(|_| HeadRows { rows: Vec::with_capacity(t) }).collect();
    for row in out.chunks_exact_mut(heads * dv) {
        for (h, slice) in row.chunks_exact_mut(dv).enumerate() {
            per_head[h].rows.push(slice);
        }
    }
    per_head
}

/// A token's experts and their weights, in expert order: softmax over the logits, the `top_k`
/// largest (ties to the lower index), renormalised when asked.
fn route(logits: &[f32], routing: Routing) -> Vec<(usize, f32)> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exp: Vec<f32> = logits.iter().map(|l| (l - max).exp()).collect();
    let sum: f32 = exp.iter().sum();
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| exp[b].total_cmp(&exp[a]).then(a.cmp(&b)));
    let mut chosen: Vec<(usize, f32)> = order[..routing.top_k].iter().map(|&i| (i, exp[i] / sum)).collect();
    if routing.normalize {
        let total: f32 = chosen.iter().map(|c| c.1).sum();
        for c in &mut chosen {
            c.1 /= total;
        }
    }
    chosen.sort_by_key(|c| c.0);
    chosen
}

impl Backend for CpuBackend {
    type Tensor = CpuTensor;
    type Weight = Box<dyn QuantMatrix>;
    type KvCache = CpuKvCache;
    type Experts = Vec<GatedMlp<Self>>;

    fn describe(&self) -> String {
        let kernels = self.dot.map_or("f32 reference", DotKernel::name);
        format!("cpu ({} threads, {kernels})", self.workers.threads())
    }

    fn supports(&self, _cap: Capability) -> bool {
        true
    }

    /// Block formats are repacked for the integer kernels (`interleaved`); everything else
    /// stays as loaded.
    fn upload_weight(&self, w: Box<dyn QuantMatrix>) -> Result<Self::Weight> {
        if self.dot.is_none() {
            return Ok(w);
        }
        let (matrix, rows) = match (w.as_ggml(), w.row_selection()) {
            (Some(m), _) => (m, None),
            (None, Some((inner, rows))) => match inner.as_ggml() {
                Some(m) => (m, Some(rows)),
                None => return Ok(w),
            },
            (None, None) => return Ok(w),
        };
        Ok(Box::new(InterleavedMatrix::pack(matrix, rows)))
    }

    fn upload_experts(&self, count: usize, expert: &mut dyn FnMut(usize) -> Result<GatedMlp<Self>>) -> Result<Self::Experts> {
        (0..count)
            .map(|n| {
                let GatedMlp { gate, up, down } = expert(n)?;
                Ok(GatedMlp { gate: self.upload_weight(gate)?, up: self.upload_weight(up)?, down: self.upload_weight(down)? })
            })
            .collect()
    }

    fn upload_vector(&self, v: &[f32]) -> Result<CpuTensor> {
        Ok(CpuTensor::new(1, v.len(), v.to_vec()))
    }

    fn set_kv_pool(&self, kv_width: usize, blocks: usize) -> Result<()> {
        *self.kv_pool.lock().unwrap_or_else(|p| p.into_inner()) = Some((kv_width, KvPool::new(blocks)?));
        Ok(())
    }

    fn kv_block_bytes(&self, kv_width: usize) -> usize {
        2 * KV_BLOCK * (kv_width + 16) * std::mem::size_of::<f32>()
    }

    fn kv_pool_usage(&self) -> Option<(usize, usize)> {
        let pool = self.kv_pool.lock().unwrap_or_else(|p| p.into_inner());
        pool.as_ref().map(|(_, p)| (p.blocks() - p.free_blocks(), p.blocks()))
    }

    fn new_kv_cache(&self, kv_width: usize, _capacity: usize) -> Result<CpuKvCache> {
        let pool = self.kv_pool.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let Some((width, pool)) = pool else {
            return Err(Error::InvalidArgument("a KV cache before its pool (Backend::set_kv_pool)".into()));
        };
        if width != kv_width {
            return Err(Error::InvalidArgument(format!("a KV cache of width {kv_width} from a pool of width {width}")));
        }
        // Grown as positions arrive: memory follows use, not the context size.
        Ok(CpuKvCache { width: kv_width, keys: Vec::new(), values: Vec::new(), blocks: Some(BlockList::new(&pool)) })
    }

    fn reserve_kv(&self, cache: &mut CpuKvCache, positions: usize) -> Result<()> {
        cache.blocks.as_mut().map_or(Ok(0), |b| b.grow(positions)).map(|_| ())
    }

    fn to_host(&self, x: &CpuTensor) -> Result<Vec<f32>> {
        Ok(x.data.clone())
    }

    fn save_kv(&self, caches: &[&CpuKvCache], start: usize, len: usize) -> Result<Vec<CpuKvCache>> {
        caches
            .iter()
            .map(|cache| {
                let stride = cache.stride();
                let rows = start.checked_add(len).map(|end| start * stride..end * stride).filter(|r| r.end <= cache.keys.len());
                let Some(rows) = rows else {
                    return Err(Error::InvalidArgument(format!("save_kv: positions {start}..+{len} past the {} cached", cache.positions())));
                };
                Ok(CpuKvCache { width: cache.width, keys: cache.keys[rows.clone()].to_vec(), values: cache.values[rows].to_vec(), blocks: None })
            })
            .collect()
    }

    fn restore_kv(&self, restores: &mut [KvRestore<'_, CpuKvCache>]) -> Result<()> {
        for KvRestore { cache, pieces } in restores {
            for &(saved, start) in pieces.iter() {
                if saved.width != cache.width {
                    return Err(Error::InvalidArgument(format!("restore_kv: width {} into a cache of width {}", saved.width, cache.width)));
                }
                let from = start * cache.stride();
                let end = from + saved.keys.len();
                self.reserve_kv(cache, end / cache.stride())?;
                cache.keys.resize(end, 0.0);
                cache.values.resize(end, 0.0);
                cache.keys[from..].copy_from_slice(&saved.keys);
                cache.values[from..].copy_from_slice(&saved.values);
            }
        }
        Ok(())
    }

    fn kv_bytes(&self, cache: &CpuKvCache) -> usize {
        std::mem::size_of_val(cache.keys.as_slice()) + std::mem::size_of_val(cache.values.as_slice())
    }

    fn tensor_bytes(&self, x: &CpuTensor) -> usize {
        std::mem::size_of_val(x.data.as_slice())
    }

    fn save_tensor(&self, x: &CpuTensor) -> Result<CpuTensor> {
        Ok(x.clone())
    }

    fn restore_tensor(&self, saved: &CpuTensor, x: &mut CpuTensor) -> Result<()> {
        same_shape(saved, x, "restore_tensor")?;
        x.data.copy_from_slice(&saved.data);
        Ok(())
    }

    fn embed(&self, table: &Self::Weight, tokens: &[u32]) -> Result<CpuTensor> {
        let cols = table.cols();
        let mut out = vec![0f32; tokens.len() * cols];
        for (&tok, row) in tokens.iter().zip(out.chunks_exact_mut(cols)) {
            if tok as usize >= table.rows() {
                return Err(Error::InvalidRequest(format!(
                    "token id {tok} is outside the model's vocabulary of {}",
                    table.rows()
                )));
            }
            table.dequant_row(tok as usize, row);
        }
        Ok(CpuTensor::new(tokens.len(), cols, out))
    }

    fn rms_norm(&self, x: &CpuTensor, weight: &CpuTensor, eps: f32) -> Result<CpuTensor> {
        let group = weight.cols;
        if group == 0 || !x.cols.is_multiple_of(group) {
            return Err(Error::InvalidArgument(format!("rms_norm: width {} is not a multiple of {group}", x.cols)));
        }
        let mut out = x.data.clone();
        for g in out.chunks_exact_mut(group) {
            let mean_sq = dot(g, g) / group as f32;
            let scale = 1.0 / (mean_sq + eps).sqrt();
            for (v, w) in g.iter_mut().zip(&weight.data) {
                *v = *v * scale * w;
            }
        }
        Ok(CpuTensor::new(x.rows, x.cols, out))
    }

    fn linear(&self, x: &CpuTensor, w: &Self::Weight, bias: Option<&CpuTensor>) -> Result<CpuTensor> {
        self.linear_sharing(x, w.as_ref(), bias, &mut None)
    }

    /// Quantises the input once for all the products.
    fn norm_linears<const N: usize>(&self, x: &CpuTensor, norm: &CpuTensor, eps: f32, projs: [Proj<'_, Self>; N]) -> Result<[CpuTensor; N]> {
        let xn = self.rms_norm(x, norm, eps)?;
        let mut quantized = None;
        let out = projs.iter().map(|p| self.linear_sharing(&xn, p.weight.as_ref(), p.bias, &mut quantized)).collect::<Result<Vec<_>>>()?;
        out.try_into().map_err(|_| Error::InvalidArgument("norm_linears: projection count".into()))
    }

    /// Quantises the input once for both products.
    fn norm_silu_gate_up(&self, x: &CpuTensor, norm: &CpuTensor, eps: f32, gate: Proj<'_, Self>, up: Proj<'_, Self>) -> Result<CpuTensor> {
        let xn = self.rms_norm(x, norm, eps)?;
        let mut quantized = None;
        let g = self.linear_sharing(&xn, gate.weight.as_ref(), gate.bias, &mut quantized)?;
        let u = self.linear_sharing(&xn, up.weight.as_ref(), up.bias, &mut quantized)?;
        self.silu_mul(&g, &u)
    }

    fn rope(&self, x: &mut CpuTensor, rope: &Rope, start_pos: usize) -> Result<()> {
        let d = rope.head_dim;
        let half = rope.inv_freq.len();
        if d == 0 || !x.cols.is_multiple_of(d) || 2 * half > d {
            return Err(Error::InvalidArgument(format!("rope: width {} and head_dim {d} disagree", x.cols)));
        }
        let cols = x.cols;
        for (t, row) in x.data.chunks_exact_mut(cols).enumerate() {
            let pos = (start_pos + t) as f32;
            let (cos, sin): (Vec<f32>, Vec<f32>) =
                rope.inv_freq.iter().map(|f| { let a = pos * f; (a.cos(), a.sin()) }).unzip();
            for head in row.chunks_exact_mut(d) {
                for i in 0..half {
                    let (a, b) = (head[i], head[i + half]);
                    head[i] = a * cos[i] - b * sin[i];
                    head[i + half] = b * cos[i] + a * sin[i];
                }
            }
        }
        Ok(())
    }

    fn attention(
        &self,
        q: &CpuTensor,
        k: &CpuTensor,
        v: &CpuTensor,
        cache: &mut CpuKvCache,
        start_pos: usize,
        shape: AttentionShape,
    ) -> Result<CpuTensor> {
        let AttentionShape { num_heads, num_kv_heads, head_dim: d } = shape;
        let width = cache.width;
        if k.cols != width || v.cols != width || q.cols != num_heads * d || num_kv_heads * d != width {
            return Err(Error::InvalidArgument("attention: q/k/v widths disagree with the shape".into()));
        }
        let (t, stride) = (q.rows, cache.stride());
        let end = start_pos + t;
        self.reserve_kv(cache, end)?;
        cache.keys.resize(end * stride, 0.0);
        cache.values.resize(end * stride, 0.0);
        for (cached, new) in [(&mut cache.keys, k), (&mut cache.values, v)] {
            for (row, from) in cached[start_pos * stride..].chunks_exact_mut(stride).zip(new.data.chunks_exact(width)) {
                row[..width].copy_from_slice(from);
            }
        }

        let group = num_heads / num_kv_heads;
        let scale = 1.0 / (d as f32).sqrt();
        let (keys, values) = (&cache.keys, &cache.values);
        // One task per head and tile of TILE tokens, each writing its tokens' head_dim slices of
        // the output, in head order: the threads' contiguous shares then hold whole heads, the
        // same causal work each.
        let mut out = vec![0f32; t * num_heads * d];
        let mut slices: Vec<Option<&mut [f32]>> = out.chunks_mut(d).map(Some).collect();
        let mut tasks: Vec<(usize, usize, Vec<&mut [f32]>)> = Vec::new();
        for h in 0..num_heads {
            for first in (0..t).step_by(TILE) {
                let outs = (first..t.min(first + TILE)).filter_map(|tok| slices[tok * num_heads + h].take()).collect();
                tasks.push((h, first, outs));
            }
        }
        // A prompt's queries take their head's keys and values from a contiguous copy, made once
        // per head and thread: in the cache they lie a position's width apart, a stream the
        // prefetchers do not follow. (A token or a few read them in place.)
        let gather = t >= 16;
        self.workers.for_each(&mut tasks, HeadScratch::default, |s: &mut HeadScratch, _, (h, first, outs)| {
            let kvh = *h / group;
            let HeadScratch { scores, head, keys: head_keys, values: head_values } = s;
            let (keys, values, stride, offset) = if gather {
                if *head != Some(kvh) {
                    for (copy, cached) in [(&mut *head_keys, keys), (&mut *head_values, values)] {
                        copy.clear();
                        for row in cached.chunks_exact(stride) {
                            copy.extend_from_slice(&row[kvh * d..][..d]);
                        }
                    }
                    *head = Some(kvh);
                }
                (&head_keys[..], &head_values[..], d, 0)
            } else {
                (&keys[..], &values[..], stride, kvh * d)
            };
            let queries: Vec<Query> = (*first..*first + outs.len())
                .map(|tok| Query { q: &q.data[tok * q.cols + *h * d..][..d], offset, visible: start_pos + tok + 1, scale })
                .collect();
            scores.resize_with(queries.len(), Vec::new);
            let scores = &mut scores[..queries.len()];
            #[cfg(target_arch = "x86_64")]
            if attend_wide_available() {
                // SAFETY: attend_wide_available checked the CPU's features.
                return unsafe { attend_wide(&queries, keys, values, stride, scores, outs) };
            }
            attend::<false>(&queries, keys, values, stride, scores, outs)
        });
        Ok(CpuTensor::new(t, num_heads * d, out))
    }

    fn silu_mul(&self, gate: &CpuTensor, up: &CpuTensor) -> Result<CpuTensor> {
        same_shape(gate, up, "silu_mul")?;
        let data = gate.data.iter().zip(&up.data).map(|(g, u)| silu(*g) * u).collect();
        Ok(CpuTensor::new(gate.rows, gate.cols, data))
    }

    fn add_assign(&self, x: &mut CpuTensor, y: &CpuTensor) -> Result<()> {
        same_shape(x, y, "add")?;
        for (a, b) in x.data.iter_mut().zip(&y.data) {
            *a += b;
        }
        Ok(())
    }

    fn conv1d_silu(&self, x: &CpuTensor, weight: &CpuTensor, state: &mut CpuTensor) -> Result<CpuTensor> {
        let (t, c) = (x.rows, x.cols);
        let k = weight.data.len().checked_div(c).unwrap_or(0);
        if k == 0 || weight.data.len() != c * k || state.data.len() != (k - 1) * c {
            return Err(Error::InvalidArgument(format!(
                "conv1d: {c} channels, weight of {} values, state of {}",
                weight.data.len(),
                state.data.len()
            )));
        }
        // The window over time: the K−1 remembered inputs, then this call's.
        let mut window = state.data.clone();
        window.extend_from_slice(&x.data);
        let mut out = vec![0f32; t * c];
        for (tok, row) in out.chunks_exact_mut(c).enumerate() {
            for (ch, o) in row.iter_mut().enumerate() {
                let taps = &weight.data[ch * k..(ch + 1) * k];
                let sum: f32 = taps.iter().enumerate().map(|(j, w)| w * window[(tok + j) * c + ch]).sum();
                *o = silu(sum);
            }
        }
        state.data.copy_from_slice(&window[t * c..]);
        Ok(CpuTensor::new(t, c, out))
    }

    fn gated_delta_rule(
        &self,
        qkv: &CpuTensor,
        a: &CpuTensor,
        b: &CpuTensor,
        a_log: &CpuTensor,
        dt_bias: &CpuTensor,
        state: &mut CpuTensor,
        shape: DeltaShape,
    ) -> Result<CpuTensor> {
        let DeltaShape { key_heads, value_heads: hv, key_dim: dk, value_dim: dv } = shape;
        let t = qkv.rows;
        let vectors_ok = [a_log, dt_bias].iter().all(|v| v.data.len() == hv);
        if qkv.cols != shape.qkv_width() || [a, b].iter().any(|g| (g.rows, g.cols) != (t, hv)) || !vectors_ok
            || state.data.len() != shape.state_len() || key_heads == 0 || hv % key_heads != 0
        {
            return Err(Error::InvalidArgument(format!("gated_delta_rule: inputs disagree with {shape:?}")));
        }
        let group = hv / key_heads;
        let (k_off, v_off) = (key_heads * dk, 2 * key_heads * dk);
        let mut out = vec![0f32; t * hv * dv];
        // One task per value head: its state is its own, its tokens run in order.
        let mut heads: Vec<_> = state.data.chunks_mut(dk * dv).zip(out_heads(&mut out, t, hv, dv)).collect();
        self.workers.for_each(&mut heads, || (), |_, h, (s, o)| {
            let kh = h / group;
            let decay_rate = -a_log.data[h].exp();
            for tok in 0..t {
                let row = qkv.row(tok);
                let q = l2_normalized(&row[kh * dk..][..dk], 1.0 / (dk as f32).sqrt());
                let k = l2_normalized(&row[k_off + kh * dk..][..dk], 1.0);
                let v = &row[v_off + h * dv..][..dv];
                let beta = 1.0 / (1.0 + (-b.row(tok)[h]).exp());
                let decay = (decay_rate * softplus(a.row(tok)[h] + dt_bias.data[h])).exp();
                for x in s.iter_mut() {
                    *x *= decay;
                }
                // S is [dk, dv]: row i holds key dimension i.
                let mut recalled = vec![0f32; dv];
                for (ki, srow) in k.iter().zip(s.chunks_exact(dv)) {
                    for (r, sv) in recalled.iter_mut().zip(srow) {
                        *r += ki * sv;
                    }
                }
                for (ki, srow) in k.iter().zip(s.chunks_exact_mut(dv)) {
                    for ((sv, vj), rj) in srow.iter_mut().zip(v).zip(&recalled) {
                        *sv += ki * beta * (vj - rj);
                    }
                }
                let o_tok = o.token(tok);
                o_tok.fill(0.0);
                for (qi, srow) in q.iter().zip(s.chunks_exact(dv)) {
                    for (ov, sv) in o_tok.iter_mut().zip(srow) {
                        *ov += qi * sv;
                    }
                }
            }
        });
        Ok(CpuTensor::new(t, hv * dv, out))
    }

    fn gated_rms_norm(&self, x: &CpuTensor, z: &CpuTensor, weight: &CpuTensor, eps: f32) -> Result<CpuTensor> {
        same_shape(x, z, "gated_rms_norm")?;
        let mut out = self.rms_norm(x, weight, eps)?;
        for (o, g) in out.data.iter_mut().zip(&z.data) {
            *o *= silu(*g);
        }
        Ok(out)
    }

    fn sigmoid_gate(&self, x: &mut CpuTensor, gate: &CpuTensor) -> Result<()> {
        if gate.rows != x.rows || (gate.cols != x.cols && gate.cols != 1) {
            return Err(Error::InvalidArgument(format!(
                "sigmoid_gate: gate [{}, {}] for x [{}, {}]",
                gate.rows, gate.cols, x.rows, x.cols
            )));
        }
        let (cols, gate_cols) = (x.cols, gate.cols);
        for (i, v) in x.data.iter_mut().enumerate() {
            let g = gate.data[i / cols * gate_cols + (i % cols) % gate_cols];
            *v /= 1.0 + (-g).exp();
        }
        Ok(())
    }

    fn moe_add(&self, xn: &CpuTensor, router_logits: &CpuTensor, experts: &Self::Experts, routing: Routing, residual: &mut CpuTensor) -> Result<()> {
        let (t, h, e) = (xn.rows, xn.cols, experts.len());
        if (residual.rows, residual.cols) != (t, h) {
            return Err(Error::InvalidArgument(format!("moe: residual [{}, {}] for {t} tokens of {h}", residual.rows, residual.cols)));
        }
        if router_logits.rows != t || router_logits.cols != e || routing.top_k == 0 || routing.top_k > e {
            return Err(Error::InvalidArgument(format!(
                "moe: {t} tokens, router logits [{}, {}], {e} experts, top {}",
                router_logits.rows, router_logits.cols, routing.top_k
            )));
        }
        // Per expert, the tokens routed to it and their weights.
        let mut routed: Vec<Vec<(usize, f32)>> = vec![Vec::new(); e];
        for tok in 0..t {
            for (expert, weight) in route(router_logits.row(tok), routing) {
                routed[expert].push((tok, weight));
            }
        }
        let mut out = vec![0f32; t * h];
        for (mlp, tokens) in experts.iter().zip(&routed) {
            if tokens.is_empty() {
                continue;
            }
            let rows: Vec<f32> = tokens.iter().flat_map(|&(tok, _)| xn.row(tok).iter().copied()).collect();
            let x = CpuTensor::new(tokens.len(), h, rows);
            let act = self.silu_mul(&self.linear(&x, &mlp.gate, None)?, &self.linear(&x, &mlp.up, None)?)?;
            let y = self.linear(&act, &mlp.down, None)?;
            for (i, &(tok, weight)) in tokens.iter().enumerate() {
                for (o, v) in out[tok * h..(tok + 1) * h].iter_mut().zip(y.row(i)) {
                    *o += weight * v;
                }
            }
        }
        self.add_assign(residual, &CpuTensor::new(t, h, out))
    }

    fn set_token_mask(&self, mask: Option<&[u32]>) -> Result<()> {
        *self.token_mask.lock().unwrap_or_else(|p| p.into_inner()) = mask.map(<[u32]>::to_vec);
        Ok(())
    }

    fn set_logit_adjustments(&self, list: &[Adjustment]) -> Result<()> {
        *self.logit_adjust.lock().unwrap_or_else(|p| p.into_inner()) = list.to_vec();
        Ok(())
    }

    fn argmax(&self, x: &CpuTensor, limit: usize) -> Result<u32> {
        let values = self.masked(x);
        Ok(crate::sampling::argmax(&values[..limit.min(values.len())]))
    }

    fn argmax_rows(&self, x: &CpuTensor, limit: usize) -> Result<Vec<u32>> {
        (0..x.rows).map(|r| self.argmax(&CpuTensor::new(1, x.cols, x.row(r).to_vec()), limit)).collect()
    }

    fn top_k(&self, x: &CpuTensor, k: usize, limit: usize) -> Result<Vec<(u32, f32)>> {
        Ok(crate::sampling::top_k(&self.masked(x), k, limit))
    }

    fn chosen_logits(&self, x: &CpuTensor) -> Result<Vec<f32>> {
        Ok(self.masked(x))
    }

    fn last_row(&self, x: &CpuTensor) -> Result<CpuTensor> {
        if x.rows == 0 {
            return Err(Error::InvalidArgument("last_row of an empty tensor".into()));
        }
        Ok(CpuTensor::new(1, x.cols, x.row(x.rows - 1).to_vec()))
    }

    fn rows(&self, x: &CpuTensor, start: usize, len: usize) -> Result<CpuTensor> {
        if start.checked_add(len).is_none_or(|end| end > x.rows) {
            return Err(Error::InvalidArgument(format!("rows {start}..+{len} of a tensor of {} rows", x.rows)));
        }
        Ok(CpuTensor::new(len, x.cols, x.data[start * x.cols..(start + len) * x.cols].to_vec()))
    }

    fn stack_rows(&self, parts: &[CpuTensor]) -> Result<CpuTensor> {
        let cols = parts.first().map_or(0, |p| p.cols);
        if parts.iter().any(|p| p.cols != cols) {
            return Err(Error::InvalidArgument("stack_rows: parts of different widths".into()));
        }
        let data: Vec<f32> = parts.iter().flat_map(|p| p.data.iter().copied()).collect();
        Ok(CpuTensor::new(data.len() / cols.max(1), cols, data))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::Rng;

    fn random(rng: &mut Rng, n: usize) -> Vec<f32> {
        (0..n).map(|_| (rng.next_f64() * 2.0 - 1.0) as f32).collect()
    }

    /// Rows `from..from + n` of a [_, cols] matrix.
    fn rows(data: &[f32], from: usize, n: usize, cols: usize) -> CpuTensor {
        CpuTensor::new(n, cols, data[from * cols..(from + n) * cols].to_vec())
    }

    /// 300 positions prefilled, then 21 tokens in one call (tiles of four and one, a head's copy
    /// of the cache, spans past position 256), against the same 21 one at a time (read in place):
    /// the same bits, and within f32 rounding of attention computed in f64.
    #[test]
    fn attention_gives_each_token_the_bits_it_has_alone() {
        let mut rng = Rng::new(17);
        let shape = AttentionShape { num_heads: 4, num_kv_heads: 2, head_dim: 72 };
        let (d, width, q_cols) = (72, 2 * 72, 4 * 72);
        let (prompt, extra) = (300, 21);
        let (qs, ks, vs) = (random(&mut rng, (prompt + extra) * q_cols), random(&mut rng, (prompt + extra) * width), random(&mut rng, (prompt + extra) * width));
        let b = CpuBackend::new(2).unwrap();
        b.set_kv_pool(width, 16).unwrap();
        let prefilled = || {
            let mut cache = b.new_kv_cache(width, 0).unwrap();
            b.attention(&rows(&qs, 0, prompt, q_cols), &rows(&ks, 0, prompt, width), &rows(&vs, 0, prompt, width), &mut cache, 0, shape).unwrap();
            cache
        };
        let mut cache = prefilled();
        let together = b.attention(&rows(&qs, prompt, extra, q_cols), &rows(&ks, prompt, extra, width), &rows(&vs, prompt, extra, width), &mut cache, prompt, shape).unwrap();
        let mut cache = prefilled();
        for i in 0..extra {
            let at = prompt + i;
            let alone = b.attention(&rows(&qs, at, 1, q_cols), &rows(&ks, at, 1, width), &rows(&vs, at, 1, width), &mut cache, at, shape).unwrap();
            let row = &together.data[i * q_cols..(i + 1) * q_cols];
            assert!(row.iter().zip(&alone.data).all(|(a, b)| a.to_bits() == b.to_bits()), "token {i}");
            for h in 0..4 {
                let (q, kv) = (&qs[at * q_cols + h * d..][..d], (h / 2) * d);
                let scores: Vec<f64> = (0..=at).map(|p| (0..d).map(|j| f64::from(q[j]) * f64::from(ks[p * width + kv + j])).sum::<f64>() / (d as f64).sqrt()).collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = scores.iter().map(|s| (s - max).exp()).sum();
                for j in 0..d {
                    let want: f64 = scores.iter().enumerate().map(|(p, s)| (s - max).exp() / sum * f64::from(vs[p * width + kv + j])).sum();
                    assert!((f64::from(row[h * d + j]) - want).abs() < 1e-5, "token {i} head {h}: {} vs {want}", row[h * d + j]);
                }
            }
        }
    }

    /// The AVX2 copy of `attend` gives the plain one's bits.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn wide_attention_gives_the_plain_bits() {
        if !attend_wide_available() {
            return;
        }
        let mut rng = Rng::new(19);
        let (d, positions) = (128, 301);
        let (keys, values) = (random(&mut rng, positions * d), random(&mut rng, positions * d));
        let qs: Vec<Vec<f32>> = (0..3).map(|_| random(&mut rng, d)).collect();
        let queries: Vec<Query> = qs.iter().enumerate().map(|(i, q)| Query { q, offset: 0, visible: positions - 2 + i, scale: 0.09 }).collect();
        let run = |wide: bool| {
            let mut out = vec![f32::NAN; 3 * d];
            let mut outs: Vec<&mut [f32]> = out.chunks_mut(d).collect();
            let mut scores = vec![Vec::new(); 3];
            if wide {
                // SAFETY: AVX2, checked above.
                unsafe { attend_wide(&queries, &keys, &values, d, &mut scores, &mut outs) };
            } else {
                attend::<false>(&queries, &keys, &values, d, &mut scores, &mut outs);
            }
            out.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        };
        assert_eq!(run(true), run(false));
    }
}
