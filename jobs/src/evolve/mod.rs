//! Directional harness evolution and the Sibling Harness Pool (Harness-S §3.2, Eq. 2–4,
//! Appendices E–F).
//!
//! - [`diagnose`]: failed trajectories → root causes per task (rule-based or LLM).
//! - [`direction`]: causes → repair directions (2–3 related causes, ≥ 2 tasks each).
//! - [`editor`]: Edit(H, d): the built-in template editor and the LLM editor.
//! - [`reading`]: the patterns that read a reply or result (shared by diagnoser and editor).
//! - [`select`]: parent selection maximising |∪ V(H)| with at most B parents (Eq. 3).
//! - [`pool`]: the pool as a versioned artifact with lineage under `runs/<run>/pool/`.
//! - [`packet`]: trace packets for a learned editor (Harness-R1 §3.1).
//! - [`learned`]: a trained harness editor as evolution's editor (`editor = "learned"`).
//! - [`job`]: the evolve stage, built from rollout jobs.
//! - [`report`]: Figure 1a (repaired vs regressed per sibling) and Figure 5 (directed
//!   repair overlap), numbers and PNG plots.
//!
//! ```
//! use jobs::evolve::select::{select_parents, Candidate};
//! let c = |id: &str, t: &[&str]| Candidate { id: id.into(), solved: t.iter().map(|s| s.to_string()).collect() };
//! let pick = select_parents(&[c("a", &["1", "2", "3"]), c("b", &["1", "4"]), c("c", &["2", "3"])], 2).unwrap();
//! assert_eq!(pick.parents, vec!["a", "b"]);
//! assert_eq!(pick.covered.len(), 4);
//! ```

pub mod diagnose;
pub mod direction;
pub mod editor;
pub mod job;
pub mod learned;
pub mod packet;
pub mod pool;
pub mod reading;
pub mod report;
pub mod select;

pub use diagnose::{Diagnoser, Finding, LlmDiagnoser, RuleDiagnoser, TaskDiagnosis};
pub use direction::{form_directions, Direction, DirectionSettings};
pub use editor::{EditError, EditRequest, Editor, LlmEditor, TemplateEditor};
pub use job::{run, EvolveContext, EvolveError, EvolveInput, EvolveOutput, EvolveSettings, RoundSummary};
pub use learned::LearnedEditor;
pub use pool::{PoolEntry, PoolError, PoolManifest};
pub use select::{select_parents, Candidate, Selection};
