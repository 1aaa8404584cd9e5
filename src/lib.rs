//! Atlas: a pure-Rust inference engine for Qwen3-family models, usable from Rust and (through the
//! C ABI) from any C/C++ host.

pub mod api;
pub mod backend;
pub mod cache;
pub mod chat;
pub mod engine;
pub mod error;
pub mod eval;
pub mod gguf;
pub mod grammar;
pub mod ffi;
pub mod model;
pub mod quantize;
pub mod quant;
pub mod sampling;
pub mod tokenizer;

pub use backend::cpu::CpuKernels;
pub use engine::{Device, Engine, EngineOptions, FinishReason, GenerateRequest, Generation, LoadReport};
pub use error::{Error, Result};
