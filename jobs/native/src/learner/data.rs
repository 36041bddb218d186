//! Stored rollouts → learner [`Batch`]: one [`Sample`] per policy turn, its context the
//! prompt the policy sampled that turn from, then turns that extend each other folded into
//! one row per trajectory ([`merge_shared_prefixes`]) (Appendix B: "each auxiliary trajectory retains
//! its generating context when computing the probability ratio").
//!
//! The context is not re-invented here: it is rebuilt with the rollout's own functions —
//! [`jobs::harness::chat_messages`] over the turns before it (harness-injected turns
//! included, adjacent turns merged as the session merged them) and
//! [`crate::policy::prompt_ids`] with the trajectory's stored tool view — and then checked
//! against the fingerprint (length and hash of the prompt ids) the policy recorded when it
//! sampled. A turn whose rebuilt prompt differs, or that has no fingerprint, is refused
//! with the trajectory and turn named: the learner never scores a context the policy did
//! not see.

use std::collections::BTreeMap;

use jobs::env::ToolSpec;
use schemas::{prompt_hash, ErrorClass, Group, Trajectory, TurnSource};

use super::{grpo, Batch, Sample};
use crate::tokenizer::Tokenizer;
use crate::NativeError;

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
    serde_json::from_str(&traj.tool_view).map_err(|e| NativeError::Input(format!("trajectory `{}`: `tool_view` is not a JSON list of tools: {e}", traj.trajectory_id)))
}

/// The prompt ids turn `i` was sampled from, rebuilt with the rollout's own rendering.
fn prompt_before(traj: &Trajectory, i: usize, tools: &[ToolSpec], tok: &Tokenizer) -> Result<Vec<u32>, NativeError> {
    crate::policy::prompt_ids(tok, &jobs::harness::chat_messages(&traj.turns[..i]), tools)
}

/// Samples of one trajectory (policy turns only; harness, env and system turns are
/// context). Rows failed by infrastructure are masked out (Eq. 15 excludes their tokens):
/// their samples carry an all-false mask.
pub fn samples_from_trajectory(traj: &Trajectory, task: usize, advantage: f64, tok: &Tokenizer) -> Result<Vec<Sample>, NativeError> {
    let at = |i: usize, detail: String| NativeError::Input(format!("trajectory `{}` (task `{}`), turn {i}: {detail}", traj.trajectory_id, traj.task_id));
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
            return Err(at(i, "has no prompt fingerprint (`prompt_hash`): the prompt it was sampled from is unknown, so it cannot be trained on".into()));
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
        out.push(Sample { task, context, completion: turn.token_ids.clone(), mask, logq, advantage, temperature });
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

/// The batch of one update. Every group of the step is a task of the batch B (Eq. 15
/// divides by |B|; a task whose group has no reward contrast contributes zero); samples
/// come from the retained groups. Advantages come from the group rows (Eq. 6 as computed
/// when the group was formed), recomputed from rewards when a group row has none. Errors
/// name the group and trajectory.
pub fn batch_from_groups(groups: &[Group], trajectories: &[Trajectory], tok: &Tokenizer) -> Result<Batch, NativeError> {
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
                    NativeError::Input(format!("group `{}` (task `{}`) lists trajectory `{id}`, which is not among the step's trajectories", g.group_id, g.task_id))
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
            batch.samples.extend(merge_shared_prefixes(turns));
        }
    }
    tracing::info!(policy_turns, rows = batch.samples.len(), "learner rows (turns that extend each other share one forward pass)");
    Ok(batch)
}
