//! The native tch backend of harness-s: the policy being trained, in-process.
//!
//! Three rooms, each with one job:
//! - [`model`]: what a model is: the llama-family decoder ([`model::Llama`]: RMSNorm, RoPE
//!   in both layouts, grouped-query attention, SwiGLU, tied or untied embeddings, optional
//!   q/k/v bias for qwen2, KV cache), its config, the tokenizer and chat template, the GGUF
//!   (F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q4_K/Q6_K) and safetensors readers, the loader, export.
//! - [`infer`]: how it is decoded: the continuous-batching engine with prefix reuse, its
//!   weight formats (f32, bf16, int4 on the CPU's own kernels), the sampler, and the
//!   `native` [`jobs::policy::Policy`] backend ([`infer::policy::NativePolicy`]).
//! - [`train`]: how it is trained: the GRPO learner of the paper's Appendix B, the learn and
//!   transfer jobs, checkpoints and their retention.
//!
//! `infer` and `train` stand on `model` and never on each other; `model` knows neither.
//! The crate root holds what all three share: [`NativeError`] and the [`device`] resolver.
//! `tests/rooms.rs` reads every `use crate::` path and fails on a forbidden one.
//!
//! Only crates that need libtorch depend on this one. Build with `LIBTORCH` pointing at a
//! libtorch 2.13.0 (`infra/deploy/libtorch.sh` assembles a CPU one); the `cuda` feature
//! links `torch_cuda` for GPU learners.
//!
//! ```no_run
//! use native::{infer::sampler::{generate, GenerateOptions}, model::loader};
//! let (model, tok) = loader::load(std::path::Path::new("model.gguf"), tch::Device::Cpu)?;
//! let prompt = tok.encode("The capital of France is")?;
//! let out = generate(&model, &prompt, &GenerateOptions::greedy(20), &tok.stop_ids())?;
//! println!("{}", tok.decode(&out.tokens)?);
//! # Ok::<(), native::NativeError>(())
//! ```

use std::path::{Path, PathBuf};

pub mod device;
pub mod infer;
pub mod model;
pub mod train;

/// Failures of the native backend. Each names the file, tensor or setting involved.
#[derive(Debug, thiserror::Error)]
pub enum NativeError {
    #[error("cannot read {path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error("{path}: {detail}")]
    Format { path: PathBuf, detail: String },
    #[error("{path}: metadata key `{key}` is missing")]
    MissingMetadata { path: PathBuf, key: String },
    #[error("{path}: tensor `{tensor}` is missing")]
    MissingTensor { path: PathBuf, tensor: String },
    #[error("{path}: tensor `{tensor}` has shape {got:?}, the model expects {expected:?}")]
    Shape { path: PathBuf, tensor: String, expected: Vec<i64>, got: Vec<i64> },
    #[error("{path}: tensor `{tensor}` uses quantization {kind}, which is not supported (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K); re-quantize the model to one of these")]
    UnsupportedQuant { path: PathBuf, tensor: String, kind: String },
    #[error("{path}: architecture `{arch}` is not supported (llama, qwen2 and qwen3 are)")]
    UnsupportedArchitecture { path: PathBuf, arch: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("checkpoint {location}: {detail}")]
    Checkpoint { location: String, detail: String },
    #[error("invalid setting `{field}`: {detail}")]
    Config { field: String, detail: String },
    #[error("fetching model `{model}`: {detail}")]
    Fetch { model: String, detail: String },
    #[error("learner input: {0}")]
    Input(String),
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    #[error(transparent)]
    Store(#[from] infra::store::StoreError),
    #[error(transparent)]
    Table(#[from] infra::table::TableError),
    #[error(transparent)]
    Schema(#[from] schemas::SchemaError),
}

impl NativeError {
    pub(crate) fn io(path: &Path, error: std::io::Error) -> Self {
        NativeError::Io { path: path.to_path_buf(), error }
    }
}

impl infra::Transient for NativeError {
    /// Whether a later attempt may succeed: only store trouble (network, throttling) is
    /// transient; bad models, settings, inputs and libtorch failures fail the same way again.
    fn is_transient(&self) -> bool {
        match self {
            NativeError::Store(e) => e.is_transient(),
            NativeError::Table(e) => e.is_transient(),
            _ => false,
        }
    }
}

#[cfg(test)]
mod error_tests {
    use super::*;
    use infra::Transient;

    #[test]
    fn only_transient_store_trouble_is_retryable() {
        let unreachable = infra::store::StoreError::Unreachable { endpoint: "http://127.0.0.1:1".into(), detail: "refused".into() };
        assert!(NativeError::Store(unreachable).is_transient());
        let gone = infra::store::StoreError::NotFound { url: "file:///x".into() };
        assert!(!NativeError::Store(gone).is_transient());
        assert!(!NativeError::Input("stale rows".into()).is_transient());
        assert!(!NativeError::Config { field: "device".into(), detail: "no".into() }.is_transient());
    }
}
