//! `harness-s env serve`: the built-in DBBench environment behind AgentBench's
//! function-calling controller protocol (`jobs::env::http` is the client and holds the
//! wire types).
//!
//! Why it exists: with `[environment] kind = "http"` a run reaches its environments over
//! HTTP, so environment capacity scales on machines of its own; this server is that for
//! DBBench (SQLite in memory, or MariaDB/MySQL), and the real server the client is tested
//! against. A run against it sees the same tasks, observations and rewards as an
//! in-process run over the same task file.
//!
//! - `POST /api/start_sample {"name", "index"}` → a fresh episode of sample `index` (its
//!   own database), the task as a user message, the tools, the `session_id` header;
//! - `POST /api/interact` (header `session_id`) `{"messages": [assistant message with
//!   tool_calls]}` → one tool message per call; when the episode ends (an answer
//!   committed, the round limit) it is graded (`reward` 1/0, `finish: true`) and the
//!   session closed;
//! - `POST /api/cancel` (header `session_id`) ends a session early;
//! - `GET /api/sessions` → open sessions and counts (the leak check); `GET /health`.
//!
//! Sessions run concurrently (each holds its own database); one session's requests are
//! taken one at a time. A session idle longer than the TTL is closed (a client that died
//! without cancelling). An unknown session is a 404, a bad body or header a 400 naming the
//! field, a full server or a failing database a 503; never a crash.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

use jobs::env::dbbench::{self, DbBenchConfig, DbBenchEnv, DbTask, TaskSet};
use jobs::env::http::{
    InteractRequest, SampleIndex, SampleInfo, SampleResponse, SessionsReport, StartRequest, WireMessage, WireTool, SESSION_HEADER,
};
use jobs::env::{EnvError, Environment, Observation, ToolCall};

/// What the server serves and how.
#[derive(Clone)]
pub struct EnvServerConfig {
    /// The task set name clients send as `name`.
    pub task_set: String,
    /// The samples, by index.
    pub samples: Vec<Arc<DbTask>>,
    pub db: DbBenchConfig,
    /// A session idle this long is closed.
    pub session_ttl: Duration,
    /// Open sessions at most; more starts get a 503.
    pub max_sessions: usize,
}

impl EnvServerConfig {
    /// Samples in the order of `tasks` (the file's order).
    pub fn new(task_set: &str, tasks: &TaskSet, db: DbBenchConfig) -> Self {
        EnvServerConfig {
            task_set: task_set.to_string(),
            samples: tasks.iter().cloned().collect(),
            db,
            session_ttl: Duration::from_secs(600),
            max_sessions: 1024,
        }
    }
}

/// One open episode.
struct Session {
    env: tokio::sync::Mutex<DbBenchEnv>,
    /// Milliseconds since the server started, at the last request.
    touched: AtomicU64,
}

/// The server's state: the samples and the open sessions.
pub struct EnvServer {
    config: EnvServerConfig,
    tasks: Arc<TaskSet>,
    sessions: Mutex<HashMap<String, Arc<Session>>>,
    started_at: Instant,
    next: AtomicU64,
    salt: u64,
    started: AtomicU64,
    finished: AtomicU64,
    cancelled: AtomicU64,
    expired: AtomicU64,
}

/// Why the server cannot start.
#[derive(Debug, thiserror::Error)]
pub enum EnvServeError {
    #[error("{0}")]
    Tasks(String),
}

impl EnvServer {
    pub fn new(config: EnvServerConfig) -> Result<Arc<EnvServer>, EnvServeError> {
        if config.samples.is_empty() {
            return Err(EnvServeError::Tasks("no tasks to serve: give a task file with --tasks or --generate N".into()));
        }
        let tasks = TaskSet::from_tasks(config.samples.iter().map(|t| t.as_ref().clone()).collect()).map_err(|e| {
            EnvServeError::Tasks(format!("the task files share task ids ({e}); serve each split's file alone or give them distinct ids"))
        })?;
        Ok(Arc::new(EnvServer {
            config,
            tasks: Arc::new(tasks),
            sessions: Mutex::new(HashMap::new()),
            started_at: Instant::now(),
            next: AtomicU64::new(0),
            salt: rand::random(),
            started: AtomicU64::new(0),
            finished: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            expired: AtomicU64::new(0),
        }))
    }

