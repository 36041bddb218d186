//! The scheduler state machine of a Harness-S training run (Algorithm 1 of the paper):
//!
//! validate → baseline evaluation → calibration → for each update {base rollouts →
//! rescue decisions → rescue rollouts → retained groups + metrics → learn → re-anchor
//! when due} → final re-anchor → evaluation → report.
//!
//! Every unit of work is a job with a deterministic id; the scheduler publishes a stage's
//! jobs, waits for their done-markers, computes what the next stage needs from the stored
//! Parquet, and writes `state.json` after every stage. Running it again on the same run
//! (resume) skips finished stages and every job whose marker exists, so nothing is done
//! twice and nothing is silently skipped.

use std::collections::BTreeMap;
use std::sync::Arc;

use anyhow::{bail, Context};
use infra::store::ObjectStore;
use infra::table::{read_records, write_records};
use jobs::policy::SamplingParams;
use jobs::reanchor::{calibration_id_for_step, ReanchorInput};
use jobs::rescue::{self, Outcome, RescueStrategy};
use jobs::rollout::RolloutInput;
use jobs::router::{Evidence, RouteRequest, Router, RouterConfig};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use schemas::{
    job_id, keys, Group, HarnessSpec, JobEnvelope, JobIdParts, JobKind, MetricRow, RetainedKind, RolloutKind, RoutingDecision, Split,
    Trajectory, H0_ID,
};

use super::executor::{output_keys, Executor, StageError};
use super::inputs::RunInputs;
use super::stage::{Stage, UpdatePart};
use super::state::{self, RunState, RunStatus};
use handlers::{LearnJob, ReanchorJob, RolloutJob};

/// Seconds an endpoint may take to load a checkpoint (and to come back when restarting).
const WEIGHT_LOAD_TIMEOUT_S: u64 = 600;

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    Completed,
    Degraded,
}

/// What one pass of [`Scheduler::drive`] ended with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drive {
    Finished(Finish),
    /// Evolution wrote the run's pool: drive again with the inputs read anew.
    PoolChanged,
}

/// Drives one run.
pub struct Scheduler {
    pub store: Arc<dyn ObjectStore>,
    pub exec: Executor,
    pub inputs: Arc<RunInputs>,
    /// Costs of the stage running now (Table 9), stored when it finishes.
    pub cost: std::sync::Mutex<crate::cost::StageCost>,
    /// Run-level gauges (Prometheus).
    pub metrics: worker::Metrics,
}

/// Seed of a (purpose, step, task, harness) unit, derived from the run seed.
pub(super) fn unit_seed(run_seed: u64, parts: &[&str]) -> u64 {
    let id = job_id(&JobIdParts { run_id: &parts.join("/"), seed: run_seed, ..Default::default() });
    u64::from_str_radix(&id[..15], 16).unwrap_or(run_seed)
}

/// One rollout job of a stage: `attempts` rollouts of each of `tasks` under `harness`,
/// from the checkpoint of `checkpoint_step` (the starting weights when `None`).
struct RolloutRequest<'a> {
    /// The stage's name, part of the job id.
    stage: &'a str,
    step: u32,
    /// The rows' kind; it decides the job kind and the split.
    kind: RolloutKind,
    tasks: Vec<String>,
    harness: HarnessSpec,
    attempts: u32,
    seed: u64,
    checkpoint_step: Option<u32>,
}

impl<'a> RolloutRequest<'a> {
    /// The requests of a stage's one-task jobs (base, rescue, evaluation), made from the
    /// task, the harness, the attempts and the seed.
    fn per_task(
        stage: &'a str,
        step: u32,
        kind: RolloutKind,
        checkpoint_step: Option<u32>,
    ) -> impl Fn(&str, HarnessSpec, u32, u64) -> RolloutRequest<'a> {
        move |task, harness, attempts, seed| RolloutRequest {
            stage,
            step,
            kind,
            tasks: vec![task.to_string()],
            harness,
            attempts,
            seed,
            checkpoint_step,
        }
    }

    /// The job's deterministic id: its idempotency key, the same on every resume.
    fn job_id(&self, run_id: &str) -> String {
        job_id(&JobIdParts {
            run_id,
            stage: self.stage,
            step: self.step,
            task_id: &self.tasks.join(","),
            harness_id: &self.harness.id,
            attempt_index: self.attempts,
            seed: self.seed,
        })
    }

    /// Base and calibration rollouts are `rollout` jobs; rescue and evaluation have kinds
    /// of their own.
    fn job_kind(&self) -> JobKind {
        match self.kind {
            RolloutKind::Base | RolloutKind::Calibration => JobKind::Rollout,
            RolloutKind::Rescue => JobKind::Rescue,
            RolloutKind::Eval => JobKind::Eval,
            // An editor's rows are written by its edit job, never requested as rollouts.
            RolloutKind::Edit => JobKind::Edit,
        }
    }

    /// The split of the tasks: base and rescue rollouts train, calibration validates,
    /// evaluation tests.
    fn split(&self) -> Split {
        match self.kind {
            RolloutKind::Base | RolloutKind::Rescue => Split::Train,
            RolloutKind::Calibration => Split::Validation,
            RolloutKind::Eval => Split::Test,
            RolloutKind::Edit => Split::Train,
        }
    }
}

/// The stages of a run of `spec`, in order (Algorithm 1): evolve, baseline, calibrations,
/// update stages, final calibration, evaluation, report.
pub fn stages(spec: &super::spec::RunSpec) -> Vec<Stage> {
    if let Some(e) = &spec.editor_training {
        return super::stage::editor_stages(e);
    }
    let mut s = vec![];
    if spec.evolution.is_some() {
        s.push(Stage::Evolve);
    }
    // `updates = 0` (HE-only): the starting policy under H0, H_best and the router's
    // ranks, with no training; the final evaluation is then the baseline itself.
    if spec.evaluation.baseline && spec.algorithm.updates > 0 {
        s.push(Stage::Baseline);
    }
    s.push(Stage::Calibration(0));
    for u in 1..=spec.algorithm.updates {
        for part in [UpdatePart::Base, UpdatePart::Rescue, UpdatePart::Groups] {
            s.push(Stage::Update(u, part));
        }
        if spec.algorithm.learn {
            s.push(Stage::Update(u, UpdatePart::Learn));
        }
        let interval = spec.calibration.interval;
        if interval > 0 && u % interval == 0 && u < spec.algorithm.updates {
            s.push(Stage::Calibration(u));
        }
    }
    if spec.algorithm.updates > 0 {
        s.push(Stage::FinalCalibration(spec.algorithm.updates));
    }
    s.push(Stage::Evaluation);
    s.push(Stage::Report);
    s
}

impl Scheduler {
    pub(super) fn run_id(&self) -> &str {
        &self.inputs.stored.run_id
    }

    pub(super) fn spec(&self) -> &super::spec::RunSpec {
        self.inputs.spec()
    }

    pub(super) fn sampling(&self) -> SamplingParams {
        let p = &self.spec().policy;
        SamplingParams { temperature: p.temperature, top_p: p.top_p, max_tokens: p.max_tokens, seed: None, stop: vec![], constrain: None }
    }

