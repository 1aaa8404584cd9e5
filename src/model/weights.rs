//! Where model code gets its tensors from. Loaders (safetensors today) implement [`WeightSource`]
//! under Hugging Face tensor names, so one model file serves every checkpoint format.

use std::ops::Range;

use crate::quant::QuantMatrix;
use crate::{Error, Result};

pub trait WeightSource {
    /// A `[rows, cols]` weight matrix; an error names the tensor when it is missing or mis-shaped.
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Box<dyn QuantMatrix>>;
    /// Rows `rows` of slice `index` of a stacked `[count, rows, cols]` tensor `shape` (the experts
    /// transformers 5 fuses into one tensor), as a `[rows.len(), cols]` matrix.
    fn stacked_matrix(&self, name: &str, shape: [usize; 3], index: usize, rows: Range<usize>) -> Result<Box<dyn QuantMatrix>> {
        let _ = (shape, index, rows);
        Err(Error::Unsupported(format!("{name}: stacked (fused) tensors in this format")))
    }
    /// A small tensor of `shape` as f32, row-major (a convolution's `[C, 1, K]` kernels).
    fn array(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        match shape {
            [len] => self.vector(name, *len),
            _ => Err(Error::Unsupported(format!("{name}: {}-D tensors in this format", shape.len()))),
        }
    }
    /// A 1-D tensor of `len` elements as f32 (norm weights, biases).
    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>>;
    /// Whether `name` can be loaded. Models also count a checkpoint's decoder layers with it
    /// (`model.layers.N.input_layernorm.weight`) before sizing anything by the config.
    fn contains(&self, name: &str) -> bool;
    /// How many tensors the source holds, for progress reports.
    fn tensor_count(&self) -> usize;
}

/// Progress of a load, reported after each tensor.
#[derive(Debug, Clone, Copy)]
pub struct LoadProgress {
    pub tensors_done: usize,
    pub tensors_total: usize,
    pub bytes_done: u64,
}
