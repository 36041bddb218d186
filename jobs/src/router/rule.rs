//! The built-in rule voter: ranks candidates by success on similar validation tasks
//! (Appendix C "Rule Router"), optionally adjusted by statistical profile entries whose
//! conditions hold for the task (the offline stand-in for LLM voters in the Top-K
//! variants). Needs no LLM and is deterministic given the shown candidate order.
//!
//! Score of candidate H for task x:
//! - `s(H) = Σ_j sim(x, v_j) · rate(H, v_j) / Σ_j sim(x, v_j)` over the similar validation
//!   tasks v_j on which H has outcomes (similarity: [`super::similarity`]); H's overall
//!   validation success rate when there are none;
//! - with profiles: `+ PROFILE_WEIGHT · Σ ± min(|delta|, 1)` over H's entries whose `when`
//!   is a statistical condition ([`When`]) that holds for x (+ prefer, − avoid; an entry
//!   without a delta counts ½). Free-text conditions (LLM entries) are not checked here.
//!
//! Ties: overall validation success, then the shown (shuffled) order.

use async_trait::async_trait;

use super::vote::RawBallot;
use super::{VoteRequest, Voter};
use crate::profile::When;
use schemas::Polarity;

/// Weight of the profile term relative to similar-task success (a rate in [0, 1]).
pub const PROFILE_WEIGHT: f64 = 0.25;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RuleVoter {
    pub use_profiles: bool,
}

impl RuleVoter {
    /// The score of one candidate (see the module docs).
    pub fn score(&self, candidate: &str, req: &VoteRequest<'_>) -> f64 {
        let stats = req.evidence.stats.get(candidate);
        let (mut num, mut den) = (0.0, 0.0);
        if let Some(stats) = stats {
            for (task_id, sim) in req.similar {
                if let Some(o) = stats.by_task.get(task_id).filter(|o| o.episodes > 0) {
                    num += sim * o.rate();
                    den += sim;
                }
            }
        }
        let mut score = if den > 0.0 { num / den } else { stats.map(|s| s.success_rate()).unwrap_or(0.0) };
        if self.use_profiles {
            for e in req.evidence.profiles.get(candidate).into_iter().flatten() {
                let Ok(when) = e.when.parse::<When>() else { continue };
                if when.matches(req.task) {
                    let w = e.paired_delta.map(|d| d.abs().min(1.0)).unwrap_or(0.5);
                    score += PROFILE_WEIGHT * if e.polarity == Polarity::Prefer { w } else { -w };
                }
            }
        }
        score
    }
}

impl RuleVoter {
    /// Every candidate with its score, best first (ties as in the module docs).
    pub fn ranked(&self, req: &VoteRequest<'_>) -> Vec<(String, f64)> {
        let success = req.evidence.validation_success();
        let mut scored: Vec<(usize, &String, f64, f64)> =
            req.candidates.iter().enumerate().map(|(i, c)| (i, c, self.score(c, req), success.get(c).copied().unwrap_or(0.0))).collect();
        scored.sort_by(|a, b| {
            b.2.partial_cmp(&a.2)
                .unwrap_or(std::cmp::Ordering::Equal)
                .then_with(|| b.3.partial_cmp(&a.3).unwrap_or(std::cmp::Ordering::Equal))
                .then_with(|| a.0.cmp(&b.0))
        });
        scored.into_iter().map(|(_, c, score, _)| (c.clone(), score)).collect()
    }
}

#[async_trait]
impl Voter for RuleVoter {
    fn name(&self) -> String {
        if self.use_profiles {
            "rule+profiles".into()
        } else {
            "rule".into()
        }
    }

    async fn vote(&self, req: &VoteRequest<'_>) -> RawBallot {
        let ranking: Vec<String> = self.ranked(req).into_iter().take(req.ballot_len).map(|(c, _)| c).collect();
        RawBallot { voter: self.name(), ranking: Ok(ranking), raw: None, usage: Default::default() }
    }
}
