//! Harness Behavior Profiles (Harness-S §3.4, Eq. 8 and 11; Appendix D): when a sibling
//! harness helps or hurts the current policy relative to H0, learned from paired
//! calibration trajectories (same validation task, seed and limits; frozen policy).
//!
//! This module owns the pieces both profilers share, all pure:
//! - [`TaskInfo`]: what the router and profilers know of a task (id, type, description,
//!   features such as `rows`);
//! - [`When`]: the machine-checkable task conditions of statistical entries
//!   (`any task`, `task_type = counting`, `rows <= 23`, `rows > 23`);
//! - [`Behavior`]: action patterns detected in a trajectory's turns;
//! - [`pair_up`]: pairing of H_i and H0 rows by (task, seed);
//! - [`validation_stats`]: per-harness validation success, overall and per task;
//! - [`describe_harness`]: a short text of a spec's edits for prompts.
//!
//! The two profilers: [`stats::statistical_profile`] (built in, no LLM) and
//! [`llm::LlmProfiler`] (any OpenAI-compatible endpoint through [`crate::policy::Policy`]).
//!
//! ```
//! use jobs::profile::{When, TaskInfo};
//! let when: When = "rows > 20".parse().unwrap();
//! let mut task = TaskInfo::new("t1", "counting", "How many players?");
//! task.features.insert("rows".into(), 40.into());
//! assert!(when.matches(&task));
//! ```

pub mod llm;
pub mod stats;

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use crate::env::dbbench::DbTask;
use schemas::{ErrorClass, HarnessSpec, Role, Trajectory};

/// What the router and the profilers know of a task.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskInfo {
    pub task_id: String,
    /// Task category, e.g. `counting`, `INSERT`.
    pub task_type: String,
    /// The task as a sentence (DBBench: the question).
    pub description: String,
    /// Numeric and boolean features, e.g. `rows`, `columns`, `tables`, `write`.
    #[serde(default)]
    pub features: serde_json::Map<String, serde_json::Value>,
}

impl TaskInfo {
    pub fn new(task_id: impl Into<String>, task_type: impl Into<String>, description: impl Into<String>) -> Self {
        TaskInfo { task_id: task_id.into(), task_type: task_type.into(), description: description.into(), features: Default::default() }
    }

    /// The features the DBBench environment reports at reset, from the task itself.
    pub fn from_db_task(task: &DbTask) -> Self {
        let mut features = serde_json::Map::new();
        features.insert("rows".into(), task.row_count().into());
        features.insert("columns".into(), task.tables.iter().map(|t| t.columns.len()).sum::<usize>().into());
        features.insert("tables".into(), task.tables.len().into());
        features.insert("write".into(), task.is_write().into());
        TaskInfo { task_id: task.id.clone(), task_type: task.task_type.clone(), description: task.description.clone(), features }
    }

    /// A numeric feature (booleans count as 0/1).
    pub fn feature(&self, name: &str) -> Option<f64> {
        match self.features.get(name)? {
            serde_json::Value::Number(n) => n.as_f64(),
            serde_json::Value::Bool(b) => Some(f64::from(u8::from(*b))),
            _ => None,
        }
    }

    /// One line for prompts: `counting, rows=17: How many ...`.
    pub fn summary(&self) -> String {
        let rows = self.feature("rows").map(|r| format!(", rows={r}")).unwrap_or_default();
        format!("{}{rows}: {}", self.task_type, clip(&self.description, 200))
    }
}

/// A task condition of a statistical profile entry (the `When` of Eq. 8), written so that
/// the built-in voter can check it against a task.
#[derive(Debug, Clone, PartialEq)]
pub enum When {
    Any,
    TaskType(String),
    FeatureLe(String, f64),
    FeatureGt(String, f64),
}

impl When {
    pub fn matches(&self, task: &TaskInfo) -> bool {
        match self {
            When::Any => true,
            When::TaskType(t) => task.task_type.eq_ignore_ascii_case(t),
            When::FeatureLe(f, x) => task.feature(f).is_some_and(|v| v <= *x),
            When::FeatureGt(f, x) => task.feature(f).is_some_and(|v| v > *x),
        }
    }
}

impl std::fmt::Display for When {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            When::Any => f.write_str("any task"),
            When::TaskType(t) => write!(f, "task_type = {t}"),
            When::FeatureLe(n, x) => write!(f, "{n} <= {x}"),
            When::FeatureGt(n, x) => write!(f, "{n} > {x}"),
        }
    }
}

