//! `AmqpQueue`: RabbitMQ through lapin (`amqp://user:password@host:5672/vhost`).
//!
//! Topology, per job kind `K` and prefix `P`, all on the default exchange:
//! - `P.K`: the durable work queue. Messages are persistent and published with publisher
//!   confirms; consumers use manual acks and a channel-wide prefetch.
//! - `P.K.retry.<ms>ms`: one durable delay queue per retry delay, with
//!   `x-message-ttl = <ms>` and dead-lettering back to `P.K`. Because every message in one
//!   delay queue has the same TTL, they expire in order (no head-of-line blocking, which a
//!   per-message TTL on one shared queue would cause).
//! - `P.K.dead`: the dead-letter queue. Each letter carries `x-harness-reason`,
//!   `x-harness-attempts`, `x-harness-job-id` and `x-harness-dead-at-ms` headers.
//!
//! A retry or dead-letter is published (and confirmed) before the original is acked, so
//! a crash in between leaves a duplicate, never a loss; done-markers absorb duplicates.
//!
//! Publishing and consuming use separate connections, as RabbitMQ recommends (flow
//! control on a publishing connection must not stall acks). Each connection re-establishes
//! itself with exponential backoff after a broker restart and declares its topology again;
//! deliveries that were unsettled on a lost connection are redelivered by the broker.

use std::collections::HashSet;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use backon::{ExponentialBuilder, Retryable};
use bytes::Bytes;
use futures::stream::{SelectAll, Stream, StreamExt};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ErrorKind};
use schemas::{JobEnvelope, JobKind};
use tokio::sync::Mutex;

use super::{encode, Consumer, DeadLetter, Delivery, Queue, QueueError, QueueOptions, QueueStats, Result, Settle};

const H_REASON: &str = "x-harness-reason";
const H_ATTEMPTS: &str = "x-harness-attempts";
const H_JOB_ID: &str = "x-harness-job-id";
const H_DEAD_AT: &str = "x-harness-dead-at-ms";

/// The RabbitMQ queue. See the module docs.
pub struct AmqpQueue {
    target: Arc<Target>,
    publisher: Arc<Publisher>,
}

impl std::fmt::Debug for AmqpQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpQueue").field("url", &self.target.shown).finish()
    }
}

/// Where to connect and how.
struct Target {
    /// The URL lapin sees (our own query parameters removed).
    uri: String,
    /// The URL as given, password redacted.
    shown: String,
    options: Arc<QueueOptions>,
}

impl Target {
    /// One connection attempt, bounded by the connect timeout.
    async fn connect_once(&self, role: &str) -> Result<Connection> {
        let props = ConnectionProperties::default().with_connection_name(format!("harness-s {role} pid {}", std::process::id()).into());
        let limit = self.options.connect_timeout.max(Duration::from_secs(1));
        match tokio::time::timeout(limit, Connection::connect(&self.uri, props)).await {
            Ok(Ok(conn)) => Ok(conn),
            Ok(Err(e)) => Err(self.classify(&e, None)),
            // Nothing at all, or a server that took the connection and never answered in
            // AMQP: a second, plain TCP connection tells them apart. The first may pass (a
            // broker starting up); the second is a wrong port and is not retried.
            Err(_) => match self.tcp_reachable(Duration::from_secs(3)).await {
                Ok(()) => Err(QueueError::NoHandshake { url: self.shown.clone(), secs: limit.as_secs() }),
                Err(detail) => Err(QueueError::Unreachable {
                    url: self.shown.clone(),
                    detail: format!("no AMQP connection within {} s ({detail})", limit.as_secs()),
                }),
            },
        }
    }

