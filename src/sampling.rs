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

    /// Whether a bias or a penalty may change some logit at some step.
    pub fn adjusts_logits(&self) -> bool {
        self.repetition_penalty != 1.0 || self.presence_penalty != 0.0 || self.frequency_penalty != 0.0 || !self.logit_bias.is_empty()
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

    /// Uniform in [0, 1), exactly representable in f32 (a device's draw takes it as is).
    pub fn next_f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u32 << 24) as f32
    }
}

pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
    /// Ids at or above this are never chosen (the model's vocab is often padded past the tokenizer's).
    vocab_limit: usize,
    /// The request's biases and penalties, kept up to date as tokens are accepted.
    adjustments: Adjustments,
    /// The backend adds `adjustments` to the logits itself (see `adjust_on_device`).
    adjusted_elsewhere: bool,
}

impl Sampler {
    /// `prompt`: the tokens the repetition penalty counts as seen before the output.
    pub fn new(params: SamplingParams, vocab_limit: usize, prompt: &[u32]) -> Self {
        let seed = params.seed.unwrap_or_else(entropy_seed);
        let adjustments = Adjustments::new(&params, prompt);
        Sampler { rng: Rng::new(seed), params, vocab_limit, adjustments, adjusted_elsewhere: false }
    }

    /// From now on the backend adds the adjustments (biases, penalties) where the logits are;
    /// `sample` no longer does.
    pub fn adjust_on_device(&mut self) {
        self.adjusted_elsewhere = true;
    }

    /// The biases and penalties for the next choice; see `Adjustments`.
    pub fn adjustments(&self) -> &Adjustments {
        &self.adjustments
    }

    /// Records the chosen token (it is now part of the output the penalties look at).
    pub fn accept(&mut self, token: u32) {
        self.adjustments.accept(token);
    }

    /// Ids at or above this are never chosen.
    pub fn vocab_limit(&self) -> usize {
        self.vocab_limit
    }

    /// The uniform number a device's draw over the whole distribution takes (see `DeviceChoice::Draw`).
    pub fn uniform(&mut self) -> f32 {
        self.rng.next_f32()
    }

    /// Chooses the next token from every logit (the adjustments added here unless the backend added
    /// them).
    pub fn sample(&mut self, logits: &mut [f32]) -> u32 {
        let limit = self.vocab_limit.min(logits.len());
        let logits = &mut logits[..limit];
        if !self.adjusted_elsewhere {
            self.adjustments.apply(logits);
        }
        if self.params.temperature == 0.0 {
            return argmax(logits);
        }
        if self.draws_from_everything() {
            let u = self.uniform();
            return draw_in_order(logits, logits.len(), self.params.temperature, u);
        }
        let k = if self.params.top_k > 0 { self.params.top_k } else { logits.len() };
        self.draw(top_k(logits, k, logits.len()), None).unwrap_or(0)
    }

    /// Plain temperature sampling: no top-k, top-p or min-p cut, so the draw walks the whole
    /// distribution in id order (no sort).
    fn draws_from_everything(&self) -> bool {
        let p = &self.params;
        p.temperature > 0.0 && p.top_k == 0 && p.top_p >= 1.0 && p.min_p <= 0.0
    }

