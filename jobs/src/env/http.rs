//! Environments over HTTP: episodes against environment servers on other machines.
//!
//! Why: outside DBBench the paper's environments (AppWorld, SWE-Gym) are heavy services
//! that run on their own machines; Harness-R1 and AgentBench reach them over HTTP through
//! a controller. This module is that client, speaking AgentBench's function-calling
//! controller protocol, so a run can train against any such server and environment
//! capacity scales apart from the workers (`harness-s env serve` serves the built-in
//! DBBench over the same protocol).
//!
//! The protocol ([`StartRequest`], [`InteractRequest`], [`SampleResponse`]):
//! - `POST /api/start_sample {"name": <task set>, "index": <sample>}` → the task's first
//!   messages, its tools (OpenAI tool schemas), `finish`, `reward`, `metrics`; the session
//!   id comes in the response header `session_id`;
//! - `POST /api/interact` (header `session_id`) `{"messages": [<assistant message with its
//!   tool_calls>]}` → the new messages only, same shape;
//! - `POST /api/cancel` (header `session_id`) ends a session early.
//!
//! How it maps onto the harness runtime: `reset` starts a sample (the task id is the
//! sample index), the server's messages become the env turn's text, its tools the tool
//! view harness specs edit; `step` sends one tool call as an assistant message and shows
//! the tool messages that come back; `finish` ends the episode and `reward` grades it
//! (`reward >= 1` is a success unless the server says otherwise). An episode the server
//! did not finish (a budget ran out, the harness stopped it) is not graded: reward 0.
//! harness-s servers add an optional `info` object (task type and features at start;
//! `action_failed`, `truncated`, `committed`, `success` and the grader's `detail` after a
//! step); other servers leave it out and get the defaults.
//!
//! Sessions never outlive their episode: `close` cancels an unfinished session; an
//! environment dropped without `close` (a job cancelled, a deadline, a worker stopping
//! after its grace period) cancels from a spawned task; and [`cancel_open_sessions`]
//! cancels whatever a process still holds before it exits (the worker calls it on
//! SIGTERM). Servers also expire idle sessions.
//!
//! Failures are typed: a server that cannot be reached, times out, answers 5xx / 429 /
//! 408, or no longer knows the session (restarted) is [`EnvError::Backend`] — retryable;
//! a request the server refuses (4xx) or a response that is not the protocol's is
//! [`EnvError::Protocol`] — fatal. Requests are never retried inside an episode (an
//! interaction is not idempotent); a rollout job whose episodes lost their server is
//! retried whole ([`HttpConfig::job_retries`]), every episode started fresh.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::env::{EnvError, Environment, EnvironmentFactory, EpisodeStart, Evaluation, Observation, ToolCall, ToolSpec};

/// The response header (and request header) that carries the session id.
pub const SESSION_HEADER: &str = "session_id";
/// Round limit shown to the harness when the server does not name one.
pub const DEFAULT_MAX_ROUNDS: u32 = 15;
/// Most sample indices one split may list.
pub const MAX_INDICES: u64 = 1_000_000;

// ---------------------------------------------------------------------------------------
// The wire format (shared with the server in `serve::env`)
// ---------------------------------------------------------------------------------------

/// A sample index: AgentBench allows numbers and strings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum SampleIndex {
    Number(u64),
    Text(String),
}

impl SampleIndex {
    /// A task id as harness-s names it: digits are a numeric index.
    pub fn of_task_id(task_id: &str) -> SampleIndex {
        match task_id.parse::<u64>() {
            Ok(n) => SampleIndex::Number(n),
            Err(_) => SampleIndex::Text(task_id.to_string()),
        }
    }
}

impl std::fmt::Display for SampleIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SampleIndex::Number(n) => write!(f, "{n}"),
            SampleIndex::Text(s) => f.write_str(s),
        }
    }
}

/// Body of `POST /api/start_sample`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StartRequest {
    /// The task set (AgentBench's task name, e.g. `dbbench-std`).
    pub name: String,
    pub index: SampleIndex,
}

