//! Parent selection (Harness-S §3.2, Eq. 3): choose at most B of this round's valid
//! children to maximise the number of validation tasks their union solves, |∪ V(H)|.
//! Each task counts once, so parents that cover one another's failures are favoured.
//!
//! Exact (every subset of size 1..=B) when there are at most [`EXACT_LIMIT`] candidates,
//! greedy by marginal gain beyond. Ties are deterministic: more coverage, then fewer
//! parents, then the lexicographically smallest list of ids.

use std::collections::BTreeSet;

/// Largest candidate count solved exactly: C(24, ≤4) ≈ 13k subsets.
pub const EXACT_LIMIT: usize = 24;

/// A candidate parent and its validation coverage V(H).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub id: String,
    pub solved: BTreeSet<String>,
}

/// The chosen parents (ids sorted) and the tasks they cover together.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection {
    pub parents: Vec<String>,
    pub covered: BTreeSet<String>,
    /// `exact` or `greedy`.
    pub method: &'static str,
}

/// Eq. 3: P_{g+1} ∈ argmax_{P ⊆ C_g[valid], 1 ≤ |P| ≤ B} |∪_{H∈P} V(H)|.
/// Returns `None` when there is no candidate or `b == 0`.
pub fn select_parents(candidates: &[Candidate], b: usize) -> Option<Selection> {
    if candidates.is_empty() || b == 0 {
        return None;
    }
    let mut sorted: Vec<&Candidate> = candidates.iter().collect();
    sorted.sort_by(|x, y| x.id.cmp(&y.id));
    sorted.dedup_by(|x, y| x.id == y.id);
    if sorted.len() <= EXACT_LIMIT {
        Some(exact(&sorted, b))
    } else {
        Some(greedy(&sorted, b))
    }
}

fn union(chosen: &[&Candidate]) -> BTreeSet<String> {
    chosen.iter().flat_map(|c| c.solved.iter().cloned()).collect()
}

/// Every subset of size 1..=b in lexicographic order of (size, ids); the first subset
/// with the largest coverage wins, which is the tie rule.
pub fn exact(sorted: &[&Candidate], b: usize) -> Selection {
    let n = sorted.len();
    let mut best: Option<(usize, Vec<usize>)> = None;
    for k in 1..=b.min(n) {
        let mut idx: Vec<usize> = (0..k).collect();
        loop {
            let covered: BTreeSet<&String> = idx.iter().flat_map(|&i| sorted[i].solved.iter()).collect();
            if best.as_ref().is_none_or(|(c, _)| covered.len() > *c) {
                best = Some((covered.len(), idx.clone()));
            }
            // Next combination in lexicographic order.
            let mut i = k;
            while i > 0 && idx[i - 1] == n - k + i - 1 {
                i -= 1;
            }
            if i == 0 {
                break;
            }
            idx[i - 1] += 1;
            for j in i..k {
                idx[j] = idx[j - 1] + 1;
            }
        }
    }
    let (_, idx) = best.expect("at least one candidate");
    let chosen: Vec<&Candidate> = idx.iter().map(|&i| sorted[i]).collect();
    Selection { parents: chosen.iter().map(|c| c.id.clone()).collect(), covered: union(&chosen), method: "exact" }
}

