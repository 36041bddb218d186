//! A learned harness editor (Harness-R1) end to end: `harness-s run` with
//! `[editor_training]`, on generated DBBench tasks, with the tiny committed policies
//! (tests/data/tiny): the guesser is the frozen target (it answers a counting task right
//! about a third of the time, so reruns differ in reward) and the editor. Decoding in the
//! patch grammar, whose names and texts are capped in length, every reply the guesser starts
//! is a patch the grammar completes within the editor's 512 tokens, whatever it writes. The
//! subject is the machinery, not what a real editor writes. The target's failures under a pool sibling become
//! trace packets; the editor writes patches; invalid ones score 0 and never run; valid
//! ones are rerun with the parent's seed; the learner trains the editor on the patch
//! tokens and writes its checkpoints. The run is SIGKILLed while patches are rerun and
//! resumed: reruns already committed are not run again, and nothing is stored twice. A
//! second run then evolves a pool with the trained editor (`editor = "learned"`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use harness_s_tests::{harness_s, harness_s_bin, repo_root};
use infra::store::open_store;
use infra::table::read_prefix;
use schemas::{Group, MetricRow, PatchRecord, RolloutKind, TracePacket, Trajectory};

/// Run `id` on generated counting tasks (`train` and `validation` of them) with the tiny
/// guesser in process as the frozen target.
fn target(id: &str, train: u32, validation: u32) -> String {
    format!(
        r#"
[run]
id = "{id}"
seed = 4
[environment]
kind = "dbbench"
engine = "sqlite"
max_rounds = 2
[tasks.generate]
seed = 6
train = {train}
validation = {validation}
test = 1
difficulty = "easy"
kinds = ["counting"]
[policy]
backend = "native"
model = "{guesser}"
max_tokens = 24
temperature = 0.7
"#,
        guesser = harness_s_tests::tiny_policy().display()
    )
}

fn editor_spec(dir: &Path, id: &str) -> PathBuf {
    let spec = format!(
        r#"{target}[pool]
dir = "{pool}"
[algorithm]
k = 2
tasks_per_update = 1
updates = 1
learning_rate = 1e-5
rescue = "none"
[budgets]
episode_model_calls = 2
[learner]
# An editor's G replies share their ~900-token prompt: one micro-batch runs it once.
micro_batch_tokens = 4096
[editor_training]
model = "{editor}"
steps = 2
parent = "s1-example-answer"
packets_per_step = 2
patches = 4
failed_per_packet = 2
controls_per_packet = 1
# the longest reply the grammar allows (a worked example's two texts of 160 characters, a
# name and the markup), were every token one character
max_tokens = 512
"#,
        target = target(id, 8, 1),
        pool = repo_root().join("examples/pool").display(),
        editor = harness_s_tests::tiny_policy().display()
    );
    let path = dir.join(format!("{id}.toml"));
    std::fs::write(&path, spec).unwrap();
    path
}

