//! What a worker runs for a Harness-S run: the run [`spec`], the run's [`inputs`] in the
//! store, and one handler per job kind. Every rollout-shaped kind (base rollouts, rescue,
//! calibration rollouts, evaluation) goes through [`RolloutHandler`], re-anchoring through
//! [`ReanchorHandler`], evolution through [`EvolveHandler`], the learned editor's edits
//! through [`EditHandler`], learner updates through [`LearnHandler`] and the transfer probe
//! through [`TransferHandler`]. They load the run's inputs from the store once per process
//! and keep the current policy weights loaded between jobs.
//!
//! Failures: an error of the code a handler calls becomes a [`JobFailure`] through
//! [`JobFailure::of`], where the error's type decides retry or dead letter; where a handler
//! overrules that, one line says why. A handler's own refusals (a payload that does not
//! decode, a section the run lacks) and panics are fatal: they fail again the same way.
//!
//! The worker's runtime (`worker`) and the command line with the run's state machine
//! (`harness-s`) both stand on this crate; it knows neither the scheduler nor the CLI.

pub mod harnesses;
pub mod inputs;
pub mod spec;

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use infra::store::ObjectStore;
use jobs::policy::metered::Metered;
use jobs::policy::Policy;
use jobs::rollout::{RolloutContext, RolloutInput};
use schemas::{JobEnvelope, JobKind};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::sync::Mutex;
use worker::{Handler, JobContext, JobFailure, JobOutput, Registry};

use crate::inputs::RunInputs;
use crate::spec::{Backend, DiagnoserKind, EditorKind};

/// What the LLM components of a job spent, by component (`policy`, `profiler`,
/// `diagnoser`, `editor`): the `llm_usage` of its done-marker's result, Table 9's costs.
pub type LlmSpend = std::collections::BTreeMap<String, schemas::LlmUsage>;

/// The `llm_usage` a done-marker's result reports (empty for older markers).
pub fn spend_of(result: &serde_json::Value) -> LlmSpend {
    result.get("llm_usage").and_then(|v| serde_json::from_value(v.clone()).ok()).unwrap_or_default()
}

/// Payload of every rollout-shaped job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RolloutJob {
    pub input: RolloutInput,
    /// Checkpoint step whose weights to use; `None`: the run's starting model.
    pub checkpoint_step: Option<u32>,
}

/// Payload of a re-anchoring job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReanchorJob {
    pub input: jobs::reanchor::ReanchorInput,
    /// Checkpoint step the calibration freezes; `None`: the run's starting model.
    pub checkpoint_step: Option<u32>,
}

/// Payload of an evolve job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EvolveJob {
    pub input: jobs::evolve::EvolveInput,
}

/// Payload of an edit job (Harness-R1): the editor's weights and the job's input.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EditJob {
    pub input: jobs::edit::EditInput,
    /// The run's checkpoint step holding the editor's weights; `None`: its starting weights.
    pub editor_step: Option<u32>,
}

/// Payload of a learn job.
pub type LearnJob = native::train::learn::LearnInput;

/// The payload of a job of a run: it names the run.
trait RunPayload: DeserializeOwned {
    fn run_id(&self) -> &str;
}

impl RunPayload for RolloutJob {
    fn run_id(&self) -> &str {
        &self.input.run_id
    }
}

impl RunPayload for ReanchorJob {
    fn run_id(&self) -> &str {
        &self.input.run_id
    }
}

impl RunPayload for EditJob {
    fn run_id(&self) -> &str {
        &self.input.run_id
    }
}

impl RunPayload for EvolveJob {
    fn run_id(&self) -> &str {
        &self.input.run_id
    }
}

/// A job's payload; one that does not decode fails the job for good (`invalid <kind> payload`):
/// the same bytes fail the same way on every delivery.
fn decode<T: DeserializeOwned>(job: &JobEnvelope) -> Result<T, JobFailure> {
    serde_json::from_value(job.payload.clone()).map_err(|e| JobFailure::Fatal(format!("invalid {} payload: {e}", job.kind)))
}

