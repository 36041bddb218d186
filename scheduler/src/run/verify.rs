//! Done-markers promise their outputs: each lists every file a job wrote with its size and
//! SHA-256. This module holds them to it. A stage reads a job's outputs only after its
//! marker parsed and every output matched; a damaged marker or output is a [`Damage`],
//! and the executor deletes the marker so that the job — whose id is deterministic — runs
//! again and rewrites its files (the ordinary retry path). `harness-s verify RUN` runs the
//! same checks over a whole run, hashing every file whatever its size, and holds every
//! checkpoint's files to its `manifest.json` (size and SHA-256).

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

/// The SHA-256 of an object, read in ranges (a checkpoint's files are gigabytes).
async fn sha256_of(store: &dyn ObjectStore, key: &str, size: u64) -> anyhow::Result<String> {
    const CHUNK: u64 = 64 << 20;
    let mut hasher = Sha256::new();
    let mut at = 0;
    while at < size {
        let end = (at + CHUNK).min(size);
        let bytes = store.get_range(key, at..end).await.with_context(|| format!("reading {}", store.object_url(key)))?;
        hasher = tokio::task::spawn_blocking(move || {
            hasher.update(&bytes);
            hasher
        })
        .await?;
        at = end;
    }
    Ok(hex::encode(hasher.finalize()))
}

/// What is wrong with the object at `key` against the size and SHA-256 that `listed_by`
/// records (None: nothing); hashed only up to `hash_limit` bytes.
async fn check_file(
    store: &dyn ObjectStore,
    key: &str,
    size: u64,
    sha256: &str,
    hash_limit: u64,
    listed_by: &str,
) -> anyhow::Result<Option<String>> {
    let Some(meta) = store.head(key).await.with_context(|| format!("checking {}", store.object_url(key)))? else {
        return Ok(Some(format!("listed by {listed_by} but missing")));
    };
    if meta.size != size {
        return Ok(Some(format!("{} bytes, {listed_by} says {size}", meta.size)));
    }
    if size <= hash_limit {
        let sha = sha256_of(store, key, size).await?;
        if sha != sha256 {
            return Ok(Some(format!("SHA-256 {sha}, {listed_by} says {sha256}")));
        }
    }
    Ok(None)
}

/// Reads the done-marker at `key` and checks every output it lists (outputs above
/// [`HASH_LIMIT`] by size only). `Err(Damage)` names the first damaged file; store failures
/// are errors of their own (`Ok(Err(..))` is damage).
pub async fn check_marker(store: &dyn ObjectStore, key: &str) -> anyhow::Result<Result<DoneMarker, Damage>> {
    check_marker_up_to(store, key, HASH_LIMIT).await
}

/// [`check_marker`] hashing the outputs up to `hash_limit` bytes.
async fn check_marker_up_to(store: &dyn ObjectStore, key: &str, hash_limit: u64) -> anyhow::Result<Result<DoneMarker, Damage>> {
    let url = store.object_url(key);
    let bytes = store.get(key).await.with_context(|| format!("reading {url}"))?;
    let marker: DoneMarker = match schemas::decode_document(&url, &bytes) {
        Ok(m) => m,
        Err(e) => return Ok(Err(Damage { file: url, problem: format!("the done-marker does not parse ({e})") })),
    };
    for out in &marker.outputs {
        if let Some(problem) = check_file(store, &out.key, out.size, &out.sha256, hash_limit, "its done-marker").await? {
            return Ok(Err(Damage { file: store.object_url(&out.key), problem }));
        }
    }
    Ok(Ok(marker))
}

