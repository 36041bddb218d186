//! The voting arithmetic of the router (Harness-S §3.4, Eq. 9–10, Appendix C), as pure
//! functions: ballot validation, rank weights, score aggregation with the two tie rules,
//! Top-K auxiliaries for rescue and Rank-1 over the whole pool for inference, and the
//! seeded per-call shuffle of the candidate order.
//!
//! A ballot lists `n` distinct candidates, best first (`n` = 4, or the number of
//! candidates when fewer than 4 are offered). Rank `r` (from 1) earns weight
//! `(5 − r) / 4`: 1, ¾, ½, ¼; unlisted candidates earn 0. Invalid ballots (unparsable,
//! unknown ids, duplicates, too short) are kept in the decision with their reason and
//! contribute nothing.

use std::cmp::Ordering;
use std::collections::{BTreeMap, HashSet};

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use schemas::Ballot;
use sha2::{Digest, Sha256};

/// Candidates each ballot ranks (Appendix C).
pub const BALLOT_LEN: usize = 4;

/// Weight of rank `rank` (1-based) on a ballot: 1, ¾, ½, ¼, then 0 (Eq. 9, Appendix C).
pub fn rank_weight(rank: usize) -> f64 {
    match rank {
        1..=BALLOT_LEN => (BALLOT_LEN + 1 - rank) as f64 / BALLOT_LEN as f64,
        _ => 0.0,
    }
}

/// Ballot length required when `candidates` are offered: 4, or all of them when fewer.
pub fn required_len(candidates: usize) -> usize {
    candidates.min(BALLOT_LEN)
}

/// What a voter answered before validation: the ranking it gave, or why none could be read.
#[derive(Debug, Clone, PartialEq)]
pub struct RawBallot {
    pub voter: String,
    /// The ranking read from the answer, or the reason nothing could be read
    /// (`unparsable: ...`, `voter call failed: ...`).
    pub ranking: Result<Vec<String>, String>,
    /// The voter's raw output, kept for audit.
    pub raw: Option<String>,
    /// What the voter's call spent (zero for the rule voter).
    pub usage: schemas::LlmUsage,
}

/// Validates a raw ballot against the candidates offered (Appendix C): exactly
/// [`required_len`] distinct known ids. Extra entries beyond the required length are an
/// error too, so that a voter cannot spread weight over more than four harnesses.
pub fn validate_ballot(raw: RawBallot, candidates: &[String]) -> Ballot {
    let need = required_len(candidates.len());
    let reason = match &raw.ranking {
        Err(reason) => Some(reason.clone()),
        Ok(ranking) => {
            let known: HashSet<&str> = candidates.iter().map(String::as_str).collect();
            let mut seen = HashSet::new();
            let unknown: Vec<&str> = ranking.iter().map(String::as_str).filter(|id| !known.contains(id)).collect();
            let duplicates: Vec<&str> = ranking.iter().map(String::as_str).filter(|id| !seen.insert(*id)).collect();
            if !unknown.is_empty() {
                Some(format!("unknown harness id(s): {}", unknown.join(", ")))
            } else if !duplicates.is_empty() {
                Some(format!("duplicate harness id(s): {}", duplicates.join(", ")))
            } else if ranking.len() < need {
                Some(format!("ranks {} candidate(s); {need} distinct are required", ranking.len()))
            } else if ranking.len() > need {
                Some(format!("ranks {} candidates; exactly {need} are allowed", ranking.len()))
            } else {
                None
            }
        }
    };
    Ballot {
        voter: raw.voter,
        ranking: raw.ranking.unwrap_or_default(),
        valid: reason.is_none(),
        invalid_reason: reason,
        raw: raw.raw,
        prompt_tokens: raw.usage.prompt_tokens,
        completion_tokens: raw.usage.completion_tokens,
    }
}

