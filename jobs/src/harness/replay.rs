//! Re-rendering a recorded episode under another harness: the contexts the base harness H0
//! would have shown the policy at each of its turns, given the same history of actions and
//! observations (`[algorithm] rescue_context = "h0"`, the hint-free context of Guide-GRPO).
//!
//! Nothing here edits strings. The recorded policy replies and environment observations
//! are fed, in their order, to a fresh [`Session`] of the target spec: the session builds
//! its own system prompt, its own (absent) rules, skills and examples, its own tool view and
//! its own reminders, exactly as it does in a rollout. The recorded harness turns of the
//! generating sibling (its prompt parts, examples, hints) are simply never shown to it.
//!
//! A trajectory can be re-rendered only when the target would have lived the same episode:
//! every action the environment saw was the policy's own and the target let it through, or
//! the target's own hooks would have taken the same action there. A sibling whose hooks
//! acted for the policy where the target would not have (a forced or rewritten action, a
//! blocked call) made history H0 would not have made; such rows are [`NotRenderable`], with
//! the turn and the reason, and the learner keeps them in their generating context.

use crate::env::{EpisodeStart, Observation, ToolCall, ToolSpec};
use crate::policy::{FinishReason, Message, PolicyOutput, SamplingParams};
use schemas::{HarnessSpec, Role, Termination, Turn, TurnSource};

use super::runtime::{Budgets, Next, Session, Verdict};

/// What the target harness would have shown at one recorded policy turn.
#[derive(Debug, Clone, PartialEq)]
pub struct RenderedTurn {
    /// Index of the policy turn in the recorded transcript.
    pub turn: usize,
    /// The chat messages the target's session would have sent.
    pub messages: Vec<Message>,
}

/// A recorded episode re-rendered under the target harness.
#[derive(Debug, Clone, PartialEq)]
pub struct Rendered {
    /// The tools the target shows (after its own tool view).
    pub tools: Vec<ToolSpec>,
    /// One entry per recorded policy turn, in order.
    pub turns: Vec<RenderedTurn>,
}

/// Why a recorded episode has no rendering under the target harness.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("turn {turn}: {reason}")]
pub struct NotRenderable {
    pub turn: usize,
    pub reason: String,
}

/// The episode facts a rendering needs besides the transcript: the environment's own tools
/// (before any tool view), its round limit and the task type (hook state).
#[derive(Debug, Clone, PartialEq)]
pub struct EpisodeFacts {
    pub env_tools: Vec<ToolSpec>,
    pub max_rounds: u32,
    pub task_type: String,
}

