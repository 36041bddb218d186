//! The GRPO objective of the paper's §3.3 and Appendix B, as pure functions: group
//! advantages (Eq. 6), the clipped token objective (Eq. 7), the TIS weight (Eq. 16) and the
//! per-token normalisation of Eq. 15 (mean over policy tokens within a task, then over
//! tasks). No KL term.

use tch::{Kind, Tensor};

/// Lower clipping width η− (Appendix B).
pub const ETA_MINUS: f64 = 0.20;
/// Upper clipping width η+ (Appendix B).
pub const ETA_PLUS: f64 = 0.28;
/// Upper bound of the TIS weight w (Eq. 16).
pub const TIS_CAP: f64 = 2.0;
/// ε of Eq. 6 (Appendix B: 1e-6).
pub const ADV_EPS: f64 = 1e-6;

/// Eq. 6: a_j = (R_j − mean) / max(σ, ε) with σ the population standard deviation.
pub fn group_advantages(rewards: &[f64]) -> Vec<f64> {
    if rewards.is_empty() {
        return vec![];
    }
    let n = rewards.len() as f64;
    let mean = rewards.iter().sum::<f64>() / n;
    let var = rewards.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / n;
    let denom = var.sqrt().max(ADV_EPS);
    rewards.iter().map(|r| (r - mean) / denom).collect()
}

/// Eq. 7: ℓ(ρ, A) = min(ρA, clip(ρ, 1 − η−, 1 + η+)·A).
pub fn clipped_objective(ratio: f64, advantage: f64) -> f64 {
    (ratio * advantage).min(ratio.clamp(1.0 - ETA_MINUS, 1.0 + ETA_PLUS) * advantage)
}

/// Eq. 16: w = clip(π_old / q, 0, 2), from log-probabilities.
pub fn tis_weight(logp_old: f64, logq: f64) -> f64 {
    (logp_old - logq).exp().clamp(0.0, TIS_CAP)
}

/// The context weight of a token scored in context c but sampled in c_H (a rescue row under
/// H0): clip(π_old(y | c) / q(y | c_H), floor, cap), Eq. 16's truncated importance weight
/// with the context shift in it, from log-probabilities.
pub fn context_weight(logp_old: f64, logq: f64, floor: f64, cap: f64) -> f64 {
    (logp_old - logq).exp().clamp(floor, cap)
}

/// Eq. 15's normalisation: the weight s_i / (|B| · N_x) of each policy token of task x, 0
/// for masked tokens, where s_i is sequence i's scale and N_x = Σ s_i · (policy tokens of
/// i) over the task's sequences (all scales 1: the paper's 1 / (|B| · N_x); a trajectory
/// scored in two contexts with scales summing to 1 counts once in N_x). `task_of[i]` is
/// the task index of sequence i (tasks `0..n_tasks`, |B| = n_tasks, so a task with no
/// policy tokens still counts in |B| and contributes zero).
pub fn token_weights(task_of: &[usize], masks: &[Vec<bool>], scales: &[f64], n_tasks: usize) -> Vec<Vec<f64>> {
    let mut n_x = vec![0f64; n_tasks];
    for ((t, m), s) in task_of.iter().zip(masks).zip(scales) {
        n_x[*t] += s * m.iter().filter(|b| **b).count() as f64;
    }
    task_of
        .iter()
        .zip(masks)
        .zip(scales)
        .map(|((t, m), s)| m.iter().map(|&b| if b && n_x[*t] > 0.0 { s / (n_tasks as f64 * n_x[*t]) } else { 0.0 }).collect())
        .collect()
}

/// The GRPO loss −J(θ) of Eq. 15 over tokens (all arguments of one shape):
/// `logp` log π_θ (differentiable), `logp_old` log π_θold, `logq` the rollout log-prob,
/// `advantage` A of the token's trajectory, `weight` from [`token_weights`] (0 = masked).
/// The TIS weight is computed from constants and so receives no gradient.
pub fn grpo_loss(logp: &Tensor, logp_old: &Tensor, logq: &Tensor, advantage: &Tensor, weight: &Tensor) -> Tensor {
    let lo = Tensor::zeros_like(logp);
    let hi = Tensor::full_like(logp, TIS_CAP);
    grpo_loss_bounded(logp, logp_old, logq, advantage, weight, &lo, &hi)
}

