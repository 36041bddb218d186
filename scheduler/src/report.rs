//! `harness-s report RUN`: Markdown plus PNG plots of a run's stored metrics — the
//! training signals by update (Figure 3a/b of the paper), H0 validation success by
//! checkpoint (Figure 3c), rescue success by training stage (Table 2), Pass@k / Avg@k
//! before and after training, and Pass@k / Avg@k under the router's Rank-r harnesses
//! beside H0 (Table 5).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use anyhow::Context;
use bytes::Bytes;
use infra::store::ObjectStore;
use infra::table::read_committed;
use jobs::edit::best_patch;
use native::train::learner::metric::*;
use plotters::prelude::*;
use schemas::{keys, MetricRow, PatchRecord};

/// Metrics of a run as `name → [(step, value)]`, stage-qualified where it matters.
pub struct Series(pub BTreeMap<String, Vec<(u32, f64)>>);

impl Series {
    pub async fn load(store: &dyn ObjectStore, run_id: &str) -> anyhow::Result<Self> {
        let rows: Vec<MetricRow> = infra::table::read_prefix(store, &schemas::keys::metrics_prefix(run_id)).await?;
        let mut m: BTreeMap<String, Vec<(u32, f64)>> = BTreeMap::new();
        for r in rows {
            let name = match r.stage.as_str() {
                "baseline" | "evaluation" | "evaluation:h_best" => format!("{}/{}", r.stage, r.name),
                s if s.starts_with(crate::cost::STAGE_PREFIX) => format!("{}/{}", r.stage, r.name),
                _ => r.name,
            };
            m.entry(name).or_default().push((r.step, r.value));
        }
        for v in m.values_mut() {
            v.sort_by_key(|a| a.0);
            v.dedup_by_key(|p| p.0);
        }
        Ok(Series(m))
    }

    pub fn get(&self, name: &str) -> &[(u32, f64)] {
        self.0.get(name).map(Vec::as_slice).unwrap_or(&[])
    }

    pub fn last(&self, name: &str) -> Option<f64> {
        self.get(name).last().map(|p| p.1)
    }

    /// H_best of the final evaluation (Table 7): its id, validation success, Pass@k, Avg@k.
    pub fn h_best(&self) -> Option<(String, f64, f64, f64)> {
        let (key, v) = self.0.iter().find(|(k, _)| k.starts_with("evaluation:h_best/"))?;
        let id = key.trim_start_matches("evaluation:h_best/").to_string();
        Some((id, v.last()?.1, self.last("evaluation/h_best_pass_at_k")?, self.last("evaluation/h_best_avg_at_k")?))
    }
}

/// Columns that count things (rollouts, tokens): printed as whole numbers.
const COUNT_COLUMNS: [&str; 3] = ["rollouts_base", "rollouts_rescue", POLICY_TOKENS_TRAINED];

/// The per-update metrics table (Markdown).
pub fn update_table(s: &Series) -> String {
    let cols = [
        "effective_group_rate",
        "effective_token_share",
        "rescue_rate",
        "rescue_success",
        "mean_reward",
        "rollouts_base",
        "rollouts_rescue",
        "rollouts_relative_to_grpo",
        POLICY_TOKENS_TRAINED,
        LOSS,
        GRAD_NORM,
        MISMATCH_MEAN,
        MISMATCH_MAX,
        TIS_CLIPPED_SHARE,
        ENTROPY,
        KL_TO_START,
    ];
    let steps: std::collections::BTreeSet<u32> = cols.iter().flat_map(|c| s.get(c).iter().map(|p| p.0)).collect();
    let mut out = String::from("| update | ");
    out.push_str(&cols.join(" | "));
    out.push_str(" |\n|---|");
    out.push_str(&"---:|".repeat(cols.len()));
    out.push('\n');
    for step in steps {
        let _ = write!(out, "| {step} |");
        for c in cols {
            match s.get(c).iter().find(|p| p.0 == step) {
                Some((_, v)) if COUNT_COLUMNS.contains(&c) => {
                    let _ = write!(out, " {v:.0} |");
                }
                Some((_, v)) => {
                    let _ = write!(out, " {} |", number(*v));
                }
                None => out.push_str(" – |"),
            }
        }
        out.push('\n');
    }
    out
}

/// A table cell: three decimals, or scientific notation for small non-zero values (the
/// training–inference mismatch lives around 1e-5), integers as integers.
pub fn number(v: f64) -> String {
    if v != 0.0 && v.abs() < 0.01 {
        format!("{v:.2e}")
    } else if v.fract() == 0.0 && v.abs() >= 10.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.3}")
    }
}

/// The training stages of a run of `updates` updates, as (label, first, last): stages of
/// `stage_updates` updates each (`[evaluation] stage_updates`), or by default the run in
/// thirds (early, mid, late; Table 2, Figure 3). Empty stages are left out.
pub fn training_stages(updates: u32, stage_updates: Option<u32>) -> Vec<(String, u32, u32)> {
    match stage_updates.filter(|n| *n > 0) {
        Some(n) => (0..updates.div_ceil(n)).map(|i| (format!("{}", i + 1), i * n + 1, ((i + 1) * n).min(updates))).collect(),
        None => ["early", "mid", "late"]
            .into_iter()
            .filter_map(|stage| {
                let steps: Vec<u32> = (1..=updates).filter(|u| training_stage(*u, updates) == stage).collect();
                Some((stage.to_string(), *steps.first()?, *steps.last()?))
            })
            .collect(),
    }
}

/// Training stage of update `u` of `n` (Table 2, Figure 3): the updates split in thirds.
pub fn training_stage(u: u32, n: u32) -> &'static str {
    let n = n.max(1);
    match (3 * u.saturating_sub(1)) / n {
        0 => "early",
        1 => "mid",
        _ => "late",
    }
}

