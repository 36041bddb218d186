//! `harness-s bench storage`: writes and reads synthetic trajectories (rollouts with
//! nested turns) through the Parquet layer and any object store, and compares the stored
//! size with the same rows as JSON lines.
//!
//! The writer streams: rows are generated, encoded and uploaded one chunk at a time, so
//! peak memory stays bounded by a row group whatever `--rollouts` is (it is printed).

use std::collections::BTreeMap;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use infra::store::{open_store, ObjectStore};
use infra::table::{ParquetFile, PartWriter};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use schemas::{keys, Role, RolloutKind, Split, Termination, Trajectory, Turn, TurnSource};

use super::{human_bytes, peak_rss_bytes};

#[derive(Debug, Args)]
pub struct StorageArgs {
    /// Store to write to; the files are left there. Default: a temporary folder, removed.
    #[arg(long)]
    pub out: Option<String>,
    /// Number of rollouts (trajectory rows).
    #[arg(long, default_value_t = 10_000)]
    pub rollouts: usize,
    /// Turns per rollout.
    #[arg(long, default_value_t = 20)]
    pub turns: usize,
    /// Rollouts per part file (one part per job).
    #[arg(long, default_value_t = 1_000)]
    pub rollouts_per_part: usize,
    /// Seed of the synthetic data.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Also write what was written (counts per kind, reward sums per harness) as JSON here.
    #[arg(long)]
    pub summary_json: Option<std::path::PathBuf>,
}

/// What the benchmark wrote, for checking by other tools.
#[derive(Debug, Default, serde::Serialize)]
pub struct WrittenSummary {
    pub run_id: String,
    pub rollouts: u64,
    pub turns: u64,
    pub rows_by_kind: BTreeMap<String, u64>,
    pub reward_sum_by_harness: BTreeMap<String, f64>,
    pub success_by_harness: BTreeMap<String, u64>,
    pub parquet_bytes: u64,
    pub json_bytes: u64,
    pub files: Vec<String>,
}

const HARNESSES: [&str; 5] = ["h0", "inspect-schema", "commit-reminder", "quote-identifiers", "budget-guard"];
const RUN_ID: &str = "bench-storage";

/// Kind of the rollouts in part `p`: half base, a quarter rescue, the rest calibration
/// and evaluation, as in a training run.
fn part_kind(p: usize) -> RolloutKind {
    match p % 8 {
        0..=3 => RolloutKind::Base,
        4 | 5 => RolloutKind::Rescue,
        6 => RolloutKind::Calibration,
        _ => RolloutKind::Eval,
    }
}

fn synthetic_turn(rng: &mut ChaCha8Rng, index: u32) -> Turn {
    let (role, source) = match index % 4 {
        0 if index == 0 => (Role::System, TurnSource::System),
        1 | 3 => (Role::Assistant, TurnSource::Policy),
        _ if rng.random_bool(0.2) => (Role::User, TurnSource::Harness),
        _ => (Role::Tool, TurnSource::Env),
    };
    let text = match source {
        TurnSource::Policy => format!(
            "Action: Operation\n```sql\nSELECT `col_{}`, COUNT(*) FROM `table_{}` WHERE `score` > {} GROUP BY `col_{}`;\n```",
            rng.random_range(0..12),
            rng.random_range(0..40),
            rng.random_range(0..1000),
            rng.random_range(0..12)
        ),
        TurnSource::Env => {
            let rows: Vec<String> = (0..rng.random_range(1..6))
                .map(|_| format!("('{}', {})", rng.random_range(1000..9999), rng.random_range(0..500)))
                .collect();
            format!("[{}]", rows.join(", "))
        }
        TurnSource::Harness => "Reminder: commit the final answer with commit_final_answer before the round limit.".into(),
        TurnSource::System => "You are an agent that answers questions about a database table using SQL.".into(),
    };
    let n_tokens = text.len() / 4 + 1;
    let token_ids: Vec<u32> = (0..n_tokens).map(|_| rng.random_range(0..49_152)).collect();
    let trained = source == TurnSource::Policy;
    Turn {
        index,
        role,
        source,
        logprobs: if trained { (0..n_tokens).map(|_| -rng.random_range(0.0f32..4.0)).collect() } else { vec![] },
        loss_mask: vec![trained; n_tokens],
        tool_name: trained.then(|| "execute_sql".to_string()),
        tool_args: None,
        hook_id: (source == TurnSource::Harness).then(|| "commit-reminder/0".to_string()),
        prompt_token_count: 0,
        prompt_hash: None,
        token_ids,
        text,
    }
}

