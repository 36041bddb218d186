//! Stored rollouts → learner [`Batch`]: one [`Sample`] per policy turn, its context the
//! prompt the policy sampled that turn from, then turns that extend each other folded into
//! one row per trajectory ([`merge_shared_prefixes`]) (Appendix B: "each auxiliary trajectory retains
//! its generating context when computing the probability ratio").
//!
//! The context is not re-invented here: it is rebuilt with the rollout's own functions —
//! [`jobs::harness::chat_messages`] over the turns before it (harness-injected turns
//! included, adjacent turns merged as the session merged them) and
//! [`crate::model::chat::prompt_ids`] with the trajectory's stored tool view — and then checked
//! against the fingerprint (length and hash of the prompt ids) the policy recorded when it
//! sampled. A turn whose rebuilt prompt differs, or that has no fingerprint, is refused
//! with the trajectory and turn named: the learner never scores a context the policy did
//! not see.

use std::collections::BTreeMap;

use jobs::env::ToolSpec;
use jobs::harness::{render_under, Budgets, EpisodeFacts};
use schemas::{prompt_hash, ErrorClass, Group, HarnessSpec, RolloutKind, Trajectory, TurnSource};
use serde::{Deserialize, Serialize};

use super::{grpo, Batch, ContextShift, Sample};
use crate::model::tokenizer::Tokenizer;
use crate::NativeError;

/// `[algorithm] rescue_context`: the context a rescue trajectory's policy tokens are scored
/// in (Appendix B keeps the generating one).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RescueContextMode {
    /// The sibling's context, as sampled (the paper, Eq. 13).
    #[default]
    Generating,
    /// The context H0 would have shown at that turn given the same history (Guide-GRPO's
    /// hint-free context): ratio π_θ(y | c_H0) / π_old(y | c_H) with the context shift as
    /// a truncated importance weight.
    H0,
    /// Both, each copy with its weight.
    Both,
}

impl RescueContextMode {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Generating => "generating",
            Self::H0 => "h0",
            Self::Both => "both",
        }
    }
}

/// What the learner needs to score rescue rows under H0: H0's spec, the environment's own
/// tools, its round limit and the episode budgets (the scheduler fills them from the run),
/// and the weight settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RescueContext {
    pub mode: RescueContextMode,
    /// Scales of the generating and the H0 copy under `both` (Eq. 15 multipliers).
    pub weights: [f64; 2],
    /// Bounds of the context weight clip(π_old(y | c_H0) / q(y | c_H), floor, cap).
    pub floor: f64,
    pub cap: f64,
    pub h0: Option<HarnessSpec>,
    pub env_tools: Vec<ToolSpec>,
    pub max_rounds: u32,
    pub budgets: Budgets,
}

impl Default for RescueContext {
    fn default() -> Self {
        RescueContext {
            mode: RescueContextMode::Generating,
            weights: [0.5, 0.5],
            floor: 0.0,
            cap: grpo::TIS_CAP,
            h0: None,
            env_tools: vec![],
            max_rounds: 0,
            budgets: Budgets::default(),
        }
    }
}

impl RescueContext {
    /// The policy samples of `traj` in H0's context, when it is a sibling's rescue row
    /// that H0 can re-render: `Ok(None)` for rows that stay in their generating context
    /// (not rescue, or under H0 itself), `Err(reason)` for a sibling row H0 cannot render.
    pub fn h0_samples(&self, traj: &Trajectory, task: usize, advantage: f64, tok: &Tokenizer) -> Result<Option<Vec<Sample>>, String> {
        let Some(h0) = &self.h0 else { return Ok(None) };
        if self.mode == RescueContextMode::Generating || traj.kind != RolloutKind::Rescue || traj.harness_id == h0.id {
            return Ok(None);
        }
        self.under_h0(traj, task, advantage, tok).map(Some)
    }

