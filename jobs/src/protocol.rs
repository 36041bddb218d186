//! The job protocol, written once: a job whose done-marker exists is done (its answer is
//! read back from what it committed, and nothing runs again); otherwise its work runs and
//! writes its outputs, and the done-marker naming them is committed last
//! (`infra::store::commit`, put-if-absent). A job killed anywhere before the marker leaves
//! only outputs no marker lists, which the next delivery overwrites with identical ones.
//!
//! The jobs that commit themselves, because they also run outside a worker (rollouts,
//! re-anchoring, edits), wrap their work in [`once`]. The worker's runtime keeps the same
//! order around the handlers whose outputs it commits for them.

use infra::store::{ObjectStore, StoreError};
use schemas::{decode_document, keys, DoneMarker, JobKind, OutputEntry};

/// The job a protocol step is for.
#[derive(Clone, Copy)]
pub struct JobRef<'a> {
    pub store: &'a dyn ObjectStore,
    pub run_id: &'a str,
    pub job_id: &'a str,
    pub kind: JobKind,
    /// The delivery attempt, recorded in the marker.
    pub attempt: u32,
}

impl JobRef<'_> {
    /// `runs/<run>/jobs/<job>.done.json`.
    pub fn marker_key(&self) -> String {
        keys::done_marker(self.run_id, self.job_id)
    }
}

/// What a job's work leaves behind: its value, the outputs it wrote (listed in the marker),
/// and the marker's `result`.
pub struct Work<T> {
    pub value: T,
    pub outputs: Vec<OutputEntry>,
    pub result: serde_json::Value,
}

/// A done-marker that exists but does not decode: the job cannot tell what it committed.
#[derive(Debug, thiserror::Error)]
#[error("{key}: existing done-marker cannot be read: {detail}")]
pub struct UnreadableMarker {
    pub key: String,
    pub detail: String,
}

/// Runs the protocol around a job's pure work: `done` answers from an existing marker,
/// else `work` runs and the marker is committed after it. Returns the value and whether the
/// job was already done.
pub async fn once<T, E>(
    job: JobRef<'_>,
    done: impl AsyncFnOnce(DoneMarker) -> Result<T, E>,
    work: impl AsyncFnOnce() -> Result<Work<T>, E>,
) -> Result<(T, bool), E>
where
    E: From<StoreError> + From<UnreadableMarker>,
{
    let key = job.marker_key();
    if let Some(marker) = committed::<E>(job.store, &key).await? {
        tracing::info!(job = job.job_id, kind = %job.kind, "already done (marker present); nothing runs");
        return Ok((done(marker).await?, true));
    }
    let w = work().await?;
    let marker = DoneMarker::new(job.job_id, job.run_id, job.kind, job.attempt, w.outputs, w.result);
    // Written last: its presence means every output above is complete.
    infra::store::commit(job.store, &key, &marker).await?;
    Ok((w.value, false))
}

/// The done-marker at `key`, if one was committed.
pub async fn committed<E>(store: &dyn ObjectStore, key: &str) -> Result<Option<DoneMarker>, E>
where
    E: From<StoreError> + From<UnreadableMarker>,
{
    if store.head(key).await?.is_none() {
        return Ok(None);
    }
    let bytes = store.get(key).await?;
    let marker =
        decode_document(&store.object_url(key), &bytes).map_err(|e| UnreadableMarker { key: key.to_string(), detail: e.to_string() })?;
    Ok(Some(marker))
}
