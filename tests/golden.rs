//! The tiny fixture models (made by tests/fixtures/make_fixtures.py with transformers) against the
//! goldens transformers computed for them: last-position logits within 1e-4 relative, and the same
//! 16 greedy tokens.

mod common;

use atlas::{Device, Engine, EngineOptions};
use common::{fixture, greedy, relative_error};
use serde_json::Value;

const MODELS: [&str; 4] = ["qwen3_tied", "qwen3_untied_gqa", "llama", "qwen3_fp8"];

fn golden(name: &str) -> (Vec<u32>, Vec<f32>, Vec<u32>) {
    let text = std::fs::read_to_string(fixture(name).join("golden.json")).unwrap();
    let g: Value = serde_json::from_str(&text).unwrap();
    let ids = |k: &str| g[k].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let logits = g["logits"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
    (ids("tokens"), logits, ids("greedy"))
}

fn load(name: &str, threads: usize) -> Engine {
    let opts = EngineOptions { device: Device::Cpu, threads, ..EngineOptions::new(fixture(name)) };
    Engine::load(&opts, &mut |_| {}).unwrap()
}

#[test]
fn cpu_logits_match_transformers() {
    for name in MODELS {
        let (tokens, want, _) = golden(name);
        let got = load(name, 0).logits(&tokens).unwrap();
        let err = relative_error(&got, &want);
        assert!(err < 1e-4, "{name}: relative error {err}");
    }
}

#[test]
fn cpu_greedy_tokens_match_transformers() {
    for name in MODELS {
        let (tokens, _, want) = golden(name);
        let got = load(name, 0).generate_raw(&greedy(want.len(), tokens)).unwrap();
        assert_eq!(got.tokens, want, "{name}");
    }
}

#[test]
fn results_do_not_depend_on_thread_count() {
    let (tokens, _, _) = golden("qwen3_untied_gqa");
    let one = load("qwen3_untied_gqa", 1).logits(&tokens).unwrap();
    let two = load("qwen3_untied_gqa", 2).logits(&tokens).unwrap();
    assert_eq!(one, two);
}

#[test]
fn cached_prefix_gives_the_same_tokens() {
    let (tokens, _, want) = golden("llama");
    let mut engine = load("llama", 0);
    let first = engine.generate_raw(&greedy(4, tokens.clone())).unwrap();
    assert_eq!(first.cached_tokens, 0);
    // Same prompt again: everything but the last prompt token comes from the cache.
    let again = engine.generate_raw(&greedy(16, tokens.clone())).unwrap();
    assert_eq!(again.cached_tokens, tokens.len() - 1);
    assert_eq!(again.tokens, want);
    // A prompt that continues the previous answer reuses it too.
    let mut longer = tokens.clone();
    longer.extend_from_slice(&want[..8]);
    let cont = engine.generate_raw(&greedy(8, longer)).unwrap();
    assert_eq!(cont.tokens, want[8..]);
}

#[test]
fn bad_requests_fail_cleanly_and_leave_the_model_usable() {
    let (tokens, want_logits, _) = golden("qwen3_tied");
    let mut engine = load("qwen3_tied", 0);
    let err = engine.logits(&[1, 2, 999]).unwrap_err();
    assert!(err.to_string().contains("999"), "{err}");
    let err = engine.generate_raw(&greedy(10_000, tokens.clone())).unwrap_err();
    assert!(matches!(err, atlas::Error::ContextOverflow(_)), "{err}");
    let err = engine.generate_raw(&greedy(1, vec![])).unwrap_err();
    assert!(matches!(err, atlas::Error::InvalidRequest(_)), "{err}");
    assert!(relative_error(&engine.logits(&tokens).unwrap(), &want_logits) < 1e-4);
}
