//! The C ABI. JSON in, JSON out; every entry point catches panics and reports failures as a
//! status code plus a message, so nothing unwinds into the host. The rules a host relies on
//! (ownership, threads, re-entrancy, limits) are in the header comment of cbindgen.toml, which
//! heads include/atlas.h; the machinery behind them is in `handles`.

mod handles;

use std::ffi::{c_char, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;

use serde_json::Value;

use crate::api::{prepare, run, Endpoint, DEFAULT_MAX_REQUEST_BYTES};
use crate::engine::{Device, Engine, EngineOptions, DEFAULT_DRAFT_P_MIN, DEFAULT_PREFILL_CHUNK};
use crate::{CpuKernels, Error};
use handles::{Loaded, Reentry};

/// Version of this C ABI; bumped on any incompatible change.
pub const ATLAS_ABI_VERSION: u32 = 1;

/// Status codes returned by the C ABI.
#[repr(i32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtlasStatus {
    Ok = 0,
    /// A NULL pointer, invalid UTF-8, or malformed load options.
    InvalidArgument = 1,
    /// The request JSON is malformed or asks for something impossible.
    InvalidRequest = 2,
    /// The model files are missing, corrupt or inconsistent.
    ModelLoad = 3,
    /// A valid request or model that Atlas does not support (yet).
    Unsupported = 4,
    /// Prompt plus max_tokens exceed the context size.
    ContextOverflow = 5,
    /// The GPU or its runtime failed.
    Device = 6,
    /// The chunk callback returned non-zero.
    Cancelled = 7,
    /// A bug in Atlas (a caught panic); the model stays usable.
    Internal = 8,
    /// The KV cache that all sequences share has no room for the request now (others hold
    /// it): try again later, or load with a larger kv_cache_bytes.
    CacheFull = 9,
}

/// A loaded model. Opaque to C: the pointer is a handle that the library looks up in a table and
/// never dereferences, so a handle used after atlas_unload gets an error, not freed memory.
pub struct AtlasModel {
    _opaque: [u8; 0],
}

/// Called once per streamed chunk with the JSON of one chat.completion.chunk; return non-zero to cancel.
pub type AtlasChunkCallback = Option<unsafe extern "C" fn(chunk_json: *const c_char, user_data: *mut c_void) -> i32>;

fn status_of(e: &Error, loading: bool) -> AtlasStatus {
    match e {
        Error::Unsupported(_) => AtlasStatus::Unsupported,
        Error::InvalidArgument(_) => AtlasStatus::InvalidArgument,
        Error::Device(_) => AtlasStatus::Device,
        _ if loading => AtlasStatus::ModelLoad,
        Error::InvalidRequest(_) | Error::Template(_) => AtlasStatus::InvalidRequest,
        Error::ContextOverflow(_) => AtlasStatus::ContextOverflow,
        Error::CacheFull(_) => AtlasStatus::CacheFull,
        Error::Cancelled => AtlasStatus::Cancelled,
        _ => AtlasStatus::Internal,
    }
}

/// Copies `s` into a C string owned by the caller (freed with atlas_string_free). Interior NULs,
/// impossible in JSON output, are replaced rather than trusted.
fn to_c_string(s: &str) -> *mut c_char {
    let owned = CString::new(s).unwrap_or_else(|_| CString::new(s.replace('\0', "\u{fffd}")).unwrap_or_default());
    owned.into_raw()
}

/// # Safety
/// `out` is NULL or points to writable storage for a pointer.
unsafe fn set_out(out: *mut *mut c_char, value: Option<&str>) {
    if !out.is_null() {
        *out = value.map_or(std::ptr::null_mut(), to_c_string);
    }
}

/// # Safety
/// `p` is NULL or a NUL-terminated string.
unsafe fn str_arg<'a>(p: *const c_char, what: &str) -> Result<&'a str, (AtlasStatus, String)> {
    if p.is_null() {
        return Err((AtlasStatus::InvalidArgument, format!("{what} is NULL")));
    }
    CStr::from_ptr(p)
        .to_str()
        .map_err(|e| (AtlasStatus::InvalidArgument, format!("{what} is not valid UTF-8: {e}")))
}

/// Runs `f`, turning a panic into Internal; writes the error message to `out_error`.
fn guarded(out_error: *mut *mut c_char, f: impl FnOnce() -> Result<(), (AtlasStatus, String)>) -> i32 {
    let result = catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        let msg = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        Err((AtlasStatus::Internal, format!("internal error: {msg}")))
    });
    // SAFETY: the caller passes NULL or a valid pointer slot, as documented.
    unsafe {
        match result {
            Ok(()) => {
                set_out(out_error, None);
                AtlasStatus::Ok as i32
            }
            Err((status, msg)) => {
                set_out(out_error, Some(&msg));
                status as i32
            }
        }
    }
}

