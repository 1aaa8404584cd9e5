//! `atlas quantize`. A GGUF file with float weights (F32, F16, BF16) re-encoded in a block format
//! Atlas writes (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, llama.cpp's Q4_K_M mix, and the ROCmFPX fork's
//! ROCmFP4 types 100 and 101 alone or in its seven presets): every weight
//! matrix (2-D, or 3-D stacked experts) whose rows are whole blocks, except the MoE routers and
//! the Gated DeltaNet convolution, which stay as they are, like every vector; the metadata is
//! copied with `general.file_type` set. Or a safetensors checkpoint written as NVFP4 in NVIDIA
//! ModelOpt's layout. The same input gives the same bytes.

use std::path::Path;

use crate::gguf::{dense_dtype, write_gguf, GgmlType, GgufFile, MetaValue, TensorInfo, TensorOut};
use crate::model::safetensors::SafetensorsStore;
use crate::quant::fp4::nvfp4_quantize;
use crate::quant::{DType, DenseMatrix, GgmlFormat, QuantMatrix};
use crate::{Error, Result};

/// What happened to one tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorLine {
    pub name: String,
    pub dims: Vec<u64>,
    pub from: String,
    /// None: copied as it is.
    pub to: Option<String>,
    pub bytes_before: u64,
    pub bytes_after: u64,
}

/// What a GGUF quantisation writes: one block format for every weight, llama.cpp's Q4_K_M mix,
/// or one of the ROCmFPX fork's ROCmFP4 presets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plan {
    Uniform(GgmlFormat),
    /// Q4_K, with Q6_K for the head (the tied embedding too) and for the value and down
    /// projections of the layers llama.cpp gives more bits (the first and last eighth, and every
    /// third between), and Q5_K for a fused qkv projection, as llama.cpp does.
    Q4KM,
    Rocm(RocmPreset),
}

/// The ROCmFPX fork's ROCmFP4 presets (its llama_ftype 100–106, `Q4_0_ROCMFP4*`): which tensor
/// role gets type 100 (two scales a block), 101 (one scale), Q5_K or Q6_K; see `rocm_format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RocmPreset {
    Base,
    Lean,
    Coherent,
    Fast,
    FastCoherent,
    Strix,
    StrixLean,
}

impl RocmPreset {
    pub const ALL: [RocmPreset; 7] = [
        RocmPreset::Base,
        RocmPreset::Lean,
        RocmPreset::Coherent,
        RocmPreset::Fast,
        RocmPreset::FastCoherent,
        RocmPreset::Strix,
        RocmPreset::StrixLean,
    ];

    /// The fork's name (`llama-quantize` accepts it; `general.file_type` = 100 + index).
    pub fn name(self) -> &'static str {
        match self {
            RocmPreset::Base => "Q4_0_ROCMFP4",
            RocmPreset::Lean => "Q4_0_ROCMFP4_LEAN",
            RocmPreset::Coherent => "Q4_0_ROCMFP4_COHERENT",
            RocmPreset::Fast => "Q4_0_ROCMFP4_FAST",
            RocmPreset::FastCoherent => "Q4_0_ROCMFP4_FAST_COHERENT",
            RocmPreset::Strix => "Q4_0_ROCMFP4_STRIX",
            RocmPreset::StrixLean => "Q4_0_ROCMFP4_STRIX_LEAN",
        }
    }
}

impl std::fmt::Display for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Plan::Q4KM => f.write_str("q4_k_m"),
            Plan::Uniform(format) => f.write_str(format.name()),
            Plan::Rocm(preset) => f.write_str(preset.name()),
        }
    }
}

impl Plan {
    /// llama.cpp's `general.file_type` (llama_ftype) of the file.
    fn file_type(self) -> u32 {
        match self {
            Plan::Q4KM => 15,
            Plan::Rocm(preset) => 100 + RocmPreset::ALL.iter().position(|&p| p == preset).unwrap_or(0) as u32,
            Plan::Uniform(GgmlFormat::Q8_0) => 7,
            Plan::Uniform(GgmlFormat::Q4_0) => 2,
            Plan::Uniform(GgmlFormat::Q4_K) => 14,
            Plan::Uniform(GgmlFormat::Q5_K) => 16,
            Plan::Uniform(GgmlFormat::Q6_K) => 18,
            Plan::Uniform(GgmlFormat::ROCMFP4) => 100,
            // The fork's ftype for "all FAST" is 103 (its tensor type is 101).
            Plan::Uniform(_) => 103,
        }
    }
}