impl std::str::FromStr for When {
    type Err = String;
    /// Parses the forms [`When`]'s `Display` writes; anything else (e.g. an LLM's free
    /// text) is an error.
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s == "any task" {
            return Ok(When::Any);
        }
        if let Some(t) = s.strip_prefix("task_type = ") {
            return Ok(When::TaskType(t.trim().to_string()));
        }
        for (op, le) in [(" <= ", true), (" > ", false)] {
            if let Some((name, value)) = s.split_once(op) {
                let name = name.trim();
                if let (true, Ok(v)) = (name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'), value.trim().parse::<f64>()) {
                    return Ok(if le { When::FeatureLe(name.into(), v) } else { When::FeatureGt(name.into(), v) });
                }
            }
        }
        Err(format!("`{s}` is not a statistical condition"))
    }
}

/// Action patterns read from a trajectory's turns (Appendix D: behaviors relative to H0).
/// The first four are always tried; [`Behavior::observed`] adds the ones the paired
/// trajectories themselves show (the tools used, the hooks that fired, how episodes ended),
/// so profiles tell apart harnesses that differ in ways no fixed list foresaw.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Behavior {
    /// The first query looks at the schema or sample rows (`PRAGMA`, `DESCRIBE`, `SHOW`,
    /// `sqlite_master`, `information_schema`, `SELECT * ... LIMIT`).
    InspectsSchemaFirst,
    /// The episode ended with a committed answer (not a round or budget limit).
    CommitsWithinBudget,
    /// The same action (tool and arguments) was taken twice or more.
    RepeatsIdenticalAction,
    /// An answer was committed without any query.
    CommitsWithoutQuery,
    /// Calls this (non-commit) tool at least once.
    UsesTool(String),
    /// A harness hook with this id fired.
    HookFires(String),
    /// A tool result reported an error.
    HitsToolError,
    /// The episode ended this way (a termination other than a commit).
    EndsBy(String),
    /// At most this many model calls (the paired episodes' median).
    ModelCallsAtMost(u32),
}

impl Behavior {
    pub const ALL: [Behavior; 4] =
        [Self::InspectsSchemaFirst, Self::CommitsWithinBudget, Self::RepeatsIdenticalAction, Self::CommitsWithoutQuery];

    pub fn text(&self) -> String {
        match self {
            Self::InspectsSchemaFirst => "inspects the schema before the first query".into(),
            Self::CommitsWithinBudget => "commits a final answer within the budget".into(),
            Self::RepeatsIdenticalAction => "repeats an identical action".into(),
            Self::CommitsWithoutQuery => "commits an answer without running a query".into(),
            Self::UsesTool(t) => format!("calls `{t}`"),
            Self::HookFires(h) => format!("hook `{h}` fires"),
            Self::HitsToolError => "gets a tool error".into(),
            Self::EndsBy(t) => format!("ends by `{t}`"),
            Self::ModelCallsAtMost(n) => format!("uses at most {n} model calls"),
        }
    }

    /// Whether this behavior comes from the data rather than the fixed list.
    pub fn is_observed(&self) -> bool {
        !Self::ALL.contains(self)
    }

