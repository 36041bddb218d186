//! Static validation of harness specs. It walks the raw JSON (not the typed struct, which
//! would stop at the first serde error) and reports EVERY problem with its JSON path:
//! unknown fields, events, actions, predicates, operators and paths; wrong types;
//! oversized texts; duplicate ids; hook parameters that do not fit the condition or action.
//! A spec that passes here deserialises into [`HarnessSpec`] and runs without surprises.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use serde_json::{Map, Value};

use super::condition::{check_path, event_name, parse_extractions, predicate, template_paths, ValueType, PREDICATES};
use schemas::{HarnessSpec, HookEvent};

/// Longest text (message, rule, skill, description) a spec may carry, in bytes.
pub const MAX_TEXT_BYTES: usize = 8 * 1024;
/// Most entries of one component list (hooks, rules, skills, ...).
pub const MAX_ITEMS: usize = 64;
/// Deepest condition nesting.
pub const MAX_CONDITION_DEPTH: usize = 8;
/// Prompt slots the runtime places (see `runtime::build_context`).
pub const SLOTS: &[&str] = &["system", "task_preamble", "action_guidance", "answer_format", "error_recovery"];

const EVENTS: &[&str] = &["episode_start", "before_decision", "before_action", "after_tool"];
const ACTIONS: &[&str] = &["warn", "inject_hint", "block_and_prompt", "rewrite_action", "force_action"];
const OPERATORS: &[&str] = &["all", "any", "not", "eq", "ne", "lt", "lte", "gt", "gte", "contains"];

/// One problem in a spec: where (a JSON path such as `hooks[2].condition.all[0]`) and what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub path: String,
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let path = if self.path.is_empty() { "(spec)" } else { &self.path };
        write!(f, "{path}: {}", self.message)
    }
}

/// Why a spec text could not be used.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("{file}:{line}:{column}: not valid JSON: {detail}")]
    Json { file: String, line: usize, column: usize, detail: String },
    #[error("{file}: {} problem(s):\n{}", .problems.len(), .problems.iter().map(|p| p.to_string()).collect::<Vec<_>>().join("\n"))]
    Invalid { file: String, problems: Vec<Problem> },
}

/// What validation may check beyond the spec itself.
#[derive(Debug, Clone, Default)]
pub struct ValidateOptions {
    /// Tool names the target environment offers; when given, tool views and hook actions
    /// must name one of them.
    pub tools: Option<Vec<String>>,
    /// Hooks may act in the policy's place (`force_action`, `rewrite_action`). The
    /// environment opts in (`[environment] harness_actions = true`); off, such hooks are
    /// refused: what a harness does in the policy's place is not the policy's behaviour,
    /// and its tokens are never trained on.
    pub harness_actions: bool,
    /// The spec is a run's base harness (`[pool] base`): id `h0` may carry edits.
    pub base: bool,
}

/// Ids of a spec's hooks that act in the policy's place (`force_action`, `rewrite_action`):
/// its harness-side mechanisms. A spec without any repairs only through the policy's own
/// output (examples, prompt rules, skills, hints, blocking).
pub fn harness_side_hooks(spec: &schemas::HarnessSpec) -> Vec<String> {
    spec.hooks
        .iter()
        .enumerate()
        .filter(|(_, h)| matches!(h.action, schemas::HookAction::ForceAction | schemas::HookAction::RewriteAction))
        .map(|(i, h)| h.id.clone().unwrap_or_else(|| format!("hooks[{i}]")))
        .collect()
}

/// Parses and validates a spec text; `file` names it in errors.
pub fn parse_spec(file: &str, text: &str, opts: &ValidateOptions) -> Result<HarnessSpec, SpecError> {
    spec_from_value(file, &read_value(file, text)?, opts)
}

/// Parses a spec text as JSON, refusing duplicate keys (JSON readers keep the last of two
/// equal keys; a spec that says a thing twice is refused).
pub fn read_value(file: &str, text: &str) -> Result<Value, SpecError> {
    let json_error =
        |e: serde_json::Error| SpecError::Json { file: file.to_string(), line: e.line(), column: e.column(), detail: e.to_string() };
    serde_json::from_str::<NoDuplicateKeys>(text).map_err(json_error)?;
    serde_json::from_str(text).map_err(json_error)
}

/// Validates a JSON value and converts it into a spec.
pub fn spec_from_value(file: &str, value: &Value, opts: &ValidateOptions) -> Result<HarnessSpec, SpecError> {
    let problems = validate_value(value, opts);
    if !problems.is_empty() {
        return Err(SpecError::Invalid { file: file.to_string(), problems });
    }
    serde_json::from_value(value.clone()).map_err(|e| SpecError::Invalid {
        file: file.to_string(),
        problems: vec![Problem { path: String::new(), message: format!("does not match the spec format: {e}") }],
    })
}

/// Validates a spec already in memory (e.g. one built by the editor).
pub fn check_spec(spec: &HarnessSpec, opts: &ValidateOptions) -> Vec<Problem> {
    match serde_json::to_value(spec) {
        Ok(v) => validate_value(&v, opts),
        Err(e) => vec![Problem { path: String::new(), message: format!("cannot be serialised: {e}") }],
    }
}

/// A JSON document in which no object has the same key twice (deserialising it checks).
struct NoDuplicateKeys;

impl<'de> serde::Deserialize<'de> for NoDuplicateKeys {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = NoDuplicateKeys;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("JSON")
            }
            fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
                Ok(NoDuplicateKeys)
            }
            fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
                Ok(NoDuplicateKeys)
            }
            fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
                Ok(NoDuplicateKeys)
            }
            fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
                Ok(NoDuplicateKeys)
            }
            fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
                Ok(NoDuplicateKeys)
            }
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(NoDuplicateKeys)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                while seq.next_element::<NoDuplicateKeys>()?.is_some() {}
                Ok(NoDuplicateKeys)
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut seen = std::collections::HashSet::new();
                while let Some(key) = map.next_key::<String>()? {
                    if !seen.insert(key.clone()) {
                        return Err(serde::de::Error::custom(format!("key `{key}` appears twice in one object; keep one")));
                    }
                    map.next_value::<NoDuplicateKeys>()?;
                }
                Ok(NoDuplicateKeys)
            }
        }
        d.deserialize_any(V)
    }
}

