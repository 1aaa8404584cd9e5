//! Qwen3.5 / Qwen3.6: a hybrid of Gated DeltaNet layers (`linear_attn`, a recurrent linear
//! attention) and gated full-attention layers (`self_attn`), with dense or mixture-of-experts
//! MLPs. Field names mirror the Hugging Face tensor names (`model.layers.N.linear_attn.in_proj_qkv`).
//!
//! Per layer, with T new tokens and H = hidden_size:
//!   Gated DeltaNet:  xn = norm(x)
//!                    q|k|v = silu(conv1d(in_proj_qkv(xn)))            causal, kernel K, with state
//!                    o = delta_rule(q, k, v, β = σ(in_proj_b xn), g = −e^A_log · softplus(in_proj_a xn + dt_bias))
//!                    h = x + out_proj(rms_norm(o) · silu(in_proj_z xn))      per value head
//!   gated attention: q|gate = q_proj(xn) (per head: d query values, then d gate values)
//!                    h = x + o_proj(attn(rope(q_norm q), rope(k_norm k_proj xn), v_proj xn) · σ(gate))
//!                    rope turns only the first rotary_dim values of each head
//!   out = h + mlp(norm(h))
//! Every RMSNorm here is zero-centred (scale 1 + w, folded in at load) except the DeltaNet
//! output norm, which scales by w.

use super::config::{HybridConfig, LayerKind, ModelConfig};
use super::loader::Loader;
use super::mlp::FeedForward;
use super::qwen3::inv_freq;
use super::weights::{LoadProgress, WeightSource};
use super::qwen3_5_mtp::Mtp;
use super::{per_seq, rotary_attention, DraftHead, LayerCache, LogitRows, Network, Seq};
use crate::backend::{AttentionShape, Backend, DeltaShape, DeltaWeights, QkNorms, Rope};
use crate::{Error, Result};

struct GatedDeltaNet<B: Backend> {
    in_proj_qkv: B::Weight,
    in_proj_z: B::Weight,
    in_proj_b: B::Weight,
    in_proj_a: B::Weight,
    /// `[C, 1, K]` as one row.
    conv1d: B::Tensor,
    a_log: B::Tensor,
    dt_bias: B::Tensor,
    norm: B::Tensor,
    out_proj: B::Weight,
}

struct GatedAttention<B: Backend> {
    /// q_proj's query rows and its gate rows, separated at load.
    q_proj: B::Weight,
    q_gate: B::Weight,
    k_proj: B::Weight,
    v_proj: B::Weight,
    o_proj: B::Weight,
    q_norm: B::Tensor,
    k_norm: B::Tensor,
}

enum Mixer<B: Backend> {
    DeltaNet(GatedDeltaNet<B>),
    Attention(GatedAttention<B>),
}

pub(super) struct DecoderLayer<B: Backend> {
    input_layernorm: B::Tensor,
    mixer: Mixer<B>,
    post_attention_layernorm: B::Tensor,
    mlp: FeedForward<B>,
}

pub struct Qwen35<B: Backend> {
    config: ModelConfig,
    hybrid: HybridConfig,
    embed_tokens: B::Weight,
    layers: Vec<DecoderLayer<B>>,
    norm: B::Tensor,
    lm_head: Option<B::Weight>,
    rope: Rope,
    /// The multi-token-prediction head, loaded when drafting wants it (`hybrid.mtp_layers`).
    mtp: Option<Mtp<B>>,
}

impl<B: Backend> Qwen35<B> {
    pub fn load(
        config: ModelConfig,
        source: &dyn WeightSource,
        backend: &B,
        progress: &mut dyn FnMut(LoadProgress),
    ) -> Result<Self> {
        let mut ld = Loader::new(&config, backend, source, progress)?;
        let hybrid = config.hybrid.clone().ok_or_else(|| Error::InvalidArgument("a Qwen3.5 config without its linear_* keys".into()))?;
        let c = &config;
        let h = c.hidden_size;

        let embed_tokens = ld.matrix("model.embed_tokens.weight", c.vocab_size, h)?;
        let mut layers = Vec::with_capacity(c.num_layers);
        for (i, kind) in hybrid.layer_kinds.iter().enumerate() {
            let p = format!("model.layers.{i}");
            let mixer = match kind {
                LayerKind::DeltaNet => Mixer::DeltaNet(load_delta_net(&mut ld, &format!("{p}.linear_attn"), c, &hybrid)?),
                LayerKind::Attention => Mixer::Attention(load_attention(&mut ld, &format!("{p}.self_attn"), c)?),
            };
            let mlp = FeedForward::load(&mut ld, &format!("{p}.mlp"), i, c)?;
            layers.push(DecoderLayer::load(&mut ld, &p, mixer, mlp, h)?);
        }
        let norm = ld.centred_norm("model.norm.weight", h)?;
        let lm_head = if c.tie_word_embeddings || !source.contains("lm_head.weight") {
            None
        } else {
            Some(ld.matrix("lm_head.weight", c.vocab_size, h)?)
        };
        let mtp = if hybrid.mtp_layers > 0 { Some(Mtp::load(&mut ld, c, hybrid.mtp_layers)?) } else { None };
        let rope = Rope { head_dim: c.head_dim, inv_freq: inv_freq(c) };
        Ok(Qwen35 { config, hybrid, embed_tokens, layers, norm, lm_head, rope, mtp })
    }