/// Rates of each training stage (Table 2 layout), pooled over the stage's groups: effective
/// groups / groups, effective policy tokens / policy tokens, rescue groups / groups, rescue
/// groups with a success / rescue groups. Runs stored before the counts were recorded get
/// the mean of the per-update rates instead (rescue success over updates where it fired).
pub fn stage_table(s: &Series, updates: u32, stage_updates: Option<u32>) -> String {
    let cols = ["effective_group_rate", "effective_token_share", "rescue_rate", "rescue_success"];
    // (rate, numerator count, denominator count)
    let pooled = [
        ("effective_group_rate", "effective_groups", "groups"),
        ("effective_token_share", "effective_policy_tokens", "retained_policy_tokens"),
        ("rescue_rate", "rescued_groups", "groups"),
        ("rescue_success", "rescued_with_success", "rescued_groups"),
    ];
    let at = |name: &str, u: u32| s.get(name).iter().find(|p| p.0 == u).map(|p| p.1);
    let mut out = String::from("| stage | updates | ");
    out.push_str(&cols.join(" | "));
    out.push_str(" |\n|---|---|");
    out.push_str(&"---:|".repeat(cols.len()));
    out.push('\n');
    for (stage, first, last) in training_stages(updates, stage_updates) {
        let steps: Vec<u32> = (first..=last).collect();
        let _ = write!(out, "| {stage} | {first}–{last} |");
        for (c, num, den) in pooled {
            // Updates that ran record their counts; a stage pools those it has.
            let counts: Vec<(f64, f64)> = steps.iter().filter_map(|u| Some((at(num, *u)?, at(den, *u)?))).collect();
            let value = match (!counts.is_empty()).then_some(counts) {
                Some(counts) => {
                    let (n, d) = counts.iter().fold((0.0, 0.0), |a, p| (a.0 + p.0, a.1 + p.1));
                    (d > 0.0).then(|| n / d)
                }
                None => {
                    let fired = |u: &u32| c != "rescue_success" || s.get("rollouts_rescue").iter().any(|p| p.0 == *u && p.1 > 0.0);
                    let xs: Vec<f64> = steps.iter().filter(|u| fired(u)).filter_map(|u| at(c, *u)).collect();
                    (!xs.is_empty()).then(|| xs.iter().sum::<f64>() / xs.len() as f64)
                }
            };
            match value {
                Some(v) => {
                    let _ = write!(out, " {v:.3} |");
                }
                None => out.push_str(" – |"),
            }
        }
        out.push('\n');
    }
    out
}

/// What the report plots from the training rollout rows (base and rescue kinds).
#[derive(Debug, Default, PartialEq)]
pub struct TrajectorySeries {
    /// Success rate per update, by harness.
    pub success_by_harness: BTreeMap<String, Vec<(u32, f64)>>,
    /// Rollouts and successes over the run, by harness.
    pub totals_by_harness: BTreeMap<String, (u64, u64)>,
    /// Mean reward of the base (H0) rollouts per update.
    pub base_reward: Vec<(u32, f64)>,
    /// Calibration (validation) rollouts and successes by checkpoint step and harness: each
    /// harness's validation success with the policy of that step (the pool's gate at step 0).
    pub calibration: BTreeMap<u32, BTreeMap<String, (u64, u64)>>,
    /// The same rollouts by checkpoint step, task and harness (for the rescue contrast).
    pub calibration_tasks: BTreeMap<u32, BTreeMap<String, BTreeMap<String, (u64, u64)>>>,
    /// Mean policy (completion) tokens per rollout per update, in hundreds (to share an
    /// axis with the reward).
    pub length_hundreds: Vec<(u32, f64)>,
}

impl TrajectorySeries {
    pub fn of(rows: &[schemas::Trajectory]) -> Self {
        use schemas::RolloutKind;
        let training: Vec<&schemas::Trajectory> =
            rows.iter().filter(|r| matches!(r.kind, RolloutKind::Base | RolloutKind::Rescue)).collect();
        let mut by: BTreeMap<(String, u32), (u64, u64)> = BTreeMap::new();
        let mut reward: BTreeMap<u32, (f64, u64)> = BTreeMap::new();
        let mut length: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
        let mut out = TrajectorySeries::default();
        for r in rows.iter().filter(|r| r.kind == RolloutKind::Calibration && r.error_class.is_none()) {
            let e = out.calibration.entry(r.step).or_default().entry(r.harness_id.clone()).or_default();
            e.0 += 1;
            e.1 += u64::from(r.success);
            let e = out.calibration_tasks.entry(r.step).or_default().entry(r.task_id.clone()).or_default();
            let e = e.entry(r.harness_id.clone()).or_default();
            e.0 += 1;
            e.1 += u64::from(r.success);
        }
        for r in &training {
            let e = by.entry((r.harness_id.clone(), r.step)).or_default();
            e.0 += 1;
            e.1 += u64::from(r.success);
            let t = out.totals_by_harness.entry(r.harness_id.clone()).or_default();
            t.0 += 1;
            t.1 += u64::from(r.success);
            if r.kind == RolloutKind::Base {
                let e = reward.entry(r.step).or_default();
                e.0 += r.reward;
                e.1 += 1;
            }
            let e = length.entry(r.step).or_default();
            e.0 += r.completion_tokens;
            e.1 += 1;
        }
        for ((h, step), (n, ok)) in by {
            out.success_by_harness.entry(h).or_default().push((step, ok as f64 / n as f64));
        }
        out.base_reward = reward.into_iter().map(|(s, (sum, n))| (s, sum / n as f64)).collect();
        out.length_hundreds = length.into_iter().map(|(s, (sum, n))| (s, sum as f64 / n as f64 / 100.0)).collect();
        out
    }
}

/// The run's resolved settings in a few lines: what the numbers below were measured with.
pub fn spec_summary(stored: &handlers::inputs::StoredRun) -> String {
    let s = &stored.spec;
    let a = &s.algorithm;
    let model = if s.policy.backend == handlers::spec::Backend::Native {
        s.policy.model.clone()
    } else {
        format!("{} at {}", s.policy.model, infra::redact_url(s.policy.base_url.as_deref().unwrap_or_default()))
    };
    format!(
        "Policy `{model}` ({} backend, temperature {}); K = {}, {} task(s) per update, {} update(s), learning rate {:e}; rescue `{}` with the `{}` router over {} sibling(s){}; seed {}.\n\n",
        s.policy.backend,
        s.policy.temperature,
        a.k,
        a.tasks_per_update,
        a.updates,
        a.learning_rate,
        a.rescue.as_str(),
        s.router.variant_name(),
        stored.pool.len(),
        if a.learn { "" } else { "; no learning (rescue only)" },
        s.run.seed
    )
}