/// Body of `POST /api/interact`: the agent's new messages (one assistant message with its
/// tool calls).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InteractRequest {
    pub messages: Vec<WireMessage>,
}

/// An OpenAI chat message as the protocol carries it.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct WireMessage {
    pub role: String,
    /// A string, a list of content parts (`{"type": "text", "text": ...}`) or null.
    #[serde(default)]
    pub content: Value,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<WireToolCall>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl WireMessage {
    /// The message's text: a string content, or its text parts joined.
    pub fn text(&self) -> String {
        match &self.content {
            Value::String(s) => s.clone(),
            Value::Array(parts) => {
                parts.iter().filter_map(|p| p.get("text").and_then(Value::as_str).or_else(|| p.as_str())).collect::<Vec<_>>().join("\n")
            }
            Value::Null => String::new(),
            other => other.to_string(),
        }
    }
}

/// An OpenAI tool call: `{"id", "type": "function", "function": {"name", "arguments"}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WireToolCall {
    #[serde(default)]
    pub id: String,
    #[serde(rename = "type", default = "function_type")]
    pub kind: String,
    pub function: WireFunctionCall,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WireFunctionCall {
    pub name: String,
    /// The arguments object as a JSON string (OpenAI's convention).
    #[serde(default)]
    pub arguments: String,
}

fn function_type() -> String {
    "function".into()
}

/// An OpenAI tool schema: `{"type": "function", "function": {"name", "description", "parameters"}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WireTool {
    #[serde(rename = "type", default = "function_type")]
    pub kind: String,
    pub function: WireFunction,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WireFunction {
    pub name: String,
    #[serde(default)]
    pub description: String,
    #[serde(default)]
    pub parameters: Value,
}

impl From<&ToolSpec> for WireTool {
    fn from(t: &ToolSpec) -> Self {
        WireTool {
            kind: function_type(),
            function: WireFunction { name: t.name.clone(), description: t.description.clone(), parameters: t.parameters.clone() },
        }
    }
}

impl From<WireTool> for ToolSpec {
    fn from(t: WireTool) -> Self {
        ToolSpec { name: t.function.name, description: t.function.description, parameters: t.function.parameters }
    }
}

/// The response of `start_sample` and `interact`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct SampleResponse {
    /// AgentBench's sample status: `running`, `completed`, `task limit reached`, ...
    #[serde(default)]
    pub status: String,
    #[serde(default)]
    pub messages: Vec<WireMessage>,
    #[serde(default)]
    pub tools: Vec<WireTool>,
    #[serde(default)]
    pub finish: bool,
    #[serde(default)]
    pub reward: f64,
    #[serde(default)]
    pub metrics: serde_json::Map<String, Value>,
    /// harness-s's extension; other servers leave it out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub info: Option<SampleInfo>,
}

/// What a harness-s server adds to a response, for the harness's state and the report.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct SampleInfo {
    /// At start: the task's category (e.g. `counting`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_type: Option<String>,
    /// At start: task features for routing and profiles.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub features: Option<serde_json::Map<String, Value>>,
    /// At start: environment actions the episode allows.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_rounds: Option<u32>,
    /// After a step: the action failed (an SQL error); the text says why.
    #[serde(default)]
    pub action_failed: bool,
    /// After a step: the observation was cut to fit.
    #[serde(default)]
    pub truncated: bool,
    /// After a step: the agent committed its final answer.
    #[serde(default)]
    pub committed: bool,
    /// At finish: whether the episode succeeded (default: `reward >= 1`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub success: Option<bool>,
    /// At finish: why it was graded so, in words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// Body of `GET /api/sessions` on a harness-s server.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct SessionsReport {
    /// Sessions started and neither finished, cancelled nor expired.
    pub open: usize,
    pub started: u64,
    pub finished: u64,
    pub cancelled: u64,
    pub expired: u64,
}

// ---------------------------------------------------------------------------------------
// Settings
// ---------------------------------------------------------------------------------------