/// The environments of a run's splits fail to build only from the run's own inputs (task
/// files, an environment URL the spec names): the same on every delivery.
fn envs_failed(e: anyhow::Error) -> JobFailure {
    JobFailure::Fatal(format!("{e:#}"))
}

/// Run inputs and the loaded policy, shared by the handlers of one process.
#[derive(Default)]
pub struct Shared {
    inputs: Mutex<HashMap<String, Arc<RunInputs>>>,
    /// (run, checkpoint step) → policy; only the latest is kept (weights are large).
    policy: Mutex<Option<((String, Option<u32>), Arc<dyn Policy>)>>,
    /// The same for the editor of an editor run (its target is `policy` at step `None`).
    editor: Mutex<Option<((String, Option<u32>), Arc<dyn Policy>)>>,
}

impl Shared {
    /// What every handler of a run's jobs starts with: the job's payload and the run's
    /// inputs.
    async fn open<T: RunPayload>(&self, store: &dyn ObjectStore, job: &JobEnvelope) -> Result<(T, Arc<RunInputs>), JobFailure> {
        let payload: T = decode(job)?;
        let inputs = self.inputs(store, payload.run_id()).await?;
        Ok((payload, inputs))
    }

    async fn inputs(&self, store: &dyn ObjectStore, run_id: &str) -> Result<Arc<RunInputs>, JobFailure> {
        let mut cache = self.inputs.lock().await;
        if let Some(i) = cache.get(run_id) {
            return Ok(i.clone());
        }
        let loaded = RunInputs::load(store, run_id)
            .await
            // Overruled: the inputs' error is untyped (anyhow); retried so that a store blip
            // does not lose the job, and bad inputs dead-letter once the attempts are used.
            .map_err(|e| JobFailure::Retryable(format!("loading the inputs of run `{run_id}`: {e:#}")))?;
        let loaded = Arc::new(loaded);
        cache.insert(run_id.to_string(), loaded.clone());
        Ok(loaded)
    }

    async fn policy(&self, store: &dyn ObjectStore, inputs: &RunInputs, step: Option<u32>) -> Result<Arc<dyn Policy>, JobFailure> {
        let key = (inputs.stored.run_id.clone(), step);
        let mut slot = self.policy.lock().await;
        if let Some((k, p)) = slot.as_ref() {
            if *k == key {
                return Ok(p.clone());
            }
        }
        let p = load_policy(store, inputs, step).await?;
        *slot = Some((key, p.clone()));
        Ok(p)
    }

    /// An editor run's editor: the run's checkpoint `step`, or its starting weights.
    async fn editor(&self, store: &dyn ObjectStore, inputs: &RunInputs, step: Option<u32>) -> Result<Arc<dyn Policy>, JobFailure> {
        let key = (inputs.stored.run_id.clone(), step);
        let mut slot = self.editor.lock().await;
        if let Some((k, p)) = slot.as_ref() {
            if *k == key {
                return Ok(p.clone());
            }
        }
        let spec = inputs.spec();
        let device = native::device::parse(&spec.policy.device).map_err(JobFailure::of)?;
        let path = inputs.stored.editor_model.clone().ok_or_else(|| {
            JobFailure::Fatal(format!("run `{}` has no editor model ([editor_training] model or a native policy.model)", key.0))
        })?;
        let p: Arc<dyn Policy> = match step {
            None => {
                let engine = spec.policy.engine();
                Arc::new(
                    tokio::task::spawn_blocking(move || native::infer::policy::NativePolicy::load(&path, device, engine))
                        .await
                        .map_err(|e| JobFailure::Fatal(format!("loading the editor panicked: {e}")))?
                        .map_err(JobFailure::of)?,
                )
            }
            Some(s) => native_checkpoint(store, &key.0, s, device, &path, spec.policy.engine()).await?,
        };
        *slot = Some((key, p.clone()));
        Ok(p)
    }
}

