//! The router and the profiles against the real OpenAI-compatible server (llama.cpp's
//! server with SmolLM2-135M-Instruct): a re-anchoring job on real DBBench tasks with the
//! LLM profiler, then LLM voters routing rescue and inference. Whatever the small model
//! answers, the calibration completes, decisions are well-formed, and invalid ballots or
//! profiler answers are recorded with their reasons instead of failing anything.

use std::collections::BTreeSet;
use std::sync::Arc;

use harness_s_tests::{openai_model, openai_url, unique};
use jobs::env::dbbench::{DbBenchConfig, DbBenchFactory, TaskSet};
use jobs::harness::{parse_spec, spec_from_value, Budgets, ValidateOptions};
use jobs::policy::openai::{OpenAiConfig, OpenAiPolicy, TokenIds, ToolProtocol};
use jobs::policy::SamplingParams;
use jobs::profile::llm::LlmProfilerConfig;
use jobs::profile::TaskInfo;
use jobs::reanchor::{self, ReanchorContext, ReanchorInput};
use jobs::router::vote::rank_weight;
use jobs::router::{write_decisions, LlmVoter, RouteRequest, Router, RouterConfig, Variant, Voter};
use schemas::{HarnessSpec, RoutePurpose, RoutingDecision};

use harness_s_tests::repo_root;

fn pool() -> Vec<HarnessSpec> {
    let mut pool = vec![HarnessSpec::h0()];
    for name in ["s1-inspect-schema", "s2-commit-answer", "s3-quote-identifiers"] {
        let path = repo_root().join(format!("examples/hooks/{name}.json"));
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        pool.push(parse_spec(&path.display().to_string(), &text, &ValidateOptions::default()).unwrap());
    }
    let low_budget = serde_json::json!({"id": "s4-low-budget", "parent": "h0",
        "direction": "answer before the budget runs out",
        "hooks": [{"event": "after_tool", "condition": "remaining_steps_lte", "parameters": {"threshold": 2},
                   "action": "warn", "message": "Budget is low: commit your final answer now."}]});
    pool.push(spec_from_value("s4", &low_budget, &ValidateOptions::default()).unwrap());
    pool
}

/// Checks one decision against what the router promises, whatever the voters answered.
fn assert_well_formed(d: &RoutingDecision, pool: &[String], k: usize, voters: usize) {
    let offered: BTreeSet<&String> = match d.purpose {
        RoutePurpose::Rescue => pool.iter().filter(|h| *h != "h0").collect(),
        RoutePurpose::Inference => pool.iter().collect(),
    };
    assert_eq!(d.candidate_order.iter().collect::<BTreeSet<_>>(), offered, "order is a permutation: {d:?}");
    assert_eq!(d.ballots.len(), voters, "every voter's ballot is recorded: {d:?}");
    let need = offered.len().min(4);
    let mut expected = std::collections::BTreeMap::<&str, f64>::new();
    for b in &d.ballots {
        if b.valid {
            assert_eq!(b.invalid_reason, None);
            assert_eq!(b.ranking.len(), need, "{b:?}");
            assert_eq!(b.ranking.iter().collect::<BTreeSet<_>>().len(), need, "distinct: {b:?}");
            assert!(b.ranking.iter().all(|h| offered.contains(h)), "{b:?}");
            for (i, h) in b.ranking.iter().enumerate() {
                *expected.entry(h).or_default() += rank_weight(i + 1);
            }
        } else {
            let reason = b.invalid_reason.as_deref().unwrap_or("");
            assert!(!reason.is_empty(), "an invalid ballot says why: {b:?}");
        }
    }
    assert_eq!(d.score_harnesses.len(), offered.len());
    for (h, s) in d.score_harnesses.iter().zip(&d.scores) {
        assert_eq!(*s, expected.get(h.as_str()).copied().unwrap_or(0.0), "Eq. 9 sum for {h}: {d:?}");
    }
    assert!(d.scores.windows(2).all(|w| w[0] >= w[1]), "rank order: {:?}", d.scores);
    assert_eq!(d.selected.len(), k, "{d:?}");
    assert!(d.selected.iter().all(|h| offered.contains(h)));
    if d.purpose == RoutePurpose::Inference {
        assert!(d.selected.iter().all(|h| *h == d.score_harnesses[0]), "Rank-1 fixed across attempts: {d:?}");
    }
    assert_eq!(d.calibration_id.as_deref(), Some("step-0000"));
}