/// Where the server is and how to talk to it (`[environment] kind = "http"`).
#[derive(Debug, Clone, PartialEq)]
pub struct HttpConfig {
    /// The controller's base URL (`http://host:port`; the routes are under `/api/`).
    pub url: String,
    /// The task set name sent as `name` in `start_sample`.
    pub task_set: String,
    /// Whole-request limit of `start_sample` (starting a task may build a container).
    pub start_timeout: Duration,
    /// Whole-request limit of `interact` and `cancel`.
    pub request_timeout: Duration,
    pub connect_timeout: Duration,
    /// Sessions this process holds open at once; further episodes wait for a slot.
    pub concurrency: usize,
    /// Deliveries of a rollout job that are retried when some episode lost its server;
    /// after that the episodes are recorded as failed.
    pub job_retries: u32,
    /// Round limit shown to the harness when the server does not name one.
    pub max_rounds: u32,
}

impl HttpConfig {
    /// A config with the defaults: 300 s to start a sample, 60 s per interaction, 10 s to
    /// connect, 64 sessions, 2 job retries.
    pub fn new(url: &str, task_set: &str) -> Result<Self, HttpConfigError> {
        let config = HttpConfig {
            url: url.trim_end_matches('/').to_string(),
            task_set: task_set.to_string(),
            start_timeout: Duration::from_secs(300),
            request_timeout: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(10),
            concurrency: 64,
            job_retries: 2,
            max_rounds: DEFAULT_MAX_ROUNDS,
        };
        config.check()?;
        Ok(config)
    }

    /// Checks every setting; the error names it.
    pub fn check(&self) -> Result<(), HttpConfigError> {
        check_url(&self.url)?;
        if self.task_set.trim().is_empty() {
            return Err(HttpConfigError::Setting { field: "task_set", reason: "is empty: name the server's task set".into() });
        }
        for (field, d) in
            [("start_timeout", self.start_timeout), ("request_timeout", self.request_timeout), ("connect_timeout", self.connect_timeout)]
        {
            if d.is_zero() {
                return Err(HttpConfigError::Setting { field, reason: "must be more than 0 seconds".into() });
            }
        }
        if self.concurrency == 0 {
            return Err(HttpConfigError::Setting { field: "concurrency", reason: "must be at least 1".into() });
        }
        if self.max_rounds == 0 {
            return Err(HttpConfigError::Setting { field: "max_rounds", reason: "must be at least 1".into() });
        }
        Ok(())
    }
}

/// Bad settings of the http environment; the variant names the setting.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum HttpConfigError {
    #[error("url: `{url}` {reason} (e.g. http://127.0.0.1:5000)")]
    Url { url: String, reason: String },
    #[error("{field}: {reason}")]
    Setting { field: &'static str, reason: String },
    #[error("cannot build the HTTP client: {0}")]
    Client(String),
}

/// An `http://` or `https://` URL with a host (credentials never shown).
pub fn check_url(raw: &str) -> Result<url::Url, HttpConfigError> {
    let shown = infra::redact_url(raw);
    let bad = |reason: &str| HttpConfigError::Url { url: shown.clone(), reason: reason.to_string() };
    let url = url::Url::parse(raw).map_err(|e| bad(&format!("is not a URL: {e}")))?;
    if url.scheme() != "http" && url.scheme() != "https" {
        return Err(bad("is not an http:// or https:// URL"));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(bad("has no host"));
    }
    Ok(url)
}

/// Parses a split's sample indices: `0-39`, `0-9,20,30-34` (ranges inclusive).
pub fn parse_indices(text: &str) -> Result<Vec<u64>, String> {
    let mut out: Vec<u64> = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    if text.trim().is_empty() {
        return Err("is empty: give indices such as \"0-39\" or \"0-9,20,30-34\"".into());
    }
    for part in text.split(',') {
        let part = part.trim();
        let number = |s: &str| {
            s.trim()
                .parse::<u64>()
                .map_err(|_| format!("`{s}` in \"{text}\" is not a whole number (write indices such as \"0-39\" or \"0-9,20\")"))
        };
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (number(a)?, number(b)?),
            None => {
                let n = number(part)?;
                (n, n)
            }
        };
        if lo > hi {
            return Err(format!("range `{part}` runs backwards; write it as {hi}-{lo}"));
        }
        if (out.len() as u64).saturating_add(hi - lo + 1) > MAX_INDICES {
            return Err(format!("lists more than {MAX_INDICES} samples"));
        }
        for i in lo..=hi {
            if !seen.insert(i) {
                return Err(format!("index {i} is listed twice"));
            }
            out.push(i);
        }
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------
// Open sessions of this process
// ---------------------------------------------------------------------------------------

/// (base URL, session id) of every session this process started and has not ended.
fn registry() -> &'static Mutex<HashMap<(String, String), ()>> {
    static OPEN: OnceLock<Mutex<HashMap<(String, String), ()>>> = OnceLock::new();
    OPEN.get_or_init(Default::default)
}

