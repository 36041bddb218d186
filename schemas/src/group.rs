use serde::{Deserialize, Serialize};

use crate::{Record, Split};

/// Which rollouts of a task the learner trains on (Eq. 5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RetainedKind {
    /// The base group under H0 had a success (or rescue did not fire).
    Base,
    /// The all-fail base group was replaced by the rescue group.
    Rescue,
    /// Nothing retained (no reward variance, or failures masked the group).
    None,
}

/// One task's group at one update: base outcome, rescue decision and what is kept.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Group {
    pub run_id: String,
    pub step: u32,
    pub group_id: String,
    pub task_id: String,
    pub split: Split,
    /// Rollouts per group (K).
    pub k: u32,
    pub base_successes: u32,
    pub rescue_fired: bool,
    /// Rescue strategy in force (`none`, `h0`, `router`, `mixed`).
    pub rescue_strategy: String,
    /// Harness ids of the rollouts in the retained group, in attempt order.
    pub harnesses: Vec<String>,
    pub rescue_successes: u32,
    pub retained: bool,
    pub retained_kind: RetainedKind,
    /// Why a group was dropped or replaced, in words.
    pub filter_reason: Option<String>,
    pub mean_reward: f64,
    pub reward_std: f64,
    /// GRPO advantages of the retained rollouts (Appendix B), aligned with `trajectory_ids`.
    pub advantages: Vec<f64>,
    pub trajectory_ids: Vec<String>,
    /// Policy (trainable) tokens in the retained rollouts.
    pub policy_tokens: u64,
}

impl Record for Group {
    const NAME: &'static str = "group";
    const VERSION: u32 = 1;
}