/// A native policy from the run's checkpoint `step`; the tokenizer from the checkpoint, or
/// from `base_model` when the checkpoint has none.
async fn native_checkpoint(
    store: &dyn ObjectStore,
    run_id: &str,
    step: u32,
    device: native::device::Device,
    base_model: &std::path::Path,
    engine: native::infer::engine::EngineConfig,
) -> Result<Arc<dyn Policy>, JobFailure> {
    let (model, tokenizer, _) = native::train::checkpoint::load_model(store, run_id, step, device).await.map_err(JobFailure::of)?;
    let tokenizer = match tokenizer {
        Some(t) => t,
        None => native::model::loader::load_tokenizer(base_model).map_err(JobFailure::of)?,
    };
    let key = native::train::checkpoint::manifest_key(run_id, step);
    let policy = native::infer::policy::NativePolicy::new(model, tokenizer, key, engine).map_err(JobFailure::of)?;
    Ok(Arc::new(policy))
}

/// Loads the policy a rollout job asks for.
async fn load_policy(store: &dyn ObjectStore, inputs: &RunInputs, step: Option<u32>) -> Result<Arc<dyn Policy>, JobFailure> {
    let spec = inputs.spec();
    match spec.policy.backend {
        Backend::Native => {
            let device = native::device::parse(&spec.policy.device).map_err(JobFailure::of)?;
            match step {
                None => {
                    let path =
                        inputs.stored.base_model.clone().ok_or_else(|| JobFailure::Fatal("native policy without a model path".into()))?;
                    let engine = spec.policy.engine();
                    let policy = tokio::task::spawn_blocking(move || native::infer::policy::NativePolicy::load(&path, device, engine))
                        .await
                        .map_err(|e| JobFailure::Fatal(format!("loading the model panicked: {e}")))?
                        .map_err(JobFailure::of)?;
                    Ok(Arc::new(policy))
                }
                Some(s) => {
                    let base =
                        inputs.stored.base_model.clone().ok_or_else(|| JobFailure::Fatal("native policy without a model path".into()))?;
                    native_checkpoint(store, &inputs.stored.run_id, s, device, &base, spec.policy.engine()).await
                }
            }
        }
        Backend::Openai => {
            if step.is_some() && !spec.policy.syncs_weights() {
                return Err(JobFailure::Fatal(
                    "this rollout asks for a trained checkpoint, but the endpoint policy has no weight sync; set [policy] weight_sync = \"sglang\"".into(),
                ));
            }
            let mut config = spec.policy.openai_config();
            // The scheduler brought the endpoint to these weights before the stage; rows name
            // them unless the server names its own.
            if spec.policy.syncs_weights() {
                config.checkpoint = inputs.stored.served_weights(store, step);
                // under adapter sync the starting weights are the base itself, a trained
                // step its adapter, asked for by name
                if spec.policy.weight_sync == jobs::policy::weight_sync::WeightSync::Lora {
                    match step {
                        Some(_) => config.adapter = Some(jobs::policy::weight_sync::adapter_name(&config.model)),
                        None => config.checkpoint = None,
                    }
                }
            }
            let p = jobs::policy::openai::OpenAiPolicy::new(config).map_err(JobFailure::of)?;
            Ok(Arc::new(p))
        }
    }
}

/// An endpoint model asked for text only (profiler, diagnoser, editor): no log-probabilities.
fn text_model(endpoint: &crate::spec::EndpointSection, field: &str) -> Result<Arc<dyn Policy>, JobFailure> {
    let mut config = endpoint.openai_config();
    config.logprobs = false;
    let p = jobs::policy::openai::OpenAiPolicy::new(config).map_err(|e| JobFailure::of(e).context(field))?;
    Ok(Arc::new(p))
}

/// Runs rollout, rescue, calibration and evaluation jobs.
pub struct RolloutHandler {
    shared: Arc<Shared>,
}

