//! Records of the learned harness editor (Harness-R1 §3): the trace packets an editor
//! reads and the patches it writes, with their rewards.

use serde::{Deserialize, Serialize};

use crate::Record;

/// A bounded, sanitised extract of a frozen target's failed episodes under one parent
/// harness (Harness-R1 §3.1's failure packet s_B), with the successful control tasks the
/// patched harness is rerun on as well. Stored, so that an editor's input is reproducible.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TracePacket {
    /// Content id: the parent harness version, the tasks and the seed.
    pub packet_id: String,
    pub run_id: String,
    pub parent_harness_id: String,
    /// Content hash of the parent harness spec the episodes ran under.
    pub parent_harness_version: String,
    /// Every task of the packet's batch B: the failed ones first, then the controls.
    pub task_ids: Vec<String>,
    /// Whether each task of `task_ids` is a control (succeeded under the parent).
    pub controls: Vec<bool>,
    /// The parent's reward on each task of `task_ids` (R⁰ of Eq. 1).
    pub parent_rewards: Vec<f64>,
    /// The parent's episodes, aligned with `task_ids`.
    pub source_trajectory_ids: Vec<String>,
    /// Seed the parent's episodes ran with; reruns use the same one.
    pub seed: u64,
    /// What the editor reads: per failed task, its question, the turns that matter, how it
    /// ended and the rule diagnosis; capped in length.
    pub text: String,
}

impl Record for TracePacket {
    const NAME: &'static str = "trace_packet";
    const VERSION: u32 = 1;
}

/// One patch an editor wrote for a packet, and what it earned.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PatchRecord {
    pub run_id: String,
    pub step: u32,
    pub packet_id: String,
    /// Index of the patch among the packet's G (its sampling seed is the job's seed + index).
    pub patch_index: u32,
    /// The editor row (a `kind=edit` trajectory) holding the reply's tokens.
    pub trajectory_id: String,
    /// The editor's weights: a checkpoint key, or the base model's path.
    pub editor_checkpoint: String,
    /// The editor's reply as written.
    pub reply: String,
    /// Whether the reply parsed as a patch and the patched harness validated.
    pub valid: bool,
    /// Why it did not (parse or validation problems, with their paths).
    pub error: Option<String>,
    /// The patched harness (JSON), when valid.
    pub child_spec: Option<String>,
    pub child_harness_id: Option<String>,
    /// The rollout job that reran the packet's tasks under the patched harness.
    pub rerun_job_id: Option<String>,
    /// The patched harness's reward on each task of the packet (Rᴾ of Eq. 1; empty when invalid).
    pub patched_rewards: Vec<f64>,
    /// Eq. 1: mean over the packet's tasks of Rᴾ − R⁰; 0 for an invalid patch.
    pub reward: f64,
    /// Eq. 3: the reward normalised within the packet's G patches.
    pub advantage: f64,
}

impl Record for PatchRecord {
    const NAME: &'static str = "patch";
    const VERSION: u32 = 1;
}
