//! Regenerates include/atlas.h from src/ffi.rs (CI fails when the committed header is stale).

fn main() {
    println!("cargo:rerun-if-changed=src/ffi.rs");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    let dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let config = cbindgen::Config::from_file(format!("{dir}/cbindgen.toml")).expect("cbindgen.toml is valid");
    match cbindgen::Builder::new().with_config(config).with_src(format!("{dir}/src/ffi.rs")).generate() {
        Ok(bindings) => {
            bindings.write_to_file(format!("{dir}/include/atlas.h"));
        }
        Err(e) => panic!("cannot generate include/atlas.h: {e}"),
    }
}
