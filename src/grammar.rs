//! Constrained decoding: a JSON schema, "any JSON object" or a Lark grammar turned, step by step,
//! into the set of tokens that keep the output valid (llguidance over the model's tokenizer).
//!
//! The vocabulary is read once per model ([`GrammarVocab`]); each request gets a [`Constraint`]
//! that masks the logits before the sampler chooses and then consumes the chosen token. When the
//! grammar is complete only end-of-sequence tokens stay allowed, so the output always parses.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use crate::tokenizer::Tokenizer;
use crate::{Error, Result};

/// What a request constrains its output to.
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// A JSON schema (`response_format: {"type": "json_schema", ...}`).
    JsonSchema(Value),
    /// A grammar in llguidance's Lark syntax (the `grammar` extension field).
    Lark(String),
}

/// The model's vocabulary as llguidance sees it, with the parser settings every request shares.
pub struct GrammarVocab {
    factory: Arc<ParserFactory>,
}

/// The tokenizer side of llguidance: token bytes in a trie, and our tokenizer for text.
struct Env {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |text| self.tokenizer.encode(text).unwrap_or_default())
    }
}

impl GrammarVocab {
    /// The vocabulary of `tokenizer` over `vocab_size` logits (ids past the tokenizer's are never
    /// allowed), ending at `eos`. Tokenizers whose pieces are not byte-level BPE or byte-fallback
    /// (SentencePiece) are refused with the reason.
    pub fn new(tokenizer: &Tokenizer, vocab_size: usize, eos: &[u32]) -> Result<Self> {
        let refused = |why: String| Error::Unsupported(format!("constrained decoding with this tokenizer: {why}"));
        let json: Value = serde_json::from_str(&tokenizer.to_json()?).map_err(|e| refused(e.to_string()))?;
        // llguidance asserts on some malformed vocabularies: a panic is a refusal, never a crash.
        let mut bytes = std::panic::catch_unwind(|| llguidance::token_bytes_from_tokenizer_json(&json))
            .map_err(|_| refused("its vocabulary could not be read".into()))?
            .map_err(|e| refused(e.to_string()))?;
        if bytes.len() > vocab_size {
            return Err(refused(format!("{} tokens but {vocab_size} logits", bytes.len())));
        }
        // Ids the tokenizer does not spell: special placeholders, which no grammar can reach.
        while bytes.len() < vocab_size {
            let mut name = format!(".<[{}]>", bytes.len()).into_bytes();
            name[0] = TokTrie::SPECIAL_TOKEN_MARKER;
            bytes.push(name);
        }
        let first_eos = *eos.first().ok_or_else(|| refused("the model has no end-of-sequence token".into()))?;
        let info = TokRxInfo::new(vocab_size as u32, first_eos);
        let trie = TokTrie::from(&info, &bytes).with_eos_tokens(eos);
        let env: TokEnv = Arc::new(Env { trie, tokenizer: tokenizer.clone() });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| refused(e.to_string()))?;
        // A library inside a host process prints nothing of its own.
        factory.quiet();
        Ok(GrammarVocab { factory: Arc::new(factory) })
    }

    /// A fresh constraint for one request. A schema or grammar llguidance cannot take is an
    /// invalid request naming the problem.
    pub fn constraint(&self, spec: &GrammarSpec) -> Result<Constraint> {
        let grammar = match spec {
            GrammarSpec::JsonObject => TopLevelGrammar::from_json_schema(bounded_whitespace(serde_json::json!({"type": "object"}), JSON_WHITESPACE_RUN)),
            GrammarSpec::JsonSchema(schema) => TopLevelGrammar::from_json_schema(bounded_whitespace(schema.clone(), JSON_WHITESPACE_RUN)),
            GrammarSpec::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
        };
        let what = match spec {
            GrammarSpec::Lark(_) => "grammar",
            _ => "response_format schema",
        };
        let parser = self.factory.create_parser(grammar).map_err(|e| Error::InvalidRequest(format!("{what}: {e}")))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(Error::InvalidRequest(format!("{what}: {e}")));
        }
        Ok(Constraint { matcher })
    }
}

/// One request's grammar state.
pub struct Constraint {
    matcher: Matcher,
}

impl Constraint {
    /// The tokens the grammar allows next: bit i of word i / 32.
    pub fn allowed(&mut self) -> Result<Vec<u32>> {
        Ok(self.matcher.compute_mask_or_eos().map_err(grammar_error)?.as_slice().to_vec())
    }

    /// Advances past the chosen token (one that `allowed` allowed).
    pub fn accept(&mut self, token: u32) -> Result<()> {
        if self.matcher.is_stopped() {
            return Ok(());
        }
        self.matcher.consume_token(token).map_err(grammar_error)
    }

    /// Whether the text so far is a complete sentence of the grammar.
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }
}

/// Whitespace between JSON tokens: at most this many characters at a time (indentation a few levels
/// deep), so that a model cannot fill its answer with blank lines. A schema's own `x-guidance`
/// options (llguidance's) replace this.
pub const JSON_WHITESPACE_RUN: usize = 32;

/// `schema` with at most `run` whitespace characters between two JSON tokens, unless it says
/// otherwise (`x-guidance`).
pub fn bounded_whitespace(mut schema: Value, run: usize) -> Value {
    if let Some(obj) = schema.as_object_mut() {
        obj.entry("x-guidance").or_insert_with(|| serde_json::json!({"whitespace_pattern": format!("[\\x20\\x0A\\x0D\\x09]{{1,{run}}}")}));
    }
    schema
}

fn grammar_error(e: impl std::fmt::Display) -> Error {
    Error::InvalidRequest(format!("constrained decoding: {e}"))
}