    /// Per-episode execution limits: the paper's Table 8 defaults unless the spec says.
    pub(super) fn episode_budgets(&self) -> jobs::harness::Budgets {
        self.spec().budgets.episode()
    }

    /// The stages of this run, in order.
    pub fn stages(&self) -> Vec<Stage> {
        stages(self.spec())
    }

    /// Runs every stage not yet done; persists state after each.
    pub async fn drive(&self, st: &mut RunState) -> anyhow::Result<Drive> {
        st.status = RunStatus::Running;
        st.message = None;
        state::save(self.store.as_ref(), st).await?;
        for stage in self.stages() {
            let label = stage.to_string();
            if st.is_done(&label) {
                continue;
            }
            st.stage = label.clone();
            state::save(self.store.as_ref(), st).await?;
            *self.cost_mut() = Default::default();
            let started = std::time::Instant::now();
            match self.run_stage(stage, st).await {
                // The report stage writes the report: its own few seconds are not in it.
                Ok(()) if stage != Stage::Report => self.write_cost(stage, started.elapsed().as_secs_f64(), st).await?,
                Ok(()) => {}
                Err(e) => {
                    let cancelled = matches!(e.downcast_ref::<StageError>(), Some(StageError::Cancelled));
                    st.status = if cancelled { RunStatus::Cancelled } else { RunStatus::Failed };
                    st.message = Some(format!("{stage}: {e:#}"));
                    state::save(self.store.as_ref(), st).await?;
                    return Err(e.context(format!("stage `{stage}`")));
                }
            }
            st.completed.push(label);
            state::save(self.store.as_ref(), st).await?;
            self.metrics.set_run(worker::metrics::RunProgress {
                updates_done: st.step,
                stages_done: st.completed.len(),
                rollouts: st.rollouts_base + st.rollouts_rescue + st.rollouts_other,
                tokens: st.tokens,
            });
            if stage == Stage::Evolve {
                return Ok(Drive::PoolChanged);
            }
        }
        let degraded = st.failures.values().any(|n| *n > 0);
        st.status = if degraded { RunStatus::Degraded } else { RunStatus::Completed };
        st.stage = "finished".into();
        state::save(self.store.as_ref(), st).await?;
        Ok(Drive::Finished(if degraded { Finish::Degraded } else { Finish::Completed }))
    }

    async fn run_stage(&self, stage: Stage, st: &mut RunState) -> anyhow::Result<()> {
        // A stage that samples the policy first brings its endpoint to the weights it samples.
        if stage.samples_policy() {
            // An editor run's checkpoints are the editor's: its target stays at its start.
            let frozen = matches!(stage, Stage::Evolve | Stage::Baseline) || self.spec().editor_training.is_some();
            let step = if frozen { None } else { st.latest_checkpoint };
            self.sync_endpoint(step).await?;
        }
        let label = stage.to_string();
        match stage {
            Stage::Evolve => self.evolve().await,
            Stage::Packets => self.packets(st).await,
            Stage::Update(u, UpdatePart::Edit) => self.edit(u, st).await,
            Stage::Baseline => self.evaluate("baseline", 0, None, st).await,
            Stage::Calibration(n) | Stage::FinalCalibration(n) => self.calibrate(n, &label, st).await,
            Stage::Update(u, UpdatePart::Base) => self.base_rollouts(u, st).await,
            Stage::Update(u, UpdatePart::Rescue) => self.rescue_rollouts(u, st).await,
            Stage::Update(u, UpdatePart::Groups) => self.form_groups(u, st).await,
            Stage::Update(u, UpdatePart::Learn) => self.learn(u, st).await,
            Stage::Evaluation => self.evaluate("evaluation", self.spec().algorithm.updates, st.latest_checkpoint, st).await,
            Stage::Report => {
                let path = crate::report::write(self.store.as_ref(), self.run_id()).await?;
                tracing::info!(report = %path, "report written");
                Ok(())
            }
        }
    }

    /// With `[policy] weight_sync`: brings the policy endpoint to the weights of checkpoint
    /// `step` (the starting weights for `None`) before a stage samples it. Nothing is
    /// loaded when the endpoint serves them already; a restarted endpoint or a resumed run
    /// gets them again. The stage does not start until the endpoint reports them.
    async fn sync_endpoint(&self, step: Option<u32>) -> anyhow::Result<()> {
        let p = &self.spec().policy;
        if !p.syncs_weights() {
            return Ok(());
        }
        let Some(want) = self.inputs.stored.served_weights(self.store.as_ref(), step) else {
            return Ok(());
        };
        if p.weight_sync == jobs::policy::weight_sync::WeightSync::Lora {
            // the starting weights are the base the server serves: only a trained step's
            // adapter is loaded
            return match step {
                Some(_) => bring_adapter_to(&p.openai_config(), &jobs::policy::weight_sync::adapter_name(&p.model), &want).await,
                None => Ok(()),
            };
        }
        bring_endpoint_to(&p.openai_config(), &want, "policy").await
    }

    /// Directional Harness Evolution (§3.2) with the starting policy frozen: one evolve
    /// job; its pool (H0 left out) becomes the run's pool.
    async fn evolve(&self) -> anyhow::Result<()> {
        let spec = self.spec();
        let e = spec.evolution.as_ref().context("no [evolution] section")?;
        let mut train = self.inputs.task_ids(Split::Train);
        if let Some(n) = e.train_tasks {
            train.truncate(n as usize);
        }
        let mut validation = self.inputs.task_ids(Split::Validation);
        if let Some(n) = e.validation_tasks {
            validation.truncate(n as usize);
        }
        let settings = jobs::evolve::EvolveSettings {
            proposal_budgets: e.proposal_budgets.clone(),
            parent_slots: e.parent_slots,
            local_max_tasks: e.local_max_tasks,
            local_max_controls: e.local_max_controls,
            budgets: self.episode_budgets(),
            // Table 8: greedy decoding, one rollout per task.
            sampling: SamplingParams {
                temperature: 0.0,
                top_p: 1.0,
                max_tokens: spec.policy.max_tokens,
                seed: Some(spec.run.seed),
                stop: vec![],
                constrain: None,
            },
            ..Default::default()
        };
        let input = jobs::evolve::EvolveInput {
            run_id: self.run_id().to_string(),
            train_task_ids: train,
            validation_task_ids: validation,
            settings,
            seed_from: e.seed_from.clone(),
            seed: spec.run.seed,
            base: self.spec().pool.base.is_some().then(|| self.inputs.base()),
        };
        let id = job_id(&JobIdParts { run_id: self.run_id(), stage: "evolve", ..Default::default() });
        let payload = serde_json::to_value(handlers::EvolveJob { input })?;
        let markers = self.exec.run(self.run_id(), "evolve", vec![self.envelope(id, JobKind::Evolve, payload)]).await?;
        for (component, usage) in handlers::spend_of(&markers[0].result) {
            self.cost_mut().add_llm(&component, usage);
        }
        if let Some(why) = markers[0].result.get("stopped").and_then(|v| v.as_str()) {
            tracing::warn!("evolution stopped early: {why}");
        }

        let members = super::inputs::evolved_pool(self.store.as_ref(), self.run_id()).await?;
        super::check_pool_size(spec, members.len()).context("the evolved pool is too small for rescue")?;
        let mut stored = self.inputs.stored.clone();
        stored.pool = members.iter().map(|h| h.id.clone()).collect();
        let key = super::inputs::run_json_key(self.run_id());
        self.store.put(&key, bytes::Bytes::from(schemas::encode_document(&stored))).await?;
        tracing::info!(members = ?stored.pool, "evolved pool is the run's pool");
        Ok(())
    }

