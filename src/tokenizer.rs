//! tokenizer.json through the `tokenizers` crate, and an incremental detokenizer for streaming.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

use crate::{Error, Result};

/// Runs a call into the `tokenizers` crate, turning a panic into an error. Some malformed
/// tokenizer.json files make it panic instead of failing (0.23: a decoder object cut short hits
/// `expect("Helper")` in `DecoderWrapper::deserialize`); a tokenizer comes with the model files, so
/// that must be a load error, not a crash of the host. Nothing outlives the call, so nothing is
/// left half-changed by the unwinding.
pub(crate) fn guarded<T>(what: &str, f: impl FnOnce() -> std::result::Result<T, String>) -> std::result::Result<T, String> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        let msg = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "no message".into());
        Err(format!("the tokenizers crate panicked while {what}: {msg}"))
    })
}

#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
}

impl Tokenizer {
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let inner = guarded("reading tokenizer.json", || {
            let mut tk = text.parse::<tokenizers::Tokenizer>().map_err(|e| e.to_string())?;
            let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
            let growth = normalizer_growth(&json["normalizer"]);
            if growth > MAX_NORMALIZER_GROWTH {
                return Err(format!(
                    "its normalizer can make a text up to {growth} times longer (the limit is {MAX_NORMALIZER_GROWTH}): \
                     a prompt could exhaust memory"
                ));
            }
            if let Some(bpe) = uncached_bpe(&json)? {
                tk.with_model(bpe);
            }
            Ok(tk)
        })
        .map_err(|e| Error::bad_file(path, format!("cannot read tokenizer: {e}")))?;
        Ok(Tokenizer { inner })
    }

    pub fn from_inner(inner: tokenizers::Tokenizer) -> Self {
        Tokenizer { inner }
    }

    /// Encodes text that already contains its special tokens (a rendered chat template), so no
    /// BOS/EOS is added, as transformers' apply_chat_template(tokenize=True) does.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = guarded("encoding", || self.inner.encode(text, false).map_err(|e| e.to_string())).map_err(Error::Tokenizer)?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        guarded("decoding", || self.inner.decode(ids, skip_special).map_err(|e| e.to_string())).map_err(Error::Tokenizer)
    }

    /// Ids `0..vocab_size()` are the ones this tokenizer can decode.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The longest token's spelling in bytes. Every pre-tokenizer Atlas meets spells a token in at
    /// least as many bytes as the text it stands for (byte-level BPE maps a byte to one or two,
    /// SentencePiece writes a space as the 3-byte `▁`, byte fallback as `<0xNN>`).
    pub fn longest_token_bytes(&self) -> usize {
        self.inner.get_vocab(true).keys().map(String::len).max().unwrap_or(1)
    }

    /// The tokenizer in tokenizer.json form (for GGUF models too, whose tokenizer is built from the
    /// file's metadata).
    pub fn to_json(&self) -> Result<String> {
        guarded("serialising", || self.inner.to_string(false).map_err(|e| e.to_string())).map_err(Error::Tokenizer)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }
}

/// tokenizers 0.23 keeps every BPE model's cache of merged words in a thread-local map keyed by the
/// model instance, and nothing removes an instance's entries when the model is dropped: each
/// tokenizer loaded would leave up to 10,000 words behind on every thread that encoded with it, so
/// a host that loads and unloads models would grow without bound (found by the `gguf` fuzz
/// target's leak check). Atlas's BPE models are built with the cache off; encoding speed is the
/// same (Qwen3's tokenizer, 67k tokens: 0.12-0.15 s with the cache or without).
pub(crate) const BPE_CACHE_WORDS: usize = 0;

/// The longest a tokenizer's normalizer may make a text, as a multiple of its length. Real
/// tokenizers stay far below (NFKC at most 18x, SentencePiece's "▁" for " " 3x, Llama 2's
/// prepend-and-replace 12x); a hostile tokenizer.json chaining Replace normalizers would grow a
/// prompt exponentially (found by the tokenizer_json fuzz target: gigabytes from a short text).
const MAX_NORMALIZER_GROWTH: u64 = 64;

/// An upper bound on how many times longer `normalizer` (tokenizer.json's object) can make a
/// text: each step's worst case, multiplied along a sequence.
fn normalizer_growth(n: &serde_json::Value) -> u64 {
    let text_len = |key: &str| n[key].as_str().map_or(0, str::len) as u64;
    if let Some(steps) = n["normalizers"].as_array() {
        return steps.iter().fold(1u64, |g, step| g.saturating_mul(normalizer_growth(step)));
    }
    if n.get("pattern").is_some() {
        let content = text_len("content");
        // A literal of p bytes becomes the content; a regular expression's match (empty ones
        // too: the content goes between every character) at worst content + 1 per byte.
        return match n["pattern"]["String"].as_str() {
            Some(p) if !p.is_empty() => content.div_ceil(p.len() as u64).max(1),
            _ => content.saturating_add(1),
        };
    }
    if n.get("prepend").is_some() {
        return text_len("prepend").saturating_add(1);
    }
    match n["type"].as_str() {
        Some("NFKC" | "NFKD" | "Precompiled") => 18,
        Some("NFC" | "NFD" | "Lowercase" | "BertNormalizer" | "ByteLevel") => 3,
        _ => 1,
    }
}

