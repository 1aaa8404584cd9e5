//! Qwen3 dense decoder (and Llama, which is the same network without the per-head q/k norms).
//! Field names mirror the Hugging Face tensor names: `model.layers.N.self_attn.q_proj.weight`...
//!
//! Per layer, with T new tokens and H = hidden_size:
//!   h   = x + o_proj(attn(rope(q_norm(q_proj(norm(x)))), rope(k_norm(k_proj(norm(x)))), v_proj(norm(x))))
//!   out = h + down_proj(silu(gate_proj(norm(h))) * up_proj(norm(h)))
//! The backend calls take the un-normalised x with the norm's weight, so GPUs can fuse the norm
//! into the products.

use super::config::{ModelConfig, RopeScaling};
use super::weights::{LoadProgress, WeightSource};
use crate::backend::{AttentionShape, Backend, Proj, QkNorms, Rope};
use crate::Result;

struct Linear<B: Backend> {
    weight: B::Weight,
    bias: Option<B::Tensor>,
}

struct Attention<B: Backend> {
    q_proj: Linear<B>,
    k_proj: Linear<B>,
    v_proj: Linear<B>,
    o_proj: Linear<B>,
    /// Qwen3 only: RMSNorm over each head (weight [head_dim]).
    q_norm: Option<B::Tensor>,
    k_norm: Option<B::Tensor>,
}

struct Mlp<B: Backend> {
    gate_proj: Linear<B>,
    up_proj: Linear<B>,
    down_proj: Linear<B>,
}

struct DecoderLayer<B: Backend> {
    input_layernorm: B::Tensor,
    self_attn: Attention<B>,
    post_attention_layernorm: B::Tensor,
    mlp: Mlp<B>,
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

/// Loads tensors one by one, reporting progress after each.
struct Loader<'a, B: Backend> {
    backend: &'a B,
    source: &'a dyn WeightSource,
    progress: &'a mut dyn FnMut(LoadProgress),
    done: LoadProgress,
}

impl<B: Backend> Loader<'_, B> {
    fn tick(&mut self, bytes: u64) {
        self.done.tensors_done += 1;
        self.done.bytes_done += bytes;
        (self.progress)(self.done);
    }

    fn matrix(&mut self, name: &str, rows: usize, cols: usize) -> Result<B::Weight> {
        let m = self.source.matrix(name, rows, cols)?;
        let bytes = m.storage_bytes() as u64;
        let w = self.backend.upload_weight(m)?;
        self.tick(bytes);
        Ok(w)
    }

    fn vector(&mut self, name: &str, len: usize) -> Result<B::Tensor> {
        let v = self.source.vector(name, len)?;
        let t = self.backend.upload_vector(&v)?;
        self.tick(len as u64 * 4);
        Ok(t)
    }

    fn linear(&mut self, prefix: &str, rows: usize, cols: usize, with_bias: bool) -> Result<Linear<B>> {
        let weight = self.matrix(&format!("{prefix}.weight"), rows, cols)?;
        let bias = if with_bias { Some(self.vector(&format!("{prefix}.bias"), rows)?) } else { None };
        Ok(Linear { weight, bias })
    }
}

impl<B: Backend> Qwen3<B> {
    pub fn load(
        config: ModelConfig,
        source: &dyn WeightSource,
        backend: &B,
        progress: &mut dyn FnMut(LoadProgress),
    ) -> Result<Self> {
        // Configs may be built in code, not only parsed, and everything below is sized from them.
        config.validate()?;
        let c = &config;
        // More layers than the weights hold is refused before anything is loaded. Fewer are
        // accepted, as transformers does: running a prefix of a checkpoint's layers is a legitimate
        // experiment, and a source that makes its weights (synthetic) holds any layer asked for.
        let marker = |i: usize| format!("model.layers.{i}.input_layernorm.weight");
        let present = (0..c.num_layers).take_while(|&i| source.contains(&marker(i))).count();
        if present < c.num_layers {
            return Err(crate::Error::bad_tensor(
                marker(present),
                format!("missing: the config declares {} layers but the weights have {present}", c.num_layers),
            ));
        }
        let (h, q, kv, ffn) = (c.hidden_size, c.q_width(), c.kv_width(), c.intermediate_size);
        let done = LoadProgress { tensors_done: 0, tensors_total: source.tensor_count(), bytes_done: 0 };
        let mut ld = Loader { backend, source, progress, done };

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
            let mlp = Mlp {
                gate_proj: ld.linear(&format!("{p}.mlp.gate_proj"), ffn, h, c.mlp_bias)?,
                up_proj: ld.linear(&format!("{p}.mlp.up_proj"), ffn, h, c.mlp_bias)?,
                down_proj: ld.linear(&format!("{p}.mlp.down_proj"), h, ffn, c.mlp_bias)?,
            };
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

    pub fn new_cache(&self, backend: &B, capacity: usize) -> Result<Vec<B::KvCache>> {
        (0..self.layers.len()).map(|_| backend.new_kv_cache(self.config.kv_width(), capacity)).collect()
    }

    /// Runs `tokens` at positions `start_pos..` and returns the logits of the last one
    /// (`[1, vocab_size]`, on the backend). The cache must hold positions `0..start_pos`.
    pub fn forward<'a>(&'a self, b: &B, tokens: &[u32], start_pos: usize, cache: &mut [B::KvCache]) -> Result<B::Tensor> {
        let c = &self.config;
        let shape = AttentionShape { num_heads: c.num_heads, num_kv_heads: c.num_kv_heads, head_dim: c.head_dim };
        let eps = c.rms_norm_eps;
        let proj = |l: &'a Linear<B>| Proj { weight: &l.weight, bias: l.bias.as_ref() };

        let mut x = b.embed(&self.embed_tokens, tokens)?; // [T, H]
        for (layer, kv) in self.layers.iter().zip(cache.iter_mut()) {
            let attn = &layer.self_attn;
            // [T, heads * head_dim], [T, kv_heads * head_dim] twice
            let [q, k, v] =
                b.norm_linears(&x, &layer.input_layernorm, eps, [proj(&attn.q_proj), proj(&attn.k_proj), proj(&attn.v_proj)])?;
            let norms = QkNorms { q: attn.q_norm.as_ref(), k: attn.k_norm.as_ref(), eps };
            let o = b.rotary_attention(q, k, &v, norms, &self.rope, kv, start_pos, shape)?; // [T, heads * head_dim]
            b.linear_add(&o, &attn.o_proj.weight, attn.o_proj.bias.as_ref(), &mut x)?; // x += o_proj(o)

            let mlp = &layer.mlp;
            let h = b.norm_silu_gate_up(&x, &layer.post_attention_layernorm, eps, proj(&mlp.gate_proj), proj(&mlp.up_proj))?; // [T, ffn]
            b.linear_add(&h, &mlp.down_proj.weight, mlp.down_proj.bias.as_ref(), &mut x)?; // x += down_proj(h)
        }
        let last = b.rms_norm(&b.last_row(&x)?, &self.norm, eps)?; // [1, H]
        let head = self.lm_head.as_ref().unwrap_or(&self.embed_tokens);
        b.linear(&last, head, None)
    }
}

/// Rotary inverse frequencies as transformers computes them, including its rope_type scalings.
fn inv_freq(c: &ModelConfig) -> Vec<f32> {
    let d = c.head_dim;
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
