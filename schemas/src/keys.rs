//! Object-store key layout of a run. Hive-style `name=value` segments let DuckDB,
//! Polars and pyarrow recover `step` and `kind` as columns
//! (`read_parquet('runs/r/trajectories/**/*.parquet', hive_partitioning=true)`).

use crate::RolloutKind;

/// `runs/<run>`
pub fn run_prefix(run_id: &str) -> String {
    format!("runs/{run_id}")
}

/// `runs/<run>/spec.toml`
pub fn spec(run_id: &str) -> String {
    format!("runs/{run_id}/spec.toml")
}

/// `runs/<run>/state.json`
pub fn state(run_id: &str) -> String {
    format!("runs/{run_id}/state.json")
}

/// `runs/<run>/trajectories/step=<n>/kind=<kind>/part-<job>.parquet`
pub fn trajectory_part(run_id: &str, step: u32, kind: RolloutKind, job_id: &str) -> String {
    format!("runs/{run_id}/trajectories/step={step}/kind={kind}/part-{job_id}.parquet")
}

/// `runs/<run>/groups/step=<n>/part-<job>.parquet`
pub fn group_part(run_id: &str, step: u32, job_id: &str) -> String {
    format!("runs/{run_id}/groups/step={step}/part-{job_id}.parquet")
}

/// `runs/<run>/profiles/calib=<id>/part-<job>.parquet`
pub fn profile_part(run_id: &str, calibration_id: &str, job_id: &str) -> String {
    format!("runs/{run_id}/profiles/calib={calibration_id}/part-{job_id}.parquet")
}

/// `runs/<run>/routing/step=<n>/part-<job>.parquet`
pub fn routing_part(run_id: &str, step: u32, job_id: &str) -> String {
    format!("runs/{run_id}/routing/step={step}/part-{job_id}.parquet")
}

/// `runs/<run>/metrics/`: every metrics part of a run.
pub fn metrics_prefix(run_id: &str) -> String {
    format!("runs/{run_id}/metrics/")
}

/// `runs/<run>/metrics/step=<n>/part-<job>.parquet`
pub fn metrics_part(run_id: &str, step: u32, job_id: &str) -> String {
    format!("runs/{run_id}/metrics/step={step}/part-{job_id}.parquet")
}

/// `runs/<run>/checkpoints/step=<n>/` (with trailing slash)
pub fn checkpoint_dir(run_id: &str, step: u32) -> String {
    format!("runs/{run_id}/checkpoints/step={step}/")
}

/// `runs/<run>/jobs/`: every done-marker of a run.
pub fn jobs_prefix(run_id: &str) -> String {
    format!("runs/{run_id}/jobs/")
}

/// `runs/<run>/jobs/<job>.done.json`: the commit marker, written last.
pub fn done_marker(run_id: &str, job_id: &str) -> String {
    format!("runs/{run_id}/jobs/{job_id}.done.json")
}

/// `runs/<run>/pool/<harness>.json`
pub fn pool_harness(run_id: &str, harness_id: &str) -> String {
    format!("runs/{run_id}/pool/{harness_id}.json")
}

/// Folder of a side-by-side comparison of two runs (`harness-s compare A B`).
pub fn comparison_dir(run_a: &str, run_b: &str) -> String {
    format!("comparisons/{run_a}-vs-{run_b}/")
}