/// The plan named on the command line: Q4_K_M; a ROCmFP4 preset of the ROCmFPX fork
/// (`Q4_0_ROCMFP4`, `_LEAN`, `_COHERENT`, `_FAST`, `_FAST_COHERENT`, `_STRIX`, `_STRIX_LEAN`); its
/// ciru-ai fork's `Q4_0_ROCMFP4_EVEN` / `Q4_0_ROCMFP4_FAST_EVEN` (every weight one ROCmFP4 type);
/// or a format ggml names (case does not matter).
pub fn parse_target(name: &str) -> Result<Plan> {
    let upper = name.to_ascii_uppercase();
    if upper == "Q4_K_M" {
        return Ok(Plan::Q4KM);
    }
    if let Some(preset) = RocmPreset::ALL.into_iter().find(|p| p.name() == upper) {
        return Ok(Plan::Rocm(preset));
    }
    match upper.as_str() {
        "Q4_0_ROCMFP4_EVEN" => return Ok(Plan::Uniform(GgmlFormat::ROCMFP4)),
        "Q4_0_ROCMFP4_FAST_EVEN" => return Ok(Plan::Uniform(GgmlFormat::ROCMFP4_FAST)),
        _ => {}
    }
    let uniform = GgmlFormat::WRITABLE.into_iter().filter(|f| !matches!(f, GgmlFormat::ROCMFP4 | GgmlFormat::ROCMFP4_FAST));
    uniform.clone().find(|f| f.name().eq_ignore_ascii_case(name)).map(Plan::Uniform).ok_or_else(|| {
        let mut names: Vec<String> = vec!["Q4_K_M".into()];
        names.extend(uniform.map(|f| f.name().to_ascii_uppercase()));
        names.extend(RocmPreset::ALL.iter().map(|p| p.name().to_string()));
        names.extend(["Q4_0_ROCMFP4_EVEN".into(), "Q4_0_ROCMFP4_FAST_EVEN".into()]);
        Error::InvalidArgument(format!("cannot quantize to {name:?}: Atlas writes {}", names.join(", ")))
    })
}

/// Whether `t` is a weight matrix a plan writes in a block format (routers, convolutions and
/// vectors never are).
fn is_weight_matrix(t: &TensorInfo) -> bool {
    let kept = ["ffn_gate_inp", "ssm_conv1d"];
    (t.dims.len() == 2 || t.dims.len() == 3)
        && t.name.ends_with(".weight")
        && !kept.iter().any(|k| t.name.contains(k))
        && dense_dtype(t.ggml_type).is_some()
}

/// The roles whose type depends on the layer under Q4_K_M, by name.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    Head,
    Value,
    Qkv,
    Down,
    Other,
}

fn role(name: &str, has_output: bool) -> Role {
    if name == "output.weight" || (!has_output && name == "token_embd.weight") {
        Role::Head
    } else if name.contains("attn_v.weight") {
        Role::Value
    } else if name.contains("attn_qkv.weight") {
        Role::Qkv
    } else if name.contains("ffn_down") {
        Role::Down
    } else {
        Role::Other
    }
}

/// The layer of a `blk.N.` tensor.
fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

