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
    as_bytes, blocks, byte_size, packed_gemv_shared, packed_kernel, packed_slots_unfit, DeviceBuffer, GpuBackend, GpuTensor, GpuWeight, BLOCK, FP8_GEMV_ROWS, FP8_GEMV_STATIC_SHARED, GEMV1_TOKENS,
    FP8_GEMV_THREADS, GEMM_BM, GEMM_BN, GEMM_THREADS, GEMV_MAX_STAGED, GEMV_ROWS, GEMV_THREADS,
};
use crate::backend::{compose_moe_block, Backend, GatedMlp, HostMlp, Routing, SharedExpert};
use crate::quant::fp8::FP8_BLOCK;
use crate::quant::{packed, DType, GgmlFormat, QuantMatrix};
use crate::{Error, Result};

/// MOE_MAX_K of kernels/moe.hip: the most experts one token may take.
const MOE_MAX_K: usize = 32;
/// Prefill runs the experts over at most this many tokens at a time, which bounds its temporaries
/// (the gathered inputs and the experts' outputs are `[tokens · top_k, H]` each).
const MOE_CHUNK_TOKENS: usize = 4096;
/// Threads of moe_count and moe_index.
const MOE_INDEX_THREADS: u32 = 256;

/// How one projection's experts lie on the device.
#[derive(Clone, Copy, PartialEq, Debug)]
enum ExpertFormat {
    Bf16,
    Fp8,
    /// Each expert's matrix in the device layout of `quant::packed`, as `upload_weight` keeps it.
    Packed(GgmlFormat),
}

/// One projection of every expert of a layer, `[count, rows, cols]` in one buffer, an expert every
/// `stride` bytes: bf16, E4M3 codes with their f32 scale grids `[count, ceil(rows/128),
/// ceil(cols/128)]` in `scales`, or packed planes (rounded up to 256 bytes an expert, which keeps
/// every plane as aligned as a weight of its own).
struct Stacked {
    buf: DeviceBuffer,
    scales: Option<DeviceBuffer>,
    format: ExpertFormat,
    stride: usize,
    /// Device bytes, scales included.
    bytes: usize,
}

impl Stacked {
    fn scales(&self) -> u64 {
        self.scales.as_ref().map_or(0, |s| s.ptr)
    }

    /// Kernel suffix, as `GpuWeight::suffix`: a shared expert with the same one joins the launch.
    fn suffix(&self) -> &'static str {
        match self.format {
            ExpertFormat::Bf16 => "bf16",
            ExpertFormat::Fp8 => "fp8",
            ExpertFormat::Packed(f) => packed_kernel(f).1,
        }
    }
}

/// The routed experts of one layer on the GPU (see the module's documentation). Gate and up share
/// a format (one launch takes both); down may have another (Q4_K_M files keep it in Q6_K).
pub struct GpuExperts {
    gate: Stacked,
    up: Stacked,
    down: Stacked,
    count: usize,
    hidden: usize,
    inter: usize,
}

impl GpuExperts {
    /// Bytes the experts take on the device.
    pub fn device_bytes(&self) -> usize {
        [&self.gate, &self.up, &self.down].iter().map(|s| s.bytes).sum()
    }
}

/// Whether the GPU keeps `m` as FP8 (as `upload_weight` does): block-scaled codes, or synthetic
/// FP8 made on the device.
fn keeps_fp8(m: &dyn QuantMatrix) -> bool {
    m.fp8_blocks().is_some() || (m.synthetic().is_some() && m.dtype() == DType::F8E4M3)
}

/// The formats of the gate/up and the down stacks, from expert 0's matrices: FP8 when all three are;
/// otherwise a block format stays packed (gate and up when both have the same one), and the rest is
/// widened to bf16.
fn expert_formats(first: &HostMlp) -> (ExpertFormat, ExpertFormat) {
    if [&first.gate, &first.up, &first.down].iter().all(|m| keeps_fp8(m.as_ref())) {
        return (ExpertFormat::Fp8, ExpertFormat::Fp8);
    }
    let packed = |m: &dyn QuantMatrix| packed::packed_format(m).map_or(ExpertFormat::Bf16, ExpertFormat::Packed);
    let (gate, up) = (packed(first.gate.as_ref()), packed(first.up.as_ref()));
    (if gate == up { gate } else { ExpertFormat::Bf16 }, packed(first.down.as_ref()))
}