/// Replays `turns` (a recorded transcript, ending with `termination`) through a session of
/// `target` and returns the context it shows at every policy turn.
///
/// Observations carry only their text in a transcript; `done` and `committed` are restored
/// from where the episode ended, `action_failed` and `truncated` are unknown (false), so a
/// target whose hooks read them is refused by the caller's spec check, not here.
pub fn render_under(
    target: &HarnessSpec,
    budgets: Budgets,
    facts: &EpisodeFacts,
    turns: &[Turn],
    termination: Termination,
) -> Result<Rendered, NotRenderable> {
    let fail = |turn: usize, reason: String| NotRenderable { turn, reason };
    let task_at = turns
        .iter()
        .position(|t| t.source == TurnSource::Env && t.role == Role::User)
        .ok_or_else(|| fail(0, "the transcript has no task turn (an environment turn from the user)".into()))?;
    let last_observation = turns.iter().rposition(|t| t.source == TurnSource::Env && t.role == Role::Tool);
    let start = EpisodeStart {
        observation: Observation { text: turns[task_at].text.clone(), ..Default::default() },
        tools: facts.env_tools.clone(),
        max_rounds: facts.max_rounds,
        task_type: facts.task_type.clone(),
        features: Default::default(),
    };
    let mut session = Session::start(target, budgets, SamplingParams::default(), &start).map_err(|e| fail(task_at, e.to_string()))?;
    let mut out = vec![];
    // The call the target executed and whose observation comes next.
    let mut pending: Option<ToolCall> = None;
    let mut ended = false;
    for (i, turn) in turns.iter().enumerate().skip(task_at + 1) {
        match (turn.source, turn.role) {
            (TurnSource::Policy, _) => {
                if ended {
                    return Err(fail(i, "the target's episode had already ended here".into()));
                }
                if let Some(call) = &pending {
                    return Err(fail(
                        i,
                        format!(
                            "the target would have executed `{}`, but the recorded episode has no result for it (a hook blocked it)",
                            call.name
                        ),
                    ));
                }
                let messages = match session.next_step() {
                    Next::Ask(req) => req.messages,
                    Next::Act(call) => {
                        return Err(fail(i, format!("the target's harness would have acted (`{}`) instead of asking", call.name)))
                    }
                    Next::Stop(t) => return Err(fail(i, format!("the target's episode would have stopped here ({})", t.as_str()))),
                };
                out.push(RenderedTurn { turn: i, messages });
                let call = match &turn.tool_name {
                    Some(name) => {
                        let args = match turn.tool_args.as_deref() {
                            Some(a) => {
                                serde_json::from_str(a).map_err(|e| fail(i, format!("the recorded tool arguments are not JSON: {e}")))?
                            }
                            None => serde_json::Value::Object(Default::default()),
                        };
                        Some(ToolCall { name: name.clone(), args })
                    }
                    None => None,
                };
                let reply = PolicyOutput {
                    text: turn.text.clone(),
                    tool_calls: call.into_iter().collect(),
                    token_ids: turn.token_ids.clone(),
                    logprobs: turn.logprobs.clone(),
                    prompt_tokens: 0,
                    completion_tokens: turn.token_ids.len() as u32,
                    finish_reason: FinishReason::Stop,
                    prompt_hash: None,
                };
                if let Some(call) = session.record_reply(reply) {
                    match session.before_action(call) {
                        Verdict::Execute(c) => pending = Some(c),
                        Verdict::Blocked => {}
                        Verdict::Stop(_) => ended = true,
                    }
                }
            }
            (TurnSource::Env, Role::Tool) => {
                let Some(call) = pending.take() else {
                    return Err(fail(i, "an observation of an action the target would not have taken".into()));
                };
                if turn.tool_name.as_deref().is_some_and(|n| n != call.name) {
                    return Err(fail(
                        i,
                        format!("the recorded action was `{}`, the target's `{}`", turn.tool_name.as_deref().unwrap_or(""), call.name),
                    ));
                }
                let done = Some(i) == last_observation && matches!(termination, Termination::Committed | Termination::RoundLimit);
                let obs = Observation {
                    text: turn.text.clone(),
                    done,
                    committed: done && termination == Termination::Committed,
                    ..Default::default()
                };
                ended |= session.after_tool(&call, obs).is_some();
            }
            (TurnSource::Harness, Role::Assistant) => {
                // An action the generating harness took for the policy: renderable only when
                // the target takes the same one here (its own hook, or its own rewrite of
                // the policy's call).
                let hook = turn.hook_id.as_deref().unwrap_or("?");
                let recorded = recorded_call(turn).map_err(|e| fail(i, e))?;
                let taken = match pending.take() {
                    Some(c) => Some(c),
                    None if !ended => match session.next_step() {
                        Next::Act(c) => Some(c),
                        _ => None,
                    },
                    None => None,
                };
                match taken {
                    Some(c) if Some(&c) == recorded.as_ref() => pending = Some(c),
                    _ => {
                        return Err(fail(
                            i,
                            format!(
                            "harness-side: the generating harness acted for the policy here (hook `{hook}`) and the target would not have"
                        ),
                        ))
                    }
                }
            }
            // The generating harness's own text (its prompt parts, examples, hints,
            // reminders, block notes): the target writes its own.
            _ => {}
        }
    }
    Ok(Rendered { tools: session.tools().to_vec(), turns: out })
}

