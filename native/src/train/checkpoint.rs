//! Checkpoints in the object store: `runs/<run>/checkpoints/step=<n>/` holds
//! `model.safetensors` (HF tensor names, in `[checkpoints] dtype`; with `config.json` and,
//! when known, `tokenizer.json` beside it, so the folder loads in transformers and vLLM as
//! it is), `master.safetensors` (the float32 weights, only when `dtype` is not float32),
//! `optimizer.safetensors` (AdamW moments, step in its metadata) and `manifest.json`
//! ([`CheckpointManifest`]: step, parent, data cursor, RNG state, metrics, file sizes and
//! SHA-256) — written LAST. A folder without a manifest is half-written: [`latest`] never
//! takes it, [`load`] refuses it by name. Training and sampling load the float32 weights
//! where the checkpoint still has them; [`crate::train::retention`] decides which steps keep them.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use bytes::Bytes;
use sha2::{Digest, Sha256};
use tch::{Device, Tensor};

use crate::model::hf::{read_safetensors, safetensors_parts, sha256_hex as sha256};
use crate::model::lora::{self, ADAPTER_CONFIG_FILE, ADAPTER_FILE};
use crate::model::tokenizer::Tokenizer;
use crate::model::Dtype;
use crate::model::{CausalLm, Model};
use crate::train::learner::{AdamW, AdamWConfig, Learner, LearnerConfig};
use crate::NativeError;
use infra::store::ObjectStore;
use schemas::{decode_document, encode_document, keys, CheckpointManifest, Document, FileEntry};

pub use crate::model::hf::{MANIFEST_FILE, MASTER_FILE, OPTIMIZER_FILE};
pub const MODEL_FILE: &str = "model.safetensors";
pub const CONFIG_FILE: &str = "config.json";
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// What a checkpoint records besides the weights.
#[derive(Debug, Clone, Default)]
pub struct SaveInfo {
    pub run_id: String,
    pub step: u32,
    /// Manifest key of the checkpoint the update started from.
    pub parent: Option<String>,
    pub data_cursor: u64,
    pub metrics: BTreeMap<String, f64>,
    /// Element type of `model.safetensors`.
    pub dtype: crate::model::Dtype,
    /// The base model the run started from: what an adapter checkpoint's
    /// `adapter_config.json` names as `base_model_name_or_path`, and what loading it reads.
    pub base_model: String,
}

/// Key of a checkpoint's manifest.
pub fn manifest_key(run_id: &str, step: u32) -> String {
    format!("{}{MANIFEST_FILE}", keys::checkpoint_dir(run_id, step))
}

fn ckpt_err(location: impl Into<String>, detail: impl Into<String>) -> NativeError {
    NativeError::Checkpoint { location: location.into(), detail: detail.into() }
}

/// The AdamW moments (`exp_avg.<param>`, `exp_avg_sq.<param>`) as a safetensors file's
/// parts, with the step count and hyper-parameters in the file's metadata.
fn optimizer_parts(optim: &AdamW) -> Result<Vec<Bytes>, NativeError> {
    let mut tensors: Vec<(String, Tensor)> = vec![];
    for (n, t) in &optim.exp_avg {
        tensors.push((format!("exp_avg.{n}"), t.shallow_clone()));
    }
    for (n, t) in &optim.exp_avg_sq {
        tensors.push((format!("exp_avg_sq.{n}"), t.shallow_clone()));
    }
    // The step and hyper-parameters ride in the safetensors header's `__metadata__`, as one
    // entry: the header serialises a hash map, so several entries would come out in a
    // different order in every process and identical states would hash differently.
    let state = serde_json::json!({"step": optim.step, "config": optim.config});
    let meta = (!tensors.is_empty() || optim.step > 0).then(|| HashMap::from([("optimizer".to_string(), state.to_string())]));
    safetensors_parts(&tensors, Dtype::F32, meta)
}

