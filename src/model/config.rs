//! config.json -> ModelConfig: the few numbers the model code needs, checked once at load.

use std::path::Path;

use serde_json::Value;

use crate::{Error, Result};

// Upper bounds on the sizes a config may declare. Some buffers are sized from these numbers before
// any weight backs them (the layer table, rotary tables, activation rows), and a failed allocation
// aborts the whole host process where no error handling can catch it, so a corrupt or hostile
// config.json or GGUF is refused here instead. Each bound is several times the largest released
// dense model (Llama 3.1 405B: 126 layers, hidden 16384, ffn 53248, 128 heads; Gemma 3: 262144
// tokens; head_dim 256; Llama 4 Scout: 10M positions).
pub const MAX_LAYERS: usize = 1024;
/// Multi-token-prediction layers read (Qwen3.5 / 3.6 ship one).
pub const MAX_MTP_LAYERS: usize = 8;
pub const MAX_HIDDEN_SIZE: usize = 1 << 16;
pub const MAX_INTERMEDIATE_SIZE: usize = 1 << 20;
pub const MAX_HEADS: usize = 1024;
pub const MAX_HEAD_DIM: usize = 1024;
pub const MAX_VOCAB_SIZE: usize = 1 << 22;
pub const MAX_POSITIONS: usize = 1 << 24;
/// Qwen3.5/3.6-MoE has 512 experts; DeepSeek-style models 256.
pub const MAX_EXPERTS: usize = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Qwen3,
    /// Qwen3 attention with mixture-of-experts MLPs.
    Qwen3Moe,
    /// Qwen3.5/3.6: Gated DeltaNet layers and gated full-attention layers.
    Qwen35,
    /// Qwen3.5/3.6 with mixture-of-experts MLPs.
    Qwen35Moe,
}

impl Architecture {
    pub fn name(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen3 => "qwen3",
            Architecture::Qwen3Moe => "qwen3_moe",
            Architecture::Qwen35 => "qwen3_5",
            Architecture::Qwen35Moe => "qwen3_5_moe",
        }
    }
}

/// The mixture-of-experts MLP: `num_experts` gated MLPs of `expert_intermediate_size`, of which
/// each token uses `experts_per_token`.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub experts_per_token: usize,
    pub expert_intermediate_size: usize,
    /// Renormalise the chosen experts' probabilities to sum to one.
    pub normalize_top_k: bool,
    /// A shared expert every token uses, gated by sigmoid; 0 when there is none.
    pub shared_expert_intermediate_size: usize,
    /// Per layer: whether its MLP is sparse (the others are dense, of `intermediate_size`).
    pub sparse_layers: Vec<bool>,
}

/// The token mixer of one layer of a hybrid model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// Gated DeltaNet (`linear_attention`).
    DeltaNet,
    /// Gated softmax attention (`full_attention`).
    Attention,
}

/// The Gated DeltaNet layers of Qwen3.5/3.6 (config keys `linear_*`).
#[derive(Debug, Clone, PartialEq)]
pub struct HybridConfig {
    pub layer_kinds: Vec<LayerKind>,
    pub conv_kernel: usize,
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_head_dim: usize,
    pub value_head_dim: usize,
    /// Decoder layers of the multi-token-prediction head (`mtp_num_hidden_layers`; `mtp.*`
    /// tensors), 0 when it is absent or not wanted (loaded only for drafting).
    pub mtp_layers: usize,
}

impl HybridConfig {
    /// Channels of the q, k, v projection and its convolution.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_heads * self.key_head_dim + self.value_heads * self.value_head_dim
    }

    pub fn value_dim(&self) -> usize {
        self.value_heads * self.value_head_dim
    }
}

/// How rotary frequencies are derived from `rope_theta` (transformers' `rope_type`).
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    Linear { factor: f32 },
    Llama3 { factor: f32, low_freq_factor: f32, high_freq_factor: f32, original_max_position: f32 },
}

