//! Hook conditions: the vocabulary a spec may use (named predicates, state paths) and their
//! evaluation. Conditions are data: a named predicate or a small expression tree
//! (all / any / not / eq / ne / lt / lte / gt / gte / contains) over read-only paths.
//! Evaluation is a pure function of the episode snapshot; nothing from a spec is executed.
//! A hook may also declare *extractions* (`parameters.extract`): named regular expressions
//! over a string path whose first capture group fills `{{extract.<name>}}` placeholders.
//! A hook fires only when all its extractions match. Patterns are data too: the `regex`
//! crate matches in linear time, and validation bounds their size.
//!
//! The same tables drive validation ([`super::validate`]), so a path or predicate the
//! runtime cannot evaluate is rejected before an episode starts.

use std::collections::BTreeMap;

use serde_json::{Map, Value};

use crate::env::{Observation, ToolCall};
use schemas::{Condition, Expr, HookEvent};

/// The type a path resolves to, used to check literals at validation time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueType {
    Number,
    Bool,
    String,
    /// Decided by the environment or the policy (`action.args.*`, `state.features.*`).
    Any,
}

impl ValueType {
    pub fn name(self) -> &'static str {
        match self {
            ValueType::Number => "number",
            ValueType::Bool => "boolean",
            ValueType::String => "string",
            ValueType::Any => "any",
        }
    }
}

/// `state.<field>` paths: counters and flags the runtime maintains for every episode.
pub const STATE_FIELDS: &[(&str, ValueType, &str)] = &[
    (
        "remaining_steps",
        ValueType::Number,
        "steps left: the smallest of the environment's rounds, the action budget and the model-call budget still unused",
    ),
    ("model_calls", ValueType::Number, "policy calls made so far"),
    ("remaining_model_calls", ValueType::Number, "policy calls left in the budget"),
    ("env_actions", ValueType::Number, "environment actions taken so far"),
    ("remaining_env_actions", ValueType::Number, "environment actions left (round limit and budget)"),
    ("max_rounds", ValueType::Number, "the environment's round limit"),
    ("last_action_failed", ValueType::Bool, "the latest environment action failed"),
    ("consecutive_failures", ValueType::Number, "failed environment actions in a row"),
    ("answer_committed", ValueType::Bool, "a final answer has been committed"),
    ("text_only_turns", ValueType::Number, "policy replies in a row without a tool call"),
    ("repeated_actions", ValueType::Number, "how many times in a row the latest action occurred (1 = not repeated)"),
    ("context_tokens", ValueType::Number, "estimated tokens of the current context"),
    ("hints_injected", ValueType::Number, "harness texts injected so far"),
    ("task_type", ValueType::String, "the task category, e.g. `counting`"),
    ("last_tool", ValueType::String, "tool of the latest action (empty before the first)"),
    ("last_reply", ValueType::String, "text of the policy's latest reply (empty before the first)"),
];

/// `observation.<field>` paths: the latest observation (the task itself at episode start).
pub const OBSERVATION_FIELDS: &[(&str, ValueType)] =
    &[("text", ValueType::String), ("truncated", ValueType::Bool), ("action_failed", ValueType::Bool), ("done", ValueType::Bool)];

/// A named predicate: its name, the hook parameters it reads (required?), where it may run.
pub struct Predicate {
    pub name: &'static str,
    pub params: &'static [(&'static str, bool)],
    pub events: &'static [HookEvent],
    pub doc: &'static str,
}

const ALL_EVENTS: &[HookEvent] = &[HookEvent::EpisodeStart, HookEvent::BeforeDecision, HookEvent::BeforeAction, HookEvent::AfterTool];

