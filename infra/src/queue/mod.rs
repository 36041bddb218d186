//! The job-queue seam: one trait, one file per backend.
//!
//! - [`MemoryQueue`] (`memory://[name]`): in-process, tokio-based; the embedded default.
//! - [`AmqpQueue`] (`amqp://user:pass@host:port/vhost`): RabbitMQ through lapin, for
//!   distributed runs.
//!
//! [`open_queue`] picks one from a URL. Both take the same query parameters
//! (`?prefix=run42&max_attempts=5&retry_base_ms=1000&retry_max_ms=60000`, see
//! [`QueueOptions`]); every other query parameter is passed on to the AMQP client
//! (`heartbeat`, `connection_timeout`, …).
//!
//! # Guarantees every backend gives
//! (checked by the shared suite in `tests/tests/e2e/queue.rs` against both backends)
//!
//! - **Durable publish.** [`Queue::publish`] returns only once the queue has taken
//!   responsibility for the message (RabbitMQ: a publisher confirm for a persistent
//!   message on a durable queue).
//! - **At-least-once delivery.** A [`Delivery`] that is neither acked, retried nor
//!   dead-lettered — because its handler crashed, its process died, its connection
//!   dropped, or it was simply dropped — is delivered again, with
//!   [`Delivery::redelivered`] set. Work must therefore be idempotent: the worker's
//!   done-markers make it so.
//! - **Bounded prefetch.** A consumer never holds more than `prefetch` unsettled
//!   deliveries.
//! - **Retry with exponential backoff.** [`Delivery::retry`] increments the envelope's
//!   `attempt`, and the job comes back after [`QueueOptions::retry_delay`]; once `attempt`
//!   reaches [`QueueOptions::max_attempts`] it is dead-lettered instead.
//! - **Dead letters keep their reason.** [`Delivery::dead_letter`] moves the message, body
//!   unchanged, to the kind's dead-letter queue together with the reason and attempt
//!   count; [`Queue::dead_letters`] reads them back without removing them.
//! - **Isolation by prefix.** Queue names start with [`QueueOptions::prefix`], so runs and
//!   tests that share a broker never see each other's jobs.
//!
//! ```no_run
//! # async fn demo() -> Result<(), infra::queue::QueueError> {
//! use infra::queue::open_queue;
//! use schemas::JobKind;
//! let queue = open_queue("memory://demo").await?;
//! let mut consumer = queue.consume(&[JobKind::Sleep], 4).await?;
//! while let Some(delivery) = consumer.next().await? {
//!     let job = delivery.envelope().expect("a well-formed message");
//!     println!("running {}", job.job_id);
//!     delivery.ack().await?;
//! }
//! # Ok(()) }
//! ```

mod amqp;
mod memory;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use schemas::{JobEnvelope, JobKind};

pub use amqp::AmqpQueue;
pub use memory::MemoryQueue;

/// Settings shared by every backend, read from the queue URL's query string.
#[derive(Debug, Clone, PartialEq)]
pub struct QueueOptions {
    /// First segment of every queue name (`<prefix>.<kind>`); one per run or test.
    pub prefix: String,
    /// A job whose `attempt` reaches this after a retryable failure is dead-lettered.
    pub max_attempts: u32,
    /// Delay before the first retry; doubled for every further attempt.
    pub retry_base: Duration,
    /// Upper bound of the retry delay.
    pub retry_max: Duration,
    /// How long to keep trying to reach the broker when a queue is opened.
    pub connect_timeout: Duration,
    /// How long to keep reconnecting after an established connection was lost.
    pub reconnect_timeout: Duration,
}

impl Default for QueueOptions {
    fn default() -> Self {
        QueueOptions {
            prefix: "harness-s".into(),
            max_attempts: 5,
            retry_base: Duration::from_secs(1),
            retry_max: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(10),
            reconnect_timeout: Duration::from_secs(300),
        }
    }
}

