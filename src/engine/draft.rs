//! Drafting for speculative decoding. Prompt lookup: agents repeat code, file contents and tool
//! output verbatim, so the tokens that followed the last earlier occurrence of the text's final
//! few tokens are a good guess at what comes next. Where the text does not repeat, a model with
//! a multi-token-prediction head (Qwen3.5 / 3.6, `LanguageModel::draft`) guesses a few tokens
//! itself. The model then checks the guess in one step (`StepOutput::ArgmaxEach`): every drafted
//! token it would have chosen itself is kept, so greedy output is the same with drafting as
//! without.

/// Tokens the multi-token-prediction head drafts a step at most: each guess builds on the last,
/// and the fourth is rarely right (Qwen publishes its MTP head for 1–3 tokens ahead).
pub const HEAD_DRAFT_MAX: usize = 3;

/// Longest and shortest suffix looked up, in tokens: a longer match predicts better; a single
/// token matches too often by chance to be worth a step.
const NGRAM_MAX: usize = 4;
const NGRAM_MIN: usize = 2;

/// Up to `max` tokens that followed the latest earlier occurrence of the last n tokens of
/// `history` (n from NGRAM_MAX down to NGRAM_MIN, the first that occurs); empty when none does.
pub fn ngram_draft(history: &[u32], max: usize) -> Vec<u32> {
    let len = history.len();
    for n in (NGRAM_MIN..=NGRAM_MAX).rev() {
        if len <= n {
            continue;
        }
        let suffix = &history[len - n..];
        // Latest first: recent text is the likeliest to repeat. A match must leave a token after
        // it, so it ends before the suffix itself.
        let found = (0..len - n).rev().find(|&start| &history[start..start + n] == suffix);
        if let Some(start) = found {
            let from = start + n;
            return history[from..(from + max).min(len)].to_vec();
        }
    }
    Vec::new()
}