/// Table 9: what the run cost, per stage kind (wall time, rollouts, the policy's calls and
/// tokens) and per LLM component (voters, profiler, diagnoser, editor; the learner's
/// forward tokens), summed over the run. `None` when the run recorded no costs.
pub fn cost_table(s: &Series) -> Option<String> {
    use crate::cost::{COMPONENTS, KINDS, STAGE_PREFIX};
    let sum = |kind: &str, name: &str| -> Option<f64> {
        let v = s.get(&format!("{STAGE_PREFIX}{kind}/{name}"));
        (!v.is_empty()).then(|| v.iter().map(|p| p.1).sum())
    };
    let cell = |v: Option<f64>| v.map(|v| format!("{v:.0}")).unwrap_or_else(|| "–".into());
    let kinds: Vec<&str> = KINDS.iter().copied().filter(|k| sum(k, "wall_seconds").is_some()).collect();
    if kinds.is_empty() {
        return None;
    }
    let mut out = String::from("| stage | wall time (s) | rollouts | policy calls | policy prompt tokens | policy completion tokens |\n|---|---:|---:|---:|---:|---:|\n");
    let mut total = [0.0; 5];
    for k in &kinds {
        let cols = ["wall_seconds", "rollouts", "policy_calls", "policy_prompt_tokens", "policy_completion_tokens"].map(|n| sum(k, n));
        for (t, c) in total.iter_mut().zip(&cols) {
            *t += c.unwrap_or(0.0);
        }
        let wall = cols[0].map(|v| format!("{v:.1}")).unwrap_or_default();
        let _ = writeln!(out, "| {k} | {wall} | {} | {} | {} | {} |", cell(cols[1]), cell(cols[2]), cell(cols[3]), cell(cols[4]));
    }
    let _ = writeln!(out, "| all | {:.1} | {:.0} | {:.0} | {:.0} | {:.0} |", total[0], total[1], total[2], total[3], total[4]);
    out.push_str("\n| component | calls | prompt tokens | completion tokens |\n|---|---:|---:|---:|\n");
    for c in COMPONENTS {
        let n = |q: &str| KINDS.iter().filter_map(|k| sum(k, &format!("{c}_{q}"))).reduce(|a, b| a + b);
        let _ = writeln!(out, "| {c} | {} | {} | {} |", cell(n("calls")), cell(n("prompt_tokens")), cell(n("completion_tokens")));
    }
    let learner = sum("learn", "learner_forward_tokens");
    let _ = writeln!(out, "| learner (tokens run forward and backward) | – | {} | – |", cell(learner));
    Some(out)
}

/// Table 5: Pass@k / Avg@k under H0 and under the router's Rank-r harness, and how often
/// H0 sits at each rank (metrics `pass_at_k/<row>` etc. of the final evaluation).
pub fn rank_table(s: &Series) -> Option<String> {
    let mut rows = vec!["h0".to_string()];
    rows.extend((1..=8).map(|r| format!("rank-{r}")).filter(|r| s.last(&format!("pass_at_k/{r}")).is_some()));
    if rows.len() == 1 {
        return None;
    }
    let mut out = String::from("| harness | Pass@k | Avg@k | tasks placing H0 here |\n|---|---:|---:|---:|\n");
    for r in rows {
        let label = if r == "h0" { "H0".to_string() } else { r.replace("rank", "Rank") };
        let f = |name: &str| s.last(&format!("{name}/{r}")).map(|v| format!("{v:.3}")).unwrap_or_else(|| "–".into());
        let _ = writeln!(out, "| {label} | {} | {} | {} |", f("pass_at_k"), f("avg_at_k"), f("h0_rate"));
    }
    Some(out)
}

pub fn line_plot(path: &std::path::Path, title: &str, y_label: &str, series: &[(&str, &[(u32, f64)])]) -> anyhow::Result<()> {
    line_plot_over(path, title, "update", y_label, series)
}

/// [`line_plot`] with its own x-axis label. Series after the first are drawn with larger
/// hollow markers, so that equal values (two rates at 0) stay visible on top of each other.
pub fn line_plot_over(
    path: &std::path::Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[(&str, &[(u32, f64)])],
) -> anyhow::Result<()> {
    let root = BitMapBackend::new(path, (720, 420)).into_drawing_area();
    root.fill(&WHITE)?;
    let max_x = series.iter().flat_map(|(_, s)| s.iter().map(|p| p.0)).max().unwrap_or(1).max(1);
    let min_x = series.iter().flat_map(|(_, s)| s.iter().map(|p| p.0)).min().unwrap_or(0);
    let max_y = series.iter().flat_map(|(_, s)| s.iter().map(|p| p.1)).fold(f64::MIN, f64::max);
    let min_y = series.iter().flat_map(|(_, s)| s.iter().map(|p| p.1)).fold(0.0f64, f64::min);
    // Fractions keep a 0–1 axis; other quantities (loss, gradient norm) get their own range.
    let max_y = if (max_y <= 1.0 && max_y > 0.2 && min_y >= 0.0) || max_y == f64::MIN { 1.0 } else { max_y.max(min_y + 1e-9) };
    let pad = (max_y - min_y) * 0.05;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(48)
        .build_cartesian_2d(min_x as f64 - 0.5..max_x as f64 + 0.5, (min_y - if min_y < 0.0 { pad } else { 0.0 })..max_y + pad)?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .x_labels((max_x - min_x) as usize + 2)
        .x_label_formatter(&|x| if x.fract().abs() < 1e-9 { format!("{x:.0}") } else { String::new() })
        .y_label_formatter(&|y| if max_y - min_y < 0.05 { format!("{y:.1e}") } else { format!("{y:.2}") })
        .draw()?;
    let colors = [BLUE, RED, GREEN, MAGENTA, CYAN, BLACK];
    for (i, (name, points)) in series.iter().enumerate() {
        let color = colors[i % colors.len()];
        let pts: Vec<(f64, f64)> = points.iter().map(|(x, y)| (*x as f64, *y)).collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))?
            .label(*name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2)));
        let (size, style) = if i == 0 { (3, color.filled()) } else { (3 + 2 * i as i32, color.stroke_width(2)) };
        chart.draw_series(pts.into_iter().map(|p| Circle::new(p, size, style)))?;
    }
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
    root.present()?;
    Ok(())
}

