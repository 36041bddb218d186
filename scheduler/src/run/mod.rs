//! Harness-S training runs: the executor and the state machine, and the two ways to drive a
//! run with the same code — embedded (in-process memory queue and workers) and distributed
//! (a queue URL, worker processes elsewhere). The spec, the run's inputs and the worker
//! handlers are the `handlers` crate's (re-exported here as `run::spec`, `run::inputs`).

pub use handlers::{inputs, spec};

pub mod editor;
pub mod executor;
pub mod machine;
pub mod preflight;
pub mod stage;
pub mod state;
pub mod verify;

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use infra::queue::Queue;
use infra::store::ObjectStore;
use schemas::JobKind;

use executor::Executor;
use machine::{Drive, Finish, Scheduler};
use state::RunState;

/// Kinds the in-process workers of an embedded run consume.
pub const RUN_KINDS: [JobKind; 8] = [
    JobKind::Evolve,
    JobKind::Rollout,
    JobKind::Rescue,
    JobKind::Reanchor,
    JobKind::Eval,
    JobKind::Edit,
    JobKind::Learn,
    JobKind::Transfer,
];

/// Exit code for a finished run.
pub fn exit_code(f: Finish) -> u8 {
    match f {
        Finish::Completed => crate::exit::OK,
        Finish::Degraded => crate::exit::DEGRADED,
    }
}

/// Uploads a checked spec and its inputs and creates the run's state. Refuses a run id
/// that already exists in the store.
pub async fn submit(store: &dyn ObjectStore, loaded: &spec::LoadedSpec) -> anyhow::Result<RunState> {
    if let Some(st) = state::load(store, &loaded.run_id).await? {
        bail!(
            "run `{}` already exists in {} (status: {}); resume it with `harness-s resume {}` or choose another [run] id",
            loaded.run_id,
            store.url(),
            st.status.as_str(),
            loaded.run_id
        );
    }
    // Checks the pool's size (`check_pool_size`) before it writes anything.
    let stored = inputs::upload(store, loaded).await?;
    let mut st = initial_state(&loaded.run_id, &stored.pool);
    state::save(store, &mut st).await?;
    Ok(st)
}

/// The state a run starts from: submitted, nothing done, the submitted pool's version.
fn initial_state(run_id: &str, pool: &[String]) -> RunState {
    let joined = pool.join(",");
    let pool_version = schemas::job_id(&schemas::JobIdParts { run_id: &joined, ..Default::default() })[..12].to_string();
    RunState::new(run_id, pool_version)
}

/// Puts a run (finished or not) back at its submitted state, so that the next drive walks
/// every stage again: each finds its jobs' done-markers, checks them, and re-runs only the
/// jobs whose marker or outputs are damaged (jobs are deterministic, so they rewrite the same
/// files), and the stages recount what the run did from the markers.
///
/// A damaged checkpoint is the learner's state after its step: it is rebuilt by running the
/// learn jobs again from the newest earlier step whose resume state (optimizer moments and
/// float32 weights) is intact, or from the starting model (`[checkpoints]` retention keeps
/// the resume state for the newest step only). The checkpoints after that step are removed
/// (manifest first, as retention does) and their learn jobs' markers deleted; the rollouts
/// sampled from them keep their markers, since the rebuilt weights are the same bytes.
/// Returns the step the learner restarts from (`Some(None)`: the starting model; `None`: no
/// checkpoint was damaged).
pub async fn rewind_for_repair(store: &dyn ObjectStore, run_id: &str, damage: &[verify::Damage]) -> anyhow::Result<Option<Option<u32>>> {
    let old = state::load(store, run_id).await?.with_context(|| format!("no run `{run_id}` in {} (submit it first)", store.url()))?;
    let stored = inputs::load_stored(store, run_id).await?;
    let damaged_steps: std::collections::BTreeSet<u32> = damage
        .iter()
        .filter_map(|d| schemas::keys::checkpoint_of(&d.file).ok().flatten().filter(|c| c.run_id == run_id).map(|c| c.step))
        .collect();
    let restart = match damaged_steps.first() {
        None => None,
        Some(&first) => Some(rebuild_checkpoints_after(store, run_id, first, &damaged_steps).await?),
    };
    let mut st = initial_state(run_id, &stored.pool);
    st.started_at_ms = old.started_at_ms;
    state::save(store, &mut st).await?;
    Ok(restart)
}