/// The version of the C ABI described by atlas.h.
#[no_mangle]
pub extern "C" fn atlas_abi_version() -> u32 {
    ATLAS_ABI_VERSION
}

/// The library version, a static string (never freed).
#[no_mangle]
pub extern "C" fn atlas_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

const OPTION_KEYS: [&str; 13] = [
    "model",
    "device",
    "ctx_size",
    "threads",
    "seed",
    "max_request_bytes",
    "prefix_cache_bytes",
    "kv_cache_bytes",
    "draft_max",
    "draft_p_min",
    "parallel",
    "prefill_chunk",
    "cpu_kernels",
];

/// Load options as the C ABI takes them.
struct LoadOptions {
    engine: EngineOptions,
    seed: Option<u64>,
    max_request_bytes: usize,
}

fn parse_options(json: &str) -> Result<LoadOptions, Error> {
    let v: Value = serde_json::from_str(json).map_err(|e| Error::InvalidArgument(format!("options are not valid JSON: {e}")))?;
    let obj = v.as_object().ok_or_else(|| Error::InvalidArgument("options must be a JSON object".into()))?;
    if let Some(k) = obj.keys().find(|k| !OPTION_KEYS.contains(&k.as_str())) {
        return Err(Error::InvalidArgument(format!("unknown option {k:?} (known: {})", OPTION_KEYS.join(", "))));
    }
    let uint = |k: &str| -> Result<Option<usize>, Error> {
        match obj.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => x
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| Error::InvalidArgument(format!("option {k} must be a non-negative integer"))),
        }
    };
    let model = obj
        .get("model")
        .and_then(Value::as_str)
        .ok_or_else(|| Error::InvalidArgument("option model (the model directory) is required".into()))?;
    let device = match obj.get("device") {
        None | Some(Value::Null) => Device::Auto,
        Some(Value::String(s)) => s.parse()?,
        Some(_) => return Err(Error::InvalidArgument("option device must be a string".into())),
    };
    let engine = EngineOptions {
        model_dir: PathBuf::from(model),
        device,
        ctx_size: uint("ctx_size")?,
        threads: uint("threads")?.unwrap_or(0),
        prefix_cache_bytes: uint("prefix_cache_bytes")?,
        kv_cache_bytes: uint("kv_cache_bytes")?,
        draft_max: uint("draft_max")?.unwrap_or(0),
        draft_p_min: match obj.get("draft_p_min") {
            None | Some(Value::Null) => DEFAULT_DRAFT_P_MIN,
            Some(x) => x
                .as_f64()
                .filter(|p| (0.0..=1.0).contains(p))
                .ok_or_else(|| Error::InvalidArgument("option draft_p_min must be a number from 0 to 1".into()))? as f32,
        },
        parallel: uint("parallel")?.unwrap_or(0),
        prefill_chunk: uint("prefill_chunk")?.unwrap_or(DEFAULT_PREFILL_CHUNK),
        cpu_kernels: match obj.get("cpu_kernels") {
            None | Some(Value::Null) => CpuKernels::Auto,
            Some(Value::String(s)) => s.parse()?,
            Some(_) => return Err(Error::InvalidArgument("option cpu_kernels must be a string".into())),
        },
    };
    let max_request_bytes = match uint("max_request_bytes")? {
        Some(0) => return Err(Error::InvalidArgument("option max_request_bytes must be greater than zero".into())),
        n => n.unwrap_or(DEFAULT_MAX_REQUEST_BYTES),
    };
    let seed = obj
        .get("seed")
        .filter(|v| !v.is_null())
        .map(|v| v.as_u64().ok_or_else(|| Error::InvalidArgument("option seed must be a non-negative integer".into())))
        .transpose()?;
    Ok(LoadOptions { engine, seed, max_request_bytes })
}

fn failed(e: Error, loading: bool) -> (AtlasStatus, String) {
    (status_of(&e, loading), e.to_string())
}

