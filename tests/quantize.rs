//! `atlas quantize` (atlas::quantize) on the BF16 fixture GGUFs: Q8_0 tensors byte-identical to
//! llama.cpp's own Q8_0 file of the same model, every target deterministic, loadable, and close to
//! the original (KL divergence on a text, greedy tokens); and NVFP4 from a safetensors fixture.

use std::path::{Path, PathBuf};

use atlas::eval;
use atlas::gguf::GgufFile;
use atlas::quant::GgmlFormat;
use atlas::quantize::{parse_target, quantize_gguf, quantize_nvfp4, Plan};
use atlas::{Device, Engine, EngineOptions, GenerateRequest};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models").join(name)
}

fn scratch(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("atlas-quantize-{}-{name}", std::process::id()))
}

fn quantize(input: &Path, to: Plan, name: &str) -> PathBuf {
    let out = scratch(name);
    quantize_gguf(input, &out, to, &mut |_, _, _| {}).unwrap();
    out
}

fn load(path: &Path) -> Engine {
    let opts = EngineOptions { device: Device::Cpu, ctx_size: Some(64), threads: 2, ..EngineOptions::new(path) };
    Engine::load(&opts, &mut |_| {}).unwrap()
}

#[test]
fn q8_0_tensors_are_llama_cpps_bytes() {
    let ours = quantize(&fixture("qwen3_5_moe_tiny.gguf"), Plan::Uniform(GgmlFormat::Q8_0), "q8.gguf");
    let (ours_file, theirs) = (GgufFile::open(&ours).unwrap(), GgufFile::open(fixture("qwen3_5_moe_tiny.q8_0.gguf")).unwrap());
    let mut compared = 0;
    for t in theirs.tensors().iter().filter(|t| t.ggml_type.name() == "Q8_0") {
        let Some(o) = ours_file.tensor(&t.name) else { continue };
        assert_eq!(o.ggml_type, t.ggml_type, "{}", t.name);
        assert!(ours_file.tensor_data(o) == theirs.tensor_data(t), "{}: our Q8_0 blocks differ from llama.cpp's", t.name);
        compared += 1;
    }
    assert!(compared >= 30, "only {compared} tensors compared");
    assert_eq!(ours_file.get("general.file_type").and_then(|v| v.as_u64()), Some(7));
    std::fs::remove_file(ours).unwrap();
}

#[test]
fn every_target_is_deterministic_loads_and_stays_close() {
    let base_path = fixture("qwen3_moe_tiny.gguf");
    let text: Vec<u32> = (0..64u32).map(|i| (i * 37 + 11) % 256).collect();
    // The fixture's rows (64 wide) are not whole k-quant super-blocks: Q4_K_M falls back to Q8_0
    // (the plan itself is tested in atlas::quantize on 256-wide tensors).
    for name in ["Q8_0", "Q4_0", "Q4_K_M", "q4_0_rocmfp4_even", "Q4_0_ROCMFP4_FAST_EVEN", "Q4_0_ROCMFP4_STRIX_LEAN"] {
        let to = parse_target(name).unwrap();
        let (a, b) = (quantize(&base_path, to, "a.gguf"), quantize(&base_path, to, "b.gguf"));
        assert!(std::fs::read(&a).unwrap() == std::fs::read(&b).unwrap(), "{name}: two runs differ");
        let file = GgufFile::open(&a).unwrap();
        let types: Vec<&str> = file.tensors().iter().map(|t| t.ggml_type.name()).collect();
        let wanted: &[&str] = match to {
            Plan::Q4KM => &["Q8_0"],
            Plan::Uniform(f) => &[GgmlFormat::name(f)],
            // The k-quant roles fall back to Q8_0 in 64-wide rows.
            Plan::Rocm(_) => &["q4_0_rocmfp4", "q4_0_rocmfp4_fast", "Q8_0"],
        };
        for w in wanted {
            assert!(types.iter().any(|t| t.eq_ignore_ascii_case(w)), "{name}: no {w} tensor in {types:?}");
        }
        // The router stays as it was.
        let router = file.tensors().iter().find(|t| t.name.contains("ffn_gate_inp")).unwrap();
        assert_eq!(router.ggml_type.name(), GgufFile::open(&base_path).unwrap().tensor(&router.name).unwrap().ggml_type.name());
        let d = eval::divergence(&mut load(&base_path), &mut load(&a), &text, 16, 4, &mut |_, _| {}).unwrap();
        let kld = d.mean_kld().mean();
        // Random tiny models have flat distributions: bounds for them, not for real models.
        let bound = if to == Plan::Uniform(GgmlFormat::Q8_0) { 0.01 } else { 1.0 };
        assert!(kld.is_finite() && kld < bound, "{name}: mean KLD {kld}");
        let mut engine = load(&a);
        let req = GenerateRequest { prompt: text[..8].to_vec(), max_tokens: Some(6), sampling: Default::default(), stop: vec![], ignore_eos: true, grammar: None, logprobs: None };
        let first = engine.generate_raw(&req).unwrap().tokens;
        assert_eq!((first.len(), engine.generate_raw(&req).unwrap().tokens), (6, first), "{name}: greedy tokens");
        for p in [a, b] {
            std::fs::remove_file(p).unwrap();
        }
    }
    assert!(parse_target("IQ4_XS").is_err());
}

#[test]
fn nvfp4_checkpoints_are_deterministic_and_load() {
    let base = fixture("chat_tiny");
    let (a, b) = (scratch("nvfp4-a"), scratch("nvfp4-b"));
    let lines = quantize_nvfp4(&base, &a, &mut |_, _, _| {}).unwrap();
    quantize_nvfp4(&base, &b, &mut |_, _, _| {}).unwrap();
    let weights = |dir: &Path| std::fs::read(dir.join("model.safetensors")).unwrap();
    assert!(weights(&a) == weights(&b), "two runs differ");
    let written: Vec<&str> = lines.iter().filter(|l| l.to.is_some()).map(|l| l.name.as_str()).collect();
    assert!(written.contains(&"model.layers.0.self_attn.q_proj.weight") && written.contains(&"model.layers.0.mlp.down_proj.weight"), "{written:?}");
    assert!(!written.iter().any(|n| n.contains("embed_tokens") || n.contains("norm")), "{written:?}");
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(a.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["quantization_config"]["quant_algo"], "NVFP4");
    assert!(a.join("tokenizer.json").is_file());
    assert!(quantize_nvfp4(&base, &a, &mut |_, _, _| {}).is_err(), "an existing output directory");
    let text: Vec<u32> = (0..64u32).map(|i| (i * 37 + 11) % 272).collect();
    let d = eval::divergence(&mut load(&base), &mut load(&a), &text, 16, 4, &mut |_, _| {}).unwrap();
    let kld = d.mean_kld().mean();
    assert!(kld.is_finite() && kld < 1.0, "NVFP4 against f32: mean KLD {kld}");
    for dir in [a, b] {
        std::fs::remove_dir_all(dir).unwrap();
    }
}
