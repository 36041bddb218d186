//! An editor run (`[editor_training]`, Harness-R1 §3.2, Algorithm 1), read top to bottom:
//!
//! 1. `packets`: the frozen target (`[policy]`, never trained here) runs the parent harness
//!    once on each train task; its failures are cut into trace packets
//!    ([`jobs::evolve::packet`]) and stored under `runs/<run>/packets/`.
//! 2. For each step u: `update:u:edit` sends one edit job per packet of the step
//!    ([`jobs::edit`]): the editor of checkpoint u − 1 writes G patches, each valid one is
//!    rerun by the target with the parent's seed, and each patch earns Eq. 1; then
//!    `update:u:learn` is the ordinary learn job, which trains the editor on the packets'
//!    groups (Eq. 3 advantages) and writes checkpoint u, the editor's weights.
//! 3. `report`: valid-patch rate, mean reward and the best patch per step, with a plot.
//!
//! Every unit is a job with a deterministic id, so a resumed run redoes nothing.

use anyhow::{bail, Context};
use infra::table::{read_committed, read_records, write_records};
use jobs::edit::{best_patch, EditInput, EditSummary};
use jobs::policy::Constrain;
use jobs::policy::SamplingParams;
use jobs::rollout::RolloutInput;
use schemas::{job_id, keys, JobIdParts, JobKind, PatchRecord, RolloutKind, Split, TracePacket};

use super::machine::{unit_seed, Scheduler};
use super::spec::EditorTrainingSection;
use super::stage::{Stage, UpdatePart};
use super::state::RunState;
use handlers::{EditJob, RolloutJob};

/// The packet part of a run (one, written by the packets stage).
fn packets_key(run_id: &str) -> String {
    keys::packet_part(run_id, "packets")
}

impl Scheduler {
    fn editor_training(&self) -> anyhow::Result<&EditorTrainingSection> {
        self.spec().editor_training.as_ref().context("the run has no [editor_training] section")
    }

    /// The harness the editor repairs.
    fn editor_parent(&self) -> anyhow::Result<schemas::HarnessSpec> {
        let e = self.editor_training()?;
        self.inputs.harness(&e.parent).with_context(|| {
            format!(
                "editor_training.parent: `{}` is neither h0 nor a member of the run's pool ({})",
                e.parent,
                self.inputs.stored.pool.join(", ")
            )
        })
    }

    /// Stage 1: the target under the parent on the train tasks, one job per task (all with
    /// one seed, which the reruns reuse), cut into packets.
    pub(super) async fn packets(&self, st: &mut RunState) -> anyhow::Result<()> {
        let e = self.editor_training()?;
        let parent = self.editor_parent()?;
        let mut tasks = self.inputs.task_ids(Split::Train);
        if let Some(n) = e.train_tasks {
            tasks.truncate(n as usize);
        }
        let seed = unit_seed(self.spec().run.seed, &["packets"]);
        let jobs = tasks
            .iter()
            .map(|task| {
                let id = job_id(&JobIdParts {
                    run_id: self.run_id(),
                    stage: "packets",
                    task_id: task,
                    harness_id: &parent.id,
                    attempt_index: 1,
                    seed,
                    ..Default::default()
                });
                let input = RolloutInput {
                    run_id: self.run_id().to_string(),
                    step: 0,
                    kind: RolloutKind::Eval,
                    split: Split::Train,
                    task_ids: vec![task.clone()],
                    harness: parent.clone(),
                    attempts: 1,
                    seed,
                    budgets: self.episode_budgets(),
                    sampling: self.sampling(),
                    concurrency: 1,
                };
                let payload = RolloutJob { input, checkpoint_step: None };
                self.envelope(id, JobKind::Eval, serde_json::to_value(payload).expect("payloads serialise"))
            })
            .collect();
        let rows = self.rollouts(&Stage::Packets.to_string(), jobs, st).await?;
        let packets = jobs::evolve::packet::packets(self.run_id(), &rows, &e.packet_settings());
        let solved = rows.iter().filter(|r| r.success).count();
        if packets.is_empty() {
            bail!(
                "the target failed none of the {} train tasks under `{}` (it solved {solved}; the rest ended on infrastructure or server errors): there is nothing for an editor to repair; give more tasks or a weaker parent",
                rows.len(),
                parent.id
            );
        }
        write_records(self.store.as_ref(), &packets_key(self.run_id()), &packets).await?;
        tracing::info!(packets = packets.len(), tasks = rows.len(), solved, parent = %parent.id, "trace packets cut from the target's episodes");
        let values = [("packets", packets.len() as f64), ("parent_success", solved as f64 / rows.len().max(1) as f64)];
        self.write_metrics(0, "packets", &values, st).await
    }