/// A rerun of step 1 whose done-marker is committed while the step's edit jobs are not all
/// done: (its part file, its bytes, its marker's bytes).
fn committed_rerun(store_dir: &Path, run: &str) -> Option<(PathBuf, Vec<u8>, Vec<u8>)> {
    let parts = std::fs::read_dir(store_dir.join(format!("runs/{run}/trajectories/step=1/kind=eval"))).ok()?;
    for part in parts.flatten() {
        let name = part.file_name().to_string_lossy().to_string();
        let Some(job) = name.strip_prefix("part-").and_then(|n| n.strip_suffix(".parquet")) else { continue };
        if let Ok(marker) = std::fs::read(store_dir.join(format!("runs/{run}/jobs/{job}.done.json"))) {
            return Some((part.path(), std::fs::read(part.path()).ok()?, marker));
        }
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_editor_is_trained_on_the_reward_of_its_patches() {
    let dir = tempfile::tempdir().unwrap();
    let run = "e2e-editor";
    let spec = editor_spec(dir.path(), run);
    let store_dir = dir.path().join("store");
    let store_url = store_dir.display().to_string();

    // SIGKILL once a rerun of step 1 is committed, before the step's edit jobs are done.
    let log = dir.path().join("killed.log");
    let mut child = Command::new(harness_s_bin())
        .args(["run", spec.to_str().unwrap(), "--store", &store_url])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let (part, part_bytes, marker_bytes) = loop {
        if let Some(found) = committed_rerun(&store_dir, run) {
            break found;
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the run ended ({status}) before a rerun was committed:\n{}", std::fs::read_to_string(&log).unwrap());
        }
        assert!(started.elapsed() < Duration::from_secs(1200), "no rerun was committed");
        std::thread::sleep(Duration::from_millis(50));
    };
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let patch_parts =
        |step: u32| std::fs::read_dir(store_dir.join(format!("runs/{run}/patches/step={step}"))).map(|d| d.count()).unwrap_or(0);
    assert!(patch_parts(1) < 2, "killed during the reruns of step 1, before both of its edit jobs finished");

    let (code, out, err) = harness_s(&["resume", run, "--store", &store_url]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("valid_patch_rate"), "the editor table is printed: {out}");
    // The rerun committed before the kill was not run again.
    assert_eq!(std::fs::read(&part).unwrap(), part_bytes, "{} was rewritten", part.display());
    let job = part.file_name().unwrap().to_string_lossy().trim_start_matches("part-").trim_end_matches(".parquet").to_string();
    assert_eq!(std::fs::read(store_dir.join(format!("runs/{run}/jobs/{job}.done.json"))).unwrap(), marker_bytes);
    let store = open_store(&store_url).await.unwrap();
    let store = store.as_ref();

    // Packets: the target's failures under the parent, with controls it solved.
    let packets: Vec<TracePacket> = read_prefix(store, &format!("runs/{run}/packets/")).await.unwrap();
    assert!(!packets.is_empty());
    for p in &packets {
        assert_eq!(p.parent_harness_id, "s1-example-answer");
        assert!(p.controls.iter().any(|c| !c) && p.text.contains("## Failure 1"), "{p:?}");
    }
    let seeds: BTreeMap<&str, u64> = packets.iter().map(|p| (p.packet_id.as_str(), p.seed)).collect();

    let reruns: Vec<Trajectory> = read_prefix(store, &format!("runs/{run}/trajectories/")).await.unwrap();
    let patches: Vec<PatchRecord> = read_prefix(store, &format!("runs/{run}/patches/")).await.unwrap();
    for step in [1, 2] {
        let of_step: Vec<&PatchRecord> = patches.iter().filter(|p| p.step == step).collect();
        assert_eq!(of_step.len(), 2 * 4, "G = 4 patches for each of 2 packets at step {step}");
        for p in &of_step {
            if p.valid {
                // Rerun with the parent's seed, under the patched harness, on the packet's tasks.
                let job = p.rerun_job_id.as_deref().expect("a valid patch is rerun");
                let rows: Vec<&Trajectory> = reruns.iter().filter(|r| r.job_id == job).collect();
                assert!(!rows.is_empty(), "patch {} of step {step}: no rerun rows", p.patch_index);
                for r in rows {
                    assert_eq!((r.seed, r.kind), (seeds[p.packet_id.as_str()], RolloutKind::Eval));
                    assert_eq!(Some(&r.harness_id), p.child_harness_id.as_ref());
                }
            } else {
                assert_eq!((p.reward, p.rerun_job_id.as_ref(), p.patched_rewards.len()), (0.0, None, 0), "{p:?}");
                assert!(p.error.is_some());
            }
        }
    }
    // The editor's rows hold each reply's tokens; each step's groups carry the advantages.
    let edits: Vec<&Trajectory> = reruns.iter().filter(|r| r.kind == RolloutKind::Edit).collect();
    assert_eq!(edits.len(), 16);
    // Nothing stored twice across the kill: every row once, every rerun once per task.
    let ids: BTreeSet<&str> = reruns.iter().map(|r| r.trajectory_id.as_str()).collect();
    assert_eq!(ids.len(), reruns.len(), "a row was stored twice");
    let episodes: Vec<&Trajectory> = reruns.iter().filter(|r| r.kind != RolloutKind::Edit).collect();
    let per_rerun: BTreeSet<(&str, &str)> = episodes.iter().map(|r| (r.job_id.as_str(), r.task_id.as_str())).collect();
    assert_eq!(per_rerun.len(), episodes.len(), "a rerun stored a task twice");
    assert!(edits.iter().all(|r| r.turns[2].token_ids.len() == r.turns[2].logprobs.len() && !r.turns[2].token_ids.is_empty()));
    let groups: Vec<Group> = read_prefix(store, &format!("runs/{run}/groups/")).await.unwrap();
    assert_eq!(groups.len(), 4);

    // Both updates trained the editor: tokens, a loss, and weights that moved each step.
    let mut hashes = vec![];
    for step in [1, 2] {
        let bytes = store.get(&format!("runs/{run}/checkpoints/step={step}/manifest.json")).await.unwrap();
        let m: schemas::CheckpointManifest = serde_json::from_slice(&bytes).unwrap();
        assert!(m.trained && m.metrics["policy_tokens"] > 0.0 && m.metrics["loss"].is_finite(), "step {step}: {:?}", m.metrics);
        let weights = m.files.iter().find(|f| f.name == "model.safetensors").unwrap();
        hashes.push(weights.sha256.clone());
    }
    assert_ne!(hashes[0], hashes[1], "the second update changed the editor's weights");
    let (trained, _, _) = native::train::checkpoint::load_model(store, run, 1, tch::Device::Cpu).await.unwrap();
    let (base, _) = native::model::loader::load(&harness_s_tests::tiny_policy(), tch::Device::Cpu).unwrap();
    let moved = native::model::CausalLm::named_tensors(&trained)
        .iter()
        .zip(native::model::CausalLm::named_tensors(&base))
        .map(|((_, a), (_, b))| (a - b).abs().max().double_value(&[]))
        .fold(0.0, f64::max);
    assert!(moved > 0.0, "the first update left the editor's weights as they were");

    // Per-step metrics and the report.
    let metrics: Vec<MetricRow> = read_prefix(store, &format!("runs/{run}/metrics/")).await.unwrap();
    for name in ["valid_patch_rate", "mean_patch_reward", "best_patch_reward", "policy_tokens_trained"] {
        assert_eq!(metrics.iter().filter(|m| m.name == name).count(), 2, "{name}");
    }
    let report = String::from_utf8(store.get(&format!("runs/{run}/reports/report.md")).await.unwrap().to_vec()).unwrap();
    assert!(report.contains("Best patch per step") && report.contains("valid_patch_rate"), "{report}");
    assert!(store.head(&format!("runs/{run}/reports/editor.png")).await.unwrap().is_some());

    // Evolution with the trained editor: a spec naming an editor run the store lacks is
    // refused at submission; the trained one writes children the pool marks as its own.
    let (code, _, err) = harness_s(&["run", learned_spec(dir.path(), "e2e-no-editor", "nowhere").to_str().unwrap(), "--store", &store_url]);
    assert_ne!(code, 0);
    assert!(err.contains("evolution.learned_editor.run") && err.contains("nowhere"), "{err}");
    let evolved = "e2e-learned";
    let (code, out, err) = harness_s(&["run", learned_spec(dir.path(), evolved, run).to_str().unwrap(), "--store", &store_url]);
    assert!(code == 0 || code == 3, "exit {code}\n{out}\n{err}");
    let stored: serde_json::Value = serde_json::from_slice(&store.get(&format!("runs/{evolved}/inputs/run.json")).await.unwrap()).unwrap();
    assert_eq!(stored["learned_editor"]["step"], 2, "the editor run's latest checkpoint is pinned: {stored}");
    let (manifest, _) = jobs::evolve::pool::load_pool(store, evolved).await.unwrap();
    let learned: Vec<&jobs::evolve::PoolEntry> = manifest.members.iter().filter(|m| m.editor == "learned:e2e-editor@2").collect();
    assert!(!learned.is_empty(), "no child of the learned editor joined the pool: {manifest:?}");
    for m in &learned {
        assert_eq!(m.parent.as_deref(), Some("h0"));
        assert!(m.local.is_some(), "a learned editor's child is evaluated locally: {m:?}");
    }
    let (code, out, err) = harness_s(&["pool", "ls", evolved, "--store", &store_url]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("editor") && out.contains("learned:e2e-editor@2"), "{out}");
    let report = String::from_utf8(store.get(&format!("runs/{evolved}/reports/report.md")).await.unwrap().to_vec()).unwrap();
    assert!(report.contains(&format!("| {} | learned:e2e-editor@2 |", learned[0].id)), "{report}");
}

/// An evolve-only run (one round, no learning) whose children the editor run `editor`
/// writes.
fn learned_spec(dir: &Path, id: &str, editor: &str) -> PathBuf {
    let spec = format!(
        r#"{target}[evolution]
proposal_budgets = [1]
parent_slots = 1
local_max_tasks = 3
local_max_controls = 1
editor = "learned"
learned_editor = {{ run = "{editor}", max_tokens = 512 }}
[algorithm]
k = 2
tasks_per_update = 1
updates = 1
learning_rate = 1e-6
rescue = "none"
learn = false
[calibration]
interval = 0
tasks = 1
[evaluation]
k = 1
baseline = false
[budgets]
episode_model_calls = 2
"#,
        target = target(id, 4, 2)
    );
    let path = dir.join(format!("{id}.toml"));
    std::fs::write(&path, spec).unwrap();
    path
}

/// An editor behind an endpoint (`[editor_training] endpoint`): `harness-s serve` on
/// the guesser as the editor decodes the patch grammar over HTTP, returns the token ids the learner checks,
/// and is brought to the editor's checkpoint before each step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_editor_behind_an_endpoint_is_trained_and_synced_to_its_checkpoints() {
    let dir = tempfile::tempdir().unwrap();
    let editor = harness_s_tests::tiny_policy();
    let (mut server, base_url) = crate::training::start_serve(&dir.path().join("serve.log"), 0, &editor, "editor");
    let run = "e2e-endpoint-editor";
    let spec = editor_spec(dir.path(), run);
    let text = std::fs::read_to_string(&spec).unwrap();
    // the spec's editor model (the guesser) is what the endpoint serves at the start
    let endpoint = format!("endpoint = {{ base_url = \"{base_url}\", model = \"editor\" }}\n");
    std::fs::write(&spec, text.replace("[editor_training]\n", &format!("[editor_training]\n{endpoint}"))).unwrap();
    let store_url = dir.path().join("store").display().to_string();
    let (code, out, err) = harness_s(&["run", spec.to_str().unwrap(), "--store", &store_url]);
    let served = crate::training::served_weights(&base_url);
    let _ = server.kill();
    assert_eq!(code, 0, "{out}\n{err}");
    let store = open_store(&store_url).await.unwrap();
    let store = store.as_ref();

    // The replies came through the grammar: valid, but for those cut by max_tokens.
    let patches: Vec<PatchRecord> = read_prefix(store, &format!("runs/{run}/patches/")).await.unwrap();
    assert_eq!(patches.len(), 16);
    assert!(patches.iter().filter(|p| p.valid).count() >= 10, "{:?}", patches.iter().map(|p| &p.error).collect::<Vec<_>>());
    // Step 2 sampled from the endpoint after it loaded the editor's step-1 checkpoint.
    let rows: Vec<Trajectory> = read_prefix(store, &format!("runs/{run}/trajectories/")).await.unwrap();
    let step1 = native::train::checkpoint::manifest_key(run, 1);
    for r in rows.iter().filter(|r| r.kind == RolloutKind::Edit) {
        let reply = &r.turns[2];
        assert!(!reply.token_ids.is_empty() && reply.prompt_hash.is_some(), "the endpoint's ids are recorded");
        if r.step == 2 {
            assert_eq!(r.policy_checkpoint, step1);
        }
    }
    assert_eq!(native::train::learner::data::checkpoint_step(run, &served), Ok(Some(1)), "the endpoint serves the step-1 editor: {served}");
    // Both updates trained the editor on the endpoint's replies.
    for step in [1, 2] {
        let bytes = store.get(&format!("runs/{run}/checkpoints/step={step}/manifest.json")).await.unwrap();
        let m: schemas::CheckpointManifest = serde_json::from_slice(&bytes).unwrap();
        assert!(m.trained && m.metrics["policy_tokens"] > 0.0, "step {step}: {:?}", m.metrics);
        assert!(m.metrics["mismatch_max"] < 1e-3, "the endpoint's logprobs are the learner's: {:?}", m.metrics);
    }
}
