//! Launches of the Qwen3.5 hybrid ops (kernels/delta_net.hip, and the gated RMSNorm and sigmoid
//! gate of norm.hip and elementwise.hip): the causal conv1d with state, the gated delta rule
//! (recurrent for a few tokens, chunked for prefill), the gated RMSNorm, the sigmoid gate. Called
//! from the Backend impl in mod.rs.
//!
//! None takes a position and none allocates outside `tensor` (the recording arena while a decode
//! step is recorded) or downloads: they record into decode graphs as they are. The recurrent
//! states are updated in place, in buffers that outlive the recording.

use super::runtime::{Arg, DnStates, DN_SEQS};
use super::{blocks, same_shape, GpuBackend, GpuTensor, BLOCK};
use crate::backend::{DeltaShape, DeltaWeights};
use crate::{Error, Result};

/// Launch shapes fixed by kernels/delta_net.hip (its #defines).
const CONV_MAX_K: usize = 8;
const CONV_CHUNK: usize = 64;
const DN_THREADS: u32 = 128;
const DN_COLS: usize = 16;
const DN_MAX_DK: usize = 256;
const DC_CHUNK: usize = 64;
const DC_THREADS: u32 = 256;
const DC_MAX_DK: usize = 128;
const DC_COLS: usize = 32;
/// Tokens per pass of the chunked rule: its scratch (W, Ũ, q̂, k̂, P, γ: about 2·(dk + dv)·Hv
/// floats a token; the state as each chunk finds it, dk·dv·Hv floats a chunk) is sized for this
/// many, whatever the prompt's length.
const DC_SLICE: usize = 1024;
/// Grid y and z extents are at most this.
const MAX_GRID_YZ: usize = 65_535;

/// Dynamic shared memory of delta_chunk_prep and of delta_chunk_state and delta_chunk_out for key
/// heads of `dk` (the sums in their header comments).
fn chunked_shared_bytes(dk: usize) -> (usize, usize) {
    let f32s = std::mem::size_of::<f32>();
    let dk16 = dk.div_ceil(16) * 16;
    let buf_stride = dk16.max(DC_CHUNK) + 4;
    let prep = DC_CHUNK * buf_stride + DC_CHUNK * (DC_CHUNK + 4) + 4 * DC_CHUNK + (DC_CHUNK / 16 - 1) * 16 * (16 + 4);
    let state_stride = DC_COLS + 4;
    let scan = DC_CHUNK * buf_stride + dk16 * state_stride + DC_CHUNK * state_stride + DC_CHUNK;
    (prep * f32s, scan * f32s)
}

/// A size as the kernels' 32-bit int, or an error naming it.
fn int(what: &str, n: usize) -> Result<i32> {
    i32::try_from(n).map_err(|_| Error::Unsupported(format!("{what} of {n} on the GPU (the kernels take 32-bit sizes)")))
}

/// The conv1d's taps K for `channels` channels, checked against its weight `[C·K]` and a state
/// `[(K−1)·C]`.
fn conv_taps(channels: usize, weight: &GpuTensor, state: &GpuTensor) -> Result<usize> {
    let n_weight = weight.rows * weight.cols;
    let k = n_weight.checked_div(channels).unwrap_or(0);
    if k == 0 || n_weight != channels * k || state.rows * state.cols != (k - 1) * channels {
        return Err(Error::InvalidArgument(format!(
            "conv1d: {channels} channels, weight of {n_weight} values, state of {}",
            state.rows * state.cols
        )));
    }
    if k > CONV_MAX_K {
        return Err(Error::Unsupported(format!("conv1d kernels of {k} taps on the GPU (at most {CONV_MAX_K})")));
    }
    Ok(k)
}

