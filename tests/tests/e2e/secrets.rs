//! Secrets never reach the output: a sentinel password (and access key) is put in every
//! URL and credential a user passes, the commands fail as they should, and the sentinel is
//! grepped over everything they print — errors, `--help` with the variables set, and TRACE
//! logs of S3 calls.

use std::process::Command;

use harness_s_tests::harness_s_bin;

const SECRET: &str = "hunter2xyzSENTINEL";
const KEY_ID: &str = "AKIASENTINELKEYID0001";

struct Case {
    args: Vec<String>,
    env: Vec<(&'static str, String)>,
    /// The command is expected to fail (a bad or unreachable URL).
    fails: bool,
}

fn case(args: &[&str], fails: bool) -> Case {
    Case { args: args.iter().map(|s| s.to_string()).collect(), env: vec![], fails }
}

#[test]
fn no_command_prints_a_password_or_access_key() {
    let dir = tempfile::tempdir().unwrap();
    let store = format!("file://{}", dir.path().display());
    let bad_port_queue = format!("amqp://guest:{SECRET}@127.0.0.1:99999/%2f");
    let refused_queue = format!("amqp://guest:{SECRET}@127.0.0.1:1/%2f?connect_timeout_s=1");
    let s3 = format!("s3://{KEY_ID}:{SECRET}@bucket/p?endpoint=http://127.0.0.1:1");
    let s3_bad = format!("s3://{KEY_ID}:{SECRET}@bucket:99999/p");
    let file_pw = format!("file://user:{SECRET}@/tmp/x");
    let spec = format!("{}/../examples/quickstart.toml", env!("CARGO_MANIFEST_DIR"));
    let mut cases = vec![];
    for q in [&bad_port_queue, &refused_queue] {
        cases.push(case(&["queue", "stats", "--queue", q], true));
        cases.push(case(&["worker", "--queue", q, "--store", &store, "--queues", "rollout"], true));
        cases.push(case(&["scheduler", "--run", "r", "--store", &store, "--queue", q], true));
        cases.push(case(&["resume", "r", "--store", &store, "--queue", q], true));
        cases.push(case(&["submit", &spec, "--store", &store, "--queue", q], true));
    }
    for s in [&s3, &s3_bad, &file_pw] {
        cases.push(case(&["store", "ls", s], true));
        cases.push(case(&["status", "r", "--store", s], true));
        cases.push(case(&["submit", &spec, "--store", s], true));
    }
    // TRACE logs of an S3 call with credentials from the environment
    cases.push(Case {
        args: ["--log", "trace", "store", "ls", "s3://bucket/p?endpoint=http://127.0.0.1:1"].iter().map(|s| s.to_string()).collect(),
        env: vec![("AWS_ACCESS_KEY_ID", KEY_ID.to_string()), ("AWS_SECRET_ACCESS_KEY", SECRET.to_string())],
        fails: true,
    });
    // help with the variables set
    let env = vec![
        ("HARNESS_S_STORE", s3.clone()),
        ("HARNESS_S_QUEUE", bad_port_queue.clone()),
        ("HARNESS_S_DB_URL", format!("mysql://root:{SECRET}@127.0.0.1:3306")),
    ];
    for cmd in [
        &["run", "--help"][..],
        &["worker", "--help"],
        &["scheduler", "--help"],
        &["resume", "--help"],
        &["submit", "--help"],
        &["status", "--help"],
        &["tasks", "check", "--help"],
        &["queue", "stats", "--help"],
    ] {
        cases.push(Case { args: cmd.iter().map(|s| s.to_string()).collect(), env: env.clone(), fails: false });
    }
    for c in &cases {
        let mut cmd = Command::new(harness_s_bin());
        cmd.args(&c.args).current_dir(dir.path()).env_remove("HARNESS_S_STORE").env_remove("HARNESS_S_QUEUE").env_remove("RUST_LOG");
        for (k, v) in &c.env {
            cmd.env(k, v);
        }
        let out = cmd.output().expect("run harness-s");
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        let shown = c.args.join(" ");
        assert!(!text.contains(SECRET), "`{shown}` printed the password:\n{text}");
        assert!(!text.contains(KEY_ID), "`{shown}` printed the access key id:\n{text}");
        assert!(!text.contains("panicked"), "`{shown}` panicked:\n{text}");
        assert_eq!(!out.status.success(), c.fails, "`{shown}` exit status {:?}:\n{text}", out.status);
        if c.fails {
            assert!(text.contains("error"), "`{shown}` failed without saying why:\n{text}");
        }
    }
}