#[async_trait]
impl Handler for RolloutHandler {
    async fn run(&self, ctx: &JobContext, job: &JobEnvelope) -> Result<JobOutput, JobFailure> {
        let store = ctx.store.as_ref();
        let (payload, inputs) = self.shared.open::<RolloutJob>(store, job).await?;
        let policy = self.shared.policy(store, &inputs, payload.checkpoint_step).await?;
        let envs = inputs.env_factory(payload.input.split).map_err(envs_failed)?;
        let rctx =
            RolloutContext { store, policy: policy.as_ref(), envs: envs.as_ref(), job_id: &job.job_id, delivery_attempt: job.attempt };
        let out = jobs::rollout::run(&rctx, &payload.input).await.map_err(JobFailure::of)?;
        Ok(JobOutput { outputs: out.outputs, result: serde_json::to_value(&out.summary).unwrap_or_default(), committed: true })
    }
}

/// Runs re-anchoring jobs (§3.4): paired calibration rollouts (usually already done by
/// the rollout jobs the scheduler fanned out, with the same job ids), validation
/// statistics, statistical and LLM profiles, and the calibration manifest.
pub struct ReanchorHandler {
    shared: Arc<Shared>,
}

#[async_trait]
impl Handler for ReanchorHandler {
    async fn run(&self, ctx: &JobContext, job: &JobEnvelope) -> Result<JobOutput, JobFailure> {
        let store = ctx.store.as_ref();
        let (payload, inputs) = self.shared.open::<ReanchorJob>(store, job).await?;
        let policy = self.shared.policy(store, &inputs, payload.checkpoint_step).await?;
        let envs = inputs.env_factory(schemas::Split::Validation).map_err(envs_failed)?;
        let profiler = inputs.spec().router.profiler.as_ref().map(|e| text_model(e, "router.profiler")).transpose()?;
        let rctx = jobs::reanchor::ReanchorContext {
            store,
            policy: policy.as_ref(),
            envs: envs.as_ref(),
            // The job meters its profiler and reports the tokens in its done-marker.
            profiler: profiler.as_deref(),
            profiler_config: Default::default(),
            job_id: &job.job_id,
            delivery_attempt: job.attempt,
        };
        let out = jobs::reanchor::run(&rctx, &payload.input).await.map_err(JobFailure::of)?;
        let outputs = if out.already_done { vec![] } else { vec![out.manifest.profile_part.clone()] };
        Ok(JobOutput { outputs, result: serde_json::json!({ "calibration_id": out.manifest.calibration_id }), committed: true })
    }
}

/// Runs the evolve stage (§3.2): parents on fresh train tasks, diagnosis, directions,
/// edits, local evaluation, coverage and parent selection, round by round; the pool is
/// written under the run. Each batch of episodes is its own idempotent rollout, so a
/// redelivered evolve job continues where the first delivery stopped.
pub struct EvolveHandler {
    shared: Arc<Shared>,
}

