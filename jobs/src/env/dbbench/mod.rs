//! DBBench (AgentBench's database benchmark) as an [`Environment`].
//!
//! This module owns everything DBBench: loading AgentBench JSONL ([`task`]), one
//! isolated database per episode on in-memory SQLite (the embedded default) or a
//! MySQL/MariaDB server ([`Engine`]), the two tools `execute_sql(query)` and
//! `commit_final_answer(answers)`, AgentBench's result rendering (Python's
//! `str(list_of_tuples)`, cut at 800 characters with `[TRUNCATED]`), a round limit, and
//! AgentBench's grading ([`grade`]: the table hash against `answer_md5` for writes, the
//! normalized comparison for reads). [`check`] replays a task file's gold answers through
//! all of it; [`generate`] writes new tasks for the embedded default.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use jobs::env::{Environment, ToolCall};
//! use jobs::env::dbbench::{DbBenchConfig, DbBenchEnv, TaskSet};
//!
//! let loaded = TaskSet::load("tests/data/dbbench/dev.jsonl".as_ref())?;
//! let mut env = DbBenchEnv::new(Arc::new(loaded.tasks), DbBenchConfig::sqlite());
//! let start = env.reset("dev-5", 0).await?;
//! println!("{}", start.observation.text);
//! let obs = env.step(&ToolCall { name: "execute_sql".into(), args: serde_json::json!({"query": "SELECT 1"}) }).await?;
//! assert_eq!(obs.text, "[(1,)]");
//! env.step(&ToolCall { name: "commit_final_answer".into(), args: serde_json::json!({"answers": ["17"]}) }).await?;
//! println!("{:?}", env.evaluate().await?);
//! env.close().await?;
//! # Ok(()) }
//! ```
//!
//! SQL errors are observations with `action_failed`, never `Err`: only a broken backend
//! (server down, connection lost) is an [`EnvError::Backend`].

pub mod check;
mod db;
mod exec;
pub mod generate;
pub mod grade;
mod mysql;
pub mod pyvalue;
mod sqlite;

pub use mysql::check_server;
pub mod task;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde_json::json;

pub use db::Engine;
pub use exec::{Exec, ExecSettings, TIMEOUT_TEXT};
pub use task::{DbTask, LineProblem, Loaded, TableSpec, TaskFileError, TaskSet};

use crate::env::{EnvError, Environment, EpisodeStart, Evaluation, Observation, ToolCall, ToolSpec};
use db::Database;
use grade::{combine_table_hashes, compare_results};
use pyvalue::PyValue;

/// Tool that runs one SQL statement.
pub const EXECUTE_SQL: &str = "execute_sql";
/// Tool that ends the episode with the answers.
pub const COMMIT_FINAL_ANSWER: &str = "commit_final_answer";

/// AgentBench's round limit for DBBench (`configs/tasks/dbbench.yaml`).
pub const DEFAULT_MAX_ROUNDS: u32 = 15;
/// AgentBench cuts results longer than this many characters.
pub const DEFAULT_RESULT_CHARS: usize = 800;
/// AgentBench stops a statement after 60 s.
pub const DEFAULT_QUERY_TIMEOUT: Duration = mysql::DEFAULT_TIMEOUT;

/// Bad environment settings.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error("unknown DBBench engine `{0}`: use `sqlite` (embedded, no server) or `mysql` (with --db-url)")]
    UnknownEngine(String),
    #[error("engine `mysql` needs a server URL (--db-url mysql://USER[:PASSWORD]@HOST[:PORT], e.g. mysql://root@127.0.0.1:3306)")]
    MissingUrl,
    #[error("{0}")]
    BadUrl(String),
    #[error("`max_rounds` must be at least 1")]
    NoRounds,
}

/// How the environment runs episodes.
#[derive(Debug, Clone, PartialEq)]
pub struct DbBenchConfig {
    pub engine: Engine,
    /// Tool calls allowed per episode (each call is one round).
    pub max_rounds: u32,
    /// Results longer than this many characters are cut.
    pub result_chars: usize,
    /// A statement running longer is stopped and reported as timed out.
    pub query_timeout: Duration,
    /// Prefix of per-episode database names on a server (letters, digits, `_`).
    pub db_prefix: String,
}

