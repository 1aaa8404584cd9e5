//! Random-weight models of real shapes, for benchmarks that need no download: `qwen3-8b` is the
//! Qwen3-8B architecture with hash-generated bf16 or fp8 weights (see quant::synthetic), made on
//! the device by GPU backends, or with random blocks of a GGML format (made on the host, packed on
//! upload as a GGUF's would be); `qwen3.6-27b` and `qwen3.6-35b-a3b` are the Qwen3.6 hybrid shapes
//! (Gated DeltaNet, dense and mixture-of-experts).

use super::config::{Architecture, HybridConfig, LayerKind, ModelConfig, MoeConfig, RopeScaling};
use super::weights::WeightSource;
use rayon::prelude::*;

use crate::quant::synthetic::{random_ggml_blocks, SyntheticMatrix};
use crate::quant::{DType, GgmlFormat, GgmlMatrix, QuantMatrix};
use crate::{Error, Result};

pub struct SyntheticSource {
    config: ModelConfig,
    /// BF16, or F8E4M3 for the projections (embeddings and lm_head stay bf16, as in Qwen's FP8
    /// checkpoints), or a GGML block format for every matrix but the embeddings.
    dtype: DType,
}

/// The formats `--format` names: bf16, fp8, or a GGML block format by its GGUF type name.
fn synthetic_formats() -> Vec<&'static str> {
    ["bf16", "fp8"].into_iter().chain(GgmlFormat::ALL.iter().map(|f| f.name())).collect()
}

