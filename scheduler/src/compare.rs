//! `harness-s compare RUN RUN [RUN ...]`: runs side by side — the transfer experiment of
//! the paper (Figure 3, Table 1 direction): a Harness-S run against plain GRPO with the same
//! model, seed, tasks and updates, or several seeds or variants at once. Per update:
//! effective-group rate and effective-token share; rescue success; H0 validation success
//! per calibration; Pass@k / Avg@k under H0 before and after training; rollouts relative to
//! GRPO; trained policy tokens. Markdown plus PNG plots under
//! `comparisons/<A>-vs-<B>[-vs-<C>...]/` in the store.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use anyhow::Context;
use bytes::Bytes;
use infra::store::ObjectStore;
use native::train::learner::metric::{LOSS, MISMATCH_MEAN, POLICY_TOKENS_TRAINED};
use schemas::{RolloutKind, Split, Trajectory};

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
        (!s.get(POLICY_TOKENS_TRAINED).is_empty()).then(|| s.get(POLICY_TOKENS_TRAINED).iter().map(|p| p.1).sum())
    }),
    ("H0 validation success, first calibration", |s| first(s.get("h0_validation_success"))),
    ("H0 validation success, last calibration", |s| last(s.get("h0_validation_success"))),
    ("H0 Pass@k before training (test)", |s| s.last("baseline/pass_at_k")),
    ("H0 Pass@k after training (test)", |s| s.last("evaluation/pass_at_k")),
    ("H0 Avg@k before training (test)", |s| s.last("baseline/avg_at_k")),
    ("H0 Avg@k after training (test)", |s| s.last("evaluation/avg_at_k")),
    ("rollouts relative to GRPO (end)", |s| last(s.get("rollouts_relative_to_grpo"))),
    ("mean training-inference mismatch", |s| mean(s.get(MISMATCH_MEAN))),
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
    let cols = ["effective_group_rate", "effective_token_share", "rescue_success", POLICY_TOKENS_TRAINED, LOSS];
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

/// Two-sided 95 % Student-t quantiles for 1..=30 degrees of freedom (beyond: [`t95`]).
const T95: [f64; 30] = [
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093,
    2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
];

/// The two-sided 95 % Student-t quantile for `df` degrees of freedom.
fn t95(df: usize) -> f64 {
    match df {
        0 => f64::NAN,
        1..=30 => T95[df - 1],
        31..=60 => 2.0,
        61..=120 => 1.98,
        _ => 1.96,
    }
}

/// Mean and half-width of the 95 % interval of the mean (Student t over n − 1 degrees of
/// freedom; 0 for one value). None for no values.
pub fn mean_ci(values: &[f64]) -> Option<(f64, f64)> {
    let n = values.len();
    if n == 0 {
        return None;
    }
    let m = values.iter().sum::<f64>() / n as f64;
    if n == 1 {
        return Some((m, 0.0));
    }
    let var = values.iter().map(|v| (v - m).powi(2)).sum::<f64>() / (n - 1) as f64;
    let t = t95(n - 1);
    Some((m, t * (var / n as f64).sqrt()))
}

/// A run's H0 test outcomes per task (pure over its evaluation rows): each test task's
/// success share over its k attempts before training (the baseline, step 0) and after it
/// (the last evaluation step). Rows of other harnesses, splits and kinds are ignored.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TaskOutcomes {
    pub before: BTreeMap<String, f64>,
    pub after: BTreeMap<String, f64>,
}

/// A run's H0 test episodes (evaluation rows of the test split under H0, without errors):
/// those before training (the baseline, step 0) and those of the last evaluation after it.
fn h0_test_episodes(rows: &[Trajectory]) -> (Vec<&Trajectory>, Vec<&Trajectory>) {
    let test: Vec<&Trajectory> = rows
        .iter()
        .filter(|t| t.kind == RolloutKind::Eval && t.split == Split::Test && t.harness_id == schemas::H0_ID && t.error_class.is_none())
        .collect();
    let last = test.iter().map(|t| t.step).filter(|s| *s > 0).max();
    let at = |step: Option<u32>| test.iter().copied().filter(|t| Some(t.step) == step).collect();
    (at(Some(0)), at(last))
}

