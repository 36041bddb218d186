//! Puts `$LIBTORCH/lib` on the binary's rpath: the native backend links libtorch, which
//! lives outside Cargo's target directory, so `harness-s` runs without LD_LIBRARY_PATH.
//! With the `cuda` feature it also keeps `libtorch_cuda.so` linked, which `--as-needed`
//! would drop because nothing references its symbols (tch-rs issues #907, #980).
//! (Link args of a dependency's build script do not reach this binary.)

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
