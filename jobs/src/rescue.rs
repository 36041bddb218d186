//! Complementary harness rescue (Harness-S §3.3, Algorithm 1) and the training-signal
//! metrics of §4 — pure functions, no IO.
//!
//! For each task the policy makes K rollouts under H0 (the base group G0). If none
//! succeeds, K distinct auxiliary harnesses each get one fresh rollout from the task's
//! initial state (the rescue group GR), and GR replaces G0 (Eq. 5). GRPO then assigns
//! group-relative advantages (Eq. 6); only groups with both successes and failures carry
//! a learning signal ("effective groups", Figure 3).

use serde::{Deserialize, Serialize};

use schemas::RetainedKind;

/// Rescue strategy of a run: Harness-S and the paper's controls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RescueStrategy {
    /// Plain GRPO: all-fail groups stay as they are (and carry no signal).
    None,
    /// "H0 rescue" control: K fresh rollouts under H0 for an all-fail group.
    H0,
    /// Harness-S: the router's top-K distinct auxiliaries, one fresh rollout each.
    Router,
    /// Mixed-harness control: every task's base group already uses a fixed mixture of
    /// harnesses; no rescue stage.
    Mixed,
}

impl RescueStrategy {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::H0 => "h0",
            Self::Router => "router",
            Self::Mixed => "mixed",
        }
    }
}

/// A rollout's outcome as the rescue logic sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub trajectory_id: String,
    pub harness_id: String,
    pub reward: f64,
    pub success: bool,
    /// Trainable (policy) tokens of the rollout.
    pub policy_tokens: u64,
    /// The rollout ended in an error whose class masks it out of training.
    pub masked: bool,
}

/// Whether rescue fires for a base group (Algorithm 1, line 6): every rollout failed, and
/// the strategy has a rescue stage.
pub fn rescue_fires(strategy: RescueStrategy, base: &[Outcome]) -> bool {
    let all_fail = !base.is_empty() && base.iter().all(|o| !o.success);
    all_fail && matches!(strategy, RescueStrategy::H0 | RescueStrategy::Router)
}

/// The group retained for training (Eq. 5): G0 if it has a success, else GR when rescue
/// ran, else G0 (which then has no reward contrast).
pub fn retain<'a>(base: &'a [Outcome], rescue: Option<&'a [Outcome]>) -> (RetainedKind, &'a [Outcome]) {
    let base_solved = base.iter().any(|o| o.success);
    match rescue {
        Some(r) if !base_solved && !r.is_empty() => (RetainedKind::Rescue, r),
        _ => (RetainedKind::Base, base),
    }
}

/// Group-relative advantages (Eq. 6; Appendix B): (R − mean) / max(std, ε) with the
/// population standard deviation and ε = 1e-6. Masked rollouts get advantage 0 and are
/// left out of the mean and std.
pub fn advantages(group: &[Outcome]) -> Vec<f64> {
    const EPS: f64 = 1e-6;
    let live: Vec<f64> = group.iter().filter(|o| !o.masked).map(|o| o.reward).collect();
    if live.is_empty() {
        return vec![0.0; group.len()];
    }
    let n = live.len() as f64;
    let mean = live.iter().sum::<f64>() / n;
    let std = (live.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / n).sqrt();
    group.iter().map(|o| if o.masked { 0.0 } else { (o.reward - mean) / std.max(EPS) }).collect()
}

/// Mean and population standard deviation of the unmasked rewards.
pub fn reward_stats(group: &[Outcome]) -> (f64, f64) {
    let live: Vec<f64> = group.iter().filter(|o| !o.masked).map(|o| o.reward).collect();
    if live.is_empty() {
        return (0.0, 0.0);
    }
    let n = live.len() as f64;
    let mean = live.iter().sum::<f64>() / n;
    (mean, (live.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / n).sqrt())
}

/// An effective group contains both a success and a failure (Figure 3a).
pub fn is_effective(group: &[Outcome]) -> bool {
    let live = group.iter().filter(|o| !o.masked);
    let (mut ok, mut bad) = (false, false);
    for o in live {
        ok |= o.success;
        bad |= !o.success;
    }
    ok && bad
}

