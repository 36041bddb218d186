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

/// `runs/<run>/packets/part-<job>.parquet`: trace packets for a harness editor.
pub fn packet_part(run_id: &str, job_id: &str) -> String {
    format!("runs/{run_id}/packets/part-{job_id}.parquet")
}

/// `runs/<run>/packets/`
pub fn packets_prefix(run_id: &str) -> String {
    format!("runs/{run_id}/packets/")
}

/// `runs/<run>/patches/step=<n>/part-<job>.parquet`: an editor's patches and rewards.
pub fn patch_part(run_id: &str, step: u32, job_id: &str) -> String {
    format!("runs/{run_id}/patches/step={step}/part-{job_id}.parquet")
}

/// `runs/<run>/patches/step=<n>/`
pub fn patches_of_step(run_id: &str, step: u32) -> String {
    format!("runs/{run_id}/patches/step={step}/")
}

/// `runs/<run>/patches/`
pub fn patches_prefix(run_id: &str) -> String {
    format!("runs/{run_id}/patches/")
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

/// Folder of a side-by-side comparison of runs (`harness-s compare A B [C ...]`):
/// `comparisons/<A>-vs-<B>[-vs-<C>...]/`.
pub fn comparison_dir(runs: &[&str]) -> String {
    format!("comparisons/{}/", runs.join("-vs-"))
}

/// `runs/<run>/trajectories/`: every trajectory part of a run.
pub fn trajectories_prefix(run_id: &str) -> String {
    format!("runs/{run_id}/trajectories/")
}

/// `runs/<run>/trajectories/step=<n>/`, or with `kind` `…/kind=<kind>/`.
pub fn trajectories_of_step(run_id: &str, step: u32, kind: Option<RolloutKind>) -> String {
    match kind {
        Some(kind) => format!("runs/{run_id}/trajectories/step={step}/kind={kind}/"),
        None => format!("runs/{run_id}/trajectories/step={step}/"),
    }
}

/// `runs/<run>/groups/step=<n>/`
pub fn groups_of_step(run_id: &str, step: u32) -> String {
    format!("runs/{run_id}/groups/step={step}/")
}

/// `runs/<run>/profiles/calib=<id>/`: a calibration's profile parts and its document.
pub fn calibration_dir(run_id: &str, calibration_id: &str) -> String {
    format!("runs/{run_id}/profiles/calib={calibration_id}/")
}

/// `runs/<run>/profiles/calib=<id>/calibration.json`
pub fn calibration(run_id: &str, calibration_id: &str) -> String {
    format!("{}calibration.json", calibration_dir(run_id, calibration_id))
}

/// `runs/<run>/checkpoints/`: every checkpoint folder of a run.
pub fn checkpoints_prefix(run_id: &str) -> String {
    format!("runs/{run_id}/checkpoints/")
}

/// `runs/<run>/pool/manifest.json`
pub fn pool_manifest(run_id: &str) -> String {
    format!("runs/{run_id}/pool/manifest.json")
}

/// `runs/<run>/diagnostics/sleep/<job>.json` (the queue's test job)
pub fn sleep_diagnostic(run_id: &str, job_id: &str) -> String {
    format!("runs/{run_id}/diagnostics/sleep/{job_id}.json")
}

/// `runs/<run>/tensorboard/`: the run's TensorBoard event files.
pub fn tensorboard_prefix(run_id: &str) -> String {
    format!("runs/{run_id}/tensorboard/")
}

/// `runs/<run>/reports/<file>` (`report.md` and its figures)
pub fn report_file(run_id: &str, file: &str) -> String {
    format!("runs/{run_id}/reports/{file}")
}

/// `runs/<run>/inputs/run.json`: what the run was started with.
pub fn run_inputs(run_id: &str) -> String {
    format!("runs/{run_id}/inputs/run.json")
}

/// `runs/<run>/inputs/tasks/<name>.jsonl`
pub fn task_file(run_id: &str, name: &str) -> String {
    format!("runs/{run_id}/inputs/tasks/{name}.jsonl")
}

/// The job whose part `key` is (`…/part-<job>.parquet` → `<job>`), or `None` for a key
/// that is not a part.
pub fn job_of_part(key: &str) -> Option<&str> {
    let file = key.rsplit('/').next()?;
    file.strip_prefix("part-")?.strip_suffix(".parquet").filter(|id| !id.is_empty())
}

/// The job whose done-marker `key` is (`runs/<run>/jobs/<job>.done.json` → `<job>`), or
/// `None` for a key that is not a done-marker.
pub fn job_of_marker(key: &str) -> Option<&str> {
    let (prefix, file) = key.rsplit_once('/')?;
    prefix.ends_with("/jobs").then_some(())?;
    file.strip_suffix(".done.json").filter(|id| !id.is_empty())
}

/// A checkpoint a location names: `runs/<run>/checkpoints/step=<n>` somewhere in a key, a
/// checkpoint folder's path or a store URL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointRef<'a> {
    pub run_id: &'a str,
    pub step: u32,
}

/// The checkpoint `location` names (see [`CheckpointRef`]): `Ok(None)` when it names none
/// (a model path or name), an error when its `step=` holds no number or its folder is not
/// under `runs/<run>/`.
pub fn checkpoint_of(location: &str) -> Result<Option<CheckpointRef<'_>>, String> {
    const MARK: &str = "/checkpoints/step=";
    let Some(at) = location.rfind(MARK) else {
        return Ok(None);
    };
    let digits: String = location[at + MARK.len()..].chars().take_while(char::is_ascii_digit).collect();
    let step = digits.parse::<u32>().map_err(|_| format!("`{location}` names no checkpoint step"))?;
    let before = &location[..at];
    let run_id = before.rsplit('/').next().unwrap_or("");
    let under_runs = before.strip_suffix(run_id).is_some_and(|p| p.ends_with("runs/"));
    if !under_runs || run_id.is_empty() {
        return Err(format!("`{location}` names a checkpoint outside a run (`runs/<run>/checkpoints/step=<n>`)"));
    }
    Ok(Some(CheckpointRef { run_id, step }))
}

/// `runs/<run>/cancel`: a cancel request.
pub fn cancel(run_id: &str) -> String {
    format!("runs/{run_id}/cancel")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_name_their_job() {
        assert_eq!(job_of_part(&trajectory_part("r", 2, RolloutKind::Base, "abc")), Some("abc"));
        assert_eq!(job_of_part(&profile_part("r", "c0", "f00")), Some("f00"));
        assert_eq!(job_of_part("runs/r/jobs/abc.done.json"), None);
        assert_eq!(job_of_part("runs/r/x/part-.parquet"), None);
        assert_eq!(job_of_marker(&done_marker("r", "abc")), Some("abc"));
        assert_eq!(job_of_marker("runs/r/jobs/.done.json"), None);
        assert_eq!(job_of_marker(&trajectory_part("r", 2, RolloutKind::Base, "abc")), None);
    }

    #[test]
    fn checkpoint_locations_name_their_run_and_step() {
        let at = |run_id, step| Ok(Some(CheckpointRef { run_id, step }));
        assert_eq!(checkpoint_of(&format!("{}manifest.json", checkpoint_dir("r1", 3))), at("r1", 3));
        assert_eq!(checkpoint_of("s3://b/p/runs/r1/checkpoints/step=12"), at("r1", 12));
        assert_eq!(checkpoint_of("/models/smollm2.gguf"), Ok(None));
        assert!(checkpoint_of("/tmp/x/checkpoints/step=2").is_err(), "not under runs/");
        assert!(checkpoint_of("runs/r1/checkpoints/step=x").is_err());
    }
}
