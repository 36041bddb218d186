//! DBBench against the real engines: in-memory SQLite and the MariaDB server.
//!
//! Grading must agree with AgentBench on the shared dev split (gold SQL replayed, labels
//! committed), a wrong answer must fail, bad task lines and bad SQL must be reported,
//! not crash, and every MariaDB episode must use and drop its own database.

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;

use harness_s_tests::{harness_s_bin, unique};
use jobs::env::dbbench::check::{check_tasks, CheckReport};
use jobs::env::dbbench::grade::is_write_type;
use jobs::env::dbbench::{DbBenchConfig, DbBenchEnv, TaskSet, COMMIT_FINAL_ANSWER, EXECUTE_SQL};
use jobs::env::{Environment, ToolCall};
use mysql_async::prelude::Queryable;
use serde_json::json;

/// The MariaDB server of the test machine (`HARNESS_S_TEST_MYSQL_URL` overrides).
fn mysql_url() -> String {
    std::env::var("HARNESS_S_TEST_MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306".to_string())
}

/// The DBBench dev split in the repository's test data.
fn dev_file() -> PathBuf {
    harness_s_tests::dev_tasks()
}

fn dev_tasks() -> Arc<TaskSet> {
    let loaded = TaskSet::load(&dev_file()).expect("dev split readable");
    assert!(loaded.problems.is_empty(), "{:?}", loaded.problems);
    assert_eq!(loaded.tasks.len(), 60);
    Arc::new(loaded.tasks)
}

/// A MariaDB configuration whose databases all start with a fresh prefix.
fn mariadb(test: &str) -> (DbBenchConfig, String) {
    let prefix = unique(&format!("hs_t_{test}")).replace('-', "_");
    (DbBenchConfig::mysql(&mysql_url()).unwrap().with_db_prefix(&prefix), prefix)
}

/// Databases on the server whose name starts with `prefix`.
async fn databases_with_prefix(prefix: &str) -> Vec<String> {
    let mut conn = mysql_async::Conn::from_url(mysql_url()).await.expect("MariaDB reachable at 127.0.0.1:3306");
    let names: Vec<String> = conn.query("SHOW DATABASES").await.unwrap();
    conn.disconnect().await.unwrap();
    names.into_iter().filter(|n| n.starts_with(prefix)).collect()
}

fn print_failures(report: &CheckReport) {
    for c in report.checks.iter().filter(|c| !c.agreed) {
        eprintln!("{} ({}): {}", c.task_id, c.task_type, c.detail);
    }
}

fn sql(q: &str) -> ToolCall {
    ToolCall { name: EXECUTE_SQL.into(), args: json!({ "query": q }) }
}

fn commit(answers: serde_json::Value) -> ToolCall {
    ToolCall { name: COMMIT_FINAL_ANSWER.into(), args: json!({ "answers": answers }) }
}

#[tokio::test]
async fn dev_split_gold_answers_agree_on_sqlite() {
    let report = check_tasks(dev_tasks(), &DbBenchConfig::sqlite(), false, |_| {}).await.unwrap();
    print_failures(&report);
    let (writes_ok, writes) = report.agreement(is_write_type);
    let (reads_ok, reads) = report.agreement(|t| !is_write_type(t));
    assert_eq!((writes, reads), (40, 20));
    assert!(writes_ok >= 38, "gold SQL replay agreed on {writes_ok} of 40 write tasks on SQLite");
    assert_eq!(reads_ok, 20, "committing the label agreed on {reads_ok} of 20 read tasks on SQLite");
}

#[tokio::test]
async fn dev_split_gold_answers_agree_on_mariadb_and_every_database_is_dropped() {
    let (config, prefix) = mariadb("dev");
    let report = check_tasks(dev_tasks(), &config, false, |_| {}).await.unwrap();
    print_failures(&report);
    assert_eq!(report.agreement(is_write_type), (40, 40), "gold SQL replay on MariaDB");
    assert_eq!(report.agreement(|t| !is_write_type(t)), (20, 20), "committed labels on MariaDB");
    assert_eq!(databases_with_prefix(&prefix).await, Vec::<String>::new(), "episode databases left behind");
}