    /// Whether a TCP connection to the broker's host and port opens within `within`.
    async fn tcp_reachable(&self, within: Duration) -> std::result::Result<(), String> {
        let parsed = url::Url::parse(&self.uri).map_err(|e| e.to_string())?;
        let host = parsed.host_str().unwrap_or("localhost").trim_start_matches('[').trim_end_matches(']').to_string();
        let port = parsed.port().unwrap_or(if parsed.scheme() == "amqps" { 5671 } else { 5672 });
        match tokio::time::timeout(within, tokio::net::TcpStream::connect((host.as_str(), port))).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(format!("TCP connect to {host}:{port}: {e}")),
            Err(_) => Err(format!("no TCP connection to {host}:{port} within {} s", within.as_secs())),
        }
    }

    /// Connects, retrying transient failures with exponential backoff for up to `within`;
    /// a refused login fails at once.
    async fn connect(&self, role: &str, within: Duration) -> Result<Connection> {
        let backoff = ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(100))
            .with_max_delay(Duration::from_secs(5))
            .with_jitter()
            .without_max_times()
            .with_total_delay(Some(within));
        (|| self.connect_once(role))
            .retry(backoff)
            .when(|e| {
                !matches!(
                    e,
                    QueueError::AccessRefused { .. }
                        | QueueError::InvalidUrl { .. }
                        | QueueError::NotAmqp { .. }
                        | QueueError::NoHandshake { .. }
                )
            })
            .notify(|e, wait| tracing::warn!(broker = %self.shown, role, error = %e, "broker not reachable; retrying in {wait:?}"))
            .await
    }

    /// Turns a lapin error into ours; `queue` names the queue an operation was about.
    fn classify(&self, e: &lapin::Error, queue: Option<&str>) -> QueueError {
        let detail = e.to_string();
        match e.kind() {
            ErrorKind::IOError(_) | ErrorKind::MissingHeartbeatError => QueueError::Unreachable { url: self.shown.clone(), detail },
            ErrorKind::AuthProviderError(_) => QueueError::AccessRefused { url: self.shown.clone(), detail },
            ErrorKind::ProtocolError(amqp) => match amqp.kind() {
                AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED) => QueueError::AccessRefused { url: self.shown.clone(), detail },
                AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED) if queue.is_some() => {
                    QueueError::Topology { queue: queue.unwrap_or_default().to_string(), detail }
                }
                _ => QueueError::Broker { url: self.shown.clone(), detail },
            },
            // The broker closes the socket during the handshake when it rejects the
            // credentials and the client did not ask for an explicit close reason.
            // Something answered, but not in AMQP (an HTTP server, the management port).
            ErrorKind::ParsingError(_) | ErrorKind::InvalidProtocolVersion(_) => QueueError::NotAmqp { url: self.shown.clone() },
            ErrorKind::InvalidConnectionState(lapin::ConnectionState::Connecting) => QueueError::AccessRefused {
                url: self.shown.clone(),
                detail: format!("{detail} (the broker closed the connection during login)"),
            },
            _ => QueueError::Broker { url: self.shown.clone(), detail },
        }
    }

    /// Declares the queues of one kind; returns the message counts.
    async fn declare_kind(&self, channel: &Channel, kind: JobKind) -> Result<QueueStats> {
        let o = &self.options;
        let durable = QueueDeclareOptions { durable: true, ..Default::default() };
        let declare = |name: String, args: FieldTable| async move {
            channel.queue_declare(name.as_str().into(), durable, args).await.map_err(|e| self.classify(&e, Some(&name)))
        };
        let work = declare(o.work_queue(kind), FieldTable::default()).await?;
        let dead = declare(o.dead_queue(kind), FieldTable::default()).await?;
        let mut delayed = 0u64;
        for delay in o.retry_delays() {
            let mut args = FieldTable::default();
            args.insert("x-message-ttl".into(), AMQPValue::LongLongInt(delay.as_millis() as i64));
            args.insert("x-dead-letter-exchange".into(), AMQPValue::LongString("".into()));
            args.insert("x-dead-letter-routing-key".into(), AMQPValue::LongString(o.work_queue(kind).into()));
            delayed += u64::from(declare(o.delay_queue(kind, delay), args).await?.message_count());
        }
        Ok(QueueStats { ready: u64::from(work.message_count()), delayed, dead: u64::from(dead.message_count()) })
    }
}

