//! Regenerates include/atlas.h from src/ffi.rs (CI fails when the committed header is stale), and
//! keeps the library's exports to the header's functions.

fn main() {
    println!("cargo:rerun-if-changed=src/ffi.rs");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    let dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    // rustc exports every #[no_mangle] function of every dependency from a cdylib (llguidance's
    // llg_* C API among them); with GNU ld, symbols from the dependencies' archives stay inside.
    let target_env = std::env::var("CARGO_CFG_TARGET_ENV").unwrap_or_default();
    let target_os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if target_env == "gnu" && (target_os == "linux" || target_os == "windows") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,--exclude-libs,ALL");
    }
    let config = cbindgen::Config::from_file(format!("{dir}/cbindgen.toml")).expect("cbindgen.toml is valid");
    match cbindgen::Builder::new().with_config(config).with_src(format!("{dir}/src/ffi.rs")).generate() {
        Ok(bindings) => {
            bindings.write_to_file(format!("{dir}/include/atlas.h"));
        }
        Err(e) => panic!("cannot generate include/atlas.h: {e}"),
    }
}
