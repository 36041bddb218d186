//! The server engine: a MySQL or MariaDB server reached by URL, one database per episode.
//!
//! Each episode creates a database with a unique name (`CHARACTER SET utf8mb4`), fills
//! the task's tables, runs the agent's statements on one connection, and drops the
//! database at the end. The session is set up like AgentBench's `mysql:8` server so that
//! MariaDB agrees with it: MySQL 8's default `sql_mode` and `group_concat_max_len = 1024`
//! (the table hash is a `group_concat`). Results are read with the text protocol and
//! typed from the column metadata the way Python's mysql-connector types them (`int`,
//! `float`, `Decimal`, `datetime`, `str`, `bytes`).
//!
//! **The policy's SQL stays inside the episode's database.** The URL's user (the admin)
//! only creates and drops; each episode gets its own server user, created with the
//! database and dropped with it, with a random password, rights on that database alone
//! (no FILE, no other database, no `mysql.*`, no GRANT) and at most four connections. The
//! agent's statements run as that user with a server-side statement time limit
//! (`max_statement_time` on MariaDB, `max_execution_time` on MySQL) besides the client's
//! deadline. A refused statement is the server's error text, an observation for the agent.
//! The admin needs `CREATE USER` and `GRANT OPTION` (root has them).

use std::time::Duration;

use futures::StreamExt;
use md5::Digest;
use mysql_async::consts::ColumnType;
use mysql_async::prelude::Queryable;
use mysql_async::{Column, Conn, Opts, OptsBuilder, Row, Value};

use super::exec::{Exec, ExecSettings, RowRenderer, TableHash, TIMEOUT_TEXT};
use super::grade::{hash_query, quote_ident};
use super::pyvalue::PyValue;
use super::task::TableSpec;
use crate::env::EnvError;

/// MySQL 8's default `sql_mode` (AgentBench runs `mysql:8`).
const MYSQL8_SQL_MODE: &str =
    "ONLY_FULL_GROUP_BY,STRICT_TRANS_TABLES,NO_ZERO_IN_DATE,NO_ZERO_DATE,ERROR_FOR_DIVISION_BY_ZERO,NO_ENGINE_SUBSTITUTION";

/// The message for several statements in one call (the agent may run one at a time).
const ONE_STATEMENT: &str = "You can only execute one statement at a time.";

/// Rows per INSERT when filling a table (well under the 65,535 placeholder limit).
const INSERT_CHUNK: usize = 200;

pub struct MysqlDb {
    /// The URL's user, without a database: creates and drops.
    admin: Opts,
    /// The episode's user on the episode's database: runs the agent's statements.
    opts: Opts,
    conn: Option<Conn>,
    database: String,
    /// `'name'@'host'` of the episode's user.
    account: String,
    /// The statement time limit set on `conn`, if any.
    limit: Option<Duration>,
    /// Set once the database is dropped; otherwise `Drop` drops it in the background.
    closed: bool,
}

/// Rights of an episode's user on its own database: everything a DBBench task needs.
const EPISODE_GRANTS: &str =
    "SELECT, INSERT, UPDATE, DELETE, CREATE, DROP, INDEX, ALTER, CREATE TEMPORARY TABLES, CREATE VIEW, SHOW VIEW, LOCK TABLES";

/// The episode user's name for database `name` (≤ 32 characters, MySQL's limit).
fn episode_user(name: &str) -> String {
    let digest = md5::Md5::digest(name.as_bytes());
    format!("hs_{}", digest.iter().take(10).map(|b| format!("{b:02x}")).collect::<String>())
}

fn password() -> String {
    use rand::Rng;
    rand::rng().sample_iter(rand::distr::Alphanumeric).take(32).map(char::from).collect()
}

/// MySQL string literal (for account names and passwords, which cannot be placeholders).
fn quote_str(s: &str) -> String {
    format!("'{}'", s.replace('\\', "\\\\").replace('\'', "''"))
}

