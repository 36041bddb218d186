//! The declarative harness spec (docs/ARCHITECTURE.md, "Harness runtime and rollouts"; paper Appendix D, Table 7;
//! Harness-R1 §3.1 lifecycle points). A spec is data only: nothing in it is ever executed
//! as code. Semantic validation lives in the harness runtime (`jobs::harness`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Id of the base harness. H0 is the spec with no edits.
pub const H0_ID: &str = "h0";

/// A harness: the prompts, hooks and tool view wrapped around a policy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HarnessSpec {
    pub id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    #[serde(default)]
    pub generation: u32,
    /// The repair direction this sibling was made for, in words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub direction: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prompt_rules: Vec<PromptRule>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skills: Vec<Skill>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub context: Vec<ContextItem>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub memory: Vec<MemoryItem>,
    /// Demonstrations: short worked conversations placed as chat turns between the system
    /// prompt and the task (few-shot), so the policy sees the protocol used once.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub examples: Vec<Example>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_view: Option<ToolView>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hooks: Vec<Hook>,
}

impl HarnessSpec {
    /// The base harness H0: no edits.
    pub fn h0() -> Self {
        HarnessSpec {
            id: H0_ID.to_string(),
            parent: None,
            generation: 0,
            direction: None,
            prompt_rules: vec![],
            skills: vec![],
            context: vec![],
            memory: vec![],
            examples: vec![],
            tool_view: None,
            hooks: vec![],
        }
    }

    /// Content hash (first 12 hex digits of SHA-256 over canonical JSON): the harness
    /// version recorded on every trajectory row.
    pub fn version_hash(&self) -> String {
        let canonical = serde_json::to_vec(self).expect("harness specs serialise");
        hex::encode(&Sha256::digest(&canonical)[..6])
    }
}

/// Text placed into a named prompt slot: `system`, `action_guidance`, `answer_format` and
/// `error_recovery` go into the system prompt, `task_preamble` before the task.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PromptRule {
    pub slot: String,
    pub text: String,
}

/// A named procedure the agent is shown (e.g. "inspect the schema first").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Skill {
    pub name: String,
    pub text: String,
}

/// Extra context placed before the task (e.g. a worked example).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContextItem {
    pub name: String,
    pub text: String,
}

/// A worked conversation shown before the task: user, assistant and tool turns, starting
/// with a user turn and ending with an assistant turn. Its turns are harness text (never
/// trained on); the policy imitates them with its own tokens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Example {
    pub name: String,
    pub turns: Vec<ExampleTurn>,
}

/// One turn of an [`Example`]: `role` is `user`, `assistant` or `tool`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExampleTurn {
    pub role: String,
    pub text: String,
}

/// A note carried across the steps of an episode.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryItem {
    pub key: String,
    pub text: String,
}

/// Which tools are shown to the policy, with which descriptions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolView {
    pub tools: Vec<ToolViewEntry>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolViewEntry {
    pub name: String,
    #[serde(default = "default_true")]
    pub shown: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
}

fn default_true() -> bool {
    true
}

/// Lifecycle points where hooks run (Harness-R1 §3.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HookEvent {
    EpisodeStart,
    BeforeDecision,
    BeforeAction,
    AfterTool,
}

impl HookEvent {
    /// The stored (serde) name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::EpisodeStart => "episode_start",
            Self::BeforeDecision => "before_decision",
            Self::BeforeAction => "before_action",
            Self::AfterTool => "after_tool",
        }
    }
}

/// What a hook does when its condition holds (Harness-S Appendix D, Table 7).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HookAction {
    /// Inject a hint into the context; the action proceeds.
    #[serde(alias = "inject_hint")]
    Warn,
    /// Block the pending action and prompt the policy again.
    BlockAndPrompt,
    /// Replace the pending action with one built from `parameters`.
    RewriteAction,
    /// Take an action chosen by the harness instead of asking the policy.
    ForceAction,
}

impl HookAction {
    /// The stored (serde) name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Warn => "warn",
            Self::BlockAndPrompt => "block_and_prompt",
            Self::RewriteAction => "rewrite_action",
            Self::ForceAction => "force_action",
        }
    }
}

/// A hook condition: a named predicate, or a safe expression over the episode state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Condition {
    /// E.g. `pagination_present`, `remaining_steps_lte` (threshold from hook parameters).
    Named(String),
    Expr(Box<Expr>),
}

/// The expression language: boolean combinators and comparisons of a state path
/// (`state.remaining_steps`, `action.tool`, `action.args.query`, `observation.text`)
/// with a JSON literal. Externally tagged: `{"lte": ["state.remaining_steps", 2]}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Expr {
    All(Vec<Condition>),
    Any(Vec<Condition>),
    Not(Condition),
    Eq(String, serde_json::Value),
    Ne(String, serde_json::Value),
    Lt(String, serde_json::Value),
    Lte(String, serde_json::Value),
    Gt(String, serde_json::Value),
    Gte(String, serde_json::Value),
    Contains(String, serde_json::Value),
}

/// `{event, condition, action, message, parameters}` (Appendix D, Table 7).
///
/// `parameters` holds the values the condition and action read: `threshold`
/// (`remaining_steps_lte`), `times` (`repeated_action`), `tool` and `args` (the call a
/// `rewrite_action` / `force_action` builds; string values may contain `{{path}}`
/// placeholders, filled by substitution, never evaluated), and `max_fires` (how often the
/// hook may fire per episode). `jobs::harness::validate` checks all of them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hook {
    /// Names the hook on the turns it injects (`Turn::hook_id`) and in diffs; hooks
    /// without one are named by position (`hooks[2]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    pub event: HookEvent,
    pub condition: Condition,
    pub action: HookAction,
    #[serde(default)]
    pub message: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub parameters: BTreeMap<String, serde_json::Value>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hook_conditions_parse_both_forms() {
        let named: Hook = serde_json::from_str(
            r#"{"event":"after_tool","condition":"remaining_steps_lte","action":"warn","message":"commit soon","parameters":{"threshold":3}}"#,
        )
        .unwrap();
        assert_eq!(named.condition, Condition::Named("remaining_steps_lte".into()));
        let expr: Hook = serde_json::from_str(
            r#"{"event":"before_action","condition":{"all":[{"eq":["action.tool","execute_sql"]},{"not":{"contains":["action.args.query","LIMIT"]}}]},"action":"block_and_prompt","message":"add LIMIT"}"#,
        )
        .unwrap();
        match expr.condition {
            Condition::Expr(e) => assert!(matches!(*e, Expr::All(ref v) if v.len() == 2)),
            other => panic!("expected expression, got {other:?}"),
        }
        assert!(serde_json::from_str::<Hook>(r#"{"event":"on_lunch","condition":"x","action":"warn"}"#).is_err());
    }

    #[test]
    fn version_hash_changes_with_content() {
        let h0 = HarnessSpec::h0();
        let mut h1 = h0.clone();
        h1.prompt_rules.push(PromptRule { slot: "system".into(), text: "inspect the schema".into() });
        assert_ne!(h0.version_hash(), h1.version_hash());
        assert_eq!(h0.version_hash(), HarnessSpec::h0().version_hash());
    }
}
