//! Diagnostic job: sleeps for the requested time and writes a small output object.
//! It exercises the queue and the durability contract without any model or environment;
//! tests and `harness-s bench queue` use it. It can be told to fail, retryably for its
//! first attempts or fatally, to exercise retries and dead-lettering.
//!
//! The output (`runs/<run>/diagnostics/sleep/<job_id>.json`) depends only on the job, not
//! on the worker or the time, so that a redelivered half-done job rewrites the same bytes
//! and the done-marker's checksum stays true whichever run of the job wrote it last.

use std::time::Duration;

use bytes::Bytes;
use infra::store::{ObjectStore, StoreError};
use schemas::{Document, JobEnvelope, JobIdParts, JobKind, OutputEntry};
use serde::{Deserialize, Serialize};

/// Input of a diagnostic sleep job (the envelope's payload).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SleepInput {
    /// How long to sleep, in milliseconds.
    pub millis: u64,
    /// Fail with a fatal error instead of finishing (dead-letter tests).
    #[serde(default)]
    pub fail: bool,
    /// Fail with a retryable error while the job's `attempt` is below this number
    /// (`u32::MAX`: always), after sleeping (retry tests).
    #[serde(default)]
    pub fail_attempts: u32,
}

/// What the job writes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SleepOutput {
    pub job_id: String,
    pub run_id: String,
    pub slept_ms: u64,
}

/// Failures of the sleep job; [`SleepError::is_retryable`] decides retry or dead-letter.
#[derive(Debug, thiserror::Error)]
pub enum SleepError {
    #[error("invalid sleep job payload: {0}; expected {{\"millis\": N, \"fail\": false, \"fail_attempts\": 0}}")]
    Input(String),
    #[error("diagnostic failure requested by the payload (`fail: true`)")]
    FatalRequested,
    #[error("diagnostic retryable failure requested by the payload (attempt {attempt}, `fail_attempts: {fail_attempts}`)")]
    RetryableRequested { attempt: u32, fail_attempts: u32 },
    #[error("writing the sleep output: {0}")]
    Store(#[from] StoreError),
}

impl infra::Transient for SleepError {
    /// Whether running the job again may succeed.
    fn is_transient(&self) -> bool {
        match self {
            SleepError::Input(_) | SleepError::FatalRequested => false,
            SleepError::RetryableRequested { .. } => true,
            SleepError::Store(e) => e.is_transient(),
        }
    }
}

/// `runs/<run>/diagnostics/sleep/<job_id>.json`
pub fn output_key(run_id: &str, job_id: &str) -> String {
    schemas::keys::sleep_diagnostic(run_id, job_id)
}

/// The envelope of the `index`-th sleep job of a run. Its id is deterministic
/// ([`schemas::job_id`] over run, stage `diag-sleep` and the index), so enqueuing the same
/// job twice yields one job.
pub fn envelope(run_id: &str, index: u64, input: &SleepInput) -> JobEnvelope {
    let task = index.to_string();
    let job_id = schemas::job_id(&JobIdParts { run_id, stage: "diag-sleep", task_id: &task, ..Default::default() });
    JobEnvelope {
        schema_version: <JobEnvelope as Document>::VERSION,
        job_id,
        run_id: run_id.to_string(),
        kind: JobKind::Sleep,
        attempt: 0,
        payload: serde_json::to_value(input).expect("plain struct serialises"),
        created_at_ms: schemas::now_unix_ms(),
        not_before_ms: None,
        deadline_ms: None,
    }
}

/// Parses and checks the payload of a sleep job.
pub fn parse_input(job: &JobEnvelope) -> Result<SleepInput, SleepError> {
    serde_json::from_value(job.payload.clone()).map_err(|e| SleepError::Input(e.to_string()))
}

/// Runs one sleep job: sleeps, then writes its output and returns the entries for the
/// done-marker. The caller commits the marker and acks.
pub async fn run(store: &dyn ObjectStore, job: &JobEnvelope) -> Result<Vec<OutputEntry>, SleepError> {
    let input = parse_input(job)?;
    if input.fail {
        return Err(SleepError::FatalRequested);
    }
    tokio::time::sleep(Duration::from_millis(input.millis)).await;
    if job.attempt < input.fail_attempts {
        return Err(SleepError::RetryableRequested { attempt: job.attempt, fail_attempts: input.fail_attempts });
    }
    let out = SleepOutput { job_id: job.job_id.clone(), run_id: job.run_id.clone(), slept_ms: input.millis };
    let bytes = serde_json::to_vec(&out).expect("plain struct serialises");
    let key = output_key(&job.run_id, &job.job_id);
    let entry = OutputEntry::of(key.clone(), &bytes);
    store.put(&key, Bytes::from(bytes)).await?;
    Ok(vec![entry])
}

#[cfg(test)]
mod tests {
    use super::*;
    use infra::store::LocalStore;
    use infra::Transient;

    fn job(payload: serde_json::Value, attempt: u32) -> JobEnvelope {
        JobEnvelope {
            schema_version: 1,
            job_id: "j1".into(),
            run_id: "r1".into(),
            kind: JobKind::Sleep,
            attempt,
            payload,
            created_at_ms: 0,
            not_before_ms: None,
            deadline_ms: None,
        }
    }

    #[tokio::test]
    async fn writes_a_deterministic_output_and_lists_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalStore::new(dir.path()).unwrap();
        let j = job(serde_json::json!({"millis": 1}), 0);
        let first = run(&store, &j).await.unwrap();
        let again = run(&store, &j).await.unwrap();
        assert_eq!(first, again, "a rerun must write the same bytes");
        assert_eq!(first[0].key, "runs/r1/diagnostics/sleep/j1.json");
        let bytes = store.get(&first[0].key).await.unwrap();
        assert_eq!(bytes.len() as u64, first[0].size);
        assert_eq!(schemas::OutputEntry::of(first[0].key.clone(), &bytes), first[0]);
    }

    #[test]
    fn envelopes_have_stable_distinct_ids() {
        let input = SleepInput { millis: 0, fail: false, fail_attempts: 0 };
        let a = envelope("r", 1, &input);
        assert_eq!(a.job_id, envelope("r", 1, &input).job_id);
        assert_ne!(a.job_id, envelope("r", 2, &input).job_id);
        assert_ne!(a.job_id, envelope("r2", 1, &input).job_id);
        assert_eq!(parse_input(&a).unwrap(), input);
    }

    #[tokio::test]
    async fn failures_are_typed() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalStore::new(dir.path()).unwrap();
        let e = run(&store, &job(serde_json::json!({"millis": 0, "fail": true}), 0)).await.unwrap_err();
        assert!(!e.is_transient());
        let e = run(&store, &job(serde_json::json!({"millis": 0, "fail_attempts": 2}), 1)).await.unwrap_err();
        assert!(e.is_transient(), "{e}");
        assert!(run(&store, &job(serde_json::json!({"millis": 0, "fail_attempts": 2}), 2)).await.is_ok());
        let e = run(&store, &job(serde_json::json!({"milis": 5}), 0)).await.unwrap_err();
        assert!(!e.is_transient() && e.to_string().contains("milis"), "{e}");
    }
}