/// The longest queue name AMQP allows (a short string: at most 255 bytes).
pub const MAX_QUEUE_NAME: usize = 255;

/// Query parameters of every queue URL.
const QUEUE_OPTIONS: &[&str] = &["prefix", "max_attempts", "retry_base_ms", "retry_max_ms", "connect_timeout_s", "reconnect_timeout_s"];
/// Query parameters an `amqp://` URI passes to the AMQP client.
const AMQP_URI_OPTIONS: &[&str] = &["heartbeat", "channel_max", "frame_max", "connection_timeout", "auth_mechanism"];

impl QueueOptions {
    /// Reads the options out of a URL and returns them with the URL minus those
    /// parameters (what the backend itself should see).
    pub fn from_url(raw: &str) -> Result<(QueueOptions, url::Url)> {
        let mut url = url::Url::parse(raw).map_err(|e| QueueError::InvalidUrl { url: crate::redact_url(raw), reason: e.to_string() })?;
        let invalid = |reason: String| QueueError::InvalidUrl { url: shorten(&crate::redact_url(raw), 120), reason };
        if url.fragment().is_some() {
            return Err(invalid(
                "a `#fragment` is not part of a queue URL; put options in the query (`?prefix=run42&max_attempts=5`)".into(),
            ));
        }
        let mut opts = QueueOptions::default();
        let mut rest: Vec<(String, String)> = Vec::new();
        let mut seen: Vec<String> = Vec::new();
        let bad = |key: &str, value: &str, want: &str| invalid(format!("query parameter `{key}={}`: expected {want}", shorten(value, 40)));
        for (k, v) in url.query_pairs() {
            let (k, v) = (k.into_owned(), v.into_owned());
            if QUEUE_OPTIONS.contains(&k.as_str()) {
                if seen.contains(&k) {
                    return Err(invalid(format!("query parameter `{k}` is given twice; give it once")));
                }
                seen.push(k.clone());
            }
            let num = |want: &str| v.parse::<u64>().map_err(|_| bad(&k, &v, want));
            let positive = |want: &str| num(want).and_then(|n| if n == 0 { Err(bad(&k, &v, want)) } else { Ok(n) });
            match k.as_str() {
                "prefix" => {
                    if v.is_empty() || !v.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
                        return Err(bad(&k, &v, "a non-empty name of letters, digits, `-`, `_` and `.`"));
                    }
                    opts.prefix = v;
                }
                "max_attempts" => {
                    let n = num("a whole number ≥ 1")?;
                    if n == 0 || n > 100 {
                        return Err(bad(&k, &v, "a whole number between 1 and 100"));
                    }
                    opts.max_attempts = n as u32;
                }
                "retry_base_ms" => opts.retry_base = Duration::from_millis(positive("milliseconds, at least 1")?),
                "retry_max_ms" => opts.retry_max = Duration::from_millis(positive("milliseconds, at least 1")?),
                "connect_timeout_s" => opts.connect_timeout = Duration::from_secs(positive("seconds, at least 1")?),
                "reconnect_timeout_s" => opts.reconnect_timeout = Duration::from_secs(num("seconds")?),
                other => {
                    // The broker's own URI options pass through; anything else is a typo.
                    let passed: &[&str] = if url.scheme().starts_with("amqp") { AMQP_URI_OPTIONS } else { &[] };
                    if !passed.contains(&other) {
                        let mut known: Vec<&str> = QUEUE_OPTIONS.to_vec();
                        known.extend(passed);
                        return Err(invalid(format!("unknown query parameter `{other}`; known: {}", known.join(", "))));
                    }
                    rest.push((k, v))
                }
            }
        }
        if opts.retry_max < opts.retry_base {
            return Err(invalid(format!(
                "retry_base_ms = {} is above retry_max_ms = {}{}: the first retry delay cannot exceed the longest one; raise retry_max_ms or lower retry_base_ms",
                opts.retry_base.as_millis(),
                opts.retry_max.as_millis(),
                if seen.iter().any(|k| k == "retry_max_ms") { "" } else { " (the default)" }
            )));
        }
        let longest = opts.longest_queue_name();
        if longest > MAX_QUEUE_NAME {
            let room = opts.prefix.len() - (longest - MAX_QUEUE_NAME);
            return Err(bad(
                "prefix",
                &opts.prefix,
                &format!(
                    "at most {room} characters: queue names (`<prefix>.<kind>.retry.<ms>ms`) are AMQP short strings of at most {MAX_QUEUE_NAME} bytes"
                ),
            ));
        }
        if rest.is_empty() {
            url.set_query(None);
        } else {
            url.query_pairs_mut().clear().extend_pairs(rest);
        }
        Ok((opts, url))
    }

    /// Length in bytes of the longest queue name these options make (a delay queue of the
    /// longest kind name at the longest delay).
    pub fn longest_queue_name(&self) -> usize {
        let kind = JobKind::ALL.iter().map(|k| k.as_str().len()).max().unwrap_or(0);
        let delay = self.retry_max.as_millis().to_string().len();
        self.dead_queue_len(kind).max(self.prefix.len() + 1 + kind + ".retry.".len() + delay + "ms".len())
    }

    fn dead_queue_len(&self, kind: usize) -> usize {
        self.prefix.len() + 1 + kind + ".dead".len()
    }

    /// Delay before the run that carries `attempt` (≥ 1): `retry_base · 2^(attempt-1)`,
    /// capped at `retry_max`. Deterministic so that AMQP can keep one delay queue per value.
    pub fn retry_delay(&self, attempt: u32) -> Duration {
        let exp = attempt.saturating_sub(1).min(30);
        self.retry_base.saturating_mul(1u32 << exp).min(self.retry_max)
    }

    /// `<prefix>.<kind>`: the work queue of a kind.
    pub fn work_queue(&self, kind: JobKind) -> String {
        format!("{}.{}", self.prefix, kind)
    }

    /// `<prefix>.<kind>.dead`: where dead letters of a kind wait for a human.
    pub fn dead_queue(&self, kind: JobKind) -> String {
        format!("{}.{}.dead", self.prefix, kind)
    }

    /// `<prefix>.<kind>.retry.<ms>ms`: holds retried jobs for `delay`, then hands them
    /// back to the work queue.
    pub fn delay_queue(&self, kind: JobKind, delay: Duration) -> String {
        format!("{}.{}.retry.{}ms", self.prefix, kind, delay.as_millis())
    }

    /// Every distinct retry delay these options can produce, shortest first.
    pub fn retry_delays(&self) -> Vec<Duration> {
        let mut v: Vec<Duration> = (1..self.max_attempts).map(|a| self.retry_delay(a)).collect();
        v.dedup();
        v
    }
}

