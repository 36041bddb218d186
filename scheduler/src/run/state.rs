//! `runs/<run>/state.json`: where a run is, written after every stage. Resume continues
//! from it; a finished run refuses to resume.

use std::collections::BTreeMap;

use bytes::Bytes;
use infra::store::ObjectStore;
use schemas::{keys, Document};
use serde::{Deserialize, Serialize};

/// Lifecycle of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunStatus {
    Submitted,
    Running,
    /// Finished with no failure budget used.
    Completed,
    /// Finished, but some rollouts failed within their budgets.
    Degraded,
    Failed,
    Cancelled,
}

impl RunStatus {
    pub fn is_finished(self) -> bool {
        matches!(self, RunStatus::Completed | RunStatus::Degraded)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Submitted => "submitted",
            Self::Running => "running",
            Self::Completed => "completed",
            Self::Degraded => "degraded",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
        }
    }
}

/// The persisted state of a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunState {
    pub schema_version: u32,
    pub run_id: String,
    pub status: RunStatus,
    /// The stage running now (or last run).
    pub stage: String,
    /// Training updates completed.
    pub step: u32,
    /// Stages finished, in order; resume skips them.
    pub completed: Vec<String>,
    /// Train tasks consumed so far.
    pub data_cursor: u64,
    /// Calibration whose evidence routing uses now.
    pub calibration_id: Option<String>,
    /// Step of the latest checkpoint (None: the starting model).
    pub latest_checkpoint: Option<u32>,
    /// Content hash of the pool in use.
    pub pool_version: String,
    /// Rollouts that failed, by error class.
    pub failures: BTreeMap<String, u64>,
    pub rollouts_base: u64,
    pub rollouts_rescue: u64,
    pub rollouts_other: u64,
    pub tokens: u64,
    /// Why the run failed or was cancelled.
    pub message: Option<String>,
    /// The checkpoint step with the best H0 validation success at a calibration, and that
    /// success (`[checkpoints] keep_best` keeps it).
    #[serde(default)]
    pub best_checkpoint: Option<(u32, f64)>,
    pub started_at_ms: i64,
    pub updated_at_ms: i64,
}

impl Document for RunState {
    const NAME: &'static str = "run state";
    const VERSION: u32 = 1;
}

impl RunState {
    pub fn new(run_id: &str, pool_version: String) -> Self {
        let now = schemas::now_unix_ms();
        RunState {
            schema_version: Self::VERSION,
            run_id: run_id.to_string(),
            status: RunStatus::Submitted,
            stage: "submitted".into(),
            step: 0,
            completed: vec![],
            data_cursor: 0,
            calibration_id: None,
            latest_checkpoint: None,
            pool_version,
            failures: BTreeMap::new(),
            rollouts_base: 0,
            rollouts_rescue: 0,
            rollouts_other: 0,
            tokens: 0,
            message: None,
            best_checkpoint: None,
            started_at_ms: now,
            updated_at_ms: now,
        }
    }

    pub fn is_done(&self, stage: &str) -> bool {
        self.completed.iter().any(|s| s == stage)
    }
}

/// Reads a run's state; `None` if the run has none.
pub async fn load(store: &dyn ObjectStore, run_id: &str) -> anyhow::Result<Option<RunState>> {
    let key = keys::state(run_id);
    match store.get(&key).await {
        Ok(bytes) => Ok(Some(schemas::decode_document(&store.object_url(&key), &bytes)?)),
        Err(infra::store::StoreError::NotFound { .. }) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// Writes a run's state (atomically replacing the previous one).
pub async fn save(store: &dyn ObjectStore, state: &mut RunState) -> anyhow::Result<()> {
    state.updated_at_ms = schemas::now_unix_ms();
    store.put(&keys::state(&state.run_id), Bytes::from(schemas::encode_document(state))).await?;
    Ok(())
}

/// `runs/<run>/cancel`: asks the scheduler to stop at the next check.
pub fn cancel_key(run_id: &str) -> String {
    schemas::keys::cancel(run_id)
}
