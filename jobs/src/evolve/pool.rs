//! The Sibling Harness Pool as a versioned artifact (Harness-S §3.2, Eq. 4:
//! H_g = H_{g-1} ∪ C_g[valid]). Stored under `runs/<run>/pool/`:
//! - `pool/<harness>.json`: each member's spec (`schemas::keys::pool_harness`), H0 included;
//! - `pool/manifest.json`: a [`PoolManifest`] document (`schema_version`) with lineage per
//!   member (parent, direction, causes, local results, validation coverage), the rejected
//!   candidates with their reasons (never members), and a version bumped on every save.
//!
//! A pool from one run seeds another with [`seed_pool`]: specs and lineage are copied and
//! the manifest records where it came from.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::harness::{check_spec, ValidateOptions};

/// The structural check of a stored pool member. Whether hooks may act in the policy's
/// place and whether `h0` may carry edits were decided when the run's spec was loaded
/// (`[environment] harness_actions`, `[pool] base`), not here.
fn stored_member_options() -> ValidateOptions {
    ValidateOptions { harness_actions: true, base: true, ..Default::default() }
}
use infra::store::{ObjectStore, StoreError};
use schemas::{decode_document, encode_document, keys, Document, HarnessSpec, SchemaError};

/// `runs/<run>/pool/manifest.json`
pub fn manifest_key(run_id: &str) -> String {
    schemas::keys::pool_manifest(run_id)
}

/// How a child did in local evaluation (Table 8: ≤ 30 tasks, ≤ 10 successful controls).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LocalResult {
    /// Failed tasks of the parent targeted by the direction.
    pub targeted: Vec<String>,
    /// Targeted tasks the child solved.
    pub repaired: Vec<String>,
    /// Successful controls of the parent.
    pub controls: Vec<String>,
    /// Controls the child failed.
    pub regressed: Vec<String>,
    /// Whether the kept version is the revision.
    pub revised: bool,
    /// Episodes that ended in an error (executable check).
    pub errors: u32,
}

/// One pool member and its lineage.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PoolEntry {
    pub id: String,
    pub parent: Option<String>,
    pub generation: u32,
    /// Evolution round that made it (0 for H0 and seeded members).
    pub round: u32,
    pub direction: Option<String>,
    pub causes: Vec<String>,
    /// Content hash of the spec (`HarnessSpec::version_hash`).
    pub version: String,
    pub editor: String,
    #[serde(default)]
    pub local: Option<LocalResult>,
    /// V(H): validation tasks solved with the frozen policy.
    pub validation_coverage: Vec<String>,
    /// Chosen as a parent of the next round (Eq. 3).
    pub selected_as_parent: bool,
    /// The run this member was first evolved in (differs from the pool's run when seeded).
    pub origin_run: String,
}

/// A candidate that did not enter the pool, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rejected {
    pub id: String,
    pub parent: String,
    pub round: u32,
    pub causes: Vec<String>,
    pub reason: String,
}

/// `pool/manifest.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PoolManifest {
    pub schema_version: u32,
    pub run_id: String,
    /// Bumped on every save.
    pub version: u32,
    /// The run whose pool seeded this one.
    #[serde(default)]
    pub seeded_from: Option<String>,
    /// Validation tasks V(H) is measured on.
    pub validation_tasks: Vec<String>,
    pub members: Vec<PoolEntry>,
    pub rejected: Vec<Rejected>,
}

impl Document for PoolManifest {
    const NAME: &'static str = "pool manifest";
    const VERSION: u32 = 1;
}

impl PoolManifest {
    pub fn new(run_id: &str) -> Self {
        PoolManifest {
            schema_version: Self::VERSION,
            run_id: run_id.into(),
            version: 0,
            seeded_from: None,
            validation_tasks: vec![],
            members: vec![],
            rejected: vec![],
        }
    }

    pub fn member(&self, id: &str) -> Option<&PoolEntry> {
        self.members.iter().find(|m| m.id == id)
    }
}

/// Failures reading or writing a pool.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Schema(#[from] SchemaError),
    #[error("run `{run}` has no pool ({key} is missing): evolve one first, or seed it from another run")]
    Missing { run: String, key: String },
    #[error("pool of run `{run}` has no member `{id}`; members: {members}")]
    NoMember { run: String, id: String, members: String },
    #[error("{key}: pool member is not a valid harness spec: {detail}")]
    InvalidMember { key: String, detail: String },
}

/// Writes a member's spec (`runs/<run>/pool/<id>.json`). Only valid specs may enter.
pub async fn put_member(store: &dyn ObjectStore, run_id: &str, spec: &HarnessSpec) -> Result<(), PoolError> {
    let key = keys::pool_harness(run_id, &spec.id);
    let problems = check_spec(spec, &stored_member_options());
    if !problems.is_empty() {
        let detail = problems.iter().map(|p| p.to_string()).collect::<Vec<_>>().join("; ");
        return Err(PoolError::InvalidMember { key, detail });
    }
    let bytes = serde_json::to_vec_pretty(spec).expect("specs serialise");
    store.put(&key, Bytes::from(bytes)).await?;
    Ok(())
}