    /// The behaviors tried on `pairs`: the fixed four, then those the sibling's paired
    /// trajectories show — each tool called (commits are the fixed list's), each hook
    /// fired, tool errors, each non-commit ending, and at most the median model calls.
    pub fn observed(pairs: &[Pair<'_>]) -> Vec<Behavior> {
        let mut found = std::collections::BTreeSet::new();
        let mut calls: Vec<u32> = vec![];
        for p in pairs {
            let t = p.harness;
            for (tool, _) in actions(t) {
                if !is_commit(&tool) {
                    found.insert(Behavior::UsesTool(tool));
                }
            }
            for turn in &t.turns {
                if let Some(h) = &turn.hook_id {
                    found.insert(Behavior::HookFires(h.clone()));
                }
            }
            if Behavior::HitsToolError.shown_by(t) {
                found.insert(Behavior::HitsToolError);
            }
            if t.termination != schemas::Termination::Committed {
                found.insert(Behavior::EndsBy(t.termination.as_str().to_string()));
            }
            calls.push(t.model_calls);
        }
        calls.sort_unstable();
        if let Some(&m) = calls.get(calls.len().saturating_sub(1) / 2) {
            found.insert(Behavior::ModelCallsAtMost(m));
        }
        Self::ALL.into_iter().chain(found).collect()
    }

    /// Whether `traj` shows this behavior.
    pub fn shown_by(&self, traj: &Trajectory) -> bool {
        let actions = actions(traj);
        let is_query = |(tool, _): &(String, String)| !is_commit(tool);
        match self {
            Self::InspectsSchemaFirst => actions.iter().find(|a| is_query(a)).is_some_and(|(_, args)| is_schema_query(args)),
            Self::CommitsWithinBudget => traj.termination == schemas::Termination::Committed,
            Self::RepeatsIdenticalAction => {
                let mut seen = std::collections::HashSet::new();
                actions.iter().any(|a| !seen.insert(a))
            }
            Self::CommitsWithoutQuery => actions.iter().any(|(t, _)| is_commit(t)) && !actions.iter().any(is_query),
            Self::UsesTool(name) => actions.iter().any(|(t, _)| t == name),
            Self::HookFires(id) => traj.turns.iter().any(|t| t.hook_id.as_deref() == Some(id.as_str())),
            Self::HitsToolError => traj.turns.iter().any(|t| t.role == Role::Tool && t.text.to_ascii_lowercase().contains("error")),
            Self::EndsBy(how) => traj.termination.as_str() == how,
            Self::ModelCallsAtMost(n) => traj.model_calls <= *n,
        }
    }
}

fn is_commit(tool: &str) -> bool {
    tool.contains("commit") || tool.contains("final")
}

/// The actions of an episode as (tool, arguments JSON text), in order.
pub fn actions(traj: &Trajectory) -> Vec<(String, String)> {
    traj.turns
        .iter()
        .filter(|t| t.role == Role::Assistant)
        .filter_map(|t| t.tool_name.as_ref().map(|n| (n.clone(), t.tool_args.clone().unwrap_or_default())))
        .collect()
}

fn is_schema_query(args: &str) -> bool {
    let q = serde_json::from_str::<serde_json::Value>(args)
        .ok()
        .and_then(|v| v.get("query").and_then(|q| q.as_str()).map(str::to_string))
        .unwrap_or_else(|| args.to_string())
        .to_lowercase();
    let q = q.trim_start();
    ["pragma", "describe", "desc ", "show ", "explain"].iter().any(|p| q.starts_with(p))
        || q.contains("sqlite_master")
        || q.contains("information_schema")
        || (q.starts_with("select *") && q.contains(" limit "))
}

/// One paired execution: H_i and H0 on the same task and seed (Eq. 11).
#[derive(Debug, Clone, Copy)]
pub struct Pair<'a> {
    pub task: &'a TaskInfo,
    pub harness: &'a Trajectory,
    pub base: &'a Trajectory,
}

impl Pair<'_> {
    /// Paired success difference: 1, 0 or −1.
    pub fn delta(&self) -> f64 {
        f64::from(u8::from(self.harness.success)) - f64::from(u8::from(self.base.success))
    }
}

/// Whether a row's outcome says something about the policy under its harness. Infra
/// failures (a dead database, an unreachable server) do not, and their pairs are dropped
/// (Appendix E excludes tasks with an invalid paired outcome).
fn informative(t: &Trajectory) -> bool {
    t.error_class != Some(ErrorClass::Infra)
}

/// Pairs H_i rows with H0 rows of the same task and seed; rows without a partner, rows of
/// unknown tasks and pairs with an infra failure on either side are left out.
pub fn pair_up<'a>(tasks: &'a [TaskInfo], harness_rows: &'a [Trajectory], base_rows: &'a [Trajectory]) -> Vec<Pair<'a>> {
    let by_id: HashMap<&str, &TaskInfo> = tasks.iter().map(|t| (t.task_id.as_str(), t)).collect();
    let base: HashMap<(&str, u64), &Trajectory> = base_rows.iter().map(|r| ((r.task_id.as_str(), r.seed), r)).collect();
    harness_rows
        .iter()
        .filter_map(|h| {
            let b = base.get(&(h.task_id.as_str(), h.seed))?;
            let task = by_id.get(h.task_id.as_str())?;
            (informative(h) && informative(b)).then_some(Pair { task, harness: h, base: b })
        })
        .collect()
}

/// Successes and episodes of one harness on one task.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Outcome {
    pub successes: u32,
    pub episodes: u32,
}

impl Outcome {
    pub fn rate(&self) -> f64 {
        if self.episodes == 0 {
            0.0
        } else {
            f64::from(self.successes) / f64::from(self.episodes)
        }
    }
}