#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub arch: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    pub tie_word_embeddings: bool,
    pub attention_bias: bool,
    pub mlp_bias: bool,
    /// Qwen3 normalises each query and key head (RMSNorm over head_dim) before RoPE.
    pub qk_norm: bool,
    /// Dimensions of each head that rotary embedding turns (head_dim, or a part of it).
    pub rotary_dim: usize,
    pub moe: Option<MoeConfig>,
    pub hybrid: Option<HybridConfig>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

impl ModelConfig {
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let json: Value =
            serde_json::from_str(&text).map_err(|e| Error::bad_file(path, format!("not valid JSON: {e}")))?;
        Self::from_json(&json).map_err(|e| match e {
            Error::InvalidArgument(reason) => Error::bad_file(path, reason),
            other => other,
        })
    }

    pub fn from_json(outer: &Value) -> Result<Self> {
        let model_type = outer.get("model_type").and_then(Value::as_str).unwrap_or("");
        let arch = match model_type {
            "qwen3" => Architecture::Qwen3,
            "llama" => Architecture::Llama,
            "qwen3_moe" => Architecture::Qwen3Moe,
            "qwen3_5" | "qwen3_5_text" => Architecture::Qwen35,
            "qwen3_5_moe" | "qwen3_5_moe_text" => Architecture::Qwen35Moe,
            "" => return Err(Error::InvalidArgument("config.json has no model_type".into())),
            other => {
                return Err(Error::Unsupported(format!(
                    "model_type {other:?} (supported: qwen3, qwen3_moe, qwen3_5, qwen3_5_moe, llama)"
                )))
            }
        };
        // The multimodal checkpoints (Qwen3_5ForConditionalGeneration) nest the language model's
        // config; keys missing there (eos_token_id) fall back to the outer one, and the outer
        // tie_word_embeddings decides, as in transformers.
        let json = &match outer.get("text_config").filter(|t| t.is_object()) {
            Some(text) => {
                let mut merged = outer.as_object().cloned().unwrap_or_default();
                merged.remove("text_config");
                let tie = merged.get("tie_word_embeddings").cloned();
                merged.extend(text.as_object().cloned().unwrap_or_default());
                if let Some(tie) = tie {
                    merged.insert("tie_word_embeddings".into(), tie);
                }
                Value::Object(merged)
            }
            None => outer.clone(),
        };
        let hidden_size = req_usize(json, "hidden_size")?;
        let num_heads = req_usize(json, "num_attention_heads")?;
        let num_kv_heads = opt_usize(json, "num_key_value_heads")?.unwrap_or(num_heads);
        if num_heads == 0 || num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            return Err(Error::InvalidArgument(format!(
                "num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}"
            )));
        }
        let head_dim = match opt_usize(json, "head_dim")? {
            Some(d) => d,
            None => hidden_size / num_heads,
        };
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(Error::InvalidArgument(format!("head_dim {head_dim} must be even and non-zero")));
        }
        let act = json.get("hidden_act").and_then(Value::as_str).unwrap_or("silu");
        if act != "silu" {
            return Err(Error::Unsupported(format!("hidden_act {act:?} (only silu)")));
        }
        if let Some(q) = json.get("quantization_config").filter(|q| !q.is_null()) {
            check_quantization(q)?;
        }
        if json.get("use_sliding_window").and_then(Value::as_bool) == Some(true) {
            return Err(Error::Unsupported("use_sliding_window = true".into()));
        }
        // transformers 5 moved rope_theta and rope_scaling into one `rope_parameters` object.
        let rope = json.get("rope_parameters").filter(|v| v.is_object());
        let rope_theta = rope
            .and_then(|r| r.get("rope_theta"))
            .or_else(|| json.get("rope_theta"))
            .map(|v| v.as_f64().ok_or_else(|| bad_key("rope_theta", "a number")))
            .transpose()?
            .unwrap_or(10_000.0) as f32;
        let scaling = rope.or_else(|| json.get("rope_scaling").filter(|v| v.is_object()));
        let rope_scaling = parse_rope_scaling(scaling)?;
        let partial_rotary = rope
            .and_then(|r| r.get("partial_rotary_factor"))
            .or_else(|| json.get("partial_rotary_factor"))
            .map(|v| v.as_f64().filter(|f| *f > 0.0 && *f <= 1.0).ok_or_else(|| bad_key("partial_rotary_factor", "in (0, 1]")))
            .transpose()?
            // transformers' default for the Qwen3.5 text configs.
            .unwrap_or(if matches!(arch, Architecture::Qwen35 | Architecture::Qwen35Moe) { 0.25 } else { 1.0 });
        // Whole pairs of dimensions, as transformers' int(head_dim * factor) with even rounding.
        let rotary_dim = ((head_dim as f64 * partial_rotary) as usize) / 2 * 2;
        let num_layers = req_usize(json, "num_hidden_layers")?;
        let moe = match arch {
            Architecture::Qwen3Moe | Architecture::Qwen35Moe => Some(moe_config(json, arch, num_layers)?),
            _ => None,
        };
        let hybrid = match arch {
            Architecture::Qwen35 | Architecture::Qwen35Moe => Some(hybrid_config(json, num_layers)?),
            _ => None,
        };
        let eos_token_ids = token_ids(json.get("eos_token_id"), "eos_token_id")?;
        let bos_token_id = token_ids(json.get("bos_token_id"), "bos_token_id")?.first().copied();

        let config = ModelConfig {
            arch,
            vocab_size: req_usize(json, "vocab_size")?,
            hidden_size,
            // The MoE models have no dense MLP unless some layers are dense.
            intermediate_size: match (&moe, opt_usize(json, "intermediate_size")?) {
                (_, Some(n)) => n,
                (Some(m), None) => m.expert_intermediate_size,
                (None, None) => return Err(Error::InvalidArgument("config.json is missing intermediate_size".into())),
            },
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            max_position_embeddings: opt_usize(json, "max_position_embeddings")?.unwrap_or(4096),
            rms_norm_eps: json.get("rms_norm_eps").and_then(Value::as_f64).unwrap_or(1e-6) as f32,
            rope_theta,
            rope_scaling,
            tie_word_embeddings: json.get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(false),
            attention_bias: json.get("attention_bias").and_then(Value::as_bool).unwrap_or(false),
            mlp_bias: json.get("mlp_bias").and_then(Value::as_bool).unwrap_or(false),
            qk_norm: arch != Architecture::Llama,
            rotary_dim,
            moe,
            hybrid,
            bos_token_id,
            eos_token_ids,
        };
        config.validate()?;
        Ok(config)
    }

    /// Checks every size against the limits above, naming it by its config.json key.
    pub fn validate(&self) -> Result<()> {
        self.check_sizes(|s| s.json.to_string())
    }

    /// [`Self::validate`], naming each size by its GGUF metadata key under `arch` (llama.cpp's
    /// architecture name, e.g. `qwen35moe`).
    pub fn validate_gguf(&self, arch: &str) -> Result<()> {
        self.check_sizes(|s| format!("{arch}.{}", s.gguf))
    }

    fn check_sizes(&self, name: impl Fn(&Size) -> String) -> Result<()> {
        let size = |json, gguf, value, max| Size { json, gguf, value, max };
        let sizes = [
            size("num_hidden_layers", "block_count", self.num_layers, MAX_LAYERS),
            size("hidden_size", "embedding_length", self.hidden_size, MAX_HIDDEN_SIZE),
            size("intermediate_size", "feed_forward_length", self.intermediate_size, MAX_INTERMEDIATE_SIZE),
            size("num_attention_heads", "attention.head_count", self.num_heads, MAX_HEADS),
            size("num_key_value_heads", "attention.head_count_kv", self.num_kv_heads, MAX_HEADS),
            size("head_dim", "attention.key_length", self.head_dim, MAX_HEAD_DIM),
            size("vocab_size", "vocab_size", self.vocab_size, MAX_VOCAB_SIZE),
            size("max_position_embeddings", "context_length", self.max_position_embeddings, MAX_POSITIONS),
        ];
        for s in &sizes {
            if s.value == 0 || s.value > s.max {
                return Err(Error::InvalidArgument(format!(
                    "{} = {} is outside the supported range 1..={}",
                    name(s),
                    s.value,
                    s.max
                )));
            }
        }
        if let Some(m) = &self.moe {
            let limited = [("num_experts", m.num_experts, MAX_EXPERTS), ("moe_intermediate_size", m.expert_intermediate_size, MAX_INTERMEDIATE_SIZE)];
            for (key, value, max) in limited {
                if value == 0 || value > max {
                    return Err(Error::InvalidArgument(format!("{key} = {value} is outside the supported range 1..={max}")));
                }
            }
            if m.experts_per_token == 0 || m.experts_per_token > m.num_experts {
                return Err(Error::InvalidArgument(format!(
                    "num_experts_per_tok = {} must be between 1 and num_experts = {}",
                    m.experts_per_token, m.num_experts
                )));
            }
            if m.shared_expert_intermediate_size > MAX_INTERMEDIATE_SIZE || m.sparse_layers.len() != self.num_layers {
                return Err(Error::InvalidArgument("shared_expert_intermediate_size or the sparse layers are out of range".into()));
            }
        }
        if let Some(h) = &self.hybrid {
            let limited = [
                ("linear_conv_kernel_dim", h.conv_kernel, 64),
                ("linear_num_key_heads", h.key_heads, MAX_HEADS),
                ("linear_num_value_heads", h.value_heads, MAX_HEADS),
                ("linear_key_head_dim", h.key_head_dim, MAX_HEAD_DIM),
                ("linear_value_head_dim", h.value_head_dim, MAX_HEAD_DIM),
            ];
            for (key, value, max) in limited {
                if value == 0 || value > max {
                    return Err(Error::InvalidArgument(format!("{key} = {value} is outside the supported range 1..={max}")));
                }
            }
            if h.value_heads % h.key_heads != 0 || h.layer_kinds.len() != self.num_layers {
                return Err(Error::InvalidArgument(format!(
                    "linear_num_value_heads = {} is not a multiple of linear_num_key_heads = {}, or layer_types has not one entry per layer",
                    h.value_heads, h.key_heads
                )));
            }
        }
        if self.rotary_dim == 0 || self.rotary_dim > self.head_dim || !self.rotary_dim.is_multiple_of(2) {
            return Err(Error::InvalidArgument(format!("rotary dimensions {} for head_dim {}", self.rotary_dim, self.head_dim)));
        }
        // Within the limits these cannot overflow a 64-bit usize, but they size whole matrices
        // and activation rows, so a narrower target must refuse rather than wrap.
        let [_, hidden, ffn, heads, kv_heads, head_dim, vocab, _] = &sizes;
        for (a, b) in [(vocab, hidden), (heads, head_dim), (kv_heads, head_dim), (ffn, hidden)] {
            if a.value.checked_mul(b.value).is_none() {
                return Err(Error::InvalidArgument(format!(
                    "{} × {} = {} × {} overflows this platform's address space",
                    name(a),
                    name(b),
                    a.value,
                    b.value
                )));
            }
        }
        Ok(())
    }

    pub fn q_width(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_width(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Layers that keep keys and values: every layer of a dense model; a hybrid's attention
    /// layers and those of its drafting head, when loaded.
    pub fn attention_layers(&self) -> usize {
        match &self.hybrid {
            Some(h) => h.layer_kinds.iter().filter(|k| matches!(k, LayerKind::Attention)).count() + h.mtp_layers,
            None => self.num_layers,
        }
    }
}

/// One size a config declares: its config.json key, its GGUF key (after `{arch}.`), its value and
/// its limit.
struct Size {
    json: &'static str,
    gguf: &'static str,
    value: usize,
    max: usize,
}

fn moe_config(json: &Value, arch: Architecture, num_layers: usize) -> Result<MoeConfig> {
    // transformers 5 writes Qwen3-MoE's expert count as num_local_experts.
    let key = if json.get("num_experts").is_some() { "num_experts" } else { "num_local_experts" };
    let num_experts = req_usize(json, key)?;
    let qwen35 = arch == Architecture::Qwen35Moe;
    // Qwen3.5-MoE always renormalises and has every MLP sparse; Qwen3-MoE says so in its config.
    let normalize_top_k = qwen35 || json.get("norm_topk_prob").and_then(Value::as_bool).unwrap_or(false);
    let sparse_step = opt_usize(json, "decoder_sparse_step")?.unwrap_or(1).max(1);
    let dense: Vec<usize> = match json.get("mlp_only_layers") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| v.as_u64().map(|i| i as usize).ok_or_else(|| bad_key("mlp_only_layers", "a list of layer indices")))
            .collect::<Result<_>>()?,
        Some(_) => return Err(bad_key("mlp_only_layers", "a list of layer indices")),
    };
    let sparse_layers = (0..num_layers.min(MAX_LAYERS))
        .map(|i| qwen35 || (!dense.contains(&i) && (i + 1) % sparse_step == 0))
        .collect();
    Ok(MoeConfig {
        num_experts,
        experts_per_token: req_usize(json, "num_experts_per_tok")?,
        expert_intermediate_size: req_usize(json, "moe_intermediate_size")?,
        normalize_top_k,
        shared_expert_intermediate_size: if qwen35 { req_usize(json, "shared_expert_intermediate_size")? } else { 0 },
        sparse_layers,
    })
}

