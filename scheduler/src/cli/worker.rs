//! `harness-s worker`: a worker process. Consumes the given job kinds from the queue,
//! runs them, commits outputs and done-markers to the store, acks. SIGTERM or SIGINT
//! stops it gracefully (in-flight jobs finish within `--grace-secs`, exit 0).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use schemas::JobKind;
use tokio::signal::unix::{signal, SignalKind};
use worker::{Metrics, Worker, WorkerConfig};

#[derive(Debug, Args)]
pub struct WorkerArgs {
    #[command(flatten)]
    pub queue: super::QueueArg,
    /// Where outputs and done-markers go.
    #[command(flatten)]
    pub store: super::StoreArg,
    /// Job kinds to consume, comma-separated (evolve, rollout, rescue, reanchor, learn,
    /// eval, edit, transfer, sleep).
    #[arg(long, value_delimiter = ',', required = true)]
    pub queues: Vec<String>,
    /// Jobs run at the same time (also the broker prefetch).
    #[arg(long, default_value_t = 1)]
    pub concurrency: usize,
    /// Serve Prometheus metrics on this address (e.g. 127.0.0.1:9464), path /metrics.
    #[arg(long)]
    pub metrics_addr: Option<SocketAddr>,
    /// Seconds in-flight jobs get to finish after SIGTERM/SIGINT; unfinished ones go back
    /// to the queue.
    #[arg(long, default_value_t = 30.0)]
    pub grace_secs: f64,
}

/// Checked settings.
struct Settings {
    kinds: Vec<JobKind>,
    grace: Duration,
}

fn check(args: &WorkerArgs) -> anyhow::Result<Settings> {
    let mut kinds = Vec::new();
    for name in args.queues.iter().map(|s| s.trim()).filter(|s| !s.is_empty()) {
        match JobKind::parse(name) {
            Some(k) => kinds.push(k),
            None => {
                let known = JobKind::ALL.iter().map(|k| k.as_str()).collect::<Vec<_>>().join(", ");
                bail!("--queues: unknown job kind `{name}`; known kinds: {known}");
            }
        }
    }
    if kinds.is_empty() {
        bail!("--queues: give at least one job kind, e.g. --queues rollout,rescue");
    }
    if !(args.grace_secs.is_finite() && args.grace_secs >= 0.0) {
        bail!("--grace-secs: {} is not a number of seconds ≥ 0", args.grace_secs);
    }
    shared_queue(&args.queue.url, "worker")?;
    Ok(Settings { kinds, grace: Duration::from_secs_f64(args.grace_secs) })
}

/// Refuses a queue that cannot reach other processes (`memory://`) for `command`, which
/// runs apart from the processes it works with (a scheduler and its workers).
pub(crate) fn shared_queue(url: &str, command: &str) -> anyhow::Result<()> {
    if !url.trim_start().starts_with("memory:") {
        return Ok(());
    }
    let (who, fix) = match command {
        "worker" => ("a separate worker process would never see its jobs", "or run in-process workers with `harness-s run`"),
        _ => (
            "the workers (separate processes) would never see the scheduler's jobs and the run would wait forever",
            "or drive the run with in-process workers: leave --queue out",
        ),
    };
    bail!(
        "--queue {}: a memory:// queue lives inside one process, so {who}; `harness-s {command}` needs a queue \
         other processes reach: amqp://user:password@host:5672/%2f (RabbitMQ), {fix}",
        infra::redact_url(url)
    )
}

pub async fn run(args: WorkerArgs) -> anyhow::Result<u8> {
    let settings = check(&args)?;
    // Signal handlers first: a SIGTERM during start-up must not kill the process
    // mid-connection with the default action.
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let shutdown = async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM received; finishing in-flight jobs"),
            _ = int.recv() => tracing::info!("SIGINT received; finishing in-flight jobs"),
        }
    };

    let queue = infra::queue::open_queue(&args.queue.url)
        .await
        .with_context(|| format!("opening the queue {}", infra::redact_url(&args.queue.url)))?;
    let store = args.store.open().await?;

    let mut config = WorkerConfig::new(settings.kinds, args.concurrency);
    config.grace = settings.grace;
    let metrics = Metrics::new();
    let _server = super::serve_metrics(&metrics, args.metrics_addr).await?;
    let worker = Worker::new(queue.clone(), Arc::clone(&store), handlers::registry(), config)?.with_metrics(metrics);
    let summary = worker.run(shutdown).await;
    // Jobs given up after the grace period dropped their environments; sessions they held on
    // environment servers end here rather than at the servers' expiry.
    jobs::env::http::cancel_open_sessions(Duration::from_secs(5)).await;
    let summary = summary?;
    // Summary on stdout for scripts; the same line went to the log.
    println!("worker stopped: {summary}");
    Ok(crate::exit::OK)
}
