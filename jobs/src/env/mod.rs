//! The `Environment` seam: what an agent acts in. One environment instance runs one
//! episode at a time: `reset` (task + seed → first observation and tools), `step` (a tool
//! call → observation), `evaluate` (→ reward and success), `close` (release resources,
//! e.g. drop the per-episode database).
//!
//! Backends: [`dbbench`] (in process, SQLite or MariaDB) and [`http`] (any server that
//! speaks AgentBench's controller protocol, e.g. `harness-s env serve`).

pub mod dbbench;
pub mod http;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use schemas::ErrorClass;

/// A tool the environment offers, with a JSON-Schema description of its arguments
/// (the OpenAI `tools` shape). Harnesses may hide tools or rewrite descriptions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolSpec {
    pub name: String,
    pub description: String,
    /// JSON Schema of the arguments object.
    pub parameters: serde_json::Value,
}

/// A call of a tool by the policy (or by a harness hook).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    pub name: String,
    /// Arguments object.
    pub args: serde_json::Value,
}

/// What the environment shows after reset or a step.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Observation {
    pub text: String,
    /// The episode is over (an answer was committed, or the round limit was reached).
    pub done: bool,
    /// The last action failed (e.g. an SQL error); the text says why.
    pub action_failed: bool,
    /// The observation was cut to fit (more rows exist than are shown).
    pub truncated: bool,
    /// This step committed the agent's final answer (so `done` is not a round-limit stop).
    #[serde(default)]
    pub committed: bool,
}

/// The start of an episode.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EpisodeStart {
    /// The task as shown to the agent.
    pub observation: Observation,
    pub tools: Vec<ToolSpec>,
    /// Environment actions allowed in this episode.
    pub max_rounds: u32,
    /// Task category, e.g. `counting`, `INSERT`.
    pub task_type: String,
    /// Task features for routing and profiles (e.g. `rows`, `columns`), as JSON.
    pub features: serde_json::Map<String, serde_json::Value>,
}

/// The outcome of an episode.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Evaluation {
    pub reward: f64,
    pub success: bool,
    /// Why it was graded so, in words (shown in reports, never to the policy).
    pub detail: String,
}

/// Typed environment failures. An action the agent got wrong (bad SQL) is not an error:
/// it becomes an [`Observation`] with `action_failed`.
#[derive(Debug, thiserror::Error)]
pub enum EnvError {
    #[error("unknown task `{task_id}`")]
    UnknownTask { task_id: String },
    #[error("task `{task_id}` is invalid: {reason}")]
    InvalidTask { task_id: String, reason: String },
    #[error("{operation} called in the wrong episode state: {reason}")]
    State { operation: &'static str, reason: String },
    /// The backing service (database server, ...) failed; retrying may help.
    #[error("environment backend `{backend}` failed: {detail}")]
    Backend { backend: String, detail: String },
    /// The environment server refused a request or answered outside its protocol; running
    /// the episode again fails the same way.
    #[error("environment backend `{backend}` refused the episode: {detail}")]
    Protocol { backend: String, detail: String },
}

impl EnvError {
    /// Failure class recorded on the trajectory row.
    pub fn class(&self) -> ErrorClass {
        match self {
            EnvError::Backend { .. } => ErrorClass::Infra,
            _ => ErrorClass::Env,
        }
    }
}

impl infra::Transient for EnvError {
    /// Whether the same episode may succeed if run again.
    fn is_transient(&self) -> bool {
        matches!(self, EnvError::Backend { .. })
    }
}

/// Makes one environment instance per episode (e.g. a DBBench environment with its own
/// database): the seam a worker holds, one factory per environment kind.
#[async_trait]
pub trait EnvironmentFactory: Send + Sync {
    async fn create(&self) -> Result<Box<dyn Environment>, EnvError>;

    /// Deliveries of a rollout job that fail (and are retried by the queue) when some of
    /// its episodes ended on a transient backend error, before such episodes are recorded
    /// as failed rows. 0 (the default): record them at once. Remote environments
    /// ([`http`]) retry, since a restarted server loses its sessions.
    fn job_retries(&self) -> u32 {
        0
    }
}

/// An environment that runs one episode at a time.
#[async_trait]
pub trait Environment: Send {
    /// Short name, e.g. `dbbench-sqlite`.
    fn name(&self) -> &str;
    /// Starts a fresh episode of `task_id` from its initial state.
    async fn reset(&mut self, task_id: &str, seed: u64) -> Result<EpisodeStart, EnvError>;
    /// Applies one tool call.
    async fn step(&mut self, call: &ToolCall) -> Result<Observation, EnvError>;
    /// Grades the episode (may be called once the episode is done or the budget is out).
    async fn evaluate(&mut self) -> Result<Evaluation, EnvError>;
    /// Releases the episode's resources. Idempotent.
    async fn close(&mut self) -> Result<(), EnvError>;
}
