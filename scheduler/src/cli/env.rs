//! `harness-s env serve`: the built-in DBBench environment over AgentBench's controller
//! protocol (the `serve::env` module has the routes), so that runs with `[environment]
//! kind = "http"` reach it from any machine.
//!
//! ```text
//! harness-s env serve --addr 127.0.0.1:5000 --tasks tasks.jsonl
//! harness-s env serve --addr 0.0.0.0:5000 --generate 40,10,10 --seed 1 --kinds comparison,counting
//! harness-s env serve --tasks dev.jsonl --engine mariadb --db-url mysql://root@127.0.0.1:3306 --session-ttl 300
//! ```
//!
//! Samples are numbered in order: the lines of the `--tasks` files one after another, or
//! the generated tasks. `--generate T,V,T` generates the three splits a run spec's
//! `[tasks.generate]` with the same seed, difficulty and kinds would (train first, then
//! validation, then test), so `train = "0-(T-1)"` in the http spec names the same tasks.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use tokio::signal::unix::{signal, SignalKind};

use jobs::env::dbbench::generate::{generate_jsonl, split_seed, Difficulty, GenerateOptions};
use jobs::env::dbbench::{DbBenchConfig, TaskSet};

#[derive(Debug, Subcommand)]
pub enum EnvCommand {
    /// Serve DBBench over AgentBench's controller protocol (start_sample / interact / cancel).
    Serve(EnvServeArgs),
}

#[derive(Debug, Args)]
pub struct EnvServeArgs {
    /// Address to listen on (port 0: any free port, printed at start).
    #[arg(long, default_value = "127.0.0.1:5000")]
    pub addr: SocketAddr,
    /// DBBench task file(s) (JSONL); repeat to serve several, numbered one after another.
    #[arg(long, value_name = "FILE", conflicts_with = "generate")]
    pub tasks: Vec<PathBuf>,
    /// Generated tasks: `N` (as `tasks generate --n N`), or `T,V,T` (the train, validation
    /// and test splits of a run spec's `[tasks.generate]`, in that order).
    #[arg(long, value_name = "N[,N,N]")]
    pub generate: Option<String>,
    /// Seed of --generate (the spec's `[tasks.generate] seed` with `T,V,T`).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Difficulty of --generate: easy, medium, hard or mixed.
    #[arg(long, default_value = "mixed", value_parser = ["easy", "medium", "hard", "mixed"])]
    pub difficulty: String,
    /// Kinds of --generate (comma-separated): counting, aggregation, ranking, comparison, lookup, INSERT, UPDATE.
    #[arg(long, value_delimiter = ',', value_name = "KIND,...")]
    pub kinds: Vec<String>,
    /// `sqlite` (in memory, per session) or `mariadb`/`mysql` (a database per session on --db-url).
    #[arg(long, default_value = "sqlite", value_parser = ["sqlite", "mariadb", "mysql"])]
    pub engine: String,
    /// Server URL for --engine mariadb, e.g. mysql://root@127.0.0.1:3306.
    #[arg(long, value_name = "URL", env = "HARNESS_S_DB_URL", hide_env_values = true)]
    pub db_url: Option<String>,
    /// Prefix of the per-session database names on --db-url (letters, digits, `_`).
    #[arg(long, default_value = "hs_envserve")]
    pub db_prefix: String,
    /// The task set name clients send (`[environment] task_set`).
    #[arg(long, default_value = "dbbench", value_parser = super::non_empty)]
    pub name: String,
    /// Environment actions per episode.
    #[arg(long, default_value_t = jobs::env::dbbench::DEFAULT_MAX_ROUNDS, value_parser = super::at_least_one_u32)]
    pub max_rounds: u32,
    /// Seconds a session may stay idle before the server closes it.
    #[arg(long, default_value_t = 600, value_parser = super::at_least_one_u64)]
    pub session_ttl: u64,
    /// Sessions open at once; more starts are refused with a 503.
    #[arg(long, default_value_t = 1024, value_parser = super::at_least_one)]
    pub max_sessions: usize,
}