/// [`grpo_loss`] with the bounds of each token's detached weight clip(π_old / q, lo, hi):
/// (0, 2) for a token scored in its generating context (Eq. 16), the spec's floor and cap
/// for a rescue token scored under H0, whose q was recorded in the sibling's context, so
/// that ρ·w = π_θ(y | c_H0) / π_old(y | c_H) with the context shift truncated.
pub fn grpo_loss_bounded(
    logp: &Tensor,
    logp_old: &Tensor,
    logq: &Tensor,
    advantage: &Tensor,
    weight: &Tensor,
    lo: &Tensor,
    hi: &Tensor,
) -> Tensor {
    let active = weight.gt(0.0);
    let zero = Tensor::zeros_like(logp);
    // Masked tokens may carry placeholder log-probs; keep them out of exp() entirely.
    let delta = (logp - logp_old).where_self(&active, &zero);
    let ratio = delta.exp();
    let unclipped = &ratio * advantage;
    let clipped = ratio.clamp(1.0 - ETA_MINUS, 1.0 + ETA_PLUS) * advantage;
    let objective = unclipped.minimum(&clipped);
    let w = (logp_old - logq).where_self(&active, &zero).exp().clamp_tensor(Some(lo), Some(hi)).detach();
    -(objective * w * weight).sum(Kind::Float)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-5
    }

    #[test]
    fn advantages_by_hand() {
        assert_eq!(group_advantages(&[1.0, 0.0, 0.0, 1.0]), vec![1.0, -1.0, -1.0, 1.0]);
        // mean 0.25, population σ = sqrt(0.1875) = 0.4330127
        let a = group_advantages(&[1.0, 0.0, 0.0, 0.0]);
        assert!(close(a[0], 1.7320508) && close(a[1], -0.5773503), "{a:?}");
        // no variance: σ = 0 → ε, every advantage 0
        assert_eq!(group_advantages(&[1.0, 1.0, 1.0]), vec![0.0, 0.0, 0.0]);
    }

    #[test]
    fn clip_branches_by_hand() {
        // A > 0, ρ above 1 + η+: clipped at 1.28
        assert!(close(clipped_objective(1.5, 1.0), 1.28));
        // A > 0, ρ below 1: unclipped (min picks ρA)
        assert!(close(clipped_objective(0.5, 1.0), 0.5));
        // A < 0, ρ below 1 − η−: clipped at 0.8·A
        assert!(close(clipped_objective(0.5, -1.0), -0.8));
        // A < 0, ρ above 1: unclipped (pessimistic ρA)
        assert!(close(clipped_objective(1.5, -2.0), -3.0));
    }

    #[test]
    fn tis_weight_at_zero_and_at_its_cap() {
        assert!(close(tis_weight(0.5f64.ln(), 0.5f64.ln()), 1.0));
        assert!(close(tis_weight(0.3f64.ln(), 0.6f64.ln()), 0.5));
        assert_eq!(tis_weight(0.9f64.ln(), 0.1f64.ln()), 2.0);
        assert_eq!(tis_weight(-800.0, 0.0), 0.0);
    }

    #[test]
    fn token_weights_mask_and_count_empty_tasks() {
        // task 0: [p, h, p] and [p]; task 1: [h, h] only
        let w = token_weights(&[0, 0, 1], &[vec![true, false, true], vec![true], vec![false, false]], &[1.0; 3], 2);
        let s = 1.0 / 6.0; // |B| = 2, N_0 = 3
        assert_eq!(w, vec![vec![s, 0.0, s], vec![s], vec![0.0, 0.0]]);
    }

    /// The loss on a batch covering both clip branches, a masked harness token, a TIS
    /// weight at 0 and at its cap, and a task with no policy tokens, against hand values.
    #[test]
    fn loss_and_gradient_by_hand() {
        let ln = |x: f64| x.ln();
        // token:      0 (A+, ρ=1.5)  1 (A−, ρ=0.5)  2 masked   3 (w at cap)   4 (w = 0)   5 (empty task)
        let logp_new = [ln(0.6), ln(0.2), ln(0.9), ln(0.5), -800.0, 0.0];
        let logp_old = [ln(0.4), ln(0.4), ln(0.1), ln(0.5), -800.0, 0.0];
        let logq = [ln(0.4), ln(0.4), ln(0.1), ln(0.1), 0.0, 0.0];
        let adv = [1.0, -1.0, 100.0, 2.0, 3.0, 5.0];
        // task 0 has tokens 0..5 with token 2 masked (N = 4); task 1 has token 5 masked (N = 0)
        let weights = token_weights(&[0, 1], &[vec![true, true, false, true, true], vec![false]], &[1.0, 1.0], 2);
        let weight: Vec<f64> = weights.concat();
        let t = |v: &[f64]| Tensor::from_slice(v).to_kind(Kind::Float);
        let logp = t(&logp_new).set_requires_grad(true);
        let loss = grpo_loss(&logp, &t(&logp_old), &t(&logq), &t(&adv), &t(&weight));
        // token 0: min(1.5, 1.28) = 1.28, w = 1; token 1: min(−0.5, −0.8) = −0.8, w = 1;
        // token 3: ρ = 1, ℓ = 2, w = clip(5, 0, 2) = 2 → 4; token 4: w = 0 → 0.
        // J = (1.28 − 0.8 + 4 + 0) / (|B| = 2 · N_0 = 4)
        let want = -(1.28 - 0.8 + 4.0) / 8.0;
        assert!(close(loss.double_value(&[]), want), "{} vs {want}", loss.double_value(&[]));
        loss.backward();
        let g = Vec::<f32>::try_from(&logp.grad()).unwrap();
        // clipped tokens (0, 1), the masked token, w = 0 and the empty task get no gradient;
        // token 3: ∂(−w·ρ·A/8)/∂logp = −2·1·2/8 = −0.5
        let want_g = [0.0, 0.0, 0.0, -0.5, 0.0, 0.0];
        for (i, (a, b)) in g.iter().zip(want_g).enumerate() {
            assert!(close(*a as f64, b), "token {i}: grad {a} vs {b}");
        }
    }

    /// Eq. 15 with mixed contexts: one rescue trajectory scored in its generating context
    /// and under H0 (scales ½ + ½, so it counts once in N_x), whose H0 copy carries the
    /// context weight clip(π_old(y | c_H0) / q(y | c_H), 0, 2), beside a plain trajectory.
    #[test]
    fn mixed_contexts_by_hand() {
        let ln = |x: f64| x.ln();
        // tokens: 0, 1 generating copy (A = 1); 2, 3 H0 copy (A = 1); 4 the other row (A = −1)
        let logp_old = [ln(0.5), ln(0.5), ln(0.1), ln(0.9), ln(0.2)];
        let logq = [ln(0.5), ln(0.5), ln(0.4), ln(0.3), ln(0.2)];
        let adv = [1.0, 1.0, 1.0, 1.0, -1.0];
        let weights = token_weights(&[0, 0, 0], &[vec![true; 2], vec![true; 2], vec![true]], &[0.5, 0.5, 1.0], 1);
        // N_0 = ½·2 + ½·2 + 1 = 3
        assert!(close(weights[0][0], 0.5 / 3.0) && close(weights[1][1], 0.5 / 3.0) && close(weights[2][0], 1.0 / 3.0), "{weights:?}");
        let weight: Vec<f64> = weights.concat();
        let t = |v: &[f64]| Tensor::from_slice(v).to_kind(Kind::Float);
        let logp = t(&logp_old).set_requires_grad(true);
        let lo = t(&[0.0; 5]);
        let hi = t(&[2.0; 5]);
        let loss = grpo_loss_bounded(&logp, &t(&logp_old), &t(&logq), &t(&adv), &t(&weight), &lo, &hi);
        // ρ = 1 everywhere (first pass). Generating copy: w = 1 → 2 · ⅙ = ⅓. H0 copy:
        // w = 0.1 / 0.4 = 0.25 and 0.9 / 0.3 = 3 → capped at 2: ⅙ · 2.25 = 0.375.
        // Other row: −⅓. J = 0.375.
        assert!(close(loss.double_value(&[]), -0.375), "{}", loss.double_value(&[]));
        loss.backward();
        let g = Vec::<f32>::try_from(&logp.grad()).unwrap();
        let want = [-1.0 / 6.0, -1.0 / 6.0, -0.25 / 6.0, -2.0 / 6.0, 1.0 / 3.0];
        for (i, (a, b)) in g.iter().zip(want).enumerate() {
            assert!(close(*a as f64, b), "token {i}: grad {a} vs {b}");
        }
        // floor = cap = 1: the H0 copy trains as if it had been sampled there
        let one = t(&[1.0; 5]);
        let loss = grpo_loss_bounded(&logp.detach(), &t(&logp_old), &t(&logq), &t(&adv), &t(&weight), &one, &one);
        assert!(close(loss.double_value(&[]), -(2.0 / 6.0 + 2.0 / 6.0 - 1.0 / 3.0)));
        assert!(close(context_weight(ln(0.1), ln(0.4), 0.0, 2.0), 0.25));
        assert_eq!(context_weight(ln(0.9), ln(0.3), 0.0, 2.0), 2.0);
    }

    #[test]
    fn unclipped_token_gets_ratio_times_advantage_gradient() {
        let logp = Tensor::from_slice(&[0.5f32.ln()]).set_requires_grad(true);
        let old = Tensor::from_slice(&[1.0f32.ln()]);
        let loss = grpo_loss(&logp, &old, &old, &Tensor::from_slice(&[1.0f32]), &Tensor::from_slice(&[1.0f32]));
        loss.backward();
        // ρ = 0.5 < 1 with A > 0 is inside the unclipped branch: ∂(−ρA)/∂logp = −ρA = −0.5
        assert!(close(logp.grad().double_value(&[0]), -0.5));
        assert!(close(loss.double_value(&[]), -0.5));
    }
}
