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
        self.draw(top_k(logits, k, logits.len()), None).unwrap_or(0)
    }

    /// How the next token can be chosen where the logits are, so that only an id, or the k best
    /// (id, logit) pairs and the log-partition, cross to the host; None when it needs every logit
    /// on the host (penalties, biases left to the sampler, a top-k past MAX_DEVICE_TOP_K, plain
    /// temperature sampling over the whole vocabulary). `logprobs`: the request wants the chosen
    /// token's log-probability and this many others'.
    pub fn device_choice(&self, logprobs: Option<usize>) -> Option<DeviceChoice> {
        let p = &self.params;
        if !self.leaves_logits_alone() {
            return None;
        }
        if p.temperature == 0.0 {
            return Some(match logprobs {
                None => DeviceChoice::Argmax,
                Some(top) => DeviceChoice::TopK { k: top.max(1), temperature: Some(1.0), cut: None },
            });
        }
        let (k, cut) = match p.top_k {
            1..=MAX_DEVICE_TOP_K => (p.top_k, None),
            0 if p.top_p < 1.0 || p.min_p > 0.0 => (MAX_DEVICE_TOP_K, Some(Cut { top_p: p.top_p, min_p: p.min_p })),
            _ => return None,
        };
        let k = k.max(logprobs.unwrap_or(0)).min(MAX_DEVICE_TOP_K);
        let temperature = (cut.is_some() || logprobs.is_some()).then_some(p.temperature);
        Some(DeviceChoice::TopK { k, temperature, cut })
    }

    /// Chooses the next token from the device's `k` best (id, logit) pairs, as `sample` would from
    /// every logit. `partition` (asked for by `device_choice`) tells what the candidates are of
    /// the whole distribution; None when a top-p or min-p cut does not fall among them (the
    /// backend then hands back every logit instead, see `Cut`).
    pub fn sample_candidates(&mut self, best: &[(u32, f32)], partition: Option<LogPartition>) -> Option<u32> {
        let limit = self.vocab_limit;
        let mut cands: Vec<(u32, f32)> = best.iter().copied().filter(|c| (c.0 as usize) < limit).collect();
        if self.params.temperature == 0.0 {
            return Some(cands.first().map_or(0, |c| c.0));
        }
        // The top-k draw normalises over its k; without top-k, over the whole distribution.
        let whole = match self.params.top_k {
            0 => Some(partition?.at_temperature),
            k => {
                cands.truncate(k);
                None
            }
        };
        self.draw(cands, whole)
    }

    /// Temperature, top-p and min-p over candidate (id, logit) pairs, then the seeded draw.
    /// `log_total`: log sum exp(l / T) of the whole distribution when `cands` are only its largest;
    /// None when they are all of it. None (and no draw) when the cut does not fall among them.
    fn draw(&mut self, mut cands: Vec<(u32, f32)>, log_total: Option<f32>) -> Option<u32> {
        if cands.is_empty() {
            return Some(0);
        }
        cands.iter_mut().for_each(|c| c.1 /= self.params.temperature);
        cands.sort_unstable_by(by_logit);
        let probs = top_p_min_p(&cands, self.params.top_p, self.params.min_p, log_total.map(f64::from))?;
        let total: f64 = probs.iter().sum();
        let mut u = self.rng.next_f64() * total;
        for (i, p) in probs.iter().enumerate() {
            if u < *p {
                return Some(cands[i].0);
            }
            u -= p;
        }
        Some(cands[probs.len() - 1].0)
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

/// How the backend that holds the logits makes (or prepares) the choice; see `Sampler::device_choice`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DeviceChoice {
    /// The argmax (greedy decoding).
    Argmax,
    /// The `k` largest (id, logit) pairs, with the log-partition at `temperature` when Some, and
    /// every logit instead when `cut` does not fall among the k.
    TopK { k: usize, temperature: Option<f32>, cut: Option<Cut> },
}

/// A top-p / min-p cut over the whole distribution, which the device's candidates can only serve
/// when it falls among them: with top-p 0.9 and a confident model, a handful of tokens; on a
/// flat distribution, more than MAX_DEVICE_TOP_K.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cut {
    pub top_p: f32,
    pub min_p: f32,
}

impl Cut {
    /// Whether the cut at `temperature` falls among `best` (largest first), given the log-partition.
    pub fn falls_within(&self, best: &[(u32, f32)], temperature: f32, partition: LogPartition) -> bool {
        if best.is_empty() {
            return true;
        }
        let scaled: Vec<(u32, f32)> = best.iter().map(|&(id, l)| (id, l / temperature)).collect();
        top_p_min_p(&scaled, self.top_p, self.min_p, Some(partition.at_temperature as f64)).is_some()
    }
}

