//! The main job end to end: `harness-s run` in embedded mode on generated DBBench tasks and
//! the example sibling pool runs every stage; bad specs are refused before any job runs; a
//! finished run refuses to resume. The policy is the tiny guesser
//! ([`harness_s_tests::tiny_policy`], a llama GGUF of SmolLM2's family): what these tests
//! check is the machinery (stages, stores, queues, resume, weight sync), which does not depend
//! on the policy being a real model; the README test runs the quickstart on the real
//! SmolLM2-135M.

use std::path::{Path, PathBuf};
use std::process::Command;

use harness_s_tests::{harness_s, harness_s_bin, tiny_policy};
use infra::store::open_store;
use infra::table::read_prefix;
use schemas::{Group, MetricRow, RetainedKind, RolloutKind, Trajectory};

use harness_s_tests::repo_root;

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
kinds = ["counting"]
[policy]
backend = "native"
model = "{model}"
max_tokens = 24
temperature = 0.7
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
        pool = repo_root().join("examples/pool").display(),
        model = tiny_policy().display()
    );
    let path = dir.join(format!("{id}.toml"));
    std::fs::write(&path, spec).unwrap();
    path
}

/// The `[policy]` lines of the native tiny policy in the specs above, for tests that swap it.
fn native_policy_lines() -> String {
    format!("backend = \"native\"\nmodel = \"{}\"\n", tiny_policy().display())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_run_goes_through_every_stage_and_rescues_all_fail_groups() {
    let dir = tempfile::tempdir().unwrap();
    let spec = tiny_spec(dir.path(), "e2e-embedded", "router");
    let store_url = format!("file://{}", dir.path().join("store").display());
    let (code, out, err) = harness_s(&["run", spec.to_str().unwrap(), "--store", &store_url]);
    assert!(code == 0 || code == 3, "exit {code}\nstdout:\n{out}\nstderr:\n{err}");
    assert!(out.contains("effective_group_rate"), "metrics table printed:\n{out}");
    assert!(!err.contains('\u{1b}'), "logs into a pipe carry no colour codes:\n{err}");
    assert!(out.contains("report: "), "{out}");

    let store = open_store(&store_url).await.unwrap();
    let state: serde_json::Value = serde_json::from_slice(&store.get("runs/e2e-embedded/state.json").await.unwrap()).unwrap();
    assert!(["completed", "degraded"].contains(&state["status"].as_str().unwrap()), "{state}");
    let completed: Vec<&str> = state["completed"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    for stage in [
        "baseline",
        "calibration:0",
        "update:1:base",
        "update:1:rescue",
        "update:1:groups",
        "update:1:learn",
        "calibration:final:1",
        "evaluation",
        "report",
    ] {
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
    // The README's joined view: every row of a retained group gets its GRPO advantage
    // from the group rows (trajectory rows are written before their group is formed).
    let root = dir.path().join("store/runs/e2e-embedded");
    let joined = harness_s_tests::duckdb(&format!(
        "WITH g AS (SELECT retained, retained_kind, unnest(trajectory_ids) AS trajectory_id, unnest(advantages) AS advantage \
                    FROM read_parquet('{root}/groups/**/*.parquet')) \
         SELECT t.trajectory_id, t.task_id, t.kind, t.reward, g.advantage, g.retained_kind \
         FROM read_parquet('{root}/trajectories/**/*.parquet', hive_partitioning = true) t \
         JOIN g USING (trajectory_id) WHERE g.retained ORDER BY t.trajectory_id",
        root = root.display()
    ));
    let retained: Vec<&Group> = groups.iter().filter(|g| g.retained).collect();
    assert_eq!(joined.len(), retained.iter().map(|g| g.trajectory_ids.len()).sum::<usize>(), "{joined:?}");
    for g in &retained {
        let rows: Vec<&serde_json::Value> = joined.iter().filter(|r| r["task_id"] == g.task_id.as_str()).collect();
        let sum: f64 = rows.iter().map(|r| r["advantage"].as_f64().unwrap()).sum();
        assert!(sum.abs() < 1e-9, "GRPO advantages of a group sum to zero: {rows:?}");
        assert!(rows.iter().all(|r| r["kind"] == if g.retained_kind == RetainedKind::Rescue { "rescue" } else { "base" }), "{rows:?}");
    }
    let metrics: Vec<MetricRow> = read_prefix(store.as_ref(), "runs/e2e-embedded/metrics/").await.unwrap();
    let rescue_rate = metrics.iter().find(|m| m.name == "rescue_rate").expect("rescue_rate recorded").value;
    let fired = groups.iter().filter(|g| g.rescue_fired).count() as f64 / groups.len() as f64;
    assert!((rescue_rate - fired).abs() < 1e-9);
    for name in ["effective_group_rate", "effective_token_share", "h0_validation_success", "pass_at_k", "avg_at_k", "loss"] {
        assert!(metrics.iter().any(|m| m.name == name), "metric {name} missing");
    }
    assert_trained(store.as_ref(), "e2e-embedded", 1).await;
    assert!(store.head("runs/e2e-embedded/reports/signals.png").await.unwrap().is_some());

    // Tracking: the run's metrics as TensorBoard reads them (its own EventAccumulator over
    // the event files the scheduler wrote as it went), as a wide CSV, and its folder pool.
    let tb = dir.path().join("store/runs/e2e-embedded/tensorboard");
    let script = "import json, sys\n\
                  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator\n\
                  ea = EventAccumulator(sys.argv[1], size_guidance={'scalars': 0})\n\
                  ea.Reload()\n\
                  print(json.dumps({t: [[e.step, e.value] for e in ea.Scalars(t)] for t in ea.Tags()['scalars']}))";
    let read = Command::new(harness_s_tests::python()).args(["-c", script]).arg(&tb).output().unwrap();
    assert!(read.status.success(), "TensorBoard's reader failed (pip install tensorboard): {}", String::from_utf8_lossy(&read.stderr));
    let scalars: std::collections::BTreeMap<String, Vec<(u32, f64)>> = serde_json::from_slice(&read.stdout).unwrap();
    for m in &metrics {
        let tag = format!("{}/{}", m.stage, m.name);
        let points = scalars.get(&tag).unwrap_or_else(|| panic!("no TensorBoard scalar {tag}: {:?}", scalars.keys().collect::<Vec<_>>()));
        assert!(
            points.iter().any(|(s, v)| *s == m.step && (v - m.value).abs() <= 1e-5 * m.value.abs().max(1.0)),
            "{tag} at {}: {points:?} vs {}",
            m.step,
            m.value
        );
    }
    let (code, csv, err) = harness_s(&["metrics", "e2e-embedded", "--store", &store_url]);
    assert_eq!(code, 0, "{err}");
    let header: Vec<&str> = csv.lines().next().unwrap().split(',').collect();
    assert_eq!(header[0], "step");
    assert!(header.contains(&"learn/loss") && header.contains(&"update/effective_group_rate"), "{header:?}");
    assert_eq!(
        csv.lines().count() - 1,
        metrics.iter().map(|m| m.step).collect::<std::collections::BTreeSet<_>>().len(),
        "one row per step"
    );
    let (code, pool, err) = Command::new(harness_s_bin())
        .args(["pool", "ls", "e2e-embedded"])
        .env("HARNESS_S_STORE", &store_url)
        .output()
        .map(|o| {
            (o.status.code().unwrap_or(-1), String::from_utf8_lossy(&o.stdout).to_string(), String::from_utf8_lossy(&o.stderr).to_string())
        })
        .unwrap();
    assert_eq!(code, 0, "pool ls takes the store from HARNESS_S_STORE: {err}");
    assert!(pool.contains("from [pool] dir") && pool.contains("| s1-example-answer |") && pool.contains("policy-side"), "{pool}");

    // The trained policy leaves for llama.cpp: `export gguf` writes a GGUF that it loads.
    let exported = dir.path().join("trained.gguf");
    let (code, said, err) = harness_s(&["export", "gguf", "e2e-embedded", "--out", exported.to_str().unwrap(), "--store", &store_url]);
    assert_eq!(code, 0, "{said}\n{err}");
    assert!(said.contains("step 1 of run `e2e-embedded`"), "{said}");
    let load = Command::new(harness_s_tests::python())
        .args([
            "-c",
            "import sys; from llama_cpp import Llama; m = Llama(model_path=sys.argv[1], n_ctx=128, verbose=False); print(m.n_vocab())",
        ])
        .arg(&exported)
        .output()
        .unwrap();
    assert!(load.status.success() && String::from_utf8_lossy(&load.stdout).trim() == "49152", "{}", String::from_utf8_lossy(&load.stderr));

    // Table 9: every finished stage has its wall time; the policy's tokens equal the rows'.
    let cost = |stage: &str, name: &str| metrics.iter().filter(|m| m.stage == stage && m.name == name).map(|m| m.value).sum::<f64>();
    for stage in ["baseline", "calibration", "base", "rescue", "groups", "learn", "evaluation"] {
        assert!(metrics.iter().any(|m| m.stage == format!("cost:{stage}") && m.name == "wall_seconds"), "no wall time for {stage}");
    }
    let base_rows = rows.iter().filter(|r| r.kind == RolloutKind::Base);
    assert_eq!(cost("cost:base", "policy_completion_tokens"), base_rows.clone().map(|r| r.completion_tokens as f64).sum::<f64>());
    assert_eq!(cost("cost:base", "rollouts"), base_rows.count() as f64);
    assert!(cost("cost:learn", "learner_forward_tokens") > 0.0, "the learner's tokens are counted");
    assert_eq!(cost("cost:rescue", "voter_calls"), 0.0, "the rule router spends no LLM tokens");

    // H_best (Table 7): the pool member with the best validation success at the final
    // calibration, evaluated on every test task with H0's seeds, named in the report.
    let h_best = metrics.iter().find(|m| m.stage == "evaluation:h_best").expect("H_best recorded");
    let final_stats = serde_json::from_slice::<serde_json::Value>(
        &store.get("runs/e2e-embedded/profiles/calib=step-0001/calibration.json").await.unwrap(),
    )
    .unwrap();
    assert!(final_stats["stats"].get(&h_best.name).is_some(), "H_best `{}` is a calibrated harness", h_best.name);
    for name in ["h_best_pass_at_k", "h_best_avg_at_k"] {
        assert!(metrics.iter().any(|m| m.stage == "evaluation" && m.name == name), "metric {name} missing");
    }
    if h_best.name != "h0" {
        let eval: Vec<Trajectory> = read_prefix(store.as_ref(), "runs/e2e-embedded/trajectories/step=1/kind=eval/").await.unwrap();
        let seeds = |h: &str| {
            eval.iter().filter(|r| r.harness_id == h).map(|r| (r.task_id.clone(), r.seed)).collect::<std::collections::BTreeSet<_>>()
        };
        assert_eq!(seeds(&h_best.name), seeds("h0"), "H_best runs every test task with H0's seeds");
    }
    let report = String::from_utf8(store.get("runs/e2e-embedded/reports/report.md").await.unwrap().to_vec()).unwrap();
    assert!(report.contains(&format!("under H_best = `{}`", h_best.name)), "{report}");
    assert!(report.contains("## Cost (Table 9 layout)") && report.contains("| learn |"), "{report}");
    assert!(
        report.contains("K = 2, 2 task(s) per update, 1 update(s)") && report.contains("rescue `router`"),
        "the resolved settings head the report:\n{report}"
    );
    assert!(report.contains("## Training rollouts") && report.contains("| h0 |"), "{report}");
    for png in ["harnesses.png", "rollouts.png", "validation.png"] {
        assert_eq!(&store.get(&format!("runs/e2e-embedded/reports/{png}")).await.unwrap()[1..4], b"PNG", "{png}");
    }
    assert!(out.contains("H_best = "), "{out}");

    // Re-anchoring: one calibration per checkpoint, each naming the checkpoint it froze;
    // rescue routing names the calibration it used (the rule router keeps the first).
    let manifest = |id: &str| {
        let store = store.clone();
        let key = format!("runs/e2e-embedded/profiles/calib={id}/calibration.json");
        async move { serde_json::from_slice::<serde_json::Value>(&store.get(&key).await.unwrap()).unwrap() }
    };
    let (before, after) = (manifest("step-0000").await, manifest("step-0001").await);
    let frozen = |m: &serde_json::Value| m["policy_checkpoint"].as_str().unwrap().to_string();
    assert!(frozen(&after).ends_with("checkpoints/step=1/manifest.json"), "{}", frozen(&after));
    assert_ne!(frozen(&before), frozen(&after), "each calibration freezes its own checkpoint");
    for m in [&before, &after] {
        let stats = m["stats"].as_object().unwrap();
        assert_eq!(stats.len(), 5, "H0 and the four siblings: {stats:?}");
    }
    let decisions: Vec<schemas::RoutingDecision> = read_prefix(store.as_ref(), "runs/e2e-embedded/routing/").await.unwrap();
    let rescue_decisions: Vec<_> = decisions.iter().filter(|d| d.purpose == schemas::RoutePurpose::Rescue).collect();
    assert_eq!(rescue_decisions.len(), groups.iter().filter(|g| g.rescue_fired).count());
    for d in rescue_decisions {
        assert_eq!(d.calibration_id.as_deref(), Some("step-0000"), "{d:?}");
        assert_eq!(d.variant, "rule");
    }

    // A finished run refuses to resume, with a non-zero exit code.
    let (code, _, err) = harness_s(&["resume", "e2e-embedded", "--store", &store_url]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("already finished"), "{err}");
}

/// HE-only (`updates = 0`): the pool evaluated with the starting policy — H0, H_best and
/// the router's Rank-1 on the test tasks after one calibration — with no update rollouts,
/// no learn step and no checkpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn updates_zero_evaluates_the_pool_with_the_starting_policy() {
    let dir = tempfile::tempdir().unwrap();
    let spec = spec_with(dir.path(), "e2e-he-only", "router", 2);
    let text = std::fs::read_to_string(&spec).unwrap();
    assert!(text.contains("updates = 1\n"));
    std::fs::write(&spec, text.replace("updates = 1\n", "updates = 0\n")).unwrap();
    let store_url = format!("file://{}", dir.path().join("store").display());
    let (code, out, err) = harness_s(&["run", spec.to_str().unwrap(), "--store", &store_url]);
    assert!(code == 0 || code == 3, "exit {code}\n{out}\n{err}");
    let store = open_store(&store_url).await.unwrap();
    let state: serde_json::Value = serde_json::from_slice(&store.get("runs/e2e-he-only/state.json").await.unwrap()).unwrap();
    let completed: Vec<&str> = state["completed"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    assert_eq!(completed, ["calibration:0", "evaluation", "report"], "{state}");
    let (counts, _) = row_counts(store.as_ref(), "e2e-he-only").await;
    assert!(counts.keys().all(|(_, kind)| kind == "calibration" || kind == "eval"), "no update rollouts: {counts:?}");
    assert!(store.list("runs/e2e-he-only/checkpoints/").await.unwrap().is_empty(), "no checkpoint");
    let metrics: Vec<MetricRow> = read_prefix(store.as_ref(), "runs/e2e-he-only/metrics/").await.unwrap();
    for name in ["pass_at_k", "h_best_pass_at_k", "pass_at_k/rank-1"] {
        assert!(metrics.iter().any(|m| m.name == name && m.step == 0), "metric {name} missing: {metrics:?}");
    }
    let report = String::from_utf8(store.get("runs/e2e-he-only/reports/report.md").await.unwrap().to_vec()).unwrap();
    assert!(report.contains("starting policy (no updates), under H0") && report.contains("under H_best = `"), "{report}");
}

/// The tiny spec as a rescue-only run of an endpoint policy (text tool protocol), on a
/// MySQL server at `db_url` when given.
fn endpoint_spec(dir: &Path, id: &str, base_url: &str, db_url: Option<&str>) -> PathBuf {
    let mut spec = std::fs::read_to_string(spec_with(dir, id, "router", 2))
        .unwrap()
        .replace(
            &native_policy_lines(),
            &format!("backend = \"openai\"\nmodel = \"m\"\nbase_url = \"{base_url}\"\ntool_protocol = \"text\"\n"),
        )
        .replace("learning_rate = 1e-6\n", "learning_rate = 1e-6\nlearn = false\n");
    if let Some(url) = db_url {
        spec = spec.replace("engine = \"sqlite\"", &format!("engine = \"mysql\"\ndb_url = \"{url}\""));
    }
    let path = dir.join(format!("{id}.toml"));
    std::fs::write(&path, spec).unwrap();
    path
}

/// `harness-s run SPEC --store DIR`: whether it succeeded, and its stderr.
fn run_spec(spec: &Path, store: &Path) -> (bool, String) {
    let out = Command::new(harness_s_bin()).args(["run", spec.to_str().unwrap(), "--store", store.to_str().unwrap()]).output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn a_run_whose_services_do_not_answer_stops_before_any_episode() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let path = endpoint_spec(dir.path(), "unreachable", "http://127.0.0.1:1/v1", Some("mysql://root@127.0.0.1:1"));
    let started = std::time::Instant::now();
    let (ok, err) = run_spec(&path, &store);
    assert!(!ok, "{err}");
    assert!(started.elapsed().as_secs() < 60, "took {:?}", started.elapsed());
    assert!(err.contains("2 service(s)") && err.contains("environment.db_url") && err.contains("policy.base_url"), "{err}");
    assert!(err.contains("nothing was run"), "{err}");
    // no episode was recorded
    let trajectories = store.join("runs/unreachable/trajectories");
    assert!(!trajectories.exists(), "episodes were recorded against unreachable services");
}

/// A server that lists models but refuses every completion (404: the model is not served),
/// so that every episode fails with a `policy` error after the preflight passed.
fn refusing_server() -> u16 {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            std::thread::spawn(move || {
                let mut buf = vec![];
                let mut chunk = [0u8; 4096];
                // read the head, then as much body as Content-Length says
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut chunk) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                let text = String::from_utf8_lossy(&buf).to_string();
                let head_end = text.find("\r\n\r\n").unwrap() + 4;
                let length = text
                    .lines()
                    .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().parse::<usize>().unwrap_or(0)))
                    .unwrap_or(0);
                while buf.len() < head_end + length {
                    match stream.read(&mut chunk) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                let (status, body) = if text.starts_with("GET") {
                    ("200 OK", r#"{"object":"list","data":[{"id":"other","object":"model"}]}"#)
                } else {
                    ("404 Not Found", r#"{"error":{"message":"model `m` is not served here","code":"model_not_found"}}"#)
                };
                let _ = write!(
                    stream,
                    "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
            });
        }
    });
    port
}

#[test]
fn a_stage_whose_episodes_all_hit_service_errors_stops_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let port = refusing_server();
    let path = endpoint_spec(dir.path(), "refused", &format!("http://127.0.0.1:{port}/v1"), None);
    let (ok, err) = run_spec(&path, &store);
    assert!(!ok, "{err}");
    assert!(err.contains("failed with service errors") && err.contains("budgets.stage_failure_share"), "{err}");
    assert!(err.contains("not served here"), "the first error is shown: {err}");
    // it stopped at the first stage: no learner step, no evaluation
    assert!(!store.join("runs/refused/checkpoints").exists());
    let state = read_state(&store, "refused").expect("state.json");
    assert_ne!(state["phase"], "finished", "{state}");
}