/// Checks the gated delta rule's inputs (qkv, a, b, a_log, dt_bias) and states against `shape`
/// and the kernels' limits; returns the blocks of DN_COLS columns a value head takes.
fn check_delta_rule(inputs: [&GpuTensor; 5], states: &[&GpuTensor], shape: DeltaShape) -> Result<usize> {
    let [qkv, a, b, a_log, dt_bias] = inputs;
    let DeltaShape { key_heads, value_heads: hv, key_dim: dk, value_dim: dv } = shape;
    let t = qkv.rows;
    let vectors_ok = [a_log, dt_bias].iter().all(|v| v.rows * v.cols == hv);
    if qkv.cols != shape.qkv_width()
        || [a, b].iter().any(|g| (g.rows, g.cols) != (t, hv))
        || !vectors_ok
        || states.iter().any(|s| s.rows * s.cols != shape.state_len())
        || key_heads == 0
        || hv % key_heads != 0
    {
        return Err(Error::InvalidArgument(format!("gated_delta_rule: inputs disagree with {shape:?}")));
    }
    if dk > DN_MAX_DK {
        return Err(Error::Unsupported(format!(
            "Gated DeltaNet key heads of {dk} values on the GPU (at most {DN_MAX_DK}; value heads of any size)"
        )));
    }
    let col_blocks = dv.div_ceil(DN_COLS);
    if col_blocks > MAX_GRID_YZ {
        return Err(Error::Unsupported(format!("Gated DeltaNet value heads of {dv} values on the GPU")));
    }
    int("gated delta rule input", t * qkv.cols)?;
    int("gated delta rule state", shape.state_len())?;
    Ok(col_blocks)
}