fn register(url: &str, session: &str) {
    registry().lock().unwrap_or_else(|e| e.into_inner()).insert((url.to_string(), session.to_string()), ());
}

fn unregister(url: &str, session: &str) {
    registry().lock().unwrap_or_else(|e| e.into_inner()).remove(&(url.to_string(), session.to_string()));
}

/// Sessions this process holds open on environment servers.
pub fn open_sessions() -> usize {
    registry().lock().unwrap_or_else(|e| e.into_inner()).len()
}

/// Cancels every session this process still holds (a worker stopping: the jobs it gave up
/// dropped their environments, whose own cancels may not have run). Returns how many were
/// cancelled; failures are logged, since the server's expiry ends them anyway.
pub async fn cancel_open_sessions(timeout: Duration) -> usize {
    let open: Vec<(String, String)> = registry().lock().unwrap_or_else(|e| e.into_inner()).keys().cloned().collect();
    if open.is_empty() {
        return 0;
    }
    let Ok(client) = reqwest::Client::builder().timeout(timeout).build() else { return 0 };
    let cancels = open.iter().map(|(url, session)| {
        let client = client.clone();
        async move {
            let ok = cancel(&client, url, session).await;
            unregister(url, session);
            ok
        }
    });
    let done = futures::future::join_all(cancels).await;
    let n = done.iter().filter(|ok| **ok).count();
    tracing::info!(cancelled = n, open = open.len(), "cancelled the environment sessions this process held");
    n
}

/// Whether a server answers HTTP at `url` (a run's preflight): any response counts, since
/// the protocol has no health route; only a transport failure is an error.
pub async fn probe(url: &str, timeout: Duration) -> Result<(), EnvError> {
    let backend = format!("http {}", infra::redact_url(url));
    let client = reqwest::Client::builder()
        .timeout(timeout)
        .build()
        .map_err(|e| EnvError::Backend { backend: backend.clone(), detail: e.to_string() })?;
    match client.get(format!("{}/api/sessions", url.trim_end_matches('/'))).send().await {
        Ok(_) => Ok(()),
        Err(e) => Err(EnvError::Backend { backend, detail: describe(&e, timeout) }),
    }
}

/// `POST /api/cancel`; a session the server no longer knows is already ended.
async fn cancel(client: &reqwest::Client, url: &str, session: &str) -> bool {
    match client.post(format!("{url}/api/cancel")).header(SESSION_HEADER, session).json(&json!({})).send().await {
        Ok(r) if r.status().is_success() || r.status() == reqwest::StatusCode::NOT_FOUND => true,
        Ok(r) => {
            tracing::warn!(url, session, status = %r.status(), "cancelling an environment session failed");
            false
        }
        Err(e) => {
            tracing::warn!(url, session, error = %error_chain(&e), "cancelling an environment session failed");
            false
        }
    }
}

// ---------------------------------------------------------------------------------------
// The client
// ---------------------------------------------------------------------------------------

/// What the environments of one factory share: the HTTP client (its connection pool),
/// the settings and the session slots.
struct Shared {
    config: HttpConfig,
    client: reqwest::Client,
    slots: Arc<Semaphore>,
}

/// Makes one [`HttpEnv`] per episode; all of them share one connection pool and the
/// session limit ([`HttpConfig::concurrency`]).
#[derive(Clone)]
pub struct HttpFactory {
    shared: Arc<Shared>,
}