/// Streams a file's `parts` to `key` (one upload, visible once complete) and returns its
/// manifest entry; each part is hashed on a helper thread while it is written.
async fn put_parts(store: &dyn ObjectStore, key: &str, name: &str, parts: Vec<Bytes>) -> Result<FileEntry, NativeError> {
    let mut upload = store.put_multipart(key).await?;
    let (mut hasher, mut size) = (Sha256::new(), 0u64);
    for part in parts {
        size += part.len() as u64;
        let hashed = part.clone();
        let hashing = tokio::task::spawn_blocking(move || {
            hasher.update(&hashed);
            hasher
        });
        let written = upload.write(part).await;
        hasher = hashing.await.map_err(|e| ckpt_err(key, format!("hashing failed: {e}")))?;
        if let Err(e) = written {
            let _ = upload.abort().await;
            return Err(e.into());
        }
    }
    upload.complete().await?;
    Ok(FileEntry { name: name.to_string(), size, sha256: hex::encode(hasher.finalize()) })
}

fn restore_optimizer(bytes: &[u8], location: &str, device: Device) -> Result<AdamW, NativeError> {
    let (_, meta) =
        safetensors::SafeTensors::read_metadata(bytes).map_err(|e| ckpt_err(location, format!("not a safetensors file: {e:?}")))?;
    let meta = meta.metadata().clone().unwrap_or_default();
    let (step, config): (u64, AdamWConfig) = match meta.get("optimizer") {
        Some(state) => {
            let v: serde_json::Value = serde_json::from_str(state).map_err(|e| ckpt_err(location, format!("optimizer state: {e}")))?;
            let config = serde_json::from_value(v["config"].clone()).map_err(|e| ckpt_err(location, format!("optimizer config: {e}")))?;
            (v["step"].as_u64().unwrap_or(0), config)
        }
        None => (0, AdamWConfig::default()),
    };
    let mut optim = AdamW::new(config);
    optim.step = step;
    for (name, t) in read_safetensors(bytes, &PathBuf::from(location))? {
        let t = t.to_device(device);
        if let Some(p) = name.strip_prefix("exp_avg_sq.") {
            optim.exp_avg_sq.insert(p.to_string(), t);
        } else if let Some(p) = name.strip_prefix("exp_avg.") {
            optim.exp_avg.insert(p.to_string(), t);
        } else {
            return Err(ckpt_err(location, format!("unexpected tensor `{name}`")));
        }
    }
    Ok(optim)
}

/// Writes a checkpoint of `learner` (files first, manifest last); returns the manifest key.
pub async fn save(
    store: &dyn ObjectStore,
    learner: &Learner,
    tokenizer: Option<&Tokenizer>,
    info: &SaveInfo,
) -> Result<String, NativeError> {
    let dir = keys::checkpoint_dir(&info.run_id, info.step);
    let started = std::time::Instant::now();
    // `format = pt`: what transformers' loader looks for in a safetensors header.
    let pt = || Some(HashMap::from([("format".to_string(), "pt".to_string())]));
    let mut small = vec![(CONFIG_FILE, serde_json::to_vec_pretty(&learner.model.config_json()).expect("serialises"))];
    let mut large = vec![];
    match (&learner.config.adapter, lora::is_adapted(&learner.model)) {
        // an adapter run: the adapter in PEFT's layout (float32, small); the base stays where it is
        (Some(adapter), true) => {
            large.push((ADAPTER_FILE, safetensors_parts(&lora::adapter_tensors(&learner.model), Dtype::F32, pt())?));
            let peft = lora::peft_config(adapter, &learner.model, &info.base_model);
            small.push((ADAPTER_CONFIG_FILE, serde_json::to_vec_pretty(&peft).expect("serialises")));
        }
        (None, false) => {
            let tensors = learner.model.named_tensors();
            large.push((MODEL_FILE, safetensors_parts(&tensors, info.dtype, pt())?));
            if info.dtype != Dtype::F32 {
                large.push((MASTER_FILE, safetensors_parts(&tensors, Dtype::F32, pt())?));
            }
        }
        (Some(_), false) | (None, true) => {
            return Err(ckpt_err(
                dir,
                "the learner's model and its `adapter` setting disagree (an adapter without a config, or a config without one)",
            ))
        }
    }
    large.push((OPTIMIZER_FILE, optimizer_parts(&learner.optim)?));
    let mut entries = vec![];
    for (name, parts) in large {
        entries.push(put_parts(store, &format!("{dir}{name}"), name, parts).await?);
    }
    if let Some(tok) = tokenizer {
        small.push((TOKENIZER_FILE, tok.to_json()?.into_bytes()));
        small.push(("tokenizer_config.json", serde_json::to_vec_pretty(&tok.hf_config()).expect("serialises")));
    }
    for (name, bytes) in small {
        entries.push(FileEntry { name: name.to_string(), size: bytes.len() as u64, sha256: sha256(&bytes) });
        store.put(&format!("{dir}{name}"), Bytes::from(bytes)).await?;
    }
    let bytes: u64 = entries.iter().map(|e| e.size).sum();
    let key = put_manifest(store, info, learner.model.architecture(), entries, learner.rng_state(), Some(info.step)).await?;
    tracing::info!(key = %key, bytes, seconds = started.elapsed().as_secs_f64(), "checkpoint written");
    Ok(key)
}

