//! The GPU backend: the Backend trait over a vendor runtime (CUDA today, HIP through the same
//! kernels). Activations are f32, weights bf16 (other formats are converted at upload), the KV
//! cache bf16.

pub mod cuda;
pub mod hip;
pub mod runtime;

use std::sync::{Arc, Mutex};

use half::bf16;
use rayon::prelude::*;

use self::runtime::{Arg, Runtime};
use super::{AttentionShape, Backend, Rope};
use crate::quant::QuantMatrix;
use crate::{Error, Result};

/// A device allocation, freed when dropped; or a slice of the recording arena, which is not.
pub struct DeviceBuffer {
    ptr: u64,
    rt: Option<Arc<dyn Runtime>>,
}

impl DeviceBuffer {
    fn new(rt: &Arc<dyn Runtime>, bytes: usize) -> Result<Self> {
        Ok(DeviceBuffer { ptr: rt.alloc(bytes)?, rt: Some(rt.clone()) })
    }

    pub fn ptr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if let Some(rt) = &self.rt {
            rt.free(self.ptr);
        }
    }
}

/// f32 activations `[rows, cols]` on the device.
pub struct GpuTensor {
    buf: DeviceBuffer,
    pub rows: usize,
    pub cols: usize,
}

/// A bf16 weight matrix `[rows, cols]` on the device.
pub struct GpuWeight {
    buf: DeviceBuffer,
    rows: usize,
    cols: usize,
}

pub struct GpuKvCache {
    keys: DeviceBuffer,
    values: DeviceBuffer,
    capacity: usize,
    width: usize,
}

pub struct GpuBackend {
    rt: Arc<dyn Runtime>,
    /// The rotary frequency table on the device, uploaded once (every layer uses the same one).
    rope_table: Mutex<Option<(Vec<f32>, GpuTensor)>>,
    decode: Mutex<DecodeGraph>,
}

/// The recorded decode step. While recording, ops read the token and position from `inputs`
/// (device [token, pos]) instead of taking them as launch arguments, and attention covers the
/// whole cache, so one recording serves every later step.
struct DecodeGraph {
    recording: bool,
    inputs: Option<DeviceBuffer>,
    logits: Option<GpuTensor>,
    exec: Option<u64>,
    /// Temporaries of the recorded step come from this arena, so the graph holds kernels only,
    /// no allocation nodes. Too small an arena still records (with allocation nodes) and is
    /// resized for the next recording.
    arena: Option<DeviceBuffer>,
    arena_size: usize,
    arena_used: usize,
}

const INITIAL_ARENA: usize = 64 << 20;

const BLOCK: u32 = 256;
const GEMV_MAX_T: usize = 8;
/// Positions per attention block before the work is split across more blocks.
const ATTENTION_CHUNK: usize = 256;

fn blocks(n: usize, per: u32) -> u32 {
    n.div_ceil(per as usize) as u32
}

impl GpuBackend {
    pub fn new(rt: Arc<dyn Runtime>) -> Self {
        let decode = DecodeGraph {
            recording: false,
            inputs: None,
            logits: None,
            exec: None,
            arena: None,
            arena_size: INITIAL_ARENA,
            arena_used: 0,
        };
        GpuBackend { rt, rope_table: Mutex::new(None), decode: Mutex::new(decode) }
    }

    fn decode_state(&self) -> std::sync::MutexGuard<'_, DecodeGraph> {
        self.decode.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Device pointer of the recorded step's [token, pos] pair, or None outside a recording.
    fn recorded_inputs(&self) -> Option<u64> {
        let d = self.decode_state();
        d.recording.then(|| d.inputs.as_ref().map(|b| b.ptr)).flatten()
    }

