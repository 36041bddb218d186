//! The LLM profiler (§3.4, Eq. 8 and 11; Appendix D): an LLM reads paired calibration
//! trajectories of H_i and H0 and writes `{prefer: [{when, behavior}], avoid: [...]}`.
//!
//! Pairs are shown in batches small enough for small-context models. Each answer must be
//! one JSON object of exactly that shape ([`parse_profile`]: surrounding prose or a code
//! fence is ignored, the object itself is parsed strictly: unknown keys, missing fields,
//! empty or oversized texts are errors). An invalid answer gets one retry with the error
//! shown to the model; a second invalid answer (or a failed call) is recorded in
//! [`LlmProfileOutcome::problems`] and the batch contributes nothing — never a crash.
//! Entries repeated across batches are consolidated by (polarity, when, behavior) after
//! normalising case, spaces and end punctuation: `support` counts the batches that gave
//! the entry, and `paired_delta` is the mean paired success delta over those batches' pairs.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::stats::ProfileMeta;
use super::{actions, clip, Pair};
use crate::policy::{Message, Policy, SamplingParams};
use schemas::{Polarity, ProfileEntry, Role};

/// Longest `when` or `behavior` text accepted.
pub const MAX_ENTRY_CHARS: usize = 300;
/// Most entries accepted per list in one answer.
pub const MAX_ENTRIES: usize = 8;

const SYSTEM: &str = "You compare two agent harnesses on the same database tasks. \
Answer with one JSON object only, no other text.";

/// Settings of the LLM profiler.
#[derive(Debug, Clone, PartialEq)]
pub struct LlmProfilerConfig {
    /// Paired examples per call.
    pub pairs_per_call: usize,
    /// Calls (batches) per harness at most; further pairs are not shown.
    pub max_calls: usize,
    pub sampling: SamplingParams,
}

impl Default for LlmProfilerConfig {
    fn default() -> Self {
        LlmProfilerConfig {
            pairs_per_call: 2,
            max_calls: 4,
            sampling: SamplingParams { temperature: 0.2, top_p: 1.0, max_tokens: 256, seed: None, stop: vec![], constrain: None },
        }
    }
}

