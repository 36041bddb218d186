//! The edit job (Harness-R1 §3, Eq. 1 and 3): a harness editor reads one trace packet and
//! writes G patches; each is scored by what it changes in a frozen target. Read top to
//! bottom:
//!
//! 1. A done-marker means a redelivery: its stored patches are the answer.
//! 2. The editor samples G replies to the packet (patch g with seed `seed + g`).
//! 3. Each reply is parsed and applied to the parent ([`patch_from_reply`]). A reply that
//!    does not parse or validate is no patch: it scores 0, is stored with its error and
//!    never runs.
//! 4. Each valid patch is rerun by the frozen target on the packet's tasks (failed ones and
//!    controls) with the parent's seed: an ordinary rollout job with its own deterministic
//!    id (from the packet and the child's content) and done-marker, so a killed worker loses
//!    nothing and an identical patch is rerun once.
//! 5. Reward (Eq. 1): the mean over the packet's tasks of Rᴾ − R⁰, the parent's rewards
//!    being those of the episodes the packet was cut from. Advantages (Eq. 3): the rewards
//!    normalised within the G patches.
//! 6. Outputs: the editor's rows (`kind=edit` trajectories: instructions, packet, reply,
//!    with the reply's sampled tokens and logprobs), one group (the packet's G rows with
//!    their advantages, retained when the rewards differ) and the patch rows; then the
//!    done-marker. The learn job trains the editor on the group like any other.

use futures::stream::{self, StreamExt};
use serde::{Deserialize, Serialize};

use crate::env::EnvironmentFactory;
use crate::evolve::editor::{patch_from_reply, EDIT_INSTRUCTIONS};
use crate::harness::{Budgets, ValidateOptions};
use crate::policy::{Message, Policy, PolicyError, PolicyOutput, SamplingParams};
use crate::protocol::{self, JobRef, UnreadableMarker, Work};
use crate::rescue::{advantages, reward_stats, Outcome};
use crate::rollout::{self, RolloutContext, RolloutError, RolloutInput};
use infra::store::{ObjectStore, StoreError};
use infra::table::{read_records, write_records, TableError};
use schemas::{
    job_id, keys, now_unix_ms, DoneMarker, Group, HarnessSpec, JobIdParts, JobKind, PatchRecord, RetainedKind, Role, RolloutKind, Split,
    Termination, TracePacket, Trajectory, Turn, TurnSource,
};

/// What the editor is told before the packet: the patch format of the evolve editor, and
/// that one patch is judged by rerunning the same tasks.
pub const PATCH_INSTRUCTIONS: &str = "You are a harness engineer. A frozen agent failed the tasks in the failure \
packet below under the parent harness. Write ONE patch to the parent harness that makes the agent succeed on these \
tasks; the patch is judged by rerunning them, and tasks the agent already solves are rerun too.";

/// Input of an edit job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EditInput {
    pub run_id: String,
    /// The editor's update step: its rows are trained at this step.
    pub step: u32,
    pub packet: TracePacket,
    /// The harness the packet's episodes ran under.
    pub parent: HarnessSpec,
    /// G: patches sampled for the packet.
    pub patches: u32,
    /// The editor's sampling; patch g uses seed `seed + g`.
    pub sampling: SamplingParams,
    pub seed: u64,
    /// The editor's weights, recorded on its rows (checkpoint key or model path).
    pub editor_checkpoint: String,
    /// The frozen target's budgets and sampling in reruns (those of the parent's episodes).
    #[serde(default)]
    pub budgets: Budgets,
    #[serde(default)]
    pub rerun_sampling: SamplingParams,
    /// Episodes of a rerun at the same time.
    #[serde(default = "rollout::one")]
    pub concurrency: usize,
}

/// What an edit job runs against.
pub struct EditContext<'a> {
    pub store: &'a dyn ObjectStore,
    /// The editor (trained).
    pub editor: &'a dyn Policy,
    /// The frozen target that reruns the patched harnesses.
    pub target: &'a dyn Policy,
    pub envs: &'a dyn EnvironmentFactory,
    /// The environment's tools, for validating patches.
    pub validate: &'a ValidateOptions,
    pub job_id: &'a str,
    pub delivery_attempt: u32,
}