/// Validation statistics of one harness at one calibration.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct HarnessStats {
    pub harness_id: String,
    pub successes: u32,
    pub episodes: u32,
    /// Episodes whose outcome was not counted (infra failures).
    pub excluded: u32,
    pub by_task: BTreeMap<String, Outcome>,
}

impl HarnessStats {
    pub fn success_rate(&self) -> f64 {
        Outcome { successes: self.successes, episodes: self.episodes }.rate()
    }
}

/// Per-harness validation success, overall and per task, from calibration rows.
pub fn validation_stats(rows: &[Trajectory]) -> BTreeMap<String, HarnessStats> {
    let mut out: BTreeMap<String, HarnessStats> = BTreeMap::new();
    for r in rows {
        let s = out.entry(r.harness_id.clone()).or_insert_with(|| HarnessStats { harness_id: r.harness_id.clone(), ..Default::default() });
        if !informative(r) {
            s.excluded += 1;
            continue;
        }
        let ok = u32::from(r.success);
        s.successes += ok;
        s.episodes += 1;
        let t = s.by_task.entry(r.task_id.clone()).or_default();
        t.successes += ok;
        t.episodes += 1;
    }
    out
}

/// A short description of a harness for prompts: its direction, else its edits.
pub fn describe_harness(spec: &HarnessSpec) -> String {
    if spec.id == schemas::H0_ID {
        return "the base harness H0 (no edits)".into();
    }
    let mut parts = Vec::new();
    if let Some(d) = &spec.direction {
        parts.push(clip(d, 160));
    }
    for r in &spec.prompt_rules {
        parts.push(format!("rule[{}]: {}", r.slot, clip(&r.text, 100)));
    }
    for s in &spec.skills {
        parts.push(format!("skill {}: {}", s.name, clip(&s.text, 80)));
    }
    for h in &spec.hooks {
        let cond = match &h.condition {
            schemas::Condition::Named(n) => n.clone(),
            schemas::Condition::Expr(_) => "expression".into(),
        };
        parts.push(format!("hook {}/{cond} -> {}: {}", h.event.as_str(), h.action.as_str(), clip(&h.message, 100)));
    }
    if spec.tool_view.is_some() {
        parts.push("changes the tool view".into());
    }
    if !spec.context.is_empty() || !spec.memory.is_empty() {
        parts.push("adds context or memory".into());
    }
    if parts.is_empty() {
        return "no edits".into();
    }
    clip(&parts.join("; "), 360)
}

/// `text` cut to at most `max` characters, with `…` when cut.
pub fn clip(text: &str, max: usize) -> String {
    let text = text.trim();
    if text.chars().count() <= max {
        return text.to_string();
    }
    let mut s: String = text.chars().take(max.saturating_sub(1)).collect();
    s.push('…');
    s
}

#[cfg(test)]
pub(crate) mod testing {
    //! Trajectory builders shared by the profile and router tests.
    use super::*;
    use schemas::{RolloutKind, Split, Termination, Turn, TurnSource};

