//! config.json: arbitrary bytes parsed as JSON, then `ModelConfig::from_json` (every size checked
//! against the limits before anything is sized by it).
#![no_main]

use atlas::model::ModelConfig;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(json) = serde_json::from_slice::<serde_json::Value>(data) else { return };
    if let Ok(config) = ModelConfig::from_json(&json) {
        // What the model code computes from a config first.
        let _ = (config.q_width(), config.kv_width());
        if let Some(h) = &config.hybrid {
            let _ = (h.conv_dim(), h.value_dim());
        }
        config.validate().expect("a config from_json accepted must validate");
    }
});