/// Loads a model. `options_json`: {"model": DIR, "device": "auto"|"cpu"|"hip"|"cuda",
/// "ctx_size": N, "threads": N, "seed": N, "max_request_bytes": N, "prefix_cache_bytes": N, "kv_cache_bytes": N,
/// "draft_max": N, "draft_p_min": P, "parallel": N, "prefill_chunk": N, "cpu_kernels": K};
/// unknown keys are an error. `draft_p_min`: the least probability of a token the model's own
/// drafting head guesses (default 0.75); `parallel`: requests decoded at once (0 or absent: as
/// the device memory allows; 1 on the CPU); `prefill_chunk`: prompt positions read per step
/// while others decode (default 512; 0: all); `cpu_kernels`: "auto" (the default: integer dot
/// products for GGUF block weights on the CPU, inputs rounded to 8 bits, as llama.cpp), "avx2"
/// (those sums without AVX-512 VNNI), "scalar" (the same sums in plain code) or "reference"
/// (every weight widened to f32, slower).
/// On success `*out_model` holds the handle (release it with atlas_unload).
///
/// # Safety
/// Pointers are NULL or valid; `options_json` is NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn atlas_load(options_json: *const c_char, out_model: *mut *mut AtlasModel, out_error: *mut *mut c_char) -> i32 {
    guarded(out_error, || {
        if out_model.is_null() {
            return Err((AtlasStatus::InvalidArgument, "out_model is NULL".into()));
        }
        *out_model = std::ptr::null_mut();
        let json = str_arg(options_json, "options_json")?;
        let opts = parse_options(json).map_err(|e| failed(e, true))?;
        let mut engine = Engine::load(&opts.engine, &mut |_| {}).map_err(|e| failed(e, true))?;
        engine.set_default_seed(opts.seed);
        let info = serde_json::to_string(engine.report()).map_err(|e| (AtlasStatus::Internal, e.to_string()))?;
        let engines = engine.split().map_err(|e| failed(e, true))?;
        let loaded = Loaded::new(engines, info, opts.max_request_bytes).map_err(|e| failed(e, true))?;
        *out_model = handles::insert(loaded);
        Ok(())
    })
}

/// Releases a model. Waits for every call on it that has already begun (running or queued
/// requests, model_info); calls that begin after it fail with ATLAS_STATUS_INVALID_ARGUMENT.
/// From inside an on_chunk callback of a request on the same model it returns at once and the
/// model is released when that request returns. NULL and unknown handles are ignored.
///
/// # Safety
/// None beyond the handle being a value (it is never dereferenced).
#[no_mangle]
pub unsafe extern "C" fn atlas_unload(model: *mut AtlasModel) {
    let _ = catch_unwind(AssertUnwindSafe(|| handles::unload(model)));
}

/// Runs an OpenAI chat-completions request. With "stream": true and a callback, each
/// chat.completion.chunk is passed to `on_chunk` (non-zero cancels: status Cancelled). On success
/// `*out_response_json` holds the chat.completion JSON.
///
/// # Safety
/// `model` is a handle from atlas_load; other pointers are NULL or valid; strings are
/// NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn atlas_chat_completion(
    model: *mut AtlasModel,
    request_json: *const c_char,
    on_chunk: AtlasChunkCallback,
    user_data: *mut c_void,
    out_response_json: *mut *mut c_char,
    out_error: *mut *mut c_char,
) -> i32 {
    completion(Endpoint::Chat, model, request_json, on_chunk, user_data, out_response_json, out_error)
}

/// Runs an OpenAI text-completions request (`/v1/completions`: a prompt string or token ids,
/// `echo`, `suffix` for fill-in-the-middle, `logprobs` 0-5), as atlas_chat_completion runs a chat
/// request: text_completion chunks to `on_chunk`, the whole text_completion JSON in
/// `*out_response_json`. A host that must also run with older libraries looks it up with dlsym.
///
/// # Safety
/// As atlas_chat_completion.
#[no_mangle]
pub unsafe extern "C" fn atlas_text_completion(
    model: *mut AtlasModel,
    request_json: *const c_char,
    on_chunk: AtlasChunkCallback,
    user_data: *mut c_void,
    out_response_json: *mut *mut c_char,
    out_error: *mut *mut c_char,
) -> i32 {
    completion(Endpoint::Text, model, request_json, on_chunk, user_data, out_response_json, out_error)
}

