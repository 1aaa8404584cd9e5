//! A Hugging Face `tokenizers` tokenizer rebuilt from GGUF metadata (`tokenizer.ggml.*`), for the
//! byte-level BPE vocabularies (`tokenizer.ggml.model = "gpt2"`) of Llama 3, Qwen, SmolLM and kin.
//!
//! The pieces: the vocabulary (`tokens`, ids in order) and `merges` make the BPE model; the text is
//! split the way the merges were learned, chosen by `tokenizer.ggml.pre` (the same splits llama.cpp's
//! llama-vocab applies); control tokens (token type 3) become special added tokens and user-defined
//! ones (type 4) plain added tokens, both matched whole in the input, as llama.cpp does.

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

use super::reader::{GgufFile, MetaArray, MetaValue};
use crate::{Error, Result};

/// GGUF token types (llama.cpp's `llama_token_type`).
const TOKEN_CONTROL: i128 = 3;
const TOKEN_USER_DEFINED: i128 = 4;

/// Qwen2 / Qwen3 (transformers' Qwen2 PRETOKENIZE_REGEX; llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2).
const QWEN2_SPLIT: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen3.5: Qwen2's regex with combining marks (\p{M}) kept inside words (transformers'
/// Qwen3_5Tokenizer PRETOKENIZE_REGEX; llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN35).
const QWEN35_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Llama 3 (llama.cpp's LLAMA_VOCAB_PRE_TYPE_LLAMA3).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// How text is split before BPE, by `tokenizer.ggml.pre`.
enum PreSplit {
    /// GPT-2's own regex (ByteLevel with use_regex).
    Gpt2,
    /// Every digit on its own, then GPT-2's regex (StarCoder, SmolLM).
    DigitsThenGpt2,
    /// One regex, isolated matches, then byte-level mapping without a regex; optional NFC first.
    Regex { pattern: &'static str, nfc: bool, ignore_merges: bool },
}

fn pre_split(pre: &str) -> Option<PreSplit> {
    Some(match pre {
        "default" | "gpt2" | "gpt-2" => PreSplit::Gpt2,
        "smollm" | "starcoder" | "refact" | "codeshell" => PreSplit::DigitsThenGpt2,
        // Qwen's tokenizer.json normalises to NFC before splitting; llama.cpp skips that step, which
        // only matters for text that is not already NFC. We follow the original tokenizer.
        "qwen2" | "deepseek-r1-qwen" => PreSplit::Regex { pattern: QWEN2_SPLIT, nfc: true, ignore_merges: false },
        "qwen35" => PreSplit::Regex { pattern: QWEN35_SPLIT, nfc: true, ignore_merges: false },
        "llama3" | "llama-v3" | "llama-bpe" => {
            PreSplit::Regex { pattern: LLAMA3_SPLIT, nfc: false, ignore_merges: true }
        }
        _ => return None,
    })
}

pub(crate) fn build(file: &GgufFile) -> Result<Tokenizer> {
    let path = file.path();
    let bad = |reason: String| Error::bad_file(path, reason);
    let model = file
        .get_str("tokenizer.ggml.model")?
        .ok_or_else(|| bad("no tokenizer.ggml.model in the GGUF metadata".into()))?;
    if model != "gpt2" {
        return Err(Error::Unsupported(format!(
            "{}: tokenizer.ggml.model {model:?} (only \"gpt2\", byte-level BPE)",
            path.display()
        )));
    }
    let pre_name = file.get_str("tokenizer.ggml.pre")?.unwrap_or("default");
    let split = pre_split(pre_name).ok_or_else(|| {
        Error::Unsupported(format!(
            "{}: tokenizer.ggml.pre {pre_name:?} (supported: default, gpt2, smollm, starcoder, qwen2, qwen35, llama-bpe)",
            path.display()
        ))
    })?;

    let tokens = file
        .get("tokenizer.ggml.tokens")
        .ok_or_else(|| bad("no tokenizer.ggml.tokens in the GGUF metadata".into()))?
        .as_strings()
        .ok_or_else(|| bad("tokenizer.ggml.tokens must be an array of strings".into()))?;
    if tokens.is_empty() || u32::try_from(tokens.len()).is_err() {
        return Err(bad(format!("tokenizer.ggml.tokens has {} entries", tokens.len())));
    }
    let merges = file
        .get("tokenizer.ggml.merges")
        .ok_or_else(|| bad("no tokenizer.ggml.merges in the GGUF metadata".into()))?
        .as_strings()
        .ok_or_else(|| bad("tokenizer.ggml.merges must be an array of strings".into()))?;
    let types: Option<&MetaArray> = match file.get("tokenizer.ggml.token_type") {
        None => None,
        Some(MetaValue::Array(a)) if a.len() == tokens.len() && (a.is_empty() || a.int_at(0).is_some()) => Some(a),
        Some(v) => {
            return Err(bad(format!(
                "tokenizer.ggml.token_type must be an integer array of {} entries, found {}",
                tokens.len(),
                v.type_name()
            )))
        }
    };

    // When a string appears twice, its first id wins (the later ones can still be decoded).
    let mut vocab: Vocab = Vocab::default();
    for (id, tok) in tokens.iter().enumerate() {
        vocab.entry(tok.clone()).or_insert(id as u32);
    }
    let mut merge_pairs = Vec::with_capacity(merges.len());
    for (i, m) in merges.iter().enumerate() {
        let (a, b) = m
            .split_once(' ')
            .ok_or_else(|| bad(format!("tokenizer.ggml.merges entry {i} ({m:?}) is not two tokens")))?;
        // Checked here: tokenizers 0.23 copies a merge's two halves into a buffer as long as the
        // longest token before it looks the result up, and panics when they are longer.
        if let Some(missing) = [a, b, &format!("{a}{b}")].into_iter().find(|t| !vocab.contains_key(*t)) {
            return Err(bad(format!("tokenizer.ggml.merges entry {i} ({m:?}) needs the token {missing:?}, which is not in the vocabulary")));
        }
        merge_pairs.push((a.to_string(), b.to_string()));
    }
    let ignore_merges = matches!(split, PreSplit::Regex { ignore_merges: true, .. });
    let bpe = crate::tokenizer::guarded("building the GGUF file's BPE model", || {
        BPE::builder()
            .vocab_and_merges(vocab, merge_pairs)
            .ignore_merges(ignore_merges)
            .cache_capacity(crate::tokenizer::BPE_CACHE_WORDS)
            .build()
            .map_err(|e| e.to_string())
    })
    .map_err(|e| bad(format!("cannot build the BPE tokenizer: {e}")))?;

    let mut tk = Tokenizer::new(bpe);
    let byte_level = ByteLevel::default().add_prefix_space(false).trim_offsets(false);
    match split {
        PreSplit::Gpt2 => {
            tk.with_pre_tokenizer(Some(byte_level.use_regex(true)));
        }
        PreSplit::DigitsThenGpt2 => {
            let seq: Vec<PreTokenizerWrapper> = vec![Digits::new(true).into(), byte_level.use_regex(true).into()];
            tk.with_pre_tokenizer(Some(Sequence::new(seq)));
        }
        PreSplit::Regex { pattern, nfc, .. } => {
            let split = Split::new(SplitPattern::Regex(pattern.to_string()), SplitDelimiterBehavior::Isolated, false)
                .map_err(|e| Error::Tokenizer(format!("pre-tokenizer regex: {e}")))?;
            let seq: Vec<PreTokenizerWrapper> = vec![split.into(), byte_level.use_regex(false).into()];
            tk.with_pre_tokenizer(Some(Sequence::new(seq)));
            if nfc {
                tk.with_normalizer(Some(NFC)).map_err(|e| Error::Tokenizer(e.to_string()))?;
            }
        }
    }
    tk.with_decoder(Some(ByteLevelDecoder::default()));

    let type_of = |i: usize| types.and_then(|a| a.int_at(i));
    let control: Vec<AddedToken> = (0..tokens.len())
        .filter(|&i| type_of(i) == Some(TOKEN_CONTROL))
        .map(|i| AddedToken::from(tokens[i].clone(), true).normalized(false))
        .collect();
    let user: Vec<AddedToken> = (0..tokens.len())
        .filter(|&i| type_of(i) == Some(TOKEN_USER_DEFINED))
        .map(|i| AddedToken::from(tokens[i].clone(), false).normalized(false))
        .collect();
    tk.add_special_tokens(control).map_err(|e| Error::Tokenizer(e.to_string()))?;
    tk.add_tokens(user).map_err(|e| Error::Tokenizer(e.to_string()))?;

    // llama.cpp prepends BOS when the file asks for it; encode(.., add_special_tokens = true) does too.
    if file.get_bool("tokenizer.ggml.add_bos_token")? == Some(true) {
        if let Some(bos) = file.get_u64("tokenizer.ggml.bos_token_id")? {
            let tok = usize::try_from(bos)
                .ok()
                .and_then(|i| tokens.get(i))
                .ok_or_else(|| bad(format!("tokenizer.ggml.bos_token_id {bos} is not in the vocabulary")))?;
            let post = TemplateProcessing::builder()
                .try_single(format!("{tok}:0 $A:0"))
                .and_then(|b| b.try_pair(format!("{tok}:0 $A:0 $B:1")))
                .map_err(|e| Error::Tokenizer(format!("BOS template: {e}")))?
                .special_tokens(vec![(tok.clone(), bos as u32)])
                .build()
                .map_err(|e| Error::Tokenizer(format!("BOS template: {e}")))?;
            tk.with_post_processor(Some(post));
        }
    }
    Ok(tk)
}
