//! Turning logits into the next token: penalties, temperature, top-k, top-p, min-p, then a draw
//! from a seeded generator (the same seed gives the same tokens on the same device).

/// Sampling settings of one request. Neutral values switch a stage off.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means no top-k cut.
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    /// Divides positive (multiplies negative) logits of every token seen in prompt or output; 1 is off.
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token already generated (OpenAI semantics).
    pub presence_penalty: f32,
    /// Subtracted per occurrence from the logit of every token already generated.
    pub frequency_penalty: f32,
    /// Added to the logits of these token ids before anything else (OpenAI's `logit_bias`).
    pub logit_bias: Vec<(u32, f32)>,
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            seed: None,
        }
    }
}

impl SamplingParams {
    pub fn validate(&self) -> Result<(), String> {
        let finite = |v: f32| v.is_finite();
        if !finite(self.temperature) || self.temperature < 0.0 {
            return Err(format!("temperature must be >= 0, got {}", self.temperature));
        }
        if !finite(self.top_p) || self.top_p <= 0.0 || self.top_p > 1.0 {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !finite(self.min_p) || !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if !finite(self.repetition_penalty) || self.repetition_penalty <= 0.0 {
            return Err(format!("repetition penalty must be > 0, got {}", self.repetition_penalty));
        }
        if !finite(self.presence_penalty) || !finite(self.frequency_penalty) {
            return Err("presence and frequency penalties must be finite".into());
        }
        if let Some((id, bias)) = self.logit_bias.iter().find(|(_, b)| !(-100.0..=100.0).contains(b)) {
            return Err(format!("logit_bias of token {id} must be in [-100, 100], got {bias}"));
        }
        Ok(())
    }
}

/// xoshiro256** seeded through splitmix64: small, fast, and identical on every platform.
#[derive(Debug, Clone)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        Rng { s: [next(), next(), next(), next()] }
    }

    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
    /// Ids at or above this are never chosen (the model's vocab is often padded past the tokenizer's).
    vocab_limit: usize,
}

impl Sampler {
    pub fn new(params: SamplingParams, vocab_limit: usize) -> Self {
        let seed = params.seed.unwrap_or_else(entropy_seed);
        Sampler { rng: Rng::new(seed), params, vocab_limit }
    }

    /// True when the choice is the plain argmax of the logits (no temperature, penalties or
    /// biases), which a GPU can make on the device: only the id then crosses to the host.
    pub fn is_plain_greedy(&self) -> bool {
        self.params.temperature == 0.0 && self.leaves_logits_alone()
    }

    /// No penalty or bias changes the logits before the choice.
    fn leaves_logits_alone(&self) -> bool {
        let p = &self.params;
        p.repetition_penalty == 1.0 && p.presence_penalty == 0.0 && p.frequency_penalty == 0.0 && p.logit_bias.is_empty()
    }

    /// Replaces the biases this sampler adds (a backend that adds them itself takes them over).
    pub fn set_logit_bias(&mut self, bias: Vec<(u32, f32)>) {
        self.params.logit_bias = bias;
    }

    /// Ids at or above this are never chosen.
    pub fn vocab_limit(&self) -> usize {
        self.vocab_limit
    }

