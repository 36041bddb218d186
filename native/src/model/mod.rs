//! The model room: everything that defines a model, and nothing that runs or trains it.
//!
//! One file per architecture over the shared [`layers`] and [`config`]: [`llama`] (llama,
//! qwen2, qwen3) and [`qwen3_5`] (the hybrid of Gated DeltaNet, [`deltanet`], and gated
//! attention); [`family`]'s [`Model`] holds either, chosen by `config.json`. Then the
//! tokenizer and the chat template ([`tokenizer`], [`chat`]); the file formats ([`gguf`]
//! with dequantisation, [`hf`] for safetensors + `config.json`), the [`loader`] that picks
//! one, and GGUF [`export`].
//!
//! The rule of the crate (checked by `tests/rooms.rs`): this room imports only itself and
//! the crate root (`NativeError`, `device`); [`crate::infer`] and [`crate::train`] stand on
//! it and never on each other.

pub mod chat;
pub mod config;
pub mod deltanet;
pub mod export;
pub mod family;
pub mod gguf;
pub mod hf;
pub mod layers;
pub mod llama;
pub mod loader;
pub mod qwen3_5;
pub mod tokenizer;

pub use config::LlamaConfig;
pub use family::Model;
pub use hf::Dtype;
pub use llama::{KvCache, Llama};
pub use tokenizer::Tokenizer;

use tch::{Device, Kind, Tensor};

/// What the learner needs of a model: teacher-forced logits at chosen positions, alone or
/// after a prefix the rows share, its parameters, and the kind its products run in.
pub trait CausalLm {
    fn device(&self) -> Device;
    /// The kind of the matrix products of the learner's passes (`Float`, or `BFloat16` for
    /// mixed precision; parameters stay float32).
    fn set_compute(&mut self, kind: Kind);
    /// Parameters by transformers' name (shared storage, float32).
    fn named_tensors(&self) -> Vec<(String, Tensor)>;
    /// Logits `[N, vocab]` at `flat` positions `[N]` (row · T + column) of `tokens` `[B, T]`.
    fn logits_at(&self, tokens: &Tensor, flat: &Tensor) -> Tensor;
    /// [`CausalLm::logits_at`] of rows `[B, T]` that all follow `prefix` `[P]`, computed once;
    /// `flat` indexes the rows. Equal to the unshared pass within float rounding.
    fn logits_at_shared(&self, prefix: &Tensor, rows: &Tensor, flat: &Tensor) -> Tensor;
}

impl CausalLm for Llama {
    fn device(&self) -> Device {
        Llama::device(self)
    }

    fn set_compute(&mut self, kind: Kind) {
        self.compute = kind;
    }

    fn named_tensors(&self) -> Vec<(String, Tensor)> {
        Llama::named_tensors(self)
    }

    fn logits_at(&self, tokens: &Tensor, flat: &Tensor) -> Tensor {
        Llama::logits_at(self, tokens, flat)
    }

    fn logits_at_shared(&self, prefix: &Tensor, rows: &Tensor, flat: &Tensor) -> Tensor {
        Llama::logits_at_shared(self, prefix, rows, flat)
    }
}
