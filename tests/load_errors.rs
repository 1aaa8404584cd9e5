//! Broken model directories are rejected with a message that names the file or tensor at fault.

use std::path::{Path, PathBuf};

use atlas::gguf::{GgufFile, GgufStore};
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

/// chat_tiny (two layers) with `num_hidden_layers` rewritten.
fn chat_tiny_with_layers(layers: u64, tag: &str) -> PathBuf {
    let dir = scratch_copy("chat_tiny", tag);
    let cfg = std::fs::read_to_string(dir.join("config.json")).unwrap();
    assert!(cfg.contains("\"num_hidden_layers\": 2,"));
    let cfg = cfg.replace("\"num_hidden_layers\": 2,", &format!("\"num_hidden_layers\": {layers},"));
    std::fs::write(dir.join("config.json"), cfg).unwrap();
    dir
}

#[test]
fn absurd_layer_count_in_config_json_is_an_error_not_an_abort() {
    let msg = load_error(&chat_tiny_with_layers(1_000_000_000_000, "huge-layers"));
    assert!(msg.contains("config.json") && msg.contains("num_hidden_layers = 1000000000000"), "{msg}");
    assert!(msg.contains("1..=1024"), "{msg}");
}

#[test]
fn more_layers_than_the_weights_hold_is_refused_before_loading() {
    let msg = load_error(&chat_tiny_with_layers(3, "extra-layer"));
    assert!(msg.contains("model.layers.2.input_layernorm.weight"), "{msg}");
    assert!(msg.contains("declares 3 layers but the weights have 2"), "{msg}");
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// GGUF metadata key/values, as written after the header.
#[derive(Default)]
struct Meta {
    bytes: Vec<u8>,
    count: u64,
}

impl Meta {
    fn key(&mut self, name: &str, value_type: u32) -> &mut Vec<u8> {
        self.count += 1;
        put_str(&mut self.bytes, name);
        self.bytes.extend(value_type.to_le_bytes());
        &mut self.bytes
    }

    fn str(&mut self, name: &str, value: &str) {
        put_str(self.key(name, 8), value);
    }

    fn strs(&mut self, name: &str, values: &[&str]) {
        let out = self.key(name, 9);
        out.extend(8u32.to_le_bytes());
        out.extend((values.len() as u64).to_le_bytes());
        for v in values {
            put_str(out, v);
        }
    }
}

/// A GGUF image of `meta` and f32 `tensors` (name, ggml dims innermost first), 32-byte aligned.
fn gguf_bytes(meta: &Meta, tensors: &[(String, Vec<u64>)]) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend(meta.count.to_le_bytes());
    b.extend(&meta.bytes);
    let mut offset = 0u64;
    for (name, dims) in tensors {
        put_str(&mut b, name);
        b.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(0u32.to_le_bytes());
        b.extend(offset.to_le_bytes());
        offset += (dims.iter().product::<u64>() * 4).next_multiple_of(32);
    }
    b.resize(b.len().next_multiple_of(32), 0);
    let data: Vec<u8> = (0..offset / 4).flat_map(|i| (0.01 * (i % 7) as f32).to_le_bytes()).collect();
    b.extend(data);
    b
}

