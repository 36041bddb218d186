//! Failure diagnosis (Harness-S §3.2, Appendix F "Attribution"): from the trajectory rows of
//! failed episodes under a parent harness to root causes per task.
//!
//! Two diagnosers share the [`Diagnoser`] seam:
//! - [`RuleDiagnoser`]: built in, no LLM. [`diagnose_trajectory`] is a pure function of one
//!   row that follows the episode from its earliest decision to its end and names every
//!   cause it can see (never committed, budget exhausted, round limit, SQL error on an
//!   identifier, other SQL errors, empty results, wrong aggregate, repeated identical
//!   action, answer format, answer in prose, write not executed, no query).
//! - [`LlmDiagnoser`]: any [`Policy`] reads a compact transcript and answers strict JSON
//!   `{"causes": [{"cause": "<code>", "evidence": "..."}]}`; an unusable answer gets one
//!   more try and is then recorded as `unresolved` with the reason.
//!
//! Rows that ended in an infrastructure or policy error are not failures of the harness and
//! are skipped (the paper's "every valid failure").

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::reading;
use crate::policy::{Message, Policy, SamplingParams};
use schemas::{ErrorClass, Role, Termination, Trajectory, TurnSource};

/// The cause codes the built-in diagnoser emits and the template editor repairs.
pub mod codes {
    pub const NEVER_COMMITTED: &str = "never_committed";
    pub const BUDGET_EXHAUSTED: &str = "budget_exhausted";
    pub const ROUND_LIMIT: &str = "round_limit";
    pub const PROSE_ANSWER: &str = "prose_answer";
    pub const IDENTIFIER_ERROR: &str = "identifier_error";
    pub const SQL_ERROR: &str = "sql_error";
    pub const EMPTY_RESULT: &str = "empty_result";
    pub const WRONG_AGGREGATE: &str = "wrong_aggregate";
    pub const REPEATED_ACTION: &str = "repeated_action";
    pub const ANSWER_FORMAT: &str = "answer_format";
    pub const WRONG_ANSWER: &str = "wrong_answer";
    pub const WRITE_NOT_EXECUTED: &str = "write_not_executed";
    pub const NO_QUERY: &str = "no_query";
    pub const UNPARSED_ACTION: &str = "unparsed_action";
    pub const RESULT_NOT_COMMITTED: &str = "result_not_committed";
    pub const UNRESOLVED: &str = "unresolved";

    /// Every code with its one-line meaning (shown to LLM diagnosers and editors).
    pub const ALL: &[(&str, &str)] = &[
        (NEVER_COMMITTED, "the episode ended without a committed final answer"),
        (BUDGET_EXHAUSTED, "the model-call or action budget ran out"),
        (ROUND_LIMIT, "the environment's round limit was reached"),
        (PROSE_ANSWER, "the agent stated a result in prose instead of calling a tool"),
        (IDENTIFIER_ERROR, "SQL failed on a table or column name (e.g. an unquoted multi-word identifier)"),
        (SQL_ERROR, "SQL failed for another reason (syntax, types)"),
        (EMPTY_RESULT, "a query returned no rows and the agent did not adjust it"),
        (WRONG_AGGREGATE, "the query used a different aggregate than the question asks for"),
        (REPEATED_ACTION, "the same action was repeated without progress"),
        (ANSWER_FORMAT, "the committed answer is not the bare value the result showed"),
        (WRONG_ANSWER, "a well-formed answer that the verifier rejected"),
        (WRITE_NOT_EXECUTED, "a write task committed without running INSERT/UPDATE/DELETE"),
        (NO_QUERY, "the agent answered without querying the database"),
        (UNPARSED_ACTION, "a reply wrote SQL outside a ```sql block, so no query ran"),
        (RESULT_NOT_COMMITTED, "a query returned a single value and the episode ended without committing it"),
    ];
}

/// One root cause seen in one failed episode.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Finding {
    /// A snake_case cause code (see [`codes`]).
    pub cause: String,
    /// What in the trajectory shows it.
    pub evidence: String,
}