/// Summed scores q(H | x) over the valid ballots (Eq. 9), for every candidate (zero when
/// no valid ballot lists it).
pub fn sum_scores(ballots: &[Ballot], candidates: &[String]) -> BTreeMap<String, f64> {
    let mut scores: BTreeMap<String, f64> = candidates.iter().map(|c| (c.clone(), 0.0)).collect();
    for ballot in ballots.iter().filter(|b| b.valid) {
        for (i, id) in ballot.ranking.iter().enumerate() {
            if let Some(s) = scores.get_mut(id) {
                *s += rank_weight(i + 1);
            }
        }
    }
    scores
}

/// Candidates in final rank order: score descending, then validation success descending,
/// then harness id ascending (Appendix C tie rules). A harness without validation evidence
/// counts as success 0.
pub fn rank(scores: &BTreeMap<String, f64>, validation_success: &BTreeMap<String, f64>) -> Vec<(String, f64)> {
    let mut ranked: Vec<(String, f64)> = scores.iter().map(|(h, s)| (h.clone(), *s)).collect();
    let success = |h: &str| validation_success.get(h).copied().filter(|v| v.is_finite()).unwrap_or(0.0);
    ranked.sort_by(|(ha, sa), (hb, sb)| {
        sb.partial_cmp(sa)
            .unwrap_or(Ordering::Equal)
            .then_with(|| success(hb).partial_cmp(&success(ha)).unwrap_or(Ordering::Equal))
            .then_with(|| ha.cmp(hb))
    });
    ranked
}

/// Top-K auxiliaries for a rescue group (Eq. 10): the first `k` of `ranked` that are not
/// the base harness. When fewer than `k` auxiliaries exist, all of them are returned.
pub fn top_k_auxiliaries(ranked: &[(String, f64)], base: &str, k: usize) -> Vec<String> {
    ranked.iter().map(|(h, _)| h).filter(|h| h.as_str() != base).take(k).cloned().collect()
}

/// Rank-1 over the whole pool, base harness included (Eq. 12).
pub fn rank1(ranked: &[(String, f64)]) -> Option<String> {
    ranked.first().map(|(h, _)| h.clone())
}

/// Splits `rollouts` over the harnesses in `order`, `per_harness` each, going round the
/// list again when it is too short, so that a group always has `rollouts` members
/// (Appendix C: Top-8 gives one rollout to each of eight; LLM 4×2 two to each of four).
/// Returns `(harness, rollouts)` in order, each harness once.
pub fn allocate(order: &[String], rollouts: u32, per_harness: u32) -> Vec<(String, u32)> {
    let mut alloc: Vec<(String, u32)> = Vec::new();
    if order.is_empty() || per_harness == 0 {
        return alloc;
    }
    let mut left = rollouts;
    let mut i = 0usize;
    while left > 0 {
        let h = &order[i % order.len()];
        let n = per_harness.min(left);
        match alloc.iter_mut().find(|(x, _)| x == h) {
            Some((_, c)) => *c += n,
            None => alloc.push((h.clone(), n)),
        }
        left -= n;
        i += 1;
    }
    alloc
}

/// Seed of one routing call, derived from the run seed and what the call is about, so that
/// candidate order differs between calls yet replays identically on resume.
pub fn call_seed(run_seed: u64, step: u32, task_id: &str, purpose: &str) -> u64 {
    let mut h = Sha256::new();
    h.update(run_seed.to_le_bytes());
    h.update(step.to_le_bytes());
    h.update(task_id.as_bytes());
    h.update([0x1f]);
    h.update(purpose.as_bytes());
    let d = h.finalize();
    u64::from_le_bytes(d[..8].try_into().expect("8 bytes"))
}