pub async fn run(cmd: EnvCommand) -> anyhow::Result<u8> {
    match cmd {
        EnvCommand::Serve(args) => serve(args).await,
    }
}

/// The tasks to serve, in sample order.
fn load_tasks(args: &EnvServeArgs) -> anyhow::Result<TaskSet> {
    let mut all = Vec::new();
    match &args.generate {
        Some(counts) => {
            let counts: Vec<usize> = counts
                .split(',')
                .map(|c| c.trim().parse::<usize>().ok().filter(|n| *n > 0))
                .collect::<Option<_>>()
                .with_context(|| format!("--generate `{counts}`: give N or T,V,T, whole numbers of at least 1 (e.g. 40,10,10)"))?;
            let difficulty = match args.difficulty.as_str() {
                "mixed" => None,
                d => Some(d.parse::<Difficulty>()?),
            };
            let seeds: Vec<u64> = match counts.len() {
                1 => vec![args.seed],
                3 => (0..3).map(|i| split_seed(args.seed, i)).collect(),
                _ => bail!("--generate `{}`: give one count (N) or three (train,validation,test)", args.generate.as_deref().unwrap_or("")),
            };
            for (n, seed) in counts.into_iter().zip(seeds) {
                let text = generate_jsonl(&GenerateOptions { seed, n, difficulty, kinds: args.kinds.clone() }).context("--generate")?;
                all.extend(TaskSet::parse(&text, "generated", "gen").tasks.iter().map(|t| t.as_ref().clone()));
            }
        }
        None => {
            if args.tasks.is_empty() {
                bail!("no tasks to serve: give --tasks FILE (DBBench JSONL) or --generate N");
            }
            for file in &args.tasks {
                let loaded = TaskSet::load(file).map_err(|e| anyhow::anyhow!("--tasks: {e}"))?;
                if !loaded.problems.is_empty() {
                    let lines: Vec<String> = loaded.problems.iter().map(|p| p.to_string()).collect();
                    bail!("--tasks {}: {} bad line(s):\n  {}", file.display(), lines.len(), lines.join("\n  "));
                }
                if loaded.tasks.is_empty() {
                    bail!("--tasks {}: the file holds no tasks", file.display());
                }
                all.extend(loaded.tasks.iter().map(|t| t.as_ref().clone()));
            }
        }
    }
    TaskSet::from_tasks(all).map_err(|e| anyhow::anyhow!("--tasks: the files share task ids ({e}); give each task one id"))
}

async fn serve(args: EnvServeArgs) -> anyhow::Result<u8> {
    let tasks = load_tasks(&args)?;
    let db = DbBenchConfig::from_engine_name(&args.engine, args.db_url.as_deref())
        .map_err(|e| anyhow::anyhow!("--engine {}: {e}", args.engine))?
        .with_max_rounds(args.max_rounds)?
        .with_db_prefix(&args.db_prefix);
    if let jobs::env::dbbench::Engine::Mysql { url } = &db.engine {
        jobs::env::dbbench::check_server(url, Duration::from_secs(10))
            .await
            .with_context(|| format!("--db-url {}", infra::redact_url(url)))?;
    }
    let mut config = serve::env::EnvServerConfig::new(&args.name, &tasks, db);
    config.session_ttl = Duration::from_secs(args.session_ttl);
    config.max_sessions = args.max_sessions;
    let server = serve::env::EnvServer::new(config)?;
    let listener = tokio::net::TcpListener::bind(args.addr).await.with_context(|| format!("--addr: cannot listen on {}", args.addr))?;
    let bound = listener.local_addr()?;
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let shutdown = async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM received; closing the open sessions"),
            _ = int.recv() => tracing::info!("SIGINT received; closing the open sessions"),
        }
    };
    println!(
        "serving {} DBBench samples (0 to {}) of task set `{}` on {} at http://{bound}",
        server.len(),
        server.len() - 1,
        args.name,
        args.engine
    );
    tracing::info!(addr = %bound, "listening");
    serve::env::serve(listener, Arc::clone(&server), shutdown).await?;
    Ok(crate::exit::OK)
}
