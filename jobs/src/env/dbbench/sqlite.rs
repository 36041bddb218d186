//! The embedded engine: one in-memory SQLite database per episode.
//!
//! DBBench is written for MySQL, so the connection gets the MySQL functions its grading
//! and gold SQL use — `md5`, `concat_ws`, `concat` (NULL if any argument is NULL) — and a
//! few that agents commonly write: `left`, `right`, `locate`, `lcase`, `ucase`,
//! `char_length`, `substring_index` (`substring` is built into SQLite). A statement that
//! runs past its deadline is interrupted through SQLite's progress handler.
//!
//! Statements run on the calling thread: DBBench tables are tens of rows, and the
//! deadline bounds the worst case.
//!
//! **The policy's SQL stays inside the episode's database.** Once the tables are filled,
//! the connection is sandboxed: an authorizer refuses ATTACH/DETACH (which would create
//! or open files anywhere the worker can write), every PRAGMA but the read-only schema
//! ones, and `load_extension`/`readfile`/`writefile`; `SQLITE_LIMIT_ATTACHED = 0` also
//! stops `VACUUM INTO 'file'`; defensive mode guards the schema; limits bound string
//! length, statement length, columns, program size and expression depth. A refused
//! statement is an SQL error, i.e. an observation for the agent.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use md5::{Digest, Md5};
use rusqlite::config::DbConfig;
use rusqlite::functions::{Context, FunctionFlags};
use rusqlite::hooks::{AuthAction, AuthContext, Authorization};
use rusqlite::limits::Limit;
use rusqlite::types::ValueRef;
use rusqlite::{Connection, ErrorCode};

use super::exec::{Exec, ExecSettings, RowRenderer, TableHash, TIMEOUT_TEXT};
use super::grade::{aggregate_rowhashes, quote_ident, rowhash_query};
use super::pyvalue::{float_repr, PyValue};
use super::task::TableSpec;
use crate::env::EnvError;

/// Python's sqlite3 message for several statements in one call.
const ONE_STATEMENT: &str = "You can only execute one statement at a time.";

pub struct SqliteDb {
    conn: Connection,
    deadline: Arc<Mutex<Option<Instant>>>,
}

fn backend(detail: impl std::fmt::Display) -> EnvError {
    EnvError::Backend { backend: "sqlite".into(), detail: detail.to_string() }
}

impl SqliteDb {
    /// An in-memory database with the tables created (all columns TEXT) and filled.
    pub fn create(tables: &[TableSpec]) -> Result<SqliteDb, EnvError> {
        let mut conn = Connection::open_in_memory().map_err(backend)?;
        register_functions(&conn).map_err(backend)?;
        let deadline: Arc<Mutex<Option<Instant>>> = Arc::new(Mutex::new(None));
        let d = Arc::clone(&deadline);
        conn.progress_handler(1000, Some(move || d.lock().map(|g| g.is_some_and(|t| Instant::now() > t)).unwrap_or(false)))
            .map_err(backend)?;
        {
            let tx = conn.transaction().map_err(backend)?;
            for t in tables {
                let cols: Vec<String> = t.columns.iter().map(|c| quote_ident(c)).collect();
                let defs: Vec<String> = cols.iter().map(|c| format!("{c} TEXT")).collect();
                tx.execute(&format!("CREATE TABLE IF NOT EXISTS {} ({})", quote_ident(&t.name), defs.join(",")), [])
                    .map_err(|e| EnvError::InvalidTask { task_id: t.name.clone(), reason: format!("cannot create table: {e}") })?;
                let marks = vec!["?"; cols.len()].join(",");
                let mut insert =
                    tx.prepare(&format!("INSERT INTO {} ({}) VALUES ({marks})", quote_ident(&t.name), cols.join(","))).map_err(backend)?;
                for row in &t.rows {
                    insert.execute(rusqlite::params_from_iter(row.iter())).map_err(backend)?;
                }
            }
            tx.commit().map_err(backend)?;
        }
        sandbox(&mut conn).map_err(backend)?;
        Ok(SqliteDb { conn, deadline })
    }

    /// Runs one statement, rendering rows as AgentBench does.
    pub fn execute(&mut self, sql: &str, settings: ExecSettings) -> Exec {
        self.set_deadline(Some(Instant::now() + settings.timeout));
        let out = self.run(sql, settings.result_chars);
        self.set_deadline(None);
        out
    }