/// What profiling one harness produced.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LlmProfileOutcome {
    pub entries: Vec<ProfileEntry>,
    /// Model calls made (retries included).
    pub calls: u32,
    /// One line per batch that gave nothing usable, with the reason.
    pub problems: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WireProfile {
    prefer: Vec<WireEntry>,
    avoid: Vec<WireEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WireEntry {
    when: String,
    behavior: String,
}

/// The JSON object in `text`: from the first `{` to the last `}` (models often wrap it in a
/// code fence or a sentence); the object itself must be valid JSON.
pub fn json_object(text: &str) -> Result<&str, String> {
    let start = text.find('{').ok_or("no JSON object in the answer (no `{`)")?;
    let end = text.rfind('}').filter(|&e| e > start).ok_or("the JSON object is not closed (no `}` after `{`)")?;
    Ok(&text[start..=end])
}

/// Parses a profile answer strictly into (polarity, when, behavior) triples.
pub fn parse_profile(text: &str) -> Result<Vec<(Polarity, String, String)>, String> {
    let object = json_object(text)?;
    let wire: WireProfile = serde_json::from_str(object).map_err(|e| format!("not a profile object: {e}"))?;
    let mut out = Vec::new();
    for (polarity, list, name) in [(Polarity::Prefer, wire.prefer, "prefer"), (Polarity::Avoid, wire.avoid, "avoid")] {
        if list.len() > MAX_ENTRIES {
            return Err(format!("`{name}` has {} entries; at most {MAX_ENTRIES} are allowed", list.len()));
        }
        for (i, e) in list.into_iter().enumerate() {
            for (field, value) in [("when", &e.when), ("behavior", &e.behavior)] {
                if value.trim().is_empty() {
                    return Err(format!("`{name}[{i}].{field}` is empty"));
                }
                if value.chars().count() > MAX_ENTRY_CHARS {
                    return Err(format!("`{name}[{i}].{field}` is longer than {MAX_ENTRY_CHARS} characters"));
                }
            }
            out.push((polarity, e.when.trim().to_string(), e.behavior.trim().to_string()));
        }
    }
    Ok(out)
}

/// The consolidation key of an entry text: lower case, single spaces, no end punctuation.
pub fn normalize(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ").to_lowercase().trim_end_matches(['.', '!', ';', ',']).to_string()
}

/// One paired example in a few lines.
fn render_pair(i: usize, p: &Pair<'_>) -> String {
    let side = |t: &schemas::Trajectory| {
        let acts: Vec<String> = actions(t).iter().take(4).map(|(tool, args)| format!("{tool} {}", clip(args, 70))).collect();
        format!(
            "{} ({:?}); actions: {}",
            if t.success { "success" } else { "failure" },
            t.termination,
            if acts.is_empty() { "none".into() } else { acts.join(" | ") }
        )
    };
    format!("Pair {}: task {}\n  H: {}\n  H0: {}", i + 1, p.task.summary(), side(p.harness), side(p.base))
}

/// The user prompt for one batch.
pub fn prompt(harness_id: &str, description: &str, pairs: &[Pair<'_>]) -> String {
    let body: Vec<String> = pairs.iter().enumerate().map(|(i, p)| render_pair(i, p)).collect();
    format!(
        "Harness H = {harness_id}: {}\nBase harness H0 has no edits. Same tasks, same seeds.\n\n{}\n\n\
         When should H be preferred over H0 or avoided? Reply with JSON only:\n\
         {{\"prefer\": [{{\"when\": \"task condition\", \"behavior\": \"what H does differently\"}}], \"avoid\": []}}",
        clip(description, 300),
        body.join("\n")
    )
}

/// An LLM profiler over any [`Policy`] (e.g. [`crate::policy::openai::OpenAiPolicy`]).
pub struct LlmProfiler<'a> {
    pub policy: &'a dyn Policy,
    /// Recorded as `source = llm:<label>` on entries.
    pub label: String,
    pub config: LlmProfilerConfig,
}

impl<'a> LlmProfiler<'a> {
    pub fn new(policy: &'a dyn Policy, config: LlmProfilerConfig) -> Self {
        LlmProfiler { label: policy.checkpoint(), policy, config }
    }

    /// One call with one retry on invalid output.
    async fn ask(&self, messages: &mut Vec<Message>, calls: &mut u32, seed: u64) -> Result<Vec<(Polarity, String, String)>, String> {
        let mut last = String::new();
        for attempt in 0..2u64 {
            let sampling = SamplingParams { seed: Some(seed.wrapping_add(attempt)), ..self.config.sampling.clone() };
            *calls += 1;
            let out = self.policy.chat(messages, &[], &sampling).await.map_err(|e| format!("profiler call failed: {e}"))?;
            match parse_profile(&out.text) {
                Ok(entries) => return Ok(entries),
                Err(e) => {
                    last = format!("invalid output after {} attempt(s): {e}; answer was: {}", attempt + 1, clip(&out.text, 200));
                    messages.push(Message::new(Role::Assistant, out.text));
                    messages.push(Message::new(
                        Role::User,
                        format!("That answer is not valid: {e}. Reply with only the JSON object {{\"prefer\": [...], \"avoid\": [...]}}."),
                    ));
                }
            }
        }
        Err(last)
    }

    /// Profiles one harness from its pairs with H0; `seed` makes the calls replayable.
    pub async fn profile(&self, meta: &ProfileMeta, description: &str, pairs: &[Pair<'_>], seed: u64) -> LlmProfileOutcome {
        let mut outcome = LlmProfileOutcome::default();
        // key → (polarity, when, behavior, batches, sum of deltas, pairs)
        let mut merged: BTreeMap<(u8, String, String), (Polarity, String, String, u32, f64, u32)> = BTreeMap::new();
        let size = self.config.pairs_per_call.max(1);
        for (b, batch) in pairs.chunks(size).take(self.config.max_calls).enumerate() {
            let mut messages =
                vec![Message::new(Role::System, SYSTEM), Message::new(Role::User, prompt(&meta.harness_id, description, batch))];
            match self.ask(&mut messages, &mut outcome.calls, seed.wrapping_add(2 * b as u64)).await {
                Ok(entries) => {
                    let delta_sum: f64 = batch.iter().map(Pair::delta).sum();
                    let mut seen_here = std::collections::HashSet::new();
                    for (polarity, when, behavior) in entries {
                        let key = (u8::from(polarity == Polarity::Avoid), normalize(&when), normalize(&behavior));
                        if !seen_here.insert(key.clone()) {
                            continue;
                        }
                        let e = merged.entry(key).or_insert((polarity, when, behavior, 0, 0.0, 0));
                        e.3 += 1;
                        e.4 += delta_sum;
                        e.5 += batch.len() as u32;
                    }
                }
                Err(reason) => {
                    tracing::warn!(harness = %meta.harness_id, batch = b, %reason, "profiler batch gave no entries");
                    outcome.problems.push(format!("batch {b}: {reason}"));
                }
            }
        }
        let source = format!("llm:{}", self.label);
        let mut entries: Vec<_> = merged.into_values().collect();
        // Repeated observations first (Appendix D consolidation), then by text.
        entries.sort_by(|a, b| b.3.cmp(&a.3).then_with(|| a.1.cmp(&b.1)));
        outcome.entries = entries
            .into_iter()
            .map(|(polarity, when, behavior, batches, dsum, n)| {
                meta.entry(polarity, when, behavior, batches, (n > 0).then(|| dsum / f64::from(n)), &source)
            })
            .collect();
        outcome
    }
}

#[cfg(test)]
mod tests {
    use super::super::pair_up;
    use super::super::testing::*;
    use super::*;
    use crate::env::ToolSpec;
    use crate::policy::{FinishReason, PolicyError, PolicyOutput};
    use async_trait::async_trait;
    use std::sync::Mutex;

    #[test]
    fn profile_answers_are_parsed_strictly() {
        let ok = r#"Here you go: ```json
{"prefer": [{"when": "counting on big tables", "behavior": "inspects the schema first"}], "avoid": []}
```"#;
        assert_eq!(
            parse_profile(ok).unwrap(),
            vec![(Polarity::Prefer, "counting on big tables".into(), "inspects the schema first".into())]
        );
        for (bad, needle) in [
            ("no json here", "no JSON object"),
            ("{\"prefer\": []}", "missing field `avoid`"),
            ("{\"prefer\": [], \"avoid\": [], \"extra\": 1}", "unknown field `extra`"),
            ("{\"prefer\": [{\"when\": \"\", \"behavior\": \"x\"}], \"avoid\": []}", "`prefer[0].when` is empty"),
            ("{\"prefer\": [{\"when\": \"a\"}], \"avoid\": []}", "missing field `behavior`"),
            ("{\"prefer\": [1], \"avoid\": []}", "not a profile object"),
        ] {
            let err = parse_profile(bad).unwrap_err();
            assert!(err.contains(needle), "{bad}: {err}");
        }
        assert_eq!(normalize("  Inspects  the Schema. "), "inspects the schema");
    }

    /// Replays answers in order, recording each request.
    struct Replay {
        answers: Vec<&'static str>,
        seen: Mutex<Vec<Vec<Message>>>,
    }

    #[async_trait]
    impl Policy for Replay {
        fn checkpoint(&self) -> String {
            "replay".into()
        }
        async fn chat(&self, m: &[Message], _t: &[ToolSpec], _s: &SamplingParams) -> Result<PolicyOutput, PolicyError> {
            let mut seen = self.seen.lock().unwrap();
            let text = self.answers.get(seen.len()).copied().unwrap_or("{}");
            seen.push(m.to_vec());
            Ok(PolicyOutput {
                prompt_hash: None,
                text: text.into(),
                tool_calls: vec![],
                token_ids: vec![],
                logprobs: vec![],
                prompt_tokens: 0,
                completion_tokens: 0,
                finish_reason: FinishReason::Stop,
            })
        }
    }

    #[tokio::test]
    async fn one_retry_then_consolidation_across_batches() {
        let tasks: Vec<_> = (0..4).map(|i| task(&format!("t{i}"), "counting", 10, "How many")).collect();
        let h: Vec<_> = (0..4).map(|i| traj("h1", &format!("t{i}"), 1, i < 3, &["SELECT 1"], true)).collect();
        let b: Vec<_> = (0..4).map(|i| traj("h0", &format!("t{i}"), 1, false, &[], false)).collect();
        let pairs = pair_up(&tasks, &h, &b);
        let policy = Replay {
            answers: vec![
                "I think H is better.", // batch 0: invalid, then retried
                r#"{"prefer": [{"when": "Counting tasks", "behavior": "Commits the answer."}], "avoid": []}"#,
                r#"{"prefer": [{"when": "counting  tasks", "behavior": "commits the answer"}], "avoid": [{"when": "inserts", "behavior": "loops"}]}"#,
            ],
            seen: Mutex::new(vec![]),
        };
        let meta = ProfileMeta { run_id: "r".into(), calibration_id: "c".into(), policy_checkpoint: "ck".into(), harness_id: "h1".into() };
        let out = LlmProfiler::new(&policy, LlmProfilerConfig::default()).profile(&meta, "adds a commit hook", &pairs, 1).await;
        assert_eq!(out.calls, 3);
        assert!(out.problems.is_empty(), "{:?}", out.problems);
        let seen = policy.seen.lock().unwrap();
        assert!(seen[1].last().unwrap().content.contains("That answer is not valid"), "the retry names the error");
        assert_eq!(out.entries.len(), 2);
        let repeated = &out.entries[0];
        assert_eq!((repeated.polarity, repeated.support, repeated.when.as_str()), (Polarity::Prefer, 2, "Counting tasks"));
        assert_eq!(repeated.paired_delta, Some(0.75), "3 wins of 4 pairs over both batches");
        assert_eq!(repeated.source, "llm:replay");
        assert_eq!((out.entries[1].polarity, out.entries[1].support, out.entries[1].paired_delta), (Polarity::Avoid, 1, Some(0.5)));
    }

    #[tokio::test]
    async fn two_invalid_answers_are_recorded_not_fatal() {
        let tasks = vec![task("t0", "counting", 10, "How many")];
        let h = vec![traj("h1", "t0", 1, true, &[], true)];
        let b = vec![traj("h0", "t0", 1, false, &[], false)];
        let pairs = pair_up(&tasks, &h, &b);
        let policy = Replay { answers: vec!["nope", "{\"prefer\": 3}"], seen: Mutex::new(vec![]) };
        let meta = ProfileMeta { run_id: "r".into(), calibration_id: "c".into(), policy_checkpoint: "ck".into(), harness_id: "h1".into() };
        let out = LlmProfiler::new(&policy, LlmProfilerConfig::default()).profile(&meta, "d", &pairs, 1).await;
        assert_eq!((out.calls, out.entries.len()), (2, 0));
        assert_eq!(out.problems.len(), 1);
        assert!(out.problems[0].contains("after 2 attempt(s)"), "{:?}", out.problems);
    }
}