/// Counts of one edit job, its done-marker's result.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EditSummary {
    pub patches: u32,
    pub valid: u32,
    pub mean_reward: f64,
    pub best_reward: f64,
    /// Index of the best valid patch, if any was valid.
    pub best_patch: Option<u32>,
    /// Policy tokens of the editor rows (what the learner can train on).
    pub policy_tokens: u64,
    pub retained: bool,
}

/// The job's result.
#[derive(Debug, Clone, PartialEq)]
pub struct EditOutput {
    pub summary: EditSummary,
    pub patches: Vec<PatchRecord>,
    pub marker_key: String,
    pub already_done: bool,
}

/// Failures of the job itself (invalid patches are recorded, not raised).
#[derive(Debug, thiserror::Error)]
pub enum EditJobError {
    #[error("edit input: `{field}` {reason}")]
    InvalidInput { field: &'static str, reason: String },
    #[error("editor: {0}")]
    Editor(#[from] PolicyError),
    #[error(transparent)]
    Rollout(#[from] RolloutError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Table(#[from] TableError),
    #[error(transparent)]
    Marker(#[from] UnreadableMarker),
}

impl infra::Transient for EditJobError {
    fn is_transient(&self) -> bool {
        match self {
            EditJobError::Editor(e) => e.is_transient(),
            EditJobError::Rollout(e) => e.is_transient(),
            EditJobError::Store(e) => e.is_transient(),
            EditJobError::Table(e) => e.is_transient(),
            EditJobError::InvalidInput { .. } | EditJobError::Marker(_) => false,
        }
    }
}

pub async fn run(ctx: &EditContext<'_>, input: &EditInput) -> Result<EditOutput, EditJobError> {
    check_input(input)?;
    let job = JobRef { store: ctx.store, run_id: &input.run_id, job_id: ctx.job_id, kind: JobKind::Edit, attempt: ctx.delivery_attempt };
    // A redelivered job: the patches its committed run stored.
    let done = async |marker: DoneMarker| -> Result<_, EditJobError> {
        let summary = serde_json::from_value(marker.result).unwrap_or_default();
        let patches = read_records(ctx.store, &keys::patch_part(&input.run_id, input.step, ctx.job_id)).await?;
        Ok((summary, patches))
    };
    let ((summary, patches), already_done) = protocol::once(job, done, async || edit(ctx, input).await).await?;
    Ok(EditOutput { summary, patches, marker_key: job.marker_key(), already_done })
}

/// The job's work: G patches sampled, scored, and written with the editor's rows and group.
async fn edit(ctx: &EditContext<'_>, input: &EditInput) -> Result<Work<(EditSummary, Vec<PatchRecord>)>, EditJobError> {
    let messages = prompt(&input.parent, &input.packet);
    let replies = sample(ctx, input, &messages).await?;
    // Patches are scored at the same time: the target's engine batches their reruns.
    // Owned texts keep the stream's futures `Send` for any caller lifetime.
    let texts: Vec<(u32, String)> = replies.iter().enumerate().map(|(g, r)| (g as u32, r.text.clone())).collect();
    let scored: Vec<Result<PatchRecord, EditJobError>> = stream::iter(texts)
        .map(|(g, text)| async move { score(ctx, input, g, &text).await })
        .buffered(replies.len().max(1))
        .collect()
        .await;
    let mut patches = scored.into_iter().collect::<Result<Vec<_>, _>>()?;
    // Eq. 3: advantages within the packet's G patches.
    let outcomes: Vec<Outcome> = patches
        .iter()
        .map(|p| Outcome {
            trajectory_id: p.trajectory_id.clone(),
            harness_id: p.child_harness_id.clone().unwrap_or_default(),
            reward: p.reward,
            success: p.reward > 0.0,
            policy_tokens: 0,
            masked: false,
        })
        .collect();
    for (p, a) in patches.iter_mut().zip(advantages(&outcomes)) {
        p.advantage = a;
    }
    let rows: Vec<Trajectory> = replies.into_iter().zip(&patches).map(|(r, p)| editor_row(ctx, input, &messages, r, p)).collect();
    let group = group_of(input, &patches, &rows, &outcomes);
    let summary = summarize(&patches, &group);

    let outputs = vec![
        write_records(ctx.store, &keys::trajectory_part(&input.run_id, input.step, RolloutKind::Edit, ctx.job_id), &rows).await?,
        write_records(ctx.store, &keys::group_part(&input.run_id, input.step, ctx.job_id), &[group]).await?,
        write_records(ctx.store, &keys::patch_part(&input.run_id, input.step, ctx.job_id), &patches).await?,
    ];
    let result = serde_json::to_value(&summary).expect("summaries serialise");
    tracing::info!(job = ctx.job_id, packet = %input.packet.packet_id, valid = summary.valid, patches = summary.patches,
        mean_reward = summary.mean_reward, "edit job done");
    Ok(Work { value: (summary, patches), outputs, result })
}

fn check_input(input: &EditInput) -> Result<(), EditJobError> {
    let bad = |field, reason: &str| Err(EditJobError::InvalidInput { field, reason: reason.to_string() });
    let p = &input.packet;
    if input.patches == 0 {
        return bad("patches", "must be at least 1 (G patches per packet)");
    }
    if p.task_ids.is_empty() {
        return bad("packet.task_ids", "is empty: a packet needs at least one task");
    }
    if p.parent_rewards.len() != p.task_ids.len() || p.controls.len() != p.task_ids.len() {
        return bad("packet.parent_rewards", "must give one reward (and one control flag) per task of `packet.task_ids`");
    }
    if p.parent_harness_version != input.parent.version_hash() {
        return bad(
            "parent",
            &format!(
                "is harness `{}` version {}, but the packet's episodes ran under version {}",
                input.parent.id,
                input.parent.version_hash(),
                p.parent_harness_version
            ),
        );
    }
    Ok(())
}

/// The editor's prompt: the instructions and patch format, then the parent and the packet.
pub fn prompt(parent: &HarnessSpec, packet: &TracePacket) -> Vec<Message> {
    let parent = serde_json::to_string(parent).expect("harness specs serialise");
    vec![
        Message::new(Role::System, format!("{PATCH_INSTRUCTIONS}\n\n{EDIT_INSTRUCTIONS}")),
        Message::new(Role::User, format!("Parent harness:\n{parent}\n\nFailure packet:\n{}", packet.text)),
    ]
}

/// G replies, sampled concurrently (an engine batches them; they share the prompt).
async fn sample(ctx: &EditContext<'_>, input: &EditInput, messages: &[Message]) -> Result<Vec<PolicyOutput>, EditJobError> {
    let replies: Vec<Result<PolicyOutput, PolicyError>> = stream::iter(0..input.patches)
        .map(|g| {
            let sampling = SamplingParams { seed: Some(input.seed.wrapping_add(u64::from(g))), ..input.sampling.clone() };
            async move { ctx.editor.chat(messages, &[], &sampling).await }
        })
        .buffered(input.patches as usize)
        .collect()
        .await;
    Ok(replies.into_iter().collect::<Result<_, _>>()?)
}

/// Id of the editor's row for patch `g`.
fn row_id(input: &EditInput, g: u32) -> String {
    job_id(&JobIdParts {
        run_id: &input.run_id,
        stage: "edit",
        step: input.step,
        task_id: &input.packet.packet_id,
        attempt_index: g,
        seed: input.seed,
        ..Default::default()
    })
}

/// Patch `g`: parsed and validated; when valid, rerun and rewarded (Eq. 1).
async fn score(ctx: &EditContext<'_>, input: &EditInput, g: u32, reply: &str) -> Result<PatchRecord, EditJobError> {
    let mut record = PatchRecord {
        run_id: input.run_id.clone(),
        step: input.step,
        packet_id: input.packet.packet_id.clone(),
        patch_index: g,
        trajectory_id: row_id(input, g),
        editor_checkpoint: input.editor_checkpoint.clone(),
        reply: reply.to_string(),
        valid: false,
        error: None,
        child_spec: None,
        child_harness_id: None,
        rerun_job_id: None,
        patched_rewards: vec![],
        reward: 0.0,
        advantage: 0.0,
    };
    // The child is named by its content, so the same patch is the same child (and rerun).
    let named = job_id(&JobIdParts { run_id: &input.parent.version_hash(), stage: "patch", task_id: reply, ..Default::default() });
    let child_id = format!("r1-{}", &named[..12]);
    let direction = format!("learned patch for packet {}", input.packet.packet_id);
    let child = match patch_from_reply(&input.parent, reply, &child_id, input.parent.generation + 1, &direction, ctx.validate) {
        Ok(child) => child,
        Err(reason) => {
            tracing::info!(job = ctx.job_id, patch = g, reason = %reason, "patch invalid: reward 0, not run");
            record.error = Some(reason);
            return Ok(record);
        }
    };
    let rerun = rerun(ctx, input, &child).await?;
    // Eq. 1: Δ_B(P) = mean over the batch of Rᴾ − R⁰.
    let n = input.packet.task_ids.len() as f64;
    record.reward = rerun.1.iter().zip(&input.packet.parent_rewards).map(|(p, o)| p - o).sum::<f64>() / n;
    record.valid = true;
    record.child_spec = Some(serde_json::to_string(&child).expect("harness specs serialise"));
    record.child_harness_id = Some(child.id);
    record.rerun_job_id = Some(rerun.0);
    record.patched_rewards = rerun.1;
    Ok(record)
}

/// The frozen target on the packet's tasks under `child`, with the parent's seed: the
/// rerun's job id and the reward of each task in packet order.
async fn rerun(ctx: &EditContext<'_>, input: &EditInput, child: &HarnessSpec) -> Result<(String, Vec<f64>), EditJobError> {
    let packet = &input.packet;
    let id = job_id(&JobIdParts {
        run_id: &input.run_id,
        stage: "edit/rerun",
        step: input.step,
        task_id: &packet.packet_id,
        harness_id: &child.version_hash(),
        seed: packet.seed,
        ..Default::default()
    });
    let rollout_input = RolloutInput {
        run_id: input.run_id.clone(),
        step: input.step,
        kind: RolloutKind::Eval,
        split: Split::Train,
        task_ids: packet.task_ids.clone(),
        harness: child.clone(),
        attempts: 1,
        seed: packet.seed,
        budgets: input.budgets,
        sampling: input.rerun_sampling.clone(),
        concurrency: input.concurrency,
    };
    let rctx = RolloutContext { store: ctx.store, policy: ctx.target, envs: ctx.envs, job_id: &id, delivery_attempt: ctx.delivery_attempt };
    rollout::run(&rctx, &rollout_input).await?;
    let rows: Vec<Trajectory> = read_records(ctx.store, &keys::trajectory_part(&input.run_id, input.step, RolloutKind::Eval, &id)).await?;
    let rewards = packet.task_ids.iter().map(|t| rows.iter().find(|r| &r.task_id == t).map(|r| r.reward).unwrap_or(0.0)).collect();
    Ok((id, rewards))
}

/// The editor's row for one patch: its prompt as turns (so the learner rebuilds the exact
/// context the reply was sampled from) and the reply with its sampled tokens.
fn editor_row(ctx: &EditContext<'_>, input: &EditInput, messages: &[Message], reply: PolicyOutput, patch: &PatchRecord) -> Trajectory {
    let completion_tokens = u64::from(reply.completion_tokens);
    let turns = vec![
        Turn::context(0, Role::System, TurnSource::System, messages[0].content.clone()),
        Turn::context(1, Role::User, TurnSource::Env, messages[1].content.clone()),
        Turn {
            loss_mask: vec![true; reply.token_ids.len()],
            token_ids: reply.token_ids,
            logprobs: reply.logprobs,
            prompt_token_count: reply.prompt_tokens,
            prompt_hash: reply.prompt_hash,
            ..Turn::context(2, Role::Assistant, TurnSource::Policy, reply.text)
        },
    ];
    Trajectory {
        trajectory_id: patch.trajectory_id.clone(),
        run_id: input.run_id.clone(),
        job_id: ctx.job_id.to_string(),
        step: input.step,
        kind: RolloutKind::Edit,
        split: Split::Train,
        task_id: input.packet.packet_id.clone(),
        task_type: "edit".into(),
        group_id: ctx.job_id.to_string(),
        attempt: patch.patch_index,
        harness_id: input.parent.id.clone(),
        harness_version: input.parent.version_hash(),
        policy_checkpoint: input.editor_checkpoint.clone(),
        seed: input.seed.wrapping_add(u64::from(patch.patch_index)),
        reward: patch.reward,
        success: patch.reward > 0.0,
        termination: Termination::Committed,
        error_class: None,
        error_message: patch.error.clone(),
        prompt_tokens: u64::from(reply.prompt_tokens),
        completion_tokens,
        harness_tokens: 0,
        model_calls: 1,
        env_actions: 0,
        started_at_ms: now_unix_ms(),
        duration_ms: 0,
        policy_ms: 0,
        env_ms: 0,
        temperature: input.sampling.temperature,
        tool_view: String::new(),
        turns,
    }
}

/// The packet's group: its G editor rows with their advantages; retained when the rewards
/// differ (equal rewards carry no signal, GRPO's filter).
fn group_of(input: &EditInput, patches: &[PatchRecord], rows: &[Trajectory], outcomes: &[Outcome]) -> Group {
    let (mean, std) = reward_stats(outcomes);
    let retained = std > 0.0;
    let valid = patches.iter().filter(|p| p.valid).count() as u32;
    Group {
        run_id: input.run_id.clone(),
        step: input.step,
        group_id: rows.first().map(|r| r.group_id.clone()).unwrap_or_default(),
        task_id: input.packet.packet_id.clone(),
        split: Split::Train,
        k: input.patches,
        base_successes: valid,
        rescue_fired: false,
        rescue_strategy: "none".into(),
        harnesses: patches.iter().map(|p| p.child_harness_id.clone().unwrap_or_else(|| "invalid".into())).collect(),
        rescue_successes: patches.iter().filter(|p| p.reward > 0.0).count() as u32,
        retained,
        retained_kind: if retained { RetainedKind::Base } else { RetainedKind::None },
        filter_reason: (!retained).then(|| format!("all {} patches earned the same reward {mean}", patches.len())),
        mean_reward: mean,
        reward_std: std,
        advantages: patches.iter().map(|p| p.advantage).collect(),
        trajectory_ids: rows.iter().map(|r| r.trajectory_id.clone()).collect(),
        policy_tokens: rows.iter().flat_map(|r| &r.turns).map(|t| t.loss_mask.iter().filter(|m| **m).count() as u64).sum(),
    }
}

/// The valid patch with the highest reward (the lowest index on ties).
pub fn best_patch(patches: &[PatchRecord]) -> Option<&PatchRecord> {
    patches.iter().filter(|p| p.valid).max_by(|a, b| a.reward.total_cmp(&b.reward).then(b.patch_index.cmp(&a.patch_index)))
}

fn summarize(patches: &[PatchRecord], group: &Group) -> EditSummary {
    let best = best_patch(patches);
    EditSummary {
        patches: patches.len() as u32,
        valid: patches.iter().filter(|p| p.valid).count() as u32,
        mean_reward: group.mean_reward,
        best_reward: best.map(|p| p.reward).unwrap_or(0.0),
        best_patch: best.map(|p| p.patch_index),
        policy_tokens: group.policy_tokens,
        retained: group.retained,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use async_trait::async_trait;
    use serde_json::json;

    use super::*;
    use crate::env::{ToolCall, ToolSpec};
    use crate::policy::FinishReason;
    use crate::testing::{say, Factory};
    use infra::store::LocalStore;

    /// The editor: reply `g` for the call with seed `seed + g`.
    struct Editor {
        replies: Vec<String>,
    }

    #[async_trait]
    impl Policy for Editor {
        fn checkpoint(&self) -> String {
            "editor".into()
        }
        async fn chat(&self, _m: &[Message], _t: &[ToolSpec], s: &SamplingParams) -> Result<PolicyOutput, PolicyError> {
            let g = (s.seed.unwrap() - 7) as usize;
            Ok(PolicyOutput { prompt_hash: Some(format!("h{g}")), text: self.replies[g].clone(), ..say("", None).unwrap() })
        }
    }

    /// The frozen target: commits the right answer when its system prompt says COMMIT,
    /// otherwise answers in prose; records the seed of every call.
    #[derive(Default)]
    struct Target {
        seeds: Mutex<Vec<u64>>,
    }

    #[async_trait]
    impl Policy for Target {
        fn checkpoint(&self) -> String {
            "target".into()
        }
        async fn chat(&self, m: &[Message], _t: &[ToolSpec], s: &SamplingParams) -> Result<PolicyOutput, PolicyError> {
            self.seeds.lock().unwrap().push(s.seed.unwrap());
            let obeys = m.iter().any(|m| m.role == Role::System && m.content.contains("COMMIT"));
            let call = obeys.then(|| ToolCall { name: "commit_final_answer".into(), args: json!({"answers": ["2"]}) });
            Ok(PolicyOutput {
                text: if obeys { String::new() } else { "It is probably two.".into() },
                tool_calls: call.into_iter().collect(),
                finish_reason: FinishReason::Stop,
                ..say("", None).unwrap()
            })
        }
    }

    fn packet(parent: &HarnessSpec) -> TracePacket {
        TracePacket {
            packet_id: "p1".into(),
            run_id: "r".into(),
            parent_harness_id: parent.id.clone(),
            parent_harness_version: parent.version_hash(),
            task_ids: vec!["a".into(), "b".into(), "c".into()],
            controls: vec![false, false, true],
            parent_rewards: vec![0.0, 0.0, 1.0],
            source_trajectory_ids: vec!["ta".into(), "tb".into(), "tc".into()],
            seed: 42,
            text: "## Failure 1: task a\n...".into(),
        }
    }

    fn input(replies: usize) -> EditInput {
        let parent = HarnessSpec::h0();
        EditInput {
            run_id: "r".into(),
            step: 1,
            packet: packet(&parent),
            parent,
            patches: replies as u32,
            sampling: SamplingParams { seed: None, ..SamplingParams::default() },
            seed: 7,
            editor_checkpoint: "base.gguf".into(),
            budgets: Budgets::default(),
            rerun_sampling: SamplingParams { temperature: 0.0, ..SamplingParams::default() },
            concurrency: 2,
        }
    }

    const COMMIT: &str = r#"{"prompt_rules": [{"slot": "answer_format", "text": "COMMIT the value with commit_final_answer."}]}"#;
    const PROSE: &str = r#"Here: {"prompt_rules": [{"slot": "answer_format", "text": "Explain the answer in prose."}]}"#;

    fn context<'a>(store: &'a LocalStore, editor: &'a Editor, target: &'a Target, validate: &'a ValidateOptions) -> EditContext<'a> {
        EditContext { store, editor, target, envs: &Factory { fail_step: false }, validate, job_id: "edit1", delivery_attempt: 1 }
    }

    fn validate() -> ValidateOptions {
        ValidateOptions { tools: Some(vec!["execute_sql".into(), "commit_final_answer".into()]), harness_actions: false, base: false }
    }

    #[tokio::test]
    async fn invalid_patches_score_zero_and_never_run_valid_ones_rerun_with_the_parents_seed() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalStore::new(dir.path()).unwrap();
        let replies = vec![
            "I would add a rule.".to_string(),
            COMMIT.to_string(),
            PROSE.to_string(),
            r#"{"hooks": [{"id": "x", "event": "whenever", "condition": "always", "action": "warn", "message": "hi"}]}"#.to_string(),
            COMMIT.to_string(),
        ];
        let editor = Editor { replies };
        let target = Target::default();
        let v = validate();
        let out = run(&context(&store, &editor, &target, &v), &input(5)).await.unwrap();
        let p = &out.patches;
        assert_eq!(p.len(), 5);
        // Invalid: no JSON, and a hook with an unknown event (named by its path).
        assert!(!p[0].valid && p[0].error.as_deref().unwrap().contains("no JSON object"), "{:?}", p[0].error);
        assert!(!p[3].valid && p[3].error.as_deref().unwrap().contains("hooks[0].event"), "{:?}", p[3].error);
        for i in [0, 3] {
            assert_eq!((p[i].reward, p[i].rerun_job_id.as_ref(), p[i].patched_rewards.len()), (0.0, None, 0));
        }
        // Eq. 1: the COMMIT rule repairs a and b and keeps the control c: (1 + 1 + 0) / 3.
        assert!(p[1].valid);
        assert_eq!(p[1].patched_rewards, [1.0, 1.0, 1.0]);
        assert!((p[1].reward - 2.0 / 3.0).abs() < 1e-12);
        // The prose rule breaks the control: (0 + 0 - 1) / 3.
        assert_eq!(p[2].patched_rewards, [0.0, 0.0, 0.0]);
        assert!((p[2].reward + 1.0 / 3.0).abs() < 1e-12);
        // The same patch is the same child and one rerun.
        assert_eq!((&p[4].child_harness_id, &p[4].rerun_job_id, p[4].reward), (&p[1].child_harness_id, &p[1].rerun_job_id, p[1].reward));
        // Reruns: two jobs (COMMIT and PROSE), three episodes each, all with the parent's seed.
        let reruns: Vec<Trajectory> =
            infra::table::read_prefix(&store, &keys::trajectories_of_step("r", 1, Some(RolloutKind::Eval))).await.unwrap();
        assert_eq!(reruns.len(), 6);
        assert!(reruns.iter().all(|r| r.seed == 42 && r.harness_id.starts_with("r1-")));
        assert!(target.seeds.lock().unwrap().iter().all(|s| *s == 42));
        // Eq. 3 advantages within the packet, stored on the group and the patch rows.
        let rewards: Vec<f64> = p.iter().map(|p| p.reward).collect();
        let mean = rewards.iter().sum::<f64>() / 5.0;
        assert!((out.summary.mean_reward - mean).abs() < 1e-12);
        assert!(p[1].advantage > 0.0 && p[2].advantage < p[0].advantage && p[0].advantage < 0.0);
        let groups: Vec<Group> = read_records(&store, &keys::group_part("r", 1, "edit1")).await.unwrap();
        assert!(groups[0].retained);
        assert_eq!(groups[0].advantages, p.iter().map(|p| p.advantage).collect::<Vec<_>>());
        // The editor's rows: instructions and packet as context, the reply's tokens trained.
        let rows: Vec<Trajectory> =
            infra::table::read_prefix(&store, &keys::trajectories_of_step("r", 1, Some(RolloutKind::Edit))).await.unwrap();
        assert_eq!(rows.len(), 5);
        assert_eq!(groups[0].trajectory_ids, rows.iter().map(|r| r.trajectory_id.clone()).collect::<Vec<_>>());
        let turns = &rows[1].turns;
        assert_eq!(turns.iter().map(|t| t.source).collect::<Vec<_>>(), [TurnSource::System, TurnSource::Env, TurnSource::Policy]);
        assert_eq!((turns[2].token_ids.clone(), turns[2].prompt_hash.as_deref()), (vec![11, 12], Some("h1")));
        assert_eq!(rows[1].reward, p[1].reward);
        assert_eq!(out.summary.best_patch, Some(1));
        assert_eq!(out.summary.valid, 3);
    }

    #[tokio::test]
    async fn a_job_killed_after_its_reruns_redoes_none_of_them() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalStore::new(dir.path()).unwrap();
        let editor = Editor { replies: vec![COMMIT.to_string(), PROSE.to_string()] };
        let target = Target::default();
        let v = validate();
        let first = run(&context(&store, &editor, &target, &v), &input(2)).await.unwrap();
        let calls = target.seeds.lock().unwrap().len();
        let rerun_parts = store.list(&keys::trajectories_of_step("r", 1, Some(RolloutKind::Eval))).await.unwrap();
        // Killed before its own outputs were committed: the marker and the parts are gone.
        store.delete(&keys::done_marker("r", "edit1")).await.unwrap();
        for key in [keys::patch_part("r", 1, "edit1"), keys::group_part("r", 1, "edit1")] {
            store.delete(&key).await.unwrap();
        }
        let again = run(&context(&store, &editor, &target, &v), &input(2)).await.unwrap();
        assert!(!again.already_done);
        assert_eq!(again.patches, first.patches);
        assert_eq!(target.seeds.lock().unwrap().len(), calls, "the reruns were not run again");
        assert_eq!(store.list(&keys::trajectories_of_step("r", 1, Some(RolloutKind::Eval))).await.unwrap(), rerun_parts);
        // A third delivery finds the marker.
        let third = run(&context(&store, &editor, &target, &v), &input(2)).await.unwrap();
        assert!(third.already_done);
        assert_eq!(third.patches, first.patches);
    }

    #[tokio::test]
    async fn a_packet_from_another_parent_version_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalStore::new(dir.path()).unwrap();
        let editor = Editor { replies: vec![COMMIT.to_string()] };
        let target = Target::default();
        let v = validate();
        let mut i = input(1);
        i.packet.parent_harness_version = "other".into();
        let err = run(&context(&store, &editor, &target, &v), &i).await.unwrap_err();
        assert!(err.to_string().contains("`parent`") && err.to_string().contains("other"), "{err}");
    }
}
