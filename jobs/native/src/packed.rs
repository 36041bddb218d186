//! Weight formats of the rollout engine's matrix products.
//!
//! The learner trains float32 parameters; the engine can decode from a copy of them in a
//! cheaper format, as RL systems that roll out with bf16 or quantised weights do. The
//! price is a rollout/learner mismatch, which the learner measures on every update
//! (`mismatch_mean`, `mismatch_max`) and corrects with its truncated importance weight
//! (Appendix B, Eq. 16):
//!
//! | format | matrix product | rollout = learner |
//! |---|---|---|
//! | `f32` | float32 (the learner's own) | to ~1e-6 |
//! | `bf16` | bfloat16 weights and inputs, float32 residual stream | to ~1e-2 |
//! | `int4` | 4-bit weights in groups of 32 with a bfloat16 scale and offset each (the layout of GGUF's Q4_1), bfloat16 inputs | to ~1e-1 |
//!
//! Every format keeps the engine's batch invariance: a row of a product does not depend
//! on the other rows at a fixed shape (the engine's tests check it per format).

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::NativeError;

/// Group size of the 4-bit format: one scale and offset per 32 input features.
pub const INT4_GROUP: i64 = 32;

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

    pub fn parse(s: &str) -> Result<Self, NativeError> {
        match s {
            "f32" => Ok(WeightFormat::F32),
            "bf16" => Ok(WeightFormat::Bf16),
            "int4" => Ok(WeightFormat::Int4),
            other => Err(NativeError::Config { field: "rollout_weights".into(), detail: format!("`{other}` is not a weight format; use f32, bf16 or int4") }),
        }
    }
}

/// One weight matrix `[out, in]` in a [`WeightFormat`].
pub enum Packed {
    /// `[out, in]`, float32 or bfloat16.
    Dense(Tensor),
    /// libtorch's packed 4-bit layout with `[in / 32, out, 2]` bfloat16 scales and offsets:
    /// w = (q − 8) · scale + offset.
    Int4 { packed: Tensor, scales: Tensor, out: i64 },
}

impl Packed {
    /// Converts `w` `[out, in]` (float32) to `format`. Errors name `name` when the shape
    /// does not suit the format.
    pub fn new(w: &Tensor, format: WeightFormat, name: &str) -> Result<Packed, NativeError> {
        let _g = tch::no_grad_guard();
        Ok(match format {
            WeightFormat::F32 => Packed::Dense(w.to_kind(Kind::Float).contiguous()),
            WeightFormat::Bf16 => Packed::Dense(w.to_kind(Kind::BFloat16).contiguous()),
            WeightFormat::Int4 => {
                if w.device() != tch::Device::Cpu {
                    return Err(NativeError::Config { field: "rollout_weights".into(), detail: "int4 uses libtorch's CPU kernel; on a GPU use bf16".into() });
                }
                let (out, inp) = w.size2()?;
                if inp % INT4_GROUP != 0 || out % 16 != 0 {
                    return Err(NativeError::Config {
                        field: "rollout_weights".into(),
                        detail: format!("int4 needs matrices with input features divisible by {INT4_GROUP} and outputs divisible by 16; `{name}` is [{out}, {inp}]: use bf16 or f32"),
                    });
                }
                let (q, scale, min) = quantize_int4(&w.to_kind(Kind::Float));
                let packed = q.internal_convert_weight_to_int4pack_for_cpu(1);
                let offset = &min + &scale * 8.0;
                let scales = Tensor::stack(&[scale.tr(), offset.tr()], 2).to_kind(Kind::BFloat16).contiguous();
                Packed::Int4 { packed, scales, out }
            }
        })
    }

    /// x `[rows, in]` (float32) times the matrix transposed: `[rows, out]`, float32.
    pub fn apply(&self, x: &Tensor) -> Tensor {
        match self {
            Packed::Dense(w) if w.kind() == Kind::Float => x.matmul(&w.tr()),
            Packed::Dense(w) => x.to_kind(w.kind()).matmul(&w.tr()).to_kind(Kind::Float),
            Packed::Int4 { packed, scales, out } => {
                let y = x.to_kind(Kind::BFloat16).internal_weight_int4pack_mm_for_cpu(packed, INT4_GROUP, scales);
                y.narrow(1, 0, *out).to_kind(Kind::Float)
            }
        }
    }
}

