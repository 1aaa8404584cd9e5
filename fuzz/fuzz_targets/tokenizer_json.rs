//! tokenizer.json: arbitrary bytes loaded as `Tokenizer::from_file` loads them (the `tokenizers`
//! crate's parser), then an encode and a decode of some text, as a chat request would.
//! A panic inside `tokenizers` that Atlas turns into an error is not a finding; one that escapes is.
#![no_main]

#[path = "common/mod.rs"]
mod common;

use atlas::tokenizer::Tokenizer;
use libfuzzer_sys::fuzz_target;

const TEXT: &str = "<|im_start|>user\nHello, wörld! 123 日本語 \u{1F600}  \t<think>ok</think><|im_end|>";

fuzz_target!(|data: &[u8]| {
    // Atlas catches the panics of the tokenizers crate (see src/tokenizer.rs) and returns errors;
    // libFuzzer's hook would abort at the panic itself, before Atlas could catch it. Without the
    // hook a panic that escapes Atlas still aborts (libfuzzer-sys catches it and aborts), so only
    // panics turned into errors pass.
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| std::panic::set_hook(Box::new(|_| {})));
    let path = common::scratch_file("tokenizer.json", data);
    let Ok(tk) = Tokenizer::from_file(&path) else { return };
    let _ = (tk.vocab_size(), tk.longest_token_bytes(), tk.token_to_id("<|im_end|>"), tk.id_to_token(0));
    if let Ok(ids) = tk.encode(TEXT) {
        let _ = tk.decode(&ids, false);
        let _ = tk.decode(&ids, true);
    }
    let _ = tk.decode(&[0, 1, 2, 255, 256, u32::MAX], false);
});
