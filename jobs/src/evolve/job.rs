//! The evolve stage (Harness-S §3.2, Eq. 2–4; Appendix F, Table 8), read top to bottom:
//!
//! 1. V(H0): the base harness on the validation tasks.
//! 2. For each round g (proposal budgets 7 / 8 / 8 by default):
//!    a. every parent P ∈ P_g runs on this round's fresh training tasks;
//!    b. the diagnoser turns its failures into root causes; causes become directions
//!    (2–3 related causes, each supported by ≥ 2 failed tasks);
//!    c. the editor makes one child per direction (round-robin over parents, up to the
//!    budget; a budget larger than the directions proposes each again for another
//!    mechanism); static validation; duplicates of a member are dropped;
//!    d. local evaluation on ≤ 30 tasks (the direction's failed tasks plus ≤ 10 of the
//!    parent's successes as controls); one revision when the first version repairs
//!    nothing or regresses a control; executable check (no episode broken by the
//!    harness);
//!    e. V(H) of every valid child on the validation tasks; the pool keeps them all
//!    (Eq. 4) and the manifest is saved;
//!    f. parent selection maximises |∪ V(H)| with at most B parents (Eq. 3).
//!
//! Every batch of episodes is a rollout job ([`crate::rollout::run`]) with a deterministic
//! id, so a redelivered evolve job re-reads finished batches instead of re-running them.
//! Evolve rollouts are written as `kind=eval`, `step=0` rows; their job ids start from the
//! stage name `evolve/...` (see [`batch_job_id`]).

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::diagnose::{DiagnoseError, Diagnoser};
use super::direction::{form_directions, Direction, DirectionSettings};
use super::editor::{EditError, EditRequest, Editor};
use super::pool::{load_pool, put_member, save_manifest, seed_pool, LocalResult, PoolEntry, PoolError, PoolManifest, Rejected};
use super::select::{select_parents, Candidate};
use crate::env::EnvironmentFactory;
use crate::harness::{check_spec, Budgets, ValidateOptions};
use crate::policy::{Policy, SamplingParams};
use crate::rollout::{self, RolloutContext, RolloutError, RolloutInput};
use infra::store::ObjectStore;
use schemas::{job_id, keys, ErrorClass, HarnessSpec, JobIdParts, RolloutKind, Split, Termination, Trajectory};

/// Settings of the evolve stage; defaults are Table 8's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EvolveSettings {
    /// Proposals per round; the number of entries is the number of rounds.
    pub proposal_budgets: Vec<u32>,
    /// B of Eq. 3.
    pub parent_slots: usize,
    pub local_max_tasks: usize,
    pub local_max_controls: usize,
    /// Revisions after the initial version.
    pub revisions: u32,
    pub directions: DirectionSettings,
    pub budgets: Budgets,
    pub sampling: SamplingParams,
    /// Episodes at the same time within one batch.
    pub concurrency: usize,
}

impl Default for EvolveSettings {
    fn default() -> Self {
        EvolveSettings {
            // Table 8: "3 rounds; proposal budgets 7 / 8 / 8; 4 parent slots".
            proposal_budgets: vec![7, 8, 8],
            parent_slots: 4,
            // Table 8: "At most 30 tasks, including at most 10 successful controls".
            local_max_tasks: 30,
            local_max_controls: 10,
            // Table 8: "Initial candidate plus at most one revision".
            revisions: 1,
            directions: DirectionSettings::default(),
            budgets: Budgets::default(),
            // Table 8: "Greedy decoding; one rollout per task; seed 42".
            sampling: SamplingParams { temperature: 0.0, top_p: 1.0, max_tokens: 512, seed: Some(42), stop: vec![], constrain: None },
            concurrency: 1,
        }
    }
}

