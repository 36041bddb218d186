//! Where tensors live and how many CPU threads libtorch uses: the only libtorch settings
//! the binary, the server and the worker handlers need. They come from here so that
//! `jobs/native` stays the one library crate that links libtorch.

pub use tch::Device;

use crate::NativeError;

/// Parses `cpu`, `cuda` or `cuda:N`.
pub fn parse(s: &str) -> Result<Device, NativeError> {
    match s {
        "cpu" => Ok(Device::Cpu),
        "cuda" => Ok(Device::Cuda(0)),
        other => match other.strip_prefix("cuda:").and_then(|n| n.parse().ok()) {
            Some(n) => Ok(Device::Cuda(n)),
            None => Err(NativeError::Config { field: "device".into(), detail: format!("`{other}` is not `cpu`, `cuda` or `cuda:N`") }),
        },
    }
}

/// Whether libtorch can use a CUDA device in this build on this machine.
pub fn cuda_available() -> bool {
    tch::Cuda::is_available()
}

/// Sets libtorch's intra-op CPU threads (the learner's and the libtorch policy paths').
pub fn set_cpu_threads(n: i32) {
    tch::set_num_threads(n);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_and_bad_ones_name_the_field() {
        assert_eq!(parse("cpu").unwrap(), Device::Cpu);
        assert_eq!(parse("cuda").unwrap(), Device::Cuda(0));
        assert_eq!(parse("cuda:3").unwrap(), Device::Cuda(3));
        let e = parse("tpu").unwrap_err().to_string();
        assert!(e.contains("device") && e.contains("`tpu`"), "{e}");
    }
}
