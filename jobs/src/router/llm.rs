//! The LLM voter (§3.4 Eq. 9, Appendix C): one OpenAI-compatible endpoint and model,
//! called through [`Policy`], shown the task, the candidates in the call's shuffled order,
//! each candidate's description, validation success rate, outcomes on the similar
//! validation tasks and (for profile variants) its current profile entries, and asked for
//! `{"ranking": [four ids, best first]}`.
//!
//! The answer is parsed strictly ([`parse_ranking`]: the JSON object may sit inside prose
//! or a code fence, but must be exactly `{"ranking": [strings]}`); whatever is wrong with
//! it, and a failed call too, becomes an invalid ballot with the reason and the raw text,
//! which the router records and does not count.

use std::sync::Arc;

use async_trait::async_trait;
use serde::Deserialize;

use super::vote::RawBallot;
use super::{VoteRequest, Voter};
use crate::policy::openai::{OpenAiConfig, OpenAiPolicy, TokenIds};
use crate::policy::{Message, Policy, PolicyError, SamplingParams};
use crate::profile::clip;
use crate::profile::llm::json_object;
use schemas::{Polarity, Role};

const SYSTEM: &str = "You choose which agent harnesses to run on a database task. Answer with one JSON object only.";

/// An LLM voter over any [`Policy`].
pub struct LlmVoter {
    policy: Arc<dyn Policy>,
    label: String,
    pub sampling: SamplingParams,
    /// Profile entries shown per candidate and polarity.
    pub max_profile_entries: usize,
}

impl LlmVoter {
    pub fn new(policy: Arc<dyn Policy>) -> Self {
        LlmVoter {
            label: policy.checkpoint(),
            policy,
            sampling: SamplingParams { temperature: 0.7, top_p: 1.0, max_tokens: 96, seed: None, stop: vec![], constrain: None },
            max_profile_entries: 2,
        }
    }

    /// A voter on an OpenAI-compatible endpoint (`base_url` with `/v1`), without
    /// log-probabilities or token ids (a vote needs only the text).
    pub fn openai(base_url: &str, model: &str) -> Result<Self, PolicyError> {
        Self::openai_with(OpenAiConfig::new(base_url, model))
    }

    /// A voter with full endpoint settings (timeouts, retries, API key variable); log-
    /// probabilities and token ids are turned off.
    pub fn openai_with(mut config: OpenAiConfig) -> Result<Self, PolicyError> {
        config.logprobs = false;
        config.token_ids = TokenIds::ResponseOnly;
        Ok(Self::new(Arc::new(OpenAiPolicy::new(config)?)))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WireRanking {
    ranking: Vec<String>,
}

/// Reads `{"ranking": [...]}` from an answer (ids trimmed; validation against the
/// candidates is the router's job).
pub fn parse_ranking(text: &str) -> Result<Vec<String>, String> {
    let object = json_object(text).map_err(|e| format!("unparsable: {e}"))?;
    let wire: WireRanking = serde_json::from_str(object).map_err(|e| format!("unparsable: not a ranking object: {e}"))?;
    Ok(wire.ranking.into_iter().map(|s| s.trim().to_string()).collect())
}

/// The prompt of one vote.
pub fn prompt(req: &VoteRequest<'_>, max_profile_entries: usize) -> String {
    let ev = req.evidence;
    let similar: Vec<String> =
        req.similar.iter().filter_map(|(id, sim)| ev.task(id).map(|t| format!("{id} ({}, sim {sim:.2})", t.task_type))).collect();
    let mut lines = vec![
        format!("Task: {}", req.task.summary()),
        format!("Similar validation tasks: {}", if similar.is_empty() { "none".into() } else { similar.join(", ") }),
        "Candidates:".into(),
    ];
    for c in req.candidates {
        let desc = ev.descriptions.get(c).map(|d| clip(d, 160)).unwrap_or_else(|| "no description".into());
        let mut line = format!("- {c}: {desc}.");
        if let Some(s) = ev.stats.get(c) {
            line.push_str(&format!(" Validation success {}/{}.", s.successes, s.episodes));
            let (mut ok, mut n) = (0, 0);
            for (id, _) in req.similar {
                if let Some(o) = s.by_task.get(id) {
                    ok += o.successes;
                    n += o.episodes;
                }
            }
            if n > 0 {
                line.push_str(&format!(" On similar tasks {ok}/{n}."));
            }
        }
        if req.use_profiles {
            for polarity in [Polarity::Prefer, Polarity::Avoid] {
                let entries: Vec<String> = ev
                    .profiles
                    .get(c)
                    .into_iter()
                    .flatten()
                    .filter(|e| e.polarity == polarity)
                    .take(max_profile_entries)
                    .map(|e| format!("when {}: {}", clip(&e.when, 60), clip(&e.behavior, 90)))
                    .collect();
                if !entries.is_empty() {
                    let name = if polarity == Polarity::Prefer { "Prefer" } else { "Avoid" };
                    line.push_str(&format!(" {name}: {}.", entries.join("; ")));
                }
            }
        }
        lines.push(line);
    }
    let example: Vec<String> = req.candidates.iter().take(req.ballot_len).map(|c| format!("\"{c}\"")).collect();
    lines.push(format!(
        "Rank the {} best candidates for this task, best first, each id once. Reply with JSON only, e.g. {{\"ranking\": [{}]}}",
        req.ballot_len,
        example.join(", ")
    ));
    lines.join("\n")
}

#[async_trait]
impl Voter for LlmVoter {
    fn name(&self) -> String {
        format!("llm:{}", self.label)
    }

    async fn vote(&self, req: &VoteRequest<'_>) -> RawBallot {
        let messages = [Message::new(Role::System, SYSTEM), Message::new(Role::User, prompt(req, self.max_profile_entries))];
        let sampling = SamplingParams { seed: Some(req.seed), ..self.sampling.clone() };
        match self.policy.chat(&messages, &[], &sampling).await {
            Ok(out) => RawBallot {
                voter: self.name(),
                ranking: parse_ranking(&out.text),
                usage: schemas::LlmUsage::call(out.prompt_tokens.into(), out.completion_tokens.into()),
                raw: Some(out.text),
            },
            Err(e) => {
                tracing::warn!(voter = %self.name(), error = %e, "voter call failed; its ballot is discarded");
                RawBallot { voter: self.name(), ranking: Err(format!("voter call failed: {e}")), raw: None, usage: Default::default() }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rankings_are_parsed_strictly() {
        assert_eq!(parse_ranking("```json\n{\"ranking\": [\" h1\", \"h2\"]}\n```").unwrap(), vec!["h1", "h2"]);
        assert!(parse_ranking("h1, h2, h3").unwrap_err().starts_with("unparsable: no JSON object"));
        assert!(parse_ranking("{\"ranking\": \"h1\"}").unwrap_err().contains("not a ranking object"));
        assert!(parse_ranking("{\"rank\": [\"h1\"]}").unwrap_err().contains("unknown field `rank`"));
        assert!(parse_ranking("{\"ranking\": [1, 2]}").unwrap_err().contains("unparsable"));
    }
}
