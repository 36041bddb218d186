//! `harness-s bench queue`: throughput and enqueue-to-ack latency of the job queue with
//! in-process workers running the diagnostic sleep job (0 ms), for `memory://` and for
//! RabbitMQ, beside Celery running a no-op task on the same RabbitMQ
//! (`benches/peers/celery_bench.py`).
//!
//! Method (the same on both sides), with W workers of one job slot each:
//! 1. throughput: N jobs are queued before the workers start; jobs/s is measured between
//!    the first and the last ack (worker start-up excluded);
//! 2. latency: L jobs are published one at a time at a fixed rate below capacity; each
//!    job's latency runs from the moment its publish was issued to its ack.
//!
//! Two rows per backend: "ack only" consumers decode the envelope and ack (the queue's
//! own cost, comparable with Celery's no-op task, which has no result backend), and
//! "durable" workers take the full path of the durability contract (done-marker check,
//! output object, done-marker, ack, through the object store, which fsyncs).

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use infra::queue::{open_queue, Queue};
use infra::store::{open_store, ObjectStore};
use jobs::sleep::SleepInput;
use schemas::JobKind;
use worker::{JobEvent, Outcome, Registry, Worker, WorkerConfig};

#[derive(Debug, Args)]
pub struct QueueArgs {
    /// RabbitMQ URL to measure besides memory:// (and to run Celery on), e.g.
    /// amqp://guest:guest@127.0.0.1:5672/%2f. Use `memory://` to measure only that.
    #[arg(long, env = "HARNESS_S_QUEUE", hide_env_values = true)]
    pub queue: String,
    /// Store for outputs and done-markers. Default: a temporary folder, removed after.
    #[arg(long)]
    pub store: Option<String>,
    /// Throughput phase: jobs queued before the workers start.
    #[arg(long, default_value_t = 2000)]
    pub jobs: u64,
    /// Latency phase: jobs published one at a time while the workers run.
    #[arg(long, default_value_t = 200)]
    pub latency_jobs: u64,
    /// Latency phase: jobs published per second (keep it below capacity).
    #[arg(long, default_value_t = 100.0)]
    pub rate: f64,
    /// Workers (one job slot each; Celery: threads).
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    /// The Celery peer script.
    #[arg(long, default_value = "benches/peers/celery_bench.py")]
    pub celery_script: PathBuf,
    /// Python interpreter with Celery installed (`pip install celery`).
    #[arg(long, env = "HARNESS_S_PYTHON", default_value = "python3")]
    pub python: String,
    /// Skip the Celery comparison.
    #[arg(long)]
    pub no_celery: bool,
}

/// One line of the table.
#[derive(Debug, Clone, serde::Deserialize)]
pub struct Row {
    #[serde(default)]
    pub backend: String,
    pub jobs: u64,
    pub workers: usize,
    pub seconds: f64,
    pub jobs_per_s: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
}

/// Nearest-rank percentile of sorted values.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// A fresh prefix so the benchmark never touches anyone else's queues.
fn with_prefix(url: &str, prefix: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}prefix={prefix}")
}

/// Collects `n` successes of the given job ids; returns when each was acked.
async fn collect(
    label: &str,
    events: &mut tokio::sync::mpsc::UnboundedReceiver<JobEvent>,
    ids: &HashMap<String, usize>,
) -> anyhow::Result<Vec<Instant>> {
    let mut acked = vec![None; ids.len()];
    let mut left = ids.len();
    while left > 0 {
        let ev = tokio::time::timeout(Duration::from_secs(120), events.recv())
            .await
            .with_context(|| format!("{label}: no job finished for 120 s ({left} of {} left)", ids.len()))?
            .context("all workers stopped early")?;
        match (&ev.outcome, ev.job_id.as_ref().and_then(|id| ids.get(id))) {
            (Outcome::Succeeded, Some(&i)) if acked[i].is_none() => {
                acked[i] = Some(ev.at);
                left -= 1;
            }
            (other, _) => bail!("{label}: unexpected outcome {other:?} for job {:?}", ev.job_id),
        }
    }
    Ok(acked.into_iter().map(|t| t.expect("every job acked")).collect())
}

