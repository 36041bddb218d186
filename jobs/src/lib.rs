//! The harness-s domain: what a job does, independent of how it is delivered.
//!
//! This crate owns the harness runtime, the environments (DBBench, HTTP), the policy trait
//! and its OpenAI-compatible backend, the router and profiles, directional evolution and
//! the learned editor's edit job, with one module per job kind exposing a
//! `run(ctx, input) -> output` entry point and the job protocol they share ([`protocol`]).
//! Algorithms are pure functions (rescue decision, advantages, voting, parent selection,
//! metrics) that cite the paper's equation they implement; IO goes through the `infra`
//! traits. The GRPO learner and the native policy live in `native`, which stands on this
//! crate.
//!
//! The diagnostic [`sleep`] job is used by queue tests and `harness-s bench queue`.

pub mod edit;
pub mod env;
pub mod evolve;
pub mod harness;
pub mod policy;
pub mod profile;
pub mod protocol;
pub mod reanchor;
pub mod rescue;
pub mod rollout;
pub mod router;
pub mod sleep;
#[cfg(test)]
pub(crate) mod testing;