    /// Chooses the next token. `history` is prompt + output so far; `output_start` is where the
    /// output begins in it (presence and frequency penalties look at the output only).
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32], output_start: usize) -> u32 {
        let limit = self.vocab_limit.min(logits.len());
        let logits = &mut logits[..limit];
        self.apply_penalties(logits, history, output_start);
        if self.params.temperature == 0.0 {
            return argmax(logits);
        }
        let k = if self.params.top_k > 0 { self.params.top_k } else { logits.len() };
        self.draw(top_k(logits, k, logits.len()))
    }

    /// When the next token depends only on the `k` largest logits (top-k sampling with no
    /// penalties), `Some(k)`: a GPU then hands over those k (id, logit) pairs instead of every logit.
    pub fn device_top_k(&self) -> Option<usize> {
        let p = &self.params;
        (p.temperature > 0.0 && self.leaves_logits_alone() && (1..=MAX_DEVICE_TOP_K).contains(&p.top_k)).then_some(p.top_k)
    }

    /// Chooses the next token from the `device_top_k()` largest logits (id, logit), as `sample`
    /// would from all of them.
    pub fn sample_top_k(&mut self, best: Vec<(u32, f32)>) -> u32 {
        let limit = self.vocab_limit;
        self.draw(best.into_iter().filter(|c| (c.0 as usize) < limit).collect())
    }

    /// Temperature, top-p and min-p over candidate (id, logit) pairs, then the seeded draw.
    fn draw(&mut self, mut cands: Vec<(u32, f32)>) -> u32 {
        if cands.is_empty() {
            return 0;
        }
        cands.iter_mut().for_each(|c| c.1 /= self.params.temperature);
        cands.sort_unstable_by(by_logit);
        let probs = top_p_min_p(&cands, self.params.top_p, self.params.min_p);
        let total: f64 = probs.iter().sum();
        let mut u = self.rng.next_f64() * total;
        for (i, p) in probs.iter().enumerate() {
            if u < *p {
                return cands[i].0;
            }
            u -= p;
        }
        cands[probs.len() - 1].0
    }

    fn apply_penalties(&self, logits: &mut [f32], history: &[u32], output_start: usize) {
        let p = &self.params;
        for &(id, bias) in &p.logit_bias {
            if let Some(l) = logits.get_mut(id as usize) {
                *l += bias;
            }
        }
        if p.repetition_penalty != 1.0 {
            let mut seen = vec![false; logits.len()];
            for &t in history {
                if let Some(s) = seen.get_mut(t as usize) {
                    if !*s {
                        *s = true;
                        let l = &mut logits[t as usize];
                        *l = if *l > 0.0 { *l / p.repetition_penalty } else { *l * p.repetition_penalty };
                    }
                }
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            let mut counts = std::collections::HashMap::<u32, u32>::new();
            for &t in history.get(output_start..).unwrap_or(&[]) {
                *counts.entry(t).or_default() += 1;
            }
            for (t, n) in counts {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -= p.presence_penalty + p.frequency_penalty * n as f32;
                }
            }
        }
    }
}

/// The most candidates a GPU selects for top-k sampling (TOPK_MAX in kernels/sampling.hip).
pub const MAX_DEVICE_TOP_K: usize = 64;

/// Larger logit first, ties by lower id, so the order never depends on the sort algorithm.
fn by_logit(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// The `k` largest (id, logit) pairs among the first `limit` logits, largest first (ties by id).
pub fn top_k(logits: &[f32], k: usize, limit: usize) -> Vec<(u32, f32)> {
    let mut cands: Vec<(u32, f32)> = logits[..limit.min(logits.len())].iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
    if k < cands.len() {
        cands.select_nth_unstable_by(k.max(1) - 1, by_logit);
        cands.truncate(k.max(1));
    }
    cands.sort_unstable_by(by_logit);
    cands
}

/// The chosen token's log-probability and the `top` most likely tokens' (largest first, ties by
/// id), over the first `limit` logits: log-softmax in f64.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprob {
    pub fn new(logits: &[f32], limit: usize, token: u32, top: usize) -> Self {
        let logits = &logits[..limit.min(logits.len())];
        let max = logits.iter().fold(f32::NEG_INFINITY, |m, &l| m.max(l)) as f64;
        let log_total = max + logits.iter().map(|&l| (l as f64 - max).exp()).sum::<f64>().ln();
        let logprob = |l: f32| (l as f64 - log_total) as f32;
        let chosen = logits.get(token as usize).map_or(f32::NEG_INFINITY, |&l| logprob(l));
        let top = if top == 0 { Vec::new() } else { top_k(logits, top, logits.len()) };
        TokenLogprob { token, logprob: chosen, top: top.into_iter().map(|(id, l)| (id, logprob(l))).collect() }
    }
}

