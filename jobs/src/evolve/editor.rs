//! Editors: Edit(H, d) of Harness-S Eq. 2 — a parent harness and a repair direction in, a
//! child [`HarnessSpec`] out. Every child must pass the harness runtime's static
//! validation ([`crate::harness::check_spec`]) before it is measured.
//!
//! - [`TemplateEditor`]: built in, no LLM. A library of parameterised repairs per cause
//!   ([`repairs_for`]): prompt rules, skills, and hooks (`remaining_steps_lte` → "commit
//!   now", an `after_tool` reminder to call `commit_final_answer`, a `before_action` block
//!   of unquoted identifiers, ...). Each cause has several mechanisms; the variant index
//!   rotates them so that siblings of one parent differ (Appendix F: "seek different
//!   mechanisms, triggers, or recovery strategies").
//! - [`LlmEditor`]: any [`Policy`] gets the Appendix F planning instructions, the parent
//!   and the direction, and answers a JSON diff (components to add). An invalid answer gets
//!   one revision with the validation problems; a second invalid answer drops the
//!   candidate with its reason ([`EditError::Rejected`]).

use async_trait::async_trait;
use serde_json::{json, Map, Value};

use super::diagnose::codes;
use super::direction::Direction;
use super::reading::{SINGLE_VALUE_PATTERN, STATED_ANSWER_PATTERN, STATED_NAME_PATTERN, STATED_NUMBER_PATTERN, STATED_SQL_PATTERN};
use crate::harness::{check_spec, spec_from_value, ValidateOptions};
use crate::policy::{Message, Policy, SamplingParams};
use schemas::{HarnessSpec, Role, Trajectory};

/// What an editor is asked to do.
#[derive(Debug, Clone)]
pub struct EditRequest<'a> {
    pub parent: &'a HarnessSpec,
    pub direction: &'a Direction,
    /// The id the child gets.
    pub child_id: String,
    pub generation: u32,
    /// Which mechanism to try (rotates repairs; also the revision counter's base).
    pub variant: usize,
    /// Local-evaluation feedback for a revision (None for the initial version).
    pub feedback: Option<String>,
    /// Briefs of the other candidates of this round (to seek different mechanisms).
    pub other_briefs: Vec<String>,
    /// Children already proposed this round: an editor seeks mechanisms they do not use.
    pub earlier: Vec<HarnessSpec>,
    /// Validation options (the environment's tool names).
    pub validate: &'a ValidateOptions,
    /// The parent's episodes of this round (a learned editor reads its failures).
    pub evidence: &'a [Trajectory],
}

/// Why no child came out.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EditError {
    /// The edit was invalid after its one revision; the candidate is dropped.
    #[error("candidate `{child}` rejected: {reason}")]
    Rejected { child: String, reason: String },
    /// The editor has nothing to offer for this direction.
    #[error("candidate `{child}`: no repair for causes {causes}")]
    NoRepair { child: String, causes: String },
    /// The editor's backend failed (e.g. the LLM server is unreachable).
    #[error("editor backend: {0}")]
    Backend(String),
}