    fn set_deadline(&self, at: Option<Instant>) {
        if let Ok(mut g) = self.deadline.lock() {
            *g = at;
        }
    }

    fn run(&self, sql: &str, limit: usize) -> Exec {
        let mut stmt = match self.conn.prepare(sql) {
            Ok(s) => s,
            // Python's cursor.execute("") does nothing and fetches [].
            Err(rusqlite::Error::Empty) => return RowRenderer::new(limit).finish(),
            Err(e) => return failed(&e),
        };
        let ncols = stmt.column_count();
        let mut rows = match stmt.query([]) {
            Ok(r) => r,
            Err(e) => return failed(&e),
        };
        let mut renderer = RowRenderer::new(limit);
        loop {
            match rows.next() {
                Ok(Some(row)) => {
                    let values = (0..ncols).map(|i| row.get_ref(i).map(to_py).unwrap_or(PyValue::None)).collect();
                    if !renderer.push(values) {
                        break;
                    }
                }
                Ok(None) => break,
                Err(e) => return failed(&e),
            }
        }
        renderer.finish()
    }

    /// All rows of a query as Python values (for computing generated tasks' labels).
    pub fn query_values(&self, sql: &str) -> Result<Vec<Vec<PyValue>>, String> {
        let mut stmt = self.conn.prepare(sql).map_err(|e| sqlite_message(&e))?;
        let ncols = stmt.column_count();
        let rows = stmt
            .query_map([], |r| (0..ncols).map(|i| r.get_ref(i).map(to_py)).collect::<Result<Vec<_>, _>>())
            .and_then(|rows| rows.collect::<Result<Vec<_>, _>>())
            .map_err(|e| sqlite_message(&e))?;
        Ok(rows)
    }

    /// The AgentBench table hash: row hashes in SQL (the engine's own text conversion),
    /// aggregated like MySQL's `group_concat` (see [`aggregate_rowhashes`]).
    pub fn table_hash(&self, table: &TableSpec) -> TableHash {
        let query = rowhash_query(&table.name, &table.columns);
        let mut stmt = self.conn.prepare(&query).map_err(|e| sqlite_message(&e))?;
        let hashes = stmt
            .query_map([], |r| r.get::<_, Option<String>>(0))
            .and_then(|rows| rows.collect::<Result<Vec<_>, _>>())
            .map_err(|e| sqlite_message(&e))?;
        Ok(aggregate_rowhashes(hashes.into_iter().flatten().collect()))
    }
}

/// Schema-reading pragmas, the only ones a sandboxed connection runs.
const READ_ONLY_PRAGMAS: &[&str] =
    &["table_info", "table_xinfo", "table_list", "index_list", "index_info", "index_xinfo", "foreign_key_list", "collation_list"];

/// Functions that reach the file system or load code.
const DENIED_FUNCTIONS: &[&str] = &["load_extension", "readfile", "writefile", "edit", "fts3_tokenizer"];

fn authorize(ctx: AuthContext<'_>) -> Authorization {
    match ctx.action {
        AuthAction::Attach { .. } | AuthAction::Detach { .. } => Authorization::Deny,
        AuthAction::Pragma { pragma_name, .. } if !READ_ONLY_PRAGMAS.contains(&pragma_name.to_ascii_lowercase().as_str()) => {
            Authorization::Deny
        }
        AuthAction::Function { function_name } if DENIED_FUNCTIONS.contains(&function_name.to_ascii_lowercase().as_str()) => {
            Authorization::Deny
        }
        _ => Authorization::Allow,
    }
}

/// Confines a filled episode database (see the module docs).
fn sandbox(conn: &mut Connection) -> rusqlite::Result<()> {
    conn.set_db_config(DbConfig::SQLITE_DBCONFIG_DEFENSIVE, true)?;
    conn.set_db_config(DbConfig::SQLITE_DBCONFIG_TRUSTED_SCHEMA, false)?;
    for (limit, value) in [
        (Limit::SQLITE_LIMIT_ATTACHED, 0),
        (Limit::SQLITE_LIMIT_LENGTH, 1_000_000),
        (Limit::SQLITE_LIMIT_SQL_LENGTH, 100_000),
        (Limit::SQLITE_LIMIT_COLUMN, 256),
        (Limit::SQLITE_LIMIT_VDBE_OP, 250_000),
        (Limit::SQLITE_LIMIT_EXPR_DEPTH, 200),
        (Limit::SQLITE_LIMIT_COMPOUND_SELECT, 100),
        (Limit::SQLITE_LIMIT_TRIGGER_DEPTH, 10),
    ] {
        conn.set_limit(limit, value)?;
    }
    conn.authorizer(Some(authorize))
}

