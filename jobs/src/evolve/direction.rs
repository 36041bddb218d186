//! Direction formation (Harness-S §3.2, Eq. 2; Appendix F, Table 8 "Repair direction"):
//! group the diagnosed root causes of a parent into repair directions of 2–3 related
//! causes, each cause supported by at least 2 distinct failed tasks.
//!
//! Pure function of the diagnoses. Relatedness: causes of the same family (finishing the
//! episode, writing SQL, the answer itself, control flow) are related first; beyond the
//! family, causes that co-occur on the same tasks (Jaccard overlap of their task sets).
//! Every qualifying cause seeds one direction; identical cause sets are formed once.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::diagnose::{codes, TaskDiagnosis};

/// A repair direction: the causes one child targets, with the tasks that support them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Direction {
    /// The seed cause first, then its partners.
    pub causes: Vec<String>,
    /// cause → failed tasks that show it.
    pub support: BTreeMap<String, BTreeSet<String>>,
    /// One line for lineage and the editor.
    pub summary: String,
}

impl Direction {
    /// Every task that supports one of the causes.
    pub fn tasks(&self) -> BTreeSet<String> {
        self.support.values().flatten().cloned().collect()
    }
}

/// Settings of direction formation (Table 8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DirectionSettings {
    /// Distinct failed tasks a cause needs.
    pub min_task_support: usize,
    pub min_causes: usize,
    pub max_causes: usize,
}

impl Default for DirectionSettings {
    fn default() -> Self {
        // Table 8: "2–3 related root causes per candidate; at least 2 distinct failed tasks per cause".
        DirectionSettings { min_task_support: 2, min_causes: 2, max_causes: 3 }
    }
}

/// The family of a cause code; unknown codes (from an LLM diagnoser) form their own family.
pub fn family(cause: &str) -> &str {
    match cause {
        codes::NEVER_COMMITTED | codes::BUDGET_EXHAUSTED | codes::ROUND_LIMIT | codes::PROSE_ANSWER | codes::RESULT_NOT_COMMITTED => {
            "finish"
        }
        codes::IDENTIFIER_ERROR | codes::SQL_ERROR | codes::EMPTY_RESULT => "sql",
        codes::WRONG_AGGREGATE | codes::ANSWER_FORMAT | codes::WRONG_ANSWER | codes::WRITE_NOT_EXECUTED => "answer",
        codes::REPEATED_ACTION | codes::NO_QUERY | codes::UNPARSED_ACTION => "control",
        other => other,
    }
}

/// cause → distinct failed tasks showing it (`unresolved` excluded).
pub fn cause_support(diagnoses: &[TaskDiagnosis]) -> BTreeMap<String, BTreeSet<String>> {
    let mut support: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for d in diagnoses {
        for f in &d.findings {
            if f.cause != codes::UNRESOLVED {
                support.entry(f.cause.clone()).or_default().insert(d.task_id.clone());
            }
        }
    }
    support
}

fn jaccard(a: &BTreeSet<String>, b: &BTreeSet<String>) -> f64 {
    let inter = a.intersection(b).count() as f64;
    let union = a.union(b).count() as f64;
    if union == 0.0 {
        0.0
    } else {
        inter / union
    }
}