/// Named predicates (Harness-S Appendix D, Table 7 uses the first two).
pub const PREDICATES: &[Predicate] = &[
    Predicate {
        name: "pagination_present",
        params: &[],
        events: &[HookEvent::BeforeDecision, HookEvent::BeforeAction, HookEvent::AfterTool],
        doc: "the latest observation was cut or carries pagination metadata",
    },
    Predicate {
        name: "remaining_steps_lte",
        params: &[("threshold", true)],
        events: ALL_EVENTS,
        doc: "state.remaining_steps <= parameters.threshold",
    },
    Predicate {
        name: "last_action_failed",
        params: &[],
        events: &[HookEvent::BeforeDecision, HookEvent::BeforeAction, HookEvent::AfterTool],
        doc: "the latest environment action failed",
    },
    Predicate {
        name: "repeated_action",
        params: &[("times", false)],
        events: &[HookEvent::BeforeDecision, HookEvent::BeforeAction, HookEvent::AfterTool],
        doc: "the current (or latest) action equals the previous ones, `times` in a row (default 2)",
    },
    Predicate { name: "no_answer_committed", params: &[], events: ALL_EVENTS, doc: "no final answer has been committed yet" },
    Predicate {
        name: "text_only_reply",
        params: &[],
        events: &[HookEvent::BeforeDecision],
        doc: "the policy's latest reply called no tool",
    },
    Predicate { name: "always", params: &[], events: ALL_EVENTS, doc: "always true" },
];

pub fn predicate(name: &str) -> Option<&'static Predicate> {
    PREDICATES.iter().find(|p| p.name == name)
}

/// Events where an `action.*` path is defined: there is a pending or just-executed action.
pub fn has_action(event: HookEvent) -> bool {
    matches!(event, HookEvent::BeforeAction | HookEvent::AfterTool)
}

/// Checks a path for use at `event`; returns its type, or why it is not allowed.
pub fn check_path(path: &str, event: HookEvent) -> Result<ValueType, String> {
    let (root, rest) = path.split_once('.').unwrap_or((path, ""));
    match root {
        "state" => {
            if let Some(feature) = rest.strip_prefix("features.") {
                if feature.is_empty() {
                    return Err("`state.features.` needs a feature name".into());
                }
                return Ok(ValueType::Any);
            }
            STATE_FIELDS.iter().find(|(name, _, _)| *name == rest).map(|(_, t, _)| *t).ok_or_else(|| {
                let names: Vec<String> = STATE_FIELDS.iter().map(|(n, _, _)| format!("state.{n}")).collect();
                format!("unknown path `{path}`; state paths are {}, state.features.<name>", names.join(", "))
            })
        }
        "action" => {
            if !has_action(event) {
                return Err(format!(
                    "`{path}` is not available at {}: there is no action yet (use it at before_action or after_tool)",
                    event_name(event)
                ));
            }
            if rest == "tool" {
                Ok(ValueType::String)
            } else if let Some(arg) = rest.strip_prefix("args.") {
                if arg.is_empty() || arg.split('.').any(str::is_empty) {
                    Err(format!("`{path}` names no argument; write action.args.<name>"))
                } else {
                    Ok(ValueType::Any)
                }
            } else {
                Err(format!("unknown path `{path}`; action paths are action.tool, action.args.<name>"))
            }
        }
        "observation" => OBSERVATION_FIELDS.iter().find(|(n, _)| *n == rest).map(|(_, t)| *t).ok_or_else(|| {
            format!(
                "unknown path `{path}`; observation paths are observation.text, observation.truncated, \
                 observation.action_failed, observation.done"
            )
        }),
        "extract" => {
            if rest.is_empty() || rest.contains('.') {
                Err(format!("`{path}` names no extraction; write extract.<name> for a name under parameters.extract"))
            } else {
                Ok(ValueType::String)
            }
        }
        _ => Err(format!("unknown path `{path}`; paths start with `state.`, `action.`, `observation.` or `extract.`")),
    }
}

/// Longest extraction pattern a spec may carry.
pub const MAX_PATTERN_BYTES: usize = 512;
/// Compiled-size limit of one extraction pattern (the regex crate's `size_limit`).
const PATTERN_SIZE_LIMIT: usize = 1024 * 1024;

