//! `harness-s pool ls|show|diff`: inspect a run's Sibling Harness Pool
//! (`runs/<run>/pool/manifest.json` and `runs/<run>/pool/<id>.json`).

use std::io::Write;

use anyhow::Context;
use clap::{Args, Subcommand};
use jobs::evolve::pool::{load_manifest, load_member};
use jobs::harness::diff_specs;

use super::StoreArg;
use crate::exit;

#[derive(Debug, Subcommand)]
pub enum PoolCommand {
    /// List the pool's members with lineage and validation coverage, and rejected candidates.
    Ls(LsArgs),
    /// Print one member's spec (JSON) and its lineage.
    Show(ShowArgs),
    /// Show the edits that turn member A into member B.
    Diff(DiffArgs),
    /// Write Figure 1a (repaired vs regressed tasks per sibling relative to H0) and Figure 5
    /// (directed repair overlap) as PNG files, and print their numbers.
    Report(ReportArgs),
}

#[derive(Debug, Args)]
pub struct ReportArgs {
    pub run: String,
    /// Folder for `repairs.png` and `overlap.png` (created if missing).
    #[arg(long, value_name = "DIR")]
    pub out: std::path::PathBuf,
    #[command(flatten)]
    pub store: StoreArg,
}

#[derive(Debug, Args)]
pub struct LsArgs {
    pub run: String,
    #[command(flatten)]
    pub store: StoreArg,
}

#[derive(Debug, Args)]
pub struct ShowArgs {
    pub run: String,
    pub id: String,
    #[command(flatten)]
    pub store: StoreArg,
}

#[derive(Debug, Args)]
pub struct DiffArgs {
    pub run: String,
    pub a: String,
    pub b: String,
    #[command(flatten)]
    pub store: StoreArg,
}

pub async fn run(cmd: PoolCommand) -> anyhow::Result<u8> {
    match cmd {
        PoolCommand::Ls(a) => ls(a).await,
        PoolCommand::Show(a) => show(a).await,
        PoolCommand::Diff(a) => diff(a).await,
        PoolCommand::Report(a) => report(a).await,
    }
}

async fn ls(args: LsArgs) -> anyhow::Result<u8> {
    let store = args.store.open().await?;
    let m = match load_manifest(store.as_ref(), &args.run).await {
        Ok(m) => m,
        // A pool that came from a folder (or another run) has members but no evolution
        // manifest: list them from the submitted run.
        Err(jobs::evolve::PoolError::Missing { .. }) => return ls_submitted(store.as_ref(), &args.run).await,
        Err(e) => return Err(e.into()),
    };
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "pool of run {} (version {}, {} members, {} validation tasks{})",
        m.run_id,
        m.version,
        m.members.len(),
        m.validation_tasks.len(),
        m.seeded_from.as_ref().map(|s| format!(", seeded from {s}")).unwrap_or_default()
    )?;
    writeln!(
        out,
        "{:<14} {:<10} {:>3} {:>5} {:>9} {:>7} {:>6}  {:<20} causes",
        "id", "parent", "gen", "round", "V(H)", "local", "parent", "editor"
    )?;
    for e in &m.members {
        let local = e.local.as_ref().map(|l| format!("{}/{}", l.repaired.len(), l.targeted.len())).unwrap_or_else(|| "-".into());
        writeln!(
            out,
            "{:<14} {:<10} {:>3} {:>5} {:>9} {:>7} {:>6}  {:<20} {}",
            e.id,
            e.parent.as_deref().unwrap_or("-"),
            e.generation,
            e.round,
            format!("{}/{}", e.validation_coverage.len(), m.validation_tasks.len()),
            local,
            if e.selected_as_parent { "yes" } else { "" },
            e.editor,
            e.causes.join(", ")
        )?;
    }
    if !m.rejected.is_empty() {
        writeln!(out, "rejected candidates ({}):", m.rejected.len())?;
        for r in &m.rejected {
            writeln!(out, "  {} (from {}, round {}): {}", r.id, r.parent, r.round, r.reason)?;
        }
    }
    Ok(exit::OK)
}

/// The members of a run's pool as submitted (`[pool] dir` or `from_run`): id, parent,
/// generation, components and whether they act for the policy.
async fn ls_submitted(store: &dyn infra::store::ObjectStore, run_id: &str) -> anyhow::Result<u8> {
    let stored = crate::run::inputs::load_stored(store, run_id).await?;
    let mut out = std::io::stdout().lock();
    let source = match (&stored.spec.pool.dir, &stored.spec.pool.from_run) {
        (Some(dir), _) => format!("[pool] dir = {}", dir.display()),
        (None, Some(from)) => format!("[pool] from_run = {from}"),
        (None, None) => {
            writeln!(out, "run {run_id} has no pool (no [pool] section and no evolution): rescue can only use H0")?;
            return Ok(exit::OK);
        }
    };
    writeln!(out, "pool of run {run_id} ({} members besides h0, from {source}; no evolution manifest)", stored.pool.len())?;
    let mut specs = Vec::new();
    for id in &stored.pool {
        specs.push(load_member(store, run_id, id).await?);
    }
    write!(out, "{}", jobs::evolve::report::mechanism_table(&specs, None))?;
    Ok(exit::OK)
}

async fn show(args: ShowArgs) -> anyhow::Result<u8> {
    let store = args.store.open().await?;
    let spec = load_member(store.as_ref(), &args.run, &args.id).await?;
    let m = load_manifest(store.as_ref(), &args.run).await?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", serde_json::to_string_pretty(&spec)?)?;
    if let Some(e) = m.member(&args.id) {
        eprintln!("lineage: {}", serde_json::to_string(e)?);
    }
    Ok(exit::OK)
}

async fn diff(args: DiffArgs) -> anyhow::Result<u8> {
    let store = args.store.open().await?;
    let a = load_member(store.as_ref(), &args.run, &args.a).await?;
    let b = load_member(store.as_ref(), &args.run, &args.b).await?;
    super::harness::print_edits(&diff_specs(&a, &b))?;
    Ok(exit::OK)
}

async fn report(args: ReportArgs) -> anyhow::Result<u8> {
    use jobs::evolve::report::{plot_overlap, plot_repairs, pool_repair_counts, repair_table};
    let store = args.store.open().await?;
    let m = load_manifest(store.as_ref(), &args.run).await?;
    let counts = pool_repair_counts(&m).with_context(|| format!("pool of run `{}` has no `h0` member to compare with", args.run))?;
    std::fs::create_dir_all(&args.out).with_context(|| format!("cannot create {}", args.out.display()))?;
    plot_repairs(&counts, &args.out.join("repairs.png"))?;
    plot_overlap(&counts, &args.out.join("overlap.png"))?;
    let mut out = std::io::stdout().lock();
    write!(out, "{}", repair_table(&counts))?;
    writeln!(out, "figures: {} {}", args.out.join("repairs.png").display(), args.out.join("overlap.png").display())?;
    Ok(exit::OK)
}