/// Flipped bytes in a trajectory part and a truncated done-marker: `harness-s verify` names
/// both files and exits 1; a resume re-runs exactly the two damaged jobs (WARN lines name
/// the files), rewrites the same rows, and the run verifies clean again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damaged_outputs_are_found_and_healed_by_re_running_their_jobs() {
    let dir = tempfile::tempdir().unwrap();
    let base = std::fs::read_to_string(tiny_spec(dir.path(), "damaged", "router")).unwrap();
    let spec = dir.path().join("damaged.toml");
    std::fs::write(&spec, base.replace("learning_rate = 1e-6\n", "learning_rate = 1e-6\nlearn = false\n")).unwrap();
    let store_dir = dir.path().join("store");
    let store_url = format!("file://{}", store_dir.display());
    let (code, _, err) = harness_s(&["submit", spec.to_str().unwrap(), "--store", &store_url]);
    assert_eq!(code, 0, "{err}");
    let state_path = store_dir.join("runs/damaged/state.json");
    let initial_state = std::fs::read(&state_path).unwrap();
    let (code, _, err) = harness_s(&["resume", "damaged", "--store", &store_url]);
    assert!(code == 0 || code == 3, "{err}");
    let (code, out, err) = harness_s(&["verify", "damaged", "--store", &store_url]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("intact"), "{out}");

    let store = open_store(&store_url).await.unwrap();
    let before: Vec<Trajectory> = read_prefix(store.as_ref(), "runs/damaged/trajectories/").await.unwrap();
    let parts: Vec<String> = store.list("runs/damaged/trajectories/step=1/kind=base/").await.unwrap().into_iter().map(|o| o.key).collect();
    let part = parts.first().expect("a base part").clone();
    let mut bytes = std::fs::read(store_dir.join(&part)).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    bytes[mid + 1] ^= 0x55;
    std::fs::write(store_dir.join(&part), &bytes).unwrap();
    let markers: Vec<String> = store.list("runs/damaged/jobs/").await.unwrap().into_iter().map(|o| o.key).collect();
    let mut truncated = None;
    for m in &markers {
        let text = String::from_utf8(store.get(m).await.unwrap().to_vec()).unwrap();
        if !text.contains(&part) && text.contains("trajectories") {
            std::fs::write(store_dir.join(m), &text.as_bytes()[..text.len() / 2]).unwrap();
            truncated = Some(m.clone());
            break;
        }
    }
    let truncated = truncated.expect("another rollout job's marker");

    let (code, out, _) = harness_s(&["verify", "damaged", "--store", &store_url]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("2 damaged")
            && out.contains(&part)
            && out.contains("SHA-256")
            && out.contains(&truncated)
            && out.contains("does not parse"),
        "{out}"
    );

    // an interrupted run resumes over the damage: back to the submitted state, every stage
    // runs again, finds its markers, and re-runs only the damaged jobs
    std::fs::write(&state_path, initial_state).unwrap();
    let (code, _, err) = harness_s(&["resume", "damaged", "--store", &store_url]);
    assert!(code == 0 || code == 3, "{err}");
    let warns: Vec<&str> = err.lines().filter(|l| l.contains("damaged job output")).collect();
    assert_eq!(warns.len(), 2, "{err}");
    assert!(warns.iter().any(|l| l.contains(&part)) && warns.iter().any(|l| l.contains(&truncated)), "{warns:?}");
    let (code, out, _) = harness_s(&["verify", "damaged", "--store", &store_url]);
    assert_eq!(code, 0, "{out}");
    let after: Vec<Trajectory> = read_prefix(store.as_ref(), "runs/damaged/trajectories/").await.unwrap();
    let key = |r: &Trajectory| (r.task_id.clone(), r.kind, r.harness_id.clone(), r.attempt, r.success, r.completion_tokens);
    let (mut a, mut b): (Vec<_>, Vec<_>) = (before.iter().map(key).collect(), after.iter().map(key).collect());
    a.sort();
    b.sort();
    assert_eq!(a, b, "the re-run jobs wrote the same rows");

    // the run is finished now: `resume` refuses it, `repair` re-runs the damaged job and the
    // run ends as it did (same rows, same counts, finished)
    let finished: serde_json::Value = serde_json::from_slice(&std::fs::read(&state_path).unwrap()).unwrap();
    std::fs::write(store_dir.join(&part), &bytes).unwrap();
    let (code, _, err) = harness_s(&["resume", "damaged", "--store", &store_url]);
    assert_ne!(code, 0, "a finished run does not resume: {err}");
    let (code, out, _) = harness_s(&["verify", "damaged", "--store", &store_url]);
    assert!(code == 1 && out.contains("harness-s repair damaged"), "{out}");
    let (code, out, err) = harness_s(&["repair", "damaged", "--store", &store_url]);
    assert!(code == 0 || code == 3, "{out}{err}");
    assert!(out.contains("repaired") && err.contains(&part), "{out}{err}");
    let (code, out, _) = harness_s(&["verify", "damaged", "--store", &store_url]);
    assert_eq!(code, 0, "{out}");
    let repaired: serde_json::Value = serde_json::from_slice(&std::fs::read(&state_path).unwrap()).unwrap();
    for field in
        ["status", "step", "completed", "rollouts_base", "rollouts_rescue", "rollouts_other", "tokens", "failures", "started_at_ms"]
    {
        assert_eq!(repaired[field], finished[field], "state.{field} after the repair");
    }
    let mut c: Vec<_> = read_prefix::<Trajectory>(store.as_ref(), "runs/damaged/trajectories/").await.unwrap().iter().map(key).collect();
    c.sort();
    assert_eq!(a, c, "the repaired run holds the same rows");
}