impl TaskOutcomes {
    pub fn of(rows: &[Trajectory]) -> Self {
        let share = |episodes: Vec<&Trajectory>| {
            let mut by_task: BTreeMap<String, (f64, f64)> = BTreeMap::new();
            for t in episodes {
                let e = by_task.entry(t.task_id.clone()).or_default();
                e.0 += f64::from(u8::from(t.success));
                e.1 += 1.0;
            }
            by_task.into_iter().map(|(k, (ok, n))| (k, ok / n)).collect()
        };
        let (before, after) = h0_test_episodes(rows);
        TaskOutcomes { before: share(before), after: share(after) }
    }
}

/// What an H0 test episode did (pure over its row), for tool-using environments whose
/// query tool is `execute_sql` and whose answer tool is `commit_final_answer` (DBBench).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Behaviour {
    /// The first action the environment executed was a query.
    pub queried_first: bool,
    /// Some query ran.
    pub queried: bool,
    /// An answer was committed after a query had returned rows.
    pub answered_after_result: bool,
    pub success: bool,
}

impl Behaviour {
    pub fn of(row: &Trajectory) -> Self {
        use schemas::{Role, TurnSource};
        let actions: Vec<&schemas::Turn> =
            row.turns.iter().filter(|t| t.role == Role::Tool && t.source == TurnSource::Env && t.tool_name.is_some()).collect();
        let is = |t: &schemas::Turn, tool: &str| t.tool_name.as_deref() == Some(tool);
        let first_rows = actions.iter().position(|t| is(t, "execute_sql") && t.text.trim_start().starts_with('['));
        Behaviour {
            queried_first: actions.first().is_some_and(|t| is(t, "execute_sql")),
            queried: actions.iter().any(|t| is(t, "execute_sql")),
            answered_after_result: first_rows.is_some_and(|i| actions[i..].iter().any(|t| is(t, "commit_final_answer"))),
            success: row.success,
        }
    }
}

/// The behaviour table of arms (pure): for each arm, its H0 test episodes before and after
/// training, pooled over its runs — how many queried first, answered after a query's rows,
/// and succeeded with and without a query. `rows[i]` holds arm i's runs' trajectories.
pub fn behaviour_table(arms: &[(&str, Vec<&[Trajectory]>)]) -> String {
    let mut out = String::from(
        "| arm | H0 test episodes | queried first | answered after a result | success | success given a query | success without a query |\n|---|---:|---:|---:|---:|---:|---:|\n",
    );
    let share = |k: usize, n: usize| if n == 0 { "–".to_string() } else { format!("{k} of {n} ({:.0} %)", 100.0 * k as f64 / n as f64) };
    for (name, runs) in arms {
        for (when, after) in [("before", false), ("after", true)] {
            let mut b: Vec<Behaviour> = vec![];
            for rows in runs {
                let (before, last) = h0_test_episodes(rows);
                b.extend(if after { last } else { before }.into_iter().map(Behaviour::of));
            }
            let n = b.len();
            let count = |f: &dyn Fn(&Behaviour) -> bool| b.iter().filter(|x| f(x)).count();
            let queried = count(&|x| x.queried);
            let _ = writeln!(
                out,
                "| `{name}` {when} | {n} | {} | {} | {} | {} | {} |",
                share(count(&|x| x.queried_first), n),
                share(count(&|x| x.answered_after_result), n),
                share(count(&|x| x.success), n),
                share(count(&|x| x.queried && x.success), queried),
                share(count(&|x| !x.queried && x.success), n - queried),
            );
        }
    }
    out
}

