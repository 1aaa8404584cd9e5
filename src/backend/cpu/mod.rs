//! The reference backend: plain Rust, f32 accumulation, fixed summation order. Rows of a product
//! are spread over a rayon pool; every output element is computed by one thread in one order, so
//! results do not depend on the thread count.

use rayon::prelude::*;

use super::{AttentionShape, Backend, Rope};
use crate::quant::{dot, QuantMatrix};
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

pub struct CpuKvCache {
    width: usize,
    keys: Vec<f32>,
    values: Vec<f32>,
}

pub struct CpuBackend {
    pool: rayon::ThreadPool,
}

impl CpuBackend {
    /// `threads == 0` uses every core.
    pub fn new(threads: usize) -> Result<Self> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("atlas-cpu-{i}"))
            .build()
            .map_err(|e| Error::Device(format!("cannot start CPU threads: {e}")))?;
        Ok(CpuBackend { pool })
    }
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

impl Backend for CpuBackend {
    type Tensor = CpuTensor;
    type Weight = Box<dyn QuantMatrix>;
    type KvCache = CpuKvCache;

    fn describe(&self) -> String {
        format!("cpu ({} threads)", self.pool.current_num_threads())
    }

    fn upload_weight(&self, w: Box<dyn QuantMatrix>) -> Result<Self::Weight> {
        Ok(w)
    }

    fn upload_vector(&self, v: &[f32]) -> Result<CpuTensor> {
        Ok(CpuTensor::new(1, v.len(), v.to_vec()))
    }

    fn new_kv_cache(&self, kv_width: usize, _capacity: usize) -> Result<CpuKvCache> {
        // Grown as positions arrive: memory follows use, not the context size.
        Ok(CpuKvCache { width: kv_width, keys: Vec::new(), values: Vec::new() })
    }

    fn to_host(&self, x: &CpuTensor) -> Result<Vec<f32>> {
        Ok(x.data.clone())
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
        if group == 0 || x.cols % group != 0 {
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
        let (n, k, t) = (w.rows(), w.cols(), x.rows);
        if x.cols != k {
            return Err(Error::InvalidArgument(format!("linear: input width {} but weight has {k} columns", x.cols)));
        }
        if t == 0 {
            return Ok(CpuTensor::new(0, n, Vec::new()));
        }
        // Work on the transposed output [n, t] so each thread owns whole weight rows: a row is
        // dequantised once and used for every token.
        let mut out_t = vec![0f32; n * t];
        self.pool.install(|| {
            out_t.par_chunks_mut(t * 16).enumerate().for_each_init(
                || vec![0f32; k],
                |row_buf, (chunk, out)| {
                    for (i, o) in out.chunks_exact_mut(t).enumerate() {
                        w.dequant_row(chunk * 16 + i, row_buf);
                        for (tok, slot) in o.iter_mut().enumerate() {
                            *slot = dot(row_buf, x.row(tok));
                        }
                    }
                },
            )
        });
        let mut out = vec![0f32; t * n];
        for (j, col) in out_t.chunks_exact(t).enumerate() {
            for (tok, v) in col.iter().enumerate() {
                out[tok * n + j] = *v;
            }
        }
        if let Some(b) = bias {
            for row in out.chunks_exact_mut(n) {
                for (v, bv) in row.iter_mut().zip(&b.data) {
                    *v += bv;
                }
            }
        }
        Ok(CpuTensor::new(t, n, out))
    }

    fn rope(&self, x: &mut CpuTensor, rope: &Rope, start_pos: usize) -> Result<()> {
        let d = rope.head_dim;
        let half = d / 2;
        if x.cols % d != 0 || rope.inv_freq.len() != half {
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
        let t = q.rows;
        let end = start_pos + t;
        cache.keys.resize(end * width, 0.0);
        cache.values.resize(end * width, 0.0);
        cache.keys[start_pos * width..].copy_from_slice(&k.data);
        cache.values[start_pos * width..].copy_from_slice(&v.data);

        let group = num_heads / num_kv_heads;
        let scale = 1.0 / (d as f32).sqrt();
        let (keys, values) = (&cache.keys, &cache.values);
        // One task per (token, head); each writes its own head_dim slice of the output.
        let mut out = vec![0f32; t * num_heads * d];
        self.pool.install(|| {
            out.par_chunks_mut(d).enumerate().for_each_init(Vec::new, |scores: &mut Vec<f32>, (idx, o)| {
                let (tok, h) = (idx / num_heads, idx % num_heads);
                let kvh = h / group;
                let qh = &q.data[tok * q.cols + h * d..][..d];
                let visible = start_pos + tok + 1;
                scores.clear();
                scores.extend((0..visible).map(|p| dot(qh, &keys[p * width + kvh * d..][..d]) * scale));
                let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0f32;
                for s in scores.iter_mut() {
                    *s = (*s - max).exp();
                    sum += *s;
                }
                o.fill(0.0);
                for (p, s) in scores.iter().enumerate() {
                    let weight = s / sum;
                    for (acc, vv) in o.iter_mut().zip(&values[p * width + kvh * d..][..d]) {
                        *acc += weight * vv;
                    }
                }
            })
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

    fn last_row(&self, x: &CpuTensor) -> Result<CpuTensor> {
        if x.rows == 0 {
            return Err(Error::InvalidArgument("last_row of an empty tensor".into()));
        }
        Ok(CpuTensor::new(1, x.cols, x.row(x.rows - 1).to_vec()))
    }
}