#[tokio::test]
async fn llm_profiler_and_llm_voters_on_the_real_server_never_break_routing() {
    let url = openai_url();
    let model = openai_model();
    let dir = tempfile::tempdir().unwrap();
    let store = infra::store::LocalStore::new(dir.path()).unwrap();
    let run = unique("e2e-router");

    let tasks = Arc::new(TaskSet::load(&harness_s_tests::dev_tasks()).unwrap().tasks);
    let info = |id: &str| TaskInfo::from_db_task(tasks.get(id).unwrap_or_else(|| panic!("{id} is in dev.jsonl")));
    let validation: Vec<TaskInfo> = ["dev-24", "dev-18"].iter().map(|id| info(id)).collect();

    // Re-anchoring: 5 harnesses × 2 validation tasks, paired, small budgets for a 2k context.
    let mut policy_config = OpenAiConfig::new(&url, &model);
    policy_config.tool_protocol = ToolProtocol::Text;
    let policy = OpenAiPolicy::new(policy_config).unwrap();
    let mut profiler_config = OpenAiConfig::new(&url, &model);
    profiler_config.logprobs = false;
    profiler_config.token_ids = TokenIds::ResponseOnly;
    let profiler = OpenAiPolicy::new(profiler_config).unwrap();
    let factory = DbBenchFactory { tasks: Arc::clone(&tasks), config: DbBenchConfig::sqlite().with_max_rounds(3).unwrap() };
    let pool = pool();
    let pool_ids: Vec<String> = pool.iter().map(|s| s.id.clone()).collect();
    let input = ReanchorInput {
        run_id: run.clone(),
        step: 0,
        calibration_id: "step-0000".into(),
        pool,
        tasks: validation.clone(),
        attempts: 1,
        seed: 7,
        budgets: Budgets { max_model_calls: 2, max_context_tokens: 2048, ..Budgets::default() },
        sampling: SamplingParams { temperature: 0.0, top_p: 1.0, max_tokens: 40, seed: None, stop: vec![], constrain: None },
        concurrency: 1,
    };
    // Short answers keep the test quick on a shared CPU; a profile object fits in 160 tokens.
    let mut profiler_config = LlmProfilerConfig::default();
    profiler_config.sampling.max_tokens = 160;
    let ctx = ReanchorContext {
        store: &store,
        policy: &policy,
        envs: &factory,
        profiler: Some(&profiler),
        profiler_config,
        job_id: "reanchor-0",
        delivery_attempt: 0,
    };
    let out = reanchor::run(&ctx, &input).await.expect("re-anchoring completes whatever the model answers");
    let m = &out.manifest;
    assert_eq!(m.stats.len(), 5, "{:?}", m.stats);
    for (h, s) in &m.stats {
        assert_eq!(s.episodes + s.excluded, 2, "{h}: one paired episode per validation task");
    }
    assert_eq!(m.profilers, vec!["statistical".to_string(), format!("llm:{model}")]);
    assert_eq!(m.policy_checkpoint, model);
    let evidence = reanchor::load_evidence(&store, &run, "step-0000").await.unwrap();
    let llm_entries: Vec<_> = evidence.profiles.values().flatten().filter(|e| e.source.starts_with("llm:")).collect();
    for e in &llm_entries {
        assert!(!e.when.trim().is_empty() && !e.behavior.trim().is_empty(), "{e:?}");
        assert!(e.support >= 1 && e.calibration_id == "step-0000", "{e:?}");
    }
    // Every LLM batch either gave entries or is recorded as a problem with its reason.
    for p in &m.profiler_problems {
        assert!(p.contains("invalid output") || p.contains("profiler call failed"), "{p}");
    }
    eprintln!("profiler: {} LLM entries, {} problem batch(es)", llm_entries.len(), m.profiler_problems.len());

    // Routing with two LLM voters on the real server, plus one unreachable voter whose
    // ballot must be discarded with a reason.
    let mut dead = OpenAiConfig::new("http://127.0.0.1:9/v1", &model);
    dead.max_attempts = 1;
    dead.connect_timeout_s = 2.0;
    let llm_voter = || {
        let mut v = LlmVoter::openai(&url, &model).unwrap();
        v.sampling.max_tokens = 48; // `{"ranking": [four ids]}` is about 30 tokens
        Box::new(v) as Box<dyn Voter>
    };
    let voters = || -> Vec<Box<dyn Voter>> { vec![llm_voter(), llm_voter(), Box::new(LlmVoter::openai_with(dead.clone()).unwrap())] };
    let targets: Vec<TaskInfo> = ["dev-10"].iter().map(|id| info(id)).collect();
    let mut rows = Vec::new();
    for (variant, k) in [(Variant::TopkAdaptive, 4u32), (Variant::Llm4x2, 4)] {
        let router = Router::new(RouterConfig::new(variant, k, 11), voters()).unwrap();
        for task in &targets {
            let routed = router.route(&RouteRequest::rescue(&run, 1, task, &pool_ids, &evidence)).await.unwrap();
            assert_well_formed(&routed.decision, &pool_ids, k as usize, 3);
            assert!(!routed.decision.selected.contains(&"h0".to_string()));
            let dead_ballot = &routed.decision.ballots[2];
            assert!(!dead_ballot.valid);
            assert!(dead_ballot.invalid_reason.as_deref().unwrap().starts_with("voter call failed"), "{dead_ballot:?}");
            if variant == Variant::Llm4x2 {
                assert!(routed.allocation.iter().all(|(_, n)| *n == 2), "{:?}", routed.allocation);
            }
            rows.push(routed.decision);
        }
    }
    let router = Router::new(RouterConfig::new(Variant::TopkAdaptive, 3, 11), voters()).unwrap();
    for task in &targets {
        let routed = router.route(&RouteRequest::inference(&run, 9, task, &pool_ids, &evidence)).await.unwrap();
        assert_well_formed(&routed.decision, &pool_ids, 3, 3);
        rows.push(routed.decision);
    }
    let valid = rows.iter().flat_map(|d| &d.ballots).filter(|b| b.valid).count();
    let llm_invalid: Vec<_> = rows.iter().flat_map(|d| &d.ballots[..2]).filter(|b| !b.valid).collect();
    for b in &llm_invalid {
        assert!(b.raw.is_some(), "the model answered; its text is kept for audit: {b:?}");
    }
    eprintln!("ballots: {valid} valid, {} invalid from the model", llm_invalid.len());

    // Stored as Parquet and read back unchanged.
    let part = write_decisions(&store, &run, 1, "route-e2e", &rows).await.unwrap();
    let back: Vec<RoutingDecision> = infra::table::read_records(&store, &part.key).await.unwrap();
    assert_eq!(back, rows);
}
