//! tokenizer.json through the `tokenizers` crate, and an incremental detokenizer for streaming.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

use crate::{Error, Result};

/// Runs a call into the `tokenizers` crate, turning a panic into an error. Some malformed
/// tokenizer.json files make it panic instead of failing (0.23: a decoder object cut short hits
/// `expect("Helper")` in `DecoderWrapper::deserialize`); a tokenizer comes with the model files, so
/// that must be a load error, not a crash of the host. Nothing outlives the call, so nothing is
/// left half-changed by the unwinding.
fn guarded<T>(what: &str, f: impl FnOnce() -> std::result::Result<T, String>) -> std::result::Result<T, String> {
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
        let inner = guarded("reading tokenizer.json", || text.parse::<tokenizers::Tokenizer>().map_err(|e| e.to_string()))
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

/// Turns a growing token sequence into text pieces without ever splitting a UTF-8 character: a
/// token that ends in the middle of a multi-byte character is held back until the next one
/// completes it (the prefix-offset method of text-generation-inference).
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
        if full.len() > prefix.len() && !full.ends_with('\u{fffd}') && full.is_char_boundary(prefix.len()) {
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
