//! The layers every architecture shares, as pure functions of tensors: RMSNorm and the
//! mixed-precision product.

use tch::{Kind, Tensor};

pub(crate) fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Tensor {
    let var = x.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
    x * (var + eps).rsqrt() * w
}

/// x · wᵀ in `kind` (float32 out): the mixed-precision product of [`Llama::compute`]. With
/// `kind` float32 every `to_kind` returns its tensor itself: the plain product.
pub(crate) fn mm(x: &Tensor, w: &Tensor, kind: Kind) -> Tensor {
    x.to_kind(kind).matmul(&w.to_kind(kind).tr()).to_kind(Kind::Float)
}

pub(crate) fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>, kind: Kind) -> Tensor {
    let y = mm(x, w, kind);
    match b {
        Some(b) => y + b,
        None => y,
    }
}
