//! Checkpoint retention (`[checkpoints]`): which checkpoints outlive newer ones, and in
//! what form.
//!
//! Why every step is still written: the next update's rollouts sample the weights of the
//! step before (workers load them from the store), and a resumed run continues from the
//! newest complete checkpoint. What this module decides is what stays once a newer
//! checkpoint is committed: the step holding the newest weights keeps its full resume state
//! (float32 weights and AdamW moments); older kept steps keep their weights only, in the
//! configured dtype; the rest are removed. A 135M model's full state is 1.6 GB per step, its
//! bf16 weights 0.27 GB.
//!
//! Removal follows the checkpoint commit protocol backwards: the manifest is the commit
//! point, so a removed step loses its manifest first and its files after (a folder without a
//! manifest is never read), and a slimmed step gets a manifest without the dropped files
//! before they are deleted. A prune interrupted anywhere leaves only files no manifest
//! lists, and the next prune deletes those.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::model::Dtype;
use crate::train::checkpoint::{manifest_key, read_manifest, MANIFEST_FILE, MASTER_FILE, OPTIMIZER_FILE};
use crate::NativeError;
use infra::store::ObjectStore;
use schemas::{encode_document, keys};

/// Which kept steps keep their optimizer state (and float32 weights beside `dtype` ones).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ResumeState {
    /// Only the step holding the newest weights: a run resumes from there.
    #[default]
    Latest,
    /// Every kept step, so training can branch from any of them.
    All,
}

/// `[checkpoints]` of a run spec.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Retention {
    /// Weights of `model.safetensors`: `f32`, `bf16` or `f16`. Steps that keep their resume
    /// state also keep float32 weights (`master.safetensors`), so training and rollouts
    /// continue from exact weights whatever this is.
    pub dtype: Dtype,
    /// Keep every N-th step (0: none by this rule).
    pub every: u32,
    /// Keep the N newest steps; left out, every step is kept.
    pub keep_last: Option<u32>,
    /// Keep the step with the best H0 validation success at a calibration.
    pub keep_best: bool,
    /// `latest` or `all`: which kept steps keep their optimizer state.
    pub optimizer: ResumeState,
}

impl Default for Retention {
    fn default() -> Self {
        Retention { dtype: Dtype::F32, every: 0, keep_last: None, keep_best: true, optimizer: ResumeState::Latest }
    }
}

/// What becomes of one stored step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    /// Weights, float32 master weights and optimizer state stay.
    Full,
    /// Only the weights (in `dtype`) and the loading files stay.
    Weights,
    /// The checkpoint is removed.
    Remove,
}

/// A stored step: its number and the step whose folder holds its weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stored {
    pub step: u32,
    pub weights_step: Option<u32>,
}

/// The fate of every stored step under `policy`, with `best` the best-validating step.
/// The newest step is always kept, and so is the folder any kept step takes its weights
/// from; the step holding the newest weights keeps its resume state.
pub fn plan(stored: &[Stored], policy: &Retention, best: Option<u32>) -> BTreeMap<u32, Fate> {
    let Some(latest) = stored.iter().map(|s| s.step).max() else { return BTreeMap::new() };
    let weights_of: BTreeMap<u32, Option<u32>> = stored.iter().map(|s| (s.step, s.weights_step)).collect();
    let wanted = |s: u32| {
        s == latest
            || policy.keep_last.is_none_or(|n| s + n > latest)
            || (policy.every > 0 && s.is_multiple_of(policy.every))
            || (policy.keep_best && best == Some(s))
    };
    let mut kept: BTreeSet<u32> = weights_of.keys().copied().filter(|&s| wanted(s)).collect();
    let holders: Vec<u32> = kept.iter().filter_map(|s| weights_of[s]).collect();
    kept.extend(holders);
    let resume = weights_of[&latest];
    weights_of
        .keys()
        .map(|&s| {
            let fate = match kept.contains(&s) {
                false => Fate::Remove,
                true if policy.optimizer == ResumeState::All || Some(s) == resume => Fate::Full,
                true => Fate::Weights,
            };
            (s, fate)
        })
        .collect()
}

/// What a prune did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Pruned {
    /// Steps whose checkpoint was removed.
    pub removed: Vec<u32>,
    /// Steps that lost their resume state and kept their weights.
    pub slimmed: Vec<u32>,
    /// Objects deleted in all.
    pub objects: usize,
    pub bytes: u64,
}