fn hybrid_config(json: &Value, num_layers: usize) -> Result<HybridConfig> {
    let layer_kinds = match json.get("layer_types") {
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| match v.as_str() {
                Some("linear_attention") => Ok(LayerKind::DeltaNet),
                Some("full_attention") => Ok(LayerKind::Attention),
                _ => Err(bad_key("layer_types", "a list of \"linear_attention\" / \"full_attention\"")),
            })
            .collect::<Result<_>>()?,
        // As transformers: every `full_attention_interval`-th layer is full attention.
        _ => {
            let interval = opt_usize(json, "full_attention_interval")?.unwrap_or(4).max(1);
            (0..num_layers.min(MAX_LAYERS))
                .map(|i| if (i + 1) % interval == 0 { LayerKind::Attention } else { LayerKind::DeltaNet })
                .collect()
        }
    };
    Ok(HybridConfig {
        layer_kinds,
        conv_kernel: req_usize(json, "linear_conv_kernel_dim")?,
        key_heads: req_usize(json, "linear_num_key_heads")?,
        value_heads: req_usize(json, "linear_num_value_heads")?,
        key_head_dim: req_usize(json, "linear_key_head_dim")?,
        value_head_dim: req_usize(json, "linear_value_head_dim")?,
        mtp_layers: opt_usize(json, "mtp_num_hidden_layers")?.unwrap_or(0).min(MAX_MTP_LAYERS),
    })
}