impl DbBenchConfig {
    /// In-memory SQLite with AgentBench's limits.
    pub fn sqlite() -> Self {
        DbBenchConfig {
            engine: Engine::Sqlite,
            max_rounds: DEFAULT_MAX_ROUNDS,
            result_chars: DEFAULT_RESULT_CHARS,
            query_timeout: DEFAULT_QUERY_TIMEOUT,
            db_prefix: "hs_dbbench".into(),
        }
    }

    /// A MySQL/MariaDB server at `url` (checked here, connected per episode).
    pub fn mysql(url: &str) -> Result<Self, ConfigError> {
        mysql::parse_url(url).map_err(ConfigError::BadUrl)?;
        Ok(DbBenchConfig { engine: Engine::Mysql { url: url.to_string() }, ..Self::sqlite() })
    }

    /// From a command-line engine name (`sqlite` | `mysql`) and optional URL.
    pub fn from_engine_name(name: &str, url: Option<&str>) -> Result<Self, ConfigError> {
        match name {
            "sqlite" => Ok(Self::sqlite()),
            "mysql" | "mariadb" => Self::mysql(url.ok_or(ConfigError::MissingUrl)?),
            other => Err(ConfigError::UnknownEngine(other.to_string())),
        }
    }

    /// Sets the round limit.
    pub fn with_max_rounds(mut self, rounds: u32) -> Result<Self, ConfigError> {
        if rounds == 0 {
            return Err(ConfigError::NoRounds);
        }
        self.max_rounds = rounds;
        Ok(self)
    }

    /// Sets the database-name prefix (other characters become `_`).
    pub fn with_db_prefix(mut self, prefix: &str) -> Self {
        self.db_prefix = sanitize(prefix);
        self
    }

    fn exec_settings(&self) -> ExecSettings {
        ExecSettings { result_chars: self.result_chars, timeout: self.query_timeout }
    }
}

fn sanitize(s: &str) -> String {
    s.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' { c } else { '_' }).collect()
}

/// A database name no other episode, process or earlier run uses (≤ 64 characters).
fn unique_db_name(prefix: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    let tail = format!("_{}_{}_{}", std::process::id(), nanos % 1_000_000_000_000, N.fetch_add(1, Ordering::Relaxed));
    let mut prefix = sanitize(prefix);
    prefix.truncate(64 - tail.len());
    format!("{prefix}{tail}")
}

/// The tools, as AgentBench declares them.
/// How harness specs are validated for DBBench: its tools, and whether hooks may act in the
/// policy's place (`harness_actions`, off unless the run opts in).
pub fn validate_options(harness_actions: bool) -> crate::harness::ValidateOptions {
    crate::harness::ValidateOptions { tools: Some(tools().into_iter().map(|t| t.name).collect()), harness_actions, base: false }
}

pub fn tools() -> Vec<ToolSpec> {
    vec![
        ToolSpec {
            name: EXECUTE_SQL.into(),
            description: "Executes a given SQL statement on the database and returns the result.".into(),
            parameters: json!({
                "type": "object",
                "properties": {"query": {"type": "string", "description": "The SQL query to be executed."}},
                "required": ["query"],
                "additionalProperties": false
            }),
        },
        ToolSpec {
            name: COMMIT_FINAL_ANSWER.into(),
            description: "Commits the final answer after all operations are completed.".into(),
            parameters: json!({
                "type": "object",
                "properties": {"answers": {"type": "array", "items": {"type": "string"}, "description": "The list of final answers to commit."}},
                "required": ["answers"],
                "additionalProperties": false
            }),
        },
    ]
}

/// The answer an episode committed; for write tasks the table hash at that moment.
struct Committed {
    answer: PyValue,
    table_hash: Option<String>,
}

struct Episode {
    task: Arc<DbTask>,
    db: Option<Database>,
    rounds_used: u32,
    committed: Option<Committed>,
    done: bool,
}

/// The DBBench environment: one episode at a time, each with its own database.
pub struct DbBenchEnv {
    tasks: Arc<TaskSet>,
    config: DbBenchConfig,
    name: String,
    episode: Option<Episode>,
}

impl DbBenchEnv {
    pub fn new(tasks: Arc<TaskSet>, config: DbBenchConfig) -> Self {
        let name = format!("dbbench-{}", config.engine.kind());
        DbBenchEnv { tasks, config, name, episode: None }
    }