/// Input of the evolve job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EvolveInput {
    pub run_id: String,
    /// Training tasks; split into one fresh chunk per round.
    pub train_task_ids: Vec<String>,
    /// Validation tasks for V(H).
    pub validation_task_ids: Vec<String>,
    #[serde(default)]
    pub settings: EvolveSettings,
    /// Start from this run's pool (its members join; its selected parents are P_1).
    #[serde(default)]
    pub seed_from: Option<String>,
    /// Seed of every rollout (Table 8: 42).
    #[serde(default = "seed42")]
    pub seed: u64,
    /// The run's base harness H0 when it is not the unedited one (`[pool] base`): the root
    /// of the pool and the harness every sibling's repairs are measured against.
    #[serde(default)]
    pub base: Option<HarnessSpec>,
}

fn seed42() -> u64 {
    42
}

/// What the evolve job runs against.
pub struct EvolveContext<'a> {
    pub store: &'a dyn ObjectStore,
    pub policy: &'a dyn Policy,
    pub envs: &'a dyn EnvironmentFactory,
    pub diagnoser: &'a dyn Diagnoser,
    pub editor: &'a dyn Editor,
    /// The environment's tools, for static validation of children.
    pub validate: ValidateOptions,
}

/// One round's outcome.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoundSummary {
    pub round: u32,
    pub parents: Vec<String>,
    pub directions: usize,
    pub proposals: usize,
    pub valid: Vec<String>,
    pub rejected: usize,
    pub selected: Vec<String>,
    pub covered: usize,
}

/// The job's result.
#[derive(Debug, Clone, PartialEq)]
pub struct EvolveOutput {
    pub manifest: PoolManifest,
    pub rounds: Vec<RoundSummary>,
    /// Why evolution stopped before its last round, if it did.
    pub stopped: Option<String>,
}

