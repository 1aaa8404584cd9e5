//! Qwen3 decoder, dense or with mixture-of-experts MLPs (Qwen3-MoE), and Llama (the dense network
//! without the per-head q/k norms). Field names mirror the Hugging Face tensor names:
//! `model.layers.N.self_attn.q_proj.weight`...
//!
//! Per layer, with T new tokens and H = hidden_size:
//!   h   = x + o_proj(attn(rope(q_norm(q_proj(norm(x)))), rope(k_norm(k_proj(norm(x)))), v_proj(norm(x))))
//!   out = h + mlp(norm(h))      mlp: down_proj(silu(gate_proj(·)) * up_proj(·)), or experts (mlp.rs)
//! The backend calls take the un-normalised x with the norm's weight, so GPUs can fuse the norm
//! into the products.

use super::config::{ModelConfig, RopeScaling};
use super::loader::{Linear, Loader};
use super::mlp::FeedForward;
use super::{rotary_attention, LayerCache, LogitRows, Network, Seq};
use super::weights::{LoadProgress, WeightSource};
use crate::backend::{AttentionShape, Backend, QkNorms, Rope};
use crate::Result;

struct Attention<B: Backend> {
    q_proj: Linear<B>,
    k_proj: Linear<B>,
    v_proj: Linear<B>,
    o_proj: Linear<B>,
    /// Qwen3 only: RMSNorm over each head (weight [head_dim]).
    q_norm: Option<B::Tensor>,
    k_norm: Option<B::Tensor>,
}

struct DecoderLayer<B: Backend> {
    input_layernorm: B::Tensor,
    self_attn: Attention<B>,
    post_attention_layernorm: B::Tensor,
    mlp: FeedForward<B>,
}

pub struct Qwen3<B: Backend> {
    pub config: ModelConfig,
    embed_tokens: B::Weight,
    layers: Vec<DecoderLayer<B>>,
    norm: B::Tensor,
    /// None when the output projection is tied to `embed_tokens`.
    lm_head: Option<B::Weight>,
    rope: Rope,
}

impl<B: Backend> Qwen3<B> {
    pub fn load(
        config: ModelConfig,
        source: &dyn WeightSource,
        backend: &B,
        progress: &mut dyn FnMut(LoadProgress),
    ) -> Result<Self> {
        let mut ld = Loader::new(&config, backend, source, progress)?;
        let c = &config;
        let (h, q, kv) = (c.hidden_size, c.q_width(), c.kv_width());

        let embed_tokens = ld.matrix("model.embed_tokens.weight", c.vocab_size, h)?;
        let mut layers = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let p = format!("model.layers.{i}");
            let self_attn = Attention {
                q_proj: ld.linear(&format!("{p}.self_attn.q_proj"), q, h, c.attention_bias)?,
                k_proj: ld.linear(&format!("{p}.self_attn.k_proj"), kv, h, c.attention_bias)?,
                v_proj: ld.linear(&format!("{p}.self_attn.v_proj"), kv, h, c.attention_bias)?,
                o_proj: ld.linear(&format!("{p}.self_attn.o_proj"), h, q, c.attention_bias)?,
                q_norm: c.qk_norm.then(|| ld.vector(&format!("{p}.self_attn.q_norm.weight"), c.head_dim)).transpose()?,
                k_norm: c.qk_norm.then(|| ld.vector(&format!("{p}.self_attn.k_norm.weight"), c.head_dim)).transpose()?,
            };
            let mlp = FeedForward::load(&mut ld, &format!("{p}.mlp"), i, c)?;
            layers.push(DecoderLayer {
                input_layernorm: ld.vector(&format!("{p}.input_layernorm.weight"), h)?,
                self_attn,
                post_attention_layernorm: ld.vector(&format!("{p}.post_attention_layernorm.weight"), h)?,
                mlp,
            });
        }
        let norm = ld.vector("model.norm.weight", h)?;
        // Some tied checkpoints still ship lm_head.weight; the config decides.
        let lm_head = if c.tie_word_embeddings || !source.contains("lm_head.weight") {
            None
        } else {
            Some(ld.matrix("lm_head.weight", c.vocab_size, h)?)
        };
        let rope = Rope { head_dim: c.head_dim, inv_freq: inv_freq(c) };
        Ok(Qwen3 { config, embed_tokens, layers, norm, lm_head, rope })
    }

}

impl<B: Backend> Network<B> for Qwen3<B> {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn new_cache(&self, backend: &B, capacity: usize) -> Result<Vec<LayerCache<B>>> {
        (0..self.layers.len()).map(|_| Ok(LayerCache::Attention(backend.new_kv_cache(self.config.kv_width(), capacity)?))).collect()
    }

    fn forward(&self, b: &B, tokens: &[u32], seqs: &mut [Seq<'_, B>], rows: LogitRows) -> Result<B::Tensor> {
        let c = &self.config;
        let shape = AttentionShape { num_heads: c.num_heads, num_kv_heads: c.num_kv_heads, head_dim: c.head_dim };
        let eps = c.rms_norm_eps;

        let mut x = b.embed(&self.embed_tokens, tokens)?; // [T, H]
        for (l, layer) in self.layers.iter().enumerate() {
            let attn = &layer.self_attn;
            // [T, heads * head_dim], [T, kv_heads * head_dim] twice
            let [q, k, v] =
                b.norm_linears(&x, &layer.input_layernorm, eps, [attn.q_proj.proj(), attn.k_proj.proj(), attn.v_proj.proj()])?;
            // [T, heads * head_dim], each sequence over its own cache
            let norms = QkNorms { q: attn.q_norm.as_ref(), k: attn.k_norm.as_ref(), eps };
            let o = rotary_attention(b, [q, k, v], norms, &self.rope, seqs, l, shape)?;
            b.linear_add(&o, &attn.o_proj.weight, attn.o_proj.bias.as_ref(), &mut x)?; // x += o_proj(o)

            layer.mlp.forward_add(b, &mut x, &layer.post_attention_layernorm, eps)?; // x += mlp(norm(x))
        }
        let x = b.rms_norm(&rows.of(b, x, seqs)?, &self.norm, eps)?; // [seqs, H], or [T, H] for every position
        let head = self.lm_head.as_ref().unwrap_or(&self.embed_tokens);
        b.linear(&x, head, None)
    }
}

/// Rotary inverse frequencies as transformers computes them, including its rope_type scalings.
pub(super) fn inv_freq(c: &ModelConfig) -> Vec<f32> {
    let d = c.rotary_dim;
    let base: Vec<f64> = (0..d / 2).map(|i| 1.0 / (c.rope_theta as f64).powf((2 * i) as f64 / d as f64)).collect();
    let scaled: Vec<f64> = match c.rope_scaling {
        RopeScaling::None => base,
        RopeScaling::Linear { factor } => base.iter().map(|f| f / factor as f64).collect(),
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position } => {
            let (factor, low, high, old) =
                (factor as f64, low_freq_factor as f64, high_freq_factor as f64, original_max_position as f64);
            let low_wavelen = old / low;
            let high_wavelen = old / high;
            base.iter()
                .map(|&f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - low) / (high - low);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
    };
    scaled.into_iter().map(|f| f as f32).collect()
}
