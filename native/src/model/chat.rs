//! A policy turn's prompt as the model sees it: the harness's tools described in the system
//! message, the chat template, the tokenizer. Sampling (the engine) and scoring (the
//! learner) both build prompts here, so they score exactly what was sampled from.

use jobs::env::ToolSpec;
use jobs::policy::Message;
use schemas::Role;

use crate::model::tokenizer::Tokenizer;
use crate::NativeError;

/// Describes the tools in the system message: the native backend has no structured
/// tool-call channel, so the harness's text protocol carries the calls.
fn with_tools(messages: &[Message], tools: &[ToolSpec]) -> Vec<Message> {
    if tools.is_empty() {
        return messages.to_vec();
    }
    let text = jobs::policy::text_protocol::instructions(tools);
    let mut out = messages.to_vec();
    match out.first_mut() {
        Some(m) if m.role == Role::System => {
            m.content = format!("{}\n\n{}", m.content, text.trim_end());
        }
        _ => out.insert(0, Message::new(Role::System, text.trim_end())),
    }
    out
}

/// The prompt token ids the native backend samples from for `messages` and `tools`: the
/// tool instructions in the system message, the chat template, the tokenizer. The learner
/// rebuilds each policy turn's prompt with this same function.
pub fn prompt_ids(tokenizer: &Tokenizer, messages: &[Message], tools: &[ToolSpec]) -> Result<Vec<u32>, NativeError> {
    tokenizer.encode_chat(&with_tools(messages, tools))
}