/// The candidate order shown to voters: `candidates` shuffled with `seed` (Appendix C:
/// candidate order varies across calls, against position bias).
pub fn shuffled(candidates: &[String], seed: u64) -> Vec<String> {
    let mut order = candidates.to_vec();
    order.sort();
    order.dedup();
    order.shuffle(&mut ChaCha8Rng::seed_from_u64(seed));
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    fn ballot(voter: &str, ranking: &[&str], candidates: &[String]) -> Ballot {
        validate_ballot(RawBallot { voter: voter.into(), ranking: Ok(ids(ranking)), raw: None, usage: Default::default() }, candidates)
    }

    fn pool() -> Vec<String> {
        ids(&["h0", "h1", "h2", "h3", "h4", "h5", "h6", "h7", "h8"])
    }

    #[test]
    fn weights_are_one_three_quarters_half_quarter() {
        assert_eq!((1..=5).map(rank_weight).collect::<Vec<_>>(), vec![1.0, 0.75, 0.5, 0.25, 0.0]);
        assert_eq!(rank_weight(0), 0.0);
    }

    #[test]
    fn the_papers_worked_example() {
        // Figure 2: LLM1 = H7 H2 H6 H1, LLM2 = H7 H6 H2 H5, LLM3 = H2 H7 H1 H6.
        let c = pool();
        let ballots = vec![
            ballot("llm1", &["h7", "h2", "h6", "h1"], &c),
            ballot("llm2", &["h7", "h6", "h2", "h5"], &c),
            ballot("llm3", &["h2", "h7", "h1", "h6"], &c),
        ];
        assert!(ballots.iter().all(|b| b.valid));
        let scores = sum_scores(&ballots, &c);
        assert_eq!(scores["h7"], 2.75); // 1 + 1 + 0.75
        assert_eq!(scores["h2"], 2.25); // 0.75 + 0.5 + 1
        assert_eq!(scores["h6"], 1.50); // 0.5 + 0.75 + 0.25
        assert_eq!(scores["h1"], 0.75);
        assert_eq!(scores["h5"], 0.25);
        assert_eq!(scores["h3"], 0.0);
        let ranked = rank(&scores, &BTreeMap::new());
        assert_eq!(top_k_auxiliaries(&ranked, "h0", 3), ids(&["h7", "h2", "h6"]));
        assert_eq!(rank1(&ranked).as_deref(), Some("h7"));
    }

    #[test]
    fn ties_are_broken_by_validation_success_then_harness_id() {
        let c = ids(&["h0", "h1", "h2", "h3"]);
        // h1 and h2 both score 1.0 + 0.75 = 1.75 over two ballots.
        let ballots = vec![ballot("a", &["h1", "h2", "h3", "h0"], &c), ballot("b", &["h2", "h1", "h0", "h3"], &c)];
        let scores = sum_scores(&ballots, &c);
        assert_eq!((scores["h1"], scores["h2"]), (1.75, 1.75));

        // Rule 1: higher validation success wins the tie.
        let success: BTreeMap<String, f64> = [("h1".into(), 0.2), ("h2".into(), 0.6)].into();
        let ranked = rank(&scores, &success);
        assert_eq!(ranked[0].0, "h2");
        assert_eq!(ranked[1].0, "h1");

        // Rule 2: equal validation success falls back to harness id.
        let success: BTreeMap<String, f64> = [("h1".into(), 0.5), ("h2".into(), 0.5)].into();
        let ranked = rank(&scores, &success);
        assert_eq!((ranked[0].0.as_str(), ranked[1].0.as_str()), ("h1", "h2"));
        // h0 and h3 also tie (0.75 each): no evidence for either, so by id.
        assert_eq!((ranked[2].0.as_str(), ranked[3].0.as_str()), ("h0", "h3"));
    }

    #[test]
    fn rescue_excludes_h0_and_inference_includes_it() {
        let c = ids(&["h0", "h1", "h2", "h3", "h4"]);
        let ballots = vec![ballot("a", &["h0", "h3", "h1", "h2"], &c)];
        let ranked = rank(&sum_scores(&ballots, &c), &BTreeMap::new());
        assert_eq!(rank1(&ranked).as_deref(), Some("h0"));
        assert_eq!(top_k_auxiliaries(&ranked, "h0", 2), ids(&["h3", "h1"]));
        assert_eq!(top_k_auxiliaries(&ranked, "h0", 10), ids(&["h3", "h1", "h2", "h4"]));
    }

    #[test]
    fn invalid_ballots_are_recorded_with_a_reason_and_count_nothing() {
        let c = ids(&["h0", "h1", "h2", "h3", "h4"]);
        let unknown = ballot("u", &["h1", "h9", "h2", "h3"], &c);
        assert!(!unknown.valid);
        assert!(unknown.invalid_reason.as_deref().unwrap().contains("unknown harness id(s): h9"));
        let dup = ballot("d", &["h1", "h1", "h2", "h3"], &c);
        assert!(dup.invalid_reason.as_deref().unwrap().contains("duplicate harness id(s): h1"));
        let short = ballot("s", &["h1", "h2"], &c);
        assert!(short.invalid_reason.as_deref().unwrap().contains("ranks 2 candidate(s); 4 distinct are required"));
        let long = ballot("l", &["h1", "h2", "h3", "h4", "h0"], &c);
        assert!(long.invalid_reason.as_deref().unwrap().contains("exactly 4"));
        let unparsable = validate_ballot(
            RawBallot {
                voter: "p".into(),
                ranking: Err("unparsable: expected `{`".into()),
                raw: Some("I like h1".into()),
                usage: Default::default(),
            },
            &c,
        );
        assert_eq!((unparsable.valid, unparsable.raw.as_deref()), (false, Some("I like h1")));
        assert!(unparsable.ranking.is_empty());
        let good = ballot("g", &["h4", "h3", "h2", "h1"], &c);
        let scores = sum_scores(&[unknown, dup, short, long, unparsable, good], &c);
        assert_eq!(scores.values().sum::<f64>(), 2.5, "only the valid ballot counts");
        assert_eq!(scores["h4"], 1.0);
    }

    #[test]
    fn small_pools_need_shorter_ballots() {
        let c = ids(&["h0", "h1", "h2"]);
        assert!(ballot("a", &["h2", "h0", "h1"], &c).valid);
        assert!(!ballot("a", &["h2", "h0"], &c).valid);
    }

    #[test]
    fn allocation_fills_the_group() {
        let order = ids(&["a", "b", "c", "d", "e"]);
        assert_eq!(allocate(&order[..4], 8, 2), vec![("a".into(), 2), ("b".into(), 2), ("c".into(), 2), ("d".into(), 2)]);
        assert_eq!(allocate(&order, 3, 1), vec![("a".into(), 1), ("b".into(), 1), ("c".into(), 1)]);
        // Fewer auxiliaries than rollouts: go round again, best first.
        assert_eq!(allocate(&order[..2], 5, 1), vec![("a".into(), 3), ("b".into(), 2)]);
        assert_eq!(allocate(&order[..3], 8, 2), vec![("a".into(), 4), ("b".into(), 2), ("c".into(), 2)]);
        assert!(allocate(&[], 8, 1).is_empty());
    }

    #[test]
    fn candidate_order_is_seeded_per_call() {
        let c = pool();
        let s1 = call_seed(7, 3, "t1", "rescue");
        assert_eq!(shuffled(&c, s1), shuffled(&c, call_seed(7, 3, "t1", "rescue")), "replays identically");
        let mut sorted = shuffled(&c, s1);
        sorted.sort();
        assert_eq!(sorted, c, "a permutation");
        let orders: HashSet<Vec<String>> = (0..20).map(|i| shuffled(&c, call_seed(7, 3, &format!("t{i}"), "rescue"))).collect();
        assert!(orders.len() > 15, "orders vary across calls ({} distinct of 20)", orders.len());
        assert_ne!(call_seed(7, 3, "t1", "rescue"), call_seed(8, 3, "t1", "rescue"));
        assert_ne!(call_seed(7, 3, "t1", "rescue"), call_seed(7, 3, "t1", "inference"));
    }
}
