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

/// Tokens an LLM component (voter, profiler, diagnoser, editor) spent: the cost columns of
/// the paper's Table 9. Counts come from the endpoint's own usage figures.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LlmUsage {
    pub calls: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

impl LlmUsage {
    /// One call's usage.
    pub fn call(prompt_tokens: u64, completion_tokens: u64) -> Self {
        LlmUsage { calls: 1, prompt_tokens, completion_tokens }
    }

    pub fn add(&mut self, other: LlmUsage) {
        self.calls += other.calls;
        self.prompt_tokens += other.prompt_tokens;
        self.completion_tokens += other.completion_tokens;
    }

    pub fn total_tokens(&self) -> u64 {
        self.prompt_tokens + self.completion_tokens
    }
}

impl std::iter::Sum for LlmUsage {
    fn sum<I: Iterator<Item = LlmUsage>>(iter: I) -> Self {
        let mut total = LlmUsage::default();
        for u in iter {
            total.add(u);
        }
        total
    }
}
