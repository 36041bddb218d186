use serde::{Deserialize, Serialize};

use crate::Record;

/// Why a rollout was run (Algorithm 1 of the Harness-S paper).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RolloutKind {
    /// One of the K rollouts of a task under the base harness H0.
    Base,
    /// A rescue rollout under an auxiliary sibling harness (Eq. 5).
    Rescue,
    /// A paired validation rollout used to re-anchor behavior profiles (§3.4).
    Calibration,
    /// An evaluation rollout (baseline or final, Pass@k / Avg@k).
    Eval,
    /// A harness editor's reply to a trace packet (Harness-R1): one patch, its reward the
    /// change it made to the frozen target's success.
    Edit,
}

impl RolloutKind {
    pub const ALL: [RolloutKind; 5] = [Self::Base, Self::Rescue, Self::Calibration, Self::Eval, Self::Edit];

    /// The value used in object names (`kind=<value>`) and in the `kind` column.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Base => "base",
            Self::Rescue => "rescue",
            Self::Calibration => "calibration",
            Self::Eval => "eval",
            Self::Edit => "edit",
        }
    }
}

impl std::fmt::Display for RolloutKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Which part of the task data a task comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Split {
    Train,
    Validation,
    Test,
}

/// How an episode ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Termination {
    /// The agent committed a final answer.
    Committed,
    /// The environment's round limit was reached without a commit.
    RoundLimit,
    /// A harness execution budget (model calls, actions, tokens) ran out.
    BudgetExhausted,
    /// The context no longer fit the model.
    ContextLimit,
    /// The episode was aborted by an error; see `error_class`.
    Error,
}

impl Termination {
    /// The stored value (as serialised).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Committed => "committed",
            Self::RoundLimit => "round_limit",
            Self::BudgetExhausted => "budget_exhausted",
            Self::ContextLimit => "context_limit",
            Self::Error => "error",
        }
    }
}

/// Typed failure classes; each has a policy and a budget in the scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorClass {
    Infra,
    Env,
    Policy,
    Timeout,
    ContextLength,
    InvalidOutput,
}

impl ErrorClass {
    /// The stored (serde) name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Infra => "infra",
            Self::Env => "env",
            Self::Policy => "policy",
            Self::Timeout => "timeout",
            Self::ContextLength => "context_length",
            Self::InvalidOutput => "invalid_output",
        }
    }
}

/// Chat role of a turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    System,
    User,
    Assistant,
    Tool,
}

impl Role {
    /// The role's name in chat messages (OpenAI's and chat templates').
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// Who produced a turn's text. Only `policy` tokens are ever trained on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TurnSource {
    Policy,
    Harness,
    Env,
    System,
}

/// One message of an episode, stored nested inside its [`Trajectory`] row.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Turn {
    /// Position in the episode, from 0.
    pub index: u32,
    pub role: Role,
    pub source: TurnSource,
    pub text: String,
    /// Token ids of `text` as the policy saw or produced them (empty when unknown).
    pub token_ids: Vec<u32>,
    /// Rollout-time log-probability of each sampled token (policy turns; else empty).
    pub logprobs: Vec<f32>,
    /// Per-token loss mask: true only for policy-sampled tokens (Appendix B).
    pub loss_mask: Vec<bool>,
    /// Tool called by this turn, if any.
    pub tool_name: Option<String>,
    /// Tool arguments as JSON text.
    pub tool_args: Option<String>,
    /// Id of the hook that injected or rewrote this turn, if any.
    pub hook_id: Option<String>,
    /// Policy turns: the number of prompt tokens the policy was conditioned on when it
    /// sampled this turn (0 when the backend did not say).
    pub prompt_token_count: u32,
    /// Policy turns: [`prompt_hash`] of those prompt token ids, when the backend gave
    /// them. The learner rebuilds the prompt and refuses to train on a turn whose rebuilt
    /// prompt has another hash, so what it scores is what the policy saw, token for token.
    pub prompt_hash: Option<String>,
}

