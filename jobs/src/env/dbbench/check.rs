//! A data and engine sanity check: every task's gold answer, sent through the
//! environment and its grader, should be graded correct.
//!
//! Write tasks replay their gold SQL with `execute_sql` and commit; read tasks commit
//! their label with `commit_final_answer` — or, with `verify_labels`, the answers their
//! gold SQL returns on SQLite, so that a label that disagrees with its own query (say
//! `["banana"]` for a count) is caught. The report counts agreement per task type
//! ([`CheckReport::table`]); `harness-s tasks check` prints it.

use std::sync::Arc;

use serde_json::json;

use super::{DbBenchConfig, DbBenchEnv, TaskSet, COMMIT_FINAL_ANSWER, EXECUTE_SQL};
use crate::env::{EnvError, Environment, ToolCall};

/// The check of one task.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskCheck {
    pub task_id: String,
    pub task_type: String,
    /// The grader accepted the gold answer.
    pub agreed: bool,
    /// The grader's explanation, or what went wrong before grading.
    pub detail: String,
}

/// Agreement of one task type.
#[derive(Debug, Clone, PartialEq)]
pub struct TypeTally {
    pub task_type: String,
    pub tasks: usize,
    pub agreed: usize,
}

/// All checks of one file on one engine.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckReport {
    /// `sqlite` or `mysql`.
    pub engine: String,
    pub checks: Vec<TaskCheck>,
}

impl CheckReport {
    /// Per task type, in order of first appearance.
    pub fn by_type(&self) -> Vec<TypeTally> {
        let mut tallies: Vec<TypeTally> = Vec::new();
        for c in &self.checks {
            let i = match tallies.iter().position(|t| t.task_type == c.task_type) {
                Some(i) => i,
                None => {
                    tallies.push(TypeTally { task_type: c.task_type.clone(), tasks: 0, agreed: 0 });
                    tallies.len() - 1
                }
            };
            tallies[i].tasks += 1;
            tallies[i].agreed += c.agreed as usize;
        }
        tallies
    }

    /// Agreement over the tasks whose type satisfies `pred`: (agreed, tasks).
    pub fn agreement(&self, pred: impl Fn(&str) -> bool) -> (usize, usize) {
        let sel: Vec<&TaskCheck> = self.checks.iter().filter(|c| pred(&c.task_type)).collect();
        (sel.iter().filter(|c| c.agreed).count(), sel.len())
    }

    /// The per-type table with a total line.
    pub fn table(&self) -> String {
        let tallies = self.by_type();
        let width = tallies.iter().map(|t| t.task_type.len()).max().unwrap_or(4).max("task type".len());
        let mut out = format!("{:<width$}  {:>5}  {:>6}  {:>7}\n", "task type", "tasks", "agreed", "rate");
        let line = |name: &str, tasks: usize, agreed: usize| {
            let rate = if tasks == 0 { 0.0 } else { 100.0 * agreed as f64 / tasks as f64 };
            format!("{name:<width$}  {tasks:>5}  {agreed:>6}  {rate:>6.1}%\n")
        };
        for t in &tallies {
            out.push_str(&line(&t.task_type, t.tasks, t.agreed));
        }
        let (agreed, tasks) = self.agreement(|_| true);
        out.push_str(&line("all", tasks, agreed));
        out
    }
}

/// Checks every task of `tasks` on the configured engine. `progress` sees each check as
/// it finishes. A backend failure (server down) stops the check with that error; a task
/// the engine cannot even set up counts as a disagreement.
pub async fn check_tasks(
    tasks: Arc<TaskSet>,
    config: &DbBenchConfig,
    verify_labels: bool,
    mut progress: impl FnMut(&TaskCheck),
) -> Result<CheckReport, EnvError> {
    let mut checks = Vec::with_capacity(tasks.len());
    for task in tasks.iter() {
        let gold = if task.is_write() { task.gold_sql() } else { Vec::new() };
        // Writes: "your answer field can be anything"; reads: the label, or what the gold
        // SQL answers.
        let answers = if task.is_write() {
            json!([])
        } else if verify_labels {
            match gold_answers(task) {
                Ok(a) => a,
                Err(detail) => {
                    let check = TaskCheck { task_id: task.id.clone(), task_type: task.task_type.clone(), agreed: false, detail };
                    progress(&check);
                    checks.push(check);
                    continue;
                }
            }
        } else {
            task.label.clone()
        };
        // Room for every gold statement and the commit.
        let mut cfg = config.clone();
        cfg.max_rounds = cfg.max_rounds.max(gold.len() as u32 + 1);
        let mut env = DbBenchEnv::new(Arc::clone(&tasks), cfg);
        let outcome = check_one(&mut env, &task.id, &gold, &answers).await;
        let closed = env.close().await;
        let check = match outcome {
            Ok((agreed, detail)) => TaskCheck { task_id: task.id.clone(), task_type: task.task_type.clone(), agreed, detail },
            Err(e @ EnvError::Backend { .. }) => return Err(e),
            Err(e) => TaskCheck { task_id: task.id.clone(), task_type: task.task_type.clone(), agreed: false, detail: e.to_string() },
        };
        closed?;
        progress(&check);
        checks.push(check);
    }
    Ok(CheckReport { engine: config.engine.kind().to_string(), checks })
}

/// The answers a read task's gold SQL returns on SQLite, as the label would list them.
fn gold_answers(task: &super::task::DbTask) -> Result<serde_json::Value, String> {
    let Some(sql) = &task.sql_query else { return Err("no gold SQL (`sql.query`) to verify the label with".into()) };
    let db = super::sqlite::SqliteDb::create(&task.tables).map_err(|e| format!("cannot set up the tables: {e}"))?;
    let rows = db.query_values(sql).map_err(|e| format!("gold SQL failed: {e}"))?;
    Ok(json!(rows.iter().flatten().map(super::pyvalue::PyValue::to_py_str).collect::<Vec<String>>()))
}

async fn check_one(env: &mut DbBenchEnv, task_id: &str, gold: &[String], answers: &serde_json::Value) -> Result<(bool, String), EnvError> {
    env.reset(task_id, 0).await?;
    let mut failures = Vec::new();
    for sql in gold {
        let obs = env.step(&ToolCall { name: EXECUTE_SQL.into(), args: json!({ "query": sql }) }).await?;
        if obs.action_failed {
            failures.push(format!("gold SQL failed: {}", obs.text));
        }
    }
    env.step(&ToolCall { name: COMMIT_FINAL_ANSWER.into(), args: json!({ "answers": answers }) }).await?;
    let eval = env.evaluate().await?;
    failures.push(eval.detail);
    Ok((eval.success, failures.join("; ")))
}
