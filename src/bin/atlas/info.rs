//! `atlas info`: what a model holds and what it needs, read from headers only.

use std::collections::BTreeMap;

use atlas::engine::{model_format, ModelFormat};
use atlas::gguf::GgufStore;
use atlas::model::safetensors::SafetensorsStore;
use atlas::model::ModelConfig;
use atlas::{EngineOptions, Result};

pub fn print(opts: &EngineOptions) -> Result<()> {
    let path = &opts.model_dir;
    let (config, tensors, format) = match model_format(path)? {
        ModelFormat::HfDirectory => {
            let store = SafetensorsStore::open_dir(path)?;
            let tensors = owned(store.summary());
            (ModelConfig::from_file(&path.join("config.json"))?, tensors, "safetensors")
        }
        ModelFormat::Gguf(file) => {
            let store = GgufStore::open(&file)?;
            (store.config()?, owned(store.summary()), "gguf")
        }
    };
    let mut params = 0usize;
    let mut weight_bytes = 0usize;
    let mut dtypes: BTreeMap<String, usize> = BTreeMap::new();
    for (dtype, count, bytes) in tensors {
        params += count;
        weight_bytes += bytes;
        *dtypes.entry(dtype).or_default() += count;
    }
    let ctx = opts.ctx_size.unwrap_or(config.max_position_embeddings.min(4096));
    // The CPU backend keeps keys and values in f32.
    let kv_per_token = config.num_layers * 2 * config.kv_width() * 4;
    let gb = |b: usize| b as f64 / 1e9;
    println!("model             {} ({format})", path.display());
    println!("architecture      {}", config.arch.name());
    println!("layers            {}", config.num_layers);
    println!("hidden size       {}", config.hidden_size);
    println!("ffn size          {}", config.intermediate_size);
    println!(
        "attention         {} query heads, {} key/value heads, head_dim {}{}",
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        if config.qk_norm { ", q/k norm" } else { "" }
    );
    println!("vocabulary        {}", config.vocab_size);
    println!("tied embeddings   {}", config.tie_word_embeddings);
    println!("max positions     {}", config.max_position_embeddings);
    println!("parameters        {params} ({:.3} B)", params as f64 / 1e9);
    let mix: Vec<String> =
        dtypes.iter().map(|(d, n)| format!("{d} {:.1}%", *n as f64 * 100.0 / params.max(1) as f64)).collect();
    println!("dtypes            {}", mix.join(", "));
    println!("weights           {:.3} GB", gb(weight_bytes));
    println!("kv cache          {:.3} GB at context {ctx} ({kv_per_token} bytes per token)", gb(kv_per_token * ctx));
    println!("memory needed     {:.3} GB", gb(weight_bytes + kv_per_token * ctx));
    Ok(())
}

fn owned(summary: Vec<(&str, String, usize, usize)>) -> Vec<(String, usize, usize)> {
    summary.into_iter().map(|(_, dtype, count, bytes)| (dtype, count, bytes)).collect()
}