/// `s` cut to `max` characters, saying how long it was (a 300-character prefix is named,
/// not printed whole).
pub fn shorten(s: &str, max: usize) -> String {
    let n = s.chars().count();
    if n <= max {
        return s.to_string();
    }
    format!("{}… ({n} characters)", s.chars().take(max).collect::<String>())
}

/// Errors of queues. Messages name the broker (password redacted), queue or message and
/// say what to do next.
#[derive(Debug, thiserror::Error)]
pub enum QueueError {
    #[error("invalid queue URL `{url}`: {reason}")]
    InvalidUrl { url: String, reason: String },
    #[error("cannot reach the message broker at {url}: {detail}; check that RabbitMQ is running and listening there (e.g. `rabbitmqctl status`), or use `memory://` for an in-process queue")]
    Unreachable { url: String, detail: String },
    #[error("the server at {url} does not speak AMQP 0-9-1: is this RabbitMQ's AMQP port (usually 5672), not its management port or another service's?")]
    NotAmqp { url: String },
    #[error("{url} accepted the TCP connection but sent no AMQP handshake within {secs} s: is this RabbitMQ's AMQP port (usually 5672), not another service's? (raise `connect_timeout_s=` for a slow broker)")]
    NoHandshake { url: String, secs: u64 },
    #[error("the message broker at {url} refused the login: {detail}; check the user name and password in the queue URL (and that the user may use the virtual host)")]
    AccessRefused { url: String, detail: String },
    #[error("queue `{queue}` already exists with different settings: {detail}; delete it (`rabbitmqctl delete_queue {queue}`) or use another `prefix=`")]
    Topology { queue: String, detail: String },
    #[error("lost the connection to {url} and could not reconnect within {secs} s: {detail}")]
    Disconnected { url: String, secs: u64, detail: String },
    #[error("the broker did not confirm a message for queue `{queue}`: {detail}")]
    NotConfirmed { queue: String, detail: String },
    #[error("{kind} delivery could not be settled because its connection is gone ({detail}); the broker will deliver it again")]
    SettleLost { kind: JobKind, detail: String },
    #[error("cannot encode job `{job_id}`: {detail}")]
    Encode { job_id: String, detail: String },
    #[error("{url}: {detail}")]
    Broker { url: String, detail: String },
}

