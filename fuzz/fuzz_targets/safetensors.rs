//! A safetensors checkpoint file (the 8-byte header length, the JSON header, the data), opened as
//! Atlas opens a model's shards (`SafetensorsStore::open_files`, memory-mapped), then every tensor
//! read through the `WeightSource` method its rank calls for (FP8 block-scaled and NVFP4 weights
//! included).
#![no_main]

#[path = "common/mod.rs"]
mod common;

use atlas::model::safetensors::SafetensorsStore;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = common::scratch_file("model.safetensors", data);
    let Ok(store) = SafetensorsStore::open_files(&[path]) else { return };
    // The header parsed, so it is JSON: take the shapes from it (the store keeps them private).
    let header_len = u64::from_le_bytes(data[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&data[8..8 + header_len]).unwrap();
    let _ = store.summary();
    for (name, info) in header.as_object().into_iter().flatten() {
        let Some(shape) = info.get("shape").and_then(|s| s.as_array()) else { continue };
        let shape: Vec<usize> = shape.iter().filter_map(|d| d.as_u64().map(|d| d as usize)).collect();
        // Atlas reads a multimodal checkpoint's text model under the text-only names.
        let name = match name.strip_prefix("model.language_model.") {
            Some(rest) => format!("model.{rest}"),
            None => name.clone(),
        };
        common::read_tensor(&store, &name, &shape);
        // NVFP4 codes hold two values a byte: read them as the weight of twice the width.
        let nvfp4_weight = name.strip_suffix(".weight_packed").map(|b| format!("{b}.weight")).or_else(|| name.ends_with(".weight").then(|| name.clone()));
        if let (Some(weight), [rows, cols]) = (nvfp4_weight, shape.as_slice()) {
            common::read_tensor(&store, &weight, &[*rows, cols.saturating_mul(2)]);
        }
    }
});