    /// The policy samples of any trajectory in the context H0 would have shown at each of
    /// its turns (the transfer probe scores held-out sibling rows so); `Err(reason)` when
    /// H0 cannot re-render it or this context names no H0.
    pub fn under_h0(&self, traj: &Trajectory, task: usize, advantage: f64, tok: &Tokenizer) -> Result<Vec<Sample>, String> {
        let h0 = self.h0.as_ref().ok_or("no H0 spec to render under")?;
        let facts = EpisodeFacts { env_tools: self.env_tools.clone(), max_rounds: self.max_rounds, task_type: traj.task_type.clone() };
        let rendered = render_under(h0, self.budgets, &facts, &traj.turns, traj.termination).map_err(|e| e.to_string())?;
        let generating = samples_from_trajectory(traj, task, advantage, tok).map_err(|e| e.to_string())?;
        let mut out = vec![];
        let policy_turns = traj.turns.iter().enumerate().filter(|(_, t)| t.source == TurnSource::Policy && !t.token_ids.is_empty());
        let shift = ContextShift { floor: self.floor, cap: self.cap };
        for ((i, _), mut s) in policy_turns.zip(generating) {
            let r = rendered.turns.iter().find(|r| r.turn == i).ok_or_else(|| format!("turn {i} has no H0 rendering"))?;
            s.context = crate::model::chat::prompt_ids(tok, &r.messages, &rendered.tools).map_err(|e| e.to_string())?;
            s.shift = Some(shift);
            out.push(s);
        }
        Ok(out)
    }
}

/// The temperature π_old is scored at for a row sampled at `t` (greedy decoding records
/// its logprobs at temperature 1).
pub fn scoring_temperature(t: f32) -> f32 {
    if t > 0.0 && t.is_finite() {
        t
    } else {
        1.0
    }
}

/// The tools a row's policy was shown (its stored tool view).
fn tool_view(traj: &Trajectory) -> Result<Vec<ToolSpec>, NativeError> {
    if traj.tool_view.is_empty() {
        return Ok(vec![]);
    }
    serde_json::from_str(&traj.tool_view)
        .map_err(|e| NativeError::Input(format!("trajectory `{}`: `tool_view` is not a JSON list of tools: {e}", traj.trajectory_id)))
}

/// The prompt ids turn `i` was sampled from, rebuilt with the rollout's own rendering.
fn prompt_before(traj: &Trajectory, i: usize, tools: &[ToolSpec], tok: &Tokenizer) -> Result<Vec<u32>, NativeError> {
    crate::model::chat::prompt_ids(tok, &jobs::harness::chat_messages(&traj.turns[..i]), tools)
}

/// Samples of one trajectory (policy turns only; harness, env and system turns are
/// context). Rows failed by infrastructure are masked out (Eq. 15 excludes their tokens):
/// their samples carry an all-false mask.
pub fn samples_from_trajectory(traj: &Trajectory, task: usize, advantage: f64, tok: &Tokenizer) -> Result<Vec<Sample>, NativeError> {
    let at = |i: usize, detail: String| {
        NativeError::Input(format!("trajectory `{}` (task `{}`), turn {i}: {detail}", traj.trajectory_id, traj.task_id))
    };
    let tools = tool_view(traj)?;
    let masked = traj.error_class == Some(ErrorClass::Infra);
    let temperature = scoring_temperature(traj.temperature);
    let mut out = vec![];
    for (i, turn) in traj.turns.iter().enumerate() {
        if turn.source != TurnSource::Policy {
            continue;
        }
        if turn.token_ids.is_empty() {
            if turn.text.is_empty() {
                continue;
            }
            return Err(at(i, "is a policy turn without sampled token ids (the backend returned none); the learner trains only on the tokens the policy sampled".into()));
        }
        let Some(recorded) = &turn.prompt_hash else {
            return Err(at(
                i,
                "has no prompt fingerprint (`prompt_hash`): the prompt it was sampled from is unknown, so it cannot be trained on".into(),
            ));
        };
        let context = prompt_before(traj, i, &tools, tok)?;
        let rebuilt = prompt_hash(&context);
        if context.len() != turn.prompt_token_count as usize || &rebuilt != recorded {
            return Err(at(
                i,
                format!(
                    "the rebuilt prompt ({} tokens, hash {rebuilt}) is not the one the policy sampled from ({} tokens, hash {recorded}); refusing to train on a context the policy never saw (was the row edited, or is the tokenizer another model's?)",
                    context.len(),
                    turn.prompt_token_count
                ),
            ));
        }
        let logq = if turn.logprobs.len() == turn.token_ids.len() {
            turn.logprobs.clone()
        } else if turn.logprobs.is_empty() {
            vec![]
        } else {
            return Err(at(i, format!("{} sampled tokens but {} rollout logprobs", turn.token_ids.len(), turn.logprobs.len())));
        };
        let mask = if masked {
            vec![false; turn.token_ids.len()]
        } else if turn.loss_mask.len() == turn.token_ids.len() {
            turn.loss_mask.clone()
        } else {
            return Err(at(i, format!("{} sampled tokens but {} loss-mask entries", turn.token_ids.len(), turn.loss_mask.len())));
        };
        out.push(Sample { task, context, completion: turn.token_ids.clone(), mask, logq, advantage, temperature, scale: 1.0, shift: None });
    }
    Ok(out)
}

