//! What one statement gives, as both engines render it: AgentBench's `str(list_of_tuples)`
//! of the rows ([`RowRenderer`], cut at [`ExecSettings::result_chars`] characters with
//! `[TRUNCATED]`), or the engine's error ([`Exec::Failed`]); and a table's hash for write
//! grading ([`TableHash`]). A leaf: the engines ([`super::sqlite`], [`super::mysql`]) and
//! [`super::db`] above them import it, it imports neither.

use std::time::Duration;

use super::pyvalue::PyValue;

/// The text AgentBench shows when a statement runs too long.
pub const TIMEOUT_TEXT: &str = "Error: SQL execution timed out.";

/// Limits of one statement.
#[derive(Debug, Clone, Copy)]
pub struct ExecSettings {
    /// Results longer than this many characters are cut (AgentBench: 800).
    pub result_chars: usize,
    /// A statement running longer is stopped (AgentBench: 60 s).
    pub timeout: Duration,
}

/// The outcome of one statement as the agent sees it.
#[derive(Debug, Clone, PartialEq)]
pub enum Exec {
    /// The statement ran; `text` is the rendered result (`[]` for statements without rows).
    Rows { text: String, truncated: bool },
    /// The statement failed (syntax, unknown table, timeout ...); `text` says why.
    Failed { text: String },
}

/// The hash of one table after the episode: `Ok(None)` for an empty table (SQL NULL),
/// `Err(text)` when the hash query itself failed (e.g. the agent dropped the table).
pub type TableHash = Result<Option<String>, String>;

/// Builds AgentBench's `str(rows)` incrementally, stopping once it is longer than the
/// limit so that a huge result is never fully materialised.
pub struct RowRenderer {
    out: String,
    chars: usize,
    limit: usize,
    rows: usize,
    stopped: bool,
}

impl RowRenderer {
    pub fn new(limit: usize) -> Self {
        RowRenderer { out: String::from("["), chars: 1, limit, rows: 0, stopped: false }
    }

    /// Adds one row; `false` once enough has been rendered (stop fetching).
    pub fn push(&mut self, row: Vec<PyValue>) -> bool {
        if self.stopped {
            return false;
        }
        let mut piece = String::new();
        if self.rows > 0 {
            piece.push_str(", ");
        }
        PyValue::Tuple(row).write_repr(&mut piece);
        self.chars += piece.chars().count();
        self.out.push_str(&piece);
        self.rows += 1;
        if self.chars > self.limit {
            self.stopped = true;
        }
        !self.stopped
    }

    /// The text the agent sees, and whether it was cut.
    pub fn finish(mut self) -> Exec {
        if !self.stopped {
            self.out.push(']');
            self.chars += 1;
        }
        if self.chars > self.limit {
            let mut text: String = self.out.chars().take(self.limit).collect();
            text.push_str("[TRUNCATED]");
            Exec::Rows { text, truncated: true }
        } else {
            Exec::Rows { text: self.out, truncated: false }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(s: &str) -> Vec<PyValue> {
        vec![PyValue::Str(s.into())]
    }

    #[test]
    fn short_results_are_whole() {
        let mut r = RowRenderer::new(800);
        assert!(r.push(row("a")));
        assert!(r.push(vec![PyValue::Int("3".into()), PyValue::None]));
        assert_eq!(r.finish(), Exec::Rows { text: "[('a',), (3, None)]".into(), truncated: false });
        assert_eq!(RowRenderer::new(800).finish(), Exec::Rows { text: "[]".into(), truncated: false });
    }

    #[test]
    fn long_results_are_cut_at_the_limit_in_characters() {
        let mut r = RowRenderer::new(20);
        let mut pushed = 0;
        while r.push(row("ééééé")) {
            pushed += 1;
        }
        assert!(pushed < 5, "rendering stops early");
        let Exec::Rows { text, truncated } = r.finish() else { panic!() };
        assert!(truncated);
        assert_eq!(text, "[('ééééé',), ('ééééé[TRUNCATED]");
        // Exactly at the limit: whole; one character over: cut.
        let mut r = RowRenderer::new(11);
        r.push(row("abcd"));
        assert_eq!(r.finish(), Exec::Rows { text: "[('abcd',)]".into(), truncated: false });
        let mut r = RowRenderer::new(10);
        r.push(row("abcd"));
        assert_eq!(r.finish(), Exec::Rows { text: "[('abcd',)[TRUNCATED]".into(), truncated: true });
    }
}
