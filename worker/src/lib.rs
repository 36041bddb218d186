//! The worker process: pulls job envelopes from a queue, runs the registered handler for
//! each kind, writes outputs and the done-marker through the object store, then acks.
//!
//! - [`Worker`] (in [`runtime`]): the consumer loop, deadlines, the durability contract
//!   (marker present → ack and skip; otherwise run, write outputs, write the marker LAST,
//!   then ack), typed failures (retry with backoff or dead-letter), graceful shutdown.
//! - [`Registry`] and [`Handler`] (in [`handler`]): what runs for each
//!   [`schemas::JobKind`]; [`JobFailure`] decides between retry and dead-letter.
//! - [`Metrics`] (in [`metrics`]): Prometheus counters and the `/metrics` endpoint.
//!
//! `harness-s worker --queue URL --store URL --queues sleep --concurrency 4` wraps it.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use worker::{Registry, Worker, WorkerConfig};
//! let queue = infra::queue::open_queue("memory://demo").await?;
//! let store = infra::store::open_store("file:///tmp/harness-s-demo").await?;
//! let config = WorkerConfig::new(vec![schemas::JobKind::Sleep], 4);
//! let worker = Worker::new(queue, store, Registry::builtin(), config)?;
//! let summary = worker.run(async { let _ = tokio::signal::ctrl_c().await; }).await?;
//! println!("{summary}");
//! # Ok(()) }
//! ```

pub mod handler;
pub mod metrics;
pub mod runtime;

pub use handler::{Handler, JobContext, JobFailure, JobOutput, Registry, SleepHandler};
pub use metrics::Metrics;
pub use runtime::{JobEvent, Outcome, Worker, WorkerConfig, WorkerError, WorkerSummary};
