//! `harness-s run | submit | scheduler | status | resume | cancel | report`: the main job.
//!
//! `run SPEC` is the embedded default (memory queue, in-process workers, local store);
//! `submit` + `scheduler` + `worker` is the distributed form of the same code path.

use std::io::IsTerminal;
use std::path::PathBuf;

use anyhow::Context;
use bytes::Bytes;
use clap::Args;
use infra::store::open_store;

use crate::run::{self, machine::Finish, spec, state};

use super::{OptQueueArg, QueueArg, StoreArg};

#[derive(Debug, Args)]
pub struct RunArgs {
    /// Run spec (TOML), e.g. examples/quickstart.toml.
    pub spec: PathBuf,
    /// Override a spec key: --set algorithm.updates=5 --set policy.temperature=0.7
    /// (repeatable; typed and checked like the file).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    #[command(flatten)]
    pub store: StoreArg,
    /// In-process workers.
    #[arg(long, default_value_t = 1, value_parser = super::at_least_one)]
    pub workers: usize,
    /// Serve Prometheus metrics (run-level gauges and job counters) on this address, path /metrics.
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,
}

#[derive(Debug, Args)]
pub struct SubmitArgs {
    pub spec: PathBuf,
    /// Override a spec key (repeatable), as for `run`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    #[command(flatten)]
    pub store: StoreArg,
    /// Queue the scheduler will use (checked to be reachable now).
    #[command(flatten)]
    pub queue: OptQueueArg,
}

#[derive(Debug, Args)]
pub struct SchedulerArgs {
    /// Run to drive.
    #[arg(long)]
    pub run: String,
    #[command(flatten)]
    pub store: StoreArg,
    #[command(flatten)]
    pub queue: QueueArg,
    /// Serve Prometheus metrics (run-level gauges) on this address, path /metrics.
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,
}

#[derive(Debug, Args)]
pub struct RunRefArgs {
    /// Run id.
    pub run: String,
    #[command(flatten)]
    pub store: StoreArg,
}

#[derive(Debug, Args)]
pub struct CompareArgs {
    /// The runs to compare, two or more (e.g. the Harness-S run, then plain GRPO with the
    /// same model, seed and tasks, then other seeds or variants).
    #[arg(required_unless_present = "arms", num_args = 2..)]
    pub runs: Vec<String>,
    /// An experiment's arm instead: `NAME=RUN,RUN,...` (one run per seed; repeatable). Each
    /// figure is then the mean over the arm's runs ± its 95 % interval.
    #[arg(long = "arm", value_name = "NAME=RUNS")]
    pub arms: Vec<String>,
    #[command(flatten)]
    pub store: StoreArg,
}

#[derive(Debug, Args)]
pub struct ResumeArgs {
    pub run: String,
    #[command(flatten)]
    pub store: StoreArg,
    /// Drive through this queue (distributed); default: in-process workers.
    #[command(flatten)]
    pub queue: OptQueueArg,
    /// In-process workers (embedded resume only).
    #[arg(long, default_value_t = 1, value_parser = super::at_least_one)]
    pub workers: usize,
    /// Serve Prometheus metrics on this address, path /metrics.
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,
}

pub(crate) fn load_spec(path: &std::path::Path, overrides: &[String]) -> anyhow::Result<spec::LoadedSpec> {
    spec::load_with(path, overrides).map_err(|e| anyhow::anyhow!("invalid run spec {e}"))
}

async fn finish(store_url: &str, run_id: &str, result: anyhow::Result<Finish>) -> anyhow::Result<u8> {
    let store = open_store(store_url).await?;
    match result {
        Ok(f) => {
            print_summary(store.as_ref(), run_id).await?;
            match f {
                Finish::Completed => println!("run `{run_id}` completed"),
                Finish::Degraded => println!(
                    "run `{run_id}` finished degraded: some rollouts failed within their budgets (see `harness-s status {run_id}`)"
                ),
            }
            Ok(run::exit_code(f))
        }
        Err(e) => {
            eprintln!("error: run `{run_id}`: {e:#}");
            eprintln!("resume with: harness-s resume {run_id} --store {}", infra::redact_url(store_url));
            Ok(crate::exit::FAILED)
        }
    }
}

/// Prints the metrics table and where the report is.
async fn print_summary(store: &dyn infra::store::ObjectStore, run_id: &str) -> anyhow::Result<()> {
    let series = crate::report::Series::load(store, run_id).await?;
    let editor_run = crate::run::inputs::load_stored(store, run_id).await.is_ok_and(|r| r.spec.editor_training.is_some());
    if editor_run {
        println!("\n{}", crate::report::editor_table(&series));
    } else {
        println!("\n{}", crate::report::update_table(&series));
    }
    for stage in ["baseline", "evaluation"] {
        if let (Some(p), Some(a)) = (series.last(&format!("{stage}/pass_at_k")), series.last(&format!("{stage}/avg_at_k"))) {
            println!("{stage:>10}: Pass@k {p:.3}  Avg@k {a:.3} (H0, test split)");
        }
    }
    if let Some((id, validation, p, a)) = series.h_best() {
        println!("{:>10}: Pass@k {p:.3}  Avg@k {a:.3} (H_best = {id}, the best harness on validation: {validation:.3})", "evaluation");
    }
    let report = schemas::keys::report_file(run_id, "report.md");
    if store.head(&report).await?.is_some() {
        println!("report: {}", store.object_url(&report));
    }
    Ok(())
}