/// Writes the manifest of `info.step` (the commit point of a checkpoint); a step trained
/// iff its weights are its own.
async fn put_manifest(
    store: &dyn ObjectStore,
    info: &SaveInfo,
    architecture: String,
    files: Vec<FileEntry>,
    rng_state: String,
    weights_step: Option<u32>,
) -> Result<String, NativeError> {
    let manifest = CheckpointManifest {
        schema_version: CheckpointManifest::VERSION,
        run_id: info.run_id.clone(),
        step: info.step,
        parent: info.parent.clone(),
        architecture,
        files,
        data_cursor: info.data_cursor,
        rng_state,
        metrics: info.metrics.clone(),
        created_at_ms: schemas::now_unix_ms(),
        trained: weights_step == Some(info.step),
        weights_step,
    };
    let key = manifest_key(&info.run_id, info.step);
    store.put(&key, Bytes::from(encode_document(&manifest))).await?;
    Ok(key)
}

/// Records a step that trained nothing: a manifest without files whose `weights_step`
/// names the checkpoint that still holds the weights (`None`: the base model). No copy of
/// unchanged weights is written; [`load`] and [`latest`] follow the reference.
pub async fn save_untrained(
    store: &dyn ObjectStore,
    info: &SaveInfo,
    weights_step: Option<u32>,
    rng_state: String,
    architecture: String,
) -> Result<String, NativeError> {
    debug_assert!(weights_step.is_none_or(|w| w < info.step), "an untrained step's weights are an earlier step's");
    let key = put_manifest(store, info, architecture, vec![], rng_state, weights_step).await?;
    tracing::info!(key = %key, weights_step = ?weights_step, "untrained step recorded (no weights written)");
    Ok(key)
}

/// Checks that every file `manifest` lists (or, for an untrained step, the checkpoint its
/// weights live in lists) is present with its recorded size. A committed manifest (it is
/// written last; retention rewrites it before deleting files) whose files are gone is a
/// damaged checkpoint: an error naming the file, never a reason to fall back silently to an
/// older step.
async fn check_complete(store: &dyn ObjectStore, run_id: &str, manifest: &CheckpointManifest) -> Result<(), NativeError> {
    let here = manifest_key(run_id, manifest.step);
    let (files_of, step) = match manifest.weights_step {
        Some(w) if w != manifest.step => {
            let m = read_manifest(store, &manifest_key(run_id, w)).await?;
            if m.weights_step != Some(w) {
                return Err(ckpt_err(
                    store.object_url(&here),
                    format!("names step {w} as holding its weights, but step {w}'s manifest says it does not; the checkpoint is damaged (`harness-s verify {run_id}`)"),
                ));
            }
            (m, w)
        }
        // The base model: nothing stored to check.
        None => return Ok(()),
        Some(_) => (manifest.clone(), manifest.step),
    };
    let dir = keys::checkpoint_dir(run_id, step);
    for f in &files_of.files {
        let key = format!("{dir}{}", f.name);
        let problem = match store.head(&key).await? {
            Some(meta) if meta.size == f.size => continue,
            Some(meta) => format!("{} bytes, its manifest says {}", meta.size, f.size),
            None => "listed by its manifest but missing".to_string(),
        };
        return Err(ckpt_err(
            store.object_url(&key),
            format!("{problem}: checkpoint step {step} is damaged and is not used (`harness-s verify {run_id}` lists the damage)"),
        ));
    }
    Ok(())
}

