//! `harness-s compare RUN RUN [RUN ...]`: runs side by side — the transfer experiment of
//! the paper (Figure 3, Table 1 direction): a Harness-S run against plain GRPO with the same
//! model, seed, tasks and updates, or several seeds or variants at once. Per update:
//! effective-group rate and effective-token share; rescue success; H0 validation success
//! per calibration; Pass@k / Avg@k under H0 before and after training; rollouts relative to
//! GRPO; trained policy tokens. Markdown plus PNG plots under
//! `comparisons/<A>-vs-<B>[-vs-<C>...]/` in the store.

use std::fmt::Write as _;

use anyhow::Context;
use bytes::Bytes;
use infra::store::ObjectStore;

use crate::report::{line_plot, number, Series};

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

/// A figure of the summary: its label and how it is read off a run's metrics.
type Figure = (&'static str, fn(&Series) -> Option<f64>);

const FIGURES: [Figure; 12] = [
    ("mean effective-group rate", |s| mean(s.get("effective_group_rate"))),
    ("mean effective-token share", |s| mean(s.get("effective_token_share"))),
    ("mean rescue success (updates where rescue fired)", |s| {
        let fired: Vec<(u32, f64)> = s
            .get("rescue_success")
            .iter()
            .copied()
            .filter(|(u, _)| s.get("rollouts_rescue").iter().any(|p| p.0 == *u && p.1 > 0.0))
            .collect();
        mean(&fired)
    }),
    ("policy tokens trained (all updates)", |s| {
        (!s.get("policy_tokens_trained").is_empty()).then(|| s.get("policy_tokens_trained").iter().map(|p| p.1).sum())
    }),
    ("H0 validation success, first calibration", |s| first(s.get("h0_validation_success"))),
    ("H0 validation success, last calibration", |s| last(s.get("h0_validation_success"))),
    ("H0 Pass@k before training (test)", |s| s.last("baseline/pass_at_k")),
    ("H0 Pass@k after training (test)", |s| s.last("evaluation/pass_at_k")),
    ("H0 Avg@k before training (test)", |s| s.last("baseline/avg_at_k")),
    ("H0 Avg@k after training (test)", |s| s.last("evaluation/avg_at_k")),
    ("rollouts relative to GRPO (end)", |s| last(s.get("rollouts_relative_to_grpo"))),
    ("mean training-inference mismatch", |s| mean(s.get("mismatch_mean"))),
];

/// The summary table (pure): one line per figure of the transfer experiment, a column per
/// run.
pub fn summary_table(runs: &[(&str, &Series)]) -> String {
    let mut out = String::from("| figure |");
    for (id, _) in runs {
        let _ = write!(out, " `{id}` |");
    }
    let _ = writeln!(out, "\n|---|{}", "---:|".repeat(runs.len()));
    for (label, f) in FIGURES {
        let _ = write!(out, "| {label} |");
        for (_, s) in runs {
            let _ = write!(out, " {} |", cell(f(s)));
        }
        out.push('\n');
    }
    out
}

/// Per-update table of the training signal, the runs side by side under each column.
pub fn update_table(runs: &[(&str, &Series)]) -> String {
    let cols = ["effective_group_rate", "effective_token_share", "rescue_success", "policy_tokens_trained", "loss"];
    let steps: std::collections::BTreeSet<u32> =
        cols.iter().flat_map(|c| runs.iter().flat_map(move |(_, s)| s.get(c).iter().map(|p| p.0))).collect();
    let mut out = String::from("| update |");
    for c in cols {
        for (id, _) in runs {
            let _ = write!(out, " {c} `{id}` |");
        }
    }
    out.push_str("\n|---|");
    out.push_str(&"---:|".repeat(runs.len() * cols.len()));
    out.push('\n');
    for step in steps {
        let _ = write!(out, "| {step} |");
        for c in cols {
            for (_, s) in runs {
                let v = s.get(c).iter().find(|p| p.0 == step).map(|p| p.1);
                let _ = write!(out, " {} |", cell(v));
            }
        }
        out.push('\n');
    }
    out
}

/// Writes `comparisons/<A>-vs-<B>[-vs-...]/{compare.md, signal.png, validation.png}`;
/// returns the Markdown's URL. Refuses fewer than two runs, a run named twice, and runs
/// that stored no metrics (a misspelt id).
pub async fn write(store: &dyn ObjectStore, ids: &[&str]) -> anyhow::Result<String> {
    anyhow::ensure!(ids.len() >= 2, "compare needs at least two runs, got {}", ids.len());
    for (i, id) in ids.iter().enumerate() {
        anyhow::ensure!(!ids[..i].contains(id), "run `{id}` is named twice; compare different runs");
    }
    let mut series = vec![];
    for id in ids {
        let s = Series::load(store, id).await?;
        anyhow::ensure!(!s.0.is_empty(), "run `{id}` has no metrics in {}: is the id right, and has the run started?", store.url());
        series.push(s);
    }
    let runs: Vec<(&str, &Series)> = ids.iter().copied().zip(&series).collect();
    let dir = schemas::keys::comparison_dir(ids);
    let tmp = tempfile::tempdir().context("cannot create a temporary folder for plots")?;
    let plots = [
        ("signal.png", "Effective-group rate by update", "fraction", "effective_group_rate", "EG rate"),
        ("validation.png", "H0 validation success by checkpoint", "success rate", "h0_validation_success", "H0 validation"),
    ];
    for (file, title, y, metric, what) in plots {
        let path = tmp.path().join(file);
        let names: Vec<String> = ids.iter().map(|id| format!("{id}: {what}")).collect();
        let named: Vec<(&str, &[(u32, f64)])> = names.iter().zip(&series).map(|(n, s)| (n.as_str(), s.get(metric))).collect();
        line_plot(&path, title, y, &named).with_context(|| format!("drawing {file}"))?;
        store.put(&format!("{dir}{file}"), Bytes::from(std::fs::read(&path)?)).await?;
    }
    let title = ids.iter().map(|id| format!("`{id}`")).collect::<Vec<_>>().join(" vs ");
    let mut md = format!("# {title}\n\n## Summary\n\n");
    md.push_str(&summary_table(&runs));
    md.push_str("\n## Training signal by update\n\n");
    md.push_str(&update_table(&runs));
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
        let t = summary_table(&[("hs", &hs), ("grpo", &grpo)]);
        assert!(t.contains("| mean effective-group rate | 0.750 | 0.000 |"), "{t}");
        assert!(t.contains("| H0 validation success, last calibration | 0.500 | 0.000 |"), "{t}");
        // rescue success averages only the updates where rescue fired
        assert!(t.contains("| mean rescue success (updates where rescue fired) | 0.500 | – |"), "{t}");
        assert!(t.contains("| H0 Pass@k after training (test) | 0.250 | – |"), "{t}");
        let u = update_table(&[("hs", &hs), ("grpo", &grpo)]);
        assert!(u.lines().any(|l| l.starts_with("| 2 | 1.000 | 0.000 |")), "{u}");
    }

    #[test]
    fn three_runs_get_a_column_each() {
        let a = series(&[("effective_group_rate", &[(1, 0.5)]), ("loss", &[(1, 0.1)])]);
        let b = series(&[("effective_group_rate", &[(1, 0.25)])]);
        let c = series(&[("effective_group_rate", &[(2, 1.0)])]);
        let t = summary_table(&[("a", &a), ("b", &b), ("c", &c)]);
        assert!(t.starts_with("| figure | `a` | `b` | `c` |\n|---|---:|---:|---:|\n"), "{t}");
        assert!(t.contains("| mean effective-group rate | 0.500 | 0.250 | 1.000 |"), "{t}");
        let u = update_table(&[("a", &a), ("b", &b), ("c", &c)]);
        let header = u.lines().next().unwrap();
        assert_eq!(header.matches('|').count(), 1 + 1 + 5 * 3, "{header}");
        assert!(u.lines().any(|l| l.starts_with("| 1 | 0.500 | 0.250 | – |")), "{u}");
        assert!(u.lines().any(|l| l.starts_with("| 2 | – | – | 1.000 |")), "{u}");
        assert_eq!(schemas::keys::comparison_dir(&["a", "b", "c"]), "comparisons/a-vs-b-vs-c/");
    }
}
