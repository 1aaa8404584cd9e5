//! The feed-forward half of a decoder layer: a dense gated MLP, or the sparse mixture of experts
//! of Qwen3-MoE and Qwen3.5/3.6-MoE:
//!
//!   xn     = rms_norm(x)                                  [T, H]
//!   route  = top_k(softmax(router · xn))                  per token: k experts and weights
//!   y      = Σ_route weight · down(silu(gate(xn)) * up(xn))
//!   y     += sigmoid(shared_expert_gate · xn) · shared_expert(xn)   (Qwen3.5 only)
//!
//! Experts are read from either layout a checkpoint ships: one tensor per expert
//! (`experts.N.gate_proj.weight`, ...) or transformers 5's fused `experts.gate_up_proj`
//! `[E, 2·I, H]` (gate rows first) and `experts.down_proj` `[E, H, I]`.

use super::config::{MoeConfig, ModelConfig};
use super::loader::{Linear, Loader};
use crate::backend::{Backend, GatedMlp, HostMlp, Proj, Routing, SharedExpert};
use crate::Result;

/// `down(silu(gate(x)) * up(x))`, with biases where the checkpoint has them (Llama's mlp_bias).
pub struct Mlp<B: Backend> {
    gate_proj: Linear<B>,
    up_proj: Linear<B>,
    down_proj: Linear<B>,
}

pub enum FeedForward<B: Backend> {
    Dense(Mlp<B>),
    Sparse(SparseMoe<B>),
}

impl<B: Backend> FeedForward<B> {
    /// Layer `layer`'s `{prefix}` (`model.layers.N.mlp`): sparse where the config says so.
    pub fn load(ld: &mut Loader<'_, B>, prefix: &str, layer: usize, c: &ModelConfig) -> Result<Self> {
        let sparse = c.moe.as_ref().is_some_and(|moe| moe.sparse_layers.get(layer) == Some(&true));
        Self::load_kind(ld, prefix, sparse, c)
    }

    /// `{prefix}` as a sparse (mixture-of-experts) or a dense MLP.
    pub fn load_kind(ld: &mut Loader<'_, B>, prefix: &str, sparse: bool, c: &ModelConfig) -> Result<Self> {
        let (h, ffn, bias) = (c.hidden_size, c.intermediate_size, c.mlp_bias);
        match &c.moe {
            Some(moe) if sparse => Ok(FeedForward::Sparse(SparseMoe::load(ld, prefix, h, moe)?)),
            _ => Ok(FeedForward::Dense(Mlp {
                gate_proj: ld.linear(&format!("{prefix}.gate_proj"), ffn, h, bias)?,
                up_proj: ld.linear(&format!("{prefix}.up_proj"), ffn, h, bias)?,
                down_proj: ld.linear(&format!("{prefix}.down_proj"), h, ffn, bias)?,
            })),
        }
    }

    /// `x += mlp(rms_norm(x))`.
    pub fn forward_add(&self, b: &B, x: &mut B::Tensor, norm: &B::Tensor, eps: f32) -> Result<()> {
        match self {
            FeedForward::Dense(m) => {
                let h = b.norm_silu_gate_up(x, norm, eps, m.gate_proj.proj(), m.up_proj.proj())?; // [T, ffn]
                b.linear_add(&h, &m.down_proj.weight, m.down_proj.bias.as_ref(), x) // x += down_proj(h)
            }
            FeedForward::Sparse(moe) => moe.forward_add(b, x, norm, eps),
        }
    }
}

pub struct SparseMoe<B: Backend> {
    /// The router, `[E, H]`.
    gate: B::Weight,
    experts: B::Experts,
    shared_expert: Option<SharedMlp<B>>,
    routing: Routing,
}

struct SharedMlp<B: Backend> {
    mlp: GatedMlp<B>,
    /// `[1, H]`: the shared expert's output is scaled by sigmoid of this projection.
    gate: B::Weight,
}

