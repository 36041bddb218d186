//! The rescue machinery is exactly what it claims to be (Harness-S §3.3, Eq. 5–6): runs
//! that differ only where the method says they differ, compared row for row and bit for
//! bit. The policy is the committed tiny Qwen3.5 taught to guess (`Final Answer: [n]`,
//! [`harness_s_tests::tiny_qwen3_5`]), so that a group of easy counting tasks has successes
//! and failures at random and every run is seconds of CPU.
//!
//! - An identity pool (siblings that are H0 under other ids) rescues exactly as H0 rescue
//!   does: the same rows, rewards, advantages, loss and weights bit for bit (also under
//!   `rescue_context = "h0"`); under `"h0"` and `"both"` each rescue row's H0 context is its
//!   own context, token for token, and `"both"` (two half-weighted copies) gives H0 rescue's
//!   gradient within float rounding.
//! - A sibling that never succeeds leaves the run bit-identical to plain GRPO.
//! - Learning rate 0: H0's test episodes after training are the episodes before it.
//! - Rewards shuffled within a rescue group move its advantages with them into the
//!   learner's samples; no base row of a rescued task carries an advantage.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use harness_s_tests::{harness_s, tiny_qwen3_5};
use infra::store::{open_store, ObjectStore};
use infra::table::read_prefix;
use native::train::learner::data::{self, RescueContext, RescueContextMode};
use schemas::{Group, HarnessSpec, RetainedKind, RolloutKind, Trajectory, TurnSource};

/// A pool folder of `n` siblings, each `body` under the id `<prefix><i>`.
fn pool(dir: &Path, name: &str, prefix: &str, n: usize, body: serde_json::Value) -> PathBuf {
    let pool = dir.join(name);
    std::fs::create_dir_all(&pool).unwrap();
    for i in 1..=n {
        let mut spec = body.clone();
        spec["id"] = format!("{prefix}{i}").into();
        spec["parent"] = "h0".into();
        spec["generation"] = 1.into();
        std::fs::write(pool.join(format!("{prefix}{i}.json")), spec.to_string()).unwrap();
    }
    pool
}

/// `updates` updates of 8 easy counting tasks × K = 2 (so that some base groups fail
/// entirely), the rule router over the pool, run seed `seed`; `algorithm` holds the learning
/// rate and the rescue keys, `evaluation` the evaluation keys.
fn spec(dir: &Path, id: &str, seed: u64, pool: &Path, algorithm: &str, updates: u32, evaluation: &str) -> PathBuf {
    let text = format!(
        r#"
[run]
id = "{id}"
seed = {seed}
[environment]
kind = "dbbench"
engine = "sqlite"
max_rounds = 2
harness_actions = true
[tasks.generate]
seed = 3
train = 8
validation = 1
test = 6
difficulty = "easy"
kinds = ["counting"]
[policy]
backend = "native"
model = "{model}"
max_tokens = 12
temperature = 1.0
[pool]
dir = "{pool}"
[algorithm]
k = 2
tasks_per_update = 8
updates = {updates}
{algorithm}
[router]
variant = "rule"
[calibration]
interval = 0
tasks = 1
transfer_rows = 0
[evaluation]
{evaluation}
ranks = 0
[budgets]
episode_model_calls = 2
"#,
        model = tiny_qwen3_5().display(),
        pool = pool.display()
    );
    let path = dir.join(format!("{id}.toml"));
    std::fs::write(&path, text).unwrap();
    path
}

/// Runs a spec into the store at `dir/store`; panics with the output on failure.
fn run(spec: &Path, dir: &Path) {
    let url = format!("file://{}", dir.join("store").display());
    let (code, out, err) = harness_s(&["run", spec.to_str().unwrap(), "--store", &url]);
    assert!(code == 0 || code == 3, "{}: exit {code}\n{out}\n{err}", spec.display());
}

async fn store(dir: &Path) -> std::sync::Arc<dyn ObjectStore> {
    open_store(&format!("file://{}", dir.join("store").display())).await.unwrap()
}

async fn rows(store: &dyn ObjectStore, run: &str, step: u32, kind: RolloutKind) -> Vec<Trajectory> {
    let mut all: Vec<Trajectory> =
        read_prefix(store, &format!("runs/{run}/trajectories/step={step}/kind={}/", kind.as_str())).await.unwrap();
    all.sort_by(|a, b| (&a.task_id, a.seed, a.attempt).cmp(&(&b.task_id, b.seed, b.attempt)));
    all
}

