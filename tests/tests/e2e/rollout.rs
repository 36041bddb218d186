//! `harness-s rollout` end to end: real DBBench dev tasks on embedded SQLite, the real
//! llama.cpp server (llama-cpp-python + SmolLM2-135M-Instruct, started by
//! `infra/deploy/llama-server.sh`), trajectories written as Parquet to a local store and
//! read back with DuckDB (no project code). A fault-injecting HTTP server on 127.0.0.1
//! stands in for a broken policy server (invalid JSON, answers slower than the timeout).

use std::path::Path;
use std::process::Output;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use harness_s_tests::{harness_s_bin, openai_model, openai_url, unique};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Three dev tasks with small tables (short prompts for a 2,048-token context): a write, an
/// aggregation and a comparison.
const TASKS: &str = "dev-24,dev-18,dev-10";

use harness_s_tests::repo_root;

use harness_s_tests::dev_tasks;

/// Runs `harness-s rollout` with small budgets that fit SmolLM2's context.
async fn rollout(policy_url: &str, harness: &str, tasks: &str, out: &Path, run: &str, extra: &[&str]) -> Output {
    let mut cmd = tokio::process::Command::new(harness_s_bin());
    cmd.args(["rollout", "--tasks"])
        .arg(dev_tasks())
        .args(["--task-ids", tasks, "--harness", harness, "--policy", policy_url, "--model", &openai_model()])
        .args(["--tool-protocol", "text", "--n", "1", "--seed", "7", "--run", run])
        .args(["--max-rounds", "3", "--max-model-calls", "2", "--max-tokens", "40", "--max-context-tokens", "2048"])
        .arg("--store")
        .arg(out)
        .args(extra);
    cmd.output().await.expect("harness-s runs")
}

fn text(out: &Output) -> String {
    format!("{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
}

/// Runs a DuckDB query over every Parquet file under `dir` (`TRAJ` in `select`).
fn duckdb(dir: &Path, select: &str) -> Vec<serde_json::Value> {
    let glob = format!("{}/**/*.parquet", dir.display());
    harness_s_tests::duckdb(&select.replace("TRAJ", &format!("read_parquet('{glob}')")))
}

#[tokio::test]
async fn rollouts_under_h0_and_a_hooked_sibling_write_parquet_with_token_logprobs() {
    let url = openai_url();
    let dir = tempfile::tempdir().unwrap();
    let run = unique("e2e-rollout");
    let sibling = repo_root().join("examples/hooks/s2-commit-answer.json");
    for harness in ["h0", sibling.to_str().unwrap()] {
        let out = rollout(&url, harness, TASKS, dir.path(), &run, &[]).await;
        let shown = text(&out);
        assert_eq!(out.status.code(), Some(0), "rollout under {harness} failed:\n{shown}");
        assert!(shown.contains("all                     3"), "the summary counts 3 episodes:\n{shown}");
        assert!(shown.contains("tokens: prompt"), "{shown}");
    }

    // One row per (harness, task), written by the real policy, no errors.
    let rows = duckdb(
        dir.path(),
        "SELECT harness_id, count(*) AS n, count(DISTINCT task_id) AS tasks, count(error_class) AS errors, \
                min(policy_checkpoint) AS model, min(model_calls) AS min_calls, sum(completion_tokens) AS completion \
         FROM TRAJ GROUP BY harness_id ORDER BY harness_id",
    );
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert_eq!(rows[0]["harness_id"], "h0");
    assert_eq!(rows[1]["harness_id"], "s2-commit-answer");
    for r in &rows {
        assert_eq!((r["n"].as_i64(), r["tasks"].as_i64(), r["errors"].as_i64()), (Some(3), Some(3), Some(0)), "{r}");
        assert_eq!(r["model"], openai_model());
        assert!(r["min_calls"].as_i64().unwrap() >= 1, "{r}");
        assert!(r["completion"].as_i64().unwrap() > 0, "{r}");
    }

    // Every policy turn carries per-token logprobs (≤ 0) aligned with its token ids and a
    // loss mask of the same length; no harness, env or system turn is ever trained on.
    let turns = duckdb(
        dir.path(),
        "SELECT t.source AS source, count(*) AS n, \
                count(*) FILTER (WHERE len(t.logprobs) > 0) AS with_logprobs, \
                count(*) FILTER (WHERE len(t.token_ids) = len(t.logprobs) AND len(t.loss_mask) = len(t.logprobs)) AS aligned, \
                count(*) FILTER (WHERE list_bool_or(t.loss_mask)) AS trained, \
                max(list_max(t.logprobs)) AS max_logprob \
         FROM (SELECT unnest(turns) AS t FROM TRAJ) GROUP BY t.source ORDER BY t.source",
    );
    let by_source = |s: &str| turns.iter().find(|r| r["source"] == s).cloned().unwrap_or_else(|| panic!("no {s} turns in {turns:?}"));
    let policy = by_source("policy");
    let n = policy["n"].as_i64().unwrap();
    assert!(n >= 6, "at least one policy turn per episode: {policy}");
    assert_eq!(policy["with_logprobs"].as_i64(), Some(n), "every policy turn has logprobs: {policy}");
    assert_eq!(policy["aligned"].as_i64(), Some(n), "token ids from /extras/tokenize align with logprobs: {policy}");
    assert_eq!(policy["trained"].as_i64(), Some(n));
    assert!(policy["max_logprob"].as_f64().unwrap() <= 0.0, "{policy}");
    let harness = by_source("harness");
    assert!(harness["n"].as_i64().unwrap() >= 3, "the sibling's prompt rule is a harness turn in each episode: {harness}");
    assert_eq!(harness["trained"].as_i64(), Some(0), "injected text is never trained on: {harness}");
    for source in ["env", "system"] {
        assert_eq!(by_source(source)["trained"].as_i64(), Some(0));
    }
}

/// A policy server that answers every chat request with `body` after `delay`, counting
/// requests. Fault injection only: real policies are tested against llama.cpp above.
async fn broken_server(body: &'static str, delay: Duration) -> (String, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    let hits = Arc::new(AtomicUsize::new(0));
    let counter = hits.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else { return };
            let counter = counter.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                let mut seen = Vec::new();
                // Read the head and the body (Content-Length) before answering.
                loop {
                    let Ok(n) = stream.read(&mut buf).await else { return };
                    if n == 0 {
                        return;
                    }
                    seen.extend_from_slice(&buf[..n]);
                    let Some(end) = seen.windows(4).position(|w| w == b"\r\n\r\n") else { continue };
                    let head = String::from_utf8_lossy(&seen[..end]).to_ascii_lowercase();
                    let length: usize =
                        head.lines().find_map(|l| l.strip_prefix("content-length:").map(|v| v.trim().parse().unwrap_or(0))).unwrap_or(0);
                    if seen.len() >= end + 4 + length {
                        break;
                    }
                }
                counter.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(delay).await;
                let response = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(response.as_bytes()).await;
                let _ = stream.shutdown().await;
            });
        }
    });
    (url, hits)
}

