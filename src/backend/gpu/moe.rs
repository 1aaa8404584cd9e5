//! Mixture of experts on the GPU (kernels/moe.hip). A layer's experts live stacked, one buffer per
//! projection (`[E, rows, cols]`, bf16 or FP8 block-scaled), so that kernels pick them by the ids
//! the routing leaves in device memory: nothing crosses to the host inside a step, and a recorded
//! decode step replays with whatever experts each token chooses.
//!
//! - Decode (one token): `moe_route`, then the chosen experts' gate/up GEMV (grid: row tiles x
//!   top_k, SiLU·up fused), their down GEMV (row tiles x top_k) and `moe_combine`, which weighs and
//!   sums the top_k outputs in expert order and adds them to the residual stream. Only the chosen
//!   experts' weights are read. A whole block (`moe_block`) also normalises the input inside
//!   gate/up and runs a shared expert of the same shape as one more slot, weighed by its sigmoid
//!   gate in the combine: four launches.
//! - Prefill: `moe_route`, the assignments grouped by expert (`moe_count`, `moe_index`), the inputs
//!   gathered in that order, grouped GEMMs for gate and up (one launch), `silu_mul`, a grouped GEMM
//!   for down, and `moe_combine`; `MOE_CHUNK_TOKENS` tokens at a time.


use super::runtime::Arg;
use super::{
    as_bytes, blocks, byte_size, DeviceBuffer, GpuBackend, GpuTensor, GpuWeight, BLOCK, FP8_GEMV_ROWS, FP8_GEMV_STATIC_SHARED, GEMV1_TOKENS,
    FP8_GEMV_THREADS, GEMM_BM, GEMM_BN, GEMM_THREADS, GEMV_MAX_STAGED, GEMV_ROWS, GEMV_THREADS,
};
use crate::backend::{compose_moe_block, Backend, GatedMlp, HostMlp, Routing, SharedExpert};
use crate::quant::fp8::FP8_BLOCK;
use crate::quant::{DType, QuantMatrix};
use crate::{Error, Result};

/// MOE_MAX_K of kernels/moe.hip: the most experts one token may take.
const MOE_MAX_K: usize = 32;
/// Prefill runs the experts over at most this many tokens at a time, which bounds its temporaries
/// (the gathered inputs and the experts' outputs are `[tokens · top_k, H]` each).
const MOE_CHUNK_TOKENS: usize = 4096;
/// Threads of moe_count and moe_index.
const MOE_INDEX_THREADS: u32 = 256;

/// One projection of every expert of a layer: `[count, rows, cols]` in one buffer, bf16, or E4M3
/// codes with their f32 scale grids `[count, ceil(rows/128), ceil(cols/128)]` in `scales`.
struct Stacked {
    buf: DeviceBuffer,
    scales: Option<DeviceBuffer>,
}

impl Stacked {
    fn scales(&self) -> u64 {
        self.scales.as_ref().map_or(0, |s| s.ptr)
    }
}

/// The routed experts of one layer on the GPU (see the module's documentation).
pub struct GpuExperts {
    gate: Stacked,
    up: Stacked,
    down: Stacked,
    count: usize,
    hidden: usize,
    inter: usize,
    fp8: bool,
}

/// Whether the GPU keeps `m` as FP8 (as `upload_weight` does): block-scaled codes, or synthetic
/// FP8 made on the device.
fn keeps_fp8(m: &dyn QuantMatrix) -> bool {
    m.fp8_blocks().is_some() || (m.synthetic().is_some() && m.dtype() == DType::F8E4M3)
}

impl GpuBackend {
    /// `Backend::upload_experts`: the stacked buffers are sized from expert 0, then every expert is
    /// copied into its slice as it arrives (one expert's matrices on the host at a time). FP8 stays
    /// FP8 when all three of expert 0's matrices are FP8; otherwise every expert is widened to bf16.
    pub(super) fn stack_experts(&self, count: usize, expert: &mut dyn FnMut(usize) -> Result<HostMlp>) -> Result<GpuExperts> {
        if count == 0 {
            return Err(Error::InvalidArgument("a mixture of no experts".into()));
        }
        let first = expert(0)?;
        let (inter, hidden) = (first.gate.rows(), first.gate.cols());
        let fp8 = [&first.gate, &first.up, &first.down].iter().all(|m| keeps_fp8(m.as_ref()));
        let gate = self.stacked(count, inter, hidden, fp8)?;
        let up = self.stacked(count, inter, hidden, fp8)?;
        let down = self.stacked(count, hidden, inter, fp8)?;
        let mut next = Some(first);
        for n in 0..count {
            let m = match next.take() {
                Some(m) => m,
                None => expert(n)?,
            };
            for (what, w, stack, rows, cols) in
                [("gate", &m.gate, &gate, inter, hidden), ("up", &m.up, &up, inter, hidden), ("down", &m.down, &down, hidden, inter)]
            {
                if (w.rows(), w.cols()) != (rows, cols) {
                    return Err(Error::InvalidArgument(format!(
                        "expert {n}: {what} projection [{}, {}], expected [{rows}, {cols}] as expert 0's",
                        w.rows(),
                        w.cols()
                    )));
                }
                self.upload_slice(w.as_ref(), stack, n, fp8)?;
            }
        }
        Ok(GpuExperts { gate, up, down, count, hidden, inter, fp8 })
    }