/// One named extraction of a hook: `pattern` applied to the string at `from`.
#[derive(Debug, Clone)]
pub struct Extraction {
    pub name: String,
    pub from: String,
    pub pattern: regex::Regex,
}

/// Parses a hook's `parameters.extract` (`{"<name>": {"from": "<path>", "pattern": "<regex>"}}`;
/// `None`: no extractions). Errors name the extraction and what is wrong; paths are
/// checked by the caller.
pub fn parse_extractions(spec: Option<&Value>) -> Result<Vec<Extraction>, Vec<(String, String)>> {
    let Some(spec) = spec else { return Ok(vec![]) };
    let Value::Object(map) = spec else {
        return Err(vec![(
            String::new(),
            "expected an object of named extractions: {\"<name>\": {\"from\": \"<path>\", \"pattern\": \"<regex>\"}}".into(),
        )]);
    };
    let mut out = Vec::new();
    let mut problems = Vec::new();
    for (name, item) in map {
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            problems.push((name.clone(), "extraction names use letters, digits and `_`".into()));
            continue;
        }
        let from = item.get("from").and_then(Value::as_str);
        let pattern = item.get("pattern").and_then(Value::as_str);
        let unknown: Vec<&String> =
            item.as_object().map(|m| m.keys().filter(|k| *k != "from" && *k != "pattern").collect()).unwrap_or_default();
        if !unknown.is_empty() {
            problems.push((name.clone(), format!("unknown key `{}`; an extraction has `from` and `pattern`", unknown[0])));
            continue;
        }
        let (Some(from), Some(pattern)) = (from, pattern) else {
            problems.push((name.clone(), "needs `from` (a path) and `pattern` (a regular expression), both strings".into()));
            continue;
        };
        if pattern.len() > MAX_PATTERN_BYTES {
            problems.push((name.clone(), format!("pattern exceeds {MAX_PATTERN_BYTES} bytes")));
            continue;
        }
        match regex::RegexBuilder::new(pattern).size_limit(PATTERN_SIZE_LIMIT).build() {
            Ok(re) => out.push(Extraction { name: name.clone(), from: from.to_string(), pattern: re }),
            Err(e) => {
                problems.push((name.clone(), format!("pattern does not compile: {}", e.to_string().lines().last().unwrap_or("invalid"))))
            }
        }
    }
    if problems.is_empty() {
        Ok(out)
    } else {
        Err(problems)
    }
}

/// Runs a hook's extractions: each yields its first capture group (or the whole match),
/// trimmed. `None` when one does not match or matches only whitespace: the hook does not
/// fire. Strings are searched as they are; other values as their JSON text.
pub fn run_extractions(extractions: &[Extraction], s: &Scope<'_>) -> Option<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for e in extractions {
        let text = match s.resolve(&e.from) {
            Value::String(t) => t,
            Value::Null => return None,
            other => other.to_string(),
        };
        let caps = e.pattern.captures(&text)?;
        let m = caps.get(1).or_else(|| caps.get(0))?;
        let value = m.as_str().trim();
        if value.is_empty() {
            return None;
        }
        out.insert(e.name.clone(), value.to_string());
    }
    Some(out)
}

pub fn event_name(event: HookEvent) -> &'static str {
    match event {
        HookEvent::EpisodeStart => "episode_start",
        HookEvent::BeforeDecision => "before_decision",
        HookEvent::BeforeAction => "before_action",
        HookEvent::AfterTool => "after_tool",
    }
}

/// A read-only view of the episode state, maintained by the runtime.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StateView {
    pub remaining_steps: u32,
    pub model_calls: u32,
    pub remaining_model_calls: u32,
    pub env_actions: u32,
    pub remaining_env_actions: u32,
    pub max_rounds: u32,
    pub last_action_failed: bool,
    pub consecutive_failures: u32,
    pub answer_committed: bool,
    pub text_only_turns: u32,
    pub repeated_actions: u32,
    pub context_tokens: u64,
    pub hints_injected: u32,
    pub task_type: String,
    pub last_tool: String,
    pub last_reply: String,
    pub features: Map<String, Value>,
}