/// The URL without its password, for messages ([`infra::redact_url`]).
pub fn redact(url: &str) -> String {
    infra::redact_url(url)
}

/// How long opening a connection may take: the TCP connect and the server's handshake.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Opens a connection within [`CONNECT_TIMEOUT`]. On a timeout the error says what was
/// awaited: a TCP connection (nothing there, or a firewall), or the MySQL handshake from a
/// server that took the connection and never spoke (another service's port).
async fn connect(opts: Opts) -> Result<Conn, String> {
    let (host, port) = (opts.ip_or_hostname().to_string(), opts.tcp_port());
    match tokio::time::timeout(CONNECT_TIMEOUT, Conn::new(opts)).await {
        Ok(Ok(conn)) => Ok(conn),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => {
            let secs = CONNECT_TIMEOUT.as_secs();
            match tokio::time::timeout(Duration::from_secs(3), tokio::net::TcpStream::connect((host.as_str(), port))).await {
                Ok(Ok(_)) => Err(format!(
                    "{host}:{port} accepted the TCP connection but sent no MySQL handshake within {secs} s: is this a MySQL/MariaDB port (usually 3306), not another service's?"
                )),
                Ok(Err(e)) => Err(format!("no MySQL connection within {secs} s (TCP connect to {host}:{port}: {e})")),
                Err(_) => Err(format!("no TCP connection to {host}:{port} within {secs} s (a firewall, or no host there?)")),
            }
        }
    }
}

/// Parses a `mysql://user[:password]@host[:port]` URL.
pub fn parse_url(url: &str) -> Result<Opts, String> {
    Opts::from_url(url).map_err(|e| {
        format!("invalid MySQL URL `{}`: {e} (expected mysql://USER[:PASSWORD]@HOST[:PORT], e.g. mysql://root@127.0.0.1:3306)", redact(url))
    })
}

/// Checks that the server at `url` accepts the URL's user (connect and `SELECT 1`, within
/// `timeout`).
pub async fn check_server(url: &str, timeout: Duration) -> Result<(), EnvError> {
    let opts = server_opts(url)?;
    let probe = async {
        let mut conn = connect(opts).await?;
        conn.query_drop("SELECT 1").await.map_err(|e| e.to_string())?;
        conn.disconnect().await.map_err(|e| e.to_string())
    };
    match tokio::time::timeout(timeout, probe).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(backend("cannot connect to the MySQL/MariaDB server", url, e)),
        Err(_) => Err(backend(
            "cannot connect to the MySQL/MariaDB server",
            url,
            format!("no answer within {} s (waiting for the connection, the handshake and `SELECT 1`)", timeout.as_secs()),
        )),
    }
}

/// The URL's options over its own transport (no switch to a local socket), so that the
/// server sees every connection of an episode, the admin's and the agent's, from one host.
fn server_opts(url: &str) -> Result<Opts, EnvError> {
    let opts = parse_url(url).map_err(|e| EnvError::Backend { backend: "mysql".into(), detail: e })?;
    Ok(OptsBuilder::from_opts(opts).prefer_socket(false).into())
}

fn backend(what: &str, url: &str, e: impl std::fmt::Display) -> EnvError {
    EnvError::Backend { backend: "mysql".into(), detail: format!("{what} at {}: {e}", redact(url)) }
}