#[test]
fn an_invalid_spec_is_refused_before_any_job_runs_with_every_problem_listed() {
    let dir = tempfile::tempdir().unwrap();
    let pool = dir.path().join("pool");
    std::fs::create_dir_all(&pool).unwrap();
    std::fs::write(pool.join("bad.json"), r#"{"id": "bad", "hooks": [{"event": "on_lunch", "condition": "x", "action": "warn"}]}"#)
        .unwrap();
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
    let fixed = spec
        .replace("colour = \"red\"\n", "")
        .replace("k = 0", "k = 1\nlearn = false")
        .replace("train = \"train.jsonl\"", "train = \"train.jsonl\"\nvalidation = \"train.jsonl\"\ntest = \"train.jsonl\"");
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
                .args(["worker", "--queue", &queue_url, "--store", &store_url, "--queues", "rollout,rescue,reanchor,eval,learn,transfer"])
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

/// A pool folder with the first `n` example siblings (sorted by file name).
fn small_pool(dir: &Path, n: usize) -> PathBuf {
    let pool = dir.join("pool");
    std::fs::create_dir_all(&pool).unwrap();
    let mut files: Vec<PathBuf> = std::fs::read_dir(repo_root().join("examples/pool"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with('s'))
        .collect();
    files.sort();
    for f in files.into_iter().take(n) {
        std::fs::copy(&f, pool.join(f.file_name().unwrap())).unwrap();
    }
    pool
}

/// Two updates, rescue by the rule router over two siblings, re-anchoring only before
/// training and at the end: the smallest run with a checkpoint that depends on another.
fn two_update_spec(dir: &Path, id: &str, pool: &Path, train: u32, tasks_per_update: u32, updates: u32) -> PathBuf {
    let spec = format!(
        r#"
[run]
id = "{id}"
seed = 21
[environment]
kind = "dbbench"
engine = "sqlite"
max_rounds = 2
[tasks.generate]
seed = 8
train = {train}
validation = 1
test = 1
difficulty = "easy"
kinds = ["counting"]
[policy]
backend = "native"
model = "{model}"
max_tokens = 16
temperature = 0.7
[pool]
dir = "{pool}"
[algorithm]
k = 2
tasks_per_update = {tasks_per_update}
updates = {updates}
learning_rate = 1e-5
rescue = "router"
[router]
variant = "rule"
[calibration]
interval = 0
tasks = 1
[evaluation]
k = 1
baseline = false
ranks = 0
[budgets]
episode_model_calls = 2
"#,
        pool = pool.display(),
        model = tiny_policy().display()
    );
    let path = dir.join(format!("{id}.toml"));
    std::fs::write(&path, spec).unwrap();
    path
}

/// A run spec whose `model` is a Qwen3.5 folder trains on the CPU end to end: the native
/// engine rolls the hybrid model out (GDN state per sequence), rescue and the learn jobs run
/// on it, and both updates train (policy tokens, changed weights, a training–inference
/// mismatch below 1e-3) and checkpoint a Qwen3.5 folder (transformers' names and config).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_qwen3_5_folder_trains_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let pool = small_pool(dir.path(), 4);
    let folder = harness_s_tests::tiny_qwen3_5();
    // `generate` runs it as a chat: the guesser's answer
    let (code, out, err) = harness_s(&["generate", "--model", folder.to_str().unwrap(), "--prompt", "How many?", "--chat", "--greedy"]);
    assert!(code == 0 && out.contains("Final Answer: ["), "generate: exit {code}\n{out}\n{err}");
    let spec = two_update_spec(dir.path(), "qwen3-5", &pool, 8, 4, 2);
    let text = std::fs::read_to_string(&spec)
        .unwrap()
        .replace(&format!("model = \"{}\"", tiny_policy().display()), &format!("model = \"{}\"", folder.display()))
        .replace("k = 2\ntasks_per_update", "k = 4\ntasks_per_update");
    std::fs::write(&spec, text).unwrap();
    let store_dir = dir.path().join("store");
    let store_url = format!("file://{}", store_dir.display());
    let (code, out, err) = harness_s(&["run", spec.to_str().unwrap(), "--store", &store_url]);
    assert!(code == 0 || code == 3, "exit {code}\n{out}\n{err}");
    let store = open_store(&store_url).await.unwrap();
    let rows: Vec<Trajectory> = read_prefix(store.as_ref(), "runs/qwen3-5/trajectories/").await.unwrap();
    let wins = rows.iter().filter(|t| t.reward > 0.0).count();
    assert!(wins > 0 && wins < rows.len(), "{wins} of {} rollouts rewarded", rows.len());
    let (base, _) = native::model::loader::load(&folder, tch::Device::Cpu).unwrap();
    for step in [1u32, 2] {
        let bytes = store.get(&format!("runs/qwen3-5/checkpoints/step={step}/manifest.json")).await.unwrap();
        let m: schemas::CheckpointManifest = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(m.architecture, "qwen3_5_text", "update {step}");
        assert!(m.trained && m.weights_step == Some(step), "update {step} trained nothing: {:?}", m.metrics);
        assert!(m.metrics["policy_tokens"] > 0.0 && m.metrics["grad_norm"] > 0.0, "{:?}", m.metrics);
        assert!(m.metrics["mismatch_mean"] < 1e-3 && m.metrics["mismatch_tokens"] > 0.0, "{:?}", m.metrics);
        // the step is a Qwen3.5 folder with its own weights
        let ckpt = store_dir.join(format!("runs/qwen3-5/checkpoints/step={step}"));
        let config: serde_json::Value = serde_json::from_slice(&std::fs::read(ckpt.join("config.json")).unwrap()).unwrap();
        assert_eq!(config["architectures"][0], "Qwen3_5ForCausalLM");
        let (trained, _) = native::model::loader::load(&ckpt, tch::Device::Cpu).unwrap();
        let moved = native::model::CausalLm::named_tensors(&trained)
            .iter()
            .zip(native::model::CausalLm::named_tensors(&base))
            .map(|((n, a), (m, b))| {
                assert_eq!(n, &m);
                (a - b).abs().max().double_value(&[])
            })
            .fold(0.0, f64::max);
        assert!(moved > 0.0, "update {step} left every weight as the base model's");
    }
}

/// Update `step` of `run` trained: its manifest records policy tokens, a finite loss and a
/// training–inference mismatch below 1e-3, and its weights differ from the base model's.
async fn assert_trained(store: &dyn infra::store::ObjectStore, run: &str, step: u32) {
    let bytes = store.get(&format!("runs/{run}/checkpoints/step={step}/manifest.json")).await.unwrap();
    let m: schemas::CheckpointManifest = serde_json::from_slice(&bytes).unwrap();
    assert!(m.trained && m.weights_step == Some(step), "update {step} of {run} trained nothing: {m:?}");
    assert!(m.metrics["policy_tokens"] > 0.0 && m.metrics["loss"].is_finite() && m.metrics["grad_norm"] > 0.0, "{:?}", m.metrics);
    assert!(m.metrics["mismatch_mean"] < 1e-3 && m.metrics["mismatch_tokens"] > 0.0, "{:?}", m.metrics);
    let (trained, _, _) = native::train::checkpoint::load_model(store, run, step, tch::Device::Cpu).await.unwrap();
    let (base, _) = native::model::loader::load(&tiny_policy(), tch::Device::Cpu).unwrap();
    // a step kept in bfloat16 alone is compared with the base model rounded the same way
    let rounded = !m.files.iter().any(|f| f.name == native::train::checkpoint::MASTER_FILE) && {
        let weights = store.get(&format!("runs/{run}/checkpoints/step={step}/model.safetensors")).await.unwrap();
        let (_, meta) = safetensors::SafeTensors::read_metadata(&weights).unwrap();
        meta.tensors().values().any(|t| t.dtype == safetensors::Dtype::BF16)
    };
    let moved = native::model::CausalLm::named_tensors(&trained)
        .iter()
        .zip(native::model::CausalLm::named_tensors(&base))
        .map(|((n, a), (m, b))| {
            assert_eq!(n, &m);
            let b = if rounded { b.to_kind(tch::Kind::BFloat16).to_kind(tch::Kind::Float) } else { b };
            (a - b).abs().max().double_value(&[])
        })
        .fold(0.0, f64::max);
    assert!(moved > 0.0, "update {step} of {run} left every weight as the base model's");
    // The weights file says it is a PyTorch-layout safetensors file, as transformers expects.
    let weights = store.get(&format!("runs/{run}/checkpoints/step={step}/model.safetensors")).await.unwrap();
    let header_len = u64::from_le_bytes(weights[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&weights[8..8 + header_len]).unwrap();
    assert_eq!(header["__metadata__"]["format"], "pt", "{}", header["__metadata__"]);
}

/// `(name, sha256)` of every file of a stored checkpoint.
async fn checkpoint_files(store: &dyn infra::store::ObjectStore, run: &str, step: u32) -> Vec<(String, String)> {
    let bytes = store.get(&format!("runs/{run}/checkpoints/step={step}/manifest.json")).await.unwrap();
    let m: schemas::CheckpointManifest = serde_json::from_slice(&bytes).unwrap();
    let mut files: Vec<(String, String)> = m.files.into_iter().map(|f| (f.name, f.sha256)).collect();
    files.sort();
    files
}

/// Rows per (step, kind) of a run's trajectories, and whether any trajectory id repeats.
async fn row_counts(store: &dyn infra::store::ObjectStore, run: &str) -> (std::collections::BTreeMap<(u32, String), usize>, bool) {
    let rows: Vec<Trajectory> = read_prefix(store, &format!("runs/{run}/trajectories/")).await.unwrap();
    let mut counts = std::collections::BTreeMap::new();
    let mut ids = std::collections::BTreeSet::new();
    let mut repeated = false;
    for r in &rows {
        *counts.entry((r.step, r.kind.as_str().to_string())).or_default() += 1;
        repeated |= !ids.insert(r.trajectory_id.clone());
    }
    (counts, repeated)
}

fn read_state(store_dir: &Path, run: &str) -> Option<serde_json::Value> {
    let bytes = std::fs::read(store_dir.join(format!("runs/{run}/state.json"))).ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// The scheduler is SIGKILLed after the first update; `harness-s resume` finishes the run
/// and its final checkpoint is bit-identical to an uninterrupted run's with the same seed
/// (native backend on CPU). A second resume refuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_killed_after_the_first_update_resumes_to_the_same_final_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let pool = small_pool(dir.path(), 2);
    let store_dir = dir.path().join("store");
    let store_url = format!("file://{}", store_dir.display());
    let store = open_store(&store_url).await.unwrap();

    // both runs keep bfloat16 weights, and float32 weights and optimizer state only for the
    // newest step: resuming must still be exact
    let bf16 = |spec: PathBuf| {
        let text = std::fs::read_to_string(&spec).unwrap();
        std::fs::write(&spec, format!("{text}\n[checkpoints]\ndtype = \"bf16\"\n")).unwrap();
        spec
    };
    let whole = bf16(two_update_spec(dir.path(), "resume-whole", &pool, 2, 1, 2));
    let (code, out, err) = harness_s(&["run", whole.to_str().unwrap(), "--store", &store_url]);
    assert!(code == 0 || code == 3, "uninterrupted run: exit {code}\n{out}\n{err}");

    let killed = bf16(two_update_spec(dir.path(), "resume-killed", &pool, 2, 1, 2));
    let log = std::fs::File::create(dir.path().join("killed.log")).unwrap();
    let mut child = Command::new(harness_s_bin())
        .args(["run", killed.to_str().unwrap(), "--store", &store_url])
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    loop {
        if let Some(st) = read_state(&store_dir, "resume-killed") {
            if st["completed"].as_array().unwrap().iter().any(|s| s == "update:1:learn") {
                break;
            }
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!(
                "the run ended ({status}) before it could be killed:\n{}",
                std::fs::read_to_string(dir.path().join("killed.log")).unwrap()
            );
        }
        assert!(started.elapsed() < std::time::Duration::from_secs(1800), "update 1 never finished");
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let st = read_state(&store_dir, "resume-killed").unwrap();
    assert_eq!(st["status"], "running", "a killed scheduler leaves the run unfinished: {st}");
    assert!(store.head("runs/resume-killed/checkpoints/step=2/manifest.json").await.unwrap().is_none());

    let (code, out, err) = harness_s(&["resume", "resume-killed", "--store", &store_url]);
    assert!(code == 0 || code == 3, "resume: exit {code}\n{out}\n{err}");
    // The run learned: update 1 trained policy tokens (the resumed part starts from it).
    assert_trained(store.as_ref(), "resume-whole", 1).await;
    // Its stored step replays as one GRPO update (what the GPU probe compares across devices).
    let tokenizer = tiny_policy();
    let (code, out, err) = harness_s(&[
        "bench",
        "learner",
        "--replay",
        &store_url,
        "--run",
        "resume-whole",
        "--step",
        "1",
        "--tokenizer",
        tokenizer.to_str().unwrap(),
        "--vocab",
        "49152",
        "--width",
        "64",
        "--layers",
        "2",
    ]);
    assert_eq!(code, 0, "replay: {out}\n{err}");
    let replay = out.lines().find(|l| l.starts_with("replay of run `resume-whole` step 1")).unwrap_or_else(|| panic!("{out}"));
    let tokens: u64 = replay.split(", ").find_map(|p| p.strip_suffix(" policy tokens")).unwrap().parse().unwrap();
    assert!(tokens > 0, "{replay}");
    assert!(out.lines().any(|l| l.starts_with("loss=") && l.contains("grad_norm=")), "{out}");
    for step in [1, 2] {
        let a = checkpoint_files(store.as_ref(), "resume-whole", step).await;
        let b = checkpoint_files(store.as_ref(), "resume-killed", step).await;
        assert_eq!(a, b, "checkpoint of update {step}: resumed run differs from the uninterrupted one");
        let manifest = |run: &str| {
            let store = store.clone();
            let key = format!("runs/{run}/checkpoints/step={step}/manifest.json");
            async move { serde_json::from_slice::<schemas::CheckpointManifest>(&store.get(&key).await.unwrap()).unwrap() }
        };
        let (x, y) = (manifest("resume-whole").await, manifest("resume-killed").await);
        assert_eq!(
            (x.trained, x.weights_step, x.metrics.get("policy_tokens")),
            (y.trained, y.weights_step, y.metrics.get("policy_tokens"))
        );
    }
    // retention: the step holding the final weights keeps the resume state, step 1 (when
    // it is not that step) only its bfloat16 weights
    let last = serde_json::from_slice::<schemas::CheckpointManifest>(
        &store.get("runs/resume-whole/checkpoints/step=2/manifest.json").await.unwrap(),
    )
    .unwrap()
    .weights_step;
    for step in [1u32, 2] {
        let names: Vec<String> = checkpoint_files(store.as_ref(), "resume-whole", step).await.into_iter().map(|(n, _)| n).collect();
        let full = ["master.safetensors", "optimizer.safetensors"].iter().all(|f| names.iter().any(|n| n == f));
        if last == Some(step) {
            assert!(full, "step {step} holds the final weights and lost its resume state: {names:?}");
        } else if step == 1 {
            assert!(
                names.iter().all(|n| n != "master.safetensors" && n != "optimizer.safetensors")
                    && names.iter().any(|n| n == "model.safetensors"),
                "step 1 kept more than its weights: {names:?}"
            );
        }
    }
    let (whole_rows, whole_repeat) = row_counts(store.as_ref(), "resume-whole").await;
    let (killed_rows, killed_repeat) = row_counts(store.as_ref(), "resume-killed").await;
    assert_eq!(whole_rows, killed_rows, "the resumed run stored the same rows");
    assert!(!whole_repeat && !killed_repeat, "no trajectory is stored twice");

    let (code, _, err) = harness_s(&["resume", "resume-killed", "--store", &store_url]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("already finished"), "{err}");

    // `compare`: the two runs side by side give the same figures in both columns
    let (code, md, err) = harness_s(&["compare", "resume-whole", "resume-killed", "--store", &store_url]);
    assert_eq!(code, 0, "{err}");
    let row = md.lines().find(|l| l.starts_with("| policy tokens trained")).unwrap_or_else(|| panic!("{md}"));
    let cells: Vec<&str> = row.split('|').map(str::trim).filter(|c| !c.is_empty()).collect();
    assert!(cells.len() == 3 && cells[1] == cells[2] && cells[1] != "–", "{row}");
    for file in ["compare.md", "signal.png", "validation.png"] {
        assert!(store.head(&format!("comparisons/resume-whole-vs-resume-killed/{file}")).await.unwrap().is_some(), "{file}");
    }
    let (code, _, err) = harness_s(&["compare", "resume-whole", "--store", &store_url]);
    assert_eq!(code, 2, "compare of one run is a usage error: {err}");

    // One flipped bit in step 1's bfloat16 weights (a weights-only step) of the finished
    // run: `verify` names the file, exporting that step is refused, and `repair` rebuilds
    // the checkpoints by running both learn jobs again from the starting model: the same
    // bytes as before, the same state, and the run verifies intact.
    let before = [checkpoint_files(store.as_ref(), "resume-whole", 1).await, checkpoint_files(store.as_ref(), "resume-whole", 2).await];
    let state_before = read_state(&store_dir, "resume-whole").unwrap();
    let weights = store_dir.join("runs/resume-whole/checkpoints/step=1/model.safetensors");
    let mut bytes = std::fs::read(&weights).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x10;
    std::fs::write(&weights, &bytes).unwrap();
    let (code, out, _) = harness_s(&["verify", "resume-whole", "--store", &store_url]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("step=1/model.safetensors") && out.contains("SHA-256") && out.contains("harness-s repair"), "{out}");
    let gguf = dir.path().join("step1.gguf");
    let (code, _, err) =
        harness_s(&["export", "gguf", "resume-whole", "--out", gguf.to_str().unwrap(), "--step", "1", "--store", &store_url]);
    assert!(code != 0 && err.contains("model.safetensors") && !gguf.exists(), "exporting a damaged step is refused: {err}");
    let (code, out, err) = harness_s(&["repair", "resume-whole", "--store", &store_url]);
    assert!(code == 0 || code == 3, "repair: exit {code}\n{out}\n{err}");
    assert!(err.contains("from the starting model") && out.contains("repaired"), "{out}{err}");
    let (code, out, _) = harness_s(&["verify", "resume-whole", "--store", &store_url]);
    assert_eq!(code, 0, "{out}");
    let after = [checkpoint_files(store.as_ref(), "resume-whole", 1).await, checkpoint_files(store.as_ref(), "resume-whole", 2).await];
    assert_eq!(before, after, "the rebuilt checkpoints are the same bytes");
    let state_after = read_state(&store_dir, "resume-whole").unwrap();
    for field in ["status", "step", "completed", "latest_checkpoint", "rollouts_base", "rollouts_rescue", "tokens"] {
        assert_eq!(state_after[field], state_before[field], "state.{field} after the repair");
    }
}

/// One of two workers is SIGKILLed while rescue rollouts run: the broker redelivers its
/// job to the other worker, and the run completes with exactly the rows an undisturbed run
/// stores (K base rollouts per task, K rescue rollouts per fired group, one calibration
/// rollout per harness and validation task, one evaluation rollout per test task).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_during_rescue_rollouts_loses_nothing() {
    let _broker = harness_s_tests::broker_shared().await;
    let dir = tempfile::tempdir().unwrap();
    let pool = small_pool(dir.path(), 2);
    let run_id = harness_s_tests::unique("e2e-killworker");
    let spec = two_update_spec(dir.path(), &run_id, &pool, 2, 2, 1);
    // comparison tasks: the guesser fails every base group, so rescue jobs run
    let text = std::fs::read_to_string(&spec).unwrap();
    std::fs::write(&spec, text.replace("kinds = [\"counting\"]", "kinds = [\"comparison\"]")).unwrap();
    let store_url = harness_s_tests::s3_store_url("training");
    let queue_url = format!("{}?prefix={run_id}", harness_s_tests::amqp_url());
    let (code, _, err) = harness_s(&["submit", spec.to_str().unwrap(), "--store", &store_url, "--queue", &queue_url]);
    assert_eq!(code, 0, "{err}");
    let store = open_store(&store_url).await.unwrap();

    let worker = |name: &str| {
        let log = std::fs::File::create(dir.path().join(format!("{name}.log"))).unwrap();
        Command::new(harness_s_bin())
            .args(["worker", "--queue", &queue_url, "--store", &store_url, "--queues", "rollout,rescue,reanchor,eval,learn,transfer"])
            .env("RUST_LOG", "info")
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start a worker")
    };
    let mut doomed = worker("doomed");
    let mut survivor = worker("survivor");
    let metrics_port = harness_s_tests::free_port();
    let mut scheduler = Command::new(harness_s_bin())
        .args(["scheduler", "--run", &run_id, "--store", &store_url, "--queue", &queue_url, "--metrics-addr"])
        .arg(format!("127.0.0.1:{metrics_port}"))
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(dir.path().join("scheduler.log")).unwrap())
        .spawn()
        .unwrap();

    // Kill the doomed worker as soon as it starts a rescue job: the episode is mid-way.
    let started = std::time::Instant::now();
    let doomed_log = dir.path().join("doomed.log");
    loop {
        let text = plain(&std::fs::read_to_string(&doomed_log).unwrap_or_default());
        if text.lines().any(|l| l.contains("kind=rescue") && l.contains("job started")) {
            break;
        }
        if let Some(status) = scheduler.try_wait().unwrap() {
            panic!("the run ended ({status}) before the doomed worker started a rescue job:\n{text}");
        }
        assert!(started.elapsed() < std::time::Duration::from_secs(1800), "no rescue job started on the doomed worker");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    doomed.kill().unwrap(); // SIGKILL
    doomed.wait().unwrap();
    // The scheduler's Prometheus endpoint follows the run: by the rescue stage the
    // calibration and the base rollouts are done.
    let scraped = harness_s_tests::scrape(metrics_port);
    assert!(harness_s_tests::sample(&scraped, "harness_s_run_stages_done").is_some_and(|v| v >= 2.0), "{scraped}");
    assert!(harness_s_tests::sample(&scraped, "harness_s_run_rollouts").is_some_and(|v| v >= 4.0), "{scraped}");
    assert!(harness_s_tests::sample(&scraped, "harness_s_run_tokens").is_some_and(|v| v > 0.0), "{scraped}");
    assert!(harness_s_tests::sample(&scraped, "harness_s_run_h0_validation_success").is_some(), "{scraped}");

    let status = scheduler.wait().unwrap();
    let _ = Command::new("kill").args(["-TERM", &survivor.id().to_string()]).status();
    let _ = survivor.wait();
    let log = |name: &str| plain(&std::fs::read_to_string(dir.path().join(format!("{name}.log"))).unwrap_or_default());
    assert!(matches!(status.code(), Some(0) | Some(3)), "scheduler: {status}\n{}", log("scheduler"));

    let groups: Vec<Group> = read_prefix(store.as_ref(), &format!("runs/{run_id}/groups/")).await.unwrap();
    assert_eq!(groups.len(), 2);
    let fired = groups.iter().filter(|g| g.rescue_fired).count();
    assert!(fired > 0, "rescue fired on some all-fail group: {groups:?}");
    let (counts, repeated) = row_counts(store.as_ref(), &run_id).await;
    // The evaluation runs H0 and, when another harness was best on validation, H_best too.
    let metrics: Vec<MetricRow> = read_prefix(store.as_ref(), &format!("runs/{run_id}/metrics/")).await.unwrap();
    let h_best = metrics.iter().find(|m| m.stage == "evaluation:h_best").map(|m| m.name.clone()).expect("H_best recorded");
    let expected: std::collections::BTreeMap<(u32, String), usize> = [
        ((0, "calibration".to_string()), 3),
        ((1, "base".to_string()), 4),
        ((1, "rescue".to_string()), 2 * fired),
        ((1, "calibration".to_string()), 3),
        ((1, "eval".to_string()), if h_best == "h0" { 1 } else { 2 }),
    ]
    .into_iter()
    .collect();
    assert_eq!(counts, expected, "rows of the run with a killed worker");
    assert!(!repeated, "no trajectory is stored twice");
    let survivor_log = log("survivor");
    assert!(
        survivor_log.lines().any(|l| l.contains("kind=rescue") && l.contains("job started redelivered=true")),
        "the killed worker's job was redelivered to the survivor:\n{survivor_log}"
    );
}

/// Log text without ANSI colour sequences.
fn plain(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// `harness-s serve` of `model` under the name `name` on `port` (0: a free one); returns the
/// child and its `/v1` base URL.
pub(crate) fn start_serve(log: &Path, port: u16, model: impl AsRef<std::ffi::OsStr>, name: &str) -> (std::process::Child, String) {
    use std::io::BufRead;
    let mut child = Command::new(harness_s_bin())
        .args(["serve", "--model"])
        .arg(model)
        .args(["--served-model-name", name, "--port", &port.to_string(), "--max-concurrent-sequences", "8"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .expect("start harness-s serve");
    let mut first = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut first).unwrap();
    // "serving <weights> at http://127.0.0.1:<port>/v1"
    let url = first.trim().rsplit(' ').next().unwrap_or_default().to_string();
    assert!(
        url.starts_with("http://127.0.0.1:") && url.ends_with("/v1"),
        "serve printed `{first}`:\n{}",
        std::fs::read_to_string(log).unwrap_or_default()
    );
    (child, url)
}

/// The weights `harness-s serve` at `base_url` serves now (`/get_model_info`).
pub(crate) fn served_weights(base_url: &str) -> String {
    let root = base_url.trim_end_matches("/v1");
    let out = Command::new("curl").args(["-sf", &format!("{root}/get_model_info")]).output().unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    v["model_path"].as_str().unwrap_or_default().to_string()
}

/// Training a policy served behind an endpoint, distributed: RabbitMQ, the S3 server, a
/// scheduler process, two workers and `harness-s serve` as the policy endpoint with weight
/// sync. The server is SIGKILLed as update 2's stage starts and restarted on its starting
/// weights: the calls cut off are retried, the restarted server is brought back to the
/// step-1 checkpoint by the first client that gets a reply from other weights, and the run
/// completes. Every update trains (tokens > 0, the weights move, the server's f32 logprobs
/// match the learner's), the update-2 rollouts name the step-1 checkpoint, and the server
/// ends on the run's last checkpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_served_behind_an_endpoint_is_trained_with_weight_sync() {
    let _broker = harness_s_tests::broker_shared().await;
    let dir = tempfile::tempdir().unwrap();
    let (mut server, base_url) = start_serve(&dir.path().join("serve.log"), 0, tiny_policy(), "tiny");
    let port: u16 = base_url.trim_end_matches("/v1").rsplit(':').next().unwrap().parse().unwrap();
    let pool = small_pool(dir.path(), 2);
    let run_id = harness_s_tests::unique("e2e-endpoint-train");
    let native_spec = std::fs::read_to_string(two_update_spec(dir.path(), &run_id, &pool, 4, 2, 2)).unwrap();
    let spec_text = native_spec.replace(
        &native_policy_lines(),
        &format!(
            "backend = \"openai\"\nmodel = \"tiny\"\nbase_url = \"{base_url}\"\nweights = \"{}\"\nweight_sync = \"sglang\"\nconcurrency = 4\n",
            tiny_policy().display()
        ),
    );
    assert_ne!(spec_text, native_spec);
    let spec = dir.path().join("endpoint.toml");
    std::fs::write(&spec, spec_text).unwrap();
    let store_url = harness_s_tests::s3_store_url("endpoint-training");
    let queue_url = format!("{}?prefix={run_id}", harness_s_tests::amqp_url());
    let (code, _, err) = harness_s(&["submit", spec.to_str().unwrap(), "--store", &store_url, "--queue", &queue_url]);
    assert_eq!(code, 0, "{err}");
    let store = open_store(&store_url).await.unwrap();

    let worker = |name: &str| {
        Command::new(harness_s_bin())
            .args(["worker", "--queue", &queue_url, "--store", &store_url, "--queues", "rollout,rescue,reanchor,eval,learn,transfer"])
            .env("RUST_LOG", "info")
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(dir.path().join(format!("{name}.log"))).unwrap())
            .spawn()
            .expect("start a worker")
    };
    let mut workers = [worker("w1"), worker("w2")];
    let mut scheduler = Command::new(harness_s_bin())
        .args(["scheduler", "--run", &run_id, "--store", &store_url, "--queue", &queue_url])
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(dir.path().join("scheduler.log")).unwrap())
        .spawn()
        .unwrap();
    // Kill the server as update 2 samples, and start it again at once on its starting weights.
    let started = std::time::Instant::now();
    loop {
        let text = plain(&std::fs::read_to_string(dir.path().join("scheduler.log")).unwrap_or_default());
        if text.contains("stage started stage=\"update:2:base\"") {
            break;
        }
        if let Some(status) = scheduler.try_wait().unwrap() {
            panic!("the run ended ({status}) before update 2 started:\n{text}");
        }
        assert!(started.elapsed() < std::time::Duration::from_secs(1800), "update 2 never started");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    // At once: the scheduler synced the endpoint before it logged the stage, and the tiny
    // policy's rollouts take tens of milliseconds, so update 2's first replies come from the
    // restarted server.
    server.kill().unwrap(); // SIGKILL
    server.wait().unwrap();
    let (restarted, _) = start_serve(&dir.path().join("serve-restarted.log"), port, tiny_policy(), "tiny");
    server = restarted;
    let scheduler = scheduler.wait().unwrap();
    for w in &mut workers {
        let _ = Command::new("kill").args(["-TERM", &w.id().to_string()]).status();
        let _ = w.wait();
    }
    let log = |name: &str| plain(&std::fs::read_to_string(dir.path().join(format!("{name}.log"))).unwrap_or_default());
    assert!(
        matches!(scheduler.code(), Some(0) | Some(3)),
        "scheduler: {scheduler}\n{}\n--- w1\n{}\n--- serve\n{}",
        log("scheduler"),
        log("w1"),
        log("serve-restarted")
    );

    // Both updates trained, each from the one before.
    assert_trained(store.as_ref(), &run_id, 1).await;
    assert_trained(store.as_ref(), &run_id, 2).await;
    for step in [1, 2] {
        let m: schemas::CheckpointManifest =
            serde_json::from_slice(&store.get(&format!("runs/{run_id}/checkpoints/step={step}/manifest.json")).await.unwrap()).unwrap();
        eprintln!("update {step} through the endpoint: {:?}", m.metrics);
    }
    assert_ne!(
        checkpoint_files(store.as_ref(), &run_id, 1).await,
        checkpoint_files(store.as_ref(), &run_id, 2).await,
        "step 2 moved the weights again"
    );

    // Update 1 sampled the starting weights; update 2 the step-1 checkpoint, as the server named it.
    let rows: Vec<Trajectory> = read_prefix(store.as_ref(), &format!("runs/{run_id}/trajectories/")).await.unwrap();
    let step_of = |r: &Trajectory| native::train::learner::data::checkpoint_step(&run_id, &r.policy_checkpoint).unwrap();
    let update = |u: u32| rows.iter().filter(move |r| r.step == u && matches!(r.kind, RolloutKind::Base | RolloutKind::Rescue));
    assert!(
        update(1).count() > 0 && update(1).all(|r| step_of(r).is_none()),
        "{:?}",
        update(1).map(|r| &r.policy_checkpoint).collect::<Vec<_>>()
    );
    assert!(
        update(2).count() > 0 && update(2).all(|r| step_of(r) == Some(1)),
        "{:?}",
        update(2).map(|r| &r.policy_checkpoint).collect::<Vec<_>>()
    );
    assert!(
        rows.iter().filter(|r| r.kind == RolloutKind::Eval).all(|r| step_of(r) == Some(2)),
        "the evaluation sampled the last checkpoint"
    );
    // The server now serves the last checkpoint, loaded from the store by its URL.
    let serving = served_weights(&base_url);
    assert_eq!(native::train::learner::data::checkpoint_step(&run_id, &serving), Ok(Some(2)), "{serving}");
    assert!(serving.starts_with("s3://"), "{serving}");
    let scheduler_log = log("scheduler");
    assert!(scheduler_log.matches("policy endpoint loaded the run's weights").count() >= 2, "{scheduler_log}");
    let workers_log = log("w1") + &log("w2");
    assert!(
        workers_log.contains("serves other weights than the synced ones"),
        "a client found the restarted server on its starting weights:\n{workers_log}"
    );

    server.kill().unwrap();
    server.wait().unwrap();
}

/// A LoRA run trained through `harness-s serve`, embedded, with adapter sync (`weight_sync =
/// "lora"`, vLLM's protocol): the learner trains a rank-8 adapter (block recompute on), each
/// checkpoint is PEFT's adapter folder (no full weights), the scheduler loads each into the
/// server in place under `tiny-lora`, and rollouts of a trained step ask for that name.
/// Every update trains (tokens > 0, the adapter moves), the served policy is the trained one
/// (mismatch below 1e-3), update 2's rows name the step-1 adapter, and the server ends
/// serving the last adapter beside its unchanged base.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lora_policy_served_behind_harness_s_serve_is_trained_with_adapter_sync() {
    use native::model::lora::{ADAPTER_CONFIG_FILE, ADAPTER_FILE};
    let dir = tempfile::tempdir().unwrap();
    let (mut server, base_url) = start_serve(&dir.path().join("serve.log"), 0, tiny_policy(), "tiny");
    let pool = small_pool(dir.path(), 2);
    let run_id = harness_s_tests::unique("e2e-lora-serve");
    let native_spec = std::fs::read_to_string(two_update_spec(dir.path(), &run_id, &pool, 4, 2, 2)).unwrap();
    let spec_text = native_spec.replace(
        &native_policy_lines(),
        &format!(
            "backend = \"openai\"\nmodel = \"tiny\"\nbase_url = \"{base_url}\"\nweights = \"{}\"\nweight_sync = \"lora\"\nconcurrency = 4\n",
            tiny_policy().display()
        ),
    ) + "[learner]\nrecompute = \"blocks\"\n[learner.adapter]\nrank = 8\n";
    let spec = dir.path().join("lora.toml");
    std::fs::write(&spec, spec_text).unwrap();
    let store_dir = dir.path().join("store");
    let (code, out, err) = harness_s(&["run", spec.to_str().unwrap(), "--store", store_dir.to_str().unwrap()]);
    let serve_log = std::fs::read_to_string(dir.path().join("serve.log")).unwrap_or_default();
    assert!(matches!(code, 0 | 3), "{out}\n{err}\n--- serve\n{serve_log}");
    let store: std::sync::Arc<dyn infra::store::ObjectStore> = std::sync::Arc::new(infra::store::LocalStore::new(&store_dir).unwrap());
    let mut adapters = vec![];
    for step in [1, 2] {
        let m: schemas::CheckpointManifest =
            serde_json::from_slice(&store.get(&format!("runs/{run_id}/checkpoints/step={step}/manifest.json")).await.unwrap()).unwrap();
        assert!(m.trained && m.metrics["policy_tokens"] > 0.0 && m.metrics["grad_norm"] > 0.0, "{:?}", m.metrics);
        assert!(
            m.metrics["mismatch_mean"] < 1e-3 && m.metrics["mismatch_tokens"] > 0.0,
            "the served policy is not the trained one: {:?}",
            m.metrics
        );
        let names: Vec<&str> = m.files.iter().map(|f| f.name.as_str()).collect();
        assert!(
            names.contains(&ADAPTER_FILE) && names.contains(&ADAPTER_CONFIG_FILE) && !names.contains(&"model.safetensors"),
            "{names:?}"
        );
        adapters.push(m.files.iter().find(|f| f.name == ADAPTER_FILE).unwrap().sha256.clone());
        eprintln!("LoRA update {step} through serve: {:?}", m.metrics);
    }
    assert_ne!(adapters[0], adapters[1], "update 2 moved the adapter again");
    // the base still serves the starting weights; the adapter beside it is step 2's
    let base = served_weights(&base_url);
    assert_eq!(native::train::learner::data::checkpoint_step(&run_id, &base), Ok(None), "{base}");
    let models: serde_json::Value = reqwest::get(format!("{base_url}/models")).await.unwrap().json().await.unwrap();
    let adapter = models["data"].as_array().unwrap().iter().find(|m| m["id"] == "tiny-lora").unwrap_or_else(|| panic!("{models}"));
    let root = adapter["root"].as_str().unwrap();
    assert_eq!(native::train::learner::data::checkpoint_step(&run_id, root), Ok(Some(2)), "{models}");
    assert!(serve_log.matches("LoRA adapter loaded").count() >= 2, "{serve_log}");
    let rows: Vec<Trajectory> = read_prefix(store.as_ref(), &format!("runs/{run_id}/trajectories/")).await.unwrap();
    let step_of = |r: &Trajectory| native::train::learner::data::checkpoint_step(&run_id, &r.policy_checkpoint).unwrap();
    assert!(
        rows.iter().filter(|r| r.step == 2 && r.kind == RolloutKind::Base).all(|r| step_of(r) == Some(1)),
        "update 2 sampled the step-1 adapter"
    );
    assert!(rows.iter().any(|r| r.step == 2 && r.kind == RolloutKind::Base));
    server.kill().unwrap();
    server.wait().unwrap();
}

/// An object store that fails the first read of the update's groups (which only the learn
/// job reads) with a transient error, as a dropped S3 connection would.
#[derive(Debug)]
struct FlakyStore {
    inner: std::sync::Arc<dyn infra::store::ObjectStore>,
    failing: String,
    failures: std::sync::atomic::AtomicUsize,
}

#[async_trait::async_trait]
impl infra::store::ObjectStore for FlakyStore {
    fn url(&self) -> String {
        self.inner.url()
    }
    fn folder_url(&self, prefix: &str) -> String {
        self.inner.folder_url(prefix)
    }
    async fn put(&self, key: &str, bytes: bytes::Bytes) -> infra::store::Result<()> {
        self.inner.put(key, bytes).await
    }
    async fn put_if_absent(&self, key: &str, bytes: bytes::Bytes) -> infra::store::Result<infra::store::PutOutcome> {
        self.inner.put_if_absent(key, bytes).await
    }
    async fn get(&self, key: &str) -> infra::store::Result<bytes::Bytes> {
        if key.starts_with(&self.failing) && self.failures.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
            return Err(infra::store::StoreError::Unreachable { endpoint: self.url(), detail: "connection reset (injected)".into() });
        }
        self.inner.get(key).await
    }
    async fn get_range(&self, key: &str, range: std::ops::Range<u64>) -> infra::store::Result<bytes::Bytes> {
        self.inner.get_range(key, range).await
    }
    async fn head(&self, key: &str) -> infra::store::Result<Option<infra::store::ObjectMeta>> {
        self.inner.head(key).await
    }
    async fn list(&self, prefix: &str) -> infra::store::Result<Vec<infra::store::ObjectMeta>> {
        self.inner.list(prefix).await
    }
    async fn delete(&self, key: &str) -> infra::store::Result<()> {
        self.inner.delete(key).await
    }
    async fn put_multipart(&self, key: &str) -> infra::store::Result<Box<dyn infra::store::MultipartUpload>> {
        self.inner.put_multipart(key).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_learn_job_whose_store_fails_transiently_is_retried_and_the_run_completes() {
    let dir = tempfile::tempdir().unwrap();
    let spec = tiny_spec(dir.path(), "flaky-learn", "router");
    let loaded = scheduler::run::spec::load(&spec).unwrap();
    let local = open_store(&format!("file://{}", dir.path().join("store").display())).await.unwrap();
    let flaky = std::sync::Arc::new(FlakyStore {
        inner: local.clone(),
        failing: "runs/flaky-learn/groups/step=1/".into(),
        failures: Default::default(),
    });
    scheduler::run::submit(flaky.as_ref(), &loaded).await.unwrap();
    let finish = scheduler::run::drive_embedded(flaky.clone(), "flaky-learn", 1, false, worker::Metrics::default()).await.unwrap();
    assert!(matches!(finish, scheduler::run::machine::Finish::Completed | scheduler::run::machine::Finish::Degraded), "{finish:?}");
    let reads = flaky.failures.load(std::sync::atomic::Ordering::SeqCst);
    assert!(reads >= 2, "the learn job read the groups, failed once and read them again on its retry ({reads} reads)");
    let state: serde_json::Value = serde_json::from_slice(&local.get("runs/flaky-learn/state.json").await.unwrap()).unwrap();
    let completed: Vec<&str> = state["completed"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    assert!(completed.contains(&"update:1:learn") && completed.contains(&"report"), "{state}");
    let learn: Vec<MetricRow> = read_prefix(local.as_ref(), "runs/flaky-learn/metrics/").await.unwrap();
    assert!(learn.iter().any(|m| m.stage == "learn"), "the learn step recorded its metrics");
}