/// The publishing connection: one confirm-mode channel, re-established on demand.
struct Publisher {
    target: Arc<Target>,
    live: Mutex<Option<PublishLink>>,
}

struct PublishLink {
    conn: Connection,
    channel: Channel,
    /// Kinds whose topology this connection has declared.
    declared: HashSet<JobKind>,
}

/// One message to publish.
struct Outgoing {
    kind: JobKind,
    queue: String,
    body: Bytes,
    message_id: Option<String>,
    headers: Option<FieldTable>,
}

impl Publisher {
    async fn link(&self, within: Duration) -> Result<PublishLink> {
        let conn = self.target.connect("publisher", within).await?;
        let channel = conn.create_channel().await.map_err(|e| self.target.classify(&e, None))?;
        channel.confirm_select(ConfirmSelectOptions::default()).await.map_err(|e| self.target.classify(&e, None))?;
        Ok(PublishLink { conn, channel, declared: HashSet::new() })
    }

    /// Runs `op` on a live, topology-declared channel; on a connection-level failure drops
    /// the connection, reconnects with backoff and runs `op` again, for up to the
    /// reconnect timeout.
    async fn with_channel<T, F>(&self, kinds: &[JobKind], op: F) -> Result<T>
    where
        F: for<'c> Fn(&'c Channel) -> futures::future::BoxFuture<'c, Result<T>>,
    {
        let deadline = tokio::time::Instant::now() + self.target.options.reconnect_timeout;
        let mut last_err: Option<QueueError> = None;
        let mut wait = Duration::from_millis(100);
        loop {
            let mut guard = self.live.lock().await;
            let attempt: Result<T> = async {
                if guard.is_none() {
                    let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                    *guard = Some(self.link(left).await?);
                }
                let link = guard.as_mut().expect("link was just set");
                for kind in kinds {
                    if !link.declared.contains(kind) {
                        self.target.declare_kind(&link.channel, *kind).await?;
                        link.declared.insert(*kind);
                    }
                }
                op(&link.channel).await
            }
            .await;
            match attempt {
                Ok(v) => return Ok(v),
                Err(e) => {
                    // Any failure may have closed the channel; start afresh next time.
                    if let Some(link) = guard.take() {
                        let _ = link.conn.close(200, "reset after an error".into()).await;
                    }
                    drop(guard);
                    let retryable =
                        matches!(e, QueueError::Unreachable { .. } | QueueError::Broker { .. } | QueueError::NotConfirmed { .. });
                    if !retryable {
                        return Err(e);
                    }
                    if tokio::time::Instant::now() + wait > deadline {
                        return Err(match last_err.unwrap_or(e) {
                            QueueError::AccessRefused { url, detail } => QueueError::AccessRefused { url, detail },
                            other => QueueError::Disconnected {
                                url: self.target.shown.clone(),
                                secs: self.target.options.reconnect_timeout.as_secs(),
                                detail: other.to_string(),
                            },
                        });
                    }
                    tracing::warn!(broker = %self.target.shown, error = %e, "publishing failed; reconnecting in {wait:?}");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(5));
                    last_err = Some(e);
                }
            }
        }
    }

    /// A new channel on the live publishing connection (re-established if needed), for
    /// questions that may close their channel.
    async fn side_channel(&self) -> Result<Channel> {
        let mut guard = self.live.lock().await;
        if !guard.as_ref().is_some_and(|l| l.conn.status().connected()) {
            *guard = Some(self.link(self.target.options.reconnect_timeout).await?);
        }
        let link = guard.as_ref().expect("link was just set");
        link.conn.create_channel().await.map_err(|e| self.target.classify(&e, None))
    }

    /// Publishes persistent messages and waits for every confirmation.
    async fn send(&self, batch: Vec<Outgoing>) -> Result<()> {
        let mut kinds: Vec<JobKind> = batch.iter().map(|m| m.kind).collect();
        kinds.sort();
        kinds.dedup();
        let target = self.target.clone();
        let batch = Arc::new(batch);
        self.with_channel(&kinds, move |channel| {
            let batch = batch.clone();
            let target = target.clone();
            Box::pin(async move {
                let mut confirms = Vec::with_capacity(batch.len());
                for m in batch.iter() {
                    let mut props = BasicProperties::default().with_delivery_mode(2).with_content_type("application/json".into());
                    if let Some(id) = &m.message_id {
                        props = props.with_message_id(id.as_str().into());
                    }
                    if let Some(h) = &m.headers {
                        props = props.with_headers(h.clone());
                    }
                    let confirm = channel
                        .basic_publish(
                            "".into(),
                            m.queue.as_str().into(),
                            BasicPublishOptions { mandatory: true, ..Default::default() },
                            &m.body,
                            props,
                        )
                        .await
                        .map_err(|e| target.classify(&e, Some(&m.queue)))?;
                    confirms.push((m.queue.as_str(), confirm));
                }
                for (queue, confirm) in confirms {
                    let confirmation = confirm.await.map_err(|e| target.classify(&e, Some(queue)))?;
                    if confirmation.is_nack() {
                        return Err(QueueError::NotConfirmed { queue: queue.to_string(), detail: "negative ack".into() });
                    }
                    if let Some(returned) = confirmation.take_message() {
                        // `mandatory` returned it: the queue is gone (deleted under us).
                        return Err(QueueError::NotConfirmed {
                            queue: queue.to_string(),
                            detail: format!("unroutable: {}", returned.reply_text),
                        });
                    }
                }
                Ok(())
            })
        })
        .await
    }
}