impl HttpFactory {
    pub fn new(config: HttpConfig) -> Result<Self, HttpConfigError> {
        config.check()?;
        let client = reqwest::Client::builder()
            .connect_timeout(config.connect_timeout)
            .pool_max_idle_per_host(config.concurrency)
            .build()
            .map_err(|e| HttpConfigError::Client(e.to_string()))?;
        let slots = Arc::new(Semaphore::new(config.concurrency));
        Ok(HttpFactory { shared: Arc::new(Shared { config, client, slots }) })
    }

    pub fn config(&self) -> &HttpConfig {
        &self.shared.config
    }

    /// An environment of this factory (the same as [`EnvironmentFactory::create`]).
    pub fn env(&self) -> HttpEnv {
        HttpEnv { shared: Arc::clone(&self.shared), name: format!("http-{}", self.shared.config.task_set), episode: None }
    }
}

#[async_trait]
impl EnvironmentFactory for HttpFactory {
    async fn create(&self) -> Result<Box<dyn Environment>, EnvError> {
        Ok(Box::new(self.env()))
    }

    fn job_retries(&self) -> u32 {
        self.shared.config.job_retries
    }
}

/// The running episode: its server session and what the server said last.
struct Episode {
    session: String,
    index: SampleIndex,
    /// Holds one of the factory's session slots until the session ends.
    _slot: OwnedSemaphorePermit,
    /// The server reported `finish`: the session is over on its side.
    finished: bool,
    status: String,
    reward: f64,
    metrics: serde_json::Map<String, Value>,
    success: Option<bool>,
    detail: Option<String>,
    calls: u64,
}

/// One episode at a time against an environment server.
pub struct HttpEnv {
    shared: Arc<Shared>,
    name: String,
    episode: Option<Episode>,
}

impl HttpEnv {
    /// The server session of the running episode.
    pub fn session_id(&self) -> Option<&str> {
        self.episode.as_ref().map(|e| e.session.as_str())
    }

    fn url(&self) -> &str {
        &self.shared.config.url
    }

    fn backend(&self) -> String {
        format!("http {}", infra::redact_url(self.url()))
    }

    /// One protocol request; the response body is a [`SampleResponse`].
    async fn call(
        &self,
        route: &'static str,
        session: Option<&str>,
        body: &impl Serialize,
        timeout: Duration,
    ) -> Result<(reqwest::header::HeaderMap, SampleResponse), EnvError> {
        let mut req = self.shared.client.post(format!("{}/api/{route}", self.url())).timeout(timeout).json(body);
        if let Some(s) = session {
            req = req.header(SESSION_HEADER, s);
        }
        let backend = self.backend();
        let transient = |detail: String| EnvError::Backend { backend: backend.clone(), detail };
        let resp = req.send().await.map_err(|e| transient(format!("{route}: {}", describe(&e, timeout))))?;
        let status = resp.status();
        let headers = resp.headers().clone();
        let text = resp.text().await.map_err(|e| transient(format!("{route}: reading the response: {}", describe(&e, timeout))))?;
        if !status.is_success() {
            return Err(status_error(&backend, route, session, status, &text));
        }
        let parsed: SampleResponse = serde_json::from_str(&text).map_err(|e| EnvError::Protocol {
            backend: backend.clone(),
            detail: format!("{route}: the response is not the protocol's JSON ({e}): {}", shorten(&text, 300)),
        })?;
        if !parsed.reward.is_finite() {
            return Err(EnvError::Protocol { backend, detail: format!("{route}: reward is not a finite number") });
        }
        Ok((headers, parsed))
    }

    /// Ends the session on the server if it is still open there.
    async fn end_session(&mut self) {
        if let Some(ep) = self.episode.take() {
            if !ep.finished {
                let client = self.shared.client.clone();
                cancel(&client, &self.shared.config.url, &ep.session).await;
            }
            unregister(&self.shared.config.url, &ep.session);
        }
    }

    fn episode_mut(&mut self, operation: &'static str) -> Result<&mut Episode, EnvError> {
        self.episode.as_mut().ok_or_else(|| EnvError::State { operation, reason: "no episode is running; call reset first".into() })
    }

