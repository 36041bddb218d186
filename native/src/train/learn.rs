//! The learn job: one GRPO update of a run's policy from the retained groups of a step.
//!
//! 1. If step n's checkpoint is already complete, the job is a redelivery: return it.
//! 2. Start from the run's latest complete checkpoint, or from the base model when the run
//!    has none yet.
//! 3. Read `groups/step=<n>/` and `trajectories/step=<n>/`, keep the retained groups, and
//!    turn their trajectories into samples (each policy turn in its own harness context).
//! 4. Update (Appendix B) and write `checkpoints/step=<n>/` with the manifest last.
//! 5. Apply `[checkpoints]` retention to the steps before ([`crate::train::retention`]); a
//!    redelivered job applies it again, so an interrupted prune finishes.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::train::checkpoint::{self, SaveInfo};
use crate::train::learner::{data, Learner, LearnerConfig, StepMetrics};
use crate::NativeError;
use infra::store::ObjectStore;
use infra::table::{read_committed, read_prefix};
use schemas::{Group, Trajectory};

/// Input of a learn job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LearnInput {
    pub run_id: String,
    /// The step whose retained groups are trained on; the checkpoint gets this step.
    pub step: u32,
    /// GGUF file or HF directory of the starting policy (used while the run has no
    /// checkpoint yet).
    pub base_model: PathBuf,
    #[serde(default)]
    pub learner: LearnerConfig,
    /// Position in the task stream after this step, recorded in the manifest.
    #[serde(default)]
    pub data_cursor: u64,
    /// `cpu` or `cuda` (`cuda:N` for a given GPU).
    #[serde(default = "default_device")]
    pub device: String,
    /// Learn steps a trained row's weights may lag behind the learner's starting weights
    /// (0: on-policy only); older rows are refused ([`data::check_staleness`]).
    #[serde(default)]
    pub max_off_policy_steps: u32,
    /// `[checkpoints]`: the weights' dtype and which earlier checkpoints stay.
    #[serde(default)]
    pub checkpoints: crate::train::retention::Retention,
    /// The step with the best H0 validation success so far (kept by `keep_best`).
    #[serde(default)]
    pub best_step: Option<u32>,
    /// `[algorithm] rescue_context`: the context rescue rows are scored in, with what H0's
    /// re-rendering needs.
    #[serde(default)]
    pub rescue_context: data::RescueContext,
}

fn default_device() -> String {
    "cpu".into()
}

/// Result of a learn job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LearnOutput {
    pub manifest_key: String,
    /// Manifest key of the checkpoint the update started from (None: the base model).
    pub parent: Option<String>,
    pub metrics: StepMetrics,
    /// True when the checkpoint already existed (redelivered job): nothing was trained.
    pub already_done: bool,
    /// Whether this step trained any policy token.
    pub trained: bool,
    /// The step whose checkpoint holds the weights after this step (`None`: still the base
    /// model). Later rollouts load these weights.
    pub weights_step: Option<u32>,
}

