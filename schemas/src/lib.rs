//! Plain serde records of harness-s, their Arrow schemas, schema versions and the
//! object-store key layout.
//!
//! Everything a run produces is one of these records: rollouts ([`Trajectory`], with its
//! [`Turn`]s nested), rescue-filtered [`Group`]s, behavior [`ProfileEntry`]s,
//! [`RoutingDecision`]s, long-format [`MetricRow`]s (all stored as Parquet), and the JSON
//! documents [`CheckpointManifest`], [`JobEnvelope`], [`DoneMarker`] and [`HarnessSpec`].
//!
//! Every Parquet file carries its record name and schema version in the file's key-value
//! metadata (`harness_s.record`, `harness_s.schema_version`); every JSON document carries a
//! `schema_version` field. Readers refuse a version they do not know with an error naming
//! the file and both versions ([`SchemaError::UnsupportedVersion`]).
//!
//! ```
//! use schemas::{Record, Trajectory, keys};
//! let fields = Trajectory::fields();
//! assert!(fields.iter().any(|f| f.name() == "reward"));
//! assert_eq!(
//!     keys::trajectory_part("r1", 3, schemas::RolloutKind::Rescue, "abc"),
//!     "runs/r1/trajectories/step=3/kind=rescue/part-abc.parquet"
//! );
//! ```
//!
//! This crate depends on nothing else of ours; tracking data (job ids, attempts) lives in
//! [`JobEnvelope`] and stays apart from payloads.

mod checkpoint;
mod edit;
mod error;
mod group;
mod harness;
mod job;
pub mod keys;
mod metrics;
mod profile;
mod record;
mod routing;
mod trajectory;

pub use checkpoint::{CheckpointManifest, FileEntry};
pub use edit::{PatchRecord, TracePacket};
pub use error::SchemaError;
pub use group::{Group, RetainedKind};
pub use harness::*;
pub use job::{job_id, DoneMarker, JobEnvelope, JobIdParts, JobKind, OutputEntry};
pub use metrics::{LlmUsage, MetricRow};
pub use profile::{Polarity, ProfileEntry};
pub use record::{decode_document, encode_document, Document, Record, RECORD_KEY, VERSION_KEY};
pub use routing::{Ballot, RoutePurpose, RoutingDecision};
pub use trajectory::{prompt_hash, ErrorClass, Role, RolloutKind, Split, Termination, Trajectory, Turn, TurnSource};

/// Milliseconds since the Unix epoch, the time unit of every `*_ms` timestamp column.
pub fn now_unix_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}