/// The figures pooled over an arm's seeds and test tasks (pure): one value per (seed, task),
/// so that the interval reflects both. `outcomes[i]` is the arm's i-th run; `reference`
/// (the first arm's runs, in the same seed order, on the same tasks) gives the paired
/// difference. Each row: label, then mean ± half-width with n.
pub fn pooled_rows(arms: &[(&str, &[TaskOutcomes])]) -> String {
    let cell = |v: &[f64]| match mean_ci(v) {
        Some((m, h)) if v.len() > 1 => format!("{} ± {} (n = {})", number(m), number(h), v.len()),
        Some((m, _)) => format!("{} (n = 1)", number(m)),
        None => "–".into(),
    };
    let (ref_name, reference) = arms.first().map_or(("", &[][..]), |a| (a.0, a.1));
    // Per arm: before, after, after − before, after − reference; one value per (seed, task).
    let columns: Vec<[Vec<f64>; 4]> = arms
        .iter()
        .map(|(_, runs)| {
            let mut c: [Vec<f64>; 4] = Default::default();
            for (i, run) in runs.iter().enumerate() {
                c[0].extend(run.before.values());
                for (task, after) in &run.after {
                    c[1].push(*after);
                    c[2].extend(run.before.get(task).map(|b| after - b));
                    c[3].extend(reference.get(i).and_then(|r| r.after.get(task)).map(|b| after - b));
                }
            }
            c
        })
        .collect();
    let labels = [
        "H0 test success before training, per seed × task".to_string(),
        "H0 test success after training, per seed × task".to_string(),
        "H0 test success, after − before (paired by task)".to_string(),
        format!("H0 test success after training, − `{ref_name}` (paired by seed and task)"),
    ];
    let mut out = String::new();
    for (row, label) in labels.iter().enumerate() {
        let _ = write!(out, "| {label} |");
        for c in &columns {
            let _ = write!(out, " {} |", cell(&c[row]));
        }
        out.push('\n');
    }
    out
}

/// An arm of an experiment: its name and its runs (one per seed).
pub struct Arm<'a> {
    pub name: &'a str,
    pub runs: Vec<(&'a str, &'a Series)>,
}

/// Parses `NAME=RUN,RUN,...` (`--arm`).
pub fn parse_arm(text: &str) -> anyhow::Result<(String, Vec<String>)> {
    let (name, runs) =
        text.split_once('=').with_context(|| format!("--arm `{text}`: write NAME=RUN,RUN,... (e.g. grpo=t-grpo-1,t-grpo-2)"))?;
    let runs: Vec<String> = runs.split(',').map(str::trim).filter(|r| !r.is_empty()).map(str::to_string).collect();
    anyhow::ensure!(!name.is_empty() && !runs.is_empty(), "--arm `{text}`: needs a name and at least one run");
    Ok((name.to_string(), runs))
}

fn cell_ci(v: Option<(f64, f64)>, n: usize) -> String {
    match v {
        Some((m, h)) if n > 1 => format!("{} ± {}", number(m), number(h)),
        Some((m, _)) => number(m),
        None => "–".into(),
    }
}