impl StateView {
    fn field(&self, name: &str) -> Value {
        match name {
            "remaining_steps" => self.remaining_steps.into(),
            "model_calls" => self.model_calls.into(),
            "remaining_model_calls" => self.remaining_model_calls.into(),
            "env_actions" => self.env_actions.into(),
            "remaining_env_actions" => self.remaining_env_actions.into(),
            "max_rounds" => self.max_rounds.into(),
            "last_action_failed" => self.last_action_failed.into(),
            "consecutive_failures" => self.consecutive_failures.into(),
            "answer_committed" => self.answer_committed.into(),
            "text_only_turns" => self.text_only_turns.into(),
            "repeated_actions" => self.repeated_actions.into(),
            "context_tokens" => self.context_tokens.into(),
            "hints_injected" => self.hints_injected.into(),
            "task_type" => self.task_type.clone().into(),
            "last_tool" => self.last_tool.clone().into(),
            "last_reply" => self.last_reply.clone().into(),
            _ => Value::Null,
        }
    }
}

/// Everything a condition may look at when one hook runs.
#[derive(Debug, Clone, Copy)]
pub struct Scope<'a> {
    pub event: HookEvent,
    pub state: &'a StateView,
    /// The pending action (before_action) or the executed one (after_tool).
    pub action: Option<&'a ToolCall>,
    /// The latest observation.
    pub observation: Option<&'a Observation>,
    /// Recent executed actions, oldest first (for `repeated_action`).
    pub history: &'a [ToolCall],
    /// The policy's latest reply called no tool.
    pub text_only_reply: bool,
    /// The hook's parameters.
    pub params: &'a BTreeMap<String, Value>,
    /// Values of the hook's extractions (`extract.<name>`).
    pub extracted: &'a BTreeMap<String, String>,
}

impl Scope<'_> {
    /// Resolves a path; anything absent at run time is `null`.
    pub fn resolve(&self, path: &str) -> Value {
        let (root, rest) = path.split_once('.').unwrap_or((path, ""));
        match root {
            "state" => match rest.strip_prefix("features.") {
                Some(feature) => lookup(&Value::Object(self.state.features.clone()), feature),
                None => self.state.field(rest),
            },
            "action" => match (self.action, rest) {
                (Some(a), "tool") => a.name.clone().into(),
                (Some(a), r) => r.strip_prefix("args.").map(|arg| lookup(&a.args, arg)).unwrap_or(Value::Null),
                (None, _) => Value::Null,
            },
            "observation" => match self.observation {
                Some(o) => match rest {
                    "text" => o.text.clone().into(),
                    "truncated" => o.truncated.into(),
                    "action_failed" => o.action_failed.into(),
                    "done" => o.done.into(),
                    _ => Value::Null,
                },
                None => Value::Null,
            },
            "extract" => self.extracted.get(rest).map(|v| Value::String(v.clone())).unwrap_or(Value::Null),
            _ => Value::Null,
        }
    }

    fn param_u64(&self, name: &str, default: u64) -> u64 {
        self.params.get(name).and_then(Value::as_u64).unwrap_or(default)
    }
}

/// Follows a dotted path inside a JSON value.
fn lookup(v: &Value, dotted: &str) -> Value {
    let mut cur = v;
    for seg in dotted.split('.') {
        match cur.get(seg) {
            Some(next) => cur = next,
            None => return Value::Null,
        }
    }
    cur.clone()
}

/// Markers of paginated or cut results (checked case-insensitively).
const PAGINATION_MARKERS: &[&str] =
    &["next_page", "next page", "page_token", "has_more", "more rows", "page_index", "\"page\":", "truncated"];