/// The newest checkpoint of a run: the highest step whose manifest exists (the commit
/// point), checked to parse and to list files that are all present with their recorded
/// sizes. A damaged newest checkpoint is an error naming the file, not a reason to fall back
/// to an older step.
pub async fn latest(store: &dyn ObjectStore, run_id: &str) -> Result<Option<CheckpointManifest>, NativeError> {
    let newest = committed_steps(store, run_id).await?.into_iter().max();
    let Some(step) = newest else { return Ok(None) };
    let manifest = read_manifest(store, &manifest_key(run_id, step)).await?;
    check_complete(store, run_id, &manifest).await?;
    Ok(Some(manifest))
}

/// The newest step before `before` (and not in `skip`) whose checkpoint holds its own
/// resume state (AdamW moments beside its weights), which training can continue from; None
/// when there is none (retention keeps it for the step of the newest weights only).
pub async fn newest_resume_state(
    store: &dyn ObjectStore,
    run_id: &str,
    before: u32,
    skip: &std::collections::BTreeSet<u32>,
) -> Result<Option<u32>, NativeError> {
    let mut steps: Vec<u32> = committed_steps(store, run_id).await?.into_iter().filter(|s| *s < before && !skip.contains(s)).collect();
    steps.sort_unstable_by(|a, b| b.cmp(a));
    for step in steps {
        if let Ok(m) = read_manifest(store, &manifest_key(run_id, step)).await {
            if m.weights_step == Some(step) && m.files.iter().any(|f| f.name == OPTIMIZER_FILE) {
                return Ok(Some(step));
            }
        }
    }
    Ok(None)
}

/// Removes every checkpoint of `run_id` after step `after` (0: all of them), the commit
/// protocol backwards: every manifest first (a folder without one is never read), the
/// files after. For checkpoints that are made again by training again.
pub async fn remove_after(store: &dyn ObjectStore, run_id: &str, after: u32) -> Result<(), NativeError> {
    let objects = store.list(&keys::checkpoints_prefix(run_id)).await?;
    let step_of = |key: &str| keys::checkpoint_of(key).ok().flatten().map(|c| c.step);
    let doomed: std::collections::BTreeSet<u32> = objects.iter().filter_map(|o| step_of(&o.key)).filter(|&s| s > after).collect();
    for &step in &doomed {
        store.delete(&manifest_key(run_id, step)).await?;
    }
    for o in objects.iter().filter(|o| step_of(&o.key).is_some_and(|s| doomed.contains(&s))) {
        store.delete(&o.key).await?;
    }
    Ok(())
}

/// Steps of `run_id` with a committed checkpoint (a manifest).
async fn committed_steps(store: &dyn ObjectStore, run_id: &str) -> Result<Vec<u32>, NativeError> {
    let prefix = keys::checkpoints_prefix(run_id);
    Ok(store
        .list(&prefix)
        .await?
        .iter()
        .filter_map(|m| m.key.strip_prefix(&prefix)?.strip_suffix(&format!("/{MANIFEST_FILE}"))?.strip_prefix("step=")?.parse().ok())
        .collect())
}

pub(crate) async fn read_manifest(store: &dyn ObjectStore, key: &str) -> Result<CheckpointManifest, NativeError> {
    let bytes = match store.get(key).await {
        Ok(b) => b,
        Err(infra::store::StoreError::NotFound { .. }) => {
            return Err(ckpt_err(
                store.object_url(key),
                "manifest.json is absent: the checkpoint is half-written (its manifest is written last), was removed by `[checkpoints]` retention, or was never made; load the latest complete checkpoint instead",
            ))
        }
        Err(e) => return Err(e.into()),
    };
    Ok(decode_document::<CheckpointManifest>(&store.object_url(key), &bytes)?)
}

async fn read_file(store: &dyn ObjectStore, dir: &str, manifest: &CheckpointManifest, name: &str) -> Result<Option<Bytes>, NativeError> {
    let Some(entry) = manifest.files.iter().find(|f| f.name == name) else { return Ok(None) };
    let key = format!("{dir}{name}");
    let bytes = store.get(&key).await?;
    // hashed on a helper thread: a checkpoint's two large files are read and checked at once
    let hashed = bytes.clone();
    let digest = tokio::task::spawn_blocking(move || sha256(&hashed))
        .await
        .map_err(|e| ckpt_err(store.object_url(&key), format!("hashing failed: {e}")))?;
    if bytes.len() as u64 != entry.size || digest != entry.sha256 {
        return Err(ckpt_err(store.object_url(&key), "size or SHA-256 differs from the manifest (corrupt or overwritten file)"));
    }
    Ok(Some(bytes))
}