impl crate::Transient for QueueError {
    /// Whether trying the same call again later may succeed.
    fn is_transient(&self) -> bool {
        matches!(
            self,
            QueueError::Unreachable { .. }
                | QueueError::Disconnected { .. }
                | QueueError::NotConfirmed { .. }
                | QueueError::SettleLost { .. }
                | QueueError::Broker { .. }
        )
    }
}

pub type Result<T, E = QueueError> = std::result::Result<T, E>;

/// A message body that is not a valid [`JobEnvelope`] (poison message).
#[derive(Debug, Clone, thiserror::Error)]
#[error("malformed {kind} message ({len} bytes): {detail}")]
pub struct MalformedMessage {
    pub kind: JobKind,
    pub len: usize,
    pub detail: String,
}

/// Message counts of one kind's queues.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QueueStats {
    /// Waiting in the work queue (not yet delivered, or returned to it).
    pub ready: u64,
    /// Waiting out a retry delay.
    pub delayed: u64,
    /// In the dead-letter queue.
    pub dead: u64,
}

/// A message in a dead-letter queue.
#[derive(Debug, Clone, PartialEq)]
pub struct DeadLetter {
    pub kind: JobKind,
    /// The job id, when the body was a readable envelope.
    pub job_id: Option<String>,
    /// Why it was given up on.
    pub reason: String,
    /// The envelope's attempt count when it was given up on (0 for unreadable bodies).
    pub attempts: u32,
    pub dead_at_ms: i64,
    /// The message body, unchanged.
    pub body: Bytes,
}

/// What [`Delivery::retry`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryOutcome {
    /// Scheduled again; the job comes back after `delay` carrying `attempt`.
    Retried { attempt: u32, delay: Duration },
    /// Attempts exhausted; moved to the dead-letter queue.
    DeadLettered { attempts: u32 },
}

/// A job queue with one work queue per [`JobKind`].
#[async_trait]
pub trait Queue: Send + Sync + fmt::Debug {
    /// The queue's URL, safe to print (password redacted).
    fn url(&self) -> String;

    /// The options this queue was opened with.
    fn options(&self) -> &QueueOptions;

    /// Publishes a job to its kind's work queue; returns once the queue holds it durably.
    async fn publish(&self, job: &JobEnvelope) -> Result<()> {
        self.publish_many(std::slice::from_ref(job)).await
    }

    /// Publishes several jobs, waiting for all confirmations together (much faster than
    /// one [`Queue::publish`] after the other). On error some of them may have been
    /// published; publishing them again is safe because job ids are deterministic.
    async fn publish_many(&self, jobs: &[JobEnvelope]) -> Result<()>;

