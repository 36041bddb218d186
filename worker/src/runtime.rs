//! The consumer loop and the durability contract.
//!
//! For each delivery, in this order:
//! 1. decode the envelope; a malformed body is dead-lettered (the worker carries on);
//! 2. if `runs/<run>/jobs/<job_id>.done.json` exists, ack and skip (a redelivery of
//!    finished work is a no-op);
//! 3. refuse a job whose deadline has passed (dead-letter), wait out `not_before_ms`;
//! 4. run the handler (in its own task, so a panic becomes a fatal failure, and bounded by
//!    the job's deadline);
//! 5. on success write the done-marker with `put_if_absent` — LAST, after every output —
//!    then ack; on a [`JobFailure::Retryable`] retry with backoff (dead-letter when the
//!    attempts are used up); on a [`JobFailure::Fatal`] dead-letter with the reason.
//!
//! Shutdown: the future given to [`Worker::run`] resolving (SIGTERM/SIGINT in the CLI)
//! stops consumption at once; in-flight jobs get the grace period to finish and commit;
//! whatever is still running after it is abandoned unsettled, so the queue delivers it
//! again elsewhere. Nothing is lost either way.

use infra::Transient;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use infra::queue::{Delivery, Queue, QueueError, RetryOutcome};
use infra::store::ObjectStore;
use schemas::{keys, DoneMarker, JobEnvelope, JobKind};
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinSet;
use tracing::Instrument;

use crate::handler::{Handler, JobContext, JobFailure, JobOutput, Registry};
use crate::metrics::Metrics;

/// Settings of one worker.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// Kinds to consume; each needs a handler in the registry.
    pub kinds: Vec<JobKind>,
    /// Jobs run at the same time (also the queue prefetch).
    pub concurrency: usize,
    /// How long in-flight jobs may take to finish after shutdown was requested.
    pub grace: Duration,
    /// Names this worker in logs.
    pub worker_id: String,
}

impl WorkerConfig {
    pub fn new(kinds: Vec<JobKind>, concurrency: usize) -> Self {
        WorkerConfig { kinds, concurrency, grace: Duration::from_secs(30), worker_id: default_worker_id() }
    }
}

/// `<host>-<pid>-<4 random hex digits>`: the host name tells machines and pods apart, and
/// the random part containers on one host network, which share the host's name and each
/// have a PID namespace of their own (every worker there is PID 7 or so).
fn default_worker_id() -> String {
    use std::hash::BuildHasher;
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string()).unwrap_or_default();
    let host = if host.is_empty() { "worker".to_string() } else { host };
    // RandomState is seeded from the OS's randomness, per process.
    let salt = std::collections::hash_map::RandomState::new().hash_one(std::process::id()) as u16;
    format!("{host}-{}-{salt:04x}", std::process::id())
}

/// How one delivery ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Handler ran, marker written, acked.
    Succeeded,
    /// Marker already there; acked without running.
    Skipped,
    /// Retryable failure; scheduled again.
    Retried { attempt: u32 },
    /// Fatal failure, exhausted attempts or malformed message.
    DeadLettered { reason: String },
    /// The outcome could not be settled with the queue (connection lost) or the worker
    /// stopped before it finished: the queue delivers it again.
    Unsettled { reason: String },
}

/// One settled delivery, for callers that watch progress (benchmarks, tests).
#[derive(Debug, Clone)]
pub struct JobEvent {
    pub kind: JobKind,
    /// `None` for a malformed message.
    pub job_id: Option<String>,
    pub outcome: Outcome,
    /// When the outcome was settled with the queue.
    pub at: Instant,
}

/// Counts over a worker's life, printed when it stops.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkerSummary {
    pub succeeded: u64,
    pub skipped: u64,
    pub retried: u64,
    pub dead_lettered: u64,
    pub unsettled: u64,
}

impl WorkerSummary {
    fn add(&mut self, o: &Outcome) {
        match o {
            Outcome::Succeeded => self.succeeded += 1,
            Outcome::Skipped => self.skipped += 1,
            Outcome::Retried { .. } => self.retried += 1,
            Outcome::DeadLettered { .. } => self.dead_lettered += 1,
            Outcome::Unsettled { .. } => self.unsettled += 1,
        }
    }
}

impl std::fmt::Display for WorkerSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} succeeded, {} skipped (already done), {} retried, {} dead-lettered, {} left to the queue",
            self.succeeded, self.skipped, self.retried, self.dead_lettered, self.unsettled
        )
    }
}