    /// Notes what a response says about the episode's end.
    fn absorb(ep: &mut Episode, resp: &SampleResponse) {
        ep.status = resp.status.clone();
        ep.metrics = resp.metrics.clone();
        if resp.finish {
            ep.finished = true;
            ep.reward = resp.reward;
            ep.success = resp.info.as_ref().and_then(|i| i.success);
            ep.detail = resp.info.as_ref().and_then(|i| i.detail.clone());
        }
    }
}

/// The episode's text from the server's new messages.
fn messages_text(messages: &[WireMessage]) -> String {
    messages.iter().map(WireMessage::text).filter(|t| !t.is_empty()).collect::<Vec<_>>().join("\n\n")
}

/// A failed status: retryable when the server is overloaded, failing or lost the session.
fn status_error(backend: &str, route: &str, session: Option<&str>, status: reqwest::StatusCode, body: &str) -> EnvError {
    let said = shorten(body, 300);
    let code = status.as_u16();
    if status.is_server_error() || code == 429 || code == 408 {
        return EnvError::Backend { backend: backend.to_string(), detail: format!("{route}: HTTP {status}: {said}") };
    }
    if code == 404 {
        if let Some(s) = session {
            // A restarted or expiring server: the episode can run again from the start.
            return EnvError::Backend {
                backend: backend.to_string(),
                detail: format!("{route}: the server no longer knows session `{s}` (restarted, or the session expired): {said}"),
            };
        }
    }
    EnvError::Protocol { backend: backend.to_string(), detail: format!("{route}: HTTP {status}: {said}") }
}

/// A transport error in words: timeouts say their limit, connection errors their cause.
fn describe(e: &reqwest::Error, timeout: Duration) -> String {
    if e.is_timeout() {
        format!("no answer within {:.1}s", timeout.as_secs_f64())
    } else if e.is_connect() {
        format!("cannot connect: {}", error_chain(e))
    } else {
        error_chain(e)
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let more = s.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = s.source();
    }
    text
}

fn shorten(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        return s.to_string();
    }
    format!("{}…", s.chars().take(max).collect::<String>())
}

#[async_trait]
impl Environment for HttpEnv {
    fn name(&self) -> &str {
        &self.name
    }

    /// Starts sample `task_id` (its index) fresh on the server; the seed is not sent (the
    /// protocol has none: a sample always starts from its initial state).
    async fn reset(&mut self, task_id: &str, _seed: u64) -> Result<EpisodeStart, EnvError> {
        self.end_session().await;
        let index = SampleIndex::of_task_id(task_id);
        let slot = Arc::clone(&self.shared.slots)
            .acquire_owned()
            .await
            .map_err(|_| EnvError::State { operation: "reset", reason: "the environment factory was shut down".into() })?;
        let body = StartRequest { name: self.shared.config.task_set.clone(), index: index.clone() };
        let result = self.call("start_sample", None, &body, self.shared.config.start_timeout).await;
        let (headers, resp) = match result {
            Err(EnvError::Protocol { detail, .. }) if detail.contains("HTTP 404") => {
                return Err(EnvError::UnknownTask { task_id: format!("{task_id} (the server says: {detail})") })
            }
            other => other?,
        };
        let session = headers.get(SESSION_HEADER).and_then(|v| v.to_str().ok()).map(str::to_string).ok_or_else(|| EnvError::Protocol {
            backend: self.backend(),
            detail: format!("start_sample: the response has no `{SESSION_HEADER}` header"),
        })?;
        register(self.url(), &session);
        let info = resp.info.clone().unwrap_or_default();
        let mut ep = Episode {
            session,
            index: index.clone(),
            _slot: slot,
            finished: false,
            status: String::new(),
            reward: 0.0,
            metrics: Default::default(),
            success: None,
            detail: None,
            calls: 0,
        };
        Self::absorb(&mut ep, &resp);
        if ep.finished {
            unregister(self.url(), &ep.session);
        }
        let done = ep.finished;
        self.episode = Some(ep);
        let mut features = info.features.unwrap_or_default();
        features.entry("index").or_insert_with(|| json!(index.to_string()));
        Ok(EpisodeStart {
            observation: Observation { text: messages_text(&resp.messages), done, ..Default::default() },
            tools: resp.tools.into_iter().map(ToolSpec::from).collect(),
            max_rounds: info.max_rounds.unwrap_or(self.shared.config.max_rounds),
            task_type: info.task_type.unwrap_or_else(|| self.shared.config.task_set.clone()),
            features,
        })
    }