    pub fn config(&self) -> &DbBenchConfig {
        &self.config
    }

    fn episode(&mut self, operation: &'static str) -> Result<&mut Episode, EnvError> {
        self.episode.as_mut().ok_or_else(|| EnvError::State { operation, reason: "no episode is running; call reset first".into() })
    }

    /// The name of the server database of the running episode (`None` on SQLite).
    pub fn database_name(&self) -> Option<String> {
        match self.episode.as_ref()?.db.as_ref()? {
            Database::Mysql(db) => Some(db.name().to_string()),
            Database::Sqlite(_) => None,
        }
    }

    async fn run_sql(&mut self, query: &str) -> Result<Observation, EnvError> {
        let settings = self.config.exec_settings();
        let ep = self.episode("step")?;
        let db = ep.db.as_mut().ok_or_else(|| EnvError::State { operation: "step", reason: "the episode's database is closed".into() })?;
        Ok(match db.execute(query, settings).await? {
            Exec::Rows { text, truncated } => Observation {
                // AgentBench's text for an empty response; `[]` is not empty.
                text: if text.is_empty() { "No response from database.".into() } else { text },
                truncated,
                ..Default::default()
            },
            Exec::Failed { text } => Observation { text, action_failed: true, ..Default::default() },
        })
    }

    async fn commit(&mut self, answer: PyValue) -> Result<Observation, EnvError> {
        let ep = self.episode("step")?;
        let table_hash = if ep.task.is_write() {
            let db =
                ep.db.as_mut().ok_or_else(|| EnvError::State { operation: "step", reason: "the episode's database is closed".into() })?;
            Some(hash_tables(db, &ep.task).await?)
        } else {
            None
        };
        ep.committed = Some(Committed { answer, table_hash });
        Ok(Observation { text: "Answer committed.".into(), done: true, committed: true, ..Default::default() })
    }
}

/// The hash a write task's gold SQL gives on a fresh database (AgentBench does this
/// when `answer_md5` is empty).
async fn reference_hash(config: &DbBenchConfig, task: &DbTask) -> Result<String, EnvError> {
    let mut db = Database::create(&config.engine, &unique_db_name(&config.db_prefix), &task.tables).await?;
    let mut result = Ok(String::new());
    for sql in task.gold_sql() {
        if let Err(e) = db.execute(&sql, config.exec_settings()).await {
            result = Err(e);
            break;
        }
    }
    if result.is_ok() {
        result = hash_tables(&mut db, task).await;
    }
    let closed = db.close().await;
    let hash = result?;
    closed?;
    Ok(hash)
}

/// AgentBench's combined hash of all the task's tables; a failed hash query yields its
/// error text, which matches no `answer_md5`.
async fn hash_tables(db: &mut Database, task: &DbTask) -> Result<String, EnvError> {
    let mut hashes = Vec::new();
    for t in &task.tables {
        match db.table_hash(t).await? {
            Ok(h) => hashes.push(h),
            Err(text) => return Ok(format!("error: {text}")),
        }
    }
    Ok(combine_table_hashes(&hashes))
}

/// The first argument AgentBench would read (`list(arguments.values())[0]`), preferring
/// the declared name; a bare string stands for itself.
fn first_arg<'a>(args: &'a serde_json::Value, name: &str) -> Option<&'a serde_json::Value> {
    match args {
        serde_json::Value::Object(map) => map.get(name).or_else(|| map.values().next()),
        serde_json::Value::String(_) => Some(args),
        _ => None,
    }
}

fn failed(text: String) -> Observation {
    Observation { text, action_failed: true, ..Default::default() }
}

#[async_trait]
impl Environment for DbBenchEnv {
    fn name(&self) -> &str {
        &self.name
    }

