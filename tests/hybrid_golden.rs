//! Qwen3-MoE, Qwen3.5 (hybrid Gated DeltaNet) and Qwen3.5-MoE fixtures (made by
//! tests/fixtures/make_hybrid_fixtures.py with transformers) against transformers' goldens, in every
//! layout a checkpoint ships: per-expert and fused experts, text-only and multimodal-wrapped.
//! Last-position logits within 1e-4 relative and the same 16 greedy tokens, for a 12-token prompt
//! and a 300-token one; the 300 tokens also one at a time (the recurrent state carries).

mod common;

use atlas::{Device, Engine, EngineOptions};
use common::{fixture, greedy, relative_error};
use serde_json::Value;

const MODELS: [&str; 5] = ["qwen3_moe_tiny", "qwen3_5_tiny", "qwen3_5_vl_tiny", "qwen3_5_moe_tiny", "qwen3_5_moe_tiny_per_expert"];

struct Golden {
    tokens: Vec<u32>,
    logits: Vec<f32>,
    greedy: Vec<u32>,
}

fn goldens(name: &str) -> (Golden, Golden) {
    let text = std::fs::read_to_string(fixture(name).join("golden.json")).unwrap();
    let g: Value = serde_json::from_str(&text).unwrap();
    let read = |g: &Value| {
        let ids = |k: &str| g[k].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let logits = g["logits"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap() as f32).collect();
        Golden { tokens: ids("tokens"), logits, greedy: ids("greedy") }
    };
    (read(&g), read(&g["long"]))
}

fn load(name: &str) -> Engine {
    let opts = EngineOptions { device: Device::Cpu, ctx_size: Some(512), ..EngineOptions::new(fixture(name)) };
    Engine::load(&opts, &mut |_| {}).unwrap_or_else(|e| panic!("{name}: {e}"))
}

#[test]
fn cpu_logits_and_greedy_tokens_match_transformers() {
    for name in MODELS {
        let mut engine = load(name);
        for g in [goldens(name).0, goldens(name).1] {
            let err = relative_error(&engine.logits(&g.tokens).unwrap(), &g.logits);
            assert!(err < 1e-4, "{name}, {} tokens: relative error {err}", g.tokens.len());
            let got = engine.generate_raw(&greedy(g.greedy.len(), g.tokens.clone())).unwrap();
            assert_eq!(got.tokens, g.greedy, "{name}, {} tokens", g.tokens.len());
        }
    }
}

#[test]
fn one_token_at_a_time_equals_the_whole_prompt() {
    for name in ["qwen3_5_tiny", "qwen3_5_moe_tiny"] {
        let (_, long) = goldens(name);
        let mut engine = load(name);
        let mut logits = Vec::new();
        for (pos, &token) in long.tokens.iter().enumerate() {
            logits = engine.forward(&[token], pos).unwrap();
        }
        let err = relative_error(&logits, &long.logits);
        assert!(err < 1e-4, "{name}: relative error {err} after {} single steps", long.tokens.len());
    }
}

#[test]
fn a_conversation_continues_from_the_recurrent_state_and_restarts_when_it_cannot() {
    let (short, _) = goldens("qwen3_5_tiny");
    let mut engine = load("qwen3_5_tiny");
    let first = engine.generate_raw(&greedy(8, short.tokens.clone())).unwrap();
    assert_eq!(first.tokens, short.greedy[..8]);
    // Continuing the answer reuses the state of every cached token.
    let mut longer = short.tokens.clone();
    longer.extend_from_slice(&short.greedy[..8]);
    let cont = engine.generate_raw(&greedy(8, longer)).unwrap();
    assert_eq!(cont.cached_tokens, short.tokens.len() + 7);
    assert_eq!(cont.tokens, short.greedy[8..]);
    // The same prompt again cannot rewind the state: it runs from the start, with the same answer.
    let again = engine.generate_raw(&greedy(16, short.tokens.clone())).unwrap();
    assert_eq!(again.cached_tokens, 0);
    assert_eq!(again.tokens, short.greedy);
}

#[test]
fn a_step_that_does_not_continue_the_state_is_refused() {
    let (short, _) = goldens("qwen3_5_tiny");
    let mut engine = load("qwen3_5_tiny");
    engine.forward(&short.tokens, 0).unwrap();
    let err = engine.forward(&[1], 3).unwrap_err();
    assert!(err.to_string().contains("recurrent"), "{err}");
    // From position 0 the state starts again.
    let err = relative_error(&engine.logits(&short.tokens).unwrap(), &short.logits);
    assert!(err < 1e-4);
}

#[test]
fn the_load_report_names_the_architecture() {
    for (name, arch) in [("qwen3_moe_tiny", "qwen3_moe"), ("qwen3_5_vl_tiny", "qwen3_5"), ("qwen3_5_moe_tiny", "qwen3_5_moe")] {
        assert_eq!(load(name).report().architecture, arch);
    }
}

#[test]
fn the_load_report_says_what_is_not_used() {
    let unused = load("qwen3_5_vl_tiny").report().unused.clone();
    assert!(unused.iter().any(|u| u.contains("vision tower")), "{unused:?}");
    assert!(unused.iter().any(|u| u.contains("mtp.")), "{unused:?}");
    let unused = load("qwen3_5_tiny").report().unused.clone();
    assert!(matches!(&unused[..], [head] if head.contains("multi-token-prediction head")), "{unused:?}");
    // Drafting loads the head: it is used, and the report says so.
    let opts = EngineOptions { device: Device::Cpu, draft_max: 3, ..EngineOptions::new(fixture("qwen3_5_tiny")) };
    let report = Engine::load(&opts, &mut |_| {}).unwrap().report().clone();
    assert!(report.unused.is_empty(), "{:?}", report.unused);
    assert!(report.notes.iter().any(|n| n.contains("multi-token-prediction head loaded")), "{:?}", report.notes);
}

#[test]
fn atlas_info_names_the_architecture_and_the_layer_mix() {
    for (name, want) in [("qwen3_5_vl_tiny", ["qwen3_5", "LFLF"]), ("qwen3_5_moe_tiny", ["qwen3_5_moe", "LLLF"]), ("qwen3_moe_tiny", ["qwen3_moe", "2 of 8 per token"])] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_atlas"))
            .args(["info", "--model"])
            .arg(fixture(name))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success() && want.iter().all(|w| text.contains(w)), "{name}: {text}");
    }
}
