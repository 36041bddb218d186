//! The transfer probe job: does the policy under H0 carry what the siblings showed it?
//! A signal that moves before H0's success does.
//!
//! At every calibration the scheduler asks this job for the current policy's mean
//! per-token log-probability, in the context H0 would have shown, of a fixed held-out set:
//! the successful sibling trajectories of the first calibration (validation tasks, frozen
//! starting policy), re-rendered under H0 ([`crate::train::learner::data::RescueContext::under_h0`]).
//! Calibration rows are never in a group, so the learner never trains on them; the set is
//! chosen from stored rows by content alone (success, then task and harness order), so
//! every calibration of a run, a resumed run and runs with the same seed and pool score the
//! same rows.
//!
//! 1. Read the first calibration's sibling rows; keep the successes H0 can re-render, at
//!    most `max_rows`, in (task, harness, trajectory id) order.
//! 2. Load the weights of `weights_step` (or the starting model) and score them.
//! 3. Return the mean log-probability and the ids scored (the done-marker carries them).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::train::learner::data::RescueContext;
use crate::train::learner::{Learner, LearnerConfig};
use crate::NativeError;
use infra::store::ObjectStore;
use infra::table::read_committed;
use schemas::{RolloutKind, Trajectory};

/// Input of a transfer probe job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransferInput {
    pub run_id: String,
    /// The calibration step this probe belongs to (its metrics' step).
    pub step: u32,
    /// The step whose checkpoint holds the weights to score with (`None`: the starting
    /// model).
    pub weights_step: Option<u32>,
    /// GGUF file or HF directory of the starting policy.
    pub base_model: PathBuf,
    #[serde(default = "default_device")]
    pub device: String,
    /// The calibration step whose sibling successes form the held-out set (0: before training).
    #[serde(default)]
    pub set_step: u32,
    /// At most this many held-out trajectories.
    pub max_rows: usize,
    /// H0's spec, the environment's tools and the episode limits to render under.
    pub context: RescueContext,
}

fn default_device() -> String {
    "cpu".into()
}

/// Result of a transfer probe job.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TransferOutput {
    /// Mean log π(y | c_H0) over the policy tokens of the held-out set (None: empty set).
    pub mean_logprob: Option<f64>,
    pub tokens: u64,
    /// The held-out trajectories scored, in order.
    pub trajectory_ids: Vec<String>,
    /// Sibling successes H0 could not re-render (left out of the set).
    pub not_renderable: u64,
}