    /// One rollout job envelope; its id is [`RolloutRequest::job_id`].
    fn rollout_job(&self, req: RolloutRequest<'_>) -> JobEnvelope {
        let id = req.job_id(self.run_id());
        self.rollout_job_with_id(id, req)
    }

    /// A rollout job envelope with a given job id.
    fn rollout_job_with_id(&self, id: String, req: RolloutRequest<'_>) -> JobEnvelope {
        let (job_kind, split) = (req.job_kind(), req.split());
        let input = RolloutInput {
            run_id: self.run_id().to_string(),
            step: req.step,
            kind: req.kind,
            split,
            task_ids: req.tasks,
            harness: req.harness,
            attempts: req.attempts,
            seed: req.seed,
            budgets: self.episode_budgets(),
            sampling: self.sampling(),
            concurrency: self.inputs.spec().policy.concurrency() as usize,
        };
        let payload = RolloutJob { input, checkpoint_step: req.checkpoint_step };
        self.envelope(id, job_kind, serde_json::to_value(payload).expect("payloads serialise"))
    }

    pub(super) fn envelope(&self, job_id: String, kind: JobKind, payload: serde_json::Value) -> JobEnvelope {
        JobEnvelope {
            schema_version: 1,
            job_id,
            run_id: self.run_id().to_string(),
            kind,
            attempt: 0,
            payload,
            created_at_ms: schemas::now_unix_ms(),
            not_before_ms: None,
            deadline_ms: None,
        }
    }

    /// Runs rollout jobs, reads back their rows, and charges rollouts and failures to the
    /// run's budgets.
    pub(super) async fn rollouts(&self, label: &str, jobs: Vec<JobEnvelope>, st: &mut RunState) -> anyhow::Result<Vec<Trajectory>> {
        let markers = self.exec.run(self.run_id(), label, jobs).await?;
        let mut rows = Vec::new();
        for key in output_keys(&markers) {
            if key.ends_with(".parquet") {
                rows.extend(read_records::<Trajectory>(self.store.as_ref(), &key).await?);
            }
        }
        self.cost_mut().add_rows(&rows);
        self.charge(&rows, st)?;
        Ok(rows)
    }

    /// Counts rollouts and failures; fails the run when a failure budget is exceeded.
    fn charge(&self, rows: &[Trajectory], st: &mut RunState) -> anyhow::Result<()> {
        for r in rows {
            match r.kind {
                RolloutKind::Base => st.rollouts_base += 1,
                RolloutKind::Rescue => st.rollouts_rescue += 1,
                _ => st.rollouts_other += 1,
            }
            st.tokens += r.prompt_tokens + r.completion_tokens;
            if let Some(class) = r.error_class {
                *st.failures.entry(class.as_str().to_string()).or_default() += 1;
            }
        }
        let budgets = &self.spec().budgets;
        let service = |r: &&Trajectory| {
            matches!(
                r.error_class,
                Some(schemas::ErrorClass::Infra | schemas::ErrorClass::Env | schemas::ErrorClass::Policy | schemas::ErrorClass::Timeout)
            )
        };
        let failed = rows.iter().filter(service).count();
        let share = budgets.stage_failure_share();
        if !rows.is_empty() && share < 1.0 && failed as f64 > share * rows.len() as f64 {
            let first = rows.iter().find(service).and_then(|r| r.error_message.clone()).unwrap_or_default();
            bail!(
                "{failed} of the stage's {} rollouts failed with service errors (more than budgets.stage_failure_share = {share}); the run stops instead of training on them. First error: {first}",
                rows.len()
            );
        }
        for (class, n) in &st.failures {
            if let Some(limit) = budgets.failures.get(class) {
                if n > limit {
                    bail!("failure budget exceeded: {n} rollouts failed with `{class}` (budget {limit})");
                }
            }
        }
        let total = st.rollouts_base + st.rollouts_rescue + st.rollouts_other;
        if let Some(max) = budgets.max_rollouts {
            if total > max {
                bail!("rollout budget exceeded: {total} rollouts (budget {max})");
            }
        }
        if let Some(max) = budgets.max_tokens {
            if st.tokens > max {
                bail!("token budget exceeded: {} tokens (budget {max})", st.tokens);
            }
        }
        Ok(())
    }

    fn cost_mut(&self) -> std::sync::MutexGuard<'_, crate::cost::StageCost> {
        self.cost.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stores what stage `label` cost (Table 9) as metrics of stage `cost:<kind>`: the wall
    /// time of the drive that finished it, and what [`Scheduler::cost`] collected.
    async fn write_cost(&self, stage: Stage, wall_seconds: f64, st: &RunState) -> anyhow::Result<()> {
        let values = self.cost_mut().metrics(wall_seconds);
        let refs: Vec<(&str, f64)> = values.iter().map(|(n, v)| (n.as_str(), *v)).collect();
        let kind = format!("{}{}", crate::cost::STAGE_PREFIX, stage.kind());
        let step = stage.step(self.spec().algorithm.updates);
        self.write_metric_part(step, &kind, &format!("cost:{stage}"), &refs, st).await
    }

    pub(super) async fn write_metrics(&self, step: u32, stage: &str, values: &[(&str, f64)], st: &RunState) -> anyhow::Result<()> {
        self.write_metric_part(step, stage, stage, values, st).await
    }

    /// Writes metric rows of `stage` at `step` as one part named by `part` (parts with the
    /// same part and step replace each other: a re-run stage rewrites its own).
    async fn write_metric_part(&self, step: u32, stage: &str, part: &str, values: &[(&str, f64)], st: &RunState) -> anyhow::Result<()> {
        let now = schemas::now_unix_ms();
        for (name, value) in values {
            self.metrics.observe_run_metric(name, *value);
        }
        let rows: Vec<MetricRow> = values
            .iter()
            .map(|(name, value)| MetricRow {
                run_id: self.run_id().to_string(),
                step,
                stage: stage.to_string(),
                name: name.to_string(),
                value: *value,
                policy_checkpoint: st.latest_checkpoint.map(|s| native::train::checkpoint::manifest_key(self.run_id(), s)),
                recorded_at_ms: now,
            })
            .collect();
        self.store_metric_rows(step, part, &rows).await
    }

