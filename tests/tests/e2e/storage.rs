//! The object-store suite, run against every backend (the local filesystem and the real
//! S3 server), plus Parquet round trips and the bad-input cases of the storage layer.

use std::process::Command;
use std::sync::Arc;

use bytes::Bytes;
use harness_s_tests::{harness_s_bin, s3_endpoint, s3_store_url, unique};
use infra::store::{open_store, ObjectStore, PutOutcome, StoreError};
use infra::table::{read_prefix, read_records, write_records, PartWriter, TableError};
use schemas::{keys, Record, Role, RolloutKind, SchemaError, Split, Termination, Trajectory, Turn, TurnSource};
use sha2::{Digest, Sha256};

async fn local_store() -> (tempfile::TempDir, Arc<dyn ObjectStore>) {
    let dir = tempfile::tempdir().unwrap();
    let store = open_store(&format!("file://{}", dir.path().display())).await.unwrap();
    (dir, store)
}

async fn s3_store(test: &str) -> Arc<dyn ObjectStore> {
    open_store(&s3_store_url(test)).await.expect("the S3 test server is reachable")
}

/// put / get / head / list / delete / get_range, the same for every backend.
async fn basic_operations(store: &dyn ObjectStore) {
    assert!(store.head("a/b/missing.txt").await.unwrap().is_none());
    match store.get("a/b/missing.txt").await {
        Err(StoreError::NotFound { url }) => assert!(url.ends_with("a/b/missing.txt"), "{url}"),
        other => panic!("expected NotFound, got {other:?}"),
    }
    store.put("a/b/one.txt", Bytes::from_static(b"first")).await.unwrap();
    store.put("a/b/one.txt", Bytes::from_static(b"second")).await.unwrap();
    store.put("a/c/two.txt", Bytes::from_static(b"0123456789")).await.unwrap();
    store.put("z.txt", Bytes::from_static(b"z")).await.unwrap();
    assert_eq!(&store.get("a/b/one.txt").await.unwrap()[..], b"second");
    assert_eq!(store.head("a/c/two.txt").await.unwrap().unwrap().size, 10);
    assert_eq!(&store.get_range("a/c/two.txt", 2..5).await.unwrap()[..], b"234");
    let keys: Vec<String> = store.list("a/").await.unwrap().into_iter().map(|o| o.key).collect();
    assert_eq!(keys, vec!["a/b/one.txt", "a/c/two.txt"]);
    let keys: Vec<String> = store.list("a/b").await.unwrap().into_iter().map(|o| o.key).collect();
    assert_eq!(keys, vec!["a/b/one.txt"]);
    assert_eq!(store.list("").await.unwrap().len(), 3);
    store.delete("a/b/one.txt").await.unwrap();
    store.delete("a/b/one.txt").await.unwrap(); // idempotent
    assert!(store.head("a/b/one.txt").await.unwrap().is_none());
    assert!(matches!(store.put("../escape", Bytes::new()).await, Err(StoreError::InvalidKey { .. })));
    assert!(matches!(store.put("/abs", Bytes::new()).await, Err(StoreError::InvalidKey { .. })));
    // nothing outside the store can be named: not by a key, not by a listing prefix
    for key in ["a/../../etc/passwd", "a/./b", "a/b\0c", "a/b\nc", "a\\..\\b"] {
        assert!(matches!(store.put(key, Bytes::new()).await, Err(StoreError::InvalidKey { .. })), "put {key:?}");
        assert!(matches!(store.get(key).await, Err(StoreError::InvalidKey { .. })), "get {key:?}");
        assert!(matches!(store.head(key).await, Err(StoreError::InvalidKey { .. })), "head {key:?}");
        assert!(matches!(store.delete(key).await, Err(StoreError::InvalidKey { .. })), "delete {key:?}");
    }
    for prefix in ["../../../etc/ssl", "a/../..", "/etc", "a\0"] {
        match store.list(prefix).await {
            Err(StoreError::InvalidKey { reason, .. }) => assert!(!reason.is_empty()),
            other => panic!("list {prefix:?}: expected InvalidKey, got {other:?}"),
        }
    }
}

/// Many tasks race to create one marker: exactly one wins, and its content stays.
async fn put_if_absent_race(store: Arc<dyn ObjectStore>) {
    let key = "runs/r/jobs/race.done.json";
    let mut tasks = Vec::new();
    for i in 0..16 {
        let s = store.clone();
        tasks.push(tokio::spawn(async move { (i, s.put_if_absent(key, Bytes::from(format!("writer-{i}"))).await.unwrap()) }));
    }
    let mut winners = Vec::new();
    for t in tasks {
        let (i, outcome) = t.await.unwrap();
        if outcome == PutOutcome::Created {
            winners.push(i);
        }
    }
    assert_eq!(winners.len(), 1, "exactly one creator, got {winners:?}");
    assert_eq!(store.get(key).await.unwrap(), Bytes::from(format!("writer-{}", winners[0])));
    assert_eq!(store.put_if_absent(key, Bytes::from_static(b"late")).await.unwrap(), PutOutcome::AlreadyExists);
}

