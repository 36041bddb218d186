//! The harness runtime: one [`Session`] per episode. It builds the context the policy sees
//! (system prompt, prompt rules by slot, skills, memory, context items, tool view), runs
//! hooks at the four lifecycle points of Harness-R1 §3.1 (episode_start, before_decision,
//! before_action, after_tool) with the effects of its Appendix 9 / Harness-S Table 7 (warn
//! / inject_hint, block_and_prompt, rewrite_action, force_action), and enforces execution
//! budgets (Harness-S Appendix F, Table 8).
//!
//! The session is a pure state machine: it never calls the policy or the environment. The
//! episode driver (`crate::rollout`) asks it what to do next ([`Session::next_step`]), makes the
//! call, and reports back ([`Session::record_reply`], [`Session::before_action`],
//! [`Session::after_tool`]). That keeps every hook effect unit-testable without IO.
//!
//! Every text the runtime adds is a [`Turn`] with `source = harness` (or `system` for the
//! base prompt) and an empty, all-false loss mask, so the learner never trains on it
//! (Harness-S Appendix B: only policy tokens enter the loss).
//!
//! Hook effects by lifecycle point (validation rejects the combinations marked "—"):
//!
//! | event           | warn / inject_hint                  | block_and_prompt                 | rewrite_action                  | force_action                        |
//! |-----------------|-------------------------------------|----------------------------------|---------------------------------|-------------------------------------|
//! | episode_start   | hint after the task                 | —                                | —                               | the first action is the hook's      |
//! | before_decision | hint, then the policy is asked      | —                                | —                               | the hook's action instead of a call |
//! | before_action   | hint after the action's result      | call suppressed, policy re-asked | call's args/tool replaced       | call replaced by the hook's         |
//! | after_tool      | hint after the result               | —                                | —                               | the next action is the hook's       |
//!
//! All matching warns fire, in spec order; of the mediating hooks (block, rewrite, force)
//! only the first matching one applies. Harness-made actions skip before_action hooks.
//! `max_fires` limits how often a hook fires per episode.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::condition::{eval, parse_extractions, render_template, run_extractions, Extraction, Scope, StateView};
use crate::env::{EpisodeStart, Observation, ToolCall, ToolSpec};
use crate::policy::{Message, PolicyOutput, SamplingParams};
use schemas::{HarnessSpec, Hook, HookAction, HookEvent, Role, Termination, Turn, TurnSource};

/// The base system prompt of every harness (H0 adds nothing to it).
pub const BASE_SYSTEM_PROMPT: &str = "You solve the task below by calling the tools you are given, one tool call per \
reply. Each tool result comes back to you in the next message. Use what the results show, not guesses. When you know \
the final answer, submit it with the tool meant for final answers; the episode ends when you do.";

/// Execution budgets of one episode. Defaults are the limits of Harness-S Appendix F,
/// Table 8: 32 model calls, 30 environment actions, 65,532 context tokens and 8,192
/// output tokens per call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Budgets {
    pub max_model_calls: u32,
    pub max_env_actions: u32,
    pub max_context_tokens: u64,
    pub max_output_tokens: u32,
}

impl Default for Budgets {
    fn default() -> Self {
        // Harness-S Appendix F, Table 8 ("Execution limits").
        Budgets { max_model_calls: 32, max_env_actions: 30, max_context_tokens: 65_532, max_output_tokens: 8_192 }
    }
}

/// Rough token count of a text when the backend reports none (about 4 bytes per token
/// for English and SQL under BPE tokenizers).
pub fn approx_tokens(text: &str) -> u64 {
    (text.len() as u64).div_ceil(4)
}

/// Why a session cannot start.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("harness `{harness}`: tool_view names `{tool}`, which the environment does not offer (it offers: {offered})")]
    UnknownTool { harness: String, tool: String, offered: String },
}

/// A policy call the driver should make.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicyRequest {
    pub messages: Vec<Message>,
    pub tools: Vec<ToolSpec>,
    pub sampling: SamplingParams,
}

/// What the driver does next.
#[derive(Debug, Clone, PartialEq)]
pub enum Next {
    /// The episode is over.
    Stop(Termination),
    /// Call the policy; report its answer with [`Session::record_reply`].
    Ask(PolicyRequest),
    /// Execute an action the harness chose (force_action); it skips before_action hooks.
    Act(ToolCall),
}

/// The outcome of before_action hooks for a proposed call.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// Execute this call (possibly rewritten or replaced by a hook).
    Execute(ToolCall),
    /// The call was blocked; ask the policy again ([`Session::next_step`]).
    Blocked,
    /// The episode is over (no environment action left).
    Stop(Termination),
}

/// Counters of an episode, copied onto its trajectory row.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub model_calls: u32,
    pub env_actions: u32,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// Estimated tokens of harness-injected text (never trained on).
    pub harness_tokens: u64,
}

/// A hook that fired, with its effect resolved against the current scope.
struct Fired {
    index: usize,
    hook_id: String,
    action: HookAction,
    message: String,
    /// The call built from `parameters` for rewrite_action / force_action.
    call: Option<ToolCall>,
}

/// One episode of the harness runtime.
pub struct Session {
    spec: HarnessSpec,
    budgets: Budgets,
    sampling: SamplingParams,
    tools: Vec<ToolSpec>,
    turns: Vec<Turn>,
    state: StateView,
    history: Vec<ToolCall>,
    last_observation: Observation,
    text_only_reply: bool,
    queued: Option<(ToolCall, String, String)>,
    deferred_hints: Vec<(String, String)>,
    fires: Vec<u32>,
    /// Each hook's compiled extractions (validation guarantees they compile; a hook whose
    /// extractions do not gets none and can never fire).
    extractions: Vec<Option<Vec<Extraction>>>,
    usage: Usage,
    /// Tokens the backend counted at the latest call (prompt + completion), and the number
    /// of turns at that point: the base of the context estimate.
    calibration: Option<(u64, usize)>,
}

impl Session {
    /// Builds the context and runs the episode_start hooks.
    pub fn start(spec: &HarnessSpec, budgets: Budgets, sampling: SamplingParams, start: &EpisodeStart) -> Result<Session, RuntimeError> {
        let tools = apply_tool_view(spec, &start.tools)?;
        let mut session = Session {
            spec: spec.clone(),
            budgets,
            sampling,
            tools,
            turns: Vec::new(),
            state: StateView {
                max_rounds: start.max_rounds,
                task_type: start.task_type.clone(),
                features: start.features.clone(),
                ..Default::default()
            },
            history: Vec::new(),
            last_observation: start.observation.clone(),
            text_only_reply: false,
            queued: None,
            deferred_hints: Vec::new(),
            fires: vec![0; spec.hooks.len()],
            extractions: spec.hooks.iter().map(|h| parse_extractions(h.parameters.get("extract")).ok()).collect(),
            usage: Usage::default(),
            calibration: None,
        };
        session.build_context(&start.observation);
        session.refresh_state();
        for fired in session.fire(HookEvent::EpisodeStart, None) {
            match fired.action {
                HookAction::Warn => session.hint(fired.message, fired.hook_id),
                HookAction::ForceAction => {
                    if let Some(call) = fired.call {
                        session.queued = Some((call, fired.message, fired.hook_id));
                    }
                }
                // Validation keeps mediation of a pending action to before_action.
                HookAction::BlockAndPrompt | HookAction::RewriteAction => {}
            }
        }
        Ok(session)
    }