/// Removes the checkpoints from the newest intact resume state before `first` onwards and
/// the done-markers of the learn jobs that wrote them; returns that resume state's step.
async fn rebuild_checkpoints_after(
    store: &dyn ObjectStore,
    run_id: &str,
    first: u32,
    damaged: &std::collections::BTreeSet<u32>,
) -> anyhow::Result<Option<u32>> {
    use native::train::checkpoint;
    let from = checkpoint::newest_resume_state(store, run_id, first, damaged).await?;
    let after = from.unwrap_or(0);
    checkpoint::remove_after(store, run_id, after).await?;
    for o in store.list(&schemas::keys::jobs_prefix(run_id)).await? {
        if schemas::keys::job_of_marker(&o.key).is_none() {
            continue;
        }
        let Ok(marker) = schemas::decode_document::<schemas::DoneMarker>(&o.key, &store.get(&o.key).await?) else { continue };
        let step = marker
            .result
            .get("manifest_key")
            .and_then(|k| k.as_str())
            .and_then(|k| schemas::keys::checkpoint_of(k).ok().flatten())
            .map(|c| c.step);
        if marker.kind == JobKind::Learn && step.is_some_and(|s| s > after) {
            store.delete(&o.key).await?;
        }
    }
    Ok(from)
}

pub use inputs::check_pool_size;

/// Loads a run's state for driving; refuses finished runs.
pub async fn state_for_drive(store: &dyn ObjectStore, run_id: &str) -> anyhow::Result<RunState> {
    let st = state::load(store, run_id).await?.with_context(|| format!("no run `{run_id}` in {} (submit it first)", store.url()))?;
    if st.status.is_finished() {
        bail!("run `{run_id}` already finished ({}); nothing to resume", st.status.as_str());
    }
    // A cancel request applies to the drive it interrupted; resuming clears it.
    store.delete(&state::cancel_key(run_id)).await?;
    Ok(st)
}

/// Drives a run with the given queue (workers consume it elsewhere or in-process).
/// `metrics` gets the run-level gauges as stages finish (serve it with `--metrics-addr`).
pub async fn drive(
    store: Arc<dyn ObjectStore>,
    queue: Arc<dyn Queue>,
    run_id: &str,
    bars: bool,
    metrics: worker::Metrics,
) -> anyhow::Result<Finish> {
    let mut st = state_for_drive(store.as_ref(), run_id).await?;
    preflight::check(&inputs::load_stored(store.as_ref(), run_id).await?.spec).await?;
    let poll = if queue.url().starts_with("memory:") { Duration::from_millis(100) } else { Duration::from_millis(500) };
    loop {
        // Inputs are read again after evolution wrote the run's pool.
        let inputs = Arc::new(inputs::RunInputs::load(store.as_ref(), run_id).await?);
        let exec = Executor { store: store.clone(), queue: queue.clone(), poll, bars };
        let sched = Scheduler { store: store.clone(), exec, inputs, cost: Default::default(), metrics: metrics.clone() };
        match sched.drive(&mut st).await? {
            Drive::Finished(f) => return Ok(f),
            Drive::PoolChanged => continue,
        }
    }
}

/// Drives a run in this process: a memory queue and `workers` in-process workers.
/// The in-process workers count their jobs in `metrics` too.
pub async fn drive_embedded(
    store: Arc<dyn ObjectStore>,
    run_id: &str,
    workers: usize,
    bars: bool,
    metrics: worker::Metrics,
) -> anyhow::Result<Finish> {
    let queue = infra::queue::open_queue(&format!("memory://{run_id}")).await?;
    let registry = handlers::registry();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    // Jobs at once per worker: the spec's policy concurrency, so that a stage's rollout jobs
    // feed the engine together (results do not depend on it).
    let per_worker = inputs::load_stored(store.as_ref(), run_id).await?.spec.policy.concurrency().max(1) as usize;
    let mut tasks = Vec::new();
    for i in 0..workers.max(1) {
        let mut config = worker::WorkerConfig::new(RUN_KINDS.to_vec(), per_worker);
        config.worker_id = format!("embedded-{i}");
        let w = worker::Worker::new(queue.clone(), store.clone(), registry.clone(), config)?.with_metrics(metrics.clone());
        let mut rx = stop_rx.clone();
        tasks.push(tokio::spawn(async move {
            w.run(async move {
                let _ = rx.wait_for(|s| *s).await;
            })
            .await
        }));
    }
    let result = drive(store, queue, run_id, bars, metrics).await;
    let _ = stop_tx.send(true);
    for t in tasks {
        match t.await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "an in-process worker stopped with an error"),
            Err(e) => tracing::warn!(error = %e, "an in-process worker panicked"),
        }
    }
    // Sessions on environment servers that stopped jobs still held ([environment] kind = "http").
    jobs::env::http::cancel_open_sessions(Duration::from_secs(5)).await;
    result
}