impl Turn {
    /// A turn the policy did not sample (system, task, harness or environment text): no
    /// token ids, no logprobs, an empty loss mask, no tool call.
    pub fn context(index: u32, role: Role, source: TurnSource, text: String) -> Turn {
        Turn {
            index,
            role,
            source,
            text,
            token_ids: vec![],
            logprobs: vec![],
            loss_mask: vec![],
            tool_name: None,
            tool_args: None,
            hook_id: None,
            prompt_token_count: 0,
            prompt_hash: None,
        }
    }
}

/// Fingerprint of a prompt's token ids: SHA-256 over the ids as little-endian u32, first
/// 128 bits in hex.
pub fn prompt_hash(ids: &[u32]) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    for id in ids {
        h.update(id.to_le_bytes());
    }
    hex::encode(&h.finalize()[..16])
}

/// One rollout: a policy acting in an environment through a harness. One row per rollout,
/// its turns nested, with full provenance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Trajectory {
    pub trajectory_id: String,
    pub run_id: String,
    /// The job that produced this row.
    pub job_id: String,
    /// Training update index (0 for stages before the first update).
    pub step: u32,
    pub kind: RolloutKind,
    pub split: Split,
    pub task_id: String,
    /// Task category, e.g. `counting`, `INSERT`.
    pub task_type: String,
    pub group_id: String,
    /// Index of this rollout within its group.
    pub attempt: u32,
    pub harness_id: String,
    /// Content hash of the harness spec used.
    pub harness_version: String,
    pub policy_checkpoint: String,
    pub seed: u64,
    pub reward: f64,
    pub success: bool,
    pub termination: Termination,
    pub error_class: Option<ErrorClass>,
    pub error_message: Option<String>,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// Tokens injected by the harness (never trained on).
    pub harness_tokens: u64,
    pub model_calls: u32,
    pub env_actions: u32,
    pub started_at_ms: i64,
    pub duration_ms: u64,
    pub policy_ms: u64,
    pub env_ms: u64,
    /// Sampling temperature of the policy's turns (the distribution `logprobs` are under;
    /// the learner scores π_old at the same temperature).
    pub temperature: f32,
    /// The tools the policy was shown (after the harness's tool view), as a JSON array of
    /// `{name, description, parameters}`: part of the prompt the policy sampled from.
    pub tool_view: String,
    pub turns: Vec<Turn>,
}

impl Record for Trajectory {
    const NAME: &'static str = "trajectory";
    /// 2: turns carry their prompt fingerprint; rows carry temperature and tool view.
    /// 3: no `advantage` / `retained` / `retained_reason`: a rollout row is written before
    /// its group is formed, so those live on the group rows (`trajectory_ids` and
    /// `advantages` aligned), joined by `group_id` or trajectory id when read.
    const VERSION: u32 = 3;
}

#[cfg(test)]
mod termination_tests {
    use super::Termination;

    #[test]
    fn as_str_is_the_stored_value() {
        for t in
            [Termination::Committed, Termination::RoundLimit, Termination::BudgetExhausted, Termination::ContextLimit, Termination::Error]
        {
            assert_eq!(serde_json::to_value(t).unwrap(), t.as_str());
        }
        use super::ErrorClass as E;
        for c in [E::Infra, E::Env, E::Policy, E::Timeout, E::ContextLength, E::InvalidOutput] {
            assert_eq!(serde_json::to_value(c).unwrap(), c.as_str());
        }
        use crate::{HookAction as A, HookEvent as H};
        for h in [H::EpisodeStart, H::BeforeDecision, H::BeforeAction, H::AfterTool] {
            assert_eq!(serde_json::to_value(h).unwrap(), h.as_str());
        }
        for a in [A::Warn, A::BlockAndPrompt, A::RewriteAction, A::ForceAction] {
            assert_eq!(serde_json::to_value(a).unwrap(), a.as_str());
        }
    }
}
