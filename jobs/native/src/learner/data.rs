//! Stored rollouts → learner [`Batch`]: one [`Sample`] per policy turn, its context being
//! the chat of the turns before it rendered with the model's template — the exact prompt
//! the native policy sampled that turn from, harness-injected turns included, so each
//! auxiliary trajectory keeps its generating context (Appendix B).

use std::collections::BTreeMap;

use jobs::policy::Message;
use schemas::{Group, Trajectory, TurnSource};

use super::{grpo, Batch, Sample};
use crate::tokenizer::Tokenizer;
use crate::NativeError;

/// Samples of one trajectory (policy turns only; harness, env and system turns are context).
pub fn samples_from_trajectory(traj: &Trajectory, task: usize, advantage: f64, tok: &Tokenizer) -> Result<Vec<Sample>, NativeError> {
    let mut messages: Vec<Message> = vec![];
    let mut out = vec![];
    for turn in &traj.turns {
        if turn.source == TurnSource::Policy {
            let context = tok.encode_chat(&messages)?;
            let (completion, logq) = if turn.token_ids.is_empty() {
                (tok.encode_continuation(&turn.text)?, vec![])
            } else {
                let logq = if turn.logprobs.len() == turn.token_ids.len() { turn.logprobs.clone() } else { vec![] };
                (turn.token_ids.clone(), logq)
            };
            let mask = if turn.loss_mask.len() == completion.len() { turn.loss_mask.clone() } else { vec![true; completion.len()] };
            out.push(Sample { task, context, completion, mask, logq, advantage });
        }
        messages.push(Message::new(turn.role, turn.text.clone()));
    }
    Ok(out)
}

/// The batch of one update from the retained groups and their trajectories. Advantages
/// come from the group rows (Eq. 6 as computed when the group was formed), recomputed
/// from rewards when a group row has none. Errors name the group and trajectory.
pub fn batch_from_groups(groups: &[Group], trajectories: &[Trajectory], tok: &Tokenizer) -> Result<Batch, NativeError> {
    let by_id: BTreeMap<&str, &Trajectory> = trajectories.iter().map(|t| (t.trajectory_id.as_str(), t)).collect();
    let mut batch = Batch::default();
    let mut retained: Vec<&Group> = groups.iter().filter(|g| g.retained).collect();
    retained.sort_by(|a, b| a.group_id.cmp(&b.group_id));
    for g in retained {
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
        let task = batch.tasks.len();
        batch.tasks.push(g.task_id.clone());
        for (t, a) in trajs.iter().zip(advantages) {
            batch.samples.extend(samples_from_trajectory(t, task, a, tok)?);
        }
    }
    Ok(batch)
}