/// Whether a string of `v` has a `{{` without a `}}` after it.
fn unterminated_placeholder(v: &Value) -> bool {
    match v {
        Value::String(text) => {
            let mut rest = text.as_str();
            while let Some(start) = rest.find("{{") {
                match rest[start + 2..].find("}}") {
                    Some(end) => rest = &rest[start + 2 + end + 2..],
                    None => return true,
                }
            }
            false
        }
        Value::Array(items) => items.iter().any(unterminated_placeholder),
        Value::Object(map) => map.values().any(unterminated_placeholder),
        _ => false,
    }
}

/// The first `{{name.path}}` placeholder in a text, if any.
fn placeholder_in(s: &str) -> Option<&str> {
    let mut rest = s;
    while let Some(start) = rest.find("{{") {
        let after = &rest[start + 2..];
        if let Some(end) = after.find("}}") {
            let inner = after[..end].trim();
            if !inner.is_empty() && inner.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.')) {
                return Some(&rest[start..start + 2 + end + 2]);
            }
        }
        rest = after;
    }
    None
}

/// Every problem of a spec given as JSON, in document order.
pub fn validate_value(value: &Value, opts: &ValidateOptions) -> Vec<Problem> {
    let mut v = Validator { problems: Vec::new(), opts, extractions: Vec::new() };
    v.spec(value);
    v.problems
}

struct Validator<'o> {
    problems: Vec<Problem>,
    opts: &'o ValidateOptions,
    /// Extraction names the hook being checked declares (`parameters.extract`).
    extractions: Vec<String>,
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

/// "a string", "an array", ...: what a JSON value is, for error messages.
pub(crate) fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