/// Curves of means with error bars (an experiment's arms): per name, (x, mean, half-width
/// of the interval).
pub fn interval_plot(path: &std::path::Path, title: &str, y_label: &str, curves: &[(String, Vec<(u32, f64, f64)>)]) -> anyhow::Result<()> {
    let root = BitMapBackend::new(path, (760, 440)).into_drawing_area();
    root.fill(&WHITE)?;
    let xs = curves.iter().flat_map(|(_, c)| c.iter().map(|p| p.0));
    let (min_x, max_x) = (xs.clone().min().unwrap_or(0), xs.max().unwrap_or(1).max(1));
    let lo = curves.iter().flat_map(|(_, c)| c.iter().map(|p| p.1 - p.2)).fold(f64::MAX, f64::min);
    let hi = curves.iter().flat_map(|(_, c)| c.iter().map(|p| p.1 + p.2)).fold(f64::MIN, f64::max);
    let (lo, hi) = if lo >= 0.0 && hi <= 1.0 && hi > 0.2 { (0.0, 1.0) } else { (lo, hi.max(lo + 1e-9)) };
    let pad = (hi - lo) * 0.05;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(52)
        .build_cartesian_2d(min_x as f64 - 0.5..max_x as f64 + 0.5, lo - pad..hi + pad)?;
    chart.configure_mesh().x_desc("update").y_desc(y_label).x_labels((max_x - min_x) as usize + 2).draw()?;
    let colors = [BLUE, RED, GREEN, MAGENTA, CYAN, BLACK];
    let n = curves.len().max(1) as f64;
    for (i, (name, c)) in curves.iter().enumerate() {
        let color = colors[i % colors.len()];
        // Arms side by side at each x, so equal values stay visible.
        let dx = (i as f64 - (n - 1.0) / 2.0) * 0.08;
        let pts: Vec<(f64, f64)> = c.iter().map(|(x, m, _)| (*x as f64 + dx, *m)).collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2)));
        chart.draw_series(c.iter().map(|(x, m, h)| ErrorBar::new_vertical(*x as f64 + dx, m - h, *m, m + h, color.filled(), 6)))?;
    }
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
    root.present()?;
    Ok(())
}

/// The evolved pool's figures (Figure 1a, Figure 5) and table, when this run evolved or
/// seeded a pool with validation coverage; writes `repairs.png` and `overlap.png`.
async fn pool_section(store: &dyn ObjectStore, run_id: &str, dir: &std::path::Path) -> anyhow::Result<Option<String>> {
    use jobs::evolve::report::{mechanism_table, plot_overlap, plot_repairs, pool_repair_counts, repair_table};
    let (m, specs) = match jobs::evolve::pool::load_pool(store, run_id).await {
        Ok(m) => m,
        Err(jobs::evolve::PoolError::Missing { .. }) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let Some(counts) = pool_repair_counts(&m) else { return Ok(None) };
    if counts.is_empty() {
        return Ok(None);
    }
    plot_repairs(&counts, &dir.join("repairs.png"))?;
    plot_overlap(&counts, &dir.join("overlap.png"))?;
    for file in ["repairs.png", "overlap.png"] {
        store.put(&schemas::keys::report_file(run_id, file), Bytes::from(std::fs::read(dir.join(file))?)).await?;
    }
    Ok(Some(format!(
        "\n## Sibling pool: repairs relative to H0 on {} validation tasks (Figure 1a, Figure 5)\n\n{}\n![repairs](repairs.png)\n![overlap](overlap.png)\n\n### Mechanisms\n\nPolicy-side siblings change what the policy itself writes, which training keeps; harness-side ones act in its place (`[environment] harness_actions`), and those tokens are never trained on.\n\n{}",
        m.validation_tasks.len(),
        repair_table(&counts),
        mechanism_table(&specs, Some(&m))
    )))
}

/// The calibrations of a run (pure): H0 validation success at each checkpoint step, with
/// the transfer probe (mean log-probability per token of the held-out sibling successes
/// under H0) and the share of H0 replies that follow the answer protocol where measured.
pub fn calibration_table(s: &Series) -> String {
    let at = |name: &str, step: u32| s.get(name).iter().find(|p| p.0 == step).map_or_else(|| "–".to_string(), |p| format!("{:.3}", p.1));
    let mut md = String::from(
        "| checkpoint step | H0 validation success | transfer log-prob (held-out, under H0) | H0 answer-protocol share |\n|---:|---:|---:|---:|\n",
    );
    for (step, v) in s.get("h0_validation_success") {
        let _ = writeln!(md, "| {step} | {v:.3} | {} | {} |", at("transfer_logprob", *step), at("h0_protocol_share", *step));
    }
    md
}

/// Validation success by harness (rows, H0 first) and checkpoint step (columns), as
/// "successes / rollouts (share)" (pure).
pub fn calibration_harness_table(c: &BTreeMap<u32, BTreeMap<String, (u64, u64)>>) -> String {
    let steps: Vec<u32> = c.keys().copied().collect();
    let mut harnesses: Vec<&String> = c.values().flat_map(|m| m.keys()).collect::<std::collections::BTreeSet<_>>().into_iter().collect();
    harnesses.sort_by_key(|h| (h.as_str() != schemas::H0_ID, h.as_str()));
    let mut md = String::from("| harness |");
    for s in &steps {
        let _ = write!(md, " step {s} |");
    }
    let _ = writeln!(md, "\n|---|{}", "---:|".repeat(steps.len()));
    for h in harnesses {
        let _ = write!(md, "| {h} |");
        for s in &steps {
            match c[s].get(h) {
                Some((n, ok)) => {
                    let _ = write!(md, " {ok} / {n} ({:.3}) |", *ok as f64 / (*n).max(1) as f64);
                }
                None => md.push_str(" – |"),
            }
        }
        md.push('\n');
    }
    md
}

/// The rescue groups the validation rollouts of checkpoint `step` predict: of the
/// validation tasks H0 failed (no success), how many would get a rescue group with both
/// outcomes — a group GRPO can learn from (Eq. 6 gives a group of equal rewards no
/// advantage). The K routed siblings are taken as the K with the highest validation
/// success at that step (ties by id): the rule router's ranking without the task's own
/// neighbours. Returns (H0-failed tasks, tasks whose routed siblings' rollouts mix
/// successes and failures, the siblings).
pub fn rescue_contrast(t: &TrajectorySeries, step: u32, k: usize) -> Option<(usize, usize, Vec<String>)> {
    let by_harness = t.calibration.get(&step)?;
    let mut siblings: Vec<(&String, f64)> =
        by_harness.iter().filter(|(h, _)| h.as_str() != schemas::H0_ID).map(|(h, (n, ok))| (h, *ok as f64 / (*n).max(1) as f64)).collect();
    if siblings.is_empty() {
        return None;
    }
    siblings.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(b.0)));
    let routed: Vec<String> = siblings.iter().take(k.max(1)).map(|(h, _)| (*h).clone()).collect();
    let (mut failed, mut mixed) = (0, 0);
    for outcomes in t.calibration_tasks.get(&step)?.values() {
        let Some((_, h0_ok)) = outcomes.get(schemas::H0_ID) else { continue };
        if *h0_ok > 0 {
            continue;
        }
        failed += 1;
        let (n, ok) = routed.iter().filter_map(|h| outcomes.get(h)).fold((0, 0), |(n, ok), (a, b)| (n + a, ok + b));
        mixed += usize::from(ok > 0 && ok < n);
    }
    Some((failed, mixed, routed))
}