/// The ROCmFPX fork's choice for one tensor under `preset` (its llama-quant.cpp, by name as it
/// matches them): D = type 100, F = type 101. `layers`: the file's block count; `experts`: its
/// expert count. Returns the format before the shape fallback.
fn rocm_format(preset: RocmPreset, name: &str, tied: bool, layers: usize, experts: u64) -> GgmlFormat {
    use GgmlFormat::{Q5_K, Q6_K, Q8_0, ROCMFP4 as D, ROCMFP4_FAST as F};
    use RocmPreset::*;
    let fast = matches!(preset, Fast | FastCoherent | Strix | StrixLean);
    let default = if fast { F } else { D };
    let layer = layer_of(name).unwrap_or(0);
    let has = |s: &str| name.contains(s);
    let chosen = if name == "token_embd.weight" {
        match preset {
            Base if tied => Q6_K,
            Base => D,
            Lean | StrixLean => Q5_K,
            Coherent | FastCoherent | Strix => Q6_K,
            Fast => F,
        }
    } else if name == "output.weight" {
        if preset == Base { Q6_K } else { default }
    } else if has("attn_k.weight") {
        if experts == 8 && !matches!(preset, Strix | StrixLean) {
            Q8_0
        } else if matches!(preset, Strix | StrixLean) {
            D
        } else {
            default
        }
    } else if has("attn_v.weight") || has("attn_qkv.weight") || has("attn_kv_b.weight") {
        if experts == 8 {
            Q8_0
        } else {
            match preset {
                Base => Q5_K,
                Strix | StrixLean => D,
                _ => default,
            }
        }
    } else if has("attn_output.weight") {
        if preset == Base { Q5_K } else { default }
    } else if has("ffn_gate") && preset == Base {
        if more_bits(layer, layers) { Q5_K } else { D }
    } else if has("ffn_down") && preset == Base {
        if layer < 2 * layers / 3 { Q6_K } else { Q5_K }
    } else {
        default
    };
    // Later forks' floor for draft (MTP / NextN) projections.
    let draft = name.ends_with("fc.weight")
        || ["nextn.eh_proj", "nextn.e_proj", "nextn.h_proj", "mtp.pre_projection", "mtp.post_projection"].iter().any(|p| has(p));
    if draft && matches!(chosen, D | F | GgmlFormat::Q4_0) { Q8_0 } else { chosen }
}

