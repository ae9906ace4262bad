//! The libfabric ABI, from the installed headers (Debian's `libfabric-dev`). Without them the
//! provider builds empty (`cfg(no_libfabric)`): the rest of the workspace needs no libfabric.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(no_libfabric)");
    println!("cargo:rerun-if-changed=wrapper.h");
    let header = std::path::Path::new("/usr/include/rdma/providers/fi_prov.h");
    println!("cargo:rerun-if-changed={}", header.display());
    if !header.exists() {
        println!("cargo:rustc-cfg=no_libfabric");
        return;
    }
    // (bindgen panics when it finds no libclang: that is a missing tool, not a failed build)
    let bindings = std::panic::catch_unwind(|| {
        bindgen::Builder::default()
            .header("wrapper.h")
            .allowlist_type("fi_.*|fid.*")
            .allowlist_var("FI_.*")
            .allowlist_function("fi_dupinfo|fi_freeinfo")
            .derive_default(true)
            .layout_tests(false)
            .generate_comments(false)
            .generate()
            .map_err(|e| e.to_string())
    })
    .unwrap_or_else(|_| Err("libclang not found (install libclang-dev)".into()));
    match bindings {
        Ok(b) => {
            let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
            b.write_to_file(out.join("fabric.rs")).expect("writing the bindings");
        }
        Err(e) => {
            println!(
                "cargo:warning=clan-fi: generating the libfabric bindings failed ({e}); the provider builds empty"
            );
            println!("cargo:rustc-cfg=no_libfabric");
        }
    }
}