fn failed(e: &rusqlite::Error) -> Exec {
    if e.sqlite_error_code() == Some(ErrorCode::OperationInterrupted) {
        return Exec::Failed { text: TIMEOUT_TEXT.into() };
    }
    Exec::Failed { text: format!("SQLite execution error: {}", sqlite_message(e)) }
}

/// The message Python's sqlite3 module would give.
fn sqlite_message(e: &rusqlite::Error) -> String {
    match e {
        rusqlite::Error::MultipleStatement => ONE_STATEMENT.into(),
        rusqlite::Error::SqliteFailure(_, Some(msg)) if !msg.is_empty() => msg.clone(),
        // Python shows SQLite's message without the statement and offset.
        rusqlite::Error::SqlInputError { msg, .. } => msg.clone(),
        other => other.to_string(),
    }
}

/// The Python value Python's sqlite3 module returns for a column value.
fn to_py(v: ValueRef<'_>) -> PyValue {
    match v {
        ValueRef::Null => PyValue::None,
        ValueRef::Integer(i) => PyValue::Int(i.to_string()),
        ValueRef::Real(f) => PyValue::Float(f),
        ValueRef::Text(t) => PyValue::Str(String::from_utf8_lossy(t).into_owned()),
        ValueRef::Blob(b) => PyValue::Bytes(b.to_vec()),
    }
}

/// A function argument as MySQL would see it as a string; `None` for NULL.
fn arg_text(ctx: &Context<'_>, i: usize) -> Option<Vec<u8>> {
    match ctx.get_raw(i) {
        ValueRef::Null => None,
        ValueRef::Integer(v) => Some(v.to_string().into_bytes()),
        // SQLite prints integral reals with `.0`, like Python's repr.
        ValueRef::Real(f) => Some(float_repr(f).into_bytes()),
        ValueRef::Text(t) | ValueRef::Blob(t) => Some(t.to_vec()),
    }
}

fn text(bytes: Vec<u8>) -> String {
    String::from_utf8(bytes).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned())
}

fn arg_int(ctx: &Context<'_>, i: usize) -> Option<i64> {
    match ctx.get_raw(i) {
        ValueRef::Null => None,
        ValueRef::Integer(v) => Some(v),
        ValueRef::Real(f) => Some(f.round() as i64),
        ValueRef::Text(t) | ValueRef::Blob(t) => {
            let s = String::from_utf8_lossy(t);
            let s = s.trim();
            // MySQL reads the leading number of a string, 0 if none.
            let end =
                s.char_indices().find(|&(i, c)| !(c.is_ascii_digit() || (i == 0 && (c == '-' || c == '+')))).map_or(s.len(), |(i, _)| i);
            Some(s[..end].parse().unwrap_or(0))
        }
    }
}

