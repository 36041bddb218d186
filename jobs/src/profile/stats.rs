//! The built-in statistical profiler: Harness Behavior Profiles (Eq. 8, 11) from paired
//! calibration trajectories, with no LLM.
//!
//! Conditions come from task features: `any task`, `task_type = <t>` for each task type
//! among the pairs, and `rows <= m` / `rows > m` with `m` the median row count of the paired
//! tasks. Behaviors are the [`Behavior`] patterns shown by H_i's trajectory, plus the bare
//! outcome. For each (condition, behavior) the supporting pairs are those whose task meets
//! the condition and whose H_i run shows the behavior; the entry's `paired_delta` is the
//! mean of `success(H_i) − success(H0)` over them. Behaviors are the fixed four plus those
//! the sibling's trajectories show ([`Behavior::observed`]: tools, hooks, tool errors,
//! endings, model calls); an observed behavior that H0 shows on every supporting pair too
//! is no difference and is skipped. An entry is kept when it has at least `min_support`
//! pairs (default 1: Appendix D keeps single-task observations) and a nonzero delta beyond
//! `min_abs_delta`: positive → prefer,
//! negative → avoid. An entry adds nothing when an entry already kept (conditions are tried
//! broadest first) has the same polarity and behavior, a superset of its supporting pairs
//! and the same delta; it is dropped.
//! Each list keeps the `max_per_list` entries with the largest `|delta| · support`.

use std::collections::BTreeSet;

use super::{Behavior, Pair, When};
use schemas::{Polarity, ProfileEntry};

/// Thresholds of the statistical profiler.
#[derive(Debug, Clone, PartialEq)]
pub struct StatsConfig {
    pub min_support: u32,
    pub min_abs_delta: f64,
    pub max_per_list: usize,
}

impl Default for StatsConfig {
    fn default() -> Self {
        // Appendix D keeps useful observations from individual tasks: one pair is enough
        // (entries are ranked by |delta| · support, so broader evidence comes first).
        StatsConfig { min_support: 1, min_abs_delta: 0.0, max_per_list: 6 }
    }
}

/// Provenance stamped on every entry.
#[derive(Debug, Clone, PartialEq)]
pub struct ProfileMeta {
    pub run_id: String,
    pub calibration_id: String,
    pub policy_checkpoint: String,
    pub harness_id: String,
}

impl ProfileMeta {
    pub fn entry(
        &self,
        polarity: Polarity,
        when: String,
        behavior: String,
        support: u32,
        paired_delta: Option<f64>,
        source: &str,
    ) -> ProfileEntry {
        ProfileEntry {
            run_id: self.run_id.clone(),
            calibration_id: self.calibration_id.clone(),
            policy_checkpoint: self.policy_checkpoint.clone(),
            harness_id: self.harness_id.clone(),
            polarity,
            when,
            behavior,
            support,
            paired_delta,
            source: source.to_string(),
        }
    }
}

/// The `source` of statistical entries.
pub const SOURCE: &str = "statistical";

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    let n = v.len();
    Some(if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 })
}