/// A consumer that only decodes and acks: the queue's own cost, comparable with a no-op
/// Celery task.
async fn ack_only(
    queue: Arc<dyn Queue>,
    events: tokio::sync::mpsc::UnboundedSender<JobEvent>,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let mut consumer = queue.consume(&[JobKind::Sleep], 1).await?;
    tokio::pin!(shutdown);
    loop {
        let d = tokio::select! {
            _ = &mut shutdown => break,
            d = consumer.next() => d?,
        };
        let Some(d) = d else { break };
        let job = d.envelope()?;
        d.ack().await?;
        let at = Instant::now();
        let _ = events.send(JobEvent { kind: JobKind::Sleep, job_id: Some(job.job_id), outcome: Outcome::Succeeded, at });
    }
    consumer.close().await?;
    Ok(())
}

/// Measures one backend; `durable`: full workers (done-marker check, output, marker,
/// ack), otherwise [`ack_only`] consumers.
async fn measure(label: &str, url: &str, store: Arc<dyn ObjectStore>, args: &QueueArgs, durable: bool) -> anyhow::Result<Row> {
    let tag = format!("bench-{}-{}", std::process::id(), schemas::now_unix_ms());
    let queue = open_queue(&with_prefix(url, &tag)).await.with_context(|| format!("opening {}", infra::redact_url(url)))?;
    let input = SleepInput { millis: 0, fail: false, fail_attempts: 0 };

    // Phase 1 (throughput): everything queued before the workers start.
    let run = format!("{tag}-throughput");
    let envelopes: Vec<_> = (0..args.jobs).map(|i| jobs::sleep::envelope(&run, i, &input)).collect();
    let ids: HashMap<String, usize> = envelopes.iter().enumerate().map(|(i, j)| (j.job_id.clone(), i)).collect();
    queue.publish_many(&envelopes).await?;

    let (events_tx, mut events) = tokio::sync::mpsc::unbounded_channel();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut handles: Vec<tokio::task::JoinHandle<anyhow::Result<()>>> = Vec::new();
    for w in 0..args.workers {
        let mut stop = stop_rx.clone();
        let shutdown = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        if durable {
            let mut config = WorkerConfig::new(vec![JobKind::Sleep], 1);
            config.worker_id = format!("bench-{w}");
            let worker = Worker::new(queue.clone(), store.clone(), Registry::builtin(), config)?.with_events(events_tx.clone());
            handles.push(tokio::spawn(async move {
                worker.run(shutdown).await?;
                Ok(())
            }));
        } else {
            let queue = queue.clone();
            let events = events_tx.clone();
            handles.push(tokio::spawn(ack_only(queue, events, shutdown)));
        }
    }
    drop(events_tx);
    let acked = collect(label, &mut events, &ids).await?;
    let first = acked.iter().min().copied().expect("at least 2 jobs");
    let last = acked.iter().max().copied().expect("at least 2 jobs");
    let seconds = last.duration_since(first).as_secs_f64();

    // Phase 2 (latency): one job at a time at a fixed rate, below capacity.
    let run = format!("{tag}-latency");
    let envelopes: Vec<_> = (0..args.latency_jobs).map(|i| jobs::sleep::envelope(&run, i, &input)).collect();
    let ids: HashMap<String, usize> = envelopes.iter().enumerate().map(|(i, j)| (j.job_id.clone(), i)).collect();
    let interval = Duration::from_secs_f64(1.0 / args.rate);
    let start = tokio::time::Instant::now();
    let mut issued = Vec::with_capacity(envelopes.len());
    for (k, job) in envelopes.iter().enumerate() {
        tokio::time::sleep_until(start + interval * k as u32).await;
        issued.push(Instant::now());
        queue.publish(job).await?;
    }
    let acked = collect(label, &mut events, &ids).await?;
    let mut latencies: Vec<f64> = acked.iter().zip(&issued).map(|(a, i)| a.duration_since(*i).as_secs_f64() * 1000.0).collect();

    let _ = stop_tx.send(true);
    for h in handles {
        h.await.context("worker task")??;
    }
    queue.delete_all().await?;
    latencies.sort_by(|a, b| a.total_cmp(b));
    Ok(Row {
        backend: label.to_string(),
        jobs: args.jobs,
        workers: args.workers,
        seconds,
        jobs_per_s: (args.jobs - 1) as f64 / seconds.max(1e-9),
        p50_ms: percentile(&latencies, 50.0),
        p99_ms: percentile(&latencies, 99.0),
    })
}