    /// The seed is unused: a DBBench episode always starts from the task's tables.
    async fn reset(&mut self, task_id: &str, _seed: u64) -> Result<EpisodeStart, EnvError> {
        self.close().await?;
        let task = self.tasks.get(task_id).cloned().ok_or_else(|| EnvError::UnknownTask { task_id: task_id.to_string() })?;
        let db =
            Database::create(&self.config.engine, &unique_db_name(&self.config.db_prefix), &task.tables).await.map_err(|e| match e {
                EnvError::InvalidTask { reason, .. } => EnvError::InvalidTask { task_id: task.id.clone(), reason },
                other => other,
            })?;
        let mut features = serde_json::Map::new();
        features.insert("rows".into(), json!(task.row_count()));
        features.insert("columns".into(), json!(task.tables.iter().map(|t| t.columns.len()).sum::<usize>()));
        features.insert("tables".into(), json!(task.tables.len()));
        features.insert("write".into(), json!(task.is_write()));
        features.insert("source".into(), json!(task.source));
        if let Some(d) = &task.difficulty {
            features.insert("difficulty".into(), json!(d));
        }
        let start = EpisodeStart {
            observation: Observation { text: task.prompt(), ..Default::default() },
            tools: tools(),
            max_rounds: self.config.max_rounds,
            task_type: task.task_type.clone(),
            features,
        };
        self.episode = Some(Episode { task, db: Some(db), rounds_used: 0, committed: None, done: false });
        Ok(start)
    }

    async fn step(&mut self, call: &ToolCall) -> Result<Observation, EnvError> {
        let max_rounds = self.config.max_rounds;
        let ep = self.episode("step")?;
        if ep.done {
            return Err(EnvError::State {
                operation: "step",
                reason: "the episode is over (an answer was committed or the round limit was reached); call reset".into(),
            });
        }
        ep.rounds_used += 1;
        let mut obs = match call.name.as_str() {
            EXECUTE_SQL => match first_arg(&call.args, "query") {
                Some(serde_json::Value::String(q)) => {
                    let q = q.clone();
                    self.run_sql(&q).await?
                }
                _ => failed("execute_sql needs one string argument `query`, e.g. {\"query\": \"SELECT * FROM `table`\"}.".into()),
            },
            COMMIT_FINAL_ANSWER => match first_arg(&call.args, "answers") {
                Some(a) => {
                    let answer = PyValue::from_json(a);
                    self.commit(answer).await?
                }
                None => failed("commit_final_answer needs `answers`, a list of strings, e.g. {\"answers\": [\"42\"]}.".into()),
            },
            other => {
                failed(format!("Invalid function call `{other}`. Please call a tool instead: {EXECUTE_SQL} or {COMMIT_FINAL_ANSWER}."))
            }
        };
        let ep = self.episode("step")?;
        if !obs.done && ep.rounds_used >= max_rounds {
            obs.done = true;
            obs.text.push_str(&format!("\n\nRound limit reached ({max_rounds} rounds): the episode ends without an answer."));
        }
        ep.done = obs.done;
        Ok(obs)
    }

    async fn evaluate(&mut self) -> Result<Evaluation, EnvError> {
        let ep = self.episode("evaluate")?;
        let task = Arc::clone(&ep.task);
        let rounds = ep.rounds_used;
        let Some(committed) = ep.committed.as_ref() else {
            return Ok(Evaluation {
                reward: 0.0,
                success: false,
                detail: format!("no answer committed ({rounds} of {} rounds used)", self.config.max_rounds),
            });
        };
        let (cmp, detail) = if task.is_write() {
            let hash = committed.table_hash.clone().unwrap_or_default();
            let (truth, source) = match task.answer_md5.as_deref().filter(|m| !m.is_empty()) {
                Some(md5) => (md5.to_string(), "answer_md5"),
                None => {
                    let config = self.config.clone();
                    (reference_hash(&config, &task).await?, "gold SQL replayed on a fresh database")
                }
            };
            let cmp = compare_results(&PyValue::Str(hash.clone()), &PyValue::Str(truth.clone()), &task.task_type);
            let detail = format!(
                "{} task `{}`: table hash {hash} {} {} ({source})",
                task.task_type,
                task.id,
                if cmp.matched { "matches" } else { "differs from" },
                cmp.truth.join(","),
            );
            (cmp, detail)
        } else {
            let cmp = compare_results(&committed.answer, &task.label_value(), &task.task_type);
            let detail = format!("{} task `{}`: {}", task.task_type, task.id, cmp.describe());
            (cmp, detail)
        };
        Ok(Evaluation { reward: if cmp.matched { 1.0 } else { 0.0 }, success: cmp.matched, detail })
    }

    async fn close(&mut self) -> Result<(), EnvError> {
        if let Some(mut ep) = self.episode.take() {
            if let Some(db) = ep.db.take() {
                db.close().await?;
            }
        }
        Ok(())
    }
}

