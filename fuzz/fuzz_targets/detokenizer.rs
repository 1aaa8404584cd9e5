//! The streaming detokenizer over arbitrary token ids (what a model may generate, ids past the
//! vocabulary included) with the chat_tiny fixture's tokenizer: `Detokenizer::push` per id, then
//! `finish`. Checked: no panic, and the pieces add up to the whole decode whenever that decode
//! holds no incomplete character (and the hold limit released none).
#![no_main]

#[path = "common/mod.rs"]
mod common;

use std::sync::OnceLock;

use atlas::tokenizer::{Detokenizer, Tokenizer, MAX_HELD_TOKENS};
use libfuzzer_sys::fuzz_target;

fn tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| Tokenizer::from_file(&common::fixtures().join("models/chat_tiny/tokenizer.json")).unwrap())
}

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else { return };
    let tk = tokenizer();
    let skip_special = flags & 1 != 0;
    // Two bytes an id: mostly inside the vocabulary (272 ids), sometimes past it.
    let ids: Vec<u32> = rest
        .chunks_exact(2)
        .map(|b| {
            let v = u16::from_le_bytes([b[0], b[1]]) as u32;
            if v & 0x8000 != 0 { v } else { v % 272 }
        })
        .collect();
    let mut d = Detokenizer::new(skip_special);
    let mut text = String::new();
    for &id in &ids {
        text.push_str(&d.push(tk, id).expect("decoding never fails for u32 ids"));
    }
    text.push_str(&d.finish(tk).expect("decoding never fails for u32 ids"));
    let whole = tk.decode(&ids, skip_special).unwrap();
    // A character left incomplete past the hold limit is released as U+FFFD, even if ids that
    // decode to nothing (skipped specials) later let it complete in the whole decode.
    let forced = text.contains('\u{fffd}') && ids.len() > MAX_HELD_TOKENS;
    if !whole.contains('\u{fffd}') && !forced {
        assert_eq!(text, whole, "streamed pieces differ from the whole decode of {ids:?}");
    }
});
