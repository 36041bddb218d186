//! Router evaluation, pure: Pass@k / Avg@k (Appendix C evaluation protocol), evaluation
//! under H_rank1 beside H0 (Eq. 12), and the rank analysis of Table 5 (Rank-1/2/3 scores and
//! the fraction of tasks placing H0 at each rank).
//!
//! Inputs are inference [`RoutingDecision`]s (their `score_harnesses` are in final rank
//! order, so Rank-r of a task is `score_harnesses[r-1]`) and evaluation outcomes per
//! (task, harness), e.g. from [`outcomes`] over eval trajectories. A task whose Rank-r
//! harness was not evaluated is counted in `missing` and left out of that row's scores.

use std::collections::BTreeMap;

use schemas::{now_unix_ms, MetricRow, RoutePurpose, RoutingDecision, Trajectory};

/// Success of each attempt, per (task id, harness id).
pub type Outcomes = BTreeMap<(String, String), Vec<bool>>;

/// Outcomes of evaluation rows per (task, harness), attempts in order.
pub fn outcomes(rows: &[Trajectory]) -> Outcomes {
    let mut sorted: Vec<&Trajectory> = rows.iter().collect();
    sorted.sort_by_key(|r| (r.task_id.clone(), r.harness_id.clone(), r.attempt));
    let mut out = Outcomes::new();
    for r in sorted {
        out.entry((r.task_id.clone(), r.harness_id.clone())).or_default().push(r.success);
    }
    out
}

/// Pass@k (tasks with at least one success) and Avg@k (mean success over attempts, per
/// task, then over tasks), as fractions; tasks with no attempts are ignored.
/// H_best (Table 7): the single harness of `pool` with the best validation success, ties to
/// the earlier one in `pool` (H0 first); `None` for an empty pool or no statistics.
pub fn best_harness(success: &BTreeMap<String, f64>, pool: &[String]) -> Option<(String, f64)> {
    let mut best: Option<(String, f64)> = None;
    for h in pool {
        if let Some(&rate) = success.get(h) {
            if best.as_ref().is_none_or(|(_, b)| rate > *b) {
                best = Some((h.clone(), rate));
            }
        }
    }
    best
}

pub fn pass_avg(per_task: &[&[bool]]) -> (f64, f64) {
    let tasks: Vec<&&[bool]> = per_task.iter().filter(|a| !a.is_empty()).collect();
    if tasks.is_empty() {
        return (0.0, 0.0);
    }
    let n = tasks.len() as f64;
    let pass = tasks.iter().filter(|a| a.iter().any(|s| *s)).count() as f64 / n;
    let avg = tasks.iter().map(|a| a.iter().filter(|s| **s).count() as f64 / a.len() as f64).sum::<f64>() / n;
    (pass, avg)
}

/// One row of Table 5.
#[derive(Debug, Clone, PartialEq)]
pub struct RankRow {
    /// `H0`, `Rank-1`, `Rank-2`, ...
    pub label: String,
    /// None for the fixed H0 row.
    pub rank: Option<usize>,
    /// Tasks scored.
    pub tasks: usize,
    /// Tasks whose harness at this rank has no evaluation outcomes.
    pub missing: usize,
    pub pass_at_k: f64,
    pub avg_at_k: f64,
    /// Fraction of routed tasks placing H0 at this rank (None for the H0 row).
    pub h0_rate: Option<f64>,
}

/// The latest inference decision per task.
fn inference_decisions(decisions: &[RoutingDecision]) -> BTreeMap<&str, &RoutingDecision> {
    let mut by_task: BTreeMap<&str, &RoutingDecision> = BTreeMap::new();
    for d in decisions.iter().filter(|d| d.purpose == RoutePurpose::Inference) {
        let e = by_task.entry(&d.task_id).or_insert(d);
        if (d.step, d.decided_at_ms) > (e.step, e.decided_at_ms) {
            *e = d;
        }
    }
    by_task
}

