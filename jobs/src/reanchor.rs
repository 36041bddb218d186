//! The re-anchoring (calibration) job (Harness-S §3.4 Eq. 11, Algorithm 1 lines 1, 3, 14;
//! Appendix C "Profile refresh", Appendix D–E paired protocol).
//!
//! With the policy frozen at one checkpoint, every harness of the pool and H0 run on the
//! same validation tasks with the same seeds, attempts and limits (paired execution), one
//! [`crate::rollout`] job per harness (kind = calibration, split = validation). From the
//! stored trajectories the job computes per-harness validation statistics and Harness
//! Behavior Profiles of each sibling against H0 — always the statistical profile, and the
//! LLM profile too when a profiler endpoint is given — and stores, under
//! `runs/<run>/profiles/calib=<id>/`:
//! - `part-<job>.parquet`: the [`ProfileEntry`] rows (both profilers, told apart by `source`);
//! - `calibration.json`: the [`CalibrationManifest`] (tasks, statistics, harness
//!   descriptions, the trajectory parts, profiler problems);
//!
//! then, last, the done-marker `runs/<run>/jobs/<job>.done.json`. Redelivery of a done job
//! does nothing; a half-done one reruns only the harnesses whose rollout job has no marker
//! yet (each rollout job is itself idempotent) and overwrites the same keys.
//!
//! The router reads a calibration back with [`load_evidence`]; the routing rows name the
//! calibration they used (`RoutingDecision::calibration_id`).

use std::collections::{BTreeMap, BTreeSet};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::env::EnvironmentFactory;
use crate::harness::Budgets;
use crate::policy::{Policy, SamplingParams};
use crate::profile::llm::{LlmProfiler, LlmProfilerConfig};
use crate::profile::stats::{statistical_profile, ProfileMeta, StatsConfig};
use crate::profile::{describe_harness, pair_up, validation_stats, HarnessStats, TaskInfo};
use crate::protocol::{self, JobRef, UnreadableMarker, Work};
use crate::rollout::{self, RolloutContext, RolloutError, RolloutInput};
use crate::router::Evidence;
use infra::store::{ObjectStore, StoreError};
use infra::table::TableError;
use schemas::{
    decode_document, encode_document, job_id, keys, now_unix_ms, Document, DoneMarker, HarnessSpec, JobIdParts, JobKind, OutputEntry,
    ProfileEntry, RolloutKind, Split, Trajectory, H0_ID,
};

/// Input of a re-anchoring job (the payload of its envelope).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReanchorInput {
    pub run_id: String,
    /// Training update index of the frozen checkpoint.
    pub step: u32,
    /// Names this calibration in object keys and on routing rows (e.g. `step-0010`).
    pub calibration_id: String,
    /// Every harness to calibrate; must include the base harness `h0`.
    pub pool: Vec<HarnessSpec>,
    /// The validation tasks (ids, types, descriptions, features).
    pub tasks: Vec<TaskInfo>,
    /// Rollouts per (harness, task); attempt `i` uses seed `seed + i` under every harness.
    #[serde(default = "one")]
    pub attempts: u32,
    pub seed: u64,
    #[serde(default)]
    pub budgets: Budgets,
    #[serde(default)]
    pub sampling: SamplingParams,
    #[serde(default = "one_usize")]
    pub concurrency: usize,
}

fn one() -> u32 {
    1
}
fn one_usize() -> usize {
    1
}

/// The calibration id used for the checkpoint of update `step` (a convention, not a rule).
pub fn calibration_id_for_step(step: u32) -> String {
    format!("step-{step:04}")
}

/// `runs/<run>/profiles/calib=<id>/calibration.json`
pub fn manifest_key(run_id: &str, calibration_id: &str) -> String {
    schemas::keys::calibration(run_id, calibration_id)
}

/// What one calibration produced; the router's evidence besides the profile rows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CalibrationManifest {
    pub schema_version: u32,
    pub run_id: String,
    pub calibration_id: String,
    pub step: u32,
    pub policy_checkpoint: String,
    pub job_id: String,
    pub tasks: Vec<TaskInfo>,
    /// Validation statistics per harness id.
    pub stats: BTreeMap<String, HarnessStats>,
    /// Short description of each harness.
    pub descriptions: BTreeMap<String, String>,
    pub trajectory_parts: Vec<String>,
    pub profile_part: OutputEntry,
    /// Profilers that ran: `statistical`, `llm:<model>`.
    pub profilers: Vec<String>,
    /// Entries per harness id.
    pub profile_entries: BTreeMap<String, u32>,
    /// LLM profiler batches that gave nothing usable, `<harness>: <reason>`.
    pub profiler_problems: Vec<String>,
    pub finished_at_ms: i64,
}

