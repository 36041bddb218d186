//! The adaptive harness router (Harness-S §3.4, Eq. 9, 10, 12; Appendix C).
//!
//! This module owns routing decisions: which auxiliary harnesses get the rescue rollouts of
//! an all-fail task (Top-K, H0 excluded) and which harness runs a test task at inference
//! (Rank-1 over the whole pool, H0 included, fixed across the task's k attempts).
//!
//! - [`vote`]: the voting arithmetic, pure (weights 1, ¾, ½, ¼; sums; tie rules; ballot
//!   validation; seeded candidate shuffle; allocation of rollouts).
//! - [`similarity`]: TF-IDF cosine over task descriptions plus a task-type bonus.
//! - [`Voter`]: one ranker; [`rule::RuleVoter`] (built in) and [`llm::LlmVoter`] (any
//!   OpenAI-compatible endpoint through [`crate::policy::Policy`]).
//! - [`Evidence`]: what voters see from one calibration (profiles, validation statistics,
//!   validation tasks); built by [`crate::reanchor::load_evidence`].
//! - [`Router`] with a [`Variant`] switch: `random`, `rule`, `llm_4x2`, `topk_fixed`,
//!   `topk_adaptive`; each call yields a [`schemas::RoutingDecision`] row, written with
//!   [`write_decisions`].
//! - [`analysis`]: Table 5 rank analysis and Pass@k / Avg@k under H_rank1 beside H0.
//!
//! ```
//! # tokio_test_block(async {
//! use jobs::profile::TaskInfo;
//! use jobs::router::{Evidence, RouteRequest, Router, RouterConfig, Variant};
//! let router = Router::new(RouterConfig::new(Variant::Rule, 2, 7), vec![]).unwrap();
//! let pool: Vec<String> = ["h0", "h1", "h2", "h3"].map(String::from).to_vec();
//! let task = TaskInfo::new("t1", "counting", "How many players scored?");
//! let routed = router
//!     .route(&RouteRequest::rescue("run1", 3, &task, &pool, &Evidence::default()))
//!     .await
//!     .unwrap();
//! assert_eq!(routed.decision.selected.len(), 2);
//! assert!(!routed.decision.selected.contains(&"h0".to_string()));
//! # });
//! # fn tokio_test_block<F: std::future::Future>(f: F) { tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(f); }
//! ```

pub mod analysis;
pub mod llm;
pub mod rule;
pub mod similarity;
pub mod vote;

use std::collections::BTreeMap;

use async_trait::async_trait;
use futures::future::join_all;

use crate::profile::{HarnessStats, TaskInfo};
use infra::store::ObjectStore;
use infra::table::TableError;
use schemas::{keys, now_unix_ms, OutputEntry, ProfileEntry, RoutePurpose, RoutingDecision, H0_ID};
use similarity::SimilarityIndex;
use vote::RawBallot;

pub use llm::LlmVoter;
pub use rule::RuleVoter;

/// The evidence of one calibration that voters see (§3.4: profiles, validation success
/// rates, outcomes on similar validation tasks).
#[derive(Debug, Clone, Default)]
pub struct Evidence {
    /// The calibration it comes from; recorded on every routing row.
    pub calibration_id: Option<String>,
    /// The validation tasks (for similarity).
    pub tasks: Vec<TaskInfo>,
    /// Validation statistics per harness id.
    pub stats: BTreeMap<String, HarnessStats>,
    /// Profile entries per harness id.
    pub profiles: BTreeMap<String, Vec<ProfileEntry>>,
    /// Short description of each harness (its direction or edits).
    pub descriptions: BTreeMap<String, String>,
    index: SimilarityIndex,
}