    fn delta_shape(&self) -> DeltaShape {
        let h = &self.hybrid;
        DeltaShape { key_heads: h.key_heads, value_heads: h.value_heads, key_dim: h.key_head_dim, value_dim: h.value_head_dim }
    }
}

impl<B: Backend> GatedDeltaNet<B> {
    fn weights(&self) -> DeltaWeights<'_, B> {
        DeltaWeights { conv1d: &self.conv1d, a_log: &self.a_log, dt_bias: &self.dt_bias }
    }
}

fn load_delta_net<B: Backend>(ld: &mut Loader<'_, B>, p: &str, c: &ModelConfig, hy: &HybridConfig) -> Result<GatedDeltaNet<B>> {
    let (h, conv, vd, vh) = (c.hidden_size, hy.conv_dim(), hy.value_dim(), hy.value_heads);
    Ok(GatedDeltaNet {
        in_proj_qkv: ld.matrix(&format!("{p}.in_proj_qkv.weight"), conv, h)?,
        in_proj_z: ld.matrix(&format!("{p}.in_proj_z.weight"), vd, h)?,
        in_proj_b: ld.matrix(&format!("{p}.in_proj_b.weight"), vh, h)?,
        in_proj_a: ld.matrix(&format!("{p}.in_proj_a.weight"), vh, h)?,
        conv1d: ld.array(&format!("{p}.conv1d.weight"), &[conv, 1, hy.conv_kernel])?,
        a_log: ld.vector(&format!("{p}.A_log"), vh)?,
        dt_bias: ld.vector(&format!("{p}.dt_bias"), vh)?,
        norm: ld.vector(&format!("{p}.norm.weight"), hy.value_head_dim)?,
        out_proj: ld.matrix(&format!("{p}.out_proj.weight"), h, vd)?,
    })
}

