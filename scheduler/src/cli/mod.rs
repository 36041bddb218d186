//! Argument parsing and dispatch. One file per subcommand group.

use clap::{Args, Parser, Subcommand};

mod bench;
mod harness;
mod store;

/// harness-s: train LLM agents with Harness-S (sibling-harness rescue for GRPO).
#[derive(Debug, Parser)]
#[command(name = "harness-s", version, about, propagate_version = true)]
pub struct Cli {
    #[command(flatten)]
    pub global: GlobalArgs,
    #[command(subcommand)]
    pub command: Command,
}

/// Options every subcommand takes.
#[derive(Debug, Args)]
pub struct GlobalArgs {
    /// Log format: `human` or `json` (JSON lines for log shippers).
    #[arg(long, global = true, default_value = "human", value_parser = ["human", "json"])]
    pub log_format: String,
    /// Log filter (tracing's EnvFilter syntax); also read from RUST_LOG.
    #[arg(long, global = true, env = "RUST_LOG", default_value = "info")]
    pub log: String,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Inspect an object store: list objects, print Parquet rows as JSON lines.
    #[command(subcommand)]
    Store(store::StoreCommand),
    /// Benchmarks that print a table.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Harness specs: validate one, or show the edits between two.
    #[command(subcommand)]
    Harness(harness::HarnessCommand),
}

/// Sets up tracing to stderr in the chosen format.
pub fn init_tracing(global: &GlobalArgs) {
    let filter = tracing_subscriber::EnvFilter::try_new(&global.log)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    if global.log_format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }
}

/// Runs a parsed command; returns the process exit code.
pub async fn dispatch(cli: Cli) -> anyhow::Result<u8> {
    match cli.command {
        Command::Store(cmd) => store::run(cmd).await,
        Command::Bench(cmd) => bench::run(cmd).await,
        Command::Harness(cmd) => harness::run(cmd).await,
    }
}