/// Saves the manifest, bumping its version. Members' specs must be written first.
pub async fn save_manifest(store: &dyn ObjectStore, manifest: &mut PoolManifest) -> Result<(), PoolError> {
    manifest.version += 1;
    store.put(&manifest_key(&manifest.run_id), Bytes::from(encode_document(manifest))).await?;
    Ok(())
}

/// Loads a run's manifest.
pub async fn load_manifest(store: &dyn ObjectStore, run_id: &str) -> Result<PoolManifest, PoolError> {
    let key = manifest_key(run_id);
    if store.head(&key).await?.is_none() {
        return Err(PoolError::Missing { run: run_id.into(), key });
    }
    let bytes = store.get(&key).await?;
    Ok(decode_document(&store.object_url(&key), &bytes)?)
}

/// Loads one member's spec.
pub async fn load_member(store: &dyn ObjectStore, run_id: &str, id: &str) -> Result<HarnessSpec, PoolError> {
    let key = keys::pool_harness(run_id, id);
    if store.head(&key).await?.is_none() {
        let members = load_manifest(store, run_id)
            .await
            .map(|m| m.members.iter().map(|e| e.id.clone()).collect::<Vec<_>>().join(", "))
            .unwrap_or_default();
        return Err(PoolError::NoMember { run: run_id.into(), id: id.into(), members });
    }
    let bytes = store.get(&key).await?;
    let text = String::from_utf8_lossy(&bytes);
    crate::harness::parse_spec(&store.object_url(&key), &text, &stored_member_options())
        .map_err(|e| PoolError::InvalidMember { key, detail: e.to_string() })
}

/// Every member's spec, in manifest order (what a training run's router gets).
pub async fn load_pool(store: &dyn ObjectStore, run_id: &str) -> Result<(PoolManifest, Vec<HarnessSpec>), PoolError> {
    let manifest = load_manifest(store, run_id).await?;
    let mut specs = Vec::with_capacity(manifest.members.len());
    for m in &manifest.members {
        specs.push(load_member(store, run_id, &m.id).await?);
    }
    Ok((manifest, specs))
}

/// Copies the pool of `from_run` into `to_run` (specs and lineage), recording the source.
pub async fn seed_pool(store: &dyn ObjectStore, from_run: &str, to_run: &str) -> Result<PoolManifest, PoolError> {
    let (source, specs) = load_pool(store, from_run).await?;
    for spec in &specs {
        put_member(store, to_run, spec).await?;
    }
    let mut manifest = PoolManifest {
        schema_version: PoolManifest::VERSION,
        run_id: to_run.into(),
        version: 0,
        seeded_from: Some(from_run.into()),
        validation_tasks: source.validation_tasks.clone(),
        members: source.members.clone(),
        rejected: vec![],
    };
    save_manifest(store, &mut manifest).await?;
    Ok(manifest)
}

#[cfg(test)]
mod tests {
    use super::*;
    use infra::store::LocalStore;

    fn entry(id: &str, parent: Option<&str>) -> PoolEntry {
        PoolEntry {
            id: id.into(),
            parent: parent.map(str::to_string),
            generation: u32::from(parent.is_some()),
            round: 1,
            direction: None,
            causes: vec![],
            version: String::new(),
            editor: "template".into(),
            local: None,
            validation_coverage: vec!["t1".into()],
            selected_as_parent: false,
            origin_run: "r1".into(),
        }
    }

    #[tokio::test]
    async fn a_pool_round_trips_and_seeds_another_run() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalStore::new(dir.path()).unwrap();
        assert!(matches!(load_manifest(&store, "r1").await, Err(PoolError::Missing { .. })));
        let h0 = HarnessSpec::h0();
        let mut s1 = HarnessSpec::h0();
        s1.id = "s1".into();
        s1.parent = Some("h0".into());
        s1.prompt_rules.push(schemas::PromptRule { slot: "answer_format".into(), text: "bare values".into() });
        put_member(&store, "r1", &h0).await.unwrap();
        put_member(&store, "r1", &s1).await.unwrap();
        let mut m = PoolManifest::new("r1");
        m.members = vec![entry("h0", None), entry("s1", Some("h0"))];
        save_manifest(&store, &mut m).await.unwrap();
        save_manifest(&store, &mut m).await.unwrap();
        let back = load_manifest(&store, "r1").await.unwrap();
        assert_eq!(back.version, 2);
        assert_eq!(back, m);
        let (_, specs) = load_pool(&store, "r1").await.unwrap();
        assert_eq!(specs, vec![h0, s1.clone()]);
        let err = load_member(&store, "r1", "nope").await.unwrap_err().to_string();
        assert!(err.contains("no member `nope`") && err.contains("h0, s1"), "{err}");

        let seeded = seed_pool(&store, "r1", "r2").await.unwrap();
        assert_eq!(seeded.seeded_from.as_deref(), Some("r1"));
        assert_eq!(load_member(&store, "r2", "s1").await.unwrap(), s1);

        let mut bad = HarnessSpec::h0();
        bad.id = "bad".into();
        bad.prompt_rules.push(schemas::PromptRule { slot: "nowhere".into(), text: "x".into() });
        assert!(matches!(put_member(&store, "r1", &bad).await, Err(PoolError::InvalidMember { .. })));
    }
}