    pub fn traj(harness: &str, task: &str, seed: u64, success: bool, queries: &[&str], commit: bool) -> Trajectory {
        let mut turns = vec![];
        let mut push = |role: Role, tool: Option<(&str, String)>| {
            turns.push(Turn {
                index: turns.len() as u32,
                role,
                source: TurnSource::Policy,
                text: String::new(),
                token_ids: vec![],
                logprobs: vec![],
                loss_mask: vec![],
                tool_name: tool.as_ref().map(|t| t.0.to_string()),
                tool_args: tool.map(|t| t.1),
                hook_id: None,
                prompt_token_count: 0,
                prompt_hash: None,
            })
        };
        for q in queries {
            push(Role::Assistant, Some(("execute_sql", serde_json::json!({"query": q}).to_string())));
            push(Role::Tool, None);
        }
        if commit {
            push(Role::Assistant, Some(("commit_final_answer", r#"{"answers":["2"]}"#.to_string())));
        }
        Trajectory {
            trajectory_id: format!("{harness}-{task}-{seed}"),
            run_id: "r".into(),
            job_id: "j".into(),
            step: 0,
            kind: RolloutKind::Calibration,
            split: Split::Validation,
            task_id: task.into(),
            task_type: "counting".into(),
            group_id: "g".into(),
            attempt: 0,
            harness_id: harness.into(),
            harness_version: "v".into(),
            policy_checkpoint: "ckpt".into(),
            seed,
            reward: f64::from(u8::from(success)),
            success,
            termination: if commit { Termination::Committed } else { Termination::RoundLimit },
            error_class: None,
            error_message: None,
            prompt_tokens: 0,
            completion_tokens: 0,
            harness_tokens: 0,
            model_calls: 0,
            env_actions: 0,
            started_at_ms: 0,
            duration_ms: 0,
            policy_ms: 0,
            env_ms: 0,
            temperature: 1.0,
            tool_view: String::new(),
            turns,
        }
    }

    pub fn task(id: &str, ty: &str, rows: u64, d: &str) -> TaskInfo {
        let mut t = TaskInfo::new(id, ty, d);
        t.features.insert("rows".into(), rows.into());
        t
    }
}

#[cfg(test)]
mod tests {
    use super::testing::*;
    use super::*;

    #[test]
    fn conditions_print_and_parse_back() {
        for w in [When::Any, When::TaskType("counting".into()), When::FeatureLe("rows".into(), 23.0), When::FeatureGt("rows".into(), 7.5)] {
            assert_eq!(w.to_string().parse::<When>().unwrap(), w);
        }
        assert!("when the table is huge".parse::<When>().is_err());
        let t = task("t", "Counting", 30, "d");
        assert!(When::TaskType("counting".into()).matches(&t));
        assert!(When::FeatureGt("rows".into(), 23.0).matches(&t));
        assert!(!When::FeatureLe("rows".into(), 23.0).matches(&t));
        assert!(!When::FeatureLe("columns".into(), 23.0).matches(&t), "a missing feature never matches");
    }

    #[test]
    fn behaviors_are_read_from_actions() {
        let inspect = traj("h1", "t", 1, true, &["PRAGMA table_info(t)", "SELECT count(*) FROM t"], true);
        assert!(Behavior::InspectsSchemaFirst.shown_by(&inspect));
        assert!(Behavior::CommitsWithinBudget.shown_by(&inspect));
        assert!(!Behavior::RepeatsIdenticalAction.shown_by(&inspect));
        let sample = traj("h1", "t", 1, true, &["select * from t limit 3"], true);
        assert!(Behavior::InspectsSchemaFirst.shown_by(&sample));
        let repeat = traj("h0", "t", 1, false, &["SELECT a FROM t", "SELECT a FROM t"], false);
        assert!(Behavior::RepeatsIdenticalAction.shown_by(&repeat));
        assert!(!Behavior::InspectsSchemaFirst.shown_by(&repeat));
        assert!(!Behavior::CommitsWithinBudget.shown_by(&repeat));
        let blind = traj("h0", "t", 1, false, &[], true);
        assert!(Behavior::CommitsWithoutQuery.shown_by(&blind));
        assert!(!Behavior::CommitsWithoutQuery.shown_by(&inspect));
    }

    #[test]
    fn pairs_match_task_and_seed_and_skip_infra_failures() {
        let tasks = vec![task("a", "counting", 5, "x"), task("b", "counting", 5, "y")];
        let h = vec![traj("h1", "a", 1, true, &[], true), traj("h1", "a", 2, true, &[], true), traj("h1", "b", 1, false, &[], true)];
        let mut broken = traj("h0", "b", 1, false, &[], false);
        broken.error_class = Some(ErrorClass::Infra);
        let b = vec![traj("h0", "a", 1, false, &[], false), broken, traj("h0", "zzz", 1, false, &[], false)];
        let pairs = pair_up(&tasks, &h, &b);
        assert_eq!(pairs.len(), 1, "a/2 has no partner; b/1 has an infra failure");
        assert_eq!((pairs[0].task.task_id.as_str(), pairs[0].delta()), ("a", 1.0));
        let stats = validation_stats(&b);
        assert_eq!((stats["h0"].episodes, stats["h0"].excluded, stats["h0"].successes), (2, 1, 0));
        let stats = validation_stats(&h);
        assert_eq!(stats["h1"].by_task["a"], Outcome { successes: 2, episodes: 2 });
        assert!((stats["h1"].success_rate() - 2.0 / 3.0).abs() < 1e-12);
    }

    #[test]
    fn harness_descriptions_are_short() {
        let mut s = HarnessSpec::h0();
        assert!(describe_harness(&s).contains("H0"));
        s.id = "s1".into();
        s.prompt_rules.push(schemas::PromptRule { slot: "action_guidance".into(), text: "x".repeat(1000) });
        let d = describe_harness(&s);
        assert!(d.starts_with("rule[action_guidance]:") && d.chars().count() <= 360, "{d}");
    }
}