/// Writes `runs/<run>/reports/{report.md, signals.png, validation.png, rescue.png}`;
/// returns the report's URL.
pub async fn write(store: &dyn ObjectStore, run_id: &str) -> anyhow::Result<String> {
    if handlers::inputs::load_stored(store, run_id).await.is_ok_and(|r| r.spec.editor_training.is_some()) {
        return write_editor_report(store, run_id).await;
    }
    let s = Series::load(store, run_id).await?;
    let dir = tempfile::tempdir().context("cannot create a temporary folder for plots")?;
    let rows: Vec<schemas::Trajectory> = infra::table::read_committed(store, run_id, &schemas::keys::trajectories_prefix(run_id)).await?;
    let t = TrajectorySeries::of(&rows);
    let harness_lines: Vec<(&str, &[(u32, f64)])> = t.success_by_harness.iter().map(|(h, v)| (h.as_str(), v.as_slice())).collect();
    let plots: [(&str, &str, &str, Vec<(&str, &[(u32, f64)])>); 10] = [
        (
            "signals.png",
            "Training signal by update",
            "fraction",
            vec![("effective group rate", s.get("effective_group_rate")), ("effective token share", s.get("effective_token_share"))],
        ),
        (
            "validation.png",
            "H0 validation success by calibration",
            "success rate",
            vec![("H0 validation success", s.get("h0_validation_success"))],
        ),
        (
            "transfer.png",
            "Held-out sibling successes under H0 (transfer probe)",
            "log-prob per token / share",
            vec![("mean log-probability per token", s.get("transfer_logprob")), ("H0 answer-protocol share", s.get("h0_protocol_share"))],
        ),
        (
            "rescue.png",
            "Rescue by update",
            "fraction",
            vec![("rescue rate", s.get("rescue_rate")), ("rescue success", s.get("rescue_success"))],
        ),
        ("learner.png", "GRPO update by update", "value", vec![("loss", s.get(LOSS)), ("gradient norm", s.get(GRAD_NORM))]),
        ("entropy.png", "Policy entropy at its sampled tokens", "nats", vec![("entropy", s.get(ENTROPY))]),
        ("kl.png", "KL(pi_old || pi_start), k3 estimator (LoRA runs)", "nats", vec![("KL to the start", s.get(KL_TO_START))]),
        (
            "mismatch.png",
            "Training-inference mismatch |log q - log pi_old|",
            "nats",
            vec![("mean", s.get(MISMATCH_MEAN)), ("max", s.get(MISMATCH_MAX))],
        ),
        ("harnesses.png", "Training rollout success by harness (base and rescue)", "success rate", harness_lines),
        (
            "rollouts.png",
            "Training rollouts by update",
            "value",
            vec![("mean reward (base)", t.base_reward.as_slice()), ("policy tokens per rollout / 100", t.length_hundreds.as_slice())],
        ),
    ];
    // The transfer probe runs only in runs with a pool and native weights.
    let probed = !s.get("transfer_logprob").is_empty() || !s.get("h0_protocol_share").is_empty();
    for (file, title, y, series) in &plots {
        if (*file == "transfer.png" && !probed) || (*file == "kl.png" && s.get(KL_TO_START).is_empty()) {
            continue;
        }
        let path = dir.path().join(file);
        // Calibrations sit at the checkpoint step they froze (0: the starting policy).
        let x = if matches!(*file, "validation.png" | "transfer.png") { "checkpoint step" } else { "update" };
        line_plot_over(&path, title, x, y, series).with_context(|| format!("drawing {file}"))?;
        let bytes = std::fs::read(&path)?;
        store.put(&schemas::keys::report_file(run_id, file), Bytes::from(bytes)).await?;
    }
    let mut md = format!("# Run `{run_id}`\n\n");
    let stored = handlers::inputs::load_stored(store, run_id).await.ok();
    if let Some(stored) = &stored {
        md.push_str(&spec_summary(stored));
    }
    md.push_str("## Evaluation (test split)\n\n| | Pass@k | Avg@k |\n|---|---:|---:|\n");
    for stage in ["baseline", "evaluation"] {
        let pass = s.last(&format!("{stage}/pass_at_k"));
        let avg = s.last(&format!("{stage}/avg_at_k"));
        if let (Some(p), Some(a)) = (pass, avg) {
            let label = match stage {
                "baseline" => "before training",
                _ if s.get("rollouts_base").is_empty() => "starting policy (no updates)",
                _ => "after training",
            };
            let _ = writeln!(md, "| {label}, under H0 | {p:.3} | {a:.3} |");
        }
    }
    if let Some((id, validation, p, a)) = s.h_best() {
        let when = if s.get("rollouts_base").is_empty() { "starting policy (no updates)" } else { "after training" };
        let _ = writeln!(md, "| {when}, under H_best = `{id}` (the best harness on validation: {validation:.3}) | {p:.3} | {a:.3} |");
    }
    md.push_str("\n## Training updates\n\n");
    md.push_str(&update_table(&s));
    let untrained: Vec<String> = s.get(TRAINED).iter().filter(|p| p.1 == 0.0).map(|p| p.0.to_string()).collect();
    if !untrained.is_empty() {
        let _ = writeln!(
            md,
            "\nUpdates that trained nothing (no retained group had a policy token; the weights stayed as they were): {}.",
            untrained.join(", ")
        );
    }
    let kl = if s.get(KL_TO_START).is_empty() { "" } else { "![KL to the start](kl.png)\n" };
    let _ = write!(
        md,
        "\n![training signal](signals.png)\n![learner](learner.png)\n![entropy](entropy.png)\n{kl}![mismatch](mismatch.png)\n\n## H0 validation success by calibration\n\n"
    );
    md.push_str(&calibration_table(&s));
    md.push_str("\n![validation](validation.png)\n");
    if probed {
        md.push_str("\n![transfer](transfer.png)\n");
    }
    if !t.calibration.is_empty() {
        md.push_str("\n## Validation success by harness and calibration\n\nEach harness's validation rollouts with the policy of that checkpoint step (step 0: the starting policy, the pool's gate).\n\n");
        md.push_str(&calibration_harness_table(&t.calibration));
        let k = stored.as_ref().map(|r| r.spec.algorithm.k as usize).unwrap_or(1);
        if let Some((failed, mixed, routed)) = rescue_contrast(&t, 0, k) {
            let share = if failed > 0 { format!("{:.0} %", 100.0 * mixed as f64 / failed as f64) } else { "–".into() };
            let _ = writeln!(
                md,
                "\n**Rescue-group contrast at step 0:** {mixed} of the {failed} validation tasks H0 failed ({share}) have both a success and a failure among the K = {k} siblings routed to them ({}; the K best by validation success): the rescue groups GRPO can learn from. The setting is in the method's regime when H0 mostly fails and this share is substantial (at least 30 %).",
                routed.join(", ")
            );
        }
    }
    md.push_str("\n## Rescue by update\n\n![rescue](rescue.png)\n");
    if !t.success_by_harness.is_empty() {
        md.push_str("\n## Training rollouts\n\n| harness | rollouts | successes | success rate |\n|---|---:|---:|---:|\n");
        for (h, (n, ok)) in &t.totals_by_harness {
            let _ = writeln!(md, "| {h} | {n} | {ok} | {:.3} |", *ok as f64 / (*n).max(1) as f64);
        }
        md.push_str("\n![harnesses](harnesses.png)\n![rollouts](rollouts.png)\n");
    }
    let updates = s.get("rollouts_base").iter().map(|p| p.0).max().unwrap_or(0);
    if updates > 0 {
        let stage_updates = stored.as_ref().and_then(|r| r.spec.evaluation.stage_updates);
        md.push_str("\n## By training stage (Table 2 layout)\n\n");
        md.push_str(&stage_table(&s, updates, stage_updates));
    }
    if let Some(t) = rank_table(&s) {
        md.push_str("\n## Evaluation under the router's ranks (Table 5 layout)\n\n");
        md.push_str(&t);
    }
    if let Some(t) = cost_table(&s) {
        md.push_str("\n## Cost (Table 9 layout)\n\nPer stage kind, summed over the run; wall time is that of the drive that finished each stage. Policy tokens are the rollouts' own (evolution's included); the components below are the other LLM calls, counted from the endpoints' usage figures.\n\n");
        md.push_str(&t);
    }
    if let Some(section) = pool_section(store, run_id, dir.path()).await? {
        md.push_str(&section);
    }
    let key = schemas::keys::report_file(run_id, "report.md");
    store.put(&key, Bytes::from(md)).await?;
    Ok(store.object_url(&key))
}

