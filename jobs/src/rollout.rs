//! The rollout job: a policy acting in an environment through a harness.
//!
//! Input: run, step, kind, tasks, one harness spec, attempts per task and a base seed.
//! For every (task, attempt) the job runs one episode from the task's initial state
//! ([`run_episode`]), turns it into a [`Trajectory`] row with its [`Turn`]s nested, writes
//! all rows as one Parquet part at `runs/<run>/trajectories/step=<n>/kind=<kind>/
//! part-<job>.parquet`, and then — last — the done-marker `runs/<run>/jobs/<job>.done.json`
//! with `put_if_absent` (docs/ARCHITECTURE.md, "Durability contract"). A redelivered job whose marker
//! exists does nothing; a half-done one overwrites the same part key.
//!
//! Failures inside an episode (policy timeouts, invalid output, environment backend
//! errors) never abort the job: they are recorded on the row as `error_class`,
//! `error_message` and `termination = error`, and the scheduler applies its policy per
//! class. Only store failures and invalid input fail the job — and, for environments
//! that ask for it ([`EnvironmentFactory::job_retries`]: a remote server that was restarted
//! loses its sessions), episodes that lost their backend: such a delivery writes nothing
//! and fails retryably ([`RolloutError::EnvUnavailable`]), so the queue runs the job again,
//! every episode started fresh; the delivery after the last retry records them as failed.

use std::collections::BTreeMap;
use std::time::Instant;

use futures::stream::{self, StreamExt};
use serde::{Deserialize, Serialize};

use crate::env::{Environment, EnvironmentFactory};
use crate::harness::{check_spec, Budgets, Next, PolicyRequest, Problem, Session, ValidateOptions, Verdict};
use crate::policy::{Policy, PolicyError, SamplingParams};
use crate::protocol::{self, JobRef, UnreadableMarker, Work};
use infra::store::{ObjectStore, StoreError};
use infra::table::{PartWriter, TableError};
use schemas::{
    job_id, keys, now_unix_ms, DoneMarker, ErrorClass, HarnessSpec, JobIdParts, JobKind, OutputEntry, RolloutKind, Split, Termination,
    Trajectory, Turn,
};

/// Input of a rollout job (the payload of its job envelope).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RolloutInput {
    pub run_id: String,
    /// Training update index.
    pub step: u32,
    pub kind: RolloutKind,
    pub split: Split,
    pub task_ids: Vec<String>,
    pub harness: HarnessSpec,
    /// Rollouts per task (K of Algorithm 1).
    pub attempts: u32,
    /// Attempt `i` of every task uses seed `seed + i` (environment and sampling).
    pub seed: u64,
    #[serde(default)]
    pub budgets: Budgets,
    #[serde(default)]
    pub sampling: SamplingParams,
    /// Episodes run at the same time (each with its own environment instance).
    #[serde(default = "one")]
    pub concurrency: usize,
}

pub(crate) fn one() -> usize {
    1
}

/// What a rollout job runs against.
pub struct RolloutContext<'a> {
    pub store: &'a dyn ObjectStore,
    pub policy: &'a dyn Policy,
    pub envs: &'a dyn EnvironmentFactory,
    /// The job's deterministic id (from its envelope): names the part and the marker.
    pub job_id: &'a str,
    /// Delivery attempt, recorded in the done-marker.
    pub delivery_attempt: u32,
}