    fn stacked(&self, count: usize, rows: usize, cols: usize, fp8: bool) -> Result<Stacked> {
        let what = format!("{count} experts' weights [{rows}, {cols}]");
        let buf = DeviceBuffer::new(&self.rt, byte_size(&what, &[count, rows, cols, if fp8 { 1 } else { 2 }])?)?;
        let scales = if fp8 {
            let grid = [count, rows.div_ceil(FP8_BLOCK), cols.div_ceil(FP8_BLOCK), 4];
            Some(DeviceBuffer::new(&self.rt, byte_size(&what, &grid)?)?)
        } else {
            None
        };
        Ok(Stacked { buf, scales })
    }

    /// Writes `w` (already checked to be `[rows, cols]` of the stack) into slice `n`.
    fn upload_slice(&self, w: &dyn QuantMatrix, stack: &Stacked, n: usize, fp8: bool) -> Result<()> {
        let (rows, cols) = (w.rows(), w.cols());
        let elems = rows * cols;
        if fp8 {
            let grid = rows.div_ceil(FP8_BLOCK) * cols.div_ceil(FP8_BLOCK);
            let codes_at = stack.buf.ptr + (n * elems) as u64;
            let scales_at = stack.scales() + (n * grid * 4) as u64;
            if let Some((codes, scales)) = w.fp8_blocks() {
                if codes.len() != elems || scales.len() != grid {
                    return Err(Error::InvalidArgument(format!("expert {n}: FP8 matrix [{rows}, {cols}] of {} codes and {} scales", codes.len(), scales.len())));
                }
                self.rt.upload(codes_at, codes)?;
                return self.rt.upload(scales_at, as_bytes(scales));
            }
            return match w.synthetic() {
                Some((seed, scale)) if w.dtype() == DType::F8E4M3 => {
                    let args = [Arg::Ptr(codes_at), Arg::I64(elems as i64), Arg::U64(seed)];
                    self.rt.launch("fill_random_fp8", [blocks(elems, BLOCK).min(65535 * 8), 1, 1], [BLOCK, 1, 1], 0, &args)?;
                    self.rt.upload(scales_at, as_bytes(&vec![scale; grid]))
                }
                _ => Err(Error::Unsupported(format!(
                    "expert {n} is stored as {} where expert 0 is FP8: one layer's experts in mixed formats",
                    w.dtype().name()
                ))),
            };
        }
        let at = stack.buf.ptr + (n * elems * 2) as u64;
        if let Some((seed, scale)) = w.synthetic().filter(|_| w.dtype() != DType::F8E4M3) {
            let args = [Arg::Ptr(at), Arg::I64(elems as i64), Arg::U64(seed), Arg::F32(scale)];
            return self.rt.launch("fill_random_bf16", [blocks(elems, BLOCK).min(65535 * 8), 1, 1], [BLOCK, 1, 1], 0, &args);
        }
        // Widened on the host, as upload_weight does.
        self.upload_widened(w, at)
    }

