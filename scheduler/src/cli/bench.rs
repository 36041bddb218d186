//! `harness-s bench ...`: benchmarks that print a table. Speed and memory targets live
//! here, never in timed tests.

use clap::Subcommand;

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Write and read synthetic trajectories as Parquet; compare with JSON lines.
    Storage(crate::bench::storage::StorageArgs),
}

pub async fn run(cmd: BenchCommand) -> anyhow::Result<u8> {
    match cmd {
        BenchCommand::Storage(a) => crate::bench::storage::run(a).await,
    }
}
