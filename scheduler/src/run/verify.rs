//! Done-markers promise their outputs: each lists every file a job wrote with its size and
//! SHA-256. This module holds them to it. A stage reads a job's outputs only after its
//! marker parsed and every output matched; a damaged marker or output is a [`Damage`],
//! and the executor deletes the marker so that the job — whose id is deterministic — runs
//! again and rewrites its files (the ordinary retry path). `harness-s verify RUN` runs the
//! same checks over a whole run.

use anyhow::Context;
use sha2::{Digest, Sha256};

use infra::store::ObjectStore;
use schemas::{keys, DoneMarker};

/// Outputs up to this size are hashed on every check; larger ones (checkpoints) have their
/// size checked here and their hashes checked by the checkpoint loader.
pub const HASH_LIMIT: u64 = 64 << 20;

/// One damaged file: its URL and what is wrong with it.
#[derive(Debug, Clone, PartialEq)]
pub struct Damage {
    pub file: String,
    pub problem: String,
}

impl std::fmt::Display for Damage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.file, self.problem)
    }
}

/// Reads the done-marker at `key` and checks every output it lists. `Err(Damage)` names
/// the first damaged file; store failures are errors of their own (`Ok(Err(..))` is damage).
pub async fn check_marker(store: &dyn ObjectStore, key: &str) -> anyhow::Result<Result<DoneMarker, Damage>> {
    let url = store.object_url(key);
    let bytes = store.get(key).await.with_context(|| format!("reading {url}"))?;
    let marker: DoneMarker = match schemas::decode_document(&url, &bytes) {
        Ok(m) => m,
        Err(e) => return Ok(Err(Damage { file: url, problem: format!("the done-marker does not parse ({e})") })),
    };
    for out in &marker.outputs {
        let file = store.object_url(&out.key);
        let Some(meta) = store.head(&out.key).await.with_context(|| format!("checking {file}"))? else {
            return Ok(Err(Damage { file, problem: "listed by its done-marker but missing".into() }));
        };
        if meta.size != out.size {
            return Ok(Err(Damage { file, problem: format!("{} bytes, its done-marker says {}", meta.size, out.size) }));
        }
        if out.size <= HASH_LIMIT {
            let body = store.get(&out.key).await.with_context(|| format!("reading {file}"))?;
            let sha = hex::encode(Sha256::digest(&body));
            if sha != out.sha256 {
                return Ok(Err(Damage { file, problem: format!("SHA-256 {sha}, its done-marker says {}", out.sha256) }));
            }
        }
    }
    Ok(Ok(marker))
}

/// Checks every done-marker of `run_id` and the files they list, that the run's state and
/// spec parse, and that its metrics parts read. Returns the damage found (empty: the run is intact) and the number of
/// markers checked.
pub async fn verify_run(store: &dyn ObjectStore, run_id: &str) -> anyhow::Result<(Vec<Damage>, usize)> {
    let mut damage = vec![];
    for key in [super::inputs::run_json_key(run_id), keys::state(run_id)] {
        let url = store.object_url(&key);
        match store.get(&key).await {
            Ok(bytes) => {
                if let Err(e) = serde_json::from_slice::<serde_json::Value>(&bytes) {
                    damage.push(Damage { file: url, problem: format!("not valid JSON ({e})") });
                }
            }
            Err(infra::store::StoreError::NotFound { .. }) if key == keys::state(run_id) => {}
            Err(e) => return Err(e).with_context(|| format!("reading {url}")),
        }
    }
    let markers: Vec<String> =
        store.list(&keys::jobs_prefix(run_id)).await?.into_iter().map(|o| o.key).filter(|k| keys::job_of_marker(k).is_some()).collect();
    for key in &markers {
        if let Err(d) = check_marker(store, key).await? {
            damage.push(d);
        }
    }
    // The scheduler's own metrics parts have no done-marker: each must read as metrics.
    let metrics: Vec<String> = store.list(&keys::metrics_prefix(run_id)).await?.into_iter().map(|o| o.key).collect();
    for key in &metrics {
        if let Err(e) = infra::table::read_records::<schemas::MetricRow>(store, key).await {
            damage.push(Damage { file: store.object_url(key), problem: format!("metrics do not read ({e})") });
        }
    }
    Ok((damage, markers.len()))
}