    fn set_inputs(&self, token: u32, pos: usize) -> Result<u64> {
        let mut d = self.decode_state();
        if d.inputs.is_none() {
            d.inputs = Some(DeviceBuffer::new(&self.rt, 8)?);
        }
        let ptr = d.inputs.as_ref().map_or(0, |b| b.ptr);
        let mut bytes = [0u8; 8];
        bytes[..4].copy_from_slice(&(token as i32).to_le_bytes());
        bytes[4..].copy_from_slice(&(pos as i32).to_le_bytes());
        drop(d);
        self.rt.upload(ptr, &bytes)?;
        Ok(ptr)
    }

    /// Memory for a temporary: from the arena while recording, else from the stream's pool.
    fn scratch(&self, bytes: usize) -> Result<DeviceBuffer> {
        let mut d = self.decode_state();
        if d.recording {
            let start = d.arena_used.next_multiple_of(256);
            d.arena_used = start + bytes;
            if let Some(arena) = d.arena.as_ref().filter(|_| start + bytes <= d.arena_size) {
                return Ok(DeviceBuffer { ptr: arena.ptr + start as u64, rt: None });
            }
        }
        drop(d);
        DeviceBuffer::new(&self.rt, bytes)
    }

    /// The rotary frequency table on the device, uploaded on first use.
    fn rope_freqs(&self, rope: &Rope) -> Result<u64> {
        let mut table = self.rope_table.lock().unwrap_or_else(|p| p.into_inner());
        if table.as_ref().map_or(true, |(host, _)| *host != rope.inv_freq) {
            *table = Some((rope.inv_freq.clone(), self.upload_f32(1, rope.inv_freq.len(), &rope.inv_freq)?));
        }
        Ok(table.as_ref().map_or(0, |(_, t)| t.buf.ptr))
    }

    /// One-token product `y = x · wᵀ (+ bias) (+ residual)`; `residual` may be `y` itself.
    fn gemv1(&self, x: &GpuTensor, w: &GpuWeight, bias: Option<&GpuTensor>, residual: Option<u64>, y: u64) -> Result<()> {
        let args = [
            Arg::Ptr(w.buf.ptr),
            Arg::Ptr(x.buf.ptr),
            Arg::Ptr(bias.map_or(0, |b| b.buf.ptr)),
            Arg::Ptr(residual.unwrap_or(0)),
            Arg::Ptr(y),
            Arg::I32(w.rows as i32),
            Arg::I32(w.cols as i32),
        ];
        self.rt.launch("gemv1_bf16", [blocks(w.rows, BLOCK / self.rt.warp_size()), 1, 1], [BLOCK, 1, 1], 0, &args)
    }

    fn forget_recording(&self) {
        let mut d = self.decode_state();
        if let Some(exec) = d.exec.take() {
            self.rt.destroy_graph(exec);
        }
    }

    /// The first CUDA device.
    pub fn cuda() -> Result<Self> {
        Ok(GpuBackend::new(Arc::new(cuda::CudaRuntime::new(0)?)))
    }

    /// The first HIP (AMD) device.
    pub fn hip() -> Result<Self> {
        Ok(GpuBackend::new(Arc::new(hip::HipRuntime::new(0)?)))
    }

    pub fn runtime(&self) -> &Arc<dyn Runtime> {
        &self.rt
    }

    fn tensor(&self, rows: usize, cols: usize) -> Result<GpuTensor> {
        Ok(GpuTensor { buf: self.scratch(rows * cols * 4)?, rows, cols })
    }

    /// A tensor that outlives any recording (weights, tables, test inputs): never from the arena.
    pub fn upload_f32(&self, rows: usize, cols: usize, data: &[f32]) -> Result<GpuTensor> {
        let t = GpuTensor { buf: DeviceBuffer::new(&self.rt, rows * cols * 4)?, rows, cols };
        self.rt.upload(t.buf.ptr, as_bytes(data))?;
        Ok(t)
    }

