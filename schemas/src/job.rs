use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::{Document, FileEntry};

/// The kinds of job, one queue each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobKind {
    Evolve,
    Rollout,
    Rescue,
    Reanchor,
    Learn,
    Eval,
    /// A harness editor writes G patches for a trace packet, and each valid one is rerun
    /// (Harness-R1).
    Edit,
    /// The transfer probe: the policy's log-probability, under H0's context, of held-out
    /// successful sibling trajectories (at every calibration).
    Transfer,
    /// Diagnostic: sleeps and writes a small output. Used by tests and `bench queue`.
    Sleep,
}

impl JobKind {
    pub const ALL: [JobKind; 9] =
        [Self::Evolve, Self::Rollout, Self::Rescue, Self::Reanchor, Self::Learn, Self::Eval, Self::Edit, Self::Transfer, Self::Sleep];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Evolve => "evolve",
            Self::Rollout => "rollout",
            Self::Rescue => "rescue",
            Self::Reanchor => "reanchor",
            Self::Learn => "learn",
            Self::Eval => "eval",
            Self::Edit => "edit",
            Self::Transfer => "transfer",
            Self::Sleep => "sleep",
        }
    }

    /// Parses a kind name as used on the command line (`--queues rollout,rescue`).
    pub fn parse(s: &str) -> Option<JobKind> {
        Self::ALL.into_iter().find(|k| k.as_str() == s)
    }
}

impl std::fmt::Display for JobKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The parts a job id is derived from (durability contract: deterministic ids).
#[derive(Debug, Clone, Default)]
pub struct JobIdParts<'a> {
    pub run_id: &'a str,
    pub stage: &'a str,
    pub step: u32,
    pub task_id: &'a str,
    pub harness_id: &'a str,
    pub attempt_index: u32,
    pub seed: u64,
}

/// Deterministic job id: the first 128 bits of SHA-256 over the parts, as hex. The same
/// unit of work always gets the same id, so its outputs and done-marker keys are stable.
pub fn job_id(parts: &JobIdParts<'_>) -> String {
    let mut h = Sha256::new();
    for field in [
        parts.run_id,
        parts.stage,
        &parts.step.to_string(),
        parts.task_id,
        parts.harness_id,
        &parts.attempt_index.to_string(),
        &parts.seed.to_string(),
    ] {
        h.update(field.as_bytes());
        h.update([0x1f]);
    }
    hex::encode(&h.finalize()[..16])
}

/// A message on the queue: tracking data plus an opaque, kind-specific payload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobEnvelope {
    pub schema_version: u32,
    pub job_id: String,
    pub run_id: String,
    pub kind: JobKind,
    /// Deliveries so far that ended in a retryable failure.
    pub attempt: u32,
    /// Kind-specific input; each job module defines and validates its own shape.
    pub payload: serde_json::Value,
    pub created_at_ms: i64,
    /// Do not start before this time (retry backoff).
    pub not_before_ms: Option<i64>,
    /// Give up (and dead-letter) a run of the job that has not finished by then.
    pub deadline_ms: Option<i64>,
}

impl Document for JobEnvelope {
    const NAME: &'static str = "job envelope";
    const VERSION: u32 = 1;
}

/// An output object written by a job, listed in its done-marker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutputEntry {
    pub key: String,
    pub size: u64,
    pub sha256: String,
}

impl OutputEntry {
    /// The entry of an object holding `bytes` at `key`: its size and SHA-256.
    pub fn of(key: impl Into<String>, bytes: &[u8]) -> Self {
        use sha2::Digest;
        OutputEntry { key: key.into(), size: bytes.len() as u64, sha256: hex::encode(sha2::Sha256::digest(bytes)) }
    }
}

impl From<OutputEntry> for FileEntry {
    fn from(o: OutputEntry) -> Self {
        FileEntry { name: o.key, size: o.size, sha256: o.sha256 }
    }
}

/// `runs/<run>/jobs/<job_id>.done.json`, written after every output and before the ack.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DoneMarker {
    pub schema_version: u32,
    pub job_id: String,
    pub run_id: String,
    pub kind: JobKind,
    pub attempt: u32,
    pub outputs: Vec<OutputEntry>,
    /// Small kind-specific result summary (counts, metrics) for the scheduler.
    pub result: serde_json::Value,
    pub finished_at_ms: i64,
}

impl DoneMarker {
    /// The marker of delivery `attempt` of job `job_id`, finished now.
    pub fn new(job_id: &str, run_id: &str, kind: JobKind, attempt: u32, outputs: Vec<OutputEntry>, result: serde_json::Value) -> Self {
        DoneMarker {
            schema_version: Self::VERSION,
            job_id: job_id.to_string(),
            run_id: run_id.to_string(),
            kind,
            attempt,
            outputs,
            result,
            finished_at_ms: crate::now_unix_ms(),
        }
    }
}

impl Document for DoneMarker {
    const NAME: &'static str = "done marker";
    const VERSION: u32 = 1;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_id_is_deterministic_and_sensitive_to_every_part() {
        let base = JobIdParts { run_id: "r", stage: "base", step: 1, task_id: "t", harness_id: "h0", attempt_index: 0, seed: 7 };
        let id = job_id(&base);
        assert_eq!(id, job_id(&base.clone()));
        assert_eq!(id.len(), 32);
        let variants = [
            JobIdParts { run_id: "r2", ..base.clone() },
            JobIdParts { stage: "rescue", ..base.clone() },
            JobIdParts { step: 2, ..base.clone() },
            JobIdParts { task_id: "t2", ..base.clone() },
            JobIdParts { harness_id: "h1", ..base.clone() },
            JobIdParts { attempt_index: 1, ..base.clone() },
            JobIdParts { seed: 8, ..base.clone() },
        ];
        for v in variants {
            assert_ne!(job_id(&v), id);
        }
        // Field boundaries matter: ("ab","c") differs from ("a","bc").
        let a = JobIdParts { run_id: "ab", stage: "c", ..base.clone() };
        let b = JobIdParts { run_id: "a", stage: "bc", ..base };
        assert_ne!(job_id(&a), job_id(&b));
    }

    #[test]
    fn kinds_round_trip_through_their_names() {
        for k in JobKind::ALL {
            assert_eq!(JobKind::parse(k.as_str()), Some(k));
        }
        assert_eq!(JobKind::parse("nope"), None);
    }
}