/// Edit(H, d).
#[async_trait]
pub trait Editor: Send + Sync {
    fn name(&self) -> &str;
    async fn edit(&self, req: &EditRequest<'_>) -> Result<HarnessSpec, EditError>;
}

/// One parameterised repair: the components it adds, as a JSON diff.
#[derive(Debug, Clone, PartialEq)]
pub struct Repair {
    pub mechanism: &'static str,
    pub diff: Value,
}

impl Repair {
    /// Whether the repair acts in the policy's place (a `force_action` / `rewrite_action`
    /// hook) rather than changing what the policy itself writes.
    pub fn harness_side(&self) -> bool {
        self.diff.get("hooks").and_then(Value::as_array).is_some_and(|hooks| {
            hooks.iter().any(|h| matches!(h.get("action").and_then(Value::as_str), Some("force_action" | "rewrite_action")))
        })
    }
}

/// A worked conversation placed before the task as chat turns: the policy sees, in its own
/// turns, the protocol it is missing.
fn example(name: &str, turns: &[(&str, &str)]) -> Value {
    let turns: Vec<Value> = turns.iter().map(|(role, text)| json!({"role": role, "text": text})).collect();
    json!({"examples": [{"name": name, "turns": turns}]})
}

const EXAMPLE_TASK_COMPARE: &str = "The name of this table is fruits, and the headers of this table are name,price.\nQuestion: Which fruit has a higher price: Apple or Pear?";
const EXAMPLE_TASK_COUNT: &str =
    "The name of this table is fruits, and the headers of this table are name,price.\nQuestion: How many fruits have price greater than 4?";

fn example_final_answer() -> Value {
    example("final-answer", &[("user", EXAMPLE_TASK_COMPARE), ("assistant", "Final Answer: [\"Pear\"]")])
}

fn example_query_answer() -> Value {
    example(
        "query-then-answer",
        &[
            ("user", EXAMPLE_TASK_COUNT),
            ("assistant", "```sql\nSELECT COUNT(*) FROM fruits WHERE price > 4;\n```"),
            ("tool", "[(2,)]"),
            ("assistant", "Final Answer: [\"2\"]"),
        ],
    )
}

fn hook(id: &str, event: &str, condition: Value, action: &str, message: &str, parameters: Value) -> Value {
    let mut h = json!({"id": id, "event": event, "condition": condition, "action": action, "message": message});
    if parameters.as_object().is_some_and(|m| !m.is_empty()) {
        h["parameters"] = parameters;
    }
    h
}

const COMMIT_NOW: &str = "Execution budget is low. Commit now: reply with the single line Final Answer: [\"<value from the last result>\"] (commit_final_answer); do not run more queries.";
const COMMIT_AFTER_RESULT: &str = "If this result answers the question, commit it now with the single line Final Answer: [\"<value>\"], e.g. for [(2,)] write Final Answer: [\"2\"].";
const NO_PROSE: &str = "Do not write the answer as a sentence. Either run a query in a ```sql block, or commit with the single line Final Answer: [\"<value>\"].";

fn extract(name: &str, from: &str, pattern: &str) -> Value {
    json!({ name: {"from": from, "pattern": pattern} })
}

/// A before_decision hook that commits what a prose reply stated, read by `pattern`.
fn commit_stated(id: &str, pattern: &str) -> Value {
    json!({"hooks": [hook(id, "before_decision", json!("text_only_reply"), "force_action", "",
        json!({"max_fires": 1, "extract": extract("answer", "state.last_reply", pattern),
               "tool": "commit_final_answer", "args": {"answers": ["{{extract.answer}}"]}}))]})
}

/// The repair library: for a cause, its mechanisms, those that change the policy's own
/// output first (worked examples, reminders, prompt rules, skills, blocking), then those
/// that act in its place (commit what a reply stated, run the SQL it wrote), which only
/// environments with `harness_actions` accept. `threshold` parameterises budget hooks.
pub fn repairs_for(cause: &str, threshold: u32) -> Vec<Repair> {
    let r = |mechanism, diff| Repair { mechanism, diff };
    match cause {
        codes::NEVER_COMMITTED | codes::BUDGET_EXHAUSTED | codes::ROUND_LIMIT => vec![
            r("example:query-answer", example_query_answer()),
            r(
                "hook:low-budget",
                json!({"hooks": [hook("commit-when-low", "after_tool", json!("remaining_steps_lte"), "warn", COMMIT_NOW, json!({"threshold": threshold}))]}),
            ),
            r(
                "hook:after-result",
                json!({"hooks": [hook("commit-after-result", "after_tool",
                json!({"all": [{"eq": ["action.tool", "execute_sql"]}, {"not": "last_action_failed"}]}), "warn", COMMIT_AFTER_RESULT, json!({"max_fires": 2}))]}),
            ),
            r(
                "prompt:answer-format",
                json!({"prompt_rules": [{"slot": "answer_format", "text":
                "First run one SELECT in a ```sql block. As soon as the result contains the answer, commit it with the line Final Answer: [\"<value>\"]. Never end an episode without committing an answer."}]}),
            ),
            r("hook:commit-stated-number", commit_stated("commit-stated-number", STATED_NUMBER_PATTERN)),
        ],
        codes::PROSE_ANSWER => vec![
            r("example:final-answer", example_final_answer()),
            r(
                "hook:no-prose",
                json!({"hooks": [hook("no-prose", "before_decision", json!("text_only_reply"), "warn", NO_PROSE, json!({}))]}),
            ),
            r(
                "skill:commit",
                json!({"skills": [{"name": "commit-answer", "text":
                "1. Run one SELECT that computes the value.\n2. Read the value from the result, e.g. [(2,)] means 2.\n3. Call commit_final_answer with answers: [\"2\"]."}]}),
            ),
            r(
                "hook:after-result",
                json!({"hooks": [hook("commit-after-result", "after_tool",
                json!({"all": [{"eq": ["action.tool", "execute_sql"]}, {"not": "last_action_failed"}]}), "warn", COMMIT_AFTER_RESULT, json!({"max_fires": 2}))]}),
            ),
            r("hook:commit-stated-name", commit_stated("commit-stated-name", STATED_NAME_PATTERN)),
            r("hook:commit-stated-answer", commit_stated("commit-stated-answer", STATED_ANSWER_PATTERN)),
        ],
        codes::UNPARSED_ACTION => vec![
            r(
                "prompt:sql-fence",
                json!({"prompt_rules": [{"slot": "answer_format", "text":
                "Write every query inside a ```sql block; SQL anywhere else is not run."}]}),
            ),
            r("example:query-answer", example_query_answer()),
            r(
                "hook:run-stated-sql",
                json!({"hooks": [hook("run-stated-sql", "before_decision", json!("text_only_reply"), "force_action", "",
                json!({"max_fires": 2, "extract": extract("sql", "state.last_reply", STATED_SQL_PATTERN),
                       "tool": "execute_sql", "args": {"query": "{{extract.sql}}"}}))]}),
            ),
        ],
        codes::RESULT_NOT_COMMITTED => vec![
            r(
                "hook:after-result",
                json!({"hooks": [hook("commit-after-result", "after_tool",
                json!({"all": [{"eq": ["action.tool", "execute_sql"]}, {"not": "last_action_failed"}]}), "warn", COMMIT_AFTER_RESULT, json!({"max_fires": 2}))]}),
            ),
            r("example:query-answer", example_query_answer()),
            r(
                "hook:commit-single-value",
                json!({"hooks": [hook("commit-single-value", "after_tool",
                json!({"all": [{"eq": ["action.tool", "execute_sql"]}, {"not": "last_action_failed"}]}), "force_action", "",
                json!({"max_fires": 1, "extract": extract("value", "observation.text", SINGLE_VALUE_PATTERN),
                       "tool": "commit_final_answer", "args": {"answers": ["{{extract.value}}"]}}))]}),
            ),
        ],
        codes::IDENTIFIER_ERROR => vec![
            r(
                "hook:block-unquoted",
                json!({"hooks": [hook("quote-identifiers", "before_action",
                json!({"all": [{"eq": ["action.tool", "execute_sql"]}, {"eq": ["state.features.difficulty", "hard"]}, {"not": {"contains": ["action.args.query", "`"]}}]}),
                "block_and_prompt", "Blocked: table and column names with spaces must be quoted with backticks, e.g. SELECT * FROM `Employee Records`. Rewrite the query with backticks.", json!({"max_fires": 2}))]}),
            ),
            r(
                "prompt:quoting",
                json!({"prompt_rules": [{"slot": "error_recovery", "text":
                "If a query fails on a table or column name, quote every identifier with backticks (`Table Name`.`column`) and retry once."}]}),
            ),
            r(
                "hook:after-error",
                json!({"hooks": [hook("quote-after-error", "after_tool", json!("last_action_failed"), "warn",
                "The query failed. Check the exact table and column names in the task and quote them with backticks.", json!({"max_fires": 2}))]}),
            ),
        ],
        codes::SQL_ERROR => vec![
            r(
                "prompt:sql-recovery",
                json!({"prompt_rules": [{"slot": "error_recovery", "text":
                "When SQL fails, read the error, fix only the part it names and run the corrected query; keep queries to one simple SELECT."}]}),
            ),
            r(
                "hook:after-error",
                json!({"hooks": [hook("fix-after-error", "after_tool", json!("last_action_failed"), "warn",
                "The query failed. Read the error message, correct the query and run it again.", json!({"max_fires": 2}))]}),
            ),
        ],
        codes::EMPTY_RESULT => vec![
            r(
                "hook:empty",
                json!({"hooks": [hook("empty-result", "after_tool",
                json!({"contains": ["observation.text", "No response from database"]}), "warn",
                "The query returned no rows. Check the filter values against the table (spelling, case, numbers stored as text) before answering.", json!({"max_fires": 2}))]}),
            ),
            r(
                "skill:inspect",
                json!({"skills": [{"name": "inspect-first", "text":
                "Run SELECT * FROM the table LIMIT 5 to see exact values before writing a WHERE clause."}]}),
            ),
        ],
        codes::WRONG_AGGREGATE => vec![
            r(
                "prompt:aggregate",
                json!({"prompt_rules": [{"slot": "action_guidance", "text":
                "Match the aggregate to the question: how many → COUNT, total → SUM, average → AVG, lowest → MIN, highest → MAX. Compare numbers with column + 0."}]}),
            ),
            r(
                "context:example",
                json!({"context": [{"name": "aggregate-example", "text":
                "Question: What is the average age? Query: SELECT AVG(age + 0) FROM t; Result: [(31.5,)]; Answer: commit_final_answer with answers [\"31.5\"]."}]}),
            ),
        ],
        codes::ANSWER_FORMAT | codes::WRONG_ANSWER => vec![
            r(
                "prompt:bare-answer",
                json!({"prompt_rules": [{"slot": "answer_format", "text":
                "Commit only the bare value(s) from the last result, e.g. for [(2,)] commit answers [\"2\"]; no words, units or brackets."}]}),
            ),
            r(
                "memory:copy",
                json!({"memory": [{"key": "answer", "text": "The committed answer must be copied exactly from the query result."}]}),
            ),
        ],
        codes::WRITE_NOT_EXECUTED => vec![r(
            "prompt:write",
            json!({"prompt_rules": [{"slot": "action_guidance", "text":
                "For insert or update tasks, run the INSERT/UPDATE statement first, then call commit_final_answer with an empty answers list."}]}),
        )],
        codes::REPEATED_ACTION => vec![
            r(
                "hook:repeat",
                json!({"hooks": [hook("stop-repeating", "before_action", json!("repeated_action"), "block_and_prompt",
                "Blocked: this repeats your previous action. Use its result, or commit the answer.", json!({"times": 2}))]}),
            ),
            r(
                "prompt:progress",
                json!({"prompt_rules": [{"slot": "action_guidance", "text": "Never repeat a query that already ran; use its result."}]}),
            ),
        ],
        codes::NO_QUERY => vec![
            r(
                "prompt:query-first",
                json!({"prompt_rules": [{"slot": "action_guidance", "text":
                "Always run at least one SQL query before committing an answer."}]}),
            ),
            r("example:query-answer", example_query_answer()),
        ],
        _ => vec![],
    }
}

/// The field that names an entry of each component list (what `replace` and `remove` match
/// on); `tool_view` entries are named by `name` under `tool_view.tools`.
fn entry_key(component: &str) -> Option<&'static str> {
    match component {
        "prompt_rules" => Some("slot"),
        "skills" | "context" | "examples" => Some("name"),
        "memory" => Some("key"),
        "hooks" => Some("id"),
        "tool_view" => Some("name"),
        _ => None,
    }
}