/// Failures of the stage itself (invalid candidates are recorded, not raised).
#[derive(Debug, thiserror::Error)]
pub enum EvolveError {
    #[error("evolve input: `{field}` {reason}")]
    InvalidInput { field: &'static str, reason: String },
    #[error(transparent)]
    Rollout(#[from] RolloutError),
    #[error(transparent)]
    Pool(#[from] PoolError),
    #[error(transparent)]
    Diagnose(#[from] DiagnoseError),
    #[error("editor: {0}")]
    Editor(String),
    /// Every episode of a batch failed for reasons outside the harness (policy server
    /// down, timeouts): nothing can be diagnosed or measured.
    #[error("evolve {stage} batch of `{harness}`: every episode failed outside the harness ({class:?}): {detail}; check the policy server and retry")]
    NoEpisodes { stage: String, harness: String, class: Option<ErrorClass>, detail: String },
    #[error("reading evolve rollouts {key}: {detail}")]
    Rows { key: String, detail: String },
}

impl infra::Transient for EvolveError {
    /// Everything but bad input may pass on a later delivery: rollout, store and endpoint
    /// trouble (batches already done are kept, so a retry resumes).
    fn is_transient(&self) -> bool {
        !matches!(self, EvolveError::InvalidInput { .. })
    }
}

/// Deterministic id of one batch of evolve episodes (docs/ARCHITECTURE.md, "Durability contract").
pub fn batch_job_id(run_id: &str, stage: &str, round: u32, harness: &HarnessSpec, tasks: &[String], seed: u64) -> String {
    let harness_key = format!("{}@{}", harness.id, harness.version_hash());
    job_id(&JobIdParts {
        run_id,
        stage: &format!("evolve/{stage}"),
        step: round,
        task_id: &tasks.join(","),
        harness_id: &harness_key,
        attempt_index: 0,
        seed,
    })
}

/// Runs one batch as a rollout job and returns its rows (re-read when already done).
async fn batch(
    ctx: &EvolveContext<'_>,
    input: &EvolveInput,
    stage: &str,
    round: u32,
    harness: &HarnessSpec,
    tasks: &[String],
    split: Split,
) -> Result<Vec<Trajectory>, EvolveError> {
    if tasks.is_empty() {
        return Ok(vec![]);
    }
    let id = batch_job_id(&input.run_id, stage, round, harness, tasks, input.seed);
    let rctx = RolloutContext { store: ctx.store, policy: ctx.policy, envs: ctx.envs, job_id: &id, delivery_attempt: 0 };
    let rin = RolloutInput {
        run_id: input.run_id.clone(),
        step: 0,
        kind: RolloutKind::Eval,
        split,
        task_ids: tasks.to_vec(),
        harness: harness.clone(),
        attempts: 1,
        seed: input.seed,
        budgets: input.settings.budgets,
        sampling: input.settings.sampling.clone(),
        concurrency: input.settings.concurrency.max(1),
    };
    rollout::run(&rctx, &rin).await?;
    let key = keys::trajectory_part(&input.run_id, 0, RolloutKind::Eval, &id);
    let rows: Vec<Trajectory> =
        infra::table::read_records(ctx.store, &key).await.map_err(|e| EvolveError::Rows { key, detail: e.to_string() })?;
    let outside = |r: &Trajectory| matches!(r.error_class, Some(ErrorClass::Infra | ErrorClass::Timeout | ErrorClass::Policy));
    if !rows.is_empty() && rows.iter().all(outside) {
        return Err(EvolveError::NoEpisodes {
            stage: stage.to_string(),
            harness: harness.id.clone(),
            class: rows[0].error_class,
            detail: rows[0].error_message.clone().unwrap_or_default(),
        });
    }
    Ok(rows)
}

fn solved(rows: &[Trajectory]) -> BTreeSet<String> {
    rows.iter().filter(|r| r.success).map(|r| r.task_id.clone()).collect()
}

/// The fresh tasks of round `round` (1-based, §3.2 "fresh tasks"): the training tasks split
/// into `rounds` chunks, no task in two rounds. `None` when the split has run out (fewer
/// tasks than rounds): tasks are never repeated.
pub fn round_tasks(train: &[String], rounds: usize, round: usize) -> Option<Vec<String>> {
    let size = train.len().div_ceil(rounds.max(1)).max(1);
    train.chunks(size).nth(round.checked_sub(1)?).map(<[String]>::to_vec)
}

/// Local-evaluation tasks (Table 8): the direction's failed tasks first, then at most
/// `max_controls` of the parent's successes, at most `max_tasks` in all. Pure.
pub fn local_tasks(
    direction: &Direction,
    parent_failed: &BTreeSet<String>,
    parent_solved: &BTreeSet<String>,
    max_tasks: usize,
    max_controls: usize,
) -> (Vec<String>, Vec<String>) {
    let controls: Vec<String> = parent_solved.iter().take(max_controls.min(max_tasks)).cloned().collect();
    let room = max_tasks.saturating_sub(controls.len());
    let targeted: Vec<String> = direction.tasks().into_iter().filter(|t| parent_failed.contains(t)).take(room).collect();
    (targeted, controls)
}

fn local_result(rows: &[Trajectory], targeted: &[String], controls: &[String]) -> LocalResult {
    let ok = solved(rows);
    LocalResult {
        targeted: targeted.to_vec(),
        repaired: targeted.iter().filter(|t| ok.contains(*t)).cloned().collect(),
        controls: controls.to_vec(),
        regressed: controls.iter().filter(|t| !ok.contains(*t)).cloned().collect(),
        revised: false,
        errors: rows.iter().filter(|r| r.termination == Termination::Error).count() as u32,
    }
}

/// The executable check: no episode may be broken by the harness itself (an environment
/// class error, e.g. a tool view naming a tool the environment lacks), and at least one
/// episode must end through the environment's protocol.
pub fn executable_problem(rows: &[Trajectory]) -> Option<String> {
    if let Some(r) = rows.iter().find(|r| r.error_class == Some(ErrorClass::Env)) {
        return Some(format!("not executable: task `{}`: {}", r.task_id, r.error_message.clone().unwrap_or_default()));
    }
    if !rows.is_empty() && rows.iter().all(|r| r.termination == Termination::Error) {
        return Some(format!("no episode completed: {}", rows[0].error_message.clone().unwrap_or_default()));
    }
    None
}

/// The components of a spec, without identity and lineage: two members with the same
/// components are the same sibling.
fn components(spec: &HarnessSpec) -> serde_json::Value {
    let mut v = serde_json::to_value(spec).expect("specs serialise");
    let obj = v.as_object_mut().expect("object");
    for k in ["id", "parent", "generation", "direction"] {
        obj.remove(k);
    }
    v
}

/// Static check, duplicate check, local evaluation and executable check of one version
/// of a child. `Ok(Err(reason))` drops the version; `Err` is a failure of the stage.
#[allow(clippy::too_many_arguments)]
async fn measure(
    ctx: &EvolveContext<'_>,
    input: &EvolveInput,
    round: u32,
    direction: &Direction,
    failed: &BTreeSet<String>,
    ok: &BTreeSet<String>,
    specs: &BTreeMap<String, HarnessSpec>,
    child: HarnessSpec,
) -> Result<Result<(HarnessSpec, LocalResult), String>, EvolveError> {
    let s = &input.settings;
    let problems = check_spec(&child, &ctx.validate);
    if !problems.is_empty() {
        let text = problems.iter().map(|p| p.to_string()).collect::<Vec<_>>().join("; ");
        return Ok(Err(format!("static check: {text}")));
    }
    if let Some((same, _)) = specs.iter().find(|(_, m)| components(m) == components(&child)) {
        return Ok(Err(format!("duplicate of pool member `{same}`")));
    }
    let (targeted, controls) = local_tasks(direction, failed, ok, s.local_max_tasks, s.local_max_controls);
    let local: Vec<String> = targeted.iter().chain(controls.iter()).cloned().collect();
    let rows = batch(ctx, input, "local", round, &child, &local, Split::Train).await?;
    if let Some(problem) = executable_problem(&rows) {
        return Ok(Err(problem));
    }
    Ok(Ok((child, local_result(&rows, &targeted, &controls))))
}

/// The input's own checks, before anything runs.
fn check_input(input: &EvolveInput) -> Result<(), EvolveError> {
    let s = &input.settings;
    let bad = |field, reason: &str| Err(EvolveError::InvalidInput { field, reason: reason.to_string() });
    if input.train_task_ids.is_empty() {
        return bad("train_task_ids", "is empty: evolution needs training tasks to diagnose");
    }
    if input.validation_task_ids.is_empty() {
        return bad("validation_task_ids", "is empty: parent selection needs validation tasks");
    }
    if s.proposal_budgets.is_empty() {
        return bad("settings.proposal_budgets", "is empty: give one budget per round, e.g. [7, 8, 8]");
    }
    if s.parent_slots == 0 {
        return bad("settings.parent_slots", "must be at least 1");
    }
    if s.local_max_tasks == 0 {
        return bad("settings.local_max_tasks", "must be at least 1");
    }
    Ok(())
}

/// The pool as evolution grows it: its manifest, its members' specs, and the number of
/// the next child id.
struct Pool {
    manifest: PoolManifest,
    specs: BTreeMap<String, HarnessSpec>,
    next_child: usize,
}

impl Pool {
    /// The next child id of `round` (`g<round>-s<n>`) that no member has.
    fn child_id(&mut self, round: u32) -> String {
        loop {
            let id = format!("g{round}-s{}", self.next_child);
            self.next_child += 1;
            if !self.specs.contains_key(&id) {
                return id;
            }
        }
    }

    /// Records a candidate that was not kept.
    fn reject(&mut self, round: u32, child_id: &str, plan: &Plan, reason: String) {
        tracing::info!(round, child = %child_id, reason = %reason, "candidate rejected");
        self.manifest.rejected.push(Rejected {
            id: child_id.to_string(),
            parent: plan.parent.id.clone(),
            round,
            causes: plan.direction.causes.clone(),
            reason,
        });
    }

    /// The members selected as parents, or the first `slots` members when none is.
    fn parents(&self, slots: usize) -> Vec<HarnessSpec> {
        let parents: Vec<HarnessSpec> =
            self.manifest.members.iter().filter(|m| m.selected_as_parent).filter_map(|m| self.specs.get(&m.id).cloned()).collect();
        if parents.is_empty() {
            return self.specs.values().take(slots).cloned().collect();
        }
        parents
    }
}

/// The pool evolution starts from: H0, or another run's pool.
async fn start_pool(ctx: &EvolveContext<'_>, input: &EvolveInput) -> Result<Pool, EvolveError> {
    let (manifest, specs) = match &input.seed_from {
        Some(from) => {
            let m = seed_pool(ctx.store, from, &input.run_id).await?;
            let (_, list) = load_pool(ctx.store, &input.run_id).await?;
            (m, list.into_iter().map(|h| (h.id.clone(), h)).collect())
        }
        None => {
            let h0 = input.base.clone().unwrap_or_else(HarnessSpec::h0);
            put_member(ctx.store, &input.run_id, &h0).await?;
            let mut m = PoolManifest::new(&input.run_id);
            m.members.push(PoolEntry {
                id: h0.id.clone(),
                parent: None,
                generation: 0,
                round: 0,
                direction: None,
                causes: vec![],
                version: h0.version_hash(),
                editor: "base".into(),
                local: None,
                validation_coverage: vec![],
                selected_as_parent: true,
                origin_run: input.run_id.clone(),
            });
            (m, BTreeMap::from([(h0.id.clone(), h0)]))
        }
    };
    Ok(Pool { manifest, specs, next_child: 1 })
}

/// Step 1: V(H) of members without coverage (H0, or members seeded without it); the
/// manifest is saved.
async fn measure_uncovered(ctx: &EvolveContext<'_>, input: &EvolveInput, pool: &mut Pool) -> Result<(), EvolveError> {
    for i in 0..pool.manifest.members.len() {
        if pool.manifest.members[i].validation_coverage.is_empty() {
            let spec = pool.specs[&pool.manifest.members[i].id].clone();
            let rows = batch(ctx, input, "validation", 0, &spec, &input.validation_task_ids, Split::Validation).await?;
            pool.manifest.members[i].validation_coverage = solved(&rows).into_iter().collect();
        }
    }
    save_manifest(ctx.store, &mut pool.manifest).await?;
    Ok(())
}

/// One proposal of a round: a direction of one parent, with the parent's failed and
/// solved tasks of the round.
#[derive(Clone)]
struct Plan {
    /// The direction's place among its parent's directions (rotates the editor's repairs).
    index: usize,
    parent: HarnessSpec,
    direction: Direction,
    failed: BTreeSet<String>,
    solved: BTreeSet<String>,
    /// The parent's episodes of the round (what a learned editor reads).
    rows: std::sync::Arc<Vec<Trajectory>>,
}

/// Steps 2a–b: every parent on the round's fresh tasks, its failures diagnosed and formed
/// into directions; at most `budget` plans, round-robin over parents. Also returns how
/// many directions were formed.
async fn plan_round(
    ctx: &EvolveContext<'_>,
    input: &EvolveInput,
    round: u32,
    parents: &[HarnessSpec],
    tasks: &[String],
    budget: u32,
) -> Result<(Vec<Plan>, usize), EvolveError> {
    let s = &input.settings;
    let per_parent = (budget as usize).div_ceil(parents.len().max(1));
    let mut per_parent_plans: Vec<Vec<Plan>> = Vec::new();
    let mut directions = 0;
    for parent in parents {
        let rows = batch(ctx, input, "train", round, parent, tasks, Split::Train).await?;
        let ok = solved(&rows);
        let failed: BTreeSet<String> = rows.iter().filter(|r| !r.success).map(|r| r.task_id.clone()).collect();
        let diagnoses = ctx.diagnoser.diagnose(&rows).await?;
        let formed = form_directions(&diagnoses, &s.directions, per_parent);
        let formed_here = formed.len();
        directions += formed_here;
        let dirs = again_for_other_mechanisms(formed, per_parent);
        tracing::info!(round, parent = %parent.id, solved = ok.len(), failed = failed.len(), directions = formed_here, proposals = dirs.len(), "parent diagnosed");
        let rows = std::sync::Arc::new(rows);
        per_parent_plans.push(
            dirs.into_iter()
                .enumerate()
                .map(|(index, direction)| Plan {
                    index,
                    parent: parent.clone(),
                    direction,
                    failed: failed.clone(),
                    solved: ok.clone(),
                    rows: rows.clone(),
                })
                .collect(),
        );
    }
    Ok((round_robin(&per_parent_plans, budget as usize), directions))
}

/// `n` directions from the distinct ones formed: when the failures support fewer
/// directions than the parent's share of the budget, each is proposed again, in order, so
/// that the editor tries another mechanism for it (the plan's index rotates the template
/// editor's repairs; Appendix F: "seek different mechanisms, triggers, or recovery
/// strategies"). A child that repeats a member is still dropped as a duplicate.
pub fn again_for_other_mechanisms(distinct: Vec<Direction>, n: usize) -> Vec<Direction> {
    let count = if distinct.is_empty() { 0 } else { n.max(distinct.len()) };
    distinct.iter().cycle().take(count).cloned().collect()
}

/// At most `budget` plans, taking every parent's k-th before any parent's (k+1)-th, so
/// every parent gets proposals before any gets more.
fn round_robin(per_parent: &[Vec<Plan>], budget: usize) -> Vec<Plan> {
    let mut plans = Vec::new();
    for k in 0.. {
        if plans.len() >= budget || per_parent.iter().all(|d| d.len() <= k) {
            break;
        }
        for d in per_parent {
            if plans.len() < budget {
                if let Some(plan) = d.get(k) {
                    plans.push(plan.clone());
                }
            }
        }
    }
    plans
}

/// A version of a child and its local evaluation, or why it is dropped.
type ChildVersion = Result<(HarnessSpec, LocalResult), String>;

/// The editor's child for `req`, measured ([`measure`]).
async fn edit_and_measure(
    ctx: &EvolveContext<'_>,
    input: &EvolveInput,
    round: u32,
    plan: &Plan,
    req: &EditRequest<'_>,
    specs: &BTreeMap<String, HarnessSpec>,
) -> Result<ChildVersion, EvolveError> {
    match ctx.editor.edit(req).await {
        Ok(child) => measure(ctx, input, round, &plan.direction, &plan.failed, &plan.solved, specs, child).await,
        Err(EditError::Backend(e)) => Err(EvolveError::Editor(e)),
        Err(e) => Ok(Err(e.to_string())),
    }
}

/// Steps 2c–d for one plan: the editor's child, validated and evaluated locally, and one
/// revision when the first version fails a check, repairs nothing or regresses a control.
async fn propose(
    ctx: &EvolveContext<'_>,
    input: &EvolveInput,
    round: u32,
    plan: &Plan,
    mut req: EditRequest<'_>,
    specs: &BTreeMap<String, HarnessSpec>,
) -> Result<ChildVersion, EvolveError> {
    let first = edit_and_measure(ctx, input, round, plan, &req, specs).await?;
    let needs_revision = match &first {
        Err(_) => true,
        Ok((_, l)) => l.repaired.is_empty() || !l.regressed.is_empty(),
    };
    if !needs_revision || input.settings.revisions == 0 {
        return Ok(first);
    }
    req.variant += 1;
    // The revision seeks mechanisms the first version did not use.
    if let Ok((first_child, _)) = &first {
        req.earlier.push(first_child.clone());
    }
    req.feedback = Some(revision_feedback(&first));
    let second = edit_and_measure(ctx, input, round, plan, &req, specs).await?;
    Ok(better_version(first, second))
}

/// What a revision is told about the first version.
fn revision_feedback(first: &ChildVersion) -> String {
    match first {
        Err(reason) => format!("invalid: {reason}"),
        Ok((_, l)) => format!(
            "repaired {} of {} targeted tasks; regressed {} of {} controls",
            l.repaired.len(),
            l.targeted.len(),
            l.regressed.len(),
            l.controls.len()
        ),
    }
}

/// The version kept of a first version and its revision: the revision when it is valid and
/// scores higher (repaired minus regressed), or the first is invalid.
fn better_version(first: ChildVersion, second: ChildVersion) -> ChildVersion {
    let score = |l: &LocalResult| l.repaired.len() as i64 - l.regressed.len() as i64;
    match (first, second) {
        (Err(a), Err(b)) => Err(format!("{a}; revision: {b}")),
        (Err(_), Ok((c, mut l))) => {
            l.revised = true;
            Ok((c, l))
        }
        (Ok(first), Err(_)) => Ok(first),
        (Ok(first), Ok((c, mut l))) => {
            if score(&l) > score(&first.1) {
                l.revised = true;
                Ok((c, l))
            } else {
                Ok(first)
            }
        }
    }
}

/// Steps 2c–e of one round: a child per plan; each kept child's V(H) is measured and it
/// joins the pool (Eq. 4). Returns the kept children and how many were rejected.
async fn make_children(
    ctx: &EvolveContext<'_>,
    input: &EvolveInput,
    round: u32,
    plans: &[Plan],
    pool: &mut Pool,
) -> Result<(Vec<Candidate>, usize), EvolveError> {
    let briefs: Vec<String> = plans.iter().map(|p| format!("{} from {}", p.direction.summary, p.parent.id)).collect();
    let mut valid: Vec<Candidate> = Vec::new();
    // Children kept so far this round (so the editor seeks other mechanisms).
    let mut proposed: Vec<HarnessSpec> = Vec::new();
    let mut rejected = 0usize;
    for plan in plans {
        let child_id = pool.child_id(round);
        let others: Vec<String> = briefs.iter().filter(|b| !b.starts_with(&plan.direction.summary)).cloned().collect();
        let req = EditRequest {
            parent: &plan.parent,
            direction: &plan.direction,
            child_id: child_id.clone(),
            generation: plan.parent.generation + 1,
            variant: plan.index + (round as usize - 1),
            feedback: None,
            other_briefs: others,
            earlier: proposed.clone(),
            validate: &ctx.validate,
            evidence: &plan.rows,
        };
        let (child, local) = match propose(ctx, input, round, plan, req, &pool.specs).await? {
            Ok(v) => v,
            Err(reason) => {
                pool.reject(round, &child_id, plan, reason);
                rejected += 1;
                continue;
            }
        };
        proposed.push(child.clone());
        valid.push(add_child(ctx, input, round, plan, &child, local, &mut pool.manifest).await?);
        pool.specs.insert(child.id.clone(), child);
    }
    Ok((valid, rejected))
}

/// Step 2e for a kept child: its V(H) on the validation tasks; it joins the pool.
async fn add_child(
    ctx: &EvolveContext<'_>,
    input: &EvolveInput,
    round: u32,
    plan: &Plan,
    child: &HarnessSpec,
    local: LocalResult,
    manifest: &mut PoolManifest,
) -> Result<Candidate, EvolveError> {
    let rows = batch(ctx, input, "validation", round, child, &input.validation_task_ids, Split::Validation).await?;
    let coverage = solved(&rows);
    put_member(ctx.store, &input.run_id, child).await?;
    tracing::info!(round, child = %child.id, parent = %plan.parent.id, repaired = local.repaired.len(), regressed = local.regressed.len(), validation = coverage.len(), "sibling added to the pool");
    manifest.members.push(PoolEntry {
        id: child.id.clone(),
        parent: Some(plan.parent.id.clone()),
        generation: child.generation,
        round,
        direction: child.direction.clone(),
        causes: plan.direction.causes.clone(),
        version: child.version_hash(),
        editor: ctx.editor.name().to_string(),
        local: Some(local),
        validation_coverage: coverage.iter().cloned().collect(),
        selected_as_parent: false,
        origin_run: input.run_id.clone(),
    });
    Ok(Candidate { id: child.id.clone(), solved: coverage })
}

/// Runs the stage.
pub async fn run(ctx: &EvolveContext<'_>, input: &EvolveInput) -> Result<EvolveOutput, EvolveError> {
    check_input(input)?;
    let s = &input.settings;
    let mut pool = start_pool(ctx, input).await?;
    pool.manifest.validation_tasks = input.validation_task_ids.clone();
    let mut parents = pool.parents(s.parent_slots);
    measure_uncovered(ctx, input, &mut pool).await?;

    let rounds_total = s.proposal_budgets.len();
    let mut rounds = Vec::new();
    let mut stopped = None;
    for (ri, budget) in s.proposal_budgets.iter().enumerate() {
        let round = ri as u32 + 1;
        let Some(tasks) = round_tasks(&input.train_task_ids, rounds_total, ri + 1) else {
            let why = format!(
                "the training split ran out: {} task(s) give fresh tasks to {ri} of {rounds_total} rounds (give evolution at least {rounds_total} training tasks, or fewer proposal_budgets)",
                input.train_task_ids.len()
            );
            tracing::warn!(round, "{why}; evolution stops");
            stopped = Some(why);
            break;
        };
        tracing::info!(round, parents = parents.len(), tasks = tasks.len(), budget, "evolve round started");
        let (plans, directions) = plan_round(ctx, input, round, &parents, &tasks, *budget).await?;
        let (valid, rejected) = make_children(ctx, input, round, &plans, &mut pool).await?;

        // 2f: parent selection (Eq. 3).
        let selection = select_parents(&valid, s.parent_slots);
        for m in pool.manifest.members.iter_mut() {
            m.selected_as_parent = selection.as_ref().is_some_and(|sel| sel.parents.contains(&m.id));
        }
        save_manifest(ctx.store, &mut pool.manifest).await?;
        let summary = RoundSummary {
            round,
            parents: parents.iter().map(|p| p.id.clone()).collect(),
            directions,
            proposals: plans.len(),
            valid: valid.iter().map(|c| c.id.clone()).collect(),
            rejected,
            selected: selection.as_ref().map(|s| s.parents.clone()).unwrap_or_default(),
            covered: selection.as_ref().map(|s| s.covered.len()).unwrap_or(0),
        };
        tracing::info!(round, valid = summary.valid.len(), rejected, selected = ?summary.selected, covered = summary.covered, "evolve round done");
        rounds.push(summary);
        match selection {
            Some(sel) => parents = sel.parents.iter().map(|id| pool.specs[id].clone()).collect(),
            None => {
                tracing::info!(round, "no valid child this round; evolution stops");
                if ri + 1 < rounds_total {
                    stopped = Some(format!("round {round} made no valid child, so no round after it had parents"));
                }
                break;
            }
        }
    }
    Ok(EvolveOutput { manifest: pool.manifest, rounds, stopped })
}

#[cfg(test)]
mod tests {
    use super::{again_for_other_mechanisms, round_tasks, Direction};

    #[test]
    fn a_budget_beyond_the_directions_proposes_each_again() {
        let dir = |c: &str| Direction { causes: vec![c.to_string()], support: Default::default(), summary: c.to_string() };
        let causes = |v: &[Direction]| v.iter().map(|d| d.summary.clone()).collect::<Vec<_>>();
        assert_eq!(causes(&again_for_other_mechanisms(vec![dir("a"), dir("b")], 5)), ["a", "b", "a", "b", "a"]);
        assert_eq!(causes(&again_for_other_mechanisms(vec![dir("a"), dir("b")], 1)), ["a", "b"], "never fewer than formed");
        assert!(again_for_other_mechanisms(vec![], 5).is_empty(), "no direction, no proposal");
    }

    #[test]
    fn rounds_get_fresh_tasks_and_none_once_the_split_runs_out() {
        let train: Vec<String> = (0..7).map(|i| format!("t{i}")).collect();
        let rounds: Vec<Vec<String>> = (1..=3).map(|r| round_tasks(&train, 3, r).unwrap()).collect();
        assert_eq!(rounds.iter().map(Vec::len).collect::<Vec<_>>(), [3, 3, 1]);
        let all: std::collections::BTreeSet<&String> = rounds.iter().flatten().collect();
        assert_eq!(all.len(), 7, "no task in two rounds");
        // Two tasks for three rounds: the third round has none left, and none repeats.
        let two = &train[..2];
        assert_eq!(round_tasks(two, 3, 1).unwrap(), ["t0"]);
        assert_eq!(round_tasks(two, 3, 2).unwrap(), ["t1"]);
        assert_eq!(round_tasks(two, 3, 3), None);
        assert_eq!(round_tasks(&[], 1, 1), None);
    }
}