fn parse_rope_scaling(v: Option<&Value>) -> Result<RopeScaling> {
    let Some(v) = v else { return Ok(RopeScaling::None) };
    let kind = v.get("rope_type").or_else(|| v.get("type")).and_then(Value::as_str).unwrap_or("default");
    let num = |key: &str| -> Result<f32> {
        v.get(key)
            .and_then(Value::as_f64)
            .map(|x| x as f32)
            .ok_or_else(|| bad_key(&format!("rope scaling {key}"), "a number"))
    };
    match kind {
        "default" => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear { factor: num("factor")? }),
        "llama3" => Ok(RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position: num("original_max_position_embeddings")?,
        }),
        other => Err(Error::Unsupported(format!("rope_type {other:?} (supported: default, linear, llama3)"))),
    }
}

fn bad_key(key: &str, expected: &str) -> Error {
    Error::InvalidArgument(format!("config key {key} must be {expected}"))
}

fn opt_usize(json: &Value, key: &str) -> Result<Option<usize>> {
    match json.get(key) {
        None | Some(Value::Null) => Ok(None),
        // Saturating, so a value too large for this platform still meets the limits in validate.
        Some(v) => v
            .as_u64()
            .map(|x| Some(usize::try_from(x).unwrap_or(usize::MAX)))
            .ok_or_else(|| bad_key(key, "a non-negative integer")),
    }
}

