//! Hands a stage's jobs to the queue and waits for their done-markers: the scheduler's
//! only way of learning that work finished. Jobs whose markers exist are not published
//! again (resume never redoes work); a job that lands in the dead-letter queue fails the
//! stage with its reason; a cancel request stops the wait.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use infra::queue::Queue;
use infra::store::ObjectStore;
use schemas::{keys, DoneMarker, JobEnvelope, JobKind};

/// Why a stage's jobs did not all finish.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    #[error("job {job_id} ({kind}) was dead-lettered: {reason}")]
    DeadLettered { job_id: String, kind: JobKind, reason: String },
    #[error("the run was cancelled")]
    Cancelled,
    #[error(transparent)]
    Other(#[from] anyhow::Error),
}

/// Times a stage re-runs jobs whose outputs came back damaged before it gives up.
pub const REPAIRS: usize = 3;

/// Publishes jobs and collects their done-markers.
pub struct Executor {
    pub store: Arc<dyn ObjectStore>,
    pub queue: Arc<dyn Queue>,
    pub poll: Duration,
    /// Show progress bars (embedded runs on a terminal); otherwise periodic log lines.
    pub bars: bool,
}

impl Executor {
    /// Runs `jobs` to completion and returns their markers in the same order. A marker that
    /// does not parse, or whose outputs do not match it, is deleted with a WARN naming the
    /// file, and its job runs again (at most [`REPAIRS`] times per stage).
    pub async fn run(&self, run_id: &str, label: &str, jobs: Vec<JobEnvelope>) -> Result<Vec<DoneMarker>, StageError> {
        let prefix = keys::jobs_prefix(run_id);
        let mut done = self.markers(&prefix).await?;
        // Markers left by an earlier drive are checked before they are trusted, once.
        let mut checked: std::collections::BTreeMap<String, DoneMarker> = Default::default();
        let mut to_publish: Vec<JobEnvelope> = vec![];
        for j in &jobs {
            match done.contains(&j.job_id) {
                true => match self.repair(run_id, j).await? {
                    Some(m) => {
                        checked.insert(j.job_id.clone(), m);
                    }
                    None => {
                        done.remove(&j.job_id);
                        to_publish.push(j.clone());
                    }
                },
                false => to_publish.push(j.clone()),
            }
        }
        let skipped = jobs.len() - to_publish.len();
        if !to_publish.is_empty() {
            self.queue.publish_many(&to_publish).await.map_err(|e| anyhow::anyhow!("publishing {label} jobs: {e}"))?;
        }
        tracing::info!(stage = label, jobs = jobs.len(), already_done = skipped, "stage started");
        let bar = if self.bars {
            let b = ProgressBar::new(jobs.len() as u64);
            b.set_style(
                ProgressStyle::with_template("{prefix:>24} [{bar:30}] {pos}/{len} jobs {elapsed_precise} (about {eta} left)")
                    .expect("valid template")
                    .progress_chars("=> "),
            );
            b.set_prefix(label.to_string());
            b
        } else {
            ProgressBar::hidden()
        };
        let wanted: BTreeSet<String> = jobs.iter().map(|j| j.job_id.clone()).collect();
        let kinds: BTreeSet<JobKind> = jobs.iter().map(|j| j.kind).collect();
        let mut last_log = Instant::now();
        let stage_started = Instant::now();
        let mut repairs = 0;
        loop {
            let finished = wanted.iter().filter(|id| done.contains(*id)).count();
            bar.set_position(finished as u64);
            if finished == wanted.len() {
                // Every marker is there: check the ones not checked yet; damaged ones run again.
                let mut again = vec![];
                for j in &jobs {
                    if !checked.contains_key(&j.job_id) {
                        match self.repair(run_id, j).await? {
                            Some(m) => {
                                checked.insert(j.job_id.clone(), m);
                            }
                            None => again.push(j.clone()),
                        }
                    }
                }
                if again.is_empty() {
                    bar.finish_and_clear();
                    tracing::info!(stage = label, jobs = jobs.len(), "stage finished");
                    return Ok(jobs.iter().filter_map(|j| checked.get(&j.job_id).cloned()).collect());
                }
                repairs += 1;
                if repairs > REPAIRS {
                    bar.abandon();
                    return Err(anyhow::anyhow!(
                        "{label}: {} job(s) wrote damaged outputs {REPAIRS} times in a row; see the WARN lines above",
                        again.len()
                    )
                    .into());
                }
                for j in &again {
                    done.remove(&j.job_id);
                }
                self.queue.publish_many(&again).await.map_err(|e| anyhow::anyhow!("republishing {label} jobs: {e}"))?;
                continue;
            }
            if self.store.head(&super::state::cancel_key(run_id)).await.map_err(anyhow::Error::from)?.is_some() {
                bar.abandon();
                return Err(StageError::Cancelled);
            }
            for kind in &kinds {
                let dead = self.queue.dead_letters(*kind, 10_000).await.map_err(|e| anyhow::anyhow!("reading dead letters: {e}"))?;
                if let Some(d) = dead.iter().find(|d| d.job_id.as_ref().is_some_and(|id| wanted.contains(id) && !done.contains(id))) {
                    bar.abandon();
                    return Err(StageError::DeadLettered {
                        job_id: d.job_id.clone().unwrap_or_default(),
                        kind: *kind,
                        reason: d.reason.clone(),
                    });
                }
            }
            if last_log.elapsed() > Duration::from_secs(15) {
                // the time left at the pace of the jobs this drive finished (the workers log
                // each episode with its own progress)
                let elapsed = stage_started.elapsed().as_secs();
                let ran = finished.saturating_sub(skipped);
                let left = (ran > 0).then(|| elapsed * (wanted.len() - finished) as u64 / ran as u64);
                tracing::info!(
                    stage = label,
                    finished,
                    total = wanted.len(),
                    elapsed_s = elapsed,
                    left_s = left.map_or_else(|| "unknown until a job finishes".to_string(), |s| s.to_string()),
                    "waiting for jobs"
                );
                last_log = Instant::now();
            }
            tokio::time::sleep(self.poll).await;
            done = self.markers(&prefix).await?;
        }
    }

    /// Job `j`'s checked marker; `None` (after a WARN naming the damaged file and deleting
    /// the marker) when the marker or an output is damaged, so that the job runs again.
    async fn repair(&self, run_id: &str, j: &JobEnvelope) -> anyhow::Result<Option<DoneMarker>> {
        let key = keys::done_marker(run_id, &j.job_id);
        match super::verify::check_marker(self.store.as_ref(), &key).await? {
            Ok(m) => Ok(Some(m)),
            Err(damage) => {
                tracing::warn!(job = %j.job_id, kind = %j.kind, file = %damage.file, problem = %damage.problem, "damaged job output; the job runs again");
                self.store.delete(&key).await?;
                Ok(None)
            }
        }
    }

    /// Job ids with a done-marker.
    async fn markers(&self, prefix: &str) -> anyhow::Result<BTreeSet<String>> {
        Ok(self.store.list(prefix).await?.into_iter().filter_map(|o| schemas::keys::job_of_marker(&o.key).map(str::to_string)).collect())
    }
}

/// Output keys listed by markers, in marker order.
pub fn output_keys(markers: &[DoneMarker]) -> Vec<String> {
    markers.iter().flat_map(|m| m.outputs.iter().map(|o| o.key.clone())).collect()
}