/// tokenizer.json's BPE model (already checked by the crate's own parser) built again with
/// [`BPE_CACHE_WORDS`]; None for other models.
fn uncached_bpe(json: &serde_json::Value) -> std::result::Result<Option<tokenizers::models::bpe::BPE>, String> {
    use serde_json::Value;
    use tokenizers::models::bpe::{Vocab, BPE};
    let model = &json["model"];
    if model["type"] != "BPE" && !(model["type"].is_null() && model.get("merges").is_some()) {
        return Ok(None);
    }
    let mut vocab = Vocab::default();
    let entries = model["vocab"].as_object().ok_or("the BPE model has no vocab object")?;
    for (token, id) in entries {
        let id = id.as_u64().and_then(|i| u32::try_from(i).ok()).ok_or_else(|| format!("vocab entry {token:?} has no id"))?;
        vocab.insert(token.clone(), id);
    }
    let mut merges = Vec::new();
    for m in model["merges"].as_array().map_or(&[][..], Vec::as_slice) {
        let pair = match m {
            Value::String(s) => s.split_once(' ').filter(|(_, b)| !b.contains(' ')).map(|(a, b)| (a.to_string(), b.to_string())),
            Value::Array(p) => match p.as_slice() {
                [Value::String(a), Value::String(b)] => Some((a.clone(), b.clone())),
                _ => None,
            },
            _ => None,
        };
        merges.push(pair.ok_or_else(|| format!("merge {m} is not two tokens"))?);
    }
    let text_of = |key: &str| model[key].as_str().map(str::to_string);
    let flag = |key: &str| model[key].as_bool().unwrap_or(false);
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .cache_capacity(BPE_CACHE_WORDS)
        .fuse_unk(flag("fuse_unk"))
        .byte_fallback(flag("byte_fallback"))
        .ignore_merges(flag("ignore_merges"));
    if let Some(p) = model["dropout"].as_f64() {
        builder = builder.dropout(p as f32);
    }
    if let Some(t) = text_of("unk_token") {
        builder = builder.unk_token(t);
    }
    if let Some(t) = text_of("continuing_subword_prefix") {
        builder = builder.continuing_subword_prefix(t);
    }
    if let Some(t) = text_of("end_of_word_suffix") {
        builder = builder.end_of_word_suffix(t);
    }
    builder.build().map(Some).map_err(|e| e.to_string())
}

/// The most tokens a `Detokenizer` holds back waiting for a character to complete.
pub const MAX_HELD_TOKENS: usize = 64;

/// Turns a growing token sequence into text pieces without ever splitting a UTF-8 character: a
/// token that ends in the middle of a multi-byte character is held back until the next one
/// completes it (the prefix-offset method of text-generation-inference), for at most
/// MAX_HELD_TOKENS tokens.
pub struct Detokenizer {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    skip_special: bool,
}

impl Detokenizer {
    pub fn new(skip_special: bool) -> Self {
        Detokenizer { ids: Vec::new(), prefix_offset: 0, read_offset: 0, skip_special }
    }