#[async_trait]
impl Handler for EvolveHandler {
    async fn run(&self, ctx: &JobContext, job: &JobEnvelope) -> Result<JobOutput, JobFailure> {
        let store = ctx.store.as_ref();
        let (payload, inputs) = self.shared.open::<EvolveJob>(store, job).await?;
        let Some(settings) = inputs.spec().evolution.clone() else {
            return Err(JobFailure::Fatal(format!("run `{}` has no [evolution] section", payload.input.run_id)));
        };
        let policy = self.shared.policy(store, &inputs, None).await?;
        let envs = inputs.env_factory_over(&[schemas::Split::Train, schemas::Split::Validation]).map_err(envs_failed)?;
        let policy = Metered::new(policy.as_ref());
        let llm = settings.llm.as_ref().map(|e| text_model(e, "evolution.llm")).transpose()?;
        // Diagnoser and editor may share one endpoint; each counts its own calls.
        let (diagnoser_llm, editor_llm) = (llm.as_deref().map(Metered::new), llm.as_deref().map(Metered::new));
        // Appendix F: the diagnoser and editor answer deterministically.
        let greedy =
            jobs::policy::SamplingParams { temperature: 0.0, top_p: 1.0, max_tokens: 512, seed: Some(42), stop: vec![], constrain: None };
        let missing = || JobFailure::Fatal("evolution.llm is required for an LLM diagnoser or editor".into());
        let rule = jobs::evolve::RuleDiagnoser;
        let llm_diagnoser;
        let diagnoser: &dyn jobs::evolve::Diagnoser = if settings.diagnoser == DiagnoserKind::Llm {
            llm_diagnoser = jobs::evolve::LlmDiagnoser { policy: diagnoser_llm.as_ref().ok_or_else(missing)?, sampling: greedy.clone() };
            &llm_diagnoser
        } else {
            &rule
        };
        let template = jobs::evolve::TemplateEditor::default();
        let llm_editor;
        let (learned_policy, learned_editor);
        let mut learned_metered = None;
        let editor: &dyn jobs::evolve::Editor = match settings.editor {
            EditorKind::Llm => {
                llm_editor = jobs::evolve::LlmEditor { policy: editor_llm.as_ref().ok_or_else(missing)?, sampling: greedy };
                &llm_editor
            }
            EditorKind::Learned => {
                let (pinned, l) = inputs.stored.learned_editor.as_ref().zip(settings.learned_editor.as_ref()).ok_or_else(|| {
                    JobFailure::Fatal("editor = \"learned\" without a pinned evolution.learned_editor; resubmit the run".into())
                })?;
                let spec = inputs.spec();
                let device = native::device::parse(&spec.policy.device).map_err(JobFailure::of)?;
                learned_policy =
                    native_checkpoint(store, &pinned.run, pinned.step, device, &pinned.base_model, spec.policy.engine()).await?;
                // Its calls count as the editor's (Table 9).
                let metered = learned_metered.insert(Metered::new(learned_policy.as_ref()));
                let sampling = jobs::policy::SamplingParams {
                    temperature: l.temperature,
                    max_tokens: l.max_tokens,
                    constrain: l.constrain.then_some(jobs::policy::Constrain::HarnessPatch),
                    ..greedy
                };
                learned_editor = jobs::evolve::LearnedEditor {
                    policy: metered,
                    name: jobs::evolve::LearnedEditor::name_of(&pinned.run, pinned.step),
                    sampling,
                    packet: pinned.packet.clone(),
                };
                &learned_editor
            }
            EditorKind::Template => &template,
        };
        let validate = inputs.spec().environment.validate_options();
        let ectx = jobs::evolve::EvolveContext { store, policy: &policy, envs: envs.as_ref(), diagnoser, editor, validate };
        // Rollout, store and endpoint trouble may pass (batches already done are kept); bad
        // input fails the same way again.
        let out = jobs::evolve::run(&ectx, &payload.input).await.map_err(JobFailure::of)?;
        let members: Vec<&str> = out.manifest.members.iter().map(|m| m.id.as_str()).collect();
        // What this delivery spent (a redelivered job counts only its own calls).
        let usage = LlmSpend::from([
            ("policy".to_string(), policy.usage()),
            ("diagnoser".to_string(), diagnoser_llm.as_ref().map(Metered::usage).unwrap_or_default()),
            ("editor".to_string(), editor_llm.as_ref().or(learned_metered.as_ref()).map(Metered::usage).unwrap_or_default()),
        ]);
        Ok(JobOutput {
            outputs: vec![],
            result: serde_json::json!({ "members": members, "rejected": out.manifest.rejected.len(), "rounds": out.rounds, "stopped": out.stopped, "llm_usage": usage }),
            committed: false,
        })
    }
}

/// Runs edit jobs (Harness-R1): the editor of the run's checkpoint writes patches for a
/// trace packet and the frozen target (the run's starting policy) reruns each valid one.
pub struct EditHandler {
    shared: Arc<Shared>,
}

