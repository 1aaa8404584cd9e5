//! A GGUF model file as a [`WeightSource`] under Hugging Face tensor names, plus the model config,
//! chat template and special tokens from its metadata.
//!
//! llama.cpp's converter (convert_hf_to_gguf.py) renames every tensor and changes some of them; the
//! store undoes each change, so a tensor reads as it is in the Hugging Face checkpoint
//! (tests/fixtures/HYBRID_NOTES.md, section "GGUF", cites the converter for each):
//! * llama: the q/k rows of each head are reordered for llama.cpp's interleaved rotary.
//! * qwen35, qwen35moe: zero-centred RMSNorm weights are stored as 1 + w; `A_log` as
//!   `ssm_a = -exp(A_log)`; and the Gated DeltaNet's value heads are reordered from grouped by key
//!   head to tiled (ggml broadcasts key heads that way) in `in_proj_qkv`'s v rows, `in_proj_z`,
//!   `in_proj_b`, `in_proj_a`, the conv1d's v channels, `A_log`, `dt_bias` and `out_proj`'s columns.
//! * qwen3moe, qwen35moe: the experts of a layer are stacked into `ffn_{gate,up,down}_exps` (or
//!   `ffn_gate_up_exps`), read as transformers 5's fused `experts.gate_up_proj` / `experts.down_proj`.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::Path;

use super::reader::{GgmlType, GgufFile, MetaArray, MetaValue, TensorInfo};
use crate::model::config::{
    Architecture, HybridConfig, LayerKind, ModelConfig, MoeConfig, RopeScaling, MAX_LAYERS, MAX_VOCAB_SIZE,
};
use crate::model::weights::WeightSource;
use crate::quant::{DType, DenseData, DenseMatrix, GgmlFormat, GgmlMatrix, QuantMatrix};
use crate::{Error, Result};

/// Per-layer GGUF tensor names (after `blk.N.`) and their Hugging Face names (after
/// `model.layers.N.`), as the supported architectures use them.
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
    // Qwen3.5 calls its second norm post_attention_norm (llama.cpp's ATTN_POST_NORM).
    ("post_attention_norm", "post_attention_layernorm"),
    ("attn_qkv", "linear_attn.in_proj_qkv"),
    ("attn_gate", "linear_attn.in_proj_z"),
    ("ssm_beta", "linear_attn.in_proj_b"),
    ("ssm_alpha", "linear_attn.in_proj_a"),
    ("ssm_conv1d", "linear_attn.conv1d"),
    ("ssm_norm", "linear_attn.norm"),
    ("ssm_out", "linear_attn.out_proj"),
    ("ffn_gate_inp", "mlp.gate"),
    ("ffn_gate_shexp", "mlp.shared_expert.gate_proj"),
    ("ffn_up_shexp", "mlp.shared_expert.up_proj"),
    ("ffn_down_shexp", "mlp.shared_expert.down_proj"),
    ("ffn_gate_inp_shexp", "mlp.shared_expert_gate"),
];

/// The decoder layer index of a `blk.N.` name and what follows it.
fn split_layer(gguf: &str) -> Option<(&str, &str)> {
    let (layer, rest) = gguf.strip_prefix("blk.")?.split_once('.')?;
    if layer.is_empty() || !layer.bytes().all(|b| b.is_ascii_digit()) || (layer.len() > 1 && layer.starts_with('0')) {
        return None;
    }
    Some((layer, rest))
}

/// The Hugging Face name of a GGUF tensor of a supported model, or `None` when it has none (for
/// example `rope_freqs.weight`) or is half of one (`ffn_gate_exps` and `ffn_up_exps` together
/// are `experts.gate_up_proj`).
pub fn hf_name(gguf: &str) -> Option<String> {
    match gguf {
        "token_embd.weight" => return Some("model.embed_tokens.weight".into()),
        "output.weight" => return Some("lm_head.weight".into()),
        "output_norm.weight" => return Some("model.norm.weight".into()),
        _ => {}
    }
    let (layer, rest) = split_layer(gguf)?;
    let hf = match rest {
        // llama.cpp names these as parameters, not as a layer's weight or bias.
        "ssm_a" => "linear_attn.A_log".to_string(),
        "ssm_dt.bias" => "linear_attn.dt_bias".to_string(),
        // transformers 5's stacked experts have no .weight suffix.
        "ffn_gate_up_exps.weight" => "mlp.experts.gate_up_proj".to_string(),
        "ffn_down_exps.weight" => "mlp.experts.down_proj".to_string(),
        _ => {
            let (base, suffix) = rest.rsplit_once('.')?;
            if suffix != "weight" && suffix != "bias" {
                return None;
            }
            let (_, hf) = LAYER_NAMES.iter().find(|(g, _)| *g == base)?;
            format!("{hf}.{suffix}")
        }
    };
    Some(format!("model.layers.{layer}.{hf}"))
}