/// What a rollout drew, without the names that differ by harness or run: task, seed,
/// the policy's tokens turn by turn, reward.
fn drawn(rows: &[Trajectory]) -> Vec<(String, u64, Vec<Vec<u32>>, f64)> {
    rows.iter().map(|r| (r.task_id.clone(), r.seed, policy_tokens(r), r.reward)).collect()
}

/// The policy's token ids, turn by turn.
fn policy_tokens(r: &Trajectory) -> Vec<Vec<u32>> {
    r.turns.iter().filter(|t| t.source == TurnSource::Policy).map(|t| t.token_ids.clone()).collect()
}

async fn groups(store: &dyn ObjectStore, run: &str, step: u32) -> Vec<Group> {
    let mut g: Vec<Group> = read_prefix(store, &format!("runs/{run}/groups/step={step}/")).await.unwrap();
    g.sort_by(|a, b| a.task_id.cmp(&b.task_id));
    g
}

async fn manifest(store: &dyn ObjectStore, run: &str, step: u32) -> schemas::CheckpointManifest {
    serde_json::from_slice(&store.get(&format!("runs/{run}/checkpoints/step={step}/manifest.json")).await.unwrap()).unwrap()
}

/// `(name, sha256)` of every weights and optimizer file of a checkpoint (the manifest's
/// own fields name the run, so it is left out).
async fn weights(store: &dyn ObjectStore, run: &str, step: u32) -> Vec<(String, String)> {
    let m = manifest(store, run, step).await;
    let mut files: Vec<(String, String)> =
        m.files.into_iter().filter(|f| f.name.ends_with(".safetensors")).map(|f| (f.name, f.sha256)).collect();
    files.sort();
    assert!(!files.is_empty(), "{run} step {step} lists no weights");
    files
}

