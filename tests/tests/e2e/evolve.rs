//! Directional harness evolution end to end: generated DBBench tasks on SQLite, the real
//! llama.cpp server with SmolLM2-135M as the frozen policy, the built-in diagnoser and
//! template editor (and the LLM editor against the same server), the pool written to a
//! local store, read back by `harness-s pool`, and seeded into another run.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;
use std::sync::Arc;

use harness_s_tests::{harness_s_bin, openai_model, openai_url, unique};
use infra::store::{LocalStore, ObjectStore};
use jobs::env::dbbench::generate::{generate_jsonl, Difficulty, GenerateOptions};
use jobs::env::dbbench::{tools, DbBenchConfig, DbBenchFactory, TaskSet};
use jobs::evolve::pool::{load_manifest, load_pool, seed_pool};
use jobs::evolve::report::{overlap_matrix, plot_overlap, plot_repairs, repair_counts};
use jobs::evolve::{self, EvolveContext, EvolveInput, EvolveSettings, LlmEditor, RuleDiagnoser, TemplateEditor};
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
async fn template_evolution_on_generated_tasks_builds_a_diverse_pool() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStore::new(dir.path()).unwrap();
    let (set, ids) = tasks(21, 8);
    let factory = DbBenchFactory { tasks: set, config: DbBenchConfig::sqlite().with_max_rounds(3).unwrap() };
    let policy = policy();
    let ctx = EvolveContext {
        store: &store,
        policy: &policy,
        envs: &factory,
        diagnoser: &RuleDiagnoser,
        editor: &TemplateEditor::default(),
        validate: validate(),
    };
    let run = unique("evolve");
    let input = EvolveInput {
        run_id: run.clone(),
        train_task_ids: ids[..4].to_vec(),
        validation_task_ids: ids[4..].to_vec(),
        settings: settings(4, 2),
        seed_from: None,
        seed: 42,
    };
    let out = evolve::run(&ctx, &input).await.unwrap();
    let m = &out.manifest;

    // At least 3 valid, distinct siblings besides H0.
    let (manifest, specs) = load_pool(&store, &run).await.unwrap();
    assert_eq!(&manifest, m);
    let siblings: Vec<_> = specs.iter().filter(|s| s.id != "h0").collect();
    if siblings.len() < 3 {
        let rows: Vec<schemas::Trajectory> = infra::table::read_prefix(&store, &format!("runs/{run}/trajectories/")).await.unwrap();
        let seen: Vec<String> = rows.iter().map(|r| format!("{} {} {:?} {:?} {:?} {:?}", r.harness_id, r.task_id, r.termination, r.error_class,
            r.error_message, jobs::evolve::diagnose::diagnose_trajectory(r).iter().map(|f| f.cause.clone()).collect::<Vec<_>>())).collect();
        panic!("only {} valid siblings; rounds {:?}; rejected {:?}; episodes:\n{}", siblings.len(), out.rounds, m.rejected, seen.join("\n"));
    }
    for s in &specs {
        assert!(check_spec(s, &validate()).is_empty(), "{} is invalid", s.id);
    }
    let distinct: BTreeSet<String> = siblings.iter().map(|s| {
        let mut v = serde_json::to_value(s).unwrap();
        for k in ["id", "parent", "generation", "direction"] {
            v.as_object_mut().unwrap().remove(k);
        }
        v.to_string()
    }).collect();
    assert_eq!(distinct.len(), siblings.len(), "siblings must differ in their components");
    // Lineage: every sibling names its parent, direction and 2–3 causes.
    for e in m.members.iter().filter(|e| e.id != "h0") {
        assert_eq!(e.parent.as_deref(), Some("h0"));
        assert!((2..=3).contains(&e.causes.len()), "{e:?}");
        assert!(e.direction.is_some() && e.local.is_some());
    }
    // Rejected candidates never enter the pool.
    for r in &m.rejected {
        assert!(m.member(&r.id).is_none() && !r.reason.is_empty(), "{r:?}");
    }

    // Repaired-task sets relative to H0 (Figure 1a) differ between siblings.
    let tasks: BTreeSet<String> = input.validation_task_ids.iter().cloned().collect();
    let h0: BTreeSet<String> = m.member("h0").unwrap().validation_coverage.iter().cloned().collect();
    let sib: BTreeMap<String, BTreeSet<String>> = m.members.iter().filter(|e| e.id != "h0")
        .map(|e| (e.id.clone(), e.validation_coverage.iter().cloned().collect())).collect();
    let counts = repair_counts(&tasks, &h0, &sib);
    let repaired: BTreeSet<Vec<String>> = counts.iter().map(|c| c.repaired.iter().cloned().collect()).collect();
    assert!(repaired.len() >= 2, "every sibling repairs the same tasks: {counts:?}");
    assert_eq!(overlap_matrix(&counts).len(), counts.len());
    plot_repairs(&counts, &dir.path().join("fig1a.png")).unwrap();
    plot_overlap(&counts, &dir.path().join("fig5.png")).unwrap();

    // A redelivered evolve job re-reads its rollouts and gives the same pool members.
    let again = evolve::run(&ctx, &input).await.unwrap();
    let ids_a: Vec<&str> = m.members.iter().map(|e| e.id.as_str()).collect();
    let ids_b: Vec<&str> = again.manifest.members.iter().map(|e| e.id.as_str()).collect();
    assert_eq!(ids_a, ids_b);

    // The CLI reads the pool.
    let url = format!("file://{}", dir.path().display());
    let ls = Command::new(harness_s_bin()).args(["pool", "ls", &run, "--store", &url]).output().unwrap();
    assert!(ls.status.success(), "{}", String::from_utf8_lossy(&ls.stderr));
    let text = String::from_utf8_lossy(&ls.stdout);
    for s in &specs {
        assert!(text.contains(&s.id), "{text}");
    }
    let a = &siblings[0].id;
    let show = Command::new(harness_s_bin()).args(["pool", "show", &run, a, "--store", &url]).output().unwrap();
    assert!(show.status.success());
    assert!(String::from_utf8_lossy(&show.stdout).contains("\"parent\": \"h0\""));
    let diff = Command::new(harness_s_bin()).args(["pool", "diff", &run, "h0", a, "--store", &url]).output().unwrap();
    assert!(diff.status.success());
    assert!(String::from_utf8_lossy(&diff.stdout).lines().any(|l| l.starts_with('+')), "{}", String::from_utf8_lossy(&diff.stdout));
    let missing = Command::new(harness_s_bin()).args(["pool", "show", &run, "nope", "--store", &url]).output().unwrap();
    assert!(!missing.status.success());
    assert!(String::from_utf8_lossy(&missing.stderr).contains("no member `nope`"));

    let figs = dir.path().join("figs");
    let report = Command::new(harness_s_bin()).args(["pool", "report", &run, "--store", &url, "--out"]).arg(&figs).output().unwrap();
    assert!(report.status.success(), "{}", String::from_utf8_lossy(&report.stderr));
    assert!(String::from_utf8_lossy(&report.stdout).contains("union of repairs"));
    for f in ["repairs.png", "overlap.png"] {
        assert_eq!(&std::fs::read(figs.join(f)).unwrap()[1..4], b"PNG");
    }

    // The pool seeds another run.
    let other = unique("seeded");
    let seeded = seed_pool(&store, &run, &other).await.unwrap();
    assert_eq!(seeded.seeded_from.as_deref(), Some(run.as_str()));
    assert_eq!(load_pool(&store, &other).await.unwrap().1, specs);
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