impl MysqlDb {
    /// Creates database `name` on the server, fills the task's tables and creates the
    /// episode's user; the agent's connection is that user's.
    pub async fn create(url: &str, name: &str, tables: &[TableSpec]) -> Result<MysqlDb, EnvError> {
        let base = server_opts(url)?;
        let admin: Opts = OptsBuilder::from_opts(base.clone()).db_name(None::<String>).into();
        let mut conn = connect(admin.clone()).await.map_err(|e| {
            backend("cannot connect to the MySQL/MariaDB server (is it running? start it or pass another --db-url)", url, e)
        })?;
        conn.query_drop(format!("CREATE DATABASE {} CHARACTER SET utf8mb4", quote_ident(name)))
            .await
            .map_err(|e| backend(&format!("cannot create database `{name}`"), url, e))?;
        // The episode's user connects from where the admin does.
        let host: String = conn.query_first("SELECT SUBSTRING_INDEX(USER(), '@', -1)").await.ok().flatten().unwrap_or_else(|| "%".into());
        let (user, pass) = (episode_user(name), password());
        let account = format!("{}@{}", quote_str(&user), quote_str(&host));
        let opts: Opts = OptsBuilder::from_opts(base).db_name(Some(name.to_string())).user(Some(user)).pass(Some(pass.clone())).into();
        let mut db = MysqlDb { admin, opts, conn: None, database: name.to_string(), account: account.clone(), limit: None, closed: false };
        let ready = async {
            conn.query_drop(format!("USE {}", quote_ident(name))).await.map_err(|e| backend("cannot use the new database", url, e))?;
            setup_session(&mut conn).await;
            db.conn = Some(conn);
            db.fill(tables).await?;
            let mut admin_conn = db.conn.take().expect("set above");
            for sql in [
                format!("CREATE USER {account} IDENTIFIED BY {} WITH MAX_USER_CONNECTIONS 4", quote_str(&pass)),
                format!("GRANT {EPISODE_GRANTS} ON {}.* TO {account}", quote_ident(name)),
            ] {
                admin_conn.query_drop(&sql).await.map_err(|e| {
                    backend("cannot create the episode's database user (the URL's user needs CREATE USER and GRANT OPTION)", url, e)
                })?;
            }
            let _ = admin_conn.disconnect().await;
            let mut agent = connect(db.opts.clone()).await.map_err(|e| backend("cannot connect as the episode's user", url, e))?;
            setup_session(&mut agent).await;
            db.conn = Some(agent);
            Ok::<(), EnvError>(())
        };
        if let Err(e) = ready.await {
            let _ = db.drop_database().await;
            db.closed = true;
            return Err(e);
        }
        Ok(db)
    }

    /// The episode's database name.
    pub fn name(&self) -> &str {
        &self.database
    }

    fn url(&self) -> String {
        format!("mysql://{}:{}/{}", self.opts.ip_or_hostname(), self.opts.tcp_port(), self.database)
    }

    async fn fill(&mut self, tables: &[TableSpec]) -> Result<(), EnvError> {
        let url = self.url();
        let conn = self.conn()?;
        for t in tables {
            let cols: Vec<String> = t.columns.iter().map(|c| quote_ident(c)).collect();
            let defs: Vec<String> = cols.iter().map(|c| format!("{c} TEXT")).collect();
            conn.query_drop(format!("CREATE TABLE IF NOT EXISTS {} ({})", quote_ident(&t.name), defs.join(","))).await.map_err(
                |e| match e {
                    mysql_async::Error::Server(e) => {
                        EnvError::InvalidTask { task_id: t.name.clone(), reason: format!("cannot create table: {}", server_text(&e)) }
                    }
                    other => backend("cannot create a table", &url, other),
                },
            )?;
            let row_marks = format!("({})", vec!["?"; cols.len()].join(","));
            for chunk in t.rows.chunks(INSERT_CHUNK) {
                let sql = format!(
                    "INSERT INTO {} ({}) VALUES {}",
                    quote_ident(&t.name),
                    cols.join(","),
                    vec![row_marks.as_str(); chunk.len()].join(",")
                );
                let params: Vec<Value> = chunk.iter().flatten().map(|v| Value::from(v.as_str())).collect();
                conn.exec_drop(sql, params).await.map_err(|e| backend("cannot fill a table", &url, e))?;
            }
        }
        Ok(())
    }

    fn conn(&mut self) -> Result<&mut Conn, EnvError> {
        self.conn.as_mut().ok_or_else(|| EnvError::Backend { backend: "mysql".into(), detail: "the episode's connection is closed".into() })
    }