/// Forms at most `limit` directions from one parent's diagnoses (Eq. 2's D_g(H)).
/// Qualifying causes (support ≥ `min_task_support`) seed directions in order of support
/// (ties by code); each takes its 1–2 most related qualifying partners. When fewer than
/// `min_causes` causes qualify, no direction is formed: one cause alone is not a direction.
pub fn form_directions(diagnoses: &[TaskDiagnosis], settings: &DirectionSettings, limit: usize) -> Vec<Direction> {
    let support = cause_support(diagnoses);
    let mut qualifying: Vec<(&String, &BTreeSet<String>)> =
        support.iter().filter(|(_, tasks)| tasks.len() >= settings.min_task_support).collect();
    qualifying.sort_by(|a, b| b.1.len().cmp(&a.1.len()).then_with(|| a.0.cmp(b.0)));
    if qualifying.len() < settings.min_causes.max(1) {
        return vec![];
    }
    let mut seen: BTreeSet<BTreeSet<String>> = BTreeSet::new();
    let mut out = Vec::new();
    for (seed, seed_tasks) in &qualifying {
        if out.len() >= limit {
            break;
        }
        let mut partners: Vec<(&String, bool, f64)> =
            qualifying.iter().filter(|(c, _)| c != seed).map(|(c, t)| (*c, family(c) == family(seed), jaccard(seed_tasks, t))).collect();
        // Same family first, then co-occurrence, then code: deterministic.
        partners.sort_by(|a, b| b.1.cmp(&a.1).then(b.2.total_cmp(&a.2)).then_with(|| a.0.cmp(b.0)));
        // Largest related set first; when that set was already formed from another seed,
        // a smaller one (down to `min_causes`) keeps this seed's direction distinct.
        let mut related: Vec<String> = vec![(*seed).clone()];
        for (c, same_family, overlap) in partners.into_iter().take(settings.max_causes.saturating_sub(1)) {
            // A third cause must be related (same family or co-occurring), not just present.
            if related.len() >= settings.min_causes && !same_family && overlap == 0.0 {
                break;
            }
            related.push(c.clone());
        }
        let mut causes = None;
        for size in (settings.min_causes.max(1)..=related.len()).rev() {
            let key: BTreeSet<String> = related[..size].iter().cloned().collect();
            if seen.insert(key) {
                causes = Some(related[..size].to_vec());
                break;
            }
        }
        let Some(causes) = causes else { continue };
        let support: BTreeMap<String, BTreeSet<String>> = causes.iter().map(|c| (c.clone(), support[c].clone())).collect();
        let summary = causes.iter().map(|c| format!("{c} ({} tasks)", support[c].len())).collect::<Vec<_>>().join(" + ");
        out.push(Direction { causes, support, summary });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::evolve::diagnose::Finding;

    fn diag(task: &str, causes: &[&str]) -> TaskDiagnosis {
        TaskDiagnosis {
            task_id: task.into(),
            task_type: "counting".into(),
            harness_id: "h0".into(),
            findings: causes.iter().map(|c| Finding { cause: c.to_string(), evidence: String::new() }).collect(),
        }
    }

    #[test]
    fn causes_need_two_tasks_and_directions_group_related_ones() {
        let d = vec![
            diag("t1", &["never_committed", "prose_answer"]),
            diag("t2", &["never_committed", "prose_answer", "sql_error"]),
            diag("t3", &["identifier_error", "sql_error"]),
            diag("t4", &["identifier_error", "repeated_action"]),
            diag("t5", &["wrong_answer"]),
        ];
        let dirs = form_directions(&d, &DirectionSettings::default(), 10);
        // wrong_answer (1 task) and repeated_action (1 task) never appear.
        for dir in &dirs {
            assert!(!dir.causes.contains(&"wrong_answer".to_string()));
            assert!(!dir.causes.contains(&"repeated_action".to_string()));
            assert!((2..=3).contains(&dir.causes.len()), "{dir:?}");
            for tasks in dir.support.values() {
                assert!(tasks.len() >= 2);
            }
        }
        // identifier_error's partner is sql_error (same family), never_committed's is prose_answer.
        let first_of = |seed: &str| dirs.iter().find(|d| d.causes[0] == seed).unwrap().causes[1].clone();
        assert_eq!(first_of("identifier_error"), "sql_error");
        assert_eq!(first_of("never_committed"), "prose_answer");
        // Identical cause sets are formed once.
        let sets: BTreeSet<BTreeSet<String>> = dirs.iter().map(|d| d.causes.iter().cloned().collect()).collect();
        assert_eq!(sets.len(), dirs.len());
        assert_eq!(form_directions(&d, &DirectionSettings::default(), 1).len(), 1);
    }

    #[test]
    fn one_family_of_causes_still_gives_one_direction_per_seed() {
        // The weak-policy pattern: every failure shows the same three finishing causes.
        let d: Vec<TaskDiagnosis> =
            (0..4).map(|i| diag(&format!("t{i}"), &["never_committed", "budget_exhausted", "prose_answer"])).collect();
        let dirs = form_directions(&d, &DirectionSettings::default(), 10);
        let sets: Vec<BTreeSet<String>> = dirs.iter().map(|d| d.causes.iter().cloned().collect()).collect();
        assert_eq!(dirs.len(), 3, "{dirs:?}");
        assert_eq!(sets.iter().collect::<BTreeSet<_>>().len(), 3);
        assert_eq!(dirs[0].causes.len(), 3);
        assert!(dirs[1..].iter().all(|d| d.causes.len() == 2));
    }

    #[test]
    fn a_single_qualifying_cause_forms_no_direction() {
        let d = vec![diag("t1", &["never_committed"]), diag("t2", &["never_committed", "sql_error"])];
        assert!(form_directions(&d, &DirectionSettings::default(), 5).is_empty());
    }
}