impl<B: Backend> SparseMoe<B> {
    /// Loads `{prefix}.gate`, `{prefix}.experts...` and, when the config has one, the shared expert.
    pub fn load(ld: &mut Loader<'_, B>, prefix: &str, hidden: usize, moe: &MoeConfig) -> Result<Self> {
        let (e, i) = (moe.num_experts, moe.expert_intermediate_size);
        let gate = ld.matrix(&format!("{prefix}.gate.weight"), e, hidden)?;
        let per_expert = ld.source.contains(&format!("{prefix}.experts.0.gate_proj.weight"));
        // The backend takes the layer's experts one by one, from the host, and keeps them its way.
        let (backend, source) = (ld.backend, ld.source);
        let experts = backend.upload_experts(e, &mut |n| {
            if per_expert {
                let name = |m: &str| format!("{prefix}.experts.{n}.{m}_proj.weight");
                Ok(HostMlp {
                    gate: ld.host_matrix(source.matrix(&name("gate"), i, hidden), true)?,
                    up: ld.host_matrix(source.matrix(&name("up"), i, hidden), true)?,
                    down: ld.host_matrix(source.matrix(&name("down"), hidden, i), true)?,
                })
            } else {
                // Each fused tensor counts as loaded with its last slice.
                let (gate_up, down) = (format!("{prefix}.experts.gate_up_proj"), format!("{prefix}.experts.down_proj"));
                let last = n + 1 == e;
                Ok(HostMlp {
                    gate: ld.host_matrix(source.stacked_matrix(&gate_up, [e, 2 * i, hidden], n, 0..i), false)?,
                    up: ld.host_matrix(source.stacked_matrix(&gate_up, [e, 2 * i, hidden], n, i..2 * i), last)?,
                    down: ld.host_matrix(source.stacked_matrix(&down, [e, hidden, i], n, 0..hidden), last)?,
                })
            }
        })?;
        let shared_expert = match moe.shared_expert_intermediate_size {
            0 => None,
            si => Some(SharedMlp {
                mlp: gated_mlp(ld, &format!("{prefix}.shared_expert"), hidden, si)?,
                gate: ld.matrix(&format!("{prefix}.shared_expert_gate.weight"), 1, hidden)?,
            }),
        };
        let routing = Routing { top_k: moe.experts_per_token, normalize: moe.normalize_top_k };
        Ok(SparseMoe { gate, experts, shared_expert, routing })
    }

    /// `x += moe(rms_norm(x))`: the router (and the shared expert's gate) with the norm fused,
    /// then the block, which the backend runs as few launches as it can.
    pub fn forward_add(&self, b: &B, x: &mut B::Tensor, norm: &B::Tensor, eps: f32) -> Result<()> {
        let proj = |w| Proj { weight: w, bias: None };
        match &self.shared_expert {
            None => {
                let [logits] = b.norm_linears(x, norm, eps, [proj(&self.gate)])?; // [T, E]
                b.moe_block_add(x, norm, eps, &logits, &self.experts, None, self.routing)
            }
            Some(s) => {
                let [logits, gate_logits] = b.norm_linears(x, norm, eps, [proj(&self.gate), proj(&s.gate)])?; // [T, E], [T, 1]
                let shared = SharedExpert { mlp: &s.mlp, gate_logits: &gate_logits };
                b.moe_block_add(x, norm, eps, &logits, &self.experts, Some(shared), self.routing)
            }
        }
    }
}

fn gated_mlp<B: Backend>(ld: &mut Loader<'_, B>, prefix: &str, hidden: usize, inner: usize) -> Result<GatedMlp<B>> {
    Ok(GatedMlp {
        gate: ld.matrix(&format!("{prefix}.gate_proj.weight"), inner, hidden)?,
        up: ld.matrix(&format!("{prefix}.up_proj.weight"), inner, hidden)?,
        down: ld.matrix(&format!("{prefix}.down_proj.weight"), hidden, inner)?,
    })
}
