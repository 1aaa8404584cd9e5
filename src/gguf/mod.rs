//! GGUF model files (llama.cpp's format): the container reader and writer, a [`WeightSource`] over
//! it under Hugging Face tensor names, and the model config and tokenizer rebuilt from its metadata.
//!
//! [`WeightSource`]: crate::model::WeightSource

mod reader;
mod store;
mod tokenizer;
mod writer;

pub use reader::{GgmlType, GgufFile, MetaArray, MetaValue, TensorInfo, DEFAULT_ALIGNMENT};
pub use store::{dense_dtype, hf_name, unpermute_rows, untile_value_heads, GgufStore, SpecialTokens};
pub use writer::{write_gguf, TensorOut};