/// The summary table of arms (pure): every figure of [`FIGURES`] plus the transfer probe,
/// as the mean over an arm's runs ± the half-width of its 95 % interval.
pub fn arms_table(arms: &[Arm<'_>]) -> String {
    let mut out = String::from("| figure |");
    for a in arms {
        let _ = write!(out, " `{}` (n = {}) |", a.name, a.runs.len());
    }
    let _ = writeln!(out, "\n|---|{}", "---:|".repeat(arms.len()));
    let extra: [Figure; 4] = [
        ("transfer log-probability, first calibration", |s| first(s.get("transfer_logprob"))),
        ("transfer log-probability, last calibration", |s| last(s.get("transfer_logprob"))),
        ("H0 answer-protocol share, first calibration", |s| first(s.get("h0_protocol_share"))),
        ("H0 answer-protocol share, last calibration", |s| last(s.get("h0_protocol_share"))),
    ];
    for (label, f) in FIGURES.iter().chain(&extra) {
        let _ = write!(out, "| {label} |");
        for a in arms {
            let values: Vec<f64> = a.runs.iter().filter_map(|(_, s)| f(s)).collect();
            let _ = write!(out, " {} |", cell_ci(mean_ci(&values), values.len()));
        }
        out.push('\n');
    }
    out
}

/// An arm's curve of `metric`: at each step the runs report it, the mean and interval.
pub fn arm_curve(arm: &Arm<'_>, metric: &str) -> Vec<(u32, f64, f64)> {
    mean_curve(&arm.runs.iter().map(|(_, s)| s.get(metric)).collect::<Vec<_>>())
}

/// Curves of several runs as one: at each step any run has, the mean and interval of the
/// runs' values there.
fn mean_curve(runs: &[&[(u32, f64)]]) -> Vec<(u32, f64, f64)> {
    let steps: std::collections::BTreeSet<u32> = runs.iter().flat_map(|c| c.iter().map(|p| p.0)).collect();
    steps
        .into_iter()
        .filter_map(|step| {
            let values: Vec<f64> = runs.iter().filter_map(|c| c.iter().find(|p| p.0 == step).map(|p| p.1)).collect();
            mean_ci(&values).map(|(m, h)| (step, m, h))
        })
        .collect()
}

/// Writes `comparisons/<arm>-vs-<arm>[...]/{compare.md, validation.png, transfer.png,
/// protocol.png, signal.png, rollouts.png}`: each arm's mean over its runs with its 95 %
/// interval as error bars. Returns the Markdown's URL.
pub async fn write_arms(store: &dyn ObjectStore, arms: &[(String, Vec<String>)]) -> anyhow::Result<String> {
    anyhow::ensure!(!arms.is_empty(), "compare needs at least one arm");
    let mut loaded: Vec<Vec<(String, Series)>> = vec![];
    let mut seen = std::collections::BTreeSet::new();
    for (name, runs) in arms {
        anyhow::ensure!(seen.insert(name.clone()), "arm `{name}` is named twice");
        let mut v = vec![];
        for id in runs {
            let s = Series::load(store, id).await?;
            anyhow::ensure!(
                !s.0.is_empty(),
                "run `{id}` (arm `{name}`) has no metrics in {}: is the id right, and has the run started?",
                store.url()
            );
            v.push((id.clone(), s));
        }
        loaded.push(v);
    }
    let arm_views: Vec<Arm<'_>> = arms
        .iter()
        .zip(&loaded)
        .map(|((name, _), runs)| Arm { name: name.as_str(), runs: runs.iter().map(|(id, s)| (id.as_str(), s)).collect() })
        .collect();
    let names: Vec<&str> = arms.iter().map(|(n, _)| n.as_str()).collect();
    let dir = schemas::keys::comparison_dir(&names);
    let tmp = tempfile::tempdir().context("cannot create a temporary folder for plots")?;
    let plots = [
        ("validation.png", "H0 validation success by calibration", "success rate", "h0_validation_success"),
        ("transfer.png", "Held-out sibling successes under H0: mean log-probability per token", "log-prob", "transfer_logprob"),
        ("protocol.png", "H0 replies that follow the answer protocol", "share", "h0_protocol_share"),
        ("signal.png", "Effective-group rate by update", "fraction", "effective_group_rate"),
        ("rollouts.png", "Rollouts relative to GRPO", "ratio", "rollouts_relative_to_grpo"),
    ];
    for (file, title, y, metric) in plots {
        let curves: Vec<(String, Vec<(u32, f64, f64)>)> =
            arm_views.iter().map(|a| (a.name.to_string(), arm_curve(a, metric))).filter(|(_, c)| !c.is_empty()).collect();
        if curves.is_empty() {
            continue;
        }
        let path = tmp.path().join(file);
        crate::report::interval_plot(&path, title, y, &curves).with_context(|| format!("drawing {file}"))?;
        store.put(&format!("{dir}{file}"), Bytes::from(std::fs::read(&path)?)).await?;
    }
    let mut md = format!(
        "# {}\n\nEach cell: the mean over the arm's runs (seeds) ± the half-width of its 95 % interval (Student t).\n\n",
        names.join(" vs ")
    );
    for a in &arm_views {
        let _ = writeln!(md, "- `{}`: {}", a.name, a.runs.iter().map(|(id, _)| format!("`{id}`")).collect::<Vec<_>>().join(", "));
    }
    md.push_str("\n## Summary\n\n");
    md.push_str(&arms_table(&arm_views));
    let mut outcomes: Vec<Vec<TaskOutcomes>> = vec![];
    let mut all_rows: Vec<Vec<Vec<Trajectory>>> = vec![];
    for (_, runs) in arms {
        let mut v = vec![];
        let mut r = vec![];
        for id in runs {
            let rows: Vec<Trajectory> = infra::table::read_committed(store, id, &schemas::keys::trajectories_prefix(id)).await?;
            v.push(TaskOutcomes::of(&rows));
            r.push(rows);
        }
        outcomes.push(v);
        all_rows.push(r);
    }
    // H0's own training curve: the base rollouts' mean reward per update.
    let base_curves: Vec<(String, Vec<(u32, f64, f64)>)> = names
        .iter()
        .zip(&all_rows)
        .map(|(name, runs)| {
            let per_run: Vec<Vec<(u32, f64)>> = runs.iter().map(|rows| crate::report::TrajectorySeries::of(rows).base_reward).collect();
            (name.to_string(), mean_curve(&per_run.iter().map(Vec::as_slice).collect::<Vec<_>>()))
        })
        .filter(|(_, c): &(String, Vec<(u32, f64, f64)>)| !c.is_empty())
        .collect();
    let base_plot = !base_curves.is_empty();
    if base_plot {
        let path = tmp.path().join("base-reward.png");
        crate::report::interval_plot(&path, "H0 base rollouts: mean reward by update", "reward", &base_curves)
            .context("drawing base-reward.png")?;
        store.put(&format!("{dir}base-reward.png"), Bytes::from(std::fs::read(&path)?)).await?;
    }
    let pooled: Vec<(&str, &[TaskOutcomes])> = names.iter().copied().zip(outcomes.iter().map(Vec::as_slice)).collect();
    let _ = write!(
        md,
        "\n## H0 test success pooled over seeds and tasks\n\nOne value per (seed, test task): the task's success share over its k attempts under H0. The paired rows subtract, task by task, the same task before training, or under the first arm (`{}`) with the same seed.\n\n| figure |{}\n|---|{}\n",
        names[0],
        names.iter().map(|n| format!(" `{n}` |")).collect::<String>(),
        "---:|".repeat(names.len())
    );
    md.push_str(&pooled_rows(&pooled));
    let behaviour: Vec<(&str, Vec<&[Trajectory]>)> =
        names.iter().copied().zip(all_rows.iter().map(|runs| runs.iter().map(Vec::as_slice).collect())).collect();
    md.push_str("\n## What H0 test episodes did\n\nPooled over each arm's runs; before training (the baseline) and after it. A result is a query's rows.\n\n");
    md.push_str(&behaviour_table(&behaviour));
    if base_plot {
        md.push_str("\n![H0 base rollouts' reward by update](base-reward.png)\n");
    }
    md.push_str("\n![H0 validation](validation.png)\n\n![transfer](transfer.png)\n\n![protocol](protocol.png)\n\n![EG rate](signal.png)\n\n![rollouts](rollouts.png)\n");
    let key = format!("{dir}compare.md");
    store.put(&key, Bytes::from(md.clone())).await?;
    println!("{md}");
    Ok(store.object_url(&key))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn intervals_by_hand() {
        assert_eq!(mean_ci(&[]), None);
        assert_eq!(mean_ci(&[0.5]), Some((0.5, 0.0)));
        // n = 3: mean 2, s = 1, half-width t(2) · 1 / √3 = 4.303 / 1.732
        let (m, h) = mean_ci(&[1.0, 2.0, 3.0]).unwrap();
        assert!((m - 2.0).abs() < 1e-12 && (h - 4.303 / 3f64.sqrt()).abs() < 1e-9, "{m} {h}");
        assert_eq!(parse_arm("grpo=a, b").unwrap(), ("grpo".to_string(), vec!["a".to_string(), "b".to_string()]));
        assert!(parse_arm("grpo").is_err() && parse_arm("=a").is_err());
    }

    #[test]
    fn arms_average_their_seeds_with_an_interval() {
        let a1 = series(&[("h0_validation_success", &[(0, 0.0), (4, 0.25)]), ("transfer_logprob", &[(0, -2.0), (4, -1.0)])]);
        let a2 = series(&[("h0_validation_success", &[(0, 0.0), (4, 0.75)]), ("transfer_logprob", &[(0, -2.0), (4, -1.5)])]);
        let b = series(&[("h0_validation_success", &[(0, 0.0), (4, 0.0)])]);
        let arms = [Arm { name: "hs", runs: vec![("a1", &a1), ("a2", &a2)] }, Arm { name: "grpo", runs: vec![("b", &b)] }];
        let t = arms_table(&arms);
        // mean 0.5, s = 0.3536, t(1) = 12.706: ± 12.706 · 0.3536 / √2 = 3.176
        assert!(t.contains("| H0 validation success, last calibration | 0.500 ± 3.176 | 0.000 |"), "{t}");
        assert!(t.contains("| transfer log-probability, last calibration | -1.250 ± 3.176 | – |"), "{t}");
        assert!(t.starts_with("| figure | `hs` (n = 2) | `grpo` (n = 1) |"), "{t}");
        let c = arm_curve(&arms[0], "h0_validation_success");
        assert_eq!(c[0], (0, 0.0, 0.0));
        assert_eq!((c[1].0, c[1].1), (4, 0.5));
    }

    fn series(pairs: &[(&str, &[(u32, f64)])]) -> Series {
        Series(pairs.iter().map(|(n, p)| (n.to_string(), p.to_vec())).collect::<BTreeMap<_, _>>())
    }

    fn outcomes(before: &[(&str, f64)], after: &[(&str, f64)]) -> TaskOutcomes {
        let m = |v: &[(&str, f64)]| v.iter().map(|(k, x)| (k.to_string(), *x)).collect();
        TaskOutcomes { before: m(before), after: m(after) }
    }

    fn eval_row(task: &str, step: u32, success: bool, harness: &str, split: Split) -> Trajectory {
        Trajectory {
            trajectory_id: format!("{task}-{step}-{harness}"),
            run_id: "r".into(),
            job_id: "j".into(),
            step,
            kind: RolloutKind::Eval,
            split,
            task_id: task.into(),
            task_type: "counting".into(),
            group_id: String::new(),
            attempt: 0,
            harness_id: harness.into(),
            harness_version: String::new(),
            policy_checkpoint: String::new(),
            seed: 0,
            reward: f64::from(u8::from(success)),
            success,
            termination: schemas::Termination::Committed,
            error_class: None,
            error_message: None,
            prompt_tokens: 0,
            completion_tokens: 0,
            harness_tokens: 0,
            model_calls: 1,
            env_actions: 1,
            started_at_ms: 0,
            duration_ms: 0,
            policy_ms: 0,
            env_ms: 0,
            temperature: 0.7,
            tool_view: String::new(),
            turns: vec![],
        }
    }

    /// An H0 test episode at `step` whose environment executed `actions` (tool, result text).
    fn episode(step: u32, actions: &[(&str, &str)], success: bool) -> Trajectory {
        use schemas::{Role, Turn, TurnSource};
        let mut row = eval_row("t", step, success, "h0", Split::Test);
        for (i, (tool, text)) in actions.iter().enumerate() {
            let mut call = Turn::context(2 * i as u32, Role::Assistant, TurnSource::Policy, String::new());
            call.tool_name = Some(tool.to_string());
            let mut result = Turn::context(2 * i as u32 + 1, Role::Tool, TurnSource::Env, text.to_string());
            result.tool_name = Some(tool.to_string());
            row.turns.extend([call, result]);
        }
        row
    }

    #[test]
    fn behaviour_reads_what_an_episode_did() {
        let q = ("execute_sql", "[(34,)]");
        let err = ("execute_sql", "no such column: agee");
        let answer = ("commit_final_answer", "Answer committed.");
        let read = Behaviour::of(&episode(3, &[q, answer], true));
        assert_eq!(read, Behaviour { queried_first: true, queried: true, answered_after_result: true, success: true });
        // a query that failed is not a result to answer from
        let failed = Behaviour::of(&episode(3, &[err, answer], false));
        assert_eq!(failed, Behaviour { queried_first: true, queried: true, answered_after_result: false, success: false });
        let guessed = Behaviour::of(&episode(3, &[answer], true));
        assert_eq!(guessed, Behaviour { queried_first: false, queried: false, answered_after_result: false, success: true });
        // repeating the query without answering
        let repeated = Behaviour::of(&episode(3, &[q, q, q], false));
        assert!(repeated.queried_first && !repeated.answered_after_result);

        let before = vec![episode(0, &[answer], false), episode(0, &[answer], true)];
        let after = vec![episode(5, &[q, answer], true), episode(5, &[q, q], false), episode(5, &[answer], false)];
        let run: Vec<Trajectory> = before.into_iter().chain(after).collect();
        let t = behaviour_table(&[("hs", vec![run.as_slice()])]);
        assert!(t.contains("| `hs` before | 2 | 0 of 2 (0 %) | 0 of 2 (0 %) | 1 of 2 (50 %) | – | 1 of 2 (50 %) |"), "{t}");
        assert!(t.contains("| `hs` after | 3 | 2 of 3 (67 %) | 1 of 3 (33 %) | 1 of 3 (33 %) | 1 of 2 (50 %) | 0 of 1 (0 %) |"), "{t}");
    }

    #[test]
    fn eval_rows_become_per_task_shares_before_and_after() {
        let row = eval_row;
        let rows = vec![
            row("a", 0, true, "h0", Split::Test),
            row("a", 0, false, "h0", Split::Test),
            row("a", 8, true, "h0", Split::Test),
            row("a", 8, true, "h0", Split::Test),
            row("a", 8, true, "s1", Split::Test),       // another harness
            row("b", 0, true, "h0", Split::Validation), // evolve rows share kind and step
            row("b", 0, false, "h0", Split::Test),
            row("b", 8, false, "h0", Split::Test),
        ];
        let o = TaskOutcomes::of(&rows);
        assert_eq!(o, outcomes(&[("a", 0.5), ("b", 0.0)], &[("a", 1.0), ("b", 0.0)]));
    }

    #[test]
    fn pooled_rows_pair_by_task_and_by_seed() {
        let grpo = [outcomes(&[("a", 0.0), ("b", 0.5)], &[("a", 0.0), ("b", 0.5)]), outcomes(&[("c", 0.0)], &[("c", 0.0)])];
        let hs = [outcomes(&[("a", 0.0), ("b", 0.5)], &[("a", 1.0), ("b", 0.5)]), outcomes(&[("c", 0.0)], &[("c", 1.0)])];
        let t = pooled_rows(&[("grpo", &grpo), ("hs", &hs)]);
        // hs after: [1, 0.5, 1], mean 0.833, s = 0.2887, t(2) = 4.303: ± 0.717
        assert!(t.contains("| H0 test success after training, per seed × task | 0.167 ± 0.717 (n = 3) | 0.833 ± 0.717 (n = 3) |"), "{t}");
        // paired: after − before = [1, 0, 1]; − grpo = [1, 0, 1]
        assert!(t.contains("| H0 test success, after − before (paired by task) | 0.000 ± 0.000 (n = 3) | 0.667 ± 1.434 (n = 3) |"), "{t}");
        assert!(t.contains("− `grpo` (paired by seed and task) | 0.000 ± 0.000 (n = 3) | 0.667 ± 1.434 (n = 3) |"), "{t}");
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
