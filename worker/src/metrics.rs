//! Prometheus metrics of a worker and the small HTTP endpoint that serves them
//! (`harness-s worker --metrics-addr 127.0.0.1:PORT`, then `GET /metrics`).
//!
//! Families (label `kind`): `harness_s_jobs_started_total`, `…_succeeded_total`,
//! `…_skipped_total` (done-marker already present), `…_retried_total`,
//! `…_dead_lettered_total`, the gauge `harness_s_jobs_in_flight` and the histogram
//! `harness_s_job_duration_seconds`.

use std::net::SocketAddr;
use std::sync::Arc;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use schemas::JobKind;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    pub kind: String,
}

fn label(kind: JobKind) -> KindLabel {
    KindLabel { kind: kind.as_str().to_string() }
}

/// The worker's counters. Cheap to clone (shared inside).
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    started: Family<KindLabel, Counter>,
    succeeded: Family<KindLabel, Counter>,
    skipped: Family<KindLabel, Counter>,
    retried: Family<KindLabel, Counter>,
    dead_lettered: Family<KindLabel, Counter>,
    in_flight: Gauge,
    duration: Family<KindLabel, Histogram>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("harness_s");
        let started = Family::<KindLabel, Counter>::default();
        let succeeded = Family::<KindLabel, Counter>::default();
        let skipped = Family::<KindLabel, Counter>::default();
        let retried = Family::<KindLabel, Counter>::default();
        let dead_lettered = Family::<KindLabel, Counter>::default();
        let in_flight = Gauge::default();
        // 1 ms … ~33 min, doubling: covers a no-op sleep job and a long learner step.
        let duration =
            Family::<KindLabel, Histogram>::new_with_constructor(|| Histogram::new(exponential_buckets(0.001, 2.0, 22)));
        registry.register("jobs_started", "Jobs whose handler was started", started.clone());
        registry.register("jobs_succeeded", "Jobs committed (done-marker written) and acked", succeeded.clone());
        registry.register("jobs_skipped", "Deliveries acked without running because the done-marker existed", skipped.clone());
        registry.register("jobs_retried", "Retryable failures scheduled again with backoff", retried.clone());
        registry.register("jobs_dead_lettered", "Jobs and malformed messages moved to the dead-letter queue", dead_lettered.clone());
        registry.register("jobs_in_flight", "Jobs running now", in_flight.clone());
        registry.register("job_duration_seconds", "Handler run time", duration.clone());
        Metrics { registry: Arc::new(registry), started, succeeded, skipped, retried, dead_lettered, in_flight, duration }
    }

    pub fn started(&self, kind: JobKind) {
        self.started.get_or_create(&label(kind)).inc();
        self.in_flight.inc();
    }

    pub fn finished_running(&self, kind: JobKind, seconds: f64) {
        self.in_flight.dec();
        self.duration.get_or_create(&label(kind)).observe(seconds);
    }

    pub fn succeeded(&self, kind: JobKind) {
        self.succeeded.get_or_create(&label(kind)).inc();
    }

    pub fn skipped(&self, kind: JobKind) {
        self.skipped.get_or_create(&label(kind)).inc();
    }

    pub fn retried(&self, kind: JobKind) {
        self.retried.get_or_create(&label(kind)).inc();
    }

    pub fn dead_lettered(&self, kind: JobKind) {
        self.dead_lettered.get_or_create(&label(kind)).inc();
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }

    /// Serves `GET /metrics` (any path, in fact) on `addr` until the returned task is
    /// aborted. Returns the bound address (useful with port 0).
    pub async fn serve(&self, addr: SocketAddr) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let bound = listener.local_addr()?;
        let metrics = self.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { continue };
                let metrics = metrics.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |_req: Request<hyper::body::Incoming>| {
                        let body = metrics.render();
                        async move {
                            Ok::<_, std::convert::Infallible>(
                                Response::builder()
                                    .header("content-type", "application/openmetrics-text; version=1.0.0; charset=utf-8")
                                    .body(Full::new(Bytes::from(body)))
                                    .expect("static headers are valid"),
                            )
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
                });
            }
        });
        Ok((bound, task))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_by_kind() {
        let m = Metrics::new();
        m.started(JobKind::Sleep);
        m.finished_running(JobKind::Sleep, 0.01);
        m.succeeded(JobKind::Sleep);
        let text = m.render();
        assert!(text.contains("harness_s_jobs_succeeded_total{kind=\"sleep\"} 1"), "{text}");
        assert!(text.contains("harness_s_jobs_in_flight 0"), "{text}");
        assert!(text.contains("harness_s_job_duration_seconds_count{kind=\"sleep\"} 1"), "{text}");
    }
}
