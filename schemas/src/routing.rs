use serde::{Deserialize, Serialize};

use crate::Record;

/// What a routing decision is for (§3.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RoutePurpose {
    /// Top-K auxiliaries (H0 excluded) for a rescue group.
    Rescue,
    /// Rank-1 over the whole pool (H0 included) for inference.
    Inference,
}

/// One voter's ranking of 4 distinct candidates (Appendix C); the rule router's ballot ranks
/// every candidate (its Rule Router has no ballot size).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Ballot {
    /// `rule` or `llm:<endpoint model>`.
    pub voter: String,
    pub ranking: Vec<String>,
    pub valid: bool,
    /// Why an invalid ballot was discarded (unknown id, duplicate, unparsable, ...).
    pub invalid_reason: Option<String>,
    /// Raw voter output, kept for audit.
    pub raw: Option<String>,
    /// Tokens the voter's call spent (zero for the rule voter), Table 9.
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

/// A routing decision with its ballots, summed scores (Eq. 9–10) and selection.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoutingDecision {
    pub run_id: String,
    pub step: u32,
    pub task_id: String,
    pub purpose: RoutePurpose,
    /// Allocation variant, e.g. `random`, `rule`, `llm_4x2`, `topk_fixed`, `topk_adaptive`.
    pub variant: String,
    /// Calibration whose profiles and statistics the voters saw.
    pub calibration_id: Option<String>,
    /// Candidate order shown to voters (shuffled per call from the run seed).
    pub candidate_order: Vec<String>,
    pub ballots: Vec<Ballot>,
    /// Harness ids with their summed scores, aligned.
    pub score_harnesses: Vec<String>,
    pub scores: Vec<f64>,
    pub selected: Vec<String>,
    pub decided_at_ms: i64,
}

impl Record for RoutingDecision {
    const NAME: &'static str = "routing_decision";
    /// 2: ballots carry the tokens their call spent.
    const VERSION: u32 = 2;
}