    /// Index of the largest logit among the first `limit` of a `[1, n]` tensor, computed on the device.
    pub fn argmax(&self, logits: &GpuTensor, limit: usize) -> Result<u32> {
        let out = DeviceBuffer::new(&self.rt, 4)?;
        let args = [Arg::Ptr(logits.buf.ptr), Arg::I32(logits.cols as i32), Arg::I32(limit.min(i32::MAX as usize) as i32), Arg::Ptr(out.ptr)];
        self.rt.launch("argmax", [1, 1, 1], [1024, 1, 1], 0, &args)?;
        let mut id = [0u8; 4];
        self.rt.download(out.ptr, &mut id)?;
        Ok(u32::from_le_bytes(id))
    }

    fn elementwise(&self, kernel: &str, n: usize, args: &[Arg]) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        self.rt.launch(kernel, [blocks(n, BLOCK), 1, 1], [BLOCK, 1, 1], 0, args)
    }

    fn grow_cache(&self, cache: &mut GpuKvCache, needed: usize) -> Result<()> {
        if needed <= cache.capacity {
            return Ok(());
        }
        // The recorded decode step points at the old buffers.
        self.forget_recording();
        let capacity = needed.next_power_of_two().max(256);
        let bytes = capacity * cache.width * 2;
        let keys = DeviceBuffer::new(&self.rt, bytes)?;
        let values = DeviceBuffer::new(&self.rt, bytes)?;
        let used = cache.capacity * cache.width * 2;
        if used > 0 {
            self.rt.copy(keys.ptr, cache.keys.ptr, used)?;
            self.rt.copy(values.ptr, cache.values.ptr, used)?;
        }
        *cache = GpuKvCache { keys, values, capacity, width: cache.width };
        Ok(())
    }
}

fn as_bytes(data: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and any byte pattern is a valid u8.
    unsafe { std::slice::from_raw_parts(data.as_ptr().cast(), std::mem::size_of_val(data)) }
}

fn same_shape(a: &GpuTensor, b: &GpuTensor, op: &str) -> Result<()> {
    if (a.rows, a.cols) != (b.rows, b.cols) {
        return Err(Error::InvalidArgument(format!(
            "{op}: shapes [{}, {}] and [{}, {}] differ",
            a.rows, a.cols, b.rows, b.cols
        )));
    }
    Ok(())
}

impl Backend for GpuBackend {
    type Tensor = GpuTensor;
    type Weight = GpuWeight;
    type KvCache = GpuKvCache;

    fn describe(&self) -> String {
        self.rt.describe()
    }

    fn upload_weight(&self, w: Box<dyn QuantMatrix>) -> Result<GpuWeight> {
        let (rows, cols) = (w.rows(), w.cols());
        let buf = DeviceBuffer::new(&self.rt, rows * cols * 2)?;
        if let Some((seed, scale)) = w.synthetic() {
            // Random weights for benchmarks are made where they are used: no host copy of gigabytes.
            let n = (rows * cols) as i64;
            let args = [Arg::Ptr(buf.ptr), Arg::I64(n), Arg::U64(seed), Arg::F32(scale)];
            self.rt.launch("fill_random_bf16", [blocks(rows * cols, BLOCK).min(65535 * 8), 1, 1], [BLOCK, 1, 1], 0, &args)?;
        } else {
            // Every other format is widened on the host (in parallel) and stored as bf16.
            let mut host = vec![bf16::ZERO; rows * cols];
            host.par_chunks_mut(cols).enumerate().for_each_init(
                || vec![0f32; cols],
                |row_buf, (r, out)| {
                    w.dequant_row(r, row_buf);
                    for (o, v) in out.iter_mut().zip(row_buf.iter()) {
                        *o = bf16::from_f32(*v);
                    }
                },
            );
            // SAFETY: bf16 is a plain 2-byte value.
            let bytes = unsafe { std::slice::from_raw_parts(host.as_ptr().cast::<u8>(), host.len() * 2) };
            self.rt.upload(buf.ptr, bytes)?;
        }
        Ok(GpuWeight { buf, rows, cols })
    }

