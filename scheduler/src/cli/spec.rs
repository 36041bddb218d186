//! `harness-s spec show SPEC [--set key=value ...]`: the resolved spec with every default
//! filled in, and what a run of it would do — its stages in order and the rollouts each
//! kind of stage makes at most — without running or storing anything.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand};

use crate::run::spec::{LoadedSpec, RunSpec};
use crate::run::stage::Stage;

#[derive(Debug, Subcommand)]
pub enum SpecCommand {
    /// Print the resolved spec (defaults filled in) and the run's plan.
    Show(ShowArgs),
}

#[derive(Debug, Args)]
pub struct ShowArgs {
    /// Run spec (TOML).
    pub spec: PathBuf,
    /// Override a spec key (repeatable), as for `run`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
}

pub async fn run(cmd: SpecCommand) -> anyhow::Result<u8> {
    match cmd {
        SpecCommand::Show(a) => show(a),
    }
}

fn show(args: ShowArgs) -> anyhow::Result<u8> {
    let loaded = super::run::load_spec(&args.spec, &args.set)?;
    // URLs are shown through infra::redact_url: the resolved spec is printed, its
    // credentials are not.
    let mut value = toml::Value::try_from(&loaded.spec).context("writing the resolved spec as TOML")?;
    redact_urls(&mut value);
    let text = toml::to_string_pretty(&value).context("writing the resolved spec as TOML")?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "# run `{}`: {} with every default filled in", loaded.run_id, args.spec.display())?;
    writeln!(out, "{text}")?;
    writeln!(out, "# plan")?;
    for line in plan(&loaded)? {
        writeln!(out, "{line}")?;
    }
    Ok(crate::exit::OK)
}

/// Every string value holding a URL, redacted in place.
fn redact_urls(v: &mut toml::Value) {
    match v {
        toml::Value::String(s) if s.contains("://") => *s = infra::redact_url(s),
        toml::Value::Array(items) => items.iter_mut().for_each(redact_urls),
        toml::Value::Table(t) => t.iter_mut().for_each(|(_, v)| redact_urls(v)),
        _ => {}
    }
}

/// Tasks of each split: generated counts, or the lines of the task files.
fn split_sizes(loaded: &LoadedSpec) -> anyhow::Result<[usize; 3]> {
    let spec = &loaded.spec;
    if spec.environment.is_http() {
        let mut sizes = [0; 3];
        for (i, split) in [schemas::Split::Train, schemas::Split::Validation, schemas::Split::Test].into_iter().enumerate() {
            sizes[i] = spec.environment.http_task_ids(split).map_err(anyhow::Error::msg)?.len();
        }
        return Ok(sizes);
    }
    if let Some(g) = &spec.tasks.generate {
        return Ok([g.train, g.validation, g.test]);
    }
    let mut sizes = [0; 3];
    for (i, (name, file)) in
        [("train", &spec.tasks.train), ("validation", &spec.tasks.validation), ("test", &spec.tasks.test)].into_iter().enumerate()
    {
        let path = loaded.resolve(file.as_ref().with_context(|| format!("tasks.{name} is not set"))?);
        let text = std::fs::read_to_string(&path).with_context(|| format!("tasks.{name}: cannot read {}", path.display()))?;
        sizes[i] = text.lines().filter(|l| !l.trim().is_empty()).count();
    }
    Ok(sizes)
}

/// Siblings the run's pool has (`None` when only the run itself will know: evolution or
/// another run's pool).
fn pool_size(loaded: &LoadedSpec) -> anyhow::Result<Option<usize>> {
    let spec: &RunSpec = &loaded.spec;
    if spec.evolution.is_some() || spec.pool.from_run.is_some() {
        return Ok(None);
    }
    match &spec.pool.dir {
        Some(dir) => Ok(Some(handlers::harnesses::read_pool(&loaded.resolve(dir), &spec.environment.validate_options())?.len())),
        None => Ok(Some(0)),
    }
}

/// The stages in order, then per kind of stage the rollouts it makes at most.
fn plan(loaded: &LoadedSpec) -> anyhow::Result<Vec<String>> {
    let spec = &loaded.spec;
    let stages = crate::run::machine::stages(spec);
    let [_, validation, test] = split_sizes(loaded)?;
    let pool = pool_size(loaded)?;
    let a = &spec.algorithm;
    let calibration_tasks = spec.calibration.tasks.map(|n| n as usize).unwrap_or(validation).min(validation);
    let calibrations = stages.iter().filter(|s| matches!(s, Stage::Calibration(_) | Stage::FinalCalibration(_))).count();
    let harnesses = pool.map(|p| (p + 1).to_string()).unwrap_or_else(|| "1 + the pool's".into());
    let per_calibration =
        pool.map(|p| ((p + 1) * calibration_tasks).to_string()).unwrap_or_else(|| format!("{calibration_tasks} per harness"));
    let per_update = a.tasks_per_update as usize * a.k as usize;
    let eval_harnesses = 1 + spec.eval_ranks() as usize + usize::from(spec.has_pool());
    let labels: Vec<String> = stages.iter().map(Stage::to_string).collect();
    let mut lines = vec![format!("stages ({}): {}", stages.len(), labels.join(" → "))];
    lines.push(format!("router: {}; rescue: {}; learn: {}", spec.router.variant_name(), a.rescue.as_str(), a.learn));
    lines.push("rollouts, at most:".into());
    if let Some(e) = &spec.evolution {
        lines.push(format!(
            "  evolve: {} round(s), {} proposal(s) in all",
            e.proposal_budgets.len(),
            e.proposal_budgets.iter().sum::<u32>()
        ));
    }
    if stages.contains(&Stage::Baseline) {
        lines.push(format!("  baseline: {} (test tasks {test} × k {}, under H0)", test * spec.evaluation.k as usize, spec.evaluation.k));
    }
    lines.push(format!(
        "  calibration: {calibrations} × {per_calibration} ({harnesses} harness(es) × {calibration_tasks} validation task(s))"
    ));
    if a.updates > 0 {
        lines.push(format!("  base: {} × {per_update} (tasks per update {} × K {})", a.updates, a.tasks_per_update, a.k));
        if matches!(a.rescue, jobs::rescue::RescueStrategy::H0 | jobs::rescue::RescueStrategy::Router) {
            lines.push(format!("  rescue: {} × {per_update} (only for all-fail groups)", a.updates));
        }
    }
    lines.push(format!(
        "  evaluation: {} (test tasks {test} × k {} × up to {eval_harnesses} harness(es): H0{})",
        test * spec.evaluation.k as usize * eval_harnesses,
        spec.evaluation.k,
        match (spec.has_pool(), spec.eval_ranks()) {
            (false, _) => String::new(),
            (true, 0) => " and H_best".to_string(),
            (true, r) => format!(", Rank-1..{r} and H_best"),
        }
    ));
    if a.learn && a.updates > 0 {
        lines.push(format!("learn steps: {} (a checkpoint each)", a.updates));
    }
    if let Some(report) = &loaded.memory {
        lines.extend(report.lines());
    }
    Ok(lines)
}