    /// The system prompt and the first user message: base prompt and harness additions
    /// by slot, skills and memory in the system message; task preamble and context items,
    /// then the task itself, in the first user message.
    fn build_context(&mut self, task: &Observation) {
        self.push(Role::System, TurnSource::System, BASE_SYSTEM_PROMPT.to_string(), None, None);
        let spec = self.spec.clone();
        let rules = |slot: &str| -> Vec<&str> { spec.prompt_rules.iter().filter(|r| r.slot == slot).map(|r| r.text.as_str()).collect() };
        let mut system = Vec::new();
        system.extend(rules("system").into_iter().map(str::to_string));
        for (slot, title) in
            [("action_guidance", "How to act"), ("answer_format", "Answer format"), ("error_recovery", "When an action fails")]
        {
            let texts = rules(slot);
            if !texts.is_empty() {
                system.push(format!("## {title}\n{}", texts.join("\n")));
            }
        }
        if !spec.skills.is_empty() {
            let skills: Vec<String> = spec.skills.iter().map(|s| format!("### {}\n{}", s.name, s.text)).collect();
            system.push(format!("## Skills\n{}", skills.join("\n\n")));
        }
        if !spec.memory.is_empty() {
            let notes: Vec<String> = spec.memory.iter().map(|m| format!("- {}: {}", m.key, m.text)).collect();
            system.push(format!("## Notes\n{}", notes.join("\n")));
        }
        if !system.is_empty() {
            self.push(Role::System, TurnSource::Harness, system.join("\n\n"), None, None);
        }
        // Demonstrations as chat turns (validation guarantees user first, assistant last).
        for example in &spec.examples {
            for turn in &example.turns {
                let role = match turn.role.as_str() {
                    "assistant" => Role::Assistant,
                    "tool" => Role::Tool,
                    _ => Role::User,
                };
                self.push(role, TurnSource::Harness, turn.text.clone(), None, None);
            }
        }
        let mut preamble: Vec<String> = rules("task_preamble").into_iter().map(str::to_string).collect();
        preamble.extend(spec.context.iter().map(|c| format!("## {}\n{}", c.name, c.text)));
        if !preamble.is_empty() {
            self.push(Role::User, TurnSource::Harness, preamble.join("\n\n"), None, None);
        }
        self.push(Role::User, TurnSource::Env, task.text.clone(), None, None);
    }

    /// What to do next: a queued forced action, a policy call (after before_decision
    /// hooks), or stop because a budget ran out.
    pub fn next_step(&mut self) -> Next {
        self.refresh_state();
        if self.state.remaining_env_actions == 0 {
            return Next::Stop(Termination::BudgetExhausted);
        }
        if let Some((call, message, hook_id)) = self.queued.take() {
            self.push_harness_call(&call, message, hook_id);
            return Next::Act(call);
        }
        if self.usage.model_calls >= self.budgets.max_model_calls {
            return Next::Stop(Termination::BudgetExhausted);
        }
        for fired in self.fire(HookEvent::BeforeDecision, None) {
            match fired.action {
                HookAction::Warn => self.hint(fired.message, fired.hook_id),
                HookAction::ForceAction => {
                    if let Some(call) = fired.call {
                        // The harness acted on the latest reply: it no longer awaits one.
                        self.text_only_reply = false;
                        self.push_harness_call(&call, fired.message, fired.hook_id);
                        return Next::Act(call);
                    }
                }
                HookAction::BlockAndPrompt | HookAction::RewriteAction => {}
            }
        }
        let context = self.context_tokens();
        if context >= self.budgets.max_context_tokens {
            return Next::Stop(Termination::ContextLimit);
        }
        let mut sampling = self.sampling.clone();
        let room = (self.budgets.max_context_tokens - context).min(u64::from(u32::MAX)) as u32;
        sampling.max_tokens = sampling.max_tokens.min(self.budgets.max_output_tokens).min(room);
        self.usage.model_calls += 1;
        self.text_only_reply = false;
        Next::Ask(PolicyRequest { messages: self.messages(), tools: self.tools.clone(), sampling })
    }

    /// Records the policy's reply; returns the call to act on (the first, if several).
    /// A reply without a tool call gets a reminder and the driver asks again.
    pub fn record_reply(&mut self, out: PolicyOutput) -> Option<ToolCall> {
        let call = out.tool_calls.first().cloned();
        self.state.last_reply = out.text.clone();
        self.usage.prompt_tokens += u64::from(out.prompt_tokens);
        self.usage.completion_tokens += u64::from(out.completion_tokens);
        let turn = Turn {
            index: self.turns.len() as u32,
            role: Role::Assistant,
            source: TurnSource::Policy,
            loss_mask: vec![true; out.token_ids.len()],
            token_ids: out.token_ids,
            logprobs: out.logprobs,
            tool_name: call.as_ref().map(|c| c.name.clone()),
            tool_args: call.as_ref().map(|c| c.args.to_string()),
            hook_id: None,
            prompt_token_count: out.prompt_tokens,
            prompt_hash: out.prompt_hash,
            text: out.text,
        };
        self.turns.push(turn);
        if out.prompt_tokens > 0 {
            let counted = u64::from(out.prompt_tokens) + u64::from(out.completion_tokens);
            self.calibration = Some((counted, self.turns.len()));
        }
        match call {
            Some(c) => {
                self.state.text_only_turns = 0;
                Some(c)
            }
            None => {
                self.state.text_only_turns += 1;
                self.text_only_reply = true;
                let names: Vec<&str> = self.tools.iter().map(|t| t.name.as_str()).collect();
                let reminder = format!("Your reply called no tool. Reply with a call to one of: {}.", names.join(", "));
                self.push(Role::User, TurnSource::Harness, reminder, None, None);
                None
            }
        }
    }