impl AmqpQueue {
    /// Connects to the broker now (retrying for the connect timeout), so that a wrong
    /// address or password is reported by the caller that opened the queue.
    pub async fn connect(url: &str) -> Result<AmqpQueue> {
        let (options, rest) = QueueOptions::from_url(url)?;
        let target = Arc::new(Target { uri: rest.to_string(), shown: crate::redact_url(url), options: Arc::new(options) });
        let publisher = Arc::new(Publisher { target: target.clone(), live: Mutex::new(None) });
        let link = publisher.link(target.options.connect_timeout).await?;
        *publisher.live.lock().await = Some(link);
        Ok(AmqpQueue { target, publisher })
    }
}

#[async_trait]
impl Queue for AmqpQueue {
    fn url(&self) -> String {
        self.target.shown.clone()
    }

    fn options(&self) -> &QueueOptions {
        &self.target.options
    }

    async fn publish_many(&self, jobs: &[JobEnvelope]) -> Result<()> {
        let mut batch = Vec::with_capacity(jobs.len());
        for job in jobs {
            batch.push(Outgoing {
                kind: job.kind,
                queue: self.target.options.work_queue(job.kind),
                body: encode(job)?,
                message_id: Some(job.job_id.clone()),
                headers: None,
            });
        }
        // Bounded batches keep the number of unconfirmed messages (and memory) in check.
        let mut rest = batch;
        while !rest.is_empty() {
            let tail = rest.split_off(rest.len().min(500));
            self.publisher.send(rest).await?;
            rest = tail;
        }
        Ok(())
    }

    async fn publish_raw(&self, kind: JobKind, body: Bytes) -> Result<()> {
        let queue = self.target.options.work_queue(kind);
        self.publisher.send(vec![Outgoing { kind, queue, body, message_id: None, headers: None }]).await
    }

    async fn consume(&self, kinds: &[JobKind], prefetch: u16) -> Result<Box<dyn Consumer>> {
        let mut kinds = kinds.to_vec();
        kinds.sort();
        kinds.dedup();
        let mut consumer = AmqpConsumer {
            target: self.target.clone(),
            publisher: self.publisher.clone(),
            kinds,
            prefetch: prefetch.max(1),
            live: None,
            cancelled: false,
        };
        // Connect now so that the caller sees a wrong URL at once.
        consumer.live = Some(consumer.establish(self.target.options.connect_timeout).await?);
        Ok(Box::new(consumer))
    }

