//! Prometheus metrics of a worker and the small HTTP endpoint that serves them
//! (`harness-s worker --metrics-addr 127.0.0.1:PORT`, then `GET /metrics`).
//!
//! Families (label `kind`): `harness_s_jobs_started_total`, `…_succeeded_total`,
//! `…_skipped_total` (done-marker already present), `…_retried_total`,
//! `…_dead_lettered_total`, the gauge `harness_s_jobs_in_flight` and the histogram
//! `harness_s_job_duration_seconds`. A process that drives a run (`harness-s run`,
//! `harness-s scheduler`) adds run-level gauges: `harness_s_run_updates_done`,
//! `…_run_stages_done`, `…_run_rollouts`, `…_run_tokens`, `…_run_mean_reward` (of the
//! latest update's retained groups) and `…_run_h0_validation_success` (latest calibration).

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
    run: RunGauges,
}

/// Run-level gauges, set by the scheduler as stages finish.
#[derive(Clone, Default)]
struct RunGauges {
    updates_done: Gauge,
    stages_done: Gauge,
    rollouts: Gauge,
    tokens: Gauge,
    mean_reward: Gauge<f64, std::sync::atomic::AtomicU64>,
    h0_validation_success: Gauge<f64, std::sync::atomic::AtomicU64>,
}

/// Where a run stands, for the run-level gauges.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RunProgress {
    pub updates_done: u32,
    pub stages_done: usize,
    pub rollouts: u64,
    pub tokens: u64,
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
        let duration = Family::<KindLabel, Histogram>::new_with_constructor(|| Histogram::new(exponential_buckets(0.001, 2.0, 22)));
        registry.register("jobs_started", "Jobs whose handler was started", started.clone());
        registry.register("jobs_succeeded", "Jobs committed (done-marker written) and acked", succeeded.clone());
        registry.register("jobs_skipped", "Deliveries acked without running because the done-marker existed", skipped.clone());
        registry.register("jobs_retried", "Retryable failures scheduled again with backoff", retried.clone());
        registry.register("jobs_dead_lettered", "Jobs and malformed messages moved to the dead-letter queue", dead_lettered.clone());
        registry.register("jobs_in_flight", "Jobs running now", in_flight.clone());
        registry.register("job_duration_seconds", "Handler run time", duration.clone());
        let run = RunGauges::default();
        registry.register("run_updates_done", "Training updates the run has finished", run.updates_done.clone());
        registry.register("run_stages_done", "Stages the run has finished", run.stages_done.clone());
        registry.register("run_rollouts", "Rollouts the run has made (base, rescue and other)", run.rollouts.clone());
        registry.register("run_tokens", "Prompt and completion tokens of the run's rollouts", run.tokens.clone());
        registry.register("run_mean_reward", "Mean reward of the latest update's retained groups", run.mean_reward.clone());
        registry.register(
            "run_h0_validation_success",
            "H0's validation success at the latest calibration",
            run.h0_validation_success.clone(),
        );
        Metrics { registry: Arc::new(registry), started, succeeded, skipped, retried, dead_lettered, in_flight, duration, run }
    }

    /// Sets the run-level gauges.
    pub fn set_run(&self, p: RunProgress) {
        self.run.updates_done.set(i64::from(p.updates_done));
        self.run.stages_done.set(p.stages_done as i64);
        self.run.rollouts.set(p.rollouts as i64);
        self.run.tokens.set(p.tokens as i64);
    }

    /// Records a run metric the gauges follow (`mean_reward`, `h0_validation_success`).
    pub fn observe_run_metric(&self, name: &str, value: f64) {
        match name {
            "mean_reward" => {
                self.run.mean_reward.set(value);
            }
            "h0_validation_success" => {
                self.run.h0_validation_success.set(value);
            }
            _ => {}
        }
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