#[async_trait]
impl Handler for EditHandler {
    async fn run(&self, ctx: &JobContext, job: &JobEnvelope) -> Result<JobOutput, JobFailure> {
        let store = ctx.store.as_ref();
        let (payload, inputs) = self.shared.open::<EditJob>(store, job).await?;
        let target = self.shared.policy(store, &inputs, None).await?;
        let editor = match inputs.spec().editor_training.as_ref().and_then(|e| e.endpoint_config()) {
            // The scheduler brought the endpoint to these weights before the step; a reply
            // from others is refused and the weights loaded again.
            Some(mut config) => {
                config.checkpoint = inputs.stored.editor_weights(store, payload.editor_step);
                let p =
                    jobs::policy::openai::OpenAiPolicy::new(config).map_err(|e| JobFailure::of(e).context("editor_training.endpoint"))?;
                Arc::new(p) as Arc<dyn Policy>
            }
            None => self.shared.editor(store, &inputs, payload.editor_step).await?,
        };
        let envs = inputs.env_factory(schemas::Split::Train).map_err(envs_failed)?;
        let validate = inputs.spec().environment.validate_options();
        let ectx = jobs::edit::EditContext {
            store,
            editor: editor.as_ref(),
            target: target.as_ref(),
            envs: envs.as_ref(),
            validate: &validate,
            job_id: &job.job_id,
            delivery_attempt: job.attempt,
        };
        let out = jobs::edit::run(&ectx, &payload.input).await.map_err(JobFailure::of)?;
        Ok(JobOutput { outputs: vec![], result: serde_json::to_value(&out.summary).unwrap_or_default(), committed: true })
    }
}

/// Runs learner updates (GRPO, Appendix B) and writes checkpoints.
pub struct LearnHandler;

#[async_trait]
impl Handler for LearnHandler {
    async fn run(&self, ctx: &JobContext, job: &JobEnvelope) -> Result<JobOutput, JobFailure> {
        let input: LearnJob = decode(job)?;
        on_blocking_thread(ctx, "the learner", move |store| async move { native::train::learn::run(store.as_ref(), &input).await }).await
    }
}

/// Runs the transfer probe (held-out sibling successes scored under H0).
pub struct TransferHandler;

#[async_trait]
impl Handler for TransferHandler {
    async fn run(&self, ctx: &JobContext, job: &JobEnvelope) -> Result<JobOutput, JobFailure> {
        let input: native::train::transfer::TransferInput = decode(job)?;
        on_blocking_thread(
            ctx,
            "the transfer probe",
            move |store| async move { native::train::transfer::run(store.as_ref(), &input).await },
        )
        .await
    }
}

/// Runs a libtorch job (CPU/GPU-bound, its state not `Send`) on a blocking thread that
/// drives the job's own IO to completion; its result is the job's. A store that fails for
/// a moment retries the job, bad input dead-letters it, a panic is fatal.
async fn on_blocking_thread<F, Fut, T>(ctx: &JobContext, what: &str, job: F) -> Result<JobOutput, JobFailure>
where
    F: FnOnce(Arc<dyn infra::store::ObjectStore>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<T, native::NativeError>>,
    T: serde::Serialize + Send + 'static,
{
    let store = ctx.store.clone();
    let handle = tokio::runtime::Handle::current();
    let out = tokio::task::spawn_blocking(move || handle.block_on(job(store)))
        .await
        .map_err(|e| JobFailure::Fatal(format!("{what} panicked: {e}")))?
        .map_err(JobFailure::of)?;
    Ok(JobOutput { outputs: vec![], result: serde_json::to_value(&out).unwrap_or_default(), committed: false })
}

/// Every handler of this build: the diagnostic sleep job plus the Harness-S jobs.
pub fn registry() -> Registry {
    let shared = Arc::new(Shared::default());
    let mut r = Registry::builtin();
    for kind in [JobKind::Rollout, JobKind::Rescue, JobKind::Eval] {
        r.register(kind, RolloutHandler { shared: shared.clone() });
    }
    r.register(JobKind::Reanchor, ReanchorHandler { shared: shared.clone() });
    r.register(JobKind::Evolve, EvolveHandler { shared: shared.clone() });
    r.register(JobKind::Edit, EditHandler { shared: shared.clone() });
    r.register(JobKind::Learn, LearnHandler);
    r.register(JobKind::Transfer, TransferHandler);
    r
}