    /// Stores metric rows as the Parquet part named by (`part`, `step`) and, for
    /// TensorBoard as they arrive, as an event file (`tensorboard --logdir` on the folder).
    async fn store_metric_rows(&self, step: u32, part: &str, rows: &[MetricRow]) -> anyhow::Result<()> {
        let id = job_id(&JobIdParts { run_id: self.run_id(), stage: part, step, ..Default::default() });
        write_records(self.store.as_ref(), &keys::metrics_part(self.run_id(), step, &id), rows).await?;
        let at = rows.iter().map(|r| r.recorded_at_ms).max().unwrap_or_else(schemas::now_unix_ms);
        let events = format!("{}{}", crate::tensorboard::events_prefix(self.run_id()), crate::tensorboard::event_file_name(at, &id[..16]));
        self.store.put(&events, bytes::Bytes::from(crate::tensorboard::encode(rows))).await?;
        Ok(())
    }

    /// Evaluation on the test split under H0 (Pass@k, Avg@k), and — after training, with
    /// a pool — under the router's Rank-1 .. Rank-r harness of each task, fixed across its
    /// k attempts (Eq. 12), with the rank analysis of Table 5.
    async fn evaluate(&self, stage: &str, step: u32, checkpoint: Option<u32>, st: &mut RunState) -> anyhow::Result<()> {
        let spec = self.spec();
        let seed = unit_seed(spec.run.seed, &["eval"]);
        let tasks = self.inputs.task_ids(Split::Test);
        let k = spec.evaluation.k;
        // k attempts of one test task under one harness; every unit uses the same seeds.
        let eval_request = RolloutRequest::per_task(stage, step, RolloutKind::Eval, checkpoint);
        let eval_job = |task: &str, harness: HarnessSpec| self.rollout_job(eval_request(task, harness, k, seed));
        let mut jobs: Vec<JobEnvelope> = tasks.iter().map(|t| eval_job(t, self.inputs.base())).collect();
        let ranks = if stage == "evaluation" { spec.eval_ranks() as usize } else { 0 };
        let mut decisions = Vec::new();
        // (task, harness) units already evaluated: H0 on every task; a harness that is both a
        // task's Rank-r and H_best runs once. Every unit uses H0's seeds: comparisons are paired.
        let mut units: std::collections::BTreeSet<(String, String)> = tasks.iter().map(|t| (t.clone(), H0_ID.to_string())).collect();
        // With a pool, the final evaluation uses the latest calibration (the final policy's).
        let evidence = if stage == "evaluation" && !self.inputs.pool.is_empty() {
            Some(self.load_evidence(st.calibration_id.as_deref()).await?)
        } else {
            None
        };
        let pool = self.pool_ids();
        if let (true, Some(evidence)) = (ranks > 0, &evidence) {
            let router = self.router(k)?;
            for info in self.inputs.task_infos(Split::Test, &tasks) {
                let routed = router.route(&RouteRequest::inference(self.run_id(), step, &info, &pool, evidence)).await?;
                for h in routed.decision.score_harnesses.iter().take(ranks) {
                    if !units.insert((info.task_id.clone(), h.clone())) {
                        continue;
                    }
                    let harness = self.inputs.harness(h).with_context(|| format!("router ranked unknown harness `{h}`"))?;
                    jobs.push(eval_job(&info.task_id, harness));
                }
                decisions.push(routed.decision);
            }
        }
        // H_best (Table 7): the one harness with the best validation success, on every task.
        let h_best = evidence.as_ref().and_then(|e| jobs::router::analysis::best_harness(&e.validation_success(), &pool));
        if let Some((h, _)) = &h_best {
            for t in &tasks {
                if units.insert((t.clone(), h.clone())) {
                    let harness = self.inputs.harness(h).with_context(|| format!("H_best is an unknown harness `{h}`"))?;
                    jobs.push(eval_job(t, harness));
                }
            }
        }
        let rows = self.rollouts(stage, jobs, st).await?;
        let outcomes = jobs::router::analysis::outcomes(&rows);
        let under = |h: &str| -> (f64, f64) {
            let per_task: Vec<&[bool]> =
                tasks.iter().filter_map(|t| outcomes.get(&(t.clone(), h.to_string())).map(|v| v.as_slice())).collect();
            jobs::router::analysis::pass_avg(&per_task)
        };
        let (pass, avg) = under(H0_ID);
        tracing::info!(stage, pass_at_k = pass, avg_at_k = avg, k, "evaluation under H0");
        let mut values = vec![("pass_at_k", pass), ("avg_at_k", avg)];
        if let Some((h, validation)) = &h_best {
            let (p, a) = under(h);
            tracing::info!(stage, harness = %h, validation_success = validation, pass_at_k = p, avg_at_k = a, k, "evaluation under H_best (the best harness on validation, Table 7)");
            values.extend([("h_best_pass_at_k", p), ("h_best_avg_at_k", a), ("h_best_validation_success", *validation)]);
        }
        self.write_metrics(step, stage, &values, st).await?;
        if let Some((h, validation)) = &h_best {
            // Which harness H_best is: its id as the metric's name.
            self.write_metrics(step, "evaluation:h_best", &[(h.as_str(), *validation)], st).await?;
        }
        self.cost_mut().add_decisions(&decisions);
        if !decisions.is_empty() {
            let id = job_id(&JobIdParts { run_id: self.run_id(), stage: "evaluation:routing", step, ..Default::default() });
            jobs::router::write_decisions(self.store.as_ref(), self.run_id(), step, &id, &decisions).await?;
            let table = jobs::router::analysis::rank_analysis(&decisions, &outcomes, H0_ID, ranks);
            for r in &table {
                tracing::info!(row = %r.label, tasks = r.tasks, pass_at_k = r.pass_at_k, avg_at_k = r.avg_at_k, h0_rate = ?r.h0_rate, "rank analysis (Table 5)");
            }
            let checkpoint_key = checkpoint.map(|s| native::train::checkpoint::manifest_key(self.run_id(), s));
            let rows = jobs::router::analysis::metric_rows(&table, self.run_id(), step, "evaluation:ranks", checkpoint_key.as_deref());
            self.store_metric_rows(step, "evaluation:ranks", &rows).await?;
        }
        Ok(())
    }

    /// Every harness id routing may pick from, H0 first.
    fn pool_ids(&self) -> Vec<String> {
        std::iter::once(H0_ID.to_string()).chain(self.inputs.pool.iter().map(|h| h.id.clone())).collect()
    }

    /// The router of this run for `rollouts` rollouts per decision (K for rescue, k at
    /// inference).
    fn router(&self, rollouts: u32) -> anyhow::Result<Router> {
        let spec = self.spec();
        let mut config = RouterConfig::new(spec.router.variant(), rollouts, spec.run.seed);
        if let Some(m) = spec.router.similar_tasks {
            config.similar_tasks = m;
        }
        config.rule_voter = spec.router.rule_voter;
        let mut voters: Vec<Box<dyn jobs::router::Voter>> = Vec::new();
        for (i, v) in spec.router.voters.iter().enumerate() {
            let voter = jobs::router::LlmVoter::openai_with(v.openai_config()).with_context(|| format!("router.voters[{i}]"))?;
            voters.push(Box::new(voter));
        }
        Ok(Router::new(config, voters)?)
    }