    async fn step(&mut self, call: &ToolCall) -> Result<Observation, EnvError> {
        let ep = self.episode_mut("step")?;
        if ep.finished {
            return Err(EnvError::State { operation: "step", reason: "the server finished the episode; call reset".into() });
        }
        ep.calls += 1;
        let session = ep.session.clone();
        let message = WireMessage {
            role: "assistant".into(),
            content: Value::String(String::new()),
            tool_calls: vec![WireToolCall {
                id: format!("call_{}", ep.calls),
                kind: function_type(),
                function: WireFunctionCall { name: call.name.clone(), arguments: call.args.to_string() },
            }],
            tool_call_id: None,
        };
        let body = InteractRequest { messages: vec![message] };
        let (_, resp) = self.call("interact", Some(&session), &body, self.shared.config.request_timeout).await?;
        let url = self.shared.config.url.clone();
        let ep = self.episode_mut("step")?;
        Self::absorb(ep, &resp);
        if ep.finished {
            unregister(&url, &ep.session);
        }
        let extended = resp.info.is_some();
        let info = resp.info.unwrap_or_default();
        Ok(Observation {
            text: messages_text(&resp.messages),
            done: resp.finish,
            action_failed: info.action_failed,
            truncated: info.truncated,
            // Without the extension, a sample that completed is taken as committed.
            committed: info.committed || (resp.finish && resp.status == "completed" && !extended),
        })
    }

    async fn evaluate(&mut self) -> Result<Evaluation, EnvError> {
        let ep = self.episode_mut("evaluate")?;
        if !ep.finished {
            return Ok(Evaluation {
                reward: 0.0,
                success: false,
                detail: format!(
                    "sample {} ended before the server finished it (status `{}`): not graded, reward 0",
                    ep.index,
                    if ep.status.is_empty() { "running" } else { ep.status.as_str() }
                ),
            });
        }
        let success = ep.success.unwrap_or(ep.reward >= 1.0);
        let detail = ep.detail.clone().unwrap_or_else(|| {
            format!("sample {}: status `{}`, reward {}, metrics {}", ep.index, ep.status, ep.reward, Value::Object(ep.metrics.clone()))
        });
        Ok(Evaluation { reward: ep.reward, success, detail })
    }

    async fn close(&mut self) -> Result<(), EnvError> {
        self.end_session().await;
        Ok(())
    }
}