pub async fn run(args: RunArgs) -> anyhow::Result<u8> {
    let loaded = load_spec(&args.spec, &args.set)?;
    // Every service the spec names answers before anything is stored: a run refused here
    // leaves the store as it was (the drive checks again, for resumes).
    run::preflight::check(&loaded.spec).await?;
    let store = args.store.open().await?;
    run::submit(store.as_ref(), &loaded).await?;
    println!("run `{}` → {}", loaded.run_id, store.url());
    let bars = std::io::stderr().is_terminal();
    let metrics = worker::Metrics::new();
    let _server = super::serve_metrics(&metrics, args.metrics_addr).await?;
    let result = run::drive_embedded(store.clone(), &loaded.run_id, args.workers, bars, metrics).await;
    finish(&args.store.url(), &loaded.run_id, result).await
}

pub async fn submit(args: SubmitArgs) -> anyhow::Result<u8> {
    let loaded = load_spec(&args.spec, &args.set)?;
    if let Some(q) = &args.queue.url {
        infra::queue::open_queue(q).await.with_context(|| format!("--queue {}", infra::redact_url(q)))?;
    }
    let store = args.store.open().await?;
    run::submit(store.as_ref(), &loaded).await?;
    println!("{}", loaded.run_id);
    Ok(crate::exit::OK)
}

pub async fn scheduler(args: SchedulerArgs) -> anyhow::Result<u8> {
    super::worker::shared_queue(&args.queue.url, "scheduler")?;
    let store = args.store.open().await?;
    let queue = infra::queue::open_queue(&args.queue.url).await?;
    let metrics = worker::Metrics::new();
    let _server = super::serve_metrics(&metrics, args.metrics_addr).await?;
    let result = run::drive(store, queue, &args.run, false, metrics).await;
    finish(&args.store.url(), &args.run, result).await
}

pub async fn resume(args: ResumeArgs) -> anyhow::Result<u8> {
    let url = args.store.url();
    let store = open_store(&url).await?;
    if let Some(q) = &args.queue.url {
        super::worker::shared_queue(q, "resume")?;
    }
    // Refuse before starting anything when the run is finished.
    run::state_for_drive(store.as_ref(), &args.run).await?;
    let metrics = worker::Metrics::new();
    let _server = super::serve_metrics(&metrics, args.metrics_addr).await?;
    let result = match &args.queue.url {
        Some(q) => run::drive(store, infra::queue::open_queue(q).await?, &args.run, false, metrics).await,
        None => run::drive_embedded(store, &args.run, args.workers, std::io::stderr().is_terminal(), metrics).await,
    };
    finish(&url, &args.run, result).await
}

/// `harness-s repair RUN`: verify, put the run back at its submitted state, drive it again
/// (only the damaged jobs run), verify again.
pub async fn repair(args: ResumeArgs) -> anyhow::Result<u8> {
    let url = args.store.url();
    let store = open_store(&url).await?;
    if let Some(q) = &args.queue.url {
        super::worker::shared_queue(q, "repair")?;
    }
    run::inputs::load_stored(store.as_ref(), &args.run).await?;
    eprintln!("verifying run `{}` ...", args.run);
    let (damage, markers, checkpoints) = run::verify::verify_run(store.as_ref(), &args.run).await?;
    if damage.is_empty() {
        println!("run `{}`: {markers} done-markers and {checkpoints} checkpoints are intact; nothing to repair", args.run);
        return Ok(crate::exit::OK);
    }
    for d in &damage {
        eprintln!("damaged: {d}");
    }
    match run::rewind_for_repair(store.as_ref(), &args.run, &damage).await? {
        None => {}
        Some(from) => eprintln!(
            "run `{}`: damaged checkpoints are rebuilt by running the learn jobs again from {}",
            args.run,
            from.map(|s| format!("step {s}'s resume state")).unwrap_or_else(|| "the starting model".into())
        ),
    }
    eprintln!("run `{}`: walking its stages again from the submitted state; only the damaged jobs run", args.run);
    let metrics = worker::Metrics::new();
    let _server = super::serve_metrics(&metrics, args.metrics_addr).await?;
    let result = match &args.queue.url {
        Some(q) => run::drive(store.clone(), infra::queue::open_queue(q).await?, &args.run, false, metrics).await,
        None => run::drive_embedded(store.clone(), &args.run, args.workers, std::io::stderr().is_terminal(), metrics).await,
    };
    let code = finish(&url, &args.run, result).await?;
    let (left, _, _) = run::verify::verify_run(store.as_ref(), &args.run).await?;
    if !left.is_empty() {
        for d in &left {
            eprintln!("still damaged: {d}");
        }
        anyhow::bail!("run `{}`: {} file(s) are still damaged after the repair", args.run, left.len());
    }
    println!("run `{}` repaired: {} damaged file(s) rewritten; it verifies intact", args.run, damage.len());
    Ok(code)
}

