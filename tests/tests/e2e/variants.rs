//! The five allocation variants of the router (§3.4, Table 2) through the scheduler: a
//! small embedded rescue-only run per variant (one update; two with a re-anchoring between
//! them for Top-K Adaptive), with one OpenAI-compatible server as policy, LLM voters and LLM
//! profiler: `harness-s serve` of the tiny guesser ([`harness_s_tests::tiny_policy`]), started
//! by the test, so that it shares no server with other tests. Every variant routes the
//! all-fail groups, stores its decisions (naming the calibration they used), records rescue
//! success by stage, and routes the test tasks for evaluation under H_rank1 beside H0. A
//! guesser's ballots do not parse, so LLM routing falls back to its tie rules here (invalid
//! ballots are kept with their reasons); `router.rs` runs voters and the profiler on the real
//! SmolLM2 behind llama.cpp.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use harness_s_tests::{harness_s, tiny_policy};
use infra::store::open_store;
use infra::table::read_prefix;
use schemas::{Group, MetricRow, ProfileEntry, RoutePurpose, RoutingDecision};

use harness_s_tests::repo_root;

/// Updates of a variant's run: only adaptive routing re-anchors between updates, so only it
/// needs two with a calibration between them; the others route one update's all-fail groups.
fn updates(variant: &str) -> u32 {
    if variant == "topk_adaptive" {
        2
    } else {
        1
    }
}

