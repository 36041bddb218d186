//! `harness-s compare RUN_A RUN_B`: two runs side by side — the transfer experiment of the
//! paper (Figure 3, Table 1 direction): a Harness-S run against plain GRPO with the same
//! model, seed, tasks and updates. Per update: effective-group rate and effective-token
//! share; rescue success; H0 validation success per calibration; Pass@k / Avg@k under H0
//! before and after training; rollouts relative to GRPO; trained policy tokens. Markdown
//! plus PNG plots under `comparisons/<A>-vs-<B>/` in the store.

use std::fmt::Write as _;

use anyhow::Context;
use bytes::Bytes;
use infra::store::ObjectStore;

use crate::report::{line_plot, number, Series};

/// One row of the comparison: a metric, how it is summarised, and both runs' values.
struct Row {
    label: &'static str,
    a: Option<f64>,
    b: Option<f64>,
}

fn mean(points: &[(u32, f64)]) -> Option<f64> {
    (!points.is_empty()).then(|| points.iter().map(|p| p.1).sum::<f64>() / points.len() as f64)
}

fn first(points: &[(u32, f64)]) -> Option<f64> {
    points.first().map(|p| p.1)
}

fn last(points: &[(u32, f64)]) -> Option<f64> {
    points.last().map(|p| p.1)
}

fn cell(v: Option<f64>) -> String {
    v.map(number).unwrap_or_else(|| "–".into())
}

/// The summary table (pure): one line per figure of the transfer experiment.
pub fn summary_table(a_id: &str, b_id: &str, a: &Series, b: &Series) -> String {
    let both = |label, f: &dyn Fn(&Series) -> Option<f64>| Row { label, a: f(a), b: f(b) };
    let rows = [
        both("mean effective-group rate", &|s| mean(s.get("effective_group_rate"))),
        both("mean effective-token share", &|s| mean(s.get("effective_token_share"))),
        both("mean rescue success (updates where rescue fired)", &|s| {
            let fired: Vec<(u32, f64)> =
                s.get("rescue_success").iter().copied().filter(|(u, _)| s.get("rollouts_rescue").iter().any(|p| p.0 == *u && p.1 > 0.0)).collect();
            mean(&fired)
        }),
        both("policy tokens trained (all updates)", &|s| (!s.get("policy_tokens_trained").is_empty()).then(|| s.get("policy_tokens_trained").iter().map(|p| p.1).sum())),
        both("H0 validation success, first calibration", &|s| first(s.get("h0_validation_success"))),
        both("H0 validation success, last calibration", &|s| last(s.get("h0_validation_success"))),
        both("H0 Pass@k before training (test)", &|s| s.last("baseline/pass_at_k")),
        both("H0 Pass@k after training (test)", &|s| s.last("evaluation/pass_at_k")),
        both("H0 Avg@k before training (test)", &|s| s.last("baseline/avg_at_k")),
        both("H0 Avg@k after training (test)", &|s| s.last("evaluation/avg_at_k")),
        both("rollouts relative to GRPO (end)", &|s| last(s.get("rollouts_relative_to_grpo"))),
        both("mean training-inference mismatch", &|s| mean(s.get("mismatch_mean"))),
    ];
    let mut out = format!("| figure | `{a_id}` | `{b_id}` |\n|---|---:|---:|\n");
    for r in rows {
        let _ = writeln!(out, "| {} | {} | {} |", r.label, cell(r.a), cell(r.b));
    }
    out
}

/// Per-update table of the training signal, both runs side by side.
pub fn update_table(a_id: &str, b_id: &str, a: &Series, b: &Series) -> String {
    let cols = ["effective_group_rate", "effective_token_share", "rescue_success", "policy_tokens_trained", "loss"];
    let steps: std::collections::BTreeSet<u32> =
        cols.iter().flat_map(|c| a.get(c).iter().chain(b.get(c)).map(|p| p.0)).collect();
    let mut out = String::from("| update |");
    for c in cols {
        let _ = write!(out, " {c} `{a_id}` | {c} `{b_id}` |");
    }
    out.push_str("\n|---|");
    out.push_str(&"---:|".repeat(2 * cols.len()));
    out.push('\n');
    for step in steps {
        let _ = write!(out, "| {step} |");
        for c in cols {
            for s in [a, b] {
                let v = s.get(c).iter().find(|p| p.0 == step).map(|p| p.1);
                let _ = write!(out, " {} |", cell(v));
            }
        }
        out.push('\n');
    }
    out
}