fn register_functions(conn: &Connection) -> rusqlite::Result<()> {
    let flags = FunctionFlags::SQLITE_UTF8 | FunctionFlags::SQLITE_DETERMINISTIC;
    conn.create_scalar_function("md5", 1, flags, |ctx| Ok(arg_text(ctx, 0).map(|b| hex::encode(Md5::digest(&b)))))?;
    // MySQL: NULL separator → NULL; NULL arguments are skipped.
    conn.create_scalar_function("concat_ws", -1, flags, |ctx| {
        if ctx.len() < 2 {
            return Err(rusqlite::Error::UserFunctionError("concat_ws needs a separator and at least one value".into()));
        }
        let Some(sep) = arg_text(ctx, 0) else { return Ok(None) };
        let parts: Vec<Vec<u8>> = (1..ctx.len()).filter_map(|i| arg_text(ctx, i)).collect();
        Ok(Some(text(parts.join(&sep[..]))))
    })?;
    // MySQL: NULL if any argument is NULL.
    conn.create_scalar_function("concat", -1, flags, |ctx| {
        let mut out = Vec::new();
        for i in 0..ctx.len() {
            match arg_text(ctx, i) {
                Some(b) => out.extend(b),
                None => return Ok(None),
            }
        }
        Ok(Some(text(out)))
    })?;
    conn.create_scalar_function("left", 2, flags, |ctx| {
        let (Some(s), Some(n)) = (arg_text(ctx, 0), arg_int(ctx, 1)) else { return Ok(None) };
        Ok(Some(text(s).chars().take(n.max(0) as usize).collect::<String>()))
    })?;
    conn.create_scalar_function("right", 2, flags, |ctx| {
        let (Some(s), Some(n)) = (arg_text(ctx, 0), arg_int(ctx, 1)) else { return Ok(None) };
        let chars: Vec<char> = text(s).chars().collect();
        let n = (n.max(0) as usize).min(chars.len());
        Ok(Some(chars[chars.len() - n..].iter().collect::<String>()))
    })?;
    for (name, n_arg) in [("locate", 2), ("locate", 3)] {
        conn.create_scalar_function(name, n_arg, flags, |ctx| {
            let (Some(needle), Some(hay)) = (arg_text(ctx, 0), arg_text(ctx, 1)) else { return Ok(None) };
            let start = if ctx.len() == 3 { arg_int(ctx, 2).unwrap_or(1) } else { 1 };
            let (needle, hay) = (text(needle).to_lowercase(), text(hay).to_lowercase());
            let hay: Vec<char> = hay.chars().collect();
            let needle: Vec<char> = needle.chars().collect();
            if start < 1 {
                return Ok(Some(0i64));
            }
            let from = (start - 1) as usize;
            if needle.is_empty() {
                return Ok(Some(if from <= hay.len() { start } else { 0 }));
            }
            let pos = (from..hay.len().saturating_sub(needle.len() - 1)).find(|&i| hay[i..i + needle.len()] == needle[..]);
            Ok(Some(pos.map_or(0, |i| i as i64 + 1)))
        })?;
    }
    conn.create_scalar_function("lcase", 1, flags, |ctx| Ok(arg_text(ctx, 0).map(|s| text(s).to_lowercase())))?;
    conn.create_scalar_function("ucase", 1, flags, |ctx| Ok(arg_text(ctx, 0).map(|s| text(s).to_uppercase())))?;
    for name in ["char_length", "character_length"] {
        conn.create_scalar_function(name, 1, flags, |ctx| Ok(arg_text(ctx, 0).map(|s| text(s).chars().count() as i64)))?;
    }
    conn.create_scalar_function("substring_index", 3, flags, |ctx| {
        let (Some(s), Some(delim), Some(count)) = (arg_text(ctx, 0), arg_text(ctx, 1), arg_int(ctx, 2)) else {
            return Ok(None);
        };
        let (s, delim) = (text(s), text(delim));
        if delim.is_empty() || count == 0 {
            return Ok(Some(String::new()));
        }
        let parts: Vec<&str> = s.split(delim.as_str()).collect();
        let n = count.unsigned_abs() as usize;
        if n >= parts.len() {
            return Ok(Some(s));
        }
        Ok(Some(if count > 0 { parts[..n].join(&delim) } else { parts[parts.len() - n..].join(&delim) }))
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn settings() -> ExecSettings {
        ExecSettings { result_chars: 800, timeout: Duration::from_secs(5) }
    }

    fn db() -> SqliteDb {
        SqliteDb::create(&[TableSpec {
            name: "My Table".into(),
            columns: vec!["Name".into(), "Age".into()],
            rows: vec![vec!["Ann".into(), "31".into()], vec!["Bob's".into(), "9".into()]],
        }])
        .unwrap()
    }

    fn rows(e: Exec) -> String {
        match e {
            Exec::Rows { text, .. } => text,
            Exec::Failed { text } => panic!("failed: {text}"),
        }
    }

    #[test]
    fn results_render_as_python_tuples() {
        let mut d = db();
        assert_eq!(rows(d.execute("SELECT * FROM `My Table`", settings())), "[('Ann', '31'), (\"Bob's\", '9')]");
        assert_eq!(rows(d.execute("SELECT count(*), sum(Age), avg(Age), NULL FROM `My Table`", settings())), "[(2, 40, 20.0, None)]");
        assert_eq!(rows(d.execute("UPDATE `My Table` SET Age = '32' WHERE Name = 'Ann';", settings())), "[]");
        assert_eq!(rows(d.execute("", settings())), "[]");
    }

    #[test]
    fn errors_are_messages_not_panics() {
        let mut d = db();
        assert_eq!(d.execute("SELEC 1", settings()), Exec::Failed { text: "SQLite execution error: near \"SELEC\": syntax error".into() });
        assert_eq!(d.execute("SELECT 1; SELECT 2", settings()), Exec::Failed { text: format!("SQLite execution error: {ONE_STATEMENT}") });
        let Exec::Failed { text } = d.execute("SELECT * FROM nope", settings()) else { panic!() };
        assert!(text.contains("no such table: nope"), "{text}");
    }

    /// Each way out of the episode's database is refused as an SQL error, and nothing is
    /// created on disk; schema pragmas and ordinary statements still work.
    #[test]
    fn the_policy_cannot_leave_the_episode_database() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("x.db");
        let t = target.display();
        let mut d = db();
        for sql in [
            format!("ATTACH DATABASE '{t}' AS p"),
            format!("VACUUM INTO '{t}'"),
            "DETACH DATABASE main".to_string(),
            format!("PRAGMA temp_store_directory = '{}'", dir.path().display()),
            "PRAGMA writable_schema = ON".to_string(),
            "PRAGMA journal_mode = WAL".to_string(),
            "SELECT load_extension('/tmp/evil')".to_string(),
            "SELECT writefile('/tmp/evil', 'x')".to_string(),
            "SELECT length(randomblob(50000000))".to_string(),
        ] {
            match d.execute(&sql, settings()) {
                Exec::Failed { text } => assert!(text.starts_with("SQLite execution error") || text.contains("error"), "{sql}: {text}"),
                other => panic!("{sql} was not refused: {other:?}"),
            }
        }
        assert!(!target.exists(), "a file was created");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        assert!(rows(d.execute("PRAGMA table_info(\"My Table\")", settings())).contains("'Name'"));
        assert_eq!(rows(d.execute("SELECT COUNT(*) FROM \"My Table\"", settings())), "[(2,)]");
        assert!(matches!(d.execute("INSERT INTO \"My Table\" VALUES ('Cy', '4')", settings()), Exec::Rows { .. }));
        assert_eq!(rows(d.execute("SELECT COUNT(*) FROM \"My Table\"", settings())), "[(3,)]");
    }

    #[test]
    fn a_runaway_query_is_interrupted() {
        let mut d = db();
        let out = d.execute(
            "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c",
            ExecSettings { result_chars: 800, timeout: Duration::from_millis(200) },
        );
        assert_eq!(out, Exec::Failed { text: TIMEOUT_TEXT.into() });
        // The connection is usable afterwards.
        assert_eq!(rows(d.execute("SELECT count(*) FROM `My Table`", settings())), "[(2,)]");
    }

    #[test]
    fn mysql_functions_behave_like_mysql() {
        let mut d = db();
        let q = "SELECT md5('abc'), concat_ws(',', 'a', NULL, 'b'), concat('a', NULL), concat('a', 1), substring('hello', 1, 3), \
                 left('hello', 2), right('hello', 2), locate('L', 'hello'), locate('l', 'hello', 4), ucase('a'), char_length('é'), \
                 substring_index('a.b.c', '.', 2), substring_index('a.b.c', '.', -1)";
        assert_eq!(
            rows(d.execute(q, settings())),
            "[('900150983cd24fb0d6963f7d28e17f72', 'a,b', None, 'a1', 'hel', 'he', 'lo', 3, 4, 'A', 1, 'a.b', 'c')]"
        );
    }

    #[test]
    fn table_hash_matches_the_mysql_formula() {
        let d = db();
        let h = d.table_hash(&TableSpec { name: "My Table".into(), columns: vec!["Name".into(), "Age".into()], rows: vec![] });
        let row = |s: &str| hex::encode(Md5::digest(s.as_bytes()))[..5].to_string();
        let mut parts = [row("Ann,31"), row("Bob's,9")];
        parts.sort();
        assert_eq!(h, Ok(Some(hex::encode(Md5::digest(parts.join(",").as_bytes())))));
        // AgentBench's own hash query runs unchanged on SQLite with the registered
        // functions and gives the same value.
        let mut d2 = db();
        let agentbench = d2.execute(&super::super::grade::hash_query("My Table", &["Name".into(), "Age".into()]), settings());
        assert_eq!(agentbench, Exec::Rows { text: format!("[('{}',)]", h.clone().unwrap().unwrap()), truncated: false });
        let missing = d.table_hash(&TableSpec { name: "gone".into(), columns: vec!["a".into()], rows: vec![] });
        assert!(missing.unwrap_err().contains("no such table"));
    }
}
