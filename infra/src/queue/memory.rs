//! `MemoryQueue`: the in-process queue of the embedded default (`memory://[name]`).
//!
//! A complete backend, not a stub: the same guarantees as RabbitMQ within one process —
//! unsettled deliveries come back (a dropped [`Delivery`] is returned to the front of its
//! queue, marked redelivered), prefetch is bounded, retries wait out their backoff in a
//! delay list, dead letters keep their reason. Messages are kept as encoded bytes, exactly
//! as on the wire, so poison messages behave the same way too.
//!
//! Opening the same `memory://name` twice in one process gives two handles on the same
//! queues (the scheduler and in-process workers share them); the queues disappear with the
//! last handle. Nothing survives the process: durability across crashes needs `amqp://`.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use schemas::{JobEnvelope, JobKind};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::{encode, Consumer, DeadLetter, Delivery, Queue, QueueError, QueueOptions, QueueStats, Result, Settle};

/// The in-process queue. See the module docs.
pub struct MemoryQueue {
    url: String,
    options: Arc<QueueOptions>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for MemoryQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryQueue").field("url", &self.url).finish()
    }
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    /// Woken on every change that may let a consumer proceed.
    notify: Notify,
}

/// Queues by work-queue name (`<prefix>.<kind>`), so that prefixes isolate as on a broker.
#[derive(Default)]
struct State {
    queues: HashMap<String, KindQueues>,
}

#[derive(Default)]
struct KindQueues {
    ready: VecDeque<Message>,
    /// Retried messages with the time they become ready, in insertion order.
    delayed: Vec<(Instant, Bytes)>,
    dead: Vec<DeadLetter>,
}

struct Message {
    body: Bytes,
    redelivered: bool,
}