/// The editor run's report: `report.md` and `editor.png` under the run's reports.
pub async fn write_editor_report(store: &dyn ObjectStore, run_id: &str) -> anyhow::Result<String> {
    let s = Series::load(store, run_id).await?;
    let patches: Vec<PatchRecord> = read_committed(store, run_id, &keys::patches_prefix(run_id)).await?;
    let mut by_step: BTreeMap<u32, Vec<PatchRecord>> = BTreeMap::new();
    for p in patches {
        by_step.entry(p.step).or_default().push(p);
    }
    let dir = tempfile::tempdir().context("cannot create a temporary folder for plots")?;
    let path = dir.path().join("editor.png");
    line_plot_over(
        &path,
        "Harness editor by step",
        "step",
        "value",
        &[
            ("valid-patch rate", s.get("valid_patch_rate")),
            ("mean patch reward (Eq. 1)", s.get("mean_patch_reward")),
            ("best patch reward", s.get("best_patch_reward")),
        ],
    )
    .context("drawing editor.png")?;
    store.put(&keys::report_file(run_id, "editor.png"), Bytes::from(std::fs::read(&path)?)).await?;
    let mut md = format!("# Editor run `{run_id}`\n\n");
    if let Ok(stored) = handlers::inputs::load_stored(store, run_id).await {
        md.push_str(&spec_summary(&stored));
    }
    md.push_str(&editor_table(&s));
    md.push_str("\n![editor](editor.png)\n\n## Best patch per step\n\n");
    for (step, ps) in &by_step {
        match best_patch(ps) {
            Some(b) => {
                let reply: String = b.reply.chars().take(600).collect();
                let _ = writeln!(
                    md,
                    "### Step {step}: `{}`, reward {:.3} (per task Rᴾ {:?})\n\n```\n{reply}\n```\n",
                    b.child_harness_id.as_deref().unwrap_or(""),
                    b.reward,
                    b.patched_rewards
                );
            }
            None => {
                let _ = writeln!(md, "### Step {step}: no valid patch among {}\n", ps.len());
            }
        }
    }
    let key = keys::report_file(run_id, "report.md");
    store.put(&key, Bytes::from(md)).await?;
    Ok(store.object_url(&key))
}