/// Applies [`plan`] to a run's stored checkpoints. Only steps before the newest are
/// touched, so a prune never races the writer of the newest checkpoint.
pub async fn prune(store: &dyn ObjectStore, run_id: &str, policy: &Retention, best: Option<u32>) -> Result<Pruned, NativeError> {
    let prefix = keys::checkpoints_prefix(run_id);
    // every object, by step folder
    let mut folders: BTreeMap<u32, Vec<(String, u64)>> = BTreeMap::new();
    for meta in store.list(&prefix).await? {
        let Some(step) = meta
            .key
            .strip_prefix(&prefix)
            .and_then(|rest| rest.split('/').next())
            .and_then(|d| d.strip_prefix("step="))
            .and_then(|n| n.parse().ok())
        else {
            continue;
        };
        folders.entry(step).or_default().push((meta.key.clone(), meta.size));
    }
    let mut manifests = BTreeMap::new();
    for (&step, objects) in &folders {
        let key = manifest_key(run_id, step);
        if !objects.iter().any(|(k, _)| *k == key) {
            continue;
        }
        match read_manifest(store, &key).await {
            Ok(m) => {
                manifests.insert(step, m);
            }
            Err(e @ NativeError::Store(_)) => return Err(e),
            // not ours to judge: leave an unreadable manifest's folder alone
            Err(e) => tracing::warn!(key = %key, error = %e, "checkpoint retention skips an unreadable manifest"),
        }
    }
    let Some(&latest) = manifests.keys().max() else { return Ok(Pruned::default()) };
    let stored: Vec<Stored> = manifests.values().map(|m| Stored { step: m.step, weights_step: m.weights_step }).collect();
    let fates = plan(&stored, policy, best);
    let mut done = Pruned::default();
    for (&step, objects) in folders.range(..latest) {
        let dir = keys::checkpoint_dir(run_id, step);
        let listed: BTreeSet<String> = match (manifests.get(&step), fates.get(&step)) {
            (Some(_), Some(Fate::Remove)) => {
                store.delete(&manifest_key(run_id, step)).await?;
                done.removed.push(step);
                BTreeSet::new()
            }
            (Some(m), Some(Fate::Weights)) if m.files.iter().any(|f| f.name == MASTER_FILE || f.name == OPTIMIZER_FILE) => {
                let mut slim = m.clone();
                slim.files.retain(|f| f.name != MASTER_FILE && f.name != OPTIMIZER_FILE);
                store.put(&manifest_key(run_id, step), bytes::Bytes::from(encode_document(&slim))).await?;
                done.slimmed.push(step);
                slim.files.iter().map(|f| format!("{dir}{}", f.name)).chain([format!("{dir}{MANIFEST_FILE}")]).collect()
            }
            (Some(m), Some(_)) => m.files.iter().map(|f| format!("{dir}{}", f.name)).chain([format!("{dir}{MANIFEST_FILE}")]).collect(),
            // a folder without a readable manifest: an unreadable one is left alone, a
            // missing one is an earlier write or removal that was interrupted
            (None, _) if objects.iter().any(|(k, _)| k.ends_with(MANIFEST_FILE)) => continue,
            (None, _) => BTreeSet::new(),
            (Some(_), None) => continue,
        };
        for (key, size) in objects {
            if !listed.contains(key) && *key != manifest_key(run_id, step) {
                store.delete(key).await?;
                done.objects += 1;
                done.bytes += size;
            }
        }
    }
    if !done.removed.is_empty() || !done.slimmed.is_empty() {
        tracing::info!(run = %run_id, removed = ?done.removed, slimmed = ?done.slimmed, freed_mb = done.bytes / 1_000_000, "checkpoint retention");
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trained(steps: std::ops::RangeInclusive<u32>) -> Vec<Stored> {
        steps.map(|s| Stored { step: s, weights_step: Some(s) }).collect()
    }

    fn fates(p: &BTreeMap<u32, Fate>, f: Fate) -> Vec<u32> {
        p.iter().filter(|(_, v)| **v == f).map(|(s, _)| *s).collect()
    }

    #[test]
    fn by_default_every_step_stays_and_only_the_newest_keeps_its_optimizer() {
        let p = plan(&trained(1..=5), &Retention::default(), None);
        assert_eq!(fates(&p, Fate::Full), vec![5]);
        assert_eq!(fates(&p, Fate::Weights), vec![1, 2, 3, 4]);
        let all = Retention { optimizer: ResumeState::All, ..Default::default() };
        assert_eq!(fates(&plan(&trained(1..=5), &all, None), Fate::Full), vec![1, 2, 3, 4, 5]);
    }

    #[test]
    fn last_n_every_n_and_best_are_kept() {
        let policy = Retention { keep_last: Some(2), every: 4, ..Default::default() };
        let p = plan(&trained(1..=10), &policy, Some(3));
        assert_eq!(fates(&p, Fate::Remove), vec![1, 2, 5, 6, 7]);
        assert_eq!(fates(&p, Fate::Weights), vec![3, 4, 8, 9]);
        assert_eq!(fates(&p, Fate::Full), vec![10]);
        let no_best = Retention { keep_best: false, ..policy };
        assert_eq!(fates(&plan(&trained(1..=10), &no_best, Some(3)), Fate::Remove), vec![1, 2, 3, 5, 6, 7]);
    }

    #[test]
    fn a_kept_step_that_trained_nothing_keeps_the_folder_of_its_weights() {
        // steps 4 and 5 trained nothing: their weights are step 3's
        let mut stored = trained(1..=3);
        stored.extend([Stored { step: 4, weights_step: Some(3) }, Stored { step: 5, weights_step: Some(3) }]);
        let p = plan(&stored, &Retention { keep_last: Some(1), keep_best: false, ..Default::default() }, None);
        assert_eq!(fates(&p, Fate::Remove), vec![1, 2, 4]);
        // step 3 holds the newest weights: it keeps the resume state (step 5 has no files)
        assert_eq!(fates(&p, Fate::Full), vec![3]);
        assert_eq!(fates(&p, Fate::Weights), vec![5]);
        // nothing trained yet: nothing to hold
        let p = plan(
            &[Stored { step: 1, weights_step: None }, Stored { step: 2, weights_step: None }],
            &Retention { keep_last: Some(1), ..Default::default() },
            None,
        );
        assert_eq!(fates(&p, Fate::Remove), vec![1]);
    }
}