/// Evaluates a named predicate (unknown names are false; validation rejects them).
pub fn eval_predicate(name: &str, s: &Scope<'_>) -> bool {
    match name {
        "always" => true,
        "pagination_present" => s.observation.is_some_and(|o| {
            let lower = o.text.to_lowercase();
            o.truncated || PAGINATION_MARKERS.iter().any(|m| lower.contains(m))
        }),
        "remaining_steps_lte" => u64::from(s.state.remaining_steps) <= s.param_u64("threshold", 0),
        "last_action_failed" => s.state.last_action_failed,
        "no_answer_committed" => !s.state.answer_committed,
        "text_only_reply" => s.text_only_reply,
        "repeated_action" => {
            let times = s.param_u64("times", 2).max(2) as usize;
            // At before_action the pending action joins the history; elsewhere the latest
            // executed action is the current one.
            let mut seq: Vec<&ToolCall> = s.history.iter().collect();
            if s.event == HookEvent::BeforeAction {
                if let Some(a) = s.action {
                    seq.push(a);
                }
            }
            seq.len() >= times && seq[seq.len() - times..].windows(2).all(|w| w[0] == w[1])
        }
        _ => false,
    }
}

/// Evaluates a condition.
pub fn eval(cond: &Condition, s: &Scope<'_>) -> bool {
    match cond {
        Condition::Named(name) => eval_predicate(name, s),
        Condition::Expr(e) => eval_expr(e, s),
    }
}

fn eval_expr(e: &Expr, s: &Scope<'_>) -> bool {
    match e {
        Expr::All(cs) => cs.iter().all(|c| eval(c, s)),
        Expr::Any(cs) => cs.iter().any(|c| eval(c, s)),
        Expr::Not(c) => !eval(c, s),
        Expr::Eq(p, lit) => json_eq(&s.resolve(p), lit),
        Expr::Ne(p, lit) => !json_eq(&s.resolve(p), lit),
        Expr::Lt(p, lit) => compare(&s.resolve(p), lit).is_some_and(|o| o.is_lt()),
        Expr::Lte(p, lit) => compare(&s.resolve(p), lit).is_some_and(|o| o.is_le()),
        Expr::Gt(p, lit) => compare(&s.resolve(p), lit).is_some_and(|o| o.is_gt()),
        Expr::Gte(p, lit) => compare(&s.resolve(p), lit).is_some_and(|o| o.is_ge()),
        Expr::Contains(p, lit) => contains(&s.resolve(p), lit),
    }
}

/// Equality with numbers compared by value (`2` equals `2.0`).
fn json_eq(a: &Value, b: &Value) -> bool {
    match (a.as_f64(), b.as_f64()) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    }
}

/// Orders two numbers, or two strings; anything else is incomparable (the comparison is false).
fn compare(a: &Value, b: &Value) -> Option<std::cmp::Ordering> {
    match (a, b) {
        (Value::Number(_), Value::Number(_)) => a.as_f64()?.partial_cmp(&b.as_f64()?),
        (Value::String(x), Value::String(y)) => Some(x.cmp(y)),
        _ => None,
    }
}

/// Case-insensitive substring for strings (SQL keywords come in any case); membership for
/// arrays.
fn contains(hay: &Value, needle: &Value) -> bool {
    match hay {
        Value::String(h) => {
            let n = match needle {
                Value::String(n) => n.clone(),
                Value::Number(n) => n.to_string(),
                _ => return false,
            };
            h.to_lowercase().contains(&n.to_lowercase())
        }
        Value::Array(items) => items.iter().any(|i| json_eq(i, needle)),
        _ => false,
    }
}