/// Makes one [`DbBenchEnv`] per episode for the rollout job.
#[derive(Clone)]
pub struct DbBenchFactory {
    pub tasks: Arc<TaskSet>,
    pub config: DbBenchConfig,
}

#[async_trait]
impl crate::env::EnvironmentFactory for DbBenchFactory {
    async fn create(&self) -> Result<Box<dyn Environment>, EnvError> {
        Ok(Box::new(DbBenchEnv::new(Arc::clone(&self.tasks), self.config.clone())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use infra::Transient;

    const TASKS: &str = r#"{"id": "count", "description": "How many people are older than 30?", "label": ["2"], "table": {"table_name": "people", "table_info": {"columns": [{"name": "name", "type": "TEXT"}, {"name": "age", "type": "INT"}], "rows": [["Ann", "31"], ["Bob", "45"], ["Cy", "12"]]}}, "add_description": "The name of this table is people, and the headers of this table are name,age.", "type": ["counting"]}
{"id": "insert", "description": "Add Dee, 50.", "label": ["INSERT INTO people (name, age) VALUES ('Dee', '50')"], "table": {"table_name": "people", "table_info": {"columns": [{"name": "name", "type": "TEXT"}, {"name": "age", "type": "INT"}], "rows": [["Ann", "31"]]}}, "type": ["INSERT"], "answer_md5": ""}
"#;

    fn env(rounds: u32) -> DbBenchEnv {
        let loaded = TaskSet::parse(TASKS, "t.jsonl", "t");
        assert!(loaded.problems.is_empty(), "{:?}", loaded.problems);
        DbBenchEnv::new(Arc::new(loaded.tasks), DbBenchConfig::sqlite().with_max_rounds(rounds).unwrap())
    }

    fn sql(q: &str) -> ToolCall {
        ToolCall { name: EXECUTE_SQL.into(), args: json!({ "query": q }) }
    }

    fn commit(a: serde_json::Value) -> ToolCall {
        ToolCall { name: COMMIT_FINAL_ANSWER.into(), args: json!({ "answers": a }) }
    }

    #[tokio::test]
    async fn a_read_episode_runs_and_grades() {
        let mut e = env(5);
        let start = e.reset("count", 1).await.unwrap();
        assert_eq!(start.task_type, "counting");
        assert_eq!(start.tools.len(), 2);
        assert!(start.observation.text.ends_with("Question: How many people are older than 30?\n"));
        assert_eq!(start.features["rows"], json!(3));
        let obs = e.step(&sql("SELECT count(*) FROM people WHERE age > 30")).await.unwrap();
        assert_eq!(obs, Observation { text: "[(2,)]".into(), ..Default::default() });
        let obs = e.step(&commit(json!(["2"]))).await.unwrap();
        assert!(obs.done);
        let ev = e.evaluate().await.unwrap();
        assert!(ev.success && ev.reward == 1.0, "{ev:?}");
        assert!(ev.detail.contains("single number within 0.01"), "{}", ev.detail);
        // Stepping after the end is a state error, not a panic.
        assert!(matches!(e.step(&sql("SELECT 1")).await, Err(EnvError::State { .. })));
        e.close().await.unwrap();
        e.close().await.unwrap();
    }

    #[tokio::test]
    async fn a_wrong_answer_fails() {
        let mut e = env(5);
        e.reset("count", 0).await.unwrap();
        e.step(&commit(json!(["3"]))).await.unwrap();
        let ev = e.evaluate().await.unwrap();
        assert!(!ev.success && ev.reward == 0.0);
        assert!(ev.detail.contains("wrong"), "{}", ev.detail);
    }

    #[tokio::test]
    async fn sql_errors_and_bad_calls_are_observations() {
        let mut e = env(10);
        e.reset("count", 0).await.unwrap();
        let obs = e.step(&sql("SELECT * FROM nowhere")).await.unwrap();
        assert!(obs.action_failed && !obs.done);
        assert!(obs.text.contains("no such table: nowhere"), "{}", obs.text);
        let obs = e.step(&ToolCall { name: "drop_everything".into(), args: json!({}) }).await.unwrap();
        assert!(obs.action_failed && obs.text.contains("Invalid function call"));
        let obs = e.step(&ToolCall { name: EXECUTE_SQL.into(), args: json!({"query": 5}) }).await.unwrap();
        assert!(obs.action_failed && obs.text.contains("needs one string argument `query`"));
        let obs = e.step(&ToolCall { name: COMMIT_FINAL_ANSWER.into(), args: json!({}) }).await.unwrap();
        assert!(obs.action_failed && !obs.done);
        // The episode goes on after errors.
        assert_eq!(e.step(&sql("SELECT name FROM people WHERE age = '12'")).await.unwrap().text, "[('Cy',)]");
    }

    #[tokio::test]
    async fn the_round_limit_ends_the_episode_without_an_answer() {
        let mut e = env(2);
        e.reset("count", 0).await.unwrap();
        assert!(!e.step(&sql("SELECT 1")).await.unwrap().done);
        let obs = e.step(&sql("SELECT 2")).await.unwrap();
        assert!(obs.done && obs.text.contains("Round limit reached (2 rounds)"), "{}", obs.text);
        let ev = e.evaluate().await.unwrap();
        assert!(!ev.success && ev.detail.contains("no answer committed (2 of 2 rounds used)"), "{}", ev.detail);
    }

    #[tokio::test]
    async fn long_results_are_truncated() {
        let mut e = env(5);
        e.reset("count", 0).await.unwrap();
        let obs = e.step(&sql("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c LIMIT 500) SELECT x FROM c")).await.unwrap();
        assert!(obs.truncated);
        assert!(obs.text.ends_with("[TRUNCATED]"));
        assert_eq!(obs.text.chars().count(), DEFAULT_RESULT_CHARS + "[TRUNCATED]".len());
    }

    #[tokio::test]
    async fn a_write_without_answer_md5_is_graded_against_its_replayed_gold() {
        let mut e = env(5);
        e.reset("insert", 0).await.unwrap();
        e.step(&sql("INSERT INTO people (name, age) VALUES ('Dee', '50')")).await.unwrap();
        e.step(&commit(json!([]))).await.unwrap();
        let ev = e.evaluate().await.unwrap();
        assert!(ev.success, "{}", ev.detail);
        assert!(ev.detail.contains("gold SQL replayed"), "{}", ev.detail);
        // Each episode starts from the task's initial table.
        e.reset("insert", 0).await.unwrap();
        e.step(&sql("INSERT INTO people (name, age) VALUES ('Dee', '51')")).await.unwrap();
        e.step(&commit(json!([]))).await.unwrap();
        assert!(!e.evaluate().await.unwrap().success);
    }

    #[tokio::test]
    async fn unknown_tasks_and_missing_resets_are_typed_errors() {
        let mut e = env(5);
        assert!(matches!(e.reset("nope", 0).await, Err(EnvError::UnknownTask { .. })));
        assert!(matches!(e.step(&sql("SELECT 1")).await, Err(EnvError::State { .. })));
        assert!(matches!(e.evaluate().await, Err(EnvError::State { .. })));
    }

    #[tokio::test]
    async fn a_server_that_is_down_is_a_retryable_backend_error() {
        let loaded = TaskSet::parse(TASKS, "t.jsonl", "t");
        // Nothing listens on port 1.
        let mut e = DbBenchEnv::new(Arc::new(loaded.tasks), DbBenchConfig::mysql("mysql://root@127.0.0.1:1").unwrap());
        let err = e.reset("count", 0).await.unwrap_err();
        assert!(matches!(err, EnvError::Backend { .. }) && err.is_transient(), "{err}");
        assert!(err.to_string().contains("cannot connect"), "{err}");
    }

    #[test]
    fn config_errors_say_what_to_do() {
        assert_eq!(DbBenchConfig::from_engine_name("oracle", None), Err(ConfigError::UnknownEngine("oracle".into())));
        assert_eq!(DbBenchConfig::from_engine_name("mysql", None), Err(ConfigError::MissingUrl));
        assert!(matches!(DbBenchConfig::from_engine_name("mysql", Some("http://x")), Err(ConfigError::BadUrl(_))));
        assert_eq!(DbBenchConfig::sqlite().with_max_rounds(0), Err(ConfigError::NoRounds));
        let name = unique_db_name(&"x-".repeat(60));
        assert!(name.len() <= 64 && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'), "{name}");
    }
}