/// The list a component's entries live in: `obj[component]`, or `obj.tool_view.tools`.
fn entries_mut<'v>(obj: &'v mut Map<String, Value>, component: &str) -> Option<&'v mut Vec<Value>> {
    let list = match component {
        "tool_view" => obj.get_mut("tool_view")?.get_mut("tools")?,
        c => obj.get_mut(c)?,
    };
    list.as_array_mut()
}

/// Applies `remove` (`{"<component>": ["<key>", ...]}`) or `replace` (`{"<component>":
/// [<entry>, ...]}`) of an edit: entries are matched by [`entry_key`] (a prompt rule by its
/// slot: every rule of that slot). A key the parent does not have is an error naming the
/// keys it has, so that a revision can correct it.
fn change_entries(obj: &mut Map<String, Value>, op: &str, changes: &Value) -> Result<(), String> {
    let Value::Object(changes) = changes else {
        return Err(format!("`{op}` must be an object of component lists, e.g. {{\"hooks\": [...]}}"));
    };
    for (component, items) in changes {
        let key = entry_key(component).ok_or_else(|| {
            format!("`{op}.{component}`: unknown component; one of prompt_rules, skills, context, memory, examples, hooks, tool_view")
        })?;
        let Value::Array(items) = items else {
            return Err(format!("`{op}.{component}` must be a list"));
        };
        let mut list = entries_mut(obj, component).map(std::mem::take).unwrap_or_default();
        let have: Vec<String> = list.iter().filter_map(|e| e.get(key).and_then(Value::as_str)).map(str::to_string).collect();
        for (i, item) in items.iter().enumerate() {
            let name = match op {
                "remove" => item.as_str(),
                _ => item.get(key).and_then(Value::as_str),
            }
            .ok_or_else(|| match op {
                "remove" => format!("`remove.{component}[{i}]` must be the {key} of an entry"),
                _ => format!("`replace.{component}[{i}]` needs its `{key}` (the entry it replaces)"),
            })?;
            if !have.iter().any(|h| h == name) {
                let names = if have.is_empty() { "none".to_string() } else { have.join(", ") };
                return Err(format!("`{op}.{component}[{i}]`: the parent has no entry with {key} `{name}`; its {component}: {names}"));
            }
            let at = list.iter().position(|e| e.get(key).and_then(Value::as_str) == Some(name));
            list.retain(|e| e.get(key).and_then(Value::as_str) != Some(name));
            if op == "replace" {
                list.insert(at.unwrap_or(list.len()).min(list.len()), item.clone());
            }
        }
        match component.as_str() {
            "tool_view" => {
                if list.is_empty() {
                    obj.remove("tool_view");
                } else {
                    obj.insert("tool_view".into(), json!({"tools": list}));
                }
            }
            c => {
                obj.insert(c.to_string(), Value::Array(list));
            }
        }
    }
    Ok(())
}