    async fn stats(&self, kind: JobKind) -> Result<QueueStats> {
        let o = &self.target.options;
        let mut probe = Probe { target: &self.target, publisher: &self.publisher, channel: None };
        let mut delayed = 0;
        for delay in o.retry_delays() {
            delayed += probe.count(&o.delay_queue(kind, delay)).await?;
        }
        let stats = QueueStats { ready: probe.count(&o.work_queue(kind)).await?, delayed, dead: probe.count(&o.dead_queue(kind)).await? };
        probe.close().await;
        Ok(stats)
    }

    async fn dead_letters(&self, kind: JobKind, limit: usize) -> Result<Vec<DeadLetter>> {
        let target = self.target.clone();
        // A channel of its own: messages fetched without ack go back to the queue, in
        // order, when it closes, so reading leaves the letters in place.
        let channel = self.publisher.side_channel().await?;
        let queue = target.options.dead_queue(kind);
        let mut out = Vec::new();
        // Reading never creates queues: a missing dead-letter queue has no letters.
        let passive = QueueDeclareOptions { passive: true, ..Default::default() };
        if let Err(e) = channel.queue_declare(queue.as_str().into(), passive, FieldTable::default()).await {
            if is_not_found(&e) {
                return Ok(out);
            }
            return Err(target.classify(&e, Some(&queue)));
        }
        while out.len() < limit {
            let got = channel
                .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: false })
                .await
                .map_err(|e| target.classify(&e, Some(&queue)))?;
            let Some(msg) = got else { break };
            let headers = msg.delivery.properties.headers().clone().unwrap_or_default();
            let text = |k: &str| match headers.inner().get(k) {
                Some(AMQPValue::LongString(s)) => Some(s.to_string()),
                Some(AMQPValue::ShortString(s)) => Some(s.as_str().to_string()),
                _ => None,
            };
            let int = |k: &str| match headers.inner().get(k) {
                Some(AMQPValue::LongLongInt(n)) => Some(*n),
                Some(AMQPValue::LongInt(n)) => Some(i64::from(*n)),
                Some(AMQPValue::LongUInt(n)) => Some(i64::from(*n)),
                _ => None,
            };
            out.push(DeadLetter {
                kind,
                job_id: text(H_JOB_ID).filter(|s| !s.is_empty()),
                reason: text(H_REASON).unwrap_or_else(|| "(no reason recorded)".into()),
                attempts: int(H_ATTEMPTS).unwrap_or(0) as u32,
                dead_at_ms: int(H_DEAD_AT).unwrap_or(0),
                body: Bytes::from(msg.delivery.data.clone()),
            });
        }
        let _ = channel.close(200, "read dead letters".into()).await;
        Ok(out)
    }

    async fn delete_all(&self) -> Result<()> {
        let options = self.target.options.clone();
        let target = self.target.clone();
        self.publisher
            .with_channel(&[], move |channel| {
                let options = options.clone();
                let target = target.clone();
                Box::pin(async move {
                    for kind in JobKind::ALL {
                        let mut names = vec![options.work_queue(kind), options.dead_queue(kind)];
                        names.extend(options.retry_delays().into_iter().map(|d| options.delay_queue(kind, d)));
                        for name in names {
                            channel
                                .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
                                .await
                                .map_err(|e| target.classify(&e, Some(&name)))?;
                        }
                    }
                    Ok(())
                })
            })
            .await?;
        if let Some(link) = self.publisher.live.lock().await.as_mut() {
            link.declared.clear();
        }
        Ok(())
    }
}

fn is_not_found(e: &lapin::Error) -> bool {
    matches!(e.kind(), ErrorKind::ProtocolError(a) if matches!(a.kind(), AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND)))
}

/// Counts messages with passive declares, which create nothing. A missing queue closes
/// the channel (404), so a fresh one is opened for the next question.
struct Probe<'a> {
    target: &'a Target,
    publisher: &'a Publisher,
    channel: Option<Channel>,
}