/// Folds the per-turn samples of one trajectory into as few rows as their tokens allow:
/// when a turn's context is the previous row's context and completion followed by more
/// tokens (the env and harness turns in between), the two become one row whose completion
/// carries those in-between tokens with a false mask. One forward pass then scores every
/// policy turn of the episode instead of one pass per turn re-reading the shared prefix.
/// The scores are the same: causal attention gives each position the same context either
/// way. Turns whose contexts do not extend each other (a re-tokenised reply that differs
/// from the sampled ids, a harness that rewrote history) stay separate rows.
pub fn merge_shared_prefixes(samples: Vec<Sample>) -> Vec<Sample> {
    let mut out: Vec<Sample> = vec![];
    for s in samples {
        if let Some(prev) = out.last_mut() {
            let covered = prev.context.len() + prev.completion.len();
            let extends = s.task == prev.task
                && s.advantage == prev.advantage
                && s.temperature == prev.temperature
                && s.scale == prev.scale
                && s.shift == prev.shift
                && s.logq.is_empty() == prev.logq.is_empty()
                && s.context.len() >= covered
                && s.context[..prev.context.len()] == prev.context[..]
                && s.context[prev.context.len()..covered] == prev.completion[..];
            if extends {
                let between = &s.context[covered..];
                prev.completion.extend_from_slice(between);
                prev.mask.extend(std::iter::repeat_n(false, between.len()));
                if !prev.logq.is_empty() {
                    prev.logq.extend(std::iter::repeat_n(0.0, between.len()));
                }
                prev.completion.extend_from_slice(&s.completion);
                prev.mask.extend_from_slice(&s.mask);
                prev.logq.extend_from_slice(&s.logq);
                continue;
            }
        }
        out.push(s);
    }
    out
}

/// Records on `traj`'s policy turns the prompt fingerprint a native rollout records when it
/// samples (for rows built outside a rollout: tests, imported data). Panics on nothing;
/// errors when the tool view or the chat cannot be rendered.
pub fn fingerprint(traj: &mut Trajectory, tok: &Tokenizer) -> Result<(), NativeError> {
    let tools = tool_view(traj)?;
    for i in 0..traj.turns.len() {
        if traj.turns[i].source == TurnSource::Policy {
            let ids = prompt_before(traj, i, &tools, tok)?;
            traj.turns[i].prompt_token_count = ids.len() as u32;
            traj.turns[i].prompt_hash = Some(prompt_hash(&ids));
        }
    }
    Ok(())
}

/// The learn step of the run `run_id` whose checkpoint a row's `policy_checkpoint` names
/// (`…runs/<run>/checkpoints/step=<n>…`: a manifest key, a checkpoint folder path or store
/// URL); `Ok(None)` for anything else (the starting weights: a model path or name); an error
/// for another run's checkpoint.
pub fn checkpoint_step(run_id: &str, policy_checkpoint: &str) -> Result<Option<u32>, String> {
    match schemas::keys::checkpoint_of(policy_checkpoint)? {
        None => Ok(None),
        Some(c) if c.run_id == run_id => Ok(Some(c.step)),
        Some(_) => Err(format!("`{policy_checkpoint}` is a checkpoint of another run than `{run_id}`")),
    }
}

