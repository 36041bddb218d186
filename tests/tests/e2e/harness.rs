//! `harness-s harness validate|diff` as a user runs them: the built binary, real files.

use std::path::PathBuf;
use std::process::Command;

use harness_s_tests::harness_s_bin;

fn pool() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/hooks")
}

#[test]
fn validate_prints_one_line_per_problem_and_exits_non_zero() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.json");
    let spec = serde_json::json!({
        "id": "bad",
        "hooks": [
            {"event": "on_lunch", "condition": "always", "action": "warn", "message": "x"},
            {"event": "after_tool", "condition": {"lte": ["state.remaning_steps", 2]}, "action": "warn", "message": "y"},
            {"event": "after_tool", "condition": "always", "action": "warn", "message": "z".repeat(50 * 1024)}
        ]
    });
    std::fs::write(&file, serde_json::to_vec(&spec).unwrap()).unwrap();
    let out = Command::new(harness_s_bin()).args(["harness", "validate"]).arg(&file).output().unwrap();
    assert_eq!(out.status.code(), Some(1), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 3, "{stdout}");
    assert!(lines[0].starts_with("hooks[0].event: unknown event `on_lunch`"), "{}", lines[0]);
    assert!(lines[1].starts_with("hooks[1].condition.lte[0]: unknown path `state.remaning_steps`"), "{}", lines[1]);
    assert!(lines[2].starts_with("hooks[2].message: text is 51200 bytes"), "{}", lines[2]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("3 problem(s)"));
}

#[test]
fn the_example_pool_validates_and_diffs() {
    let default_pool = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/pool");
    let files = ["h0.json", "s1-inspect-schema.json", "s2-commit-answer.json", "s3-quote-identifiers.json"].map(|n| pool().join(n));
    let defaults = ["s1-example-answer.json", "s2-example-query.json", "s3-two-examples.json", "s4-two-examples-alt.json"]
        .map(|n| default_pool.join(n));
    for path in files.iter().chain(&defaults) {
        let name = path.display();
        let out = Command::new(harness_s_bin())
            .args(["harness", "validate", "--tools", "execute_sql,commit_final_answer"])
            .arg(path)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(0), "{name}: {}", String::from_utf8_lossy(&out.stdout));
        assert!(String::from_utf8_lossy(&out.stdout).contains(": valid harness `"));
    }
    let out = Command::new(harness_s_bin())
        .args(["harness", "diff"])
        .arg(pool().join("h0.json"))
        .arg(pool().join("s2-commit-answer.json"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let stdout = String::from_utf8(out.stdout).unwrap();
    for edit in
        ["+ hooks[id=commit-after-result]: ", "+ hooks[id=low-budget-commit]: ", "~ id: \"h0\" -> \"s2-commit-answer\"", "+ parent: \"h0\""]
    {
        assert!(stdout.lines().any(|l| l.starts_with(edit)), "missing {edit:?} in:\n{stdout}");
    }
    let same =
        Command::new(harness_s_bin()).args(["harness", "diff"]).arg(pool().join("h0.json")).arg(pool().join("h0.json")).output().unwrap();
    assert_eq!(String::from_utf8(same.stdout).unwrap(), "no edits\n");
}

#[test]
fn validate_names_the_file_for_unreadable_or_non_json_input() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("broken.json");
    std::fs::write(&file, "{\"id\": ").unwrap();
    let out = Command::new(harness_s_bin()).args(["harness", "validate"]).arg(&file).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("broken.json:") && stderr.contains("not valid JSON"), "{stderr}");
}
