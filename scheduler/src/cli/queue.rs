//! `harness-s queue …`: look at and feed a job queue by hand — message counts, dead
//! letters with their reasons, diagnostic sleep jobs, raw messages, cleanup.

use std::io::Write;

use anyhow::{bail, Context};
use bytes::Bytes;
use clap::{Args, Subcommand};
use infra::queue::{open_queue, Queue};
use jobs::sleep::SleepInput;
use schemas::JobKind;

#[derive(Debug, Subcommand)]
pub enum QueueCommand {
    /// Publish diagnostic sleep jobs (ids are deterministic per run and index).
    EnqueueSleep(EnqueueSleepArgs),
    /// Publish a message body as is (e.g. to check that workers dead-letter poison).
    PublishRaw(PublishRawArgs),
    /// Message counts (ready, waiting out a retry delay, dead) per job kind.
    Stats(StatsArgs),
    /// Print dead letters with their reasons (they stay in the queue).
    DeadLetters(DeadLettersArgs),
    /// Delete every queue of the URL's prefix, with its messages.
    Delete(QueueUrl),
}

/// The queue these commands look at (the same `--queue` as everywhere).
pub type QueueUrl = super::QueueArg;

#[derive(Debug, Args)]
pub struct EnqueueSleepArgs {
    #[command(flatten)]
    pub url: QueueUrl,
    /// Run id the jobs belong to (their outputs go under runs/<run>/).
    #[arg(long, value_parser = super::run_id)]
    pub run: String,
    /// Number of jobs.
    #[arg(long, default_value_t = 1)]
    pub count: u64,
    /// Index of the first job (ids derive from run and index).
    #[arg(long, default_value_t = 0)]
    pub first: u64,
    /// How long each job sleeps.
    #[arg(long, default_value_t = 0)]
    pub millis: u64,
    /// Make every job fail fatally (dead-letter at once).
    #[arg(long)]
    pub fail: bool,
    /// Make every job fail retryably while its attempt is below this.
    #[arg(long, default_value_t = 0)]
    pub fail_attempts: u32,
    /// Give each job a deadline this many seconds from now.
    #[arg(long)]
    pub deadline_secs: Option<f64>,
}

#[derive(Debug, Args)]
pub struct PublishRawArgs {
    #[command(flatten)]
    pub url: QueueUrl,
    /// Job kind whose work queue receives the body.
    #[arg(long)]
    pub kind: String,
    /// The message body.
    pub body: String,
}

#[derive(Debug, Args)]
pub struct StatsArgs {
    #[command(flatten)]
    pub url: QueueUrl,
    /// Kinds to show, comma-separated (default: all).
    #[arg(long, value_delimiter = ',')]
    pub kinds: Vec<String>,
}

#[derive(Debug, Args)]
pub struct DeadLettersArgs {
    #[command(flatten)]
    pub url: QueueUrl,
    /// Job kind.
    #[arg(long)]
    pub kind: String,
    /// Print at most this many.
    #[arg(long, default_value_t = 20)]
    pub limit: usize,
    /// One JSON object per line instead of text.
    #[arg(long)]
    pub json: bool,
}

fn kind(name: &str) -> anyhow::Result<JobKind> {
    JobKind::parse(name.trim()).with_context(|| {
        let known = JobKind::ALL.iter().map(|k| k.as_str()).collect::<Vec<_>>().join(", ");
        format!("unknown job kind `{name}`; known kinds: {known}")
    })
}

async fn open(url: &QueueUrl) -> anyhow::Result<std::sync::Arc<dyn Queue>> {
    open_queue(&url.url).await.with_context(|| format!("opening the queue {}", infra::queue::shorten(&infra::redact_url(&url.url), 120)))
}

pub async fn run(cmd: QueueCommand) -> anyhow::Result<u8> {
    let mut out = std::io::stdout().lock();
    match cmd {
        QueueCommand::EnqueueSleep(a) => {
            if a.count == 0 {
                bail!("--count: 0 jobs; give at least 1");
            }
            let q = open(&a.url).await?;
            let input = SleepInput { millis: a.millis, fail: a.fail, fail_attempts: a.fail_attempts };
            let deadline = a.deadline_secs.map(|s| schemas::now_unix_ms() + (s * 1000.0) as i64);
            let jobs: Vec<_> = (a.first..a.first + a.count)
                .map(|i| {
                    let mut job = jobs::sleep::envelope(&a.run, i, &input);
                    job.deadline_ms = deadline;
                    job
                })
                .collect();
            q.publish_many(&jobs).await?;
            writeln!(out, "published {} sleep jobs for run {} to {}", jobs.len(), a.run, q.url())?;
        }
        QueueCommand::PublishRaw(a) => {
            let k = kind(&a.kind)?;
            let q = open(&a.url).await?;
            q.publish_raw(k, Bytes::from(a.body.into_bytes())).await?;
            writeln!(out, "published 1 raw message to the {k} queue of {}", q.url())?;
        }
        QueueCommand::Stats(a) => {
            let kinds = if a.kinds.is_empty() {
                JobKind::ALL.to_vec()
            } else {
                a.kinds.iter().map(|k| kind(k)).collect::<anyhow::Result<Vec<_>>>()?
            };
            let q = open(&a.url).await?;
            writeln!(out, "{:<10} {:>10} {:>10} {:>10}", "kind", "ready", "delayed", "dead")?;
            for k in kinds {
                let s = q.stats(k).await?;
                writeln!(out, "{:<10} {:>10} {:>10} {:>10}", k.as_str(), s.ready, s.delayed, s.dead)?;
            }
        }
        QueueCommand::DeadLetters(a) => {
            let k = kind(&a.kind)?;
            let q = open(&a.url).await?;
            let letters = q.dead_letters(k, a.limit).await?;
            for l in &letters {
                if a.json {
                    let v = serde_json::json!({
                        "kind": l.kind.as_str(),
                        "job_id": l.job_id,
                        "reason": l.reason,
                        "attempts": l.attempts,
                        "dead_at_ms": l.dead_at_ms,
                        "body": String::from_utf8_lossy(&l.body),
                    });
                    writeln!(out, "{v}")?;
                } else {
                    writeln!(
                        out,
                        "{}  attempts={}  job={}  reason: {}",
                        l.kind,
                        l.attempts,
                        l.job_id.as_deref().unwrap_or("(unreadable body)"),
                        l.reason
                    )?;
                }
            }
            if !a.json {
                writeln!(out, "{} dead letters shown", letters.len())?;
            }
        }
        QueueCommand::Delete(a) => {
            let q = open(&a).await?;
            q.delete_all().await?;
            writeln!(out, "deleted the queues of {}", q.url())?;
        }
    }
    Ok(crate::exit::OK)
}