    /// Publishes a body as is, for tools and tests that need a message which is not a
    /// valid envelope; workers dead-letter such messages.
    async fn publish_raw(&self, kind: JobKind, body: Bytes) -> Result<()>;

    /// Starts consuming the work queues of `kinds`, holding at most `prefetch` unsettled
    /// deliveries at a time.
    async fn consume(&self, kinds: &[JobKind], prefetch: u16) -> Result<Box<dyn Consumer>>;

    /// Message counts of a kind's queues.
    async fn stats(&self, kind: JobKind) -> Result<QueueStats>;

    /// Up to `limit` dead letters of a kind, oldest first, left in place.
    async fn dead_letters(&self, kind: JobKind, limit: usize) -> Result<Vec<DeadLetter>>;

    /// Deletes every queue of this prefix with its messages (test and benchmark cleanup).
    async fn delete_all(&self) -> Result<()>;
}

/// A stream of deliveries from one or more work queues.
#[async_trait]
pub trait Consumer: Send {
    /// The next delivery; waits for one. `None` once the consumer was cancelled. Lost
    /// connections are re-established inside (with backoff); an error means the
    /// consumer gave up and should be dropped.
    async fn next(&mut self) -> Result<Option<Delivery>>;

    /// Stops taking new deliveries. Deliveries already handed out can still be settled;
    /// any the consumer had buffered go back to the queue.
    async fn cancel(&mut self) -> Result<()>;

    /// Cancels and closes the consumer's connection; every unsettled delivery goes back
    /// to the queue.
    async fn close(&mut self) -> Result<()>;
}

/// One delivered message. Settle it exactly once with [`ack`](Self::ack),
/// [`retry`](Self::retry), [`dead_letter`](Self::dead_letter) or
/// [`requeue`](Self::requeue); dropping it unsettled gives it back to the queue.
pub struct Delivery {
    kind: JobKind,
    body: Bytes,
    redelivered: bool,
    options: Arc<QueueOptions>,
    settle: Box<dyn Settle>,
}

impl fmt::Debug for Delivery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Delivery").field("kind", &self.kind).field("len", &self.body.len()).field("redelivered", &self.redelivered).finish()
    }
}

impl Delivery {
    pub(crate) fn new(kind: JobKind, body: Bytes, redelivered: bool, options: Arc<QueueOptions>, settle: Box<dyn Settle>) -> Self {
        Delivery { kind, body, redelivered, options, settle }
    }

    /// The work queue it came from.
    pub fn kind(&self) -> JobKind {
        self.kind
    }

    /// The raw body.
    pub fn body(&self) -> &Bytes {
        &self.body
    }

    /// Whether the queue delivered this message before without it being settled (a
    /// worker died or dropped it). Retried jobs come back as new messages, not as
    /// redeliveries.
    pub fn redelivered(&self) -> bool {
        self.redelivered
    }

    /// Decodes the body into an envelope of this queue's kind.
    pub fn envelope(&self) -> Result<JobEnvelope, MalformedMessage> {
        let bad = |detail: String| MalformedMessage { kind: self.kind, len: self.body.len(), detail };
        let job: JobEnvelope = serde_json::from_slice(&self.body).map_err(|e| bad(e.to_string()))?;
        if job.kind != self.kind {
            return Err(bad(format!("envelope of kind `{}` on the `{}` queue", job.kind, self.kind)));
        }
        if job.job_id.is_empty() || job.run_id.is_empty() {
            return Err(bad("empty `job_id` or `run_id`".into()));
        }
        Ok(job)
    }

    /// Done: removes the message for good. Call only after the job's outputs and
    /// done-marker are committed.
    pub async fn ack(self) -> Result<()> {
        self.settle.ack().await
    }

    /// Gives the message back to its work queue now, unchanged (shutdown).
    pub async fn requeue(self) -> Result<()> {
        self.settle.requeue().await
    }