impl Validator<'_> {
    /// [`check_path`], plus: an `extract.<name>` path must name one of the hook's extractions.
    fn check_path(&self, path: &str, event: HookEvent) -> Result<ValueType, String> {
        let ty = check_path(path, event)?;
        if let Some(name) = path.strip_prefix("extract.") {
            if !self.extractions.iter().any(|n| n == name) {
                return Err(format!(
                    "`{path}` names no extraction of this hook; declare it under parameters.extract (declared: {})",
                    if self.extractions.is_empty() { "none".to_string() } else { self.extractions.join(", ") }
                ));
            }
        }
        Ok(ty)
    }

    fn problem(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.problems.push(Problem { path: path.into(), message: message.into() });
    }

    /// Checks an object's keys; returns the map when `v` is an object.
    fn object<'v>(&mut self, path: &str, v: &'v Value, allowed: &[&str], required: &[&str]) -> Option<&'v Map<String, Value>> {
        let Some(map) = v.as_object() else {
            self.problem(path, format!("expected an object, found {}", type_name(v)));
            return None;
        };
        for key in map.keys() {
            if !allowed.contains(&key.as_str()) {
                self.problem(join(path, key), format!("unknown field `{key}`; expected one of: {}", allowed.join(", ")));
            }
        }
        for key in required {
            if !map.contains_key(*key) {
                self.problem(path, format!("missing field `{key}`"));
            }
        }
        Some(map)
    }

    fn text(&mut self, path: &str, v: &Value, required_non_empty: bool) -> Option<String> {
        match v {
            Value::String(s) => {
                if s.len() > MAX_TEXT_BYTES {
                    self.problem(
                        path,
                        format!(
                            "text is {} bytes; the limit is {MAX_TEXT_BYTES} bytes ({} KB): shorten it",
                            s.len(),
                            MAX_TEXT_BYTES / 1024
                        ),
                    );
                } else if required_non_empty && s.trim().is_empty() {
                    self.problem(path, "must not be empty");
                }
                Some(s.clone())
            }
            other => {
                self.problem(path, format!("expected a string, found {}", type_name(other)));
                None
            }
        }
    }

    /// A non-empty text the policy sees as written: a `{{path}}` placeholder in it would
    /// reach the policy verbatim (JSON that happens to end in `}}` is fine).
    fn shown_text(&mut self, path: &str, v: &Value) {
        if let Some(s) = self.text(path, v, true) {
            if let Some(p) = placeholder_in(&s) {
                self.problem(
                    path,
                    format!("`{p}` is shown to the policy as written: texts have no placeholders; `{{{{...}}}}` works in `parameters.args` of rewrite_action and tool_call hooks"),
                );
            }
        }
    }

    fn ident(&mut self, path: &str, v: &Value) -> Option<String> {
        let s = self.text(path, v, true)?;
        let ok_chars = s.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
        if s.is_empty() {
            return None;
        }
        if s.len() > 64 || !ok_chars || !s.chars().next().is_some_and(|c| c.is_ascii_alphanumeric()) {
            self.problem(
                path,
                format!("`{s}` is not a valid id: use 1-64 letters, digits, `_`, `-` or `.`, starting with a letter or digit"),
            );
            return None;
        }
        Some(s)
    }

    fn list<'v>(&mut self, path: &str, v: &'v Value) -> &'v [Value] {
        match v {
            Value::Array(items) => {
                if items.len() > MAX_ITEMS {
                    self.problem(path, format!("{} entries; at most {MAX_ITEMS} are allowed", items.len()));
                }
                items
            }
            other => {
                self.problem(path, format!("expected an array, found {}", type_name(other)));
                &[]
            }
        }
    }

    fn unique(&mut self, seen: &mut HashMap<String, String>, what: &str, value: Option<String>, path: &str) {
        if let Some(v) = value {
            if let Some(first) = seen.get(&v) {
                self.problem(path, format!("duplicate {what} `{v}` (first at {first})"));
            } else {
                seen.insert(v, path.to_string());
            }
        }
    }

    fn spec(&mut self, v: &Value) {
        const EDIT_FIELDS: &[&str] = &["prompt_rules", "skills", "context", "memory", "examples", "tool_view", "hooks"];
        const FIELDS: &[&str] =
            &["id", "parent", "generation", "direction", "prompt_rules", "skills", "context", "memory", "examples", "tool_view", "hooks"];
        let Some(map) = self.object("", v, FIELDS, &["id"]) else { return };
        let own_id = map.get("id").and_then(Value::as_str).map(str::to_string);
        if let Some(id) = map.get("id") {
            if self.ident("id", id).as_deref() == Some(schemas::H0_ID) && !self.opts.base {
                let edits: Vec<&str> = EDIT_FIELDS
                    .iter()
                    .copied()
                    .filter(|f| map.get(*f).is_some_and(|v| !v.is_null() && v != &Value::Array(vec![])))
                    .collect();
                if !edits.is_empty() {
                    self.problem(
                        "id",
                        format!(
                            "`h0` is the base harness and carries no edits (this spec has {}); give the sibling another id, or name the file as the run's base harness ([pool] base)",
                            edits.join(", ")
                        ),
                    );
                }
            }
        }
        match map.get("parent") {
            None | Some(Value::Null) => {}
            Some(p) => {
                if let Some(parent) = self.ident("parent", p) {
                    if own_id.as_deref() == Some(parent.as_str()) {
                        self.problem(
                            "parent",
                            format!("`{parent}` is this harness's own id: a harness cannot be its own parent; name the harness it edits (e.g. `h0`)"),
                        );
                    }
                }
            }
        }
        if let Some(g) = map.get("generation") {
            if g.as_u64().is_none_or(|n| n > u64::from(u32::MAX)) {
                self.problem("generation", format!("expected a non-negative integer, found {g}"));
            }
        }
        match map.get("direction") {
            None | Some(Value::Null) => {}
            Some(d) => {
                self.text("direction", d, false);
            }
        }
        if let Some(rules) = map.get("prompt_rules") {
            for (i, rule) in self.list("prompt_rules", rules).iter().enumerate() {
                let path = format!("prompt_rules[{i}]");
                if let Some(r) = self.object(&path, rule, &["slot", "text"], &["slot", "text"]) {
                    if let Some(slot) = r.get("slot") {
                        let slot_path = join(&path, "slot");
                        if let Some(s) = self.text(&slot_path, slot, true) {
                            if !s.is_empty() && !SLOTS.contains(&s.as_str()) {
                                self.problem(slot_path, format!("unknown slot `{s}`; expected one of: {}", SLOTS.join(", ")));
                            }
                        }
                    }
                    if let Some(t) = r.get("text") {
                        self.shown_text(&join(&path, "text"), t);
                    }
                }
            }
        }
        self.named_texts(map, "skills", "name", "skill name");
        self.named_texts(map, "context", "name", "context name");
        self.named_texts(map, "memory", "key", "memory key");
        if let Some(examples) = map.get("examples") {
            self.examples(examples);
        }
        if let Some(tv) = map.get("tool_view") {
            self.tool_view(tv);
        }
        if let Some(hooks) = map.get("hooks") {
            let mut ids = HashMap::new();
            for (i, hook) in self.list("hooks", hooks).iter().enumerate() {
                let path = format!("hooks[{i}]");
                let id = hook.get("id").filter(|v| !v.is_null()).and_then(|v| self.ident(&join(&path, "id"), v));
                self.unique(&mut ids, "hook id", id, &join(&path, "id"));
                self.hook(&path, hook);
            }
        }
    }

    fn named_texts(&mut self, map: &Map<String, Value>, field: &str, key: &str, what: &str) {
        let Some(items) = map.get(field) else { return };
        let mut seen = HashMap::new();
        for (i, item) in self.list(field, items).iter().enumerate() {
            let path = format!("{field}[{i}]");
            if let Some(obj) = self.object(&path, item, &[key, "text"], &[key, "text"]) {
                let name = obj.get(key).and_then(|n| self.ident(&join(&path, key), n));
                self.unique(&mut seen, what, name, &join(&path, key));
                if let Some(t) = obj.get("text") {
                    self.shown_text(&join(&path, "text"), t);
                }
            }
        }
    }

    fn examples(&mut self, v: &Value) {
        let mut seen = HashMap::new();
        for (i, item) in self.list("examples", v).iter().enumerate() {
            let path = format!("examples[{i}]");
            let Some(obj) = self.object(&path, item, &["name", "turns"], &["name", "turns"]) else { continue };
            let name = obj.get("name").and_then(|n| self.ident(&join(&path, "name"), n));
            self.unique(&mut seen, "example name", name, &join(&path, "name"));
            let Some(turns) = obj.get("turns") else { continue };
            let turns_path = join(&path, "turns");
            let turns = self.list(&turns_path, turns);
            if turns.is_empty() {
                self.problem(turns_path.clone(), "an example needs at least a user turn and an assistant turn".to_string());
            }
            let mut roles = vec![];
            for (j, turn) in turns.iter().enumerate() {
                let tp = format!("{turns_path}[{j}]");
                let Some(t) = self.object(&tp, turn, &["role", "text"], &["role", "text"]) else { continue };
                if let Some(role) = t.get("role").and_then(|r| self.text(&join(&tp, "role"), r, true)) {
                    if !["user", "assistant", "tool"].contains(&role.as_str()) {
                        self.problem(join(&tp, "role"), format!("unknown role `{role}`; expected user, assistant or tool"));
                    }
                    roles.push(role);
                }
                if let Some(text) = t.get("text") {
                    self.shown_text(&join(&tp, "text"), text);
                }
            }
            if !turns.is_empty() && roles.len() == turns.len() {
                if roles.first().map(String::as_str) != Some("user") {
                    self.problem(format!("{turns_path}[0].role"), "an example starts with a user turn".to_string());
                }
                if roles.last().map(String::as_str) != Some("assistant") {
                    self.problem(
                        format!("{turns_path}[{}].role", roles.len() - 1),
                        "an example ends with an assistant turn (the answer it demonstrates)".to_string(),
                    );
                }
            }
        }
    }

    fn tool_view(&mut self, v: &Value) {
        let Some(map) = self.object("tool_view", v, &["tools"], &["tools"]) else { return };
        let Some(tools) = map.get("tools") else { return };
        let mut seen = HashMap::new();
        let mut hidden = Vec::new();
        let entries = self.list("tool_view.tools", tools);
        for (i, entry) in entries.iter().enumerate() {
            let path = format!("tool_view.tools[{i}]");
            let Some(e) = self.object(&path, entry, &["name", "shown", "description"], &["name"]) else { continue };
            let name = e.get("name").and_then(|n| self.text(&join(&path, "name"), n, true));
            if let Some(n) = &name {
                self.known_tool(&join(&path, "name"), n);
            }
            self.unique(&mut seen, "tool", name.clone(), &join(&path, "name"));
            match e.get("shown") {
                None | Some(Value::Bool(true)) => {}
                Some(Value::Bool(false)) => hidden.extend(name.clone()),
                Some(other) => self.problem(join(&path, "shown"), format!("expected true or false, found {}", type_name(other))),
            }
            match e.get("description") {
                None | Some(Value::Null) => {}
                Some(d) => {
                    self.shown_text(&join(&path, "description"), d);
                }
            }
        }
        if let Some(offered) = &self.opts.tools {
            if !offered.is_empty() && offered.iter().all(|t| hidden.contains(t)) {
                self.problem("tool_view.tools", "hides every tool the environment offers; the policy could not act");
            }
        }
    }

    fn known_tool(&mut self, path: &str, name: &str) {
        if let Some(tools) = &self.opts.tools {
            if !tools.iter().any(|t| t == name) {
                let msg = format!("unknown tool `{name}`; the environment offers: {}", tools.join(", "));
                self.problem(path, msg);
            }
        }
    }

    fn hook(&mut self, path: &str, v: &Value) {
        const FIELDS: &[&str] = &["id", "event", "condition", "action", "message", "parameters"];
        let Some(h) = self.object(path, v, FIELDS, &["event", "condition", "action"]) else { return };

        let event = h.get("event").and_then(|e| {
            let p = join(path, "event");
            let name = self.text(&p, e, true)?;
            match name.as_str() {
                "episode_start" => Some(HookEvent::EpisodeStart),
                "before_decision" => Some(HookEvent::BeforeDecision),
                "before_action" => Some(HookEvent::BeforeAction),
                "after_tool" => Some(HookEvent::AfterTool),
                _ => {
                    self.problem(p, format!("unknown event `{name}`; expected one of: {}", EVENTS.join(", ")));
                    None
                }
            }
        });
        let action = h.get("action").and_then(|a| {
            let p = join(path, "action");
            let name = self.text(&p, a, true)?;
            if ACTIONS.contains(&name.as_str()) {
                Some(if name == "inject_hint" { "warn".to_string() } else { name })
            } else {
                self.problem(p, format!("unknown action `{name}`; expected one of: {}", ACTIONS.join(", ")));
                None
            }
        });

        self.extractions = h
            .get("parameters")
            .and_then(|p| p.get("extract"))
            .and_then(Value::as_object)
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default();
        // Which predicates the condition uses decides which parameters it reads.
        let mut used = Vec::new();
        if let Some(c) = h.get("condition") {
            self.condition(&join(path, "condition"), c, event, 0, &mut used);
        }

        let message = match h.get("message") {
            None => String::new(),
            Some(m) => self.text(&join(path, "message"), m, false).unwrap_or_default(),
        };
        // A message is shown as written: a placeholder in it would reach the policy verbatim.
        if message.contains("{{") || message.contains("}}") {
            self.problem(
                join(path, "message"),
                "messages are shown to the policy as written and have no placeholders; `{{...}}` works in `parameters.args` of rewrite_action and tool_call hooks".to_string(),
            );
        }

        if let (Some(event), Some(action)) = (event, action.as_deref()) {
            match action {
                "block_and_prompt" | "rewrite_action" if event != HookEvent::BeforeAction => self.problem(
                    join(path, "action"),
                    format!("`{action}` needs a pending action, so it runs only at before_action (this hook is at {})", event_name(event)),
                ),
                _ => {}
            }
            if matches!(action, "warn" | "block_and_prompt") && message.trim().is_empty() && h.contains_key("event") {
                self.problem(path, format!("a `{action}` hook needs a non-empty `message` to show the policy"));
            }
        }

        self.parameters(path, h.get("parameters"), event, action.as_deref(), &used);
    }

    fn condition(&mut self, path: &str, c: &Value, event: Option<HookEvent>, depth: usize, used: &mut Vec<&'static str>) {
        if depth > MAX_CONDITION_DEPTH {
            self.problem(path, format!("condition nests deeper than {MAX_CONDITION_DEPTH} levels"));
            return;
        }
        match c {
            Value::String(name) => match predicate(name) {
                Some(p) => {
                    used.push(p.name);
                    if let Some(ev) = event {
                        if !p.events.contains(&ev) {
                            let where_: Vec<&str> = p.events.iter().map(|e| event_name(*e)).collect();
                            self.problem(
                                path,
                                format!("`{name}` cannot be evaluated at {}; it works at: {}", event_name(ev), where_.join(", ")),
                            );
                        }
                    }
                }
                None => {
                    let names: Vec<&str> = PREDICATES.iter().map(|p| p.name).collect();
                    self.problem(path, format!("unknown condition `{name}`; named conditions are: {}", names.join(", ")));
                }
            },
            Value::Object(map) => {
                if map.len() != 1 {
                    self.problem(
                        path,
                        format!("an expression has exactly one operator key (one of: {}), found {}", OPERATORS.join(", "), map.len()),
                    );
                    return;
                }
                let (op, arg) = map.iter().next().expect("one entry");
                let p = join(path, op);
                match op.as_str() {
                    "all" | "any" => match arg {
                        Value::Array(items) if !items.is_empty() => {
                            for (i, item) in items.iter().enumerate() {
                                self.condition(&format!("{p}[{i}]"), item, event, depth + 1, used);
                            }
                        }
                        Value::Array(_) => self.problem(p, format!("`{op}` needs at least one condition")),
                        other => self.problem(p, format!("`{op}` takes an array of conditions, found {}", type_name(other))),
                    },
                    "not" => self.condition(&p, arg, event, depth + 1, used),
                    "eq" | "ne" | "lt" | "lte" | "gt" | "gte" | "contains" => self.comparison(&p, op, arg, event),
                    _ => self.problem(p, format!("unknown operator `{op}`; expected one of: {}", OPERATORS.join(", "))),
                }
            }
            other => self.problem(path, format!("a condition is a predicate name or an expression object, found {}", type_name(other))),
        }
    }

    fn comparison(&mut self, path: &str, op: &str, arg: &Value, event: Option<HookEvent>) {
        let Some([p, lit]) = arg.as_array().map(Vec::as_slice).and_then(|s| <&[Value; 2]>::try_from(s).ok()) else {
            self.problem(path, format!("`{op}` takes [path, value], e.g. {{\"{op}\": [\"state.remaining_steps\", 2]}}"));
            return;
        };
        let Some(path_str) = p.as_str() else {
            self.problem(format!("{path}[0]"), format!("expected a path string, found {}", type_name(p)));
            return;
        };
        let ty = match event {
            Some(ev) => match self.check_path(path_str, ev) {
                Ok(t) => t,
                Err(msg) => {
                    self.problem(format!("{path}[0]"), msg);
                    return;
                }
            },
            // The event is already reported; still catch paths unknown everywhere.
            None => match self.check_path(path_str, HookEvent::AfterTool) {
                Ok(t) => t,
                Err(msg) => {
                    self.problem(format!("{path}[0]"), msg);
                    return;
                }
            },
        };
        let lit_path = format!("{path}[1]");
        match op {
            "lt" | "lte" | "gt" | "gte" => {
                if !lit.is_number() {
                    self.problem(lit_path, format!("`{op}` compares with a number, found {}", type_name(lit)));
                } else if !matches!(ty, ValueType::Number | ValueType::Any) {
                    self.problem(format!("{path}[0]"), format!("`{path_str}` is a {}, which `{op}` cannot order", ty.name()));
                }
            }
            "contains" => {
                if !(lit.is_string() || lit.is_number()) {
                    self.problem(lit_path, format!("`contains` looks for a string or number, found {}", type_name(lit)));
                } else if matches!(ty, ValueType::Number | ValueType::Bool) {
                    self.problem(format!("{path}[0]"), format!("`{path_str}` is a {}; `contains` needs text or a list", ty.name()));
                }
            }
            _ => {
                let fits = match ty {
                    ValueType::Number => lit.is_number(),
                    ValueType::Bool => lit.is_boolean(),
                    ValueType::String => lit.is_string(),
                    ValueType::Any => true,
                };
                if !fits {
                    self.problem(lit_path, format!("`{path_str}` is a {}, found {}", ty.name(), type_name(lit)));
                }
            }
        }
    }

    fn parameters(&mut self, path: &str, params: Option<&Value>, event: Option<HookEvent>, action: Option<&str>, used: &[&str]) {
        let empty = Map::new();
        let ppath = join(path, "parameters");
        let map = match params {
            None | Some(Value::Null) => &empty,
            Some(Value::Object(m)) => m,
            Some(other) => {
                self.problem(ppath, format!("expected an object, found {}", type_name(other)));
                return;
            }
        };
        // Allowed keys: those of the predicates used, of the action, and `max_fires`.
        let mut allowed: BTreeMap<&str, &str> = BTreeMap::new();
        allowed.insert("max_fires", "hook");
        allowed.insert("extract", "hook");
        for name in used {
            if let Some(p) = predicate(name) {
                for (param, required) in p.params {
                    allowed.insert(param, p.name);
                    if *required && !map.contains_key(*param) {
                        self.problem(ppath.clone(), format!("condition `{}` needs parameter `{param}`", p.name));
                    }
                }
            }
        }
        let mediates = matches!(action, Some("rewrite_action" | "force_action"));
        if mediates && !self.opts.harness_actions {
            self.problem(
                join(path, "action"),
                format!(
                    "`{}` acts in the policy's place, which this environment does not allow by default: repair through the policy's own output (examples, prompt rules, skills, warn hooks, block_and_prompt), or opt in with [environment] harness_actions = true (`--harness-actions` on the command line)",
                    action.unwrap_or_default()
                ),
            );
        }
        if mediates {
            allowed.insert("tool", "action");
            allowed.insert("args", "action");
            if action == Some("force_action") && !map.contains_key("tool") {
                self.problem(ppath.clone(), "`force_action` needs parameter `tool` (and usually `args`)");
            }
            if action == Some("rewrite_action") && !map.contains_key("tool") && !map.contains_key("args") {
                self.problem(ppath.clone(), "`rewrite_action` needs parameter `tool`, `args` or both");
            }
        }
        for (key, value) in map {
            let kp = join(&ppath, key);
            if !allowed.contains_key(key.as_str()) {
                let mut names: Vec<&str> = allowed.keys().copied().collect();
                names.sort_unstable();
                self.problem(kp, format!("unknown parameter `{key}` for this condition and action; allowed here: {}", names.join(", ")));
                continue;
            }
            match key.as_str() {
                "threshold" if value.as_u64().is_none() => {
                    self.problem(kp, format!("expected a non-negative integer, found {value}"));
                }
                "times" if value.as_u64().is_none_or(|n| n < 2) => {
                    self.problem(kp, format!("expected an integer of at least 2, found {value}"));
                }
                "max_fires" if value.as_u64().is_none_or(|n| n < 1) => {
                    self.problem(kp, format!("expected a positive integer, found {value}"));
                }
                "extract" => match parse_extractions(Some(value)) {
                    Ok(list) => {
                        for e in list {
                            let ep = join(&join(&kp, &e.name), "from");
                            let check = self.check_path(&e.from, event.unwrap_or(HookEvent::AfterTool));
                            match check {
                                Ok(_) if e.from.starts_with("extract.") => {
                                    self.problem(ep, "an extraction reads a state, action or observation path, not another extraction")
                                }
                                Ok(_) => {}
                                Err(msg) => self.problem(ep, msg),
                            }
                        }
                    }
                    Err(problems) => {
                        for (name, msg) in problems {
                            let p = if name.is_empty() { kp.clone() } else { join(&kp, &name) };
                            self.problem(p, msg);
                        }
                    }
                },
                "tool" => {
                    if let Some(t) = self.text(&kp, value, true) {
                        self.known_tool(&kp, &t);
                    }
                }
                "args" => {
                    if !value.is_object() {
                        self.problem(kp, format!("expected an arguments object, found {}", type_name(value)));
                        continue;
                    }
                    if value.to_string().len() > MAX_TEXT_BYTES {
                        self.problem(kp.clone(), format!("arguments exceed {MAX_TEXT_BYTES} bytes"));
                    }
                    if unterminated_placeholder(value) {
                        self.problem(kp.clone(), "a placeholder opens with `{{` but never closes with `}}`".to_string());
                    }
                    for tp in template_paths(value) {
                        let check = match event {
                            Some(ev) => self.check_path(&tp, ev),
                            None => self.check_path(&tp, HookEvent::AfterTool),
                        };
                        if let Err(msg) = check {
                            self.problem(kp.clone(), format!("placeholder {{{{{tp}}}}}: {msg}"));
                        }
                    }
                }
                _ => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Problems under options that allow harness actions (their own test refuses them).
    fn problems(v: Value) -> Vec<String> {
        validate_value(&v, &ValidateOptions { harness_actions: true, ..Default::default() }).iter().map(|p| p.to_string()).collect()
    }

    #[test]
    fn harness_actions_are_refused_unless_the_environment_opts_in() {
        let spec = json!({"id": "s1", "parent": "h0", "hooks": [
            {"id": "f", "event": "before_decision", "condition": "text_only_reply", "action": "force_action",
             "parameters": {"tool": "commit_final_answer", "args": {"answers": ["1"]}}},
            {"id": "r", "event": "before_action", "condition": "always", "action": "rewrite_action", "parameters": {"args": {"query": "SELECT 1"}}},
            {"id": "w", "event": "before_decision", "condition": "text_only_reply", "action": "warn", "message": "Commit the answer."}]});
        let refused: Vec<String> = validate_value(&spec, &ValidateOptions::default()).iter().map(|p| p.to_string()).collect();
        assert_eq!(refused.len(), 2, "{refused:?}");
        assert!(
            refused[0].starts_with("hooks[0].action:") && refused[0].contains("`force_action` acts in the policy's place"),
            "{refused:?}"
        );
        assert!(refused[1].starts_with("hooks[1].action:") && refused[1].contains("harness_actions = true"), "{refused:?}");
        assert!(problems(spec).is_empty());
    }

    #[test]
    fn duplicate_keys_placeholders_in_messages_and_open_placeholders_are_refused() {
        let dup = r#"{"id": "s1", "id": "s2"}"#;
        let e = parse_spec("s.json", dup, &ValidateOptions::default()).unwrap_err().to_string();
        assert!(e.contains("`id` appears twice") && e.contains("s.json"), "{e}");
        let msg = problems(
            json!({"id": "x", "hooks": [{"event": "before_action", "condition": "always", "action": "warn", "message": "use {{extract.x}}"}]}),
        );
        assert!(msg.iter().any(|p| p.contains("message") && p.contains("no placeholders")), "{msg:?}");
        let open = problems(json!({"id": "x", "hooks": [{"event": "before_action", "condition": "always", "action": "rewrite_action",
            "parameters": {"args": {"query": "SELECT {{action.args.query"}}}]}));
        assert!(open.iter().any(|p| p.contains("never closes")), "{open:?}");
    }

    #[test]
    fn examples_need_user_first_assistant_last_and_known_roles() {
        let got = problems(json!({"id": "x", "examples": [
            {"name": "a", "turns": [{"role": "assistant", "text": "hi"}, {"role": "robot", "text": "x"}]},
            {"name": "a", "turns": []},
            {"name": "b", "turns": [{"role": "user", "text": "q"}, {"role": "assistant", "text": ""}], "extra": 1}
        ]}));
        let joined = got.join("\n");
        for needle in [
            "examples[0].turns[0].role: an example starts with a user turn",
            "examples[0].turns[1].role: unknown role `robot`",
            "examples[1].name: duplicate example name `a`",
            "examples[1].turns: an example needs at least a user turn and an assistant turn",
            "examples[2].turns[1].text",
            "examples[2]",
        ] {
            assert!(joined.contains(needle), "`{needle}` not reported:\n{joined}");
        }
        assert!(problems(
            json!({"id": "x", "examples": [{"name": "ok", "turns": [{"role": "user", "text": "q"}, {"role": "assistant", "text": "a"}]}]})
        )
        .is_empty());
    }

    #[test]
    fn a_harness_is_not_its_own_parent() {
        let p = problems(json!({"id": "s1", "parent": "s1"}));
        assert!(p.iter().any(|m| m.starts_with("parent:") && m.contains("own parent")), "{p:?}");
        assert!(problems(json!({"id": "s1", "parent": "h0"})).is_empty());
    }

    #[test]
    fn extraction_paths_and_placeholders_are_checked() {
        let hook = |params: Value| {
            problems(json!({"id": "s1", "parent": "h0", "hooks": [{"id": "f", "event": "before_decision",
                "condition": "text_only_reply", "action": "force_action", "parameters": params}]}))
        };
        let good = hook(json!({"extract": {"sql": {"from": "state.last_reply", "pattern": "(SELECT[^;]*)"}},
                               "tool": "execute_sql", "args": {"query": "{{extract.sql}}"}}));
        assert!(good.is_empty(), "{good:?}");
        let undeclared = hook(json!({"tool": "execute_sql", "args": {"query": "{{extract.sql}}"}}));
        assert!(undeclared[0].contains("names no extraction of this hook"), "{undeclared:?}");
        let bad_path = hook(json!({"extract": {"sql": {"from": "action.args.query", "pattern": "x"}}, "tool": "execute_sql"}));
        assert!(bad_path[0].starts_with("hooks[0].parameters.extract.sql.from:") && bad_path[0].contains("not available"), "{bad_path:?}");
        let bad_regex = hook(json!({"extract": {"sql": {"from": "state.last_reply", "pattern": "(("}}, "tool": "execute_sql"}));
        assert!(bad_regex[0].starts_with("hooks[0].parameters.extract.sql:") && bad_regex[0].contains("does not compile"), "{bad_regex:?}");
    }

    #[test]
    fn a_good_spec_has_no_problems_and_parses() {
        let spec = json!({
            "id": "s8-low-budget", "parent": "h0", "generation": 1, "direction": "reserve a step for the answer",
            "prompt_rules": [{"slot": "action_guidance", "text": "Inspect the table first."}],
            "skills": [{"name": "inspect", "text": "SELECT * FROM t LIMIT 3"}],
            "memory": [{"key": "quoting", "text": "quote names with spaces"}],
            "tool_view": {"tools": [{"name": "execute_sql", "description": "Run one SQL statement."}]},
            "hooks": [
                {"id": "low", "event": "after_tool", "condition": "remaining_steps_lte", "action": "warn",
                 "message": "Budget is low.", "parameters": {"threshold": 3}},
                {"event": "before_action", "condition": {"all": [{"eq": ["action.tool", "execute_sql"]},
                    {"not": {"contains": ["action.args.query", "limit"]}}]},
                 "action": "rewrite_action", "parameters": {"args": {"query": "{{action.args.query}} LIMIT 50"}}},
                {"event": "episode_start", "condition": "always", "action": "force_action",
                 "parameters": {"tool": "execute_sql", "args": {"query": "SELECT * FROM `{{state.features.table_name}}` LIMIT 3"}}}
            ]
        });
        assert_eq!(problems(spec.clone()), Vec::<String>::new());
        let parsed = spec_from_value("x.json", &spec, &ValidateOptions { harness_actions: true, ..Default::default() }).unwrap();
        assert_eq!(parsed.hooks.len(), 3);
    }

    #[test]
    fn unknown_event_bad_path_and_oversized_message_give_one_problem_each() {
        let spec = json!({
            "id": "bad",
            "hooks": [
                {"event": "on_lunch", "condition": "always", "action": "warn", "message": "x"},
                {"event": "after_tool", "condition": {"lte": ["state.remaning_steps", 2]}, "action": "warn", "message": "y"},
                {"event": "after_tool", "condition": "always", "action": "warn", "message": "z".repeat(50 * 1024)}
            ]
        });
        let got = problems(spec);
        assert_eq!(got.len(), 3, "{got:#?}");
        assert!(got[0].starts_with("hooks[0].event: unknown event `on_lunch`"), "{}", got[0]);
        assert!(got[1].starts_with("hooks[1].condition.lte[0]: unknown path `state.remaning_steps`"), "{}", got[1]);
        assert!(got[2].starts_with("hooks[2].message: text is 51200 bytes; the limit is 8192"), "{}", got[2]);
    }

    #[test]
    fn unknown_fields_actions_conditions_and_operators_are_named() {
        let got = problems(json!({
            "id": "x", "colour": "red",
            "prompt_rules": [{"slot": "sidebar", "text": "t", "weight": 2}],
            "hooks": [
                {"event": "after_tool", "condition": "moon_is_full", "action": "warn", "message": "m"},
                {"event": "after_tool", "condition": "always", "action": "explode", "message": "m"},
                {"event": "after_tool", "condition": {"matches": ["observation.text", ".*"]}, "action": "warn", "message": "m"},
                {"event": "after_tool", "condition": "always", "action": "warn", "message": "m", "when": 1}
            ]
        }));
        let expect = [
            "colour: unknown field `colour`",
            "prompt_rules[0].weight: unknown field `weight`",
            "prompt_rules[0].slot: unknown slot `sidebar`",
            "hooks[0].condition: unknown condition `moon_is_full`",
            "hooks[1].action: unknown action `explode`",
            "hooks[2].condition.matches: unknown operator `matches`",
            "hooks[3].when: unknown field `when`",
        ];
        assert_eq!(got.len(), expect.len(), "{got:#?}");
        for (g, e) in got.iter().zip(expect) {
            assert!(g.starts_with(e), "{g} should start with {e}");
        }
    }

    #[test]
    fn duplicate_ids_are_reported_with_the_first_location() {
        let got = problems(json!({
            "id": "x",
            "skills": [{"name": "a", "text": "t"}, {"name": "a", "text": "u"}],
            "hooks": [
                {"id": "h", "event": "after_tool", "condition": "always", "action": "warn", "message": "m"},
                {"id": "h", "event": "after_tool", "condition": "always", "action": "warn", "message": "m"}
            ]
        }));
        assert_eq!(
            got,
            vec![
                "skills[1].name: duplicate skill name `a` (first at skills[0].name)".to_string(),
                "hooks[1].id: duplicate hook id `h` (first at hooks[0].id)".to_string(),
            ]
        );
    }

    #[test]
    fn event_action_and_parameter_mismatches() {
        let got = problems(json!({
            "id": "x",
            "hooks": [
                {"event": "after_tool", "condition": "always", "action": "block_and_prompt", "message": "m"},
                {"event": "before_decision", "condition": {"eq": ["action.tool", "execute_sql"]}, "action": "warn", "message": "m"},
                {"event": "after_tool", "condition": "remaining_steps_lte", "action": "warn", "message": "m"},
                {"event": "after_tool", "condition": "always", "action": "warn", "message": "m", "parameters": {"threshold": 2}},
                {"event": "before_action", "condition": "always", "action": "force_action"},
                {"event": "after_tool", "condition": "always", "action": "warn", "message": ""},
                {"event": "after_tool", "condition": {"lt": ["state.remaining_steps", "two"]}, "action": "warn", "message": "m"},
                {"event": "after_tool", "condition": "text_only_reply", "action": "warn", "message": "m"}
            ]
        }));
        let expect = [
            "hooks[0].action: `block_and_prompt` needs a pending action",
            "hooks[1].condition.eq[0]: `action.tool` is not available at before_decision",
            "hooks[2].parameters: condition `remaining_steps_lte` needs parameter `threshold`",
            "hooks[3].parameters.threshold: unknown parameter `threshold`",
            "hooks[4].parameters: `force_action` needs parameter `tool`",
            "hooks[5]: a `warn` hook needs a non-empty `message`",
            "hooks[6].condition.lt[1]: `lt` compares with a number",
            "hooks[7].condition: `text_only_reply` cannot be evaluated at after_tool",
        ];
        assert_eq!(got.len(), expect.len(), "{got:#?}");
        for (g, e) in got.iter().zip(expect) {
            assert!(g.starts_with(e), "{g} should start with {e}");
        }
    }

    #[test]
    fn tools_are_checked_when_the_environment_is_known() {
        let opts =
            ValidateOptions { tools: Some(vec!["execute_sql".into(), "commit_final_answer".into()]), harness_actions: true, base: false };
        let spec = json!({
            "id": "x",
            "tool_view": {"tools": [{"name": "run_python"}]},
            "hooks": [{"event": "before_decision", "condition": "always", "action": "force_action",
                       "parameters": {"tool": "submit", "args": {}}}]
        });
        let got: Vec<String> = validate_value(&spec, &opts).iter().map(|p| p.to_string()).collect();
        assert_eq!(got.len(), 2, "{got:#?}");
        assert!(got[0].starts_with("tool_view.tools[0].name: unknown tool `run_python`"));
        assert!(got[1].starts_with("hooks[0].parameters.tool: unknown tool `submit`"));
    }

    #[test]
    fn non_json_and_wrong_types_are_errors_not_panics() {
        match parse_spec("f.json", "{\"id\": ", &ValidateOptions::default()) {
            Err(SpecError::Json { file, line, .. }) => assert_eq!((file.as_str(), line), ("f.json", 1)),
            other => panic!("expected a JSON error, got {other:?}"),
        }
        let got = problems(json!({"id": 3, "hooks": {"a": 1}, "generation": -1}));
        assert_eq!(got.len(), 3, "{got:#?}");
        assert!(problems(json!([1, 2]))[0].starts_with("(spec): expected an object"));
    }

    #[test]
    fn the_example_pools_validate_against_dbbench_tools() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
        let opts =
            ValidateOptions { tools: Some(vec!["execute_sql".into(), "commit_final_answer".into()]), harness_actions: true, base: false };
        let load = |folder: &str| -> Vec<HarnessSpec> {
            let mut specs: Vec<HarnessSpec> = std::fs::read_dir(root.join(folder))
                .unwrap()
                .map(|entry| {
                    let path = entry.unwrap().path();
                    let text = std::fs::read_to_string(&path).unwrap();
                    let spec = parse_spec(&path.display().to_string(), &text, &opts).unwrap_or_else(|e| panic!("{e}"));
                    if spec.id != schemas::H0_ID {
                        assert_eq!(spec.parent.as_deref(), Some("h0"), "{}", path.display());
                        assert!(
                            spec.direction.is_some()
                                && spec
                                    != HarnessSpec {
                                        id: spec.id.clone(),
                                        parent: spec.parent.clone(),
                                        direction: spec.direction.clone(),
                                        generation: spec.generation,
                                        ..HarnessSpec::h0()
                                    },
                            "{}: a sibling is a repair",
                            path.display()
                        );
                    }
                    spec
                })
                .collect();
            specs.sort_by(|a, b| a.id.cmp(&b.id));
            specs
        };
        let pool = load("pool");
        let ids: Vec<&str> = pool.iter().map(|s| s.id.as_str()).collect();
        assert_eq!(ids, vec!["h0", "s1-example-answer", "s2-example-query", "s3-two-examples", "s4-two-examples-alt"]);
        // The default pool rescues through the policy's own tokens: demonstrations, rules,
        // guidance — never a hook that forces or rewrites the action (harness tokens are
        // not trained on, so the policy would learn nothing it keeps under H0).
        for s in &pool {
            for h in &s.hooks {
                assert!(!matches!(h.action, schemas::HookAction::ForceAction | schemas::HookAction::RewriteAction), "{}: {h:?}", s.id);
            }
        }
        let hooks: Vec<String> = load("hooks").into_iter().map(|s| s.id).collect();
        assert_eq!(hooks, vec!["h0", "s1-inspect-schema", "s2-commit-answer", "s3-quote-identifiers"]);
    }

    #[test]
    fn hiding_every_offered_tool_is_a_problem() {
        let opts = ValidateOptions { tools: Some(vec!["a".into(), "b".into()]), harness_actions: true, base: false };
        let spec = json!({"id": "x", "tool_view": {"tools": [{"name": "a", "shown": false}, {"name": "b", "shown": false}]}});
        let got: Vec<String> = validate_value(&spec, &opts).iter().map(|p| p.to_string()).collect();
        assert_eq!(got, vec!["tool_view.tools: hides every tool the environment offers; the policy could not act".to_string()]);
    }

    #[test]
    fn the_paper_table_7_edits_validate_as_written() {
        // Harness-S Appendix D, Table 7: S6 (pagination), S7 (intersection rule), S8 (low budget).
        let spec = json!({
            "id": "table7", "parent": "h0",
            "prompt_rules": [{"slot": "action_guidance", "text": "If the request combines conditions, fetch each condition separately and compute the intersection; do not broaden an item to its containing collection."}],
            "hooks": [
                {"action": "warn", "condition": "pagination_present", "event": "after_tool",
                 "message": "Pagination metadata is present. Continue only until an empty or short page or an authoritative total; do not treat the first page as complete.",
                 "parameters": {}},
                {"action": "warn", "condition": "remaining_steps_lte", "event": "after_tool",
                 "message": "Execution budget is low. Finish only the required verification and reserve one step for complete_task; avoid unrelated exploration.",
                 "parameters": {"threshold": 3}}
            ]
        });
        assert_eq!(problems(spec), Vec::<String>::new());
    }

    #[test]
    fn check_spec_accepts_h0() {
        assert!(check_spec(&HarnessSpec::h0(), &ValidateOptions::default()).is_empty());
    }
}
