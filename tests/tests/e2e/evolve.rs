//! Directional harness evolution end to end: generated DBBench tasks on SQLite, the real
//! llama.cpp server with SmolLM2-135M as the frozen policy, the built-in diagnoser and the
//! LLM editor against the same server, the pool written to a local store.

use std::sync::Arc;

use harness_s_tests::{openai_model, openai_url, unique};
use infra::store::{LocalStore, ObjectStore};
use jobs::env::dbbench::generate::{generate_jsonl, Difficulty, GenerateOptions};
use jobs::env::dbbench::{tools, DbBenchConfig, DbBenchFactory, TaskSet};
use jobs::evolve::pool::{load_manifest, load_pool};
use jobs::evolve::{self, EvolveContext, EvolveInput, EvolveSettings, LlmEditor, RuleDiagnoser};
use jobs::harness::{check_spec, Budgets, ValidateOptions};
use jobs::policy::openai::{OpenAiConfig, OpenAiPolicy, ToolProtocol};
use jobs::policy::SamplingParams;

fn policy() -> OpenAiPolicy {
    let mut c = OpenAiConfig::new(openai_url(), openai_model());
    c.tool_protocol = ToolProtocol::Text;
    OpenAiPolicy::new(c).expect("policy config")
}

fn tasks(seed: u64, n: usize) -> (Arc<TaskSet>, Vec<String>) {
    let text = generate_jsonl(&GenerateOptions { seed, n, difficulty: Some(Difficulty::Easy) }).unwrap();
    let loaded = TaskSet::parse(&text, "gen.jsonl", "gen");
    assert!(loaded.problems.is_empty(), "{:?}", loaded.problems);
    let ids = loaded.tasks.ids();
    (Arc::new(loaded.tasks), ids)
}

fn validate() -> ValidateOptions {
    ValidateOptions { tools: Some(tools().into_iter().map(|t| t.name).collect()) }
}

/// Small settings so the run fits a few minutes on two cores: short episodes, one round.
fn settings(budget: u32, max_model_calls: u32) -> EvolveSettings {
    EvolveSettings {
        proposal_budgets: vec![budget],
        parent_slots: 4,
        local_max_tasks: 2,
        local_max_controls: 1,
        revisions: 1,
        budgets: Budgets { max_model_calls, max_env_actions: 3, max_context_tokens: 2000, max_output_tokens: 96 },
        sampling: SamplingParams { temperature: 0.0, top_p: 1.0, max_tokens: 96, seed: Some(42), stop: vec![] },
        ..EvolveSettings::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llm_editor_output_is_validated_and_invalid_edits_never_enter_the_pool() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStore::new(dir.path()).unwrap();
    let (set, ids) = tasks(33, 3);
    let factory = DbBenchFactory { tasks: set, config: DbBenchConfig::sqlite().with_max_rounds(2).unwrap() };
    let policy = policy();
    let editor = LlmEditor {
        policy: &policy,
        sampling: SamplingParams { temperature: 0.0, top_p: 1.0, max_tokens: 200, seed: Some(42), stop: vec![] },
    };
    let ctx = EvolveContext { store: &store, policy: &policy, envs: &factory, diagnoser: &RuleDiagnoser, editor: &editor, validate: validate() };
    let run = unique("evolve-llm");
    let input = EvolveInput {
        run_id: run.clone(),
        train_task_ids: ids[..2].to_vec(),
        validation_task_ids: ids[2..].to_vec(),
        settings: settings(2, 1),
        seed_from: None,
        seed: 42,
    };
    let out = evolve::run(&ctx, &input).await.unwrap();
    let m = load_manifest(&store, &run).await.unwrap();
    assert_eq!(m, out.manifest);
    let proposals: usize = out.rounds.iter().map(|r| r.proposals).sum();
    assert!(proposals >= 1, "no candidate was proposed: {:?}", out.rounds);
    assert_eq!(m.rejected.len() + m.members.len() - 1, proposals, "every proposal is either a member or rejected");
    for r in &m.rejected {
        assert!(m.member(&r.id).is_none(), "rejected `{}` is in the pool", r.id);
        assert!(store.head(&schemas::keys::pool_harness(&run, &r.id)).await.unwrap().is_none());
        // The reason names what was wrong with each version (JSON or validation problems).
        assert!(r.reason.contains("version 1:") || r.reason.contains("duplicate") || r.reason.contains("not executable"), "{}", r.reason);
    }
    for spec in load_pool(&store, &run).await.unwrap().1 {
        assert!(check_spec(&spec, &validate()).is_empty());
    }
}
