//! Measuring what a weight format costs in quality, as llama.cpp's perplexity tool does: a text is
//! tokenized and cut into chunks of `n_ctx` tokens, each chunk runs from an empty cache in one
//! pass, and the second half of each chunk is scored (its tokens then have at least n_ctx / 2 of
//! context). Perplexity is exp(mean negative log-likelihood of the next token); the KL divergence
//! compares a model's next-token distributions with a base model's at the same positions.
//! Everything is summed in f64 in position order: the same numbers for the same logits.

use crate::engine::Engine;
use crate::{Error, Result};

/// log softmax of one row of logits, in f64.
fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().fold(f64::NEG_INFINITY, |m, &l| m.max(l as f64));
    let log_total = max + row.iter().map(|&l| (l as f64 - max).exp()).sum::<f64>().ln();
    row.iter().map(|&l| l as f64 - log_total).collect()
}

/// Mean and its standard error over samples added one at a time.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Mean {
    sum: f64,
    sum_squares: f64,
    count: usize,
}

impl Mean {
    fn add(&mut self, x: f64) {
        self.sum += x;
        self.sum_squares += x * x;
        self.count += 1;
    }

    pub fn count(&self) -> usize {
        self.count
    }

    pub fn mean(&self) -> f64 {
        self.sum / self.count.max(1) as f64
    }

    /// Standard error of the mean (0 below two samples).
    pub fn std_error(&self) -> f64 {
        if self.count < 2 {
            return 0.0;
        }
        let n = self.count as f64;
        let variance = (self.sum_squares / n - self.mean().powi(2)).max(0.0) * n / (n - 1.0);
        (variance / n).sqrt()
    }
}

/// Negative log-likelihoods of the scored tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Perplexity {
    pub nll: Mean,
}

impl Perplexity {
    pub fn value(&self) -> f64 {
        self.nll.mean().exp()
    }

    /// The perplexity's standard error (the NLL's, carried through exp).
    pub fn std_error(&self) -> f64 {
        self.value() * self.nll.std_error()
    }
}

/// A model's next-token distributions against a base model's.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Divergence {
    pub base: Perplexity,
    pub model: Perplexity,
    /// KL(base || model) at every scored position, in position order.
    pub kld: Vec<f64>,
    /// Positions where both put the same token first.
    pub same_top: usize,
}

impl Divergence {
    pub fn mean_kld(&self) -> Mean {
        let mut m = Mean::default();
        self.kld.iter().for_each(|&k| m.add(k));
        m
    }

    /// The `q`-quantile (0..=1) of the per-position divergences (nearest rank).
    pub fn kld_quantile(&self, q: f64) -> f64 {
        let mut sorted = self.kld.clone();
        sorted.sort_by(f64::total_cmp);
        match sorted.len() {
            0 => 0.0,
            n => sorted[((q * (n - 1) as f64).round() as usize).min(n - 1)],
        }
    }

    /// Share of positions whose most likely token is the same for both models.
    pub fn top1_agreement(&self) -> f64 {
        self.same_top as f64 / self.kld.len().max(1) as f64
    }
}

/// The chunks a text of `n_tokens` tokens makes: `chunks` of them when given, all whole ones
/// otherwise; an error when not even one fits.
pub fn chunk_count(n_tokens: usize, n_ctx: usize, chunks: Option<usize>) -> Result<usize> {
    if n_ctx < 4 {
        return Err(Error::InvalidArgument(format!("a context of {n_ctx} tokens is too small to score (at least 4)")));
    }
    let whole = n_tokens / n_ctx;
    if whole == 0 {
        return Err(Error::InvalidArgument(format!(
            "the text is {n_tokens} tokens long, shorter than one chunk of {n_ctx}: use a longer text or a smaller --ctx"
        )));
    }
    Ok(chunks.map_or(whole, |c| c.min(whole)))
}

/// The positions of a chunk whose next token is scored: the second half, as llama.cpp.
fn scored(n_ctx: usize) -> std::ops::Range<usize> {
    n_ctx / 2..n_ctx - 1
}