/// The causes of one failed task under one harness.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskDiagnosis {
    pub task_id: String,
    pub task_type: String,
    pub harness_id: String,
    pub findings: Vec<Finding>,
}

/// Why a diagnosis could not be made at all.
#[derive(Debug, thiserror::Error)]
pub enum DiagnoseError {
    #[error("diagnoser `{diagnoser}`: {detail}")]
    Failed { diagnoser: String, detail: String },
}

/// Turns failed trajectories into root causes per task.
#[async_trait]
pub trait Diagnoser: Send + Sync {
    fn name(&self) -> &str;
    /// Diagnoses failed rows (successes and error rows are ignored).
    async fn diagnose(&self, rows: &[Trajectory]) -> Result<Vec<TaskDiagnosis>, DiagnoseError>;
}

/// Whether a row is a failure the harness can be blamed for: unsuccessful, and not ended by
/// an infrastructure, timeout or policy-server error.
pub fn is_valid_failure(row: &Trajectory) -> bool {
    !row.success && !matches!(row.error_class, Some(ErrorClass::Infra | ErrorClass::Timeout | ErrorClass::Policy))
}

/// The built-in rule-based diagnoser.
#[derive(Debug, Clone, Default)]
pub struct RuleDiagnoser;

#[async_trait]
impl Diagnoser for RuleDiagnoser {
    fn name(&self) -> &str {
        "rules"
    }
    async fn diagnose(&self, rows: &[Trajectory]) -> Result<Vec<TaskDiagnosis>, DiagnoseError> {
        Ok(rows
            .iter()
            .filter(|r| is_valid_failure(r))
            .map(|r| TaskDiagnosis {
                task_id: r.task_id.clone(),
                task_type: r.task_type.clone(),
                harness_id: r.harness_id.clone(),
                findings: diagnose_trajectory(r),
            })
            .collect())
    }
}

/// One environment action as the trajectory shows it.
struct Action<'a> {
    tool: &'a str,
    args: Value,
    /// The environment's answer (None when the harness blocked it).
    result: Option<&'a str>,
}

fn actions(row: &Trajectory) -> Vec<Action<'_>> {
    let mut out = Vec::new();
    let mut pending: Option<(&str, Value)> = None;
    for t in &row.turns {
        match (t.role, t.source) {
            (Role::Assistant, _) => {
                if let Some((tool, args)) = pending.take() {
                    out.push(Action { tool, args, result: None });
                }
                if let Some(tool) = t.tool_name.as_deref() {
                    let args = t.tool_args.as_deref().and_then(|a| serde_json::from_str(a).ok()).unwrap_or(Value::Null);
                    pending = Some((tool, args));
                }
            }
            (Role::Tool, TurnSource::Env) => {
                let (tool, args) = match pending.take() {
                    Some(p) => p,
                    None => (
                        t.tool_name.as_deref().unwrap_or(""),
                        t.tool_args.as_deref().and_then(|a| serde_json::from_str(a).ok()).unwrap_or(Value::Null),
                    ),
                };
                out.push(Action { tool, args, result: Some(t.text.as_str()) });
            }
            (Role::Tool, TurnSource::Harness) => {
                // A blocked call: the harness answered instead of the environment.
                if let Some((tool, args)) = pending.take() {
                    out.push(Action { tool, args, result: None });
                }
            }
            _ => {}
        }
    }
    if let Some((tool, args)) = pending {
        out.push(Action { tool, args, result: None });
    }
    out
}

fn query_of(a: &Action<'_>) -> Option<String> {
    a.args.get("query").and_then(Value::as_str).map(str::to_string)
}

fn is_error_text(text: &str) -> bool {
    let t = text.to_ascii_lowercase();
    t.contains("execution error") || t.contains("syntax") || t.starts_with("error") || t.contains("(42")
}

fn is_identifier_error(text: &str) -> bool {
    let t = text.to_ascii_lowercase();
    ["no such table", "no such column", "unknown column", "doesn't exist", "unknown table", "ambiguous column"]
        .iter()
        .any(|p| t.contains(p))
}