    /// The stored evidence of a calibration (validation statistics, profiles, tasks).
    async fn load_evidence(&self, calibration_id: Option<&str>) -> anyhow::Result<Evidence> {
        let id = calibration_id.context("no calibration has run yet")?;
        Ok(jobs::reanchor::load_evidence(self.store.as_ref(), self.run_id(), id).await?)
    }

    /// Re-anchoring (§3.4): paired validation rollouts of H0 and every sibling with the
    /// frozen current checkpoint (same tasks, seeds and limits), one rollout job per
    /// harness so workers run them in parallel; then the re-anchoring job, which finds
    /// those rollouts done (same job ids) and builds statistics, profiles and the
    /// calibration manifest.
    async fn calibrate(&self, step: u32, stage: &str, st: &mut RunState) -> anyhow::Result<()> {
        let spec = self.spec();
        let calibration_id = calibration_id_for_step(step);
        let mut task_ids = self.inputs.task_ids(Split::Validation);
        if let Some(n) = spec.calibration.tasks {
            task_ids.truncate(n as usize);
        }
        let seed = unit_seed(spec.run.seed, &["calibration", &calibration_id]);
        let harnesses: Vec<HarnessSpec> = std::iter::once(self.inputs.base()).chain(self.inputs.pool.iter().cloned()).collect();
        let rollout_jobs: Vec<JobEnvelope> = harnesses
            .iter()
            .map(|h| {
                // The id the re-anchoring job gives this harness's paired rollouts.
                let id = job_id(&JobIdParts {
                    run_id: self.run_id(),
                    stage: "calibration",
                    step,
                    task_id: &calibration_id,
                    harness_id: &h.id,
                    attempt_index: 0,
                    seed,
                });
                let req = RolloutRequest {
                    stage,
                    step,
                    kind: RolloutKind::Calibration,
                    tasks: task_ids.clone(),
                    harness: h.clone(),
                    attempts: 1,
                    seed,
                    checkpoint_step: st.latest_checkpoint,
                };
                self.rollout_job_with_id(id, req)
            })
            .collect();
        self.rollouts(stage, rollout_jobs, st).await?;

        let input = ReanchorInput {
            run_id: self.run_id().to_string(),
            step,
            calibration_id: calibration_id.clone(),
            pool: harnesses,
            tasks: self.inputs.task_infos(Split::Validation, &task_ids),
            attempts: 1,
            seed,
            budgets: self.episode_budgets(),
            sampling: self.sampling(),
            concurrency: self.inputs.spec().policy.concurrency() as usize,
        };
        let id = job_id(&JobIdParts { run_id: self.run_id(), stage: "reanchor", step, task_id: &calibration_id, ..Default::default() });
        let payload = serde_json::to_value(ReanchorJob { input, checkpoint_step: st.latest_checkpoint })?;
        let markers = self.exec.run(self.run_id(), stage, vec![self.envelope(id, JobKind::Reanchor, payload)]).await?;
        for (component, usage) in handlers::spend_of(&markers[0].result) {
            self.cost_mut().add_llm(&component, usage);
        }

        let ev = self.load_evidence(Some(&calibration_id)).await?;
        let success = ev.validation_success();
        let rate = |h: &str| success.get(h).copied().unwrap_or(0.0);
        let mut metrics = vec![("h0_validation_success".to_string(), rate(H0_ID))];
        for h in &self.inputs.pool {
            metrics.push((format!("validation_success/{}", h.id), rate(&h.id)));
        }
        let key = schemas::keys::trajectories_of_step(self.run_id(), step, Some(RolloutKind::Calibration));
        let rows: Vec<Trajectory> = infra::table::read_committed(self.store.as_ref(), self.run_id(), &key).await?;
        if let Some(share) = protocol_share(rows.iter().filter(|r| r.harness_id == H0_ID)) {
            metrics.push(("h0_protocol_share".to_string(), share));
        }
        if let Some(out) = self.transfer_probe(step, stage, st).await? {
            if let Some(lp) = out.mean_logprob {
                metrics.push(("transfer_logprob".to_string(), lp));
                metrics.push(("transfer_rows".to_string(), out.trajectory_ids.len() as f64));
                metrics.push(("transfer_tokens".to_string(), out.tokens as f64));
            }
        }
        let refs: Vec<(&str, f64)> = metrics.iter().map(|(n, v)| (n.as_str(), *v)).collect();
        self.write_metrics(step, "calibration", &refs, st).await?;
        let entries: usize = ev.profiles.values().map(Vec::len).sum();
        tracing::info!(calibration = %calibration_id, h0_validation_success = rate(H0_ID), profile_entries = entries, "re-anchored");
        st.calibration_id = Some(calibration_id);
        st.best_checkpoint = best_checkpoint(st.best_checkpoint, st.latest_checkpoint, rate(H0_ID));
        Ok(())
    }

    /// The transfer probe of the calibration at `step` (a `transfer` job): the policy's
    /// mean log-probability, under H0's context, of the first calibration's successful
    /// sibling rows. None where it does not apply: no pool, a policy without native
    /// weights, an editor run, an HTTP environment, or `[calibration] transfer_rows = 0`.
    async fn transfer_probe(
        &self,
        step: u32,
        stage: &str,
        st: &RunState,
    ) -> anyhow::Result<Option<native::train::transfer::TransferOutput>> {
        let spec = self.spec();
        let max_rows = spec.calibration.transfer_rows();
        let native_weights = spec.policy.backend == super::spec::Backend::Native;
        if max_rows == 0 || self.inputs.pool.is_empty() || !native_weights || spec.editor_training.is_some() || spec.environment.is_http() {
            return Ok(None);
        }
        let Some(base_model) = self.inputs.stored.base_model.clone() else { return Ok(None) };
        let h0 = self.inputs.base();
        if jobs::harness::reads_observation_flags(&h0).is_some() {
            return Ok(None);
        }
        let context = h0_rendering(spec, h0);
        let input = native::train::transfer::TransferInput {
            run_id: self.run_id().to_string(),
            step,
            weights_step: st.latest_checkpoint,
            base_model,
            device: spec.policy.device.clone(),
            set_step: 0,
            max_rows,
            context,
        };
        let id = job_id(&JobIdParts { run_id: self.run_id(), stage: "transfer", step, task_id: stage, ..Default::default() });
        let job = self.envelope(id, JobKind::Transfer, serde_json::to_value(&input)?);
        let markers = self.exec.run(self.run_id(), stage, vec![job]).await?;
        Ok(Some(serde_json::from_value(markers[0].result.clone()).context("reading the transfer probe's result")?))
    }

    /// The calibration rescue routing uses now: the latest one for the adaptive variant,
    /// the one made before training for the others (fixed profiles).
    fn routing_calibration(&self, st: &RunState) -> Option<String> {
        if self.spec().router.variant().reanchors() {
            st.calibration_id.clone()
        } else {
            Some(calibration_id_for_step(0))
        }
    }

