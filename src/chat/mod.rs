//! Chat formatting: the model's own Jinja template in, reasoning / content / tool calls out.

pub mod output;
pub mod template;

pub use template::ChatTemplate;
