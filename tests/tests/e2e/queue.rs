//! The job queue and the worker runtime.
//!
//! - The queue suite (publish/ack, redelivery of unsettled deliveries, retry with backoff
//!   then dead-letter, poison messages, prefetch, prefix isolation), run against both
//!   backends: `MemoryQueue` and the real RabbitMQ.
//! - In-process workers on `MemoryQueue`: exactly-once outputs, idempotent skip, a
//!   crashed (dropped) job redelivered, graceful shutdown, deadlines.
//! - Real `harness-s worker` processes on RabbitMQ: 1,000 jobs over 3 processes, SIGKILL
//!   mid-job, dead-lettering with readable reasons, a broker restart, SIGTERM, and bad
//!   broker URLs.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use harness_s_tests::{amqp_url, broker_exclusive, broker_shared, harness_s_bin, unique};
use infra::queue::{open_queue, MemoryQueue, Queue, QueueError, QueueOptions, RetryOutcome};
use infra::store::{open_store, ObjectStore};
use jobs::sleep::{envelope, SleepInput};
use schemas::{keys, DoneMarker, JobEnvelope, JobKind};
use sha2::{Digest, Sha256};
use worker::{JobEvent, Outcome, Registry, Worker, WorkerConfig, WorkerSummary};

// ---------------------------------------------------------------------------------------
// Fixtures

fn sleep_input(millis: u64) -> SleepInput {
    SleepInput { millis, fail: false, fail_attempts: 0 }
}

fn jobs_for(run: &str, n: u64, input: &SleepInput) -> Vec<JobEnvelope> {
    (0..n).map(|i| envelope(run, i, input)).collect()
}

/// `amqp://…?prefix=<unique>&<extra>`
fn amqp_queue_url(test: &str, extra: &str) -> String {
    let base = amqp_url();
    let sep = if base.contains('?') { '&' } else { '?' };
    let extra = if extra.is_empty() { String::new() } else { format!("&{extra}") };
    format!("{base}{sep}prefix={}{extra}", unique(test))
}

fn memory_queue_url(test: &str, extra: &str) -> String {
    let extra = if extra.is_empty() { String::new() } else { format!("&{extra}") };
    format!("memory://{}?prefix=p{extra}", unique(test))
}

async fn local_store() -> (tempfile::TempDir, String, Arc<dyn ObjectStore>) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().display());
    let store = open_store(&url).await.unwrap();
    (dir, url, store)
}

/// Deletes a test's queues on the broker when dropped, even if the test failed.
struct QueueCleanup(String);