impl Drop for HttpEnv {
    /// An environment dropped with its session open (its job was cancelled or timed out)
    /// cancels it from a spawned task; without a runtime, [`cancel_open_sessions`] or the
    /// server's expiry ends it.
    fn drop(&mut self) {
        let Some(ep) = self.episode.take() else { return };
        if ep.finished {
            unregister(&self.shared.config.url, &ep.session);
            return;
        }
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            let client = self.shared.client.clone();
            let url = self.shared.config.url.clone();
            handle.spawn(async move {
                cancel(&client, &url, &ep.session).await;
                unregister(&url, &ep.session);
                drop(ep);
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use infra::Transient;

    #[test]
    fn indices_parse_ranges_and_lists() {
        assert_eq!(parse_indices("0-3").unwrap(), vec![0, 1, 2, 3]);
        assert_eq!(parse_indices("5, 0-1,9").unwrap(), vec![5, 0, 1, 9]);
        assert!(parse_indices("").unwrap_err().contains("is empty"));
        assert!(parse_indices("3-1").unwrap_err().contains("runs backwards; write it as 1-3"));
        assert!(parse_indices("0-2,2").unwrap_err().contains("index 2 is listed twice"));
        assert!(parse_indices("a-3").unwrap_err().contains("`a` in \"a-3\" is not a whole number"));
        assert!(parse_indices("0-99999999").unwrap_err().contains("more than"));
    }

    #[test]
    fn settings_are_checked_by_name() {
        assert!(HttpConfig::new("http://127.0.0.1:5000/", "dbbench").is_ok());
        assert_eq!(HttpConfig::new("http://127.0.0.1:5000/", "dbbench").unwrap().url, "http://127.0.0.1:5000");
        let e = HttpConfig::new("ftp://x", "dbbench").unwrap_err().to_string();
        assert!(e.starts_with("url: `ftp://x") && e.contains("is not an http:// or https:// URL"), "{e}");
        let e = HttpConfig::new("http://u:secret@h:1", "").unwrap_err().to_string();
        assert!(e.contains("task_set: is empty"), "{e}");
        let e = HttpConfig::new("not a url", "x").unwrap_err().to_string();
        assert!(e.starts_with("url:"), "{e}");
        let mut c = HttpConfig::new("http://h:1", "x").unwrap();
        c.concurrency = 0;
        assert!(c.check().unwrap_err().to_string().contains("concurrency: must be at least 1"));
    }

    #[test]
    fn status_errors_are_typed() {
        let s =
            |code: u16, session: Option<&str>| status_error("b", "interact", session, reqwest::StatusCode::from_u16(code).unwrap(), "x");
        assert!(s(503, Some("a")).is_transient());
        assert!(s(429, None).is_transient());
        assert!(s(404, Some("a")).is_transient(), "a lost session: the episode can run again");
        assert!(s(404, Some("a")).to_string().contains("no longer knows session `a`"));
        assert!(!s(400, Some("a")).is_transient());
        assert!(!s(404, None).is_transient());
        assert_eq!(s(400, None).class(), schemas::ErrorClass::Env);
        assert_eq!(s(500, None).class(), schemas::ErrorClass::Infra);
    }

    #[test]
    fn responses_parse_with_and_without_the_extension() {
        let foreign: SampleResponse = serde_json::from_value(json!({
            "status": "running",
            "messages": [{"role": "system", "content": "You are..."}, {"role": "user", "content": [{"type": "text", "text": "Q?"}]}],
            "tools": [{"type": "function", "function": {"name": "execute_sql", "parameters": {"type": "object"}}}],
            "finish": false, "reward": 0, "metrics": {}
        }))
        .unwrap();
        assert_eq!(messages_text(&foreign.messages), "You are...\n\nQ?");
        assert_eq!(ToolSpec::from(foreign.tools[0].clone()).name, "execute_sql");
        assert!(foreign.info.is_none());
        let tool = WireTool::from(&ToolSpec { name: "t".into(), description: "d".into(), parameters: json!({}) });
        assert_eq!(
            serde_json::to_value(&tool).unwrap(),
            json!({"type": "function", "function": {"name": "t", "description": "d", "parameters": {}}})
        );
        assert_eq!(SampleIndex::of_task_id("17"), SampleIndex::Number(17));
        assert_eq!(SampleIndex::of_task_id("a-1"), SampleIndex::Text("a-1".into()));
        let start: StartRequest = serde_json::from_value(json!({"name": "x", "index": 3})).unwrap();
        assert_eq!(start.index, SampleIndex::Number(3));
    }

    #[tokio::test]
    async fn a_server_that_is_not_there_is_a_retryable_backend_error() {
        // Nothing listens on port 1.
        let factory = HttpFactory::new(HttpConfig::new("http://127.0.0.1:1", "dbbench").unwrap()).unwrap();
        let mut env = factory.env();
        let err = env.reset("0", 0).await.unwrap_err();
        assert!(err.is_transient(), "{err}");
        assert!(err.to_string().contains("start_sample: cannot connect"), "{err}");
        assert_eq!(open_sessions(), 0);
        assert!(matches!(env.step(&ToolCall { name: "x".into(), args: json!({}) }).await, Err(EnvError::State { .. })));
    }
}
