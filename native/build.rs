//! Link settings for libtorch that torch-sys does not make itself.
//!
//! * rpath: the libtorch directory (`$LIBTORCH/lib`) is outside Cargo's target directory, so
//!   `cargo test` does not put it on the loader path; an rpath makes this crate's tests
//!   run without `LD_LIBRARY_PATH`. (Binaries of other crates add the same in their own
//!   build scripts: link args do not propagate.)
//! * `cuda`: libtorch registers its CUDA backend from static initialisers in
//!   `libtorch_cuda.so`; nothing references a symbol of it, so the default `--as-needed`
//!   linking drops it and `Device::Cuda` then reports no GPU (tch-rs issues #907, #980).
//!   `-Wl,--no-as-needed -ltorch_cuda` keeps it. Like the rpath, this reaches only this
//!   crate's own test binaries; the `harness-s` binary's build script (scheduler, feature
//!   `cuda`) adds the same.

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-changed=build.rs");
    if let Ok(dir) = std::env::var("LIBTORCH") {
        let lib = std::path::Path::new(&dir).join("lib");
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    }
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-ltorch_cuda,--as-needed");
    }
}