#[tokio::test]
async fn a_wrong_answer_fails_on_both_engines() {
    let tasks = dev_tasks();
    let (maria, prefix) = mariadb("wrong");
    for config in [DbBenchConfig::sqlite(), maria] {
        let mut env = DbBenchEnv::new(Arc::clone(&tasks), config.clone());
        // dev-6: "total number of register listings from dover?" → 17.
        env.reset("dev-6", 0).await.unwrap();
        env.step(&commit(json!(["18"]))).await.unwrap();
        let ev = env.evaluate().await.unwrap();
        assert!(!ev.success && ev.reward == 0.0, "{:?}: {}", config.engine, ev.detail);
        assert!(ev.detail.contains("wrong"), "{}", ev.detail);
        // The right one passes, so the failure above is the answer's fault.
        env.reset("dev-6", 0).await.unwrap();
        env.step(&commit(json!(["17"]))).await.unwrap();
        assert!(env.evaluate().await.unwrap().success);
        // A write task whose table was changed wrongly fails its hash.
        env.reset("dev-24", 0).await.unwrap();
        let obs = env
            .step(&sql("INSERT INTO `Olympic Medals` (`Rank`, `Gold`, `Silver`, `Bronze`, `Total`) VALUES ('7', '0', '1', '0', '2')"))
            .await
            .unwrap();
        assert!(!obs.action_failed, "{}", obs.text);
        env.step(&commit(json!([]))).await.unwrap();
        let ev = env.evaluate().await.unwrap();
        assert!(!ev.success, "{}", ev.detail);
        assert!(ev.detail.contains("differs from b392c838aa9d9bca57adbd1822071e00"), "{}", ev.detail);
        env.close().await.unwrap();
    }
    assert!(databases_with_prefix(&prefix).await.is_empty());
}

#[tokio::test]
async fn an_sql_error_becomes_an_observation_on_both_engines() {
    let tasks = dev_tasks();
    let (maria, _) = mariadb("sqlerr");
    for (config, want) in [
        (DbBenchConfig::sqlite(), "SQLite execution error: near \"SELEC\": syntax error"),
        (maria, "1064 (42000): You have an error in your SQL syntax"),
    ] {
        let mut env = DbBenchEnv::new(Arc::clone(&tasks), config);
        env.reset("dev-6", 0).await.unwrap();
        let obs = env.step(&sql("SELEC * FROM historic_sites")).await.unwrap();
        assert!(obs.action_failed && !obs.done, "{obs:?}");
        assert!(obs.text.starts_with(want), "{}", obs.text);
        let obs = env.step(&sql("SELECT * FROM no_such_table")).await.unwrap();
        assert!(obs.action_failed, "{obs:?}");
        let obs = env.step(&sql("SELECT 1; SELECT 2")).await.unwrap();
        assert!(obs.action_failed && obs.text.contains("one statement at a time"), "{}", obs.text);
        // The episode goes on: the right query works and the answer is graded.
        let obs = env.step(&sql("SELECT COUNT(*) FROM historic_sites WHERE `City or town` = 'Dover'")).await.unwrap();
        assert!(!obs.action_failed, "{}", obs.text);
        env.step(&commit(json!(["17"]))).await.unwrap();
        assert!(env.evaluate().await.unwrap().success);
        env.close().await.unwrap();
    }
}

#[tokio::test]
async fn results_render_like_agentbench_on_mariadb() {
    let (config, _) = mariadb("render");
    let mut env = DbBenchEnv::new(dev_tasks(), config);
    env.reset("dev-6", 0).await.unwrap();
    // mysql-connector types: COUNT → int, SUM over TEXT → float, text → str, NULL → None,
    // a decimal literal → Decimal.
    let obs = env.step(&sql("SELECT COUNT(*), SUM(`column_1`), MIN(`City or town`), NULL, 1.50 FROM historic_sites")).await.unwrap();
    assert!(!obs.action_failed, "{}", obs.text);
    let text = obs.text;
    assert!(text.starts_with("[(") && text.ends_with(")]"), "{text}");
    assert!(text.contains(".0, '") && text.contains(", None, Decimal('1.50'))]"), "{text}");
    // A long result is cut at 800 characters and flagged.
    let obs = env.step(&sql("SELECT * FROM historic_sites")).await.unwrap();
    assert!(obs.truncated && obs.text.ends_with("[TRUNCATED]"), "{}", obs.text);
    assert_eq!(obs.text.chars().count(), 800 + "[TRUNCATED]".len());
    env.close().await.unwrap();
}

#[tokio::test]
async fn mariadb_episodes_are_isolated_and_dropped() {
    let tasks = dev_tasks();
    let (config, prefix) = mariadb("iso");
    let mut a = DbBenchEnv::new(Arc::clone(&tasks), config.clone());
    let mut b = DbBenchEnv::new(Arc::clone(&tasks), config);
    a.reset("dev-24", 0).await.unwrap();
    b.reset("dev-24", 0).await.unwrap();
    let (name_a, name_b) = (a.database_name().unwrap(), b.database_name().unwrap());
    assert_ne!(name_a, name_b);
    assert!(name_a.starts_with(&prefix));
    a.step(&sql("DELETE FROM `Olympic Medals`")).await.unwrap();
    assert_eq!(a.step(&sql("SELECT COUNT(*) FROM `Olympic Medals`")).await.unwrap().text, "[(0,)]");
    let other = b.step(&sql("SELECT COUNT(*) FROM `Olympic Medals`")).await.unwrap().text;
    assert_ne!(other, "[(0,)]", "episode b saw episode a's delete");
    let mut live = databases_with_prefix(&prefix).await;
    live.sort();
    let mut want = vec![name_a.clone(), name_b.clone()];
    want.sort();
    assert_eq!(live, want);
    // A new episode on the same environment starts from a fresh database.
    a.reset("dev-24", 0).await.unwrap();
    assert_eq!(a.step(&sql("SELECT COUNT(*) FROM `Olympic Medals`")).await.unwrap().text, other);
    assert!(!databases_with_prefix(&prefix).await.contains(&name_a), "reset drops the previous database");
    a.close().await.unwrap();
    b.close().await.unwrap();
    assert!(databases_with_prefix(&prefix).await.is_empty());
}

