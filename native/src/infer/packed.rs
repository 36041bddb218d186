//! Weight formats of the rollout engine's matrix products.
//!
//! The learner trains float32 parameters; the engine can decode from a copy of them in a
//! cheaper format, as RL systems that roll out with bf16 or quantised weights do. The
//! price is a rollout/learner mismatch, which the learner measures on every update
//! (`mismatch_mean`, `mismatch_max`) and corrects with its truncated importance weight
//! (Appendix B, Eq. 16):
//!
//! | format | matrix product | runs on | rollout = learner |
//! |---|---|---|---|
//! | `f32` | float32 (the learner's own) | the CPU's own kernels ([`crate::infer::kernels::fmatmul`]) on the CPU, libtorch on a GPU | to ~1e-6 |
//! | `bf16` | bfloat16 weights and inputs, float32 residual stream | libtorch, any device | to ~1e-2 |
//! | `int4` | 4-bit weights in groups of 32 with a scale and offset each (GGUF's Q4_1), 8-bit LM head, 8-bit activations | the CPU's own kernels ([`crate::infer::kernels`]) | to ~1e-1 |
//!
//! Every format keeps the engine's batch invariance: a row of a product does not depend
//! on the other rows at a fixed shape (the engine's tests check it per format); `int4`
//! does not depend on the shape either.

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::NativeError;

/// How the engine stores the weights it decodes with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightFormat {
    /// The learner's float32 parameters as they are.
    #[default]
    F32,
    Bf16,
    Int4,
}

impl WeightFormat {
    pub fn name(self) -> &'static str {
        match self {
            WeightFormat::F32 => "f32",
            WeightFormat::Bf16 => "bf16",
            WeightFormat::Int4 => "int4",
        }
    }

    /// Whether the engine can decode in this format on `device`: `int4` runs only on the
    /// CPU's own kernels ([`crate::infer::cpu`]); a GPU uses libtorch's `f32` or `bf16`. Checked
    /// where the device and the format meet (spec load, `serve`, the benches), so a bad pair
    /// fails before a model is loaded. `field` names the setting in the error.
    pub fn check_device(self, device: tch::Device, field: &str) -> Result<(), NativeError> {
        if self == WeightFormat::Int4 && device != tch::Device::Cpu {
            return Err(NativeError::Config {
                field: field.into(),
                detail: "`int4` runs on the CPU kernels only; on a CUDA device use `bf16` (or `f32`)".into(),
            });
        }
        Ok(())
    }

    pub fn parse(s: &str) -> Result<Self, NativeError> {
        match s {
            "f32" => Ok(WeightFormat::F32),
            "bf16" => Ok(WeightFormat::Bf16),
            "int4" => Ok(WeightFormat::Int4),
            other => Err(NativeError::Config {
                field: "rollout_weights".into(),
                detail: format!("`{other}` is not a weight format; use f32, bf16 or int4"),
            }),
        }
    }
}

/// One weight matrix `[out, in]` of a libtorch format (`bf16`; `f32` on a GPU).
pub struct Packed(Tensor);

impl Packed {
    /// Converts `w` `[out, in]` (float32) to `format` (`int4` is not a libtorch format: it
    /// keeps float32 here, and the engine uses [`crate::infer::cpu`] for it).
    pub fn new(w: &Tensor, format: WeightFormat) -> Packed {
        let _g = tch::no_grad_guard();
        let kind = if format == WeightFormat::Bf16 { Kind::BFloat16 } else { Kind::Float };
        Packed(w.to_kind(kind).contiguous())
    }

    /// x `[rows, in]` (float32) times the matrix transposed: `[rows, out]`, float32.
    pub fn apply(&self, x: &Tensor) -> Tensor {
        let w = &self.0;
        if w.kind() == Kind::Float {
            x.matmul(&w.tr())
        } else {
            x.to_kind(w.kind()).matmul(&w.tr()).to_kind(Kind::Float)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    fn weights() -> Tensor {
        Tensor::randn([64, 96], (Kind::Float, Device::Cpu)) * 0.05
    }

    #[test]
    fn int4_is_refused_on_a_gpu_by_the_setting_that_chose_it() {
        for f in [WeightFormat::F32, WeightFormat::Bf16, WeightFormat::Int4] {
            f.check_device(Device::Cpu, "x").unwrap();
        }
        WeightFormat::Bf16.check_device(Device::Cuda(0), "x").unwrap();
        let e = WeightFormat::Int4.check_device(Device::Cuda(1), "policy.rollout_weights").unwrap_err().to_string();
        assert!(e.contains("policy.rollout_weights") && e.contains("bf16"), "{e}");
    }

    #[test]
    fn every_format_approximates_the_float32_product() {
        let w = weights();
        let x = Tensor::randn([5, 96], (Kind::Float, Device::Cpu));
        let want = x.matmul(&w.tr());
        let scale = want.abs().max().double_value(&[]);
        for (format, tol) in [(WeightFormat::F32, 1e-6), (WeightFormat::Bf16, 2e-2)] {
            let got = Packed::new(&w, format).apply(&x);
            assert_eq!(got.size(), vec![5, 64]);
            let err = (&got - &want).abs().max().double_value(&[]) / scale;
            assert!(err < tol, "{format:?}: relative error {err}");
            if format != WeightFormat::F32 {
                assert!(err > 0.0, "{format:?} should round");
            }
        }
    }
}
