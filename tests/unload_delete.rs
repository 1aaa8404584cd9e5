//! Once a model is unloaded its files can be replaced and deleted by the same process: on Windows a
//! memory-mapped file can be neither rewritten (ERROR_USER_MAPPED_FILE) nor deleted
//! (ERROR_ACCESS_DENIED), so a view kept past unload (or a handle, which without POSIX delete
//! semantics keeps a deleted file, and so its directory, in place) would keep a Lemonade user from
//! deleting or updating a model until the server exits. Each test loads a copy of a fixture, runs
//! it, unloads it, then rewrites every file and removes the directory.
//!
//! Runs on Linux and, through scripts/test_windows.sh, under Wine. Wine refuses to rewrite a
//! mapped file, as Windows does (`a_mapped_file_cannot_be_rewritten`, Windows only), and keeps a
//! deleted file that is still open until its last handle closes, so that its directory cannot be
//! removed (ERROR_DIR_NOT_EMPTY); but it deletes a mapped file, which Windows refuses. So under
//! Wine the rewrite catches a mapping left behind and the directory removal a handle left open
//! (both were tried by leaking one); on Linux only the loading and unloading are exercised.

use std::ffi::{CStr, CString};
use std::os::raw::c_char;
use std::path::{Path, PathBuf};

use atlas::ffi::{atlas_chat_completion, atlas_load, atlas_string_free, atlas_unload, AtlasStatus};
use atlas::sampling::SamplingParams;
use atlas::{Device, Engine, EngineOptions, GenerateRequest};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models").join(name)
}

/// A fresh temporary directory holding a copy of the fixture `name` (a directory or a file).
fn scratch_copy(name: &str, tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("atlas-unload-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let src = fixture(name);
    let files: Vec<PathBuf> = if src.is_dir() {
        std::fs::read_dir(&src).unwrap().map(|e| e.unwrap().path()).collect()
    } else {
        vec![src]
    };
    for path in files {
        std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
    }
    dir
}

/// Overwrites every file in `dir` (fails while one is still mapped on Windows and under Wine),
/// then deletes the directory (fails while a file is mapped on Windows, or open without
/// FILE_SHARE_DELETE on Windows and under Wine).
fn rewrite_then_delete(dir: &Path) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        std::fs::write(&path, b"replaced").unwrap_or_else(|e| panic!("rewriting {} after unload: {e}", path.display()));
    }
    std::fs::remove_dir_all(dir).unwrap_or_else(|e| panic!("deleting {} after unload: {e}", dir.display()));
    assert!(!dir.exists());
}

fn greedy(prompt: Vec<u32>) -> GenerateRequest {
    GenerateRequest { prompt, max_tokens: Some(4), sampling: SamplingParams::default(), stop: vec![], ignore_eos: true, grammar: None, logprobs: None }
}

#[test]
fn safetensors_directory_after_engine_drop() {
    let dir = scratch_copy("qwen3_untied_gqa", "safetensors");
    let mut opts = EngineOptions::new(&dir);
    opts.device = Device::Cpu;
    opts.threads = 2;
    let mut engine = Engine::load(&opts, &mut |_| {}).unwrap();
    assert_eq!(engine.generate_raw(&greedy(vec![1, 2, 3])).unwrap().tokens.len(), 4);
    drop(engine);
    rewrite_then_delete(&dir);
}

#[test]
fn gguf_file_after_engine_drop() {
    for file in ["qwen3_5_tiny.q8_0.gguf", "qwen3_moe_tiny.gguf"] {
        let dir = scratch_copy(file, file);
        let mut opts = EngineOptions::new(dir.join(file));
        opts.device = Device::Cpu;
        opts.threads = 2;
        let mut engine = Engine::load(&opts, &mut |_| {}).unwrap();
        assert_eq!(engine.generate_raw(&greedy(vec![1, 2, 3])).unwrap().tokens.len(), 4, "{file}");
        drop(engine);
        rewrite_then_delete(&dir);
    }
}

/// As Lemonade does it: atlas_load, a chat completion, atlas_unload, through the C ABI.
#[test]
fn model_directory_after_atlas_unload() {
    let dir = scratch_copy("chat_tiny", "c-abi");
    let opts = serde_json::json!({"model": dir, "device": "cpu", "ctx_size": 256, "threads": 2}).to_string();
    let opts = CString::new(opts).unwrap();
    let mut model = std::ptr::null_mut();
    let mut err: *mut c_char = std::ptr::null_mut();
    // SAFETY: NUL-terminated options and out-pointers to locals.
    let rc = unsafe { atlas_load(opts.as_ptr(), &mut model, &mut err) };
    // SAFETY: on failure (the only time the message is formatted) `err` is the library's string.
    assert_eq!(rc, AtlasStatus::Ok as i32, "{}", unsafe { CStr::from_ptr(err) }.to_string_lossy());

    let req = CString::new(r#"{"messages":[{"role":"user","content":"Hi"}],"max_tokens":4,"temperature":0}"#).unwrap();
    let mut resp: *mut c_char = std::ptr::null_mut();
    // SAFETY: a loaded model, a NUL-terminated request, no callback, out-pointers to locals.
    let rc = unsafe { atlas_chat_completion(model, req.as_ptr(), None, std::ptr::null_mut(), &mut resp, &mut err) };
    assert_eq!(rc, AtlasStatus::Ok as i32);
    // SAFETY: on success `resp` is the library's NUL-terminated response.
    assert!(unsafe { CStr::from_ptr(resp) }.to_string_lossy().contains("chat.completion"));
    // SAFETY: the response freed once, the model unloaded once.
    unsafe {
        atlas_string_free(resp);
        atlas_unload(model);
    }
    rewrite_then_delete(&dir);
}

/// The rewrite above would notice a file left mapped: while the loaders' own readers hold their
/// files, rewriting them fails (ERROR_USER_MAPPED_FILE, on Windows and under Wine alike). Not on
/// Linux, where truncating a mapped file is allowed.
#[cfg(windows)]
#[test]
fn a_mapped_file_cannot_be_rewritten() {
    use atlas::gguf::GgufFile;
    use atlas::model::safetensors::SafetensorsStore;
    const ERROR_USER_MAPPED_FILE: i32 = 1224;

    let dir = scratch_copy("qwen3_5_tiny.q8_0.gguf", "mapped-gguf");
    let file = dir.join("qwen3_5_tiny.q8_0.gguf");
    let reader = GgufFile::open(&file).unwrap();
    let e = std::fs::write(&file, b"replaced").expect_err("rewrote a GGUF file the reader has mapped");
    assert_eq!(e.raw_os_error(), Some(ERROR_USER_MAPPED_FILE), "{e}");
    drop(reader);
    rewrite_then_delete(&dir);

    let dir = scratch_copy("qwen3_tied", "mapped-safetensors");
    let store = SafetensorsStore::open_dir(&dir).unwrap();
    let e = std::fs::write(dir.join("model.safetensors"), b"replaced").expect_err("rewrote a mapped safetensors file");
    assert_eq!(e.raw_os_error(), Some(ERROR_USER_MAPPED_FILE), "{e}");
    drop(store);
    rewrite_then_delete(&dir);
}
