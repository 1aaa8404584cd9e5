//! Loading a network's tensors onto a backend, one by one, with progress.

use std::sync::Arc;

use super::config::ModelConfig;
use super::weights::{LoadProgress, WeightSource};
use crate::backend::{Backend, Proj};
use crate::quant::fp8::select_row_blocks;
use crate::quant::synthetic::SyntheticMatrix;
use crate::quant::{ColumnRange, QuantMatrix, RowSelection};
use crate::Result;

/// A projection's weight and optional bias.
pub struct Linear<B: Backend> {
    pub weight: B::Weight,
    pub bias: Option<B::Tensor>,
}

impl<B: Backend> Linear<B> {
    pub fn proj(&self) -> Proj<'_, B> {
        Proj { weight: &self.weight, bias: self.bias.as_ref() }
    }
}

/// Loads tensors one by one, reporting progress after each.
pub struct Loader<'a, B: Backend> {
    pub backend: &'a B,
    pub source: &'a dyn WeightSource,
    pub progress: &'a mut dyn FnMut(LoadProgress),
    pub done: LoadProgress,
}

impl<'a, B: Backend> Loader<'a, B> {
    /// A loader for `config`'s network, once the config is checked against the limits and
    /// against the layers the weights hold: configs may be built in code, not only parsed, and
    /// everything the network allocates is sized from them.
    pub fn new(config: &ModelConfig, backend: &'a B, source: &'a dyn WeightSource, progress: &'a mut dyn FnMut(LoadProgress)) -> Result<Self> {
        config.validate()?;
        check_layers_present(config, source)?;
        let done = LoadProgress { tensors_done: 0, tensors_total: source.tensor_count(), bytes_done: 0 };
        Ok(Loader { backend, source, progress, done })
    }

    fn tick(&mut self, tensors: usize, bytes: u64) {
        self.done.tensors_done += tensors;
        self.done.bytes_done += bytes;
        (self.progress)(self.done);
    }

    pub fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<B::Weight> {
        let m = self.source.matrix(name, rows, cols)?;
        let bytes = m.storage_bytes() as u64;
        let w = self.backend.upload_weight(m)?;
        self.tick(1, bytes);
        Ok(w)
    }

    /// A matrix read for the backend to take from the host itself (experts), reported as loaded:
    /// as a tensor when `whole`, else only its bytes (a slice of a fused tensor).
    pub fn host_matrix(&mut self, m: Result<Box<dyn QuantMatrix>>, whole: bool) -> Result<Box<dyn QuantMatrix>> {
        let m = m?;
        self.tick(usize::from(whole), m.storage_bytes() as u64);
        Ok(m)
    }

    pub fn vector(&mut self, name: &str, len: usize) -> Result<B::Tensor> {
        let v = self.source.vector(name, len)?;
        let t = self.backend.upload_vector(&v)?;
        self.tick(1, len as u64 * 4);
        Ok(t)
    }

    /// A zero-centred RMSNorm weight (Qwen3.5 stores w and scales by 1 + w): loaded as 1 + w.
    pub fn centred_norm(&mut self, name: &str, len: usize) -> Result<B::Tensor> {
        let v: Vec<f32> = self.source.vector(name, len)?.iter().map(|w| 1.0 + w).collect();
        let t = self.backend.upload_vector(&v)?;
        self.tick(1, len as u64 * 4);
        Ok(t)
    }

    /// A small tensor of any shape as one `[1, n]` row.
    pub fn array(&mut self, name: &str, shape: &[usize]) -> Result<B::Tensor> {
        let v = self.source.array(name, shape)?;
        let t = self.backend.upload_vector(&v)?;
        self.tick(1, v.len() as u64 * 4);
        Ok(t)
    }

    /// A `[rows, cols]` matrix split into parts, each part the listed rows in that order (a fused
    /// projection whose outputs the model uses separately).
    pub fn split_rows(&mut self, name: &str, rows: usize, cols: usize, parts: Vec<Vec<usize>>) -> Result<Vec<B::Weight>> {
        let whole: Arc<dyn QuantMatrix> = Arc::from(self.source.matrix(name, rows, cols)?);
        let bytes = whole.storage_bytes() as u64;
        let weights = parts
            .into_iter()
            .map(|part| {
                // FP8 parts of whole 128-row blocks stay FP8 (GPUs multiply them as they are).
                let blocks = whole.fp8_blocks().and_then(|(codes, scales)| select_row_blocks(codes, scales, cols, &part));
                let selected: Box<dyn QuantMatrix> = match (blocks, whole.synthetic()) {
                    (Some(m), _) => Box::new(m),
                    // Benchmark weights are made where they are used: a part is made the same way.
                    (None, Some((seed, scale))) => {
                        let seed = part_seed(seed, part.first().copied().unwrap_or(0) as u64);
                        Box::new(SyntheticMatrix::new(part.len(), cols, seed, scale, whole.dtype()))
                    }
                    (None, None) => Box::new(RowSelection::new(whole.clone(), part)?),
                };
                self.backend.upload_weight(selected)
            })
            .collect::<Result<Vec<_>>>()?;
        self.tick(1, bytes);
        Ok(weights)
    }

    /// A `[rows, cols]` matrix cut into N column blocks of `cols / N` (a projection of N
    /// concatenated inputs, each part multiplied by its own input).
    pub fn split_columns<const N: usize>(&mut self, name: &str, rows: usize, cols: usize) -> Result<[B::Weight; N]> {
        let whole: Arc<dyn QuantMatrix> = Arc::from(self.source.matrix(name, rows, cols)?);
        let bytes = whole.storage_bytes() as u64;
        let width = cols / N;
        let mut parts = Vec::with_capacity(N);
        for i in 0..N {
            let part: Box<dyn QuantMatrix> = match whole.synthetic() {
                Some((seed, scale)) => Box::new(SyntheticMatrix::new(rows, width, part_seed(seed, i as u64 + 1), scale, whole.dtype())),
                None => Box::new(ColumnRange::new(whole.clone(), i * width, width)?),
            };
            parts.push(self.backend.upload_weight(part)?);
        }
        self.tick(1, bytes);
        parts.try_into().map_err(|_| crate::Error::InvalidArgument(format!("{name}: {N} column blocks")))
    }

    pub fn linear(&mut self, prefix: &str, rows: usize, cols: usize, with_bias: bool) -> Result<Linear<B>> {
        let weight = self.matrix(&format!("{prefix}.weight"), rows, cols)?;
        let bias = if with_bias { Some(self.vector(&format!("{prefix}.bias"), rows)?) } else { None };
        Ok(Linear { weight, bias })
    }
}


/// The seed of a part of a synthetic (benchmark) matrix: made the same way, other values.
fn part_seed(seed: u64, part: u64) -> u64 {
    seed ^ part.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// More layers than the weights hold is refused before anything is sized by the layer count.
/// Fewer are accepted, as transformers does: running a prefix of a checkpoint's layers is a
/// legitimate experiment, and a source that makes its weights (synthetic) holds any layer asked for.
fn check_layers_present(c: &ModelConfig, source: &dyn WeightSource) -> Result<()> {
    let marker = |i: usize| format!("model.layers.{i}.input_layernorm.weight");
    let present = (0..c.num_layers).take_while(|&i| source.contains(&marker(i))).count();
    if present < c.num_layers {
        return Err(crate::Error::bad_tensor(
            marker(present),
            format!("missing: the config declares {} layers but the weights have {present}", c.num_layers),
        ));
    }
    Ok(())
}