/// Runs the Celery peer script and reads the JSON line it prints last.
async fn celery(args: &QueueArgs) -> anyhow::Result<Row> {
    if !args.celery_script.exists() {
        bail!(
            "--celery-script {}: not found; run from the repository root or pass the path (or --no-celery)",
            args.celery_script.display()
        );
    }
    let queue_name = format!("bench-celery-{}-{}", std::process::id(), schemas::now_unix_ms());
    let out = tokio::process::Command::new(&args.python)
        .arg(&args.celery_script)
        .args(["--broker", &args.queue, "--jobs", &args.jobs.to_string(), "--workers", &args.workers.to_string()])
        .args(["--latency-jobs", &args.latency_jobs.to_string(), "--rate", &args.rate.to_string()])
        .args(["--queue-name", &queue_name])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .await
        .with_context(|| format!("starting `{}` (the Python interpreter, --python)", args.python))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "the Celery peer failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim(),
            if stdout.is_empty() { String::new() } else { format!("\n{stdout}") }
        );
    }
    let line = stdout.lines().rev().find(|l| l.trim_start().starts_with('{')).context("the Celery peer printed no result line")?;
    let mut row: Row = serde_json::from_str(line).with_context(|| format!("reading the Celery peer's result `{line}`"))?;
    row.backend = "rabbitmq celery".into();
    Ok(row)
}

fn print_row(r: &Row) {
    println!(
        "{:<20} {:>7} {:>8} {:>9.2} {:>10.0} {:>9.1} {:>9.1}",
        r.backend, r.jobs, r.workers, r.seconds, r.jobs_per_s, r.p50_ms, r.p99_ms
    );
}

pub async fn run(args: QueueArgs) -> anyhow::Result<u8> {
    if args.jobs < 2 || args.workers == 0 || args.latency_jobs == 0 {
        bail!("--jobs must be at least 2, --workers and --latency-jobs at least 1");
    }
    if !(args.rate.is_finite() && args.rate > 0.0 && args.rate <= 10_000.0) {
        bail!("--rate {}: give jobs per second, above 0 and at most 10000", args.rate);
    }
    let amqp = args.queue.starts_with("amqp://") || args.queue.starts_with("amqps://");
    if !amqp && !args.queue.starts_with("memory:") {
        bail!("--queue {}: expected amqp://… or memory://", infra::redact_url(&args.queue));
    }
    let tmp;
    let store_url = match &args.store {
        Some(u) => u.clone(),
        None => {
            tmp = tempfile::tempdir().context("creating a temporary store folder")?;
            format!("file://{}", tmp.path().display())
        }
    };
    let store = open_store(&store_url).await?;
    tracing::info!(jobs = args.jobs, workers = args.workers, store = %store.url(), "queue benchmark");

    let mut rows = Vec::new();
    rows.push(measure("memory:// ack only", "memory://bench", store.clone(), &args, false).await?);
    rows.push(measure("memory:// durable", "memory://bench", store.clone(), &args, true).await?);
    if amqp {
        rows.push(measure("rabbitmq ack only", &args.queue, store.clone(), &args, false).await?);
        rows.push(measure("rabbitmq durable", &args.queue, store.clone(), &args, true).await?);
    }
    let peer = if amqp && !args.no_celery { Some(celery(&args).await) } else { None };

    println!(
        "queue benchmark{}: {} workers with one slot each; jobs/s drains {} queued jobs; \
         enqueue-to-ack latency over {} jobs published at {}/s",
        if cfg!(debug_assertions) { " (debug build)" } else { "" },
        args.workers,
        args.jobs,
        args.latency_jobs,
        args.rate
    );
    println!("{:<20} {:>7} {:>8} {:>9} {:>10} {:>9} {:>9}", "backend", "jobs", "workers", "seconds", "jobs/s", "p50 ms", "p99 ms");
    for r in &rows {
        print_row(r);
    }
    match peer {
        Some(Ok(c)) => {
            print_row(&c);
            for ours in rows.iter().filter(|r| r.backend.starts_with("rabbitmq")) {
                println!(
                    "{} / celery on the same RabbitMQ: throughput {:.2}x, p50 latency {:.2}x, p99 latency {:.2}x",
                    ours.backend,
                    ours.jobs_per_s / c.jobs_per_s,
                    ours.p50_ms / c.p50_ms,
                    ours.p99_ms / c.p99_ms
                );
            }
        }
        Some(Err(e)) => return Err(e.context("the Celery comparison could not run (pass --no-celery to skip it)")),
        None => {}
    }
    Ok(crate::exit::OK)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&[3.0], 99.0), 3.0);
        assert!(percentile(&[], 50.0).is_nan());
    }

    #[test]
    fn prefixes_are_appended() {
        assert_eq!(with_prefix("memory://x", "p"), "memory://x?prefix=p");
        assert_eq!(with_prefix("amqp://h/%2f?heartbeat=5", "p"), "amqp://h/%2f?heartbeat=5&prefix=p");
    }
}
