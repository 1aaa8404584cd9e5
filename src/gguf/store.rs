//! A GGUF model file as a [`WeightSource`] under Hugging Face tensor names, plus the model config,
//! chat template and special tokens from its metadata.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

use super::reader::{GgmlType, GgufFile, MetaValue, TensorInfo};
use crate::model::config::{Architecture, ModelConfig, RopeScaling, MAX_VOCAB_SIZE};
use crate::model::weights::WeightSource;
use crate::quant::{DType, DenseMatrix, GgmlFormat, GgmlMatrix, QuantMatrix};
use crate::{Error, Result};

/// Per-layer GGUF tensor names (after `blk.N.`) and their Hugging Face names (after `model.layers.N.`).
const LAYER_NAMES: &[(&str, &str)] = &[
    ("attn_norm", "input_layernorm"),
    ("attn_q", "self_attn.q_proj"),
    ("attn_k", "self_attn.k_proj"),
    ("attn_v", "self_attn.v_proj"),
    ("attn_output", "self_attn.o_proj"),
    ("attn_q_norm", "self_attn.q_norm"),
    ("attn_k_norm", "self_attn.k_norm"),
    ("ffn_norm", "post_attention_layernorm"),
    ("ffn_gate", "mlp.gate_proj"),
    ("ffn_up", "mlp.up_proj"),
    ("ffn_down", "mlp.down_proj"),
];

/// The Hugging Face name of a GGUF tensor of a llama/qwen3 model, or `None` when it has none
/// (for example `rope_freqs.weight`).
pub fn hf_name(gguf: &str) -> Option<String> {
    match gguf {
        "token_embd.weight" => return Some("model.embed_tokens.weight".into()),
        "output.weight" => return Some("lm_head.weight".into()),
        "output_norm.weight" => return Some("model.norm.weight".into()),
        _ => {}
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    if layer.is_empty() || !layer.bytes().all(|b| b.is_ascii_digit()) || (layer.len() > 1 && layer.starts_with('0')) {
        return None;
    }
    let (base, suffix) = rest.rsplit_once('.')?;
    if suffix != "weight" && suffix != "bias" {
        return None;
    }
    let (_, hf) = LAYER_NAMES.iter().find(|(g, _)| *g == base)?;
    Some(format!("model.layers.{layer}.{hf}.{suffix}"))
}

/// Undoes llama.cpp's q/k row permutation (convert_hf_to_gguf.py `LlamaModel.permute`).
///
/// Hugging Face Llama rotates the pairs (i, i + head_dim/2) of each head; llama.cpp rotates adjacent
/// pairs (2i, 2i+1), so its converter reorders the rows of every head from `[2, head_dim/2]` to
/// `[head_dim/2, 2]`: GGUF row `h*hd + 2*j + i` holds Hugging Face row `h*hd + i*hd/2 + j`.
/// Returns, for each Hugging Face row, the GGUF row it is read from.
pub fn unpermute_rows(rows: usize, n_heads: usize) -> Option<Vec<usize>> {
    if n_heads == 0 || rows % n_heads != 0 || (rows / n_heads) % 2 != 0 {
        return None;
    }
    let head_dim = rows / n_heads;
    let half = head_dim / 2;
    let mut src = Vec::with_capacity(rows);
    for h in 0..n_heads {
        for i in 0..2 {
            for j in 0..half {
                src.push(h * head_dim + 2 * j + i);
            }
        }
    }
    Some(src)
}

/// Special token strings named by the tokenizer metadata.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
}

pub struct GgufStore {
    file: GgufFile,
    arch: Architecture,
    /// Hugging Face name (or the GGUF name, for tensors without one) -> index in the tensor table.
    names: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufStore").field("file", &self.file).field("arch", &self.arch).finish()
    }
}

