//! The inference room: how a model is decoded. The continuous-batching rollout [`engine`]
//! with prefix reuse, its [`weights`] (the model's matrices in one [`packed`] format and the
//! batched forward pass) over each sequence's [`kv`] cache, the CPU's own [`kernels`] and forward
//! pass ([`cpu`]) on a [`threads`] pool, the [`sampler`] that records each token's
//! log-probability, the [`grammar`] of constrained patch decoding, and the `native`
//! [`jobs::policy::Policy`] backend ([`policy::NativePolicy`]).
//!
//! Stands on [`crate::model`]; never imports [`crate::train`] (`tests/rooms.rs`).

pub mod cpu;
pub mod engine;
pub mod grammar;
pub mod kernels;
pub mod kv;
pub mod packed;
pub mod policy;
pub mod sampler;
pub mod threads;
pub mod weights;