fn is_empty_result(text: &str) -> bool {
    let t = text.trim();
    t == "No response from database." || t == "[]" || t == "[(None,)]"
}

fn clip(s: &str, n: usize) -> String {
    let s = s.replace('\n', " ");
    if s.chars().count() <= n {
        s
    } else {
        format!("{}…", s.chars().take(n).collect::<String>())
    }
}

/// The aggregate a task type asks for (`aggregation-AVG` → AVG, `counting` → COUNT).
fn wanted_aggregate(task_type: &str) -> Option<&'static str> {
    let t = task_type.to_ascii_uppercase();
    if t == "COUNTING" {
        return Some("COUNT");
    }
    ["SUM", "AVG", "MIN", "MAX", "COUNT"].into_iter().find(|op| t.starts_with("AGGREGATION") && t.ends_with(op))
}

/// The root causes visible in one failed row, earliest decision first (Appendix F,
/// "Attribution": follow the earliest decision or tool result, then the later effect).
pub fn diagnose_trajectory(row: &Trajectory) -> Vec<Finding> {
    fn add(out: &mut Vec<Finding>, cause: &str, evidence: String) {
        if !out.iter().any(|f| f.cause == cause) {
            out.push(Finding { cause: cause.to_string(), evidence });
        }
    }
    let mut out: Vec<Finding> = Vec::new();
    let acts = actions(row);
    let commit = acts.iter().find(|a| a.tool == "commit_final_answer");
    let queries: Vec<&Action<'_>> = acts.iter().filter(|a| a.tool != "commit_final_answer").collect();

    // Decisions along the episode.
    for a in &queries {
        let (Some(q), Some(result)) = (query_of(a), a.result) else { continue };
        if is_identifier_error(result) || (is_error_text(result) && unquoted_multiword(&q, row)) {
            add(&mut out, codes::IDENTIFIER_ERROR, format!("`{}` → {}", clip(&q, 80), clip(result, 80)));
        } else if is_error_text(result) {
            add(&mut out, codes::SQL_ERROR, format!("`{}` → {}", clip(&q, 80), clip(result, 80)));
        } else if is_empty_result(result) {
            add(&mut out, codes::EMPTY_RESULT, format!("`{}` returned nothing", clip(&q, 80)));
        }
    }
    let mut run = 1;
    for w in acts.windows(2) {
        run = if w[0].tool == w[1].tool && w[0].args == w[1].args { run + 1 } else { 1 };
        if run == 2 {
            add(&mut out, codes::REPEATED_ACTION, format!("`{}` {} repeated", w[1].tool, clip(&w[1].args.to_string(), 80)));
        }
    }
    let prose = row.turns.iter().filter(|t| t.source == TurnSource::Policy && t.tool_name.is_none() && !t.text.trim().is_empty()).count();
    if prose > 0 {
        let first = row.turns.iter().find(|t| t.source == TurnSource::Policy && t.tool_name.is_none() && !t.text.trim().is_empty());
        add(
            &mut out,
            codes::PROSE_ANSWER,
            format!("{prose} repl(ies) without a tool call, e.g. \"{}\"", clip(first.map(|t| t.text.as_str()).unwrap_or(""), 80)),
        );
    }
    let unparsed =
        row.turns.iter().filter(|t| t.source == TurnSource::Policy && t.tool_name.is_none()).find_map(|t| reading::stated_sql(&t.text));
    if let Some(sql) = unparsed {
        add(&mut out, codes::UNPARSED_ACTION, format!("SQL in prose, never run: `{}`", clip(sql, 80)));
    }
    if commit.is_none() {
        if let Some((q, r)) =
            queries.iter().rev().find_map(|a| Some((query_of(a)?, a.result.filter(|r| reading::single_value(r).is_some())?)))
        {
            add(&mut out, codes::RESULT_NOT_COMMITTED, format!("`{}` returned {} and nothing was committed", clip(&q, 60), clip(r, 40)));
        }
    }
    if let Some(op) = wanted_aggregate(&row.task_type) {
        let last = queries.iter().rev().find_map(|a| query_of(a));
        if let Some(q) = last {
            if !q.to_ascii_uppercase().contains(&format!("{op}(")) && !q.to_ascii_uppercase().contains(&format!("{op} (")) {
                add(&mut out, codes::WRONG_AGGREGATE, format!("task `{}` needs {op}; last query `{}`", row.task_type, clip(&q, 80)));
            }
        }
    }
    let is_write = ["INSERT", "UPDATE", "DELETE"].iter().any(|w| row.task_type.eq_ignore_ascii_case(w));
    if is_write && commit.is_some() {
        let wrote = queries.iter().filter_map(|a| query_of(a)).any(|q| {
            let u = q.trim_start().to_ascii_uppercase();
            u.starts_with("INSERT") || u.starts_with("UPDATE") || u.starts_with("DELETE")
        });
        if !wrote {
            add(&mut out, codes::WRITE_NOT_EXECUTED, format!("`{}` task committed without a write statement", row.task_type));
        }
    }

    // How it ended.
    match (row.termination, commit) {
        (Termination::Committed, Some(c)) if !row.success => {
            if queries.is_empty() && !is_write {
                add(&mut out, codes::NO_QUERY, "committed without any query".into());
            }
            let answers: Vec<String> = c
                .args
                .get("answers")
                .and_then(Value::as_array)
                .map(|a| a.iter().map(|v| v.as_str().map(str::to_string).unwrap_or_else(|| v.to_string())).collect())
                .unwrap_or_default();
            let last_result = queries.iter().rev().find_map(|a| a.result).unwrap_or("");
            let bare = answers.iter().all(|a| !a.contains(' ') || last_result.contains(a.as_str()));
            let copied = !answers.is_empty() && answers.iter().all(|a| last_result.contains(a.trim()));
            if !is_write && (!bare || answers.is_empty() || (!copied && c.args.get("answers").is_none())) {
                add(
                    &mut out,
                    codes::ANSWER_FORMAT,
                    format!("committed {} after result {}", clip(&c.args.to_string(), 60), clip(last_result, 60)),
                );
            } else if !is_write && !copied && !last_result.is_empty() {
                add(
                    &mut out,
                    codes::ANSWER_FORMAT,
                    format!("committed {} which the last result {} does not show", clip(&c.args.to_string(), 60), clip(last_result, 60)),
                );
            } else if !out.iter().any(|f| f.cause == codes::WRONG_AGGREGATE || f.cause == codes::WRITE_NOT_EXECUTED) {
                add(&mut out, codes::WRONG_ANSWER, format!("committed {}", clip(&c.args.to_string(), 80)));
            }
        }
        (Termination::Committed, _) => {}
        (Termination::BudgetExhausted, _) => {
            add(&mut out, codes::NEVER_COMMITTED, format!("{} model calls, {} actions, no commit", row.model_calls, row.env_actions));
            add(&mut out, codes::BUDGET_EXHAUSTED, format!("budget ran out after {} model calls", row.model_calls));
        }
        (Termination::RoundLimit, _) => {
            add(&mut out, codes::NEVER_COMMITTED, format!("{} actions, no commit", row.env_actions));
            add(&mut out, codes::ROUND_LIMIT, format!("round limit reached after {} actions", row.env_actions));
        }
        (Termination::ContextLimit | Termination::Error, _) => {
            add(
                &mut out,
                codes::NEVER_COMMITTED,
                format!("ended by {:?}: {}", row.termination, clip(row.error_message.as_deref().unwrap_or(""), 80)),
            );
        }
    }
    if out.is_empty() {
        add(&mut out, codes::UNRESOLVED, "no rule matched".into());
    }
    out
}