    /// The train tasks of update `u` (1-based): a seeded shuffle of the train split,
    /// consumed `tasks_per_update` at a time, cycling.
    fn batch(&self, u: u32) -> Vec<String> {
        let spec = self.spec();
        let mut ids = self.inputs.task_ids(Split::Train);
        ids.shuffle(&mut ChaCha8Rng::seed_from_u64(spec.run.seed));
        let n = spec.algorithm.tasks_per_update as usize;
        let start = (u as usize - 1) * n;
        (0..n).map(|i| ids[(start + i) % ids.len()].clone()).collect()
    }

    /// Algorithm 1, line 5: K rollouts per task under H0 (or the fixed mixture).
    async fn base_rollouts(&self, u: u32, st: &mut RunState) -> anyhow::Result<()> {
        let spec = self.spec();
        let k = spec.algorithm.k;
        let stage = Stage::Update(u, UpdatePart::Base).to_string();
        let base_request = RolloutRequest::per_task(&stage, u, RolloutKind::Base, st.latest_checkpoint);
        let mut jobs = Vec::new();
        for task in self.batch(u) {
            let seed = unit_seed(spec.run.seed, &["base", &u.to_string(), &task]);
            if spec.algorithm.rescue == RescueStrategy::Mixed {
                // Mixed-harness control: attempt i of every task uses mixture[i mod m].
                let mixture = self.mixture()?;
                for i in 0..k {
                    let h = mixture[i as usize % mixture.len()].clone();
                    jobs.push(self.rollout_job(base_request(&task, h, 1, seed + i as u64)));
                }
            } else {
                jobs.push(self.rollout_job(base_request(&task, self.inputs.base(), k, seed)));
            }
        }
        self.rollouts(&stage, jobs, st).await?;
        st.data_cursor = u as u64 * spec.algorithm.tasks_per_update as u64;
        Ok(())
    }

    fn mixture(&self) -> anyhow::Result<Vec<HarnessSpec>> {
        match &self.spec().algorithm.mixture {
            Some(ids) => ids
                .iter()
                .map(|id| self.inputs.harness(id).with_context(|| format!("algorithm.mixture: no harness `{id}` in the pool")))
                .collect(),
            None => Ok(std::iter::once(self.inputs.base()).chain(self.inputs.pool.iter().cloned()).collect()),
        }
    }

    async fn stage_rows(&self, u: u32, kind: RolloutKind) -> anyhow::Result<Vec<Trajectory>> {
        let prefix = keys::trajectories_of_step(self.run_id(), u, Some(kind));
        Ok(infra::table::read_committed(self.store.as_ref(), self.run_id(), &prefix).await?)
    }

    /// Algorithm 1, lines 6–8: for every all-fail base group, K rollouts from the task's
    /// initial state under auxiliaries chosen by the router (Eq. 9–10; H0 excluded), or
    /// under H0 again for the `h0` control. Every routing decision is stored.
    async fn rescue_rollouts(&self, u: u32, st: &mut RunState) -> anyhow::Result<()> {
        let spec = self.spec();
        let strategy = spec.algorithm.rescue;
        let base = self.stage_rows(u, RolloutKind::Base).await?;
        let by_task = group_by_task(&base);
        let stage = Stage::Update(u, UpdatePart::Rescue).to_string();
        let rescue_request = RolloutRequest::per_task(&stage, u, RolloutKind::Rescue, st.latest_checkpoint);
        let mut jobs = Vec::new();
        let mut decisions: Vec<RoutingDecision> = Vec::new();
        let routing = if strategy == RescueStrategy::Router {
            let evidence = self.load_evidence(self.routing_calibration(st).as_deref()).await?;
            Some((self.router(spec.algorithm.k)?, evidence, self.pool_ids()))
        } else {
            None
        };
        for (task, rows) in &by_task {
            let outcomes: Vec<Outcome> = rows.iter().map(|r| outcome(r)).collect();
            if !rescue::rescue_fires(strategy, &outcomes) {
                continue;
            }
            let seed = unit_seed(spec.run.seed, &["rescue", &u.to_string(), task]);
            match (strategy, &routing) {
                (RescueStrategy::H0, _) => {
                    jobs.push(self.rollout_job(rescue_request(task, self.inputs.base(), spec.algorithm.k, seed)));
                }
                (RescueStrategy::Router, Some((router, evidence, pool))) => {
                    let info = self
                        .inputs
                        .task_infos(Split::Train, std::slice::from_ref(task))
                        .pop()
                        .with_context(|| format!("train task `{task}` is not in the run's task file"))?;
                    let routed = router.route(&RouteRequest::rescue(self.run_id(), u, &info, pool, evidence)).await?;
                    // Each rollout gets its own seed: attempts of one harness continue from
                    // where the previous harness's stopped.
                    let mut offset = 0u64;
                    for (h, n) in &routed.allocation {
                        let harness = self.inputs.harness(h).with_context(|| format!("router chose unknown harness `{h}`"))?;
                        jobs.push(self.rollout_job(rescue_request(task, harness, *n, seed.wrapping_add(offset))));
                        offset += u64::from(*n);
                    }
                    decisions.push(routed.decision);
                }
                _ => unreachable!("rescue fires only for the h0 and router strategies"),
            }
        }
        self.cost_mut().add_decisions(&decisions);
        if !decisions.is_empty() {
            let id = job_id(&JobIdParts { run_id: self.run_id(), stage: &stage, step: u, ..Default::default() });
            jobs::router::write_decisions(self.store.as_ref(), self.run_id(), u, &id, &decisions).await?;
        }
        if !jobs.is_empty() {
            self.rollouts(&stage, jobs, st).await?;
        }
        Ok(())
    }