fn variant_spec(dir: &Path, id: &str, variant: &str, url: &str) -> PathBuf {
    let model = "tiny";
    let llm = variant.starts_with("llm") || variant.starts_with("topk");
    let voters = if llm { format!("voters = [{{ base_url = \"{url}\", model = \"{model}\" }}]") } else { String::new() };
    let profiler =
        if variant == "topk_adaptive" { format!("profiler = {{ base_url = \"{url}\", model = \"{model}\" }}") } else { String::new() };
    let ranks = if variant == "topk_adaptive" { 3 } else { 1 };
    let updates = updates(variant);
    // a calibration between the updates, for the variant that re-anchors
    let interval = if updates == 2 { 1 } else { 0 };
    let spec = format!(
        r#"
[run]
id = "{id}"
seed = 11
[environment]
kind = "dbbench"
engine = "sqlite"
max_rounds = 3
[tasks.generate]
seed = 5
train = 2
validation = 2
test = 1
difficulty = "easy"
[policy]
backend = "openai"
model = "{model}"
base_url = "{url}"
tool_protocol = "text"
max_tokens = 40
temperature = 1.0
[pool]
dir = "{pool}"
[algorithm]
k = 2
tasks_per_update = 1
updates = {updates}
learning_rate = 1e-6
rescue = "router"
learn = false
[router]
variant = "{variant}"
{voters}
{profiler}
[calibration]
interval = {interval}
tasks = 1
[evaluation]
k = 1
baseline = false
ranks = {ranks}
[budgets]
episode_model_calls = 2
episode_context_tokens = 2048
"#,
        pool = repo_root().join("examples/pool").display()
    );
    let path = dir.join(format!("{id}.toml"));
    std::fs::write(&path, spec).unwrap();
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_five_router_variants_run_through_the_scheduler_and_record_rescue_success_by_stage() {
    let dir = tempfile::tempdir().unwrap();
    let (mut server, url) = crate::training::start_serve(&dir.path().join("serve.log"), 0, tiny_policy(), "tiny");
    let store_url = format!("file://{}", dir.path().join("store").display());
    let store = open_store(&store_url).await.unwrap();
    for variant in ["random", "rule", "llm_4x2", "topk_fixed", "topk_adaptive"] {
        let id = format!("variant-{}", variant.replace('_', "-"));
        let spec = variant_spec(dir.path(), &id, variant, &url);
        let (code, stdout, stderr) = harness_s(&["run", spec.to_str().unwrap(), "--store", &store_url]);
        assert!(code == 0 || code == 3, "{variant}: exit {code}\nstdout:\n{stdout}\nstderr:\n{stderr}");

        let state: serde_json::Value = serde_json::from_slice(&store.get(&format!("runs/{id}/state.json")).await.unwrap()).unwrap();
        let completed: Vec<&str> = state["completed"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
        let updates = updates(variant);
        let mut stages = vec!["calibration:0".to_string(), "update:1:rescue".to_string()];
        if updates == 2 {
            stages.extend(["calibration:1".to_string(), "update:2:groups".to_string()]);
        }
        stages.extend([format!("calibration:final:{updates}"), "evaluation".to_string()]);
        for stage in &stages {
            assert!(completed.contains(&stage.as_str()), "{variant}: stage {stage} missing from {completed:?}");
        }
        assert!(!completed.iter().any(|s| s.ends_with(":learn")), "a rescue-only run does not learn: {completed:?}");

        let groups: Vec<Group> = read_prefix(store.as_ref(), &format!("runs/{id}/groups/")).await.unwrap();
        let decisions: Vec<RoutingDecision> = read_prefix(store.as_ref(), &format!("runs/{id}/routing/")).await.unwrap();
        let rescue: BTreeMap<(u32, &str), &RoutingDecision> =
            decisions.iter().filter(|d| d.purpose == RoutePurpose::Rescue).map(|d| ((d.step, d.task_id.as_str()), d)).collect();
        assert!(groups.iter().any(|g| g.rescue_fired), "{variant}: the small policy fails some group, so rescue fires: {groups:?}");
        for g in &groups {
            let Some(d) = rescue.get(&(g.step, g.task_id.as_str())) else {
                assert!(!g.rescue_fired, "{variant}: a fired rescue without a stored decision: {g:?}");
                continue;
            };
            assert!(g.rescue_fired, "{variant}: a decision for a group whose base succeeded: {d:?}");
            assert_eq!(d.variant, variant);
            assert_eq!(d.selected.len(), 2, "{variant}: K rollouts allocated: {d:?}");
            assert!(!d.selected.iter().any(|h| h == "h0"), "{variant}: H0 is never an auxiliary: {d:?}");
            if variant == "llm_4x2" {
                assert_eq!(d.selected[0], d.selected[1], "llm_4x2 gives each chosen harness 2 rollouts: {d:?}");
            } else {
                assert_ne!(d.selected[0], d.selected[1], "{variant}: distinct auxiliaries: {d:?}");
            }
            let mut used = g.harnesses.clone();
            let mut chosen = d.selected.clone();
            used.sort();
            chosen.sort();
            assert_eq!(used, chosen, "{variant}: the rescue group ran the chosen harnesses");
            // Adaptive routing re-anchors: update 2 uses the calibration made after update 1.
            let expected = if variant == "topk_adaptive" && g.step == 2 { "step-0001" } else { "step-0000" };
            assert_eq!(d.calibration_id.as_deref(), Some(expected), "{variant}: {d:?}");
            if variant.starts_with("llm") || variant.starts_with("topk") {
                assert!(!d.ballots.is_empty(), "{variant}: ballots stored: {d:?}");
                for b in &d.ballots {
                    assert!(b.voter.starts_with("llm:"), "{variant}: {b:?}");
                    assert!(b.valid || b.invalid_reason.is_some(), "an invalid ballot says why: {b:?}");
                }
            }
        }

        let metrics: Vec<MetricRow> = read_prefix(store.as_ref(), &format!("runs/{id}/metrics/")).await.unwrap();
        for step in 1..=updates {
            let m = metrics.iter().find(|m| m.name == "rescue_success" && m.step == step);
            assert!(m.is_some_and(|m| (0.0..=1.0).contains(&m.value)), "{variant}: rescue success of update {step} recorded");
        }
        // Evaluation under H_rank1 beside H0 (and Rank-2/3 for Table 5 where asked).
        let inference: Vec<&RoutingDecision> = decisions.iter().filter(|d| d.purpose == RoutePurpose::Inference).collect();
        assert_eq!(inference.len(), 1, "{variant}: one test task routed");
        let final_calibration = format!("step-{updates:04}");
        assert_eq!(inference[0].calibration_id.as_deref(), Some(final_calibration.as_str()), "inference uses the final calibration");
        for name in ["pass_at_k/h0", "pass_at_k/rank-1", "avg_at_k/rank-1", "h0_rate/rank-1"] {
            assert!(metrics.iter().any(|m| m.name == name), "{variant}: metric {name} missing");
        }
        if variant == "topk_adaptive" {
            assert!(metrics.iter().any(|m| m.name == "pass_at_k/rank-3"), "Table 5 rows");
            // The LLM profiler ran beside the statistical one at every calibration.
            for calib in ["step-0000", "step-0001", "step-0002"] {
                let manifest: serde_json::Value =
                    serde_json::from_slice(&store.get(&format!("runs/{id}/profiles/calib={calib}/calibration.json")).await.unwrap())
                        .unwrap();
                let profilers: Vec<&str> = manifest["profilers"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
                assert!(profilers.contains(&"statistical") && profilers.iter().any(|p| p.starts_with("llm:")), "{profilers:?}");
            }
            let entries: Vec<ProfileEntry> = read_prefix(store.as_ref(), &format!("runs/{id}/profiles/")).await.unwrap();
            assert!(entries.iter().all(|e| e.harness_id != "h0"), "profiles describe siblings against H0");
        }
        assert!(store.head(&format!("runs/{id}/reports/report.md")).await.unwrap().is_some(), "{variant}: report written");

        // Table 9: the voters' tokens come from their ballots, the profiler's from the
        // re-anchoring jobs, both as the server counted them.
        let cost =
            |stage: &str, name: &str| -> f64 { metrics.iter().filter(|m| m.stage == stage && m.name == name).map(|m| m.value).sum() };
        let ballots: Vec<&schemas::Ballot> = decisions.iter().flat_map(|d| &d.ballots).filter(|b| b.voter.starts_with("llm:")).collect();
        let voter_prompt = cost("cost:rescue", "voter_prompt_tokens") + cost("cost:evaluation", "voter_prompt_tokens");
        assert_eq!(voter_prompt, ballots.iter().map(|b| b.prompt_tokens as f64).sum::<f64>(), "{variant}");
        if variant.starts_with("llm") || variant.starts_with("topk") {
            assert!(
                voter_prompt > 0.0 && ballots.iter().all(|b| b.prompt_tokens > 0),
                "{variant}: every LLM ballot counts its prompt: {ballots:?}"
            );
            assert!(cost("cost:rescue", "voter_calls") >= 1.0, "{variant}");
        } else {
            assert_eq!(voter_prompt, 0.0, "{variant}: no LLM voter, no voter tokens");
        }
        let profiler = cost("cost:calibration", "profiler_prompt_tokens");
        assert_eq!(
            profiler > 0.0,
            variant == "topk_adaptive",
            "{variant}: only the run with an LLM profiler spends profiler tokens ({profiler})"
        );
        assert!(cost("cost:base", "policy_completion_tokens") > 0.0 && cost("cost:base", "wall_seconds") > 0.0, "{variant}");
    }
    server.kill().unwrap();
    server.wait().unwrap();
}
