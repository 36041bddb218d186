//! The harness spec files a run spec names: the sibling pool folder (`[pool] dir`) and the
//! base harness (`[pool] base`). The spec checks them at load; the inputs read them into
//! the store.

use std::path::PathBuf;

use anyhow::{bail, Context};
use schemas::HarnessSpec;

/// Reads the pool folder: every `*.json` file must be a valid harness spec; all problems
/// are reported together.
pub fn read_pool(dir: &std::path::Path, opts: &jobs::harness::ValidateOptions) -> anyhow::Result<Vec<HarnessSpec>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("cannot read the pool folder {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    let mut pool = Vec::new();
    let mut problems = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).with_context(|| format!("cannot read {}", f.display()))?;
        match jobs::harness::parse_spec(&f.display().to_string(), &text, opts) {
            // H0 is implicit; a file describing it unedited is allowed and skipped.
            Ok(spec) if spec.id == schemas::H0_ID && is_unedited(&spec) => {}
            Ok(spec) => pool.push(spec),
            Err(jobs::harness::SpecError::Invalid { file, problems: ps }) => {
                for p in ps {
                    problems.push(format!("{file}: {p}"));
                }
            }
            Err(e) => problems.push(e.to_string()),
        }
    }
    let mut seen = std::collections::BTreeSet::new();
    for h in &pool {
        if !seen.insert(h.id.clone()) {
            problems.push(format!("pool: harness id `{}` appears twice", h.id));
        }
    }
    if !problems.is_empty() {
        bail!("invalid pool {}:\n  {}", dir.display(), problems.join("\n  "));
    }
    Ok(pool)
}

/// `[pool] base`: a harness spec file that is the run's H0 (its id must be `h0`).
pub fn read_base(file: &std::path::Path, opts: &jobs::harness::ValidateOptions) -> anyhow::Result<HarnessSpec> {
    let text = std::fs::read_to_string(file).with_context(|| format!("cannot read the base harness {}", file.display()))?;
    let opts = jobs::harness::ValidateOptions { base: true, ..opts.clone() };
    let spec = jobs::harness::parse_spec(&file.display().to_string(), &text, &opts)?;
    if spec.id != schemas::H0_ID {
        bail!(
            "{}: the base harness has id `{}`; give it id `{}` (it stands for H0 in every row, profile and report)",
            file.display(),
            spec.id,
            schemas::H0_ID
        );
    }
    Ok(spec)
}

/// Whether a spec makes no edits to the base harness.
fn is_unedited(h: &HarnessSpec) -> bool {
    h.prompt_rules.is_empty()
        && h.skills.is_empty()
        && h.context.is_empty()
        && h.memory.is_empty()
        && h.tool_view.is_none()
        && h.hooks.is_empty()
}
