//! What each stage of a run cost (the paper's Table 9): wall time, rollouts and the policy
//! tokens they sampled, tokens spent by each LLM component (router voters, profiler,
//! diagnoser, editor) and tokens the learner ran through. The scheduler collects one
//! [`StageCost`] while a stage runs and stores it as metrics of stage `cost:<kind>` when the
//! stage finishes; the report sums them per stage kind.

use std::collections::BTreeMap;

use schemas::{LlmUsage, RoutingDecision, Trajectory};

/// Metric stage prefix of cost rows: `cost:base`, `cost:learn`, ...
pub const STAGE_PREFIX: &str = "cost:";

/// Stage kinds in run order, as the run's `Stage::kind` names them.
pub const KINDS: [&str; 11] =
    ["evolve", "packets", "baseline", "calibration", "base", "rescue", "groups", "edit", "learn", "evaluation", "report"];

/// LLM components besides the policy, in report order.
pub const COMPONENTS: [&str; 4] = ["voter", "profiler", "diagnoser", "editor"];

/// The costs of one stage while it runs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StageCost {
    /// Rollouts whose rows the stage read (its own jobs, done now or by an earlier drive).
    pub rollouts: u64,
    /// The policy's calls and tokens: from rollout rows, or the evolve job's meter.
    pub policy: LlmUsage,
    /// Tokens of the other LLM components, by [`COMPONENTS`] name.
    pub llm: BTreeMap<String, LlmUsage>,
    /// Tokens the learner ran forward and backward.
    pub learner_forward_tokens: u64,
}

impl StageCost {
    /// Counts rollout rows: their model calls and prompt / completion tokens.
    pub fn add_rows(&mut self, rows: &[Trajectory]) {
        self.rollouts += rows.len() as u64;
        for r in rows {
            self.policy.add(LlmUsage {
                calls: u64::from(r.model_calls),
                prompt_tokens: r.prompt_tokens,
                completion_tokens: r.completion_tokens,
            });
        }
    }

    /// Counts what a component spent (`policy` goes to the policy's own line).
    pub fn add_llm(&mut self, component: &str, usage: LlmUsage) {
        if usage == LlmUsage::default() {
            return;
        }
        match component {
            "policy" => self.policy.add(usage),
            c => self.llm.entry(c.to_string()).or_default().add(usage),
        }
    }

    /// Counts the LLM voters' ballots of routing decisions (the rule voter spends nothing).
    pub fn add_decisions(&mut self, decisions: &[RoutingDecision]) {
        for b in decisions.iter().flat_map(|d| &d.ballots).filter(|b| b.voter.starts_with("llm:")) {
            self.add_llm("voter", LlmUsage::call(b.prompt_tokens, b.completion_tokens));
        }
    }

    /// The metric rows of the stage (names without the stage), zero entries left out but
    /// the wall time always present.
    pub fn metrics(&self, wall_seconds: f64) -> Vec<(String, f64)> {
        let mut m = vec![("wall_seconds".to_string(), wall_seconds)];
        let mut usage = |name: &str, u: &LlmUsage| {
            if *u != LlmUsage::default() {
                m.push((format!("{name}_calls"), u.calls as f64));
                m.push((format!("{name}_prompt_tokens"), u.prompt_tokens as f64));
                m.push((format!("{name}_completion_tokens"), u.completion_tokens as f64));
            }
        };
        usage("policy", &self.policy);
        for (c, u) in &self.llm {
            usage(c, u);
        }
        if self.rollouts > 0 {
            m.push(("rollouts".into(), self.rollouts as f64));
        }
        if self.learner_forward_tokens > 0 {
            m.push(("learner_forward_tokens".into(), self.learner_forward_tokens as f64));
        }
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn components_add_up_and_only_llm_ballots_cost() {
        let mut c = StageCost::default();
        c.add_llm("profiler", LlmUsage::call(100, 20));
        c.add_llm("profiler", LlmUsage::call(50, 10));
        c.add_llm("diagnoser", LlmUsage::default());
        c.add_llm("policy", LlmUsage::call(7, 3));
        let ballot = |voter: &str, p, q| schemas::Ballot {
            voter: voter.into(),
            ranking: vec![],
            valid: true,
            invalid_reason: None,
            raw: None,
            prompt_tokens: p,
            completion_tokens: q,
        };
        let decision = RoutingDecision {
            run_id: "r".into(),
            step: 1,
            task_id: "t".into(),
            purpose: schemas::RoutePurpose::Rescue,
            variant: "topk_adaptive".into(),
            calibration_id: None,
            candidate_order: vec![],
            ballots: vec![ballot("llm:a", 300, 12), ballot("llm:b", 310, 14), ballot("rule", 0, 0)],
            score_harnesses: vec![],
            scores: vec![],
            selected: vec![],
            decided_at_ms: 0,
        };
        c.add_decisions(&[decision]);
        let m: BTreeMap<String, f64> = c.metrics(2.5).into_iter().collect();
        assert_eq!(m["wall_seconds"], 2.5);
        assert_eq!((m["profiler_calls"], m["profiler_prompt_tokens"], m["profiler_completion_tokens"]), (2.0, 150.0, 30.0));
        assert_eq!((m["voter_calls"], m["voter_prompt_tokens"], m["voter_completion_tokens"]), (2.0, 610.0, 26.0));
        assert_eq!((m["policy_calls"], m["policy_prompt_tokens"]), (1.0, 7.0));
        assert!(!m.contains_key("diagnoser_calls"), "a component that spent nothing has no rows");
        assert!(!m.contains_key("rollouts"));
    }
}
