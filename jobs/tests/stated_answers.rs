//! Every shipped harness that commits the answer a reply states ("The answer is: …")
//! commits the whole answer of every read task kind the generator makes — decimals
//! (`45.75`, `45.67` for an AVG of 45.666…), multi-word names (`Cedar Falls`), numbers of
//! any width — and the DBBench grader scores it a success. A reply that states a wrong
//! value is committed and graded a failure, so the check can fail both ways.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use jobs::env::dbbench::generate::{generate, Difficulty, GenerateOptions};
use jobs::env::dbbench::{DbBenchConfig, DbBenchEnv, TaskSet};
use jobs::env::ToolSpec;
use jobs::harness::{Budgets, ValidateOptions};
use jobs::policy::{FinishReason, Message, Policy, PolicyError, PolicyOutput, SamplingParams};
use jobs::rollout::run_episode;
use schemas::HarnessSpec;

/// Says one fixed line.
struct Says(String);

#[async_trait]
impl Policy for Says {
    fn checkpoint(&self) -> String {
        "says".into()
    }
    async fn chat(&self, _m: &[Message], _t: &[ToolSpec], _s: &SamplingParams) -> Result<PolicyOutput, PolicyError> {
        Ok(PolicyOutput {
            prompt_hash: None,
            text: self.0.clone(),
            tool_calls: vec![],
            token_ids: vec![1],
            logprobs: vec![-0.1],
            prompt_tokens: 10,
            completion_tokens: 1,
            finish_reason: FinishReason::Stop,
        })
    }
}

/// The harness files under `examples/` whose hooks extract a stated answer.
fn shipped_harnesses() -> Vec<(PathBuf, HarnessSpec)> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "json") {
                out.push(p);
            }
        }
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let mut files = vec![];
    walk(&root, &mut files);
    files.sort();
    let opts = ValidateOptions { harness_actions: true, ..Default::default() };
    files
        .into_iter()
        .filter_map(|p| {
            let text = std::fs::read_to_string(&p).unwrap();
            let v: serde_json::Value = serde_json::from_str(&text).ok()?;
            let extracts = v["hooks"].as_array().is_some_and(|hs| hs.iter().any(|h| h["parameters"]["extract"]["answer"].is_object()));
            extracts.then(|| {
                // a run's own base harness ([pool] base) is named h0
                let opts = ValidateOptions { base: v["id"] == "h0", ..opts.clone() };
                let spec = jobs::harness::spec_from_value(&p.display().to_string(), &v, &opts).unwrap_or_else(|e| panic!("{e}"));
                (p, spec)
            })
        })
        .collect()
}

/// How a reply states `label`: an AVG's long float to two places, the rest as it is.
fn stated(label: &str) -> String {
    match label.parse::<f64>() {
        Ok(v) if label.contains('.') => format!("{v:.2}"),
        _ => label.to_string(),
    }
}

#[tokio::test]
async fn a_stated_answer_of_every_read_kind_is_committed_whole_and_graded() {
    let harnesses = shipped_harnesses();
    assert!(harnesses.len() >= 5, "the transfer experiment's H0 and siblings: {:?}", harnesses.iter().map(|h| &h.0).collect::<Vec<_>>());
    let mut tasks = vec![];
    for (i, level) in [Difficulty::Easy, Difficulty::Medium, Difficulty::Hard].into_iter().enumerate() {
        let kinds = ["counting", "aggregation", "ranking", "comparison", "lookup"].map(String::from).to_vec();
        tasks.extend(generate(&GenerateOptions { seed: 40 + i as u64, n: 60, difficulty: Some(level), kinds }).unwrap());
    }
    // one stated value per task (a list answer is not one statement)
    tasks.retain(|t| t["label"].as_array().is_some_and(|l| l.len() == 1));
    let text: String = tasks.iter().map(|t| format!("{t}\n")).collect();
    let set = Arc::new(TaskSet::parse(&text, "generated.jsonl", "gen").tasks);
    let label = |id: &str| tasks.iter().find(|t| t["id"] == id).unwrap()["label"][0].as_str().unwrap().to_string();
    let mut seen = std::collections::BTreeSet::new();
    let (mut decimals, mut multi_word) = (0, 0);
    for (file, spec) in &harnesses {
        for task in set.iter() {
            let answer = stated(&label(&task.id));
            decimals += usize::from(answer.contains('.'));
            multi_word += usize::from(answer.contains(' '));
            for (reply, right) in [
                (format!("The answer is: {answer}"), true),
                (format!("The answer is: {answer}."), true),
                ("The answer is: 1234567".into(), false),
            ] {
                let mut env = DbBenchEnv::new(Arc::clone(&set), DbBenchConfig::sqlite().with_max_rounds(3).unwrap());
                let sampling =
                    SamplingParams { temperature: 0.0, top_p: 1.0, max_tokens: 32, seed: Some(1), stop: vec![], constrain: None };
                let budgets = Budgets { max_model_calls: 3, ..Budgets::default() };
                let ep = run_episode(&Says(reply.clone()), &mut env, spec, budgets, &sampling, &task.id, 1).await;
                assert_eq!(
                    ep.success,
                    right,
                    "{}: task `{}` ({}) replied {reply:?}: {}",
                    file.display(),
                    task.id,
                    task.task_type,
                    ep.detail
                );
            }
            seen.insert(task.task_type.clone());
        }
    }
    // `other`: the lookups
    for kind in ["counting", "aggregation-SUM", "aggregation-AVG", "aggregation-MIN", "aggregation-MAX", "ranking", "comparison", "other"] {
        assert!(seen.contains(kind), "no {kind} task was checked: {seen:?}");
    }
    assert!(decimals > 0 && multi_word > 0, "decimals {decimals}, multi-word names {multi_word}");
}