    /// Runs before_action hooks on a call the policy proposed.
    pub fn before_action(&mut self, call: ToolCall) -> Verdict {
        self.refresh_state();
        if !self.tools.iter().any(|t| t.name == call.name) {
            let names: Vec<&str> = self.tools.iter().map(|t| t.name.as_str()).collect();
            let text = format!("There is no tool `{}`. Available tools: {}.", call.name, names.join(", "));
            self.push(Role::Tool, TurnSource::Harness, text, Some(&call), None);
            self.state.last_action_failed = true;
            return Verdict::Blocked;
        }
        if self.state.remaining_env_actions == 0 {
            return Verdict::Stop(Termination::BudgetExhausted);
        }
        for fired in self.fire(HookEvent::BeforeAction, Some(&call)) {
            match fired.action {
                HookAction::Warn => self.deferred_hints.push((fired.message, fired.hook_id)),
                HookAction::BlockAndPrompt => {
                    self.push(Role::Tool, TurnSource::Harness, fired.message, Some(&call), Some(fired.hook_id));
                    self.flush_deferred();
                    return Verdict::Blocked;
                }
                HookAction::RewriteAction | HookAction::ForceAction => {
                    if let Some(new_call) = fired.call {
                        let note = if fired.message.is_empty() {
                            "The harness replaced this call with the one that follows.".to_string()
                        } else {
                            fired.message.clone()
                        };
                        self.push(Role::Tool, TurnSource::Harness, note, Some(&call), Some(fired.hook_id.clone()));
                        self.push_harness_call(&new_call, String::new(), fired.hook_id);
                        return Verdict::Execute(new_call);
                    }
                }
            }
        }
        Verdict::Execute(call)
    }

    /// Records an executed action's observation and runs after_tool hooks. Returns the
    /// termination when the environment ended the episode.
    pub fn after_tool(&mut self, call: &ToolCall, obs: Observation) -> Option<Termination> {
        self.usage.env_actions += 1;
        self.state.repeated_actions = if self.history.last() == Some(call) { self.state.repeated_actions + 1 } else { 1 };
        self.history.push(call.clone());
        self.state.last_tool = call.name.clone();
        self.state.last_action_failed = obs.action_failed;
        self.state.consecutive_failures = if obs.action_failed { self.state.consecutive_failures + 1 } else { 0 };
        // `done` before the round limit can only be a commit; at the limit only the
        // environment's `committed` flag tells the two apart.
        let committed = obs.committed || (obs.done && self.usage.env_actions < self.state.max_rounds);
        self.state.answer_committed |= committed;
        self.push(Role::Tool, TurnSource::Env, obs.text.clone(), Some(call), None);
        self.last_observation = obs;
        self.flush_deferred();
        if self.last_observation.done {
            return Some(if committed { Termination::Committed } else { Termination::RoundLimit });
        }
        self.refresh_state();
        for fired in self.fire(HookEvent::AfterTool, Some(call)) {
            match fired.action {
                HookAction::Warn => self.hint(fired.message, fired.hook_id),
                HookAction::ForceAction => {
                    if self.queued.is_none() {
                        if let Some(c) = fired.call {
                            self.queued = Some((c, fired.message, fired.hook_id));
                        }
                    }
                }
                HookAction::BlockAndPrompt | HookAction::RewriteAction => {}
            }
        }
        None
    }

    /// The transcript so far.
    pub fn turns(&self) -> &[Turn] {
        &self.turns
    }

    /// The tools the policy is shown (after the tool view).
    pub fn tools(&self) -> &[ToolSpec] {
        &self.tools
    }

    /// Current counters.
    pub fn usage(&self) -> Usage {
        let mut u = self.usage;
        u.harness_tokens = self.turns.iter().filter(|t| t.source == TurnSource::Harness).map(|t| approx_tokens(&t.text)).sum();
        u
    }

    /// The state hooks see.
    pub fn state(&mut self) -> &StateView {
        self.refresh_state();
        &self.state
    }

    /// Ends the session: the transcript and the counters.
    pub fn finish(self) -> (Vec<Turn>, Usage) {
        let usage = self.usage();
        (self.turns, usage)
    }

    /// The chat messages the policy sees ([`chat_messages`] of the transcript).
    pub fn messages(&self) -> Vec<Message> {
        chat_messages(&self.turns)
    }

    fn refresh_state(&mut self) {
        let s = &mut self.state;
        s.model_calls = self.usage.model_calls;
        s.env_actions = self.usage.env_actions;
        s.remaining_model_calls = self.budgets.max_model_calls.saturating_sub(self.usage.model_calls);
        let cap = self.budgets.max_env_actions.min(s.max_rounds);
        s.remaining_env_actions = cap.saturating_sub(self.usage.env_actions);
        s.remaining_steps = s.remaining_env_actions.min(s.remaining_model_calls);
        s.hints_injected = self.turns.iter().filter(|t| t.source == TurnSource::Harness).count() as u32;
        self.state.context_tokens = self.context_tokens();
    }

    /// Estimated tokens of the next prompt: what the backend counted at the latest call
    /// plus an estimate for turns added since, or an estimate of everything.
    fn context_tokens(&self) -> u64 {
        let tools: u64 = self.tools.iter().map(|t| approx_tokens(&t.description) + approx_tokens(&t.parameters.to_string())).sum();
        match self.calibration {
            Some((counted, at)) => counted + self.turns[at..].iter().map(|t| approx_tokens(&t.text)).sum::<u64>(),
            None => tools + self.turns.iter().map(|t| approx_tokens(&t.text) + 4).sum::<u64>(),
        }
    }

    /// Evaluates the hooks of one event in spec order. Every matching warn fires; of the
    /// mediating hooks (block / rewrite / force) only the first matching one applies.
    fn fire(&mut self, event: HookEvent, action: Option<&ToolCall>) -> Vec<Fired> {
        let mut fired = Vec::new();
        let mut mediated = false;
        for (index, hook) in self.spec.hooks.iter().enumerate() {
            if hook.event != event {
                continue;
            }
            if let Some(max) = hook.parameters.get("max_fires").and_then(Value::as_u64) {
                if u64::from(self.fires[index]) >= max {
                    continue;
                }
            }
            let is_mediation = hook.action != HookAction::Warn;
            if is_mediation && mediated {
                continue;
            }
            let Some(extractions) = &self.extractions[index] else { continue };
            let mut scope = Scope {
                event,
                state: &self.state,
                action,
                observation: Some(&self.last_observation),
                history: &self.history,
                text_only_reply: self.text_only_reply,
                params: &hook.parameters,
                extracted: &BTreeMap::new(),
            };
            let extracted = if extractions.is_empty() {
                BTreeMap::new()
            } else {
                match run_extractions(extractions, &scope) {
                    Some(values) => values,
                    None => continue,
                }
            };
            scope.extracted = &extracted;
            if !eval(&hook.condition, &scope) {
                continue;
            }
            let call = build_call(hook, action, &scope);
            mediated |= is_mediation;
            fired.push(Fired { index, hook_id: hook_id(hook, index), action: hook.action, message: hook.message.clone(), call });
        }
        for f in &fired {
            self.fires[f.index] += 1;
        }
        fired
    }