    fn upload_vector(&self, v: &[f32]) -> Result<GpuTensor> {
        self.upload_f32(1, v.len(), v)
    }

    fn new_kv_cache(&self, kv_width: usize, capacity: usize) -> Result<GpuKvCache> {
        let bytes = (capacity * kv_width * 2).max(2);
        Ok(GpuKvCache {
            keys: DeviceBuffer::new(&self.rt, bytes)?,
            values: DeviceBuffer::new(&self.rt, bytes)?,
            capacity,
            width: kv_width,
        })
    }

    fn to_host(&self, x: &GpuTensor) -> Result<Vec<f32>> {
        let mut out = vec![0f32; x.rows * x.cols];
        // SAFETY: f32 has no invalid byte patterns.
        let bytes = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<u8>(), out.len() * 4) };
        self.rt.download(x.buf.ptr, bytes)?;
        Ok(out)
    }

    fn embed(&self, table: &GpuWeight, tokens: &[u32]) -> Result<GpuTensor> {
        if let Some(bad) = tokens.iter().find(|&&t| t as usize >= table.rows) {
            return Err(Error::InvalidRequest(format!(
                "token id {bad} is outside the model's vocabulary of {}",
                table.rows
            )));
        }
        let out = self.tensor(tokens.len(), table.cols)?;
        let mut ids_buf = None;
        let ids_ptr = match self.recorded_inputs() {
            Some(inputs) => inputs,
            None => {
                let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
                let buf = DeviceBuffer::new(&self.rt, ids.len() * 4)?;
                // SAFETY: i32 slice viewed as bytes.
                self.rt.upload(buf.ptr, unsafe { std::slice::from_raw_parts(ids.as_ptr().cast(), ids.len() * 4) })?;
                ids_buf.insert(buf).ptr
            }
        };
        let args = [Arg::Ptr(table.buf.ptr), Arg::Ptr(ids_ptr), Arg::Ptr(out.buf.ptr), Arg::I32(table.cols as i32)];
        self.rt.launch("embed_bf16", [blocks(table.cols, BLOCK), tokens.len() as u32, 1], [BLOCK, 1, 1], 0, &args)?;
        Ok(out)
    }

    fn rms_norm(&self, x: &GpuTensor, weight: &GpuTensor, eps: f32) -> Result<GpuTensor> {
        let group = weight.cols;
        if group == 0 || x.cols % group != 0 {
            return Err(Error::InvalidArgument(format!("rms_norm: width {} is not a multiple of {group}", x.cols)));
        }
        let out = self.tensor(x.rows, x.cols)?;
        let groups = x.rows * x.cols / group;
        // One float4 per thread where possible.
        let warp = self.rt.warp_size() as usize;
        let threads = (group / 4).clamp(warp, 1024).next_multiple_of(warp) as u32;
        let args = [Arg::Ptr(x.buf.ptr), Arg::Ptr(weight.buf.ptr), Arg::Ptr(out.buf.ptr), Arg::I32(group as i32), Arg::F32(eps)];
        if groups > 0 {
            self.rt.launch("rms_norm", [groups as u32, 1, 1], [threads, 1, 1], 0, &args)?;
        }
        Ok(out)
    }

    fn linear(&self, x: &GpuTensor, w: &GpuWeight, bias: Option<&GpuTensor>) -> Result<GpuTensor> {
        let (n, k, t) = (w.rows, w.cols, x.rows);
        if x.cols != k {
            return Err(Error::InvalidArgument(format!("linear: input width {} but weight has {k} columns", x.cols)));
        }
        let y = self.tensor(t, n)?;
        if t == 0 {
            return Ok(y);
        }
        let args = [
            Arg::Ptr(w.buf.ptr),
            Arg::Ptr(x.buf.ptr),
            Arg::Ptr(bias.map_or(0, |b| b.buf.ptr)),
            Arg::Ptr(y.buf.ptr),
            Arg::I32(n as i32),
            Arg::I32(k as i32),
            Arg::I32(t as i32),
        ];
        let rows_per_block = BLOCK / self.rt.warp_size();
        if t == 1 && k % 8 == 0 {
            self.gemv1(x, w, bias, None, y.buf.ptr)?;
        } else if t <= GEMV_MAX_T && k % 8 == 0 {
            self.rt.launch("gemv_bf16", [blocks(n, rows_per_block), 1, 1], [BLOCK, 1, 1], 0, &args)?;
        } else {
            self.rt.launch("gemm_bf16", [blocks(n, 128), blocks(t, 128), 1], [256, 1, 1], 0, &args)?;
        }
        Ok(y)
    }

    fn linear_add(&self, x: &GpuTensor, w: &GpuWeight, bias: Option<&GpuTensor>, residual: &mut GpuTensor) -> Result<()> {
        if x.rows == 1 && w.cols % 8 == 0 && x.cols == w.cols && (residual.rows, residual.cols) == (1, w.rows) {
            let out = residual.buf.ptr;
            return self.gemv1(x, w, bias, Some(out), out);
        }
        let y = self.linear(x, w, bias)?;
        self.add_assign(residual, &y)
    }

    fn silu_gate_up(
        &self,
        x: &GpuTensor,
        gate: &GpuWeight,
        gate_bias: Option<&GpuTensor>,
        up: &GpuWeight,
        up_bias: Option<&GpuTensor>,
    ) -> Result<GpuTensor> {
        let fusable = x.rows == 1 && gate.cols % 8 == 0 && x.cols == gate.cols && (up.rows, up.cols) == (gate.rows, gate.cols);
        if !fusable {
            let g = self.linear(x, gate, gate_bias)?;
            let u = self.linear(x, up, up_bias)?;
            return self.silu_mul(&g, &u);
        }
        let out = self.tensor(1, gate.rows)?;
        let args = [
            Arg::Ptr(gate.buf.ptr),
            Arg::Ptr(up.buf.ptr),
            Arg::Ptr(x.buf.ptr),
            Arg::Ptr(gate_bias.map_or(0, |b| b.buf.ptr)),
            Arg::Ptr(up_bias.map_or(0, |b| b.buf.ptr)),
            Arg::Ptr(out.buf.ptr),
            Arg::I32(gate.rows as i32),
            Arg::I32(gate.cols as i32),
        ];
        self.rt.launch("gemv1_gate_up_bf16", [blocks(gate.rows, BLOCK / self.rt.warp_size()), 1, 1], [BLOCK, 1, 1], 0, &args)?;
        Ok(out)
    }

    fn norm_rope(&self, x: &mut GpuTensor, norm: Option<&GpuTensor>, eps: f32, rope: &Rope, start_pos: usize) -> Result<()> {
        let d = rope.head_dim;
        if x.cols % d != 0 || rope.inv_freq.len() != d / 2 || norm.is_some_and(|w| w.cols != d) || d > 2048 {
            return Err(Error::InvalidArgument(format!("norm_rope: width {} and head_dim {d} disagree", x.cols)));
        }
        let freqs = self.rope_freqs(rope)?;
        let pos_dev = self.recorded_inputs().map_or(0, |p| p + 4);
        let args = [
            Arg::Ptr(x.buf.ptr),
            Arg::Ptr(norm.map_or(0, |w| w.buf.ptr)),
            Arg::F32(eps),
            Arg::Ptr(freqs),
            Arg::I32(start_pos as i32),
            Arg::Ptr(pos_dev),
            Arg::I32(d as i32),
        ];
        let threads = (d / 2).next_multiple_of(self.rt.warp_size() as usize) as u32;
        self.rt.launch("norm_rope", [(x.cols / d) as u32, x.rows as u32, 1], [threads, 1, 1], 0, &args)
    }

    fn rope(&self, x: &mut GpuTensor, rope: &Rope, start_pos: usize) -> Result<()> {
        let d = rope.head_dim;
        if x.cols % d != 0 || rope.inv_freq.len() != d / 2 {
            return Err(Error::InvalidArgument(format!("rope: width {} and head_dim {d} disagree", x.cols)));
        }
        let freqs = self.rope_freqs(rope)?;
        let pos_dev = self.recorded_inputs().map_or(0, |p| p + 4);
        let args = [Arg::Ptr(x.buf.ptr), Arg::Ptr(freqs), Arg::I32(start_pos as i32), Arg::Ptr(pos_dev), Arg::I32(d as i32)];
        let threads = (d / 2).next_multiple_of(32) as u32;
        self.rt.launch("rope", [(x.cols / d) as u32, x.rows as u32, 1], [threads, 1, 1], 0, &args)
    }

    fn attention(
        &self,
        q: &GpuTensor,
        k: &GpuTensor,
        v: &GpuTensor,
        cache: &mut GpuKvCache,
        start_pos: usize,
        shape: AttentionShape,
    ) -> Result<GpuTensor> {
        let AttentionShape { num_heads, num_kv_heads, head_dim: d } = shape;
        let width = cache.width;
        if k.cols != width || v.cols != width || q.cols != num_heads * d || num_kv_heads * d != width {
            return Err(Error::InvalidArgument("attention: q/k/v widths disagree with the shape".into()));
        }
        if d > 256 {
            return Err(Error::Unsupported(format!("head_dim {d} on the GPU (at most 256)")));
        }
        let t = q.rows;
        let recorded = self.recorded_inputs();
        if recorded.is_some() && start_pos + t > cache.capacity {
            return Err(Error::ContextOverflow(format!("position {} is past the KV cache", start_pos + t)));
        }
        self.grow_cache(cache, start_pos + t)?;
        let pos_dev = Arg::Ptr(recorded.map_or(0, |p| p + 4));
        let args = [Arg::Ptr(k.buf.ptr), Arg::Ptr(v.buf.ptr), Arg::Ptr(cache.keys.ptr), Arg::Ptr(cache.values.ptr), Arg::I32(start_pos as i32), pos_dev, Arg::I32(width as i32)];
        self.rt.launch("kv_append", [blocks(width, BLOCK), t as u32, 1], [BLOCK, 1, 1], 0, &args)?;

        // A recording must fit every later position: it covers the whole cache.
        let longest = if recorded.is_some() { cache.capacity } else { start_pos + t };
        let splits = longest.div_ceil(ATTENTION_CHUNK);
        let partial = self.scratch(t * num_heads * splits * (d + 2) * 4)?;
        let scale = 1.0 / (d as f32).sqrt();
        let args = [
            Arg::Ptr(q.buf.ptr),
            Arg::Ptr(cache.keys.ptr),
            Arg::Ptr(cache.values.ptr),
            Arg::Ptr(partial.ptr),
            Arg::I32(start_pos as i32),
            pos_dev,
            Arg::I32(num_kv_heads as i32),
            Arg::I32(d as i32),
            Arg::F32(scale),
            Arg::I32(ATTENTION_CHUNK as i32),
        ];
        // Regular head sizes take the kernel with lanes over positions; others the general one.
        let kernel = if d % 64 == 0 { "attention_partial_wide" } else { "attention_partial" };
        self.rt.launch(kernel, [num_heads as u32, t as u32, splits as u32], [128, 1, 1], 0, &args)?;
        let out = self.tensor(t, num_heads * d)?;
        let args = [Arg::Ptr(partial.ptr), Arg::Ptr(out.buf.ptr), Arg::I32(d as i32), Arg::I32(splits as i32)];
        let threads = d.next_multiple_of(32) as u32;
        self.rt.launch("attention_combine", [num_heads as u32, t as u32, 1], [threads, 1, 1], 0, &args)?;
        Ok(out)
    }

    fn silu_mul(&self, gate: &GpuTensor, up: &GpuTensor) -> Result<GpuTensor> {
        same_shape(gate, up, "silu_mul")?;
        let out = self.tensor(gate.rows, gate.cols)?;
        let n = gate.rows * gate.cols;
        self.elementwise("silu_mul", n, &[Arg::Ptr(gate.buf.ptr), Arg::Ptr(up.buf.ptr), Arg::Ptr(out.buf.ptr), Arg::I32(n as i32)])?;
        Ok(out)
    }

    fn add_assign(&self, x: &mut GpuTensor, y: &GpuTensor) -> Result<()> {
        same_shape(x, y, "add")?;
        let n = x.rows * x.cols;
        self.elementwise("add_inplace", n, &[Arg::Ptr(x.buf.ptr), Arg::Ptr(y.buf.ptr), Arg::I32(n as i32)])
    }

    fn last_row(&self, x: &GpuTensor) -> Result<GpuTensor> {
        if x.rows == 0 {
            return Err(Error::InvalidArgument("last_row of an empty tensor".into()));
        }
        let out = self.tensor(1, x.cols)?;
        self.rt.copy(out.buf.ptr, x.buf.ptr + ((x.rows - 1) * x.cols * 4) as u64, x.cols * 4)?;
        Ok(out)
    }

    fn replay_decode(&self, token: u32, pos: usize) -> Result<Option<Vec<f32>>> {
        let exec = self.decode_state().exec;
        let Some(exec) = exec else { return Ok(None) };
        self.set_inputs(token, pos)?;
        self.rt.launch_graph(exec)?;
        let d = self.decode_state();
        d.logits.as_ref().map(|l| self.to_host(l)).transpose()
    }

    fn record_decode(
        &self,
        token: u32,
        pos: usize,
        vocab: usize,
        step: &mut dyn FnMut() -> Result<GpuTensor>,
    ) -> Result<Option<Vec<f32>>> {
        self.forget_recording();
        // The output lives outside the graph: the graph ends by copying the logits into it.
        let logits = GpuTensor { buf: DeviceBuffer::new(&self.rt, vocab * 4)?, rows: 1, cols: vocab };
        self.set_inputs(token, pos)?;
        {
            let mut d = self.decode_state();
            if d.arena.is_none() {
                let size = d.arena_size;
                d.arena = Some(DeviceBuffer::new(&self.rt, size)?);
            }
            d.arena_used = 0;
        }
        if self.rt.begin_capture().is_err() {
            return Ok(None);
        }
        self.decode_state().recording = true;
        let recorded = step().and_then(|out| {
            if (out.rows, out.cols) != (1, vocab) {
                return Err(Error::InvalidArgument(format!("decode step returned [{}, {}]", out.rows, out.cols)));
            }
            self.rt.copy(logits.buf.ptr, out.buf.ptr, vocab * 4)
        });
        self.decode_state().recording = false;
        let graph = self.rt.end_capture();
        let exec = match (recorded, graph) {
            (Ok(()), Ok(exec)) => exec,
            (Ok(()), Err(e)) => return Err(e),
            (Err(e), graph) => {
                if let Ok(exec) = graph {
                    self.rt.destroy_graph(exec);
                }
                return Err(e);
            }
        };
        // Capturing records without running: run it once now.
        self.rt.launch_graph(exec)?;
        let host = self.to_host(&logits)?;
        let mut d = self.decode_state();
        d.logits = Some(logits);
        if d.arena_used > d.arena_size {
            // Record again next step, with room for every temporary.
            d.arena_size = d.arena_used + d.arena_used / 4;
            d.arena = None;
            self.rt.destroy_graph(exec);
        } else {
            d.exec = Some(exec);
        }
        Ok(Some(host))
    }
}

impl Drop for GpuBackend {
    fn drop(&mut self) {
        self.forget_recording();
    }
}
