//! What the golden tests share: fixture paths, a greedy request and the error measure.

use std::path::PathBuf;

use atlas::sampling::SamplingParams;
use atlas::GenerateRequest;

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models").join(name)
}

/// `max_tokens` greedy tokens after `prompt`, not stopping at end-of-sequence (as the goldens).
pub fn greedy(max_tokens: usize, prompt: Vec<u32>) -> GenerateRequest {
    GenerateRequest { prompt, max_tokens: Some(max_tokens), sampling: SamplingParams::default(), stop: vec![], ignore_eos: true, grammar: None, logprobs: None }
}

/// Largest absolute difference over the largest absolute reference value.
pub fn relative_error(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let max_ref = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let max_diff = got.iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    max_diff / max_ref
}