    /// A retryable failure of `job` (this delivery's envelope): schedules the job again
    /// with `attempt + 1` after the backoff delay, or dead-letters it with `reason` once
    /// the attempts are used up.
    pub async fn retry(self, job: &JobEnvelope, reason: &str) -> Result<RetryOutcome> {
        let attempt = job.attempt.saturating_add(1);
        if attempt >= self.options.max_attempts {
            let reason = format!("gave up after {attempt} attempts; last failure: {reason}");
            let letter = self.letter(Some(job.job_id.clone()), reason, attempt);
            self.settle.dead_letter(letter).await?;
            return Ok(RetryOutcome::DeadLettered { attempts: attempt });
        }
        let delay = self.options.retry_delay(attempt);
        let mut next = job.clone();
        next.attempt = attempt;
        next.not_before_ms = Some(now_ms() + delay.as_millis() as i64);
        let body = encode(&next)?;
        self.settle.retry(body, delay).await?;
        Ok(RetryOutcome::Retried { attempt, delay })
    }

    /// A fatal failure or a poison message: moves the body, unchanged, to the kind's
    /// dead-letter queue with `reason`.
    pub async fn dead_letter(self, reason: &str) -> Result<()> {
        let (job_id, attempts) = match self.envelope() {
            Ok(job) => (Some(job.job_id), job.attempt),
            Err(_) => (None, 0),
        };
        let letter = self.letter(job_id, reason.to_string(), attempts);
        self.settle.dead_letter(letter).await
    }

    fn letter(&self, job_id: Option<String>, reason: String, attempts: u32) -> DeadLetter {
        DeadLetter { kind: self.kind, job_id, reason, attempts, dead_at_ms: now_ms(), body: self.body.clone() }
    }
}

/// How a backend settles one delivery. Dropping an unsettled one must give it back.
#[async_trait]
pub(crate) trait Settle: Send + Sync {
    async fn ack(self: Box<Self>) -> Result<()>;
    async fn requeue(self: Box<Self>) -> Result<()>;
    /// Holds `body` for `delay`, then puts it on the work queue; removes the original.
    async fn retry(self: Box<Self>, body: Bytes, delay: Duration) -> Result<()>;
    /// Stores the letter in the dead-letter queue; removes the original.
    async fn dead_letter(self: Box<Self>, letter: DeadLetter) -> Result<()>;
}

/// Serialises an envelope as the JSON message body.
pub fn encode(job: &JobEnvelope) -> Result<Bytes> {
    serde_json::to_vec(job).map(Bytes::from).map_err(|e| QueueError::Encode { job_id: job.job_id.clone(), detail: e.to_string() })
}

fn now_ms() -> i64 {
    schemas::now_unix_ms()
}

