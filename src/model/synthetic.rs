//! Random-weight models of real shapes, for benchmarks that need no download: `qwen3-8b` is the
//! Qwen3-8B architecture with hash-generated bf16 or fp8 weights (see quant::synthetic), made on
//! the device by GPU backends.

use super::config::{Architecture, ModelConfig, RopeScaling};
use super::weights::WeightSource;
use crate::quant::synthetic::SyntheticMatrix;
use crate::quant::{DType, QuantMatrix};
use crate::{Error, Result};

pub struct SyntheticSource {
    config: ModelConfig,
    /// BF16, or F8E4M3 for the projections (embeddings and lm_head stay bf16, as in Qwen's FP8
    /// checkpoints).
    dtype: DType,
}

/// (name, hidden, ffn, layers, heads, kv heads, head_dim, vocab, tied)
const SHAPES: [(&str, usize, usize, usize, usize, usize, usize, usize, bool); 4] = [
    ("qwen3-0.6b", 1024, 3072, 28, 16, 8, 128, 151_936, true),
    ("qwen3-1.7b", 2048, 6144, 28, 16, 8, 128, 151_936, true),
    ("qwen3-4b", 2560, 9728, 36, 32, 8, 128, 151_936, true),
    ("qwen3-8b", 4096, 12288, 36, 32, 8, 128, 151_936, false),
];

impl SyntheticSource {
    /// `format`: "bf16" or "fp8".
    pub fn new(name: &str, format: &str) -> Result<Self> {
        let dtype = match format {
            "bf16" => DType::BF16,
            "fp8" => DType::F8E4M3,
            other => return Err(Error::InvalidArgument(format!("synthetic format {other:?} (bf16 or fp8)"))),
        };
        let &(_, hidden, ffn, layers, heads, kv, head_dim, vocab, tied) =
            SHAPES.iter().find(|s| s.0 == name).ok_or_else(|| {
                let names: Vec<&str> = SHAPES.iter().map(|s| s.0).collect();
                Error::InvalidArgument(format!("synthetic model {name:?} (known: {})", names.join(", ")))
            })?;
        let config = ModelConfig {
            arch: Architecture::Qwen3,
            vocab_size: vocab,
            hidden_size: hidden,
            intermediate_size: ffn,
            num_layers: layers,
            num_heads: heads,
            num_kv_heads: kv,
            head_dim,
            max_position_embeddings: 40_960,
            rms_norm_eps: 1e-6,
            rope_theta: 1_000_000.0,
            rope_scaling: RopeScaling::None,
            tie_word_embeddings: tied,
            attention_bias: false,
            mlp_bias: false,
            qk_norm: true,
            rotary_dim: head_dim,
            moe: None,
            hybrid: None,
            bos_token_id: None,
            eos_token_ids: vec![151_645],
        };
        Ok(SyntheticSource { config, dtype })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }
}

/// A per-tensor seed from its name, so every tensor differs and runs agree.
fn seed_of(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
}

impl WeightSource for SyntheticSource {
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Box<dyn QuantMatrix>> {
        // Scaled so activations keep a unit-ish size through the layers.
        let projection = name.starts_with("model.layers.");
        let dtype = if projection { self.dtype } else { DType::BF16 };
        // fp8 codes reach 1.875 (bf16 values stay below 1): a smaller scale keeps the same spread.
        let scale = if dtype == DType::F8E4M3 { 0.5 } else { 1.0 } / (cols as f32).sqrt();
        Ok(Box::new(SyntheticMatrix::new(rows, cols, seed_of(name), scale, dtype)))
    }

    fn vector(&self, _name: &str, len: usize) -> Result<Vec<f32>> {
        Ok(vec![1.0; len])
    }

    fn contains(&self, name: &str) -> bool {
        name != "lm_head.weight" || !self.config.tie_word_embeddings
    }

    fn tensor_count(&self) -> usize {
        self.config.num_layers * 11 + 3
    }
}