impl Evidence {
    pub fn new(
        calibration_id: Option<String>,
        tasks: Vec<TaskInfo>,
        stats: BTreeMap<String, HarnessStats>,
        profiles: Vec<ProfileEntry>,
        descriptions: BTreeMap<String, String>,
    ) -> Self {
        let mut by_harness: BTreeMap<String, Vec<ProfileEntry>> = BTreeMap::new();
        for e in profiles {
            by_harness.entry(e.harness_id.clone()).or_default().push(e);
        }
        let index = SimilarityIndex::new(&tasks);
        Evidence { calibration_id, tasks, stats, profiles: by_harness, descriptions, index }
    }

    /// Validation success rate per harness (the first tie rule).
    pub fn validation_success(&self) -> BTreeMap<String, f64> {
        self.stats.iter().map(|(h, s)| (h.clone(), s.success_rate())).collect()
    }

    /// The `m` validation tasks most similar to `task`.
    pub fn similar_tasks(&self, task: &TaskInfo, m: usize) -> Vec<(String, f64)> {
        self.index.most_similar(task, m)
    }

    pub fn task(&self, id: &str) -> Option<&TaskInfo> {
        self.tasks.iter().find(|t| t.task_id == id)
    }
}

/// What a voter is asked.
pub struct VoteRequest<'a> {
    pub task: &'a TaskInfo,
    /// Candidates in the order shown (shuffled per call).
    pub candidates: &'a [String],
    pub evidence: &'a Evidence,
    /// Whether profile entries are part of the evidence (not for the rule router).
    pub use_profiles: bool,
    /// How many candidates the ballot must rank.
    pub ballot_len: usize,
    /// The similar validation tasks with their similarity.
    pub similar: &'a [(String, f64)],
    /// Sampling seed of this call.
    pub seed: u64,
}

/// One voter: ranks `ballot_len` distinct candidates, best first. Voters never fail: a
/// voter that cannot answer returns a [`RawBallot`] with the reason, and the router
/// records it as an invalid ballot.
#[async_trait]
pub trait Voter: Send + Sync {
    /// `rule`, `rule+profiles` or `llm:<model>`; recorded on the ballot.
    fn name(&self) -> String;
    async fn vote(&self, req: &VoteRequest<'_>) -> RawBallot;
}

/// The rescue allocation variants of Table 2 / Appendix C.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Variant {
    /// Random Harness: K pool members drawn uniformly (seeded); no voters.
    Random,
    /// Rule Router: the rule voter on similar-task validation success, no profiles.
    Rule,
    /// LLM Router (4×2): the configured voters with profiles; ⌈K/2⌉ harnesses, 2 rollouts each.
    Llm4x2,
    /// Top-K with the profiles of the first calibration, never re-anchored.
    TopkFixed,
    /// Top-K with profiles re-anchored at every calibration (Harness-S).
    TopkAdaptive,
}

impl Variant {
    pub const ALL: [Variant; 5] = [Self::Random, Self::Rule, Self::Llm4x2, Self::TopkFixed, Self::TopkAdaptive];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Random => "random",
            Self::Rule => "rule",
            Self::Llm4x2 => "llm_4x2",
            Self::TopkFixed => "topk_fixed",
            Self::TopkAdaptive => "topk_adaptive",
        }
    }

    /// Rollouts each selected harness gets.
    pub fn rollouts_per_harness(self) -> u32 {
        if self == Self::Llm4x2 {
            2
        } else {
            1
        }
    }

    /// Whether voters see profile entries.
    pub fn uses_profiles(self) -> bool {
        matches!(self, Self::Llm4x2 | Self::TopkFixed | Self::TopkAdaptive)
    }

    /// Whether routing during training uses the latest calibration (re-anchored profiles).
    /// The other variants keep the evidence of the calibration made before training.
    pub fn reanchors(self) -> bool {
        self == Self::TopkAdaptive
    }
}

impl std::fmt::Display for Variant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Variant {
    type Err = RouterError;
    fn from_str(s: &str) -> Result<Self, RouterError> {
        Self::ALL.into_iter().find(|v| v.as_str() == s).ok_or_else(|| RouterError::Config {
            field: "variant",
            reason: format!("unknown variant `{s}`: use one of random, rule, llm_4x2, topk_fixed, topk_adaptive"),
        })
    }
}