fn synthetic_rollout(rng: &mut ChaCha8Rng, i: usize, kind: RolloutKind, step: u32, job_id: &str, turns: usize) -> Trajectory {
    let harness = if kind == RolloutKind::Base { "h0" } else { HARNESSES[i % HARNESSES.len()] };
    let turns: Vec<Turn> = (0..turns as u32).map(|t| synthetic_turn(rng, t)).collect();
    let completion: u64 = turns.iter().filter(|t| t.source == TurnSource::Policy).map(|t| t.token_ids.len() as u64).sum();
    let prompt: u64 = turns.iter().filter(|t| t.source != TurnSource::Policy).map(|t| t.token_ids.len() as u64).sum();
    let success = rng.random_bool(0.3);
    Trajectory {
        trajectory_id: format!("{job_id}-{i}"),
        run_id: RUN_ID.into(),
        job_id: job_id.into(),
        step,
        kind,
        split: if kind == RolloutKind::Calibration { Split::Validation } else { Split::Train },
        task_id: format!("task-{}", i / 8),
        task_type: ["counting", "aggregation", "ranking", "INSERT", "UPDATE"][i % 5].into(),
        group_id: format!("g-{step}-{}", i / 8),
        attempt: (i % 8) as u32,
        harness_id: harness.into(),
        harness_version: "0123456789ab".into(),
        policy_checkpoint: format!("runs/{RUN_ID}/checkpoints/step={step}"),
        seed: i as u64,
        reward: if success { 1.0 } else { 0.0 },
        success,
        termination: if success { Termination::Committed } else { Termination::RoundLimit },
        error_class: None,
        error_message: None,
        prompt_tokens: prompt,
        completion_tokens: completion,
        harness_tokens: 0,
        model_calls: (turns.len() / 2) as u32,
        env_actions: (turns.len() / 4) as u32,
        started_at_ms: 1_780_000_000_000 + i as i64 * 1_000,
        duration_ms: rng.random_range(500..20_000),
        policy_ms: rng.random_range(100..10_000),
        env_ms: rng.random_range(1..500),
        temperature: 1.0,
        tool_view: String::new(),
        turns,
    }
}

/// Writes the synthetic data set; returns what was written and the seconds spent in the
/// Parquet writer and the store (generating rows and measuring JSON size excluded).
async fn write_all(store: &dyn ObjectStore, args: &StorageArgs) -> anyhow::Result<(WrittenSummary, f64)> {
    let mut io = std::time::Duration::ZERO;
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
    let per_part = args.rollouts_per_part.max(1);
    let parts = args.rollouts.div_ceil(per_part);
    let mut summary = WrittenSummary { run_id: RUN_ID.into(), ..Default::default() };
    let chunk = 256;
    for p in 0..parts {
        let kind = part_kind(p);
        let step = (p / 8) as u32;
        let job_id = format!("bench{p:05}");
        let key = keys::trajectory_part(RUN_ID, step, kind, &job_id);
        let t = Instant::now();
        let mut writer = PartWriter::<Trajectory>::create(store, &key).await?;
        io += t.elapsed();
        let start = p * per_part;
        let end = ((p + 1) * per_part).min(args.rollouts);
        let mut i = start;
        while i < end {
            let n = chunk.min(end - i);
            let rows: Vec<Trajectory> = (i..i + n).map(|j| synthetic_rollout(&mut rng, j, kind, step, &job_id, args.turns)).collect();
            for r in &rows {
                summary.json_bytes += serde_json::to_vec(r)?.len() as u64 + 1;
                *summary.reward_sum_by_harness.entry(r.harness_id.clone()).or_default() += r.reward;
                *summary.success_by_harness.entry(r.harness_id.clone()).or_default() += r.success as u64;
                summary.turns += r.turns.len() as u64;
            }
            let t = Instant::now();
            writer.write(&rows).await?;
            io += t.elapsed();
            i += n;
        }
        let t = Instant::now();
        let entry = writer.finish().await?;
        io += t.elapsed();
        summary.parquet_bytes += entry.size;
        summary.rollouts += (end - start) as u64;
        *summary.rows_by_kind.entry(kind.to_string()).or_default() += (end - start) as u64;
        summary.files.push(entry.key);
        if (p + 1) % 5 == 0 || p + 1 == parts {
            tracing::info!(part = p + 1, parts, rollouts = summary.rollouts, "parts written");
        }
    }
    Ok((summary, io.as_secs_f64()))
}