/// A qwen3 GGUF of f32 tensors for `layers` layers and a byte-level vocabulary, with its
/// `qwen3.*` sizes (block_count defaults to `layers`) replaced by `sizes`.
fn tiny_gguf(layers: u64, sizes: &[(&str, u64)], tag: &str) -> PathBuf {
    let (vocab, hidden, ffn, heads, kv_heads, head_dim) = (8u64, 8u64, 16u64, 2u64, 1u64, 4u64);
    let mut meta = Meta::default();
    meta.str("general.architecture", "qwen3");
    let defaults = [
        ("block_count", layers),
        ("embedding_length", hidden),
        ("feed_forward_length", ffn),
        ("attention.head_count", heads),
        ("attention.head_count_kv", kv_heads),
        ("attention.key_length", head_dim),
        ("context_length", 64),
    ];
    for (key, default) in defaults {
        let value = sizes.iter().find(|s| s.0 == key).map_or(default, |s| s.1);
        meta.key(&format!("qwen3.{key}"), 10).extend(value.to_le_bytes());
    }
    meta.str("tokenizer.ggml.model", "gpt2");
    meta.strs("tokenizer.ggml.tokens", &["a", "b", "c", "d", "e", "f", "g", "h"]);
    meta.strs("tokenizer.ggml.merges", &[]);

    let mut tensors = vec![("token_embd.weight".to_string(), vec![hidden, vocab])];
    tensors.push(("output_norm.weight".into(), vec![hidden]));
    for i in 0..layers {
        let (q, kv) = (heads * head_dim, kv_heads * head_dim);
        for (name, dims) in [
            ("attn_norm", vec![hidden]),
            ("attn_q", vec![hidden, q]),
            ("attn_k", vec![hidden, kv]),
            ("attn_v", vec![hidden, kv]),
            ("attn_output", vec![q, hidden]),
            ("attn_q_norm", vec![head_dim]),
            ("attn_k_norm", vec![head_dim]),
            ("ffn_norm", vec![hidden]),
            ("ffn_gate", vec![hidden, ffn]),
            ("ffn_up", vec![hidden, ffn]),
            ("ffn_down", vec![ffn, hidden]),
        ] {
            tensors.push((format!("blk.{i}.{name}.weight"), dims));
        }
    }
    let path = std::env::temp_dir().join(format!("atlas-test-{}-{tag}.gguf", std::process::id()));
    std::fs::write(&path, gguf_bytes(&meta, &tensors)).unwrap();
    path
}

#[test]
fn gguf_sizes_beyond_the_limits_are_refused_by_key() {
    // The file loads as written, so each refusal below is the limit's doing.
    Engine::load(&EngineOptions::new(tiny_gguf(1, &[], "gguf-ok")), &mut |_| {}).unwrap();
    for (key, value, limit) in [
        ("block_count", 1_000_000_000_000, "1..=1024"),
        ("embedding_length", 1 << 40, "1..=65536"),
        ("attention.head_count", 1 << 20, "1..=1024"),
        ("context_length", 1 << 40, "1..=16777216"),
    ] {
        let path = tiny_gguf(1, &[(key, value)], "gguf-huge");
        let msg = load_error(&path);
        assert!(msg.contains(&format!("qwen3.{key} = {value}")) && msg.contains(limit), "{msg}");
        assert!(msg.contains("gguf-huge.gguf"), "{msg}");
    }
}

#[test]
fn gguf_block_count_above_its_blocks_is_refused() {
    let msg = load_error(&tiny_gguf(1, &[("block_count", 2)], "gguf-extra-layer"));
    assert!(msg.contains("model.layers.1.input_layernorm.weight"), "{msg}");
    assert!(msg.contains("declares 2 layers but the weights have 1"), "{msg}");
}

#[test]
fn gguf_token_list_beyond_the_vocabulary_limit_is_refused() {
    let mut meta = Meta::default();
    meta.str("general.architecture", "qwen3");
    let out = meta.key("tokenizer.ggml.tokens", 9);
    out.extend(8u32.to_le_bytes());
    let count = (1u64 << 22) + 1;
    out.extend(count.to_le_bytes());
    // Empty strings: only their lengths.
    out.resize(out.len() + 8 * count as usize, 0);
    let store = GgufStore::from_file(GgufFile::from_bytes("tokens.gguf", gguf_bytes(&meta, &[])).unwrap()).unwrap();
    let msg = store.tokenizer().unwrap_err().to_string();
    assert!(msg.contains("tokens.gguf") && msg.contains("tokenizer.ggml.tokens") && msg.contains("4194304"), "{msg}");
}
