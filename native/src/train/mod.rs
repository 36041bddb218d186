//! The training room: the GRPO [`learner`] of the paper's Appendix B (AdamW, the loss, the
//! data that turns stored groups into batches), the learn job ([`learn`]), the transfer
//! probe ([`transfer`]), [`checkpoint`]s and their [`retention`], and the learner's
//! [`memory`] plan.
//!
//! Stands on [`crate::model`]; never imports [`crate::infer`] (`tests/rooms.rs`).

pub mod checkpoint;
pub mod learn;
pub mod learner;
pub mod memory;
pub mod retention;
pub mod transfer;