    /// `Backend::moe_add`.
    pub(super) fn moe_forward(&self, xn: &GpuTensor, logits: &GpuTensor, ex: &GpuExperts, routing: Routing, residual: &mut GpuTensor) -> Result<()> {
        let (t, h, e, k) = (xn.rows, ex.hidden, ex.count, routing.top_k);
        if xn.cols != h || logits.rows != t || logits.cols != e || k == 0 || k > e || (residual.rows, residual.cols) != (t, h) {
            return Err(Error::InvalidArgument(format!(
                "moe: {t} tokens of {}, router logits [{}, {}], {e} experts of width {h}, top {k}, residual [{}, {}]",
                xn.cols, logits.rows, logits.cols, residual.rows, residual.cols
            )));
        }
        if k > MOE_MAX_K {
            return Err(Error::Unsupported(format!("{k} experts per token on the GPU (at most {MOE_MAX_K})")));
        }
        let out = residual.buf.ptr;
        // One token, or a few (checking drafts) one at a time, each as a decode step runs it.
        if t <= GEMV1_TOKENS && self.moe_gemv_fits(ex) {
            for r in 0..t {
                let (x_at, logits_at) = ((r * h * 4) as u64, (r * e * 4) as u64);
                self.moe_decode(xn.buf.ptr + x_at, None, logits.buf.ptr + logits_at, ex, None, routing, out + x_at)?;
            }
            return Ok(());
        }
        for first in (0..t).step_by(MOE_CHUNK_TOKENS) {
            let tokens = MOE_CHUNK_TOKENS.min(t - first);
            let (x_at, logits_at, out_at) =
                ((first * h * 4) as u64, (first * e * 4) as u64, (first * h * 4) as u64);
            self.moe_grouped(xn.buf.ptr + x_at, logits.buf.ptr + logits_at, tokens, ex, routing, out + out_at)?;
        }
        Ok(())
    }