/// For `blk.N.ffn_gate_exps.weight` / `blk.N.ffn_up_exps.weight`: N, and whether it is the up half.
fn expert_half(gguf: &str) -> Option<(&str, bool)> {
    match split_layer(gguf)? {
        (layer, "ffn_gate_exps.weight") => Some((layer, false)),
        (layer, "ffn_up_exps.weight") => Some((layer, true)),
        _ => None,
    }
}

/// Undoes llama.cpp's q/k row permutation (convert_hf_to_gguf.py `LlamaModel.permute`).
///
/// Hugging Face Llama rotates the pairs (i, i + head_dim/2) of each head; llama.cpp rotates adjacent
/// pairs (2i, 2i+1), so its converter reorders the rows of every head from `[2, head_dim/2]` to
/// `[head_dim/2, 2]`: GGUF row `h*hd + 2*j + i` holds Hugging Face row `h*hd + i*hd/2 + j`.
/// Returns, for each Hugging Face row, the GGUF row it is read from.
pub fn unpermute_rows(rows: usize, n_heads: usize) -> Option<Vec<usize>> {
    if n_heads == 0 || !rows.is_multiple_of(n_heads) || !(rows / n_heads).is_multiple_of(2) {
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

/// Undoes the value-head reordering of llama.cpp's Qwen3.5 converter
/// (`_LinearAttentionVReorderBase._reorder_v_heads`): Hugging Face groups the value heads by the
/// key head they read (`[k0: v0..v(r-1), k1: ...]`, r = value_heads / key_heads), the GGUF tiles
/// them (`[v0 of k0, v0 of k1, ..., v1 of k0, ...]`), so GGUF head `j * key_heads + g` holds
/// Hugging Face head `g * r + j`. Returns, for each Hugging Face head, the GGUF head it is read from.
pub fn untile_value_heads(key_heads: usize, value_heads: usize) -> Option<Vec<usize>> {
    if key_heads == 0 || !value_heads.is_multiple_of(key_heads) {
        return None;
    }
    let per_key = value_heads / key_heads;
    Some((0..value_heads).map(|h| (h % per_key) * key_heads + h / per_key).collect())
}

/// Special token strings named by the tokenizer metadata.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
}

/// Where a Hugging Face tensor comes from.
#[derive(Debug, Clone, Copy)]
enum Source {
    /// One tensor of the file (its index in the tensor table).
    Tensor(usize),
    /// `experts.gate_up_proj` of a file that stores its halves apart: `ffn_gate_exps` holds rows
    /// `[0, I)` of every expert, `ffn_up_exps` rows `[I, 2I)`.
    GateUp { gate: usize, up: usize },
}

/// The Gated DeltaNet's heads, from `{arch}.ssm.*` (named after Mamba's hyperparameters).
#[derive(Debug, Clone, Copy)]
struct DeltaHeads {
    conv_kernel: usize,
    key_heads: usize,
    key_dim: usize,
    value_heads: usize,
    value_dim: usize,
}

/// A row or column order to restore: `groups[k]` is the source group of group k, each `size`
/// consecutive rows (or columns) after the first `fixed`, which stay.
struct GroupOrder {
    fixed: usize,
    size: usize,
    groups: Vec<usize>,
}

impl GroupOrder {
    /// The source index of every index.
    fn expand(&self) -> Vec<usize> {
        let moved = self.groups.iter().flat_map(|&g| (0..self.size).map(move |i| self.fixed + g * self.size + i));
        (0..self.fixed).chain(moved).collect()
    }
}

pub struct GgufStore {
    file: GgufFile,
    arch: Architecture,
    /// `general.architecture`: llama.cpp's name, the prefix of the file's keys.
    gguf_arch: &'static str,
    /// Hugging Face name (or the GGUF name, for tensors without one) -> where it is read from.
    names: HashMap<String, Source>,
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

    /// Wraps a parsed file; errors unless `general.architecture` is one Atlas runs.
    pub fn from_file(file: GgufFile) -> Result<Self> {
        let (arch, gguf_arch) = match file.get_str("general.architecture")? {
            Some("llama") => (Architecture::Llama, "llama"),
            Some("qwen3") => (Architecture::Qwen3, "qwen3"),
            Some("qwen3moe") => (Architecture::Qwen3Moe, "qwen3moe"),
            Some("qwen35") => (Architecture::Qwen35, "qwen35"),
            Some("qwen35moe") => (Architecture::Qwen35Moe, "qwen35moe"),
            Some(other) => {
                return Err(Error::Unsupported(format!(
                    "{}: GGUF architecture {other:?} (supported: llama, qwen3, qwen3moe, qwen35, qwen35moe)",
                    file.path().display()
                )))
            }
            None => return Err(Error::bad_file(file.path(), "no general.architecture in the GGUF metadata")),
        };
        let mut names = HashMap::with_capacity(file.tensors().len());
        let mut insert = |name: String, source: Source| {
            if names.insert(name.clone(), source).is_some() {
                return Err(Error::bad_file(file.path(), format!("two tensors map to the name {name}")));
            }
            Ok(())
        };
        // Layer -> (ffn_gate_exps, ffn_up_exps).
        let mut halves: BTreeMap<&str, (Option<usize>, Option<usize>)> = BTreeMap::new();
        for (i, t) in file.tensors().iter().enumerate() {
            if let Some((layer, up)) = expert_half(&t.name) {
                let pair = halves.entry(layer).or_default();
                *(if up { &mut pair.1 } else { &mut pair.0 }) = Some(i);
                continue;
            }
            insert(hf_name(&t.name).unwrap_or_else(|| t.name.clone()), Source::Tensor(i))?;
        }
        for (layer, pair) in halves {
            let name = format!("model.layers.{layer}.mlp.experts.gate_up_proj");
            match pair {
                (Some(gate), Some(up)) => insert(name, Source::GateUp { gate, up })?,
                (gate, _) => {
                    let (have, lack) = if gate.is_some() { ("gate", "up") } else { ("up", "gate") };
                    return Err(Error::bad_file(
                        file.path(),
                        format!("blk.{layer}.ffn_{have}_exps.weight has no blk.{layer}.ffn_{lack}_exps.weight beside it"),
                    ));
                }
            }
        }
        Ok(GgufStore { file, arch, gguf_arch, names })
    }

    pub fn file(&self) -> &GgufFile {
        &self.file
    }

    pub fn architecture(&self) -> Architecture {
        self.arch
    }

    /// (name, type, element count, bytes) of every tensor, under the names `matrix`/`vector` take.
    pub fn summary(&self) -> Vec<(&str, String, usize, usize)> {
        let tensors = self.file.tensors();
        let mut out: Vec<_> = self
            .names
            .iter()
            .map(|(name, source)| match *source {
                Source::Tensor(i) => {
                    let t = &tensors[i];
                    (name.as_str(), t.ggml_type.name().to_string(), t.n_elements() as usize, t.size as usize)
                }
                Source::GateUp { gate, up } => {
                    let (g, u) = (&tensors[gate], &tensors[up]);
                    let ty = if g.ggml_type == u.ggml_type {
                        g.ggml_type.name().to_string()
                    } else {
                        format!("{}+{}", g.ggml_type.name(), u.ggml_type.name())
                    };
                    (name.as_str(), ty, (g.n_elements() + u.n_elements()) as usize, (g.size + u.size) as usize)
                }
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(b.0));
        out
    }

    fn key(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.gguf_arch)
    }

    fn is_qwen35(&self) -> bool {
        matches!(self.arch, Architecture::Qwen35 | Architecture::Qwen35Moe)
    }

    fn missing(&self, name: &str) -> Error {
        Error::bad_tensor(name, format!("missing from {}", self.file.path().display()))
    }

    /// The one file tensor behind `name`.
    fn entry(&self, name: &str) -> Result<&TensorInfo> {
        match self.names.get(name) {
            Some(&Source::Tensor(i)) => Ok(&self.file.tensors()[i]),
            Some(Source::GateUp { .. }) => Err(Error::bad_tensor(
                name,
                format!(
                    "{} stores it as two stacked tensors (ffn_gate_exps, ffn_up_exps): read it by expert",
                    self.file.path().display()
                ),
            )),
            None => Err(self.missing(name)),
        }
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

    /// The Gated DeltaNet's heads (qwen35, qwen35moe), as llama.cpp's qwen35 loader reads them:
    /// `ssm.group_count` key heads of `ssm.state_size`, `ssm.time_step_rank` value heads sharing
    /// `ssm.inner_size`.
    fn delta_heads(&self) -> Result<DeltaHeads> {
        let key_heads = self.required("ssm.group_count")?;
        let value_heads = self.required("ssm.time_step_rank")?;
        let inner = self.required("ssm.inner_size")?;
        let bad = |what: String| Err(Error::bad_file(self.file.path(), what));
        if value_heads % key_heads != 0 {
            return bad(format!(
                "{} {value_heads} is not a multiple of {} {key_heads}",
                self.key("ssm.time_step_rank"),
                self.key("ssm.group_count")
            ));
        }
        if inner % value_heads != 0 {
            return bad(format!(
                "{} {inner} is not a multiple of {} {value_heads}",
                self.key("ssm.inner_size"),
                self.key("ssm.time_step_rank")
            ));
        }
        Ok(DeltaHeads {
            conv_kernel: self.required("ssm.conv_kernel")?,
            key_heads,
            key_dim: self.required("ssm.state_size")?,
            value_heads,
            value_dim: inner / value_heads,
        })
    }

    /// The value-head order a Qwen3.5 tensor's `n` rows (or `out_proj`'s `n` columns) were written
    /// in, when the converter moved them; `None` when the order is Hugging Face's.
    fn value_head_order(&self, name: &str, n: usize, what: &str) -> Result<Option<GroupOrder>> {
        if !self.is_qwen35() || !name.contains(".linear_attn.") {
            return Ok(None);
        }
        let is = |suffix: &str| name.ends_with(suffix);
        let per_head_rows = is(".in_proj_b.weight") || is(".in_proj_a.weight") || is(".A_log") || is(".dt_bias");
        let value_rows = is(".in_proj_z.weight") || is(".out_proj.weight");
        let qk_then_value_rows = is(".in_proj_qkv.weight") || is(".conv1d.weight");
        if !(per_head_rows || value_rows || qk_then_value_rows) {
            return Ok(None);
        }
        let h = self.delta_heads()?;
        let fixed = if qk_then_value_rows { h.key_heads.checked_mul(h.key_dim).and_then(|n| n.checked_mul(2)) } else { Some(0) };
        let size = if per_head_rows { 1 } else { h.value_dim };
        // The counts come from the file: they must fit the tensor before an order is built from them.
        let fits = |fixed: &usize| h.value_heads.checked_mul(size).and_then(|v| v.checked_add(*fixed)) == Some(n);
        let Some(fixed) = fixed.filter(fits) else {
            return Err(Error::bad_tensor(
                name,
                format!(
                    "{n} {what} in {}, but its {}.ssm.* metadata gives {} key heads × {} × 2 (q, k) and {} value heads × {size}",
                    self.file.path().display(),
                    self.gguf_arch,
                    h.key_heads,
                    h.key_dim,
                    h.value_heads,
                ),
            ));
        };
        let Some(groups) = untile_value_heads(h.key_heads, h.value_heads) else { return Ok(None) };
        if groups.iter().enumerate().all(|(i, &g)| i == g) {
            return Ok(None);
        }
        Ok(Some(GroupOrder { fixed, size, groups }))
    }

    /// For each Hugging Face row of `name`, the file row it is read from; `None` when they are the same.
    fn row_order(&self, name: &str, rows: usize) -> Result<Option<Vec<usize>>> {
        if self.arch == Architecture::Llama {
            return self.llama_row_order(name, rows);
        }
        // Its columns moved, not its rows.
        if name.ends_with(".out_proj.weight") {
            return Ok(None);
        }
        Ok(self.value_head_order(name, rows, "rows")?.map(|order| order.expand()))
    }

    /// For llama q/k projections: the source row of each Hugging Face row.
    fn llama_row_order(&self, name: &str, rows: usize) -> Result<Option<Vec<usize>>> {
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
        if want.is_empty() || want.contains(&0) {
            return Err(Error::bad_tensor(name, format!("requested with an empty shape {want:?}")));
        }
        // ggml lists dimensions innermost first. A dimension of 1 moves no byte, and llama.cpp
        // writes some tensors with one where Hugging Face has none (shared_expert_gate: [1, H]
        // may be {H} or {H, 1}; conv1d: [C, 1, K] is {K, C}), so only the others must agree.
        let significant = |dims: &mut dyn Iterator<Item = u64>| dims.filter(|&d| d != 1).collect::<Vec<u64>>();
        if significant(&mut t.dims.iter().copied()) != significant(&mut want.iter().rev().map(|&d| d as u64)) {
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

    /// A `[rows, cols]` matrix of the tensor's type from `bytes` (whole rows of `t`).
    fn decode(&self, name: &str, t: &TensorInfo, rows: usize, cols: usize, bytes: Cow<[u8]>) -> Result<Box<dyn QuantMatrix>> {
        let ty = t.ggml_type;
        if let Some(dtype) = dense_dtype(ty) {
            return Ok(Box::new(DenseMatrix::from_le_bytes(rows, cols, dtype, &bytes)));
        }
        let format = GgmlFormat::from_ggml_type(ty.id()).ok_or_else(|| {
            Error::bad_tensor(
                name,
                format!(
                    "ggml type {ty} of GGUF tensor {} is not supported (f32, f16, bf16, q8_0, q4_0, q4_1, q4_k, q5_k, q6_k, iq4_nl, iq4_xs, mxfp4, nvfp4, q4_0_rocmfp4, q4_0_rocmfp4_fast)",
                    t.name
                ),
            )
        })?;
        let blocks = match bytes {
            Cow::Borrowed(raw) => self.file.share(raw).unwrap_or_else(|| raw.to_vec().into()),
            Cow::Owned(copy) => copy.into(),
        };
        let m = GgmlMatrix::new(format, rows, cols, blocks).map_err(|e| Error::bad_tensor(name, e.to_string()))?;
        Ok(Box::new(m))
    }

    /// The whole tensor as `rows` rows of `cols`, its rows reordered as `row_order` says.
    fn rows_of(&self, name: &str, t: &TensorInfo, rows: usize, cols: usize) -> Result<Box<dyn QuantMatrix>> {
        let raw = self.file.tensor_data(t);
        let bytes: Cow<[u8]> = match self.row_order(name, rows)? {
            None => Cow::Borrowed(raw),
            Some(order) => {
                // Each row is independent (whole blocks), so reordering rows reorders byte ranges.
                let row_bytes = raw.len() / rows;
                let mut out = Vec::with_capacity(raw.len());
                for src in order {
                    out.extend_from_slice(&raw[src * row_bytes..(src + 1) * row_bytes]);
                }
                Cow::Owned(out)
            }
        };
        self.decode(name, t, rows, cols, bytes)
    }

    /// The tensor as a `[rows, cols]` matrix with its column groups put back in Hugging Face order.
    /// Groups of whole blocks move as bytes; otherwise (a K-quant block of 256 spans two value
    /// heads of 128) the matrix is decoded to f32, which holds every value exactly.
    fn reorder_columns(&self, name: &str, t: &TensorInfo, rows: usize, cols: usize, order: &GroupOrder) -> Result<Box<dyn QuantMatrix>> {
        let raw = self.file.tensor_data(t);
        let src = order.expand();
        let ty = t.ggml_type;
        let (bs, bb) = (ty.block_size() as usize, ty.block_bytes() as usize);
        if order.fixed.is_multiple_of(bs) && order.size.is_multiple_of(bs) {
            let row_bytes = raw.len() / rows;
            // Where each block of a Hugging Face row starts in the file's row.
            let blocks: Vec<usize> = src.iter().step_by(bs).map(|&c| c / bs * bb).collect();
            let mut out = Vec::with_capacity(raw.len());
            for row in raw.chunks_exact(row_bytes) {
                for &b in &blocks {
                    out.extend_from_slice(&row[b..b + bb]);
                }
            }
            return self.decode(name, t, rows, cols, Cow::Owned(out));
        }
        let m = self.decode(name, t, rows, cols, Cow::Borrowed(raw))?;
        let (mut row, mut out) = (vec![0f32; cols], Vec::with_capacity(rows * cols));
        for r in 0..rows {
            m.dequant_row(r, &mut row);
            out.extend(src.iter().map(|&c| row[c]));
        }
        Ok(Box::new(DenseMatrix::new(rows, cols, DenseData::F32(out))))
    }

    /// Rows `first..first + n` of a stacked tensor whose rows are `cols` wide.
    fn slice(&self, name: &str, t: &TensorInfo, total_rows: usize, first: usize, n: usize, cols: usize) -> Result<Box<dyn QuantMatrix>> {
        let raw = self.file.tensor_data(t);
        let row_bytes = raw.len() / total_rows;
        self.decode(name, t, n, cols, Cow::Borrowed(&raw[first * row_bytes..(first + n) * row_bytes]))
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
        let block_count = self.required("block_count")?;
        // Qwen3.5's multi-token-prediction blocks are counted in block_count, after the decoder's.
        let nextn = self.file.get_u64(&self.key("nextn_predict_layers"))?.map_or(0, saturating_usize);
        let num_layers = block_count.checked_sub(nextn).filter(|&n| n > 0).ok_or_else(|| {
            bad(format!(
                "{} {nextn} leaves no decoder layer of {} {block_count}",
                self.key("nextn_predict_layers"),
                self.key("block_count")
            ))
        })?;
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
        // Qwen3.5 rotates part of each head. Its M-RoPE sections (rope.dimension_sections) only
        // matter for image positions; for text every section sees the same position.
        let rotary_dim = match self.file.get_u64(&self.key("rope.dimension_count"))? {
            None => head_dim,
            Some(r) if self.is_qwen35() => saturating_usize(r),
            Some(r) if r as usize == head_dim => head_dim,
            Some(r) => {
                return Err(Error::Unsupported(format!(
                    "{}: rope.dimension_count {r} differs from the head dimension {head_dim} (partial rotary)",
                    path.display()
                )))
            }
        };
        let max_position_embeddings = self.file.get_u64(&self.key("context_length"))?.map_or(4096, saturating_usize);
        let rms_norm_eps = self.file.get_f64(&self.key("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-6) as f32;
        let rope_theta = self.file.get_f64(&self.key("rope.freq_base"))?.unwrap_or(10_000.0) as f32;
        let rope_scaling = self.rope_scaling(rope_theta, head_dim)?;
        let moe = match self.arch {
            Architecture::Qwen3Moe | Architecture::Qwen35Moe => Some(self.moe_config(num_layers)?),
            _ => None,
        };
        let hybrid = if self.is_qwen35() { Some(self.hybrid_config(num_layers)?) } else { None };
        // A MoE model without dense layers has no feed_forward_length.
        let intermediate_size = match &moe {
            Some(m) if m.sparse_layers.iter().all(|&s| s) => match self.uniform_count("feed_forward_length")? {
                Some(n) if n > 0 => saturating_usize(n),
                _ => m.expert_intermediate_size,
            },
            _ => self.required("feed_forward_length")?,
        };

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
            qk_norm: self.arch != Architecture::Llama,
            rotary_dim,
            moe,
            hybrid,
            bos_token_id: id("tokenizer.ggml.bos_token_id")?,
            eos_token_ids,
        };
        config.validate_gguf(self.gguf_arch).map_err(|e| match e {
            Error::InvalidArgument(reason) => bad(reason),
            other => other,
        })?;
        // After the limits, so an absurd embedding_length is reported as such, not as a shape.
        if embd.dims[0] != hidden_size as u64 {
            return Err(embd_shape_error());
        }
        Ok(config)
    }

    fn moe_config(&self, num_layers: usize) -> Result<MoeConfig> {
        let qwen35 = self.arch == Architecture::Qwen35Moe;
        Ok(MoeConfig {
            num_experts: self.required("expert_count")?,
            experts_per_token: self.required("expert_used_count")?,
            expert_intermediate_size: self.required("expert_feed_forward_length")?,
            // llama.cpp's qwen3moe and qwen35moe graphs always renormalise the chosen experts'
            // weights (build_moe_ffn with norm_w = true); no key says otherwise.
            normalize_top_k: true,
            shared_expert_intermediate_size: if qwen35 { self.required("expert_shared_feed_forward_length")? } else { 0 },
            // Every Qwen3.5-MoE layer is sparse; a Qwen3-MoE layer is where its router is (llama.cpp
            // expects one in every layer, transformers allows dense ones: mlp_only_layers).
            sparse_layers: (0..num_layers.min(MAX_LAYERS))
                .map(|i| qwen35 || self.contains(&format!("model.layers.{i}.mlp.gate.weight")))
                .collect(),
        })
    }

    fn hybrid_config(&self, num_layers: usize) -> Result<HybridConfig> {
        let h = self.delta_heads()?;
        let key = self.key("attention.recurrent_layers");
        let layer_kinds = match self.file.get(&key) {
            // One flag per block, multi-token-prediction blocks included.
            Some(MetaValue::Array(a)) if a.len() >= num_layers => (0..num_layers)
                .map(|i| {
                    let recurrent = match a {
                        MetaArray::Bool(v) => Some(v[i]),
                        _ => a.int_at(i).map(|x| x != 0),
                    };
                    match recurrent {
                        Some(true) => Ok(LayerKind::DeltaNet),
                        Some(false) => Ok(LayerKind::Attention),
                        None => Err(Error::bad_file(self.file.path(), format!("{key} must hold booleans"))),
                    }
                })
                .collect::<Result<_>>()?,
            Some(v) => {
                return Err(Error::bad_file(
                    self.file.path(),
                    format!("{key} must be an array of one boolean per layer ({num_layers}), found {}", v.type_name()),
                ))
            }
            // llama.cpp's rule when the flags are absent: every interval-th layer attends.
            None => {
                let interval_key = self.key("full_attention_interval");
                let interval = self.file.get_u64(&interval_key)?.unwrap_or(4);
                if interval == 0 {
                    return Err(Error::bad_file(self.file.path(), format!("{interval_key} is zero")));
                }
                (0..num_layers.min(MAX_LAYERS) as u64)
                    .map(|i| if (i + 1) % interval == 0 { LayerKind::Attention } else { LayerKind::DeltaNet })
                    .collect()
            }
        };
        Ok(HybridConfig {
            layer_kinds,
            conv_kernel: h.conv_kernel,
            key_heads: h.key_heads,
            value_heads: h.value_heads,
            key_head_dim: h.key_dim,
            value_head_dim: h.value_dim,
            // llama.cpp's `nextn` tensors (a GGUF's multi-token-prediction head) are not read.
            mtp_layers: 0,
        })
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

    /// Undoes the converter's changes to the values of a Qwen3.5 vector.
    fn fix_values(&self, name: &str, t: &TensorInfo, v: &mut [f32]) -> Result<()> {
        if !self.is_qwen35() {
            return Ok(());
        }
        // The converter's own test (Qwen3NextModel.modify_tensors) on the Hugging Face name.
        if name.ends_with("norm.weight") && !name.ends_with("linear_attn.norm.weight") {
            v.iter_mut().for_each(|w| *w -= 1.0);
        } else if name.ends_with(".linear_attn.A_log") {
            for x in v.iter_mut() {
                if !(*x < 0.0 && x.is_finite()) {
                    return Err(Error::bad_tensor(
                        name,
                        format!(
                            "GGUF tensor {} in {} holds {x}, but it stores -exp(A_log), a negative number",
                            t.name,
                            self.file.path().display()
                        ),
                    ));
                }
                *x = (-*x).ln();
            }
        }
        Ok(())
    }
}

/// The element type of an unquantised ggml type.
/// The dense element type of a ggml type (F32, F16, BF16), None for block formats.
pub fn dense_dtype(ty: GgmlType) -> Option<DType> {
    match ty {
        GgmlType::F32 => Some(DType::F32),
        GgmlType::F16 => Some(DType::F16),
        GgmlType::BF16 => Some(DType::BF16),
        _ => None,
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
        // out_proj reads the value heads: its columns moved with them.
        let columns = if name.ends_with(".out_proj.weight") { self.value_head_order(name, cols, "columns")? } else { None };
        match columns {
            None => self.rows_of(name, t, rows, cols),
            Some(order) => self.reorder_columns(name, t, rows, cols, &order),
        }
    }

    fn stacked_matrix(&self, name: &str, shape: [usize; 3], index: usize, rows: Range<usize>) -> Result<Box<dyn QuantMatrix>> {
        let [count, total_rows, cols] = shape;
        if index >= count || rows.start > rows.end || rows.end > total_rows {
            return Err(Error::bad_tensor(name, format!("slice {index}, rows {rows:?} of a {shape:?} tensor")));
        }
        let tensors = self.file.tensors();
        match self.names.get(name) {
            None => Err(self.missing(name)),
            Some(&Source::Tensor(i)) => {
                let t = &tensors[i];
                self.check_dims(name, t, &shape)?;
                self.slice(name, t, count * total_rows, index * total_rows + rows.start, rows.len(), cols)
            }
            Some(&Source::GateUp { gate, up }) => {
                if total_rows % 2 != 0 {
                    return Err(Error::bad_tensor(name, format!("{total_rows} rows cannot be its gate and up halves")));
                }
                let half = total_rows / 2;
                let (g, u) = (&tensors[gate], &tensors[up]);
                self.check_dims(name, g, &[count, half, cols])?;
                self.check_dims(name, u, &[count, half, cols])?;
                let all = count * half;
                if rows.end <= half {
                    return self.slice(name, g, all, index * half + rows.start, rows.len(), cols);
                }
                if rows.start >= half {
                    return self.slice(name, u, all, index * half + rows.start - half, rows.len(), cols);
                }
                if g.ggml_type != u.ggml_type {
                    return Err(Error::Unsupported(format!(
                        "{name}: rows {rows:?} span {} ({}) and {} ({}), of different types",
                        g.name,
                        g.ggml_type,
                        u.name,
                        u.ggml_type
                    )));
                }
                let (gb, ub) = (self.file.tensor_data(g), self.file.tensor_data(u));
                let row_bytes = gb.len() / all;
                let gate_rows = &gb[(index * half + rows.start) * row_bytes..(index + 1) * half * row_bytes];
                let up_rows = &ub[index * half * row_bytes..(index * half + rows.end - half) * row_bytes];
                self.decode(name, g, rows.len(), cols, Cow::Owned([gate_rows, up_rows].concat()))
            }
        }
    }

    fn array(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        if let [len] = shape {
            return self.vector(name, *len);
        }
        let t = self.entry(name)?;
        self.check_dims(name, t, shape)?;
        // One row per leading index: the conv1d's [C, 1, K] is C rows of K taps.
        let cols = shape[shape.len() - 1];
        let rows = shape[..shape.len() - 1].iter().product::<usize>();
        let m = self.rows_of(name, t, rows, cols)?;
        let mut out = vec![0f32; rows * cols];
        for (r, row) in out.chunks_exact_mut(cols).enumerate() {
            m.dequant_row(r, row);
        }
        self.file.release(t);
        self.fix_values(name, t, &mut out)?;
        Ok(out)
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let t = self.entry(name)?;
        self.check_dims(name, t, &[len])?;
        // A bias of a permuted projection is permuted like its rows: one element per row.
        let order = self.row_order(name, len)?;
        let m = self.decode(name, t, 1, len, Cow::Borrowed(self.file.tensor_data(t)))?;
        let mut v = vec![0f32; len];
        m.dequant_row(0, &mut v);
        self.file.release(t);
        let mut v = match order {
            None => v,
            Some(p) => p.iter().map(|&src| v[src]).collect(),
        };
        self.fix_values(name, t, &mut v)?;
        Ok(v)
    }

    fn contains(&self, name: &str) -> bool {
        self.names.contains_key(name)
    }

    /// Tensors under Hugging Face names: a layer's two expert halves count as the one they make.
    fn tensor_count(&self) -> usize {
        self.names.len()
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
        assert_eq!(hf_name("blk.4.attn_qkv.weight").as_deref(), Some("model.layers.4.linear_attn.in_proj_qkv.weight"));
        assert_eq!(hf_name("blk.4.ssm_a").as_deref(), Some("model.layers.4.linear_attn.A_log"));
        assert_eq!(hf_name("blk.4.ssm_dt.bias").as_deref(), Some("model.layers.4.linear_attn.dt_bias"));
        assert_eq!(hf_name("blk.4.ssm_dt.weight"), None);
        assert_eq!(hf_name("blk.2.post_attention_norm.weight").as_deref(), Some("model.layers.2.post_attention_layernorm.weight"));
        assert_eq!(hf_name("blk.2.ffn_gate_inp_shexp.weight").as_deref(), Some("model.layers.2.mlp.shared_expert_gate.weight"));
        assert_eq!(hf_name("blk.2.ffn_down_exps.weight").as_deref(), Some("model.layers.2.mlp.experts.down_proj"));
        assert_eq!(hf_name("blk.2.ffn_gate_up_exps.weight").as_deref(), Some("model.layers.2.mlp.experts.gate_up_proj"));
        assert_eq!(hf_name("blk.2.ffn_gate_exps.weight"), None);
        assert_eq!(expert_half("blk.2.ffn_up_exps.weight"), Some(("2", true)));
        assert_eq!(hf_name("blk.40.nextn.eh_proj.weight"), None);
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

    /// llama.cpp's `_reorder_v_heads` on head indices: `[Hk, r] -> [r, Hk]`.
    fn llama_cpp_tile(key_heads: usize, value_heads: usize) -> Vec<usize> {
        let r = value_heads / key_heads;
        (0..r).flat_map(|j| (0..key_heads).map(move |g| g * r + j)).collect()
    }

    #[test]
    fn untile_inverts_llama_cpp_value_head_order() {
        for (hk, hv) in [(1, 1), (1, 4), (4, 4), (2, 6), (16, 32), (16, 64)] {
            let gguf = llama_cpp_tile(hk, hv);
            let src = untile_value_heads(hk, hv).unwrap();
            let back: Vec<usize> = src.iter().map(|&s| gguf[s]).collect();
            assert_eq!(back, (0..hv).collect::<Vec<_>>(), "{hk} key heads, {hv} value heads");
        }
        // Two key heads, six value heads: GGUF heads are [k0v0, k1v0, k0v1, k1v1, k0v2, k1v2].
        assert_eq!(untile_value_heads(2, 6).unwrap(), vec![0, 2, 4, 1, 3, 5]);
        assert!(untile_value_heads(4, 6).is_none());
        assert!(untile_value_heads(0, 6).is_none());
    }

    #[test]
    fn group_orders_expand_to_rows() {
        let order = GroupOrder { fixed: 2, size: 3, groups: vec![1, 0] };
        assert_eq!(order.expand(), vec![0, 1, 5, 6, 7, 2, 3, 4]);
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
