//! The read-only half of a loaded model: its tokenizer, chat template, generation defaults and
//! context size. It is shared (cheap to clone) and needs no lock, so hosts render and tokenize a
//! request while the engine is busy with another one, and refuse oversized prompts before they
//! cost anything.

use std::path::Path;
use std::sync::Arc;

use crate::chat::ChatTemplate;
use crate::model::GenerationDefaults;
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

#[derive(Clone)]
pub struct Frontend {
    parts: Arc<Parts>,
}

struct Parts {
    model_dir: String,
    tokenizer: Option<Tokenizer>,
    template: Option<ChatTemplate>,
    defaults: GenerationDefaults,
    ctx_size: usize,
    /// An upper bound on the bytes of text one token stands for (see `min_tokens`).
    max_bytes_per_token: usize,
}

/// Normalisers can shrink text before it is split (NFC composes three Hangul jamo, 9 bytes, into
/// one 3-byte syllable), so a token may cover up to this many times its own spelling.
const NORMALISER_SHRINK: usize = 3;

impl Frontend {
    pub fn new(
        model_dir: String,
        tokenizer: Option<Tokenizer>,
        template: Option<ChatTemplate>,
        defaults: GenerationDefaults,
        ctx_size: usize,
    ) -> Self {
        let longest = tokenizer.as_ref().map_or(1, Tokenizer::longest_token_bytes).max(1);
        let max_bytes_per_token = longest * NORMALISER_SHRINK;
        Frontend { parts: Arc::new(Parts { model_dir, tokenizer, template, defaults, ctx_size, max_bytes_per_token }) }
    }

    pub fn model_dir(&self) -> &str {
        &self.parts.model_dir
    }

    /// The name responses carry in `model`: the model directory's name.
    pub fn model_name(&self) -> String {
        let dir = &self.parts.model_dir;
        Path::new(dir).file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| dir.clone())
    }

    pub fn ctx_size(&self) -> usize {
        self.parts.ctx_size
    }

    pub fn defaults(&self) -> &GenerationDefaults {
        &self.parts.defaults
    }

    pub fn has_tokenizer(&self) -> bool {
        self.parts.tokenizer.is_some()
    }

    pub fn has_template(&self) -> bool {
        self.parts.template.is_some()
    }

    pub fn tokenizer(&self) -> Result<&Tokenizer> {
        self.parts.tokenizer.as_ref().ok_or_else(|| {
            Error::InvalidRequest(format!("{} has no tokenizer.json: only token-id commands work", self.parts.model_dir))
        })
    }

    pub fn template(&self) -> Result<&ChatTemplate> {
        self.parts
            .template
            .as_ref()
            .ok_or_else(|| Error::InvalidRequest(format!("{} has no chat template", self.parts.model_dir)))
    }

    /// The fewest tokens `text` can become: tokenizing costs time and memory in proportion to
    /// the text, so a prompt that cannot fit is refused from its length alone.
    pub fn min_tokens(&self, text: &str) -> usize {
        text.len().div_ceil(self.parts.max_bytes_per_token)
    }

    /// Tokenizes a rendered prompt that must leave room for `new_tokens` more in the context.
    pub fn encode_prompt(&self, text: &str, new_tokens: usize) -> Result<Vec<u32>> {
        let tokenizer = self.tokenizer()?;
        let ctx_size = self.parts.ctx_size;
        let at_least = self.min_tokens(text);
        if check_fits(at_least, new_tokens, ctx_size).is_err() {
            return Err(Error::ContextOverflow(format!(
                "the prompt of {} bytes is at least {at_least} tokens: with {new_tokens} new tokens it cannot fit the context of {ctx_size} tokens",
                text.len()
            )));
        }
        let tokens = tokenizer.encode(text)?;
        check_fits(tokens.len(), new_tokens, ctx_size)?;
        Ok(tokens)
    }
}

/// Whether `prompt` tokens plus `new_tokens` fit a context of `ctx_size`; both numbers come from
/// requests, so the sum is checked rather than trusted.
pub fn check_fits(prompt: usize, new_tokens: usize, ctx_size: usize) -> Result<()> {
    match prompt.checked_add(new_tokens) {
        Some(total) if total <= ctx_size => Ok(()),
        _ => Err(Error::ContextOverflow(format!(
            "{prompt} prompt tokens + {new_tokens} new tokens exceed the context of {ctx_size} tokens"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_that_wrap_do_not_fit() {
        assert!(check_fits(10, 20, 30).is_ok());
        assert!(matches!(check_fits(10, 21, 30), Err(Error::ContextOverflow(_))));
        assert!(matches!(check_fits(2, usize::MAX, 64), Err(Error::ContextOverflow(_))));
        assert!(matches!(check_fits(usize::MAX, 1, usize::MAX), Err(Error::ContextOverflow(_))));
    }

    #[test]
    fn a_prompt_longer_than_the_context_can_hold_is_refused_without_a_tokenizer_pass() {
        let front = Frontend::new("m".into(), None, None, GenerationDefaults::default(), 8);
        // No tokenizer: one byte per token at most (times the normaliser's shrink).
        assert_eq!(front.min_tokens(&"x".repeat(30)), 10);
        assert_eq!(front.model_name(), "m");
    }
}