    /// `Backend::moe_block_add`: one token in four launches (route, gate/up with the norm fused
    /// and the shared expert as one more slot, down, combine into `x`) where the shapes allow;
    /// the composed ops otherwise.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe_block(
        &self,
        x: &mut GpuTensor,
        norm: &GpuTensor,
        eps: f32,
        logits: &GpuTensor,
        ex: &GpuExperts,
        shared: Option<SharedExpert<'_, GpuBackend>>,
        routing: Routing,
    ) -> Result<()> {
        let (h, i) = (ex.hidden, ex.inter);
        let same = |w: &GpuWeight, rows, cols| (w.rows, w.cols) == (rows, cols) && w.suffix() == if ex.fp8 { "fp8" } else { "bf16" };
        let t = x.rows;
        let shared_fits = shared.as_ref().is_none_or(|s| {
            same(&s.mlp.gate, i, h) && same(&s.mlp.up, i, h) && same(&s.mlp.down, h, i) && (s.gate_logits.rows, s.gate_logits.cols) == (t, 1)
        });
        // One token, or a few (checking drafts) one at a time, each as a decode step runs it.
        let fused = (1..=GEMV1_TOKENS).contains(&t)
            && x.cols == h
            && norm.cols == h
            && logits.rows == t
            && logits.cols == ex.count
            && (1..=ex.count.min(MOE_MAX_K)).contains(&routing.top_k)
            && shared_fits
            && (ex.fp8 || h <= GEMV_MAX_STAGED)
            && self.moe_gemv_fits(ex);
        if !fused {
            return compose_moe_block(self, x, norm, eps, logits, ex, shared, routing);
        }
        for r in 0..t {
            let (x_at, logits_at) = ((r * h * 4) as u64, (r * ex.count * 4) as u64);
            let gate_logits = shared.as_ref().map(|s| GpuBackend::row_view(s.gate_logits, r));
            let shared_row = shared.as_ref().zip(gate_logits.as_ref()).map(|(s, g)| SharedExpert { mlp: s.mlp, gate_logits: g });
            let at = x.buf.ptr + x_at;
            self.moe_decode(at, Some((norm, eps)), logits.buf.ptr + logits_at, ex, shared_row.as_ref(), routing, at)?;
        }
        Ok(())
    }

    /// Whether the one-token expert GEMVs take these experts: whole 16-byte chunks per row, and
    /// for FP8 an input staged in shared memory that fits.
    fn moe_gemv_fits(&self, ex: &GpuExperts) -> bool {
        let (h, i) = (ex.hidden, ex.inter);
        if ex.fp8 {
            let staged = fp8_staged(h.max(i)) + FP8_GEMV_STATIC_SHARED as usize;
            h % 16 == 0 && i % 16 == 0 && staged <= self.rt.max_shared_bytes() as usize
        } else {
            h % 8 == 0 && i % 8 == 0
        }
    }

    /// Routing of `tokens` rows of router logits into ids and weights `[tokens, top_k]`.
    fn moe_route(&self, logits: u64, tokens: usize, experts: usize, routing: Routing, ids: u64, weights: u64) -> Result<()> {
        let args = [
            Arg::Ptr(logits),
            Arg::I32(experts as i32),
            Arg::I32(routing.top_k as i32),
            Arg::I32(i32::from(routing.normalize)),
            Arg::Ptr(ids),
            Arg::Ptr(weights),
        ];
        self.rt.launch("moe_route", [tokens as u32, 1, 1], [self.rt.warp_size(), 1, 1], 0, &args)
    }

    /// One token: route, the chosen experts' GEMVs (and the shared expert's, as slot top_k), the
    /// weighted sum added to `out` `[1, H]`. `x` is normalised by the gate/up kernel when `norm`
    /// is given; `out` may be `x`.
    #[allow(clippy::too_many_arguments)]
    fn moe_decode(
        &self,
        x: u64,
        norm: Option<(&GpuTensor, f32)>,
        logits: u64,
        ex: &GpuExperts,
        shared: Option<&SharedExpert<'_, GpuBackend>>,
        routing: Routing,
        out: u64,
    ) -> Result<()> {
        let (h, i, k) = (ex.hidden, ex.inter, routing.top_k);
        let slots = k + usize::from(shared.is_some());
        let ids = self.scratch(k * 4)?;
        let weights = self.scratch(k * 4)?;
        self.moe_route(logits, 1, ex.count, routing, ids.ptr, weights.ptr)?;
        let act = self.scratch(byte_size("expert activations", &[slots, i, 4])?)?;
        let y = self.scratch(byte_size("expert outputs", &[slots, h, 4])?)?;
        let (norm_w, eps) = norm.map_or((0, 0.0), |(w, eps)| (w.buf.ptr, eps));
        let shared_ptr = |w: fn(&GatedMlp<GpuBackend>) -> &GpuWeight| shared.map_or((0, 0), |s| (w(s.mlp).buf.ptr, w(s.mlp).scales()));
        let ((sg, sg_scales), (su, su_scales), (sd, sd_scales)) = (shared_ptr(|m| &m.gate), shared_ptr(|m| &m.up), shared_ptr(|m| &m.down));
        let gate_up = [
            Arg::Ptr(ex.gate.buf.ptr),
            Arg::Ptr(ex.up.buf.ptr),
            Arg::Ptr(ex.gate.scales()),
            Arg::Ptr(ex.up.scales()),
            Arg::Ptr(ids.ptr),
            Arg::Ptr(x),
            Arg::Ptr(norm_w),
            Arg::F32(eps),
            Arg::Ptr(sg),
            Arg::Ptr(su),
            Arg::Ptr(sg_scales),
            Arg::Ptr(su_scales),
            Arg::Ptr(act.ptr),
            Arg::I32(i as i32),
            Arg::I32(h as i32),
            Arg::I32(k as i32),
        ];
        let down = [
            Arg::Ptr(ex.down.buf.ptr),
            Arg::Ptr(ex.down.scales()),
            Arg::Ptr(ids.ptr),
            Arg::Ptr(act.ptr),
            Arg::Ptr(sd),
            Arg::Ptr(sd_scales),
            Arg::Ptr(y.ptr),
            Arg::I32(h as i32),
            Arg::I32(i as i32),
            Arg::I32(k as i32),
        ];
        let k32 = slots as u32;
        if ex.fp8 {
            let block = [FP8_GEMV_THREADS, 1, 1];
            // moe_down_fp8 takes two tiles of rows a block.
            let (gi, gh) = ([blocks(i, FP8_GEMV_ROWS), k32, 1], [blocks(h, 2 * FP8_GEMV_ROWS), k32, 1]);
            self.rt.launch("moe_gate_up_fp8", gi, block, fp8_staged(h) as u32, &gate_up)?;
            self.rt.launch("moe_down_fp8", gh, block, fp8_staged(i) as u32, &down)?;
        } else {
            let rows = GEMV_ROWS * GEMV_THREADS / self.rt.warp_size();
            let block = [GEMV_THREADS, 1, 1];
            // The input normalised into shared memory (f32) when the norm is fused.
            let staged = if norm.is_some() { (h * 4) as u32 } else { 0 };
            self.rt.launch("moe_gate_up_bf16", [blocks(i, rows), k32, 1], block, staged, &gate_up)?;
            self.rt.launch("moe_down_bf16", [blocks(h, rows), k32, 1], block, 0, &down)?;
        }
        let shared_logit = shared.map_or(0, |s| s.gate_logits.buf.ptr);
        let args = [Arg::Ptr(y.ptr), Arg::Ptr(0), Arg::Ptr(weights.ptr), Arg::Ptr(shared_logit), Arg::I32(k as i32), Arg::I32(h as i32), Arg::Ptr(out)];
        self.rt.launch("moe_combine", [blocks(h, BLOCK), 1, 1], [BLOCK, 1, 1], 0, &args)
    }

    /// `tokens` tokens: route, group the assignments by expert, grouped GEMMs, the weighted sum
    /// added to `out` `[tokens, H]`.
    fn moe_grouped(&self, x: u64, logits: u64, tokens: usize, ex: &GpuExperts, routing: Routing, out: u64) -> Result<()> {
        let (h, i, e, k) = (ex.hidden, ex.inter, ex.count, routing.top_k);
        let n = tokens * k;
        // Row tiles of the grouped GEMMs: Σ ceil(count_e / BM) <= (n + (BM - 1) · nonempty experts) / BM.
        let max_tiles = (n + (GEMM_BM - 1) * e.min(n)) / GEMM_BM;
        if max_tiles > 65_535 || n > i32::MAX as usize / h.max(i) {
            return Err(Error::Unsupported(format!("{e} experts over {tokens} tokens on the GPU")));
        }
        let ids = self.scratch(n * 4)?;
        let weights = self.scratch(n * 4)?;
        self.moe_route(logits, tokens, e, routing, ids.ptr, weights.ptr)?;

        let index_block = [MOE_INDEX_THREADS, 1, 1];
        let counts = self.scratch(e * 4)?;
        let args = [Arg::Ptr(ids.ptr), Arg::I32(n as i32), Arg::Ptr(counts.ptr)];
        self.rt.launch("moe_count", [e as u32, 1, 1], index_block, 0, &args)?;
        let offsets = self.scratch((e + 1) * 4)?;
        let tiles = self.scratch((e + 1) * 4)?;
        let rows = self.scratch(n * 4)?;
        let slot_row = self.scratch(n * 4)?;
        let args = [
            Arg::Ptr(ids.ptr),
            Arg::I32(n as i32),
            Arg::Ptr(counts.ptr),
            Arg::I32(e as i32),
            Arg::Ptr(offsets.ptr),
            Arg::Ptr(tiles.ptr),
            Arg::Ptr(rows.ptr),
            Arg::Ptr(slot_row.ptr),
        ];
        self.rt.launch("moe_index", [e as u32, 1, 1], index_block, 0, &args)?;

        let xg = self.tensor(n, h)?;
        let args = [Arg::Ptr(x), Arg::Ptr(rows.ptr), Arg::I32(k as i32), Arg::I32(h as i32), Arg::Ptr(xg.buf.ptr)];
        self.rt.launch("moe_gather", [n as u32, 1, 1], [BLOCK, 1, 1], 0, &args)?;

        let kernel = if ex.fp8 { "moe_gemm_fp8" } else { "moe_gemm_bf16" };
        let grouped = |w: &Stacked, y: u64, w2: &Stacked, y2: u64, x: u64, cols: usize, width: usize| {
            [
                Arg::Ptr(w.buf.ptr),
                Arg::Ptr(w.scales()),
                Arg::Ptr(y),
                Arg::Ptr(w2.buf.ptr),
                Arg::Ptr(w2.scales()),
                Arg::Ptr(y2),
                Arg::Ptr(x),
                Arg::Ptr(offsets.ptr),
                Arg::Ptr(tiles.ptr),
                Arg::I32(e as i32),
                Arg::I32(cols as i32),
                Arg::I32(width as i32),
            ]
        };
        let (g, u) = (self.tensor(n, i)?, self.tensor(n, i)?);
        let args = grouped(&ex.gate, g.buf.ptr, &ex.up, u.buf.ptr, xg.buf.ptr, i, h);
        self.rt.launch(kernel, [blocks(i, GEMM_BN as u32), max_tiles as u32, 2], [GEMM_THREADS, 1, 1], 0, &args)?;
        let act = self.silu_mul(&g, &u)?;
        drop((g, u, xg));
        let y = self.tensor(n, h)?;
        let args = grouped(&ex.down, y.buf.ptr, &ex.down, y.buf.ptr, act.buf.ptr, h, i);
        self.rt.launch(kernel, [blocks(h, GEMM_BN as u32), max_tiles as u32, 1], [GEMM_THREADS, 1, 1], 0, &args)?;

        let args = [
            Arg::Ptr(y.buf.ptr),
            Arg::Ptr(slot_row.ptr),
            Arg::Ptr(weights.ptr),
            Arg::Ptr(0),
            Arg::I32(k as i32),
            Arg::I32(h as i32),
            Arg::Ptr(out),
        ];
        self.rt.launch("moe_combine", [blocks(h, BLOCK), tokens as u32, 1], [BLOCK, 1, 1], 0, &args)
    }
}

/// Dynamic shared memory of the FP8 GEMVs for inputs of `cols` values: f16, in whole 128-column blocks.
fn fp8_staged(cols: usize) -> usize {
    cols.div_ceil(FP8_BLOCK) * FP8_BLOCK * 2
}