/// How many drafted tokens the model confirmed: `chosen[i]` is its choice after the step's
/// token i (the token before the drafts, then each draft), so draft i stands when it equals
/// `chosen[i]` and every draft before it stood.
pub fn accepted(drafts: &[u32], chosen: &[u32]) -> usize {
    drafts.iter().zip(chosen).take_while(|(d, c)| d == c).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_recent_match_supplies_the_draft() {
        // "1 2 3 4" occurred twice; the latest occurrence's continuation wins.
        let h = [1, 2, 3, 4, 9, 9, 1, 2, 3, 4, 7, 8, 0, 5, 2, 3, 4];
        assert_eq!(ngram_draft(&h, 3), vec![7, 8, 0]);
        // Cut at the end of the history.
        let h = [5, 6, 7, 5, 6];
        assert_eq!(ngram_draft(&h, 8), vec![7, 5, 6]);
        // A single repeated token is not enough; no repeat at all gives nothing.
        assert_eq!(ngram_draft(&[1, 2, 3, 1], 4), Vec::<u32>::new());
        assert_eq!(ngram_draft(&[1, 2, 3, 4], 4), Vec::<u32>::new());
        assert_eq!(ngram_draft(&[], 4), Vec::<u32>::new());
        // A shorter suffix is tried when the longer one never occurred before.
        let h = [8, 2, 3, 6, 1, 2, 3];
        assert_eq!(ngram_draft(&h, 2), vec![6, 1]);
    }

    use crate::engine::{Device, Engine, EngineOptions, GenerateRequest};

    fn load(name: &str, draft_max: usize) -> Engine {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models").join(name);
        // Every guess of the fixtures' random heads is drafted (none would be sure enough).
        let opts = EngineOptions { device: Device::Cpu, ctx_size: Some(512), draft_max, draft_p_min: 0.0, ..EngineOptions::new(dir) };
        Engine::load(&opts, &mut |_| {}).unwrap()
    }

    fn greedy(prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
        GenerateRequest { prompt, max_tokens: Some(max_tokens), sampling: Default::default(), stop: vec![], ignore_eos: true, grammar: None, logprobs: None }
    }

    /// Greedy answers with drafting are the answers without, token for token, on dense, MoE and
    /// hybrid fixtures; drafts were both confirmed and rejected (a hybrid model then rolls its
    /// recurrent state back), and a follow-up turn after drafting still continues correctly.
    #[test]
    fn drafting_changes_no_greedy_answer() {
        let (mut drafted, mut accepted) = (0, 0);
        for name in ["qwen3_untied_gqa", "qwen3_moe_tiny", "qwen3_5_tiny", "qwen3_5_moe_tiny"] {
            let (mut plain, mut spec) = (load(name, 0), load(name, 4));
            for seed in 0..3u32 {
                // A repeated passage, as agents re-read files: prompt lookup finds it.
                let passage: Vec<u32> = (0..24).map(|i| (i * 37 + seed * 11) % 256).collect();
                let prompt = [passage.clone(), passage.clone(), passage[..10].to_vec()].concat();
                let want = plain.generate_raw(&greedy(prompt.clone(), 60)).unwrap();
                let got = spec.generate_raw(&greedy(prompt.clone(), 60)).unwrap();
                assert_eq!(got.tokens, want.tokens, "{name} seed {seed}");
                assert_eq!(want.draft_tokens, 0);
                drafted += got.draft_tokens;
                accepted += got.draft_accepted;
                let follow = [prompt, got.tokens, passage[3..9].to_vec()].concat();
                let want = plain.generate_raw(&greedy(follow.clone(), 20)).unwrap();
                let got = spec.generate_raw(&greedy(follow, 20)).unwrap();
                assert_eq!(got.tokens, want.tokens, "{name} seed {seed}, follow-up");
            }
        }
        println!("{accepted} of {drafted} drafted tokens confirmed");
        assert!(accepted > 0 && drafted > accepted, "{accepted} of {drafted} drafts confirmed");
    }

    /// The multi-token-prediction head of each Qwen3.5 fixture drafts what the numpy reference
    /// (tests/fixtures/hybrid_reference.py) drafts: after a 12-token prompt, the model's next
    /// token, then three guesses (every prompt position read by the head first).
    #[test]
    fn the_drafting_head_guesses_as_the_reference() {
        for name in ["qwen3_5_tiny", "qwen3_5_vl_tiny", "qwen3_5_moe_tiny"] {
            let mut engine = load(name, 3);
            let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models").join(name);
            let golden: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
            let ids = |key: &str| -> Vec<u32> { golden["mtp"][key].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect() };
            let (prompt, drafts) = (ids("tokens"), ids("drafts"));
            let model = engine.model.as_mut();
            assert!(model.can_draft(), "{name}: the head is loaded");
            model.set_drafting(true);
            let next = model.forward_greedy(&prompt, 0, usize::MAX).unwrap();
            assert_eq!(next as u64, golden["mtp"]["next"].as_u64().unwrap(), "{name}");
            assert_eq!(model.draft(next, prompt.len(), 3, usize::MAX, 0.0).unwrap(), drafts, "{name}");
            // What it drafts from is read once.
            assert_eq!(model.draft(next, prompt.len(), 3, usize::MAX, 0.0).unwrap(), Vec::<u32>::new(), "{name}");
            // A random head is never sure: with a least probability, it guesses nothing.
            model.forward_greedy(&prompt, 0, usize::MAX).unwrap();
            assert_eq!(model.draft(next, prompt.len(), 3, usize::MAX, 0.5).unwrap(), Vec::<u32>::new(), "{name}");
        }
    }

    /// Without drafting the head is not loaded, and a model without one drafts nothing.
    #[test]
    fn the_head_is_loaded_only_to_draft_with() {
        assert!(!load("qwen3_5_tiny", 0).model.can_draft());
        let mut engine = load("qwen3_untied_gqa", 4);
        let model = engine.model.as_mut();
        model.set_drafting(true);
        let next = model.forward_greedy(&[1, 2, 3], 0, usize::MAX).unwrap();
        assert_eq!(model.draft(next, 3, 3, usize::MAX, 0.0).unwrap(), Vec::<u32>::new());
    }

    /// Greedy answers with the head's drafts (a text that never repeats, so prompt lookup finds
    /// nothing) are the answers without, on the dense-MLP and MoE hybrids, turn after turn.
    #[test]
    fn drafting_with_the_head_changes_no_greedy_answer() {
        for name in ["qwen3_5_tiny", "qwen3_5_moe_tiny"] {
            let (mut plain, mut spec) = (load(name, 0), load(name, 3));
            let (mut drafted, mut accepted) = (0, 0);
            for seed in 0..3u32 {
                let prompt: Vec<u32> = (0..20).map(|i| (i * 101 + seed * 29 + 3) % 251).collect();
                let want = plain.generate_raw(&greedy(prompt.clone(), 40)).unwrap();
                let got = spec.generate_raw(&greedy(prompt.clone(), 40)).unwrap();
                assert_eq!(got.tokens, want.tokens, "{name} seed {seed}");
                (drafted, accepted) = (drafted + got.draft_tokens, accepted + got.draft_accepted);
                let follow = [prompt, got.tokens, vec![7, 8, 9]].concat();
                let want = plain.generate_raw(&greedy(follow.clone(), 12)).unwrap();
                let got = spec.generate_raw(&greedy(follow, 12)).unwrap();
                assert_eq!(got.tokens, want.tokens, "{name} seed {seed}, follow-up");
            }
            println!("{name}: {accepted} of {drafted} drafted tokens confirmed");
            assert!(drafted > 0, "{name}: the head drafted");
        }
    }

    /// A check with a wrong draft in the middle keeps the drafts before it and the model's own
    /// choice after them; the state it leaves (a hybrid model's recurrences taken back into the
    /// step) gives the logits a fresh run of the same tokens gives.
    #[test]
    fn a_rejected_draft_leaves_the_cache_as_if_never_drafted() {
        for name in ["qwen3_untied_gqa", "qwen3_5_tiny", "qwen3_5_moe_tiny"] {
            let prompt: Vec<u32> = (0..40).map(|i| (i * 53 + 7) % 256).collect();
            let greedy_tokens = load(name, 0).generate_raw(&greedy(prompt.clone(), 5)).unwrap().tokens;
            let [g0, g1, g2, g3, _] = greedy_tokens[..] else { panic!("{name}: 5 tokens expected") };
            let mut engine = load(name, 0);
            engine.generate_raw(&greedy(prompt.clone(), 1)).unwrap();
            let pos = prompt.len();
            // g1 stands, then a draft that is not g2.
            let run = [g0, g1, (g2 + 1) % 256, g3];
            let (kept, following) = crate::engine::verify(engine.model.as_mut(), &run, pos, usize::MAX).unwrap();
            assert_eq!((kept, following), (1, g2), "{name}");
            let got = engine.model.forward(&[g2], pos + 2).unwrap();
            let want = load(name, 0).logits(&[prompt, vec![g0, g1, g2]].concat()).unwrap();
            assert_eq!(got, want, "{name}: logits after the rejected draft");
        }
    }

    /// A hybrid model goes back only into a checked step, and only to a position inside it; a
    /// refusal leaves the cache where the step left it.
    #[test]
    fn only_a_checked_step_can_be_cut_short() {
        use crate::backend::{StepOutput, StepResult};
        let prompt: Vec<u32> = (0..20).map(|i| (i * 31 + 5) % 256).collect();
        let mut engine = load("qwen3_5_tiny", 0);
        let model = engine.model.as_mut();
        model.forward_greedy(&prompt, 0, usize::MAX).unwrap();
        let refused = model.keep_until(prompt.len() - 1).unwrap_err();
        assert!(matches!(refused, crate::Error::InvalidArgument(_)), "{refused}");
        let pos = prompt.len();
        let Ok(StepResult::Tokens(_)) = model.step(&[1, 2, 3], pos, StepOutput::ArgmaxEach { limit: usize::MAX }) else { panic!("a checked step") };
        for outside in [pos, pos + 4] {
            assert!(model.keep_until(outside).is_err(), "keep_until {outside}");
        }
        let got = model.forward(&[4], pos + 3).unwrap();
        let want = load("qwen3_5_tiny", 0).logits(&[prompt, vec![1, 2, 3, 4]].concat()).unwrap();
        assert_eq!(got, want);
    }

    #[test]
    fn drafts_stand_until_the_first_the_model_would_not_choose() {
        assert_eq!(accepted(&[4, 5, 6], &[4, 5, 6, 7]), 3);
        assert_eq!(accepted(&[4, 5, 6], &[4, 9, 6, 7]), 1);
        assert_eq!(accepted(&[4, 5, 6], &[3, 5, 6, 7]), 0);
        assert_eq!(accepted(&[], &[3]), 0);
    }
}