/// Opens the queue a URL names: `memory://[name]` → [`MemoryQueue`] (one per name and
/// process), `amqp://…` or `amqps://…` → [`AmqpQueue`] (connects now, so that a wrong
/// address or password is reported here).
pub async fn open_queue(url: &str) -> Result<Arc<dyn Queue>> {
    if url.starts_with("memory:") {
        Ok(MemoryQueue::open(url)?)
    } else if url.starts_with("amqp://") || url.starts_with("amqps://") {
        Ok(Arc::new(AmqpQueue::connect(url).await?))
    } else {
        Err(QueueError::InvalidUrl {
            url: crate::redact_url(url),
            reason: "unsupported scheme; use memory://[name] or amqp://user:password@host:5672/%2f".into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_come_from_the_query_and_the_rest_stays() {
        let (o, rest) =
            QueueOptions::from_url("amqp://u:p@h:5672/%2f?prefix=t1&max_attempts=3&retry_base_ms=100&heartbeat=10&retry_max_ms=250")
                .unwrap();
        assert_eq!(o.prefix, "t1");
        assert_eq!(o.max_attempts, 3);
        assert_eq!(o.retry_base, Duration::from_millis(100));
        assert_eq!(rest.as_str(), "amqp://u:p@h:5672/%2f?heartbeat=10");
        assert_eq!(o.retry_delays(), vec![Duration::from_millis(100), Duration::from_millis(200)]);
        assert_eq!(o.retry_delay(3), Duration::from_millis(250));
        let (_, plain) = QueueOptions::from_url("amqp://h/%2f?prefix=x").unwrap();
        assert_eq!(plain.as_str(), "amqp://h/%2f");
    }

    #[test]
    fn bad_options_name_the_parameter_and_hide_the_password() {
        let e = QueueOptions::from_url("amqp://u:secret@h/%2f?max_attempts=zero").unwrap_err().to_string();
        assert!(e.contains("max_attempts=zero") && !e.contains("secret"), "{e}");
        let e = QueueOptions::from_url("memory://x?prefix=a/b").unwrap_err().to_string();
        assert!(e.contains("prefix"), "{e}");
        // a typo is refused, naming the parameter and the known ones
        let e = QueueOptions::from_url("amqp://u:secret@h/%2f?max_atempts=3").unwrap_err().to_string();
        assert!(
            e.contains("unknown query parameter `max_atempts`")
                && e.contains("max_attempts")
                && e.contains("heartbeat")
                && !e.contains("secret"),
            "{e}"
        );
        let e = QueueOptions::from_url("memory://x?heartbeat=10").unwrap_err().to_string();
        assert!(e.contains("unknown query parameter `heartbeat`"), "{e}");
    }

    #[test]
    fn options_that_mean_nothing_are_refused_by_name() {
        let err = |url: &str| QueueOptions::from_url(url).unwrap_err().to_string();
        let long = "a".repeat(300);
        let e = err(&format!("amqp://u:secret@h/%2f?prefix={long}"));
        assert!(e.contains("prefix") && e.contains("255") && e.contains("300 characters") && !e.contains("secret"), "{e}");
        // the longest name that fits is accepted
        let (o, _) = QueueOptions::from_url("memory://x?prefix=p").unwrap();
        let room = MAX_QUEUE_NAME - (o.longest_queue_name() - 1);
        let (o, _) = QueueOptions::from_url(&format!("memory://x?prefix={}", "a".repeat(room))).unwrap();
        assert_eq!(o.longest_queue_name(), MAX_QUEUE_NAME);
        assert!(err(&format!("memory://x?prefix={}", "a".repeat(room + 1))).contains(&format!("at most {room} characters")));
        for (url, want) in [
            ("amqp://h/%2f?retry_max_ms=0", "retry_max_ms=0"),
            ("amqp://h/%2f?retry_base_ms=0", "retry_base_ms=0"),
            ("amqp://h/%2f?connect_timeout_s=0", "connect_timeout_s=0"),
            ("amqp://h/%2f?retry_base_ms=500&retry_max_ms=100", "retry_base_ms = 500 is above retry_max_ms = 100"),
            ("amqp://h/%2f?retry_base_ms=120000", "(the default)"),
            ("amqp://h/%2f?prefix=a&prefix=b", "`prefix` is given twice"),
            ("amqp://h/%2f?prefix=a#frag", "#fragment"),
            ("memory://x#frag", "#fragment"),
        ] {
            let e = err(url);
            assert!(e.contains(want), "{url}: {e}");
        }
    }

    #[test]
    fn retry_delay_doubles_and_caps() {
        let o = QueueOptions { retry_base: Duration::from_secs(1), retry_max: Duration::from_secs(5), ..Default::default() };
        let d: Vec<u64> = (1..6).map(|a| o.retry_delay(a).as_secs()).collect();
        assert_eq!(d, vec![1, 2, 4, 5, 5]);
        assert_eq!(o.retry_delay(1000), Duration::from_secs(5));
    }
}
