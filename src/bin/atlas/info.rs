//! `atlas info`: what a model holds and what it needs, read from headers only.

use std::collections::BTreeMap;

use atlas::engine::{model_format, ModelFormat};
use atlas::gguf::GgufStore;
use atlas::model::safetensors::SafetensorsStore;
use atlas::model::config::LayerKind;
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
    // Only attention layers keep keys and values per token (the CPU backend in f32); Gated DeltaNet
    // layers keep a fixed-size state instead.
    let attention_layers = config.hybrid.as_ref().map_or(config.num_layers, |h| h.layer_kinds.iter().filter(|k| **k == LayerKind::Attention).count());
    let kv_per_token = attention_layers * 2 * config.kv_width() * 4;
    let recurrent_bytes = config.hybrid.as_ref().map_or(0, |h| {
        let layers = config.num_layers - attention_layers;
        layers * 4 * ((h.conv_kernel - 1) * h.conv_dim() + h.value_heads * h.key_head_dim * h.value_head_dim)
    });
    let gb = |b: usize| b as f64 / 1e9;
    println!("model             {} ({format})", path.display());
    println!("architecture      {}", config.arch.name());
    match &config.hybrid {
        Some(h) => println!(
            "layers            {} ({} Gated DeltaNet, {} full attention: {})",
            config.num_layers,
            config.num_layers - attention_layers,
            attention_layers,
            h.layer_kinds.iter().map(|k| if *k == LayerKind::Attention { 'F' } else { 'L' }).collect::<String>()
        ),
        None => println!("layers            {}", config.num_layers),
    }
    println!("hidden size       {}", config.hidden_size);
    println!("ffn size          {}", config.intermediate_size);
    println!(
        "attention         {} query heads, {} key/value heads, head_dim {}{}",
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        if config.qk_norm { ", q/k norm" } else { "" }
    );
    if let Some(h) = &config.hybrid {
        println!(
            "gated deltanet    {} key heads of {}, {} value heads of {}, conv kernel {}",
            h.key_heads, h.key_head_dim, h.value_heads, h.value_head_dim, h.conv_kernel
        );
    }
    if config.rotary_dim != config.head_dim {
        println!("rotary            first {} of {} values per head", config.rotary_dim, config.head_dim);
    }
    if let Some(m) = &config.moe {
        let sparse = m.sparse_layers.iter().filter(|s| **s).count();
        let shared = match m.shared_expert_intermediate_size {
            0 => String::new(),
            n => format!(", a shared expert of {n}"),
        };
        println!(
            "experts           {} of {} per token, {} each{shared}, in {sparse} of {} layers",
            m.experts_per_token, m.num_experts, m.expert_intermediate_size, config.num_layers
        );
    }
    println!("vocabulary        {}", config.vocab_size);
    println!("tied embeddings   {}", config.tie_word_embeddings);
    println!("max positions     {}", config.max_position_embeddings);
    println!("parameters        {params} ({:.3} B)", params as f64 / 1e9);
    let mix: Vec<String> =
        dtypes.iter().map(|(d, n)| format!("{d} {:.1}%", *n as f64 * 100.0 / params.max(1) as f64)).collect();
    println!("dtypes            {}", mix.join(", "));
    println!("weights           {:.3} GB", gb(weight_bytes));
    println!("kv cache          {:.3} GB at context {ctx} ({kv_per_token} bytes per token)", gb(kv_per_token * ctx));
    if recurrent_bytes > 0 {
        println!("recurrent state   {:.3} GB (per sequence, any length)", gb(recurrent_bytes));
    }
    println!("memory needed     {:.3} GB", gb(weight_bytes + kv_per_token * ctx + recurrent_bytes));
    Ok(())
}

fn owned(summary: Vec<(&str, String, usize, usize)>) -> Vec<(String, usize, usize)> {
    summary.into_iter().map(|(_, dtype, count, bytes)| (dtype, count, bytes)).collect()
}