/// llama.cpp's layers that get more bits: the first and last eighth, and every third between.
fn more_bits(i: usize, n: usize) -> bool {
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

/// The format of each tensor (None: kept as it is), with the shape fallback: rows that are not
/// whole k-quant super-blocks take Q8_0 (llama.cpp takes Q5_0, which Atlas does not write); under
/// a ROCmFP4 preset, types 100/101 fall back to Q4_0 and Q5_K/Q6_K to Q8_0 (the fork takes Q5_1
/// for Q5_K, which Atlas does not write), and a row that fits none stays as it is.
fn formats(file: &GgufFile, plan: Plan) -> Vec<Option<GgmlFormat>> {
    let has_output = file.tensor("output.weight").is_some();
    let arch = file.get("general.architecture").and_then(|v| v.as_str()).unwrap_or("").to_string();
    let meta_u64 = |key: &str| file.get(&format!("{arch}.{key}")).and_then(|v| v.as_u64());
    let max_layer = file.tensors().iter().filter_map(|t| layer_of(&t.name)).max().map_or(0, |l| l + 1);
    let layers = meta_u64("block_count").map_or(max_layer, |n| n as usize);
    let experts = meta_u64("expert_count").unwrap_or(0);
    let roles: Vec<Role> = file.tensors().iter().map(|t| role(&t.name, has_output)).collect();
    let count = |r: Role| roles.iter().filter(|&&x| x == r).count();
    let (n_value, n_down) = (count(Role::Value), count(Role::Down));
    let (mut i_value, mut i_down) = (0, 0);
    file.tensors()
        .iter()
        .zip(&roles)
        .map(|(t, &r)| {
            let wanted = match (plan, r) {
                (Plan::Uniform(f), _) => f,
                (Plan::Rocm(preset), _) => rocm_format(preset, &t.name, !has_output, layers, experts),
                (Plan::Q4KM, Role::Head) => GgmlFormat::Q6_K,
                (Plan::Q4KM, Role::Qkv) => GgmlFormat::Q5_K,
                (Plan::Q4KM, Role::Value) => {
                    i_value += 1;
                    if more_bits(i_value - 1, n_value) { GgmlFormat::Q6_K } else { GgmlFormat::Q4_K }
                }
                (Plan::Q4KM, Role::Down) => {
                    i_down += 1;
                    if more_bits(i_down - 1, n_down) { GgmlFormat::Q6_K } else { GgmlFormat::Q4_K }
                }
                (Plan::Q4KM, Role::Other) => GgmlFormat::Q4_K,
            };
            let fits = |f: GgmlFormat| t.dims[0] % f.block_size() as u64 == 0;
            let fallback = match (plan, wanted) {
                (Plan::Q4KM, _) => Some(GgmlFormat::Q8_0),
                (Plan::Rocm(_), GgmlFormat::ROCMFP4 | GgmlFormat::ROCMFP4_FAST) => Some(GgmlFormat::Q4_0),
                (Plan::Rocm(_), GgmlFormat::Q5_K | GgmlFormat::Q6_K) => Some(GgmlFormat::Q8_0),
                _ => None,
            };
            let chosen = if fits(wanted) { Some(wanted) } else { fallback.filter(|&f| fits(f)) };
            chosen.filter(|_| is_weight_matrix(t))
        })
        .collect()
}

/// Re-encodes `input` into `output`; `progress` sees each tensor as it is done (index, count).
pub fn quantize_gguf(input: &Path, output: &Path, plan: Plan, progress: &mut dyn FnMut(usize, usize, &TensorLine)) -> Result<Vec<TensorLine>> {
    let file = GgufFile::open(input)?;
    let mut tensors = Vec::with_capacity(file.tensors().len());
    let mut lines = Vec::with_capacity(file.tensors().len());
    for (i, (t, to)) in file.tensors().iter().zip(formats(&file, plan)).enumerate() {
        let data = file.tensor_data(t);
        let (out, line_to) = match to.zip(dense_dtype(t.ggml_type)) {
            Some((to, dtype)) => {
                let target = GgmlType::from_u32(to.ggml_type()).ok_or_else(|| Error::InvalidArgument(format!("no ggml type {}", to.ggml_type())))?;
                let cols = t.dims[0] as usize;
                let rows = (t.n_elements() / t.dims[0]) as usize;
                let m = DenseMatrix::from_le_bytes(rows, cols, dtype, data);
                let mut row = vec![0f32; cols];
                let mut blocks = Vec::with_capacity(rows * cols / to.block_size() * to.block_bytes());
                for r in 0..rows {
                    m.dequant_row(r, &mut row);
                    blocks.extend(to.quantize_row(&row).ok_or_else(|| Error::bad_tensor(&t.name, format!("rows of {cols} are not whole {to} blocks")))?);
                }
                (TensorOut { name: t.name.clone(), dims: t.dims.clone(), ggml_type: target, data: blocks }, Some(to.name().to_string()))
            }
            None => (TensorOut { name: t.name.clone(), dims: t.dims.clone(), ggml_type: t.ggml_type, data: data.to_vec() }, None),
        };
        let line = TensorLine {
            name: t.name.clone(),
            dims: t.dims.clone(),
            from: t.ggml_type.name().to_ascii_lowercase(),
            to: line_to,
            bytes_before: data.len() as u64,
            bytes_after: out.data.len() as u64,
        };
        progress(i + 1, file.tensors().len(), &line);
        tensors.push(out);
        lines.push(line);
    }
    let mut metadata: Vec<(String, MetaValue)> = file.metadata().to_vec();
    for (key, v) in [("general.file_type", plan.file_type()), ("general.quantization_version", 2)] {
        match metadata.iter_mut().find(|(k, _)| k == key) {
            Some(entry) => entry.1 = MetaValue::U32(v),
            None => metadata.push((key.to_string(), MetaValue::U32(v))),
        }
    }
    write_gguf(output, &metadata, &tensors)?;
    Ok(lines)
}

/// The projections written as NVFP4: attention, MLP and expert projections (shared experts too).
/// Embeddings, the head, norms, routers, Gated DeltaNet layers (kept high precision, as the
/// published NVFP4 Qwen3.5 checkpoints do), vision towers and MTP heads stay as they are.
fn nvfp4_target(name: &str, shape: &[usize]) -> bool {
    const PROJECTIONS: [&str; 7] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];
    let Some(module) = name.strip_suffix(".weight") else { return false };
    let last = module.rsplit('.').next().unwrap_or("");
    shape.len() == 2
        && shape[1].is_multiple_of(16)
        && PROJECTIONS.contains(&last)
        && !["linear_attn.", "visual.", "mtp."].iter().any(|p| name.contains(p))
}