/// Failures of the job itself (episode failures are recorded on rows instead).
#[derive(Debug, thiserror::Error)]
pub enum RolloutError {
    #[error("rollout input: `{field}` {reason}")]
    InvalidInput { field: &'static str, reason: String },
    #[error("rollout input: harness `{harness}` is invalid:\n{}", .problems.iter().map(|p| p.to_string()).collect::<Vec<_>>().join("\n"))]
    InvalidHarness { harness: String, problems: Vec<Problem> },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Table(#[from] TableError),
    #[error(transparent)]
    Marker(#[from] UnreadableMarker),
    /// Episodes lost their environment backend; the job runs again (nothing was written).
    #[error("{failed} of {episodes} episodes lost their environment backend (delivery {delivery} of a job retried up to {retries} times before they are recorded as failed); first: {first}")]
    EnvUnavailable { failed: usize, episodes: usize, delivery: u32, retries: u32, first: String },
}

impl infra::Transient for RolloutError {
    /// Whether a later delivery of the same job may succeed.
    fn is_transient(&self) -> bool {
        match self {
            RolloutError::Store(e) => e.is_transient(),
            RolloutError::Table(e) => e.is_transient(),
            RolloutError::EnvUnavailable { .. } => true,
            _ => false,
        }
    }
}

/// Success and size counts of a batch, per task type; stored as the done-marker's result.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RolloutSummary {
    pub episodes: u32,
    pub successes: u32,
    /// task type → (episodes, successes)
    pub by_task_type: BTreeMap<String, (u32, u32)>,
    /// termination → episodes
    pub terminations: BTreeMap<String, u32>,
    /// error class → episodes
    pub errors: BTreeMap<String, u32>,
    pub turns: u64,
    pub model_calls: u64,
    pub env_actions: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub harness_tokens: u64,
}

/// The job's result.
#[derive(Debug, Clone, PartialEq)]
pub struct RolloutOutput {
    pub summary: RolloutSummary,
    /// The Parquet part (empty when the job was already done).
    pub outputs: Vec<OutputEntry>,
    pub marker_key: String,
    /// The done-marker existed: nothing was run.
    pub already_done: bool,
}

/// Runs the job: episodes → Parquet part → done-marker (last), within the job protocol
/// ([`crate::protocol::once`]).
pub async fn run(ctx: &RolloutContext<'_>, input: &RolloutInput) -> Result<RolloutOutput, RolloutError> {
    check_input(input)?;
    let job = JobRef { store: ctx.store, run_id: &input.run_id, job_id: ctx.job_id, kind: JobKind::Rollout, attempt: ctx.delivery_attempt };
    let done = async |marker: DoneMarker| Ok((serde_json::from_value(marker.result).unwrap_or_default(), vec![]));
    let ((summary, outputs), already_done) = protocol::once(job, done, async || episodes(ctx, input).await).await?;
    Ok(RolloutOutput { summary, outputs, marker_key: job.marker_key(), already_done })
}

/// The job's work: every (task, attempt) episode, the Parquet part of their rows, the
/// summary for the marker.
async fn episodes(ctx: &RolloutContext<'_>, input: &RolloutInput) -> Result<Work<(RolloutSummary, Vec<OutputEntry>)>, RolloutError> {
    let started = Instant::now();
    // Owned task ids keep the stream's futures `Send` for any caller lifetime.
    let plan: Vec<(usize, String, u32)> =
        input.task_ids.iter().enumerate().flat_map(|(ti, task)| (0..input.attempts).map(move |a| (ti, task.clone(), a))).collect();
    let total = plan.len();
    tracing::info!(job = ctx.job_id, harness = %input.harness.id, episodes = total, "rollout job started");
    let mut rows: Vec<(usize, u32, Trajectory, bool)> = stream::iter(plan)
        .map(|(ti, task, attempt)| async move {
            let (row, lost_backend) = rollout_one(ctx, input, &task, attempt).await;
            (ti, attempt, row, lost_backend)
        })
        .buffer_unordered(input.concurrency)
        .inspect({
            // progress of the job: episodes done of all, the policy's tokens per second so
            // far and the time left at that pace
            let (mut finished, mut tokens) = (0usize, 0u64);
            move |(_, _, row, _)| {
                finished += 1;
                tokens += row.completion_tokens;
                let secs = started.elapsed().as_secs_f64().max(1e-3);
                let left = secs / finished as f64 * (total - finished) as f64;
                tracing::info!(
                    task = %row.task_id, attempt = row.attempt, success = row.success,
                    termination = ?row.termination, turns = row.turns.len(),
                    progress = %format!("{finished}/{total}"), tokens_per_s = format!("{:.1}", tokens as f64 / secs),
                    left_s = left.round() as u64, "episode finished"
                );
            }
        })
        .collect()
        .await;
    rows.sort_by_key(|(ti, attempt, _, _)| (*ti, *attempt));
    let lost: Vec<&Trajectory> = rows.iter().filter(|(_, _, _, lost)| *lost).map(|(_, _, r, _)| r).collect();
    let retries = ctx.envs.job_retries();
    if !lost.is_empty() && ctx.delivery_attempt < retries {
        let first = lost[0];
        let err = RolloutError::EnvUnavailable {
            failed: lost.len(),
            episodes: total,
            delivery: ctx.delivery_attempt,
            retries,
            first: format!("task `{}`: {}", first.task_id, first.error_message.as_deref().unwrap_or("")),
        };
        tracing::warn!(job = ctx.job_id, error = %err, "rollout job retried: its environment backend was lost");
        return Err(err);
    }
    let rows: Vec<Trajectory> = rows.into_iter().map(|(_, _, r, _)| r).collect();

    let part_key = keys::trajectory_part(&input.run_id, input.step, input.kind, ctx.job_id);
    let mut writer = PartWriter::<Trajectory>::create(ctx.store, &part_key).await?;
    writer.write(&rows).await?;
    let part = writer.finish().await?;

    let summary = summarize(&rows);
    let result = serde_json::to_value(&summary).expect("summaries serialise");
    tracing::info!(
        job = ctx.job_id,
        episodes = total,
        successes = summary.successes,
        seconds = started.elapsed().as_secs_f64(),
        "rollout job done"
    );
    Ok(Work { value: (summary, vec![part.clone()]), outputs: vec![part], result })
}

fn check_input(input: &RolloutInput) -> Result<(), RolloutError> {
    let bad = |field, reason: &str| Err(RolloutError::InvalidInput { field, reason: reason.to_string() });
    if input.run_id.is_empty() {
        return bad("run_id", "is empty");
    }
    if input.task_ids.is_empty() {
        return bad("task_ids", "is empty: give at least one task");
    }
    if input.attempts == 0 {
        return bad("attempts", "must be at least 1");
    }
    if input.concurrency == 0 {
        return bad("concurrency", "must be at least 1");
    }
    // A structural check of what arrived in the job. Whether hooks may act in the policy's
    // place is the environment's choice, and whether `h0` may carry edits the run's
    // (`[pool] base`), both made where the spec was loaded (the run spec,
    // `--harness-actions`), not here.
    let problems = check_spec(&input.harness, &ValidateOptions { harness_actions: true, base: true, ..Default::default() });
    if !problems.is_empty() {
        return Err(RolloutError::InvalidHarness { harness: input.harness.id.clone(), problems });
    }
    Ok(())
}

/// One (task, attempt): a fresh environment, one episode, one row; and whether the
/// episode ended on a transient backend error.
async fn rollout_one(ctx: &RolloutContext<'_>, input: &RolloutInput, task_id: &str, attempt: u32) -> (Trajectory, bool) {
    let seed = input.seed.wrapping_add(u64::from(attempt));
    let started_at_ms = now_unix_ms();
    let clock = Instant::now();
    let episode = match ctx.envs.create().await {
        Ok(mut env) => {
            let sampling = SamplingParams { seed: Some(seed), ..input.sampling.clone() };
            let ep = run_episode(ctx.policy, env.as_mut(), &input.harness, input.budgets, &sampling, task_id, seed).await;
            if let Err(e) = env.close().await {
                tracing::warn!(task = task_id, error = %e, "closing the environment failed");
            }
            ep
        }
        Err(e) => Episode {
            env_transient: infra::Transient::is_transient(&e),
            ..Episode::failed(e.class(), format!("creating the environment: {e}"))
        },
    };
    let lost_backend = episode.env_transient;
    let ids = |stage: &str, harness: &str, attempt_index: u32, seed: u64| {
        job_id(&JobIdParts { run_id: &input.run_id, stage, step: input.step, task_id, harness_id: harness, attempt_index, seed })
    };
    let row = Trajectory {
        trajectory_id: ids(input.kind.as_str(), &input.harness.id, attempt, seed),
        run_id: input.run_id.clone(),
        job_id: ctx.job_id.to_string(),
        step: input.step,
        kind: input.kind,
        split: input.split,
        task_id: task_id.to_string(),
        task_type: episode.task_type,
        // A task's group at a step is the same whichever harness fills it (a rescue group
        // replaces the base group, Eq. 5).
        group_id: ids("group", "", 0, 0),
        attempt,
        harness_id: input.harness.id.clone(),
        harness_version: input.harness.version_hash(),
        policy_checkpoint: ctx.policy.checkpoint(),
        seed,
        reward: episode.reward,
        success: episode.success,
        termination: episode.termination,
        error_class: episode.error_class,
        error_message: episode.error_message,
        prompt_tokens: episode.usage.prompt_tokens,
        completion_tokens: episode.usage.completion_tokens,
        harness_tokens: episode.usage.harness_tokens,
        model_calls: episode.usage.model_calls,
        env_actions: episode.usage.env_actions,
        started_at_ms,
        duration_ms: clock.elapsed().as_millis() as u64,
        policy_ms: episode.policy_ms,
        env_ms: episode.env_ms,
        temperature: input.sampling.temperature,
        tool_view: serde_json::to_string(&episode.tools).expect("tool specs serialise"),
        turns: episode.turns,
    };
    (row, lost_backend)
}

/// The outcome of one episode.
#[derive(Debug, Clone, PartialEq)]
pub struct Episode {
    pub task_type: String,
    pub turns: Vec<Turn>,
    pub usage: crate::harness::Usage,
    pub termination: Termination,
    pub error_class: Option<ErrorClass>,
    pub error_message: Option<String>,
    pub reward: f64,
    pub success: bool,
    /// The grader's explanation (not shown to the policy).
    pub detail: String,
    pub policy_ms: u64,
    pub env_ms: u64,
    /// The tools the policy was shown (after the harness's tool view).
    pub tools: Vec<crate::env::ToolSpec>,
    /// The episode ended on a transient environment error (its backend was lost).
    pub env_transient: bool,
}

impl Episode {
    fn failed(class: ErrorClass, message: String) -> Episode {
        Episode {
            task_type: "unknown".into(),
            turns: vec![],
            usage: Default::default(),
            termination: Termination::Error,
            error_class: Some(class),
            error_message: Some(message),
            reward: 0.0,
            success: false,
            detail: String::new(),
            policy_ms: 0,
            env_ms: 0,
            tools: vec![],
            env_transient: false,
        }
    }
}

/// Runs one episode of `task_id` under `spec`: reset, then decide → mediate → act until the
/// environment ends it, a budget runs out or an error occurs, then grade. Never fails:
/// errors are part of the returned [`Episode`].
pub async fn run_episode(
    policy: &dyn Policy,
    env: &mut dyn Environment,
    spec: &HarnessSpec,
    budgets: Budgets,
    sampling: &SamplingParams,
    task_id: &str,
    seed: u64,
) -> Episode {
    let mut log = EpisodeLog::default();
    let t = Instant::now();
    let start = match env.reset(task_id, seed).await {
        Ok(s) => s,
        Err(e) => {
            let env_transient = infra::Transient::is_transient(&e);
            return Episode { env_transient, ..Episode::failed(e.class(), format!("reset of task `{task_id}`: {e}")) };
        }
    };
    log.env_ms += t.elapsed().as_millis() as u64;
    let task_type = start.task_type.clone();
    let mut session = match Session::start(spec, budgets, sampling.clone(), &start) {
        Ok(s) => s,
        Err(e) => return Episode { task_type, ..Episode::failed(ErrorClass::Env, e.to_string()) },
    };
    let termination = act_until_done(policy, env, &mut session, &mut log).await;

    // Grade whatever state the episode reached; an aborted episode scores zero.
    let (reward, success, detail) =
        if termination == Termination::Error { (0.0, false, String::new()) } else { grade(env, &mut log).await };
    let tools = session.tools().to_vec();
    let (turns, usage) = session.finish();
    let termination = if log.error.is_some() && termination != Termination::ContextLimit { Termination::Error } else { termination };
    let (error_class, error_message) = match log.error {
        Some((c, m)) => (Some(c), Some(m)),
        None => (None, None),
    };
    Episode {
        task_type,
        turns,
        usage,
        termination,
        error_class,
        error_message,
        reward,
        success,
        detail,
        policy_ms: log.policy_ms,
        env_ms: log.env_ms,
        tools,
        env_transient: log.env_transient,
    }
}

/// What an episode met on its way: time spent in the policy and in the environment, and
/// the error that ended it.
#[derive(Default)]
struct EpisodeLog {
    env_ms: u64,
    policy_ms: u64,
    error: Option<(ErrorClass, String)>,
    /// The error was a transient environment error (its backend was lost).
    env_transient: bool,
}

/// decide → mediate → act until the environment ends the episode, a budget runs out or an
/// error occurs (recorded in `log`).
async fn act_until_done(policy: &dyn Policy, env: &mut dyn Environment, session: &mut Session, log: &mut EpisodeLog) -> Termination {
    loop {
        let call = match session.next_step() {
            Next::Stop(t) => return t,
            Next::Act(call) => call,
            Next::Ask(req) => match ask(policy, session, &req, log).await {
                Reply::Execute(call) => call,
                Reply::Nothing => continue,
                Reply::End(t) => return t,
            },
        };
        let t = Instant::now();
        let obs = env.step(&call).await;
        log.env_ms += t.elapsed().as_millis() as u64;
        match obs {
            Ok(obs) => {
                if let Some(t) = session.after_tool(&call, obs) {
                    return t;
                }
            }
            Err(e) => {
                log.env_transient = infra::Transient::is_transient(&e);
                log.error = Some((e.class(), format!("step `{}`: {e}", call.name)));
                return Termination::Error;
            }
        }
    }
}

/// What a policy reply comes to once the harness has seen it.
enum Reply {
    /// Execute this call.
    Execute(crate::env::ToolCall),
    /// No action this turn (no call, or one a hook blocked).
    Nothing,
    /// The episode ends.
    End(Termination),
}

/// Asks the policy and passes its reply through the harness (before_action hooks).
async fn ask(policy: &dyn Policy, session: &mut Session, req: &PolicyRequest, log: &mut EpisodeLog) -> Reply {
    let t = Instant::now();
    let reply = policy.chat(&req.messages, &req.tools, &req.sampling).await;
    log.policy_ms += t.elapsed().as_millis() as u64;
    match reply {
        Ok(out) => match session.record_reply(out) {
            Some(call) => match session.before_action(call) {
                Verdict::Execute(call) => Reply::Execute(call),
                Verdict::Blocked => Reply::Nothing,
                Verdict::Stop(t) => Reply::End(t),
            },
            None => Reply::Nothing,
        },
        Err(e) => {
            let t = match e {
                PolicyError::ContextLength { .. } => Termination::ContextLimit,
                _ => Termination::Error,
            };
            log.error = Some((e.class(), e.to_string()));
            Reply::End(t)
        }
    }
}

/// The environment's grade of the state the episode reached: (reward, success, detail);
/// zero when grading fails (the error is recorded in `log`).
async fn grade(env: &mut dyn Environment, log: &mut EpisodeLog) -> (f64, bool, String) {
    let t = Instant::now();
    let graded = env.evaluate().await;
    log.env_ms += t.elapsed().as_millis() as u64;
    match graded {
        Ok(ev) => (ev.reward, ev.success, ev.detail),
        Err(e) => {
            log.env_transient = infra::Transient::is_transient(&e);
            log.error = Some((e.class(), format!("evaluate: {e}")));
            (0.0, false, String::new())
        }
    }
}

/// Counts of a batch of rows, by task type, termination and error class.
pub fn summarize(rows: &[Trajectory]) -> RolloutSummary {
    let mut s = RolloutSummary::default();
    for r in rows {
        s.episodes += 1;
        s.successes += u32::from(r.success);
        let e = s.by_task_type.entry(r.task_type.clone()).or_default();
        e.0 += 1;
        e.1 += u32::from(r.success);
        *s.terminations.entry(r.termination.as_str().to_string()).or_default() += 1;
        if let Some(c) = r.error_class {
            *s.errors.entry(c.as_str().to_string()).or_default() += 1;
        }
        s.turns += r.turns.len() as u64;
        s.model_calls += u64::from(r.model_calls);
        s.env_actions += u64::from(r.env_actions);
        s.prompt_tokens += r.prompt_tokens;
        s.completion_tokens += r.completion_tokens;
        s.harness_tokens += r.harness_tokens;
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env::EnvError;
    use crate::testing::{say, spec, Counting, Factory, Scripted};
    use async_trait::async_trait;
    use infra::store::LocalStore;
    use schemas::{Role, TurnSource};
    use serde_json::json;

    /// The weak model's typical failure: the right SQL, then the answer in prose.
    fn prose_policy() -> Scripted {
        Scripted::new(vec![
            say("", Some(("execute_sql", json!({"query": "SELECT count(*) FROM people WHERE age > 30"})))),
            say("The output is 2.", None),
            say("", Some(("commit_final_answer", json!({"answers": ["2"]})))),
        ])
    }

    fn input(harness: HarnessSpec, tasks: &[&str], attempts: u32) -> RolloutInput {
        RolloutInput {
            run_id: "r1".into(),
            step: 0,
            kind: RolloutKind::Base,
            split: Split::Train,
            task_ids: tasks.iter().map(|t| t.to_string()).collect(),
            harness,
            attempts,
            seed: 42,
            budgets: Budgets::default(),
            sampling: SamplingParams::default(),
            concurrency: 2,
        }
    }

    #[tokio::test]
    async fn an_episode_records_policy_env_and_harness_turns() {
        let policy = prose_policy();
        let mut env = Counting { rounds: 0, max_rounds: 5, answer: None, fail_step: false };
        let s = spec(json!({"id": "s1", "hooks": [{"id": "commit", "event": "after_tool",
            "condition": {"eq": ["action.tool", "execute_sql"]}, "action": "warn",
            "message": "If this answers the question, call commit_final_answer now."}]}));
        let ep = run_episode(&policy, &mut env, &s, Budgets::default(), &SamplingParams::default(), "t1", 7).await;
        assert_eq!((ep.termination, ep.success, ep.reward), (Termination::Committed, true, 1.0));
        assert_eq!(ep.error_class, None);
        let shape: Vec<(Role, TurnSource)> = ep.turns.iter().map(|t| (t.role, t.source)).collect();
        assert_eq!(
            shape,
            vec![
                (Role::System, TurnSource::System),
                (Role::User, TurnSource::Env),
                (Role::Assistant, TurnSource::Policy),
                (Role::Tool, TurnSource::Env),
                (Role::User, TurnSource::Harness),     // the after_tool hook
                (Role::Assistant, TurnSource::Policy), // prose
                (Role::User, TurnSource::Harness),     // the runtime's no-tool reminder
                (Role::Assistant, TurnSource::Policy),
                (Role::Tool, TurnSource::Env),
            ]
        );
        assert_eq!((ep.usage.model_calls, ep.usage.env_actions), (3, 2));
        assert_eq!((ep.usage.prompt_tokens, ep.usage.completion_tokens), (120, 6));
        for t in &ep.turns {
            let trained = t.loss_mask.iter().any(|m| *m);
            assert_eq!(trained, t.source == TurnSource::Policy, "turn {}", t.index);
        }
        // The policy saw the hook's hint right after the tool result.
        let seen = policy.seen.lock().unwrap();
        let second = &seen[1];
        assert_eq!(second.last().unwrap().content, "If this answers the question, call commit_final_answer now.");
    }

    #[test]
    fn job_and_episode_futures_can_be_spawned() {
        fn assert_send<T: Send>(_: &T) {}
        let policy = prose_policy();
        let factory = Factory { fail_step: false };
        let dir = tempfile::tempdir().unwrap();
        let store = LocalStore::new(dir.path()).unwrap();
        let ctx = RolloutContext { store: &store, policy: &policy, envs: &factory, job_id: "j", delivery_attempt: 0 };
        let inp = input(HarnessSpec::h0(), &["t1"], 1);
        assert_send(&run(&ctx, &inp));
        let mut env = Counting { rounds: 0, max_rounds: 5, answer: None, fail_step: false };
        let spec = HarnessSpec::h0();
        assert_send(&run_episode(&policy, &mut env, &spec, Budgets::default(), &SamplingParams::default(), "t1", 1));
    }

    #[tokio::test]
    async fn budget_exhaustion_is_a_termination_not_an_error() {
        let policy = Scripted::new(vec![say("thinking", None)]);
        let mut env = Counting { rounds: 0, max_rounds: 5, answer: None, fail_step: false };
        let budgets = Budgets { max_model_calls: 3, ..Default::default() };
        let ep = run_episode(&policy, &mut env, &HarnessSpec::h0(), budgets, &SamplingParams::default(), "t1", 1).await;
        assert_eq!((ep.termination, ep.error_class, ep.success), (Termination::BudgetExhausted, None, false));
        assert_eq!(ep.usage.model_calls, 3);
    }

    #[tokio::test]
    async fn round_limit_without_commit_is_graded_and_fails() {
        let policy = Scripted::new(vec![say("", Some(("execute_sql", json!({"query": "SELEC"}))))]);
        let mut env = Counting { rounds: 0, max_rounds: 2, answer: None, fail_step: false };
        let ep = run_episode(&policy, &mut env, &HarnessSpec::h0(), Budgets::default(), &SamplingParams::default(), "t1", 1).await;
        assert_eq!((ep.termination, ep.success), (Termination::RoundLimit, false));
        assert_eq!(ep.usage.env_actions, 2);
        assert!(ep.detail.contains("None"));
    }

    #[tokio::test]
    async fn policy_env_and_reset_errors_are_recorded_not_raised() {
        let timeouts = Scripted::new(vec![Err(|| PolicyError::Timeout { seconds: 30.0 })]);
        let mut env = Counting { rounds: 0, max_rounds: 5, answer: None, fail_step: false };
        let ep = run_episode(&timeouts, &mut env, &HarnessSpec::h0(), Budgets::default(), &SamplingParams::default(), "t1", 1).await;
        assert_eq!((ep.termination, ep.error_class), (Termination::Error, Some(ErrorClass::Timeout)));
        assert!(ep.error_message.unwrap().contains("timed out"));
        assert_eq!(ep.turns.len(), 2, "the context built before the failure is kept");

        let too_long = Scripted::new(vec![Err(|| PolicyError::ContextLength { tokens: 9000, limit: 8192 })]);
        let ep = run_episode(&too_long, &mut env, &HarnessSpec::h0(), Budgets::default(), &SamplingParams::default(), "t1", 1).await;
        assert_eq!((ep.termination, ep.error_class), (Termination::ContextLimit, Some(ErrorClass::ContextLength)));

        let policy = prose_policy();
        let mut broken = Counting { rounds: 0, max_rounds: 5, answer: None, fail_step: true };
        let ep = run_episode(&policy, &mut broken, &HarnessSpec::h0(), Budgets::default(), &SamplingParams::default(), "t1", 1).await;
        assert_eq!((ep.termination, ep.error_class), (Termination::Error, Some(ErrorClass::Infra)));

        let ep = run_episode(&policy, &mut env, &HarnessSpec::h0(), Budgets::default(), &SamplingParams::default(), "missing", 1).await;
        assert_eq!((ep.termination, ep.error_class), (Termination::Error, Some(ErrorClass::Env)));
        assert!(ep.error_message.unwrap().contains("unknown task `missing`"));
    }

    #[tokio::test]
    async fn the_job_writes_rows_then_the_marker_and_is_idempotent() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalStore::new(dir.path()).unwrap();
        let policy = prose_policy();
        let factory = Factory { fail_step: false };
        let ctx = RolloutContext { store: &store, policy: &policy, envs: &factory, job_id: "job1", delivery_attempt: 0 };
        let s = spec(json!({"id": "s1", "parent": "h0"}));
        let out = run(&ctx, &input(s.clone(), &["t1", "missing"], 2)).await.unwrap();
        assert!(!out.already_done);
        assert_eq!((out.summary.episodes, out.summary.successes), (4, 2));
        assert_eq!(out.summary.by_task_type["counting"], (2, 2));
        assert_eq!(out.summary.errors["env"], 2);

        let key = keys::trajectory_part("r1", 0, RolloutKind::Base, "job1");
        assert_eq!(out.outputs[0].key, key);
        let rows: Vec<Trajectory> = infra::table::read_records(&store, &key).await.unwrap();
        assert_eq!(rows.len(), 4);
        assert_eq!(
            rows.iter().map(|r| (r.task_id.as_str(), r.attempt, r.seed)).collect::<Vec<_>>(),
            vec![("t1", 0, 42), ("t1", 1, 43), ("missing", 0, 42), ("missing", 1, 43)]
        );
        assert_eq!(rows[0].group_id, rows[1].group_id);
        assert_ne!(rows[0].group_id, rows[2].group_id);
        assert_ne!(rows[0].trajectory_id, rows[1].trajectory_id);
        assert_eq!((rows[0].harness_id.as_str(), rows[0].harness_version.clone()), ("s1", s.version_hash()));
        assert_eq!(rows[0].policy_checkpoint, "scripted");
        assert!(rows[0].turns.iter().any(|t| t.logprobs == vec![-0.5, -0.25]));
        assert_eq!(rows[2].termination, Termination::Error);

        let marker: DoneMarker = schemas::decode_document("m", &store.get(&out.marker_key).await.unwrap()).unwrap();
        assert_eq!(marker.outputs, out.outputs);
        assert_eq!(marker.result["successes"], 2);

        // Redelivery: nothing runs, the summary comes from the marker.
        let again = run(&ctx, &input(s, &["t1", "missing"], 2)).await.unwrap();
        assert!(again.already_done);
        assert_eq!(again.summary, out.summary);
        assert_eq!(policy.seen.lock().unwrap().len(), 6, "3 calls for each successful episode, none on redelivery");
    }

    /// An environment whose backend is lost on every step, retried by the job twice.
    struct LostBackend;

    #[async_trait]
    impl EnvironmentFactory for LostBackend {
        async fn create(&self) -> Result<Box<dyn Environment>, EnvError> {
            Ok(Box::new(Counting { rounds: 0, max_rounds: 5, answer: None, fail_step: true }))
        }
        fn job_retries(&self) -> u32 {
            2
        }
    }

    #[tokio::test]
    async fn a_lost_backend_fails_the_delivery_until_the_retries_are_used_then_is_recorded() {
        use infra::Transient;
        let dir = tempfile::tempdir().unwrap();
        let store = LocalStore::new(dir.path()).unwrap();
        let policy = prose_policy();
        for delivery in 0..2 {
            let ctx = RolloutContext { store: &store, policy: &policy, envs: &LostBackend, job_id: "job3", delivery_attempt: delivery };
            let err = run(&ctx, &input(HarnessSpec::h0(), &["t1"], 2)).await.unwrap_err();
            assert!(err.is_transient(), "{err}");
            assert!(err.to_string().contains("2 of 2 episodes lost their environment backend"), "{err}");
            assert!(store.list("runs/").await.unwrap().is_empty(), "a retried delivery writes nothing");
        }
        let ctx = RolloutContext { store: &store, policy: &policy, envs: &LostBackend, job_id: "job3", delivery_attempt: 2 };
        let out = run(&ctx, &input(HarnessSpec::h0(), &["t1"], 2)).await.unwrap();
        assert_eq!(out.summary.errors["infra"], 2);
        let rows: Vec<Trajectory> = infra::table::read_records(&store, &out.outputs[0].key).await.unwrap();
        assert_eq!(rows.len(), 2);
        assert!(rows
            .iter()
            .all(|r| r.termination == Termination::Error && r.error_message.as_deref().unwrap().contains("connection lost")));
    }

    #[tokio::test]
    async fn invalid_input_fails_the_job_with_the_field_named() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalStore::new(dir.path()).unwrap();
        let policy = prose_policy();
        let factory = Factory { fail_step: false };
        let ctx = RolloutContext { store: &store, policy: &policy, envs: &factory, job_id: "job2", delivery_attempt: 0 };
        let err = run(&ctx, &input(HarnessSpec::h0(), &[], 1)).await.unwrap_err();
        assert!(err.to_string().contains("`task_ids` is empty"), "{err}");
        let err = run(&ctx, &input(HarnessSpec::h0(), &["t1"], 0)).await.unwrap_err();
        assert!(err.to_string().contains("`attempts`"), "{err}");
        let mut bad = HarnessSpec::h0();
        bad.hooks.push(
            serde_json::from_value(json!({"event": "after_tool", "condition": "no_such", "action": "warn", "message": "m"})).unwrap(),
        );
        let err = run(&ctx, &input(bad, &["t1"], 1)).await.unwrap_err();
        assert!(err.to_string().contains("hooks[0].condition: unknown condition `no_such`"), "{err}");
        assert!(store.list("runs/").await.unwrap().is_empty(), "nothing is written for invalid input");
    }
}
