//! Qwen3-MoE, Qwen3.5 and Qwen3.5-MoE GGUF files (qwen3moe, qwen35, qwen35moe), written from the
//! safetensors fixtures by llama.cpp's own converter (tests/fixtures/make_hybrid_ggufs.py):
//! the store gives back every tensor of the Hugging Face checkpoint, the config equals config.json's,
//! and the engine reproduces transformers' goldens from the GGUF alone. Corrupt metadata is an
//! error naming the key or tensor, never a panic.

use std::path::{Path, PathBuf};

use atlas::gguf::{untile_value_heads, GgufFile, GgufStore, MetaValue};
use atlas::model::config::{LayerKind, ModelConfig};
use atlas::model::safetensors::SafetensorsStore;
use atlas::model::WeightSource;
use atlas::quant::{DType, GgmlFormat, GgmlMatrix, QuantMatrix};
use atlas::sampling::SamplingParams;
use atlas::{CpuKernels, Device, Engine, EngineOptions, GenerateRequest};
use serde_json::Value;

/// (GGUF file, the safetensors fixture it was converted from, Atlas's architecture name).
const FILES: [(&str, &str, &str); 6] = [
    ("qwen3_moe_tiny.gguf", "qwen3_moe_tiny", "qwen3_moe"),
    ("qwen3_moe_tiny.q8_0.gguf", "qwen3_moe_tiny", "qwen3_moe"),
    ("qwen3_5_tiny.gguf", "qwen3_5_tiny", "qwen3_5"),
    ("qwen3_5_tiny.q8_0.gguf", "qwen3_5_tiny", "qwen3_5"),
    ("qwen3_5_moe_tiny.gguf", "qwen3_5_moe_tiny", "qwen3_5_moe"),
    ("qwen3_5_moe_tiny.q8_0.gguf", "qwen3_5_moe_tiny", "qwen3_5_moe"),
];

/// Relative error of the last logits (max |diff| / max |golden|). The bf16 files hold the
/// checkpoint's values exactly, so they meet transformers' goldens as the safetensors fixtures do.
/// A Q8_0 file meets the goldens transformers computes from its own dequantised values
/// (gguf_q8_0_goldens.json) as closely; from the unquantised goldens it is as far as transformers
/// itself is on those values: 1.7e-2 to 3.4e-1 (a router's top-2 gap can be 4e-5 in these tiny
/// random models, so rounding picks other experts), hence the loose second bound.
const BOUND: f32 = 1e-4;
const Q8_0_TO_UNQUANTISED_BOUND: f32 = 0.4;
/// The integer kernels round each block weight's input to 8 bits (as llama.cpp does): 1.9e-2 to
/// 1.1e-1 from the Q8_0 goldens measured (the recurrent layers carry the rounding over 300
/// tokens; a router's tiny top-2 gaps can flip), about half of this bound at worst.
const INTEGER_KERNEL_BOUND: f32 = 0.25;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models").join(name)
}

fn quantised(file: &str) -> bool {
    file.ends_with(".q8_0.gguf")
}

