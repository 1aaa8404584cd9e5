//! `atlas perplexity` and `atlas kld`: what a weight format costs in quality, measured on a text
//! (see atlas::eval), printed as llama.cpp's perplexity tool prints it, or as JSON.

use std::path::{Path, PathBuf};

use atlas::eval::{self, Divergence, Perplexity};
use atlas::{Engine, EngineOptions, Error, Result};
use clap::Args;
use serde_json::json;

use crate::{load_engine, LoadArgs};

#[derive(Args, Clone)]
pub struct TextArgs {
    /// The text to score (UTF-8), e.g. wikitext-2's wiki.test.raw.
    #[arg(short, long)]
    file: PathBuf,
    /// Tokens per chunk; the second half of each chunk is scored.
    #[arg(long = "ctx", default_value_t = 512)]
    n_ctx: usize,
    /// Score only the first N chunks (default: every whole chunk of the text).
    #[arg(long)]
    chunks: Option<usize>,
    /// Print one JSON object at the end instead of the running values and the summary.
    #[arg(long)]
    json: bool,
}

impl TextArgs {
    /// The text's tokens, by `engine`'s tokenizer, and the number of chunks to score.
    fn tokens(&self, engine: &Engine) -> Result<(Vec<u32>, usize)> {
        let text = std::fs::read_to_string(&self.file).map_err(|e| Error::io(&self.file, e))?;
        let tokens = engine.tokenizer()?.encode(&text)?;
        let chunks = eval::chunk_count(tokens.len(), self.n_ctx, self.chunks)?;
        if !self.json {
            eprintln!("{}: {} tokens, {chunks} chunks of {}", self.file.display(), tokens.len(), self.n_ctx);
        }
        Ok((tokens, chunks))
    }

    /// Loads a model with room for one chunk.
    fn load(&self, load: &LoadArgs, model: Option<PathBuf>) -> Result<Engine> {
        let mut opts: EngineOptions = load.options_for(model)?;
        opts.ctx_size = Some(opts.ctx_size.unwrap_or(self.n_ctx).max(self.n_ctx));
        load_engine(&opts)
    }
}

fn ppl_json(p: &Perplexity) -> serde_json::Value {
    json!({"ppl": p.value(), "ppl_error": p.std_error(), "tokens": p.nll.count()})
}

pub fn perplexity(load: &LoadArgs, text: &TextArgs) -> Result<()> {
    let mut engine = text.load(load, None)?;
    let (tokens, chunks) = text.tokens(&engine)?;
    let started = std::time::Instant::now();
    let ppl = eval::perplexity(&mut engine, &tokens, text.n_ctx, chunks, &mut |i, p| {
        if !text.json {
            eprint!("[{i}]{:.4},", p.value());
        }
    })?;
    if text.json {
        println!("{}", ppl_json(&ppl));
    } else {
        eprintln!();
        println!("Final estimate: PPL = {:.4} +/- {:.5} ({} tokens scored, {:.1} s)", ppl.value(), ppl.std_error(), ppl.nll.count(), started.elapsed().as_secs_f64());
    }
    Ok(())
}

pub fn kld(load: &LoadArgs, base: &Path, text: &TextArgs) -> Result<()> {
    let mut base_engine = text.load(load, Some(base.to_path_buf()))?;
    let mut engine = text.load(load, None)?;
    let (tokens, chunks) = text.tokens(&base_engine)?;
    if engine.tokenizer()?.encode("The quick brown fox, 123.")? != base_engine.tokenizer()?.encode("The quick brown fox, 123.")? {
        return Err(Error::InvalidArgument("the two models tokenize differently: their logits cannot be compared".into()));
    }
    let d = eval::divergence(&mut base_engine, &mut engine, &tokens, text.n_ctx, chunks, &mut |i, d| {
        if !text.json {
            eprint!("[{i}]{:.6},", d.mean_kld().mean());
        }
    })?;
    print_divergence(&d, text.json);
    Ok(())
}

fn print_divergence(d: &Divergence, as_json: bool) {
    let kld = d.mean_kld();
    if as_json {
        let v = json!({
            "base": ppl_json(&d.base), "model": ppl_json(&d.model),
            "kld_mean": kld.mean(), "kld_error": kld.std_error(), "kld_median": d.kld_quantile(0.5),
            "kld_p99": d.kld_quantile(0.99), "kld_max": d.kld_quantile(1.0), "top1_agreement": d.top1_agreement(),
            "positions": d.kld.len(),
        });
        println!("{v}");
        return;
    }
    eprintln!();
    println!("PPL(base)          {:10.4} +/- {:.5}", d.base.value(), d.base.std_error());
    println!("PPL(model)         {:10.4} +/- {:.5}", d.model.value(), d.model.std_error());
    println!("ln(PPL ratio)      {:10.6}", d.model.nll.mean() - d.base.nll.mean());
    println!("Mean KLD           {:10.6} +/- {:.6}", kld.mean(), kld.std_error());
    println!("Median KLD         {:10.6}", d.kld_quantile(0.5));
    println!("99.0% KLD          {:10.6}", d.kld_quantile(0.99));
    println!("Maximum KLD        {:10.6}", d.kld_quantile(1.0));
    println!("Same top p         {:10.3} %  ({} positions)", 100.0 * d.top1_agreement(), d.kld.len());
}