impl GgufStore {
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        Self::from_file(GgufFile::open(path)?)
    }

    /// Wraps a parsed file; errors unless `general.architecture` is `llama` or `qwen3`.
    pub fn from_file(file: GgufFile) -> Result<Self> {
        let arch = match file.get_str("general.architecture")? {
            Some("llama") => Architecture::Llama,
            Some("qwen3") => Architecture::Qwen3,
            Some(other) => {
                return Err(Error::Unsupported(format!(
                    "{}: GGUF architecture {other:?} (supported: llama, qwen3)",
                    file.path().display()
                )))
            }
            None => return Err(Error::bad_file(file.path(), "no general.architecture in the GGUF metadata")),
        };
        let mut names = HashMap::with_capacity(file.tensors().len());
        for (i, t) in file.tensors().iter().enumerate() {
            let name = hf_name(&t.name).unwrap_or_else(|| t.name.clone());
            if names.insert(name.clone(), i).is_some() {
                return Err(Error::bad_file(file.path(), format!("two tensors map to the name {name}")));
            }
        }
        Ok(GgufStore { file, arch, names })
    }

    pub fn file(&self) -> &GgufFile {
        &self.file
    }

    pub fn architecture(&self) -> Architecture {
        self.arch
    }

    /// (name, type, element count, bytes) of every tensor, under the names `matrix`/`vector` take.
    pub fn summary(&self) -> Vec<(&str, String, usize, usize)> {
        let mut out: Vec<_> = self
            .names
            .iter()
            .map(|(name, &i)| {
                let t = &self.file.tensors()[i];
                (name.as_str(), t.ggml_type.name().to_string(), t.n_elements() as usize, t.size as usize)
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(b.0));
        out
    }

    fn key(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.arch.name())
    }

    fn entry(&self, name: &str) -> Result<&TensorInfo> {
        self.names
            .get(name)
            .map(|&i| &self.file.tensors()[i])
            .ok_or_else(|| Error::bad_tensor(name, format!("missing from {}", self.file.path().display())))
    }

    /// A per-layer count that GGUF may store either as one number or as one per layer.
    fn uniform_count(&self, suffix: &str) -> Result<Option<u64>> {
        let key = self.key(suffix);
        match self.file.get(&key) {
            None => Ok(None),
            Some(MetaValue::Array(a)) => {
                let first = a.int_at(0);
                let all_same = (0..a.len()).all(|i| a.int_at(i).is_some() && a.int_at(i) == first);
                match first {
                    Some(v) if all_same && v >= 0 => Ok(Some(v as u64)),
                    _ => {
                        Err(Error::Unsupported(format!("{}: {key} differs between layers", self.file.path().display())))
                    }
                }
            }
            Some(_) => self.file.get_u64(&key),
        }
    }

    fn required(&self, suffix: &str) -> Result<usize> {
        let key = self.key(suffix);
        match self.uniform_count(suffix)? {
            None => Err(Error::bad_file(self.file.path(), format!("no {key} in the GGUF metadata"))),
            Some(0) => Err(Error::bad_file(self.file.path(), format!("{key} is zero"))),
            Some(v) => {
                usize::try_from(v).map_err(|_| Error::bad_file(self.file.path(), format!("{key} = {v} is too large")))
            }
        }
    }

    fn heads(&self) -> Result<(usize, usize)> {
        let n_head = self.required("attention.head_count")?;
        let n_kv = match self.uniform_count("attention.head_count_kv")? {
            None | Some(0) => n_head,
            Some(v) => usize::try_from(v).unwrap_or(usize::MAX),
        };
        if n_head % n_kv != 0 {
            return Err(Error::bad_file(
                self.file.path(),
                format!(
                    "{} {n_head} is not a multiple of {} {n_kv}",
                    self.key("attention.head_count"),
                    self.key("attention.head_count_kv")
                ),
            ));
        }
        Ok((n_head, n_kv))
    }

    /// For llama q/k projections: the source row of each Hugging Face row.
    fn row_permutation(&self, name: &str, rows: usize) -> Result<Option<Vec<usize>>> {
        if self.arch != Architecture::Llama {
            return Ok(None);
        }
        let is = |proj: &str| {
            name.ends_with(&format!(".self_attn.{proj}.weight")) || name.ends_with(&format!(".self_attn.{proj}.bias"))
        };
        let heads = if is("q_proj") {
            self.heads()?.0
        } else if is("k_proj") {
            self.heads()?.1
        } else {
            return Ok(None);
        };
        unpermute_rows(rows, heads).map(Some).ok_or_else(|| {
            Error::bad_tensor(name, format!("{rows} rows cannot be split into {heads} heads of even size"))
        })
    }

    fn check_dims(&self, name: &str, t: &TensorInfo, want: &[usize]) -> Result<()> {
        // ggml lists dimensions innermost first; trailing 1s are insignificant.
        let mut dims: Vec<u64> = t.dims.clone();
        while dims.len() > want.len() && dims.last() == Some(&1) {
            dims.pop();
        }
        if want.contains(&0) {
            return Err(Error::bad_tensor(name, format!("requested with an empty shape {want:?}")));
        }
        let want_dims: Vec<u64> = want.iter().rev().map(|&d| d as u64).collect();
        if dims != want_dims {
            return Err(Error::bad_tensor(
                name,
                format!(
                    "shape {:?} (GGUF tensor {} in {}), expected {want:?}",
                    t.shape(),
                    t.name,
                    self.file.path().display()
                ),
            ));
        }
        Ok(())
    }

    /// Decodes `rows` rows of `cols` from `bytes` in the tensor's type, reordered by `perm`.
    fn build(
        &self,
        name: &str,
        t: &TensorInfo,
        rows: usize,
        cols: usize,
        perm: Option<&[usize]>,
    ) -> Result<Box<dyn QuantMatrix>> {
        let raw = self.file.tensor_data(t);
        let bytes: Cow<[u8]> = match perm {
            None => Cow::Borrowed(raw),
            Some(p) => {
                // Each row is independent (whole blocks), so reordering rows reorders byte ranges.
                let row_bytes = raw.len() / rows.max(1);
                let mut out = Vec::with_capacity(raw.len());
                for &src in p {
                    out.extend_from_slice(&raw[src * row_bytes..(src + 1) * row_bytes]);
                }
                Cow::Owned(out)
            }
        };
        let ty = t.ggml_type;
        if ty == GgmlType::F32 || ty == GgmlType::F16 || ty == GgmlType::BF16 {
            let dtype = match ty {
                GgmlType::F32 => DType::F32,
                GgmlType::F16 => DType::F16,
                _ => DType::BF16,
            };
            return Ok(Box::new(DenseMatrix::from_le_bytes(rows, cols, dtype, &bytes)));
        }
        let format = GgmlFormat::from_ggml_type(ty.id()).ok_or_else(|| {
            Error::bad_tensor(
                name,
                format!(
                    "ggml type {ty} of GGUF tensor {} is not supported (f32, f16, bf16, q8_0, q4_0, q4_1, q4_k, q5_k, q6_k)",
                    t.name
                ),
            )
        })?;
        let m = GgmlMatrix::new(format, rows, cols, bytes.into_owned())
            .map_err(|e| Error::bad_tensor(name, e.to_string()))?;
        Ok(Box::new(m))
    }

    /// `tokenizer.chat_template`.
    pub fn chat_template(&self) -> Option<String> {
        self.file.get("tokenizer.chat_template").and_then(MetaValue::as_str).map(str::to_string)
    }

    fn token_string(&self, id_key: &str) -> Option<String> {
        let id = self.file.get(id_key)?.as_u64()?;
        let tokens = self.file.get("tokenizer.ggml.tokens")?.as_strings()?;
        tokens.get(usize::try_from(id).ok()?).cloned()
    }

    /// The BOS and EOS token strings (`tokenizer.ggml.bos_token_id` / `eos_token_id` looked up in
    /// `tokenizer.ggml.tokens`).
    pub fn special_tokens(&self) -> SpecialTokens {
        SpecialTokens {
            bos_token: self.token_string("tokenizer.ggml.bos_token_id"),
            eos_token: self.token_string("tokenizer.ggml.eos_token_id"),
        }
    }

    /// A Hugging Face `tokenizers` tokenizer built from the file's `tokenizer.ggml.*` metadata.
    pub fn tokenizer(&self) -> Result<tokenizers::Tokenizer> {
        let key = "tokenizer.ggml.tokens";
        let count = self.file.get(key).and_then(MetaValue::as_array).map_or(0, |a| a.len());
        if count > MAX_VOCAB_SIZE {
            return Err(Error::bad_file(
                self.file.path(),
                format!("{key} holds {count} tokens, more than the limit of {MAX_VOCAB_SIZE}"),
            ));
        }
        super::tokenizer::build(&self.file)
    }

    /// The model configuration from `{arch}.*` metadata and the tensor table.
    pub fn config(&self) -> Result<ModelConfig> {
        let path = self.file.path();
        let bad = |reason: String| Error::bad_file(path, reason);
        let hidden_size = self.required("embedding_length")?;
        let intermediate_size = self.required("feed_forward_length")?;
        let num_layers = self.required("block_count")?;
        let (num_heads, num_kv_heads) = self.heads()?;
        let head_dim = match self.uniform_count("attention.key_length")? {
            Some(d) => saturating_usize(d),
            None => hidden_size / num_heads,
        };
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(bad(format!("head dimension {head_dim} must be even and non-zero")));
        }
        if let Some(v) = self.uniform_count("attention.value_length")? {
            if v as usize != head_dim {
                return Err(Error::Unsupported(format!(
                    "{}: attention.value_length {v} differs from attention.key_length {head_dim}",
                    path.display()
                )));
            }
        }
        if let Some(r) = self.file.get_u64(&self.key("rope.dimension_count"))? {
            if r as usize != head_dim {
                return Err(Error::Unsupported(format!(
                    "{}: rope.dimension_count {r} differs from the head dimension {head_dim} (partial rotary)",
                    path.display()
                )));
            }
        }
        let max_position_embeddings = self.file.get_u64(&self.key("context_length"))?.map_or(4096, saturating_usize);
        let rms_norm_eps = self.file.get_f64(&self.key("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-6) as f32;
        let rope_theta = self.file.get_f64(&self.key("rope.freq_base"))?.unwrap_or(10_000.0) as f32;
        let rope_scaling = self.rope_scaling(rope_theta, head_dim)?;

        let embd = self.entry("model.embed_tokens.weight")?;
        let embd_shape_error = || {
            Error::bad_tensor(
                "model.embed_tokens.weight",
                format!("shape {:?} in {}, expected [vocab, {hidden_size}]", embd.shape(), path.display()),
            )
        };
        let vocab_size = match embd.dims[..] {
            [_, vocab] => saturating_usize(vocab),
            _ => return Err(embd_shape_error()),
        };

        let id = |key: &str| -> Result<Option<u32>> {
            match self.file.get_u64(key)? {
                None => Ok(None),
                Some(v) => u32::try_from(v).map(Some).map_err(|_| bad(format!("{key} = {v} is not a token id"))),
            }
        };
        let mut eos_token_ids = Vec::new();
        for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
            if let Some(v) = id(key)? {
                if !eos_token_ids.contains(&v) {
                    eos_token_ids.push(v);
                }
            }
        }

        let config = ModelConfig {
            arch: self.arch,
            vocab_size,
            hidden_size,
            intermediate_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            max_position_embeddings,
            rms_norm_eps,
            rope_theta,
            rope_scaling,
            tie_word_embeddings: !self.contains("lm_head.weight"),
            attention_bias: self.contains("model.layers.0.self_attn.q_proj.bias"),
            mlp_bias: self.contains("model.layers.0.mlp.up_proj.bias"),
            qk_norm: self.arch == Architecture::Qwen3,
            rotary_dim: head_dim,
            moe: None,
            hybrid: None,
            bos_token_id: id("tokenizer.ggml.bos_token_id")?,
            eos_token_ids,
        };
        config.validate_gguf().map_err(|e| match e {
            Error::InvalidArgument(reason) => bad(reason),
            other => other,
        })?;
        // After the limits, so an absurd embedding_length is reported as such, not as a shape.
        if embd.dims[0] != hidden_size as u64 {
            return Err(embd_shape_error());
        }
        Ok(config)
    }

    /// `{arch}.rope.scaling.*`, or Llama 3 scaling recognised from a `rope_freqs.weight` tensor.
    fn rope_scaling(&self, theta: f32, head_dim: usize) -> Result<RopeScaling> {
        let path = self.file.path();
        let kind = self.file.get_str(&self.key("rope.scaling.type"))?;
        let factor = self.file.get_f64(&self.key("rope.scaling.factor"))?;
        let scaling = match (kind, factor) {
            (None | Some("none"), _) => match self.file.get_f64(&self.key("rope.scale_linear"))? {
                Some(f) if f != 1.0 => RopeScaling::Linear { factor: f as f32 },
                _ => RopeScaling::None,
            },
            (Some("linear"), Some(f)) => RopeScaling::Linear { factor: f as f32 },
            (Some(other), _) => {
                return Err(Error::Unsupported(format!("{}: rope scaling {other:?}", path.display())));
            }
        };
        if !self.contains("rope_freqs.weight") {
            return Ok(scaling);
        }
        if scaling != RopeScaling::None {
            return Err(Error::Unsupported(format!(
                "{}: rope_freqs.weight together with rope scaling {scaling:?}",
                path.display()
            )));
        }
        let factors = self.vector("rope_freqs.weight", head_dim / 2)?;
        let original = self.file.get_u64(&self.key("rope.scaling.original_context_length"))?.unwrap_or(8192) as f32;
        llama3_from_factors(&factors, theta, head_dim, original).ok_or_else(|| {
            Error::Unsupported(format!(
                "{}: rope_freqs.weight does not match Llama 3 frequency scaling (low 1, high 4, original context {original})",
                path.display()
            ))
        })
    }
}