    /// Samples served.
    pub fn len(&self) -> usize {
        self.config.samples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.config.samples.is_empty()
    }

    pub fn report(&self) -> SessionsReport {
        SessionsReport {
            open: self.lock().len(),
            started: self.started.load(Ordering::Relaxed),
            finished: self.finished.load(Ordering::Relaxed),
            cancelled: self.cancelled.load(Ordering::Relaxed),
            expired: self.expired.load(Ordering::Relaxed),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Session>>> {
        self.sessions.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn now_ms(&self) -> u64 {
        self.started_at.elapsed().as_millis() as u64
    }

    fn take(&self, id: &str) -> Option<Arc<Session>> {
        self.lock().remove(id)
    }

    /// Closes sessions idle longer than the TTL; returns how many.
    pub async fn expire(&self) -> usize {
        let ttl = self.config.session_ttl.as_millis() as u64;
        let now = self.now_ms();
        let stale: Vec<Arc<Session>> = {
            let mut map = self.lock();
            let ids: Vec<String> =
                map.iter().filter(|(_, s)| now.saturating_sub(s.touched.load(Ordering::Relaxed)) > ttl).map(|(id, _)| id.clone()).collect();
            ids.iter().filter_map(|id| map.remove(id)).collect()
        };
        for s in &stale {
            close(s).await;
        }
        self.expired.fetch_add(stale.len() as u64, Ordering::Relaxed);
        if !stale.is_empty() {
            tracing::info!(expired = stale.len(), "closed sessions idle longer than the TTL");
        }
        stale.len()
    }

    /// Closes every open session (shutdown).
    pub async fn close_all(&self) {
        let all: Vec<Arc<Session>> = self.lock().drain().map(|(_, s)| s).collect();
        for s in &all {
            close(s).await;
        }
    }
}

async fn close(s: &Session) {
    if let Err(e) = s.env.lock().await.close().await {
        tracing::warn!(error = %e, "closing a session's database failed");
    }
}

/// The routes.
pub fn router(server: Arc<EnvServer>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/api/start_sample", post(start_sample))
        .route("/api/interact", post(interact))
        .route("/api/cancel", post(cancel))
        .route("/api/sessions", get(sessions))
        .with_state(server)
}

/// Serves on `listener` until `shutdown` resolves, expiring idle sessions as it goes;
/// then closes every session still open (their databases with them).
pub async fn serve(
    listener: tokio::net::TcpListener,
    server: Arc<EnvServer>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let reaper = {
        let server = Arc::clone(&server);
        let every = (server.config.session_ttl / 4).clamp(Duration::from_millis(100), Duration::from_secs(30));
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                server.expire().await;
            }
        })
    };
    let result = axum::serve(listener, router(Arc::clone(&server))).with_graceful_shutdown(shutdown).await;
    reaper.abort();
    server.close_all().await;
    result
}

/// An error response: `{"error": {"message", "param"}}`.
fn refuse(status: StatusCode, param: Option<&str>, message: impl Into<String>) -> Response {
    (status, Json(json!({"error": {"message": message.into(), "param": param}}))).into_response()
}

/// A JSON body into `T`; the 400 names the field that is wrong.
fn parse<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, Response> {
    let v: Value = serde_json::from_slice(body).map_err(|e| refuse(StatusCode::BAD_REQUEST, None, format!("the body is not JSON: {e}")))?;
    serde_path_to_error::deserialize(&v).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." {
            refuse(StatusCode::BAD_REQUEST, None, format!("not a valid request: {inner}"))
        } else {
            refuse(StatusCode::BAD_REQUEST, Some(path.as_str()), format!("{path}: {inner}"))
        }
    })
}