/// Whether a query names a multi-word table of the task without quoting it. The task's
/// table names appear in its first user message ("The name of this table is X, ...").
fn unquoted_multiword(query: &str, row: &Trajectory) -> bool {
    let task_text = row.turns.iter().find(|t| t.source == TurnSource::Env && t.role == Role::User).map(|t| t.text.as_str()).unwrap_or("");
    let mut names = Vec::new();
    for part in task_text.split("The name of this table is ").skip(1) {
        if let Some(name) = part.split(", and").next() {
            if name.contains(' ') {
                names.push(name.trim().to_string());
            }
        }
    }
    names.iter().any(|n| query.contains(n.as_str()) && !query.contains(&format!("`{n}`")) && !query.contains(&format!("\"{n}\"")))
        || (!names.is_empty() && names.iter().any(|n| n.split(' ').next().is_some_and(|w| query.contains(&format!("FROM {w} ")))))
}

/// An LLM diagnoser: one strict-JSON call per failed row.
pub struct LlmDiagnoser<'p> {
    pub policy: &'p dyn Policy,
    pub sampling: SamplingParams,
}

/// Instructions of the analysis stage (Appendix F, "Attribution").
pub const DIAGNOSE_INSTRUCTIONS: &str = "You analyse one failed agent episode. For EACH failure, follow the earliest \
decision or tool result explaining the failed check, then inspect the later effect. Answer with JSON only, exactly of \
the form {\"causes\": [{\"cause\": \"<code>\", \"evidence\": \"<what in the transcript shows it>\"}]} using codes from \
this list (or \"unresolved\" if none fits):";