    /// Algorithm 1, line 10 and Eq. 5–6: the retained group of every task, with GRPO
    /// advantages; the update's training-signal metrics.
    async fn form_groups(&self, u: u32, st: &mut RunState) -> anyhow::Result<()> {
        let spec = self.spec();
        let base = self.stage_rows(u, RolloutKind::Base).await?;
        let rescue_rows = self.stage_rows(u, RolloutKind::Rescue).await?;
        let rescue_by = group_by_task(&rescue_rows);
        let mut groups = Vec::new();
        let mut kept: Vec<(RetainedKind, Vec<Outcome>)> = Vec::new();
        for (task, rows) in &group_by_task(&base) {
            let (group, outcomes) = task_group(self.run_id(), spec, u, task, rows, rescue_by.get(task).map(Vec::as_slice));
            kept.push((group.retained_kind, outcomes));
            groups.push(group);
        }
        let pairs: Vec<(RetainedKind, &[Outcome])> = kept.iter().map(|(k, g)| (*k, g.as_slice())).collect();
        let m = rescue::signal_metrics(&pairs);
        let id = job_id(&JobIdParts { run_id: self.run_id(), stage: "groups", step: u, ..Default::default() });
        write_records(self.store.as_ref(), &keys::group_part(self.run_id(), u, &id), &groups).await?;
        let plain = (u as u64) * spec.algorithm.tasks_per_update as u64 * spec.algorithm.k as u64;
        let used = st.rollouts_base + st.rollouts_rescue;
        self.write_metrics(
            u,
            "update",
            &[
                ("effective_group_rate", m.effective_group_rate),
                ("effective_token_share", m.effective_token_share),
                ("rescue_rate", m.rescue_rate),
                ("rescue_success", m.rescue_success),
                ("mean_reward", m.mean_reward),
                ("rollouts_base", base.len() as f64),
                ("rollouts_rescue", rescue_rows.len() as f64),
                ("rollouts_cumulative", used as f64),
                ("rollouts_relative_to_grpo", if plain == 0 { 0.0 } else { used as f64 / plain as f64 }),
                ("retained_groups", groups.iter().filter(|g| g.retained).count() as f64),
                // Counts behind the rates: stages pool them (Table 2).
                ("groups", m.groups as f64),
                ("effective_groups", m.effective_groups as f64),
                ("rescued_groups", m.rescued_groups as f64),
                ("rescued_with_success", m.rescued_with_success as f64),
                ("retained_policy_tokens", m.policy_tokens as f64),
                ("effective_policy_tokens", m.effective_policy_tokens as f64),
            ],
            st,
        )
        .await?;
        tracing::info!(
            update = u,
            effective_group_rate = m.effective_group_rate,
            rescue_rate = m.rescue_rate,
            rescue_success = m.rescue_success,
            "groups formed"
        );
        Ok(())
    }

    /// Algorithm 1, line 12: a GRPO update on the retained groups (Appendix B).
    async fn learn(&self, u: u32, st: &mut RunState) -> anyhow::Result<()> {
        let spec = self.spec();
        let base_model = if spec.editor_training.is_some() {
            // An editor run trains its editor (native); the target policy stays frozen.
            self.inputs.stored.editor_model.clone().context("the editor run names no editor weights ([editor_training] model)")?
        } else {
            if spec.policy.backend != super::spec::Backend::Native && !spec.policy.syncs_weights() {
                bail!(
                    "policy.backend = \"{}\" cannot be trained without [policy] weight_sync; use backend = \"native\"",
                    spec.policy.backend
                );
            }
            self.inputs
                .stored
                .base_model
                .clone()
                .context("the run names no starting weights for the learner (policy.model, or policy.weights behind an endpoint)")?
        };
        let input = learn_job(spec, self.inputs.base(), self.run_id(), u, st, base_model);
        let id = job_id(&JobIdParts { run_id: self.run_id(), stage: "learn", step: u, ..Default::default() });
        let job = self.envelope(id, JobKind::Learn, serde_json::to_value(&input)?);
        let markers = self.exec.run(self.run_id(), &Stage::Update(u, UpdatePart::Learn).to_string(), vec![job]).await?;
        let out: native::train::learn::LearnOutput =
            serde_json::from_value(markers[0].result.clone()).context("reading the learn job's result")?;
        let m = &out.metrics;
        self.cost_mut().learner_forward_tokens += m.forward_tokens;
        let values = m.run_metrics(out.trained);
        self.write_metrics(u, "learn", &values, st).await?;
        if !out.trained && !out.already_done {
            tracing::warn!(update = u, "update {u} trained nothing (no retained group had a policy token); the policy is unchanged");
        }
        st.latest_checkpoint = out.weights_step;
        st.step = u;
        Ok(())
    }
}

/// The group that stands for `task` in update `u` (Eq. 5): its base rollouts, or its
/// rescue rollouts when rescue fired and replaced an all-fail base group; with the
/// outcomes of the group kept (pure: the stored rows in, the group row out).
pub fn task_group(
    run_id: &str,
    spec: &super::spec::RunSpec,
    u: u32,
    task: &str,
    rows: &[&Trajectory],
    rescue_rows: Option<&[&Trajectory]>,
) -> (Group, Vec<Outcome>) {
    let b: Vec<Outcome> = rows.iter().map(|r| outcome(r)).collect();
    let r: Option<Vec<Outcome>> = rescue_rows.map(|rs| rs.iter().map(|r| outcome(r)).collect());
    let fired = r.is_some();
    let (kind, group) = rescue::retain(&b, r.as_deref());
    let group = group.to_vec();
    let (mean, std) = rescue::reward_stats(&group);
    let adv = rescue::advantages(&group);
    let effective = rescue::is_effective(&group);
    let source_rows = match (kind, rescue_rows) {
        (RetainedKind::Rescue, Some(rescued)) => rescued,
        _ => rows,
    };
    let g = Group {
        run_id: run_id.to_string(),
        step: u,
        group_id: rows[0].group_id.clone(),
        task_id: task.to_string(),
        split: Split::Train,
        k: spec.algorithm.k,
        base_successes: b.iter().filter(|o| o.success).count() as u32,
        rescue_fired: fired,
        rescue_strategy: spec.algorithm.rescue.as_str().to_string(),
        harnesses: group.iter().map(|o| o.harness_id.clone()).collect(),
        rescue_successes: r.as_ref().map(|r| r.iter().filter(|o| o.success).count() as u32).unwrap_or(0),
        // Eq. 5 decides which group stands for the task; only groups with a reward
        // contrast carry a GRPO signal, so only those are trained on.
        retained: effective,
        retained_kind: kind,
        filter_reason: match (kind, effective) {
            (RetainedKind::Rescue, true) => Some("all-fail base group replaced by its rescue group (Eq. 5)".into()),
            (RetainedKind::Rescue, false) => Some("rescue group has no reward contrast".into()),
            (_, false) => Some("no reward contrast (all rollouts equal)".into()),
            _ => None,
        },
        mean_reward: mean,
        reward_std: std,
        advantages: adv,
        trajectory_ids: source_rows.iter().map(|r| r.trajectory_id.clone()).collect(),
        policy_tokens: group.iter().map(|o| o.policy_tokens).sum(),
    };
    (g, group)
}

fn outcome(r: &Trajectory) -> Outcome {
    let policy_tokens = r.turns.iter().flat_map(|t| t.loss_mask.iter()).filter(|m| **m).count() as u64;
    Outcome {
        trajectory_id: r.trajectory_id.clone(),
        harness_id: r.harness_id.clone(),
        reward: r.reward,
        success: r.success,
        policy_tokens,
        // Infrastructure failures say nothing about the policy: they are masked out.
        masked: matches!(r.error_class, Some(schemas::ErrorClass::Infra)),
    }
}

/// Rows by task, each task's rows in the order of their random streams (seed, then
/// attempt, harness, trajectory id): an order that does not depend on the run's id
/// (trajectory ids hash it) nor on which harness drew a stream, so two runs with the same
/// seed give the learner its samples in the same order and reach the same weights — also
/// when one rescues under H0 and the other under siblings that render as H0 does.
pub fn group_by_task(rows: &[Trajectory]) -> BTreeMap<String, Vec<&Trajectory>> {
    let mut m: BTreeMap<String, Vec<&Trajectory>> = BTreeMap::new();
    for r in rows {
        m.entry(r.task_id.clone()).or_default().push(r);
    }
    for v in m.values_mut() {
        v.sort_by(|a, b| (a.seed, a.attempt, &a.harness_id, &a.trajectory_id).cmp(&(b.seed, b.attempt, &b.harness_id, &b.trajectory_id)));
    }
    m
}