/// A loaded checkpoint.
pub struct Loaded {
    pub manifest: CheckpointManifest,
    pub learner: Learner,
    /// The tokenizer saved with it, if any.
    pub tokenizer: Option<Tokenizer>,
}

/// Loads the checkpoint of `step`: weights, optimizer moments and RNG state. For a step
/// that trained nothing, the weights of the step it names; a step whose weights are still
/// the base model's is refused (load the base model instead).
pub async fn load(store: &dyn ObjectStore, run_id: &str, step: u32, device: Device, config: LearnerConfig) -> Result<Loaded, NativeError> {
    let parts = load_parts(store, run_id, step, device, Some(config.precision.kind())).await?;
    let adapted = lora::is_adapted(&parts.model);
    if adapted != config.adapter.is_some() {
        return Err(NativeError::Config {
            field: "learner.adapter".into(),
            detail: format!(
                "step {step} of run `{run_id}` holds {}, but the run's learner {}; a run keeps the setting it started with",
                if adapted { "a LoRA adapter" } else { "full weights" },
                if config.adapter.is_some() { "trains an adapter" } else { "trains every weight" }
            ),
        });
    }
    let mut learner = Learner::new(parts.model, config);
    if let Some(mut optim) = parts.optimizer {
        // The run's settings win over the saved ones; the moments and step carry over.
        optim.config = learner.config.optimizer.clone();
        learner.optim = optim;
    }
    learner.set_rng_state(&parts.manifest.rng_state)?;
    Ok(Loaded { manifest: parts.manifest, learner, tokenizer: parts.tokenizer })
}

/// The weights (and tokenizer) of `step`'s checkpoint without the optimizer state: what
/// a policy needs to sample. Follows `weights_step` like [`load`]; an adapter checkpoint
/// comes back merged into its base (full weights, float32).
pub async fn load_model(
    store: &dyn ObjectStore,
    run_id: &str,
    step: u32,
    device: Device,
) -> Result<(Model, Option<Tokenizer>, CheckpointManifest), NativeError> {
    let parts = load_parts(store, run_id, step, device, None).await?;
    Ok((parts.model, parts.tokenizer, parts.manifest))
}

struct Parts {
    manifest: CheckpointManifest,
    model: Model,
    optimizer: Option<AdamW>,
    tokenizer: Option<Tokenizer>,
}