    /// Step u: one edit job per packet of the step, the editor at checkpoint u − 1.
    pub(super) async fn edit(&self, u: u32, st: &mut RunState) -> anyhow::Result<()> {
        let e = self.editor_training()?;
        let parent = self.editor_parent()?;
        let packets: Vec<TracePacket> = read_records(self.store.as_ref(), &packets_key(self.run_id())).await?;
        let n = packets.len();
        let first = (u as usize - 1) * e.packets_per_step as usize;
        let chosen: Vec<&TracePacket> = (0..(e.packets_per_step as usize).min(n)).map(|i| &packets[(first + i) % n]).collect();
        let editor_step = st.latest_checkpoint;
        let editor_checkpoint = match editor_step {
            Some(s) => native::train::checkpoint::manifest_key(self.run_id(), s),
            None => self.inputs.stored.editor_model.as_ref().map(|p| p.display().to_string()).unwrap_or_default(),
        };
        // An endpoint editor samples from the editor's latest weights.
        if let Some(config) = e.endpoint_config() {
            if let Some(want) = self.inputs.stored.editor_weights(self.store.as_ref(), editor_step) {
                super::machine::bring_endpoint_to(&config, &want, "editor").await?;
            }
        }
        let jobs = chosen
            .iter()
            .map(|packet| {
                let seed = unit_seed(self.spec().run.seed, &["edit", &u.to_string(), &packet.packet_id]);
                let input = EditInput {
                    run_id: self.run_id().to_string(),
                    step: u,
                    packet: (*packet).clone(),
                    parent: parent.clone(),
                    patches: e.patches,
                    sampling: SamplingParams {
                        temperature: e.temperature,
                        top_p: 1.0,
                        max_tokens: e.max_tokens,
                        seed: None,
                        stop: vec![],
                        constrain: e.constrain.then_some(Constrain::HarnessPatch),
                    },
                    seed,
                    editor_checkpoint: editor_checkpoint.clone(),
                    budgets: self.episode_budgets(),
                    rerun_sampling: self.sampling(),
                    concurrency: self.spec().policy.concurrency() as usize,
                };
                let id = job_id(&JobIdParts {
                    run_id: self.run_id(),
                    stage: "edit",
                    step: u,
                    task_id: &packet.packet_id,
                    seed,
                    ..Default::default()
                });
                self.envelope(id, JobKind::Edit, serde_json::to_value(EditJob { input, editor_step }).expect("payloads serialise"))
            })
            .collect();
        let markers = self.exec.run(self.run_id(), &Stage::Update(u, UpdatePart::Edit).to_string(), jobs).await?;
        let summaries: Vec<EditSummary> = markers
            .iter()
            .map(|m| serde_json::from_value(m.result.clone()).context("reading an edit job's result"))
            .collect::<Result<_, _>>()?;
        let patches: Vec<PatchRecord> =
            read_committed(self.store.as_ref(), self.run_id(), &keys::patches_of_step(self.run_id(), u)).await?;
        let total = patches.len().max(1) as f64;
        let valid = patches.iter().filter(|p| p.valid).count() as f64;
        let best = best_patch(&patches);
        if let Some(b) = best {
            tracing::info!(step = u, reward = b.reward, child = b.child_harness_id.as_deref().unwrap_or(""), "best patch of the step");
        }
        let values = [
            ("patches", patches.len() as f64),
            ("valid_patch_rate", valid / total),
            ("mean_patch_reward", patches.iter().map(|p| p.reward).sum::<f64>() / total),
            ("best_patch_reward", best.map(|b| b.reward).unwrap_or(0.0)),
            ("effective_group_rate", summaries.iter().filter(|s| s.retained).count() as f64 / summaries.len().max(1) as f64),
            ("editor_policy_tokens", summaries.iter().map(|s| s.policy_tokens as f64).sum()),
        ];
        self.write_metrics(u, "edit", &values, st).await
    }
}