impl Document for CalibrationManifest {
    const NAME: &'static str = "calibration manifest";
    const VERSION: u32 = 1;
}

/// What the job runs against.
pub struct ReanchorContext<'a> {
    pub store: &'a dyn ObjectStore,
    /// The frozen policy checkpoint.
    pub policy: &'a dyn Policy,
    pub envs: &'a dyn EnvironmentFactory,
    /// The LLM profiler's endpoint; `None` runs the statistical profiler only.
    pub profiler: Option<&'a dyn Policy>,
    /// Batch size, call limit and sampling of the LLM profiler.
    pub profiler_config: LlmProfilerConfig,
    pub job_id: &'a str,
    pub delivery_attempt: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum ReanchorError {
    #[error("reanchor input: `{field}` {reason}")]
    InvalidInput { field: &'static str, reason: String },
    #[error("calibration `{calibration}`, harness `{harness}`: {source}")]
    Rollout { calibration: String, harness: String, source: RolloutError },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Table(#[from] TableError),
    #[error("{key}: {detail}")]
    Manifest { key: String, detail: String },
    #[error(transparent)]
    Marker(#[from] UnreadableMarker),
}

impl infra::Transient for ReanchorError {
    /// Whether a later delivery of the same job may succeed.
    fn is_transient(&self) -> bool {
        match self {
            ReanchorError::Rollout { source, .. } => source.is_transient(),
            ReanchorError::Store(e) => e.is_transient(),
            ReanchorError::Table(e) => e.is_transient(),
            _ => false,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ReanchorOutput {
    pub manifest: CalibrationManifest,
    /// The done-marker existed: nothing was run.
    pub already_done: bool,
}

/// Runs the job: paired rollouts → statistics → profiles → manifest → done-marker (last),
/// within the job protocol ([`crate::protocol::once`]).
pub async fn run(ctx: &ReanchorContext<'_>, input: &ReanchorInput) -> Result<ReanchorOutput, ReanchorError> {
    check_input(input)?;
    let job =
        JobRef { store: ctx.store, run_id: &input.run_id, job_id: ctx.job_id, kind: JobKind::Reanchor, attempt: ctx.delivery_attempt };
    let done = async |_: DoneMarker| read_manifest(ctx.store, &manifest_key(&input.run_id, &input.calibration_id)).await;
    let (manifest, already_done) = protocol::once(job, done, async || calibrate(ctx, input).await).await?;
    Ok(ReanchorOutput { manifest, already_done })
}

/// The job's work: steps 1 to 4 up to the manifest; the protocol commits the marker.
async fn calibrate(ctx: &ReanchorContext<'_>, input: &ReanchorInput) -> Result<Work<CalibrationManifest>, ReanchorError> {
    // 1. Paired execution: same tasks, seeds, attempts and limits under every harness.
    let (rows, parts) = paired_rollouts(ctx, input).await?;

    // 2. Validation statistics per harness.
    let all: Vec<Trajectory> = rows.values().flatten().cloned().collect();
    let stats = validation_stats(&all);
    let checkpoint = all.first().map(|r| r.policy_checkpoint.clone()).unwrap_or_else(|| ctx.policy.checkpoint());

    // 3. Profiles of each sibling against H0 (Eq. 11).
    let mut profilers = vec![crate::profile::stats::SOURCE.to_string()];
    // Metered: the profiler's tokens are this job's cost (Table 9), in its marker's result.
    let metered = ctx.profiler.map(crate::policy::metered::Metered::new);
    let llm = metered.as_ref().map(|p| LlmProfiler::new(p, ctx.profiler_config.clone()));
    if let Some(l) = &llm {
        profilers.push(format!("llm:{}", l.label));
    }
    let (entries, problems) = profile_siblings(input, &rows, &checkpoint, llm.as_ref()).await;
    let profile_part =
        infra::table::write_records(ctx.store, &keys::profile_part(&input.run_id, &input.calibration_id, ctx.job_id), &entries).await?;

    // 4. The manifest; the done-marker follows it.
    let manifest = CalibrationManifest {
        schema_version: CalibrationManifest::VERSION,
        run_id: input.run_id.clone(),
        calibration_id: input.calibration_id.clone(),
        step: input.step,
        policy_checkpoint: checkpoint,
        job_id: ctx.job_id.to_string(),
        tasks: input.tasks.clone(),
        stats,
        descriptions: input.pool.iter().map(|s| (s.id.clone(), describe_harness(s))).collect(),
        trajectory_parts: parts,
        profile_part: profile_part.clone(),
        profilers,
        profile_entries: entries_per_harness(input, &entries),
        profiler_problems: problems,
        finished_at_ms: now_unix_ms(),
    };
    let profiler_usage = metered.as_ref().map(|m| m.usage()).unwrap_or_default();
    let (outputs, result) = write_manifest(ctx, input, &manifest, profile_part, profiler_usage).await?;
    Ok(Work { value: manifest, outputs, result })
}

/// Step 1: one rollout job per harness of the pool, the same tasks, seeds, attempts and
/// limits under each; their rows as stored, by harness id, and the keys of their parts.
async fn paired_rollouts(
    ctx: &ReanchorContext<'_>,
    input: &ReanchorInput,
) -> Result<(BTreeMap<String, Vec<Trajectory>>, Vec<String>), ReanchorError> {
    let task_ids: Vec<String> = input.tasks.iter().map(|t| t.task_id.clone()).collect();
    let mut rows: BTreeMap<String, Vec<Trajectory>> = BTreeMap::new();
    let mut parts = Vec::new();
    for (i, spec) in input.pool.iter().enumerate() {
        tracing::info!(calibration = %input.calibration_id, harness = %spec.id, n = i + 1, of = input.pool.len(), "calibrating harness");
        let sub_job = job_id(&JobIdParts {
            run_id: &input.run_id,
            stage: "calibration",
            step: input.step,
            task_id: &input.calibration_id,
            harness_id: &spec.id,
            attempt_index: 0,
            seed: input.seed,
        });
        let rollout_input = RolloutInput {
            run_id: input.run_id.clone(),
            step: input.step,
            kind: RolloutKind::Calibration,
            split: Split::Validation,
            task_ids: task_ids.clone(),
            harness: spec.clone(),
            attempts: input.attempts,
            seed: input.seed,
            budgets: input.budgets,
            sampling: input.sampling.clone(),
            concurrency: input.concurrency,
        };
        let rctx = RolloutContext {
            store: ctx.store,
            policy: ctx.policy,
            envs: ctx.envs,
            job_id: &sub_job,
            delivery_attempt: ctx.delivery_attempt,
        };
        rollout::run(&rctx, &rollout_input).await.map_err(|source| ReanchorError::Rollout {
            calibration: input.calibration_id.clone(),
            harness: spec.id.clone(),
            source,
        })?;
        // Read back what is stored, so that a redelivery sees exactly the first delivery's rows.
        let key = keys::trajectory_part(&input.run_id, input.step, RolloutKind::Calibration, &sub_job);
        rows.insert(spec.id.clone(), infra::table::read_records(ctx.store, &key).await?);
        parts.push(key);
    }
    Ok((rows, parts))
}

/// Step 3: the statistical profile of every sibling against H0, and its LLM profile when
/// a profiler is given; the entries, and the LLM profiler's problems (`<harness>: <reason>`).
async fn profile_siblings(
    input: &ReanchorInput,
    rows: &BTreeMap<String, Vec<Trajectory>>,
    checkpoint: &str,
    llm: Option<&LlmProfiler<'_>>,
) -> (Vec<ProfileEntry>, Vec<String>) {
    let base = &rows[H0_ID];
    let mut entries: Vec<ProfileEntry> = Vec::new();
    let mut problems = Vec::new();
    for spec in input.pool.iter().filter(|s| s.id != H0_ID) {
        let pairs = pair_up(&input.tasks, &rows[&spec.id], base);
        let meta = ProfileMeta {
            run_id: input.run_id.clone(),
            calibration_id: input.calibration_id.clone(),
            policy_checkpoint: checkpoint.to_string(),
            harness_id: spec.id.clone(),
        };
        entries.extend(statistical_profile(&meta, &pairs, &StatsConfig::default()));
        if let Some(l) = llm {
            let out = l.profile(&meta, &describe_harness(spec), &pairs, input.seed).await;
            problems.extend(out.problems.into_iter().map(|p| format!("{}: {p}", spec.id)));
            entries.extend(out.entries);
        }
    }
    (entries, problems)
}

/// Profile entries per sibling (0 for a sibling without any).
fn entries_per_harness(input: &ReanchorInput, entries: &[ProfileEntry]) -> BTreeMap<String, u32> {
    let mut per_harness: BTreeMap<String, u32> = input.pool.iter().filter(|s| s.id != H0_ID).map(|s| (s.id.clone(), 0)).collect();
    for e in entries {
        *per_harness.entry(e.harness_id.clone()).or_default() += 1;
    }
    per_harness
}

/// Step 4: the manifest; the outputs the done-marker lists and its result (the validation
/// success per harness and the profiler's spend).
async fn write_manifest(
    ctx: &ReanchorContext<'_>,
    input: &ReanchorInput,
    manifest: &CalibrationManifest,
    profile_part: OutputEntry,
    profiler_usage: schemas::LlmUsage,
) -> Result<(Vec<OutputEntry>, serde_json::Value), ReanchorError> {
    let manifest_key = manifest_key(&input.run_id, &input.calibration_id);
    let bytes = encode_document(manifest);
    let manifest_entry = OutputEntry::of(manifest_key.clone(), &bytes);
    ctx.store.put(&manifest_key, Bytes::from(bytes)).await?;
    let summary: BTreeMap<&str, f64> = manifest.stats.iter().map(|(h, s)| (h.as_str(), s.success_rate())).collect();
    let result = serde_json::json!({
        "calibration_id": input.calibration_id,
        "validation_success": summary,
        "llm_usage": { "profiler": profiler_usage },
    });
    let entries: u32 = manifest.profile_entries.values().sum();
    tracing::info!(calibration = %input.calibration_id, entries, ?summary, "re-anchoring done");
    Ok((vec![profile_part, manifest_entry], result))
}

fn check_input(input: &ReanchorInput) -> Result<(), ReanchorError> {
    let bad = |field, reason: String| Err(ReanchorError::InvalidInput { field, reason });
    if input.run_id.is_empty() {
        return bad("run_id", "is empty".into());
    }
    let id = &input.calibration_id;
    if id.is_empty() || !id.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')) {
        return bad("calibration_id", format!("`{id}` must be non-empty letters, digits, `-`, `_` or `.` (it names an object folder)"));
    }
    let mut ids = BTreeSet::new();
    for s in &input.pool {
        if !ids.insert(s.id.as_str()) {
            return bad("pool", format!("harness `{}` appears twice", s.id));
        }
    }
    if !ids.contains(H0_ID) {
        return bad("pool", format!("must include the base harness `{H0_ID}` (profiles compare every sibling with it)"));
    }
    if input.tasks.is_empty() {
        return bad("tasks", "is empty: give the validation tasks to calibrate on".into());
    }
    let mut tids = BTreeSet::new();
    for t in &input.tasks {
        if !tids.insert(t.task_id.as_str()) {
            return bad("tasks", format!("task `{}` appears twice", t.task_id));
        }
    }
    if input.attempts == 0 {
        return bad("attempts", "must be at least 1".into());
    }
    Ok(())
}

async fn read_manifest(store: &dyn ObjectStore, key: &str) -> Result<CalibrationManifest, ReanchorError> {
    let bytes = store.get(key).await.map_err(|e| match e {
        StoreError::NotFound { .. } => ReanchorError::Manifest {
            key: key.to_string(),
            detail: "no such calibration: run the re-anchoring job for it first (or check the calibration id)".into(),
        },
        other => ReanchorError::Store(other),
    })?;
    decode_document(&store.object_url(key), &bytes).map_err(|e| ReanchorError::Manifest { key: key.to_string(), detail: e.to_string() })
}

/// The router's evidence from one stored calibration: its manifest and profile rows.
pub async fn load_evidence(store: &dyn ObjectStore, run_id: &str, calibration_id: &str) -> Result<Evidence, ReanchorError> {
    let manifest = read_manifest(store, &manifest_key(run_id, calibration_id)).await?;
    // The profile part the manifest lists, never a stray part beside it.
    let profiles: Vec<ProfileEntry> = infra::table::read_records(store, &manifest.profile_part.key).await?;
    Ok(Evidence::new(Some(manifest.calibration_id), manifest.tasks, manifest.stats, profiles, manifest.descriptions))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env::{EnvError, Environment, EpisodeStart, Evaluation, Observation, ToolCall, ToolSpec};
    use crate::policy::{FinishReason, Message, PolicyError, PolicyOutput};
    use async_trait::async_trait;
    use infra::store::LocalStore;
    use schemas::{Polarity, Role};
    use serde_json::json;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// A policy whose behavior depends on its checkpoint and on the harness hint it sees:
    /// checkpoint "weak" answers in prose unless a harness message tells it to commit;
    /// checkpoint "strong" always commits.
    struct Checkpointed {
        name: &'static str,
        calls: AtomicU32,
    }

    #[async_trait]
    impl Policy for Checkpointed {
        fn checkpoint(&self) -> String {
            self.name.into()
        }
        async fn chat(&self, m: &[Message], _t: &[ToolSpec], _s: &SamplingParams) -> Result<PolicyOutput, PolicyError> {
            self.calls.fetch_add(1, Ordering::Relaxed);
            let hinted = m.iter().any(|x| x.content.contains("commit_final_answer now"));
            let queried = m.iter().any(|x| x.role == Role::Tool);
            let call = if !queried {
                Some(ToolCall { name: "execute_sql".into(), args: json!({"query": "SELECT count(*) FROM t"}) })
            } else if self.name == "strong" || hinted {
                Some(ToolCall { name: "commit_final_answer".into(), args: json!({"answers": ["2"]}) })
            } else {
                None
            };
            Ok(PolicyOutput {
                prompt_hash: None,
                text: if call.is_none() { "The output is 2.".into() } else { String::new() },
                tool_calls: call.into_iter().collect(),
                token_ids: vec![],
                logprobs: vec![],
                prompt_tokens: 10,
                completion_tokens: 2,
                finish_reason: FinishReason::Stop,
            })
        }
    }

    struct Counting {
        answer: Option<String>,
        rounds: u32,
    }

    #[async_trait]
    impl Environment for Counting {
        fn name(&self) -> &str {
            "counting"
        }
        async fn reset(&mut self, task_id: &str, _seed: u64) -> Result<EpisodeStart, EnvError> {
            self.answer = None;
            self.rounds = 0;
            Ok(EpisodeStart {
                observation: Observation { text: format!("Task {task_id}: how many rows?"), ..Default::default() },
                tools: crate::env::dbbench::tools(),
                max_rounds: 3,
                task_type: "counting".into(),
                features: Default::default(),
            })
        }
        async fn step(&mut self, call: &ToolCall) -> Result<Observation, EnvError> {
            self.rounds += 1;
            Ok(if call.name == "commit_final_answer" {
                self.answer = call.args["answers"][0].as_str().map(str::to_string);
                Observation { text: "ok".into(), done: true, committed: true, ..Default::default() }
            } else {
                Observation { text: "[(2,)]".into(), done: self.rounds >= 3, ..Default::default() }
            })
        }
        async fn evaluate(&mut self) -> Result<Evaluation, EnvError> {
            let ok = self.answer.as_deref() == Some("2");
            Ok(Evaluation { reward: f64::from(u8::from(ok)), success: ok, detail: String::new() })
        }
        async fn close(&mut self) -> Result<(), EnvError> {
            Ok(())
        }
    }

    struct Factory;
    #[async_trait]
    impl EnvironmentFactory for Factory {
        async fn create(&self) -> Result<Box<dyn Environment>, EnvError> {
            Ok(Box::new(Counting { answer: None, rounds: 0 }))
        }
    }

    fn pool() -> Vec<HarnessSpec> {
        let hint: HarnessSpec = crate::harness::spec_from_value(
            "s1",
            &json!({"id": "s1", "parent": "h0", "direction": "remind the agent to commit after a result",
                "hooks": [{"event": "after_tool", "condition": {"eq": ["action.tool", "execute_sql"]}, "action": "warn",
                "message": "If this answers the question, call commit_final_answer now."}]}),
            &Default::default(),
        )
        .unwrap();
        vec![HarnessSpec::h0(), hint]
    }

    /// A first delivery of job `job_id` with `policy` over [`Factory`]'s environments, no
    /// LLM profiler.
    fn context<'a>(store: &'a LocalStore, policy: &'a dyn Policy, job_id: &'a str) -> ReanchorContext<'a> {
        ReanchorContext {
            store,
            policy,
            envs: &Factory,
            profiler: None,
            profiler_config: LlmProfilerConfig::default(),
            job_id,
            delivery_attempt: 0,
        }
    }

    fn input(calibration: &str, step: u32) -> ReanchorInput {
        ReanchorInput {
            run_id: "r1".into(),
            step,
            calibration_id: calibration.into(),
            pool: pool(),
            tasks: (0..3).map(|i| TaskInfo::new(format!("v{i}"), "counting", format!("How many rows in table {i}?"))).collect(),
            attempts: 1,
            seed: 5,
            budgets: Budgets::default(),
            sampling: SamplingParams::default(),
            concurrency: 2,
        }
    }

    #[tokio::test]
    async fn calibrations_change_with_the_checkpoint_and_are_idempotent() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalStore::new(dir.path()).unwrap();
        let weak = Checkpointed { name: "weak", calls: AtomicU32::new(0) };
        let ctx = context(&store, &weak, "cal-a");
        let first = run(&ctx, &input("step-0000", 0)).await.unwrap();
        assert!(!first.already_done);
        let m = &first.manifest;
        assert_eq!((m.stats["h0"].successes, m.stats["s1"].successes), (0, 3), "the hint rescues the weak policy");
        assert_eq!(m.policy_checkpoint, "weak");
        assert_eq!(m.trajectory_parts.len(), 2);
        let rows: Vec<Trajectory> = infra::table::read_records(&store, &m.trajectory_parts[0]).await.unwrap();
        assert!(rows.iter().all(|r| r.kind == RolloutKind::Calibration && r.split == Split::Validation));
        let ev = load_evidence(&store, "r1", "step-0000").await.unwrap();
        assert_eq!(ev.calibration_id.as_deref(), Some("step-0000"));
        let prefer = &ev.profiles["s1"];
        assert!(prefer.iter().any(|e| e.polarity == Polarity::Prefer && e.when == "any task" && e.paired_delta == Some(1.0)), "{prefer:?}");
        assert!(ev.descriptions["s1"].contains("remind the agent"));

        // Redelivery: nothing runs.
        let calls = weak.calls.load(Ordering::Relaxed);
        let again = run(&ctx, &input("step-0000", 0)).await.unwrap();
        assert!(again.already_done);
        assert_eq!(again.manifest, first.manifest);
        assert_eq!(weak.calls.load(Ordering::Relaxed), calls);

        // A later checkpoint no longer needs the hint: the evidence changes.
        let strong = Checkpointed { name: "strong", calls: AtomicU32::new(0) };
        let ctx = context(&store, &strong, "cal-b");
        let second = run(&ctx, &input("step-0010", 10)).await.unwrap();
        assert_eq!((second.manifest.stats["h0"].successes, second.manifest.stats["s1"].successes), (3, 3));
        let ev2 = load_evidence(&store, "r1", "step-0010").await.unwrap();
        assert!(ev2.profiles.get("s1").is_none_or(|v| v.is_empty()), "no paired difference left: {:?}", ev2.profiles);
        assert_eq!(second.manifest.profile_entries["s1"], 0);
        assert_ne!(ev.validation_success()["h0"], ev2.validation_success()["h0"]);
    }

    #[tokio::test]
    async fn bad_input_names_the_field() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalStore::new(dir.path()).unwrap();
        let weak = Checkpointed { name: "weak", calls: AtomicU32::new(0) };
        let ctx = context(&store, &weak, "j");
        let mut i = input("c/1", 0);
        assert!(run(&ctx, &i).await.unwrap_err().to_string().contains("`calibration_id`"));
        i.calibration_id = "c1".into();
        i.pool.remove(0);
        assert!(run(&ctx, &i).await.unwrap_err().to_string().contains("must include the base harness `h0`"));
        let mut i = input("c1", 0);
        i.tasks.clear();
        assert!(run(&ctx, &i).await.unwrap_err().to_string().contains("`tasks` is empty"));
        let err = load_evidence(&store, "r1", "nope").await.unwrap_err();
        assert!(err.to_string().contains("no such calibration"), "{err}");
    }
}