/// Greedy by marginal gain (ties by id); stops at b parents or when nothing is gained.
pub fn greedy(sorted: &[&Candidate], b: usize) -> Selection {
    let mut chosen: Vec<&Candidate> = Vec::new();
    let mut covered: BTreeSet<String> = BTreeSet::new();
    while chosen.len() < b {
        let next = sorted
            .iter()
            .filter(|c| !chosen.iter().any(|p| p.id == c.id))
            .map(|c| (c.solved.difference(&covered).count(), *c))
            // Largest gain; among equal gains the smallest id (sorted order, first wins).
            .fold(None::<(usize, &Candidate)>, |best, (gain, c)| match best {
                Some((g, _)) if g >= gain => best,
                _ => Some((gain, c)),
            });
        match next {
            Some((gain, c)) if gain > 0 || chosen.is_empty() => {
                covered.extend(c.solved.iter().cloned());
                chosen.push(c);
            }
            _ => break,
        }
    }
    let mut parents: Vec<String> = chosen.iter().map(|c| c.id.clone()).collect();
    parents.sort();
    Selection { parents, covered, method: "greedy" }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(id: &str, tasks: &[&str]) -> Candidate {
        Candidate { id: id.into(), solved: tasks.iter().map(|t| t.to_string()).collect() }
    }

    #[test]
    fn exact_beats_greedy_where_they_differ() {
        // Greedy takes the big set first and then gains one task; the exact optimum is the
        // two complementary sets covering all six.
        let cands = vec![c("a", &["1", "2", "3", "4"]), c("b", &["1", "2", "5"]), c("c", &["3", "4", "6"])];
        let refs: Vec<&Candidate> = cands.iter().collect();
        let g = greedy(&refs, 2);
        assert_eq!(g.covered.len(), 5);
        assert_eq!(g.parents[0], "a");
        let e = select_parents(&cands, 2).unwrap();
        assert_eq!(e.method, "exact");
        assert_eq!(e.parents, vec!["b", "c"]);
        assert_eq!(e.covered.len(), 6);
    }

    #[test]
    fn each_task_counts_once() {
        // Two big overlapping sets (5 tasks each, same 5) lose to one of them plus a small
        // disjoint one: overlap is not double counted.
        let cands = vec![c("big1", &["1", "2", "3", "4", "5"]), c("big2", &["1", "2", "3", "4", "5"]), c("small", &["6"])];
        let s = select_parents(&cands, 2).unwrap();
        assert_eq!(s.parents, vec!["big1", "small"]);
        assert_eq!(s.covered.len(), 6);
    }

    #[test]
    fn ties_are_deterministic_and_prefer_fewer_parents() {
        let cands = vec![c("z", &["1", "2"]), c("m", &["1", "2"]), c("a", &["1"])];
        // Input order does not matter.
        let mut rev = cands.clone();
        rev.reverse();
        let s1 = select_parents(&cands, 4).unwrap();
        let s2 = select_parents(&rev, 4).unwrap();
        assert_eq!(s1, s2);
        // One parent already covers everything: no extra parents; the smaller id wins.
        assert_eq!(s1.parents, vec!["m"]);
        // Greedy ties are also broken by id.
        let refs: Vec<&Candidate> = {
            let mut v: Vec<&Candidate> = cands.iter().collect();
            v.sort_by(|a, b| a.id.cmp(&b.id));
            v
        };
        assert_eq!(greedy(&refs, 4).parents, vec!["m"]);
    }

    #[test]
    fn at_most_b_parents_and_at_least_one() {
        let cands: Vec<Candidate> = (0..6).map(|i| c(&format!("h{i}"), &[&format!("t{i}")])).collect();
        let s = select_parents(&cands, 4).unwrap();
        assert_eq!(s.parents.len(), 4);
        assert_eq!(s.parents, vec!["h0", "h1", "h2", "h3"]);
        let none = vec![c("x", &[]), c("w", &[])];
        assert_eq!(select_parents(&none, 4).unwrap().parents, vec!["w"]);
        assert!(select_parents(&[], 4).is_none());
        assert!(select_parents(&cands, 0).is_none());
    }

    #[test]
    fn greedy_beyond_the_exact_limit() {
        let cands: Vec<Candidate> = (0..(EXACT_LIMIT + 2)).map(|i| c(&format!("h{i:02}"), &[&format!("t{}", i % 5)])).collect();
        let s = select_parents(&cands, 4).unwrap();
        assert_eq!(s.method, "greedy");
        assert_eq!(s.covered.len(), 4);
        assert_eq!(s.parents, vec!["h00", "h01", "h02", "h03"]);
    }
}
