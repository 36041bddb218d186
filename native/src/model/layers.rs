//! The layers every architecture shares, as pure functions of tensors: RMSNorm and the
//! mixed-precision product.

use tch::{Kind, Tensor};

pub(crate) fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Tensor {
    let var = x.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
    x * (var + eps).rsqrt() * w
}

/// x · wᵀ in `kind` (float32 out): the mixed-precision product of [`crate::model::Llama::compute`]. With
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

/// [`rms_norm`] of each `head_dim`-wide head of `x` (`[.., heads · head_dim]`) with the
/// per-head weight `w` (`[head_dim]`); `x` itself without a weight.
pub(crate) fn head_norm(x: Tensor, w: Option<&Tensor>, head_dim: i64, eps: f64) -> Tensor {
    let Some(w) = w else { return x };
    let shape = x.size();
    let mut heads = shape.clone();
    let last = heads.pop().expect("a projection has a last dimension");
    heads.extend([last / head_dim, head_dim]);
    rms_norm(&x.reshape(heads.as_slice()), w, eps).reshape(shape.as_slice())
}
