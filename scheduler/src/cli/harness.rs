//! `harness-s harness validate|diff`: static checks of a harness spec, and the edits
//! between two specs.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::{Args, Subcommand};
use jobs::harness::{diff_values, validate_value, ValidateOptions};
use schemas::HarnessSpec;
use serde_json::Value;

use crate::exit;

#[derive(Debug, Subcommand)]
pub enum HarnessCommand {
    /// Check a spec; prints one line `path: message` per problem and exits non-zero if any.
    Validate(ValidateArgs),
    /// Show the edits that turn spec A into spec B.
    Diff(DiffArgs),
}

#[derive(Debug, Args)]
pub struct ValidateArgs {
    /// The harness spec (JSON).
    pub file: PathBuf,
    /// Tool names the target environment offers (comma-separated); when given, tool views
    /// and hook actions must use them. DBBench: execute_sql,commit_final_answer
    #[arg(long, value_delimiter = ',')]
    pub tools: Option<Vec<String>>,
    /// Allow hooks that act in the policy's place (force_action, rewrite_action), as an
    /// environment with `[environment] harness_actions = true` does.
    #[arg(long)]
    pub harness_actions: bool,
}

#[derive(Debug, Args)]
pub struct DiffArgs {
    /// The old spec (JSON).
    pub a: PathBuf,
    /// The new spec (JSON).
    pub b: PathBuf,
}

pub async fn run(cmd: HarnessCommand) -> anyhow::Result<u8> {
    match cmd {
        HarnessCommand::Validate(a) => validate(a),
        HarnessCommand::Diff(a) => diff(a),
    }
}

fn read_json(path: &Path) -> anyhow::Result<Value> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read harness spec {}", path.display()))?;
    Ok(jobs::harness::validate::read_value(&path.display().to_string(), &text)?)
}

fn validate(args: ValidateArgs) -> anyhow::Result<u8> {
    let value = read_json(&args.file)?;
    let problems = validate_value(&value, &ValidateOptions { tools: args.tools, harness_actions: args.harness_actions, base: false });
    let mut out = std::io::stdout().lock();
    if problems.is_empty() {
        let spec: HarnessSpec =
            serde_json::from_value(value).with_context(|| format!("{}: passes validation but does not parse", args.file.display()))?;
        writeln!(
            out,
            "{}: valid harness `{}` (parent {}, generation {}): {} prompt rules, {} skills, {} context items, {} memory items, {} hooks{}",
            args.file.display(),
            spec.id,
            spec.parent.as_deref().unwrap_or("none"),
            spec.generation,
            spec.prompt_rules.len(),
            spec.skills.len(),
            spec.context.len(),
            spec.memory.len(),
            spec.hooks.len(),
            if spec.tool_view.is_some() { ", a tool view" } else { "" },
        )?;
        return Ok(exit::OK);
    }
    for p in &problems {
        writeln!(out, "{p}")?;
    }
    out.flush()?;
    eprintln!("{}: {} problem(s); the spec was not accepted", args.file.display(), problems.len());
    Ok(exit::FAILED)
}

/// Specs that parse are normalised through the spec type (defaults filled, empty lists
/// dropped) so that only real edits show; others are compared as raw JSON.
fn normalised(path: &Path) -> anyhow::Result<Value> {
    let raw = read_json(path)?;
    Ok(match serde_json::from_value::<HarnessSpec>(raw.clone()) {
        Ok(spec) => serde_json::to_value(spec)?,
        Err(e) => {
            eprintln!("note: {} is not a valid spec ({e}); comparing it as raw JSON", path.display());
            raw
        }
    })
}

fn diff(args: DiffArgs) -> anyhow::Result<u8> {
    let a = normalised(&args.a)?;
    let b = normalised(&args.b)?;
    print_edits(&diff_values(&a, &b))?;
    Ok(exit::OK)
}

/// Prints edits one per line, or `no edits`.
pub(crate) fn print_edits(edits: &[jobs::harness::Edit]) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    if edits.is_empty() {
        writeln!(out, "no edits")?;
    }
    for e in edits {
        writeln!(out, "{e}")?;
    }
    Ok(())
}