/// Writes `comparisons/<A>-vs-<B>/{compare.md, signal.png, validation.png}`; returns the
/// Markdown's URL. Refuses runs that stored no metrics (a misspelt id).
pub async fn write(store: &dyn ObjectStore, a_id: &str, b_id: &str) -> anyhow::Result<String> {
    let a = Series::load(store, a_id).await?;
    let b = Series::load(store, b_id).await?;
    for (id, s) in [(a_id, &a), (b_id, &b)] {
        anyhow::ensure!(!s.0.is_empty(), "run `{id}` has no metrics in {}: is the id right, and has the run started?", store.url());
    }
    let dir = schemas::keys::comparison_dir(a_id, b_id);
    let tmp = tempfile::tempdir().context("cannot create a temporary folder for plots")?;
    let (la, lb) = (format!("{a_id}: "), format!("{b_id}: "));
    let plots: [(&str, &str, &str, Vec<(String, &[(u32, f64)])>); 2] = [
        (
            "signal.png",
            "Effective-group rate by update",
            "fraction",
            vec![(format!("{la}EG rate"), a.get("effective_group_rate")), (format!("{lb}EG rate"), b.get("effective_group_rate"))],
        ),
        (
            "validation.png",
            "H0 validation success by checkpoint",
            "success rate",
            vec![(format!("{la}H0 validation"), a.get("h0_validation_success")), (format!("{lb}H0 validation"), b.get("h0_validation_success"))],
        ),
    ];
    for (file, title, y, series) in &plots {
        let path = tmp.path().join(file);
        let named: Vec<(&str, &[(u32, f64)])> = series.iter().map(|(n, p)| (n.as_str(), *p)).collect();
        line_plot(&path, title, y, &named).with_context(|| format!("drawing {file}"))?;
        store.put(&format!("{dir}{file}"), Bytes::from(std::fs::read(&path)?)).await?;
    }
    let mut md = format!("# `{a_id}` vs `{b_id}`\n\n## Summary\n\n");
    md.push_str(&summary_table(a_id, b_id, &a, &b));
    md.push_str("\n## Training signal by update\n\n");
    md.push_str(&update_table(a_id, b_id, &a, &b));
    md.push_str("\n![effective-group rate](signal.png)\n\n## H0 validation success by calibration\n\n![validation](validation.png)\n");
    let key = format!("{dir}compare.md");
    store.put(&key, Bytes::from(md.clone())).await?;
    println!("{md}");
    Ok(store.object_url(&key))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn series(pairs: &[(&str, &[(u32, f64)])]) -> Series {
        Series(pairs.iter().map(|(n, p)| (n.to_string(), p.to_vec())).collect::<BTreeMap<_, _>>())
    }

    #[test]
    fn summary_puts_both_runs_side_by_side() {
        let hs = series(&[
            ("effective_group_rate", &[(1, 0.5), (2, 1.0)]),
            ("h0_validation_success", &[(0, 0.0), (2, 0.5)]),
            ("rescue_success", &[(1, 0.5), (2, 0.0)]),
            ("rollouts_rescue", &[(1, 6.0), (2, 0.0)]),
            ("evaluation/pass_at_k", &[(2, 0.25)]),
        ]);
        let grpo = series(&[("effective_group_rate", &[(1, 0.0), (2, 0.0)]), ("h0_validation_success", &[(0, 0.0), (2, 0.0)])]);
        let t = summary_table("hs", "grpo", &hs, &grpo);
        assert!(t.contains("| mean effective-group rate | 0.750 | 0.000 |"), "{t}");
        assert!(t.contains("| H0 validation success, last calibration | 0.500 | 0.000 |"), "{t}");
        // rescue success averages only the updates where rescue fired
        assert!(t.contains("| mean rescue success (updates where rescue fired) | 0.500 | – |"), "{t}");
        assert!(t.contains("| H0 Pass@k after training (test) | 0.250 | – |"), "{t}");
        let u = update_table("hs", "grpo", &hs, &grpo);
        assert!(u.lines().any(|l| l.starts_with("| 2 | 1.000 | 0.000 |")), "{u}");
    }
}
