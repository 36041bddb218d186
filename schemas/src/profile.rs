use serde::{Deserialize, Serialize};

use crate::Record;

/// Whether a profile entry says when to prefer or to avoid a harness (Eq. 8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Polarity {
    Prefer,
    Avoid,
}

/// One `{when, behavior}` entry of a Harness Behavior Profile, per harness per calibration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProfileEntry {
    pub run_id: String,
    /// The re-anchoring that produced this entry.
    pub calibration_id: String,
    /// Checkpoint the paired trajectories were run with.
    pub policy_checkpoint: String,
    pub harness_id: String,
    pub polarity: Polarity,
    /// Condition on the task, e.g. `task_type = counting and rows > 50`.
    pub when: String,
    /// Observed behavior, e.g. `inspects the schema before the first query`.
    pub behavior: String,
    /// Number of paired tasks supporting the entry.
    pub support: u32,
    /// Paired success delta of the harness vs H0 on the supporting tasks.
    pub paired_delta: Option<f64>,
    /// `statistical` or `llm:<model>`.
    pub source: String,
}

impl Record for ProfileEntry {
    const NAME: &'static str = "profile_entry";
    const VERSION: u32 = 1;
}
