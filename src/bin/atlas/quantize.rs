//! `atlas quantize`: see atlas::quantize.

use std::io::IsTerminal;
use std::path::PathBuf;

use atlas::quantize::{parse_target, quantize_gguf, quantize_nvfp4};
use atlas::{Error, Result};
use clap::Args;

#[derive(Args, Clone)]
pub struct QuantizeArgs {
    /// A GGUF file with float (F32, F16 or BF16) weights, e.g. llama.cpp's convert_hf_to_gguf.py
    /// output; for NVFP4, a Hugging Face safetensors directory.
    #[arg(short, long)]
    model: PathBuf,
    /// The format: Q4_K_M (llama.cpp's mix of Q4_K, Q5_K and Q6_K), Q8_0, Q4_0, Q4_K, Q5_K, Q6_K;
    /// a ROCmFP4 preset of the ROCmFPX fork, which mixes types 100 (a scale per 16 weights) and
    /// 101 (one per 32) with Q5_K/Q6_K per tensor role as the fork does: Q4_0_ROCMFP4,
    /// Q4_0_ROCMFP4_LEAN, _COHERENT, _FAST, _FAST_COHERENT, _STRIX, _STRIX_LEAN (or `--to ROCMFP4
    /// --preset STRIX_LEAN`); Q4_0_ROCMFP4_EVEN / Q4_0_ROCMFP4_FAST_EVEN for one type throughout.
    /// NVFP4 for safetensors (NVIDIA ModelOpt's layout: attention and MLP projections, the rest
    /// kept).
    #[arg(long)]
    to: String,
    /// With `--to ROCMFP4`: the fork's preset (BASE, LEAN, COHERENT, FAST, FAST_COHERENT, STRIX,
    /// STRIX_LEAN, EVEN, FAST_EVEN). STRIX_SAFE and STRIX_BALANCED are names of community model
    /// uploads, not presets of the fork's source.
    #[arg(long)]
    preset: Option<String>,
    /// The GGUF file to write (NVFP4: a new directory).
    #[arg(short, long)]
    output: PathBuf,
    /// Print every tensor (name, shape, from → to, sizes), not only the totals.
    #[arg(short, long)]
    verbose: bool,
}

pub fn run(args: &QuantizeArgs) -> Result<()> {
    let nvfp4 = args.to.eq_ignore_ascii_case("nvfp4");
    let target = match &args.preset {
        None => args.to.clone(),
        Some(p) if args.to.eq_ignore_ascii_case("rocmfp4") && p.eq_ignore_ascii_case("base") => "Q4_0_ROCMFP4".into(),
        Some(p) if args.to.eq_ignore_ascii_case("rocmfp4") => format!("Q4_0_ROCMFP4_{p}"),
        Some(_) => return Err(Error::InvalidArgument("--preset goes with --to ROCMFP4".into())),
    };
    let to = if nvfp4 { None } else { Some(parse_target(&target)?) };
    if args.output.canonicalize().ok() == Some(args.model.canonicalize().map_err(|e| Error::io(&args.model, e))?) {
        return Err(Error::InvalidArgument("the output would overwrite the input".into()));
    }
    if nvfp4 != args.model.is_dir() {
        let what = if nvfp4 { "NVFP4 is written from a safetensors directory" } else { "GGUF formats are written from a GGUF file" };
        return Err(Error::InvalidArgument(format!("{what}; {} is not one", args.model.display())));
    }
    let tty = std::io::stderr().is_terminal();
    let started = std::time::Instant::now();
    let mut report = |done: usize, total: usize, line: &atlas::quantize::TensorLine| {
        if args.verbose {
            let to = line.to.as_deref().unwrap_or("(kept)");
            eprintln!("[{done:4}/{total}] {:40} {:>20} {:>6} -> {:8} {:>10} -> {:>10} bytes", line.name, format!("{:?}", line.dims), line.from, to, line.bytes_before, line.bytes_after);
        } else if tty {
            eprint!("\rquantizing: {done}/{total} tensors");
        }
    };
    let lines = match to {
        Some(to) => quantize_gguf(&args.model, &args.output, to, &mut report)?,
        None => quantize_nvfp4(&args.model, &args.output, &mut report)?,
    };
    let to = to.map_or("nvfp4".to_string(), |p| p.to_string());
    if tty && !args.verbose {
        eprint!("\r\x1b[K");
    }
    let (before, after): (u64, u64) = lines.iter().fold((0, 0), |(b, a), l| (b + l.bytes_before, a + l.bytes_after));
    let changed = lines.iter().filter(|l| l.to.is_some()).count();
    println!(
        "{} -> {}: {changed} of {} tensors to {to}, {:.2} MB -> {:.2} MB of tensor data, {:.1} s",
        args.model.display(),
        args.output.display(),
        lines.len(),
        before as f64 / 1e6,
        after as f64 / 1e6,
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