/// The learn job of update `u`: the spec's `[learner]`, `[checkpoints]` and staleness keys,
/// the run's data cursor and best checkpoint so far.
fn learn_job(
    spec: &super::spec::RunSpec,
    h0: HarnessSpec,
    run_id: &str,
    u: u32,
    st: &RunState,
    base_model: std::path::PathBuf,
) -> LearnJob {
    LearnJob {
        run_id: run_id.to_string(),
        step: u,
        base_model,
        learner: spec.learner.config(spec.algorithm.learning_rate, spec.run.seed),
        data_cursor: st.data_cursor,
        device: spec.policy.device.clone(),
        max_off_policy_steps: spec.algorithm.max_off_policy_steps,
        checkpoints: spec.checkpoints.clone(),
        best_step: st.best_checkpoint.map(|(s, _)| s),
        rescue_context: rescue_context(spec, h0),
    }
}

/// Share of policy replies that follow the answer protocol (parsed into an action: a SQL
/// block, a final-answer line, an `Action:` line); None without policy turns.
fn protocol_share<'a>(rows: impl IntoIterator<Item = &'a Trajectory>) -> Option<f64> {
    let (mut acted, mut replies) = (0u64, 0u64);
    for r in rows {
        for t in r.turns.iter().filter(|t| t.source == schemas::TurnSource::Policy) {
            replies += 1;
            acted += u64::from(t.tool_name.is_some());
        }
    }
    (replies > 0).then(|| acted as f64 / replies as f64)
}

/// `[algorithm] rescue_context` with what H0's re-rendering needs: H0's spec (always the
/// unedited base harness), DBBench's tools (the spec check keeps other environments on
/// `generating`), its round limit and the episode limits.
pub fn rescue_context(spec: &super::spec::RunSpec, h0: HarnessSpec) -> native::train::learner::data::RescueContext {
    match spec.algorithm.rescue_context {
        native::train::learner::data::RescueContextMode::Generating => spec.algorithm.rescue_context(),
        _ => h0_rendering(spec, h0),
    }
}

/// The spec's rescue-context settings with H0's rendering filled in.
fn h0_rendering(spec: &super::spec::RunSpec, h0: HarnessSpec) -> native::train::learner::data::RescueContext {
    native::train::learner::data::RescueContext {
        h0: Some(h0),
        env_tools: jobs::env::dbbench::tools(),
        max_rounds: spec.environment.max_rounds.unwrap_or(jobs::env::dbbench::DEFAULT_MAX_ROUNDS),
        budgets: spec.budgets.episode(),
        ..spec.algorithm.rescue_context()
    }
}

/// The best-validating checkpoint after a calibration of `current` (None: the starting
/// model, which is no checkpoint) that measured `success`; ties keep the earlier step.
fn best_checkpoint(best: Option<(u32, f64)>, current: Option<u32>, success: f64) -> Option<(u32, f64)> {
    match (best, current) {
        (Some((_, b)), Some(step)) if success > b => Some((step, success)),
        (None, Some(step)) => Some((step, success)),
        (best, _) => best,
    }
}

/// Asks the policy endpoint of `config` to serve the adapter folder `want` as `name`
/// (vLLM's LoRA protocol) unless it does already, and waits until it lists it.
async fn bring_adapter_to(config: &jobs::policy::openai::OpenAiConfig, name: &str, want: &str) -> anyhow::Result<()> {
    let timeout = std::time::Duration::from_secs(WEIGHT_LOAD_TIMEOUT_S);
    let endpoint = config.weight_endpoint(timeout)?;
    let started = std::time::Instant::now();
    let loaded = endpoint
        .ensure_adapter(name, want, timeout)
        .await
        .with_context(|| format!("bringing the policy endpoint's adapter `{name}` to {}", infra::redact_url(want)))?;
    if loaded {
        tracing::info!(endpoint = %endpoint.root(), adapter = %name, weights = %infra::redact_url(want), seconds = started.elapsed().as_secs_f64(), "policy endpoint loaded the run's adapter");
    }
    Ok(())
}

/// Asks the endpoint of `config` to load `want` (SGLang's weight-update protocol) unless it
/// serves them already, and waits until it reports them; `what` names it in errors and logs.
pub(super) async fn bring_endpoint_to(config: &jobs::policy::openai::OpenAiConfig, want: &str, what: &str) -> anyhow::Result<()> {
    let timeout = std::time::Duration::from_secs(WEIGHT_LOAD_TIMEOUT_S);
    let endpoint = config.weight_endpoint(timeout)?;
    let started = std::time::Instant::now();
    let loaded =
        endpoint.ensure(want, timeout).await.with_context(|| format!("bringing the {what} endpoint to {}", infra::redact_url(want)))?;
    if loaded {
        tracing::info!(endpoint = %endpoint.root(), weights = %infra::redact_url(want), seconds = started.elapsed().as_secs_f64(), "{what} endpoint loaded the run's weights");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{best_checkpoint, learn_job};
    use crate::run::state::RunState;

    #[test]
    fn the_learn_job_carries_the_learner_and_checkpoint_keys_of_the_spec() {
        let text = format!(
            "{}\n[learner]\nweight_decay = 0.05\nmicro_batch_tokens = 2048\nupdates_per_batch = 2\n[checkpoints]\ndtype = \"bf16\"\nkeep_last = 2\n",
            include_str!("../../../examples/quickstart.toml")
        );
        let spec = crate::run::spec::parse(&text, "quickstart.toml", std::path::Path::new("../examples"), "quickstart").unwrap().spec;
        let mut st = RunState::new("quickstart", String::new());
        st.data_cursor = 10;
        st.best_checkpoint = Some((1, 0.5));
        let job = learn_job(&spec, schemas::HarnessSpec::h0(), "quickstart", 2, &st, "base.gguf".into());
        let l = &job.learner;
        assert_eq!((l.optimizer.weight_decay, l.micro_batch_tokens, l.updates_per_batch), (0.05, 2048, 2));
        assert_eq!((l.optimizer.lr, l.seed), (1e-4, 7), "learning rate and seed come from [algorithm] and [run]");
        assert_eq!((job.checkpoints.dtype, job.checkpoints.keep_last), (native::model::Dtype::Bf16, Some(2)));
        assert_eq!((job.step, job.data_cursor, job.best_step), (2, 10, Some(1)));
    }

    #[test]
    fn the_best_checkpoint_is_the_first_step_with_the_highest_validation_success() {
        let mut best = best_checkpoint(None, None, 0.9);
        assert_eq!(best, None, "the starting model is no checkpoint");
        for (step, success) in [(1, 0.2), (2, 0.5), (3, 0.5), (4, 0.1)] {
            best = best_checkpoint(best, Some(step), success);
        }
        assert_eq!(best, Some((2, 0.5)));
    }
}
