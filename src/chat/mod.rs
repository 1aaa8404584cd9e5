//! Chat formatting: the model's own Jinja template, and (later) tool-call and reasoning parsing.

pub mod template;

pub use template::ChatTemplate;
