//! Where tensors live and how many CPU threads libtorch uses: the only libtorch settings
//! the binary, the server and the worker handlers need. They come from here so that
//! `native` stays the one library crate that links libtorch.

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

/// CUDA devices libtorch sees (0 in a CPU build).
pub fn cuda_devices() -> usize {
    if cuda_available() {
        tch::Cuda::device_count() as usize
    } else {
        0
    }
}

/// [`parse`], then checks that the device exists here: the one place where a `--device`
/// flag or `[policy] device` becomes a [`Device`], so every command refuses a GPU it cannot
/// use with the same message, naming `field`.
pub fn resolve(s: &str, field: &str) -> Result<Device, NativeError> {
    let device = parse(s).map_err(|e| match e {
        NativeError::Config { detail, .. } => NativeError::Config { field: field.into(), detail },
        other => other,
    })?;
    if let Device::Cuda(n) = device {
        let bad = |detail: String| NativeError::Config { field: field.into(), detail };
        let count = cuda_devices();
        if count == 0 {
            return Err(bad(format!(
                "`{s}`: CUDA is not available (this build has no CUDA support or this machine no GPU; build with `--features cuda` against a CUDA libtorch, on a GPU machine), or use `cpu`"
            )));
        }
        if n >= count {
            return Err(bad(format!("`{s}`: this machine has {count} CUDA device(s), numbered from 0")));
        }
    }
    Ok(device)
}

/// The name [`parse`] reads back: `cpu` or `cuda:N`.
pub fn name(device: Device) -> String {
    match device {
        Device::Cuda(n) => format!("cuda:{n}"),
        _ => "cpu".into(),
    }
}

/// Waits for the device's queued work (a no-op on the CPU): timings of GPU work end here.
pub fn synchronize(device: Device) {
    if let Device::Cuda(n) = device {
        tch::Cuda::synchronize(n as i64);
    }
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
        assert_eq!(name(parse("cuda:2").unwrap()), "cuda:2");
    }

    #[test]
    fn a_device_this_machine_lacks_is_refused_by_field() {
        assert_eq!(resolve("cpu", "--device").unwrap(), Device::Cpu);
        let e = resolve("gpu", "policy.device").unwrap_err().to_string();
        assert!(e.contains("policy.device") && e.contains("`gpu`"), "{e}");
        if !cuda_available() {
            let e = resolve("cuda:1", "--device").unwrap_err().to_string();
            assert!(e.contains("--device") && e.contains("CUDA is not available"), "{e}");
        }
    }
}