/// Refuses rows sampled by weights more than `max_lag` learn steps older than the weights
/// the learner starts from (`start`: the step whose checkpoint holds them; `None`: the
/// starting model), or by weights the learner has not reached: the rows an endpoint sampled
/// before it loaded the latest checkpoint, or after it restarted on other weights.
/// Appendix B's TIS weight corrects a lag the spec allows (`algorithm.max_off_policy_steps`).
pub fn check_staleness<'a>(
    run_id: &str,
    start: Option<u32>,
    max_lag: u32,
    rows: impl IntoIterator<Item = &'a Trajectory>,
) -> Result<(), NativeError> {
    let now = start.unwrap_or(0);
    for t in rows {
        let at = |detail: String| NativeError::Input(format!("trajectory `{}` (task `{}`): {detail}", t.trajectory_id, t.task_id));
        let sampled = checkpoint_step(run_id, &t.policy_checkpoint).map_err(at)?.unwrap_or(0);
        let expected = start.map(|s| format!("checkpoint step {s}")).unwrap_or_else(|| "the starting weights".into());
        if sampled > now {
            return Err(at(format!(
                "was sampled by `{}`, newer than the learner's {expected}; was a checkpoint removed?",
                t.policy_checkpoint
            )));
        }
        if now - sampled > max_lag {
            return Err(at(format!(
                "was sampled by `{}`, {} learn step(s) behind the learner's {expected}; the endpoint did not serve the latest weights (or set algorithm.max_off_policy_steps = {} to train on rows that old, with the TIS correction)",
                t.policy_checkpoint,
                now - sampled,
                now - sampled
            )));
        }
    }
    Ok(())
}

/// The batch of one update. Every group of the step is a task of the batch B (Eq. 15
/// divides by |B|; a task whose group has no reward contrast contributes zero); samples
/// come from the retained groups. Advantages come from the group rows (Eq. 6 as computed
/// when the group was formed), recomputed from rewards when a group row has none. Errors
/// name the group and trajectory.
pub fn batch_from_groups(
    groups: &[Group],
    trajectories: &[Trajectory],
    tok: &Tokenizer,
    rescue: &RescueContext,
) -> Result<Batch, NativeError> {
    let by_id: BTreeMap<&str, &Trajectory> = trajectories.iter().map(|t| (t.trajectory_id.as_str(), t)).collect();
    let mut batch = Batch::default();
    let mut policy_turns = 0usize;
    // Task order, not group-id order: group ids hash the run id, and the learner's sample
    // order (hence its float sums) must not depend on what the run is called.
    let mut all: Vec<&Group> = groups.iter().collect();
    all.sort_by(|a, b| (&a.task_id, &a.group_id).cmp(&(&b.task_id, &b.group_id)));
    for g in all {
        let task = batch.tasks.len();
        batch.tasks.push(g.task_id.clone());
        if !g.retained {
            continue;
        }
        let trajs: Vec<&Trajectory> = g
            .trajectory_ids
            .iter()
            .map(|id| {
                by_id.get(id.as_str()).copied().ok_or_else(|| {
                    NativeError::Input(format!(
                        "group `{}` (task `{}`) lists trajectory `{id}`, which is not among the step's trajectories",
                        g.group_id, g.task_id
                    ))
                })
            })
            .collect::<Result<_, _>>()?;
        let advantages = if g.advantages.len() == trajs.len() {
            g.advantages.clone()
        } else {
            grpo::group_advantages(&trajs.iter().map(|t| t.reward).collect::<Vec<_>>())
        };
        for (t, a) in trajs.iter().zip(advantages) {
            let turns = samples_from_trajectory(t, task, a, tok)?;
            policy_turns += turns.len();
            match rescue.h0_samples(t, task, a, tok) {
                Ok(None) => batch.samples.extend(merge_shared_prefixes(turns)),
                Ok(Some(under_h0)) => {
                    batch.rendered_rows += 1;
                    let scale = |w: f64, v: Vec<Sample>| v.into_iter().map(move |s| Sample { scale: w, ..s });
                    if rescue.mode == RescueContextMode::Both {
                        batch.samples.extend(scale(rescue.weights[0], merge_shared_prefixes(turns)));
                        batch.samples.extend(scale(rescue.weights[1], merge_shared_prefixes(under_h0)));
                    } else {
                        batch.samples.extend(merge_shared_prefixes(under_h0));
                    }
                }
                Err(reason) => {
                    batch.kept_rows += 1;
                    tracing::info!(trajectory = %t.trajectory_id, harness = %t.harness_id, %reason, "rescue row kept in its generating context: H0 cannot re-render it");
                    batch.samples.extend(merge_shared_prefixes(turns));
                }
            }
        }
    }
    tracing::info!(
        policy_turns,
        rows = batch.samples.len(),
        rendered_under_h0 = batch.rendered_rows,
        kept_in_generating_context = batch.kept_rows,
        "learner rows (turns that extend each other share one forward pass)"
    );
    Ok(batch)
}

