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
pub const MAX_HIDDEN_SIZE: usize = 1 << 16;
pub const MAX_INTERMEDIATE_SIZE: usize = 1 << 20;
pub const MAX_HEADS: usize = 1024;
pub const MAX_HEAD_DIM: usize = 1024;
pub const MAX_VOCAB_SIZE: usize = 1 << 22;
pub const MAX_POSITIONS: usize = 1 << 24;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Qwen3,
}

impl Architecture {
    pub fn name(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen3 => "qwen3",
        }
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

    pub fn from_json(json: &Value) -> Result<Self> {
        let model_type = json.get("model_type").and_then(Value::as_str).unwrap_or("");
        let arch = match model_type {
            "qwen3" => Architecture::Qwen3,
            "llama" => Architecture::Llama,
            "" => return Err(Error::InvalidArgument("config.json has no model_type".into())),
            other => {
                return Err(Error::Unsupported(format!(
                    "model_type {other:?} (supported: qwen3, llama)"
                )))
            }
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
            let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("");
            let block = q.get("weight_block_size").and_then(Value::as_array);
            let block_ok = block.map_or(true, |b| b.iter().all(|v| v.as_u64() == Some(128)));
            if method != "fp8" || !block_ok {
                return Err(Error::Unsupported(format!(
                    "quantization_config {q} (supported: quant_method fp8 with 128x128 weight blocks)"
                )));
            }
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
        let eos_token_ids = token_ids(json.get("eos_token_id"), "eos_token_id")?;
        let bos_token_id = token_ids(json.get("bos_token_id"), "bos_token_id")?.first().copied();

        let config = ModelConfig {
            arch,
            vocab_size: req_usize(json, "vocab_size")?,
            hidden_size,
            intermediate_size: req_usize(json, "intermediate_size")?,
            num_layers: req_usize(json, "num_hidden_layers")?,
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
            qk_norm: arch == Architecture::Qwen3,
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

    /// [`Self::validate`], naming each size by its GGUF metadata key.
    pub fn validate_gguf(&self) -> Result<()> {
        self.check_sizes(|s| format!("{}.{}", self.arch.name(), s.gguf))
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
}

/// One size a config declares: its config.json key, its GGUF key (after `{arch}.`), its value and
/// its limit.
struct Size {
    json: &'static str,
    gguf: &'static str,
    value: usize,
    max: usize,
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
    fn fp8_block_quantization_is_accepted_others_are_refused() {
        let mut j = qwen3();
        j["quantization_config"] = json!({"quant_method": "fp8", "weight_block_size": [128, 128]});
        assert!(ModelConfig::from_json(&j).is_ok());
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
        let err = c.validate_gguf().unwrap_err().to_string();
        assert!(err.contains("qwen3.block_count") && err.contains("1..=1024"), "{err}");
        c.num_layers = 2;
        c.max_position_embeddings = MAX_POSITIONS + 1;
        assert!(c.validate_gguf().unwrap_err().to_string().contains("qwen3.context_length"));
    }
}