/// A layer's conv1d and gated delta rule for each sequence of a step, from its own states of
/// `layer`: a batch of one token each in one pass of the backend. A single sequence's inputs stay
/// with its cache where a checked step wants them (`Checkpoint`).
fn delta_net<B: Backend>(
    b: &B,
    [qkv, a, beta]: [B::Tensor; 3],
    weights: DeltaWeights<'_, B>,
    seqs: &mut [Seq<'_, B>],
    layer: usize,
    shape: DeltaShape,
) -> Result<B::Tensor> {
    if let [seq] = seqs {
        let o = recurrence(b, [&qkv, &a, &beta], weights, &mut seq.cache[layer], shape)?;
        seq.cache[layer].keep_step_inputs(b, seq.len, [qkv, a, beta])?;
        return Ok(o);
    }
    if seqs.len() > 1 && seqs.iter().all(|s| s.len == 1) {
        let mut states = seqs.iter_mut().map(|s| s.cache[layer].recurrent()).collect::<Result<Vec<_>>>()?;
        return b.delta_net_rows(&qkv, &a, &beta, weights, &mut states, shape);
    }
    per_seq(b, [qkv, a, beta], seqs, |[qkv, a, beta], seq| recurrence(b, [&qkv, &a, &beta], weights, &mut seq.cache[layer], shape))
}

/// One sequence's conv1d and gated delta rule over its tokens, continuing `cache`'s states.
fn recurrence<B: Backend>(b: &B, [qkv, a, beta]: [&B::Tensor; 3], weights: DeltaWeights<'_, B>, cache: &mut LayerCache<B>, shape: DeltaShape) -> Result<B::Tensor> {
    let (conv_state, state) = cache.recurrent()?;
    let qkv = b.conv1d_silu(qkv, weights.conv1d, conv_state)?; // [T, C]
    b.gated_delta_rule(&qkv, a, beta, weights.a_log, weights.dt_bias, state, shape) // [T, Hv·dv]
}

impl<B: Backend> DecoderLayer<B> {
    fn load(ld: &mut Loader<'_, B>, p: &str, mixer: Mixer<B>, mlp: FeedForward<B>, h: usize) -> Result<Self> {
        Ok(DecoderLayer {
            input_layernorm: ld.centred_norm(&format!("{p}.input_layernorm.weight"), h)?,
            mixer,
            post_attention_layernorm: ld.centred_norm(&format!("{p}.post_attention_layernorm.weight"), h)?,
            mlp,
        })
    }

    /// A gated-attention layer `{p}` (`mtp.layers.N`) whose MLP is sparse when `sparse`.
    pub(super) fn load_attention(ld: &mut Loader<'_, B>, p: &str, sparse: bool, c: &ModelConfig) -> Result<Self> {
        let mixer = Mixer::Attention(load_attention(ld, &format!("{p}.self_attn"), c)?);
        let mlp = FeedForward::load_kind(ld, &format!("{p}.mlp"), sparse, c)?;
        Self::load(ld, p, mixer, mlp, c.hidden_size)
    }
}

fn load_attention<B: Backend>(ld: &mut Loader<'_, B>, p: &str, c: &ModelConfig) -> Result<GatedAttention<B>> {
    let (h, d, heads) = (c.hidden_size, c.head_dim, c.num_heads);
    // q_proj's rows are, per head, d query rows then d gate rows.
    let rows_of = |offset: usize| -> Vec<usize> { (0..heads).flat_map(|hd| (0..d).map(move |i| hd * 2 * d + offset + i)).collect() };
    let mut q = ld.split_rows(&format!("{p}.q_proj.weight"), 2 * heads * d, h, vec![rows_of(0), rows_of(d)])?;
    let (q_gate, q_proj) = (q.pop(), q.pop());
    let (Some(q_proj), Some(q_gate)) = (q_proj, q_gate) else {
        return Err(Error::InvalidArgument("q_proj split into two parts".into()));
    };
    Ok(GatedAttention {
        q_proj,
        q_gate,
        k_proj: ld.matrix(&format!("{p}.k_proj.weight"), c.kv_width(), h)?,
        v_proj: ld.matrix(&format!("{p}.v_proj.weight"), c.kv_width(), h)?,
        o_proj: ld.matrix(&format!("{p}.o_proj.weight"), h, heads * d)?,
        q_norm: ld.centred_norm(&format!("{p}.q_norm.weight"), d)?,
        k_norm: ld.centred_norm(&format!("{p}.k_norm.weight"), d)?,
    })
}

impl<B: Backend> Network<B> for Qwen35<B> {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// One cache per decoder layer, then one per multi-token-prediction layer.
    fn new_cache(&self, b: &B, capacity: usize) -> Result<Vec<LayerCache<B>>> {
        let hy = &self.hybrid;
        let conv_state = (hy.conv_kernel - 1) * hy.conv_dim();
        let delta_state = self.delta_shape().state_len();
        let mtp_layers = self.mtp.iter().flat_map(|m| &m.layers);
        self.layers
            .iter()
            .chain(mtp_layers)
            .map(|layer| {
                Ok(match layer.mixer {
                    Mixer::DeltaNet(_) => {
                        LayerCache::new_recurrent(b.upload_vector(&vec![0.0; conv_state])?, b.upload_vector(&vec![0.0; delta_state])?)
                    }
                    Mixer::Attention(_) => LayerCache::Attention(b.new_kv_cache(self.config.kv_width(), capacity)?),
                })
            })
            .collect()
    }

    fn forward(&self, b: &B, tokens: &[u32], seqs: &mut [Seq<'_, B>], rows: LogitRows) -> Result<B::Tensor> {
        let x = self.decoder(b, tokens, seqs)?;
        let x = b.rms_norm(&rows.of(b, x, seqs)?, &self.norm, self.config.rms_norm_eps)?; // [seqs, H], or [T, H] for every position
        self.head(b, &x)
    }

    fn draft_head(&self) -> Option<&dyn DraftHead<B>> {
        self.mtp.as_ref().map(|_| self as &dyn DraftHead<B>)
    }

    /// From the states before the checked step, the kept tokens' inputs run through each
    /// DeltaNet layer's recurrence again: the same kernels on the same rows, so the same bits as
    /// a step of only those tokens.
    fn rewind_recurrent(&self, b: &B, cache: &mut [LayerCache<B>], keep: usize) -> Result<()> {
        for (layer, cache) in self.layers.iter().zip(cache) {
            let Mixer::DeltaNet(net) = &layer.mixer else { continue };
            let inputs = cache.back_to_checkpoint(b)?;
            if keep > 0 {
                let [qkv, a, beta] = inputs.each_ref().map(|x| b.rows(x, 0, keep));
                recurrence(b, [&qkv?, &a?, &beta?], net.weights(), cache, self.delta_shape())?;
            }
        }
        Ok(())
    }
}

impl<B: Backend> DraftHead<B> for Qwen35<B> {
    fn forward_hidden(&self, b: &B, tokens: &[u32], seqs: &mut [Seq<'_, B>], rows: LogitRows) -> Result<(B::Tensor, B::Tensor)> {
        let eps = self.config.rms_norm_eps;
        let x = self.decoder(b, tokens, seqs)?;
        let hidden = b.rms_norm(&x, &self.norm, eps)?; // [T, H]
        // The logits as `forward` computes them, to the bit.
        let logits = self.head(b, &b.rms_norm(&rows.of(b, x, seqs)?, &self.norm, eps)?)?;
        Ok((hidden, logits))
    }

    fn draft_step(&self, b: &B, hidden: &B::Tensor, next: &[u32], seq: &mut Seq<'_, B>, depth: usize) -> Result<B::Tensor> {
        let mtp = self.mtp.as_ref().ok_or_else(|| Error::InvalidArgument("a draft from a model without its multi-token-prediction head".into()))?;
        let eps = self.config.rms_norm_eps;
        let layer = depth % mtp.layers.len();
        let mut x = mtp.input(b, &b.embed(&self.embed_tokens, next)?, hidden, eps)?; // [T, H]
        mtp.layers[layer].forward(b, &mut x, std::slice::from_mut(seq), self.layers.len() + layer, self)?;
        b.rms_norm(&x, mtp.norm(), eps)
    }

    fn draft_logits(&self, b: &B, x: &B::Tensor) -> Result<B::Tensor> {
        self.head(b, x)
    }
}

impl<B: Backend> Qwen35<B> {
    /// The decoder layers over `tokens`: the residual stream before the final norm, `[T, H]`.
    fn decoder(&self, b: &B, tokens: &[u32], seqs: &mut [Seq<'_, B>]) -> Result<B::Tensor> {
        let mut x = b.embed(&self.embed_tokens, tokens)?; // [T, H]
        for (l, layer) in self.layers.iter().enumerate() {
            layer.forward(b, &mut x, seqs, l, self)?;
        }
        Ok(x)
    }

    fn head(&self, b: &B, x: &B::Tensor) -> Result<B::Tensor> {
        b.linear(x, self.lm_head.as_ref().unwrap_or(&self.embed_tokens), None) // [rows, vocab]
    }
}

impl<B: Backend> DecoderLayer<B> {
    /// `x = x + mixer(norm(x))`, then `x = x + mlp(norm(x))`; the mixer reads and writes each
    /// sequence's cache of layer `l`.
    fn forward(&self, b: &B, x: &mut B::Tensor, seqs: &mut [Seq<'_, B>], l: usize, model: &Qwen35<B>) -> Result<()> {
        let c = &model.config;
        let eps = c.rms_norm_eps;
        let norm = &self.input_layernorm;
        match &self.mixer {
            Mixer::DeltaNet(net) => {
                let projs = [&net.in_proj_qkv, &net.in_proj_z, &net.in_proj_b, &net.in_proj_a].map(|w| crate::backend::Proj { weight: w, bias: None });
                let [qkv, z, beta, a] = b.norm_linears(x, norm, eps, projs)?; // [T, C], [T, Hv·dv], [T, Hv] twice
                let o = delta_net(b, [qkv, a, beta], net.weights(), seqs, l, model.delta_shape())?; // [T, Hv·dv]
                let o = b.gated_rms_norm(&o, &z, &net.norm, eps)?;
                b.linear_add(&o, &net.out_proj, None, x)?; // x += out_proj(o)
            }
            Mixer::Attention(attn) => {
                let shape = AttentionShape { num_heads: c.num_heads, num_kv_heads: c.num_kv_heads, head_dim: c.head_dim };
                let projs = [&attn.q_proj, &attn.q_gate, &attn.k_proj, &attn.v_proj].map(|w| crate::backend::Proj { weight: w, bias: None });
                let [q, gate, k, v] = b.norm_linears(x, norm, eps, projs)?; // [T, heads·d] twice, [T, kv_heads·d] twice
                let norms = QkNorms { q: Some(&attn.q_norm), k: Some(&attn.k_norm), eps };
                let mut o = rotary_attention(b, [q, k, v], norms, &model.rope, seqs, l, shape)?;
                b.sigmoid_gate(&mut o, &gate)?; // o *= σ(gate)
                b.linear_add(&o, &attn.o_proj, None, x)?; // x += o_proj(o)
            }
        }
        self.mlp.forward_add(b, x, &self.post_attention_layernorm, eps) // x += mlp(norm(x))
    }
}