    fn hint(&mut self, text: String, hook_id: String) {
        self.push(Role::User, TurnSource::Harness, text, None, Some(hook_id));
    }

    fn flush_deferred(&mut self) {
        for (text, hook_id) in std::mem::take(&mut self.deferred_hints) {
            self.hint(text, hook_id);
        }
    }

    fn push_harness_call(&mut self, call: &ToolCall, message: String, hook_id: String) {
        self.push(Role::Assistant, TurnSource::Harness, message, Some(call), Some(hook_id));
    }

    /// Appends a non-policy turn: no token ids, an all-false (empty) loss mask.
    fn push(&mut self, role: Role, source: TurnSource, text: String, call: Option<&ToolCall>, hook_id: Option<String>) {
        self.turns.push(Turn {
            tool_name: call.map(|c| c.name.clone()),
            tool_args: call.map(|c| c.args.to_string()),
            hook_id,
            ..Turn::context(self.turns.len() as u32, role, source, text)
        });
    }
}

/// The chat messages a policy is shown for a transcript: turns in order, adjacent system
/// or user turns merged (one system message; the task and harness notes in one user
/// message), assistant turns with their tool call. The rollout asks the policy with these
/// and the learner rebuilds each policy turn's prompt from the turns before it with the
/// same function, so both see one rendering.
pub fn chat_messages(turns: &[Turn]) -> Vec<Message> {
    let mut out: Vec<Message> = Vec::new();
    for t in turns {
        let mergeable = matches!(t.role, Role::System | Role::User);
        if mergeable {
            if let Some(last) = out.last_mut() {
                if last.role == t.role {
                    last.content.push_str("\n\n");
                    last.content.push_str(&t.text);
                    continue;
                }
            }
        }
        let mut m = Message::new(t.role, t.text.clone());
        if t.role == Role::Assistant {
            if let Some(name) = &t.tool_name {
                let args = t.tool_args.as_deref().and_then(|a| serde_json::from_str(a).ok()).unwrap_or(Value::Null);
                m.tool_calls.push(ToolCall { name: name.clone(), args });
            }
        }
        out.push(m);
    }
    out
}

fn hook_id(hook: &Hook, index: usize) -> String {
    hook.id.clone().unwrap_or_else(|| format!("hooks[{index}]"))
}

/// The call a rewrite_action / force_action hook produces: `parameters.tool` (or the
/// pending call's tool) with `parameters.args` rendered; a rewrite merges the rendered
/// arguments over the pending call's arguments.
fn build_call(hook: &Hook, pending: Option<&ToolCall>, scope: &Scope<'_>) -> Option<ToolCall> {
    let tool = hook.parameters.get("tool").and_then(Value::as_str);
    let args = hook.parameters.get("args").map(|a| render_template(a, scope));
    match hook.action {
        HookAction::ForceAction => {
            Some(ToolCall { name: tool?.to_string(), args: args.unwrap_or_else(|| Value::Object(Default::default())) })
        }
        HookAction::RewriteAction => {
            let pending = pending?;
            let mut new_args = pending.args.clone();
            match (args, new_args.as_object_mut()) {
                (Some(Value::Object(over)), Some(base)) => base.extend(over),
                (Some(over), _) => new_args = over,
                (None, _) => {}
            }
            Some(ToolCall { name: tool.unwrap_or(&pending.name).to_string(), args: new_args })
        }
        HookAction::Warn | HookAction::BlockAndPrompt => None,
    }
}