/// Every file of every checkpoint of `run_id` against its manifest: present, its size, its
/// SHA-256 (a manifest that does not parse is damage too). Returns the damage and the
/// number of checkpoints checked.
pub async fn verify_checkpoints(store: &dyn ObjectStore, run_id: &str) -> anyhow::Result<(Vec<Damage>, usize)> {
    let prefix = keys::checkpoints_prefix(run_id);
    let manifests: Vec<String> = store.list(&prefix).await?.into_iter().map(|o| o.key).filter(|k| k.ends_with("/manifest.json")).collect();
    let mut damage = vec![];
    for key in &manifests {
        let url = store.object_url(key);
        let bytes = store.get(key).await.with_context(|| format!("reading {url}"))?;
        let manifest: schemas::CheckpointManifest = match schemas::decode_document(&url, &bytes) {
            Ok(m) => m,
            Err(e) => {
                damage.push(Damage { file: url, problem: format!("the checkpoint manifest does not parse ({e})") });
                continue;
            }
        };
        let dir = key.trim_end_matches("manifest.json");
        for f in &manifest.files {
            let file_key = format!("{dir}{}", f.name);
            if let Some(problem) = check_file(store, &file_key, f.size, &f.sha256, u64::MAX, "its checkpoint manifest").await? {
                damage.push(Damage { file: store.object_url(&file_key), problem });
            }
        }
    }
    Ok((damage, manifests.len()))
}

/// Checks every done-marker of `run_id` and the files they list (every one hashed), every
/// checkpoint against its manifest, that the run's state and spec parse, and that its
/// metrics parts read. Returns the damage found (empty: the run is intact), the number of
/// markers and the number of checkpoints checked.
pub async fn verify_run(store: &dyn ObjectStore, run_id: &str) -> anyhow::Result<(Vec<Damage>, usize, usize)> {
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
        if let Err(d) = check_marker_up_to(store, key, u64::MAX).await? {
            damage.push(d);
        }
    }
    let (checkpoint_damage, checkpoints) = verify_checkpoints(store, run_id).await?;
    for d in checkpoint_damage {
        if !damage.iter().any(|x| x.file == d.file) {
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
    Ok((damage, markers.len(), checkpoints))
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use infra::store::LocalStore;

    /// `verify` holds a checkpoint's files to its manifest: a deleted file and a flipped bit
    /// (same size) are each named; the intact checkpoint is not.
    #[tokio::test]
    async fn a_checkpoint_with_a_missing_or_flipped_file_is_damage() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalStore::new(dir.path()).unwrap();
        for step in [1, 2] {
            let ckpt = keys::checkpoint_dir("r", step);
            let mut files = vec![];
            for (name, body) in [("model.safetensors", vec![7u8; 1000]), ("config.json", b"{}".to_vec())] {
                store.put(&format!("{ckpt}{name}"), Bytes::from(body.clone())).await.unwrap();
                files.push(schemas::FileEntry { name: name.into(), size: body.len() as u64, sha256: hex::encode(Sha256::digest(&body)) });
            }
            let manifest = schemas::CheckpointManifest {
                schema_version: <schemas::CheckpointManifest as schemas::Document>::VERSION,
                run_id: "r".into(),
                step,
                parent: None,
                architecture: "llama".into(),
                files,
                data_cursor: 0,
                rng_state: String::new(),
                metrics: Default::default(),
                created_at_ms: 0,
                trained: true,
                weights_step: Some(step),
            };
            store.put(&format!("{ckpt}manifest.json"), Bytes::from(schemas::encode_document(&manifest))).await.unwrap();
        }
        assert_eq!(verify_checkpoints(&store, "r").await.unwrap(), (vec![], 2));
        store.delete("runs/r/checkpoints/step=2/model.safetensors").await.unwrap();
        let mut flipped = vec![7u8; 1000];
        flipped[500] ^= 1;
        store.put("runs/r/checkpoints/step=1/model.safetensors", Bytes::from(flipped)).await.unwrap();
        let (damage, n) = verify_checkpoints(&store, "r").await.unwrap();
        assert_eq!(n, 2);
        assert_eq!(damage.len(), 2, "{damage:?}");
        assert!(damage[0].file.ends_with("step=1/model.safetensors") && damage[0].problem.contains("SHA-256"), "{damage:?}");
        assert!(damage[1].file.ends_with("step=2/model.safetensors") && damage[1].problem.contains("missing"), "{damage:?}");
    }
}