/// (name, hidden, ffn, layers, heads, kv heads, head_dim, vocab, tied)
type Shape = (&'static str, usize, usize, usize, usize, usize, usize, usize, bool);
const SHAPES: [Shape; 4] = [
    ("qwen3-0.6b", 1024, 3072, 28, 16, 8, 128, 151_936, true),
    ("qwen3-1.7b", 2048, 6144, 28, 16, 8, 128, 151_936, true),
    ("qwen3-4b", 2560, 9728, 36, 32, 8, 128, 151_936, true),
    ("qwen3-8b", 4096, 12288, 36, 32, 8, 128, 151_936, false),
];

impl SyntheticSource {
    /// `format`: bf16, fp8, or a GGML block format by its GGUF type name (q4_k, nvfp4, ...).
    pub fn new(name: &str, format: &str) -> Result<Self> {
        let dtype = match format {
            "bf16" => DType::BF16,
            "fp8" => DType::F8E4M3,
            other => match GgmlFormat::ALL.into_iter().find(|f| f.name() == other.to_ascii_lowercase()) {
                Some(f) => f.dtype(),
                None => {
                    return Err(Error::InvalidArgument(format!(
                        "synthetic format {other:?} (known: {})",
                        synthetic_formats().join(", ")
                    )))
                }
            },
        };
        if let Some(config) = qwen36(name) {
            return Ok(SyntheticSource { config, dtype });
        }
        let &(_, hidden, ffn, layers, heads, kv, head_dim, vocab, tied) =
            SHAPES.iter().find(|s| s.0 == name).ok_or_else(|| {
                let names: Vec<&str> = SHAPES.iter().map(|s| s.0).chain(QWEN36).collect();
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

const QWEN36: [&str; 2] = ["qwen3.6-27b", "qwen3.6-35b-a3b"];

/// The Qwen3.6 hybrid shapes: three Gated DeltaNet layers, then one gated full-attention layer,
/// heads of 256 with a quarter of each rotated; GDN heads of 128.
fn qwen36(name: &str) -> Option<ModelConfig> {
    // (hidden, ffn, layers, q heads, kv heads, GDN key heads, GDN value heads, experts)
    let (hidden, ffn, layers, heads, kv, key_heads, value_heads, moe) = match name {
        "qwen3.6-27b" => (5120, 17408, 64, 24, 4, 16, 48, false),
        "qwen3.6-35b-a3b" => (2048, 512, 40, 16, 2, 16, 32, true),
        _ => return None,
    };
    let layer_kinds = (0..layers).map(|i| if (i + 1) % 4 == 0 { LayerKind::Attention } else { LayerKind::DeltaNet }).collect();
    Some(ModelConfig {
        arch: if moe { Architecture::Qwen35Moe } else { Architecture::Qwen35 },
        vocab_size: 248_320,
        hidden_size: hidden,
        intermediate_size: ffn,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: kv,
        head_dim: 256,
        max_position_embeddings: 262_144,
        rms_norm_eps: 1e-6,
        rope_theta: 10_000_000.0,
        rope_scaling: RopeScaling::None,
        tie_word_embeddings: false,
        attention_bias: false,
        mlp_bias: false,
        qk_norm: true,
        rotary_dim: 64,
        moe: moe.then(|| MoeConfig {
            num_experts: 256,
            experts_per_token: 8,
            expert_intermediate_size: 512,
            normalize_top_k: true,
            shared_expert_intermediate_size: 512,
            sparse_layers: vec![true; layers],
        }),
        hybrid: Some(HybridConfig { layer_kinds, conv_kernel: 4, key_heads, value_heads, key_head_dim: 128, value_head_dim: 128, mtp_layers: 1 }),
        bos_token_id: None,
        eos_token_ids: vec![248_046],
    })
}

/// A matrix of random blocks (scales small enough that activations stay finite), generated in
/// bands of rows in parallel.
fn random_blocks(format: GgmlFormat, name: &str, rows: usize, cols: usize) -> Result<Box<dyn QuantMatrix>> {
    const BAND: usize = 256;
    let row_bytes = format.row_bytes(cols).ok_or_else(|| {
        Error::InvalidArgument(format!("{name}: {cols} columns are not whole {} blocks of {}", format.name(), format.block_size()))
    })?;
    let seed = seed_of(name);
    let blocks_per_row = row_bytes / format.block_bytes();
    let bands: Vec<Vec<u8>> = (0..rows.div_ceil(BAND))
        .into_par_iter()
        .map(|b| {
            let n = (rows - b * BAND).min(BAND) * blocks_per_row;
            random_ggml_blocks(format, n, seed ^ (b as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15))
        })
        .collect();
    Ok(Box::new(GgmlMatrix::new(format, rows, cols, bands.concat())?))
}

/// A per-tensor seed from its name, so every tensor differs and runs agree.
fn seed_of(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
}

impl WeightSource for SyntheticSource {
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Box<dyn QuantMatrix>> {
        if let Some(format) = GgmlFormat::from_dtype(self.dtype) {
            if name != "model.embed_tokens.weight" {
                return random_blocks(format, name, rows, cols);
            }
        }
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

    /// Convolution kernels: small hashed values (all ones would make every channel alike).
    fn array(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let n: usize = shape.iter().product();
        let seed = seed_of(name);
        Ok((0..n as u64).map(|i| crate::quant::synthetic::value(seed, i, 0.5)).collect())
    }

    fn contains(&self, name: &str) -> bool {
        name != "lm_head.weight" || !self.config.tie_word_embeddings
    }

    fn tensor_count(&self) -> usize {
        let experts = self.config.moe.as_ref().map_or(0, |m| 3 * m.num_experts + 5);
        // The multi-token-prediction head: fc and three norms, then its layers.
        let head = self.config.hybrid.as_ref().map_or(0, |h| h.mtp_layers * (11 + experts) + 4);
        self.config.num_layers * (11 + experts) + 3 + head
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_shape_is_a_valid_config() {
        for name in SHAPES.iter().map(|s| s.0).chain(QWEN36) {
            let source = SyntheticSource::new(name, "fp8").unwrap();
            source.config().validate().unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        let moe = SyntheticSource::new("qwen3.6-35b-a3b", "bf16").unwrap();
        assert_eq!(moe.config().moe.as_ref().map(|m| m.num_experts), Some(256));
        let err = SyntheticSource::new("qwen9", "bf16").err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("qwen3.6-27b"), "{err}");
        let err = SyntheticSource::new("qwen3-8b", "q3_k").err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("q4_k") && err.contains("nvfp4"), "{err}");
    }

    #[test]
    fn block_formats_make_whole_matrices_of_that_format() {
        for format in GgmlFormat::ALL {
            let source = SyntheticSource::new("qwen3-0.6b", format.name()).unwrap();
            let m = source.matrix("model.layers.0.mlp.down_proj.weight", 300, 3072).unwrap();
            assert_eq!((m.rows(), m.cols(), m.dtype()), (300, 3072, format.dtype()), "{}", format.name());
            assert_eq!(m.storage_bytes(), 300 * format.row_bytes(3072).unwrap());
            let mut row = vec![0.0; 3072];
            m.dequant_row(299, &mut row);
            assert!(row.iter().all(|v| v.is_finite()) && row.iter().any(|v| *v != 0.0), "{}", format.name());
            // The embedding table stays bf16 (looked up, not multiplied).
            let e = source.matrix("model.embed_tokens.weight", 10, 1024).unwrap();
            assert_eq!(e.dtype(), DType::BF16);
        }
    }
}
