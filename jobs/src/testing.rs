//! Test doubles shared by the job modules' tests: a scripted policy and a one-table
//! counting environment whose answer is 2.

use std::sync::Mutex;

use async_trait::async_trait;
use serde_json::json;

use crate::env::{EnvError, Environment, EnvironmentFactory, EpisodeStart, Evaluation, Observation, ToolCall, ToolSpec};
use crate::policy::{FinishReason, Message, Policy, PolicyError, PolicyOutput, SamplingParams};
use schemas::{HarnessSpec, Role};

/// Replays fixed assistant turns in order (per episode, by the number of assistant
/// messages already in the conversation), recording every request it saw.
pub struct Scripted {
    pub replies: Vec<Result<PolicyOutput, fn() -> PolicyError>>,
    pub seen: Mutex<Vec<Vec<Message>>>,
}

impl Scripted {
    pub fn new(replies: Vec<Result<PolicyOutput, fn() -> PolicyError>>) -> Self {
        Scripted { replies, seen: Mutex::new(vec![]) }
    }
}

#[async_trait]
impl Policy for Scripted {
    fn checkpoint(&self) -> String {
        "scripted".into()
    }
    async fn chat(&self, messages: &[Message], _tools: &[ToolSpec], _s: &SamplingParams) -> Result<PolicyOutput, PolicyError> {
        self.seen.lock().unwrap().push(messages.to_vec());
        let i = messages.iter().filter(|m| m.role == Role::Assistant).count();
        match self.replies.get(i).unwrap_or_else(|| self.replies.last().unwrap()) {
            Ok(out) => Ok(out.clone()),
            Err(make) => Err(make()),
        }
    }
}

pub fn say(text: &str, call: Option<(&str, serde_json::Value)>) -> Result<PolicyOutput, fn() -> PolicyError> {
    Ok(PolicyOutput {
        prompt_hash: None,
        text: text.into(),
        tool_calls: call.map(|(n, a)| ToolCall { name: n.into(), args: a }).into_iter().collect(),
        token_ids: vec![11, 12],
        logprobs: vec![-0.5, -0.25],
        prompt_tokens: 40,
        completion_tokens: 2,
        finish_reason: FinishReason::Stop,
    })
}

/// A one-table counting task: the answer is 2; the SQL "SELECT count" returns it.
pub struct Counting {
    pub rounds: u32,
    pub max_rounds: u32,
    pub answer: Option<String>,
    pub fail_step: bool,
}

#[async_trait]
impl Environment for Counting {
    fn name(&self) -> &str {
        "counting"
    }
    async fn reset(&mut self, task_id: &str, _seed: u64) -> Result<EpisodeStart, EnvError> {
        if task_id == "missing" {
            return Err(EnvError::UnknownTask { task_id: task_id.into() });
        }
        self.rounds = 0;
        self.answer = None;
        Ok(EpisodeStart {
            observation: Observation { text: "How many people are older than 30?".into(), ..Default::default() },
            tools: vec![
                ToolSpec { name: "execute_sql".into(), description: "Run SQL".into(), parameters: json!({}) },
                ToolSpec { name: "commit_final_answer".into(), description: "Answer".into(), parameters: json!({}) },
            ],
            max_rounds: self.max_rounds,
            task_type: "counting".into(),
            features: Default::default(),
        })
    }
    async fn step(&mut self, call: &ToolCall) -> Result<Observation, EnvError> {
        if self.fail_step {
            return Err(EnvError::Backend { backend: "test".into(), detail: "connection lost".into() });
        }
        self.rounds += 1;
        let limit = self.rounds >= self.max_rounds;
        Ok(match call.name.as_str() {
            "commit_final_answer" => {
                self.answer = call.args["answers"][0].as_str().map(str::to_string);
                Observation { text: "Answer committed.".into(), done: true, committed: true, ..Default::default() }
            }
            _ => match call.args["query"].as_str() {
                Some(q) if q.to_lowercase().starts_with("select count") => {
                    Observation { text: "[(2,)]".into(), done: limit, ..Default::default() }
                }
                _ => Observation { text: "syntax error".into(), action_failed: true, done: limit, ..Default::default() },
            },
        })
    }
    async fn evaluate(&mut self) -> Result<Evaluation, EnvError> {
        let ok = self.answer.as_deref() == Some("2");
        Ok(Evaluation { reward: f64::from(u8::from(ok)), success: ok, detail: format!("answer {:?}", self.answer) })
    }
    async fn close(&mut self) -> Result<(), EnvError> {
        Ok(())
    }
}

pub struct Factory {
    pub fail_step: bool,
}

#[async_trait]
impl EnvironmentFactory for Factory {
    async fn create(&self) -> Result<Box<dyn Environment>, EnvError> {
        Ok(Box::new(Counting { rounds: 0, max_rounds: 5, answer: None, fail_step: self.fail_step }))
    }
}

pub fn spec(v: serde_json::Value) -> HarnessSpec {
    crate::harness::spec_from_value("test", &v, &Default::default()).unwrap()
}