fn session_id(headers: &HeaderMap) -> Result<String, Response> {
    match headers.get(SESSION_HEADER).map(|v| v.to_str()) {
        None => Err(refuse(
            StatusCode::BAD_REQUEST,
            Some(SESSION_HEADER),
            format!("missing header `{SESSION_HEADER}`: send the id start_sample returned"),
        )),
        Some(Err(_)) => Err(refuse(StatusCode::BAD_REQUEST, Some(SESSION_HEADER), format!("header `{SESSION_HEADER}` is not text"))),
        Some(Ok(s)) => Ok(s.to_string()),
    }
}

fn unknown_session(server: &EnvServer, id: &str) -> Response {
    refuse(
        StatusCode::NOT_FOUND,
        Some(SESSION_HEADER),
        format!(
            "unknown session `{id}`: it finished, was cancelled, expired (idle for more than {} s) or never existed; start a new sample",
            server.config.session_ttl.as_secs()
        ),
    )
}

/// An environment failure: a failing database is a 503 (retry later), anything else a 500.
fn env_failure(e: &EnvError) -> Response {
    let status = if matches!(e, EnvError::Backend { .. }) { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::INTERNAL_SERVER_ERROR };
    tracing::warn!(error = %e, "environment failure");
    refuse(status, None, e.to_string())
}

async fn health() -> Response {
    Json(json!({"status": "ok"})).into_response()
}

async fn sessions(State(server): State<Arc<EnvServer>>) -> Response {
    Json(server.report()).into_response()
}

/// The sample an index names.
fn sample(server: &EnvServer, index: &SampleIndex) -> Result<Arc<DbTask>, Response> {
    let n = match index {
        SampleIndex::Number(n) => Some(*n),
        SampleIndex::Text(s) => s.parse::<u64>().ok(),
    };
    let count = server.config.samples.len();
    n.and_then(|n| server.config.samples.get(usize::try_from(n).ok()?).cloned()).ok_or_else(|| {
        refuse(
            StatusCode::NOT_FOUND,
            Some("index"),
            format!("index {index} is not a sample of `{}` (0 to {})", server.config.task_set, count - 1),
        )
    })
}

async fn start_sample(State(server): State<Arc<EnvServer>>, body: Bytes) -> Response {
    let req: StartRequest = match parse(&body) {
        Ok(r) => r,
        Err(resp) => return resp,
    };
    if req.name != server.config.task_set {
        return refuse(
            StatusCode::NOT_FOUND,
            Some("name"),
            format!("unknown task set `{}`; this server serves `{}`", req.name, server.config.task_set),
        );
    }
    let task = match sample(&server, &req.index) {
        Ok(t) => t,
        Err(resp) => return resp,
    };
    let open = server.lock().len();
    if open >= server.config.max_sessions {
        return refuse(StatusCode::SERVICE_UNAVAILABLE, None, format!("the server holds {open} sessions, its limit; retry later"));
    }
    let mut env = DbBenchEnv::new(Arc::clone(&server.tasks), server.config.db.clone());
    let start = match env.reset(&task.id, 0).await {
        Ok(s) => s,
        Err(e) => {
            let _ = env.close().await;
            return env_failure(&e);
        }
    };
    let id = format!("{:016x}{:08x}", server.salt, server.next.fetch_add(1, Ordering::Relaxed));
    let session = Arc::new(Session { env: tokio::sync::Mutex::new(env), touched: AtomicU64::new(server.now_ms()) });
    server.lock().insert(id.clone(), session);
    server.started.fetch_add(1, Ordering::Relaxed);
    let body = SampleResponse {
        status: "running".into(),
        messages: vec![WireMessage { role: "user".into(), content: Value::String(start.observation.text), ..Default::default() }],
        tools: start.tools.iter().map(WireTool::from).collect(),
        finish: false,
        reward: 0.0,
        metrics: Default::default(),
        info: Some(SampleInfo {
            task_type: Some(start.task_type),
            features: Some(start.features),
            max_rounds: Some(start.max_rounds),
            ..Default::default()
        }),
    };
    let mut headers = HeaderMap::new();
    headers.insert(SESSION_HEADER, HeaderValue::from_str(&id).expect("hex is a header value"));
    (headers, Json(body)).into_response()
}