pub async fn run(store: &dyn ObjectStore, input: &LearnInput) -> Result<LearnOutput, NativeError> {
    let device = crate::device::parse(&input.device)?;
    if device.is_cuda() && !tch::Cuda::is_available() {
        return Err(NativeError::Config {
            field: "device".into(),
            detail: "CUDA is not available to libtorch; build with `--features cuda` against a CUDA libtorch, or use `cpu`".into(),
        });
    }
    let latest = checkpoint::latest(store, &input.run_id).await?;
    if let Some(m) = &latest {
        if m.step == input.step {
            crate::train::retention::prune(store, &input.run_id, &input.checkpoints, input.best_step).await?;
            return Ok(LearnOutput {
                manifest_key: checkpoint::manifest_key(&input.run_id, m.step),
                parent: m.parent.clone(),
                metrics: StepMetrics::from_map(&m.metrics),
                already_done: true,
                trained: m.trained,
                weights_step: m.weights_step,
            });
        }
        if m.step > input.step {
            return Err(NativeError::Input(format!(
                "run `{}` already has a checkpoint at step {}, after the requested step {}; learn jobs must run in step order",
                input.run_id, m.step, input.step
            )));
        }
    }

    let (mut learner, tokenizer, parent) = match latest.as_ref().filter(|m| m.weights_step.is_some()) {
        Some(m) => {
            let loaded = checkpoint::load(store, &input.run_id, m.step, device, input.learner.clone()).await?;
            let tok = match loaded.tokenizer {
                Some(t) => t,
                None => crate::model::loader::load_tokenizer(&input.base_model)?,
            };
            (loaded.learner, tok, Some(checkpoint::manifest_key(&input.run_id, m.step)))
        }
        None => {
            let (model, tok) = crate::model::loader::load(&input.base_model, device)?;
            let parent = latest.as_ref().map(|m| checkpoint::manifest_key(&input.run_id, m.step));
            (Learner::from_base(model, input.learner.clone())?, tok, parent)
        }
    };

    let (groups, trajectories) = read_step(store, &input.run_id, input.step).await?;
    let retained: std::collections::BTreeSet<&str> =
        groups.iter().filter(|g| g.retained).flat_map(|g| g.trajectory_ids.iter().map(String::as_str)).collect();
    let start = latest.as_ref().and_then(|m| m.weights_step);
    data::check_staleness(
        &input.run_id,
        start,
        input.max_off_policy_steps,
        trajectories.iter().filter(|t| retained.contains(t.trajectory_id.as_str())),
    )?;
    let batch = data::batch_from_groups(&groups, &trajectories, &tokenizer, &input.rescue_context)?;
    tracing::info!(run = %input.run_id, step = input.step, tasks = batch.tasks.len(), samples = batch.samples.len(), "learn job: training on retained groups");
    let metrics = learner.update(&batch)?;

    let info = SaveInfo {
        run_id: input.run_id.clone(),
        step: input.step,
        parent: parent.clone(),
        data_cursor: input.data_cursor,
        metrics: metrics.to_map(),
        dtype: input.checkpoints.dtype,
        base_model: input.base_model.display().to_string(),
    };
    if metrics.policy_tokens == 0 {
        // Nothing to train: say so, and record the step without copying unchanged weights.
        let weights_step = latest.as_ref().and_then(|m| m.weights_step);
        tracing::warn!(
            run = %input.run_id,
            step = input.step,
            tasks = batch.tasks.len(),
            weights = %weights_step.map(|w| format!("step {w}")).unwrap_or_else(|| "the base model".into()),
            "learn step trained nothing: no retained group has a policy token; the weights stay as they were"
        );
        let key = checkpoint::save_untrained(store, &info, weights_step, learner.rng_state(), learner.model.architecture()).await?;
        crate::train::retention::prune(store, &input.run_id, &input.checkpoints, input.best_step).await?;
        return Ok(LearnOutput { manifest_key: key, parent, metrics, already_done: false, trained: false, weights_step });
    }
    let manifest_key = checkpoint::save(store, &learner, Some(&tokenizer), &info).await?;
    crate::train::retention::prune(store, &input.run_id, &input.checkpoints, input.best_step).await?;
    Ok(LearnOutput { manifest_key, parent, metrics, already_done: false, trained: true, weights_step: Some(input.step) })
}

