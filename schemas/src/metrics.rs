use serde::{Deserialize, Serialize};

use crate::Record;

/// One metric value, long format: `(run, step, stage, name) -> value`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MetricRow {
    pub run_id: String,
    pub step: u32,
    /// Scheduler stage that produced it, e.g. `update`, `calibration`, `evaluation`.
    pub stage: String,
    /// Metric name, e.g. `effective_group_rate`, `rescue_success`, `pass_at_k`.
    pub name: String,
    pub value: f64,
    pub policy_checkpoint: Option<String>,
    pub recorded_at_ms: i64,
}

impl Record for MetricRow {
    const NAME: &'static str = "metric";
    const VERSION: u32 = 1;
}