/// The per-step table of an editor run (Markdown).
pub fn editor_table(s: &Series) -> String {
    let cols = [
        "patches",
        "valid_patch_rate",
        "mean_patch_reward",
        "best_patch_reward",
        "effective_group_rate",
        POLICY_TOKENS_TRAINED,
        LOSS,
        GRAD_NORM,
        MISMATCH_MAX,
    ];
    let steps: std::collections::BTreeSet<u32> = cols.iter().flat_map(|c| s.get(c).iter().map(|p| p.0)).collect();
    let mut out = format!("| step | {} |\n|---|{}\n", cols.join(" | "), "---:|".repeat(cols.len()));
    for step in steps {
        let _ = write!(out, "| {step} |");
        for c in cols {
            match s.get(c).iter().find(|p| p.0 == step) {
                Some((_, v)) => {
                    let _ = write!(out, " {} |", number(*v));
                }
                None => out.push_str(" – |"),
            }
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series(pairs: &[(&str, &[(u32, f64)])]) -> Series {
        Series(pairs.iter().map(|(n, v)| (n.to_string(), v.to_vec())).collect())
    }

    #[test]
    fn calibration_rows_carry_the_transfer_probe_where_it_ran() {
        let s = series(&[
            ("h0_validation_success", &[(0, 0.25), (4, 0.5)]),
            ("transfer_logprob", &[(0, -0.4559), (4, -0.4)]),
            ("h0_protocol_share", &[(4, 0.125)]),
        ]);
        let t = calibration_table(&s);
        assert!(t.contains("| 0 | 0.250 | -0.456 | – |"), "{t}");
        assert!(t.contains("| 4 | 0.500 | -0.400 | 0.125 |"), "{t}");
    }

    #[test]
    fn updates_split_into_thirds() {
        let stages: Vec<&str> = (1..=6).map(|u| training_stage(u, 6)).collect();
        assert_eq!(stages, ["early", "early", "mid", "mid", "late", "late"]);
        assert_eq!(training_stage(1, 1), "early");
        assert_eq!([training_stage(1, 2), training_stage(2, 2)], ["early", "mid"]);
    }

    #[test]
    fn stage_table_averages_rescue_success_over_updates_where_rescue_fired() {
        let mut m = BTreeMap::new();
        m.insert("rescue_success".to_string(), vec![(1, 0.5), (2, 0.0), (3, 1.0)]);
        m.insert("rollouts_rescue".to_string(), vec![(1, 4.0), (2, 0.0), (3, 2.0)]);
        m.insert("effective_group_rate".to_string(), vec![(1, 0.25), (2, 0.75), (3, 1.0)]);
        let t = stage_table(&Series(m), 3, None);
        assert!(t.contains("| early | 1–1 | 0.250 | – | – | 0.500 |"), "{t}");
        assert!(t.contains("| mid | 2–2 | 0.750 | – | – | – |"), "{t}");
        assert!(t.contains("| late | 3–3 | 1.000 | – | – | 1.000 |"), "{t}");
    }

    /// With the counts recorded, a stage's rates pool its groups: updates of 4 and 12 groups
    /// with 1 and 9 effective make 10 of 16 = 0.625, not the mean of 0.25 and 0.75.
    #[test]
    fn stage_table_pools_counts_over_the_stage() {
        let mut m = BTreeMap::new();
        for (name, a, b) in [
            ("groups", 4.0, 12.0),
            ("effective_groups", 1.0, 9.0),
            ("effective_group_rate", 0.25, 0.75),
            ("rescued_groups", 4.0, 0.0),
            ("rescued_with_success", 1.0, 0.0),
            ("retained_policy_tokens", 100.0, 300.0),
            ("effective_policy_tokens", 0.0, 100.0),
        ] {
            m.insert(name.to_string(), vec![(1, a), (2, b)]);
        }
        // Six updates: early is updates 1–2.
        let t = stage_table(&Series(m.clone()), 6, None);
        assert!(t.contains("| early | 1–2 | 0.625 | 0.250 | 0.250 | 0.250 |"), "{t}");
        assert!(t.contains("| mid | 3–4 | – | – | – | – |"), "{t}");
        assert!(t.contains("| late | 5–6 |"), "{t}");
        // `[evaluation] stage_updates = 4`: stages 1–4 and 5–6, rates pooled the same way.
        let t = stage_table(&Series(m), 6, Some(4));
        assert!(t.contains("| 1 | 1–4 | 0.625 | 0.250 | 0.250 | 0.250 |"), "{t}");
        assert!(t.contains("| 2 | 5–6 | – | – | – | – |"), "{t}");
    }

    /// Tasks a, b, c: H0 fails a and b, succeeds on c. Siblings by validation success:
    /// s1 3/3, s2 1/3, s3 0/3; K = 2 routes s1 and s2. On a they mix (s1 ok, s2 not), on b
    /// both succeed: 1 of 2 H0-failed tasks has contrast. With K = 1 (s1 alone) none has.
    #[test]
    fn rescue_contrast_counts_h0_failed_tasks_whose_routed_siblings_mix() {
        let row = |task: &str, h: &str, success: bool| {
            let mut v: schemas::Trajectory = serde_json::from_value(serde_json::json!({
                "trajectory_id": format!("{task}-{h}"), "run_id": "r", "job_id": "j", "step": 0, "kind": "calibration", "split": "validation",
                "task_id": task, "task_type": "counting", "group_id": "g", "attempt": 0, "harness_id": h, "harness_version": "v",
                "policy_checkpoint": "c", "seed": 0, "reward": if success { 1.0 } else { 0.0 }, "success": success, "termination": "committed",
                "error_class": null, "error_message": null, "prompt_tokens": 0, "completion_tokens": 1, "harness_tokens": 0,
                "model_calls": 1, "env_actions": 1, "started_at_ms": 0, "duration_ms": 0, "policy_ms": 0, "env_ms": 0,
                "temperature": 1.0, "tool_view": "[]", "turns": []
            }))
            .unwrap();
            v.kind = schemas::RolloutKind::Calibration;
            v
        };
        let rows = [
            row("a", "h0", false),
            row("b", "h0", false),
            row("c", "h0", true),
            row("a", "s1", true),
            row("b", "s1", true),
            row("c", "s1", true),
            row("a", "s2", false),
            row("b", "s2", true),
            row("c", "s2", false),
            row("a", "s3", false),
            row("b", "s3", false),
            row("c", "s3", false),
        ];
        let t = TrajectorySeries::of(&rows);
        assert_eq!(rescue_contrast(&t, 0, 2), Some((2, 1, vec!["s1".to_string(), "s2".to_string()])));
        assert_eq!(rescue_contrast(&t, 0, 1), Some((2, 0, vec!["s1".to_string()])));
        assert_eq!(rescue_contrast(&t, 0, 3).map(|c| c.1), Some(2), "s3 fails on b: b mixes too");
        assert_eq!(rescue_contrast(&t, 5, 2), None);
    }

    #[test]
    fn trajectory_series_give_success_by_harness_reward_and_length_per_update() {
        let row = |step: u32, kind: schemas::RolloutKind, h: &str, success: bool, tokens: u64| {
            let mut v: schemas::Trajectory = serde_json::from_value(serde_json::json!({
                "trajectory_id": format!("{step}-{h}-{success}-{tokens}"), "run_id": "r", "job_id": "j", "step": step, "kind": "base", "split": "train",
                "task_id": "t", "task_type": "counting", "group_id": "g", "attempt": 0, "harness_id": h, "harness_version": "v",
                "policy_checkpoint": "c", "seed": 0, "reward": if success { 1.0 } else { 0.0 }, "success": success, "termination": "committed",
                "error_class": null, "error_message": null, "prompt_tokens": 0, "completion_tokens": tokens, "harness_tokens": 0,
                "model_calls": 1, "env_actions": 1, "started_at_ms": 0, "duration_ms": 0, "policy_ms": 0, "env_ms": 0,
                "temperature": 1.0, "tool_view": "[]", "turns": []
            })).unwrap();
            v.kind = kind;
            v
        };
        use schemas::RolloutKind::{Base, Calibration, Eval, Rescue};
        let rows = [
            row(1, Base, "h0", false, 100),
            row(1, Base, "h0", true, 300),
            row(1, Rescue, "s1", true, 200),
            row(2, Base, "h0", false, 50),
            row(2, Eval, "h0", true, 999),
            row(0, Calibration, "s1", true, 9),
            row(0, Calibration, "s1", false, 9),
            row(0, Calibration, "h0", false, 9),
            row(2, Calibration, "h0", true, 9),
        ];
        let t = TrajectorySeries::of(&rows);
        assert_eq!(t.success_by_harness["h0"], vec![(1, 0.5), (2, 0.0)]);
        assert_eq!(t.success_by_harness["s1"], vec![(1, 1.0)]);
        assert_eq!(t.totals_by_harness["h0"], (3, 1), "evaluation rows are not training rollouts");
        assert_eq!(t.base_reward, vec![(1, 0.5), (2, 0.0)]);
        assert_eq!(t.length_hundreds, vec![(1, 2.0), (2, 0.5)]);
        // calibration rows: by step and harness, H0 first in the table
        assert_eq!(t.calibration[&0]["s1"], (2, 1));
        let table = calibration_harness_table(&t.calibration);
        assert!(table.contains("| h0 | 0 / 1 (0.000) | 1 / 1 (1.000) |\n| s1 | 1 / 2 (0.500) | – |"), "{table}");
    }

    #[test]
    fn cost_table_sums_stage_kinds_and_components_over_the_run() {
        let s = series(&[
            ("cost:base/wall_seconds", &[(1, 10.0), (2, 12.5)]),
            ("cost:base/rollouts", &[(1, 8.0), (2, 8.0)]),
            ("cost:base/policy_completion_tokens", &[(1, 400.0), (2, 380.0)]),
            ("cost:rescue/wall_seconds", &[(1, 3.0)]),
            ("cost:rescue/voter_calls", &[(1, 4.0)]),
            ("cost:rescue/voter_prompt_tokens", &[(1, 1200.0)]),
            ("cost:evaluation/voter_calls", &[(3, 2.0)]),
            ("cost:learn/wall_seconds", &[(1, 20.0)]),
            ("cost:learn/learner_forward_tokens", &[(1, 5000.0)]),
        ]);
        let t = cost_table(&s).unwrap();
        assert!(t.contains("| base | 22.5 | 16 | – | – | 780 |"), "{t}");
        assert!(t.contains("| all | 45.5 | 16 | 0 | 0 | 780 |"), "{t}");
        assert!(t.contains("| voter | 6 | 1200 | – |"), "{t}");
        assert!(t.contains("| profiler | – | – | – |"), "{t}");
        assert!(t.contains("| 5000 |"), "{t}");
        assert!(!t.contains("| evolve |"), "stages that did not run have no row: {t}");
        assert!(cost_table(&series(&[(LOSS, &[(1, 0.1)])])).is_none());
    }

    #[test]
    fn rank_table_lists_h0_and_the_evaluated_ranks() {
        let mut m = BTreeMap::new();
        for (name, v) in [("pass_at_k/h0", 0.2), ("avg_at_k/h0", 0.1), ("pass_at_k/rank-1", 0.4), ("h0_rate/rank-1", 0.5)] {
            m.insert(name.to_string(), vec![(3, v)]);
        }
        let t = rank_table(&Series(m)).unwrap();
        assert!(t.contains("| H0 | 0.200 | 0.100 | – |"), "{t}");
        assert!(t.contains("| Rank-1 | 0.400 | – | 0.500 |"), "{t}");
        assert!(rank_table(&Series(BTreeMap::new())).is_none());
    }
}