    /// Adds one token; returns the text it completes (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset], self.skip_special)?;
        let full = tok.decode(&self.ids[self.prefix_offset..], self.skip_special)?;
        // A character needs at most 4 byte tokens: a window that still ends in an incomplete one
        // after MAX_HELD_TOKENS is released as it decodes (U+FFFD included). Holding it longer
        // would make each push decode an ever longer window (quadratic in the output).
        let held_too_long = self.ids.len() - self.read_offset > MAX_HELD_TOKENS;
        let complete = !full.ends_with('\u{fffd}') || held_too_long;
        if full.len() > prefix.len() && complete && full.is_char_boundary(prefix.len()) {
            let piece = full[prefix.len()..].to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            Ok(piece)
        } else {
            Ok(String::new())
        }
    }

    /// Whatever is still held back at the end of generation (an incomplete character decodes to U+FFFD).
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<String> {
        let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset], self.skip_special)?;
        let full = tok.decode(&self.ids[self.prefix_offset..], self.skip_special)?;
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Ok(full.get(prefix.len()..).unwrap_or("").to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_character_that_never_completes_is_released_after_the_hold_limit() {
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/chat_tiny/tokenizer.json");
        let tk = Tokenizer::from_file(&fixture).unwrap();
        // Byte 0xE4 ("ä" in the byte-level alphabet) opens a 3-byte character; a run of them never
        // completes one, then "é" (two bytes, complete) follows.
        let lead = tk.token_to_id("\u{e4}").unwrap();
        let ids: Vec<u32> = std::iter::repeat_n(lead, 3 * MAX_HELD_TOKENS).chain(tk.encode("é").unwrap()).collect();
        let mut d = Detokenizer::new(true);
        let mut pieces = Vec::new();
        for &id in &ids {
            pieces.push(d.push(&tk, id).unwrap());
        }
        let released_early = pieces[..2 * MAX_HELD_TOKENS].concat();
        assert!(released_early.contains('\u{fffd}'), "nothing released while holding {} tokens", 2 * MAX_HELD_TOKENS);
        let text = pieces.concat() + &d.finish(&tk).unwrap();
        assert_eq!(text, tk.decode(&ids, true).unwrap());
        assert!(text.ends_with('é'));
    }

    /// The BPE model rebuilt without its cache encodes as the crate's own reading of the file.
    #[test]
    fn the_uncached_bpe_encodes_as_the_file_says() {
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/chat_tiny/tokenizer.json");
        let text = std::fs::read_to_string(&fixture).unwrap();
        assert!(uncached_bpe(&serde_json::from_str(&text).unwrap()).unwrap().is_some(), "the fixture is a BPE tokenizer");
        let theirs: tokenizers::Tokenizer = text.parse().unwrap();
        let ours = Tokenizer::from_file(&fixture).unwrap();
        let sample = "<|im_start|>user\nHello, wörld 1234 — ok?\n\t  spaces 🦀<|im_end|>";
        let want = theirs.encode(sample, false).unwrap().get_ids().to_vec();
        assert_eq!(ours.encode(sample).unwrap(), want);
        assert_eq!(ours.decode(&want, false).unwrap(), theirs.decode(&want, false).unwrap());
        let bpe = |json: &str| uncached_bpe(&serde_json::from_str(json).unwrap());
        assert_eq!(bpe(r#"{"model": {"type": "WordLevel", "vocab": {"a": 0}}}"#).unwrap(), None);
        // Merges as "a b" strings (older files) or pairs; ranks in file order.
        for merges in [r#"["a b", "ab c"]"#, r#"[["a", "b"], ["ab", "c"]]"#] {
            let json = format!(r#"{{"model": {{"type": "BPE", "vocab": {{"a": 0, "b": 1, "c": 2, "ab": 3, "abc": 4}}, "merges": {merges}}}}}"#);
            let mut tk = tokenizers::Tokenizer::new(bpe(&json).unwrap().unwrap());
            tk.with_pre_tokenizer(None::<tokenizers::PreTokenizerWrapper>);
            assert_eq!(tk.encode("abcab", false).unwrap().get_ids(), [4, 3], "{merges}");
        }
        assert!(bpe(r#"{"model": {"type": "BPE", "vocab": {}, "merges": ["a b c"]}}"#).is_err());
    }

    /// Found by the tokenizer_json fuzz target (out of memory): Replace normalizers in a sequence,
    /// each doubling the text, made a short prompt gigabytes long. Such a tokenizer is refused at
    /// load; real normalizers stay well inside the limit.
    #[test]
    fn a_normalizer_that_could_blow_up_a_prompt_is_refused() {
        use serde_json::json;
        let doubling = json!({"type": "Replace", "pattern": {"String": " "}, "content": "  "});
        let empty_match = json!({"type": "Replace", "pattern": {"Regex": ""}, "content": "x".repeat(100)});
        let llama2 = json!({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]});
        assert_eq!(normalizer_growth(&llama2), 12);
        assert_eq!(normalizer_growth(&json!({"type": "NFC"})), 3);
        assert_eq!(normalizer_growth(&serde_json::Value::Null), 1);
        assert_eq!(normalizer_growth(&json!({"type": "Sequence", "normalizers": vec![doubling.clone(); 40]})), 1 << 40);

        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/chat_tiny/tokenizer.json");
        let mut tk: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(fixture).unwrap()).unwrap();
        let dir = std::env::temp_dir().join(format!("atlas-normalizer-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tokenizer.json");
        for (normalizer, refused) in [(json!({"type": "Sequence", "normalizers": vec![doubling; 40]}), true), (empty_match, true), (llama2, false)] {
            tk["normalizer"] = normalizer.clone();
            std::fs::write(&path, tk.to_string()).unwrap();
            match Tokenizer::from_file(&path) {
                Err(e) => assert!(refused && e.to_string().contains("times longer"), "{normalizer}: {e}"),
                Ok(t) => assert!(!refused && t.encode("a b").is_ok(), "{normalizer} loaded"),
            }
        }
        std::fs::remove_dir_all(&dir).ok();
    }

    /// Found by fuzz/fuzz_targets/tokenizer_json.rs: a tokenizer.json whose decoder object is cut
    /// short made `tokenizers` panic inside Tokenizer::from_file; it is a load error naming the file.
    #[test]
    fn a_malformed_decoder_is_an_error_not_a_panic() {
        let dir = std::env::temp_dir().join(format!("atlas-tokenizer-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tokenizer.json");
        let text = r###"{"version": "1.0", "added_tokens": [], "normalizer": null, "pre_tokenizer": null,
            "model": {"type": "WordLevel", "vocab": {"a": 0}, "unk_token": "a"},
            "decoder": {"type": "WordPiece", "prefix": "##", "clhead_dimtrue}}"###;
        std::fs::write(&path, text).unwrap();
        let err = Tokenizer::from_file(&path).err().expect("a malformed tokenizer.json must not load").to_string();
        assert!(err.contains("tokenizer.json") && err.contains("cannot read tokenizer"), "{err}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