/// Writes the checkpoint in `input` (a Hugging Face directory) to `output` as NVFP4 (ModelOpt's
/// tensors: `weight` U8, `weight_scale` F8_E4M3, `weight_scale_2` F32) in one `model.safetensors`,
/// with config.json's `quantization_config` saying so and every other file copied.
pub fn quantize_nvfp4(input: &Path, output: &Path, progress: &mut dyn FnMut(usize, usize, &TensorLine)) -> Result<Vec<TensorLine>> {
    if output.exists() {
        return Err(Error::InvalidArgument(format!("{} exists: NVFP4 output goes to a new directory", output.display())));
    }
    let store = SafetensorsStore::open_dir(input)?;
    let names = store.names();
    let mut out: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    let (mut lines, mut kept) = (Vec::new(), Vec::new());
    for (i, name) in names.iter().enumerate() {
        let (dtype, shape, bytes) = store.raw(name)?;
        let dense = match dtype {
            safetensors::Dtype::F32 => Some(DType::F32),
            safetensors::Dtype::F16 => Some(DType::F16),
            safetensors::Dtype::BF16 => Some(DType::BF16),
            _ => None,
        };
        let line_from = format!("{dtype:?}").to_ascii_lowercase();
        let mut line = TensorLine { name: name.to_string(), dims: shape.iter().map(|&d| d as u64).collect(), from: line_from, to: None, bytes_before: bytes.len() as u64, bytes_after: bytes.len() as u64 };
        match dense.filter(|_| nvfp4_target(name, shape)) {
            Some(dt) => {
                let (rows, cols) = (shape[0], shape[1]);
                let m = DenseMatrix::from_le_bytes(rows, cols, dt, bytes);
                let mut x = vec![0f32; rows * cols];
                for (r, row) in x.chunks_exact_mut(cols).enumerate() {
                    m.dequant_row(r, row);
                }
                let (codes, scales, tensor_scale) = nvfp4_quantize(&x, cols);
                let base = name.strip_suffix(".weight").unwrap_or(name);
                line.to = Some("nvfp4".into());
                line.bytes_after = (codes.len() + scales.len() + 4) as u64;
                out.push((name.to_string(), safetensors::Dtype::U8, vec![rows, cols / 2], codes));
                out.push((format!("{base}.weight_scale"), safetensors::Dtype::F8_E4M3, vec![rows, cols / 16], scales));
                out.push((format!("{base}.weight_scale_2"), safetensors::Dtype::F32, vec![], tensor_scale.to_le_bytes().to_vec()));
            }
            None => {
                if shape.len() == 2 && name.ends_with(".weight") {
                    kept.push(name.strip_suffix(".weight").unwrap_or(name).to_string());
                }
                out.push((name.to_string(), dtype, shape.to_vec(), bytes.to_vec()));
            }
        }
        progress(i + 1, names.len(), &line);
        lines.push(line);
    }
    std::fs::create_dir_all(output).map_err(|e| Error::io(output, e))?;
    let views = out
        .iter()
        .map(|(n, d, s, b)| safetensors::tensor::TensorView::new(*d, s.clone(), b).map(|v| (n.clone(), v)))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::InvalidArgument(format!("NVFP4 tensors: {e}")))?;
    let target = output.join("model.safetensors");
    safetensors::serialize_to_file(views, None, &target).map_err(|e| Error::bad_file(&target, e.to_string()))?;
    copy_beside_weights(input, output, &kept)?;
    Ok(lines)
}