/// A count from the file as usize; one too large for this platform saturates, so the config limits
/// refuse it rather than a truncated value passing them.
fn saturating_usize(v: u64) -> usize {
    usize::try_from(v).unwrap_or(usize::MAX)
}

/// Recognises the per-frequency divisors llama.cpp's converter writes for Llama 3 rope scaling and
/// returns the scaling they came from (factor = the largest divisor; low/high = 1/4, as Meta ships).
fn llama3_from_factors(factors: &[f32], theta: f32, head_dim: usize, original: f32) -> Option<RopeScaling> {
    let factor = factors.iter().copied().fold(f32::NAN, f32::max);
    if !(factor.is_finite() && factor >= 1.0) {
        return None;
    }
    let (low, high) = (1.0f64, 4.0f64);
    let (low_wavelen, high_wavelen) = (original as f64 / low, original as f64 / high);
    for (i, &got) in factors.iter().enumerate() {
        let freq = 1.0 / (theta as f64).powf(2.0 * i as f64 / head_dim as f64);
        let wavelen = 2.0 * std::f64::consts::PI / freq;
        let want = if wavelen < high_wavelen {
            1.0
        } else if wavelen > low_wavelen {
            factor as f64
        } else {
            let smooth = (original as f64 / wavelen - low) / (high - low);
            1.0 / ((1.0 - smooth) / factor as f64 + smooth)
        };
        if ((got as f64) - want).abs() > 1e-3 * want {
            return None;
        }
    }
    Some(RopeScaling::Llama3 { factor, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position: original })
}

