//! Scoring texts (atlas::eval, behind `atlas perplexity` and `atlas kld`) on the fixture models:
//! the one-pass logits of every position agree with the golden-checked last-position path, a
//! model does not diverge from itself, Q8_0 diverges a little from its BF16 original, and the
//! chat fixture's perplexity on the MIT licence text is a committed value.

use std::path::PathBuf;

use atlas::eval;
use atlas::{Device, Engine, EngineOptions};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models").join(name)
}

fn load(path: PathBuf) -> Engine {
    let opts = EngineOptions { device: Device::Cpu, ctx_size: Some(64), threads: 2, ..EngineOptions::new(path) };
    Engine::load(&opts, &mut |_| {}).unwrap()
}

fn tokens(n: usize, vocab: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + 11) % vocab).collect()
}

#[test]
fn one_pass_scores_equal_position_by_position_scores() {
    // A dense and a hybrid (Gated DeltaNet) model: every position's logits in one pass.
    for name in ["qwen3_tied", "qwen3_5_tiny"] {
        let mut engine = load(fixture(name));
        let vocab = engine.config().vocab_size as u32;
        let text = tokens(32, vocab);
        let n_ctx = 16;
        let ppl = eval::perplexity(&mut engine, &text, n_ctx, 2, &mut |_, _| {}).unwrap();
        let mut nll = 0f64;
        let mut count = 0;
        for chunk in text.chunks_exact(n_ctx) {
            for pos in n_ctx / 2..n_ctx - 1 {
                let logits = engine.logits(&chunk[..=pos]).unwrap();
                let max = logits.iter().fold(f64::NEG_INFINITY, |m, &l| m.max(l as f64));
                let log_total = max + logits.iter().map(|&l| (l as f64 - max).exp()).sum::<f64>().ln();
                nll += log_total - logits[chunk[pos + 1] as usize] as f64;
                count += 1;
            }
        }
        assert_eq!(ppl.nll.count(), count);
        let want = (nll / count as f64).exp();
        assert!((ppl.value() - want).abs() <= 1e-4 * want, "{name}: {} in one pass, {want} position by position", ppl.value());
    }
}

#[test]
fn divergences_from_itself_and_from_q8_0() {
    let text = tokens(48, 256);
    let base = fixture("qwen3_moe_tiny.gguf");
    let same = eval::divergence(&mut load(base.clone()), &mut load(base.clone()), &text, 16, 3, &mut |_, _| {}).unwrap();
    assert_eq!(same.kld.len(), 3 * 7);
    assert!(same.kld.iter().all(|&k| k < 1e-9), "{:?}", same.kld);
    assert_eq!((same.top1_agreement(), same.base.value()), (1.0, same.model.value()));
    let q8 = eval::divergence(&mut load(base), &mut load(fixture("qwen3_moe_tiny.q8_0.gguf")), &text, 16, 3, &mut |_, _| {}).unwrap();
    let kld = q8.mean_kld().mean();
    assert!(kld > 1e-6 && kld < 0.05, "Q8_0 against BF16: mean KLD {kld}");
    assert!(q8.top1_agreement() > 0.8 && q8.kld_quantile(0.99) >= q8.kld_quantile(0.5));
}

#[test]
fn the_chat_fixture_perplexity_on_the_mit_licence_is_the_committed_value() {
    let mut engine = load(fixture("chat_tiny"));
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/LICENSE-MIT")).unwrap();
    let tokens = engine.tokenizer().unwrap().encode(&text).unwrap();
    let chunks = eval::chunk_count(tokens.len(), 64, Some(4)).unwrap();
    let ppl = eval::perplexity(&mut engine, &tokens, 64, chunks, &mut |_, _| {}).unwrap();
    println!("chat_tiny on LICENSE-MIT, ctx 64, 4 chunks: PPL {} +/- {}", ppl.value(), ppl.std_error());
    assert_eq!(ppl.nll.count(), 4 * 31);
    // Random weights over 272 tokens: far above the uniform 272. Any change to the weights' reading,
    // the forward pass or the scoring moves it.
    const COMMITTED: f64 = 1521.918209663427;
    assert!((ppl.value() - COMMITTED).abs() < 1e-4 * COMMITTED, "PPL {} (committed {COMMITTED})", ppl.value());
}