/// Index of the largest logit; the lowest index wins a tie, as torch.argmax does.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Softmax over sorted candidates, then the top-p prefix and the min-p floor. Returns the kept
/// probabilities (a prefix of `cands`, at least one), not renormalised.
fn top_p_min_p(cands: &[(u32, f32)], top_p: f32, min_p: f32) -> Vec<f64> {
    let max = cands[0].1 as f64;
    let mut probs: Vec<f64> = cands.iter().map(|c| (c.1 as f64 - max).exp()).collect();
    let total: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= total);
    let mut keep = probs.len();
    if top_p < 1.0 {
        let mut cum = 0.0;
        for (i, p) in probs.iter().enumerate() {
            cum += p;
            if cum >= top_p as f64 {
                keep = i + 1;
                break;
            }
        }
    }
    if min_p > 0.0 {
        let floor = probs[0] * min_p as f64;
        keep = keep.min(probs.iter().take_while(|p| **p >= floor).count().max(1));
    }
    probs.truncate(keep);
    probs
}

fn entropy_seed() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    nanos ^ COUNTER.fetch_add(0x9E37_79B9, Ordering::Relaxed).rotate_left(32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        (0..64).map(|i| ((i * 37 % 64) as f32 * 0.1).sin() * 3.0).collect()
    }

    fn params(temperature: f32) -> SamplingParams {
        SamplingParams { temperature, seed: Some(42), ..Default::default() }
    }

    fn draw(p: SamplingParams, n: usize) -> Vec<u32> {
        let mut s = Sampler::new(p, usize::MAX);
        (0..n).map(|_| s.sample(&mut logits(), &[], 0)).collect()
    }

    #[test]
    fn device_top_k_draws_what_the_full_sampler_draws() {
        let l = logits();
        for (k, top_p, min_p) in [(20, 0.95, 0.0), (1, 1.0, 0.0), (64, 0.8, 0.05), (5, 1.0, 0.0)] {
            let p = SamplingParams { top_k: k, top_p, min_p, ..params(0.7) };
            let (mut full, mut fast) = (Sampler::new(p.clone(), usize::MAX), Sampler::new(p, usize::MAX));
            assert_eq!(fast.device_top_k(), Some(k));
            for _ in 0..50 {
                let want = full.sample(&mut l.clone(), &[], 0);
                assert_eq!(fast.sample_top_k(top_k(&l, k, l.len())), want, "k {k}");
            }
        }
        let penalised = SamplingParams { top_k: 20, repetition_penalty: 1.1, ..params(0.7) };
        assert_eq!(Sampler::new(penalised, usize::MAX).device_top_k(), None);
        assert_eq!(Sampler::new(params(0.7), usize::MAX).device_top_k(), None, "no top-k: every logit");
    }

    #[test]
    fn greedy_picks_first_maximum() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
        let l = logits();
        let best = draw(params(0.0), 1)[0] as usize;
        assert!(l.iter().all(|&x| x <= l[best]));
    }

    #[test]
    fn same_seed_same_tokens_other_seed_other_tokens() {
        let a = draw(params(1.0), 200);
        assert_eq!(a, draw(params(1.0), 200));
        let b = draw(SamplingParams { seed: Some(7), ..params(1.0) }, 200);
        assert_ne!(a, b);
    }

    #[test]
    fn top_k_keeps_only_the_k_best() {
        let l = logits();
        let mut order: Vec<usize> = (0..l.len()).collect();
        order.sort_by(|&a, &b| l[b].total_cmp(&l[a]));
        let allowed = &order[..3];
        for t in draw(SamplingParams { top_k: 3, ..params(5.0) }, 300) {
            assert!(allowed.contains(&(t as usize)), "token {t} outside top-3");
        }
    }

    #[test]
    fn top_p_mask_is_the_smallest_prefix_reaching_p() {
        let cands = [(0, 2.0f32), (1, 1.0), (2, 0.0), (3, -1.0)];
        let full = top_p_min_p(&cands, 1.0, 0.0);
        assert_eq!(full.len(), 4);
        // p0 ≈ 0.644, p0 + p1 ≈ 0.881
        assert_eq!(top_p_min_p(&cands, 0.6, 0.0).len(), 1);
        assert_eq!(top_p_min_p(&cands, 0.7, 0.0).len(), 2);
        assert_eq!(top_p_min_p(&cands, 0.9, 0.0).len(), 3);
        // min_p 0.3: p1/p0 = e^-1 ≈ 0.37 stays, p2/p0 ≈ 0.135 goes.
        assert_eq!(top_p_min_p(&cands, 1.0, 0.3).len(), 2);
    }

    #[test]
    fn sampling_respects_top_p() {
        let l = logits();
        let top = argmax(&l);
        for t in draw(SamplingParams { top_p: 1e-6, ..params(1.0) }, 50) {
            assert_eq!(t, top);
        }
    }

    #[test]
    fn vocab_limit_is_never_exceeded() {
        let mut s = Sampler::new(params(0.0), 4);
        let mut l = vec![0.0, 1.0, 2.0, 3.0, 100.0];
        assert_eq!(s.sample(&mut l, &[], 0), 3);
    }

    #[test]
    fn logit_bias_moves_and_bans_tokens_and_leaves_the_device_paths() {
        let base = vec![5.0, 4.9, 0.0];
        let mut s = Sampler::new(SamplingParams { logit_bias: vec![(2, 10.0)], ..params(0.0) }, 3);
        assert!(!s.is_plain_greedy());
        assert_eq!(s.sample(&mut base.clone(), &[], 0), 2);
        let ban = SamplingParams { logit_bias: vec![(0, -100.0)], ..params(1.0) };
        assert_eq!(Sampler::new(SamplingParams { top_k: 5, ..ban.clone() }, 3).device_top_k(), None);
        let mut s = Sampler::new(ban, 3);
        for _ in 0..50 {
            assert_ne!(s.sample(&mut base.clone(), &[], 0), 0);
        }
        assert!(SamplingParams { logit_bias: vec![(1, 100.5)], ..Default::default() }.validate().is_err());
    }

    #[test]
    fn logprobs_are_the_log_softmax() {
        let l = [1.0f32, 3.0, 2.0, f32::NEG_INFINITY, 9.0];
        let lp = TokenLogprob::new(&l, 4, 2, 2);
        let total = (1f64.exp() + 3f64.exp() + 2f64.exp()).ln();
        assert!((lp.logprob as f64 - (2.0 - total)).abs() < 1e-6);
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2]);
        assert!((lp.top[0].1 as f64 - (3.0 - total)).abs() < 1e-6);
        assert_eq!(TokenLogprob::new(&l, 4, 3, 0).logprob, f32::NEG_INFINITY);
    }

    #[test]
    fn penalties_change_the_choice() {
        let base = vec![5.0, 4.9, 0.0];
        let mut s = Sampler::new(SamplingParams { repetition_penalty: 1.5, ..params(0.0) }, 3);
        assert_eq!(s.sample(&mut base.clone(), &[0], 1), 1);
        let mut s = Sampler::new(SamplingParams { presence_penalty: 0.5, ..params(0.0) }, 3);
        assert_eq!(s.sample(&mut base.clone(), &[0], 0), 1);
        // Presence and frequency penalties ignore the prompt.
        assert_eq!(s.sample(&mut base.clone(), &[0], 1), 0);
        let mut s = Sampler::new(SamplingParams { frequency_penalty: 0.05, ..params(0.0) }, 3);
        assert_eq!(s.sample(&mut base.clone(), &[0, 0, 0], 0), 1);
    }

    #[test]
    fn validation_rejects_nonsense() {
        assert!(SamplingParams { top_p: 0.0, ..Default::default() }.validate().is_err());
        assert!(SamplingParams { temperature: -1.0, ..Default::default() }.validate().is_err());
        assert!(SamplingParams { temperature: f32::NAN, ..Default::default() }.validate().is_err());
        assert!(SamplingParams::default().validate().is_ok());
    }
}