/// What a transcript does not keep of an observation and a hook may read: a spec whose
/// hooks read one of these cannot be replayed faithfully ([`render_under`] restores only
/// `done` and `committed`). Returns the first such name the hooks mention.
pub fn reads_observation_flags(spec: &HarnessSpec) -> Option<&'static str> {
    const FLAGS: [&str; 5] = ["action_failed", "truncated", "pagination_present", "consecutive_failures", "observation.done"];
    let text = serde_json::to_string(&spec.hooks).unwrap_or_default();
    FLAGS.into_iter().find(|f| text.contains(f))
}

/// The call a recorded turn carries (its tool and JSON arguments).
fn recorded_call(turn: &Turn) -> Result<Option<ToolCall>, String> {
    let Some(name) = &turn.tool_name else { return Ok(None) };
    let args = match turn.tool_args.as_deref() {
        Some(a) => serde_json::from_str(a).map_err(|e| format!("the recorded tool arguments are not JSON: {e}"))?,
        None => serde_json::Value::Object(Default::default()),
    };
    Ok(Some(ToolCall { name: name.clone(), args }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env::EnvironmentFactory;
    use crate::policy::{Policy, PolicyError};
    use crate::testing::{say, spec, Factory};
    use async_trait::async_trait;
    use serde_json::json;
    use std::sync::Mutex;

    /// Replies in call order (not by the assistant messages in the prompt, which a
    /// sibling's examples add to), recording every request.
    struct InOrder {
        replies: Vec<PolicyOutput>,
        seen: Mutex<Vec<Vec<Message>>>,
    }

    #[async_trait]
    impl Policy for InOrder {
        fn checkpoint(&self) -> String {
            "in-order".into()
        }
        async fn chat(&self, messages: &[Message], _t: &[ToolSpec], _s: &SamplingParams) -> Result<PolicyOutput, PolicyError> {
            let mut seen = self.seen.lock().unwrap();
            let i = seen.len().min(self.replies.len() - 1);
            seen.push(messages.to_vec());
            Ok(self.replies[i].clone())
        }
    }

    fn script() -> InOrder {
        let replies = [
            say("Let me think about the table.", None),
            say("", Some(("execute_sql", json!({"query": "SELECT count(*) FROM people WHERE age > 30"})))),
            say("", Some(("commit_final_answer", json!({"answers": ["2"]})))),
        ];
        InOrder { replies: replies.into_iter().map(|r| r.unwrap()).collect(), seen: Mutex::new(vec![]) }
    }

    /// A sibling with everything H0 lacks: a rule, a skill, a worked example, a hint hook
    /// after every tool result and a tool view that re-describes a tool.
    fn sibling() -> HarnessSpec {
        spec(json!({
            "id": "s-all", "parent": "h0",
            "prompt_rules": [{"slot": "answer_format", "text": "Commit the number you found."}],
            "skills": [{"name": "counting", "text": "Use COUNT(*)."}],
            "examples": [{"name": "ex", "turns": [
                {"role": "user", "text": "How many cats?"},
                {"role": "assistant", "text": "Final Answer: [\"3\"]"}
            ]}],
            "tool_view": {"tools": [{"name": "execute_sql", "description": "Run one SQL statement."}]},
            "hooks": [{"event": "after_tool", "condition": "always", "action": "warn", "message": "Commit what the result shows."}]
        }))
    }

    async fn episode(harness: &HarnessSpec) -> (crate::rollout::Episode, Vec<Vec<Message>>) {
        let policy = script();
        let mut env = Factory { fail_step: false }.create().await.unwrap();
        let ep = crate::rollout::run_episode(&policy, env.as_mut(), harness, Budgets::default(), &SamplingParams::default(), "t", 1).await;
        let seen = policy.seen.into_inner().unwrap();
        (ep, seen)
    }

    async fn facts() -> EpisodeFacts {
        let mut env = Factory { fail_step: false }.create().await.unwrap();
        let start = env.reset("t", 1).await.unwrap();
        EpisodeFacts { env_tools: start.tools, max_rounds: start.max_rounds, task_type: start.task_type }
    }

    #[tokio::test]
    async fn a_sibling_episode_rendered_under_h0_is_what_an_h0_episode_sent() {
        let (h0_ep, h0_seen) = episode(&HarnessSpec::h0()).await;
        let (sib_ep, sib_seen) = episode(&sibling()).await;
        assert!(h0_ep.success && sib_ep.success, "both episodes commit the count");
        assert_ne!(h0_seen, sib_seen, "the sibling shows the policy more than H0 does");
        let rendered = render_under(&HarnessSpec::h0(), Budgets::default(), &facts().await, &sib_ep.turns, sib_ep.termination).unwrap();
        let got: Vec<Vec<Message>> = rendered.turns.iter().map(|r| r.messages.clone()).collect();
        assert_eq!(got, h0_seen, "every policy turn gets H0's prompt, message for message");
        assert_eq!(rendered.tools, h0_ep.tools, "H0's tool view, not the sibling's");
        let policy_turns: Vec<usize> =
            sib_ep.turns.iter().enumerate().filter(|(_, t)| t.source == TurnSource::Policy).map(|(i, _)| i).collect();
        assert_eq!(rendered.turns.iter().map(|r| r.turn).collect::<Vec<_>>(), policy_turns);
    }

    #[tokio::test]
    async fn rendering_under_the_generating_harness_changes_nothing() {
        let s = sibling();
        let (ep, seen) = episode(&s).await;
        let rendered = render_under(&s, Budgets::default(), &facts().await, &ep.turns, ep.termination).unwrap();
        assert_eq!(rendered.turns.iter().map(|r| r.messages.clone()).collect::<Vec<_>>(), seen);
    }

    #[tokio::test]
    async fn a_sibling_that_acted_for_the_policy_cannot_be_rendered() {
        let opts = crate::harness::ValidateOptions { harness_actions: true, ..Default::default() };
        let forcing = crate::harness::spec_from_value(
            "s-force",
            &json!({
                "id": "s-force", "parent": "h0",
                "hooks": [{"event": "before_decision", "condition": "text_only_reply", "action": "force_action",
                           "parameters": {"tool": "commit_final_answer", "args": {"answers": ["2"]}}, "message": "Committing."}]
            }),
            &opts,
        )
        .unwrap();
        let (ep, _) = episode(&forcing).await;
        assert!(ep.turns.iter().any(|t| t.source == TurnSource::Harness && t.role == Role::Assistant), "the hook acted");
        let err = render_under(&HarnessSpec::h0(), Budgets::default(), &facts().await, &ep.turns, ep.termination).unwrap_err();
        assert!(err.reason.contains("harness-side"), "{err}");
        // A base harness with the same hook would have acted the same way: renderable, and
        // the context at the policy's turns is the base harness's own.
        let mut base = forcing.clone();
        base.id = "h0".into();
        let (base_ep, base_seen) = episode(&base).await;
        let mut sib = forcing.clone();
        sib.examples = sibling().examples;
        let (sib_ep, _) = episode(&sib).await;
        let rendered = render_under(&base, Budgets::default(), &facts().await, &sib_ep.turns, sib_ep.termination).unwrap();
        assert_eq!(rendered.turns.iter().map(|r| r.messages.clone()).collect::<Vec<_>>(), base_seen);
        assert_eq!(base_ep.success, sib_ep.success);
    }

    #[tokio::test]
    async fn a_blocked_call_is_history_h0_would_not_have_made() {
        let blocking = spec(json!({
            "id": "s-block", "parent": "h0",
            "hooks": [{"event": "before_action", "condition": {"eq": ["action.tool", "execute_sql"]}, "action": "block_and_prompt",
                       "parameters": {"max_fires": 1}, "message": "Think first."}]
        }));
        let (ep, _) = episode(&blocking).await;
        let err = render_under(&HarnessSpec::h0(), Budgets::default(), &facts().await, &ep.turns, ep.termination).unwrap_err();
        assert!(err.reason.contains("blocked"), "{err}");
    }
}