/// The policy's SQL runs as the episode's own server user: it cannot read the server's
/// accounts, touch another episode's database, write files or change the server, and the
/// user goes with the database.
#[tokio::test]
async fn a_mariadb_episode_cannot_reach_outside_its_database() {
    let tasks = dev_tasks();
    let (config, prefix) = mariadb("sandbox");
    let mut a = DbBenchEnv::new(Arc::clone(&tasks), config.clone());
    let mut b = DbBenchEnv::new(Arc::clone(&tasks), config);
    a.reset("dev-24", 0).await.unwrap();
    b.reset("dev-24", 0).await.unwrap();
    let (name_a, name_b) = (a.database_name().unwrap(), b.database_name().unwrap());
    let rows_b = b.step(&sql("SELECT COUNT(*) FROM `Olympic Medals`")).await.unwrap().text;
    let outfile = format!("/tmp/{prefix}_out.txt");
    for q in [
        "SELECT User, Password FROM mysql.user".to_string(),
        format!("DROP DATABASE `{name_b}`"),
        format!("SELECT COUNT(*) FROM `{name_b}`.`Olympic Medals`"),
        format!("DELETE FROM `{name_b}`.`Olympic Medals`"),
        format!("SELECT 1 INTO OUTFILE '{outfile}'"),
        format!("CREATE DATABASE `{prefix}_other`"),
        "CREATE USER intruder IDENTIFIED BY 'x'".to_string(),
        "GRANT ALL ON *.* TO CURRENT_USER()".to_string(),
        "SET GLOBAL max_connections = 1".to_string(),
    ] {
        let obs = a.step(&sql(&q)).await.unwrap();
        assert!(obs.action_failed && !obs.done, "not refused: {q}: {}", obs.text);
        assert!(obs.text.contains("denied") || obs.text.contains("privilege"), "{q}: {}", obs.text);
    }
    // without FILE, LOAD_FILE reads nothing
    assert_eq!(a.step(&sql("SELECT LOAD_FILE('/etc/passwd')")).await.unwrap().text, "[(None,)]");
    let shown = a.step(&sql("SHOW DATABASES")).await.unwrap().text;
    assert!(shown.contains(&name_a) && !shown.contains(&name_b) && !shown.contains("'mysql'"), "{shown}");
    assert!(!std::path::Path::new(&outfile).exists());
    // the episode's own database works as before, the other one is untouched
    assert!(!a.step(&sql("DELETE FROM `Olympic Medals`")).await.unwrap().action_failed);
    assert_eq!(a.step(&sql("SELECT COUNT(*) FROM `Olympic Medals`")).await.unwrap().text, "[(0,)]");
    assert_eq!(b.step(&sql("SELECT COUNT(*) FROM `Olympic Medals`")).await.unwrap().text, rows_b);
    let mut admin = mysql_async::Conn::from_url(mysql_url()).await.unwrap();
    let grants = |db: String| format!("SELECT COUNT(*) FROM mysql.db WHERE Db = '{db}'");
    let held: Option<i64> = admin.query_first(grants(name_a.clone())).await.unwrap();
    assert_eq!(held, Some(1), "one episode user holds rights on the database");
    a.close().await.unwrap();
    b.close().await.unwrap();
    for db in [name_a, name_b] {
        let left: Option<i64> = admin.query_first(grants(db)).await.unwrap();
        assert_eq!(left, Some(0), "the episode's user is dropped with its database");
    }
    assert!(databases_with_prefix(&prefix).await.is_empty());
}

#[test]
fn tasks_check_reports_a_malformed_line_with_its_number_and_checks_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(dev_file()).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    lines[2] = "{\"description\": \"broken";
    let file = dir.path().join("dev-broken.jsonl");
    std::fs::write(&file, lines.join("\n")).unwrap();

    let loaded = TaskSet::load(&file).unwrap();
    assert_eq!(loaded.tasks.len(), 59);
    assert_eq!(loaded.problems.len(), 1);
    assert_eq!(loaded.problems[0].line, 3);

    let out = Command::new(harness_s_bin()).args(["tasks", "check"]).arg(&file).args(["--engine", "sqlite"]).output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(1), "a bad line makes the check fail\n{stdout}\n{stderr}");
    assert!(stderr.contains("dev-broken.jsonl:3: not valid JSON"), "{stderr}");
    assert!(stdout.lines().any(|l| l.starts_with("all ") && l.split_whitespace().nth(1) == Some("59")), "{stdout}");
}