impl GpuBackend {
    /// `Backend::upload_experts`: the stacked buffers are sized from expert 0, then every expert is
    /// copied into its slice as it arrives (one expert's matrices on the host at a time), in the
    /// formats `expert_formats` picks.
    pub(super) fn stack_experts(&self, count: usize, expert: &mut dyn FnMut(usize) -> Result<HostMlp>) -> Result<GpuExperts> {
        if count == 0 {
            return Err(Error::InvalidArgument("a mixture of no experts".into()));
        }
        let first = expert(0)?;
        let (inter, hidden) = (first.gate.rows(), first.gate.cols());
        let (gate_up, down_format) = expert_formats(&first);
        let gate = self.stacked(count, inter, hidden, gate_up)?;
        let up = self.stacked(count, inter, hidden, gate_up)?;
        let down = self.stacked(count, hidden, inter, down_format)?;
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
                self.upload_slice(w.as_ref(), stack, n)?;
            }
        }
        Ok(GpuExperts { gate, up, down, count, hidden, inter })
    }

    fn stacked(&self, count: usize, rows: usize, cols: usize, format: ExpertFormat) -> Result<Stacked> {
        let what = format!("{count} experts' weights [{rows}, {cols}]");
        let stride = match format {
            ExpertFormat::Bf16 => byte_size(&what, &[rows, cols, 2])?,
            ExpertFormat::Fp8 => byte_size(&what, &[rows, cols])?,
            ExpertFormat::Packed(f) => packed::plane_offsets(f, rows, cols)
                .and_then(|p| p.2.checked_next_multiple_of(256))
                .ok_or_else(|| Error::InvalidArgument(format!("{what}: too large")))?,
        };
        let codes = byte_size(&what, &[count, stride])?;
        let buf = DeviceBuffer::new(&self.rt, codes)?;
        let (scales, scale_bytes) = if format == ExpertFormat::Fp8 {
            let bytes = byte_size(&what, &[count, rows.div_ceil(FP8_BLOCK), cols.div_ceil(FP8_BLOCK), 4])?;
            (Some(DeviceBuffer::new(&self.rt, bytes)?), bytes)
        } else {
            (None, 0)
        };
        Ok(Stacked { buf, scales, format, stride, bytes: codes + scale_bytes })
    }

    /// Writes `w` (already checked to be `[rows, cols]` of the stack) into slice `n`.
    fn upload_slice(&self, w: &dyn QuantMatrix, stack: &Stacked, n: usize) -> Result<()> {
        let (rows, cols) = (w.rows(), w.cols());
        let elems = rows * cols;
        let at = stack.buf.ptr + (n * stack.stride) as u64;
        let mixed = |format: &str| {
            Error::Unsupported(format!("expert {n} is stored as {} where expert 0 is {format}: one layer's experts in mixed formats", w.dtype().name()))
        };
        match stack.format {
            ExpertFormat::Fp8 => {
                let grid = rows.div_ceil(FP8_BLOCK) * cols.div_ceil(FP8_BLOCK);
                let scales_at = stack.scales() + (n * grid * 4) as u64;
                if let Some((codes, scales)) = w.fp8_blocks() {
                    if codes.len() != elems || scales.len() != grid {
                        return Err(Error::InvalidArgument(format!("expert {n}: FP8 matrix [{rows}, {cols}] of {} codes and {} scales", codes.len(), scales.len())));
                    }
                    self.rt.upload(at, codes)?;
                    return self.rt.upload(scales_at, as_bytes(scales));
                }
                match w.synthetic() {
                    Some((seed, scale)) if w.dtype() == DType::F8E4M3 => {
                        let args = [Arg::Ptr(at), Arg::I64(elems as i64), Arg::U64(seed)];
                        self.rt.launch("fill_random_fp8", [blocks(elems, BLOCK).min(65535 * 8), 1, 1], [BLOCK, 1, 1], 0, &args)?;
                        self.rt.upload(scales_at, as_bytes(&vec![scale; grid]))
                    }
                    _ => Err(mixed("FP8")),
                }
            }
            ExpertFormat::Packed(format) => match packed::pack(w, None) {
                Some(p) => {
                    let p = p?;
                    if p.format != format {
                        return Err(mixed(format.name()));
                    }
                    self.rt.upload(at, &p.bytes)
                }
                None => Err(mixed(format.name())),
            },
            ExpertFormat::Bf16 => {
                if let Some((seed, scale)) = w.synthetic().filter(|_| w.dtype() != DType::F8E4M3) {
                    let args = [Arg::Ptr(at), Arg::I64(elems as i64), Arg::U64(seed), Arg::F32(scale)];
                    return self.rt.launch("fill_random_bf16", [blocks(elems, BLOCK).min(65535 * 8), 1, 1], [BLOCK, 1, 1], 0, &args);
                }
                // Widened on the host, as upload_weight does.
                self.upload_widened(w, at)
            }
        }
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
        let same = |w: &GpuWeight, stack: &Stacked, rows, cols| (w.rows, w.cols) == (rows, cols) && w.suffix() == stack.suffix();
        let t = x.rows;
        let shared_fits = shared.as_ref().is_none_or(|s| {
            same(&s.mlp.gate, &ex.gate, i, h)
                && same(&s.mlp.up, &ex.up, i, h)
                && same(&s.mlp.down, &ex.down, h, i)
                && (s.gate_logits.rows, s.gate_logits.cols) == (t, 1)
        });
        // One token, or a few (checking drafts) one at a time, each as a decode step runs it.
        let fused = (1..=GEMV1_TOKENS).contains(&t)
            && x.cols == h
            && norm.cols == h
            && logits.rows == t
            && logits.cols == ex.count
            && (1..=ex.count.min(MOE_MAX_K)).contains(&routing.top_k)
            && shared_fits
            && (ex.gate.format != ExpertFormat::Bf16 || h <= GEMV_MAX_STAGED)
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

    /// Whether the one-token expert GEMVs take these experts: for bf16 whole 8-value chunks per row,
    /// for FP8 whole 16-value chunks and an input staged in shared memory that fits; packed
    /// formats (whole runs already) the staged input and their weight slots, where their
    /// kernels have them (packed_slots_unfit).
    fn moe_gemv_fits(&self, ex: &GpuExperts) -> bool {
        let (h, i) = (ex.hidden, ex.inter);
        [(&ex.gate, h), (&ex.down, i)].into_iter().all(|(stack, k)| match stack.format {
            ExpertFormat::Bf16 => k % 8 == 0,
            ExpertFormat::Fp8 => k % 16 == 0 && fp8_staged(k) + FP8_GEMV_STATIC_SHARED as usize <= self.rt.max_shared_bytes() as usize,
            ExpertFormat::Packed(f) => {
                let async_copy = self.gemv_device().async_copy;
                !packed_slots_unfit(f, k, async_copy)
                    && packed_gemv_shared(f, k, async_copy) + FP8_GEMV_STATIC_SHARED as usize <= self.rt.max_shared_bytes() as usize
            }
        })
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
        let async_copy = self.gemv_device().async_copy;
        let (gate_up_launch, down_launch) = match (ex.gate.format, ex.down.format) {
            (ExpertFormat::Fp8, _) => {
                let block = [FP8_GEMV_THREADS, 1, 1];
                // moe_down_fp8 takes two tiles of rows a block.
                (
                    ([blocks(i, FP8_GEMV_ROWS), k32, 1], block, fp8_staged(h) as u32),
                    ([blocks(h, 2 * FP8_GEMV_ROWS), k32, 1], block, fp8_staged(i) as u32),
                )
            }
            (gate_format, down_format) => {
                let rows = GEMV_ROWS * GEMV_THREADS / self.rt.warp_size();
                let launch = |format, n: usize, k: usize, packed_rows: u32, staged: u32| match format {
                    ExpertFormat::Packed(f) => {
                        ([blocks(n, packed_rows), k32, 1], [FP8_GEMV_THREADS, 1, 1], packed_gemv_shared(f, k, async_copy) as u32)
                    }
                    // The input normalised into shared memory (f32) when the norm is fused.
                    _ => ([blocks(n, rows), k32, 1], [GEMV_THREADS, 1, 1], staged),
                };
                let staged = if norm.is_some() { (h * 4) as u32 } else { 0 };
                // The packed gate/up kernels take 8 gate rows and their 8 up rows a block.
                (launch(gate_format, i, h, FP8_GEMV_ROWS / 2, staged), launch(down_format, h, i, FP8_GEMV_ROWS, 0))
            }
        };
        let with_stride = |args: &[Arg], stack: &Stacked| {
            let mut args = args.to_vec();
            if let ExpertFormat::Packed(_) = stack.format {
                args.push(Arg::I64(stack.stride as i64));
            }
            args
        };
        let (grid, block, shared_bytes) = gate_up_launch;
        self.rt.launch(&format!("moe_gate_up_{}", ex.gate.suffix()), grid, block, shared_bytes, &with_stride(&gate_up, &ex.gate))?;
        let (grid, block, shared_bytes) = down_launch;
        self.rt.launch(&format!("moe_down_{}", ex.down.suffix()), grid, block, shared_bytes, &with_stride(&down, &ex.down))?;
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

        let kernel = |w: &Stacked| match w.format {
            ExpertFormat::Bf16 => "moe_gemm_bf16",
            ExpertFormat::Fp8 => "moe_gemm_fp8",
            ExpertFormat::Packed(_) => "moe_gemm_packed",
        };
        let grouped = |w: &Stacked, y: u64, w2: &Stacked, y2: u64, x: u64, cols: usize, width: usize| {
            let format = match w.format {
                ExpertFormat::Packed(f) => packed_kernel(f).0,
                _ => 0,
            };
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
                Arg::I32(format),
                Arg::I64(w.stride as i64),
            ]
        };
        let (g, u) = (self.tensor(n, i)?, self.tensor(n, i)?);
        let args = grouped(&ex.gate, g.buf.ptr, &ex.up, u.buf.ptr, xg.buf.ptr, i, h);
        self.rt.launch(kernel(&ex.gate), [blocks(i, GEMM_BN as u32), max_tiles as u32, 2], [GEMM_THREADS, 1, 1], 0, &args)?;
        let act = self.silu_mul(&g, &u)?;
        drop((g, u, xg));
        let y = self.tensor(n, h)?;
        let args = grouped(&ex.down, y.buf.ptr, &ex.down, y.buf.ptr, act.buf.ptr, h, i);
        self.rt.launch(kernel(&ex.down), [blocks(h, GEMM_BN as u32), max_tiles as u32, 1], [GEMM_THREADS, 1, 1], 0, &args)?;

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