/// Table 5: the H0 row, then Rank-1 .. Rank-`max_rank`, over the tasks that have an
/// inference decision.
pub fn rank_analysis(decisions: &[RoutingDecision], outcomes: &Outcomes, base: &str, max_rank: usize) -> Vec<RankRow> {
    let by_task = inference_decisions(decisions);
    let row = |label: String, rank: Option<usize>, pick: &dyn Fn(&RoutingDecision) -> Option<String>| {
        let mut scored: Vec<&[bool]> = Vec::new();
        let (mut missing, mut h0_at_rank) = (0, 0);
        for (task, d) in &by_task {
            let Some(h) = pick(d) else {
                missing += 1;
                continue;
            };
            if h == base {
                h0_at_rank += 1;
            }
            match outcomes.get(&(task.to_string(), h)) {
                Some(a) if !a.is_empty() => scored.push(a),
                _ => missing += 1,
            }
        }
        let (pass_at_k, avg_at_k) = pass_avg(&scored);
        let h0_rate = rank.map(|_| if by_task.is_empty() { 0.0 } else { h0_at_rank as f64 / by_task.len() as f64 });
        RankRow { label, rank, tasks: scored.len(), missing, pass_at_k, avg_at_k, h0_rate }
    };
    let mut rows = vec![row("H0".into(), None, &|_| Some(base.to_string()))];
    for r in 1..=max_rank {
        rows.push(row(format!("Rank-{r}"), Some(r), &|d| d.score_harnesses.get(r - 1).cloned()));
    }
    rows
}

/// Evaluation under H_rank1 beside H0 (Eq. 12): `[H0 row, Rank-1 row]`.
pub fn rank1_vs_h0(decisions: &[RoutingDecision], outcomes: &Outcomes, base: &str) -> Vec<RankRow> {
    rank_analysis(decisions, outcomes, base, 1)
}