#[test]
fn tasks_check_cli_prints_the_table_for_mariadb() {
    let out = Command::new(harness_s_bin())
        .args(["tasks", "check"])
        .arg(dev_file())
        .args(["--engine", "mysql", "--db-url", &mysql_url()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    for row in
        ["INSERT              20      20   100.0%", "UPDATE              20      20   100.0%", "all                 60      60   100.0%"]
    {
        assert!(stdout.contains(row), "missing `{row}` in\n{stdout}");
    }
    let bad = Command::new(harness_s_bin())
        .args(["tasks", "check"])
        .arg(dev_file())
        .args(["--engine", "mysql"])
        .env_remove("HARNESS_S_DB_URL")
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("needs a server URL"), "{}", String::from_utf8_lossy(&bad.stderr));
}

#[test]
fn generated_tasks_are_deterministic_and_agree_on_both_engines() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a.jsonl"), dir.path().join("b.jsonl"));
    for f in [&a, &b] {
        let out = Command::new(harness_s_bin()).args(["tasks", "generate", "--seed", "5", "--n", "48", "--out"]).arg(f).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stdout).contains("wrote 48 tasks"));
    }
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap(), "same seed, same file");
    for engine in [vec!["--engine", "sqlite"], vec!["--engine", "mysql", "--db-url", &mysql_url()]] {
        let out = Command::new(harness_s_bin()).args(["tasks", "check"]).arg(&a).args(&engine).output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(0), "{engine:?}\n{stdout}");
        let total: Vec<&str> = stdout.lines().find(|l| l.starts_with("all ")).unwrap_or_default().split_whitespace().collect();
        assert_eq!(total, ["all", "48", "48", "100.0%"], "{stdout}");
    }
}

/// A read task whose label disagrees with its own gold SQL passes the plain check (the
/// grader compares the label with itself) and fails `--verify-labels`, by task id.
#[test]
fn tasks_check_verify_labels_runs_the_gold_sql() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tasks.jsonl");
    let out = Command::new(harness_s_bin())
        .args([
            "tasks",
            "generate",
            "--seed",
            "3",
            "--n",
            "6",
            "--difficulty",
            "easy",
            "--kinds",
            "counting",
            "--out",
            file.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let mut lines: Vec<String> = std::fs::read_to_string(&file).unwrap().lines().map(str::to_string).collect();
    let mut first: serde_json::Value = serde_json::from_str(&lines[0]).unwrap();
    let id = first["id"].as_str().map(str::to_string).unwrap_or_else(|| "gen-3-0".into());
    first["label"] = serde_json::json!(["banana"]);
    lines[0] = first.to_string();
    std::fs::write(&file, lines.join("\n") + "\n").unwrap();
    let plain = Command::new(harness_s_bin()).args(["tasks", "check", file.to_str().unwrap()]).output().unwrap();
    assert!(plain.status.success(), "the plain check grades the label against itself");
    let verified = Command::new(harness_s_bin()).args(["tasks", "check", file.to_str().unwrap(), "--verify-labels"]).output().unwrap();
    let text = String::from_utf8_lossy(&verified.stdout);
    assert_eq!(verified.status.code(), Some(1), "{text}");
    assert!(text.contains(&format!("FAIL {id}")) && text.contains("banana") && text.contains("5  "), "{text}");
}

/// `harness-s ... | head -1`: the closed pipe ends the program quietly (a listing far
/// larger than the pipe's buffer, so that writing does hit the closed pipe).
#[test]
fn a_closed_pipe_ends_quietly() {
    use std::io::{BufRead, BufReader};
    let dir = tempfile::tempdir().unwrap();
    for i in 0..4000 {
        let folder = dir.path().join(format!("runs/r/trajectories/step={}", i / 100));
        std::fs::create_dir_all(&folder).unwrap();
        std::fs::write(folder.join(format!("part-{i:05}-with-a-long-name-to-fill-the-pipe.parquet")), b"x").unwrap();
    }
    let mut child = Command::new(harness_s_bin())
        .args(["store", "ls", dir.path().to_str().unwrap()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut first).unwrap();
    // the reader (and with it the pipe) is dropped here, long before the listing ends
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(first.contains("part-"), "{first}");
    assert!(!err.contains("panicked") && !err.contains("Broken pipe") && !err.contains("error"), "{err}");
    assert_eq!(out.status.code(), Some(0), "{err}");
}