fn req_usize(json: &Value, key: &str) -> Result<usize> {
    match opt_usize(json, key)? {
        Some(0) => Err(bad_key(key, "greater than zero")),
        Some(v) => Ok(v),
        None => Err(Error::InvalidArgument(format!("config.json is missing {key}"))),
    }
}

/// `eos_token_id` may be one id or a list of ids (generation_config.json uses both forms).
pub fn token_ids(v: Option<&Value>, key: &str) -> Result<Vec<u32>> {
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) => items
            .iter()
            .map(|x| x.as_u64().map(|id| id as u32).ok_or_else(|| bad_key(key, "a token id or a list of them")))
            .collect(),
        Some(x) => x.as_u64().map(|id| vec![id as u32]).ok_or_else(|| bad_key(key, "a token id or a list of them")),
    }
}

/// The quantization schemes Atlas reads: FP8 with 128×128 blocks (`quant_method: fp8`), and
/// NVFP4 from NVIDIA ModelOpt (`quant_method: modelopt`, `quant_algo: NVFP4`) or
/// compressed-tensors (`nvfp4-pack-quantized`: 4-bit floats in groups of 16). Which tensors are
/// quantized is read from the checkpoint's tensors, not from ignore lists.
fn check_quantization(q: &Value) -> Result<()> {
    let text = |key: &str| q.get(key).and_then(Value::as_str).unwrap_or("").to_ascii_lowercase();
    let supported = match text("quant_method").as_str() {
        "fp8" => q.get("weight_block_size").and_then(Value::as_array).is_none_or(|b| b.iter().all(|v| v.as_u64() == Some(128))),
        m if m.starts_with("modelopt") => text("quant_algo") == "nvfp4",
        "compressed-tensors" => {
            let nvfp4_group = |g: &Value| {
                let w = &g["weights"];
                w["num_bits"].as_u64() == Some(4) && w["type"].as_str() == Some("float") && w["group_size"].as_u64() == Some(16)
            };
            let groups = q.get("config_groups").and_then(Value::as_object);
            text("format") == "nvfp4-pack-quantized" || groups.is_some_and(|g| !g.is_empty() && g.values().all(nvfp4_group))
        }
        _ => false,
    };
    if !supported {
        return Err(Error::Unsupported(format!(
            "quantization_config {q} (supported: quant_method fp8 with 128x128 weight blocks; NVFP4 from modelopt or compressed-tensors nvfp4-pack-quantized)"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn qwen3() -> Value {
        json!({"model_type": "qwen3", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
               "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "eos_token_id": [1, 2]})
    }

    #[test]
    fn reads_qwen3_fields() {
        let c = ModelConfig::from_json(&qwen3()).unwrap();
        assert_eq!(c.arch, Architecture::Qwen3);
        assert_eq!((c.q_width(), c.kv_width()), (128, 64));
        assert_eq!(c.eos_token_ids, vec![1, 2]);
        assert!(c.qk_norm);
        assert_eq!(c.rope_theta, 1e6);
    }

    #[test]
    fn reads_rope_parameters_of_transformers_5() {
        let mut j = qwen3();
        j.as_object_mut().unwrap().remove("rope_theta");
        j["rope_parameters"] = json!({"rope_type": "default", "rope_theta": 5000.0});
        assert_eq!(ModelConfig::from_json(&j).unwrap().rope_theta, 5000.0);
    }

    #[test]
    fn fp8_blocks_and_nvfp4_are_accepted_other_quantizations_refused() {
        let mut j = qwen3();
        j["quantization_config"] = json!({"quant_method": "fp8", "weight_block_size": [128, 128]});
        assert!(ModelConfig::from_json(&j).is_ok());
        j["quantization_config"] = json!({"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": ["lm_head"]});
        assert!(ModelConfig::from_json(&j).is_ok());
        j["quantization_config"] = json!({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"});
        assert!(ModelConfig::from_json(&j).is_ok());
        let group = json!({"weights": {"num_bits": 4, "type": "float", "group_size": 16}, "targets": ["Linear"]});
        j["quantization_config"] = json!({"quant_method": "compressed-tensors", "format": "mixed-precision", "config_groups": {"group_0": group}});
        assert!(ModelConfig::from_json(&j).is_ok());
        j["quantization_config"] = json!({"quant_method": "modelopt", "quant_algo": "FP8"});
        assert!(ModelConfig::from_json(&j).is_err());
        j["quantization_config"] = json!({"quant_method": "gptq", "bits": 4});
        assert!(matches!(ModelConfig::from_json(&j), Err(Error::Unsupported(m)) if m.contains("gptq")));
        j["quantization_config"] = json!({"quant_method": "fp8", "weight_block_size": [64, 64]});
        assert!(ModelConfig::from_json(&j).is_err());
    }

    #[test]
    fn rejects_unknown_architecture_and_bad_gqa() {
        let mut j = qwen3();
        j["model_type"] = json!("mamba");
        assert!(matches!(ModelConfig::from_json(&j), Err(Error::Unsupported(_))));
        let mut j = qwen3();
        j["num_key_value_heads"] = json!(3);
        assert!(ModelConfig::from_json(&j).is_err());
    }

    #[test]
    fn every_size_is_limited_and_the_error_names_key_and_limit() {
        let limits = [
            ("num_hidden_layers", MAX_LAYERS),
            ("hidden_size", MAX_HIDDEN_SIZE),
            ("intermediate_size", MAX_INTERMEDIATE_SIZE),
            ("num_attention_heads", MAX_HEADS),
            ("head_dim", MAX_HEAD_DIM),
            ("vocab_size", MAX_VOCAB_SIZE),
            ("max_position_embeddings", MAX_POSITIONS),
        ];
        for (key, max) in limits {
            let mut j = qwen3();
            j[key] = json!(max);
            assert!(ModelConfig::from_json(&j).is_ok(), "{key} = {max} is within the limit");
            // Two above, so head_dim stays even and the head count a multiple of the KV heads.
            j[key] = json!(max + 2);
            let err = ModelConfig::from_json(&j).unwrap_err().to_string();
            assert!(err.contains(key) && err.contains(&max.to_string()), "{key}: {err}");
        }
        let mut j = qwen3();
        j["num_hidden_layers"] = json!(1_000_000_000_000u64);
        let err = ModelConfig::from_json(&j).unwrap_err().to_string();
        assert!(err.contains("num_hidden_layers = 1000000000000") && err.contains("1..=1024"), "{err}");
        j["num_hidden_layers"] = json!(u64::MAX);
        assert!(ModelConfig::from_json(&j).is_err());
    }

    #[test]
    fn zero_positions_and_hand_built_kv_heads_are_refused() {
        let mut j = qwen3();
        j["max_position_embeddings"] = json!(0);
        let err = ModelConfig::from_json(&j).unwrap_err().to_string();
        assert!(err.contains("max_position_embeddings = 0"), "{err}");
        // A config built in code skips from_json's head checks; validate still bounds the KV width.
        let mut c = ModelConfig::from_json(&qwen3()).unwrap();
        c.num_kv_heads = MAX_HEADS + 1;
        let err = c.validate().unwrap_err().to_string();
        assert!(err.contains("num_key_value_heads") && err.contains(&MAX_HEADS.to_string()), "{err}");
    }

    #[test]
    fn gguf_validation_names_gguf_keys() {
        let mut c = ModelConfig::from_json(&qwen3()).unwrap();
        c.num_layers = 1 << 40;
        let err = c.validate_gguf("qwen3").unwrap_err().to_string();
        assert!(err.contains("qwen3.block_count") && err.contains("1..=1024"), "{err}");
        c.num_layers = 2;
        c.max_position_embeddings = MAX_POSITIONS + 1;
        assert!(c.validate_gguf("qwen3").unwrap_err().to_string().contains("qwen3.context_length"));
    }
}
