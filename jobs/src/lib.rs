//! The harness-s domain: what a job does, independent of how it is delivered.
//!
//! This crate owns the harness runtime, the environments (DBBench), the policies, the
//! router and profiles, directional evolution and the GRPO learner, with one module per
//! job kind exposing a `run(ctx, input) -> output` entry point. Algorithms are pure
//! functions (rescue decision, advantages, loss, voting, parent selection, metrics) that
//! cite the paper's equation they implement; IO goes through the `infra` traits.
//!
//! The first job kind here is the diagnostic [`sleep`] job used by queue tests and
//! `harness-s bench queue`.

pub mod edit;
pub mod env;
pub mod evolve;
pub mod harness;
pub mod policy;
pub mod profile;
pub mod reanchor;
pub mod rescue;
pub mod rollout;
pub mod router;
pub mod sleep;
#[cfg(test)]
pub(crate) mod testing;