    /// How the next token can be chosen where the logits are, so that only an id, or the k best
    /// (id, logit) pairs and the log-partition, cross to the host; None when it needs every logit
    /// on the host (a top-k past MAX_DEVICE_TOP_K, logprobs of a request whose logits are
    /// adjusted). `logprobs`: the request wants the chosen token's log-probability and this many
    /// others'. The adjustments, when any, must then be added where the logits are.
    pub fn device_choice(&self, logprobs: Option<usize>) -> Option<DeviceChoice> {
        let p = &self.params;
        // Log-probabilities are of the model's own distribution, which adjusted logits are not.
        if logprobs.is_some() && p.adjusts_logits() {
            return None;
        }
        if p.temperature == 0.0 {
            return Some(match logprobs {
                None => DeviceChoice::Argmax,
                Some(top) => DeviceChoice::TopK { k: top.max(1), temperature: Some(1.0), cut: None },
            });
        }
        if self.draws_from_everything() && logprobs.is_none() {
            return Some(DeviceChoice::Draw { temperature: p.temperature });
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
}

/// What a request does to the logits before the choice, token by token: its `logit_bias`, then
/// the repetition penalty (tokens of prompt or output), then the presence and frequency penalties
/// (tokens of the output). One entry per id, so a device adds them all at once.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Adjustment {
    pub id: u32,
    pub bias: f32,
    /// Divides a positive logit, multiplies a negative one; 1 leaves it.
    pub repetition: f32,
    /// Subtracted last: presence + frequency × occurrences in the output.
    pub subtract: f32,
}

impl Adjustment {
    /// The logit after the adjustment: the same f32 operations on every backend.
    pub fn apply(&self, logit: f32) -> f32 {
        let mut l = logit + self.bias;
        if self.repetition != 1.0 {
            l = if l > 0.0 { l / self.repetition } else { l * self.repetition };
        }
        l - self.subtract
    }
}

/// A request's adjustments, updated as each output token is accepted (an entry changes, or one
/// is added), so a long prompt is counted once.
#[derive(Debug, Clone, Default)]
pub struct Adjustments {
    list: Vec<Adjustment>,
    index: std::collections::HashMap<u32, usize>,
    /// Occurrences of each listed id in the output.
    counts: Vec<u32>,
    repetition: f32,
    presence: f32,
    frequency: f32,
    /// Bumped at every change: a backend re-sends the list when it differs from what it holds.
    version: u64,
}

impl Adjustments {
    pub fn new(params: &SamplingParams, prompt: &[u32]) -> Self {
        let mut a = Adjustments {
            repetition: params.repetition_penalty,
            presence: params.presence_penalty,
            frequency: params.frequency_penalty,
            ..Default::default()
        };
        for &(id, bias) in &params.logit_bias {
            let i = a.entry(id);
            a.list[i].bias += bias;
        }
        if a.repetition != 1.0 {
            for &t in prompt {
                let i = a.entry(t);
                a.list[i].repetition = a.repetition;
            }
        }
        a
    }

    fn entry(&mut self, id: u32) -> usize {
        let list = &mut self.list;
        let counts = &mut self.counts;
        *self.index.entry(id).or_insert_with(|| {
            list.push(Adjustment { id, bias: 0.0, repetition: 1.0, subtract: 0.0 });
            counts.push(0);
            list.len() - 1
        })
    }

    /// An output token: seen (repetition), and once more in the output (presence, frequency).
    pub fn accept(&mut self, token: u32) {
        let penalises = self.repetition != 1.0 || self.presence != 0.0 || self.frequency != 0.0;
        if !penalises {
            return;
        }
        let i = self.entry(token);
        self.counts[i] += 1;
        let e = &mut self.list[i];
        e.repetition = self.repetition;
        e.subtract = self.presence + self.frequency * self.counts[i] as f32;
        self.version += 1;
    }

    pub fn list(&self) -> &[Adjustment] {
        &self.list
    }