/// Applies a JSON diff to a parent and returns the child as JSON, ready for validation:
/// `remove` and `replace` change the parent's entries (Eq. 2's Edit modifies the parent),
/// every other component key lists entries to add (`tool_view` replaces the view). An added
/// entry whose name (hook id, skill, context or example name, memory key) the child already
/// has gets a suffix (`-2`, `-3`, ...); an entry equal to one the parent has is not added.
pub fn apply_diff(parent: &HarnessSpec, diff: &Value, child_id: &str, generation: u32, direction: &str) -> Result<Value, String> {
    let Value::Object(diff) = diff else {
        return Err("the edit must be a JSON object of components to add, `replace` or `remove`".into());
    };
    let mut child = serde_json::to_value(parent).map_err(|e| e.to_string())?;
    let obj = child.as_object_mut().expect("specs are objects");
    // Removals and replacements first, so that an added entry may reuse a removed id.
    for op in ["remove", "replace"] {
        if let Some(changes) = diff.get(op) {
            change_entries(obj, op, changes)?;
        }
    }
    for (key, value) in diff {
        match key.as_str() {
            "remove" | "replace" => {}
            "prompt_rules" | "skills" | "context" | "memory" | "examples" | "hooks" => {
                let Value::Array(items) = value else {
                    return Err(format!("`{key}` must be a list"));
                };
                let list = obj.entry(key.clone()).or_insert_with(|| Value::Array(vec![]));
                let list = list.as_array_mut().expect("component lists are arrays");
                // Entries are named (hooks by id, skills, context and examples by name,
                // memory by key); prompt rules share their slot.
                let name_key = entry_key(key).filter(|_| key != "prompt_rules");
                for item in items {
                    // Do not add a text the parent already has.
                    if list.contains(item) {
                        continue;
                    }
                    let mut item = item.clone();
                    if let Some(k) = name_key {
                        if let Some(name) = item.get(k).and_then(Value::as_str).map(str::to_string) {
                            let taken = |n: &str| list.iter().any(|e| e.get(k).and_then(Value::as_str) == Some(n));
                            let mut n = 2;
                            let mut unique = name.clone();
                            while taken(&unique) {
                                unique = format!("{name}-{n}");
                                n += 1;
                            }
                            item[k] = Value::String(unique);
                        }
                    }
                    list.push(item);
                }
            }
            "tool_view" => {
                obj.insert(key.clone(), value.clone());
            }
            other => {
                // Unknown keys are kept so that validation names them.
                obj.insert(other.to_string(), value.clone());
            }
        }
    }
    obj.insert("id".into(), Value::String(child_id.into()));
    obj.insert("parent".into(), Value::String(parent.id.clone()));
    obj.insert("generation".into(), json!(generation));
    obj.insert("direction".into(), Value::String(direction.into()));
    Ok(child)
}

/// The built-in editor.
#[derive(Debug, Clone)]
pub struct TemplateEditor {
    /// `threshold` of budget hooks.
    pub low_budget_threshold: u32,
}

impl Default for TemplateEditor {
    fn default() -> Self {
        TemplateEditor { low_budget_threshold: 2 }
    }
}