    /// Replaces a connection left mid-query (after a timeout): kill it, open a new one.
    async fn reconnect(&mut self, stale_id: Option<u32>) -> Result<(), EnvError> {
        self.conn = None;
        let mut conn = connect(self.opts.clone()).await.map_err(|e| backend("cannot reconnect", &self.url(), e))?;
        if let Some(id) = stale_id {
            let _ = conn.query_drop(format!("KILL {id}")).await;
        }
        setup_session(&mut conn).await;
        self.conn = Some(conn);
        self.limit = None;
        Ok(())
    }

    /// Runs one statement; server errors become [`Exec::Failed`] with mysql-connector's
    /// text (`1064 (42000): You have an error ...`).
    pub async fn execute(&mut self, sql: &str, settings: ExecSettings) -> Result<Exec, EnvError> {
        match count_statements(sql) {
            0 => return Ok(RowRenderer::new(settings.result_chars).finish()),
            1 => {}
            _ => return Ok(Exec::Failed { text: ONE_STATEMENT.into() }),
        }
        let url = self.url();
        if self.limit != Some(settings.timeout) {
            set_statement_limit(self.conn()?, settings.timeout).await;
            self.limit = Some(settings.timeout);
        }
        let conn = self.conn()?;
        let id = conn.id();
        let run = run_query(conn, sql, settings.result_chars);
        match tokio::time::timeout(settings.timeout, run).await {
            Ok(Ok(exec)) => Ok(exec),
            Ok(Err(mysql_async::Error::Server(e))) => Ok(Exec::Failed { text: server_text(&e) }),
            Ok(Err(e)) if e.is_fatal() => {
                // The connection is gone: reconnect so the episode can go on, but report
                // the infrastructure failure.
                let _ = self.reconnect(None).await;
                Err(backend("the connection failed", &url, e))
            }
            Ok(Err(e)) => Ok(Exec::Failed { text: e.to_string() }),
            Err(_) => {
                self.reconnect(Some(id)).await?;
                Ok(Exec::Failed { text: TIMEOUT_TEXT.into() })
            }
        }
    }

    /// AgentBench's hash query for one table, run as is.
    pub async fn table_hash(&mut self, table: &TableSpec) -> Result<TableHash, EnvError> {
        let url = self.url();
        let conn = self.conn()?;
        let result: Result<Option<Option<String>>, _> = conn.query_first(hash_query(&table.name, &table.columns)).await;
        match result {
            Ok(v) => Ok(Ok(v.flatten())),
            Err(mysql_async::Error::Server(e)) => Ok(Err(server_text(&e))),
            Err(e) => Err(backend("cannot hash a table", &url, e)),
        }
    }

    /// Drops the episode's database and user, as the admin.
    async fn drop_database(&mut self) -> Result<(), EnvError> {
        let url = self.url();
        if let Some(conn) = self.conn.take() {
            let _ = conn.disconnect().await;
        }
        let mut conn = connect(self.admin.clone()).await.map_err(|e| backend("cannot reconnect to drop the database", &url, e))?;
        for sql in drop_statements(&self.database, &self.account) {
            conn.query_drop(&sql).await.map_err(|e| backend(&format!("cannot drop database `{}` and its user", self.database), &url, e))?;
        }
        let _ = conn.disconnect().await;
        Ok(())
    }

    /// Drops the episode's database and closes the connection.
    pub async fn close(mut self) -> Result<(), EnvError> {
        let dropped = self.drop_database().await;
        self.closed = true;
        dropped
    }
}

impl Drop for MysqlDb {
    /// An episode abandoned without `close` (a panic, a cancelled job) still drops its
    /// database, in the background, when a runtime is there to do it.
    fn drop(&mut self) {
        if self.closed {
            return;
        }
        let statements = drop_statements(&self.database, &self.account);
        let (admin, conn) = (self.admin.clone(), self.conn.take());
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                handle.spawn(async move {
                    if let Some(conn) = conn {
                        let _ = conn.disconnect().await;
                    }
                    if let Ok(mut conn) = connect(admin).await {
                        for sql in &statements {
                            let _ = conn.query_drop(sql).await;
                        }
                        let _ = conn.disconnect().await;
                    }
                });
            }
            Err(_) => {
                tracing::warn!(database = %self.database, "episode database left on the server: dropped outside a runtime")
            }
        }
    }
}