/// The groups of step `step` and the committed trajectories they name: what a learn job
/// of that step trains on (its retained groups), and what `bench learner --replay` replays.
pub async fn read_step(store: &dyn ObjectStore, run_id: &str, step: u32) -> Result<(Vec<Group>, Vec<Trajectory>), NativeError> {
    let groups: Vec<Group> = read_prefix(store, &schemas::keys::groups_of_step(run_id, step)).await?;
    let trajectories: Vec<Trajectory> = read_committed(store, run_id, &schemas::keys::trajectories_of_step(run_id, step, None)).await?;
    Ok((groups, trajectories))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::qwen3_5::{Qwen35, Qwen35Config};
    use crate::model::tokenizer::word_level;
    use crate::model::{CausalLm, Llama, LlamaConfig, Model};
    use infra::store::LocalStore;
    use infra::table::write_records;
    use schemas::{RetainedKind, Role, RolloutKind, Split, Termination, Turn, TurnSource};
    use tch::Device;

    const WORDS: [&str; 8] = ["user", "assistant", "system", "count", "rows", "answer", "yes", "no"];

    /// Writes rollout rows of run `r` as the job `x` would: the part, then its done-marker.
    async fn write_committed(store: &LocalStore, key: &str, rows: &[Trajectory]) {
        use infra::store::ObjectStore;
        let part = write_records(store, key, rows).await.unwrap();
        let marker = schemas::DoneMarker::new("x", "r", schemas::JobKind::Rollout, 0, vec![part], serde_json::json!({}));
        infra::store::commit(store as &dyn ObjectStore, &schemas::keys::done_marker("r", "x"), &marker).await.unwrap();
    }

    fn turn(index: u32, role: Role, source: TurnSource, text: &str, ids: Vec<u32>) -> Turn {
        let n = ids.len();
        Turn {
            index,
            role,
            source,
            text: text.into(),
            logprobs: if source == TurnSource::Policy { vec![-2.0; n] } else { vec![] },
            loss_mask: vec![source == TurnSource::Policy; n],
            token_ids: ids,
            tool_name: None,
            tool_args: None,
            hook_id: None,
            prompt_token_count: 0,
            prompt_hash: None,
        }
    }

    fn trajectory(id: &str, reward: f64, answer: u32) -> Trajectory {
        Trajectory {
            trajectory_id: id.into(),
            run_id: "r".into(),
            job_id: "j".into(),
            step: 1,
            kind: RolloutKind::Rescue,
            split: Split::Train,
            task_id: "t1".into(),
            task_type: "counting".into(),
            group_id: "g1".into(),
            attempt: 0,
            harness_id: "h1".into(),
            harness_version: "v".into(),
            policy_checkpoint: "base".into(),
            seed: 0,
            reward,
            success: reward > 0.0,
            termination: Termination::Committed,
            error_class: None,
            error_message: None,
            prompt_tokens: 0,
            completion_tokens: 1,
            harness_tokens: 2,
            model_calls: 1,
            env_actions: 0,
            started_at_ms: 0,
            duration_ms: 0,
            policy_ms: 0,
            env_ms: 0,
            temperature: 1.0,
            tool_view: String::new(),
            turns: vec![
                turn(0, Role::System, TurnSource::Harness, "answer yes or no", vec![]),
                turn(1, Role::User, TurnSource::Env, "count rows", vec![]),
                turn(2, Role::Assistant, TurnSource::Policy, if answer == 10 { "yes" } else { "no" }, vec![answer]),
            ],
        }
    }

    /// A tiny random llama of `vocab` tokens.
    fn llama(vocab: i64) -> Model {
        Llama::new(LlamaConfig::tiny(vocab, 64, 2), Device::Cpu, 4).unwrap().into()
    }

    /// A tiny random Qwen3.5 (GDN and gated attention layers) of `vocab` tokens.
    fn qwen3_5(vocab: i64) -> Model {
        Qwen35::new(Qwen35Config::shape("tiny", Some(vocab)).unwrap(), Device::Cpu, 4).unwrap().into()
    }

    /// A store, the word-level tokenizer and a tiny random llama saved as an HF directory
    /// (the base model).
    fn fixture() -> (tempfile::TempDir, LocalStore, crate::model::tokenizer::Tokenizer, std::path::PathBuf) {
        fixture_of(llama)
    }

    /// [`fixture`] with a base model of another family.
    fn fixture_of(make: fn(i64) -> Model) -> (tempfile::TempDir, LocalStore, crate::model::tokenizer::Tokenizer, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalStore::new(dir.path().join("store")).unwrap();
        let tok = word_level(&WORDS);
        let model = make(tok.vocab_size() as i64);
        let base = dir.path().join("base");
        std::fs::create_dir_all(&base).unwrap();
        std::fs::write(base.join("config.json"), model.config_json().to_string()).unwrap();
        std::fs::write(base.join("model.safetensors"), crate::model::hf::write_safetensors(&model.named_tensors()).unwrap()).unwrap();
        std::fs::write(base.join("tokenizer.json"), tok.to_json().unwrap()).unwrap();
        (dir, store, tok, base)
    }

    /// A learn job reads the retained group of a step, trains, writes a complete
    /// checkpoint, raises the rewarded answer's probability, and is a no-op when redelivered.
    #[tokio::test]
    async fn learn_job_trains_on_retained_groups_and_checkpoints() {
        learn_job_trains(llama).await;
    }

    /// The same with a Qwen3.5 base model: its checkpoint keeps transformers' names and the
    /// base folder's `config.json`, and reloads as the trained model.
    #[tokio::test]
    async fn learn_job_trains_qwen3_5() {
        let dir = learn_job_trains(qwen3_5).await;
        let ckpt = dir.path().join("store/runs/r/checkpoints/step=1");
        let config: serde_json::Value = serde_json::from_slice(&std::fs::read(ckpt.join("config.json")).unwrap()).unwrap();
        let base: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.path().join("base/config.json")).unwrap()).unwrap();
        assert_eq!(config, base);
        let names = |m: &Model| m.named_tensors().into_iter().map(|(n, _)| n).collect::<Vec<_>>();
        let (trained, _) = crate::model::loader::load(&ckpt, Device::Cpu).unwrap();
        assert!(matches!(trained, Model::Qwen35(_)));
        assert!(names(&trained).contains(&"model.layers.0.linear_attn.in_proj_qkv.weight".to_string()));
        assert_eq!(names(&trained), names(&qwen3_5(WORDS.len() as i64 + 3)));
    }

    async fn learn_job_trains(make: fn(i64) -> Model) -> tempfile::TempDir {
        learn_job_trains_with(make, None).await
    }

    /// A LoRA learn job: the checkpoint is the adapter in PEFT's layout over the base folder
    /// (no full weights), it reloads as an adapter to train on (AdamW state of the adapter
    /// only) and merged to sample, and a run that does not train an adapter is refused it.
    #[tokio::test]
    async fn a_lora_learn_job_trains_the_adapter_and_checkpoints_it_as_peft_does() {
        let adapter = crate::model::lora::AdapterConfig::lora(4, 8.0, &["all-linear"]);
        let dir = learn_job_trains_with(llama, Some(adapter.clone())).await;
        let ckpt = dir.path().join("store/runs/r/checkpoints/step=1");
        let mut files: Vec<String> =
            std::fs::read_dir(&ckpt).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        files.sort();
        assert_eq!(
            files,
            [
                "adapter_config.json",
                "adapter_model.safetensors",
                "config.json",
                "manifest.json",
                "optimizer.safetensors",
                "tokenizer.json",
                "tokenizer_config.json"
            ]
        );
        let peft: serde_json::Value = serde_json::from_slice(&std::fs::read(ckpt.join("adapter_config.json")).unwrap()).unwrap();
        assert_eq!((peft["peft_type"].as_str(), peft["r"].as_i64()), (Some("LORA"), Some(4)));
        assert_eq!(peft["base_model_name_or_path"].as_str().unwrap(), dir.path().join("base").display().to_string());
        let store = LocalStore::new(dir.path().join("store")).unwrap();
        let with = |adapter| LearnerConfig { adapter, ..Default::default() };
        let loaded = checkpoint::load(&store, "r", 1, Device::Cpu, with(Some(adapter.clone()))).await.unwrap();
        // AdamW's state is the adapter's: two factors of each of 2 × 7 layers
        assert_eq!(loaded.learner.optim.exp_avg.len(), 28);
        assert!(loaded.learner.optim.exp_avg.keys().all(|k| k.contains(".lora_")));
        let err = checkpoint::load(&store, "r", 1, Device::Cpu, with(None)).await.err().unwrap().to_string();
        assert!(err.contains("learner.adapter") && err.contains("LoRA adapter"), "{err}");
        // sampled merged: what the adapted model computes
        let (merged, _, _) = checkpoint::load_model(&store, "r", 1, Device::Cpu).await.unwrap();
        assert!(!crate::model::lora::is_adapted(&merged));
        let samples = vec![crate::train::learner::Sample::plain(0, &[1, 4, 6], &[10, 11], 1.0)];
        let (a, b) = (loaded.learner.score(&samples), Learner::new(merged, LearnerConfig::default()).score(&samples));
        for (x, y) in a[0].iter().zip(&b[0]) {
            assert!((x - y).abs() < 1e-5, "{a:?} vs {b:?}");
        }
    }

    async fn learn_job_trains_with(make: fn(i64) -> Model, adapter: Option<crate::model::lora::AdapterConfig>) -> tempfile::TempDir {
        let lora = adapter.is_some();
        let (dir, store, tok, base) = fixture_of(make);

        // "yes" (id 10) succeeds, "no" (id 11) fails; a dropped group must be ignored
        let mut trajs = vec![trajectory("a", 1.0, 10), trajectory("b", 0.0, 11), trajectory("c", 0.0, 11), trajectory("d", 0.0, 11)];
        for t in &mut trajs {
            data::fingerprint(t, &tok).unwrap();
        }
        write_committed(&store, "runs/r/trajectories/step=1/kind=rescue/part-x.parquet", &trajs).await;
        let group = |id: &str, retained: bool, ids: Vec<&str>| Group {
            run_id: "r".into(),
            step: 1,
            group_id: id.into(),
            task_id: "t1".into(),
            split: Split::Train,
            k: ids.len() as u32,
            base_successes: 0,
            rescue_fired: true,
            rescue_strategy: "router".into(),
            harnesses: vec!["h1".into(); ids.len()],
            rescue_successes: 1,
            retained,
            retained_kind: if retained { RetainedKind::Rescue } else { RetainedKind::None },
            filter_reason: None,
            mean_reward: 0.25,
            reward_std: 0.433,
            advantages: vec![],
            trajectory_ids: ids.into_iter().map(String::from).collect(),
            policy_tokens: 3,
        };
        let groups = vec![group("g1", true, vec!["a", "b", "c"]), group("g2", false, vec!["missing"])];
        write_records(&store, "runs/r/groups/step=1/part-x.parquet", &groups).await.unwrap();

        let input = LearnInput {
            run_id: "r".into(),
            step: 1,
            base_model: base.clone(),
            learner: LearnerConfig {
                optimizer: crate::train::learner::AdamWConfig { lr: 1e-2, ..Default::default() },
                adapter: adapter.clone(),
                ..Default::default()
            },
            data_cursor: 4,
            device: "cpu".into(),
            max_off_policy_steps: 0,
            checkpoints: Default::default(),
            best_step: None,
            rescue_context: Default::default(),
        };
        let out = run(&store, &input).await.unwrap();
        assert_eq!(out.manifest_key, "runs/r/checkpoints/step=1/manifest.json");
        assert_eq!(out.metrics.policy_tokens, 3);
        // Eq. 15 divides by every task of the batch, the unretained group's task included
        assert_eq!(out.metrics.tasks, 2);
        assert!(!out.already_done && out.trained);
        assert_eq!(out.weights_step, Some(1));

        let loaded = checkpoint::load(&store, "r", 1, Device::Cpu, LearnerConfig { adapter, ..Default::default() }).await.unwrap();
        assert_eq!(loaded.manifest.data_cursor, 4);
        assert!(loaded.manifest.metrics.contains_key("loss"));
        let ctx = tok
            .encode_chat(&[
                jobs::policy::Message::new(Role::System, "answer yes or no"),
                jobs::policy::Message::new(Role::User, "count rows"),
            ])
            .unwrap();
        let before = Learner::new(crate::model::hf::load_model(&base, Device::Cpu).unwrap(), LearnerConfig::default());
        let (p0, p1) = (before.sequence_logprob(&ctx, &[10]), loaded.learner.sequence_logprob(&ctx, &[10]));
        assert!(p1 > p0, "log p(yes) should rise: {p0} → {p1}");
        if lora {
            let again = run(&store, &input).await.unwrap();
            assert!(again.already_done);
            return dir;
        }
        // the checkpoint folder is an HF model directory
        let reloaded = crate::model::loader::load(&dir.path().join("store/runs/r/checkpoints/step=1"), Device::Cpu).unwrap();
        assert_eq!(
            reloaded.1.encode_chat(&[jobs::policy::Message::new(Role::User, "count rows")]).unwrap(),
            tok.encode_chat(&[jobs::policy::Message::new(Role::User, "count rows")]).unwrap()
        );

        let again = run(&store, &input).await.unwrap();
        assert!(again.already_done);
        assert_eq!(again.metrics.policy_tokens, 3, "a redelivery reports the recorded metrics");
        dir
    }

    /// A step whose groups have no reward contrast trains nothing: it says so, writes a
    /// manifest without weights that names the weights still in use, and the next step
    /// trains from them.
    #[tokio::test]
    async fn a_step_with_nothing_to_train_writes_no_weights() {
        let (_dir, store, tok, base) = fixture();
        let group = |step: u32, retained: bool, ids: &[&str]| {
            let mut trajs: Vec<Trajectory> = ids
                .iter()
                .enumerate()
                .map(|(i, id)| Trajectory { step, ..trajectory(id, if retained && i == 0 { 1.0 } else { 0.0 }, 10 + (i as u32 % 2)) })
                .collect();
            for t in &mut trajs {
                data::fingerprint(t, &tok).unwrap();
            }
            let g = Group {
                run_id: "r".into(),
                step,
                group_id: format!("g{step}"),
                task_id: "t1".into(),
                split: Split::Train,
                k: ids.len() as u32,
                base_successes: 0,
                rescue_fired: false,
                rescue_strategy: "none".into(),
                harnesses: vec!["h0".into(); ids.len()],
                rescue_successes: 0,
                retained,
                retained_kind: RetainedKind::Base,
                filter_reason: None,
                mean_reward: 0.0,
                reward_std: 0.0,
                advantages: vec![],
                trajectory_ids: ids.iter().map(|s| s.to_string()).collect(),
                policy_tokens: ids.len() as u64,
            };
            (trajs, g)
        };
        let (t1, g1) = group(1, false, &["a1", "b1"]);
        let (t2, g2) = group(2, true, &["a2", "b2"]);
        for (step, t, g) in [(1, t1, g1), (2, t2, g2)] {
            write_committed(&store, &format!("runs/r/trajectories/step={step}/kind=base/part-x.parquet"), &t).await;
            write_records(&store, &format!("runs/r/groups/step={step}/part-x.parquet"), &[g]).await.unwrap();
        }
        let input = |step| LearnInput {
            run_id: "r".into(),
            step,
            base_model: base.clone(),
            learner: LearnerConfig::default(),
            data_cursor: 0,
            device: "cpu".into(),
            max_off_policy_steps: 0,
            checkpoints: Default::default(),
            best_step: None,
            rescue_context: Default::default(),
        };
        let first = run(&store, &input(1)).await.unwrap();
        assert!(!first.trained && first.weights_step.is_none() && first.metrics.policy_tokens == 0, "{first:?}");
        let listed: Vec<String> = store.list("runs/r/checkpoints/").await.unwrap().into_iter().map(|m| m.key).collect();
        assert_eq!(listed, vec!["runs/r/checkpoints/step=1/manifest.json".to_string()], "no weights for an untrained step");
        let m = checkpoint::latest(&store, "r").await.unwrap().unwrap();
        assert!(!m.trained && m.files.is_empty());
        let second = run(&store, &input(2)).await.unwrap();
        assert!(second.trained && second.weights_step == Some(2) && second.metrics.policy_tokens > 0, "{second:?}");
        assert_eq!(second.parent.as_deref(), Some("runs/r/checkpoints/step=1/manifest.json"));
    }
}
