//! `atlas_load`'s options JSON through the C entry point itself (NUL-terminated, as a host passes
//! it; the bytes after a NUL are what C would never see). The process works in an empty scratch
//! directory, so a relative model path names nothing; inputs naming an existing absolute path are
//! skipped, so the target never loads a real model. A caught panic (status Internal) is a finding.
#![no_main]

#[path = "common/mod.rs"]
mod common;

use std::ffi::{c_char, CStr, CString};
use std::sync::Once;

use atlas::ffi::{atlas_load, atlas_string_free, atlas_unload, AtlasModel, AtlasStatus};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    static CWD: Once = Once::new();
    CWD.call_once(|| {
        let empty = common::scratch().join("empty");
        std::fs::create_dir_all(&empty).unwrap();
        std::env::set_current_dir(&empty).unwrap();
    });
    let text = &data[..data.iter().position(|&b| b == 0).unwrap_or(data.len())];
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(text) {
        if v.get("model").and_then(|m| m.as_str()).is_some_and(|m| std::path::Path::new(m).exists()) {
            return;
        }
    }
    let options = CString::new(text).unwrap();
    let mut model: *mut AtlasModel = std::ptr::null_mut();
    let mut err: *mut c_char = std::ptr::null_mut();
    // SAFETY: valid pointers and a NUL-terminated string, as the header asks.
    let rc = unsafe { atlas_load(options.as_ptr(), &mut model, &mut err) };
    assert_ne!(rc, AtlasStatus::Ok as i32, "no model can load from an empty directory");
    assert_ne!(rc, AtlasStatus::Internal as i32, "a panic inside atlas_load");
    assert!(model.is_null() && !err.is_null(), "a failed load sets the error and no model");
    // SAFETY: err came from the library; it is freed once.
    unsafe {
        let _ = CStr::from_ptr(err).to_str().expect("errors are UTF-8");
        atlas_string_free(err);
        atlas_unload(model);
    }
});
