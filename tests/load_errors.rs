//! Broken model directories are rejected with a message that names the file or tensor at fault.

use std::path::{Path, PathBuf};

use atlas::{Engine, EngineOptions};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models").join(name)
}

/// Copies a fixture into a fresh temporary directory so a test can damage it.
fn scratch_copy(name: &str, tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("atlas-test-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
    }
    dir
}

fn load_error(dir: &Path) -> String {
    match Engine::load(&EngineOptions::new(dir), &mut |_| {}) {
        Ok(_) => panic!("{} loaded but should not", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn missing_directory_and_missing_weights() {
    assert!(load_error(Path::new("/nonexistent/model")).contains("/nonexistent/model"));
    let dir = scratch_copy("qwen3_tied", "noweights");
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    assert!(load_error(&dir).contains("no model.safetensors"));
}

#[test]
fn truncated_safetensors_names_the_file() {
    let dir = scratch_copy("qwen3_tied", "truncated");
    let file = dir.join("model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() / 2]).unwrap();
    let msg = load_error(&dir);
    assert!(msg.contains("model.safetensors") && msg.contains("not a valid safetensors file"), "{msg}");
}

#[test]
fn wrong_shape_names_the_tensor() {
    let dir = scratch_copy("qwen3_tied", "shape");
    let cfg = std::fs::read_to_string(dir.join("config.json")).unwrap();
    std::fs::write(dir.join("config.json"), cfg.replace("\"intermediate_size\": 128", "\"intermediate_size\": 100")).unwrap();
    let msg = load_error(&dir);
    assert!(msg.contains("model.layers.0.mlp.gate_proj.weight") && msg.contains("[128, 64]"), "{msg}");
}

#[test]
fn missing_shard_and_bad_config() {
    let dir = scratch_copy("qwen3_untied_gqa", "shard");
    std::fs::remove_file(dir.join("model-00003-of-00007.safetensors")).unwrap();
    assert!(load_error(&dir).contains("model-00003-of-00007.safetensors"));

    let dir = scratch_copy("qwen3_tied", "arch");
    let cfg = std::fs::read_to_string(dir.join("config.json")).unwrap();
    std::fs::write(dir.join("config.json"), cfg.replace("\"model_type\": \"qwen3\"", "\"model_type\": \"gpt2\"")).unwrap();
    assert!(load_error(&dir).contains("gpt2"));

    std::fs::write(dir.join("config.json"), "{not json").unwrap();
    assert!(load_error(&dir).contains("config.json"));
}

#[test]
fn out_of_vocabulary_token_is_refused_and_the_model_stays_usable() {
    let mut engine = Engine::load(&EngineOptions::new(fixture("qwen3_tied")), &mut |_| {}).unwrap();
    let vocab = engine.config().vocab_size as u32;
    let first = engine.forward(&[1, 2, 3], 0).unwrap();
    // A decode step (the path a GPU replays from device memory) and a prompt.
    for (tokens, pos) in [(vec![vocab], 3), (vec![4, vocab + 7], 3)] {
        let err = engine.forward(&tokens, pos).unwrap_err().to_string();
        assert!(err.contains("outside the model's vocabulary"), "{err}");
    }
    assert_eq!(engine.forward(&[1, 2, 3], 0).unwrap(), first);
    engine.forward_greedy(&[4], 3).unwrap();
}