/// Per-update training-signal metrics over the retained groups (§4, Figure 3).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SignalMetrics {
    pub groups: u32,
    /// Fraction of retained groups with both successes and failures.
    pub effective_group_rate: f64,
    /// Policy tokens in effective groups / all retained policy tokens.
    pub effective_token_share: f64,
    /// Fraction of groups whose base group failed entirely and got a rescue group.
    pub rescue_rate: f64,
    /// Fraction of rescue groups with at least one success.
    pub rescue_success: f64,
    pub mean_reward: f64,
    /// The counts behind the rates, so that stages of several updates pool them (Table 2):
    /// effective groups, rescue groups, rescue groups with a success, and the policy tokens
    /// of all and of the effective groups.
    pub effective_groups: u32,
    pub rescued_groups: u32,
    pub rescued_with_success: u32,
    pub policy_tokens: u64,
    pub effective_policy_tokens: u64,
}

/// Computes [`SignalMetrics`] from (retained kind, retained group) pairs.
pub fn signal_metrics(groups: &[(RetainedKind, &[Outcome])]) -> SignalMetrics {
    if groups.is_empty() {
        return SignalMetrics::default();
    }
    let n = groups.len() as f64;
    let effective = groups.iter().filter(|(_, g)| is_effective(g)).count() as f64;
    let tokens = |g: &[Outcome]| g.iter().filter(|o| !o.masked).map(|o| o.policy_tokens).sum::<u64>();
    let all_tokens: u64 = groups.iter().map(|(_, g)| tokens(g)).sum();
    let eff_tokens: u64 = groups.iter().filter(|(_, g)| is_effective(g)).map(|(_, g)| tokens(g)).sum();
    let rescued: Vec<&[Outcome]> = groups.iter().filter(|(k, _)| *k == RetainedKind::Rescue).map(|(_, g)| *g).collect();
    let rollouts: Vec<&Outcome> = groups.iter().flat_map(|(_, g)| g.iter()).collect();
    let rescued_with_success = rescued.iter().filter(|g| g.iter().any(|o| o.success)).count();
    SignalMetrics {
        effective_groups: effective as u32,
        rescued_groups: rescued.len() as u32,
        rescued_with_success: rescued_with_success as u32,
        policy_tokens: all_tokens,
        effective_policy_tokens: eff_tokens,
        groups: groups.len() as u32,
        effective_group_rate: effective / n,
        effective_token_share: if all_tokens == 0 { 0.0 } else { eff_tokens as f64 / all_tokens as f64 },
        rescue_rate: rescued.len() as f64 / n,
        rescue_success: if rescued.is_empty() { 0.0 } else { rescued_with_success as f64 / rescued.len() as f64 },
        mean_reward: if rollouts.is_empty() { 0.0 } else { rollouts.iter().map(|o| o.reward).sum::<f64>() / rollouts.len() as f64 },
    }
}

