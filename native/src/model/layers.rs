//! The layers every architecture shares, as pure functions of tensors: RMSNorm, the
//! mixed-precision product, and the linear layer with its optional LoRA adapter.

use tch::{Kind, Tensor};

use crate::model::lora::Lora;

pub(crate) fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Tensor {
    let var = x.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
    x * (var + eps).rsqrt() * w
}

/// x · wᵀ in `kind` (float32 out): the mixed-precision product of [`crate::model::Llama::compute`]. With
/// `kind` float32 every `to_kind` returns its tensor itself: the plain product.
pub(crate) fn mm(x: &Tensor, w: &Tensor, kind: Kind) -> Tensor {
    x.to_kind(kind).matmul(&w.to_kind(kind).tr()).to_kind(Kind::Float)
}

pub(crate) fn linear(x: &Tensor, w: &Linear, b: Option<&Tensor>, kind: Kind) -> Tensor {
    let y = w.forward(x, kind);
    match b {
        Some(b) => y + b,
        None => y,
    }
}

/// A linear layer's weight `[out, in]` (a variable of the model's store) and, when an adapter
/// targets it, its LoRA factors ([`crate::model::lora`]).
pub struct Linear {
    pub weight: Tensor,
    pub lora: Option<Lora>,
}

impl Linear {
    pub(crate) fn new(weight: Tensor) -> Self {
        Linear { weight, lora: None }
    }

    /// x · Wᵀ, plus s · (x · Aᵀ) · Bᵀ when adapted (LoRA, Hu et al. 2021 Eq. 3), in `kind`
    /// (float32 out): the base weight's gradient is never formed.
    pub(crate) fn forward(&self, x: &Tensor, kind: Kind) -> Tensor {
        let y = mm(x, &self.weight, kind);
        match &self.lora {
            // s scales B (out × r) rather than the [.., out] product
            Some(l) => y + mm(&mm(x, &l.a, kind), &(&l.b * l.scale), kind),
            None => y,
        }
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

/// RoPE's rotation angles `[positions, dim / 2]`: position · θ^(−2i/dim) for each pair i of
/// the `dim` rotated dimensions.
pub(crate) fn rope_angles(theta: f64, dim: i64, pos: &Tensor) -> Tensor {
    let exponent = Tensor::arange_start_step(0, dim, 2, (Kind::Float, pos.device())) / dim as f64;
    let inv_freq = Tensor::from(theta as f32).to_device(pos.device()).pow(&exponent).reciprocal();
    pos.to_kind(Kind::Float).outer(&inv_freq)
}

/// The Hugging Face half rotation of `x`'s last dimension by `cos`/`sin` (each angle twice:
/// `[.., dim]`): the first half of each head rotates against the second.
pub(crate) fn rotate_half(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let half = x.size().last().copied().expect("a head has a last dimension") / 2;
    let rotated = Tensor::cat(&[-x.narrow(-1, half, half), x.narrow(-1, 0, half)], -1);
    x * cos + rotated * sin
}
