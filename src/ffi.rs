//! The C ABI. JSON in, JSON out; every entry point catches panics and reports failures as a
//! status code plus a message, so nothing unwinds into the host.
//!
//! Ownership: every `char *` the library hands out (responses, errors) is freed with
//! `atlas_string_free`; `atlas_version` returns a static string that is never freed.
//! Threads: any thread may call any function. Requests on one model run one at a time, in arrival
//! order (a mutex queues them). `atlas_unload` waits for requests already running on the model;
//! using a handle after `atlas_unload` has been called is undefined behaviour.

use std::ffi::{c_char, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::{Mutex, PoisonError};

use serde_json::Value;

use crate::api::{chat_completion, ChatRequest};
use crate::engine::{Device, Engine, EngineOptions};
use crate::Error;

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
}

/// A loaded model. Opaque to C.
pub struct AtlasModel {
    engine: Mutex<Engine>,
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

const OPTION_KEYS: [&str; 5] = ["model", "device", "ctx_size", "threads", "seed"];

fn parse_options(json: &str) -> Result<(EngineOptions, Option<u64>), Error> {
    let v: Value = serde_json::from_str(json).map_err(|e| Error::InvalidArgument(format!("options are not valid JSON: {e}")))?;
    let obj = v.as_object().ok_or_else(|| Error::InvalidArgument("options must be a JSON object".into()))?;
    if let Some(k) = obj.keys().find(|k| !OPTION_KEYS.contains(&k.as_str())) {
        return Err(Error::InvalidArgument(format!("unknown option {k:?} (known: {})", OPTION_KEYS.join(", "))));
    }
    let uint = |k: &str| -> Result<Option<u64>, Error> {
        match obj.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => x.as_u64().map(Some).ok_or_else(|| Error::InvalidArgument(format!("option {k} must be a non-negative integer"))),
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
    let opts = EngineOptions {
        model_dir: PathBuf::from(model),
        device,
        ctx_size: uint("ctx_size")?.map(|n| n as usize),
        threads: uint("threads")?.unwrap_or(0) as usize,
    };
    Ok((opts, uint("seed")?))
}

/// Loads a model. `options_json`: {"model": DIR, "device": "auto"|"cpu"|"hip"|"cuda",
/// "ctx_size": N, "threads": N, "seed": N}; unknown keys are an error. On success `*out_model`
/// holds the handle (release it with atlas_unload).
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
        let (opts, seed) = parse_options(json).map_err(|e| (status_of(&e, true), e.to_string()))?;
        let mut engine = Engine::load(&opts, &mut |_| {}).map_err(|e| (status_of(&e, true), e.to_string()))?;
        engine.set_default_seed(seed);
        *out_model = Box::into_raw(Box::new(AtlasModel { engine: Mutex::new(engine) }));
        Ok(())
    })
}

/// Releases a model; waits for requests running on it. NULL is ignored.
///
/// # Safety
/// `model` is NULL or a handle from atlas_load not yet unloaded.
#[no_mangle]
pub unsafe extern "C" fn atlas_unload(model: *mut AtlasModel) {
    if model.is_null() {
        return;
    }
    let _ = catch_unwind(AssertUnwindSafe(|| {
        let boxed = Box::from_raw(model);
        // Taking the lock waits for the request in flight, if any.
        drop(boxed.engine.lock().unwrap_or_else(PoisonError::into_inner));
        drop(boxed);
    }));
}

/// Runs an OpenAI chat-completions request. With "stream": true and a callback, each
/// chat.completion.chunk is passed to `on_chunk` (non-zero cancels: status Cancelled). On success
/// `*out_response_json` holds the chat.completion JSON.
///
/// # Safety
/// `model` is a live handle; other pointers are NULL or valid; strings are NUL-terminated.
#[no_mangle]
pub unsafe extern "C" fn atlas_chat_completion(
    model: *mut AtlasModel,
    request_json: *const c_char,
    on_chunk: AtlasChunkCallback,
    user_data: *mut c_void,
    out_response_json: *mut *mut c_char,
    out_error: *mut *mut c_char,
) -> i32 {
    set_out(out_response_json, None);
    guarded(out_error, || {
        let model = model.as_ref().ok_or((AtlasStatus::InvalidArgument, "model is NULL".to_string()))?;
        let text = str_arg(request_json, "request_json")?;
        let request = ChatRequest::from_json_str(text).map_err(|e| (status_of(&e, false), e.to_string()))?;
        let mut engine = lock(model);
        let mut sink = |chunk: &str| match on_chunk {
            Some(cb) => {
                let c = CString::new(chunk).unwrap_or_default();
                cb(c.as_ptr(), user_data) == 0
            }
            None => true,
        };
        let response = chat_completion(&mut engine, &request, &mut sink).map_err(|e| (status_of(&e, false), e.to_string()))?;
        set_out(out_response_json, Some(&response.to_string()));
        Ok(())
    })
}

/// Describes the loaded model as JSON (device, architecture, context size, ...).
///
/// # Safety
/// `model` is a live handle; other pointers are NULL or valid.
#[no_mangle]
pub unsafe extern "C" fn atlas_model_info(model: *mut AtlasModel, out_info_json: *mut *mut c_char, out_error: *mut *mut c_char) -> i32 {
    set_out(out_info_json, None);
    guarded(out_error, || {
        let model = model.as_ref().ok_or((AtlasStatus::InvalidArgument, "model is NULL".to_string()))?;
        let report = serde_json::to_string(lock(model).report()).map_err(|e| (AtlasStatus::Internal, e.to_string()))?;
        set_out(out_info_json, Some(&report));
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

/// A panic in an earlier request may have left the cache half-written: forget it, keep the model.
fn lock(model: &AtlasModel) -> std::sync::MutexGuard<'_, Engine> {
    model.engine.lock().unwrap_or_else(|poisoned| {
        model.engine.clear_poison();
        let mut engine = poisoned.into_inner();
        engine.reset_cache();
        engine
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_an_internal_error_with_its_message() {
        let mut err: *mut c_char = std::ptr::null_mut();
        let rc = guarded(&mut err, || panic!("boom {}", 7));
        assert_eq!(rc, AtlasStatus::Internal as i32);
        let msg = unsafe { CStr::from_ptr(err) }.to_str().unwrap().to_string();
        unsafe { atlas_string_free(err) };
        assert_eq!(msg, "internal error: boom 7");
    }

    #[test]
    fn options_are_checked() {
        assert!(parse_options(r#"{"model": "m", "threads": 2, "seed": 5}"#).is_ok());
        for bad in [r#"{"model": 1}"#, r#"{"model": "m", "ctx_size": "big"}"#, r#"{"model": "m", "typo": 1}"#, "[]"] {
            assert!(matches!(parse_options(bad), Err(Error::InvalidArgument(_))), "{bad}");
        }
    }
}