fn drop_statements(database: &str, account: &str) -> [String; 2] {
    [format!("DROP DATABASE IF EXISTS {}", quote_ident(database)), format!("DROP USER IF EXISTS {account}")]
}

/// The server's own statement time limit (MariaDB `max_statement_time` in seconds, MySQL
/// `max_execution_time` in milliseconds, SELECT only); the client's deadline stays.
async fn set_statement_limit(conn: &mut Conn, limit: Duration) {
    let maria = format!("SET SESSION max_statement_time = {}", limit.as_secs_f64());
    if conn.query_drop(&maria).await.is_err() {
        let mysql = format!("SET SESSION max_execution_time = {}", limit.as_millis());
        if let Err(e) = conn.query_drop(&mysql).await {
            tracing::warn!(error = %e, "no server-side statement time limit on this server");
        }
    }
}

/// MySQL 8 session defaults; a server that lacks one keeps its own (logged).
async fn setup_session(conn: &mut Conn) {
    for sql in [
        format!("SET SESSION sql_mode = '{MYSQL8_SQL_MODE}'"),
        format!("SET SESSION group_concat_max_len = {}", super::grade::GROUP_CONCAT_MAX_LEN),
    ] {
        if let Err(e) = conn.query_drop(&sql).await {
            tracing::warn!(%sql, error = %e, "MySQL session setting not applied");
        }
    }
}

async fn run_query(conn: &mut Conn, sql: &str, limit: usize) -> mysql_async::Result<Exec> {
    let mut result = conn.query_iter(sql).await?;
    let mut renderer = RowRenderer::new(limit);
    if let Some(mut stream) = result.stream::<Row>().await? {
        while let Some(row) = stream.next().await {
            let row = row?;
            let columns = row.columns();
            let values = row.unwrap_raw().into_iter().enumerate().map(|(i, v)| to_py(&columns[i], v.unwrap_or(Value::NULL))).collect();
            if !renderer.push(values) {
                break;
            }
        }
    }
    // Read whatever is left so the connection is ready for the next statement.
    result.drop_result().await?;
    Ok(renderer.finish())
}

/// `str(mysql.connector.Error)`: `CODE (STATE): MESSAGE`.
fn server_text(e: &mysql_async::ServerError) -> String {
    format!("{} ({}): {}", e.code, e.state, e.message)
}

/// The Python value mysql-connector returns for a text-protocol value.
fn to_py(col: &Column, v: Value) -> PyValue {
    let bytes = match v {
        Value::NULL => return PyValue::None,
        Value::Bytes(b) => b,
        // The text protocol sends bytes; other variants only come from prepared statements.
        other => return PyValue::Str(other.as_sql(true)),
    };
    let text = || String::from_utf8_lossy(&bytes).into_owned();
    use ColumnType::*;
    match col.column_type() {
        MYSQL_TYPE_TINY | MYSQL_TYPE_SHORT | MYSQL_TYPE_LONG | MYSQL_TYPE_INT24 | MYSQL_TYPE_LONGLONG | MYSQL_TYPE_YEAR => {
            PyValue::Int(text())
        }
        MYSQL_TYPE_FLOAT | MYSQL_TYPE_DOUBLE => text().parse::<f64>().map(PyValue::Float).unwrap_or_else(|_| PyValue::Str(text())),
        MYSQL_TYPE_DECIMAL | MYSQL_TYPE_NEWDECIMAL => {
            let t = text();
            PyValue::Object { repr: format!("Decimal('{t}')"), str: t }
        }
        MYSQL_TYPE_DATE | MYSQL_TYPE_NEWDATE => date_value(&text()).unwrap_or_else(|| PyValue::Str(text())),
        MYSQL_TYPE_DATETIME | MYSQL_TYPE_DATETIME2 | MYSQL_TYPE_TIMESTAMP | MYSQL_TYPE_TIMESTAMP2 => {
            datetime_value(&text()).unwrap_or_else(|| PyValue::Str(text()))
        }
        MYSQL_TYPE_TIME | MYSQL_TYPE_TIME2 => timedelta_value(&text()).unwrap_or_else(|| PyValue::Str(text())),
        MYSQL_TYPE_BIT => PyValue::Int(bytes.iter().fold(0u128, |acc, b| (acc << 8) | *b as u128).to_string()),
        // charset 63 is `binary`: BLOB and VARBINARY come back as bytes.
        _ if col.character_set() == 63 && !matches!(col.column_type(), MYSQL_TYPE_JSON) => PyValue::Bytes(bytes),
        _ => PyValue::Str(text()),
    }
}

