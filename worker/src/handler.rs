//! Job handlers: what the worker runs for each [`JobKind`], and the typed failure that
//! decides between retry and dead-letter.

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use infra::store::ObjectStore;
use schemas::{JobEnvelope, JobKind, OutputEntry};

/// What a handler gets besides the envelope.
#[derive(Debug, Clone)]
pub struct JobContext {
    /// Where outputs go; keys derive from the job id so that reruns overwrite.
    pub store: Arc<dyn ObjectStore>,
    /// The worker running the job (logs only; outputs must not depend on it).
    pub worker_id: String,
}

/// A finished job: the objects it wrote and a small summary for the done-marker.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct JobOutput {
    pub outputs: Vec<OutputEntry>,
    pub result: serde_json::Value,
    /// The handler committed the job's done-marker itself, as the last step of its own
    /// protocol (rollout and re-anchoring jobs); the worker then only acknowledges.
    pub committed: bool,
}

/// Why a job did not finish. The variant, not the text, decides what happens next.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum JobFailure {
    /// May succeed later (infrastructure trouble, a flaky endpoint): retried with backoff
    /// until the queue's attempts are used up, then dead-lettered.
    #[error("{0}")]
    Retryable(String),
    /// Will fail the same way again (bad input, a bug): dead-lettered at once.
    #[error("{0}")]
    Fatal(String),
}

impl JobFailure {
    pub fn is_retryable(&self) -> bool {
        matches!(self, JobFailure::Retryable(_))
    }

    /// The one conversion of a job's error: retried if it is transient, dead-lettered if
    /// not.
    pub fn of<E: infra::Transient + std::fmt::Display>(e: E) -> JobFailure {
        if e.is_transient() {
            JobFailure::Retryable(e.to_string())
        } else {
            JobFailure::Fatal(e.to_string())
        }
    }

    /// The same failure with `what` (a spec field, a component) before its message.
    pub fn context(self, what: &str) -> JobFailure {
        match self {
            JobFailure::Retryable(m) => JobFailure::Retryable(format!("{what}: {m}")),
            JobFailure::Fatal(m) => JobFailure::Fatal(format!("{what}: {m}")),
        }
    }
}

/// Runs jobs of one kind. Outputs are written through `ctx.store` under keys derived
/// from the job id. The done-marker is written by `infra::store::commit`: by the worker
/// with the returned outputs, or by the handler itself when it returns `committed` (then
/// the worker only acknowledges).
#[async_trait]
pub trait Handler: Send + Sync + 'static {
    async fn run(&self, ctx: &JobContext, job: &JobEnvelope) -> Result<JobOutput, JobFailure>;
}

/// Handlers by kind.
#[derive(Clone, Default)]
pub struct Registry {
    handlers: BTreeMap<JobKind, Arc<dyn Handler>>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry").field("kinds", &self.kinds()).finish()
    }
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Every job kind this build implements.
    pub fn builtin() -> Self {
        let mut r = Self::new();
        r.register(JobKind::Sleep, SleepHandler);
        r
    }

    /// Adds or replaces the handler of a kind.
    pub fn register(&mut self, kind: JobKind, handler: impl Handler) -> &mut Self {
        self.handlers.insert(kind, Arc::new(handler));
        self
    }

    pub fn get(&self, kind: JobKind) -> Option<Arc<dyn Handler>> {
        self.handlers.get(&kind).cloned()
    }

    /// Kinds with a handler, in order.
    pub fn kinds(&self) -> Vec<JobKind> {
        self.handlers.keys().copied().collect()
    }
}

/// The diagnostic sleep job ([`jobs::sleep`]).
#[derive(Debug, Clone, Copy)]
pub struct SleepHandler;

#[async_trait]
impl Handler for SleepHandler {
    async fn run(&self, ctx: &JobContext, job: &JobEnvelope) -> Result<JobOutput, JobFailure> {
        match jobs::sleep::run(ctx.store.as_ref(), job).await {
            Ok(outputs) => Ok(JobOutput { outputs, result: serde_json::json!({"diagnostic": "sleep"}), committed: false }),
            Err(e) => Err(JobFailure::of(e)),
        }
    }
}