/// Applies the spec's tool view to the environment's tools: hidden tools are removed,
/// descriptions replaced; tools the view does not mention are shown unchanged.
fn apply_tool_view(spec: &HarnessSpec, offered: &[ToolSpec]) -> Result<Vec<ToolSpec>, RuntimeError> {
    let Some(view) = &spec.tool_view else { return Ok(offered.to_vec()) };
    let by_name: BTreeMap<&str, _> = view.tools.iter().map(|e| (e.name.as_str(), e)).collect();
    for entry in &view.tools {
        if !offered.iter().any(|t| t.name == entry.name) {
            return Err(RuntimeError::UnknownTool {
                harness: spec.id.clone(),
                tool: entry.name.clone(),
                offered: offered.iter().map(|t| t.name.as_str()).collect::<Vec<_>>().join(", "),
            });
        }
    }
    Ok(offered
        .iter()
        .filter_map(|t| match by_name.get(t.name.as_str()) {
            Some(e) if !e.shown => None,
            Some(e) => Some(ToolSpec { description: e.description.clone().unwrap_or_else(|| t.description.clone()), ..t.clone() }),
            None => Some(t.clone()),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::FinishReason;
    use serde_json::json;

    fn tools() -> Vec<ToolSpec> {
        vec![
            ToolSpec {
                name: "execute_sql".into(),
                description: "Run SQL.".into(),
                parameters: json!({"type": "object", "properties": {"query": {"type": "string"}}}),
            },
            ToolSpec {
                name: "commit_final_answer".into(),
                description: "Commit the answer.".into(),
                parameters: json!({"type": "object", "properties": {"answers": {"type": "array"}}}),
            },
        ]
    }

    fn start() -> EpisodeStart {
        let mut features = serde_json::Map::new();
        features.insert("table_name".into(), json!("Team Stats"));
        EpisodeStart {
            observation: Observation { text: "How many rows have age > 30?".into(), ..Default::default() },
            tools: tools(),
            max_rounds: 5,
            task_type: "counting".into(),
            features,
        }
    }

    fn spec(hooks: Value) -> HarnessSpec {
        let v = json!({"id": "s1", "parent": "h0", "hooks": hooks});
        // Hooks that act for the policy are what these tests exercise.
        let opts = super::super::ValidateOptions { harness_actions: true, ..Default::default() };
        super::super::validate::spec_from_value("test", &v, &opts).expect("valid test spec")
    }

    fn session(hooks: Value) -> Session {
        Session::start(&spec(hooks), Budgets::default(), SamplingParams::default(), &start()).unwrap()
    }

    fn sql(q: &str) -> ToolCall {
        ToolCall { name: "execute_sql".into(), args: json!({"query": q}) }
    }

    fn reply(text: &str, call: Option<ToolCall>) -> PolicyOutput {
        PolicyOutput {
            prompt_hash: None,
            text: text.into(),
            tool_calls: call.into_iter().collect(),
            token_ids: vec![1, 2, 3],
            logprobs: vec![-0.1, -0.2, -0.3],
            prompt_tokens: 0,
            completion_tokens: 3,
            finish_reason: FinishReason::ToolCalls,
        }
    }

    fn rows(text: &str) -> Observation {
        Observation { text: text.into(), ..Default::default() }
    }

    fn ask(s: &mut Session) -> PolicyRequest {
        match s.next_step() {
            Next::Ask(r) => r,
            other => panic!("expected a policy call, got {other:?}"),
        }
    }

    /// Every non-policy turn has an empty (all-false) mask and no token ids; every policy
    /// turn is masked in, token for token.
    fn assert_masks(turns: &[Turn]) {
        for t in turns {
            if t.source == TurnSource::Policy {
                assert_eq!(t.loss_mask.len(), t.token_ids.len());
                assert!(t.loss_mask.iter().all(|m| *m));
            } else {
                assert!(t.loss_mask.iter().all(|m| !*m), "turn {} ({:?}) is trained on", t.index, t.source);
                assert!(t.token_ids.is_empty());
            }
        }
    }

    fn harness_turns(s: &Session) -> Vec<&Turn> {
        s.turns().iter().filter(|t| t.source == TurnSource::Harness).collect()
    }

    #[test]
    fn h0_context_is_base_prompt_then_task() {
        let mut s = Session::start(&HarnessSpec::h0(), Budgets::default(), SamplingParams::default(), &start()).unwrap();
        let req = ask(&mut s);
        assert_eq!(req.messages.len(), 2);
        assert_eq!(req.messages[0], Message::new(Role::System, BASE_SYSTEM_PROMPT));
        assert_eq!(req.messages[1].content, "How many rows have age > 30?");
        assert_eq!(req.tools, tools());
        assert!(harness_turns(&s).is_empty());
    }

    #[test]
    fn examples_are_chat_turns_between_the_system_prompt_and_the_task() {
        let spec: HarnessSpec = serde_json::from_value(json!({
            "id": "s-ex", "parent": "h0",
            "prompt_rules": [{"slot": "task_preamble", "text": "Be brief."}],
            "examples": [{"name": "ex", "turns": [
                {"role": "user", "text": "Q: 1 + 1?"},
                {"role": "assistant", "text": "```sql\nSELECT 1 + 1;\n```"},
                {"role": "tool", "text": "[(2,)]"},
                {"role": "assistant", "text": "Final Answer: [\"2\"]"}
            ]}]
        }))
        .unwrap();
        let mut s = Session::start(&spec, Budgets::default(), SamplingParams::default(), &start()).unwrap();
        let req = ask(&mut s);
        let roles: Vec<Role> = req.messages.iter().map(|m| m.role).collect();
        assert_eq!(roles, [Role::System, Role::User, Role::Assistant, Role::Tool, Role::Assistant, Role::User]);
        assert_eq!(req.messages[1].content, "Q: 1 + 1?");
        assert_eq!(req.messages[4].content, "Final Answer: [\"2\"]");
        // the task preamble and the task merge into the user turn after the example
        assert_eq!(req.messages[5].content, "Be brief.\n\nHow many rows have age > 30?");
        // example turns are harness text: never trained on
        assert_eq!(harness_turns(&s).len(), 5);
        assert_masks(s.turns());
    }

    #[test]
    fn context_places_rules_by_slot_skills_memory_context_and_tool_view() {
        let v = json!({
            "id": "s2",
            "prompt_rules": [
                {"slot": "system", "text": "Be exact."},
                {"slot": "action_guidance", "text": "Inspect the table first."},
                {"slot": "answer_format", "text": "Answers are strings."},
                {"slot": "task_preamble", "text": "Read the question twice."}
            ],
            "skills": [{"name": "inspect", "text": "SELECT * FROM t LIMIT 3"}],
            "memory": [{"key": "quoting", "text": "quote names with spaces"}],
            "context": [{"name": "Example", "text": "Q: ... A: ..."}],
            "tool_view": {"tools": [
                {"name": "execute_sql", "description": "Run exactly one SQL statement."},
                {"name": "commit_final_answer", "shown": true}
            ]}
        });
        let spec = super::super::validate::spec_from_value("t", &v, &Default::default()).unwrap();
        let mut s = Session::start(&spec, Budgets::default(), SamplingParams::default(), &start()).unwrap();
        let req = ask(&mut s);
        assert_eq!(req.messages.len(), 2, "system and user turns merge into one message each");
        let system = &req.messages[0].content;
        for needle in
            ["Be exact.", "## How to act\nInspect the table first.", "## Answer format", "## Skills\n### inspect", "## Notes\n- quoting"]
        {
            assert!(system.contains(needle), "system prompt lacks {needle:?}:\n{system}");
        }
        assert!(system.starts_with(BASE_SYSTEM_PROMPT));
        let user = &req.messages[1].content;
        assert!(user.starts_with("Read the question twice.\n\n## Example\nQ: ... A: ..."));
        assert!(user.ends_with("How many rows have age > 30?"));
        assert_eq!(req.tools[0].description, "Run exactly one SQL statement.");
        assert_eq!(req.tools[1].description, "Commit the answer.");
        // Turn provenance: base prompt is system, harness additions are harness, task is env.
        let sources: Vec<TurnSource> = s.turns().iter().map(|t| t.source).collect();
        assert_eq!(sources, vec![TurnSource::System, TurnSource::Harness, TurnSource::Harness, TurnSource::Env]);
        assert_masks(s.turns());
    }

    #[test]
    fn tool_view_hides_tools_and_rejects_unknown_ones() {
        let v = json!({"id": "s3", "tool_view": {"tools": [{"name": "commit_final_answer", "shown": false}]}});
        let spec = super::super::validate::spec_from_value("t", &v, &Default::default()).unwrap();
        let mut s = Session::start(&spec, Budgets::default(), SamplingParams::default(), &start()).unwrap();
        assert_eq!(s.tools().len(), 1);
        ask(&mut s);
        // A call to a hidden tool never reaches the environment.
        s.record_reply(reply("", Some(ToolCall { name: "commit_final_answer".into(), args: json!({"answers": ["1"]}) })));
        assert_eq!(s.before_action(ToolCall { name: "commit_final_answer".into(), args: json!({}) }), Verdict::Blocked);
        assert!(s.turns().last().unwrap().text.contains("There is no tool `commit_final_answer`"));

        let v = json!({"id": "s4", "tool_view": {"tools": [{"name": "run_python"}]}});
        let spec = super::super::validate::spec_from_value("t", &v, &Default::default()).unwrap();
        let err = Session::start(&spec, Budgets::default(), SamplingParams::default(), &start()).err().unwrap();
        assert!(err.to_string().contains("`run_python`"), "{err}");
    }

    // ---- each event × action ----

    #[test]
    fn episode_start_warn_injects_a_hint_after_the_task() {
        let mut s =
            session(json!([{"id": "w", "event": "episode_start", "condition": "always", "action": "warn", "message": "Inspect first."}]));
        let req = ask(&mut s);
        assert!(req.messages[1].content.ends_with("How many rows have age > 30?\n\nInspect first."));
        let h = harness_turns(&s);
        assert_eq!(h.len(), 1);
        assert_eq!((h[0].role, h[0].hook_id.as_deref()), (Role::User, Some("w")));
        assert_masks(s.turns());
    }

    #[test]
    fn episode_start_force_action_takes_the_first_step_with_a_template() {
        let mut s = session(json!([{"id": "f", "event": "episode_start", "condition": "always", "action": "force_action",
            "message": "Looking at the table first.",
            "parameters": {"tool": "execute_sql", "args": {"query": "SELECT * FROM `{{state.features.table_name}}` LIMIT 3"}}}]));
        let call = match s.next_step() {
            Next::Act(c) => c,
            other => panic!("expected a forced action, got {other:?}"),
        };
        assert_eq!(call, sql("SELECT * FROM `Team Stats` LIMIT 3"));
        assert_eq!(s.usage().model_calls, 0, "a forced action is not a model call");
        let t = s.turns().last().unwrap();
        assert_eq!((t.role, t.source, t.hook_id.as_deref()), (Role::Assistant, TurnSource::Harness, Some("f")));
        assert_eq!(s.after_tool(&call, rows("[('a', 1)]")), None);
        // Next decision is the policy's again.
        let req = ask(&mut s);
        let last = req.messages.last().unwrap();
        assert_eq!((last.role, last.content.as_str()), (Role::Tool, "[('a', 1)]"));
        assert_eq!(req.messages[req.messages.len() - 2].tool_calls, vec![call]);
        assert_masks(s.turns());
    }

    #[test]
    fn mediation_at_episode_start_or_after_tool_is_rejected_by_validation() {
        for (event, action) in [
            ("episode_start", "block_and_prompt"),
            ("episode_start", "rewrite_action"),
            ("before_decision", "block_and_prompt"),
            ("before_decision", "rewrite_action"),
            ("after_tool", "block_and_prompt"),
            ("after_tool", "rewrite_action"),
        ] {
            let params = if action == "rewrite_action" { json!({"tool": "execute_sql"}) } else { json!({}) };
            let v = json!({"id": "x", "hooks": [{"event": event, "condition": "always", "action": action, "message": "m",
                "parameters": params}]});
            let opts = super::super::ValidateOptions { harness_actions: true, ..Default::default() };
            let problems = super::super::validate::validate_value(&v, &opts);
            assert_eq!(problems.len(), 1, "{event} × {action}: {problems:?}");
            assert!(problems[0].message.contains("only at before_action"));
        }
    }

    #[test]
    fn before_decision_warn_precedes_the_policy_call_and_respects_max_fires() {
        let mut s = session(json!([{"id": "low", "event": "before_decision", "condition": "remaining_steps_lte",
            "action": "warn", "message": "Commit your answer now.", "parameters": {"threshold": 4, "max_fires": 1}}]));
        // 5 rounds left: no hint.
        let req = ask(&mut s);
        assert!(!req.messages.iter().any(|m| m.content.contains("Commit your answer now.")));
        let c = s.record_reply(reply("", Some(sql("SELECT 1")))).unwrap();
        let c = match s.before_action(c) {
            Verdict::Execute(c) => c,
            v => panic!("{v:?}"),
        };
        s.after_tool(&c, rows("[(1,)]"));
        // 4 left: the hint is the last user text before the call.
        let req = ask(&mut s);
        let last = req.messages.last().unwrap();
        assert_eq!((last.role, last.content.as_str()), (Role::User, "Commit your answer now."));
        s.record_reply(reply("", Some(sql("SELECT 2"))));
        s.after_tool(&sql("SELECT 2"), rows("[(2,)]"));
        // max_fires = 1: not again.
        let req = ask(&mut s);
        assert_eq!(req.messages.iter().filter(|m| m.content.contains("Commit your answer now.")).count(), 1);
        assert_masks(s.turns());
    }

    #[test]
    fn before_decision_force_action_skips_the_policy() {
        let mut s = session(json!([{"id": "f", "event": "before_decision",
            "condition": {"gte": ["state.env_actions", 1]}, "action": "force_action",
            "parameters": {"tool": "commit_final_answer", "args": {"answers": ["{{observation.text}}"]}, "max_fires": 1}}]));
        ask(&mut s);
        s.record_reply(reply("", Some(sql("SELECT count(*) FROM t"))));
        s.after_tool(&sql("SELECT count(*) FROM t"), rows("2"));
        match s.next_step() {
            Next::Act(c) => assert_eq!(c, ToolCall { name: "commit_final_answer".into(), args: json!({"answers": ["2"]}) }),
            other => panic!("expected a forced commit, got {other:?}"),
        }
        assert_eq!(s.usage().model_calls, 1);
    }

    #[test]
    fn extractions_turn_a_prose_reply_into_an_action_and_gate_the_hook() {
        // Run the SQL a reply wrote outside a ```sql block; commit a single-value result.
        let mut s = session(json!([
            {"id": "run-sql", "event": "before_decision", "condition": "text_only_reply", "action": "force_action",
             "parameters": {"extract": {"sql": {"from": "state.last_reply", "pattern": "(?is)\\b(SELECT\\b[^;]*)"}},
                            "tool": "execute_sql", "args": {"query": "{{extract.sql}}"}}},
            {"id": "commit-value", "event": "after_tool", "condition": {"eq": ["action.tool", "execute_sql"]}, "action": "force_action",
             "parameters": {"extract": {"value": {"from": "observation.text", "pattern": "^\\[\\('?([^()']*)'?,\\)\\]$"}},
                            "tool": "commit_final_answer", "args": {"answers": ["{{extract.value}}"]}}}
        ]));
        ask(&mut s);
        // A prose reply without SQL: no extraction matches, so the policy is asked again.
        assert_eq!(s.record_reply(reply("I think it is two.", None)), None);
        assert!(matches!(s.next_step(), Next::Ask(_)));
        assert_eq!(s.state().last_reply, "I think it is two.");
        // Unfenced SQL: the harness runs it.
        assert_eq!(s.record_reply(reply("Use SELECT count(*) FROM t WHERE age > 30; to count.", None)), None);
        let call = match s.next_step() {
            Next::Act(c) => c,
            other => panic!("expected the stated SQL to run, got {other:?}"),
        };
        assert_eq!(call, sql("SELECT count(*) FROM t WHERE age > 30"));
        // A two-row result does not match the single-value pattern: nothing is committed.
        assert_eq!(s.after_tool(&call, rows("[(1,), (2,)]")), None);
        assert!(matches!(s.next_step(), Next::Ask(_)));
        s.record_reply(reply("", Some(sql("SELECT 2"))));
        s.after_tool(&sql("SELECT 2"), rows("[('Sam',)]"));
        match s.next_step() {
            Next::Act(c) => assert_eq!(c, ToolCall { name: "commit_final_answer".into(), args: json!({"answers": ["Sam"]}) }),
            other => panic!("expected a forced commit, got {other:?}"),
        }
        assert_masks(s.turns());
    }

    #[test]
    fn before_action_warn_comes_after_the_tool_result() {
        let mut s = session(json!([{"id": "w", "event": "before_action",
            "condition": {"not": {"contains": ["action.args.query", "limit"]}}, "action": "warn", "message": "Add LIMIT next time."}]));
        ask(&mut s);
        let c = s.record_reply(reply("", Some(sql("SELECT * FROM t")))).unwrap();
        assert_eq!(s.before_action(c.clone()), Verdict::Execute(c.clone()));
        s.after_tool(&c, rows("[(1,)]"));
        let msgs = ask(&mut s).messages;
        let n = msgs.len();
        assert_eq!((msgs[n - 2].role, msgs[n - 1].role), (Role::Tool, Role::User));
        assert_eq!(msgs[n - 1].content, "Add LIMIT next time.");
        assert_masks(s.turns());
    }

    #[test]
    fn before_action_block_and_prompt_suppresses_the_call_and_asks_again() {
        let mut s = session(json!([{"id": "b", "event": "before_action",
            "condition": {"all": [{"eq": ["action.tool", "commit_final_answer"]}, {"eq": ["state.env_actions", 0]}]},
            "action": "block_and_prompt", "message": "Query the table before answering."}]));
        ask(&mut s);
        let commit = ToolCall { name: "commit_final_answer".into(), args: json!({"answers": ["7"]}) };
        let c = s.record_reply(reply("", Some(commit.clone()))).unwrap();
        assert_eq!(s.before_action(c), Verdict::Blocked);
        let t = s.turns().last().unwrap();
        assert_eq!((t.role, t.source, t.text.as_str()), (Role::Tool, TurnSource::Harness, "Query the table before answering."));
        assert_eq!(s.usage().env_actions, 0);
        let req = ask(&mut s);
        assert_eq!(s.usage().model_calls, 2);
        assert_eq!(req.messages.last().unwrap().content, "Query the table before answering.");
        // After one query, the same commit passes.
        s.record_reply(reply("", Some(sql("SELECT 7"))));
        s.after_tool(&sql("SELECT 7"), rows("[(7,)]"));
        ask(&mut s);
        let c = s.record_reply(reply("", Some(commit.clone()))).unwrap();
        assert_eq!(s.before_action(c), Verdict::Execute(commit));
        assert_masks(s.turns());
    }

    #[test]
    fn before_action_rewrite_action_merges_arguments() {
        let mut s = session(json!([{"id": "r", "event": "before_action",
            "condition": {"all": [{"eq": ["action.tool", "execute_sql"]}, {"not": {"contains": ["action.args.query", "limit"]}}]},
            "action": "rewrite_action", "message": "Added a LIMIT.",
            "parameters": {"args": {"query": "{{action.args.query}} LIMIT 50"}}}]));
        ask(&mut s);
        let c = s.record_reply(reply("", Some(sql("SELECT * FROM t")))).unwrap();
        let v = s.before_action(c.clone());
        assert_eq!(v, Verdict::Execute(sql("SELECT * FROM t LIMIT 50")));
        let n = s.turns().len();
        let (note, call) = (&s.turns()[n - 2], &s.turns()[n - 1]);
        assert_eq!((note.role, note.source, note.text.as_str()), (Role::Tool, TurnSource::Harness, "Added a LIMIT."));
        assert_eq!((call.role, call.source, call.hook_id.as_deref()), (Role::Assistant, TurnSource::Harness, Some("r")));
        // The policy's own turn keeps what it sampled (and stays trainable).
        assert_eq!(s.turns()[n - 3].tool_args.as_deref(), Some(r#"{"query":"SELECT * FROM t"}"#));
        assert_masks(s.turns());
    }

    #[test]
    fn before_action_force_action_replaces_the_call_and_first_mediation_wins() {
        let mut s = session(json!([
            {"id": "w", "event": "before_action", "condition": "repeated_action", "action": "warn", "message": "You repeat yourself."},
            {"id": "f", "event": "before_action", "condition": "repeated_action", "action": "force_action",
             "parameters": {"tool": "execute_sql", "args": {"query": "SELECT * FROM t LIMIT 3"}}},
            {"id": "b", "event": "before_action", "condition": "repeated_action", "action": "block_and_prompt", "message": "never"}
        ]));
        ask(&mut s);
        let c = s.record_reply(reply("", Some(sql("SELECT x")))).unwrap();
        assert_eq!(s.before_action(c.clone()), Verdict::Execute(c.clone()));
        s.after_tool(&c, Observation { text: "error".into(), action_failed: true, ..Default::default() });
        ask(&mut s);
        let c = s.record_reply(reply("", Some(sql("SELECT x")))).unwrap();
        assert_eq!(s.before_action(c), Verdict::Execute(sql("SELECT * FROM t LIMIT 3")));
        assert!(!s.turns().iter().any(|t| t.text == "never"));
        s.after_tool(&sql("SELECT * FROM t LIMIT 3"), rows("[(1,)]"));
        // The deferred warn shows after the forced action's result.
        assert_eq!(s.turns().last().unwrap().text, "You repeat yourself.");
        assert_masks(s.turns());
    }

    #[test]
    fn after_tool_warn_follows_the_observation() {
        let mut s = session(json!([{"id": "p", "event": "after_tool", "condition": "pagination_present", "action": "warn",
            "message": "More rows exist; narrow the query."}]));
        ask(&mut s);
        let c = s.record_reply(reply("", Some(sql("SELECT * FROM t")))).unwrap();
        s.after_tool(&c, Observation { text: "[(1,), (2,)] ...".into(), truncated: true, ..Default::default() });
        let t = s.turns().last().unwrap();
        assert_eq!((t.role, t.source, t.hook_id.as_deref()), (Role::User, TurnSource::Harness, Some("p")));
        assert_masks(s.turns());
    }

    #[test]
    fn after_tool_force_action_is_queued_for_the_next_step() {
        let mut s = session(json!([{"id": "f", "event": "after_tool", "condition": "last_action_failed", "action": "force_action",
            "message": "Checking the schema.", "parameters": {"tool": "execute_sql", "args": {"query": "SELECT * FROM t LIMIT 1"}}}]));
        ask(&mut s);
        let c = s.record_reply(reply("", Some(sql("SELEC")))).unwrap();
        s.after_tool(&c, Observation { text: "syntax error".into(), action_failed: true, ..Default::default() });
        assert_eq!(s.next_step(), Next::Act(sql("SELECT * FROM t LIMIT 1")));
        assert_eq!(s.usage().model_calls, 1);
    }

    #[test]
    fn text_only_replies_get_a_reminder_and_are_counted() {
        let mut s = session(json!([{"id": "t", "event": "before_decision", "condition": "text_only_reply", "action": "warn",
            "message": "Call commit_final_answer with the value you found."}]));
        ask(&mut s);
        assert_eq!(s.record_reply(reply("The output is 2.", None)), None);
        assert_eq!(s.state().text_only_turns, 1);
        let req = ask(&mut s);
        let last = &req.messages.last().unwrap().content;
        assert!(last.starts_with("Your reply called no tool."), "{last}");
        assert!(last.ends_with("Call commit_final_answer with the value you found."), "{last}");
        assert_masks(s.turns());
    }

    #[test]
    fn done_observations_end_the_episode_as_committed_or_round_limit() {
        let mut s = session(json!([]));
        ask(&mut s);
        let commit = ToolCall { name: "commit_final_answer".into(), args: json!({"answers": ["2"]}) };
        s.record_reply(reply("", Some(commit.clone())));
        let done = Observation { text: "committed".into(), done: true, committed: true, ..Default::default() };
        assert_eq!(s.after_tool(&commit, done), Some(Termination::Committed));
        assert!(s.state().answer_committed);

        // At the round limit (5 rounds) without the flag: the limit ended it.
        let mut s = session(json!([]));
        for i in 0..5 {
            ask(&mut s);
            s.record_reply(reply("", Some(sql("SELECT 1"))));
            let out = Observation { text: "[(1,)]".into(), done: i == 4, ..Default::default() };
            let end = s.after_tool(&sql("SELECT 1"), out);
            assert_eq!(end, if i == 4 { Some(Termination::RoundLimit) } else { None });
        }
        assert!(!s.state().answer_committed);

        // Done before the round limit can only be a commit, flag or not.
        let mut s = session(json!([]));
        ask(&mut s);
        s.record_reply(reply("", Some(commit.clone())));
        let done = Observation { text: "Answer committed.".into(), done: true, ..Default::default() };
        assert_eq!(s.after_tool(&commit, done), Some(Termination::Committed));
    }

    // ---- budgets ----

    #[test]
    fn model_call_budget_exhaustion_stops_the_episode() {
        let budgets = Budgets { max_model_calls: 2, ..Default::default() };
        let mut s = Session::start(&HarnessSpec::h0(), budgets, SamplingParams::default(), &start()).unwrap();
        for _ in 0..2 {
            ask(&mut s);
            s.record_reply(reply("thinking", None));
        }
        assert_eq!(s.next_step(), Next::Stop(Termination::BudgetExhausted));
        assert_eq!(s.usage().model_calls, 2);
    }

    #[test]
    fn env_action_budget_is_the_smaller_of_rounds_and_budget() {
        let budgets = Budgets { max_env_actions: 1, ..Default::default() };
        let mut s = Session::start(&HarnessSpec::h0(), budgets, SamplingParams::default(), &start()).unwrap();
        assert_eq!(s.state().remaining_steps, 1);
        ask(&mut s);
        s.record_reply(reply("", Some(sql("SELECT 1"))));
        s.after_tool(&sql("SELECT 1"), rows("1"));
        assert_eq!(s.state().remaining_env_actions, 0);
        assert_eq!(s.next_step(), Next::Stop(Termination::BudgetExhausted));
        // The environment's round limit (5) caps the default budget (30).
        let mut s = session(json!([]));
        assert_eq!(s.state().remaining_env_actions, 5);
    }

    #[test]
    fn context_token_budget_stops_and_output_tokens_are_clamped() {
        let budgets = Budgets { max_context_tokens: 1_000, max_output_tokens: 64, ..Default::default() };
        let sampling = SamplingParams { max_tokens: 4_096, ..Default::default() };
        let mut s = Session::start(&HarnessSpec::h0(), budgets, sampling, &start()).unwrap();
        let req = ask(&mut s);
        assert_eq!(req.sampling.max_tokens, 64);
        // The backend reports a nearly full context; the next call would not fit.
        let mut out = reply("", Some(sql("SELECT 1")));
        out.prompt_tokens = 990;
        out.completion_tokens = 10;
        s.record_reply(out);
        s.after_tool(&sql("SELECT 1"), rows("1"));
        assert_eq!(s.next_step(), Next::Stop(Termination::ContextLimit));
    }

    #[test]
    fn output_tokens_shrink_to_the_room_left_in_the_context() {
        let budgets = Budgets { max_context_tokens: 200, ..Default::default() };
        let mut s = Session::start(&HarnessSpec::h0(), budgets, SamplingParams::default(), &start()).unwrap();
        let room = 200 - s.state().context_tokens;
        assert_eq!(u64::from(ask(&mut s).sampling.max_tokens), room);
    }

    #[test]
    fn budgets_default_to_table_8() {
        let b = Budgets::default();
        assert_eq!((b.max_model_calls, b.max_env_actions, b.max_context_tokens, b.max_output_tokens), (32, 30, 65_532, 8_192));
        let partial: Budgets = serde_json::from_str(r#"{"max_model_calls": 4}"#).unwrap();
        assert_eq!(partial, Budgets { max_model_calls: 4, ..Budgets::default() });
        assert!(serde_json::from_str::<Budgets>(r#"{"max_calls": 4}"#).is_err());
    }

    #[test]
    fn injected_text_is_excluded_from_the_loss_mask_and_counted() {
        let mut s = session(json!([
            {"event": "episode_start", "condition": "always", "action": "warn", "message": "hint one"},
            {"event": "after_tool", "condition": "always", "action": "warn", "message": "hint two"}
        ]));
        ask(&mut s);
        let c = s.record_reply(reply("q", Some(sql("SELECT 1")))).unwrap();
        s.after_tool(&c, rows("1"));
        let (turns, usage) = s.finish();
        let harness: Vec<&Turn> = turns.iter().filter(|t| t.source == TurnSource::Harness).collect();
        assert_eq!(harness.iter().map(|t| t.text.as_str()).collect::<Vec<_>>(), vec!["hint one", "hint two"]);
        assert_eq!(harness[0].hook_id.as_deref(), Some("hooks[0]"));
        assert_masks(&turns);
        let policy: Vec<&Turn> = turns.iter().filter(|t| t.source == TurnSource::Policy).collect();
        assert_eq!(policy.len(), 1);
        assert_eq!(policy[0].loss_mask, vec![true, true, true]);
        assert_eq!(usage.harness_tokens, approx_tokens("hint one") + approx_tokens("hint two"));
        assert_eq!(turns.iter().map(|t| t.index).collect::<Vec<_>>(), (0..turns.len() as u32).collect::<Vec<_>>());
    }
}
