//! `atlas bench`: prefill and decode throughput, printed like llama-bench.

use std::time::Instant;

use atlas::grammar::{GrammarSpec, GrammarVocab};
use atlas::sampling::Rng;
use atlas::tokenizer::Tokenizer;
use atlas::{Engine, EngineOptions, Error, Result};
use clap::Args;

use crate::LoadArgs;

#[derive(Args)]
pub struct BenchArgs {
    #[command(flatten)]
    load: LoadArgs,
    /// Benchmark random weights of a real model shape instead of --model, generated on the device:
    /// qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b, or the Qwen3.6 hybrids qwen3.6-27b and
    /// qwen3.6-35b-a3b (Gated DeltaNet; the second with 256 experts).
    #[arg(long)]
    synthetic: Option<String>,
    /// Weight format of the synthetic model's projections: bf16, fp8 (E4M3 with a scale per
    /// 128×128 block, as Qwen's FP8 checkpoints), or a GGML block format by its GGUF type name
    /// (q8_0, q4_0, q4_1, q4_k, q5_k, q6_k, iq4_nl, iq4_xs, mxfp4, nvfp4, q4_0_rocmfp4,
    /// q4_0_rocmfp4_fast: random blocks made on the host for every matrix but the embeddings,
    /// lm_head too, packed on upload as a GGUF's are).
    #[arg(long, default_value = "bf16")]
    format: String,
    /// Prompt lengths to prefill (comma-separated); 0 skips prefill tests.
    #[arg(short = 'p', long, value_delimiter = ',', default_value = "512")]
    n_prompt: Vec<usize>,
    /// Tokens to generate one by one (comma-separated); 0 skips decode tests.
    #[arg(short = 'n', long, value_delimiter = ',', default_value = "128")]
    n_gen: Vec<usize>,
    /// Context already in the cache before each test (comma-separated).
    #[arg(short = 'd', long, value_delimiter = ',', default_value = "0")]
    depth: Vec<usize>,
    /// Repetitions of each test; the table shows mean ± standard deviation.
    #[arg(short = 'r', long, default_value_t = 3)]
    repetitions: usize,
    /// Also run each decode test under a JSON-object grammar (structured output): every step
    /// computes the grammar's mask on the CPU, hands it to the device and feeds back the token
    /// chosen under it ("tg128 json"); the plain test then feeds back its own choices too.
    #[arg(long)]
    json: bool,
    /// tokenizer.json for --json with a synthetic model (which has none of its own).
    #[arg(long)]
    tokenizer: Option<std::path::PathBuf>,
    /// Also time follow-up turns (each depth > 0 and prompt length): a conversation of d tokens
    /// is answered, then n more tokens come after it ("pp{n} @ d{d} turn"), also after another
    /// conversation of d tokens took the cache ("... turn after other"): the time to the first
    /// token as prompt tokens per second, beside "pp{n} @ d{d}" (the same n tokens on a cache
    /// already there). The prefix cache is what keeps the second from costing d tokens again.
    #[arg(long)]
    turns: bool,
    /// Also time decode in steps of K tokens whose every position's greedy choice is made, as
    /// speculative decoding checks K - 1 drafted tokens ("tg{n} verify{K}", tokens per second
    /// counting all K; comparing it with K x tg{n} gives a step's cost against a single token's).
    #[arg(long, value_name = "K")]
    verify: Option<usize>,
    /// Also time greedy generation through the engine, as a server runs it ("tg{n} generate":
    /// decode tokens per second after a prompt of d tokens, or 64): with --draft-max, the drafted
    /// and confirmed tokens are printed after the table.
    #[arg(long)]
    generate: bool,
}

/// Decode tokens per second of `streams` greedy generations of `n` tokens run at once, one per
/// engine, each after a prompt of `prompt_len` random tokens: all tokens over the time from the
/// first decode step to the last answer. Each engine reads its prompt first (a one-token request,
/// whose cache the timed request reuses but for its last token), so that the streams decode
/// together from the start: the figure is their decode rate, not the others' prompts read
/// between one stream's steps.
fn streams_rate(engines: &mut [Engine], prompts: Vec<Vec<u32>>, n: usize) -> Result<f64> {
    let ready = std::sync::Barrier::new(engines.len());
    let results: Vec<Result<(Instant, Instant, usize)>> = std::thread::scope(|s| {
        let running: Vec<_> = engines
            .iter_mut()
            .zip(prompts)
            .map(|(engine, prompt)| {
                let ready = &ready;
                s.spawn(move || {
                    // Every thread reaches the barrier, whatever its warm-up gave.
                    let warm = engine.generate_raw(&one_token(prompt.clone()));
                    ready.wait();
                    warm?;
                    let begin = Instant::now();
                    let out = engine.generate_raw(&atlas::GenerateRequest { max_tokens: Some(n), ..one_token(prompt) })?;
                    let decoding = begin + std::time::Duration::from_secs_f64(out.prompt_ms / 1e3);
                    Ok((decoding, Instant::now(), out.tokens.len()))
                })
            })
            .collect();
        running.into_iter().map(|t| t.join().unwrap_or_else(|_| Err(Error::Device("a stream panicked".into())))).collect()
    });
    let results = results.into_iter().collect::<Result<Vec<_>>>()?;
    let first = results.iter().map(|r| r.0).min().ok_or_else(|| Error::InvalidArgument("no streams".into()))?;
    let last = results.iter().map(|r| r.1).max().unwrap_or(first);
    let tokens: usize = results.iter().map(|r| r.2).sum();
    Ok(tokens as f64 / last.duration_since(first).as_secs_f64())
}

