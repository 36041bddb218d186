//! `harness-s report RUN`: Markdown plus PNG plots of a run's stored metrics — the
//! training signals by update (Figure 3a/b of the paper), H0 validation success by
//! checkpoint (Figure 3c), rescue success by stage (Table 2), and Pass@k / Avg@k before
//! and after training.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use anyhow::Context;
use bytes::Bytes;
use infra::store::ObjectStore;
use plotters::prelude::*;
use schemas::MetricRow;

/// Metrics of a run as `name → [(step, value)]`, stage-qualified where it matters.
pub struct Series(pub BTreeMap<String, Vec<(u32, f64)>>);

impl Series {
    pub async fn load(store: &dyn ObjectStore, run_id: &str) -> anyhow::Result<Self> {
        let rows: Vec<MetricRow> = infra::table::read_prefix(store, &format!("runs/{run_id}/metrics/")).await?;
        let mut m: BTreeMap<String, Vec<(u32, f64)>> = BTreeMap::new();
        for r in rows {
            let name = match r.stage.as_str() {
                "baseline" | "evaluation" => format!("{}/{}", r.stage, r.name),
                _ => r.name,
            };
            m.entry(name).or_default().push((r.step, r.value));
        }
        for v in m.values_mut() {
            v.sort_by(|a, b| a.0.cmp(&b.0));
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
}

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
        "loss",
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
                Some((_, v)) => {
                    let _ = write!(out, " {v:.3} |");
                }
                None => out.push_str(" – |"),
            }
        }
        out.push('\n');
    }
    out
}

fn line_plot(path: &std::path::Path, title: &str, y_label: &str, series: &[(&str, &[(u32, f64)])]) -> anyhow::Result<()> {
    let root = BitMapBackend::new(path, (720, 420)).into_drawing_area();
    root.fill(&WHITE)?;
    let max_x = series.iter().flat_map(|(_, s)| s.iter().map(|p| p.0)).max().unwrap_or(1).max(1);
    let min_x = series.iter().flat_map(|(_, s)| s.iter().map(|p| p.0)).min().unwrap_or(0);
    let max_y = series.iter().flat_map(|(_, s)| s.iter().map(|p| p.1)).fold(1.0f64, f64::max);
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(48)
        .build_cartesian_2d(min_x as f64 - 0.5..max_x as f64 + 0.5, 0f64..max_y * 1.05)?;
    chart
        .configure_mesh()
        .x_desc("update")
        .y_desc(y_label)
        .x_labels((max_x - min_x) as usize + 2)
        .x_label_formatter(&|x| if x.fract().abs() < 1e-9 { format!("{x:.0}") } else { String::new() })
        .draw()?;
    let colors = [BLUE, RED, GREEN, MAGENTA, CYAN, BLACK];
    for (i, (name, points)) in series.iter().enumerate() {
        let color = colors[i % colors.len()];
        let pts: Vec<(f64, f64)> = points.iter().map(|(x, y)| (*x as f64, *y)).collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))?
            .label(*name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2)));
        chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 3, color.filled())))?;
    }
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
    root.present()?;
    Ok(())
}

/// Writes `runs/<run>/reports/{report.md, signals.png, validation.png, rescue.png}`;
/// returns the report's URL.
pub async fn write(store: &dyn ObjectStore, run_id: &str) -> anyhow::Result<String> {
    let s = Series::load(store, run_id).await?;
    let dir = tempfile::tempdir().context("cannot create a temporary folder for plots")?;
    let plots: [(&str, &str, &str, Vec<(&str, &[(u32, f64)])>); 3] = [
        (
            "signals.png",
            "Training signal by update",
            "fraction",
            vec![("effective group rate", s.get("effective_group_rate")), ("effective token share", s.get("effective_token_share"))],
        ),
        ("validation.png", "H0 validation success by checkpoint", "success rate", vec![("H0 validation success", s.get("h0_validation_success"))]),
        (
            "rescue.png",
            "Rescue by update",
            "fraction",
            vec![("rescue rate", s.get("rescue_rate")), ("rescue success", s.get("rescue_success"))],
        ),
    ];
    for (file, title, y, series) in &plots {
        let path = dir.path().join(file);
        line_plot(&path, title, y, series).with_context(|| format!("drawing {file}"))?;
        let bytes = std::fs::read(&path)?;
        store.put(&format!("runs/{run_id}/reports/{file}"), Bytes::from(bytes)).await?;
    }
    let mut md = format!("# Run `{run_id}`\n\n## Evaluation under H0 (test split)\n\n| | Pass@k | Avg@k |\n|---|---:|---:|\n");
    for stage in ["baseline", "evaluation"] {
        let pass = s.last(&format!("{stage}/pass_at_k"));
        let avg = s.last(&format!("{stage}/avg_at_k"));
        if let (Some(p), Some(a)) = (pass, avg) {
            let _ = writeln!(md, "| {} | {p:.3} | {a:.3} |", if stage == "baseline" { "before training" } else { "after training" });
        }
    }
    md.push_str("\n## Training updates\n\n");
    md.push_str(&update_table(&s));
    md.push_str("\n![training signal](signals.png)\n\n## H0 validation success by calibration\n\n| checkpoint step | H0 validation success |\n|---:|---:|\n");
    for (step, v) in s.get("h0_validation_success") {
        let _ = writeln!(md, "| {step} | {v:.3} |");
    }
    md.push_str("\n![validation](validation.png)\n\n## Rescue by update\n\n![rescue](rescue.png)\n");
    let key = format!("runs/{run_id}/reports/report.md");
    store.put(&key, Bytes::from(md)).await?;
    Ok(store.object_url(&key))
}