impl LlmDiagnoser<'_> {
    fn prompt(row: &Trajectory) -> Vec<Message> {
        let list: Vec<String> = codes::ALL.iter().map(|(c, d)| format!("- {c}: {d}")).collect();
        let mut transcript = String::new();
        for t in row.turns.iter().filter(|t| t.role != Role::System) {
            let who = match (t.role, t.source) {
                (Role::Assistant, _) => "AGENT",
                (Role::Tool, TurnSource::Env) => "RESULT",
                (_, TurnSource::Harness) => "HARNESS",
                _ => "TASK",
            };
            let call = t.tool_name.as_ref().map(|n| format!(" [{n} {}]", t.tool_args.as_deref().unwrap_or(""))).unwrap_or_default();
            transcript.push_str(&format!("{who}: {}{call}\n", clip(&t.text, 300)));
        }
        transcript.push_str(&format!("END: {:?}, success = {}\n", row.termination, row.success));
        vec![
            Message::new(Role::System, format!("{DIAGNOSE_INSTRUCTIONS}\n{}", list.join("\n"))),
            Message::new(Role::User, clip(&transcript, 6000)),
        ]
    }
}

/// Parses a diagnoser reply: the first JSON object in the text with a `causes` list of
/// `{cause, evidence}`; codes are normalised to snake_case.
pub fn parse_diagnosis(text: &str) -> Result<Vec<Finding>, String> {
    let start = text.find('{').ok_or("no JSON object in the reply")?;
    let end = text.rfind('}').ok_or("no JSON object in the reply")?;
    if end < start {
        return Err("no JSON object in the reply".into());
    }
    let v: Value = serde_json::from_str(&text[start..=end]).map_err(|e| format!("not valid JSON: {e}"))?;
    let list = v.get("causes").and_then(Value::as_array).ok_or("missing `causes` list")?;
    let mut out = Vec::new();
    for (i, c) in list.iter().enumerate() {
        let code = c.get("cause").and_then(Value::as_str).ok_or(format!("causes[{i}].cause: missing or not a string"))?;
        let code: String = code.trim().to_ascii_lowercase().chars().map(|ch| if ch.is_ascii_alphanumeric() { ch } else { '_' }).collect();
        if code.is_empty() {
            return Err(format!("causes[{i}].cause: empty"));
        }
        let evidence = c.get("evidence").and_then(Value::as_str).unwrap_or("").to_string();
        out.push(Finding { cause: code, evidence });
    }
    if out.is_empty() {
        return Err("`causes` is empty".into());
    }
    Ok(out)
}