struct Golden {
    tokens: Vec<u32>,
    logits: Vec<f32>,
    greedy: Vec<u32>,
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The 12-token and the 300-token goldens of a safetensors fixture, or of a Q8_0 file (its logits
/// and greedy tokens for the fixture's prompts).
fn goldens(model: &str, q8_0_file: Option<&str>) -> [Golden; 2] {
    let prompts = read_json(&fixture(model).join("golden.json"));
    let q8_0 = q8_0_file.map(|f| read_json(&fixture("gguf_q8_0_goldens.json"))[f].clone());
    let g = q8_0.as_ref().unwrap_or(&prompts);
    let ids = |g: &Value, k: &str| g[k].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let read = |p: &Value, g: &Value| Golden {
        tokens: ids(p, "tokens"),
        logits: g["logits"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect(),
        greedy: ids(g, "greedy"),
    };
    [read(&prompts, g), read(&prompts["long"], &g["long"])]
}

/// The f32 reference path (`CpuKernels::Reference`): the goldens are transformers' f32 numbers.
fn load(path: &Path) -> Result<Engine, atlas::Error> {
    load_with(path, CpuKernels::Reference)
}

fn load_with(path: &Path, cpu_kernels: CpuKernels) -> Result<Engine, atlas::Error> {
    let opts = EngineOptions { device: Device::Cpu, ctx_size: Some(512), cpu_kernels, ..EngineOptions::new(path) };
    Engine::load(&opts, &mut |_| {})
}

fn relative_error(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let max_ref = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let max_diff = got.iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    max_diff / max_ref
}

fn greedy(max_tokens: usize, prompt: Vec<u32>) -> GenerateRequest {
    GenerateRequest { prompt, max_tokens: Some(max_tokens), sampling: SamplingParams::default(), stop: vec![], ignore_eos: true, grammar: None, logprobs: None }
}

#[test]
fn cpu_logits_from_the_gguf_match_transformers() {
    for (file, model, arch) in FILES {
        let mut engine = load(&fixture(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert_eq!(engine.report().architecture, arch, "{file}");
        for g in goldens(model, quantised(file).then_some(file)) {
            let logits = engine.logits(&g.tokens).unwrap();
            let err = relative_error(&logits, &g.logits);
            println!("{file}, {} tokens: relative error {err:.2e}", g.tokens.len());
            assert!(err < BOUND, "{file}, {} tokens: relative error {err}", g.tokens.len());
            let got = engine.generate_raw(&greedy(g.greedy.len(), g.tokens.clone())).unwrap();
            assert_eq!(got.tokens, g.greedy, "{file}, {} tokens", g.tokens.len());
        }
        if quantised(file) {
            // The integer kernels (8-bit inputs, as llama.cpp): near the same goldens.
            let mut fast = load_with(&fixture(file), CpuKernels::Auto).unwrap();
            for g in goldens(model, Some(file)) {
                let err = relative_error(&fast.logits(&g.tokens).unwrap(), &g.logits);
                println!("{file}, {} tokens: {err:.2e} with the integer kernels", g.tokens.len());
                assert!(err < INTEGER_KERNEL_BOUND, "{file}, {} tokens: relative error {err} with the integer kernels", g.tokens.len());
            }
            for g in goldens(model, None) {
                let err = relative_error(&engine.logits(&g.tokens).unwrap(), &g.logits);
                println!("{file}, {} tokens: {err:.2e} from the unquantised golden", g.tokens.len());
                assert!(err < Q8_0_TO_UNQUANTISED_BOUND, "{file}, {} tokens: relative error {err}", g.tokens.len());
            }
        }
    }
}

#[test]
fn the_config_from_gguf_metadata_equals_config_json() {
    for (file, model, _) in FILES {
        let store = GgufStore::open(fixture(file)).unwrap();
        let from_gguf = store.config().unwrap_or_else(|e| panic!("{file}: {e}"));
        let mut from_json = ModelConfig::from_file(&fixture(model).join("config.json")).unwrap();
        // The fixtures' GGUFs are converted without the multi-token-prediction head (--no-mtp).
        if let Some(h) = from_json.hybrid.as_mut() {
            h.mtp_layers = 0;
        }
        assert_eq!(format!("{from_gguf:?}"), format!("{from_json:?}"), "{file}");
    }
}

/// How the model code reads a tensor.
enum Read {
    Matrix(usize, usize),
    Vector(usize),
    Array(Vec<usize>),
    /// The experts of a sparse MLP at this prefix: `[E, 2I, H]` and `[E, H, I]`.
    Experts(usize, usize, usize),
}

/// Every tensor a model of `c` loads, with the shape it asks for.
fn tensors_of(c: &ModelConfig) -> Vec<(String, Read)> {
    use Read::*;
    let (h, d) = (c.hidden_size, c.head_dim);
    let mut out = vec![("model.embed_tokens.weight".to_string(), Matrix(c.vocab_size, h)), ("model.norm.weight".into(), Vector(h))];
    if !c.tie_word_embeddings {
        out.push(("lm_head.weight".into(), Matrix(c.vocab_size, h)));
    }
    for i in 0..c.num_layers {
        let p = format!("model.layers.{i}");
        let mut add = |name: &str, read: Read| out.push((format!("{p}.{name}"), read));
        add("input_layernorm.weight", Vector(h));
        add("post_attention_layernorm.weight", Vector(h));
        match c.hybrid.as_ref().map(|hy| (hy, hy.layer_kinds[i])) {
            Some((hy, LayerKind::DeltaNet)) => {
                let (conv, vd, vh) = (hy.conv_dim(), hy.value_dim(), hy.value_heads);
                add("linear_attn.in_proj_qkv.weight", Matrix(conv, h));
                add("linear_attn.in_proj_z.weight", Matrix(vd, h));
                add("linear_attn.in_proj_b.weight", Matrix(vh, h));
                add("linear_attn.in_proj_a.weight", Matrix(vh, h));
                add("linear_attn.conv1d.weight", Array(vec![conv, 1, hy.conv_kernel]));
                add("linear_attn.A_log", Vector(vh));
                add("linear_attn.dt_bias", Vector(vh));
                add("linear_attn.norm.weight", Vector(hy.value_head_dim));
                add("linear_attn.out_proj.weight", Matrix(h, vd));
            }
            hybrid => {
                let gated = if hybrid.is_some() { 2 } else { 1 };
                add("self_attn.q_proj.weight", Matrix(gated * c.q_width(), h));
                add("self_attn.k_proj.weight", Matrix(c.kv_width(), h));
                add("self_attn.v_proj.weight", Matrix(c.kv_width(), h));
                add("self_attn.o_proj.weight", Matrix(h, c.q_width()));
                add("self_attn.q_norm.weight", Vector(d));
                add("self_attn.k_norm.weight", Vector(d));
            }
        }
        match &c.moe {
            Some(m) if m.sparse_layers[i] => {
                add("mlp.gate.weight", Matrix(m.num_experts, h));
                add("mlp", Experts(m.num_experts, m.expert_intermediate_size, h));
                if m.shared_expert_intermediate_size > 0 {
                    let s = m.shared_expert_intermediate_size;
                    add("mlp.shared_expert.gate_proj.weight", Matrix(s, h));
                    add("mlp.shared_expert.up_proj.weight", Matrix(s, h));
                    add("mlp.shared_expert.down_proj.weight", Matrix(h, s));
                    add("mlp.shared_expert_gate.weight", Matrix(1, h));
                }
            }
            _ => {
                add("mlp.gate_proj.weight", Matrix(c.intermediate_size, h));
                add("mlp.up_proj.weight", Matrix(c.intermediate_size, h));
                add("mlp.down_proj.weight", Matrix(h, c.intermediate_size));
            }
        }
    }
    out
}

fn values(m: &dyn QuantMatrix) -> Vec<f32> {
    let mut out = vec![0f32; m.rows() * m.cols()];
    for (r, row) in out.chunks_exact_mut(m.cols()).enumerate() {
        m.dequant_row(r, row);
    }
    out
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

#[test]
fn every_tensor_of_a_bf16_gguf_equals_the_checkpoint() {
    for (file, model, _) in FILES.into_iter().filter(|(f, ..)| !quantised(f)) {
        let gguf = GgufStore::open(fixture(file)).unwrap();
        let st = SafetensorsStore::open_dir(&fixture(model)).unwrap();
        let config = gguf.config().unwrap();
        for (name, read) in tensors_of(&config) {
            let (got, want) = match &read {
                Read::Matrix(r, c) => {
                    (values(&*gguf.matrix(&name, *r, *c).unwrap()), values(&*st.matrix(&name, *r, *c).unwrap()))
                }
                Read::Vector(n) => (gguf.vector(&name, *n).unwrap(), st.vector(&name, *n).unwrap()),
                Read::Array(shape) => (gguf.array(&name, shape).unwrap(), st.array(&name, shape).unwrap()),
                Read::Experts(e, i, h) => {
                    let per_expert = st.contains(&format!("{name}.experts.0.gate_proj.weight"));
                    let (gate_up, down) = (format!("{name}.experts.gate_up_proj"), format!("{name}.experts.down_proj"));
                    let parts = [
                        (&gate_up, [*e, 2 * i, *h], 0..*i, "gate"),
                        (&gate_up, [*e, 2 * i, *h], *i..2 * i, "up"),
                        (&down, [*e, *h, *i], 0..*h, "down"),
                    ];
                    let (mut got, mut want) = (Vec::new(), Vec::new());
                    for n in 0..*e {
                        for (fused, shape, rows, part) in parts.clone() {
                            got.extend(values(&*gguf.stacked_matrix(fused, shape, n, rows.clone()).unwrap()));
                            want.extend(values(&*if per_expert {
                                let (r, c) = if part == "down" { (*h, *i) } else { (*i, *h) };
                                st.matrix(&format!("{name}.experts.{n}.{part}_proj.weight"), r, c).unwrap()
                            } else {
                                st.stacked_matrix(fused, shape, n, rows).unwrap()
                            }));
                        }
                    }
                    (got, want)
                }
            };
            // Exact but for A_log (ln(-(-exp(A_log)))) and the 1 + w norms, rounded in f32.
            let diff = max_diff(&got, &want);
            assert!(diff <= 2e-6, "{file}: {name} differs from {model} by {diff}");
        }
        // The fused view counts each layer's two expert halves once.
        let halves = gguf.file().tensors().iter().filter(|t| t.name.ends_with("ffn_up_exps.weight")).count();
        assert_eq!(gguf.tensor_count(), gguf.file().tensors().len() - halves, "{file}");
    }
}

/// A Q8_0 `out_proj` read as Hugging Face orders its columns: value head h is the file's head
/// `untile[h]`. Heads of 32 columns are whole Q8_0 blocks and keep the format; heads of 16 split
/// blocks, so those matrices come back as f32.
#[test]
fn q8_0_out_proj_columns_are_untiled_in_place_or_through_f32() {
    for (file, dv, dtype) in [("qwen3_5_tiny.q8_0.gguf", 32, DType::Q8_0), ("qwen3_5_moe_tiny.q8_0.gguf", 16, DType::F32)] {
        let store = GgufStore::open(fixture(file)).unwrap();
        let hy = store.config().unwrap().hybrid.unwrap();
        assert_eq!(hy.value_head_dim, dv);
        let untile = untile_value_heads(hy.key_heads, hy.value_heads).unwrap();
        let t = store.file().tensor("blk.0.ssm_out.weight").unwrap();
        let (rows, cols) = (t.dims[1] as usize, t.dims[0] as usize);
        let raw = values(&GgmlMatrix::new(GgmlFormat::Q8_0, rows, cols, store.file().tensor_data(t).to_vec()).unwrap());
        let m = store.matrix("model.layers.0.linear_attn.out_proj.weight", rows, cols).unwrap();
        assert_eq!(m.dtype(), dtype, "{file}");
        let got = values(&*m);
        for r in 0..rows {
            for c in 0..cols {
                let src = untile[c / dv] * dv + c % dv;
                assert_eq!(got[r * cols + c], raw[r * cols + src], "{file} [{r}, {c}]");
            }
        }
    }
}

/// A fresh scratch directory for one test.
fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("atlas-gguf-hybrid-{}-{test}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A copy of `file` in `dir` with `edit` applied.
fn edited(dir: &Path, file: &str, edit: impl FnOnce(&mut Vec<u8>)) -> PathBuf {
    let mut bytes = std::fs::read(fixture(file)).unwrap();
    edit(&mut bytes);
    let path = dir.join(file);
    std::fs::write(&path, bytes).unwrap();
    path
}

/// The offset of a metadata key's value (after its length, name and u32 type).
fn value_offset(bytes: &[u8], key: &str) -> usize {
    let mut needle = (key.len() as u64).to_le_bytes().to_vec();
    needle.extend(key.as_bytes());
    let at = bytes.windows(needle.len()).position(|w| w == needle).unwrap_or_else(|| panic!("no key {key}"));
    at + needle.len() + 4
}

fn set_u32(bytes: &mut [u8], key: &str, value: u32) {
    let at = value_offset(bytes, key);
    bytes[at..at + 4].copy_from_slice(&value.to_le_bytes());
}

fn load_error(path: &Path) -> String {
    match load(path) {
        Ok(_) => panic!("{} loaded but should not", path.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn broken_files_are_refused_with_the_key_or_tensor() {
    let dir = scratch("broken");
    let file = "qwen3_5_moe_tiny.q8_0.gguf";
    let path = edited(&dir, file, |b| set_u32(b, "qwen35moe.ssm.time_step_rank", 5));
    let err = load_error(&path);
    assert!(err.contains(file) && err.contains("qwen35moe.ssm.time_step_rank 5") && err.contains("qwen35moe.ssm.group_count 2"), "{err}");

    let path = edited(&dir, file, |b| set_u32(b, "qwen35moe.ssm.inner_size", 100));
    assert!(load_error(&path).contains("qwen35moe.ssm.inner_size 100"));

    // Value heads that disagree with the tensors: the first reordered tensor says so.
    let path = edited(&dir, file, |b| {
        set_u32(b, "qwen35moe.ssm.time_step_rank", 4);
        set_u32(b, "qwen35moe.ssm.inner_size", 64);
    });
    let err = load_error(&path);
    assert!(err.contains("model.layers.0.linear_attn.in_proj_qkv.weight") && err.contains("expected [128, 64]"), "{err}");
    // Read directly, the tensor's own shape passes but the heads cannot be put back.
    // (Each store is dropped before its file is written again: Windows refuses to write to a file
    // that is mapped.)
    let err = GgufStore::open(&path).unwrap().matrix("model.layers.0.linear_attn.in_proj_qkv.weight", 160, 64).unwrap_err().to_string();
    assert!(err.contains("160 rows") && err.contains("qwen35moe.ssm.* metadata") && err.contains("4 value heads × 16"), "{err}");

    // ssm_a holds -exp(A_log): a positive value cannot come from the converter.
    let at = {
        let store = GgufStore::open(fixture(file)).unwrap();
        let t = store.file().tensor("blk.1.ssm_a").unwrap();
        (store.file().data_start() + t.offset) as usize
    };
    let path = edited(&dir, file, |b| b[at + 3] &= 0x7f);
    let err = load_error(&path);
    assert!(err.contains("model.layers.1.linear_attn.A_log") && err.contains("blk.1.ssm_a") && err.contains("negative"), "{err}");

    // One half of a layer's experts without the other.
    let path = edited(&dir, "qwen3_5_moe_tiny.gguf", |b| {
        let name = b"blk.2.ffn_up_exps.weight";
        let at = b.windows(name.len()).position(|w| w == name).unwrap();
        b[at + 6] = b'X';
    });
    let err = load_error(&path);
    assert!(err.contains("blk.2.ffn_gate_exps.weight has no blk.2.ffn_up_exps.weight"), "{err}");

    let path = edited(&dir, "qwen3_5_tiny.gguf", |b| set_u32(b, "qwen35.full_attention_interval", 0));
    assert!(load_error(&path).contains("qwen35.full_attention_interval is zero"));

    // qwen3moe layer 1 is dense (it has no router): without feed_forward_length nothing sizes it.
    let path = edited(&dir, "qwen3_moe_tiny.gguf", |b| {
        let at = value_offset(b, "qwen3moe.feed_forward_length") - 4 - "qwen3moe.feed_forward_length".len();
        b[at] = b'X';
    });
    assert!(load_error(&path).contains("no qwen3moe.feed_forward_length"));
    std::fs::remove_dir_all(&dir).ok();
}

/// Every integer key of the architecture set to values a corrupt or hostile file might hold:
/// each load either works or fails with an error; none panics or runs away with memory.
#[test]
fn odd_metadata_values_never_panic() {
    let dir = scratch("odd");
    for file in ["qwen3_5_moe_tiny.q8_0.gguf", "qwen3_moe_tiny.gguf"] {
        let gguf = GgufFile::open(fixture(file)).unwrap();
        let arch = gguf.get_str("general.architecture").unwrap().unwrap().to_string();
        let keys: Vec<String> = gguf
            .metadata()
            .iter()
            .filter(|(k, v)| k.starts_with(&format!("{arch}.")) && matches!(v, MetaValue::U32(_)))
            .map(|(k, _)| k.clone())
            .collect();
        assert!(keys.len() >= 10, "{file}: {keys:?}");
        let (mut loaded, mut refused) = (0, 0);
        for key in &keys {
            for value in [0u32, 1, 2, 3, 5, 64, 0xFFFF, 1 << 31, u32::MAX] {
                let path = edited(&dir, file, |b| set_u32(b, key, value));
                let result = std::panic::catch_unwind(|| match load(&path) {
                    Ok(mut engine) => engine.logits(&[1, 15, 200]).map(|_| ()),
                    Err(e) => Err(e),
                });
                match result {
                    Ok(Ok(())) => loaded += 1,
                    Ok(Err(_)) => refused += 1,
                    Err(_) => panic!("{file} with {key} = {value}: panicked"),
                }
            }
        }
        println!("{file}: {loaded} odd files loaded, {refused} refused");
        assert!(refused > 0 && loaded > 0);
    }
    std::fs::remove_dir_all(&dir).ok();
}