/// Pass@k and Avg@k over tasks (§4): the fraction of tasks solved at least once in their
/// k attempts, and the mean success over all attempts. `per_task[i]` holds task i's
/// attempt successes.
pub fn pass_and_avg_at_k(per_task: &[Vec<bool>]) -> (f64, f64) {
    let tasks: Vec<&Vec<bool>> = per_task.iter().filter(|a| !a.is_empty()).collect();
    if tasks.is_empty() {
        return (0.0, 0.0);
    }
    let pass = tasks.iter().filter(|a| a.iter().any(|s| *s)).count() as f64 / tasks.len() as f64;
    let avg = tasks.iter().map(|a| a.iter().filter(|s| **s).count() as f64 / a.len() as f64).sum::<f64>() / tasks.len() as f64;
    (pass, avg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn o(h: &str, success: bool, tokens: u64) -> Outcome {
        Outcome {
            trajectory_id: format!("{h}-{success}"),
            harness_id: h.into(),
            reward: if success { 1.0 } else { 0.0 },
            success,
            policy_tokens: tokens,
            masked: false,
        }
    }

    #[test]
    fn rescue_fires_only_on_all_fail_groups_with_a_rescue_stage() {
        let fail = vec![o("h0", false, 1), o("h0", false, 1)];
        let mixed = vec![o("h0", true, 1), o("h0", false, 1)];
        assert!(rescue_fires(RescueStrategy::Router, &fail));
        assert!(rescue_fires(RescueStrategy::H0, &fail));
        assert!(!rescue_fires(RescueStrategy::None, &fail));
        assert!(!rescue_fires(RescueStrategy::Mixed, &fail));
        assert!(!rescue_fires(RescueStrategy::Router, &mixed));
        assert!(!rescue_fires(RescueStrategy::Router, &[]));
    }

    #[test]
    fn eq5_rescue_group_replaces_an_all_fail_base_group() {
        let base = vec![o("h0", false, 10), o("h0", false, 10)];
        let rescue = vec![o("h3", true, 12), o("h5", false, 8)];
        let (kind, kept) = retain(&base, Some(&rescue));
        assert_eq!(kind, RetainedKind::Rescue);
        assert_eq!(kept[0].harness_id, "h3");
        let solved = vec![o("h0", true, 10), o("h0", false, 10)];
        assert_eq!(retain(&solved, Some(&rescue)).0, RetainedKind::Base);
        assert_eq!(retain(&base, None).0, RetainedKind::Base);
    }

    #[test]
    fn eq6_advantages_use_population_std_and_epsilon() {
        // rewards 1,0,0,0: mean 0.25, pop std sqrt(0.1875)
        let g = vec![o("a", true, 1), o("b", false, 1), o("c", false, 1), o("d", false, 1)];
        let a = advantages(&g);
        let std = 0.1875f64.sqrt();
        assert!((a[0] - 0.75 / std).abs() < 1e-12);
        assert!((a[1] + 0.25 / std).abs() < 1e-12);
        // no variance: all zero, not NaN
        assert_eq!(advantages(&[o("a", false, 1), o("b", false, 1)]), vec![0.0, 0.0]);
        // a masked rollout gets 0 and does not shift the others
        let mut m = g.clone();
        m.push(Outcome { masked: true, ..o("e", true, 5) });
        let am = advantages(&m);
        assert_eq!(am[4], 0.0);
        assert!((am[0] - a[0]).abs() < 1e-12);
    }

    #[test]
    fn signal_metrics_count_effective_groups_and_tokens() {
        let eff = vec![o("h0", true, 30), o("h0", false, 10)];
        let dead = vec![o("h0", false, 60), o("h0", false, 0)];
        let rescued = vec![o("h2", true, 20), o("h4", false, 20)];
        let failed_rescue = vec![o("h2", false, 5), o("h4", false, 5)];
        let groups: Vec<(RetainedKind, &[Outcome])> = vec![
            (RetainedKind::Base, &eff),
            (RetainedKind::Base, &dead),
            (RetainedKind::Rescue, &rescued),
            (RetainedKind::Rescue, &failed_rescue),
        ];
        let m = signal_metrics(&groups);
        assert_eq!(m.groups, 4);
        assert!((m.effective_group_rate - 0.5).abs() < 1e-12);
        assert!((m.effective_token_share - 80.0 / 150.0).abs() < 1e-12);
        assert!((m.rescue_rate - 0.5).abs() < 1e-12);
        assert!((m.rescue_success - 0.5).abs() < 1e-12);
        assert_eq!((m.groups, m.effective_groups, m.rescued_groups, m.rescued_with_success), (4, 2, 2, 1));
        assert_eq!((m.policy_tokens, m.effective_policy_tokens), (150, 80));
        assert!((m.mean_reward - 2.0 / 8.0).abs() < 1e-12);
    }

    #[test]
    fn pass_and_avg_at_k_count_tasks_and_attempts() {
        let tasks = vec![vec![true, false, false], vec![false, false, false], vec![true, true, true]];
        let (pass, avg) = pass_and_avg_at_k(&tasks);
        assert!((pass - 2.0 / 3.0).abs() < 1e-12);
        assert!((avg - (1.0 / 3.0 + 0.0 + 1.0) / 3.0).abs() < 1e-12);
        assert_eq!(pass_and_avg_at_k(&[]), (0.0, 0.0));
    }
}