#[tokio::test]
async fn invalid_json_and_timeouts_are_retried_then_recorded_on_the_row() {
    let dir = tempfile::tempdir().unwrap();
    let run = unique("e2e-broken-policy");
    let retry = ["--max-attempts", "2", "--request-timeout", "0.5", "--retry-budget", "30"];

    let (garbled, garbled_hits) = broken_server("{\"choices\": [{\"message\": ", Duration::ZERO).await;
    let out = rollout(&garbled, "h0", "dev-24", &dir.path().join("garbled"), &run, &retry).await;
    assert_eq!(out.status.code(), Some(3), "errors recorded → exit 3 (degraded):\n{}", text(&out));
    assert!(text(&out).contains("errors: invalid_output 1"), "{}", text(&out));
    assert_eq!(garbled_hits.load(Ordering::SeqCst), 2, "one call, retried once within budget");

    let (slow, slow_hits) = broken_server("{}", Duration::from_secs(5)).await;
    let out = rollout(&slow, "h0", "dev-24", &dir.path().join("slow"), &run, &retry).await;
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    assert_eq!(slow_hits.load(Ordering::SeqCst), 2);

    let rows = duckdb(
        dir.path(),
        "SELECT error_class, termination, error_message, success, model_calls, \
                len(list_filter(turns, lambda t: t.source = 'policy')) AS policy_turns \
         FROM TRAJ ORDER BY error_class",
    );
    assert_eq!(rows.len(), 2, "{rows:?}");
    let (invalid, timeout) = (&rows[0], &rows[1]);
    assert_eq!(invalid["error_class"], "invalid_output", "{invalid}");
    assert_eq!(timeout["error_class"], "timeout", "{timeout}");
    for r in &rows {
        assert_eq!(r["termination"], "error", "{r}");
        assert_eq!(r["success"], false);
        assert_eq!(r["policy_turns"].as_i64(), Some(0), "no policy text was invented: {r}");
        let message = r["error_message"].as_str().unwrap();
        assert!(message.contains("gave up after 2 attempt(s)"), "{message}");
    }
    assert!(invalid["error_message"].as_str().unwrap().contains("not a chat completion"), "{invalid}");
    assert!(timeout["error_message"].as_str().unwrap().contains("timed out after 0.5s"), "{timeout}");
}