/// A streaming upload larger than 16 MiB, invisible until completed; abort leaves nothing.
async fn multipart(store: &dyn ObjectStore) {
    let key = "big/blob.bin";
    let mut upload = store.put_multipart(key).await.unwrap();
    let mut hasher = Sha256::new();
    let mut total = 0usize;
    for i in 0..18u8 {
        let chunk: Vec<u8> = (0..1024 * 1024).map(|j| (j as u8).wrapping_mul(31).wrapping_add(i)).collect();
        hasher.update(&chunk);
        total += chunk.len();
        upload.write(Bytes::from(chunk)).await.unwrap();
    }
    assert!(store.head(key).await.unwrap().is_none(), "invisible before completion");
    assert!(store.list("big/").await.unwrap().is_empty(), "list hides unfinished uploads");
    let meta = upload.complete().await.unwrap();
    assert_eq!(meta.size as usize, total);
    let back = store.get(key).await.unwrap();
    assert_eq!(back.len(), total);
    assert_eq!(Sha256::digest(&back)[..], hasher.finalize()[..]);

    let mut aborted = store.put_multipart("big/aborted.bin").await.unwrap();
    aborted.write(Bytes::from(vec![7u8; 9 * 1024 * 1024])).await.unwrap();
    aborted.abort().await.unwrap();
    assert!(store.head("big/aborted.bin").await.unwrap().is_none());
    let keys: Vec<String> = store.list("big/").await.unwrap().into_iter().map(|o| o.key).collect();
    assert_eq!(keys, vec!["big/blob.bin"]);
}

pub fn sample_trajectory(i: u32, kind: RolloutKind, harness: &str) -> Trajectory {
    Trajectory {
        trajectory_id: format!("t{i}"),
        run_id: "r1".into(),
        job_id: "job".into(),
        step: 2,
        kind,
        split: Split::Train,
        task_id: format!("task-{}", i / 4),
        task_type: "counting".into(),
        group_id: format!("g{}", i / 4),
        attempt: i % 4,
        harness_id: harness.into(),
        harness_version: "abc".into(),
        policy_checkpoint: "base".into(),
        seed: 42 + i as u64,
        reward: (i % 3) as f64 * 0.5,
        success: i % 3 == 2,
        termination: Termination::Committed,
        error_class: if i.is_multiple_of(5) { Some(schemas::ErrorClass::Timeout) } else { None },
        error_message: None,
        prompt_tokens: 100,
        completion_tokens: 20 + i as u64,
        harness_tokens: 5,
        model_calls: 3,
        env_actions: 2,
        started_at_ms: 1_780_000_000_000,
        duration_ms: 1234,
        policy_ms: 1000,
        env_ms: 30,
        temperature: 1.0,
        tool_view: String::new(),
        turns: vec![
            Turn {
                index: 0,
                role: Role::User,
                source: TurnSource::Harness,
                text: "Inspect the schema first.".into(),
                token_ids: vec![1, 2, 3],
                logprobs: vec![],
                loss_mask: vec![false; 3],
                tool_name: None,
                tool_args: None,
                hook_id: Some("h/0".into()),
                prompt_token_count: 0,
                prompt_hash: None,
            },
            Turn {
                index: 1,
                role: Role::Assistant,
                source: TurnSource::Policy,
                text: "SELECT count(*) FROM t;".into(),
                token_ids: vec![10, 11],
                logprobs: vec![-0.5, -0.25],
                loss_mask: vec![true, true],
                tool_name: Some("execute_sql".into()),
                tool_args: Some(r#"{"query":"SELECT count(*) FROM t;"}"#.into()),
                hook_id: None,
                prompt_token_count: 0,
                prompt_hash: None,
            },
        ],
    }
}

async fn parquet_round_trip(store: &dyn ObjectStore) {
    let rows: Vec<Trajectory> = (0..40).map(|i| sample_trajectory(i, RolloutKind::Rescue, "h3")).collect();
    let key = keys::trajectory_part("r1", 2, RolloutKind::Rescue, "job");
    let entry = write_records(store, &key, &rows).await.unwrap();
    assert_eq!(entry.key, key);
    assert_eq!(entry.size, store.head(&key).await.unwrap().unwrap().size);
    let back: Vec<Trajectory> = read_records(store, &key).await.unwrap();
    assert_eq!(back, rows);

    // A streaming writer with several writes gives the same rows in order.
    let key2 = keys::trajectory_part("r1", 3, RolloutKind::Base, "job2");
    let mut w = PartWriter::<Trajectory>::create(store, &key2).await.unwrap();
    for chunk in rows.chunks(7) {
        w.write(chunk).await.unwrap();
    }
    assert_eq!(w.rows(), 40);
    w.finish().await.unwrap();
    let all: Vec<Trajectory> = read_prefix(store, "runs/r1/trajectories/").await.unwrap();
    assert_eq!(all.len(), 80);

    // Reading as the wrong record type names the file and both record names.
    match read_records::<schemas::Group>(store, &key).await {
        Err(TableError::Schema(SchemaError::WrongRecord { file, found, expected })) => {
            assert!(file.ends_with(&key), "{file}");
            assert_eq!((found.as_str(), expected.as_str()), ("trajectory", "group"));
        }
        other => panic!("expected WrongRecord, got {:?}", other.map(|v| v.len())),
    }
}

#[tokio::test]
async fn local_store_suite() {
    let (dir, store) = local_store().await;
    basic_operations(store.as_ref()).await;
    put_if_absent_race(store.clone()).await;
    multipart(store.as_ref()).await;
    parquet_round_trip(store.as_ref()).await;
    // Objects are readable by the group and others (serving processes of other users load
    // checkpoints), not 0600 like the temporary files they are written through.
    use std::os::unix::fs::PermissionsExt;
    store.put("perm/a.json", bytes::Bytes::from_static(b"{}")).await.unwrap();
    let mode = std::fs::metadata(dir.path().join("perm/a.json")).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode & 0o044, 0o044, "mode {mode:o}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn s3_store_suite() {
    let store = s3_store("suite").await;
    assert!(store.url().starts_with("s3://"), "{}", store.url());
    basic_operations(store.as_ref()).await;
    put_if_absent_race(store.clone()).await;
    multipart(store.as_ref()).await;
    parquet_round_trip(store.as_ref()).await;
}

#[tokio::test]
async fn truncated_parquet_is_a_clear_error() {
    let (_dir, store) = local_store().await;
    let rows: Vec<Trajectory> = (0..10).map(|i| sample_trajectory(i, RolloutKind::Base, "h0")).collect();
    let key = "t/part-x.parquet";
    write_records(store.as_ref(), key, &rows).await.unwrap();
    let bytes = store.get(key).await.unwrap();
    store.put(key, bytes.slice(..bytes.len() / 2)).await.unwrap();
    let err = read_records::<Trajectory>(store.as_ref(), key).await.unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, TableError::Corrupt { .. }), "{msg}");
    assert!(msg.contains("t/part-x.parquet") && msg.contains("truncated or corrupt"), "{msg}");
}

