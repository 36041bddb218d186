//! The `Policy` seam: messages + tools + sampling → one assistant turn, with token ids and
//! per-token log-probabilities where the backend gives them (the learner needs them for
//! the TIS weight of Appendix B).

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::env::{ToolCall, ToolSpec};
use schemas::{ErrorClass, Role};

pub mod metered;
pub mod openai;
pub mod text_protocol;
pub mod weight_sync;

/// One chat message as sent to a policy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub role: Role,
    pub content: String,
    /// Tool calls made by an assistant message.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
}

impl Message {
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Message { role, content: content.into(), tool_calls: vec![] }
    }
}

/// Sampling settings of one call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_p: f32,
    pub max_tokens: u32,
    pub seed: Option<u64>,
    #[serde(default)]
    pub stop: Vec<String>,
    /// Decode only what this grammar allows (the native backend; an endpoint refuses it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub constrain: Option<Constrain>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 1.0, top_p: 1.0, max_tokens: 512, seed: None, stop: vec![], constrain: None }
    }
}

/// Why generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    Stop,
    Length,
    ToolCalls,
}

/// One assistant turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicyOutput {
    pub text: String,
    pub tool_calls: Vec<ToolCall>,
    /// Sampled token ids (empty if the backend does not return them).
    pub token_ids: Vec<u32>,
    /// Rollout-time log-probability of each sampled token, aligned with `token_ids`.
    pub logprobs: Vec<f32>,
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub finish_reason: FinishReason,
    /// [`schemas::prompt_hash`] of the prompt token ids the reply was sampled from, when
    /// the backend knows them (the native backend; endpoints that return prompt ids).
    pub prompt_hash: Option<String>,
}

/// Which grammar a generation is constrained to ([`SamplingParams::constrain`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Constrain {
    /// One harness patch of the evolve editor's diff format, one entry added (the native
    /// backend's `grammar` module).
    HarnessPatch,
}

impl Constrain {
    /// The name on the wire (`harness-s serve`'s `constrain` field).
    pub fn wire_name(self) -> &'static str {
        match self {
            Constrain::HarnessPatch => "harness_patch",
        }
    }

    /// The constraint of a wire name.
    pub fn from_wire(name: &str) -> Option<Constrain> {
        [Constrain::HarnessPatch].into_iter().find(|c| c.wire_name() == name)
    }
}

/// Typed policy failures; the class decides retry, masking or failing the group.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    #[error("policy call timed out after {seconds:.1}s")]
    Timeout { seconds: f64 },
    #[error("prompt of {tokens} tokens does not fit the model context of {limit}")]
    ContextLength { tokens: u64, limit: u64 },
    #[error("the policy returned output that cannot be used: {detail}")]
    InvalidOutput { detail: String },
    /// The server answered with an error status.
    #[error("policy server answered HTTP {status}: {detail}")]
    Http { status: u16, detail: String },
    /// The server could not be reached.
    #[error("cannot reach the policy server {}: {}", infra::redact_url(.endpoint), infra::redact_text(.detail))]
    Unreachable { endpoint: String, detail: String },
    /// Bad configuration (missing model file, missing API key variable, ...).
    #[error("policy configuration: {}", infra::redact_text(.0))]
    Config(String),
    /// The native backend failed.
    #[error("native policy: {0}")]
    Native(String),
    /// The endpoint answered with other weights than the ones this run synced it to (it
    /// restarted on its starting weights, say); the call is retried once the weights are
    /// loaded again.
    #[error("the policy endpoint answered with weights {served}, not the synced {expected}")]
    StaleWeights { expected: String, served: String },
    /// A retryable failure persisted through every attempt the retry budget allowed; the
    /// class is the last failure's.
    #[error("{last} (gave up after {attempts} attempt(s) in {elapsed_s:.1}s)")]
    RetriesExhausted { attempts: u32, elapsed_s: f64, last: Box<PolicyError> },
}

impl PolicyError {
    pub fn class(&self) -> ErrorClass {
        match self {
            PolicyError::Timeout { .. } => ErrorClass::Timeout,
            PolicyError::ContextLength { .. } => ErrorClass::ContextLength,
            PolicyError::InvalidOutput { .. } => ErrorClass::InvalidOutput,
            PolicyError::Http { status, .. } if *status == 429 || *status >= 500 => ErrorClass::Infra,
            PolicyError::Unreachable { .. } | PolicyError::StaleWeights { .. } => ErrorClass::Infra,
            PolicyError::RetriesExhausted { last, .. } => last.class(),
            _ => ErrorClass::Policy,
        }
    }
}

impl infra::Transient for PolicyError {
    /// Whether retrying the same call (with backoff) may succeed.
    fn is_transient(&self) -> bool {
        match self {
            PolicyError::Timeout { .. }
            | PolicyError::Unreachable { .. }
            | PolicyError::InvalidOutput { .. }
            | PolicyError::StaleWeights { .. } => true,
            PolicyError::Http { status, .. } => *status == 429 || *status >= 500,
            _ => false,
        }
    }
}

/// A policy: the LLM being trained (native tch backend) or served (OpenAI-compatible).
#[async_trait]
pub trait Policy: Send + Sync {
    /// Identifier of the weights in use (checkpoint key or model name), recorded on rows.
    fn checkpoint(&self) -> String;
    /// Produces one assistant turn.
    async fn chat(&self, messages: &[Message], tools: &[ToolSpec], sampling: &SamplingParams) -> Result<PolicyOutput, PolicyError>;
}