/// What a choice among the k largest logits needs to know of all of them: log sum exp(l / T) (the
/// top-p cut's denominator) and log sum exp(l) (log-probabilities), over the allowed ids.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LogPartition {
    pub at_temperature: f32,
    pub raw: f32,
}

impl LogPartition {
    /// Over the first `limit` values (masked ones are -inf), in f64: the reference for the device's.
    pub fn of(values: &[f32], limit: usize, temperature: f32) -> Self {
        let values = &values[..limit.min(values.len())];
        let max = values.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
        if max == f64::NEG_INFINITY {
            return LogPartition { at_temperature: f32::NEG_INFINITY, raw: f32::NEG_INFINITY };
        }
        let t = temperature as f64;
        let (mut sum_t, mut sum_1) = (0.0f64, 0.0f64);
        for &v in values.iter().filter(|v| v.is_finite()) {
            sum_t += ((v as f64 - max) / t).exp();
            sum_1 += (v as f64 - max).exp();
        }
        LogPartition { at_temperature: (max / t + sum_t.ln()) as f32, raw: (max + sum_1.ln()) as f32 }
    }
}

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

    /// From the device's candidates (largest first, the chosen token among them) and the raw
    /// log-partition of every allowed logit.
    pub fn from_candidates(best: &[(u32, f32)], log_total: f32, token: u32, top: usize) -> Self {
        let logprob = |l: f32| (l as f64 - log_total as f64) as f32;
        let chosen = best.iter().find(|c| c.0 == token).map_or(f32::NEG_INFINITY, |c| logprob(c.1));
        TokenLogprob { token, logprob: chosen, top: best.iter().take(top).map(|&(id, l)| (id, logprob(l))).collect() }
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
/// The probabilities of the kept candidates (sorted, logits already divided by the temperature):
/// the smallest prefix reaching `top_p`, cut further by `min_p` of the largest. With `log_total`
/// the candidates are the largest of a distribution with that log-partition, and None means the
/// cut lies past them.
fn top_p_min_p(cands: &[(u32, f32)], top_p: f32, min_p: f32, log_total: Option<f64>) -> Option<Vec<f64>> {
    let max = cands[0].1 as f64;
    let mut probs: Vec<f64> = match log_total {
        Some(log_total) => cands.iter().map(|c| (c.1 as f64 - log_total).exp()).collect(),
        None => {
            let mut p: Vec<f64> = cands.iter().map(|c| (c.1 as f64 - max).exp()).collect();
            let total: f64 = p.iter().sum();
            p.iter_mut().for_each(|p| *p /= total);
            p
        }
    };
    let mut keep = probs.len();
    let mut settled = log_total.is_none();
    if top_p < 1.0 {
        let mut cum = 0.0;
        if let Some(i) = probs.iter().position(|p| {
            cum += p;
            cum >= top_p as f64
        }) {
            keep = i + 1;
            settled = true;
        }
    }
    if min_p > 0.0 {
        let floor = probs[0] * min_p as f64;
        let above = probs.iter().take_while(|p| **p >= floor).count().max(1);
        // Every candidate above the floor: more of the distribution may be too.
        if above < probs.len() || settled {
            keep = keep.min(above);
            settled = true;
        }
    }
    if !settled {
        return None;
    }
    probs.truncate(keep);
    Some(probs)
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

    /// What `device_choice` asks the device for, drawn from by `sample_candidates`.
    fn device_draw(s: &mut Sampler, l: &[f32], logprobs: Option<usize>) -> Option<(u32, Option<TokenLogprob>)> {
        match s.device_choice(logprobs)? {
            DeviceChoice::Argmax => Some((argmax(l), None)),
            DeviceChoice::TopK { k, temperature, cut } => {
                let best = top_k(l, k, l.len());
                let partition = temperature.map(|t| LogPartition::of(l, l.len(), t));
                if let (Some(cut), Some(t), Some(z)) = (cut, temperature, partition) {
                    if !cut.falls_within(&best, t, z) {
                        return None;
                    }
                }
                let token = s.sample_candidates(&best, partition).expect("a settled cut draws");
                let lp = logprobs.zip(partition).map(|(top, z)| TokenLogprob::from_candidates(&best, z.raw, token, top));
                Some((token, lp))
            }
        }
    }

    #[test]
    fn device_choices_draw_what_the_full_sampler_draws() {
        // A peaked distribution over 1000 ids: top-p 0.9 falls among the 64 best.
        let l: Vec<f32> = (0..1000).map(|i| 12.0 - (i as f32 * 0.37).sqrt() * 2.5 + ((i * 7919 % 100) as f32) * 0.01).collect();
        let cases = [(20, 0.95, 0.0), (1, 1.0, 0.0), (64, 0.8, 0.05), (5, 1.0, 0.0), (0, 0.9, 0.0), (0, 1.0, 0.2), (0, 0.9, 0.05)];
        for (k, top_p, min_p) in cases {
            for logprobs in [None, Some(0), Some(5)] {
                let p = SamplingParams { top_k: k, top_p, min_p, ..params(0.7) };
                let (mut full, mut fast) = (Sampler::new(p.clone(), usize::MAX), Sampler::new(p, usize::MAX));
                for _ in 0..50 {
                    let want = full.sample(&mut l.clone(), &[], 0);
                    let (got, lp) = device_draw(&mut fast, &l, logprobs).expect("served by the device");
                    assert_eq!(got, want, "top_k {k} top_p {top_p} min_p {min_p}");
                    if let Some(top) = logprobs {
                        let host = TokenLogprob::new(&l, l.len(), want, top);
                        let lp = lp.unwrap();
                        assert!((lp.logprob - host.logprob).abs() < 1e-5, "{lp:?} vs {host:?}");
                        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), host.top.iter().map(|t| t.0).collect::<Vec<_>>());
                    }
                }
            }
        }
        // Greedy with logprobs: the top candidate, and its log-probability.
        let mut greedy = Sampler::new(params(0.0), usize::MAX);
        let (t, lp) = device_draw(&mut greedy, &l, Some(3)).unwrap();
        assert_eq!((t, lp.unwrap().top.len()), (argmax(&l), 3));
        // A flat distribution: top-p 0.9 reaches past the 64 best, so every logit is needed.
        let flat: Vec<f32> = (0..1000).map(|i| (i % 13) as f32 * 0.01).collect();
        let mut s = Sampler::new(SamplingParams { top_p: 0.9, ..params(1.0) }, usize::MAX);
        assert!(device_draw(&mut s, &flat, None).is_none());
        let mut s = Sampler::new(SamplingParams { min_p: 0.5, ..params(1.0) }, usize::MAX);
        assert!(device_draw(&mut s, &flat, None).is_none(), "all 64 above the min-p floor: more may be");
        let penalised = SamplingParams { top_k: 20, repetition_penalty: 1.1, ..params(0.7) };
        assert_eq!(Sampler::new(penalised, usize::MAX).device_choice(None), None);
        assert_eq!(Sampler::new(params(0.7), usize::MAX).device_choice(None), None, "plain temperature: every logit");
        assert_eq!(Sampler::new(SamplingParams { top_k: 100, ..params(0.7) }, usize::MAX).device_choice(None), None);
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
        let kept = |top_p, min_p| top_p_min_p(&cands, top_p, min_p, None).unwrap().len();
        assert_eq!(kept(1.0, 0.0), 4);
        // p0 ≈ 0.644, p0 + p1 ≈ 0.881
        assert_eq!(kept(0.6, 0.0), 1);
        assert_eq!(kept(0.7, 0.0), 2);
        assert_eq!(kept(0.9, 0.0), 3);
        // min_p 0.3: p1/p0 = e^-1 ≈ 0.37 stays, p2/p0 ≈ 0.135 goes.
        assert_eq!(kept(1.0, 0.3), 2);
        // The first two of the same distribution, with its log-partition: the cut must fall among them.
        let log_total = (2f64.exp() + 1f64.exp() + 1.0 + (-1f64).exp()).ln();
        let first_two = top_p_min_p(&cands[..2], 0.7, 0.0, Some(log_total)).unwrap();
        assert!(first_two.len() == 2 && (first_two[0] - 0.644).abs() < 1e-3);
        assert_eq!(top_p_min_p(&cands[..2], 0.9, 0.0, Some(log_total)), None);
        assert_eq!(top_p_min_p(&cands[..2], 1.0, 0.3, Some(log_total)), None, "both above the floor: the third might be");
        assert_eq!(top_p_min_p(&cands[..2], 1.0, 0.5, Some(log_total)).unwrap().len(), 1);
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
        assert_eq!(Sampler::new(SamplingParams { top_k: 5, ..ban.clone() }, 3).device_choice(None), None);
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