/// Copies every file of the checkpoint but its weights, with config.json's
/// `quantization_config` set to ModelOpt's NVFP4 (`kept`: the matrices left in high precision).
fn copy_beside_weights(input: &Path, output: &Path, kept: &[String]) -> Result<()> {
    let entries = std::fs::read_dir(input).map_err(|e| Error::io(input, e))?;
    for entry in entries {
        let path = entry.map_err(|e| Error::io(input, e))?.path();
        let Some(file) = path.file_name().and_then(|f| f.to_str()) else { continue };
        let weights = file.ends_with(".safetensors") || file == "model.safetensors.index.json";
        if !path.is_file() || weights {
            continue;
        }
        let to = output.join(file);
        if file == "config.json" {
            let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
            let mut config: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::bad_file(&path, format!("not valid JSON: {e}")))?;
            config["quantization_config"] = serde_json::json!({
                "quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": kept,
                "producer": {"name": "atlas", "version": env!("CARGO_PKG_VERSION")},
            });
            let json = serde_json::to_string_pretty(&config).map_err(|e| Error::bad_file(&path, e.to_string()))?;
            std::fs::write(&to, json + "\n").map_err(|e| Error::io(&to, e))?;
        } else {
            std::fs::copy(&path, &to).map_err(|e| Error::io(&to, e))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::{MetaArray, TensorOut};

    /// A GGUF of 256-wide F32 tensors named as a model's: a head, eight layers of value, down and
    /// gate projections, a query, key, output and fused qkv projection, a token embedding, a router
    /// and a norm.
    fn wide_file(path: &Path) {
        let f32t = GgmlType::from_u32(0).unwrap();
        let mut names: Vec<(String, Vec<u64>)> = vec![("output.weight".into(), vec![256, 2]), ("token_embd.weight".into(), vec![256, 2])];
        for i in 0..8 {
            names.push((format!("blk.{i}.attn_v.weight"), vec![256, 2]));
            names.push((format!("blk.{i}.ffn_down.weight"), vec![256, 2]));
            names.push((format!("blk.{i}.ffn_gate.weight"), vec![256, 2]));
        }
        for n in ["attn_q", "attn_k", "attn_output", "attn_qkv", "ffn_gate_inp"] {
            names.push((format!("blk.0.{n}.weight"), vec![256, 2]));
        }
        names.extend([("blk.0.attn_norm.weight".into(), vec![256]), ("blk.0.nextn.eh_proj.weight".into(), vec![256, 2])]);
        let tensors: Vec<TensorOut> = names
            .into_iter()
            .enumerate()
            .map(|(k, (name, dims))| {
                let n: u64 = dims.iter().product();
                let data = (0..n).flat_map(|i| (((i * 7919 + k as u64 * 31) % 211) as f32 / 211.0 - 0.5).to_le_bytes()).collect();
                TensorOut { name, dims, ggml_type: f32t, data }
            })
            .collect();
        let metadata = vec![("general.architecture".to_string(), MetaValue::String("llama".into())), ("x".to_string(), MetaValue::Array(MetaArray::U8(vec![1])))];
        write_gguf(path, &metadata, &tensors).unwrap();
    }

    #[test]
    fn q4_k_m_gives_the_head_and_the_more_bits_layers_q6_k() {
        let (input, output) = (std::env::temp_dir().join(format!("atlas-plan-{}.gguf", std::process::id())), std::env::temp_dir().join(format!("atlas-plan-out-{}.gguf", std::process::id())));
        wide_file(&input);
        let lines = quantize_gguf(&input, &output, Plan::Q4KM, &mut |_, _, _| {}).unwrap();
        let to = |name: &str| lines.iter().find(|l| l.name == name).and_then(|l| l.to.clone());
        assert_eq!(to("output.weight").as_deref(), Some("q6_k"));
        // Of 8 layers, 0, 3, 6 and 7 get more bits (the first and last eighth, every third between).
        for i in 0..8 {
            let want = if [0, 3, 6, 7].contains(&i) { "q6_k" } else { "q4_k" };
            assert_eq!(to(&format!("blk.{i}.attn_v.weight")).as_deref(), Some(want), "attn_v {i}");
            assert_eq!(to(&format!("blk.{i}.ffn_down.weight")).as_deref(), Some(want), "ffn_down {i}");
        }
        assert_eq!(to("blk.0.attn_q.weight").as_deref(), Some("q4_k"));
        assert_eq!(to("blk.0.attn_qkv.weight").as_deref(), Some("q5_k"));
        assert_eq!((to("blk.0.ffn_gate_inp.weight"), to("blk.0.attn_norm.weight")), (None, None));
        // The written blocks decode close to the values.
        let (src, out) = (GgufFile::open(&input).unwrap(), GgufFile::open(&output).unwrap());
        assert_eq!(out.get("general.file_type").and_then(MetaValue::as_u64), Some(15));
        for name in ["output.weight", "blk.1.attn_v.weight"] {
            let (t, u) = (src.tensor(name).unwrap(), out.tensor(name).unwrap());
            let want: Vec<f32> = src.tensor_data(t).chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            let format = GgmlFormat::from_ggml_type(u.ggml_type.id()).unwrap();
            let mut got = vec![0f32; want.len()];
            format.dequant_blocks(out.tensor_data(u), &mut got);
            let worst = want.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(worst < 0.05, "{name} ({format}): worst error {worst}");
        }
        assert_eq!(parse_target("q4_k_m").unwrap(), Plan::Q4KM);
        assert!(parse_target("Q5_K_M").is_err());
        for p in [input, output] {
            std::fs::remove_file(p).unwrap();
        }
    }

    /// The ROCmFPX fork's per-role table (its llama-quant.cpp) for two presets, on a file of eight
    /// layers with a head of its own.
    #[test]
    fn rocmfp4_presets_follow_the_forks_table() {
        let tmp = |s: &str| std::env::temp_dir().join(format!("atlas-rocm-{}-{s}.gguf", std::process::id()));
        let input = tmp("in");
        wide_file(&input);
        let run = |preset: &str| {
            let output = tmp(preset);
            let lines = quantize_gguf(&input, &output, parse_target(preset).unwrap(), &mut |_, _, _| {}).unwrap();
            let file_type = GgufFile::open(&output).unwrap().get("general.file_type").and_then(MetaValue::as_u64);
            std::fs::remove_file(output).unwrap();
            (lines, file_type)
        };
        let (d, f) = ("q4_0_rocmfp4", "q4_0_rocmfp4_fast");
        // Base (100): Q6_K head, Q5_K attn_v / qkv / attn_output, ffn_down Q6_K below 2n/3 and Q5_K
        // above, ffn_gate Q5_K on the more-bits layers (0, 3, 6, 7 of 8), the rest type 100; the
        // draft projection raised to Q8_0.
        let (lines, file_type) = run("Q4_0_ROCMFP4");
        let to = |name: &str| lines.iter().find(|l| l.name == name).and_then(|l| l.to.clone()).unwrap_or_default();
        assert_eq!(file_type, Some(100));
        for (name, want) in [("output.weight", "q6_k"), ("token_embd.weight", d), ("blk.0.attn_q.weight", d), ("blk.0.attn_k.weight", d),
            ("blk.0.attn_output.weight", "q5_k"), ("blk.0.attn_qkv.weight", "q5_k"), ("blk.0.nextn.eh_proj.weight", "q8_0")] {
            assert_eq!(to(name), want, "Q4_0_ROCMFP4 {name}");
        }
        for i in 0..8 {
            assert_eq!(to(&format!("blk.{i}.attn_v.weight")), "q5_k", "attn_v {i}");
            assert_eq!(to(&format!("blk.{i}.ffn_down.weight")), if i < 5 { "q6_k" } else { "q5_k" }, "ffn_down {i}");
            assert_eq!(to(&format!("blk.{i}.ffn_gate.weight")), if [0, 3, 6, 7].contains(&i) { "q5_k" } else { d }, "ffn_gate {i}");
        }
        // STRIX_LEAN (106): Q5_K token embedding, type 100 for attn_k / attn_v / qkv, 101 elsewhere
        // (the head included).
        let (lines, file_type) = run("q4_0_rocmfp4_strix_lean");
        let to = |name: &str| lines.iter().find(|l| l.name == name).and_then(|l| l.to.clone()).unwrap_or_default();
        assert_eq!(file_type, Some(106));
        for (name, want) in [("output.weight", f), ("token_embd.weight", "q5_k"), ("blk.0.attn_q.weight", f), ("blk.0.attn_k.weight", d),
            ("blk.3.attn_v.weight", d), ("blk.0.attn_qkv.weight", d), ("blk.0.attn_output.weight", f), ("blk.5.ffn_down.weight", f)] {
            assert_eq!(to(name), want, "STRIX_LEAN {name}");
        }
        // The EVEN aliases: one type for every weight.
        assert_eq!(parse_target("Q4_0_ROCMFP4_FAST_EVEN").unwrap(), Plan::Uniform(GgmlFormat::ROCMFP4_FAST));
        assert!(parse_target("Q4_0_ROCMFP4_STRIX_BALANCED").is_err(), "not a preset of the fork");
        std::fs::remove_file(input).unwrap();
    }
}
