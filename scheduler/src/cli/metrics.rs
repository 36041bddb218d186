//! `harness-s metrics RUN --format csv|parquet|tensorboard`: a run's metrics out of the
//! store in the shape a tool wants — a wide CSV (one row per step, one column per
//! `<stage>/<name>`) for spreadsheets and pandas, one long Parquet file, or a TensorBoard
//! event file.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use schemas::MetricRow;

use super::StoreArg;

#[derive(Debug, Args)]
pub struct MetricsArgs {
    /// Run id.
    pub run: String,
    /// `csv` (wide: step, then one column per stage/name), `parquet` (long: the stored rows in
    /// one file) or `tensorboard` (an event file in the --out folder).
    #[arg(long, default_value = "csv", value_parser = ["csv", "parquet", "tensorboard"])]
    pub format: String,
    /// File (csv, parquet) or folder (tensorboard) to write; csv goes to stdout without it.
    #[arg(long, value_name = "PATH")]
    pub out: Option<PathBuf>,
    #[command(flatten)]
    pub store: StoreArg,
}

pub async fn run(args: MetricsArgs) -> anyhow::Result<u8> {
    // The arguments first: nothing is read for a command that cannot write its output.
    if args.format != "csv" && args.out.is_none() {
        anyhow::bail!("--format {} writes a file: give --out PATH", args.format);
    }
    let store = args.store.open().await?;
    crate::run::inputs::load_stored(store.as_ref(), &args.run).await?;
    let mut rows: Vec<MetricRow> = infra::table::read_prefix(store.as_ref(), &schemas::keys::metrics_prefix(&args.run)).await?;
    rows.sort_by(|a, b| (a.step, a.recorded_at_ms, &a.stage, &a.name).cmp(&(b.step, b.recorded_at_ms, &b.stage, &b.name)));
    match (args.format.as_str(), &args.out) {
        ("csv", None) => std::io::stdout().lock().write_all(wide_csv(&rows).as_bytes())?,
        ("csv", Some(path)) => std::fs::write(path, wide_csv(&rows)).with_context(|| format!("--out {}", path.display()))?,
        ("parquet", Some(path)) => {
            let abs = std::path::absolute(path).with_context(|| format!("--out {}", path.display()))?;
            let (dir, name) = (
                abs.parent().unwrap_or(std::path::Path::new("/")),
                abs.file_name().with_context(|| format!("--out {}: give a file name", path.display()))?,
            );
            let local = infra::store::LocalStore::new(dir).with_context(|| format!("--out {}", path.display()))?;
            infra::table::write_records(&local, &name.to_string_lossy(), &rows)
                .await
                .with_context(|| format!("--out {}", path.display()))?;
        }
        ("tensorboard", Some(dir)) => {
            std::fs::create_dir_all(dir).with_context(|| format!("--out {}: cannot create the folder", dir.display()))?;
            let last = rows.iter().map(|r| r.recorded_at_ms).max().unwrap_or(0);
            let path = dir.join(crate::tensorboard::event_file_name(last, &args.run));
            std::fs::write(&path, crate::tensorboard::encode(&rows)).with_context(|| format!("--out {}", path.display()))?;
        }
        (format, None) => anyhow::bail!("--format {format} writes a file: give --out PATH"),
        (format, Some(_)) => anyhow::bail!("--format {format}: unknown format"),
    }
    if let Some(path) = &args.out {
        eprintln!("{} metric rows of run `{}` → {}", rows.len(), args.run, path.display());
    }
    Ok(crate::exit::OK)
}

/// One row per step, one column per `<stage>/<name>` (sorted), empty where a metric has no
/// value at a step; a later row of the same step and column wins (a re-run stage).
pub fn wide_csv(rows: &[MetricRow]) -> String {
    let columns: BTreeSet<String> = rows.iter().map(crate::tensorboard::tag).collect();
    let mut by_step: BTreeMap<u32, BTreeMap<String, f64>> = BTreeMap::new();
    for r in rows {
        by_step.entry(r.step).or_default().insert(crate::tensorboard::tag(r), r.value);
    }
    let quote = |s: &str| if s.contains([',', '"', '\n']) { format!("\"{}\"", s.replace('"', "\"\"")) } else { s.to_string() };
    let mut out = String::from("step");
    for c in &columns {
        out.push(',');
        out.push_str(&quote(c));
    }
    out.push('\n');
    for (step, values) in &by_step {
        out.push_str(&step.to_string());
        for c in &columns {
            out.push(',');
            if let Some(v) = values.get(c) {
                out.push_str(&v.to_string());
            }
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(step: u32, stage: &str, name: &str, value: f64) -> MetricRow {
        MetricRow { run_id: "r".into(), step, stage: stage.into(), name: name.into(), value, policy_checkpoint: None, recorded_at_ms: 0 }
    }

    #[test]
    fn wide_csv_has_a_column_per_metric_and_a_row_per_step() {
        let rows = [
            row(1, "update", "rescue_rate", 0.5),
            row(1, "learn", "loss", 0.25),
            row(2, "learn", "loss", 0.125),
            row(0, "calibration", "validation_success/s1,x", 1.0),
        ];
        let csv = wide_csv(&rows);
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(lines[0], "step,\"calibration/validation_success/s1,x\",learn/loss,update/rescue_rate");
        assert_eq!(lines[1], "0,1,,");
        assert_eq!(lines[2], "1,,0.25,0.5");
        assert_eq!(lines[3], "2,,0.125,");
    }
}
