//! A layer around a [`Policy`] that counts the calls and tokens it spends, so that the
//! LLM components of a run (profiler, diagnoser, editor) report their cost (Table 9)
//! without each counting for itself.

use std::sync::Mutex;

use async_trait::async_trait;
use schemas::LlmUsage;

use super::{Message, Policy, PolicyError, PolicyOutput, SamplingParams};
use crate::env::ToolSpec;

/// Counts every successful call's prompt and completion tokens (the backend's own figures).
pub struct Metered<'a> {
    inner: &'a dyn Policy,
    usage: Mutex<LlmUsage>,
}

impl<'a> Metered<'a> {
    pub fn new(inner: &'a dyn Policy) -> Self {
        Metered { inner, usage: Mutex::new(LlmUsage::default()) }
    }

    /// What the calls so far spent.
    pub fn usage(&self) -> LlmUsage {
        *self.usage.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[async_trait]
impl Policy for Metered<'_> {
    fn checkpoint(&self) -> String {
        self.inner.checkpoint()
    }

    async fn chat(&self, messages: &[Message], tools: &[ToolSpec], sampling: &SamplingParams) -> Result<PolicyOutput, PolicyError> {
        let out = self.inner.chat(messages, tools, sampling).await?;
        self.usage.lock().unwrap_or_else(|e| e.into_inner()).add(LlmUsage::call(out.prompt_tokens.into(), out.completion_tokens.into()));
        Ok(out)
    }
}
