//! The harness runtime: everything between a policy and an environment that a harness
//! spec (`schemas::HarnessSpec`) controls.
//!
//! - [`validate`]: static checks of a spec, reporting every problem with its JSON path
//!   (`harness-s harness validate`).
//! - [`condition`]: the hook condition vocabulary (named predicates, state paths) and its
//!   pure evaluation. Specs are data; nothing in them is ever executed as code.
//! - [`runtime`]: one [`Session`] per episode: context building, hooks at the four
//!   lifecycle points, execution budgets, and turn provenance (harness text is never
//!   trained on).
//! - [`diff`]: edits between two specs (`harness-s harness diff`).
//! - [`replay`]: a recorded episode re-rendered under another harness (the contexts H0
//!   would have shown for a sibling's rescue trajectory).
//!
//! ```
//! use jobs::harness::{parse_spec, ValidateOptions};
//! let text = r#"{"id": "s8", "parent": "h0", "hooks": [{"event": "after_tool",
//!   "condition": "remaining_steps_lte", "action": "warn", "parameters": {"threshold": 3},
//!   "message": "Execution budget is low. Reserve one step for the final answer."}]}"#;
//! let spec = parse_spec("s8.json", text, &ValidateOptions::default()).unwrap();
//! assert_eq!(spec.hooks.len(), 1);
//! let bad = r#"{"id": "x", "hooks": [{"event": "on_lunch", "condition": "always", "action": "warn", "message": "m"}]}"#;
//! let err = parse_spec("x.json", bad, &ValidateOptions::default()).unwrap_err();
//! assert!(err.to_string().contains("hooks[0].event: unknown event `on_lunch`"));
//! ```

pub mod condition;
pub mod diff;
pub mod replay;
pub mod runtime;
pub mod validate;

pub use diff::{diff_specs, diff_values, Edit, EditKind};
pub use replay::{reads_observation_flags, render_under, EpisodeFacts, NotRenderable, Rendered, RenderedTurn};
pub use runtime::{approx_tokens, chat_messages, Budgets, Next, PolicyRequest, RuntimeError, Session, Usage, Verdict, BASE_SYSTEM_PROMPT};
pub use validate::{
    check_spec, harness_side_hooks, parse_spec, spec_from_value, validate_value, Problem, SpecError, ValidateOptions, MAX_TEXT_BYTES,
};