/// The tool calls of the request's assistant message.
fn calls_of(req: &InteractRequest) -> Result<Vec<(String, ToolCall)>, Response> {
    let Some((i, msg)) = req.messages.iter().enumerate().rev().find(|(_, m)| m.role == "assistant") else {
        return Err(refuse(
            StatusCode::BAD_REQUEST,
            Some("messages"),
            "messages: no assistant message; send the agent's reply with its tool_calls",
        ));
    };
    if msg.tool_calls.is_empty() {
        return Err(refuse(
            StatusCode::BAD_REQUEST,
            Some(format!("messages[{i}].tool_calls").as_str()),
            format!(
                "messages[{i}].tool_calls is empty: send the tool call to run ({} or {})",
                dbbench::EXECUTE_SQL,
                dbbench::COMMIT_FINAL_ANSWER
            ),
        ));
    }
    Ok(msg
        .tool_calls
        .iter()
        .map(|c| {
            // OpenAI sends the arguments as a JSON string; text that is not JSON stands for itself.
            let args = serde_json::from_str(&c.function.arguments).unwrap_or_else(|_| Value::String(c.function.arguments.clone()));
            (c.id.clone(), ToolCall { name: c.function.name.clone(), args })
        })
        .collect())
}

async fn interact(State(server): State<Arc<EnvServer>>, headers: HeaderMap, body: Bytes) -> Response {
    let id = match session_id(&headers) {
        Ok(id) => id,
        Err(resp) => return resp,
    };
    let req: InteractRequest = match parse(&body) {
        Ok(r) => r,
        Err(resp) => return resp,
    };
    let calls = match calls_of(&req) {
        Ok(c) => c,
        Err(resp) => return resp,
    };
    let Some(session) = server.lock().get(&id).cloned() else {
        return unknown_session(&server, &id);
    };
    session.touched.store(server.now_ms(), Ordering::Relaxed);
    let mut env = session.env.lock().await;
    let mut messages = Vec::new();
    let mut last = Observation::default();
    for (call_id, call) in &calls {
        match env.step(call).await {
            Ok(obs) => {
                messages.push(WireMessage {
                    role: "tool".into(),
                    content: Value::String(obs.text.clone()),
                    tool_call_id: Some(call_id.clone()),
                    ..Default::default()
                });
                last = obs;
                if last.done {
                    break;
                }
            }
            Err(e) => {
                drop(env);
                if server.take(&id).is_some() {
                    close(&session).await;
                }
                return env_failure(&e);
            }
        }
    }
    session.touched.store(server.now_ms(), Ordering::Relaxed);
    let mut info =
        SampleInfo { action_failed: last.action_failed, truncated: last.truncated, committed: last.committed, ..Default::default() };
    let (mut reward, mut status) = (0.0, "running".to_string());
    if last.done {
        let graded = env.evaluate().await;
        let _ = env.close().await;
        drop(env);
        server.take(&id);
        server.finished.fetch_add(1, Ordering::Relaxed);
        match graded {
            Ok(ev) => {
                reward = ev.reward;
                info.success = Some(ev.success);
                info.detail = Some(ev.detail);
                status = if last.committed { "completed" } else { "task limit reached" }.into();
            }
            Err(e) => return env_failure(&e),
        }
    }
    Json(SampleResponse { status, messages, tools: vec![], finish: last.done, reward, metrics: Default::default(), info: Some(info) })
        .into_response()
}

async fn cancel(State(server): State<Arc<EnvServer>>, headers: HeaderMap) -> Response {
    let id = match session_id(&headers) {
        Ok(id) => id,
        Err(resp) => return resp,
    };
    let Some(session) = server.take(&id) else {
        return unknown_session(&server, &id);
    };
    close(&session).await;
    server.cancelled.fetch_add(1, Ordering::Relaxed);
    Json(json!({"status": "cancelled"})).into_response()
}