impl WeightSource for GgufStore {
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Box<dyn QuantMatrix>> {
        let t = self.entry(name)?;
        self.check_dims(name, t, &[rows, cols])?;
        let perm = self.row_permutation(name, rows)?;
        self.build(name, t, rows, cols, perm.as_deref())
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let t = self.entry(name)?;
        self.check_dims(name, t, &[len])?;
        // A bias of a permuted projection is permuted like its rows: one element per row.
        let perm = self.row_permutation(name, len)?;
        let m = self.build(name, t, 1, len, None)?;
        let mut v = vec![0f32; len];
        m.dequant_row(0, &mut v);
        Ok(match perm {
            None => v,
            Some(p) => p.iter().map(|&src| v[src]).collect(),
        })
    }

    fn contains(&self, name: &str) -> bool {
        self.names.contains_key(name)
    }

    fn tensor_count(&self) -> usize {
        self.file.tensors().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_names() {
        assert_eq!(hf_name("token_embd.weight").as_deref(), Some("model.embed_tokens.weight"));
        assert_eq!(hf_name("blk.12.attn_q.bias").as_deref(), Some("model.layers.12.self_attn.q_proj.bias"));
        assert_eq!(hf_name("blk.0.ffn_norm.weight").as_deref(), Some("model.layers.0.post_attention_layernorm.weight"));
        assert_eq!(hf_name("blk.3.attn_k_norm.weight").as_deref(), Some("model.layers.3.self_attn.k_norm.weight"));
        assert_eq!(hf_name("blk.x.attn_q.weight"), None);
        assert_eq!(hf_name("blk.01.attn_q.weight"), None);
        assert_eq!(hf_name("rope_freqs.weight"), None);
    }

    /// llama.cpp's `permute`: `w.reshape(n_head, 2, hd/2, K).swapaxes(1, 2).reshape(w.shape)`, i.e.
    /// out[h, j, i] = w[h, i, j] over rows.
    fn llama_cpp_permute(rows: &[u32], n_head: usize) -> Vec<u32> {
        let hd = rows.len() / n_head;
        let half = hd / 2;
        let mut out = vec![0; rows.len()];
        for h in 0..n_head {
            for j in 0..half {
                for i in 0..2 {
                    out[h * hd + j * 2 + i] = rows[h * hd + i * half + j];
                }
            }
        }
        out
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        for (n_head, hd) in [(1, 2), (3, 8), (9, 64), (4, 128)] {
            let hf: Vec<u32> = (0..(n_head * hd) as u32).collect();
            let gguf = llama_cpp_permute(&hf, n_head);
            if hd > 2 {
                assert_ne!(gguf, hf, "permute must move rows for head_dim {hd}");
            }
            let src = unpermute_rows(hf.len(), n_head).unwrap();
            let back: Vec<u32> = src.iter().map(|&s| gguf[s]).collect();
            assert_eq!(back, hf, "n_head {n_head} head_dim {hd}");
        }
        assert!(unpermute_rows(10, 3).is_none());
        assert!(unpermute_rows(9, 3).is_none());
    }

    #[test]
    fn unpermuted_rows_give_rotate_half_rope_the_same_result_as_interleaved_rope() {
        // q = W x per head; rotating GGUF rows as adjacent pairs must equal rotating HF rows as halves.
        let (n_head, hd) = (2, 8);
        let hf: Vec<f32> = (0..n_head * hd).map(|i| (i as f32 * 0.7).sin()).collect();
        let gguf: Vec<f32> = {
            let idx: Vec<u32> = (0..hf.len() as u32).collect();
            llama_cpp_permute(&idx, n_head).iter().map(|&i| hf[i as usize]).collect()
        };
        let src = unpermute_rows(hf.len(), n_head).unwrap();
        let restored: Vec<f32> = src.iter().map(|&s| gguf[s]).collect();
        let angle = |i: usize| 0.3 * (i as f32 + 1.0);
        let mut interleaved = gguf.clone();
        let mut halves = restored.clone();
        for h in 0..n_head {
            for i in 0..hd / 2 {
                let (c, s) = (angle(i).cos(), angle(i).sin());
                let (a, b) = (interleaved[h * hd + 2 * i], interleaved[h * hd + 2 * i + 1]);
                interleaved[h * hd + 2 * i] = a * c - b * s;
                interleaved[h * hd + 2 * i + 1] = b * c + a * s;
                let (a, b) = (halves[h * hd + i], halves[h * hd + i + hd / 2]);
                halves[h * hd + i] = a * c - b * s;
                halves[h * hd + i + hd / 2] = b * c + a * s;
            }
        }
        // Same rotated values, laid out in each convention's order.
        let relaid: Vec<f32> = src.iter().map(|&s| interleaved[s]).collect();
        assert_eq!(relaid, halves);
    }

    #[test]
    fn recognises_llama3_factors() {
        let (theta, hd, orig, factor) = (500_000f32, 128usize, 8192f32, 8f32);
        let factors: Vec<f32> = (0..hd / 2)
            .map(|i| {
                let freq = 1.0 / (theta as f64).powf(2.0 * i as f64 / hd as f64);
                let wavelen = 2.0 * std::f64::consts::PI / freq;
                let (lw, hw) = (orig as f64, orig as f64 / 4.0);
                (if wavelen < hw {
                    1.0
                } else if wavelen > lw {
                    factor as f64
                } else {
                    let s = (orig as f64 / wavelen - 1.0) / 3.0;
                    1.0 / ((1.0 - s) / factor as f64 + s)
                }) as f32
            })
            .collect();
        assert_eq!(
            llama3_from_factors(&factors, theta, hd, orig),
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position: orig
            })
        );
        let mut off = factors.clone();
        off[40] *= 1.1;
        assert_eq!(llama3_from_factors(&off, theta, hd, orig), None);
    }
}