impl Drop for QueueCleanup {
    fn drop(&mut self) {
        if !self.0.starts_with("amqp") {
            return;
        }
        let _ = Command::new(harness_s_bin())
            .args(["queue", "delete", "--queue", &self.0])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

async fn count_markers(store: &dyn ObjectStore, run: &str) -> usize {
    store.list(&format!("runs/{run}/jobs/")).await.unwrap().len()
}

/// Waits until at least `n` done-markers exist; returns how many there are.
async fn wait_markers(store: &dyn ObjectStore, run: &str, n: usize, timeout: Duration) -> usize {
    let start = Instant::now();
    loop {
        let c = count_markers(store, run).await;
        if c >= n || start.elapsed() > timeout {
            return c;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every marker lists outputs that exist with the recorded size and checksum, and the
/// outputs are exactly those listed: no stray or duplicated objects.
async fn check_commits(store: &dyn ObjectStore, run: &str, expected: usize) {
    let markers = store.list(&format!("runs/{run}/jobs/")).await.unwrap();
    assert_eq!(markers.len(), expected, "done-markers");
    let mut listed = BTreeSet::new();
    for m in &markers {
        let bytes = store.get(&m.key).await.unwrap();
        let marker: DoneMarker = schemas::decode_document(&m.key, &bytes).unwrap();
        assert_eq!(m.key, keys::done_marker(run, &marker.job_id));
        assert_eq!(marker.outputs.len(), 1, "{}", m.key);
        for o in &marker.outputs {
            let data = store.get(&o.key).await.unwrap();
            assert_eq!(data.len() as u64, o.size, "{}", o.key);
            assert_eq!(format!("{:x}", Sha256::digest(&data)), o.sha256, "{}", o.key);
            assert!(listed.insert(o.key.clone()), "output {} listed twice", o.key);
        }
    }
    let outputs: BTreeSet<String> =
        store.list(&format!("runs/{run}/diagnostics/sleep/")).await.unwrap().into_iter().map(|o| o.key).collect();
    assert_eq!(outputs, listed, "output objects must be exactly those the markers list");
}

// ---------------------------------------------------------------------------------------
// The queue suite, run against every backend

/// Published jobs arrive once each and are gone after their ack.
async fn publish_consume_ack(q: Arc<dyn Queue>) {
    let run = unique("pca");
    let jobs = jobs_for(&run, 5, &sleep_input(0));
    q.publish_many(&jobs).await.unwrap();
    let mut c = q.consume(&[JobKind::Sleep], 10).await.unwrap();
    let mut seen = BTreeSet::new();
    for _ in 0..5 {
        let d = tokio::time::timeout(Duration::from_secs(10), c.next()).await.unwrap().unwrap().unwrap();
        assert!(!d.redelivered());
        let env = d.envelope().unwrap();
        assert_eq!(env.kind, JobKind::Sleep);
        seen.insert(env.job_id.clone());
        d.ack().await.unwrap();
    }
    let want: BTreeSet<String> = jobs.iter().map(|j| j.job_id.clone()).collect();
    assert_eq!(seen, want);
    assert!(tokio::time::timeout(Duration::from_millis(300), c.next()).await.is_err(), "nothing else to deliver");
    c.close().await.unwrap();
    let s = q.stats(JobKind::Sleep).await.unwrap();
    assert_eq!((s.ready, s.delayed, s.dead), (0, 0, 0));
}

/// A delivery dropped unsettled, or held by a consumer that goes away, comes back
/// marked redelivered.
async fn unsettled_is_redelivered(q: Arc<dyn Queue>) {
    let run = unique("redeliver");
    let job = envelope(&run, 0, &sleep_input(0));
    q.publish(&job).await.unwrap();
    let mut c = q.consume(&[JobKind::Sleep], 1).await.unwrap();
    let d = tokio::time::timeout(Duration::from_secs(10), c.next()).await.unwrap().unwrap().unwrap();
    drop(d);
    let d = tokio::time::timeout(Duration::from_secs(10), c.next()).await.unwrap().unwrap().unwrap();
    assert!(d.redelivered());
    assert_eq!(d.envelope().unwrap().job_id, job.job_id);
    // The consumer goes away (its process dies) while holding it: another consumer
    // gets it.
    c.close().await.unwrap();
    drop(d);
    let mut other = q.consume(&[JobKind::Sleep], 1).await.unwrap();
    let again = tokio::time::timeout(Duration::from_secs(10), other.next()).await.unwrap().unwrap().unwrap();
    assert!(again.redelivered());
    assert_eq!(again.envelope().unwrap().job_id, job.job_id);
    again.ack().await.unwrap();
    other.close().await.unwrap();
}

/// Retries come back after the exponential delays with `attempt` counted up; the last
/// one is dead-lettered with its reason.
async fn retry_backoff_then_dead_letter(q: Arc<dyn Queue>) {
    assert_eq!(q.options().max_attempts, 3);
    let base = q.options().retry_base;
    let run = unique("retry");
    let job = envelope(&run, 0, &sleep_input(0));
    q.publish(&job).await.unwrap();
    let mut c = q.consume(&[JobKind::Sleep], 1).await.unwrap();
    let mut last = Instant::now();
    for expected_attempt in 0..3u32 {
        let d = tokio::time::timeout(Duration::from_secs(20), c.next()).await.unwrap().unwrap().unwrap();
        let waited = last.elapsed();
        let env = d.envelope().unwrap();
        assert_eq!(env.attempt, expected_attempt);
        if expected_attempt > 0 {
            let want = base * (1 << (expected_attempt - 1));
            assert!(waited >= want.mul_f64(0.9), "attempt {expected_attempt} came after {waited:?}, backoff is {want:?}");
            assert!(env.not_before_ms.is_some());
        }
        let outcome = d.retry(&env, "always fails").await.unwrap();
        last = Instant::now();
        match (expected_attempt, outcome) {
            (0 | 1, RetryOutcome::Retried { attempt, delay }) => {
                assert_eq!(attempt, expected_attempt + 1);
                assert_eq!(delay, q.options().retry_delay(attempt));
            }
            (2, RetryOutcome::DeadLettered { attempts }) => assert_eq!(attempts, 3),
            other => panic!("unexpected {other:?}"),
        }
    }
    let start = Instant::now();
    let dead = loop {
        let dead = q.dead_letters(JobKind::Sleep, 10).await.unwrap();
        if !dead.is_empty() || start.elapsed() > Duration::from_secs(5) {
            break dead;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].job_id.as_deref(), Some(job.job_id.as_str()));
    assert_eq!(dead[0].attempts, 3);
    assert!(dead[0].reason.contains("gave up after 3 attempts") && dead[0].reason.contains("always fails"), "{}", dead[0].reason);
    // Reading dead letters leaves them in place.
    assert_eq!(q.dead_letters(JobKind::Sleep, 10).await.unwrap().len(), 1);
    assert_eq!(q.stats(JobKind::Sleep).await.unwrap().dead, 1);
    c.close().await.unwrap();
}

/// A body that is not an envelope is reported as malformed and can be dead-lettered.
async fn poison_message(q: Arc<dyn Queue>) {
    q.publish_raw(JobKind::Sleep, Bytes::from_static(b"{\"not\": \"an envelope\"")).await.unwrap();
    let mut c = q.consume(&[JobKind::Sleep], 1).await.unwrap();
    let d = tokio::time::timeout(Duration::from_secs(10), c.next()).await.unwrap().unwrap().unwrap();
    let err = d.envelope().unwrap_err();
    assert!(err.to_string().contains("malformed sleep message"), "{err}");
    d.dead_letter(&err.to_string()).await.unwrap();
    let start = Instant::now();
    let dead = loop {
        let dead = q.dead_letters(JobKind::Sleep, 10).await.unwrap();
        if !dead.is_empty() || start.elapsed() > Duration::from_secs(5) {
            break dead;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].job_id, None);
    assert_eq!(&dead[0].body[..], b"{\"not\": \"an envelope\"");
    assert!(dead[0].reason.contains("malformed"), "{}", dead[0].reason);
    c.close().await.unwrap();
}

/// No more than `prefetch` unsettled deliveries at a time.
async fn prefetch_is_bounded(q: Arc<dyn Queue>) {
    let run = unique("prefetch");
    q.publish_many(&jobs_for(&run, 4, &sleep_input(0))).await.unwrap();
    let mut c = q.consume(&[JobKind::Sleep], 2).await.unwrap();
    let a = tokio::time::timeout(Duration::from_secs(10), c.next()).await.unwrap().unwrap().unwrap();
    let b = tokio::time::timeout(Duration::from_secs(10), c.next()).await.unwrap().unwrap().unwrap();
    assert!(tokio::time::timeout(Duration::from_millis(400), c.next()).await.is_err(), "a third delivery beyond prefetch 2");
    a.ack().await.unwrap();
    let third = tokio::time::timeout(Duration::from_secs(10), c.next()).await.unwrap().unwrap().unwrap();
    b.ack().await.unwrap();
    third.ack().await.unwrap();
    let fourth = tokio::time::timeout(Duration::from_secs(10), c.next()).await.unwrap().unwrap().unwrap();
    fourth.ack().await.unwrap();
    c.close().await.unwrap();
}

/// Queues with different prefixes never see each other's jobs.
async fn prefixes_isolate(a: Arc<dyn Queue>, b: Arc<dyn Queue>) {
    a.publish(&envelope(&unique("iso"), 0, &sleep_input(0))).await.unwrap();
    assert_eq!(a.stats(JobKind::Sleep).await.unwrap().ready, 1);
    assert_eq!(b.stats(JobKind::Sleep).await.unwrap().ready, 0);
    let mut c = b.consume(&[JobKind::Sleep], 1).await.unwrap();
    assert!(tokio::time::timeout(Duration::from_millis(300), c.next()).await.is_err());
    c.close().await.unwrap();
}

macro_rules! queue_suite {
    ($backend:ident, $url:expr, $lock:expr) => {
        mod $backend {
            use super::*;

            async fn open(test: &str, extra: &str) -> (Arc<dyn Queue>, QueueCleanup) {
                let url = $url(test, extra);
                let q = open_queue(&url).await.unwrap();
                (q, QueueCleanup(url))
            }

            #[tokio::test]
            async fn suite_publish_consume_ack() {
                let _b = $lock;
                let (q, _c) = open("suite-pca", "").await;
                publish_consume_ack(q).await;
            }

            #[tokio::test]
            async fn suite_unsettled_is_redelivered() {
                let _b = $lock;
                let (q, _c) = open("suite-redeliver", "").await;
                unsettled_is_redelivered(q).await;
            }

            #[tokio::test]
            async fn suite_retry_backoff_then_dead_letter() {
                let _b = $lock;
                let (q, _c) = open("suite-retry", "max_attempts=3&retry_base_ms=200").await;
                retry_backoff_then_dead_letter(q).await;
            }

            #[tokio::test]
            async fn suite_poison_message() {
                let _b = $lock;
                let (q, _c) = open("suite-poison", "").await;
                poison_message(q).await;
            }

            #[tokio::test]
            async fn suite_prefetch_is_bounded() {
                let _b = $lock;
                let (q, _c) = open("suite-prefetch", "").await;
                prefetch_is_bounded(q).await;
            }

            #[tokio::test]
            async fn suite_prefixes_isolate() {
                let _b = $lock;
                let (a, _ca) = open("suite-iso-a", "").await;
                let (b, _cb) = open("suite-iso-b", "").await;
                prefixes_isolate(a, b).await;
            }
        }
    };
}

queue_suite!(memory, memory_queue_url, ());
queue_suite!(rabbitmq, amqp_queue_url, broker_shared().await);

// ---------------------------------------------------------------------------------------
// In-process workers on MemoryQueue

struct Running {
    stop: tokio::sync::watch::Sender<bool>,
    handles: Vec<tokio::task::JoinHandle<Result<WorkerSummary, worker::WorkerError>>>,
    events: tokio::sync::mpsc::UnboundedReceiver<JobEvent>,
}

fn start_workers(q: &Arc<dyn Queue>, store: &Arc<dyn ObjectStore>, n: usize, concurrency: usize) -> Running {
    let (tx, events) = tokio::sync::mpsc::unbounded_channel();
    let (stop, stop_rx) = tokio::sync::watch::channel(false);
    let mut handles = Vec::new();
    for i in 0..n {
        let mut cfg = WorkerConfig::new(vec![JobKind::Sleep], concurrency);
        cfg.worker_id = format!("w{i}");
        cfg.grace = Duration::from_secs(10);
        let w = Worker::new(q.clone(), store.clone(), Registry::builtin(), cfg).unwrap().with_events(tx.clone());
        let mut rx = stop_rx.clone();
        handles.push(tokio::spawn(async move {
            w.run(async move {
                let _ = rx.wait_for(|s| *s).await;
            })
            .await
        }));
    }
    Running { stop, handles, events }
}

impl Running {
    async fn stop(self) -> (WorkerSummary, Vec<JobEvent>) {
        let _ = self.stop.send(true);
        let mut total = WorkerSummary::default();
        for h in self.handles {
            let s = h.await.unwrap().unwrap();
            total.succeeded += s.succeeded;
            total.skipped += s.skipped;
            total.retried += s.retried;
            total.dead_lettered += s.dead_lettered;
            total.unsettled += s.unsettled;
        }
        let mut events = self.events;
        let mut all = Vec::new();
        while let Ok(e) = events.try_recv() {
            all.push(e);
        }
        (total, all)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_workers_run_every_job_exactly_once() {
    let (_dir, _url, store) = local_store().await;
    let q = open_queue(&memory_queue_url("mem-once", "")).await.unwrap();
    let run = unique("mem-once");
    let running = start_workers(&q, &store, 3, 4);
    q.publish_many(&jobs_for(&run, 300, &sleep_input(0))).await.unwrap();
    assert_eq!(wait_markers(store.as_ref(), &run, 300, Duration::from_secs(60)).await, 300);
    let (summary, _) = running.stop().await;
    assert_eq!(summary.succeeded, 300, "{summary}");
    assert_eq!(summary.skipped + summary.retried + summary.dead_lettered + summary.unsettled, 0, "{summary}");
    check_commits(store.as_ref(), &run, 300).await;
    assert_eq!(q.stats(JobKind::Sleep).await.unwrap().ready, 0);
}

#[tokio::test]
async fn memory_worker_skips_a_job_whose_marker_exists() {
    let (_dir, _url, store) = local_store().await;
    let q = open_queue(&memory_queue_url("mem-skip", "")).await.unwrap();
    let run = unique("mem-skip");
    let job = envelope(&run, 0, &sleep_input(0));
    let mut running = start_workers(&q, &store, 1, 1);
    q.publish(&job).await.unwrap();
    let first = tokio::time::timeout(Duration::from_secs(10), running.events.recv()).await.unwrap().unwrap();
    assert_eq!(first.outcome, Outcome::Succeeded);
    let output = jobs::sleep::output_key(&run, &job.job_id);
    // Tamper with the output: a second run would rewrite it, a skip leaves it alone.
    store.put(&output, Bytes::from_static(b"left alone")).await.unwrap();
    q.publish(&job).await.unwrap();
    let second = tokio::time::timeout(Duration::from_secs(10), running.events.recv()).await.unwrap().unwrap();
    assert_eq!(second.outcome, Outcome::Skipped);
    assert_eq!(&store.get(&output).await.unwrap()[..], b"left alone");
    let (summary, _) = running.stop().await;
    assert_eq!((summary.succeeded, summary.skipped), (1, 1));
}

#[tokio::test]
async fn memory_worker_dead_letters_failures_and_poison_and_keeps_going() {
    let (_dir, _url, store) = local_store().await;
    let q = open_queue(&memory_queue_url("mem-dlq", "max_attempts=3&retry_base_ms=50")).await.unwrap();
    let run = unique("mem-dlq");
    let mut running = start_workers(&q, &store, 1, 2);
    let always = envelope(&run, 0, &SleepInput { millis: 0, fail: false, fail_attempts: u32::MAX });
    let fatal = envelope(&run, 1, &SleepInput { millis: 0, fail: true, fail_attempts: 0 });
    let flaky = envelope(&run, 2, &SleepInput { millis: 0, fail: false, fail_attempts: 2 });
    q.publish_many(&[always.clone(), fatal.clone(), flaky.clone()]).await.unwrap();
    q.publish_raw(JobKind::Sleep, Bytes::from_static(b"\xff\xfe garbage")).await.unwrap();
    let good = envelope(&run, 3, &sleep_input(0));
    q.publish(&good).await.unwrap();
    // Until the two good jobs are done and three letters are dead.
    let start = Instant::now();
    loop {
        let dead = q.stats(JobKind::Sleep).await.unwrap().dead;
        if (dead == 3 && count_markers(store.as_ref(), &run).await == 2) || start.elapsed() > Duration::from_secs(20) {
            break;
        }
        let _ = tokio::time::timeout(Duration::from_millis(100), running.events.recv()).await;
    }
    let dead = q.dead_letters(JobKind::Sleep, 10).await.unwrap();
    assert_eq!(dead.len(), 3, "{dead:?}");
    let by_job = |id: &str| dead.iter().find(|d| d.job_id.as_deref() == Some(id)).unwrap_or_else(|| panic!("{id} not dead"));
    let a = by_job(&always.job_id);
    assert_eq!(a.attempts, 3);
    assert!(a.reason.contains("gave up after 3 attempts") && a.reason.contains("retryable failure"), "{}", a.reason);
    let f = by_job(&fatal.job_id);
    assert_eq!(f.attempts, 0);
    assert!(f.reason.contains("fail: true"), "{}", f.reason);
    let poison = dead.iter().find(|d| d.job_id.is_none()).expect("the malformed message is dead");
    assert!(poison.reason.contains("malformed"), "{}", poison.reason);
    // The flaky job succeeded on its third run; the good one on its first.
    let marker: DoneMarker =
        schemas::decode_document("marker", &store.get(&keys::done_marker(&run, &flaky.job_id)).await.unwrap()).unwrap();
    assert_eq!(marker.attempt, 2);
    assert!(store.head(&keys::done_marker(&run, &good.job_id)).await.unwrap().is_some());
    let (summary, _) = running.stop().await;
    assert_eq!(summary.dead_lettered, 3, "{summary}");
    assert_eq!(summary.retried, 4, "2 for the always-failing job, 2 for the flaky one: {summary}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_job_of_a_crashed_worker_is_redelivered_and_finished_once() {
    let (_dir, _url, store) = local_store().await;
    let q = open_queue(&memory_queue_url("mem-crash", "")).await.unwrap();
    let run = unique("mem-crash");
    let job = envelope(&run, 0, &sleep_input(1500));
    q.publish(&job).await.unwrap();
    // The first worker takes the job; then its task is aborted mid-job (a crash).
    let first = start_workers(&q, &store, 1, 1);
    let start = Instant::now();
    while q.stats(JobKind::Sleep).await.unwrap().ready != 0 {
        assert!(start.elapsed() < Duration::from_secs(5), "the job was never taken");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    for h in &first.handles {
        h.abort();
    }
    for h in first.handles {
        assert!(h.await.unwrap_err().is_cancelled());
    }
    assert_eq!(count_markers(store.as_ref(), &run).await, 0, "the crashed run must not have committed");
    let mut second = start_workers(&q, &store, 1, 1);
    let ev = tokio::time::timeout(Duration::from_secs(10), second.events.recv()).await.unwrap().unwrap();
    assert_eq!(ev.outcome, Outcome::Succeeded);
    let (summary, _) = second.stop().await;
    assert_eq!(summary.succeeded, 1);
    check_commits(store.as_ref(), &run, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_shutdown_lets_in_flight_jobs_finish_and_leaves_the_rest_queued() {
    let (_dir, _url, store) = local_store().await;
    let q = open_queue(&memory_queue_url("mem-term", "")).await.unwrap();
    let run = unique("mem-term");
    q.publish_many(&jobs_for(&run, 6, &sleep_input(800))).await.unwrap();
    let running = start_workers(&q, &store, 1, 2);
    let start = Instant::now();
    while q.stats(JobKind::Sleep).await.unwrap().ready != 4 {
        assert!(start.elapsed() < Duration::from_secs(5));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (summary, _) = running.stop().await;
    assert_eq!(summary.succeeded, 2, "{summary}");
    assert_eq!(count_markers(store.as_ref(), &run).await, 2);
    assert_eq!(q.stats(JobKind::Sleep).await.unwrap().ready, 4, "the rest stay queued");
    let drain = start_workers(&q, &store, 1, 4);
    assert_eq!(wait_markers(store.as_ref(), &run, 6, Duration::from_secs(20)).await, 6);
    drain.stop().await;
    check_commits(store.as_ref(), &run, 6).await;
}

#[tokio::test]
async fn memory_deadlines_dead_letter_late_and_overrunning_jobs() {
    let (_dir, _url, store) = local_store().await;
    let q = open_queue(&memory_queue_url("mem-deadline", "")).await.unwrap();
    let run = unique("mem-deadline");
    let mut late = envelope(&run, 0, &sleep_input(0));
    late.deadline_ms = Some(schemas::now_unix_ms() - 1000);
    let mut overrun = envelope(&run, 1, &sleep_input(5000));
    overrun.deadline_ms = Some(schemas::now_unix_ms() + 300);
    q.publish_many(&[late.clone(), overrun.clone()]).await.unwrap();
    let mut running = start_workers(&q, &store, 1, 2);
    for _ in 0..2 {
        let ev = tokio::time::timeout(Duration::from_secs(5), running.events.recv()).await.unwrap().unwrap();
        assert!(matches!(ev.outcome, Outcome::DeadLettered { .. }), "{ev:?}");
    }
    let dead = q.dead_letters(JobKind::Sleep, 10).await.unwrap();
    let reason = |id: &str| dead.iter().find(|d| d.job_id.as_deref() == Some(id)).unwrap().reason.clone();
    assert!(reason(&late.job_id).contains("deadline passed"), "{}", reason(&late.job_id));
    assert!(reason(&overrun.job_id).contains("deadline exceeded"), "{}", reason(&overrun.job_id));
    running.stop().await;
    assert_eq!(count_markers(store.as_ref(), &run).await, 0);
}

#[tokio::test]
async fn memory_queue_urls_are_checked() {
    let e = open_queue("memory://x?max_attempts=0").await.unwrap_err();
    assert!(matches!(e, QueueError::InvalidUrl { .. }) && e.to_string().contains("max_attempts"), "{e}");
    let e = open_queue("redis://localhost").await.unwrap_err();
    assert!(e.to_string().contains("unsupported scheme"), "{e}");
    let q = MemoryQueue::private(QueueOptions::default());
    assert_eq!(q.options().prefix, "harness-s");
}

// ---------------------------------------------------------------------------------------
// `harness-s worker` processes on RabbitMQ

/// A `harness-s worker` child process with its log lines collected.
struct WorkerProc {
    child: Child,
    log: Arc<Mutex<Vec<String>>>,
    out: Arc<Mutex<String>>,
    readers: Vec<std::thread::JoinHandle<()>>,
}

impl WorkerProc {
    fn spawn(queue: &str, store: &str, concurrency: usize, grace_secs: u32) -> WorkerProc {
        let mut child = Command::new(harness_s_bin())
            .args(["--log-format", "json", "--log", "info", "worker", "--queue", queue, "--store", store])
            .args(["--queues", "sleep", "--concurrency", &concurrency.to_string()])
            .args(["--grace-secs", &grace_secs.to_string()])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start harness-s worker");
        let log = Arc::new(Mutex::new(Vec::new()));
        let out = Arc::new(Mutex::new(String::new()));
        let stderr = child.stderr.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let l = log.clone();
        let o = out.clone();
        let readers = vec![
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    l.lock().unwrap().push(line);
                }
            }),
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    let mut o = o.lock().unwrap();
                    o.push_str(&line);
                    o.push('\n');
                }
            }),
        ];
        WorkerProc { child, log, out, readers }
    }

    fn lines_with(&self, needle: &str) -> Vec<String> {
        self.log.lock().unwrap().iter().filter(|l| l.contains(needle)).cloned().collect()
    }

    async fn wait_log(&self, needle: &str, count: usize, timeout: Duration) {
        let start = Instant::now();
        while self.lines_with(needle).len() < count {
            assert!(
                start.elapsed() < timeout,
                "worker never logged `{needle}` {count} times; log:\n{}",
                self.log.lock().unwrap().join("\n")
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn signal(&self, sig: &str) {
        let ok = Command::new("kill").args([sig, &self.child.id().to_string()]).status().unwrap().success();
        assert!(ok, "kill {sig} failed");
    }

    /// SIGTERM, then waits for the exit; returns the status and the summary counts.
    async fn terminate(mut self) -> (ExitStatus, WorkerSummary, String) {
        self.signal("-TERM");
        let start = Instant::now();
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            assert!(start.elapsed() < Duration::from_secs(60), "the worker did not stop after SIGTERM");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        for r in std::mem::take(&mut self.readers) {
            r.join().unwrap();
        }
        let out = self.out.lock().unwrap().clone();
        let log = self.log.lock().unwrap().join("\n");
        (status, parse_summary(&out), format!("{out}\n{log}"))
    }
}

impl Drop for WorkerProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Reads "worker stopped: 3 succeeded, 0 skipped (already done), 0 retried, 0
/// dead-lettered, 0 left to the queue".
fn parse_summary(stdout: &str) -> WorkerSummary {
    let line = stdout.lines().find(|l| l.starts_with("worker stopped:")).unwrap_or_else(|| panic!("no summary in {stdout:?}"));
    let n = |word: &str| -> u64 {
        let before = line.split(word).next().unwrap();
        before.trim_end().rsplit(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap()
    };
    WorkerSummary {
        succeeded: n(" succeeded"),
        skipped: n(" skipped"),
        retried: n(" retried"),
        dead_lettered: n(" dead-lettered"),
        unsettled: n(" left to the queue"),
    }
}

#[test]
fn summaries_parse() {
    let s = parse_summary("worker stopped: 3 succeeded, 1 skipped (already done), 2 retried, 4 dead-lettered, 5 left to the queue\n");
    assert_eq!(s, WorkerSummary { succeeded: 3, skipped: 1, retried: 2, dead_lettered: 4, unsettled: 5 });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_1000_jobs_over_3_worker_processes_each_done_exactly_once() {
    let _b = broker_shared().await;
    let url = amqp_queue_url("amqp-1000", "");
    let _cleanup = QueueCleanup(url.clone());
    let (_dir, store_url, store) = local_store().await;
    let q = open_queue(&url).await.unwrap();
    let workers: Vec<WorkerProc> = (0..3).map(|_| WorkerProc::spawn(&url, &store_url, 4, 30)).collect();
    for w in &workers {
        w.wait_log("worker started", 1, Duration::from_secs(30)).await;
    }
    let run = unique("amqp-1000");
    q.publish_many(&jobs_for(&run, 1000, &sleep_input(0))).await.unwrap();
    assert_eq!(wait_markers(store.as_ref(), &run, 1000, Duration::from_secs(180)).await, 1000);
    let mut total = WorkerSummary::default();
    for w in workers {
        let (status, s, log) = w.terminate().await;
        assert!(status.success(), "{status}: {log}");
        assert!(s.succeeded > 0, "every process took part: {s}");
        total.succeeded += s.succeeded;
        total.skipped += s.skipped;
        total.unsettled += s.unsettled;
        total.dead_lettered += s.dead_lettered;
    }
    assert_eq!(total.succeeded, 1000, "each job ran exactly once: {total}");
    assert_eq!(total.skipped + total.unsettled + total.dead_lettered, 0, "{total}");
    check_commits(store.as_ref(), &run, 1000).await;
    let s = q.stats(JobKind::Sleep).await.unwrap();
    assert_eq!((s.ready, s.delayed, s.dead), (0, 0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_job_of_a_sigkilled_worker_is_redelivered_and_finished_elsewhere() {
    let _b = broker_shared().await;
    let url = amqp_queue_url("amqp-kill", "");
    let _cleanup = QueueCleanup(url.clone());
    let (_dir, store_url, store) = local_store().await;
    let q = open_queue(&url).await.unwrap();
    let run = unique("amqp-kill");
    let job = envelope(&run, 0, &sleep_input(3000));
    let doomed = WorkerProc::spawn(&url, &store_url, 1, 30);
    q.publish(&job).await.unwrap();
    doomed.wait_log("job started", 1, Duration::from_secs(30)).await;
    doomed.signal("-KILL");
    drop(doomed);
    assert_eq!(count_markers(store.as_ref(), &run).await, 0, "the killed run must not have committed");
    let rescuer = WorkerProc::spawn(&url, &store_url, 1, 30);
    assert_eq!(wait_markers(store.as_ref(), &run, 1, Duration::from_secs(60)).await, 1);
    let started = rescuer.lines_with("job started");
    assert_eq!(started.len(), 1);
    assert!(started[0].contains("\"redelivered\":true"), "{}", started[0]);
    let (status, s, log) = rescuer.terminate().await;
    assert!(status.success(), "{log}");
    assert_eq!(s.succeeded, 1, "{log}");
    check_commits(store.as_ref(), &run, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_failures_and_poison_are_dead_lettered_with_readable_reasons() {
    let _b = broker_shared().await;
    let url = amqp_queue_url("amqp-dlq", "max_attempts=3&retry_base_ms=100");
    let _cleanup = QueueCleanup(url.clone());
    let (_dir, store_url, store) = local_store().await;
    let q = open_queue(&url).await.unwrap();
    let run = unique("amqp-dlq");
    let always = envelope(&run, 0, &SleepInput { millis: 0, fail: false, fail_attempts: u32::MAX });
    let fatal = envelope(&run, 1, &SleepInput { millis: 0, fail: true, fail_attempts: 0 });
    let good = envelope(&run, 2, &sleep_input(0));
    let mut w = WorkerProc::spawn(&url, &store_url, 2, 30);
    q.publish_many(&[always.clone(), fatal.clone()]).await.unwrap();
    q.publish_raw(JobKind::Sleep, Bytes::from_static(b"this is not json")).await.unwrap();
    q.publish(&good).await.unwrap();
    let start = Instant::now();
    while q.stats(JobKind::Sleep).await.unwrap().dead < 3 || count_markers(store.as_ref(), &run).await < 1 {
        assert!(start.elapsed() < Duration::from_secs(60), "stats {:?}", q.stats(JobKind::Sleep).await.unwrap());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(w.child.try_wait().unwrap().is_none(), "the worker survives poison");
    let dead = q.dead_letters(JobKind::Sleep, 10).await.unwrap();
    assert_eq!(dead.len(), 3, "{dead:?}");
    let a = dead.iter().find(|d| d.job_id.as_deref() == Some(always.job_id.as_str())).unwrap();
    assert_eq!(a.attempts, 3);
    assert!(a.reason.contains("gave up after 3 attempts"), "{}", a.reason);
    let f = dead.iter().find(|d| d.job_id.as_deref() == Some(fatal.job_id.as_str())).unwrap();
    assert!(f.reason.contains("diagnostic failure requested"), "{}", f.reason);
    let p = dead.iter().find(|d| d.job_id.is_none()).unwrap();
    assert!(p.reason.contains("malformed sleep message"), "{}", p.reason);
    assert_eq!(&p.body[..], b"this is not json");
    // The reasons are readable from the command line too, without the password.
    let out = Command::new(harness_s_bin()).args(["queue", "dead-letters", "--queue", &url, "--kind", "sleep"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("gave up after 3 attempts") && text.contains("malformed"), "{text}");
    assert!(w.lines_with("moved to the dead-letter queue").len() + w.lines_with("attempts used up").len() >= 3);
    let (status, s, log) = w.terminate().await;
    assert!(status.success(), "{log}");
    assert_eq!((s.succeeded, s.dead_lettered, s.retried), (1, 3, 2), "{log}");
}

/// Runs `rabbitmqctl start_app` when dropped unless the broker was started again, so that a
/// failing test never leaves the shared broker stopped.
struct BrokerGuard {
    stopped: bool,
}

impl BrokerGuard {
    fn stop(&mut self) {
        let st = Command::new("rabbitmqctl").arg("stop_app").stdout(Stdio::null()).status().expect("rabbitmqctl on PATH");
        assert!(st.success(), "rabbitmqctl stop_app failed");
        self.stopped = true;
    }

    fn start(&mut self) {
        let st = Command::new("rabbitmqctl").arg("start_app").stdout(Stdio::null()).status().expect("rabbitmqctl on PATH");
        assert!(st.success(), "rabbitmqctl start_app failed");
        self.stopped = false;
    }
}

impl Drop for BrokerGuard {
    fn drop(&mut self) {
        if self.stopped {
            let _ = Command::new("rabbitmqctl").arg("start_app").status();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_restart_during_a_run_workers_reconnect_and_every_job_completes() {
    let _b = broker_exclusive().await;
    let url = amqp_queue_url("amqp-restart", "");
    let _cleanup = QueueCleanup(url.clone());
    let (_dir, store_url, store) = local_store().await;
    let q = open_queue(&url).await.unwrap();
    let run = unique("amqp-restart");
    let workers: Vec<WorkerProc> = (0..2).map(|_| WorkerProc::spawn(&url, &store_url, 2, 30)).collect();
    for w in &workers {
        w.wait_log("worker started", 1, Duration::from_secs(30)).await;
    }
    let jobs = jobs_for(&run, 300, &sleep_input(40));
    q.publish_many(&jobs[..250]).await.unwrap();
    assert!(wait_markers(store.as_ref(), &run, 30, Duration::from_secs(60)).await >= 30);
    let mut broker = BrokerGuard { stopped: false };
    broker.stop();
    // Publishing while the broker is down waits for it and then goes through.
    let late = jobs[250..].to_vec();
    let q2 = q.clone();
    let publisher = tokio::spawn(async move { q2.publish_many(&late).await });
    tokio::time::sleep(Duration::from_secs(2)).await;
    broker.start();
    publisher.await.unwrap().unwrap();
    assert_eq!(wait_markers(store.as_ref(), &run, 300, Duration::from_secs(180)).await, 300);
    let mut reconnected = 0;
    for w in workers {
        reconnected += w.lines_with("consumer connected; topology declared").len();
        let (status, _s, log) = w.terminate().await;
        assert!(status.success(), "{log}");
    }
    assert!(reconnected >= 2, "both workers reconnected ({reconnected} reconnections logged)");
    check_commits(store.as_ref(), &run, 300).await;
    let s = q.stats(JobKind::Sleep).await.unwrap();
    assert_eq!((s.ready, s.delayed, s.dead), (0, 0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_sigterm_lets_in_flight_jobs_finish_loses_nothing_and_exits_0() {
    let _b = broker_shared().await;
    let url = amqp_queue_url("amqp-term", "");
    let _cleanup = QueueCleanup(url.clone());
    let (_dir, store_url, store) = local_store().await;
    let q = open_queue(&url).await.unwrap();
    let run = unique("amqp-term");
    let w = WorkerProc::spawn(&url, &store_url, 2, 30);
    q.publish_many(&jobs_for(&run, 6, &sleep_input(1500))).await.unwrap();
    w.wait_log("job started", 2, Duration::from_secs(30)).await;
    let (status, s, log) = w.terminate().await;
    assert_eq!(status.code(), Some(0), "{log}");
    assert_eq!(s.succeeded, 2, "{log}");
    assert_eq!(count_markers(store.as_ref(), &run).await, 2, "the two in-flight jobs committed");
    let start = Instant::now();
    while q.stats(JobKind::Sleep).await.unwrap().ready != 4 {
        assert!(start.elapsed() < Duration::from_secs(10), "the other 4 must be back in the queue");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let drain = WorkerProc::spawn(&url, &store_url, 4, 30);
    assert_eq!(wait_markers(store.as_ref(), &run, 6, Duration::from_secs(60)).await, 6);
    let (status, s, log) = drain.terminate().await;
    assert!(status.success(), "{log}");
    assert_eq!(s.succeeded, 4, "{log}");
    check_commits(store.as_ref(), &run, 6).await;
}

#[tokio::test]
async fn rabbitmq_unreachable_broker_and_wrong_password_give_clear_errors() {
    let _b = broker_shared().await;
    let dir = tempfile::tempdir().unwrap();
    let store = format!("file://{}", dir.path().display());
    // Nothing listens on port 1.
    let out = Command::new(harness_s_bin())
        .args(["worker", "--queue", "amqp://guest:guest@127.0.0.1:1/%2f?connect_timeout_s=1", "--store", &store, "--queues", "sleep"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("cannot reach the message broker at amqp://guest:***@127.0.0.1:1"), "{err}");
    assert!(!err.contains("panicked"), "{err}");

    // Something listens but does not speak AMQP (an HTTP server): said at once, not retried.
    let http = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = http.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for s in http.incoming().flatten() {
            let mut s = s;
            let _ = std::io::Write::write_all(&mut s, b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n");
        }
    });
    let started = std::time::Instant::now();
    let out = Command::new(harness_s_bin())
        .args(["queue", "stats", "--queue", &format!("amqp://guest:guest@127.0.0.1:{port}/%2f?connect_timeout_s=20")])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("does not speak AMQP") && err.contains("5672"), "{err}");
    assert!(!err.contains("ParserErrors") && !err.contains("Nom("), "{err}");
    assert!(started.elapsed().as_secs() < 15, "retried for {:?}", started.elapsed());

    let wrong = amqp_url().replacen("guest:guest@", "guest:not-the-password@", 1);
    assert_ne!(wrong, amqp_url(), "the test URL carries guest:guest");
    let out = Command::new(harness_s_bin()).args(["worker", "--queue", &wrong, "--store", &store, "--queues", "sleep"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("refused the login") && err.contains("check the user name and password"), "{err}");
    assert!(!err.contains("not-the-password"), "the password leaked: {err}");
    match open_queue(&wrong).await {
        Err(QueueError::AccessRefused { url, .. }) => assert!(url.contains("***") && !url.contains("not-the-password")),
        other => panic!("expected AccessRefused, got {other:?}"),
    }

    // A memory:// queue cannot serve a separate process, and unknown kinds are named.
    let out =
        Command::new(harness_s_bin()).args(["worker", "--queue", "memory://x", "--store", &store, "--queues", "sleep"]).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("lives inside one process"));
    let out = Command::new(harness_s_bin())
        .args(["worker", "--queue", &amqp_url(), "--store", &store, "--queues", "sleep,bogus"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unknown job kind `bogus`") && err.contains("rollout"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_worker_serves_prometheus_metrics() {
    let _b = broker_shared().await;
    let url = amqp_queue_url("amqp-metrics", "");
    let _cleanup = QueueCleanup(url.clone());
    let (_dir, store_url, store) = local_store().await;
    let q = open_queue(&url).await.unwrap();
    let run = unique("amqp-metrics");
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let mut child = Command::new(harness_s_bin())
        .args(["worker", "--queue", &url, "--store", &store_url, "--queues", "sleep", "--metrics-addr"])
        .arg(format!("127.0.0.1:{port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    q.publish_many(&jobs_for(&run, 5, &sleep_input(0))).await.unwrap();
    assert_eq!(wait_markers(store.as_ref(), &run, 5, Duration::from_secs(30)).await, 5);
    let body = {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").unwrap();
        let mut text = String::new();
        s.read_to_string(&mut text).unwrap();
        text
    };
    let _ = child.kill();
    let _ = child.wait();
    assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    assert!(body.contains("harness_s_jobs_succeeded_total{kind=\"sleep\"} 5"), "{body}");
    assert!(body.contains("harness_s_jobs_in_flight 0"), "{body}");
}

#[tokio::test]
async fn bench_queue_prints_the_table_with_the_celery_ratio() {
    let _b = broker_shared().await;
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../benches/peers/celery_bench.py");
    let out = Command::new(harness_s_bin())
        .args(["bench", "queue", "--queue", &amqp_url(), "--jobs", "40", "--workers", "2", "--latency-jobs", "10"])
        .arg("--celery-script")
        .arg(&script)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}\n(the Celery peer needs `pip install celery`)", String::from_utf8_lossy(&out.stderr));
    for row in ["memory:// ack only", "memory:// durable", "rabbitmq ack only", "rabbitmq durable", "rabbitmq celery"] {
        let line = text.lines().find(|l| l.starts_with(row)).unwrap_or_else(|| panic!("no `{row}` row in\n{text}"));
        let jobs_per_s: f64 = line[20..].split_whitespace().nth(3).unwrap().parse().unwrap();
        assert!(jobs_per_s > 0.0, "{line}");
    }
    assert!(text.contains("rabbitmq durable / celery on the same RabbitMQ: throughput"), "{text}");
}
