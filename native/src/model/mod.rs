//! The model room: everything that defines a model, and nothing that runs or trains it.
//!
//! One file per architecture over the shared [`layers`] and [`config`]: [`llama`] (llama,
//! qwen2, qwen3) and [`qwen3_5`] (the hybrid of Gated DeltaNet, [`deltanet`], and gated
//! attention; the model alone so far: loader, learner and engine do not take it yet); the tokenizer and the chat template ([`tokenizer`], [`chat`]); the file
//! formats ([`gguf`] with dequantisation, [`hf`] for safetensors + `config.json`), the
//! [`loader`] that picks one, and GGUF [`export`].
//!
//! The rule of the crate (checked by `tests/rooms.rs`): this room imports only itself and
//! the crate root (`NativeError`, `device`); [`crate::infer`] and [`crate::train`] stand on
//! it and never on each other.

pub mod chat;
pub mod config;
pub mod deltanet;
pub mod export;
pub mod gguf;
pub mod hf;
pub mod layers;
pub mod llama;
pub mod loader;
pub mod qwen3_5;
pub mod tokenizer;

pub use config::LlamaConfig;
pub use hf::Dtype;
pub use llama::{KvCache, Llama};
pub use tokenizer::Tokenizer;
