//! `harness-s bench ...`: benchmarks that print a table. Speed and memory targets live
//! here, never in timed tests.

use clap::Subcommand;

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Write and read synthetic trajectories as Parquet; compare with JSON lines.
    Storage(crate::bench::storage::StorageArgs),
    /// Job-queue throughput and enqueue-to-ack latency (memory://, RabbitMQ, Celery peer).
    Queue(crate::bench::queue::QueueArgs),
    /// Native sampler tokens/s vs llama-cpp-python's server on the same GGUF and threads.
    Sampler(crate::bench::sampler::SamplerArgs),
    /// `harness-s serve` beside llama.cpp's server: requests/s, tokens/s, p50/p99 latency at 1, 8, 32 clients.
    Serve(crate::bench::serve::ServeArgs),
    /// GRPO step: policy tokens/s and peak memory at several sequence lengths and group sizes.
    Learner(crate::bench::learner::LearnerArgs),
}

pub async fn run(cmd: BenchCommand) -> anyhow::Result<u8> {
    match cmd {
        BenchCommand::Storage(a) => crate::bench::storage::run(a).await,
        BenchCommand::Queue(a) => crate::bench::queue::run(a).await,
        BenchCommand::Sampler(a) => crate::bench::sampler::run(a).await,
        BenchCommand::Learner(a) => crate::bench::learner::run(a).await,
        BenchCommand::Serve(a) => crate::bench::serve::run(a).await,
    }
}