impl KindQueues {
    /// Moves due delayed messages to the back of the ready queue; returns the earliest
    /// due time still pending.
    fn promote(&mut self, now: Instant) -> Option<Instant> {
        let mut earliest = None;
        let mut i = 0;
        while i < self.delayed.len() {
            if self.delayed[i].0 <= now {
                let (_, body) = self.delayed.remove(i);
                self.ready.push_back(Message { body, redelivered: false });
            } else {
                earliest = Some(earliest.map_or(self.delayed[i].0, |e: Instant| e.min(self.delayed[i].0)));
                i += 1;
            }
        }
        earliest
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the queues half-changed (every
        // critical section is a single push or pop), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn registry() -> &'static Mutex<HashMap<String, Weak<Shared>>> {
    static REGISTRY: OnceLock<Mutex<HashMap<String, Weak<Shared>>>> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

impl MemoryQueue {
    /// Opens `memory://[name][?options]`; handles with the same name share their queues.
    pub fn open(url: &str) -> Result<Arc<MemoryQueue>> {
        let (options, rest) = QueueOptions::from_url(url)?;
        if let Some(q) = rest.query() {
            return Err(QueueError::InvalidUrl {
                url: url.to_string(),
                reason: format!("unknown query parameters `{q}` for memory://; known: prefix, max_attempts, retry_base_ms, retry_max_ms"),
            });
        }
        let name = format!("{}{}", rest.host_str().unwrap_or(""), rest.path());
        let name = if name.is_empty() { "default".to_string() } else { name };
        let mut reg = registry().lock().unwrap_or_else(|p| p.into_inner());
        reg.retain(|_, w| w.strong_count() > 0);
        let shared = match reg.get(&name).and_then(Weak::upgrade) {
            Some(s) => s,
            None => {
                let s = Arc::new(Shared::default());
                reg.insert(name, Arc::downgrade(&s));
                s
            }
        };
        Ok(Arc::new(MemoryQueue { url: url.to_string(), options: Arc::new(options), shared }))
    }

    /// A private queue that no other `open` can reach.
    pub fn private(options: QueueOptions) -> Arc<MemoryQueue> {
        Arc::new(MemoryQueue {
            url: format!("memory://private?prefix={}", options.prefix),
            options: Arc::new(options),
            shared: Arc::new(Shared::default()),
        })
    }

    fn push(&self, kind: JobKind, bodies: impl IntoIterator<Item = Bytes>) {
        {
            let mut st = self.shared.lock();
            let q = st.queues.entry(self.options.work_queue(kind)).or_default();
            q.ready.extend(bodies.into_iter().map(|body| Message { body, redelivered: false }));
        }
        self.shared.notify.notify_waiters();
    }
}

#[async_trait]
impl Queue for MemoryQueue {
    fn url(&self) -> String {
        self.url.clone()
    }

    fn options(&self) -> &QueueOptions {
        &self.options
    }

    async fn publish_many(&self, jobs: &[JobEnvelope]) -> Result<()> {
        for job in jobs {
            self.push(job.kind, [encode(job)?]);
        }
        Ok(())
    }

    async fn publish_raw(&self, kind: JobKind, body: Bytes) -> Result<()> {
        self.push(kind, [body]);
        Ok(())
    }

    async fn consume(&self, kinds: &[JobKind], prefetch: u16) -> Result<Box<dyn Consumer>> {
        let mut kinds = kinds.to_vec();
        kinds.sort();
        kinds.dedup();
        Ok(Box::new(MemoryConsumer {
            shared: self.shared.clone(),
            options: self.options.clone(),
            kinds,
            prefetch: usize::from(prefetch.max(1)),
            outstanding: Arc::new(AtomicUsize::new(0)),
            cancelled: false,
            next_kind: 0,
        }))
    }

    async fn stats(&self, kind: JobKind) -> Result<QueueStats> {
        let mut st = self.shared.lock();
        let Some(q) = st.queues.get_mut(&self.options.work_queue(kind)) else {
            return Ok(QueueStats::default());
        };
        q.promote(Instant::now());
        Ok(QueueStats { ready: q.ready.len() as u64, delayed: q.delayed.len() as u64, dead: q.dead.len() as u64 })
    }

    async fn dead_letters(&self, kind: JobKind, limit: usize) -> Result<Vec<DeadLetter>> {
        let st = self.shared.lock();
        Ok(st.queues.get(&self.options.work_queue(kind)).map(|q| q.dead.iter().take(limit).cloned().collect()).unwrap_or_default())
    }

    async fn delete_all(&self) -> Result<()> {
        let mut st = self.shared.lock();
        let prefix = format!("{}.", self.options.prefix);
        st.queues.retain(|name, _| !name.starts_with(&prefix));
        Ok(())
    }
}

struct MemoryConsumer {
    shared: Arc<Shared>,
    options: Arc<QueueOptions>,
    kinds: Vec<JobKind>,
    prefetch: usize,
    /// Deliveries handed out and not yet settled (shared with their settle handles).
    outstanding: Arc<AtomicUsize>,
    cancelled: bool,
    /// Round-robin start, so that one busy kind does not starve the others.
    next_kind: usize,
}

impl MemoryConsumer {
    /// Takes a ready message if the prefetch window allows; otherwise returns when to look
    /// again (`None`: only when notified).
    fn try_take(&mut self) -> std::result::Result<Delivery, Option<Instant>> {
        let mut st = self.shared.lock();
        let now = Instant::now();
        let mut earliest: Option<Instant> = None;
        for kind in &self.kinds {
            if let Some(q) = st.queues.get_mut(&self.options.work_queue(*kind)) {
                if let Some(due) = q.promote(now) {
                    earliest = Some(earliest.map_or(due, |e| e.min(due)));
                }
            }
        }
        if self.outstanding.load(Ordering::SeqCst) >= self.prefetch {
            return Err(earliest);
        }
        let n = self.kinds.len();
        for i in 0..n {
            let kind = self.kinds[(self.next_kind + i) % n];
            let name = self.options.work_queue(kind);
            if let Some(msg) = st.queues.get_mut(&name).and_then(|q| q.ready.pop_front()) {
                self.next_kind = (self.next_kind + i + 1) % n;
                self.outstanding.fetch_add(1, Ordering::SeqCst);
                let settle = MemorySettle {
                    shared: self.shared.clone(),
                    queue: name,
                    body: msg.body.clone(),
                    outstanding: self.outstanding.clone(),
                    settled: false,
                };
                return Ok(Delivery::new(kind, msg.body, msg.redelivered, self.options.clone(), Box::new(settle)));
            }
        }
        Err(earliest)
    }
}

#[async_trait]
impl Consumer for MemoryConsumer {
    async fn next(&mut self) -> Result<Option<Delivery>> {
        loop {
            if self.cancelled || self.kinds.is_empty() {
                return Ok(None);
            }
            // Register for wake-ups before looking, so a change between the look and the
            // wait is not missed.
            let shared = self.shared.clone();
            let notified = shared.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            match self.try_take() {
                Ok(d) => return Ok(Some(d)),
                Err(Some(due)) => {
                    tokio::select! {
                        _ = &mut notified => {}
                        _ = tokio::time::sleep_until(due) => {}
                    }
                }
                Err(None) => notified.await,
            }
        }
    }

    async fn cancel(&mut self) -> Result<()> {
        self.cancelled = true;
        Ok(())
    }

    async fn close(&mut self) -> Result<()> {
        self.cancel().await
    }
}

struct MemorySettle {
    shared: Arc<Shared>,
    queue: String,
    body: Bytes,
    outstanding: Arc<AtomicUsize>,
    settled: bool,
}

impl MemorySettle {
    fn finish(&mut self, f: impl FnOnce(&mut KindQueues)) {
        {
            let mut st = self.shared.lock();
            f(st.queues.entry(self.queue.clone()).or_default());
        }
        self.settled = true;
        self.outstanding.fetch_sub(1, Ordering::SeqCst);
        self.shared.notify.notify_waiters();
    }
}

impl Drop for MemorySettle {
    fn drop(&mut self) {
        if !self.settled {
            // At-least-once: an unsettled delivery goes back to the front of its queue.
            let body = self.body.clone();
            self.finish(|q| q.ready.push_front(Message { body, redelivered: true }));
        }
    }
}

#[async_trait]
impl Settle for MemorySettle {
    async fn ack(mut self: Box<Self>) -> Result<()> {
        self.finish(|_| {});
        Ok(())
    }

    async fn requeue(mut self: Box<Self>) -> Result<()> {
        let body = self.body.clone();
        self.finish(|q| q.ready.push_front(Message { body, redelivered: true }));
        Ok(())
    }

    async fn retry(mut self: Box<Self>, body: Bytes, delay: Duration) -> Result<()> {
        let due = Instant::now() + delay;
        self.finish(|q| q.delayed.push((due, body)));
        Ok(())
    }

    async fn dead_letter(mut self: Box<Self>, letter: DeadLetter) -> Result<()> {
        self.finish(|q| q.dead.push(letter));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::queue::RetryOutcome;

    fn job(n: u32) -> JobEnvelope {
        JobEnvelope {
            schema_version: 1,
            job_id: format!("job-{n}"),
            run_id: "r".into(),
            kind: JobKind::Sleep,
            attempt: 0,
            payload: serde_json::json!({"millis": 0}),
            created_at_ms: 0,
            not_before_ms: None,
            deadline_ms: None,
        }
    }

    #[tokio::test]
    async fn a_dropped_delivery_comes_back_marked_redelivered() {
        let q = MemoryQueue::private(QueueOptions::default());
        q.publish(&job(1)).await.unwrap();
        let mut c = q.consume(&[JobKind::Sleep], 1).await.unwrap();
        let d = c.next().await.unwrap().unwrap();
        assert!(!d.redelivered());
        drop(d);
        let d = c.next().await.unwrap().unwrap();
        assert!(d.redelivered());
        assert_eq!(d.envelope().unwrap().job_id, "job-1");
        d.ack().await.unwrap();
        assert_eq!(q.stats(JobKind::Sleep).await.unwrap(), QueueStats::default());
    }

    #[tokio::test]
    async fn prefetch_bounds_unsettled_deliveries() {
        let q = MemoryQueue::private(QueueOptions::default());
        q.publish_many(&[job(1), job(2), job(3)]).await.unwrap();
        let mut c = q.consume(&[JobKind::Sleep], 2).await.unwrap();
        let a = c.next().await.unwrap().unwrap();
        let _b = c.next().await.unwrap().unwrap();
        let third = tokio::time::timeout(Duration::from_millis(50), c.next()).await;
        assert!(third.is_err(), "a third delivery went past prefetch 2");
        a.ack().await.unwrap();
        let c3 = tokio::time::timeout(Duration::from_secs(1), c.next()).await.unwrap().unwrap().unwrap();
        assert_eq!(c3.envelope().unwrap().job_id, "job-3");
    }

    /// Real time with a 10 ms base (tokio's paused clock would need its `test-util` feature,
    /// which as a dev-dependency feature made every crate on tokio build twice: once for the
    /// binaries, once for the tests). Only lower bounds are asserted: a delay is never short.
    #[tokio::test]
    async fn retries_back_off_then_dead_letter() {
        let opts = QueueOptions {
            max_attempts: 3,
            retry_base: Duration::from_millis(10),
            retry_max: Duration::from_millis(100),
            ..Default::default()
        };
        let q = MemoryQueue::private(opts);
        q.publish(&job(1)).await.unwrap();
        let mut c = q.consume(&[JobKind::Sleep], 1).await.unwrap();
        let mut seen = vec![];
        loop {
            let start = Instant::now();
            let d = c.next().await.unwrap().unwrap();
            let env = d.envelope().unwrap();
            seen.push((env.attempt, start.elapsed()));
            if let RetryOutcome::DeadLettered { attempts } = d.retry(&env, "boom").await.unwrap() {
                assert_eq!(attempts, 3);
                break;
            }
        }
        assert_eq!(seen.iter().map(|(attempt, _)| *attempt).collect::<Vec<_>>(), vec![0, 1, 2]);
        // attempt n waits base · 2^(n-1): 10 ms, then 20 ms
        assert!(seen[1].1 >= Duration::from_millis(10), "{seen:?}");
        assert!(seen[2].1 >= Duration::from_millis(20), "{seen:?}");
        let dead = q.dead_letters(JobKind::Sleep, 10).await.unwrap();
        assert_eq!(dead.len(), 1);
        assert!(dead[0].reason.contains("gave up after 3 attempts") && dead[0].reason.contains("boom"));
        assert_eq!(dead[0].job_id.as_deref(), Some("job-1"));
    }

    #[tokio::test]
    async fn prefixes_and_names_isolate() {
        let a = MemoryQueue::open("memory://iso-test?prefix=a").unwrap();
        let b = MemoryQueue::open("memory://iso-test?prefix=b").unwrap();
        let a2 = MemoryQueue::open("memory://iso-test?prefix=a").unwrap();
        a.publish(&job(1)).await.unwrap();
        assert_eq!(b.stats(JobKind::Sleep).await.unwrap().ready, 0);
        assert_eq!(a2.stats(JobKind::Sleep).await.unwrap().ready, 1);
        let other = MemoryQueue::open("memory://iso-other?prefix=a").unwrap();
        assert_eq!(other.stats(JobKind::Sleep).await.unwrap().ready, 0);
        assert!(MemoryQueue::open("memory://x?bogus=1").unwrap_err().to_string().contains("bogus"));
    }
}