impl Probe<'_> {
    async fn count(&mut self, queue: &str) -> Result<u64> {
        if self.channel.is_none() {
            self.channel = Some(self.publisher.side_channel().await?);
        }
        let channel = self.channel.as_ref().expect("channel was just set");
        let passive = QueueDeclareOptions { passive: true, ..Default::default() };
        match channel.queue_declare(queue.into(), passive, FieldTable::default()).await {
            Ok(q) => Ok(u64::from(q.message_count())),
            Err(e) if is_not_found(&e) => {
                self.channel = None;
                Ok(0)
            }
            Err(e) => Err(self.target.classify(&e, Some(queue))),
        }
    }

    async fn close(self) {
        if let Some(c) = self.channel {
            let _ = c.close(200, "counted".into()).await;
        }
    }
}

type DeliveryStream = Pin<Box<dyn Stream<Item = (JobKind, lapin::Result<lapin::message::Delivery>)> + Send + Sync>>;

struct AmqpConsumer {
    target: Arc<Target>,
    publisher: Arc<Publisher>,
    kinds: Vec<JobKind>,
    prefetch: u16,
    live: Option<ConsumeLink>,
    cancelled: bool,
}

struct ConsumeLink {
    conn: Connection,
    channel: Channel,
    tags: Vec<String>,
    stream: SelectAll<DeliveryStream>,
}

impl AmqpConsumer {
    /// Connects, declares the kinds' queues, sets the prefetch and starts one consumer per
    /// work queue on one channel.
    async fn establish(&self, within: Duration) -> Result<ConsumeLink> {
        let t = &self.target;
        let conn = t.connect("consumer", within).await?;
        let channel = conn.create_channel().await.map_err(|e| t.classify(&e, None))?;
        // `global`: the limit is shared by all the kinds' consumers on this channel.
        channel.basic_qos(self.prefetch, BasicQosOptions { global: true }).await.map_err(|e| t.classify(&e, None))?;
        let mut stream = SelectAll::new();
        let mut tags = Vec::new();
        for kind in &self.kinds {
            t.declare_kind(&channel, *kind).await?;
            let queue = t.options.work_queue(*kind);
            let consumer = channel
                .basic_consume(queue.as_str().into(), "".into(), BasicConsumeOptions::default(), FieldTable::default())
                .await
                .map_err(|e| t.classify(&e, Some(&queue)))?;
            tags.push(consumer.tag().to_string());
            let kind = *kind;
            let s: DeliveryStream = Box::pin(consumer.map(move |d| (kind, d)));
            stream.push(s);
        }
        tracing::debug!(broker = %t.shown, kinds = ?self.kinds, prefetch = self.prefetch, "consuming");
        Ok(ConsumeLink { conn, channel, tags, stream })
    }
}