pub async fn status(args: RunRefArgs) -> anyhow::Result<u8> {
    let store = args.store.open().await?;
    let st = state::load(store.as_ref(), &args.run).await?.with_context(|| format!("no run `{}` in {}", args.run, store.url()))?;
    println!("run:        {}", st.run_id);
    println!("status:     {}", st.status.as_str());
    println!("stage:      {}", st.stage);
    println!("updates:    {} done", st.step);
    println!("stages:     {} done", st.completed.len());
    println!("checkpoint: {}", st.latest_checkpoint.map(|s| format!("step {s}")).unwrap_or_else(|| "starting model".into()));
    println!("rollouts:   {} base, {} rescue, {} other", st.rollouts_base, st.rollouts_rescue, st.rollouts_other);
    println!("tokens:     {} (prompt and completion tokens of every rollout)", st.tokens);
    let wall = (st.updated_at_ms - st.started_at_ms).max(0) / 1000;
    println!("wall time:  {}:{:02}:{:02} (from submission to the last state change)", wall / 3600, wall / 60 % 60, wall % 60);
    if !st.failures.is_empty() {
        let f: Vec<String> = st.failures.iter().map(|(k, v)| format!("{k}={v}")).collect();
        println!("failures:   {}", f.join(", "));
    }
    if let Some(m) = &st.message {
        println!("message:    {m}");
    }
    print_summary(store.as_ref(), &args.run).await?;
    Ok(crate::exit::OK)
}

pub async fn cancel(args: RunRefArgs) -> anyhow::Result<u8> {
    let store = args.store.open().await?;
    let st = state::load(store.as_ref(), &args.run).await?.with_context(|| format!("no run `{}` in {}", args.run, store.url()))?;
    if st.status.is_finished() {
        anyhow::bail!("run `{}` already finished ({}); nothing to cancel", args.run, st.status.as_str());
    }
    store.put(&state::cancel_key(&args.run), Bytes::from_static(b"cancel requested\n")).await?;
    println!("cancel requested for run `{}`; the scheduler stops at its next check", args.run);
    Ok(crate::exit::OK)
}

pub async fn report(args: RunRefArgs) -> anyhow::Result<u8> {
    let store = args.store.open().await?;
    // a report of a run that is not there would be an empty report in a new folder
    run::inputs::load_stored(store.as_ref(), &args.run).await?;
    let url = crate::report::write(store.as_ref(), &args.run).await?;
    println!("{url}");
    Ok(crate::exit::OK)
}

pub async fn verify(args: RunRefArgs) -> anyhow::Result<u8> {
    let store = args.store.open().await?;
    run::inputs::load_stored(store.as_ref(), &args.run).await?;
    eprintln!("verifying run `{}`: every done-marker's outputs and every checkpoint's files, hashed ...", args.run);
    let (damage, markers, checkpoints) = run::verify::verify_run(store.as_ref(), &args.run).await?;
    if damage.is_empty() {
        println!(
            "run `{}`: {markers} done-markers, {checkpoints} checkpoints and the files they list are intact (sizes and SHA-256)",
            args.run
        );
        return Ok(crate::exit::OK);
    }
    println!("run `{}`: {} damaged file(s) ({markers} done-markers and {checkpoints} checkpoints checked):", args.run, damage.len());
    for d in &damage {
        println!("  {d}");
    }
    println!(
        "`harness-s repair {}` re-runs the jobs whose done-marker or outputs are damaged and rebuilds damaged checkpoints (finished runs included); until then a damaged checkpoint is refused wherever it would be loaded",
        args.run
    );
    Ok(crate::exit::FAILED)
}

pub async fn compare(args: CompareArgs) -> anyhow::Result<u8> {
    let store = args.store.open().await?;
    if !args.arms.is_empty() {
        anyhow::ensure!(args.runs.is_empty(), "give runs either as arguments or in --arm, not both");
        let arms = args.arms.iter().map(|a| crate::compare::parse_arm(a)).collect::<anyhow::Result<Vec<_>>>()?;
        for (_, runs) in &arms {
            for run in runs {
                run::inputs::load_stored(store.as_ref(), run).await?;
            }
        }
        let url = crate::compare::write_arms(store.as_ref(), &arms).await?;
        println!("comparison: {url}");
        return Ok(crate::exit::OK);
    }
    for run in &args.runs {
        run::inputs::load_stored(store.as_ref(), run).await?;
    }
    let ids: Vec<&str> = args.runs.iter().map(String::as_str).collect();
    let url = crate::compare::write(store.as_ref(), &ids).await?;
    println!("comparison: {url}");
    Ok(crate::exit::OK)
}