/// Fills `{{path}}` placeholders in the string values of a rewrite/force argument
/// template. A string that is exactly one placeholder takes the path's JSON value (so a
/// number stays a number); otherwise values are spliced in as text. Pure substitution:
/// nothing is evaluated.
pub fn render_template(template: &Value, s: &Scope<'_>) -> Value {
    match template {
        Value::String(text) => {
            let trimmed = text.trim();
            if let Some(inner) = trimmed.strip_prefix("{{").and_then(|t| t.strip_suffix("}}")) {
                if !inner.contains("{{") {
                    return s.resolve(inner.trim());
                }
            }
            let mut out = String::new();
            let mut rest = text.as_str();
            while let Some(start) = rest.find("{{") {
                out.push_str(&rest[..start]);
                match rest[start + 2..].find("}}") {
                    Some(end) => {
                        let path = rest[start + 2..start + 2 + end].trim();
                        match s.resolve(path) {
                            Value::String(v) => out.push_str(&v),
                            Value::Null => {}
                            other => out.push_str(&other.to_string()),
                        }
                        rest = &rest[start + 2 + end + 2..];
                    }
                    None => {
                        out.push_str(&rest[start..]);
                        rest = "";
                    }
                }
            }
            out.push_str(rest);
            Value::String(out)
        }
        Value::Array(items) => Value::Array(items.iter().map(|i| render_template(i, s)).collect()),
        Value::Object(map) => Value::Object(map.iter().map(|(k, v)| (k.clone(), render_template(v, s))).collect()),
        other => other.clone(),
    }
}

/// The `{{path}}` placeholders in a template, for validation.
pub fn template_paths(template: &Value) -> Vec<String> {
    let mut out = Vec::new();
    collect_paths(template, &mut out);
    out
}