#[derive(Clone, Copy)]
enum Test {
    Step(Step),
    /// A follow-up turn through the engine's generate, as a server runs it; `after_other`: with
    /// another conversation in between.
    Turn { after_other: bool },
    /// Greedy generation through the engine's generate.
    Generate,
    /// That many generations at once, one per sequence slot (`--parallel`).
    Streams,
}

/// Tests that drive the model step by step.
#[derive(Clone, Copy, PartialEq)]
enum Step {
    Prefill,
    /// Random tokens fed in, each next one chosen on the device (and not used).
    Decode,
    /// Each chosen token fed back in, as generation runs.
    FedBack,
    /// The same under a JSON-object grammar's mask.
    Json,
    /// Steps of K tokens, a choice after each (checking drafts).
    Verify(usize),
}

pub fn run(args: &BenchArgs) -> Result<()> {
    if args.repetitions == 0 {
        return Err(Error::InvalidArgument("--repetitions must be at least 1".into()));
    }
    let longest = args.depth.iter().max().unwrap_or(&0)
        + args.n_prompt.iter().chain(&args.n_gen).max().unwrap_or(&0)
        // A turn's answer token; the shortest prompt a generate test uses.
        + usize::from(args.turns)
        + if args.generate || args.load.parallel_or(1) > 1 { 64 } else { 0 };
    let engine = match &args.synthetic {
        Some(name) => {
            let mut opts = args.load.options_without_model()?;
            opts.ctx_size = Some(opts.ctx_size.unwrap_or(0).max(longest));
            let start = Instant::now();
            let engine = Engine::load_synthetic(name, &args.format, &opts, &mut |_| {})?;
            eprintln!("made {name} on {} in {:.1} s", engine.report().device, start.elapsed().as_secs_f64());
            engine
        }
        None => {
            let mut opts: EngineOptions = args.load.options()?;
            opts.ctx_size = Some(opts.ctx_size.unwrap_or(0).max(longest));
            crate::load_engine(&opts)?
        }
    };
    // With --parallel N the tests run on the first slot's engine; "tg{n} xN" on all of them.
    let mut engines = engine.split()?;
    let streams = engines.len();
    let mut engine = engines.remove(0);
    let vocab = engine.config().vocab_size as u64;
    let mut rng = Rng::new(1);
    let mut random_tokens = |n: usize| -> Vec<u32> { (0..n).map(|_| (rng.next_u64() % vocab) as u32).collect() };

    let model = format!("{} {}L/{}H", engine.report().architecture, engine.config().num_layers, engine.config().hidden_size);
    let backend = engine.report().device.clone();
    println!("| {:<24} | {:<24} | {:>14} | {:>20} |", "model", "backend", "test", "t/s");
    println!("| {:-<24} | {:-<24} | {:->14} | {:->20} |", "", "", "", "");
    let grammar = match (args.json, &args.tokenizer) {
        (false, _) => None,
        (true, path) => {
            let tokenizer = match path {
                Some(p) => Tokenizer::from_file(p)?,
                None => engine.tokenizer()?.clone(),
            };
            let eos = if engine.eos_ids().is_empty() { vec![0] } else { engine.eos_ids().to_vec() };
            Some(GrammarVocab::new(&tokenizer, engine.config().vocab_size, &eos)?)
        }
    };
    let mut tests: Vec<(String, usize, usize, Test)> = Vec::new();
    for &d in &args.depth {
        let at = if d > 0 { format!(" @ d{d}") } else { String::new() };
        tests.extend(args.n_prompt.iter().filter(|&&n| n > 0).map(|&n| (format!("pp{n}{at}"), d, n, Test::Step(Step::Prefill))));
        for &n in args.n_prompt.iter().filter(|&&n| n > 0 && d > 0 && args.turns) {
            tests.push((format!("pp{n}{at} turn"), d, n, Test::Turn { after_other: false }));
            tests.push((format!("pp{n}{at} turn after other"), d, n, Test::Turn { after_other: true }));
        }
        for &n in args.n_gen.iter().filter(|&&n| n > 0) {
            if grammar.is_some() {
                tests.push((format!("tg{n}{at} fed back"), d, n, Test::Step(Step::FedBack)));
                tests.push((format!("tg{n}{at} json"), d, n, Test::Step(Step::Json)));
            } else {
                tests.push((format!("tg{n}{at}"), d, n, Test::Step(Step::Decode)));
            }
            if args.generate {
                tests.push((format!("tg{n}{at} generate"), d, n, Test::Generate));
            }
            if streams > 1 {
                tests.push((format!("tg{n}{at} x{streams}"), d, n, Test::Streams));
            }
            if let Some(k) = args.verify.filter(|&k| k > 0) {
                tests.push((format!("tg{n}{at} verify{k}"), d, n, Test::Step(Step::Verify(k))));
            }
        }
    }
    let (mut drafted, mut confirmed) = (0, 0);
    for (name, depth, n, test) in tests {
        let mut rates = Vec::with_capacity(args.repetitions);
        for _ in 0..args.repetitions {
            let step = match test {
                Test::Step(step) => step,
                Test::Turn { after_other } => {
                    let (history, other, new) = (random_tokens(depth), random_tokens(depth), random_tokens(n - 1));
                    rates.push(n as f64 / follow_up_seconds(&mut engine, history, after_other.then_some(other), new)?);
                    continue;
                }
                Test::Streams => {
                    let prompts = (0..streams).map(|_| random_tokens(depth.max(64))).collect();
                    let mut all: Vec<Engine> = Vec::with_capacity(streams);
                    all.push(engine);
                    all.append(&mut engines);
                    let rate = streams_rate(&mut all, prompts, n);
                    engine = all.remove(0);
                    engines = all;
                    rates.push(rate?);
                    continue;
                }
                Test::Generate => {
                    let request = atlas::GenerateRequest { max_tokens: Some(n), ..one_token(random_tokens(depth.max(64))) };
                    let out = engine.generate_raw(&request)?;
                    (drafted, confirmed) = (drafted + out.draft_tokens, confirmed + out.draft_accepted);
                    rates.push(out.tokens.len() as f64 / (out.decode_ms / 1e3));
                    continue;
                }
            };
            if depth > 0 {
                engine.forward(&random_tokens(depth), 0)?;
            }
            let tokens = random_tokens(n);
            let t = Instant::now();
            // As greedy generation runs: the next token is chosen on the device.
            match step {
                Step::Prefill => {
                    engine.forward_greedy(&tokens, depth)?;
                }
                Step::Decode => {
                    for (i, tok) in tokens.iter().enumerate() {
                        engine.forward_greedy(&[*tok], depth + i)?;
                    }
                }
                Step::Verify(k) => {
                    for (i, step) in tokens.chunks(k).enumerate() {
                        engine.forward_greedy_each(step, depth + i * k)?;
                    }
                }
                Step::FedBack | Step::Json => {
                    let mut constraint = match (&grammar, step) {
                        (Some(g), Step::Json) => Some(g.constraint(&GrammarSpec::JsonObject)?),
                        _ => None,
                    };
                    let mut tok = tokens[0];
                    for i in 0..n {
                        // The next mask is computed while the device runs the step, as generation does.
                        tok = engine.forward_greedy_masked(&[tok], depth + i, &mut || match constraint.as_mut() {
                            Some(c) => c.allowed().map(Some),
                            None => Ok(None),
                        })?;
                        if let Some(c) = constraint.as_mut() {
                            c.accept(tok)?;
                        }
                    }
                    engine.set_token_mask(None)?;
                }
            }
            rates.push(n as f64 / t.elapsed().as_secs_f64());
        }
        let mean = rates.iter().sum::<f64>() / rates.len() as f64;
        let sd = (rates.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / (rates.len().max(2) - 1) as f64).sqrt();
        println!("| {:<24} | {:<24} | {:>14} | {:>20} |", model, backend, name, format!("{mean:.2} ± {sd:.2}"));
    }
    if drafted > 0 {
        println!("\nspeculative decoding: {confirmed} of {drafted} drafted tokens confirmed ({:.1} %)", 100.0 * confirmed as f64 / drafted as f64);
    }
    Ok(())
}

/// Seconds to the first token of a turn that follows `history` (answered first, and followed by
/// the `other` conversation when given): the answer's token and `new` tokens after it.
fn follow_up_seconds(engine: &mut Engine, history: Vec<u32>, other: Option<Vec<u32>>, new: Vec<u32>) -> Result<f64> {
    let answer = engine.generate_raw(&one_token(history.clone()))?;
    if let Some(other) = other {
        engine.generate_raw(&one_token(other))?;
    }
    let follow_up = [history, answer.tokens, new].concat();
    let t = Instant::now();
    engine.generate_raw(&one_token(follow_up))?;
    Ok(t.elapsed().as_secs_f64())
}

/// A greedy request for one token, past end-of-sequence.
fn one_token(prompt: Vec<u32>) -> atlas::GenerateRequest {
    atlas::GenerateRequest {
        prompt,
        max_tokens: Some(1),
        sampling: atlas::sampling::SamplingParams { temperature: 0.0, ..Default::default() },
        stop: Vec::new(),
        ignore_eos: true,
        grammar: None,
        logprobs: None,
    }
}
