//! A GGUF model file: header, metadata, tensor table and data. Parsed as `GgufStore::open` parses
//! it (the same parser over an in-memory image instead of a map, to spare a file per input), then
//! everything a load does with it: the config, the tokenizer rebuilt from its metadata (with an
//! encode and decode), the chat template and special tokens, and every tensor read under its
//! Hugging Face name through `WeightSource`, which decodes each quant type's blocks.
#![no_main]

#[path = "common/mod.rs"]
mod common;

use atlas::gguf::{hf_name, GgufFile, GgufStore};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(file) = GgufFile::from_bytes("fuzz.gguf", data.to_vec()) else { return };
    for (_, v) in file.metadata() {
        let _ = (v.type_name(), v.as_u64(), v.as_f64(), v.as_str(), v.as_strings());
    }
    let Ok(store) = GgufStore::from_file(file) else { return };
    let _ = store.config();
    // Rebuilding the tokenizer (its pre-tokenizer regex compiled by Oniguruma) costs ~75 ms, ten
    // times the rest: it runs for the quarter of the inputs whose last byte is a multiple of 4,
    // so the parser and decoders get the throughput (the fuzzer flips that byte freely).
    if data.last().is_some_and(|b| b % 4 == 0) {
        tokenizer(&store);
    }
    let _ = (store.chat_template(), store.special_tokens(), store.summary());
    for t in store.file().tensors() {
        let name = hf_name(&t.name).unwrap_or_else(|| t.name.clone());
        let shape: Vec<usize> = t.shape().iter().map(|&d| usize::try_from(d).unwrap_or(usize::MAX)).collect();
        common::read_tensor(&store, &name, &shape);
    }
});

fn tokenizer(store: &GgufStore) {
    if let Ok(tk) = store.tokenizer() {
        if let Ok(enc) = tk.encode("<|im_start|>user\nHello, wörld 123 <think>ok</think><|im_end|>", false) {
            let _ = tk.decode(enc.get_ids(), false);
            let _ = tk.decode(enc.get_ids(), true);
        }
    }
}