fn date_parts(s: &str) -> Option<(u32, u32, u32)> {
    let mut it = s.split('-');
    let (y, m, d) = (it.next()?.parse().ok()?, it.next()?.parse().ok()?, it.next()?.parse().ok()?);
    (it.next().is_none() && m >= 1 && d >= 1).then_some((y, m, d))
}

/// `datetime.date(Y, M, D)`.
fn date_value(s: &str) -> Option<PyValue> {
    let (y, m, d) = date_parts(s)?;
    Some(PyValue::Object { repr: format!("datetime.date({y}, {m}, {d})"), str: s.to_string() })
}

/// `datetime.datetime(Y, M, D, h, m[, s[, us]])`.
fn datetime_value(s: &str) -> Option<PyValue> {
    let (date, time) = s.split_once(' ')?;
    let (y, mo, d) = date_parts(date)?;
    let (hms, frac) = time.split_once('.').unwrap_or((time, ""));
    let mut it = hms.split(':');
    let (h, mi, sec): (u32, u32, u32) = (it.next()?.parse().ok()?, it.next()?.parse().ok()?, it.next()?.parse().ok()?);
    let us: u32 = if frac.is_empty() { 0 } else { format!("{frac:0<6}")[..6].parse().ok()? };
    let mut repr = format!("datetime.datetime({y}, {mo}, {d}, {h}, {mi}");
    if sec > 0 || us > 0 {
        repr.push_str(&format!(", {sec}"));
    }
    if us > 0 {
        repr.push_str(&format!(", {us}"));
    }
    repr.push(')');
    let str = if us > 0 { format!("{date} {h:02}:{mi:02}:{sec:02}.{us:06}") } else { format!("{date} {h:02}:{mi:02}:{sec:02}") };
    Some(PyValue::Object { repr, str })
}

/// `datetime.timedelta(...)` for a non-negative `TIME` value.
fn timedelta_value(s: &str) -> Option<PyValue> {
    let (hms, frac) = s.split_once('.').unwrap_or((s, ""));
    let mut it = hms.split(':');
    let (h, m, sec): (u64, u64, u64) = (it.next()?.parse().ok()?, it.next()?.parse().ok()?, it.next()?.parse().ok()?);
    let us: u64 = if frac.is_empty() { 0 } else { format!("{frac:0<6}")[..6].parse().ok()? };
    let total = h * 3600 + m * 60 + sec;
    let (days, secs) = (total / 86400, total % 86400);
    let mut parts = Vec::new();
    if days > 0 {
        parts.push(format!("days={days}"));
    }
    if secs > 0 {
        parts.push(format!("seconds={secs}"));
    }
    if us > 0 {
        parts.push(format!("microseconds={us}"));
    }
    let repr = if parts.is_empty() { "datetime.timedelta(0)".to_string() } else { format!("datetime.timedelta({})", parts.join(", ")) };
    let clock =
        format!("{}:{:02}:{:02}{}", secs / 3600, (secs % 3600) / 60, secs % 60, if us > 0 { format!(".{us:06}") } else { String::new() });
    let str = match days {
        0 => clock,
        1 => format!("1 day, {clock}"),
        n => format!("{n} days, {clock}"),
    };
    Some(PyValue::Object { repr, str })
}