/// The rows as long-format metrics: `pass_at_k/<label>`, `avg_at_k/<label>`,
/// `h0_rate/<label>` (labels lower-cased: `h0`, `rank-1`, ...).
pub fn metric_rows(rows: &[RankRow], run_id: &str, step: u32, stage: &str, checkpoint: Option<&str>) -> Vec<MetricRow> {
    let mut out = Vec::new();
    let at = now_unix_ms();
    for r in rows {
        let label = r.label.to_lowercase();
        let mut push = |name: &str, value: f64| {
            out.push(MetricRow {
                run_id: run_id.into(),
                step,
                stage: stage.into(),
                name: format!("{name}/{label}"),
                value,
                policy_checkpoint: checkpoint.map(str::to_string),
                recorded_at_ms: at,
            })
        };
        push("pass_at_k", r.pass_at_k);
        push("avg_at_k", r.avg_at_k);
        if let Some(h) = r.h0_rate {
            push("h0_rate", h);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn h_best_is_the_best_validation_success_ties_to_the_pool_order() {
        let pool: Vec<String> = ["h0", "s1", "s2", "s3"].iter().map(|s| s.to_string()).collect();
        let success: BTreeMap<String, f64> =
            [("h0", 0.2), ("s1", 0.5), ("s2", 0.5), ("s3", 0.1)].iter().map(|(h, v)| (h.to_string(), *v)).collect();
        assert_eq!(best_harness(&success, &pool), Some(("s1".to_string(), 0.5)));
        let flat: BTreeMap<String, f64> = pool.iter().map(|h| (h.clone(), 0.0)).collect();
        assert_eq!(best_harness(&flat, &pool), Some(("h0".to_string(), 0.0)), "no harness beats H0: H0");
        assert_eq!(best_harness(&BTreeMap::new(), &pool), None);
    }

    fn decision(task: &str, ranked: &[&str]) -> RoutingDecision {
        RoutingDecision {
            run_id: "r".into(),
            step: 10,
            task_id: task.into(),
            purpose: RoutePurpose::Inference,
            variant: "topk_adaptive".into(),
            calibration_id: Some("final".into()),
            candidate_order: ranked.iter().map(|s| s.to_string()).collect(),
            ballots: vec![],
            score_harnesses: ranked.iter().map(|s| s.to_string()).collect(),
            scores: (0..ranked.len()).map(|i| 3.0 - i as f64).collect(),
            selected: vec![ranked[0].to_string(); 3],
            decided_at_ms: 1,
        }
    }

    fn o(pairs: &[(&str, &str, &[bool])]) -> Outcomes {
        pairs.iter().map(|(t, h, a)| ((t.to_string(), h.to_string()), a.to_vec())).collect()
    }

    #[test]
    fn pass_and_avg_at_k() {
        let (p, a) = pass_avg(&[&[true, false, false], &[false, false, false], &[true, true, true]]);
        assert!((p - 2.0 / 3.0).abs() < 1e-12);
        assert!((a - (1.0 / 3.0 + 0.0 + 1.0) / 3.0).abs() < 1e-12);
        assert_eq!(pass_avg(&[]), (0.0, 0.0));
    }

    #[test]
    fn table5_rows_and_h0_rates() {
        let decisions = vec![decision("t1", &["h2", "h0", "h1"]), decision("t2", &["h0", "h1", "h2"])];
        let outcomes = o(&[
            ("t1", "h0", &[false, false, false]),
            ("t1", "h1", &[true, false, false]),
            ("t1", "h2", &[true, true, false]),
            ("t2", "h0", &[true, true, true]),
            ("t2", "h1", &[false, false, false]),
            // (t2, h2) was not evaluated.
        ]);
        let rows = rank_analysis(&decisions, &outcomes, "h0", 3);
        assert_eq!(rows.iter().map(|r| r.label.as_str()).collect::<Vec<_>>(), vec!["H0", "Rank-1", "Rank-2", "Rank-3"]);
        let h0 = &rows[0];
        assert_eq!((h0.tasks, h0.pass_at_k, h0.avg_at_k, h0.h0_rate), (2, 0.5, 0.5, None));
        let r1 = &rows[1];
        assert_eq!((r1.tasks, r1.pass_at_k, r1.h0_rate), (2, 1.0, Some(0.5)));
        assert!((r1.avg_at_k - (2.0 / 3.0 + 1.0) / 2.0).abs() < 1e-12);
        let r2 = &rows[2];
        assert_eq!((r2.pass_at_k, r2.avg_at_k, r2.h0_rate), (0.0, 0.0, Some(0.5)));
        let r3 = &rows[3];
        assert_eq!((r3.tasks, r3.missing, r3.h0_rate), (1, 1, Some(0.0)));
        assert_eq!(rank1_vs_h0(&decisions, &outcomes, "h0"), rows[..2].to_vec());
        let metrics = metric_rows(&rows, "r", 10, "evaluation", Some("ck"));
        assert!(metrics.iter().any(|m| m.name == "pass_at_k/rank-1" && m.value == 1.0));
        assert!(metrics.iter().any(|m| m.name == "h0_rate/rank-2" && m.value == 0.5));
        assert!(!metrics.iter().any(|m| m.name == "h0_rate/h0"));
    }

    #[test]
    fn outcomes_are_grouped_from_trajectories() {
        let mut rows = vec![];
        for (h, a, s) in [("h0", 1, true), ("h0", 0, false), ("h1", 0, true)] {
            let mut t = crate::profile::testing::traj(h, "t1", a as u64, s, &[], true);
            t.attempt = a;
            rows.push(t);
        }
        let out = outcomes(&rows);
        assert_eq!(out[&("t1".to_string(), "h0".to_string())], vec![false, true]);
        assert_eq!(out[&("t1".to_string(), "h1".to_string())], vec![true]);
        // Non-inference decisions are ignored.
        let mut d = decision("t1", &["h1", "h0"]);
        d.purpose = RoutePurpose::Rescue;
        assert_eq!(rank_analysis(&[d], &out, "h0", 1)[1].tasks, 0);
    }
}