#[cfg(test)]
mod staleness_tests {
    use super::*;

    #[test]
    fn checkpoint_steps_are_read_from_keys_paths_and_urls_of_this_run_only() {
        assert_eq!(checkpoint_step("r", "runs/r/checkpoints/step=3/manifest.json"), Ok(Some(3)));
        assert_eq!(checkpoint_step("r", "/data/store/runs/r/checkpoints/step=12"), Ok(Some(12)));
        assert_eq!(checkpoint_step("r", "s3://b/p/runs/r/checkpoints/step=2?endpoint=http://127.0.0.1:8333"), Ok(Some(2)));
        assert_eq!(checkpoint_step("r", "/models/smollm2.gguf"), Ok(None));
        assert_eq!(checkpoint_step("r", "smollm2"), Ok(None));
        assert!(checkpoint_step("r", "runs/other/checkpoints/step=1/manifest.json").unwrap_err().contains("another run"));
        assert!(checkpoint_step("r", "runs/xr/checkpoints/step=1").is_err());
    }

    fn row(id: &str, checkpoint: &str) -> Trajectory {
        let mut t: Trajectory = serde_json::from_value(serde_json::json!({
            "trajectory_id": id, "run_id": "r", "job_id": "j", "step": 2, "kind": "rescue", "split": "train",
            "task_id": "t", "task_type": "counting", "group_id": "g", "attempt": 0, "harness_id": "h0",
            "harness_version": "v", "policy_checkpoint": "", "seed": 0, "reward": 0.0, "success": false,
            "termination": "committed", "error_class": null, "error_message": null,
            "prompt_tokens": 0, "completion_tokens": 0,
            "harness_tokens": 0, "model_calls": 0, "env_actions": 0, "started_at_ms": 0, "duration_ms": 0,
            "policy_ms": 0, "env_ms": 0, "turns": [], "temperature": 1.0, "tool_view": ""
        }))
        .unwrap();
        t.policy_checkpoint = checkpoint.into();
        t
    }

    #[test]
    fn rows_older_than_the_allowed_lag_are_refused_with_the_setting_named() {
        let current = row("a", "/s/runs/r/checkpoints/step=2");
        let behind = row("b", "/s/runs/r/checkpoints/step=1");
        let base = row("c", "/models/smollm2.gguf");
        assert!(check_staleness("r", Some(2), 0, [&current]).is_ok());
        let e = check_staleness("r", Some(2), 0, [&current, &behind]).unwrap_err().to_string();
        assert!(e.contains("trajectory `b`") && e.contains("1 learn step(s) behind") && e.contains("max_off_policy_steps = 1"), "{e}");
        assert!(check_staleness("r", Some(2), 1, [&current, &behind]).is_ok());
        assert!(check_staleness("r", Some(2), 1, [&base]).is_err(), "two steps behind");
        assert!(check_staleness("r", None, 0, [&base]).is_ok(), "the starting weights before any checkpoint");
        let e = check_staleness("r", None, 0, [&current]).unwrap_err().to_string();
        assert!(e.contains("newer than the learner's the starting weights") || e.contains("newer"), "{e}");
    }
}