/// Advantage per (task, seed) of every row a retained group trains on.
fn advantages_by_stream(groups: &[Group], rows: &[Trajectory]) -> BTreeMap<(String, u64), f64> {
    let seed: BTreeMap<&str, u64> = rows.iter().map(|r| (r.trajectory_id.as_str(), r.seed)).collect();
    groups
        .iter()
        .filter(|g| g.retained)
        .flat_map(|g| g.trajectory_ids.iter().zip(&g.advantages).map(|(id, a)| ((g.task_id.clone(), seed[id.as_str()]), *a)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_identity_pool_rescues_exactly_as_h0_rescue_does() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // H0 has no edits: a sibling with none renders every context exactly as H0 does.
    let copies = pool(d, "copies", "copy", 2, serde_json::json!({"direction": "H0 under another id"}));
    let eval = "k = 1\nbaseline = false";
    // The comparison needs a rescue group with a success and a failure: with the committed
    // guesser, run seed 5 draws one in H0 rescue (a draw, fixed by the seed and the weights).
    let seed = 5u64;
    let h0 = format!("inv-h0-seed{seed}");
    run(&spec(d, &h0, seed, &copies, "learning_rate = 1e-3\nrescue = \"h0\"", 1, eval), d);
    let probe = groups(store(d).await.as_ref(), &h0, 1).await;
    assert!(
        probe.iter().any(|g| g.retained_kind == RetainedKind::Rescue && g.retained),
        "H0 rescue under run seed {seed} has no group with a success and a failure; pick the seed anew: {probe:?}"
    );
    let h0 = h0.as_str();
    let arms = [
        ("inv-copies", "rescue = \"router\""),
        ("inv-copies-h0ctx", "rescue = \"router\"\nrescue_context = \"h0\""),
        ("inv-copies-both", "rescue = \"router\"\nrescue_context = \"both\""),
    ];
    for (id, keys) in arms {
        run(&spec(d, id, seed, &copies, &format!("learning_rate = 1e-3\n{keys}"), 1, eval), d);
    }
    let store = store(d).await;
    let s = store.as_ref();

    // The base rollouts are the same draws; rescue fired on the same all-fail groups.
    let h0_base = rows(s, h0, 1, RolloutKind::Base).await;
    let h0_rescue = rows(s, h0, 1, RolloutKind::Rescue).await;
    let h0_groups = groups(s, h0, 1).await;
    let rescued: Vec<&Group> = h0_groups.iter().filter(|g| g.retained_kind == RetainedKind::Rescue).collect();
    let contrast = rescued.iter().filter(|g| g.retained).count();
    assert!(contrast >= 1, "no rescue group with a success and a failure: the comparison would be empty ({h0_groups:#?})");
    assert!(h0_rescue.iter().all(|r| r.harness_id == "h0"));
    for (id, _) in &arms {
        assert_eq!(drawn(&rows(s, id, 1, RolloutKind::Base).await), drawn(&h0_base), "{id}: base rollouts");
        let rescue = rows(s, id, 1, RolloutKind::Rescue).await;
        let harnesses: std::collections::BTreeSet<&str> = rescue.iter().map(|r| r.harness_id.as_str()).collect();
        assert_eq!(harnesses, ["copy1", "copy2"].into(), "{id}: the router's siblings drew the rescue rollouts");
        // the same random streams: tokens and rewards, stream by stream
        assert_eq!(drawn(&rescue), drawn(&h0_rescue), "{id}: rescue rollouts differ from H0 rescue's");
        let g = groups(s, id, 1).await;
        let kinds = |g: &[Group]| g.iter().map(|g| (g.task_id.clone(), g.retained_kind, g.retained)).collect::<Vec<_>>();
        assert_eq!(kinds(&g), kinds(&h0_groups), "{id}: retained groups");
        let all = |base: Vec<Trajectory>, resc: Vec<Trajectory>| base.into_iter().chain(resc).collect::<Vec<_>>();
        assert_eq!(
            advantages_by_stream(&g, &all(rows(s, id, 1, RolloutKind::Base).await, rescue.clone())),
            advantages_by_stream(&h0_groups, &all(h0_base.clone(), h0_rescue.clone())),
            "{id}: advantages (Eq. 6)"
        );
    }

    // The learner: the same loss; in the generating context, the same weights bit for bit.
    let reference = manifest(s, h0, 1).await;
    assert!(
        reference.trained && reference.metrics["policy_tokens"] > 0.0 && reference.metrics["grad_norm"] > 0.0,
        "{:?}",
        reference.metrics
    );
    let loss = |m: &schemas::CheckpointManifest| m.metrics["loss"];
    let copies_m = manifest(s, "inv-copies", 1).await;
    assert_eq!(loss(&copies_m), loss(&reference), "generating context: the loss of H0 rescue");
    assert_eq!(weights(s, "inv-copies", 1).await, weights(s, h0, 1).await, "generating context: H0 rescue's weights");
    for id in ["inv-copies-h0ctx", "inv-copies-both"] {
        let m = manifest(s, id, 1).await;
        assert!(m.metrics["context_tokens"] > 0.0, "{id}: no rescue token was scored under H0: {:?}", m.metrics);
        // The loss of a GRPO step at ratio 1 is Σ A·ρ ≈ 0 (advantages sum to zero within a
        // group): compared absolutely; the gradient's norm carries the scale.
        let (a, b) = (loss(&m), loss(&reference));
        let (ga, gb) = (m.metrics["grad_norm"], reference.metrics["grad_norm"]);
        assert!((a - b).abs() <= 1e-7, "{id}: loss {a} vs H0 rescue's {b}");
        assert!((ga - gb).abs() <= 1e-6 * gb, "{id}: gradient norm {ga} vs H0 rescue's {gb}");
        if id == "inv-copies-h0ctx" {
            // one copy, scored in H0's context = its own: the same computation
            assert_eq!((a, ga), (b, gb), "{id}");
            assert_eq!(weights(s, id, 1).await, weights(s, h0, 1).await, "{id}: H0 rescue's weights");
        }
        // π_old(y | c_H0) / q(y | c_H) is the sampling mismatch alone
        assert!((m.metrics["context_ratio_mean"] - 1.0).abs() < 1e-3, "{id}: {:?}", m.metrics);
    }
    // Every rescue row's H0 context is its generating context, token for token: the
    // context ratio π(y | c_H0) / π(y | c_H) is exactly 1.
    let stored = scheduler::run::inputs::load_stored(s, "inv-copies-h0ctx").await.unwrap();
    let ctx: RescueContext = scheduler::run::machine::rescue_context(&stored.spec, HarnessSpec::h0());
    assert_eq!(ctx.mode, RescueContextMode::H0);
    let tok = native::model::loader::load_tokenizer(&tiny_qwen3_5()).unwrap();
    let mut turns = 0;
    for r in rows(s, "inv-copies-h0ctx", 1, RolloutKind::Rescue).await {
        let generating = data::samples_from_trajectory(&r, 0, 1.0, &tok).unwrap();
        let under_h0 = ctx.h0_samples(&r, 0, 1.0, &tok).unwrap().expect("a sibling's rescue row is rendered under H0");
        assert_eq!(generating.len(), under_h0.len());
        for (g, h) in generating.iter().zip(&under_h0) {
            assert_eq!(g.context, h.context, "{}: H0's context differs from the copy's", r.trajectory_id);
            assert_eq!(g.completion, h.completion);
            turns += 1;
        }
    }
    assert!(turns > 0, "no rescue policy turn to compare");

    // Rewards shuffled within a rescue group: the group's advantages and the learner's
    // samples follow them (Eq. 5–6 wiring).
    let base = rows(s, "inv-copies", 1, RolloutKind::Base).await;
    let rescue = rows(s, "inv-copies", 1, RolloutKind::Rescue).await;
    let spec_of = scheduler::run::inputs::load_stored(s, "inv-copies").await.unwrap().spec;
    let by_task = scheduler::run::machine::group_by_task(&base);
    let rescue_by = scheduler::run::machine::group_by_task(&rescue);
    let mut swapped_groups = 0;
    for (task, rs) in &rescue_by {
        let (g, _) = scheduler::run::machine::task_group("inv-copies", &spec_of, 1, task, &by_task[task], Some(rs));
        if !g.retained {
            continue;
        }
        // rotate the rewards (and successes) by one place
        let n = rs.len();
        let mut shuffled: Vec<Trajectory> = rs.iter().map(|r| (*r).clone()).collect();
        for i in 0..n {
            shuffled[i].reward = rs[(i + 1) % n].reward;
            shuffled[i].success = rs[(i + 1) % n].success;
        }
        let refs: Vec<&Trajectory> = shuffled.iter().collect();
        let (g2, _) = scheduler::run::machine::task_group("inv-copies", &spec_of, 1, task, &by_task[task], Some(&refs));
        assert_eq!(g2.trajectory_ids, g.trajectory_ids);
        let rotated: Vec<f64> = (0..n).map(|i| g.advantages[(i + 1) % n]).collect();
        assert_eq!(g2.advantages, rotated, "{task}: advantages do not follow the shuffled rewards");
        assert_ne!(g2.advantages, g.advantages, "{task}: a group with contrast changes under rotation");
        // The learner's samples: row by row, the advantage of the reward it now carries.
        let batch = |g: &Group, rows: &[Trajectory]| {
            data::batch_from_groups(std::slice::from_ref(g), rows, &tok, &RescueContext::default()).unwrap()
        };
        let before = batch(&g, &rs.iter().map(|r| (*r).clone()).collect::<Vec<_>>());
        let after = batch(&g2, &shuffled);
        assert_eq!(before.samples.len(), after.samples.len());
        let mut expected = vec![];
        for (i, id) in g.trajectory_ids.iter().enumerate() {
            let one = Group { trajectory_ids: vec![id.clone()], advantages: vec![g2.advantages[i]], ..g2.clone() };
            expected.extend(batch(&one, &shuffled).samples.iter().map(|x| x.advantage));
        }
        assert_eq!(after.samples.iter().map(|x| x.advantage).collect::<Vec<_>>(), expected, "{task}");
        for (x, y) in before.samples.iter().zip(&after.samples) {
            assert_eq!((&x.context, &x.completion), (&y.context, &y.completion), "{task}: the same tokens are trained");
        }
        swapped_groups += 1;
    }
    assert!(swapped_groups > 0, "no rescue group with contrast to shuffle");

    // No base row of a rescued task carries an advantage: the rescue group replaced it.
    let g = groups(s, "inv-copies", 1).await;
    let listed: BTreeMap<&str, f64> =
        g.iter().flat_map(|g| g.trajectory_ids.iter().map(String::as_str).zip(g.advantages.iter().copied())).collect();
    for grp in g.iter().filter(|g| g.retained_kind == RetainedKind::Rescue) {
        for b in base.iter().filter(|b| b.task_id == grp.task_id) {
            assert!(
                listed.get(b.trajectory_id.as_str()).is_none_or(|a| *a == 0.0),
                "base row {} of rescued task {}",
                b.trajectory_id,
                grp.task_id
            );
        }
        assert!(grp.trajectory_ids.iter().all(|id| rescue.iter().any(|r| &r.trajectory_id == id)), "{grp:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sibling_that_never_succeeds_leaves_the_run_as_plain_grpo() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // The policy replies; the harness then commits a wrong answer in its place.
    let wrong = pool(
        d,
        "wrong",
        "wrong",
        2,
        serde_json::json!({
            "direction": "commits a wrong answer",
            "hooks": [{"id": "wrong-answer", "event": "before_action", "condition": "always", "action": "rewrite_action",
                       "parameters": {"tool": "commit_final_answer", "args": {"answers": ["999"]}}, "message": "committed 999"}]
        }),
    );
    let eval = "k = 1\nbaseline = false";
    run(&spec(d, "never-grpo", 5, &wrong, "learning_rate = 1e-3\nrescue = \"none\"", 2, eval), d);
    run(&spec(d, "never-router", 5, &wrong, "learning_rate = 1e-3\nrescue = \"router\"", 2, eval), d);
    let store = store(d).await;
    let s = store.as_ref();
    let mut rescued = 0;
    for step in [1, 2] {
        let rescue = rows(s, "never-router", step, RolloutKind::Rescue).await;
        assert!(rescue.iter().all(|r| !r.success && r.harness_id.starts_with("wrong")), "step {step}: a wrong sibling succeeded");
        assert!(
            rescue.iter().all(|r| r.turns.iter().any(|t| t.source == TurnSource::Policy && !t.token_ids.is_empty())),
            "the policy sampled"
        );
        rescued += rescue.len();
        assert_eq!(
            drawn(&rows(s, "never-router", step, RolloutKind::Base).await),
            drawn(&rows(s, "never-grpo", step, RolloutKind::Base).await),
            "step {step}: rescue sampling moved the base rollouts' random streams"
        );
        let m = manifest(s, "never-grpo", step).await;
        assert!(m.trained && m.metrics["policy_tokens"] > 0.0, "step {step} of plain GRPO trained nothing: {:?}", m.metrics);
        assert_eq!(weights(s, "never-router", step).await, weights(s, "never-grpo", step).await, "step {step}: checkpoints differ");
    }
    assert!(rescued > 0, "rescue never fired: the run tested nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_learning_rate_zero_h0_test_episodes_after_training_are_those_before() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let copies = pool(d, "copies", "copy", 2, serde_json::json!({"direction": "H0 under another id"}));
    run(&spec(d, "lr-zero", 5, &copies, "learning_rate = 0.0\nrescue = \"router\"", 1, "k = 2\nbaseline = true"), d);
    let store = store(d).await;
    let s = store.as_ref();
    let m = manifest(s, "lr-zero", 1).await;
    assert!(m.trained && m.metrics["policy_tokens"] > 0.0 && m.metrics["grad_norm"] > 0.0, "the learner ran: {:?}", m.metrics);
    let eval: Vec<Trajectory> = read_prefix(s, "runs/lr-zero/trajectories/").await.unwrap();
    let episodes = |step: u32| {
        let mut v: Vec<(String, u32, Vec<Vec<u32>>, bool)> = eval
            .iter()
            .filter(|r| r.kind == RolloutKind::Eval && r.split == schemas::Split::Test && r.harness_id == "h0" && r.step == step)
            .map(|r| (r.task_id.clone(), r.attempt, policy_tokens(r), r.success))
            .collect();
        v.sort();
        v
    };
    let before = episodes(0);
    assert_eq!(before.len(), 12, "6 test tasks × k = 2");
    assert!(before.iter().any(|e| e.3) && before.iter().any(|e| !e.3), "the guesser both wins and loses: {before:?}");
    assert_eq!(episodes(1), before, "H0 test episodes changed with learning rate 0");
}