/// The parts of `step`'s checkpoint. `learner`: `Some(base kind)` to train on (the
/// optimizer state too; an adapter stays an adapter over a base stored in that kind), `None`
/// to sample (an adapter merged into its base).
async fn load_parts(
    store: &dyn ObjectStore,
    run_id: &str,
    step: u32,
    device: Device,
    learner: Option<tch::Kind>,
) -> Result<Parts, NativeError> {
    let optimizer = learner.is_some();
    let manifest = read_manifest(store, &manifest_key(run_id, step)).await?;
    match manifest.weights_step {
        Some(w) if w == step => {}
        Some(w) if w < step => {
            let mut parts = Box::pin(load_parts(store, run_id, w, device, learner)).await?;
            parts.manifest = manifest;
            return Ok(parts);
        }
        Some(w) => return Err(ckpt_err(store.object_url(&manifest_key(run_id, step)), format!("names the weights of a later step ({w})"))),
        None => {
            return Err(ckpt_err(
                store.object_url(&manifest_key(run_id, step)),
                "trained nothing and nothing before it was trained: its weights are the base model's; load the base model",
            ))
        }
    }
    let dir = keys::checkpoint_dir(run_id, step);
    let url = |name: &str| store.object_url(&format!("{dir}{name}"));
    let missing = |name: &str| ckpt_err(url(name), format!("listed file `{name}` is missing from the manifest"));
    let cfg_bytes = read_file(store, &dir, &manifest, CONFIG_FILE).await?.ok_or_else(|| missing(CONFIG_FILE))?;
    let cfg_text = String::from_utf8_lossy(&cfg_bytes).into_owned();
    let has = |name: &str| manifest.files.iter().any(|f| f.name == name);
    // the float32 weights where this step kept them, else `model.safetensors` (any dtype), or
    // an adapter over its base
    let weights = if has(ADAPTER_FILE) {
        ADAPTER_FILE
    } else if has(MASTER_FILE) {
        MASTER_FILE
    } else {
        MODEL_FILE
    };
    let started = std::time::Instant::now();
    let (model_bytes, optimizer_bytes) = tokio::try_join!(read_file(store, &dir, &manifest, weights), async {
        match optimizer {
            true => read_file(store, &dir, &manifest, OPTIMIZER_FILE).await,
            false => Ok(None),
        }
    })?;
    let model_bytes = model_bytes.ok_or_else(|| missing(weights))?;
    let read_s = started.elapsed().as_secs_f64();
    let model_path = PathBuf::from(url(weights));
    let tensors = read_safetensors(&model_bytes, &model_path)?;
    drop(model_bytes);
    let tensors: HashMap<String, Tensor> = tensors.into_iter().map(|(k, v)| (k, v.to_device(device))).collect();
    let model = if weights == ADAPTER_FILE {
        let cfg = read_file(store, &dir, &manifest, ADAPTER_CONFIG_FILE).await?.ok_or_else(|| missing(ADAPTER_CONFIG_FILE))?;
        adapted(&cfg, &url(ADAPTER_CONFIG_FILE), &tensors, &model_path, device, learner)?
    } else {
        Model::from_hf(&cfg_text, &PathBuf::from(url(CONFIG_FILE)), &tensors, device, &model_path)?
    };
    drop(tensors);
    let optimizer = match optimizer_bytes {
        Some(bytes) => Some(restore_optimizer(&bytes, &url(OPTIMIZER_FILE), device)?),
        None => None,
    };
    tracing::info!(run = run_id, step, read_s, seconds = started.elapsed().as_secs_f64(), "checkpoint loaded");
    let tokenizer = match read_file(store, &dir, &manifest, TOKENIZER_FILE).await? {
        Some(bytes) => {
            let cfg = read_file(store, &dir, &manifest, "tokenizer_config.json").await?;
            Some(Tokenizer::from_hf_bytes(&bytes, cfg.as_deref(), &PathBuf::from(url(TOKENIZER_FILE)))?)
        }
        None => None,
    };
    Ok(Parts { manifest, model, optimizer, tokenizer })
}

