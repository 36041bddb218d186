//! AdamW (decoupled weight decay) with global gradient-norm clipping, keeping its moments
//! by parameter name so that they can be checkpointed to `optimizer.safetensors`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

/// Optimizer hyper-parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdamWConfig {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// Global L2 norm the gradient is clipped to before each step.
    pub max_grad_norm: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig { lr: 1e-6, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, max_grad_norm: 1.0 }
    }
}

/// Moments and step count.
pub struct AdamW {
    pub config: AdamWConfig,
    pub step: u64,
    pub exp_avg: BTreeMap<String, Tensor>,
    pub exp_avg_sq: BTreeMap<String, Tensor>,
}

impl AdamW {
    pub fn new(config: AdamWConfig) -> Self {
        AdamW { config, step: 0, exp_avg: BTreeMap::new(), exp_avg_sq: BTreeMap::new() }
    }

    /// Scales the gradients so their global L2 norm is at most `max_grad_norm`; returns the
    /// norm before clipping.
    pub fn clip_grad_norm(&self, params: &[(String, Tensor)]) -> f64 {
        let _g = tch::no_grad_guard();
        // The squared norms add up on the parameters' device; one read at the end (on a GPU,
        // one synchronisation per step instead of one per parameter).
        let squares: Vec<Tensor> =
            params.iter().map(|(_, p)| p.grad()).filter(|g| g.defined()).map(|g| g.pow_tensor_scalar(2).sum(Kind::Double)).collect();
        if squares.is_empty() {
            return 0.0;
        }
        let norm = Tensor::stack(&squares, 0).sum(Kind::Double).double_value(&[]).sqrt();
        if norm > self.config.max_grad_norm && norm > 0.0 {
            let scale = self.config.max_grad_norm / (norm + 1e-6);
            for (_, p) in params {
                let mut g = p.grad();
                if g.defined() {
                    let _ = g.f_mul_scalar_(scale);
                }
            }
        }
        norm
    }

    /// One AdamW update of every parameter that has a gradient, in place on the
    /// parameters' device (no host copy, no synchronisation).
    pub fn step(&mut self, params: &[(String, Tensor)]) {
        let _g = tch::no_grad_guard();
        self.step += 1;
        let c = &self.config;
        let bc1 = 1.0 - c.beta1.powi(self.step as i32);
        let bc2 = 1.0 - c.beta2.powi(self.step as i32);
        for (name, p) in params {
            let g = p.grad();
            if !g.defined() {
                continue;
            }
            // in place, with two temporaries the size of the parameter (PyTorch's single-tensor
            // AdamW): m ← lerp(m, g, 1 − β1); v ← β2·v + (1 − β2)·g²;
            // p ← p·(1 − lr·wd) − (lr / bc1)·m / (√v / √bc2 + ε)   (Loshchilov & Hutter, Alg. 2)
            let m = self.exp_avg.entry(name.clone()).or_insert_with(|| Tensor::zeros_like(p));
            let _ = m.f_lerp_(&g, 1.0 - c.beta1);
            let v = self.exp_avg_sq.entry(name.clone()).or_insert_with(|| Tensor::zeros_like(p));
            let _ = v.f_mul_scalar_(c.beta2);
            let _ = v.f_addcmul_(&g, &(&g * (1.0 - c.beta2)));
            if c.lr == 0.0 {
                continue;
            }
            // the step size rides in the denominator: addcdiv_ has no scale of its own
            let mut denom = v.sqrt();
            let _ = denom.f_div_scalar_(bc2.sqrt());
            let _ = denom.f_add_scalar_(c.eps);
            let _ = denom.f_mul_scalar_(-bc1 / c.lr);
            let mut p = p.shallow_clone();
            let _ = p.f_mul_scalar_(1.0 - c.lr * c.weight_decay);
            let _ = p.f_addcdiv_(m, &denom);
        }
    }

    /// Clears the gradients of `params`.
    pub fn zero_grad(params: &[(String, Tensor)]) {
        for (_, p) in params {
            let mut g = p.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
    }
}