/// Errors that stop a worker.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("no handler for job kind `{kind}` in this build; kinds this worker can run: {known}")]
    NoHandler { kind: JobKind, known: String },
    #[error("invalid worker setting `{setting}`: {reason}")]
    InvalidConfig { setting: &'static str, reason: String },
    #[error(transparent)]
    Queue(#[from] QueueError),
}

/// A worker: consumes the configured kinds and runs them with the registered handlers.
#[derive(Clone)]
pub struct Worker {
    queue: Arc<dyn Queue>,
    store: Arc<dyn ObjectStore>,
    registry: Arc<Registry>,
    config: Arc<WorkerConfig>,
    metrics: Metrics,
    events: Option<mpsc::UnboundedSender<JobEvent>>,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker").field("queue", &self.queue.url()).field("config", &self.config).finish()
    }
}

impl Worker {
    /// Checks the settings against the registry.
    pub fn new(queue: Arc<dyn Queue>, store: Arc<dyn ObjectStore>, registry: Registry, config: WorkerConfig) -> Result<Self, WorkerError> {
        if config.kinds.is_empty() {
            return Err(WorkerError::InvalidConfig { setting: "queues", reason: "no job kind given".into() });
        }
        if config.concurrency == 0 || config.concurrency > usize::from(u16::MAX) {
            return Err(WorkerError::InvalidConfig {
                setting: "concurrency",
                reason: format!("{} is out of range; use 1 to 65535", config.concurrency),
            });
        }
        for kind in &config.kinds {
            if registry.get(*kind).is_none() {
                let known = registry.kinds().iter().map(|k| k.as_str()).collect::<Vec<_>>().join(", ");
                return Err(WorkerError::NoHandler { kind: *kind, known });
            }
        }
        Ok(Worker { queue, store, registry: Arc::new(registry), config: Arc::new(config), metrics: Metrics::new(), events: None })
    }