/// Statements in `sql` that hold more than whitespace and comments, reading MySQL's
/// quoting (`'…'` and `"…"` with backslash escapes, `` `…` ``) and comments (`-- `, `#`,
/// `/* */`).
pub fn count_statements(sql: &str) -> usize {
    let b = sql.as_bytes();
    let mut i = 0;
    let mut count = 0;
    let mut current_has_code = false;
    while i < b.len() {
        let c = b[i];
        match c {
            b'\'' | b'"' | b'`' => {
                current_has_code = true;
                i += 1;
                while i < b.len() {
                    if b[i] == b'\\' && c != b'`' {
                        i += 2;
                        continue;
                    }
                    if b[i] == c {
                        if b.get(i + 1) == Some(&c) {
                            i += 2;
                            continue;
                        }
                        break;
                    }
                    i += 1;
                }
                i += 1;
            }
            b'#' => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'-' if b.get(i + 1) == Some(&b'-') && b.get(i + 2).is_none_or(|c| c.is_ascii_whitespace()) => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                i += 2;
                while i < b.len() && !(b[i] == b'*' && b.get(i + 1) == Some(&b'/')) {
                    i += 1;
                }
                i += 2;
            }
            b';' => {
                if current_has_code {
                    count += 1;
                }
                current_has_code = false;
                i += 1;
            }
            c if c.is_ascii_whitespace() => i += 1,
            _ => {
                current_has_code = true;
                i += 1;
            }
        }
    }
    if current_has_code {
        count += 1;
    }
    count
}

/// How long [`MysqlDb`] waits for a statement by default (AgentBench: 60 s).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_are_counted_with_quotes_and_comments() {
        assert_eq!(count_statements("SELECT 1"), 1);
        assert_eq!(count_statements("SELECT 1;"), 1);
        assert_eq!(count_statements("SELECT 1; -- done\n"), 1);
        assert_eq!(count_statements("SELECT ';' FROM t; /* x; */ # y;"), 1);
        assert_eq!(count_statements("SELECT 'it\\'s; ok'"), 1);
        assert_eq!(count_statements("SELECT `a;b` FROM t"), 1);
        assert_eq!(count_statements("SELECT 1; DROP TABLE t"), 2);
        assert_eq!(count_statements("  ;  "), 0);
        assert_eq!(count_statements(""), 0);
    }

    #[test]
    fn temporal_values_print_like_mysql_connector() {
        assert_eq!(date_value("2020-01-02").unwrap().repr(), "datetime.date(2020, 1, 2)");
        assert_eq!(datetime_value("2020-01-02 03:04:00").unwrap().repr(), "datetime.datetime(2020, 1, 2, 3, 4)");
        assert_eq!(datetime_value("2020-01-02 03:04:05.5").unwrap().repr(), "datetime.datetime(2020, 1, 2, 3, 4, 5, 500000)");
        assert_eq!(timedelta_value("25:00:01").unwrap().repr(), "datetime.timedelta(days=1, seconds=3601)");
        assert_eq!(timedelta_value("00:00:00").unwrap().repr(), "datetime.timedelta(0)");
        assert_eq!(timedelta_value("25:00:01").unwrap().to_py_str(), "1 day, 1:00:01");
    }

    #[test]
    fn urls_are_checked_and_redacted() {
        assert!(parse_url("mysql://root@127.0.0.1:3306").is_ok());
        let e = parse_url("postgres://x").unwrap_err();
        assert!(e.contains("expected mysql://"), "{e}");
        assert_eq!(redact("mysql://u:secret@h:1/db"), "mysql://u:***@h:1/db");
    }
}