/// Reads every part back into typed rows; returns (rows, turns, reward sum).
async fn read_all(store: &dyn ObjectStore, files: &[String]) -> anyhow::Result<(u64, u64, f64)> {
    let (mut rows, mut turns, mut reward) = (0u64, 0u64, 0.0f64);
    for key in files {
        let records = ParquetFile::open(store, key).await?.records::<Trajectory>()?;
        rows += records.len() as u64;
        for r in &records {
            turns += r.turns.len() as u64;
            reward += r.reward;
        }
    }
    Ok((rows, turns, reward))
}

pub async fn run(args: StorageArgs) -> anyhow::Result<u8> {
    let temp;
    let url = match &args.out {
        Some(u) => u.clone(),
        None => {
            temp = tempfile::tempdir().context("cannot create a temporary folder")?;
            format!("file://{}", temp.path().display())
        }
    };
    let store = open_store(&url).await?;
    tracing::info!(store = %store.url(), rollouts = args.rollouts, turns = args.turns, "writing synthetic trajectories");

    let (summary, write_s) = write_all(store.as_ref(), &args).await?;
    tracing::info!(seconds = write_s, "written; reading back");

    let t1 = Instant::now();
    let (rows, turns, reward) = read_all(store.as_ref(), &summary.files).await?;
    let read_s = t1.elapsed().as_secs_f64();
    anyhow::ensure!(rows == summary.rollouts, "read {rows} rows back, wrote {}", summary.rollouts);
    anyhow::ensure!(turns == summary.turns, "read {turns} turns back, wrote {}", summary.turns);
    let written_reward: f64 = summary.reward_sum_by_harness.values().sum();
    anyhow::ensure!((reward - written_reward).abs() < 1e-6, "reward sum changed in the round trip");

    let mb = summary.parquet_bytes as f64 / 1e6;
    println!("bench storage: {} rollouts x {} turns -> {}", summary.rollouts, args.turns, store.url());
    println!("| phase | rows/s | turns/s | MB/s (Parquet) | seconds |");
    println!("|---|---:|---:|---:|---:|");
    for (phase, s) in [("write", write_s), ("read", read_s)] {
        println!("| {phase} | {:.0} | {:.0} | {:.1} | {:.2} |", summary.rollouts as f64 / s, summary.turns as f64 / s, mb / s, s);
    }
    println!();
    println!("| format | bytes | human |");
    println!("|---|---:|---:|");
    println!("| Parquet (zstd) | {} | {} |", summary.parquet_bytes, human_bytes(summary.parquet_bytes));
    println!("| JSON lines | {} | {} |", summary.json_bytes, human_bytes(summary.json_bytes));
    println!("| ratio JSON/Parquet | {:.2}x | |", summary.json_bytes as f64 / summary.parquet_bytes.max(1) as f64);
    println!();
    for (kind, n) in &summary.rows_by_kind {
        println!("rows kind={kind}: {n}");
    }
    match peak_rss_bytes() {
        Some(b) => println!("peak memory (VmHWM): {} ({} bytes)", human_bytes(b), b),
        None => println!("peak memory: not reported by this OS"),
    }
    if let Some(path) = &args.summary_json {
        std::fs::write(path, serde_json::to_vec_pretty(&summary)?)
            .with_context(|| format!("cannot write the summary to {}", path.display()))?;
    }
    Ok(crate::exit::OK)
}
