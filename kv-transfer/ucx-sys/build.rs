//! Generates bindings for the UCP API of the system libucx (Debian: libucx-dev, libclang-dev).
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=wrapper.h");
    let ucx = match pkg_config::Config::new().atleast_version("1.12").probe("ucx") {
        Ok(lib) => lib,
        Err(e) => panic!(
            "libucx not found via pkg-config ({e}); install it (Debian: apt-get install libucx-dev libclang-dev pkg-config) \
             or build without the `ucx` feature"
        ),
    };
    let mut builder = bindgen::Builder::default()
        .header("wrapper.h")
        .allowlist_function("ucp_.*")
        .allowlist_function("ucs_status_string")
        .allowlist_type("ucp_.*")
        .allowlist_type("ucs_.*")
        .allowlist_var("UCP_.*")
        .allowlist_var("UCS_.*")
        .rustified_enum("ucs_status_t")
        .prepend_enum_name(false)
        .derive_default(true)
        .layout_tests(false)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    for path in &ucx.include_paths {
        builder = builder.clang_arg(format!("-I{}", path.display()));
    }
    let bindings = builder.generate().expect("bindgen could not read ucp.h");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    bindings.write_to_file(out.join("ucp.rs")).expect("writing bindings");
}
