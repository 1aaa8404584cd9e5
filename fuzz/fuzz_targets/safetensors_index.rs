//! `model.safetensors.index.json`: a model directory whose index is the input and whose one real
//! shard (the chat_tiny fixture's weights) sits beside it, opened with `SafetensorsStore::open_dir`.
//! Shard names that leave the directory must be refused; every other name is looked up in it.
#![no_main]

#[path = "common/mod.rs"]
mod common;

use std::path::PathBuf;
use std::sync::OnceLock;

use atlas::model::safetensors::SafetensorsStore;
use atlas::model::WeightSource;
use libfuzzer_sys::fuzz_target;

fn model_dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = common::scratch().join("indexed");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(common::fixtures().join("models/chat_tiny/model.safetensors"), dir.join("model.safetensors")).unwrap();
        dir
    })
}

fuzz_target!(|data: &[u8]| {
    let dir = model_dir();
    std::fs::write(dir.join("model.safetensors.index.json"), data).unwrap();
    if let Ok(store) = SafetensorsStore::open_dir(dir) {
        let _ = store.tensor_count();
        let _ = store.vector("model.norm.weight", 32);
    }
});