/// The conditions tried, broadest first.
pub fn conditions(pairs: &[Pair<'_>]) -> Vec<When> {
    let mut out = vec![When::Any];
    let types: BTreeSet<&str> = pairs.iter().map(|p| p.task.task_type.as_str()).collect();
    out.extend(types.into_iter().map(|t| When::TaskType(t.to_string())));
    if let Some(m) = median(pairs.iter().filter_map(|p| p.task.feature("rows")).collect()) {
        out.push(When::FeatureLe("rows".into(), m));
        out.push(When::FeatureGt("rows".into(), m));
    }
    out
}

/// Profile entries of one harness from its pairs with H0 (Eq. 11, statistical variant).
pub fn statistical_profile(meta: &ProfileMeta, pairs: &[Pair<'_>], config: &StatsConfig) -> Vec<ProfileEntry> {
    struct Candidate {
        polarity: Polarity,
        when: String,
        behavior: String,
        kind: Option<Behavior>,
        support: Vec<usize>,
        delta: f64,
    }
    let mut candidates: Vec<Candidate> = Vec::new();
    let observed = Behavior::observed(pairs);
    for when in conditions(pairs) {
        let in_condition: Vec<usize> = (0..pairs.len()).filter(|&i| when.matches(pairs[i].task)).collect();
        let mut behaviors: Vec<Option<Behavior>> = vec![None];
        behaviors.extend(observed.iter().cloned().map(Some));
        for behavior in behaviors {
            let support: Vec<usize> =
                in_condition.iter().copied().filter(|&i| behavior.as_ref().is_none_or(|b| b.shown_by(pairs[i].harness))).collect();
            if (support.len() as u32) < config.min_support.max(1) {
                continue;
            }
            // A behavior read from the data says something about the sibling only where H0
            // does not show it on every supporting pair too.
            if behavior.as_ref().is_some_and(|b| b.is_observed() && support.iter().all(|&i| b.shown_by(pairs[i].base))) {
                continue;
            }
            let n = support.len();
            let delta = support.iter().map(|&i| pairs[i].delta()).sum::<f64>() / n as f64;
            if delta == 0.0 || delta.abs() <= config.min_abs_delta {
                continue;
            }
            let wins = support.iter().filter(|&&i| pairs[i].harness.success).count();
            let base_wins = support.iter().filter(|&&i| pairs[i].base.success).count();
            let text = match &behavior {
                None => format!("succeeds on {wins}/{n} paired tasks vs H0 {base_wins}/{n}"),
                Some(b) => {
                    let base_shows = support.iter().filter(|&&i| b.shown_by(pairs[i].base)).count();
                    format!("{} (H0 does in {base_shows}/{n}); succeeds {wins}/{n} vs H0 {base_wins}/{n}", b.text())
                }
            };
            let polarity = if delta > 0.0 { Polarity::Prefer } else { Polarity::Avoid };
            candidates.push(Candidate { polarity, when: when.to_string(), behavior: text, kind: behavior, support, delta });
        }
    }
    let mut out = Vec::new();
    for polarity in [Polarity::Prefer, Polarity::Avoid] {
        let mut kept: Vec<&Candidate> = Vec::new();
        for c in candidates.iter().filter(|c| c.polarity == polarity) {
            let subsumed =
                |k: &&Candidate| k.kind == c.kind && (k.delta - c.delta).abs() < 1e-9 && c.support.iter().all(|i| k.support.contains(i));
            if !kept.iter().any(subsumed) {
                kept.push(c);
            }
        }
        // Stable sort keeps the broader condition first among equals.
        kept.sort_by(|a, b| {
            let w = |c: &Candidate| c.delta.abs() * c.support.len() as f64;
            w(b).partial_cmp(&w(a)).unwrap_or(std::cmp::Ordering::Equal)
        });
        kept.truncate(config.max_per_list);
        out.extend(
            kept.into_iter()
                .map(|c| meta.entry(c.polarity, c.when.clone(), c.behavior.clone(), c.support.len() as u32, Some(c.delta), SOURCE)),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::testing::*;
    use super::super::{pair_up, TaskInfo};
    use super::*;

    fn meta() -> ProfileMeta {
        ProfileMeta { run_id: "r".into(), calibration_id: "c1".into(), policy_checkpoint: "ck".into(), harness_id: "h1".into() }
    }

    /// h1 inspects the schema and wins on large counting tables; it loses on small INSERTs.
    fn fixture() -> (Vec<TaskInfo>, Vec<schemas::Trajectory>, Vec<schemas::Trajectory>) {
        let tasks = vec![
            task("c1", "counting", 60, "How many a"),
            task("c2", "counting", 70, "How many b"),
            task("c3", "counting", 80, "How many c"),
            task("i1", "INSERT", 5, "Insert x"),
            task("i2", "INSERT", 6, "Insert y"),
        ];
        let mut h = vec![];
        let mut b = vec![];
        for id in ["c1", "c2", "c3"] {
            h.push(traj("h1", id, 1, true, &["PRAGMA table_info(t)", "SELECT count(*) FROM t"], true));
            b.push(traj("h0", id, 1, false, &["SELECT count(*) FROM x", "SELECT count(*) FROM x"], false));
        }
        for id in ["i1", "i2"] {
            h.push(traj("h1", id, 1, false, &["INSERT INTO t VALUES (1)"], false));
            b.push(traj("h0", id, 1, true, &["INSERT INTO t VALUES (1)"], true));
        }
        (tasks, h, b)
    }

    #[test]
    fn entries_carry_paired_deltas_and_support() {
        let (tasks, h, b) = fixture();
        let pairs = pair_up(&tasks, &h, &b);
        assert_eq!(pairs.len(), 5);
        let entries = statistical_profile(&meta(), &pairs, &StatsConfig::default());
        let prefer: Vec<_> = entries.iter().filter(|e| e.polarity == Polarity::Prefer).collect();
        let avoid: Vec<_> = entries.iter().filter(|e| e.polarity == Polarity::Avoid).collect();
        // Counting pairs all improve.
        let counting = prefer.iter().find(|e| e.when == "task_type = counting").expect("counting entry");
        assert_eq!((counting.support, counting.paired_delta), (3, Some(1.0)));
        assert!(counting.behavior.contains("3/3") && counting.behavior.contains("H0 0/3"), "{}", counting.behavior);
        // h1 inspects the schema on exactly the counting pairs: one entry, under the broadest
        // condition, not repeated for `task_type = counting`.
        let inspects: Vec<_> = prefer.iter().filter(|e| e.behavior.starts_with("inspects the schema")).collect();
        assert_eq!(inspects.len(), 1, "{prefer:?}");
        assert_eq!((inspects[0].when.as_str(), inspects[0].support), ("any task", 3));
        assert!(inspects[0].behavior.contains("H0 does in 0/3"), "{}", inspects[0].behavior);
        // Tasks above the median size (60 rows) are all counting tasks: nothing new to say.
        assert!(!prefer.iter().any(|e| e.when == "rows > 60"), "{prefer:?}");
        let small =
            avoid.iter().find(|e| e.when == "rows <= 60" && e.behavior.starts_with("succeeds")).unwrap_or_else(|| panic!("{avoid:?}"));
        assert_eq!(small.support, 3);
        // INSERT pairs all get worse.
        let insert = avoid.iter().find(|e| e.when == "task_type = INSERT").expect("insert entry");
        assert_eq!((insert.support, insert.paired_delta), (2, Some(-1.0)));
        // Overall: 3 wins, 2 losses over 5 pairs.
        let any = entries.iter().find(|e| e.when == "any task" && e.behavior.starts_with("succeeds")).unwrap();
        assert_eq!((any.polarity, any.support, any.paired_delta), (Polarity::Prefer, 5, Some(0.2)));
        assert!(entries.iter().all(|e| e.source == "statistical" && e.calibration_id == "c1" && e.harness_id == "h1"));
        // Every `when` is machine-checkable.
        assert!(entries.iter().all(|e| e.when.parse::<When>().is_ok()));
    }

    /// Behaviors read from the trajectories: a hook that fires in the sibling's episodes
    /// gets an entry, even from one task (Appendix D keeps single-task observations); a tool
    /// that H0 calls as well is no difference.
    #[test]
    fn observed_behaviors_tell_siblings_apart_down_to_one_task() {
        let (tasks, mut h, b) = fixture();
        h[0].turns[0].hook_id = Some("commit-hint".into());
        let pairs = pair_up(&tasks, &h, &b);
        let entries = statistical_profile(&meta(), &pairs, &StatsConfig { max_per_list: 50, ..Default::default() });
        let hook = entries.iter().find(|e| e.behavior.starts_with("hook `commit-hint` fires")).unwrap_or_else(|| panic!("{entries:?}"));
        assert_eq!((hook.polarity, hook.support, hook.paired_delta), (Polarity::Prefer, 1, Some(1.0)));
        assert!(!entries.iter().any(|e| e.behavior.starts_with("calls `execute_sql`")), "both call it: {entries:?}");
        let observed = Behavior::observed(&pairs);
        assert!(
            observed.contains(&Behavior::UsesTool("execute_sql".into())) && observed.contains(&Behavior::HookFires("commit-hint".into())),
            "{observed:?}"
        );
        assert_eq!(&observed[..4], &Behavior::ALL, "the fixed four come first");
    }

    #[test]
    fn support_threshold_and_caps_apply() {
        let (tasks, h, b) = fixture();
        let pairs = pair_up(&tasks, &h, &b);
        let strict = StatsConfig { min_support: 4, ..Default::default() };
        let entries = statistical_profile(&meta(), &pairs, &strict);
        assert!(entries.iter().all(|e| e.support >= 4), "{entries:?}");
        let capped = StatsConfig { max_per_list: 1, ..Default::default() };
        let entries = statistical_profile(&meta(), &pairs, &capped);
        assert!(entries.iter().filter(|e| e.polarity == Polarity::Prefer).count() <= 1);
        // Identical outcomes give no entries at all.
        let same = pair_up(&tasks, &b, &b);
        assert!(statistical_profile(&meta(), &same, &StatsConfig::default()).is_empty());
    }
}