#[tokio::test]
async fn unknown_schema_version_names_file_and_both_versions() {
    use arrow_schema::Schema;
    use parquet::arrow::ArrowWriter;
    use parquet::file::metadata::KeyValue;
    use parquet::file::properties::WriterProperties;

    let (_dir, store) = local_store().await;
    let rows = vec![sample_trajectory(0, RolloutKind::Base, "h0")];
    let fields = Trajectory::fields();
    let batch = serde_arrow::to_record_batch(&fields, &rows).unwrap();
    let props = WriterProperties::builder()
        .set_key_value_metadata(Some(vec![
            KeyValue::new(schemas::RECORD_KEY.to_string(), "trajectory".to_string()),
            KeyValue::new(schemas::VERSION_KEY.to_string(), "99".to_string()),
        ]))
        .build();
    let mut buf = Vec::new();
    let mut w = ArrowWriter::try_new(&mut buf, std::sync::Arc::new(Schema::new(fields)), Some(props)).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
    store.put("future/part.parquet", Bytes::from(buf)).await.unwrap();
    let msg = read_records::<Trajectory>(store.as_ref(), "future/part.parquet").await.unwrap_err().to_string();
    assert!(msg.contains("future/part.parquet"), "{msg}");
    assert!(msg.contains("version 99") && msg.contains(&format!("version {}", <Trajectory as schemas::Record>::VERSION)), "{msg}");
}

#[tokio::test]
async fn unreachable_s3_endpoint_is_a_clear_error() {
    let url = format!("s3://{}/x?endpoint=http://127.0.0.1:9", unique("nobucket"));
    let store = open_store(&url).await.expect("credentials are set for the tests");
    let err = store.get("k").await.unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, StoreError::Unreachable { .. }), "{msg}");
    assert!(msg.contains("http://127.0.0.1:9"), "{msg}");
    assert!(!msg.contains(&std::env::var("AWS_SECRET_ACCESS_KEY").unwrap_or_else(|_| "\u{0}".into())), "{msg}");
}