/// Asymmetric 4-bit quantisation of `w` `[out, in]` in groups of [`INT4_GROUP`] inputs:
/// q = round((w − min) / scale) in 0..=15 with scale = (max − min) / 15 per group, so that
/// w ≈ q · scale + min (GGUF's Q4_1). Returns q `[out, in]` (int32), scale and min
/// `[out, in / 32]`.
pub fn quantize_int4(w: &Tensor) -> (Tensor, Tensor, Tensor) {
    let (out, inp) = w.size2().expect("a matrix");
    let g = w.view([out, inp / INT4_GROUP, INT4_GROUP]);
    let min = g.amin(&[2i64][..], true);
    let max = g.amax(&[2i64][..], true);
    // a constant group has scale 0: any positive scale represents it exactly with q = 0
    let scale = ((&max - &min) / 15.0).clamp_min(f32::MIN_POSITIVE as f64);
    let q = ((&g - &min) / &scale).round().clamp(0, 15).to_kind(Kind::Int).view([out, inp]);
    (q, scale.squeeze_dim(2), min.squeeze_dim(2))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    fn weights() -> Tensor {
        Tensor::randn([64, 96], (Kind::Float, Device::Cpu)) * 0.05
    }

    #[test]
    fn every_format_approximates_the_float32_product() {
        let w = weights();
        let x = Tensor::randn([5, 96], (Kind::Float, Device::Cpu));
        let want = x.matmul(&w.tr());
        let scale = want.abs().max().double_value(&[]);
        for (format, tol) in [(WeightFormat::F32, 1e-6), (WeightFormat::Bf16, 2e-2), (WeightFormat::Int4, 2e-1)] {
            let got = Packed::new(&w, format, "w").unwrap().apply(&x);
            assert_eq!(got.size(), vec![5, 64]);
            let err = (&got - &want).abs().max().double_value(&[]) / scale;
            assert!(err < tol, "{format:?}: relative error {err}");
            if format != WeightFormat::F32 {
                assert!(err > 0.0, "{format:?} should round");
            }
        }
    }

    #[test]
    fn int4_represents_q4_1_weights_up_to_bf16_rounding() {
        // weights that are exactly q · scale + min per group of 32 (a dequantised Q4_1 tensor)
        let q = Tensor::randint(16, [32, 64], (Kind::Float, Device::Cpu));
        let _ = q.narrow(1, 0, 1).fill_(0.0);
        let _ = q.narrow(1, 1, 1).fill_(15.0);
        let _ = q.narrow(1, 32, 1).fill_(0.0);
        let _ = q.narrow(1, 33, 1).fill_(15.0);
        let w = &q * 0.0078125 - 0.0625; // scale 2^-7, min −2^-4: exact in bf16
        let x = Tensor::randn([3, 64], (Kind::Float, Device::Cpu)).to_kind(Kind::BFloat16).to_kind(Kind::Float);
        let got = Packed::new(&w, WeightFormat::Int4, "w").unwrap().apply(&x);
        let want = x.to_kind(Kind::BFloat16).matmul(&w.to_kind(Kind::BFloat16).tr()).to_kind(Kind::Float);
        let err = (&got - &want).abs().max().double_value(&[]);
        assert!(err < 5e-2, "{err}");
        let (qq, s, m) = quantize_int4(&w);
        assert_eq!(qq.to_kind(Kind::Float).equal(&q), true);
        assert!((s.double_value(&[0, 0]) - 0.0078125).abs() < 1e-9 && (m.double_value(&[0, 0]) + 0.0625).abs() < 1e-9);
    }

    #[test]
    fn int4_refuses_shapes_it_cannot_pack_naming_the_matrix() {
        let w = Tensor::randn([64, 40], (Kind::Float, Device::Cpu));
        let e = Packed::new(&w, WeightFormat::Int4, "layers.0.q").err().unwrap().to_string();
        assert!(e.contains("layers.0.q") && e.contains("rollout_weights"), "{e}");
        assert!(WeightFormat::parse("fp8").unwrap_err().to_string().contains("f32, bf16 or int4"));
    }
}
