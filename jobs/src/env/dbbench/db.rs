//! One isolated database per episode, on either engine, with the AgentBench rendering
//! of query results.
//!
//! [`Database`] creates the task's tables (every column `TEXT`, as AgentBench does),
//! executes one statement at a time ([`Database::execute`]: the result printed as
//! Python's `str(list_of_tuples)`, cut at [`ExecSettings::result_chars`] characters with
//! `[TRUNCATED]`; an SQL error becomes [`Exec::Failed`] with the engine's message), hashes
//! tables for write grading, and is dropped at the end of the episode. What a statement
//! gives is in [`super::exec`], which both engines share.

use super::exec::{Exec, ExecSettings, TableHash};
use super::mysql::MysqlDb;
use super::sqlite::SqliteDb;
use super::task::TableSpec;
use crate::env::EnvError;

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
