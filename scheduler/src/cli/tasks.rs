//! `harness-s tasks ...`: DBBench task files.
//!
//! - `tasks check FILE --engine sqlite|mysql [--db-url URL]` sends every task's gold
//!   answer through the environment and its grader (write tasks replay their gold SQL,
//!   read tasks commit their label) and prints agreement per task type: a data and engine
//!   sanity check. Exit 0 when every task agrees and every line loaded, 1 otherwise.
//! - `tasks generate --seed S --n N --out FILE [--difficulty easy|medium|hard|mixed]`
//!   writes DBBench-format tasks over generated tables, answers computed on SQLite.
//!
//! ```text
//! harness-s tasks check tests/data/dbbench/dev.jsonl --engine mysql --db-url mysql://root@127.0.0.1:3306
//! harness-s tasks generate --seed 1 --n 200 --out tasks.jsonl --difficulty easy
//! ```

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};

use jobs::env::dbbench::check::check_tasks;
use jobs::env::dbbench::generate::{for_each_task, Difficulty, GenerateOptions};
use jobs::env::dbbench::{DbBenchConfig, TaskSet};

use crate::exit;

#[derive(Debug, Subcommand)]
pub enum TasksCommand {
    /// Replay every task's gold answer through the environment and grader; print agreement per task type.
    Check(CheckArgs),
    /// Write generated DBBench-format tasks (answers computed on SQLite).
    Generate(GenerateArgs),
}

#[derive(Debug, Args)]
pub struct CheckArgs {
    /// DBBench-format task file (JSONL).
    #[arg(value_name = "FILE")]
    pub file: PathBuf,
    /// `sqlite` (embedded, in memory) or `mysql` (a MySQL/MariaDB server, with --db-url).
    #[arg(long, default_value = "sqlite", value_parser = ["sqlite", "mysql"])]
    pub engine: String,
    /// Server URL for --engine mysql, e.g. mysql://root@127.0.0.1:3306.
    #[arg(long, value_name = "URL", env = "HARNESS_S_DB_URL", hide_env_values = true)]
    pub db_url: Option<String>,
    /// Print every task's verdict, not only the disagreements.
    #[arg(long)]
    pub verbose: bool,
    /// Read tasks: commit what the gold SQL returns (run on SQLite) instead of the label,
    /// so that a label that disagrees with its own query fails.
    #[arg(long)]
    pub verify_labels: bool,
}

#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// Random seed; the same seed gives the same file.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Number of tasks, at most 1000000 (written to --out as they are generated).
    #[arg(long = "n", value_name = "N")]
    pub n: usize,
    /// Output JSONL file (overwritten).
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
    /// `easy`, `medium`, `hard` or `mixed` (2 : 2 : 1).
    #[arg(long, default_value = "mixed", value_parser = ["easy", "medium", "hard", "mixed"])]
    pub difficulty: String,
    /// Only these kinds (comma-separated): counting, aggregation, ranking, comparison, lookup, INSERT, UPDATE.
    #[arg(long, value_delimiter = ',', value_name = "KIND,...")]
    pub kinds: Vec<String>,
}

pub async fn run(cmd: TasksCommand) -> anyhow::Result<u8> {
    match cmd {
        TasksCommand::Check(args) => check(args).await,
        TasksCommand::Generate(args) => generate_file(args),
    }
}

async fn check(args: CheckArgs) -> anyhow::Result<u8> {
    let config = DbBenchConfig::from_engine_name(&args.engine, args.db_url.as_deref())?;
    let loaded = TaskSet::load(&args.file)?;
    for problem in &loaded.problems {
        eprintln!("warning: skipped {problem}");
    }
    if loaded.tasks.is_empty() {
        bail!("{}: no valid task to check", args.file.display());
    }
    let bar = ProgressBar::new(loaded.tasks.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{spinner} checking {pos}/{len} tasks on {msg} [{elapsed}]")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message(args.engine.clone());
    let report = check_tasks(Arc::new(loaded.tasks), &config, args.verify_labels, |_| bar.inc(1))
        .await
        .with_context(|| format!("checking {} on {}", args.file.display(), args.engine))?;
    bar.finish_and_clear();

    println!("{} on {}", args.file.display(), report.engine);
    print!("{}", report.table());
    let disagreements: Vec<_> = report.checks.iter().filter(|c| !c.agreed).collect();
    for c in &report.checks {
        if args.verbose || !c.agreed {
            println!("{} {} ({}): {}", if c.agreed { "ok  " } else { "FAIL" }, c.task_id, c.task_type, c.detail);
        }
    }
    if !loaded.problems.is_empty() {
        println!("{} line(s) could not be loaded (see the warnings above)", loaded.problems.len());
    }
    Ok(if disagreements.is_empty() && loaded.problems.is_empty() { exit::OK } else { exit::FAILED })
}

fn generate_file(args: GenerateArgs) -> anyhow::Result<u8> {
    use std::io::Write;
    let difficulty = match args.difficulty.as_str() {
        "mixed" => None,
        d => Some(d.parse::<Difficulty>()?),
    };
    let opts = GenerateOptions { seed: args.seed, n: args.n, difficulty, kinds: args.kinds.clone() };
    opts.check()?;
    // Written as generated, into a file beside --out that replaces it once complete: a
    // failure or an interruption leaves no half-written --out.
    let cannot = |e: &dyn std::fmt::Display| anyhow::anyhow!("cannot write --out {}: {e}", args.out.display());
    let mut partial = args.out.clone().into_os_string();
    partial.push(".partial");
    let partial = PathBuf::from(partial);
    let file = std::fs::File::create(&partial).map_err(|e| cannot(&e))?;
    let mut writer = std::io::BufWriter::new(file);
    let mut counts: BTreeMap<(String, String), usize> = BTreeMap::new();
    let written = for_each_task(&opts, |t| {
        let ty = t["type"][0].as_str().unwrap_or("?").to_string();
        let level = t["difficulty"].as_str().unwrap_or("?").to_string();
        *counts.entry((ty, level)).or_default() += 1;
        writeln!(writer, "{t}").map_err(|e| cannot(&e))
    })
    .and_then(|n| writer.flush().map(|()| n).map_err(|e| cannot(&e)));
    let written = match written.and_then(|n| std::fs::rename(&partial, &args.out).map(|()| n).map_err(|e| cannot(&e))) {
        Ok(n) => n,
        Err(e) => {
            let _ = std::fs::remove_file(&partial);
            return Err(e);
        }
    };
    println!("wrote {written} tasks to {} (seed {})", args.out.display(), args.seed);
    println!("{:<18}  {:>4}  {:>6}  {:>4}", "task type", "easy", "medium", "hard");
    let types: Vec<String> = {
        let mut t: Vec<String> = counts.keys().map(|(ty, _)| ty.clone()).collect();
        t.dedup();
        t
    };
    for ty in types {
        let n = |level: &str| counts.get(&(ty.clone(), level.to_string())).copied().unwrap_or(0);
        println!("{ty:<18}  {:>4}  {:>6}  {:>4}", n("easy"), n("medium"), n("hard"));
    }
    Ok(exit::OK)
}