/// Every position's logits of one chunk, checked for shape.
fn chunk_logits(engine: &mut Engine, chunk: &[u32]) -> Result<(Vec<f32>, usize)> {
    let logits = engine.logits_all(chunk)?;
    let vocab = logits.len() / chunk.len().max(1);
    if vocab == 0 || logits.len() != vocab * chunk.len() {
        return Err(Error::Device(format!("{} logits for a chunk of {} tokens", logits.len(), chunk.len())));
    }
    Ok((logits, vocab))
}

/// Perplexity of `tokens` cut into `chunks` chunks of `n_ctx`; `on_chunk` sees the running value
/// after each chunk (llama.cpp prints it as `[i]ppl`).
pub fn perplexity(
    engine: &mut Engine,
    tokens: &[u32],
    n_ctx: usize,
    chunks: usize,
    on_chunk: &mut dyn FnMut(usize, &Perplexity),
) -> Result<Perplexity> {
    let mut ppl = Perplexity::default();
    for (i, chunk) in tokens.chunks_exact(n_ctx).take(chunks).enumerate() {
        let (logits, vocab) = chunk_logits(engine, chunk)?;
        for pos in scored(n_ctx) {
            let row = &logits[pos * vocab..(pos + 1) * vocab];
            let target = chunk[pos + 1] as usize;
            let lp = log_softmax(row);
            ppl.nll.add(-lp.get(target).copied().unwrap_or(f64::NEG_INFINITY));
        }
        on_chunk(i + 1, &ppl);
    }
    Ok(ppl)
}

/// `model` against `base` on the same chunks: both perplexities, KL(base || model) at every scored
/// position and the top-1 agreement. The models must share a vocabulary.
pub fn divergence(
    base: &mut Engine,
    model: &mut Engine,
    tokens: &[u32],
    n_ctx: usize,
    chunks: usize,
    on_chunk: &mut dyn FnMut(usize, &Divergence),
) -> Result<Divergence> {
    let mut d = Divergence::default();
    for (i, chunk) in tokens.chunks_exact(n_ctx).take(chunks).enumerate() {
        let (p_logits, vocab) = chunk_logits(base, chunk)?;
        let (q_logits, q_vocab) = chunk_logits(model, chunk)?;
        if q_vocab != vocab {
            return Err(Error::InvalidArgument(format!("the base model has {vocab} logits a position, the model {q_vocab}")));
        }
        for pos in scored(n_ctx) {
            let (p_row, q_row) = (&p_logits[pos * vocab..(pos + 1) * vocab], &q_logits[pos * vocab..(pos + 1) * vocab]);
            let (lp, lq) = (log_softmax(p_row), log_softmax(q_row));
            let target = chunk[pos + 1] as usize;
            d.base.nll.add(-lp[target]);
            d.model.nll.add(-lq[target]);
            d.kld.push(lp.iter().zip(&lq).map(|(a, b)| a.exp() * (a - b)).sum::<f64>().max(0.0));
            if crate::sampling::argmax(p_row) == crate::sampling::argmax(q_row) {
                d.same_top += 1;
            }
        }
        on_chunk(i + 1, &d);
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statistics_by_hand() {
        let mut m = Mean::default();
        [1.0, 2.0, 3.0, 4.0].iter().for_each(|&x| m.add(x));
        assert_eq!(m.mean(), 2.5);
        // Sample variance 5/3; standard error sqrt(5/3 / 4).
        assert!((m.std_error() - (5.0f64 / 12.0).sqrt()).abs() < 1e-12);
        // Uniform over 4 tokens: every NLL is ln 4, perplexity 4.
        let lp = log_softmax(&[0.5; 4]);
        assert!(lp.iter().all(|&l| (l + 4f64.ln()).abs() < 1e-12));
        let d = Divergence { kld: vec![0.3, 0.1, 0.2, 0.0], same_top: 3, ..Default::default() };
        assert_eq!((d.kld_quantile(0.0), d.kld_quantile(1.0), d.kld_quantile(0.5)), (0.0, 0.3, 0.2));
        assert_eq!(d.top1_agreement(), 0.75);
        assert_eq!(chunk_count(1000, 256, None).unwrap(), 3);
        assert_eq!(chunk_count(1000, 256, Some(2)).unwrap(), 2);
        assert!(chunk_count(100, 256, None).is_err());
        assert_eq!(scored(8), 4..7);
    }
}