impl TemplateEditor {
    /// The diff for a direction: for every cause its `variant`-th mechanism (the most
    /// direct repair for variant 0). A mechanism in `taken` (already in the parent, used by
    /// another child of this round, or by the version being revised) or already chosen for
    /// another cause of this direction is passed over for the next one of its cause; when
    /// all are taken the cause adds nothing.
    /// Repairs that act in the policy's place are offered only with `harness_actions`.
    pub fn diff(
        &self,
        direction: &Direction,
        variant: usize,
        taken: &[&'static str],
        harness_actions: bool,
    ) -> Option<(Value, Vec<&'static str>)> {
        let mut merged = Map::new();
        let mut mechanisms = Vec::new();
        for cause in &direction.causes {
            let repairs: Vec<Repair> =
                repairs_for(cause, self.low_budget_threshold).into_iter().filter(|r| harness_actions || !r.harness_side()).collect();
            if repairs.is_empty() {
                continue;
            }
            let n = repairs.len();
            let free =
                (0..n).map(|j| &repairs[(variant + j) % n]).find(|r| !taken.contains(&r.mechanism) && !mechanisms.contains(&r.mechanism));
            let Some(pick) = free else { continue };
            mechanisms.push(pick.mechanism);
            for (k, v) in pick.diff.as_object().expect("repairs are objects") {
                let list = merged.entry(k.clone()).or_insert_with(|| Value::Array(vec![]));
                list.as_array_mut().expect("lists").extend(v.as_array().cloned().unwrap_or_default());
            }
        }
        if mechanisms.is_empty() {
            None
        } else {
            Some((Value::Object(merged), mechanisms))
        }
    }
}

impl TemplateEditor {
    /// The library mechanisms a spec already carries: every component of the repair is in
    /// the spec (hooks compared without their ids, which may have been suffixed).
    pub fn mechanisms_in(&self, spec: &HarnessSpec) -> Vec<&'static str> {
        let have = serde_json::to_value(spec).unwrap_or(Value::Null);
        let strip_id = |v: &Value| {
            let mut v = v.clone();
            if let Some(m) = v.as_object_mut() {
                m.remove("id");
            }
            v
        };
        let mut out = Vec::new();
        for (cause, _) in codes::ALL {
            for repair in repairs_for(cause, self.low_budget_threshold) {
                if out.contains(&repair.mechanism) {
                    continue;
                }
                let present = repair.diff.as_object().is_some_and(|diff| {
                    diff.iter().all(|(key, items)| {
                        let list: Vec<Value> =
                            have.get(key).and_then(Value::as_array).map(|l| l.iter().map(strip_id).collect()).unwrap_or_default();
                        items.as_array().is_some_and(|items| items.iter().all(|i| list.contains(&strip_id(i))))
                    })
                });
                if present {
                    out.push(repair.mechanism);
                }
            }
        }
        out
    }
}

#[async_trait]
impl Editor for TemplateEditor {
    fn name(&self) -> &str {
        "template"
    }
    async fn edit(&self, req: &EditRequest<'_>) -> Result<HarnessSpec, EditError> {
        let mut taken = self.mechanisms_in(req.parent);
        for child in &req.earlier {
            taken.extend(self.mechanisms_in(child));
        }
        let Some((diff, mechanisms)) = self.diff(req.direction, req.variant, &taken, req.validate.harness_actions) else {
            return Err(EditError::NoRepair { child: req.child_id.clone(), causes: req.direction.causes.join(", ") });
        };
        let text = format!("{} via {}", req.direction.summary, mechanisms.join(", "));
        let value = apply_diff(req.parent, &diff, &req.child_id, req.generation, &text)
            .map_err(|reason| EditError::Rejected { child: req.child_id.clone(), reason })?;
        spec_from_value(&req.child_id, &value, req.validate)
            .map_err(|e| EditError::Rejected { child: req.child_id.clone(), reason: e.to_string() })
    }
}

/// Appendix F instructions of the editing stage ("Planning", "Submission").
pub const EDIT_INSTRUCTIONS: &str = "You improve an agent harness. Choose among all six editable components according \
to the diagnosed cause; do not default to prompt/skill edits. Components: prompt_rules [{slot, text}] with slot one of \
system, task_preamble, action_guidance, answer_format, error_recovery; skills [{name, text}]; context [{name, text}]; \
memory [{key, text}]; hooks [{id, event, condition, action, message, parameters}] with event one of episode_start, \
before_decision, before_action, after_tool, action one of warn, block_and_prompt (before_action only), \
rewrite_action, force_action, condition a named predicate (remaining_steps_lte with parameters.threshold, \
last_action_failed, repeated_action, no_answer_committed, text_only_reply, pagination_present, always) or an \
expression such as {\"eq\": [\"action.tool\", \"execute_sql\"]}. rewrite_action and force_action take \
parameters.tool and parameters.args, whose strings may hold {{path}} placeholders; parameters.extract \
{\"<name>\": {\"from\": \"state.last_reply\", \"pattern\": \"<regex>\"}} captures text for {{extract.<name>}} \
(the hook fires only when every pattern matches); examples [{name, turns: [{role, text}]}] are worked \
conversations shown before the task (role user, assistant or tool). Answer with ONE JSON object: component lists \
to ADD, e.g. {\"hooks\": [{\"id\": \"commit-now\", \"event\": \"after_tool\", \"condition\": \
\"remaining_steps_lte\", \"action\": \"warn\", \"message\": \"Commit the answer now.\", \"parameters\": \
{\"threshold\": 2}}]}; \"replace\": {component: [entries]} to rewrite the parent's entries (matched by hook id, \
prompt-rule slot, skill/context/example name, memory key, tool_view tool name); \"remove\": {component: [ids]} to \
drop entries that mislead the policy. Never claim unrun tests.";

/// An LLM editor over any OpenAI-compatible (or native) policy.
pub struct LlmEditor<'p> {
    pub policy: &'p dyn Policy,
    pub sampling: SamplingParams,
}

/// Extracts the first JSON object of a reply (code fences and prose around it allowed).
pub fn extract_json(text: &str) -> Result<Value, String> {
    let start = text.find('{').ok_or("the reply holds no JSON object")?;
    let end = text.rfind('}').ok_or("the reply holds no JSON object")?;
    if end < start {
        return Err("the reply holds no JSON object".into());
    }
    serde_json::from_str(&text[start..=end]).map_err(|e| format!("the reply is not valid JSON: {e}"))
}