#[async_trait]
impl Consumer for AmqpConsumer {
    async fn next(&mut self) -> Result<Option<Delivery>> {
        loop {
            if self.cancelled {
                return Ok(None);
            }
            if self.live.is_none() {
                let link = self.establish(self.target.options.reconnect_timeout).await.map_err(|e| match e {
                    QueueError::Unreachable { detail, .. } | QueueError::Broker { detail, .. } => QueueError::Disconnected {
                        url: self.target.shown.clone(),
                        secs: self.target.options.reconnect_timeout.as_secs(),
                        detail,
                    },
                    other => other,
                })?;
                tracing::info!(broker = %self.target.shown, kinds = ?self.kinds, "consumer connected; topology declared");
                self.live = Some(link);
            }
            let link = self.live.as_mut().expect("link was just set");
            match link.stream.next().await {
                Some((kind, Ok(d))) => {
                    let settle = AmqpSettle { acker: Some(d.acker), kind, publisher: self.publisher.clone(), target: self.target.clone() };
                    return Ok(Some(Delivery::new(
                        kind,
                        Bytes::from(d.data),
                        d.redelivered,
                        self.target.options.clone(),
                        Box::new(settle),
                    )));
                }
                Some((_, Err(e))) => {
                    tracing::warn!(broker = %self.target.shown, error = %e, "consumer connection lost; reconnecting (unsettled deliveries will be redelivered)");
                    self.live = None;
                }
                None => {
                    if self.cancelled {
                        return Ok(None);
                    }
                    tracing::warn!(broker = %self.target.shown, "the broker ended the consumer (queue deleted or broker stopping); reconnecting");
                    if let Some(link) = self.live.take() {
                        let _ = link.conn.close(200, "consumer ended".into()).await;
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }

    async fn cancel(&mut self) -> Result<()> {
        self.cancelled = true;
        if let Some(link) = &self.live {
            for tag in &link.tags {
                // Best effort: if the connection is gone, nothing will be delivered anyway.
                let _ = link.channel.basic_cancel(tag.as_str().into(), Default::default()).await;
            }
        }
        Ok(())
    }

    async fn close(&mut self) -> Result<()> {
        self.cancel().await?;
        if let Some(link) = self.live.take() {
            let _ = link.conn.close(200, "worker stopping".into()).await;
        }
        Ok(())
    }
}

struct AmqpSettle {
    acker: Option<lapin::Acker>,
    kind: JobKind,
    publisher: Arc<Publisher>,
    target: Arc<Target>,
}

impl AmqpSettle {
    fn lost(&self, detail: String) -> QueueError {
        QueueError::SettleLost { kind: self.kind, detail }
    }

    async fn ack_now(&mut self) -> Result<()> {
        let acker = self.acker.take().expect("settled once");
        match acker.ack(BasicAckOptions::default()).await {
            Ok(true) => Ok(()),
            Ok(false) => Err(self.lost("the channel closed before the ack".into())),
            Err(e) => Err(self.lost(e.to_string())),
        }
    }
}

impl Drop for AmqpSettle {
    fn drop(&mut self) {
        // Unsettled: hand it back now rather than when the channel closes.
        if let Some(acker) = self.acker.take() {
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    let _ = acker.nack(BasicNackOptions { requeue: true, multiple: false }).await;
                });
            }
        }
    }
}

#[async_trait]
impl Settle for AmqpSettle {
    async fn ack(mut self: Box<Self>) -> Result<()> {
        self.ack_now().await
    }

    async fn requeue(mut self: Box<Self>) -> Result<()> {
        let acker = self.acker.take().expect("settled once");
        match acker.nack(BasicNackOptions { requeue: true, multiple: false }).await {
            Ok(true) => Ok(()),
            Ok(false) => Err(self.lost("the channel closed before the requeue".into())),
            Err(e) => Err(self.lost(e.to_string())),
        }
    }

    async fn retry(mut self: Box<Self>, body: Bytes, delay: Duration) -> Result<()> {
        let queue = self.target.options.delay_queue(self.kind, delay);
        self.publisher.send(vec![Outgoing { kind: self.kind, queue, body, message_id: None, headers: None }]).await?;
        self.ack_now().await
    }

    async fn dead_letter(mut self: Box<Self>, letter: DeadLetter) -> Result<()> {
        let mut h = FieldTable::default();
        h.insert(H_REASON.into(), AMQPValue::LongString(letter.reason.as_str().into()));
        h.insert(H_ATTEMPTS.into(), AMQPValue::LongLongInt(i64::from(letter.attempts)));
        h.insert(H_JOB_ID.into(), AMQPValue::LongString(letter.job_id.clone().unwrap_or_default().into()));
        h.insert(H_DEAD_AT.into(), AMQPValue::LongLongInt(letter.dead_at_ms));
        let queue = self.target.options.dead_queue(self.kind);
        self.publisher
            .send(vec![Outgoing { kind: self.kind, queue, body: letter.body, message_id: letter.job_id, headers: Some(h) }])
            .await?;
        self.ack_now().await
    }
}
