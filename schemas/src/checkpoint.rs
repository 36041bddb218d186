use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::Document;

/// A file listed in a manifest or done-marker, with its size and SHA-256.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    pub name: String,
    pub size: u64,
    pub sha256: String,
}

/// `checkpoints/step=<n>/manifest.json`: written last, so a checkpoint without it is
/// half-written and never taken as the latest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointManifest {
    pub schema_version: u32,
    pub run_id: String,
    pub step: u32,
    /// Manifest key of the checkpoint this one was trained from.
    pub parent: Option<String>,
    /// Model family and architecture description (e.g. `llama`), for loaders.
    pub architecture: String,
    pub files: Vec<FileEntry>,
    /// Position in the training task stream after this update.
    pub data_cursor: u64,
    /// Serialized RNG state of the learner and sampler.
    pub rng_state: String,
    pub metrics: BTreeMap<String, f64>,
    pub created_at_ms: i64,
    /// Whether this step's update trained any policy token. A step with nothing to train
    /// writes a manifest without files that says so.
    pub trained: bool,
    /// The step whose folder holds this checkpoint's weights and optimizer state: `step`
    /// itself when it trained, the last step that trained when it did not, and none while
    /// nothing has been trained yet (the weights are the base model's).
    pub weights_step: Option<u32>,
}

impl Document for CheckpointManifest {
    const NAME: &'static str = "checkpoint manifest";
    /// 2: `trained` and `weights_step` (steps that train nothing write no weights).
    const VERSION: u32 = 2;
}