    /// Uses these metrics (e.g. ones already served over HTTP).
    pub fn with_metrics(mut self, metrics: Metrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// Sends a [`JobEvent`] for every settled delivery.
    pub fn with_events(mut self, events: mpsc::UnboundedSender<JobEvent>) -> Self {
        self.events = Some(events);
        self
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Consumes until `shutdown` resolves (then drains as described in the module docs)
    /// or the queue fails for good.
    pub async fn run(&self, shutdown: impl Future<Output = ()> + Send) -> Result<WorkerSummary, WorkerError> {
        let cfg = &self.config;
        let mut consumer = self.queue.consume(&cfg.kinds, cfg.concurrency as u16).await?;
        tracing::info!(
            worker = %cfg.worker_id,
            queue = %self.queue.url(),
            store = %self.store.url(),
            kinds = ?cfg.kinds.iter().map(|k| k.as_str()).collect::<Vec<_>>(),
            concurrency = cfg.concurrency,
            "worker started"
        );
        let slots = Arc::new(Semaphore::new(cfg.concurrency));
        let mut tasks: JoinSet<Outcome> = JoinSet::new();
        let mut summary = WorkerSummary::default();
        let mut failure: Option<QueueError> = None;
        tokio::pin!(shutdown);
        loop {
            while let Some(done) = tasks.try_join_next() {
                summary.add(&joined(done));
            }
            let permit = tokio::select! {
                _ = &mut shutdown => break,
                p = slots.clone().acquire_owned() => p.expect("the semaphore is never closed"),
            };
            let next = tokio::select! {
                _ = &mut shutdown => break,
                // `next` is cancel-safe: a delivery is either returned or left queued.
                d = consumer.next() => d,
            };
            match next {
                Ok(Some(delivery)) => {
                    let this = self.clone();
                    tasks.spawn(async move {
                        let outcome = this.process(delivery).await;
                        drop(permit);
                        outcome
                    });
                }
                Ok(None) => break,
                Err(e) => {
                    tracing::error!(error = %e, "the queue failed; stopping");
                    failure = Some(e);
                    break;
                }
            }
        }
        // Stop taking work; whatever the consumer had buffered goes back to the queue.
        if let Err(e) = consumer.cancel().await {
            tracing::warn!(error = %e, "cancelling the consumer failed; the queue reclaims its deliveries when the connection closes");
        }
        while let Some(done) = tasks.try_join_next() {
            summary.add(&joined(done));
        }
        if !tasks.is_empty() {
            tracing::info!(in_flight = tasks.len(), grace_secs = cfg.grace.as_secs_f64(), "stopping: letting in-flight jobs finish");
        }
        let grace = tokio::time::sleep(cfg.grace);
        tokio::pin!(grace);
        loop {
            tokio::select! {
                done = tasks.join_next() => match done {
                    Some(done) => summary.add(&joined(done)),
                    None => break,
                },
                _ = &mut grace => {
                    tracing::warn!(abandoned = tasks.len(), "grace period over; unfinished jobs go back to the queue");
                    tasks.abort_all();
                    while let Some(done) = tasks.join_next().await {
                        summary.add(&joined(done));
                    }
                    break;
                }
            }
        }
        if let Err(e) = consumer.close().await {
            tracing::warn!(error = %e, "closing the consumer failed");
        }
        tracing::info!(worker = %cfg.worker_id, %summary, "worker stopped");
        match failure {
            Some(e) => Err(e.into()),
            None => Ok(summary),
        }
    }

    /// One delivery, start to settle. Never panics and never returns early without
    /// settling or deliberately leaving the delivery to the queue.
    async fn process(&self, delivery: Delivery) -> Outcome {
        let kind = delivery.kind();
        let job = match delivery.envelope() {
            Ok(job) => job,
            Err(bad) => {
                tracing::error!(kind = %kind, error = %bad, "malformed message; moving it to the dead-letter queue");
                let reason = bad.to_string();
                let outcome = self.dead_letter(delivery, kind, &reason).await;
                self.emit(kind, None, &outcome);
                return outcome;
            }
        };
        let span = tracing::info_span!("job", job_id = %job.job_id, run = %job.run_id, kind = %kind, attempt = job.attempt);
        let outcome = self.run_job(delivery, &job).instrument(span).await;
        self.emit(kind, Some(job.job_id.clone()), &outcome);
        outcome
    }

    /// One delivery, in the order of the durability contract: check the marker → run the
    /// handler within the deadline → commit → settle the message (ack, retry or
    /// dead-letter).
    async fn run_job(&self, delivery: Delivery, job: &JobEnvelope) -> Outcome {
        let marker_key = keys::done_marker(&job.run_id, &job.job_id);
        let next = match self.prepare(job, &marker_key, delivery.redelivered()).await {
            Ok(handler) => {
                let result = self.execute(handler, job, delivery.redelivered()).await;
                self.commit(job, &marker_key, result).await
            }
            Err(next) => next,
        };
        match next {
            Next::Ack(outcome) => self.ack(delivery, outcome).await,
            Next::Retry(reason) => self.retry(delivery, job, &reason).await,
            Next::DeadLetter(reason) => self.dead_letter(delivery, job.kind, &reason).await,
        }
    }

    /// The handler to run, or what to do instead: skip a job whose marker exists, refuse
    /// one past its deadline or without a handler. Waits out `not_before`.
    async fn prepare(&self, job: &JobEnvelope, marker_key: &str, redelivered: bool) -> Result<Arc<dyn Handler>, Next> {
        match self.store.head(marker_key).await {
            Ok(Some(_)) => {
                tracing::info!(redelivered, "already done (marker present); acking without running");
                self.metrics.skipped(job.kind);
                return Err(Next::Ack(Outcome::Skipped));
            }
            Ok(None) => {}
            Err(e) => {
                return Err(Next::of_store_error(format!("cannot check the done-marker {}: {e}", self.store.object_url(marker_key)), &e))
            }
        }
        let now = schemas::now_unix_ms();
        if let Some(deadline) = job.deadline_ms.filter(|d| now >= *d) {
            return Err(Next::DeadLetter(format!("deadline passed {} ms before the job could start", now - deadline)));
        }
        if let Some(not_before) = job.not_before_ms.filter(|t| *t > now) {
            // Retries arrive after their delay already; this covers clock skew and
            // publishers that schedule ahead.
            tokio::time::sleep(Duration::from_millis((not_before - now) as u64)).await;
        }
        self.registry.get(job.kind).ok_or_else(|| Next::DeadLetter(format!("no handler for job kind `{}`", job.kind)))
    }

    /// Runs the handler in its own task (a panic becomes a fatal failure instead of taking
    /// the worker down; the guard aborts it if this task is aborted at shutdown), within
    /// the job's deadline.
    async fn execute(&self, handler: Arc<dyn Handler>, job: &JobEnvelope, redelivered: bool) -> Result<JobOutput, JobFailure> {
        tracing::info!(redelivered, "job started");
        self.metrics.started(job.kind);
        let started = Instant::now();
        let ctx = JobContext { store: self.store.clone(), worker_id: self.config.worker_id.clone() };
        let owned = job.clone();
        let task = AbortOnDrop(tokio::spawn(async move { handler.run(&ctx, &owned).await }));
        let result = match job.deadline_ms {
            Some(deadline) => {
                let left = Duration::from_millis((deadline - schemas::now_unix_ms()).max(0) as u64);
                match tokio::time::timeout(left, task).await {
                    Ok(r) => r,
                    Err(_) => Err(JobFailure::Fatal(format!("deadline exceeded after {:.1} s", started.elapsed().as_secs_f64()))),
                }
            }
            None => task.await,
        };
        let secs = started.elapsed().as_secs_f64();
        self.metrics.finished_running(job.kind, secs);
        tracing::info!(secs, ok = result.is_ok(), "job ran");
        result
    }

    /// Writes the done-marker of a handler's outputs (unless the handler committed itself)
    /// and decides what happens to the message.
    async fn commit(&self, job: &JobEnvelope, marker_key: &str, result: Result<JobOutput, JobFailure>) -> Next {
        match result {
            Ok(output) if output.committed => {
                tracing::info!("job committed by its handler");
            }
            Ok(output) => {
                let marker = DoneMarker::new(&job.job_id, &job.run_id, job.kind, job.attempt, output.outputs, output.result);
                if let Err(e) = infra::store::commit(self.store.as_ref(), marker_key, &marker).await {
                    return Next::of_store_error(format!("cannot write the done-marker {}: {e}", self.store.object_url(marker_key)), &e);
                }
                tracing::info!("job committed");
            }
            Err(JobFailure::Retryable(reason)) => {
                tracing::warn!(%reason, "job failed (retryable)");
                return Next::Retry(reason);
            }
            Err(JobFailure::Fatal(reason)) => {
                tracing::error!(%reason, "job failed (fatal)");
                return Next::DeadLetter(reason);
            }
        }
        self.metrics.succeeded(job.kind);
        Next::Ack(Outcome::Succeeded)
    }

    async fn ack(&self, delivery: Delivery, outcome: Outcome) -> Outcome {
        match delivery.ack().await {
            Ok(()) => outcome,
            Err(e) => {
                // The commit is durable; the redelivery will find the marker and skip.
                tracing::warn!(error = %e, "ack lost; the redelivery will be skipped by its done-marker");
                Outcome::Unsettled { reason: e.to_string() }
            }
        }
    }

    async fn retry(&self, delivery: Delivery, job: &JobEnvelope, reason: &str) -> Outcome {
        match delivery.retry(job, reason).await {
            Ok(RetryOutcome::Retried { attempt, delay }) => {
                tracing::info!(next_attempt = attempt, delay_ms = delay.as_millis() as u64, "scheduled again");
                self.metrics.retried(job.kind);
                Outcome::Retried { attempt }
            }
            Ok(RetryOutcome::DeadLettered { attempts }) => {
                tracing::error!(attempts, %reason, "attempts used up; moved to the dead-letter queue");
                self.metrics.dead_lettered(job.kind);
                Outcome::DeadLettered { reason: reason.to_string() }
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not schedule the retry; the queue delivers the job again");
                Outcome::Unsettled { reason: e.to_string() }
            }
        }
    }

    async fn dead_letter(&self, delivery: Delivery, kind: JobKind, reason: &str) -> Outcome {
        match delivery.dead_letter(reason).await {
            Ok(()) => {
                tracing::error!(%reason, "moved to the dead-letter queue");
                self.metrics.dead_lettered(kind);
                Outcome::DeadLettered { reason: reason.to_string() }
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not dead-letter; the queue delivers the message again");
                Outcome::Unsettled { reason: e.to_string() }
            }
        }
    }

    fn emit(&self, kind: JobKind, job_id: Option<String>, outcome: &Outcome) {
        if let Some(tx) = &self.events {
            let _ = tx.send(JobEvent { kind, job_id, outcome: outcome.clone(), at: Instant::now() });
        }
    }
}

/// Maps a finished job task to its outcome; an aborted task left its delivery unsettled.
fn joined(done: Result<Outcome, tokio::task::JoinError>) -> Outcome {
    match done {
        Ok(o) => o,
        Err(e) if e.is_cancelled() => Outcome::Unsettled { reason: "stopped before it finished".into() },
        Err(e) => Outcome::Unsettled { reason: format!("job task failed: {e}") },
    }
}

/// What happens to a delivery's message once its job ran (or could not).
enum Next {
    Ack(Outcome),
    Retry(String),
    DeadLetter(String),
}

impl Next {
    /// A store failure: retried if it is transient, dead-lettered if not.
    fn of_store_error(reason: String, e: &infra::store::StoreError) -> Next {
        if e.is_transient() {
            Next::Retry(reason)
        } else {
            Next::DeadLetter(reason)
        }
    }
}

/// Aborts the handler task if the job's own task is dropped (shutdown after the grace).
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl<T> Future for AbortOnDrop<Result<T, JobFailure>> {
    type Output = Result<T, JobFailure>;

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        std::pin::Pin::new(&mut self.0).poll(cx).map(|r| match r {
            Ok(r) => r,
            Err(e) if e.is_panic() => {
                let msg = e.into_panic();
                let text = msg
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| msg.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "(no message)".into());
                Err(JobFailure::Fatal(format!("the handler panicked: {text}")))
            }
            Err(e) => Err(JobFailure::Retryable(format!("the handler task was cancelled: {e}"))),
        })
    }
}