/// Turns an editor reply into a validated child, or the reason it is invalid (the
/// validation problems with their JSON paths).
pub fn child_from_reply(req: &EditRequest<'_>, reply: &str) -> Result<HarnessSpec, String> {
    patch_from_reply(req.parent, reply, &req.child_id, req.generation, &req.direction.summary, req.validate)
}

/// A reply's patch applied to `parent`: the child `child_id` when the reply holds one JSON
/// diff that parses, applies, validates and changes at least one component; otherwise why
/// not, in words a revision (or a stored patch row) can show.
pub fn patch_from_reply(
    parent: &HarnessSpec,
    reply: &str,
    child_id: &str,
    generation: u32,
    direction: &str,
    validate: &ValidateOptions,
) -> Result<HarnessSpec, String> {
    let diff = extract_json(reply)?;
    if diff.as_object().is_some_and(|m| m.is_empty()) {
        return Err("the edit adds nothing".into());
    }
    let value = apply_diff(parent, &diff, child_id, generation, direction)?;
    let spec = spec_from_value(child_id, &value, validate).map_err(|e| e.to_string())?;
    if spec.prompt_rules == parent.prompt_rules
        && spec.skills == parent.skills
        && spec.hooks == parent.hooks
        && spec.context == parent.context
        && spec.memory == parent.memory
        && spec.examples == parent.examples
        && spec.tool_view == parent.tool_view
    {
        return Err("the edit changes no component of the parent".into());
    }
    debug_assert!(check_spec(&spec, validate).is_empty());
    Ok(spec)
}

