//! The transfer experiment at CI size: `examples/transfer/run.sh --quick` (one seed, two
//! updates, small splits) for plain GRPO and Harness-S with rescue rows scored under H0,
//! then `harness-s compare --arm`, with the tiny guesser as the policy (`--set policy.model`,
//! [`harness_s_tests::tiny_policy`]: what is checked here is the experiment's wiring, not
//! what SmolLM2 learns; the experiment's figures in docs/BENCHMARKS.md come from the script
//! as written). Asserts that the signals the experiment reads exist:
//! GRPO has effective groups in this setting (H0 is not all-fail), every update with an
//! effective group trained policy tokens, the transfer probe scored held-out sibling
//! successes at every calibration, and those held-out trajectories are never in a group
//! the learner trained on.

use std::collections::BTreeSet;

use harness_s_tests::{harness_s_bin, repo_root, tiny_policy};
use infra::store::open_store;
use infra::table::read_prefix;
use scheduler::report::Series;
use schemas::{DoneMarker, Group, JobKind, RolloutKind, Trajectory};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quick_transfer_experiment_trains_every_arm_and_never_trains_on_the_held_out_set() {
    let dir = tempfile::tempdir().unwrap();
    let store_dir = dir.path().join("store");
    let out = std::process::Command::new("bash")
        .arg(repo_root().join("examples/transfer/run.sh"))
        .args(["--quick", "--arms", "grpo,hs-h0", "--store"])
        .arg(&store_dir)
        .arg("--set")
        .arg(format!("policy.model=\"{}\"", tiny_policy().display()))
        .env("HARNESS_S_BIN", harness_s_bin())
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "run.sh --quick failed ({}):\n{stdout}\n{}", out.status, &stderr[stderr.len().saturating_sub(6000)..]);
    assert!(stdout.contains("`grpo` (n = 1)") && stdout.contains("`hs-h0` (n = 1)"), "compare did not draw both arms:\n{stdout}");

    let store = open_store(&format!("file://{}", store_dir.display())).await.unwrap();
    for arm in ["grpo", "hs-h0"] {
        let run = format!("transfer-quick-{arm}-1");
        let s = Series::load(store.as_ref(), &run).await.unwrap();

        // Every update with an effective group trained policy tokens.
        let eg = s.get("effective_group_rate");
        assert_eq!(eg.len(), 2, "{run}: one effective-group rate per update, got {eg:?}");
        for &(step, rate) in eg {
            let tokens = s.get("policy_tokens_trained").iter().find(|p| p.0 == step).map_or(0.0, |p| p.1);
            assert!(rate == 0.0 || tokens > 0.0, "{run}: update {step} had effective groups (rate {rate}) but trained {tokens} tokens");
        }
        if arm == "grpo" {
            // H0 is not all-fail in this setting: plain GRPO has groups to learn from.
            assert!(eg.iter().any(|p| p.1 > 0.0), "{run}: GRPO found no effective group in either update: {eg:?}");
        }

        // The transfer probe at the first and the last calibration, on the same rows.
        let lp = s.get("transfer_logprob");
        assert_eq!(lp.iter().map(|p| p.0).collect::<Vec<_>>(), vec![0, 2], "{run}: transfer probe at calibrations 0 and 2: {lp:?}");
        assert!(lp.iter().all(|p| p.1.is_finite() && p.1 < 0.0), "{run}: {lp:?}");
        let rows = s.get("transfer_rows");
        assert!(rows.len() == 2 && rows[0].1 > 0.0 && rows[0].1 == rows[1].1, "{run}: held-out rows per calibration {rows:?}");
        assert_eq!(s.get("h0_protocol_share").len(), 2, "{run}: protocol share at both calibrations");

        // The held-out set: successful sibling rows of the first calibration, never trained.
        let markers: Vec<DoneMarker> = futures::future::try_join_all(
            store.list(&schemas::keys::jobs_prefix(&run)).await.unwrap().into_iter().filter(|m| m.key.ends_with(".done.json")).map(|m| {
                let store = store.clone();
                async move { store.get(&m.key).await.map(|b| schemas::decode_document::<DoneMarker>(&m.key, &b).unwrap()) }
            }),
        )
        .await
        .unwrap();
        let probes: Vec<&DoneMarker> = markers.iter().filter(|m| m.kind == JobKind::Transfer).collect();
        assert_eq!(probes.len(), 2, "{run}: one transfer job per calibration");
        let held_out: Vec<BTreeSet<String>> = probes
            .iter()
            .map(|m| m.result["trajectory_ids"].as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_string()).collect())
            .collect();
        assert!(!held_out[0].is_empty() && held_out[0] == held_out[1], "{run}: both probes score the same held-out rows: {held_out:?}");
        let calibration: Vec<Trajectory> =
            read_prefix(store.as_ref(), &schemas::keys::trajectories_of_step(&run, 0, Some(RolloutKind::Calibration))).await.unwrap();
        for id in &held_out[0] {
            let row = calibration.iter().find(|t| &t.trajectory_id == id);
            assert!(
                row.is_some_and(|t| t.success && t.harness_id != schemas::H0_ID),
                "{run}: held-out {id} is not a successful sibling row of the first calibration"
            );
        }
        let groups: Vec<Group> = read_prefix(store.as_ref(), &format!("runs/{run}/groups/")).await.unwrap();
        let trained: BTreeSet<&String> = groups.iter().filter(|g| g.retained).flat_map(|g| &g.trajectory_ids).collect();
        assert!(!trained.is_empty(), "{run}: no retained group");
        let leaked: Vec<&String> = held_out[0].iter().filter(|id| trained.contains(id)).collect();
        assert!(leaked.is_empty(), "{run}: held-out trajectories in trained groups: {leaked:?}");
    }
}
