//! One isolated database per episode, on either engine, with the AgentBench rendering
//! of query results.
//!
//! [`Database`] creates the task's tables (every column `TEXT`, as AgentBench does),
//! executes one statement at a time ([`Database::execute`]: the result printed as
//! Python's `str(list_of_tuples)`, cut at [`ExecSettings::result_chars`] characters with
//! `[TRUNCATED]`; an SQL error becomes [`Exec::Failed`] with the engine's message), hashes
//! tables for write grading, and is dropped at the end of the episode.

use std::time::Duration;

use super::mysql::MysqlDb;
use super::pyvalue::PyValue;
use super::sqlite::SqliteDb;
use super::task::TableSpec;
use crate::env::EnvError;

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

/// The engine an environment uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Engine {
    /// In-memory SQLite (the embedded default; no server).
    Sqlite,
    /// A MySQL or MariaDB server, e.g. `mysql://root@127.0.0.1:3306`.
    Mysql { url: String },
}

impl Engine {
    /// `sqlite` or `mysql`.
    pub fn kind(&self) -> &'static str {
        match self {
            Engine::Sqlite => "sqlite",
            Engine::Mysql { .. } => "mysql",
        }
    }
}

/// An episode's database.
pub enum Database {
    Sqlite(SqliteDb),
    Mysql(MysqlDb),
}

impl Database {
    /// Creates a fresh database holding `tables`. `name` names it on a server.
    pub async fn create(engine: &Engine, name: &str, tables: &[TableSpec]) -> Result<Database, EnvError> {
        match engine {
            Engine::Sqlite => Ok(Database::Sqlite(SqliteDb::create(tables)?)),
            Engine::Mysql { url } => Ok(Database::Mysql(MysqlDb::create(url, name, tables).await?)),
        }
    }

    /// Runs one statement. SQL errors are [`Exec::Failed`]; only a broken backend (lost
    /// connection) is an `Err`.
    pub async fn execute(&mut self, sql: &str, settings: ExecSettings) -> Result<Exec, EnvError> {
        match self {
            Database::Sqlite(db) => Ok(db.execute(sql, settings)),
            Database::Mysql(db) => db.execute(sql, settings).await,
        }
    }

    /// AgentBench's table hash of one table.
    pub async fn table_hash(&mut self, table: &TableSpec) -> Result<TableHash, EnvError> {
        match self {
            Database::Sqlite(db) => Ok(db.table_hash(table)),
            Database::Mysql(db) => db.table_hash(table).await,
        }
    }

    /// Drops the database (server) or frees it (SQLite).
    pub async fn close(self) -> Result<(), EnvError> {
        match self {
            Database::Sqlite(_) => Ok(()),
            Database::Mysql(db) => db.close().await,
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