#[async_trait]
impl Editor for LlmEditor<'_> {
    fn name(&self) -> &str {
        "llm"
    }
    async fn edit(&self, req: &EditRequest<'_>) -> Result<HarnessSpec, EditError> {
        let parent = serde_json::to_string(req.parent).unwrap_or_default();
        let mut brief = format!("Parent harness:\n{parent}\n\nRepair direction: {}\nEvidence:\n", req.direction.summary);
        for (cause, tasks) in &req.direction.support {
            brief.push_str(&format!("- {cause}: failed tasks {}\n", tasks.iter().cloned().collect::<Vec<_>>().join(", ")));
        }
        if !req.other_briefs.is_empty() {
            brief.push_str(&format!("Other candidates this round (seek a different mechanism): {}\n", req.other_briefs.join("; ")));
        }
        if let Some(f) = &req.feedback {
            brief.push_str(&format!("Local evaluation of your previous version: {f}\n"));
        }
        let mut messages = vec![Message::new(Role::System, EDIT_INSTRUCTIONS), Message::new(Role::User, brief)];
        let mut reasons = Vec::new();
        // The initial version and at most one revision (Table 8 "Revision budget").
        for round in 0..2 {
            let reply = self.policy.chat(&messages, &[], &self.sampling).await.map_err(|e| EditError::Backend(e.to_string()))?;
            match child_from_reply(req, &reply.text) {
                Ok(spec) => return Ok(spec),
                Err(reason) => {
                    tracing::info!(child = %req.child_id, round, reason = %reason, "editor output invalid");
                    reasons.push(format!("version {}: {reason}", round + 1));
                    messages.push(Message::new(Role::Assistant, reply.text));
                    messages.push(Message::new(
                        Role::User,
                        format!("That edit is invalid: {reason}\nAnswer with one corrected JSON object only."),
                    ));
                }
            }
        }
        Err(EditError::Rejected { child: req.child_id.clone(), reason: reasons.join(" | ") })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use super::*;

    fn direction(causes: &[&str]) -> Direction {
        Direction {
            causes: causes.iter().map(|c| c.to_string()).collect(),
            support: causes
                .iter()
                .map(|c| (c.to_string(), BTreeSet::from(["t1".to_string(), "t2".to_string()])))
                .collect::<BTreeMap<_, _>>(),
            summary: causes.join(" + "),
        }
    }

    fn opts() -> ValidateOptions {
        ValidateOptions { tools: Some(vec!["execute_sql".into(), "commit_final_answer".into()]), harness_actions: true, base: false }
    }

    /// A request for a child of `parent`, one generation down, along `direction`: no
    /// feedback, no other briefs, no earlier children.
    fn request<'a>(
        parent: &'a HarnessSpec,
        direction: &'a Direction,
        child_id: &str,
        variant: usize,
        validate: &'a ValidateOptions,
    ) -> EditRequest<'a> {
        EditRequest {
            parent,
            direction,
            child_id: child_id.into(),
            generation: parent.generation + 1,
            variant,
            feedback: None,
            other_briefs: vec![],
            earlier: vec![],
            validate,
            evidence: &[],
        }
    }

    #[tokio::test]
    async fn every_repair_in_the_library_validates_and_variants_differ() {
        let editor = TemplateEditor::default();
        let o = opts();
        let h0 = HarnessSpec::h0();
        for (cause, _) in codes::ALL {
            assert!(!repairs_for(cause, 2).is_empty(), "no repair for {cause}");
            for variant in 0..3 {
                let d = direction(&[cause, codes::PROSE_ANSWER]);
                let req = request(&h0, &d, &format!("c-{cause}-{variant}"), variant, &o);
                let child = editor.edit(&req).await.unwrap_or_else(|e| panic!("{cause} v{variant}: {e}"));
                assert!(check_spec(&child, &o).is_empty());
                assert_eq!(child.parent.as_deref(), Some("h0"));
            }
        }
        let d = direction(&[codes::NEVER_COMMITTED, codes::PROSE_ANSWER]);
        let a = editor.diff(&d, 0, &[], true).unwrap().0;
        let b = editor.diff(&d, 1, &[], true).unwrap().0;
        assert_ne!(a, b);
    }

    /// Without `harness_actions` (the DBBench default) no child forces or rewrites an
    /// action; the first mechanism of every cause changes the policy's own output.
    #[tokio::test]
    async fn without_harness_actions_children_repair_through_the_policys_output() {
        let editor = TemplateEditor::default();
        let o = ValidateOptions { harness_actions: false, ..opts() };
        let h0 = HarnessSpec::h0();
        for (cause, _) in codes::ALL {
            let repairs = repairs_for(cause, 2);
            assert!(!repairs[0].harness_side(), "{cause}: policy-side mechanisms come first");
            let first_harness_side = repairs.iter().position(Repair::harness_side).unwrap_or(repairs.len());
            assert!(repairs[first_harness_side..].iter().all(Repair::harness_side), "{cause}: harness-side mechanisms come last");
            for variant in 0..4 {
                let d = direction(&[cause]);
                let req = request(&h0, &d, &format!("c-{cause}-{variant}"), variant, &o);
                let child = editor.edit(&req).await.unwrap_or_else(|e| panic!("{cause} v{variant}: {e}"));
                assert!(check_spec(&child, &o).is_empty());
                assert!(crate::harness::harness_side_hooks(&child).is_empty(), "{cause} v{variant}: {child:?}");
            }
        }
        // The same direction with the opt-in may reach a forced commit.
        let d = direction(&[codes::PROSE_ANSWER]);
        let reached: Vec<bool> =
            (0..6).map(|v| editor.diff(&d, v, &[], true).is_some_and(|(diff, _)| diff.to_string().contains("force_action"))).collect();
        assert!(reached.iter().any(|f| *f), "{reached:?}");
    }

    #[tokio::test]
    async fn children_of_one_round_use_different_mechanisms() {
        let editor = TemplateEditor::default();
        let o = opts();
        // Two directions whose rotations would both pick the same prose repair.
        let d1 = direction(&[codes::NEVER_COMMITTED, codes::PROSE_ANSWER]);
        let d2 = direction(&[codes::PROSE_ANSWER, codes::NEVER_COMMITTED]);
        let h0 = HarnessSpec::h0();
        let first = request(&h0, &d1, "c1", 0, &o);
        let c1 = editor.edit(&first).await.unwrap();
        let m1 = editor.mechanisms_in(&c1);
        assert_eq!(m1.len(), 2, "{m1:?}");
        let second = EditRequest { direction: &d2, child_id: "c2".into(), variant: 1, earlier: vec![c1.clone()], ..first.clone() };
        let c2 = editor.edit(&second).await.unwrap();
        let m2 = editor.mechanisms_in(&c2);
        assert!(m2.iter().all(|m| !m1.contains(m)), "{m1:?} vs {m2:?}");
        // A child of c1 does not re-add what c1 has.
        let grand = EditRequest { parent: &c1, child_id: "c3".into(), generation: 2, ..first.clone() };
        let c3 = editor.edit(&grand).await.unwrap();
        assert!(editor.mechanisms_in(&c3).len() > m1.len());
        assert!(editor.mechanisms_in(&HarnessSpec::h0()).is_empty());
    }

    #[test]
    fn library_patterns_read_what_small_models_write() {
        let first = |pattern: &str, text: &str| {
            regex::Regex::new(pattern).unwrap().captures(text).and_then(|c| c.get(1)).map(|m| m.as_str().trim().to_string())
        };
        // Replies SmolLM2-135M gave on generated DBBench tasks.
        assert_eq!(
            first(STATED_SQL_PATTERN, "Shorter version:\nSELECT COUNT(*) FROM cities WHERE city > 25;").as_deref(),
            Some("SELECT COUNT(*) FROM cities WHERE city > 25")
        );
        assert_eq!(
            first(STATED_SQL_PATTERN, "Here:\n```\nSELECT * FROM Products WHERE Product = 'Fan'\n```").as_deref(),
            Some("SELECT * FROM Products WHERE Product = 'Fan'")
        );
        assert_eq!(first(STATED_SQL_PATTERN, "I'm ready to help. What's the question?"), None);
        assert_eq!(first(STATED_ANSWER_PATTERN, "The answer is: \"42\"").as_deref(), Some("42"));
        assert_eq!(first(STATED_ANSWER_PATTERN, "Students: 2,348\nThe answer is 751.").as_deref(), Some("751"));
        assert_eq!(first(STATED_ANSWER_PATTERN, "The answer is 45.75.").as_deref(), Some("45.75"));
        assert_eq!(first(STATED_ANSWER_PATTERN, "The answer is: Cedar Falls. It has more parks.").as_deref(), Some("Cedar Falls"));
        assert_eq!(first(STATED_ANSWER_PATTERN, "Based on the given data, Blue River has more copies."), None);
        assert_eq!(first(STATED_NAME_PATTERN, "The answer is: Joao has a higher goals than Luka.").as_deref(), Some("Joao"));
        assert_eq!(first(STATED_NAME_PATTERN, "The answer is Mateo.").as_deref(), Some("Mateo"));
        assert_eq!(first(STATED_NAME_PATTERN, "Blue River has a higher number of copies.").as_deref(), Some("Blue River"));
        assert_eq!(first(STATED_NAME_PATTERN, "The answer is: The employee with the lowest years of service."), None);
        assert_eq!(
            first(STATED_NUMBER_PATTERN, "The answer to this question is: The lowest area of all cities is 1.").as_deref(),
            Some("1")
        );
        assert_eq!(first(STATED_NUMBER_PATTERN, "I'm ready to help."), None);
        assert_eq!(first(SINGLE_VALUE_PATTERN, "[(266,)]").as_deref(), Some("266"));
        assert_eq!(first(SINGLE_VALUE_PATTERN, "[('Iron Gate',)]").as_deref(), Some("Iron Gate"));
        assert_eq!(first(SINGLE_VALUE_PATTERN, "[(1,), (2,)]"), None);
        assert_eq!(first(SINGLE_VALUE_PATTERN, "[('Sam', 3)]"), None);
    }

    #[tokio::test]
    async fn editing_a_child_keeps_hook_ids_unique() {
        let editor = TemplateEditor::default();
        let o = opts();
        let d = direction(&[codes::NEVER_COMMITTED, codes::ROUND_LIMIT]);
        let h0 = HarnessSpec::h0();
        let req = request(&h0, &d, "c1", 0, &o);
        let c1 = editor.edit(&req).await.unwrap();
        let req2 = EditRequest { parent: &c1, child_id: "c2".into(), generation: 2, variant: 0, ..req.clone() };
        let c2 = editor.edit(&req2).await.unwrap();
        assert!(check_spec(&c2, &o).is_empty());
        assert_eq!(c2.parent.as_deref(), Some("c1"));
    }

    /// Eq. 2's Edit modifies the parent: an LLM reply may replace and remove the parent's
    /// entries as well as add; a key the parent lacks is refused with the keys it has.
    #[test]
    fn llm_edits_replace_and_remove_parent_components() {
        let o = opts();
        let parent: HarnessSpec = serde_json::from_value(json!({"id": "p", "parent": "h0", "generation": 1,
            "prompt_rules": [{"slot": "answer_format", "text": "Answer in a sentence."}, {"slot": "action_guidance", "text": "Inspect first."}],
            "skills": [{"name": "inspect", "text": "SELECT * LIMIT 5."}],
            "hooks": [{"id": "nag", "event": "after_tool", "condition": "always", "action": "warn", "message": "Think."},
                      {"id": "low", "event": "before_decision", "condition": "remaining_steps_lte", "action": "warn", "message": "Commit now.", "parameters": {"threshold": 2}}],
            "tool_view": {"tools": [{"name": "execute_sql", "description": "Run SQL."}, {"name": "commit_final_answer"}]}})).unwrap();
        let d = direction(&[codes::PROSE_ANSWER]);
        let req = request(&parent, &d, "c", 0, &o);
        let reply = r#"{"replace": {"prompt_rules": [{"slot": "answer_format", "text": "Commit with Final Answer: [\"<value>\"]."}],
                                    "tool_view": [{"name": "execute_sql", "description": "Run one SELECT."}]},
                        "remove": {"hooks": ["nag"], "skills": ["inspect"]},
                        "hooks": [{"id": "low", "event": "after_tool", "condition": "last_action_failed", "action": "warn", "message": "Fix the query."}]}"#;
        let child = child_from_reply(&req, reply).unwrap();
        assert_eq!(child.prompt_rules.len(), 2);
        assert_eq!(child.prompt_rules[0].slot, "answer_format", "a replaced entry keeps its place");
        assert!(child.prompt_rules[0].text.starts_with("Commit with Final Answer"));
        assert!(child.skills.is_empty());
        let ids: Vec<&str> = child.hooks.iter().filter_map(|h| h.id.as_deref()).collect();
        assert_eq!(ids, ["low", "low-2"], "the removed hook is gone; an added hook with a taken id gets a suffix");
        let view = child.tool_view.as_ref().unwrap();
        assert_eq!(view.tools[0].description.as_deref(), Some("Run one SELECT."));
        assert_eq!(view.tools.len(), 2);
        assert!(check_spec(&child, &o).is_empty());
        // Removing only: a valid edit that changes the parent.
        let only = child_from_reply(&req, r#"{"remove": {"prompt_rules": ["action_guidance"]}}"#).unwrap();
        assert_eq!(only.prompt_rules.len(), 1);
        for (reply, needle) in [
            (r#"{"remove": {"hooks": ["ghost"]}}"#, "`remove.hooks[0]`: the parent has no entry with id `ghost`; its hooks: nag, low"),
            (r#"{"replace": {"skills": [{"text": "x"}]}}"#, "`replace.skills[0]` needs its `name`"),
            (r#"{"remove": {"widgets": ["a"]}}"#, "`remove.widgets`: unknown component"),
            (r#"{"remove": {"hooks": "nag"}}"#, "`remove.hooks` must be a list"),
            (r#"{"remove": []}"#, "`remove` must be an object"),
        ] {
            let err = child_from_reply(&req, reply).unwrap_err();
            assert!(err.contains(needle), "{reply}: {err}");
        }
    }

    #[test]
    fn invalid_llm_replies_are_rejected_with_the_field_named() {
        let o = opts();
        let d = direction(&[codes::NEVER_COMMITTED, codes::PROSE_ANSWER]);
        let h0 = HarnessSpec::h0();
        let req = request(&h0, &d, "x", 0, &o);
        assert!(child_from_reply(&req, "I would add a hook.").unwrap_err().contains("no JSON object"));
        let err = child_from_reply(&req, r#"{"hooks": [{"event": "on_lunch", "condition": "always", "action": "warn", "message": "m"}]}"#)
            .unwrap_err();
        assert!(err.contains("hooks[0].event: unknown event `on_lunch`"), "{err}");
        let err = child_from_reply(&req, r#"{"prompt_rules": [{"slot": "system", "text": "x"}], "magic": 1}"#).unwrap_err();
        assert!(err.contains("unknown field `magic`"), "{err}");
        let ok = child_from_reply(
            &req,
            "Here:\n```json\n{\"prompt_rules\": [{\"slot\": \"answer_format\", \"text\": \"Commit the bare value.\"}]}\n```",
        )
        .unwrap();
        assert_eq!(ok.prompt_rules.len(), 1);
        assert_eq!(ok.id, "x");
    }
}