impl GpuBackend {
    pub(super) fn launch_conv1d_silu(&self, x: &GpuTensor, weight: &GpuTensor, state: &mut GpuTensor) -> Result<GpuTensor> {
        let (t, c) = (x.rows, x.cols);
        let k = conv_taps(c, weight, state)?;
        let chunks = t.div_ceil(CONV_CHUNK);
        if chunks > MAX_GRID_YZ {
            return Err(Error::Unsupported(format!("conv1d over {t} tokens in one call on the GPU")));
        }
        int("conv1d input", t * c)?;
        let out = self.tensor(t, c)?;
        if t == 0 {
            return Ok(out);
        }
        let args = [
            Arg::Ptr(x.buf.ptr),
            Arg::Ptr(weight.buf.ptr),
            Arg::Ptr(state.buf.ptr),
            Arg::Ptr(out.buf.ptr),
            Arg::I32(t as i32),
            Arg::I32(c as i32),
            Arg::I32(k as i32),
        ];
        self.rt.launch("conv1d_silu", [blocks(c, BLOCK), chunks as u32, 1], [BLOCK, 1, 1], 0, &args)?;
        Ok(out)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_gated_delta_rule(
        &self,
        qkv: &GpuTensor,
        a: &GpuTensor,
        b: &GpuTensor,
        a_log: &GpuTensor,
        dt_bias: &GpuTensor,
        state: &mut GpuTensor,
        shape: DeltaShape,
    ) -> Result<GpuTensor> {
        let DeltaShape { key_heads, value_heads: hv, key_dim: dk, value_dim: dv } = shape;
        let t = qkv.rows;
        let col_blocks = check_delta_rule([qkv, a, b, a_log, dt_bias], &[state], shape)?;
        let out = self.tensor(t, hv * dv)?;
        if t == 0 || hv == 0 || dv == 0 {
            return Ok(out);
        }
        if t >= DC_CHUNK && dk <= DC_MAX_DK {
            let (prep_shared, scan_shared) = chunked_shared_bytes(dk);
            if prep_shared.max(scan_shared) <= self.rt.max_shared_bytes() as usize {
                self.chunked_delta_rule([qkv, a, b, a_log, dt_bias], state, &out, shape)?;
                return Ok(out);
            }
        }
        let args = [
            Arg::Ptr(qkv.buf.ptr),
            Arg::Ptr(a.buf.ptr),
            Arg::Ptr(b.buf.ptr),
            Arg::Ptr(a_log.buf.ptr),
            Arg::Ptr(dt_bias.buf.ptr),
            Arg::Ptr(state.buf.ptr),
            Arg::Ptr(out.buf.ptr),
            Arg::I32(t as i32),
            Arg::I32(key_heads as i32),
            Arg::I32(hv as i32),
            Arg::I32(dk as i32),
            Arg::I32(dv as i32),
        ];
        self.rt.launch("gated_delta_rule", [hv as u32, col_blocks as u32, 1], [DN_THREADS, 1, 1], 0, &args)?;
        Ok(out)
    }

    /// conv1d_silu_rows then gated_delta_rule_rows (kernels/delta_net.hip): one token of each
    /// sequence, `states[i]` = (conv, delta) of the sequence of row i, DN_SEQS sequences a launch.
    pub(super) fn launch_delta_net_rows(
        &self,
        qkv: &GpuTensor,
        a: &GpuTensor,
        b: &GpuTensor,
        weights: DeltaWeights<'_, GpuBackend>,
        states: &mut [(&mut GpuTensor, &mut GpuTensor)],
        shape: DeltaShape,
    ) -> Result<GpuTensor> {
        let DeltaShape { key_heads, value_heads: hv, key_dim: dk, value_dim: dv } = shape;
        let (n, c) = (states.len(), qkv.cols);
        if qkv.rows != n {
            return Err(Error::InvalidArgument(format!("delta_net_rows: {} rows for {n} sequences", qkv.rows)));
        }
        let mut k = 0;
        for (conv, _) in states.iter() {
            k = conv_taps(c, weights.conv1d, conv)?;
        }
        let deltas: Vec<&GpuTensor> = states.iter().map(|(_, delta)| &**delta).collect();
        let col_blocks = check_delta_rule([qkv, a, b, weights.a_log, weights.dt_bias], &deltas, shape)?;
        let x = self.tensor(n, c)?;
        let out = self.tensor(n, hv * dv)?;
        if n == 0 || hv == 0 || dv == 0 {
            return Ok(out);
        }
        let f32s = std::mem::size_of::<f32>() as u64;
        let at = |t: &GpuTensor, row: usize| Arg::Ptr(t.buf.ptr + (row * t.cols) as u64 * f32s);
        for (chunk, group) in states.chunks(DN_SEQS).enumerate() {
            let (first, rows) = (chunk * DN_SEQS, group.len() as u32);
            let mut dn = DnStates::default();
            for (i, (conv, delta)) in group.iter().enumerate() {
                (dn.conv[i], dn.delta[i]) = (conv.buf.ptr, delta.buf.ptr);
            }
            let conv = [at(qkv, first), Arg::Ptr(weights.conv1d.buf.ptr), Arg::DnStates(dn), at(&x, first), Arg::I32(c as i32), Arg::I32(k as i32)];
            self.rt.launch("conv1d_silu_rows", [blocks(c, BLOCK), 1, rows], [BLOCK, 1, 1], 0, &conv)?;
            let rule = [
                vec![at(&x, first), at(a, first), at(b, first), Arg::Ptr(weights.a_log.buf.ptr), Arg::Ptr(weights.dt_bias.buf.ptr)],
                vec![Arg::DnStates(dn), at(&out, first)],
                [key_heads, hv, dk, dv].map(|v| Arg::I32(v as i32)).to_vec(),
            ]
            .concat();
            self.rt.launch("gated_delta_rule_rows", [hv as u32, col_blocks as u32, rows], [DN_THREADS, 1, 1], 0, &rule)?;
        }
        Ok(out)
    }

    /// The chunked form (kernels/delta_net.hip, delta_chunk_prep, delta_chunk_state, delta_chunk_out) over
    /// slices of at most DC_SLICE tokens, the state carried from slice to slice. `inputs`: qkv,
    /// a, b, a_log, dt_bias as launch_gated_delta_rule takes them (checked there).
    fn chunked_delta_rule(&self, inputs: [&GpuTensor; 5], state: &mut GpuTensor, out: &GpuTensor, shape: DeltaShape) -> Result<()> {
        let [qkv, a, b, a_log, dt_bias] = inputs;
        let DeltaShape { key_heads: hk, value_heads: hv, key_dim: dk, value_dim: dv } = shape;
        let t = qkv.rows;
        let slice = t.min(DC_SLICE);
        let chunks = slice.div_ceil(DC_CHUNK);
        let qn = self.tensor(hk * slice, dk)?;
        let kn = self.tensor(hk * slice, dk)?;
        let w = self.tensor(hv * slice, dk)?;
        let u = self.tensor(hv * slice, dv)?;
        let p = self.tensor(hv * chunks, DC_CHUNK * DC_CHUNK)?;
        let gam = self.tensor(hv, slice)?;
        let hs = self.tensor(hv * chunks * dk, dv)?;
        int("gated delta rule scratch", hv * slice * dk.max(dv))?;
        int("gated delta rule scratch", hv * chunks * dk * dv)?;
        int("gated delta rule scratch", hv * chunks * DC_CHUNK * DC_CHUNK)?;
        let (prep_shared, scan_shared) = chunked_shared_bytes(dk);
        let f32s = std::mem::size_of::<f32>() as u64;
        for start in (0..t).step_by(DC_SLICE) {
            let len = (t - start).min(DC_SLICE);
            let at = |x: &GpuTensor, cols: usize| Arg::Ptr(x.buf.ptr + (start * cols) as u64 * f32s);
            let sizes = [len, hk, hv, dk, dv].map(|n| Arg::I32(n as i32));
            let prep = [
                vec![at(qkv, qkv.cols), at(a, hv), at(b, hv), Arg::Ptr(a_log.buf.ptr), Arg::Ptr(dt_bias.buf.ptr)],
                [&qn, &kn, &w, &u, &p, &gam].map(|x| Arg::Ptr(x.buf.ptr)).to_vec(),
                sizes.to_vec(),
            ]
            .concat();
            let grid = [hv as u32, len.div_ceil(DC_CHUNK) as u32, 1];
            self.rt.launch("delta_chunk_prep", grid, [DC_THREADS, 1, 1], prep_shared as u32, &prep)?;
            let walk = [[&kn, &w, &u, &gam, &*state, &hs].map(|x| Arg::Ptr(x.buf.ptr)).to_vec(), sizes.to_vec()].concat();
            let col_blocks = dv.div_ceil(DC_COLS) as u32;
            self.rt.launch("delta_chunk_state", [hv as u32, col_blocks, 1], [DC_THREADS, 1, 1], scan_shared as u32, &walk)?;
            let outs = [
                [&qn, &u, &p, &gam, &hs].map(|x| Arg::Ptr(x.buf.ptr)).to_vec(),
                vec![at(out, hv * dv)],
                sizes.to_vec(),
            ]
            .concat();
            let grid = [hv as u32, col_blocks, len.div_ceil(DC_CHUNK) as u32];
            self.rt.launch("delta_chunk_out", grid, [DC_THREADS, 1, 1], scan_shared as u32, &outs)?;
        }
        Ok(())
    }

    pub(super) fn launch_gated_rms_norm(&self, x: &GpuTensor, z: &GpuTensor, weight: &GpuTensor, eps: f32) -> Result<GpuTensor> {
        same_shape(x, z, "gated_rms_norm")?;
        let group = weight.cols;
        if group == 0 || !x.cols.is_multiple_of(group) {
            return Err(Error::InvalidArgument(format!("gated_rms_norm: width {} is not a multiple of {group}", x.cols)));
        }
        int("gated_rms_norm input", x.rows * x.cols)?;
        let out = self.tensor(x.rows, x.cols)?;
        let groups = x.rows * x.cols / group;
        // As rms_norm: one float4 per thread where possible.
        let warp = self.rt.warp_size() as usize;
        let threads = (group / 4).clamp(warp, 1024).next_multiple_of(warp) as u32;
        let args = [
            Arg::Ptr(x.buf.ptr),
            Arg::Ptr(z.buf.ptr),
            Arg::Ptr(weight.buf.ptr),
            Arg::Ptr(out.buf.ptr),
            Arg::I32(group as i32),
            Arg::F32(eps),
        ];
        if groups > 0 {
            self.rt.launch("gated_rms_norm", [groups as u32, 1, 1], [threads, 1, 1], 0, &args)?;
        }
        Ok(out)
    }

    pub(super) fn launch_sigmoid_gate(&self, x: &mut GpuTensor, gate: &GpuTensor) -> Result<()> {
        if gate.rows != x.rows || (gate.cols != x.cols && gate.cols != 1) {
            return Err(Error::InvalidArgument(format!(
                "sigmoid_gate: gate [{}, {}] for x [{}, {}]",
                gate.rows, gate.cols, x.rows, x.cols
            )));
        }
        let n = x.rows * x.cols;
        int("sigmoid_gate input", n)?;
        let args = [Arg::Ptr(x.buf.ptr), Arg::Ptr(gate.buf.ptr), Arg::I32(x.cols as i32), Arg::I32(gate.cols as i32), Arg::I32(n as i32)];
        self.elementwise("sigmoid_gate", n, &args)
    }
}
