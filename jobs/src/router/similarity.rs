//! Task similarity used to find "similar validation tasks" (§3.4, Appendix C).
//!
//! Similarity of a task `x` to a validation task `v`:
//! `cos(tfidf(x), tfidf(v)) + TYPE_BONUS · [type(x) = type(v)]`, where descriptions are
//! lower-cased and split on non-alphanumeric characters, term frequency is the raw count,
//! and `idf(t) = ln((1 + N) / (1 + df(t))) + 1` over the N validation descriptions
//! (smoothed, so a term in every description still counts a little and a term seen in none
//! gets the largest weight). The type match compares task types case-insensitively.

use std::collections::HashMap;

use crate::profile::TaskInfo;

/// Added to the cosine when the task types match.
pub const TYPE_BONUS: f64 = 0.25;

fn terms(text: &str) -> Vec<String> {
    text.split(|c: char| !c.is_alphanumeric()).filter(|t| !t.is_empty()).map(str::to_lowercase).collect()
}

/// A TF-IDF index over the validation tasks' descriptions.
#[derive(Debug, Clone, Default)]
pub struct SimilarityIndex {
    tasks: Vec<(String, String)>, // (task id, lower-case task type)
    vectors: Vec<HashMap<String, f64>>,
    df: HashMap<String, usize>,
}

impl SimilarityIndex {
    pub fn new(tasks: &[TaskInfo]) -> Self {
        let mut df: HashMap<String, usize> = HashMap::new();
        let counts: Vec<HashMap<String, f64>> = tasks.iter().map(|t| term_counts(&t.description)).collect();
        for c in &counts {
            for term in c.keys() {
                *df.entry(term.clone()).or_default() += 1;
            }
        }
        let mut index = SimilarityIndex {
            tasks: tasks.iter().map(|t| (t.task_id.clone(), t.task_type.to_lowercase())).collect(),
            vectors: Vec::new(),
            df,
        };
        index.vectors = counts.into_iter().map(|c| index.weigh(c)).collect();
        index
    }

    fn idf(&self, term: &str) -> f64 {
        let n = self.tasks.len() as f64;
        let df = self.df.get(term).copied().unwrap_or(0) as f64;
        ((1.0 + n) / (1.0 + df)).ln() + 1.0
    }

    fn weigh(&self, counts: HashMap<String, f64>) -> HashMap<String, f64> {
        let mut v: HashMap<String, f64> = counts
            .into_iter()
            .map(|(t, c)| {
                let w = c * self.idf(&t);
                (t, w)
            })
            .collect();
        let norm = v.values().map(|w| w * w).sum::<f64>().sqrt();
        if norm > 0.0 {
            v.values_mut().for_each(|w| *w /= norm);
        }
        v
    }

    /// Similarity of `task` to every indexed task, in index order.
    pub fn scores(&self, task: &TaskInfo) -> Vec<f64> {
        let q = self.weigh(term_counts(&task.description));
        let ty = task.task_type.to_lowercase();
        self.vectors
            .iter()
            .zip(&self.tasks)
            .map(|(v, (_, vty))| {
                let cos: f64 = q.iter().filter_map(|(t, w)| v.get(t).map(|x| x * w)).sum();
                cos + if !ty.is_empty() && *vty == ty { TYPE_BONUS } else { 0.0 }
            })
            .collect()
    }

    /// The `m` most similar indexed tasks with a positive similarity, most similar first
    /// (ties by task id), excluding `task` itself.
    pub fn most_similar(&self, task: &TaskInfo, m: usize) -> Vec<(String, f64)> {
        let mut scored: Vec<(String, f64)> = self
            .scores(task)
            .into_iter()
            .zip(&self.tasks)
            .filter(|(s, (id, _))| *s > 0.0 && *id != task.task_id)
            .map(|(s, (id, _))| (id.clone(), s))
            .collect();
        scored.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap_or(std::cmp::Ordering::Equal).then_with(|| a.0.cmp(&b.0)));
        scored.truncate(m);
        scored
    }
}

fn term_counts(text: &str) -> HashMap<String, f64> {
    let mut c = HashMap::new();
    for t in terms(text) {
        *c.entry(t).or_insert(0.0) += 1.0;
    }
    c
}

/// Cosine similarity of two texts under TF-IDF weights fitted on `corpus` (used to match
/// free-text profile conditions to a task description).
pub fn text_similarity(corpus: &[TaskInfo], a: &str, b: &str) -> f64 {
    let index = SimilarityIndex::new(corpus);
    let va = index.weigh(term_counts(a));
    let vb = index.weigh(term_counts(b));
    va.iter().filter_map(|(t, w)| vb.get(t).map(|x| x * w)).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(id: &str, ty: &str, d: &str) -> TaskInfo {
        TaskInfo { task_id: id.into(), task_type: ty.into(), description: d.into(), features: Default::default() }
    }

    #[test]
    fn similar_descriptions_and_types_rank_first() {
        let val = vec![
            task("v1", "counting", "How many players scored more than 10 goals?"),
            task("v2", "INSERT", "Insert a new player named Bob into the players table."),
            task("v3", "counting", "How many cities have a population above one million?"),
            task("v4", "ranking", "Which team scored the most goals?"),
        ];
        let index = SimilarityIndex::new(&val);
        let q = task("x", "counting", "How many players scored fewer than 3 goals?");
        let top = index.most_similar(&q, 3);
        assert_eq!(top[0].0, "v1");
        assert!(top[0].1 > TYPE_BONUS + 0.5, "cosine plus the type bonus: {top:?}");
        // v3 shares only "how many" and the type; v4 shares "scored goals" but not the type.
        let ids: Vec<&str> = top.iter().map(|(i, _)| i.as_str()).collect();
        assert!(ids.contains(&"v3") && ids.contains(&"v4"), "{top:?}");
        // A task with nothing in common and another type is not similar at all.
        let none = index.most_similar(&task("y", "DELETE", "zzz qqq"), 3);
        assert!(none.is_empty(), "{none:?}");
        // The task itself is excluded.
        assert!(index.most_similar(&val[0], 4).iter().all(|(i, _)| i != "v1"));
    }

    #[test]
    fn identical_texts_have_cosine_one() {
        let val = vec![task("v1", "a", "alpha beta"), task("v2", "b", "gamma")];
        let index = SimilarityIndex::new(&val);
        let s = index.scores(&task("x", "c", "alpha beta"));
        assert!((s[0] - 1.0).abs() < 1e-9 && s[1] == 0.0, "{s:?}");
        assert!((text_similarity(&val, "alpha beta", "beta alpha") - 1.0).abs() < 1e-9);
    }
}