fn collect_paths(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::String(text) => {
            let mut rest = text.as_str();
            while let Some(start) = rest.find("{{") {
                match rest[start + 2..].find("}}") {
                    Some(end) => {
                        out.push(rest[start + 2..start + 2 + end].trim().to_string());
                        rest = &rest[start + 2 + end + 2..];
                    }
                    None => break,
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|i| collect_paths(i, out)),
        Value::Object(map) => map.values().for_each(|i| collect_paths(i, out)),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn call(tool: &str, args: Value) -> ToolCall {
        ToolCall { name: tool.into(), args }
    }

    struct Fixture {
        state: StateView,
        action: Option<ToolCall>,
        observation: Option<Observation>,
        history: Vec<ToolCall>,
        text_only: bool,
        params: BTreeMap<String, Value>,
        extracted: BTreeMap<String, String>,
        event: HookEvent,
    }

    impl Fixture {
        fn new() -> Self {
            Fixture {
                state: StateView { remaining_steps: 5, task_type: "counting".into(), ..Default::default() },
                action: Some(call("execute_sql", json!({"query": "SELECT count(*) FROM t"}))),
                observation: Some(Observation { text: "[(2,)]".into(), ..Default::default() }),
                history: vec![],
                text_only: false,
                params: BTreeMap::new(),
                extracted: BTreeMap::new(),
                event: HookEvent::BeforeAction,
            }
        }
        fn scope(&self) -> Scope<'_> {
            Scope {
                event: self.event,
                state: &self.state,
                action: self.action.as_ref(),
                observation: self.observation.as_ref(),
                history: &self.history,
                text_only_reply: self.text_only,
                params: &self.params,
                extracted: &self.extracted,
            }
        }
        fn holds(&self, cond: Value) -> bool {
            let c: Condition = serde_json::from_value(cond).expect("condition parses");
            eval(&c, &self.scope())
        }
    }

    #[test]
    fn pagination_present_sees_truncation_and_markers() {
        let mut f = Fixture::new();
        f.event = HookEvent::AfterTool;
        assert!(!f.holds(json!("pagination_present")));
        f.observation.as_mut().unwrap().truncated = true;
        assert!(f.holds(json!("pagination_present")));
        f.observation = Some(Observation { text: r#"{"items": [1], "next_page": 2}"#.into(), ..Default::default() });
        assert!(f.holds(json!("pagination_present")));
        f.observation = None;
        assert!(!f.holds(json!("pagination_present")));
    }

    #[test]
    fn remaining_steps_lte_uses_the_threshold_parameter() {
        let mut f = Fixture::new();
        f.params.insert("threshold".into(), json!(3));
        assert!(!f.holds(json!("remaining_steps_lte")));
        f.state.remaining_steps = 3;
        assert!(f.holds(json!("remaining_steps_lte")));
        f.state.remaining_steps = 0;
        assert!(f.holds(json!("remaining_steps_lte")));
    }

    #[test]
    fn last_action_failed_and_no_answer_committed_follow_the_state() {
        let mut f = Fixture::new();
        assert!(!f.holds(json!("last_action_failed")));
        f.state.last_action_failed = true;
        assert!(f.holds(json!("last_action_failed")));
        assert!(f.holds(json!("no_answer_committed")));
        f.state.answer_committed = true;
        assert!(!f.holds(json!("no_answer_committed")));
    }

    #[test]
    fn repeated_action_counts_the_pending_action_at_before_action() {
        let mut f = Fixture::new();
        let pending = f.action.clone().unwrap();
        assert!(!f.holds(json!("repeated_action")));
        f.history = vec![pending.clone()];
        assert!(f.holds(json!("repeated_action")));
        f.params.insert("times".into(), json!(3));
        assert!(!f.holds(json!("repeated_action")));
        f.history = vec![pending.clone(), pending.clone()];
        assert!(f.holds(json!("repeated_action")));
        // Different arguments break the run.
        f.history = vec![pending.clone(), call("execute_sql", json!({"query": "SELECT 1"}))];
        assert!(!f.holds(json!("repeated_action")));
        // After the tool ran, the history already holds the current action.
        f.event = HookEvent::AfterTool;
        f.params.clear();
        f.history = vec![pending.clone(), pending];
        assert!(f.holds(json!("repeated_action")));
    }

    #[test]
    fn text_only_reply_and_always() {
        let mut f = Fixture::new();
        assert!(f.holds(json!("always")));
        assert!(!f.holds(json!("text_only_reply")));
        f.text_only = true;
        assert!(f.holds(json!("text_only_reply")));
        assert!(!f.holds(json!("no_such_predicate")));
    }

    #[test]
    fn comparison_operators() {
        let f = Fixture::new(); // remaining_steps = 5
        for (op, lit, want) in [
            ("eq", 5, true),
            ("eq", 4, false),
            ("ne", 4, true),
            ("ne", 5, false),
            ("lt", 6, true),
            ("lt", 5, false),
            ("lte", 5, true),
            ("lte", 4, false),
            ("gt", 4, true),
            ("gt", 5, false),
            ("gte", 5, true),
            ("gte", 6, false),
        ] {
            assert_eq!(f.holds(json!({ op: ["state.remaining_steps", lit] })), want, "{op} {lit}");
        }
        // Numbers compare by value; strings by equality; mismatched types never order.
        assert!(f.holds(json!({"eq": ["state.remaining_steps", 5.0]})));
        assert!(f.holds(json!({"eq": ["state.task_type", "counting"]})));
        assert!(!f.holds(json!({"lt": ["state.task_type", 3]})));
    }

    #[test]
    fn contains_is_case_insensitive_and_checks_arrays() {
        let mut f = Fixture::new();
        assert!(f.holds(json!({"contains": ["action.args.query", "COUNT(*)"]})));
        assert!(!f.holds(json!({"contains": ["action.args.query", "LIMIT"]})));
        assert!(f.holds(json!({"contains": ["observation.text", "2,"]})));
        f.action = Some(call("commit_final_answer", json!({"answers": ["2", "3"]})));
        assert!(f.holds(json!({"contains": ["action.args.answers", "3"]})));
        assert!(!f.holds(json!({"contains": ["action.args.answers", "4"]})));
        // A missing argument is null, which contains nothing.
        assert!(!f.holds(json!({"contains": ["action.args.query", "x"]})));
    }

    #[test]
    fn boolean_combinators() {
        let f = Fixture::new();
        let yes = json!({"eq": ["action.tool", "execute_sql"]});
        let no = json!({"eq": ["action.tool", "commit_final_answer"]});
        assert!(f.holds(json!({"all": [yes, "always"]})));
        assert!(!f.holds(json!({"all": [yes, no]})));
        assert!(f.holds(json!({"any": [no, yes]})));
        assert!(!f.holds(json!({"any": [no, no]})));
        assert!(f.holds(json!({"not": no})));
        assert!(!f.holds(json!({"not": yes})));
    }

    #[test]
    fn paths_are_checked_against_the_event() {
        assert_eq!(check_path("state.remaining_steps", HookEvent::EpisodeStart), Ok(ValueType::Number));
        assert_eq!(check_path("state.features.rows", HookEvent::AfterTool), Ok(ValueType::Any));
        assert!(check_path("action.tool", HookEvent::BeforeDecision).unwrap_err().contains("not available"));
        assert_eq!(check_path("action.args.query", HookEvent::BeforeAction), Ok(ValueType::Any));
        assert!(check_path("state.remaning_steps", HookEvent::AfterTool).unwrap_err().contains("unknown path"));
        assert!(check_path("env.secret", HookEvent::AfterTool).is_err());
        assert!(check_path("action.args.", HookEvent::AfterTool).is_err());
    }

    #[test]
    fn extractions_take_the_first_capture_and_fail_closed() {
        let mut f = Fixture::new();
        f.state.last_reply = "The answer is: \"42\".".into();
        let params: BTreeMap<String, Value> = serde_json::from_value(json!({"extract": {
            "answer": {"from": "state.last_reply", "pattern": "answer is:? \"?([^\".]*)"},
            "table": {"from": "state.features.table_name", "pattern": "\\w+"}
        }}))
        .unwrap();
        let ex = parse_extractions(params.get("extract")).unwrap();
        f.state.features.insert("table_name".into(), json!("Team Stats"));
        let got = run_extractions(&ex, &f.scope()).unwrap();
        assert_eq!(got["answer"], "42");
        assert_eq!(got["table"], "Team", "no capture group: the whole match");
        // One extraction that does not match stops the hook.
        f.state.last_reply = "No idea.".into();
        assert!(run_extractions(&ex, &f.scope()).is_none());
        // A missing path is no match, not an empty value.
        f.state.last_reply = "The answer is 7".into();
        f.state.features.clear();
        assert!(run_extractions(&ex, &f.scope()).is_none());
        // extract.<name> resolves from the scope.
        f.extracted.insert("answer".into(), "7".into());
        assert!(f.holds(json!({"eq": ["extract.answer", "7"]})));
    }

    #[test]
    fn bad_extractions_name_what_is_wrong() {
        let parse = |v: Value| parse_extractions(v.get("extract")).unwrap_err();
        assert!(parse(json!({"extract": []}))[0].1.contains("expected an object"));
        let e = parse(json!({"extract": {"x": {"from": "state.last_reply", "pattern": "(unclosed"}}}));
        assert_eq!(e[0].0, "x");
        assert!(e[0].1.contains("does not compile"), "{e:?}");
        assert!(parse(json!({"extract": {"x": {"from": "state.last_reply"}}}))[0].1.contains("needs `from`"));
        assert!(parse(json!({"extract": {"x y": {"from": "a", "pattern": "b"}}}))[0].1.contains("letters"));
        let long = "a".repeat(MAX_PATTERN_BYTES + 1);
        assert!(parse(json!({"extract": {"x": {"from": "state.last_reply", "pattern": long}}}))[0].1.contains("exceeds"));
    }

    #[test]
    fn templates_substitute_paths_without_evaluating_anything() {
        let mut f = Fixture::new();
        f.state.features.insert("table_name".into(), json!("Team Stats"));
        let s = f.scope();
        let out = render_template(
            &json!({"query": "SELECT * FROM `{{state.features.table_name}}` LIMIT 3", "n": "{{state.remaining_steps}}", "raw": "{{ x"}),
            &s,
        );
        assert_eq!(out, json!({"query": "SELECT * FROM `Team Stats` LIMIT 3", "n": 5, "raw": "{{ x"}));
        assert_eq!(template_paths(&json!(["a {{state.model_calls}} b {{action.tool}}"])), vec!["state.model_calls", "action.tool"]);
    }
}