/// Router failures: bad configuration or a request with nothing to choose from.
#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    #[error("router config: `{field}` {reason}")]
    Config { field: &'static str, reason: String },
    #[error("routing task `{task}` for {purpose}: no candidate harness (the pool has {pool} harness(es); rescue needs at least one besides `{base}`)")]
    NoCandidates { task: String, purpose: &'static str, pool: usize, base: String },
    #[error(transparent)]
    Table(#[from] TableError),
}

/// Settings of a router.
#[derive(Debug, Clone, PartialEq)]
pub struct RouterConfig {
    pub variant: Variant,
    /// Rollouts to allocate: K of a rescue group; k attempts at inference.
    pub rollouts: u32,
    /// The run seed (candidate order and LLM sampling derive from it per call).
    pub seed: u64,
    /// How many similar validation tasks voters see.
    pub similar_tasks: usize,
    /// The base harness id.
    pub base_id: String,
    /// The profile variants (`llm_4x2`, `topk_*`) vote with the built-in rule voter over
    /// profiles instead of LLM voters (recorded as `rule+profiles` on every ballot). Off by
    /// default: those variants then need voters.
    pub rule_voter: bool,
}

impl RouterConfig {
    pub fn new(variant: Variant, rollouts: u32, seed: u64) -> Self {
        RouterConfig { variant, rollouts, seed, similar_tasks: 3, base_id: H0_ID.to_string(), rule_voter: false }
    }

    /// The same with [`RouterConfig::rule_voter`] on.
    pub fn with_rule_voter(mut self) -> Self {
        self.rule_voter = true;
        self
    }
}

/// One routing call.
#[derive(Debug, Clone)]
pub struct RouteRequest<'a> {
    pub run_id: &'a str,
    pub step: u32,
    pub task: &'a TaskInfo,
    pub purpose: RoutePurpose,
    /// Every harness id of the pool, H0 included.
    pub pool: &'a [String],
    pub evidence: &'a Evidence,
}

impl<'a> RouteRequest<'a> {
    pub fn rescue(run_id: &'a str, step: u32, task: &'a TaskInfo, pool: &'a [String], evidence: &'a Evidence) -> Self {
        RouteRequest { run_id, step, task, purpose: RoutePurpose::Rescue, pool, evidence }
    }
    pub fn inference(run_id: &'a str, step: u32, task: &'a TaskInfo, pool: &'a [String], evidence: &'a Evidence) -> Self {
        RouteRequest { run_id, step, task, purpose: RoutePurpose::Inference, pool, evidence }
    }
}

/// A decision and the rollouts it allocates.
#[derive(Debug, Clone, PartialEq)]
pub struct Routed {
    /// The row to store. `score_harnesses`/`scores` are in final rank order (Rank-r is
    /// `score_harnesses[r-1]`); `selected` names the harness of each rollout, in order
    /// (a harness given two rollouts appears twice).
    pub decision: RoutingDecision,
    /// `(harness, rollouts)`, each harness once, best first.
    pub allocation: Vec<(String, u32)>,
}

/// The router: a variant, its settings and its voters.
pub struct Router {
    config: RouterConfig,
    voters: Vec<Box<dyn Voter>>,
}

impl Router {
    /// `voters` are the LLM voters of the profile variants (`llm_4x2`, `topk_*`): those
    /// variants need at least one, or [`RouterConfig::rule_voter`], never a silent
    /// stand-in. `random` and `rule` take none.
    pub fn new(config: RouterConfig, voters: Vec<Box<dyn Voter>>) -> Result<Self, RouterError> {
        match (config.variant.uses_profiles(), voters.is_empty(), config.rule_voter) {
            (true, true, false) => {
                return Err(RouterError::Config {
                    field: "voters",
                    reason: format!(
                        "variant `{}` votes with LLM voters: give at least one, or choose the rule voter over profiles (rule_voter)",
                        config.variant
                    ),
                })
            }
            (true, false, true) => {
                return Err(RouterError::Config {
                    field: "rule_voter",
                    reason: "give LLM voters or choose the rule voter, not both".into(),
                })
            }
            (false, false, _) => {
                return Err(RouterError::Config { field: "voters", reason: format!("variant `{}` takes no voters", config.variant) })
            }
            (false, true, true) => {
                return Err(RouterError::Config {
                    field: "rule_voter",
                    reason: format!("variant `{}` has no LLM voters to replace", config.variant),
                })
            }
            _ => {}
        }
        if config.rollouts == 0 {
            return Err(RouterError::Config { field: "rollouts", reason: "must be at least 1 (K of a rescue group)".into() });
        }
        if config.base_id.is_empty() {
            return Err(RouterError::Config { field: "base_id", reason: "is empty".into() });
        }
        Ok(Router { config, voters })
    }

    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    /// Routes one task (Eq. 9–10 for rescue, Eq. 12 for inference).
    pub async fn route(&self, req: &RouteRequest<'_>) -> Result<Routed, RouterError> {
        let cfg = &self.config;
        let purpose = match req.purpose {
            RoutePurpose::Rescue => "rescue",
            RoutePurpose::Inference => "inference",
        };
        let candidates: Vec<String> = match req.purpose {
            RoutePurpose::Rescue => req.pool.iter().filter(|h| **h != cfg.base_id).cloned().collect(),
            RoutePurpose::Inference => req.pool.to_vec(),
        };
        let seed = vote::call_seed(cfg.seed, req.step, &req.task.task_id, purpose);
        let order = vote::shuffled(&candidates, seed);
        if order.is_empty() {
            return Err(RouterError::NoCandidates {
                task: req.task.task_id.clone(),
                purpose,
                pool: req.pool.len(),
                base: cfg.base_id.clone(),
            });
        }

        let (ballots, ranked) = if cfg.variant == Variant::Random {
            // The seeded shuffle is the random draw; no tie rules, or it would not be random.
            (vec![], order.iter().map(|h| (h.clone(), 0.0)).collect::<Vec<_>>())
        } else if cfg.variant == Variant::Rule {
            // Appendix C's Rule Router ranks every candidate by success on similar validation
            // tasks: no 4-slot ballot, so with K = 8 ranks 5–8 are ranked by the rule too.
            let rule = RuleVoter { use_profiles: false };
            let similar = req.evidence.similar_tasks(req.task, cfg.similar_tasks);
            let vr = VoteRequest {
                task: req.task,
                candidates: &order,
                evidence: req.evidence,
                use_profiles: false,
                ballot_len: order.len(),
                similar: &similar,
                seed,
            };
            let ranked = rule.ranked(&vr);
            let ranking = ranked.iter().map(|(h, _)| h.clone()).collect();
            let ballot = schemas::Ballot {
                voter: rule.name(),
                ranking,
                valid: true,
                invalid_reason: None,
                raw: None,
                prompt_tokens: 0,
                completion_tokens: 0,
            };
            (vec![ballot], ranked)
        } else {
            // `Router::new` allows no voters only when the rule voter was chosen.
            let rule_voter = RuleVoter { use_profiles: true };
            let voters: Vec<&dyn Voter> =
                if self.voters.is_empty() { vec![&rule_voter] } else { self.voters.iter().map(|v| v.as_ref()).collect() };
            let similar = req.evidence.similar_tasks(req.task, cfg.similar_tasks);
            let ballot_len = vote::required_len(order.len());
            let raws = join_all(voters.iter().enumerate().map(|(i, v)| {
                let vr = VoteRequest {
                    task: req.task,
                    candidates: &order,
                    evidence: req.evidence,
                    use_profiles: cfg.variant.uses_profiles(),
                    ballot_len,
                    similar: &similar,
                    seed: seed.wrapping_add(i as u64),
                };
                async move { v.vote(&vr).await }
            }))
            .await;
            let ballots: Vec<_> = raws.into_iter().map(|r| vote::validate_ballot(r, &order)).collect();
            for b in ballots.iter().filter(|b| !b.valid) {
                tracing::warn!(task = %req.task.task_id, voter = %b.voter, reason = b.invalid_reason.as_deref().unwrap_or(""), "ballot discarded");
            }
            let scores = vote::sum_scores(&ballots, &order);
            (ballots, vote::rank(&scores, &req.evidence.validation_success()))
        };

        let allocation = match req.purpose {
            RoutePurpose::Rescue => {
                let per = cfg.variant.rollouts_per_harness();
                let n = cfg.rollouts.div_ceil(per) as usize;
                vote::allocate(&vote::top_k_auxiliaries(&ranked, &cfg.base_id, n), cfg.rollouts, per)
            }
            // Rank-1, fixed across the task's k attempts (Appendix C).
            RoutePurpose::Inference => vote::rank1(&ranked).map(|h| vec![(h, cfg.rollouts)]).unwrap_or_default(),
        };
        let selected = allocation.iter().flat_map(|(h, n)| std::iter::repeat_n(h.clone(), *n as usize)).collect();
        let decision = RoutingDecision {
            run_id: req.run_id.to_string(),
            step: req.step,
            task_id: req.task.task_id.clone(),
            purpose: req.purpose,
            variant: cfg.variant.as_str().to_string(),
            calibration_id: req.evidence.calibration_id.clone(),
            candidate_order: order,
            ballots,
            score_harnesses: ranked.iter().map(|(h, _)| h.clone()).collect(),
            scores: ranked.iter().map(|(_, s)| *s).collect(),
            selected,
            decided_at_ms: now_unix_ms(),
        };
        Ok(Routed { decision, allocation })
    }
}

/// Writes decisions as one Parquet part at `runs/<run>/routing/step=<n>/part-<job>.parquet`.
pub async fn write_decisions(
    store: &dyn ObjectStore,
    run_id: &str,
    step: u32,
    job_id: &str,
    decisions: &[RoutingDecision],
) -> Result<OutputEntry, RouterError> {
    Ok(infra::table::write_records(store, &keys::routing_part(run_id, step, job_id), decisions).await?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::testing::task;
    use crate::profile::Outcome;
    use schemas::Polarity;

    fn pool(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("h{i}")).collect()
    }

    /// Validation evidence: h3 wins on counting tasks, h1 on INSERT tasks, h2 overall mediocre.
    fn evidence() -> Evidence {
        let tasks = vec![
            task("v1", "counting", 50, "How many players scored more than ten goals"),
            task("v2", "counting", 60, "How many teams won more than five games"),
            task("v3", "INSERT", 5, "Insert a new player into the roster table"),
        ];
        let mut stats = BTreeMap::new();
        let mk = |h: &str, outcomes: &[(&str, u32, u32)]| {
            let mut s = HarnessStats { harness_id: h.into(), ..Default::default() };
            for (t, ok, n) in outcomes {
                s.by_task.insert(t.to_string(), Outcome { successes: *ok, episodes: *n });
                s.successes += ok;
                s.episodes += n;
            }
            s
        };
        stats.insert("h0".into(), mk("h0", &[("v1", 0, 1), ("v2", 0, 1), ("v3", 0, 1)]));
        stats.insert("h1".into(), mk("h1", &[("v1", 0, 1), ("v2", 0, 1), ("v3", 1, 1)]));
        stats.insert("h2".into(), mk("h2", &[("v1", 1, 2), ("v2", 0, 2), ("v3", 1, 2)]));
        stats.insert("h3".into(), mk("h3", &[("v1", 1, 1), ("v2", 1, 1), ("v3", 0, 1)]));
        let profile = ProfileEntry {
            run_id: "r".into(),
            calibration_id: "c1".into(),
            policy_checkpoint: "ck".into(),
            harness_id: "h4".into(),
            polarity: Polarity::Prefer,
            when: "task_type = counting".into(),
            behavior: "inspects the schema".into(),
            support: 3,
            paired_delta: Some(1.0),
            source: "statistical".into(),
        };
        Evidence::new(Some("c1".into()), tasks, stats, vec![profile], BTreeMap::new())
    }

    #[tokio::test]
    async fn rule_router_picks_harnesses_that_win_on_similar_tasks() {
        let ev = evidence();
        let router = Router::new(RouterConfig::new(Variant::Rule, 2, 1), vec![]).unwrap();
        let x = task("x", "counting", 55, "How many players scored fewer than three goals");
        let routed = router.route(&RouteRequest::rescue("r", 1, &x, &pool(5), &ev)).await.unwrap();
        let d = &routed.decision;
        assert_eq!(d.selected, vec!["h3", "h2"], "{d:?}");
        assert_eq!(d.ballots.len(), 1);
        assert_eq!(d.ballots[0].voter, "rule");
        assert_eq!(d.ballots[0].ranking.len(), 4);
        assert_eq!(d.calibration_id.as_deref(), Some("c1"));
        assert_eq!(d.variant, "rule");
        assert!(!d.candidate_order.contains(&"h0".to_string()));
        assert_eq!(d.score_harnesses.len(), 4);
        assert!(d.scores[0] > d.scores[1], "scores are the rule's similar-task success: {:?}", d.scores);
        // Without profiles h4 (no validation evidence) ranks last.
        assert_eq!(d.score_harnesses.last().unwrap(), "h4");
        let x2 = task("x2", "INSERT", 4, "Insert a player into the roster");
        let routed = router.route(&RouteRequest::rescue("r", 1, &x2, &pool(5), &ev)).await.unwrap();
        assert_eq!(routed.decision.selected[0], "h1");
    }

    /// Appendix C's Rule Router ranks every candidate by similar-task success: with K = 8 of
    /// 9 siblings, ranks 5–8 follow it too, not overall validation success (which a 4-slot
    /// ballot would fall back to, picking the similar-task worst h9 here).
    #[tokio::test]
    async fn rule_router_ranks_every_candidate_for_large_k() {
        let tasks = vec![task("v1", "counting", 50, "How many players scored more than ten goals")];
        let mut stats = BTreeMap::new();
        for i in 1..=9u32 {
            let mut s = HarnessStats { harness_id: format!("h{i}"), ..Default::default() };
            s.by_task.insert("v1".into(), Outcome { successes: 10 - i, episodes: 10 });
            // Overall success rises with i: the opposite order.
            (s.successes, s.episodes) = (10 * i, 100);
            stats.insert(format!("h{i}"), s);
        }
        let ev = Evidence::new(None, tasks, stats, vec![], BTreeMap::new());
        let router = Router::new(RouterConfig::new(Variant::Rule, 8, 3), vec![]).unwrap();
        let x = task("x", "counting", 55, "How many players scored fewer than three goals");
        let d = router.route(&RouteRequest::rescue("r", 1, &x, &pool(10), &ev)).await.unwrap().decision;
        let expected: Vec<String> = (1..=8).map(|i| format!("h{i}")).collect();
        assert_eq!(d.selected, expected, "{d:?}");
        assert_eq!(d.score_harnesses.len(), 9);
        assert_eq!(d.ballots[0].ranking.len(), 9, "the rule ranks every candidate");
        assert!(d.scores.windows(2).all(|w| w[0] >= w[1]), "{:?}", d.scores);
    }

    #[tokio::test]
    async fn profile_variants_use_profiles_and_allocate_per_variant() {
        let ev = evidence();
        let x = task("x", "counting", 55, "How many players scored fewer than three goals");
        let topk = Router::new(RouterConfig::new(Variant::TopkAdaptive, 4, 1).with_rule_voter(), vec![]).unwrap();
        let routed = topk.route(&RouteRequest::rescue("r", 1, &x, &pool(5), &ev)).await.unwrap();
        assert_eq!(routed.decision.ballots[0].voter, "rule+profiles");
        // h4 has no validation evidence; its matching prefer entry (+0.25) lifts it above h1 (0).
        let pos = |h: &str| routed.decision.score_harnesses.iter().position(|x| x == h).unwrap();
        assert!(pos("h4") < 3, "{:?}", routed.decision.score_harnesses);
        assert_eq!(routed.allocation.iter().map(|(_, n)| n).sum::<u32>(), 4);
        assert!(routed.allocation.iter().all(|(_, n)| *n == 1));

        let four_by_two = Router::new(RouterConfig::new(Variant::Llm4x2, 4, 1).with_rule_voter(), vec![]).unwrap();
        let routed = four_by_two.route(&RouteRequest::rescue("r", 1, &x, &pool(5), &ev)).await.unwrap();
        assert_eq!(routed.allocation.len(), 2);
        assert!(routed.allocation.iter().all(|(_, n)| *n == 2));
        assert_eq!(routed.decision.selected.len(), 4);
        assert_eq!(routed.decision.selected[0], routed.decision.selected[1]);
    }

    #[tokio::test]
    async fn random_draws_vary_across_tasks_and_never_pick_h0_for_rescue() {
        let ev = Evidence::default();
        let router = Router::new(RouterConfig::new(Variant::Random, 3, 9), vec![]).unwrap();
        let mut firsts = std::collections::HashSet::new();
        for i in 0..20 {
            let x = task(&format!("t{i}"), "counting", 1, "q");
            let d = router.route(&RouteRequest::rescue("r", 0, &x, &pool(9), &ev)).await.unwrap().decision;
            assert!(d.ballots.is_empty());
            assert_eq!(d.selected.len(), 3);
            assert!(!d.selected.contains(&"h0".to_string()));
            let distinct: std::collections::HashSet<_> = d.selected.iter().collect();
            assert_eq!(distinct.len(), 3);
            assert_eq!(d.calibration_id, None);
            firsts.insert(d.selected[0].clone());
        }
        assert!(firsts.len() >= 4, "random draws vary: {firsts:?}");
    }

    #[tokio::test]
    async fn inference_ranks_the_whole_pool_including_h0() {
        let mut ev = evidence();
        // Make H0 the best on similar tasks.
        let h0 = ev.stats.get_mut("h0").unwrap();
        h0.by_task.insert("v1".into(), Outcome { successes: 3, episodes: 3 });
        h0.by_task.insert("v2".into(), Outcome { successes: 3, episodes: 3 });
        (h0.successes, h0.episodes) = (6, 7);
        let router = Router::new(RouterConfig::new(Variant::Rule, 3, 1), vec![]).unwrap();
        let x = task("x", "counting", 55, "How many players scored fewer than three goals");
        let routed = router.route(&RouteRequest::inference("r", 9, &x, &pool(5), &ev)).await.unwrap();
        assert_eq!(routed.decision.purpose, RoutePurpose::Inference);
        assert_eq!(routed.allocation, vec![("h0".to_string(), 3)], "Rank-1 fixed across the k = 3 attempts");
        assert_eq!(routed.decision.selected, vec!["h0", "h0", "h0"]);
        assert!(routed.decision.candidate_order.contains(&"h0".to_string()));
    }

    #[tokio::test]
    async fn bad_requests_and_configs_are_errors_not_panics() {
        let ev = Evidence::default();
        let router = Router::new(RouterConfig::new(Variant::TopkFixed, 8, 1).with_rule_voter(), vec![]).unwrap();
        let x = task("x", "counting", 1, "q");
        let err = router.route(&RouteRequest::rescue("r", 0, &x, &pool(1), &ev)).await.unwrap_err();
        assert!(err.to_string().contains("no candidate harness"), "{err}");
        assert!(Router::new(RouterConfig::new(Variant::Rule, 0, 1), vec![]).is_err());
        // A variant that votes with LLMs has voters, or the rule voter by choice; never a
        // silent stand-in.
        let err = Router::new(RouterConfig::new(Variant::TopkAdaptive, 4, 1), vec![]).err().unwrap().to_string();
        assert!(err.contains("votes with LLM voters") && err.contains("rule_voter"), "{err}");
        assert!(Router::new(RouterConfig::new(Variant::Rule, 2, 1).with_rule_voter(), vec![]).is_err());
        let voters: Vec<Box<dyn Voter>> = vec![Box::new(RuleVoter { use_profiles: true })];
        assert!(Router::new(RouterConfig::new(Variant::TopkFixed, 2, 1).with_rule_voter(), voters).is_err());
        let err = "top8".parse::<Variant>().unwrap_err();
        assert!(err.to_string().contains("llm_4x2"), "{err}");
        for v in Variant::ALL {
            assert_eq!(v.as_str().parse::<Variant>().unwrap(), v);
        }
        // A pool smaller than K: every auxiliary is used, the group still gets K rollouts.
        let d = router.route(&RouteRequest::rescue("r", 0, &x, &pool(3), &ev)).await.unwrap();
        assert_eq!(d.decision.selected.len(), 8);
        assert_eq!(d.allocation.len(), 2);
    }

    /// A voter that answers nonsense: its ballot is recorded as invalid, the decision stands.
    struct Broken;
    #[async_trait]
    impl Voter for Broken {
        fn name(&self) -> String {
            "llm:broken".into()
        }
        async fn vote(&self, req: &VoteRequest<'_>) -> RawBallot {
            RawBallot {
                voter: self.name(),
                ranking: Ok(vec![req.candidates[0].clone(); 4]),
                raw: Some("dup".into()),
                usage: Default::default(),
            }
        }
    }

    #[tokio::test]
    async fn invalid_ballots_leave_a_well_formed_decision() {
        let ev = evidence();
        let voters: Vec<Box<dyn Voter>> = vec![Box::new(Broken), Box::new(RuleVoter { use_profiles: true })];
        let router = Router::new(RouterConfig::new(Variant::TopkAdaptive, 2, 1), voters).unwrap();
        let x = task("x", "counting", 55, "How many players scored fewer than three goals");
        let d = router.route(&RouteRequest::rescue("r", 1, &x, &pool(5), &ev)).await.unwrap().decision;
        assert_eq!(d.ballots.len(), 2);
        assert!(!d.ballots[0].valid);
        assert!(d.ballots[0].invalid_reason.as_deref().unwrap().contains("duplicate"));
        assert!(d.ballots[1].valid);
        assert_eq!(d.selected.len(), 2);
        let total: f64 = d.scores.iter().sum();
        assert_eq!(total, 2.5, "only the valid ballot is counted");
    }

    #[tokio::test]
    async fn decisions_round_trip_through_parquet() {
        let dir = tempfile::tempdir().unwrap();
        let store = infra::store::LocalStore::new(dir.path()).unwrap();
        let router = Router::new(RouterConfig::new(Variant::Rule, 2, 1), vec![]).unwrap();
        let ev = evidence();
        let mut rows = vec![];
        for i in 0..3 {
            let x = task(&format!("t{i}"), "counting", 1, "How many");
            rows.push(router.route(&RouteRequest::rescue("r", 4, &x, &pool(5), &ev)).await.unwrap().decision);
        }
        let out = write_decisions(&store, "r", 4, "job", &rows).await.unwrap();
        assert_eq!(out.key, "runs/r/routing/step=4/part-job.parquet");
        let back: Vec<RoutingDecision> = infra::table::read_records(&store, &out.key).await.unwrap();
        assert_eq!(back, rows);
    }
}
