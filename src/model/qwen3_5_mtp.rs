//! Qwen3.5 / Qwen3.6's multi-token-prediction head (`mtp.*`): one more gated-attention decoder
//! layer that reads the model's final hidden state at position i together with the token chosen
//! for position i + 1, and guesses the token at i + 2. Speculative decoding drafts with it and
//! the model checks the drafts (engine::draft); a wrong guess costs time, never a token.
//!
//! Per row, H = hidden_size (vLLM's Qwen3_5MultiTokenPredictor is the reference):
//!   x = fc([norm_e(embed(t_{i+1})); norm_h(h_i)])    fc [H, 2H], kept as its two [H, H] halves
//!   g = norm(layer(x))                               its own KV cache, rotary position i
//!   logits = lm_head(g)                              the model's head
//! Drafting further feeds g back in place of h with the token just drafted, one position on.
//! Every norm here is zero-centred (scale 1 + w), as in the rest of the model.

use super::config::ModelConfig;
use super::loader::Loader;
use super::qwen3_5::DecoderLayer;
use crate::backend::Backend;
use crate::Result;

pub(super) struct Mtp<B: Backend> {
    pre_fc_norm_embedding: B::Tensor,
    pre_fc_norm_hidden: B::Tensor,
    /// `fc`'s columns that take the embedding, and those that take the hidden state.
    fc_embedding: B::Weight,
    fc_hidden: B::Weight,
    pub(super) layers: Vec<DecoderLayer<B>>,
    norm: B::Tensor,
}

impl<B: Backend> Mtp<B> {
    pub(super) fn load(ld: &mut Loader<'_, B>, c: &ModelConfig, layers: usize) -> Result<Self> {
        let h = c.hidden_size;
        let [fc_embedding, fc_hidden] = ld.split_columns("mtp.fc.weight", h, 2 * h)?;
        Ok(Mtp {
            pre_fc_norm_embedding: ld.centred_norm("mtp.pre_fc_norm_embedding.weight", h)?,
            pre_fc_norm_hidden: ld.centred_norm("mtp.pre_fc_norm_hidden.weight", h)?,
            fc_embedding,
            fc_hidden,
            // The MoE models' head has a mixture-of-experts MLP too.
            layers: (0..layers)
                .map(|i| DecoderLayer::load_attention(ld, &format!("mtp.layers.{i}"), c.moe.is_some(), c))
                .collect::<Result<_>>()?,
            norm: ld.centred_norm("mtp.norm.weight", h)?,
        })
    }

    /// The fused input of the head's layer: `fc([norm_e(embedded); norm_h(hidden)])`, `[T, H]`.
    pub(super) fn input(&self, b: &B, embedded: &B::Tensor, hidden: &B::Tensor, eps: f32) -> Result<B::Tensor> {
        let e = b.rms_norm(embedded, &self.pre_fc_norm_embedding, eps)?;
        let h = b.rms_norm(hidden, &self.pre_fc_norm_hidden, eps)?;
        let mut x = b.linear(&e, &self.fc_embedding, None)?;
        b.linear_add(&h, &self.fc_hidden, None, &mut x)?;
        Ok(x)
    }

    pub(super) fn norm(&self) -> &B::Tensor {
        &self.norm
    }
}