/// Runs the CLI and returns (exit code, stdout, stderr).
fn cli(args: &[&str], env: &[(&str, &str)], clear_aws: bool) -> (i32, String, String) {
    let mut cmd = Command::new(harness_s_bin());
    cmd.args(args);
    if clear_aws {
        for (k, _) in std::env::vars() {
            if k.starts_with("AWS_") {
                cmd.env_remove(k);
            }
        }
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run harness-s");
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

#[test]
fn missing_credentials_is_one_clear_line() {
    let home = tempfile::tempdir().unwrap();
    let url = format!("s3://{}?endpoint={}", harness_s_tests::s3_bucket(), s3_endpoint());
    let (code, _out, err) = cli(&["store", "ls", &url], &[("HOME", home.path().to_str().unwrap())], true);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("no AWS credentials found") && err.contains("AWS_ACCESS_KEY_ID"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
}

#[test]
fn cli_cat_prints_rows_and_reports_truncated_files() {
    let dir = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let store = rt.block_on(open_store(&format!("file://{}", dir.path().display()))).unwrap();
    let rows: Vec<Trajectory> = (0..5).map(|i| sample_trajectory(i, RolloutKind::Eval, "h0")).collect();
    rt.block_on(write_records(store.as_ref(), "p/part-a.parquet", &rows)).unwrap();
    let file = dir.path().join("p/part-a.parquet");
    let url = format!("file://{}", file.display());

    let (code, out, err) = cli(&["store", "cat", &url], &[], false);
    assert_eq!(code, 0, "{err}");
    let lines: Vec<serde_json::Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 5);
    assert_eq!(lines[3]["trajectory_id"], "t3");
    assert_eq!(lines[3]["kind"], "eval");

    let (code, out, _) = cli(&["store", "ls", &format!("file://{}", dir.path().display())], &[], false);
    assert_eq!(code, 0);
    assert!(out.contains("p/part-a.parquet") && out.contains("1 objects"), "{out}");

    // A prefix ending in `/`: every Parquet file under it, in key order; --limit counts all.
    let more: Vec<Trajectory> = (5..8).map(|i| sample_trajectory(i, RolloutKind::Base, "h0")).collect();
    rt.block_on(write_records(store.as_ref(), "p/q/part-b.parquet", &more)).unwrap();
    std::fs::write(dir.path().join("p/notes.txt"), "not rows").unwrap();
    let prefix_url = format!("file://{}/p/", dir.path().display());
    let (code, out, err) = cli(&["store", "cat", &prefix_url], &[], false);
    assert_eq!(code, 0, "{err}");
    let ids: Vec<String> =
        out.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["trajectory_id"].as_str().unwrap().to_string()).collect();
    assert_eq!(ids, ["t0", "t1", "t2", "t3", "t4", "t5", "t6", "t7"]);
    let (code, out, _) = cli(&["store", "cat", &prefix_url, "--limit", "6"], &[], false);
    assert_eq!(code, 0);
    assert_eq!(out.lines().count(), 6, "{out}");
    let (code, out, _) = cli(&["store", "cat", "p/q/", "--store", &format!("file://{}", dir.path().display())], &[], false);
    assert_eq!((code, out.lines().count()), (0, 3), "{out}");
    let (code, _, err) = cli(&["store", "cat", &format!("file://{}/none/", dir.path().display())], &[], false);
    assert_eq!(code, 1);
    assert!(err.contains("no Parquet object under") && !err.contains("panicked"), "{err}");
    std::fs::remove_dir_all(dir.path().join("p/q")).unwrap();

    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() - 20]).unwrap();
    let (code, _, err) = cli(&["store", "cat", &url], &[], false);
    assert_eq!(code, 1);
    assert!(err.contains("part-a.parquet") && err.contains("truncated or corrupt"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// Reading a store that is not there fails with a clear error and creates nothing: not a
/// folder for a missing path, not one for a bare word, not a run for `resume`.
#[test]
fn reading_a_missing_local_store_creates_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-store");
    let url = format!("file://{}", missing.display());
    let cases: Vec<Vec<String>> = vec![
        vec!["store".into(), "ls".into(), url.clone()],
        vec!["store".into(), "ls".into(), "banana".into()],
        vec!["resume".into(), "r".into(), "--store".into(), url.clone()],
        vec!["status".into(), "r".into(), "--store".into(), url.clone()],
        vec!["verify".into(), "r".into(), "--store".into(), url.clone()],
        vec!["report".into(), "r".into(), "--store".into(), missing.display().to_string()],
    ];
    for args in &cases {
        let out = std::process::Command::new(harness_s_tests::harness_s_bin()).args(args).current_dir(dir.path()).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(err.contains("no store at") || err.contains("no run `r`") || err.contains("run `r` was not submitted"), "{args:?}: {err}");
        assert!(!missing.exists() && !dir.path().join("banana").exists(), "{args:?} created a folder");
    }
}
