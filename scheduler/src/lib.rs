//! The `harness-s` command line and the run scheduler.
//!
//! The binary is thin: [`cli`] parses arguments into checked settings and calls the
//! library crates (`infra`, `jobs`, `worker`). Each subcommand lives in its own file under
//! `cli/`. `anyhow` is used only here; libraries return their own error enums.

pub mod bench;
pub mod cli;
pub mod compare;
pub mod cost;
pub mod report;
pub mod run;
pub mod tensorboard;

/// Process exit codes, so that CI and cron can tell outcomes apart.
pub mod exit {
    /// Completed successfully.
    pub const OK: u8 = 0;
    /// Failed (bad input, an unrecoverable error, or a refused request).
    pub const FAILED: u8 = 1;
    /// Command-line usage error (clap's convention).
    pub const USAGE: u8 = 2;
    /// Finished, but some failure budget was used.
    pub const DEGRADED: u8 = 3;
}