/// The body of both completion calls.
///
/// # Safety
/// As atlas_chat_completion.
unsafe fn completion(
    endpoint: Endpoint,
    model: *mut AtlasModel,
    request_json: *const c_char,
    on_chunk: AtlasChunkCallback,
    user_data: *mut c_void,
    out_response_json: *mut *mut c_char,
    out_error: *mut *mut c_char,
) -> i32 {
    set_out(out_response_json, None);
    guarded(out_error, || {
        let call = handles::Call::enter(model).map_err(|e| failed(e, false))?;
        let _running = Reentry::begin(&call).map_err(|e| failed(e, false))?;
        let loaded = &call.loaded;
        if request_json.is_null() {
            return Err((AtlasStatus::InvalidArgument, "request_json is NULL".into()));
        }
        let size = CStr::from_ptr(request_json).to_bytes().len();
        if size > loaded.max_request_bytes {
            return Err((
                AtlasStatus::InvalidRequest,
                format!("the request is {size} bytes, over the limit of {} (load option max_request_bytes)", loaded.max_request_bytes),
            ));
        }
        let text = str_arg(request_json, "request_json")?;
        let turn = loaded.take_turn();
        // Parsing, rendering and tokenizing need no engine: done while earlier requests run.
        let prepared = prepare(&loaded.front, endpoint, text).map_err(|e| failed(e, false))?;
        let mut engine = turn.engine().map_err(|e| failed(e, false))?;
        let mut sink = |chunk: &str| match on_chunk {
            Some(cb) => {
                let c = CString::new(chunk).unwrap_or_default();
                cb(c.as_ptr(), user_data) == 0
            }
            None => true,
        };
        let response = run(engine.get(), prepared, &mut sink).map_err(|e| failed(e, false))?;
        set_out(out_response_json, Some(&response.to_string()));
        Ok(())
    })
}

/// Describes the loaded model as JSON (device, architecture, context size, ...). It never waits
/// for a running request, and may be called from inside on_chunk.
///
/// # Safety
/// `model` is a handle from atlas_load; other pointers are NULL or valid.
#[no_mangle]
pub unsafe extern "C" fn atlas_model_info(model: *mut AtlasModel, out_info_json: *mut *mut c_char, out_error: *mut *mut c_char) -> i32 {
    set_out(out_info_json, None);
    guarded(out_error, || {
        let call = handles::Call::enter(model).map_err(|e| failed(e, false))?;
        set_out(out_info_json, Some(&call.loaded.info));
        Ok(())
    })
}

/// Frees a string returned by the library. NULL is ignored.
///
/// # Safety
/// `s` is NULL or a string from this library, freed once.
#[no_mangle]
pub unsafe extern "C" fn atlas_string_free(s: *mut c_char) {
    if !s.is_null() {
        drop(CString::from_raw(s));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_an_internal_error_with_its_message() {
        let mut err: *mut c_char = std::ptr::null_mut();
        let rc = guarded(&mut err, || panic!("boom {}", 7));
        assert_eq!(rc, AtlasStatus::Internal as i32);
        // SAFETY: `guarded` set `err` to a NUL-terminated string of ours.
        let msg = unsafe { CStr::from_ptr(err) }.to_str().unwrap().to_string();
        // SAFETY: that string, freed once.
        unsafe { atlas_string_free(err) };
        assert_eq!(msg, "internal error: boom 7");
    }

    #[test]
    fn options_are_checked() {
        let opts = parse_options(r#"{"model": "m", "threads": 2, "seed": 5}"#).unwrap();
        assert_eq!((opts.seed, opts.max_request_bytes), (Some(5), DEFAULT_MAX_REQUEST_BYTES));
        assert_eq!(parse_options(r#"{"model": "m", "max_request_bytes": 100}"#).unwrap().max_request_bytes, 100);
        assert_eq!(opts.engine.prefill_chunk, DEFAULT_PREFILL_CHUNK);
        assert_eq!(parse_options(r#"{"model": "m", "prefill_chunk": 0}"#).unwrap().engine.prefill_chunk, 0);
        assert_eq!(opts.engine.draft_p_min, DEFAULT_DRAFT_P_MIN);
        assert_eq!(parse_options(r#"{"model": "m", "draft_p_min": 0.5}"#).unwrap().engine.draft_p_min, 0.5);
        assert_eq!(opts.engine.cpu_kernels, CpuKernels::Auto);
        assert_eq!(parse_options(r#"{"model": "m", "cpu_kernels": "reference"}"#).unwrap().engine.cpu_kernels, CpuKernels::Reference);
        for bad in [
            r#"{"model": 1}"#,
            r#"{"model": "m", "ctx_size": "big"}"#,
            r#"{"model": "m", "typo": 1}"#,
            r#"{"model": "m", "max_request_bytes": 0}"#,
            r#"{"model": "m", "seed": -1}"#,
            r#"{"model": "m", "prefill_chunk": -2}"#,
            r#"{"model": "m", "draft_p_min": 1.5}"#,
            r#"{"model": "m", "draft_p_min": "high"}"#,
            r#"{"model": "m", "cpu_kernels": "fast"}"#,
            r#"{"model": "m", "cpu_kernels": 1}"#,
            "[]",
        ] {
            assert!(matches!(parse_options(bad), Err(Error::InvalidArgument(_))), "{bad}");
        }
    }
}
