//! The one error type of the crate. Every variant carries enough context (a file, a tensor, a key)
//! for a user to fix the problem without reading the source.

use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },

    #[error("{path}: {reason}")]
    BadFile { path: PathBuf, reason: String },

    #[error("tensor {name}: {reason}")]
    BadTensor { name: String, reason: String },

    #[error("unsupported: {0}")]
    Unsupported(String),

    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    #[error("invalid request: {0}")]
    InvalidRequest(String),

    #[error("context overflow: {0}")]
    ContextOverflow(String),

    /// The KV pool shared by all sequences has no room left for a request (others hold it).
    #[error("KV cache full: {0}")]
    CacheFull(String),

    #[error("chat template: {0}")]
    Template(String),

    #[error("tokenizer: {0}")]
    Tokenizer(String),

    #[error("device: {0}")]
    Device(String),

    #[error("cancelled")]
    Cancelled,
}

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }

    pub fn bad_file(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        Error::BadFile { path: path.into(), reason: reason.into() }
    }

    pub fn bad_tensor(name: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::BadTensor { name: name.into(), reason: reason.into() }
    }
}