/// The model of an adapter checkpoint: its base (the folder or file `adapter_config.json`
/// names) with the adapter `tensors` attached (`learner`: the base frozen in that kind) or
/// merged (`None`).
fn adapted(
    config: &[u8],
    config_url: &str,
    tensors: &HashMap<String, Tensor>,
    source: &std::path::Path,
    device: Device,
    learner: Option<tch::Kind>,
) -> Result<Model, NativeError> {
    let (adapter, base) = lora::read_peft_config(&String::from_utf8_lossy(config), std::path::Path::new(config_url))?;
    if base.is_empty() {
        return Err(ckpt_err(config_url, "`base_model_name_or_path` is empty: the adapter does not say which base it adapts"));
    }
    let mut model = crate::model::loader::load_model(std::path::Path::new(&base), device)
        .map_err(|e| ckpt_err(config_url, format!("its base model `{base}` (`base_model_name_or_path`) does not load: {e}")))?;
    lora::load(&mut model, &adapter, tensors, learner.unwrap_or(tch::Kind::Float), source)?;
    if learner.is_none() {
        lora::merge(&mut model);
        lora::unfreeze(&mut model);
    }
    Ok(model)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Llama, LlamaConfig};
    use crate::train::learner::{Batch, Sample};
    use infra::store::LocalStore;

    fn learner(seed: u64) -> Learner {
        let m = Llama::new(LlamaConfig::tiny(32, 64, 2), Device::Cpu, seed).unwrap();
        Learner::new(
            m.into(),
            LearnerConfig {
                optimizer: AdamWConfig { lr: 1e-2, ..Default::default() },
                micro_batch_tokens: 8,
                seed: 3,
                ..Default::default()
            },
        )
    }

    fn batch() -> Batch {
        Batch {
            tasks: vec!["a".into()],
            samples: vec![Sample::plain(0, &[1, 2], &[3, 4], 1.0), Sample::plain(0, &[1, 2], &[5], -1.0)],
            ..Default::default()
        }
    }

    fn store() -> (tempfile::TempDir, LocalStore) {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalStore::new(dir.path()).unwrap();
        (dir, store)
    }

    fn logits(l: &Learner) -> Tensor {
        let _g = tch::no_grad_guard();
        l.model.logits_last(&Tensor::from_slice(&[1i64, 2, 3, 4, 5]).view([1, 5]), &mut l.model.new_cache())
    }

    #[tokio::test]
    async fn save_then_load_gives_identical_logits_and_resumes_bit_identically() {
        let (_d, store) = store();
        let mut a = learner(1);
        a.update(&batch()).unwrap();
        let info = SaveInfo { run_id: "r".into(), step: 1, data_cursor: 8, ..Default::default() };
        let key = save(&store, &a, None, &info).await.unwrap();
        assert_eq!(key, "runs/r/checkpoints/step=1/manifest.json");
        let cfg = a.config.clone();
        let loaded = load(&store, "r", 1, Device::Cpu, cfg.clone()).await.unwrap();
        assert_eq!(loaded.manifest.data_cursor, 8);
        assert!(logits(&a).equal(&logits(&loaded.learner)), "logits differ after save → load");
        // two runs from the same checkpoint and seed: bit-identical weights after an update
        let mut b = load(&store, "r", 1, Device::Cpu, cfg.clone()).await.unwrap().learner;
        let mut c = load(&store, "r", 1, Device::Cpu, cfg).await.unwrap().learner;
        b.update(&batch()).unwrap();
        c.update(&batch()).unwrap();
        a.update(&batch()).unwrap();
        for (((n, x), (_, y)), (_, z)) in b.model.named_tensors().iter().zip(c.model.named_tensors()).zip(a.model.named_tensors()) {
            assert!(x.equal(&y), "{n} differs between two resumed runs");
            assert!(x.equal(&z), "{n} differs from the uninterrupted run");
        }
    }

    #[tokio::test]
    async fn retention_keeps_weights_in_their_dtype_and_the_resume_state_of_the_newest() {
        use crate::model::Dtype;
        use crate::train::retention::{prune, ResumeState, Retention};
        let (_d, store) = store();
        let policy = Retention { dtype: Dtype::Bf16, keep_last: Some(2), every: 0, keep_best: true, optimizer: ResumeState::Latest };
        let mut a = learner(5);
        for step in 1..=4 {
            a.update(&batch()).unwrap();
            save(&store, &a, None, &SaveInfo { run_id: "r".into(), step, dtype: Dtype::Bf16, ..Default::default() }).await.unwrap();
            prune(&store, "r", &policy, Some(1)).await.unwrap();
        }
        let names = |step: u32| {
            let store = &store;
            async move {
                let dir = keys::checkpoint_dir("r", step);
                let mut v: Vec<String> =
                    store.list(&dir).await.unwrap().into_iter().map(|m| m.key.strip_prefix(&dir).unwrap().to_string()).collect();
                v.sort();
                v
            }
        };
        let weights_only = vec![CONFIG_FILE, MANIFEST_FILE, MODEL_FILE];
        assert_eq!(names(1).await, weights_only, "step 1 is the best: kept, weights only");
        assert!(names(2).await.is_empty(), "step 2 is neither of the last two nor the best");
        assert_eq!(names(3).await, weights_only);
        assert_eq!(names(4).await, vec![CONFIG_FILE, MANIFEST_FILE, MASTER_FILE, MODEL_FILE, OPTIMIZER_FILE]);
        // the kept weights are bfloat16; a manifest lists exactly what is stored
        let model = store.get("runs/r/checkpoints/step=3/model.safetensors").await.unwrap();
        let (_, meta) = safetensors::SafeTensors::read_metadata(&model).unwrap();
        assert!(meta.tensors().values().all(|t| t.dtype == safetensors::Dtype::BF16));
        assert_eq!(read_manifest(&store, &manifest_key("r", 3)).await.unwrap().files.len(), 2);
        // the newest resumes bit-identically (float32 weights and moments), an older one loads
        let cfg = a.config.clone();
        let mut b = load(&store, "r", 4, Device::Cpu, cfg).await.unwrap().learner;
        a.update(&batch()).unwrap();
        b.update(&batch()).unwrap();
        assert!(logits(&a).equal(&logits(&b)), "resuming from the newest checkpoint is not exact");
        let (older, _, _) = load_model(&store, "r", 3, Device::Cpu).await.unwrap();
        assert_eq!(older.named_tensors().len(), a.model.named_tensors().len());
        // a prune that was interrupted left a stray file: the next one deletes it, and a prune
        // with nothing to do changes nothing
        store.put("runs/r/checkpoints/step=2/model.safetensors", Bytes::from_static(b"partial")).await.unwrap();
        let again = prune(&store, "r", &policy, Some(1)).await.unwrap();
        assert_eq!((again.objects, again.removed.len(), again.slimmed.len()), (1, 0, 0));
        assert_eq!(prune(&store, "r", &policy, Some(1)).await.unwrap(), crate::train::retention::Pruned::default());
    }

    /// A checkpoint folder loaded as a folder (`generate --model`, `serve`'s weight updates,
    /// a spec's `policy.model`) is held to its manifest: a flipped bit or a missing file is
    /// an error naming the file, and the intact folder loads.
    #[tokio::test]
    async fn a_damaged_checkpoint_folder_is_refused_by_every_folder_loader() {
        let (dir, store) = store();
        let a = learner(2);
        let tok = crate::model::tokenizer::word_level(&["a", "b"]);
        save(&store, &a, Some(&tok), &SaveInfo { run_id: "r".into(), step: 1, ..Default::default() }).await.unwrap();
        let folder = dir.path().join("runs/r/checkpoints/step=1");
        crate::model::loader::load(&folder, Device::Cpu).unwrap();
        // one bit of the weights
        let weights = folder.join(MODEL_FILE);
        let mut bytes = std::fs::read(&weights).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&weights, &bytes).unwrap();
        let err = crate::model::hf::load_model(&folder, Device::Cpu).err().unwrap().to_string();
        assert!(err.contains("step=1/model.safetensors") && err.contains("SHA-256") && err.contains("manifest.json"), "{err}");
        // the tokenizer's files too
        bytes[last] ^= 1;
        std::fs::write(&weights, &bytes).unwrap();
        std::fs::write(folder.join(TOKENIZER_FILE), tok.to_json().unwrap().replace("\"a\"", "\"z\"")).unwrap();
        let err = crate::model::loader::load(&folder, Device::Cpu).err().unwrap().to_string();
        assert!(err.contains("tokenizer.json") && err.contains("SHA-256"), "{err}");
        // a listed file that is gone
        std::fs::remove_file(&weights).unwrap();
        let err = crate::model::hf::load_model(&folder, Device::Cpu).err().unwrap().to_string();
        assert!(err.contains("model.safetensors") && err.contains("listed in manifest.json but missing"), "{err}");
    }

    /// A half-written checkpoint (no manifest) is skipped; a committed one whose files are
    /// gone is an error naming the file, never a silent fall back to an older step.
    #[tokio::test]
    async fn a_half_written_checkpoint_is_never_the_latest() {
        let (_d, store) = store();
        let a = learner(2);
        save(&store, &a, None, &SaveInfo { run_id: "r".into(), step: 1, ..Default::default() }).await.unwrap();
        // step 2: files written, manifest missing (the writer died before the last put)
        save(&store, &a, None, &SaveInfo { run_id: "r".into(), step: 2, ..Default::default() }).await.unwrap();
        store.delete(&manifest_key("r", 2)).await.unwrap();
        // step 3: manifest present but the model file was lost
        save(&store, &a, None, &SaveInfo { run_id: "r".into(), step: 3, ..Default::default() }).await.unwrap();
        store.delete("runs/r/checkpoints/step=3/model.safetensors").await.unwrap();
        let err = latest(&store, "r").await.unwrap_err().to_string();
        assert!(err.contains("step=3/model.safetensors") && err.contains("missing") && err.contains("verify"), "{err}");
        store.delete(&manifest_key("r", 3)).await.unwrap();
        assert_eq!(latest(&store, "r").await.unwrap().map(|m| m.step), Some(1));
        let err = load(&store, "r", 2, Device::Cpu, LearnerConfig::default()).await.err().unwrap().to_string();
        assert!(err.contains("step=2/manifest.json") && err.contains("manifest.json is absent"), "{err}");
        assert!(latest(&store, "other").await.unwrap().is_none());
    }
}