/// The held-out set (pure): the successful sibling rows of a calibration, in (task,
/// harness, id) order, that H0 can re-render (`render` gives their rendering, once each);
/// at most `max_rows`. Returns them with their renderings and the count of successes left
/// out because H0 cannot render them.
pub fn held_out<'a, V>(
    rows: &'a [Trajectory],
    h0_id: &str,
    max_rows: usize,
    render: impl Fn(&Trajectory) -> Option<V>,
) -> (Vec<(&'a Trajectory, V)>, u64) {
    let mut ok: Vec<&Trajectory> = rows
        .iter()
        .filter(|t| t.kind == RolloutKind::Calibration && t.success && t.harness_id != h0_id && t.error_class.is_none())
        .collect();
    ok.sort_by(|a, b| (&a.task_id, &a.harness_id, &a.trajectory_id).cmp(&(&b.task_id, &b.harness_id, &b.trajectory_id)));
    let mut out = vec![];
    let mut left_out = 0;
    for t in ok {
        if out.len() >= max_rows {
            break;
        }
        match render(t) {
            Some(v) => out.push((t, v)),
            None => left_out += 1,
        }
    }
    (out, left_out)
}

pub async fn run(store: &dyn ObjectStore, input: &TransferInput) -> Result<TransferOutput, NativeError> {
    let device = crate::device::parse(&input.device)?;
    let h0_id = input.context.h0.as_ref().map(|h| h.id.clone()).ok_or_else(|| NativeError::Config {
        field: "context.h0".into(),
        detail: "the transfer probe renders under H0 and needs its spec".into(),
    })?;
    let key = schemas::keys::trajectories_of_step(&input.run_id, input.set_step, Some(RolloutKind::Calibration));
    let rows: Vec<Trajectory> = read_committed(store, &input.run_id, &key).await?;
    let (model, tokenizer) = match input.weights_step {
        Some(step) => {
            let (model, tok, _) = crate::train::checkpoint::load_model(store, &input.run_id, step, device).await?;
            let tok = match tok {
                Some(t) => t,
                None => crate::model::loader::load(&input.base_model, tch::Device::Cpu)?.1,
            };
            (model, tok)
        }
        None => crate::model::loader::load(&input.base_model, device)?,
    };
    let render = |t: &Trajectory| input.context.under_h0(t, 0, 0.0, &tokenizer).ok();
    let (set, not_renderable) = held_out(&rows, &h0_id, input.max_rows, render);
    let samples: Vec<_> = set.iter().flat_map(|(_, s)| s.iter().cloned()).collect();
    let learner = Learner::new(model, LearnerConfig::default());
    let scored = learner.score(&samples);
    let (mut sum, mut tokens) = (0f64, 0u64);
    for (s, lp) in samples.iter().zip(&scored) {
        for (m, v) in s.mask.iter().zip(lp) {
            if *m {
                sum += *v as f64;
                tokens += 1;
            }
        }
    }
    let out = TransferOutput {
        mean_logprob: (tokens > 0).then(|| sum / tokens as f64),
        tokens,
        trajectory_ids: set.iter().map(|(t, _)| t.trajectory_id.clone()).collect(),
        not_renderable,
    };
    tracing::info!(run = %input.run_id, step = input.step, rows = set.len(), tokens, mean_logprob = ?out.mean_logprob, "transfer probe: held-out sibling successes scored under H0");
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use schemas::{Split, Termination};

    fn row(id: &str, task: &str, harness: &str, success: bool) -> Trajectory {
        serde_json::from_value(serde_json::json!({
            "trajectory_id": id, "run_id": "r", "job_id": "j", "step": 0, "kind": "calibration", "split": "validation",
            "task_id": task, "task_type": "counting", "group_id": "g", "attempt": 0, "harness_id": harness,
            "harness_version": "v", "policy_checkpoint": "", "seed": 0, "reward": if success { 1.0 } else { 0.0 }, "success": success,
            "termination": "committed", "error_class": null, "error_message": null,
            "prompt_tokens": 0, "completion_tokens": 0,
            "harness_tokens": 0, "model_calls": 0, "env_actions": 0, "started_at_ms": 0, "duration_ms": 0,
            "policy_ms": 0, "env_ms": 0, "turns": [], "temperature": 1.0, "tool_view": ""
        }))
        .unwrap()
    }

    #[test]
    fn the_held_out_set_is_the_renderable_sibling_successes_in_content_order() {
        let rows = vec![
            row("c", "t2", "s1", true),
            row("a", "t1", "s2", true),
            row("b", "t1", "s1", true),
            row("h", "t1", "h0", true),
            row("f", "t3", "s1", false),
            row("x", "t4", "s-force", true),
        ];
        let (set, left_out) = held_out(&rows, "h0", 10, |t| (t.harness_id != "s-force").then_some(()));
        let ids: Vec<&str> = set.iter().map(|(t, _)| t.trajectory_id.as_str()).collect();
        assert_eq!(ids, ["b", "a", "c"], "successes of siblings only, by task then harness");
        assert_eq!(left_out, 1);
        let (set, _) = held_out(&rows, "h0", 2, |_| Some(()));
        assert_eq!(set.len(), 2);
        assert!(set.iter().all(|(t, _)| t.split == Split::Validation && t.termination == Termination::Committed));
    }
}