    /// Changes at every accepted token that changed the list.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Adds them to `logits` (ids past its end are ignored).
    pub fn apply(&self, logits: &mut [f32]) {
        for a in &self.list {
            if let Some(l) = logits.get_mut(a.id as usize) {
                *l = a.apply(*l);
            }
        }
    }
}

/// The token a uniform `u` in [0, 1) picks from the softmax at `temperature` of the first `limit`
/// values (-inf ones left out), walking the ids in order: the first id whose cumulative probability
/// passes u (the last finite one when rounding leaves u past them all). f64: the reference for
/// the device's draw, which walks in the same order.
pub fn draw_in_order(values: &[f32], limit: usize, temperature: f32, u: f32) -> u32 {
    let values = &values[..limit.min(values.len())];
    let max = values.iter().filter(|v| v.is_finite()).fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    if max == f64::NEG_INFINITY {
        return 0;
    }
    let t = temperature as f64;
    let weight = |v: f32| if v.is_finite() { ((v as f64 - max) / t).exp() } else { 0.0 };
    let total: f64 = values.iter().map(|&v| weight(v)).sum();
    let mut rest = u as f64 * total;
    let mut last = 0;
    for (i, &v) in values.iter().enumerate() {
        let w = weight(v);
        if w > 0.0 {
            if rest < w {
                return i as u32;
            }
            rest -= w;
            last = i;
        }
    }
    last as u32
}

/// The most candidates a GPU selects for top-k sampling (TOPK_MAX in kernels/sampling.hip).
pub const MAX_DEVICE_TOP_K: usize = 64;

/// How the backend that holds the logits makes (or prepares) the choice; see `Sampler::device_choice`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DeviceChoice {
    /// The argmax (greedy decoding).
    Argmax,
    /// A draw from the whole distribution at `temperature` with a uniform number from the
    /// sampler (`Sampler::uniform`), as `draw_in_order` makes it.
    Draw { temperature: f32 },
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
        let mut s = Sampler::new(p, usize::MAX, &[]);
        (0..n).map(|_| s.sample(&mut logits())).collect()
    }

    /// What `device_choice` asks the device for, drawn from by `sample_candidates`.
    fn device_draw(s: &mut Sampler, l: &[f32], logprobs: Option<usize>) -> Option<(u32, Option<TokenLogprob>)> {
        match s.device_choice(logprobs)? {
            DeviceChoice::Argmax => Some((argmax(l), None)),
            DeviceChoice::Draw { temperature } => Some((draw_in_order(l, l.len(), temperature, s.uniform()), None)),
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
        let cases = [(20, 0.95, 0.0), (1, 1.0, 0.0), (64, 0.8, 0.05), (5, 1.0, 0.0), (0, 0.9, 0.0), (0, 1.0, 0.2), (0, 0.9, 0.05), (0, 1.0, 0.0)];
        for (k, top_p, min_p) in cases {
            // A plain temperature draw with logprobs needs every logit (checked below).
            let with_logprobs: &[Option<usize>] = if (k, top_p, min_p) == (0, 1.0, 0.0) { &[None] } else { &[None, Some(0), Some(5)] };
            for &logprobs in with_logprobs {
                let p = SamplingParams { top_k: k, top_p, min_p, ..params(0.7) };
                let (mut full, mut fast) = (Sampler::new(p.clone(), usize::MAX, &[]), Sampler::new(p, usize::MAX, &[]));
                for _ in 0..50 {
                    let want = full.sample(&mut l.clone());
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
        let mut greedy = Sampler::new(params(0.0), usize::MAX, &[]);
        let (t, lp) = device_draw(&mut greedy, &l, Some(3)).unwrap();
        assert_eq!((t, lp.unwrap().top.len()), (argmax(&l), 3));
        // A flat distribution: top-p 0.9 reaches past the 64 best, so every logit is needed.
        let flat: Vec<f32> = (0..1000).map(|i| (i % 13) as f32 * 0.01).collect();
        let mut s = Sampler::new(SamplingParams { top_p: 0.9, ..params(1.0) }, usize::MAX, &[]);
        assert!(device_draw(&mut s, &flat, None).is_none());
        let mut s = Sampler::new(SamplingParams { min_p: 0.5, ..params(1.0) }, usize::MAX, &[]);
        assert!(device_draw(&mut s, &flat, None).is_none(), "all 64 above the min-p floor: more may be");
        // Adjusted logits: the device adds the adjustments, but has no log-probabilities of the model's own.
        let penalised = SamplingParams { top_k: 20, repetition_penalty: 1.1, ..params(0.7) };
        assert!(Sampler::new(penalised.clone(), usize::MAX, &[3]).device_choice(None).is_some());
        assert_eq!(Sampler::new(penalised.clone(), usize::MAX, &[3]).device_choice(Some(2)), None);
        assert_eq!(Sampler::new(SamplingParams { top_k: 100, ..params(0.7) }, usize::MAX, &[]).device_choice(None), None);
        assert_eq!(Sampler::new(params(0.7), usize::MAX, &[]).device_choice(Some(1)), None, "a whole-distribution draw with logprobs");
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
        let mut s = Sampler::new(params(0.0), 4, &[]);
        let l = vec![0.0, 1.0, 2.0, 3.0, 100.0];
        assert_eq!(s.sample(&mut l.clone()), 3);
        let mut s = Sampler::new(params(5.0), 4, &[]);
        for _ in 0..100 {
            assert!(s.sample(&mut l.clone()) < 4);
        }
    }

    #[test]
    fn logit_bias_moves_and_bans_tokens() {
        let base = vec![5.0, 4.9, 0.0];
        let mut s = Sampler::new(SamplingParams { logit_bias: vec![(2, 10.0)], ..params(0.0) }, 3, &[]);
        assert_eq!(s.sample(&mut base.clone()), 2);
        let ban = SamplingParams { logit_bias: vec![(0, -60.0), (0, -40.0)], ..params(1.0) };
        assert_eq!(Adjustments::new(&ban, &[]).list(), &[Adjustment { id: 0, bias: -100.0, repetition: 1.0, subtract: 0.0 }]);
        let mut s = Sampler::new(ban, 3, &[]);
        for _ in 0..50 {
            assert_ne!(s.sample(&mut base.clone()), 0);
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
        let mut s = Sampler::new(SamplingParams { repetition_penalty: 1.5, ..params(0.0) }, 3, &[0]);
        assert_eq!(s.sample(&mut base.clone()), 1);
        // Presence and frequency penalties ignore the prompt.
        let mut s = Sampler::new(SamplingParams { presence_penalty: 0.5, ..params(0.0) }, 3, &[0]);
        assert_eq!(s.sample(&mut base.clone()), 0);
        s.accept(0);
        assert_eq!(s.sample(&mut base.clone()), 1);
        let mut s = Sampler::new(SamplingParams { frequency_penalty: 0.05, ..params(0.0) }, 3, &[]);
        s.accept(0);
        assert_eq!(s.sample(&mut base.clone()), 0, "0.05 lower: still the largest");
        s.accept(0);
        s.accept(0);
        assert_eq!(s.sample(&mut base.clone()), 1);
    }

    /// The adjustments as the sampler used to make them: from the whole history at every step.
    fn penalised_from_history(p: &SamplingParams, logits: &mut [f32], history: &[u32], output_start: usize) {
        for &(id, bias) in &p.logit_bias {
            logits[id as usize] += bias;
        }
        let mut seen = std::collections::HashSet::new();
        for &t in history {
            if p.repetition_penalty != 1.0 && seen.insert(t) {
                let l = &mut logits[t as usize];
                *l = if *l > 0.0 { *l / p.repetition_penalty } else { *l * p.repetition_penalty };
            }
        }
        let mut counts = std::collections::HashMap::<u32, u32>::new();
        for &t in &history[output_start..] {
            *counts.entry(t).or_default() += 1;
        }
        for (t, n) in counts {
            logits[t as usize] -= p.presence_penalty + p.frequency_penalty * n as f32;
        }
    }

    #[test]
    fn adjustments_kept_up_to_date_equal_the_history_recounted() {
        let mut rng = Rng::new(5);
        let p = SamplingParams {
            repetition_penalty: 1.3,
            presence_penalty: 0.4,
            frequency_penalty: 0.15,
            logit_bias: vec![(3, 2.0), (40, -7.5)],
            ..params(0.8)
        };
        let prompt: Vec<u32> = (0..30).map(|_| (rng.next_u64() % 64) as u32).collect();
        let mut a = Adjustments::new(&p, &prompt);
        let mut history = prompt.clone();
        for step in 0..40 {
            let base: Vec<f32> = (0..64).map(|_| rng.next_f32() * 8.0 - 4.0).collect();
            let (mut want, mut got) = (base.clone(), base.clone());
            penalised_from_history(&p, &mut want, &history, prompt.len());
            a.apply(&mut got);
            assert_eq!(got, want, "step {step}");
            let before = a.version();
            let token = (rng.next_u64() % 64) as u32;
            a.accept(token);
            history.push(token);
            assert_ne!(a.version(), before);
        }
        let ids: std::collections::HashSet<u32> = a.list().iter().map(|e| e.id).collect();
        assert_eq!(ids.len(), a.list().len(), "one entry per id");
    }

    #[test]
    fn a_draw_in_order_follows_the_softmax() {
        let l = [1.0f32, f32::NEG_INFINITY, 3.0, 2.0, 9.0];
        // At temperature 1 over the first four: weights e^1, 0, e^3, e^2.
        let total = 1f64.exp() + 3f64.exp() + 2f64.exp();
        let at = |u: f64| draw_in_order(&l, 4, 1.0, u as f32);
        assert_eq!(at(0.0), 0);
        assert_eq!(at(1f64.exp() / total - 1e-3), 0);
        assert_eq!(at(1f64.exp() / total + 1e-3), 2);
        assert_eq!(at((1f64.exp() + 3f64.exp()) / total + 1e-3), 3);
        assert_eq!(at(0.999_999), 3);
        assert_eq!(draw_in_order(&[f32::NEG_INFINITY; 3], 3, 1.0, 0.5), 0);
        // The sampler draws that way for plain temperature: frequencies follow the probabilities.
        let mut s = Sampler::new(params(1.0), 4, &[]);
        let mut hits = [0usize; 5];
        for _ in 0..20_000 {
            hits[s.sample(&mut l.to_vec()) as usize] += 1;
        }
        assert_eq!((hits[1], hits[4]), (0, 0));
        assert!((hits[2] as f64 / 20_000.0 - 3f64.exp() / total).abs() < 0.02, "{hits:?}");
    }

    #[test]
    fn validation_rejects_nonsense() {
        assert!(SamplingParams { top_p: 0.0, ..Default::default() }.validate().is_err());
        assert!(SamplingParams { temperature: -1.0, ..Default::default() }.validate().is_err());
        assert!(SamplingParams { temperature: f32::NAN, ..Default::default() }.validate().is_err());
        assert!(SamplingParams::default().validate().is_ok());
    }
}