#[async_trait]
impl Diagnoser for LlmDiagnoser<'_> {
    fn name(&self) -> &str {
        "llm"
    }
    async fn diagnose(&self, rows: &[Trajectory]) -> Result<Vec<TaskDiagnosis>, DiagnoseError> {
        let mut out = Vec::new();
        for row in rows.iter().filter(|r| is_valid_failure(r)) {
            let mut messages = Self::prompt(row);
            let mut findings = None;
            let mut last_problem = String::new();
            for _ in 0..2 {
                let reply = self
                    .policy
                    .chat(&messages, &[], &self.sampling)
                    .await
                    .map_err(|e| DiagnoseError::Failed { diagnoser: "llm".into(), detail: format!("task `{}`: {e}", row.task_id) })?;
                match parse_diagnosis(&reply.text) {
                    Ok(f) => {
                        findings = Some(f);
                        break;
                    }
                    Err(problem) => {
                        last_problem = problem.clone();
                        messages.push(Message::new(Role::Assistant, reply.text));
                        messages.push(Message::new(
                            Role::User,
                            format!("That reply is unusable ({problem}). Answer with the JSON object only."),
                        ));
                    }
                }
            }
            let findings = findings.unwrap_or_else(|| {
                vec![Finding { cause: codes::UNRESOLVED.into(), evidence: format!("diagnoser reply unusable: {last_problem}") }]
            });
            out.push(TaskDiagnosis {
                task_id: row.task_id.clone(),
                task_type: row.task_type.clone(),
                harness_id: row.harness_id.clone(),
                findings,
            });
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use schemas::{RolloutKind, Split, Turn};

    fn turn(role: Role, source: TurnSource, text: &str, tool: Option<(&str, Value)>) -> Turn {
        Turn {
            index: 0,
            role,
            source,
            text: text.into(),
            token_ids: vec![],
            logprobs: vec![],
            loss_mask: vec![],
            tool_name: tool.as_ref().map(|t| t.0.to_string()),
            tool_args: tool.map(|t| t.1.to_string()),
            hook_id: None,
            prompt_token_count: 0,
            prompt_hash: None,
        }
    }

    fn row(task_type: &str, termination: Termination, turns: Vec<Turn>) -> Trajectory {
        Trajectory {
            trajectory_id: "t".into(),
            run_id: "r".into(),
            job_id: "j".into(),
            step: 0,
            kind: RolloutKind::Eval,
            split: Split::Train,
            task_id: "task".into(),
            task_type: task_type.into(),
            group_id: "g".into(),
            attempt: 0,
            harness_id: "h0".into(),
            harness_version: "v".into(),
            policy_checkpoint: "p".into(),
            seed: 1,
            reward: 0.0,
            success: false,
            termination,
            error_class: None,
            error_message: None,
            prompt_tokens: 0,
            completion_tokens: 0,
            harness_tokens: 0,
            model_calls: 3,
            env_actions: 2,
            started_at_ms: 0,
            duration_ms: 0,
            policy_ms: 0,
            env_ms: 0,
            temperature: 1.0,
            tool_view: String::new(),
            turns,
        }
    }

    fn causes(r: &Trajectory) -> Vec<String> {
        diagnose_trajectory(r).into_iter().map(|f| f.cause).collect()
    }

    fn task(text: &str) -> Turn {
        turn(Role::User, TurnSource::Env, text, None)
    }

    fn sql(q: &str) -> Turn {
        turn(Role::Assistant, TurnSource::Policy, "", Some(("execute_sql", serde_json::json!({"query": q}))))
    }

    fn result(text: &str) -> Turn {
        turn(Role::Tool, TurnSource::Env, text, None)
    }

    #[test]
    fn prose_after_a_result_and_no_commit() {
        let r = row(
            "counting",
            Termination::BudgetExhausted,
            vec![
                task("The name of this table is people, and the headers of this table are name,age.\nQuestion: How many?"),
                sql("SELECT count(*) FROM people WHERE age > 30"),
                result("[(2,)]"),
                turn(Role::Assistant, TurnSource::Policy, "The output is 2.", None),
                turn(Role::User, TurnSource::Harness, "Your reply called no tool.", None),
            ],
        );
        assert_eq!(causes(&r), vec!["prose_answer", "result_not_committed", "never_committed", "budget_exhausted"]);
    }

    #[test]
    fn sql_written_in_prose_is_an_unparsed_action() {
        let r = row(
            "counting",
            Termination::BudgetExhausted,
            vec![
                task("Question: How many cities have area greater than 25?"),
                turn(Role::Assistant, TurnSource::Policy, "Shorter version:\nSELECT COUNT(*) FROM cities WHERE area > 25;", None),
                turn(Role::User, TurnSource::Harness, "Your reply called no tool.", None),
            ],
        );
        let found = diagnose_trajectory(&r);
        assert_eq!(found[1].cause, "unparsed_action");
        assert!(found[1].evidence.contains("`SELECT COUNT(*) FROM cities WHERE area > 25;`"), "{found:?}");
        // A multi-row result is not a single value left uncommitted.
        let rows = row("ranking", Termination::BudgetExhausted, vec![task("t"), sql("SELECT name FROM t"), result("[('a',), ('b',)]")]);
        assert!(!causes(&rows).contains(&"result_not_committed".to_string()));
    }

    #[test]
    fn identifier_errors_repeats_and_round_limit() {
        let q = "SELECT count(*) FROM Employee Records";
        let r = row(
            "counting",
            Termination::RoundLimit,
            vec![
                task("The name of this table is Employee Records, and the headers of this table are name,age.\nQuestion: How many?"),
                sql(q),
                result("SQLite execution error: near \"Records\": syntax error"),
                sql(q),
                result("SQLite execution error: near \"Records\": syntax error"),
            ],
        );
        assert_eq!(causes(&r), vec!["identifier_error", "repeated_action", "never_committed", "round_limit"]);
        let r = row(
            "ranking",
            Termination::RoundLimit,
            vec![task("t"), sql("SELECT name FROM t WHERE x = 1"), result("SQLite execution error: no such column: x")],
        );
        assert!(causes(&r).contains(&"identifier_error".to_string()));
    }

    #[test]
    fn committed_failures_name_the_answer_problem() {
        let commit =
            |a: Value| turn(Role::Assistant, TurnSource::Policy, "", Some(("commit_final_answer", serde_json::json!({"answers": a}))));
        let wrong_op = row(
            "aggregation-AVG",
            Termination::Committed,
            vec![task("t"), sql("SELECT SUM(age) FROM t"), result("[(62,)]"), commit(serde_json::json!(["62"]))],
        );
        assert_eq!(causes(&wrong_op), vec!["wrong_aggregate"]);
        let prose = row(
            "counting",
            Termination::Committed,
            vec![task("t"), sql("SELECT count(*) FROM t"), result("[(2,)]"), commit(serde_json::json!(["there are two people"]))],
        );
        assert_eq!(causes(&prose), vec!["answer_format"]);
        let empty = row(
            "ranking",
            Termination::Committed,
            vec![
                task("t"),
                sql("SELECT name FROM t WHERE name = 'x'"),
                result("No response from database."),
                commit(serde_json::json!(["x"])),
            ],
        );
        assert!(causes(&empty).contains(&"empty_result".to_string()));
        let write = row(
            "INSERT",
            Termination::Committed,
            vec![task("t"), sql("SELECT * FROM t"), result("[('a', 1)]"), commit(serde_json::json!([]))],
        );
        assert_eq!(causes(&write), vec!["write_not_executed"]);
        let mut infra = row("counting", Termination::Error, vec![]);
        infra.error_class = Some(ErrorClass::Infra);
        assert!(!is_valid_failure(&infra));
    }

    #[test]
    fn llm_diagnoses_are_parsed_strictly() {
        let f = parse_diagnosis("Sure: {\"causes\": [{\"cause\": \"Never Committed\", \"evidence\": \"no commit\"}]}").unwrap();
        assert_eq!(f[0].cause, "never_committed");
        assert!(parse_diagnosis("no idea").unwrap_err().contains("no JSON object"));
        assert!(parse_diagnosis("{\"causes\": []}").unwrap_err().contains("empty"));
        assert!(parse_diagnosis("{\"causes\": [{\"evidence\": 1}]}").unwrap_err().contains("causes[0].cause"));
    }
}
