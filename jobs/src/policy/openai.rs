//! A [`Policy`] served by any OpenAI-compatible chat-completions endpoint (vLLM, SGLang,
//! llama.cpp's server, llama-cpp-python's server, hosted APIs).
//!
//! This module owns the wire format and the failure handling of that backend:
//! - **Requests**: `POST {base_url}/chat/completions` with the model, the messages, the
//!   sampling settings and `logprobs: true, top_logprobs: 0`. The API key, when one is
//!   needed, is read from the environment variable named by [`OpenAiConfig::api_key_env`]
//!   and sent as a bearer token; it is never logged or shown in errors.
//! - **Tool calls**: [`ToolProtocol::Native`] sends `tools` and reads `tool_calls` (and
//!   also reads explicit JSON call lines in the text, which many models emit instead).
//!   [`ToolProtocol::Text`] is for servers and chat templates without tools (llama.cpp's
//!   `chatml` format drops `tools` silently): the tools and the protocol of
//!   [`text_protocol`] are appended to the system prompt, tool results are sent as user
//!   messages, and the reply is parsed with [`text_protocol::parse`].
//! - **Token ids and log-probabilities**: per-token log-probabilities come from the
//!   response's `choices[0].logprobs.content`. Token ids come from, in order: an integer `id`
//!   on each entry (llama.cpp's C++ server), `token_id:<n>` token strings (vLLM with
//!   `return_tokens_as_token_ids`), or, with [`TokenIds::Auto`], the server's tokenizer
//!   endpoint — `POST /extras/tokenize {"input"}` (llama-cpp-python) or
//!   `POST /tokenize {"content"}` (llama.cpp), probed once. The sampled pieces are
//!   re-tokenized as one text, and piece by piece when that does not give one id per piece;
//!   if neither aligns, `token_ids` stays empty (logged) rather than being wrong.
//! - **Training behind the endpoint** ([`OpenAiConfig::return_token_ids`]): the request
//!   asks for `return_token_ids` (vLLM's field; `harness-s serve` answers it); the
//!   response's `prompt_token_ids` become the turn's prompt fingerprint
//!   ([`schemas::prompt_hash`]) and `choices[0].token_ids` its sampled ids, so the learner can
//!   check that it scores the very context the server sampled from. The weights that
//!   answered are read from the `x-harness-s-checkpoint` response header and reported by
//!   [`Policy::checkpoint`]; a server that does not name them is taken to serve
//!   [`OpenAiConfig::checkpoint`] (the checkpoint the scheduler synced it to), else the model
//!   name.
//! - **Failures**: every failure is a typed [`PolicyError`]. Timeouts, unreachable
//!   servers, HTTP 429/5xx and bodies that are not a chat completion are retried with
//!   exponential backoff and jitter (`backon`) while attempts and the wall-clock retry
//!   budget last; then the call fails with [`PolicyError::RetriesExhausted`] carrying the
//!   last error, which the episode driver records on the trajectory row.
//!
//! ```no_run
//! # async fn demo() -> Result<(), jobs::policy::PolicyError> {
//! use jobs::policy::openai::{OpenAiConfig, OpenAiPolicy, ToolProtocol};
//! use jobs::policy::{Message, Policy, SamplingParams};
//! let mut config = OpenAiConfig::new("http://127.0.0.1:8080/v1", "smollm2");
//! config.tool_protocol = ToolProtocol::Text;
//! let policy = OpenAiPolicy::new(config)?;
//! let out = policy
//!     .chat(&[Message::new(schemas::Role::User, "Say hi")], &[], &SamplingParams::default())
//!     .await?;
//! println!("{} ({} logprobs)", out.text, out.logprobs.len());
//! # Ok(()) }
//! ```

use infra::Transient;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use backon::{ExponentialBuilder, Retryable};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::sync::OnceCell;

use super::{text_protocol, FinishReason, Message, Policy, PolicyError, PolicyOutput, SamplingParams};
use crate::env::{ToolCall, ToolSpec};
use schemas::Role;

/// How tools are offered to the model and calls read back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolProtocol {
    /// OpenAI `tools` / `tool_calls`.
    #[default]
    Native,
    /// The documented text protocol of [`text_protocol`], for models without tool calls.
    Text,
}

impl std::str::FromStr for ToolProtocol {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "native" => Ok(Self::Native),
            "text" => Ok(Self::Text),
            other => Err(format!("unknown tool protocol `{other}`: use `native` or `text`")),
        }
    }
}

/// Where sampled token ids come from when the response does not carry them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenIds {
    /// Ask the server's tokenizer endpoint (probed once).
    #[default]
    Auto,
    /// Only ids the response carries; never call a tokenizer endpoint.
    ResponseOnly,
}

/// Settings of an OpenAI-compatible policy (a `[policy]` table of a run spec).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpenAiConfig {
    /// Base URL including the API prefix, e.g. `http://127.0.0.1:8080/v1`.
    pub base_url: String,
    /// Model name sent with each request and recorded as the policy checkpoint.
    pub model: String,
    /// Name of the environment variable holding the API key (none: no key is sent).
    #[serde(default)]
    pub api_key_env: Option<String>,
    #[serde(default)]
    pub tool_protocol: ToolProtocol,
    /// Request per-token log-probabilities (`logprobs: true, top_logprobs: 0`).
    #[serde(default = "default_true")]
    pub logprobs: bool,
    #[serde(default)]
    pub token_ids: TokenIds,
    /// Limit of one HTTP attempt, seconds.
    #[serde(default = "default_request_timeout")]
    pub request_timeout_s: f64,
    #[serde(default = "default_connect_timeout")]
    pub connect_timeout_s: f64,
    /// Attempts per call, the first included.
    #[serde(default = "default_max_attempts")]
    pub max_attempts: u32,
    /// No retry starts once this much wall-clock time has passed since the call began.
    #[serde(default = "default_retry_budget")]
    pub retry_budget_s: f64,
    #[serde(default = "default_min_backoff")]
    pub min_backoff_ms: u64,
    #[serde(default = "default_max_backoff")]
    pub max_backoff_ms: u64,
    /// Ask for the prompt's and the reply's token ids (`return_token_ids: true`) and record
    /// the prompt fingerprint from them; training on the endpoint's rollouts needs it.
    #[serde(default)]
    pub return_token_ids: bool,
    /// The checkpoint the endpoint is expected to serve (set by the scheduler after a weight
    /// sync); recorded on rows when the server does not name its weights itself.
    #[serde(default)]
    pub checkpoint: Option<String>,
    /// Under `weight_sync = "lora"`, once a trained step is synced: the name the run's
    /// adapter is served under ([`super::weight_sync::adapter_name`]); calls ask for it as
    /// their `model`, and a server that lost it is asked to load `checkpoint` again.
    #[serde(default)]
    pub adapter: Option<String>,
    /// The server decodes in harness-s's grammars (`harness-s serve`): a constrained call
    /// sends `constrain` (e.g. `"harness_patch"`) and refuses an answer that does not echo
    /// it. Off: a constrained call fails with a configuration error.
    #[serde(default)]
    pub grammars: bool,
}

fn default_true() -> bool {
    true
}
fn default_request_timeout() -> f64 {
    120.0
}
fn default_connect_timeout() -> f64 {
    10.0
}
fn default_max_attempts() -> u32 {
    4
}
fn default_retry_budget() -> f64 {
    300.0
}
fn default_min_backoff() -> u64 {
    500
}
fn default_max_backoff() -> u64 {
    20_000
}

impl OpenAiConfig {
    /// The weight-sync endpoint of this server, with the key `api_key_env` names (the
    /// routes of [`super::weight_sync`] live at the server's root).
    pub fn weight_endpoint(&self, timeout: std::time::Duration) -> Result<super::weight_sync::Endpoint, super::weight_sync::SyncError> {
        let key = self.api_key_env.as_ref().and_then(|v| std::env::var(v).ok()).filter(|k| !k.is_empty());
        super::weight_sync::Endpoint::new(&self.base_url, key, timeout)
    }

    /// A config with the defaults: native tools, logprobs on, 120 s per attempt, 4
    /// attempts within 300 s, backoff 0.5 s doubling to 20 s.
    pub fn new(base_url: impl Into<String>, model: impl Into<String>) -> Self {
        OpenAiConfig {
            base_url: base_url.into(),
            model: model.into(),
            api_key_env: None,
            tool_protocol: ToolProtocol::Native,
            logprobs: true,
            token_ids: TokenIds::Auto,
            request_timeout_s: default_request_timeout(),
            connect_timeout_s: default_connect_timeout(),
            max_attempts: default_max_attempts(),
            retry_budget_s: default_retry_budget(),
            min_backoff_ms: default_min_backoff(),
            max_backoff_ms: default_max_backoff(),
            return_token_ids: false,
            checkpoint: None,
            adapter: None,
            grammars: false,
        }
    }
}

/// The API key; its `Debug` never shows the value.
#[derive(Clone)]
struct ApiKey(String);

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

/// The tokenizer endpoint a server offers, found by probing once.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Tokenizer {
    /// llama-cpp-python: `POST /extras/tokenize {"input"}`; `prefix` ids (BOS) are dropped.
    Extras {
        prefix: usize,
    },
    /// llama.cpp: `POST /tokenize {"content", "add_special": false}`.
    LlamaCpp,
    None,
}

/// An OpenAI-compatible chat-completions policy.
#[derive(Debug)]
pub struct OpenAiPolicy {
    config: OpenAiConfig,
    http: reqwest::Client,
    api_key: Option<ApiKey>,
    chat_url: String,
    /// Server root (base URL without the `/v1` API prefix), where tokenizer routes live.
    root_url: String,
    tokenizer: OnceCell<Tokenizer>,
    /// The weights the server last said it answered with (`x-harness-s-checkpoint`).
    served: std::sync::Mutex<Option<String>>,
}

impl OpenAiPolicy {
    /// Checks the config, reads the API key variable, builds the HTTP client.
    pub fn new(config: OpenAiConfig) -> Result<Self, PolicyError> {
        let base = config.base_url.trim_end_matches('/').to_string();
        let parsed = url::Url::parse(&base)
            .map_err(|e| PolicyError::Config(format!("base_url `{base}` is not a URL ({e}); e.g. http://127.0.0.1:8080/v1")))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(PolicyError::Config(format!("base_url `{base}` must start with http:// or https://")));
        }
        if config.model.trim().is_empty() {
            return Err(PolicyError::Config("model is empty: name the served model (`--model`)".into()));
        }
        if config.max_attempts == 0 {
            return Err(PolicyError::Config("max_attempts must be at least 1".into()));
        }
        for (name, value) in [
            ("request_timeout_s", config.request_timeout_s),
            ("connect_timeout_s", config.connect_timeout_s),
            ("retry_budget_s", config.retry_budget_s),
        ] {
            if !(value.is_finite() && value > 0.0) {
                return Err(PolicyError::Config(format!("{name} must be a positive number of seconds, got {value}")));
            }
        }
        let api_key = match &config.api_key_env {
            None => None,
            Some(var) => match std::env::var(var) {
                Ok(key) if !key.is_empty() => Some(ApiKey(key)),
                _ => {
                    return Err(PolicyError::Config(format!(
                        "api_key_env names `{var}`, but that environment variable is not set or empty: export it, or drop api_key_env for a server without keys"
                    )))
                }
            },
        };
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs_f64(config.request_timeout_s))
            .connect_timeout(Duration::from_secs_f64(config.connect_timeout_s))
            .build()
            .map_err(|e| PolicyError::Config(format!("cannot build the HTTP client: {e}")))?;
        let root_url = super::weight_sync::server_root(&base);
        Ok(OpenAiPolicy {
            chat_url: format!("{base}/chat/completions"),
            root_url,
            http,
            api_key,
            tokenizer: OnceCell::new(),
            served: std::sync::Mutex::new(None),
            config,
        })
    }

    pub fn config(&self) -> &OpenAiConfig {
        &self.config
    }

    /// Checks that the server answers (`GET {base_url}/models`, within the connect timeout
    /// plus 10 s): a refused connection, a timeout or a refused key is an error; any other
    /// answer, even 404 from a server without that route, counts as reachable.
    pub async fn probe(&self) -> Result<(), PolicyError> {
        let url = format!("{}/models", self.config.base_url.trim_end_matches('/'));
        let request = self.with_key(self.http.get(&url).timeout(Duration::from_secs_f64(self.config.connect_timeout_s + 10.0)));
        let response = request.send().await.map_err(|e| PolicyError::Unreachable { endpoint: url.clone(), detail: error_chain(&e) })?;
        match response.status().as_u16() {
            401 | 403 => {
                let text = response.text().await.unwrap_or_default();
                Err(http_error(401, &text, self.api_key.is_some()))
            }
            _ => Ok(()),
        }
    }

    /// The request body of one call (pure; exposed for inspection and tests).
    pub fn request_body(&self, messages: &[Message], tools: &[ToolSpec], sampling: &SamplingParams) -> Value {
        let mut body = json!({
            "model": self.config.adapter.as_deref().unwrap_or(&self.config.model),
            "messages": wire_messages(messages, tools, self.config.tool_protocol),
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_tokens": sampling.max_tokens,
        });
        let obj = body.as_object_mut().expect("object literal");
        if let Some(seed) = sampling.seed {
            obj.insert("seed".into(), json!(seed));
        }
        if !sampling.stop.is_empty() {
            obj.insert("stop".into(), json!(sampling.stop));
        }
        if self.config.logprobs {
            obj.insert("logprobs".into(), json!(true));
            obj.insert("top_logprobs".into(), json!(0));
        }
        if self.config.return_token_ids {
            obj.insert("return_token_ids".into(), json!(true));
        }
        if let Some(c) = sampling.constrain {
            obj.insert("constrain".into(), json!(c.wire_name()));
        }
        if self.config.tool_protocol == ToolProtocol::Native && !tools.is_empty() {
            let wire_tools: Vec<Value> = tools
                .iter()
                .map(
                    |t| json!({"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}),
                )
                .collect();
            obj.insert("tools".into(), Value::Array(wire_tools));
            obj.insert("tool_choice".into(), json!("auto"));
        }
        body
    }

    /// One HTTP attempt: send, check the status, decode the completion.
    async fn attempt(&self, body: &Value) -> Result<Completion, PolicyError> {
        let (text, served) = self.post(&self.chat_url, body).await?;
        let mut completion = parse_completion(&text)?;
        completion.checkpoint = served;
        Ok(completion)
    }

    /// `request` with the API key, when there is one.
    fn with_key(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.api_key {
            Some(key) => request.bearer_auth(&key.0),
            None => request,
        }
    }

    /// POSTs `body` as JSON to `url`: the answer's text and the weights it names
    /// (`x-harness-s-checkpoint`), or the transport error or the typed error status.
    async fn post(&self, url: &str, body: &Value) -> Result<(String, Option<String>), PolicyError> {
        let response = self.with_key(self.http.post(url).json(body)).send().await.map_err(|e| self.transport_error(e))?;
        let status = response.status();
        let served = response.headers().get(CHECKPOINT_HEADER).and_then(|v| v.to_str().ok()).map(str::to_string);
        let text = response.text().await.map_err(|e| self.transport_error(e))?;
        // a server that lost the run's adapter (restarted) answers 404 for its name
        if let (404, Some(name), Some(expected)) = (status.as_u16(), &self.config.adapter, &self.config.checkpoint) {
            tracing::warn!(endpoint = %self.root_url, adapter = %name, "the policy endpoint does not serve the run's adapter; loading it again");
            self.reload(expected).await?;
            return Err(PolicyError::StaleWeights { expected: expected.clone(), served: format!("no adapter `{name}`") });
        }
        if !status.is_success() {
            return Err(http_error(status.as_u16(), &text, self.api_key.is_some()));
        }
        Ok((text, served))
    }

    /// With a synced checkpoint ([`OpenAiConfig::checkpoint`]): a reply from other weights
    /// than those (the server restarted on its starting weights) is not used; the server is
    /// asked to load the synced weights again and the call fails retryably, so its retry
    /// samples from them.
    async fn check_weights(&self, c: &Completion) -> Result<(), PolicyError> {
        let (Some(expected), Some(served)) = (&self.config.checkpoint, &c.checkpoint) else {
            return Ok(());
        };
        if super::weight_sync::same_weights(served, expected) {
            return Ok(());
        }
        tracing::warn!(endpoint = %self.root_url, served = %served, expected = %expected, "the policy endpoint serves other weights than the synced ones; loading them again");
        self.reload(expected).await?;
        Err(PolicyError::StaleWeights { expected: expected.clone(), served: served.clone() })
    }

    /// Asks the server to load the synced weights `expected` again: the run's adapter under
    /// its name, or the weights themselves. A failure is logged: the call that found the
    /// server on other weights fails retryably either way.
    async fn reload(&self, expected: &str) -> Result<(), PolicyError> {
        let key = self.api_key.as_ref().map(|k| k.0.clone());
        let timeout = Duration::from_secs_f64(self.config.retry_budget_s);
        let endpoint =
            super::weight_sync::Endpoint::new(&self.config.base_url, key, timeout).map_err(|e| PolicyError::Config(e.to_string()))?;
        let reloaded = match &self.config.adapter {
            Some(name) => endpoint.ensure_adapter(name, expected, timeout).await,
            None => endpoint.ensure(expected, timeout).await,
        };
        if let Err(e) = reloaded {
            tracing::warn!(error = %e, "reloading the synced weights failed");
        }
        Ok(())
    }

    fn transport_error(&self, e: reqwest::Error) -> PolicyError {
        if e.is_timeout() {
            PolicyError::Timeout { seconds: self.config.request_timeout_s }
        } else {
            // Connection refused/reset, a body cut short: the server side failed.
            PolicyError::Unreachable { endpoint: self.chat_url.clone(), detail: error_chain(&e) }
        }
    }

    /// Token ids of the sampled pieces, or empty when they cannot be known exactly.
    async fn token_ids(&self, pieces: &[LogprobEntry]) -> Vec<u32> {
        if pieces.is_empty() {
            return Vec::new();
        }
        if let Some(ids) = pieces.iter().map(LogprobEntry::carried_id).collect::<Option<Vec<u32>>>() {
            return ids;
        }
        if self.config.token_ids == TokenIds::ResponseOnly {
            return Vec::new();
        }
        let tokenizer = self.tokenizer.get_or_init(|| self.probe_tokenizer()).await;
        if *tokenizer == Tokenizer::None {
            return Vec::new();
        }
        let joined: String = pieces.iter().map(|p| p.token.as_str()).collect();
        match self.tokenize(tokenizer, &joined).await {
            Ok(ids) if ids.len() == pieces.len() => return ids,
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %e, "tokenizer endpoint failed; token ids left empty for this turn");
                return Vec::new();
            }
        }
        // The pieces re-tokenize differently as one text (merges across piece borders):
        // map each piece on its own, which is exact when each is one vocabulary entry.
        let mut ids = Vec::with_capacity(pieces.len());
        for piece in pieces {
            match self.tokenize(tokenizer, &piece.token).await {
                Ok(one) if one.len() == 1 => ids.push(one[0]),
                _ => {
                    tracing::warn!(
                        pieces = pieces.len(),
                        "sampled pieces do not map one-to-one to token ids; token ids left empty for this turn"
                    );
                    return Vec::new();
                }
            }
        }
        ids
    }

    async fn probe_tokenizer(&self) -> Tokenizer {
        if let Ok(prefix) = self.post_tokenize(&format!("{}/extras/tokenize", self.root_url), json!({"input": ""})).await {
            return Tokenizer::Extras { prefix: prefix.len() };
        }
        if self.post_tokenize(&format!("{}/tokenize", self.root_url), json!({"content": "a", "add_special": false})).await.is_ok() {
            return Tokenizer::LlamaCpp;
        }
        tracing::warn!(server = %self.root_url, "the server has no tokenizer endpoint (/extras/tokenize or /tokenize): token ids will be empty");
        Tokenizer::None
    }

    async fn tokenize(&self, tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>, PolicyError> {
        match tokenizer {
            Tokenizer::Extras { prefix } => {
                let ids = self.post_tokenize(&format!("{}/extras/tokenize", self.root_url), json!({"input": text})).await?;
                Ok(ids.get(*prefix..).unwrap_or_default().to_vec())
            }
            Tokenizer::LlamaCpp => {
                self.post_tokenize(
                    &format!("{}/tokenize", self.root_url),
                    json!({"content": text, "add_special": false, "parse_special": true}),
                )
                .await
            }
            Tokenizer::None => Ok(Vec::new()),
        }
    }

    async fn post_tokenize(&self, url: &str, body: Value) -> Result<Vec<u32>, PolicyError> {
        #[derive(Deserialize)]
        struct Tokens {
            tokens: Vec<u32>,
        }
        let (text, _) = self.post(url, &body).await?;
        serde_json::from_str::<Tokens>(&text)
            .map(|t| t.tokens)
            .map_err(|e| PolicyError::InvalidOutput { detail: format!("tokenizer answer from {url} is not {{\"tokens\": [...]}}: {e}") })
    }
}

#[async_trait]
impl Policy for OpenAiPolicy {
    /// The weights the server last named, else the synced checkpoint, else the model name.
    fn checkpoint(&self) -> String {
        let served = self.served.lock().unwrap_or_else(|e| e.into_inner()).clone();
        served.or_else(|| self.config.checkpoint.clone()).unwrap_or_else(|| self.config.model.clone())
    }

    async fn chat(&self, messages: &[Message], tools: &[ToolSpec], sampling: &SamplingParams) -> Result<PolicyOutput, PolicyError> {
        if let (Some(c), false) = (sampling.constrain, self.config.grammars) {
            return Err(PolicyError::Config(format!(
                "constrained decoding ({c:?}) needs the native backend or an endpoint served by `harness-s serve`; use one of those or drop the constraint"
            )));
        }
        let body = self.request_body(messages, tools, sampling);
        let started = Instant::now();
        let attempts = AtomicU32::new(0);
        let budget = Duration::from_secs_f64(self.config.retry_budget_s);
        let backoff = ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(self.config.min_backoff_ms))
            .with_max_delay(Duration::from_millis(self.config.max_backoff_ms.max(self.config.min_backoff_ms)))
            .with_max_times(self.config.max_attempts as usize - 1)
            .with_jitter();
        let completion = (|| async {
            attempts.fetch_add(1, Ordering::Relaxed);
            let c = self.attempt(&body).await?;
            self.check_weights(&c).await?;
            if let Some(want) = sampling.constrain {
                if c.constrained.as_deref() != Some(want.wire_name()) {
                    return Err(PolicyError::Config(format!(
                        "{} answered without decoding in the `{}` grammar: it is not `harness-s serve`; drop the constraint for this endpoint",
                        self.root_url,
                        want.wire_name()
                    )));
                }
            }
            Ok(c)
        })
        .retry(backoff)
        .sleep(tokio::time::sleep)
        .when(<PolicyError as Transient>::is_transient)
        // The budget is wall-clock: no retry starts if its backoff would end past it.
        .adjust(|_, delay| delay.filter(|d| started.elapsed() + *d < budget))
        .notify(|err, delay| {
            tracing::warn!(
                model = %self.config.model,
                attempt = attempts.load(Ordering::Relaxed),
                retry_in_ms = delay.as_millis() as u64,
                class = ?err.class(),
                error = %err,
                "policy call failed; retrying"
            )
        })
        .await;
        let mut completion = match completion {
            Ok(c) => c,
            Err(e) if e.is_transient() => {
                return Err(PolicyError::RetriesExhausted {
                    attempts: attempts.load(Ordering::Relaxed),
                    elapsed_s: started.elapsed().as_secs_f64(),
                    last: Box::new(e),
                })
            }
            Err(e) => return Err(e),
        };

        let offered: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
        let mut tool_calls = completion.tool_calls;
        if tool_calls.is_empty() && !tools.is_empty() {
            let shorthands = self.config.tool_protocol == ToolProtocol::Text;
            tool_calls = text_protocol::parse(&completion.text, &offered, shorthands);
        }
        if let Some(served) = &completion.checkpoint {
            *self.served.lock().unwrap_or_else(|e| e.into_inner()) = Some(served.clone());
        }
        let logprobs: Vec<f32> = completion.logprobs.iter().map(|p| p.logprob as f32).collect();
        let token_ids = match completion.token_ids.take() {
            // Ids the server sampled, when they align with the log-probabilities.
            Some(ids) if logprobs.is_empty() || ids.len() == logprobs.len() => ids,
            _ => self.token_ids(&completion.logprobs).await,
        };
        // The prompt the server sampled from, when it says: the learner checks its rebuilt
        // context against this fingerprint.
        let (prompt_hash, prompt_tokens) = match &completion.prompt_ids {
            Some(ids) => (Some(schemas::prompt_hash(ids)), ids.len() as u32),
            None => (None, completion.prompt_tokens),
        };
        let finish_reason = match completion.finish_reason {
            FinishReason::Stop if !tool_calls.is_empty() => FinishReason::ToolCalls,
            other => other,
        };
        let completion_tokens = completion.completion_tokens.unwrap_or(logprobs.len() as u32);
        tracing::debug!(
            model = %self.config.model,
            attempts = attempts.load(Ordering::Relaxed),
            ms = started.elapsed().as_millis() as u64,
            prompt_tokens = completion.prompt_tokens,
            completion_tokens,
            tool_calls = tool_calls.len(),
            "policy call done"
        );
        Ok(PolicyOutput {
            prompt_hash,
            text: completion.text,
            tool_calls,
            token_ids,
            logprobs,
            prompt_tokens,
            completion_tokens,
            finish_reason,
        })
    }
}

/// For a tool result that answers no recorded call: when the message before it is an
/// assistant message whose text shows a call in the text protocol (a worked example a
/// harness placed as chat turns), that call becomes the message's `tool_calls` and the
/// result answers it, so the server sees a tool result where the policy saw one. Returns
/// the call's id.
fn call_shown_in_text(out: &mut [Value], i: usize, tools: &[ToolSpec]) -> Option<String> {
    let last = out.last_mut()?;
    if last["role"] != "assistant" || last.get("tool_calls").is_some() {
        return None;
    }
    let offered: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
    let call = text_protocol::parse(last["content"].as_str()?, &offered, true).into_iter().next()?;
    let id = format!("call_{i}_shown");
    last["tool_calls"] = json!([{"id": id, "type": "function", "function": {"name": call.name, "arguments": call.args.to_string()}}]);
    Some(id)
}

/// Messages in the wire format of the chosen protocol (pure).
///
/// Native: assistant calls get ids `call_<message>_<k>`, and each later tool message answers
/// the oldest unanswered call; a tool message with no open call is sent as a user message.
/// Text: system messages before the first other message are merged and followed by the
/// protocol instructions; later system messages and tool results become user messages
/// (simple chat templates keep only one leading system message and drop `tool` roles);
/// assistant turns whose text does not show their calls get them in the protocol form.
pub fn wire_messages(messages: &[Message], tools: &[ToolSpec], protocol: ToolProtocol) -> Vec<Value> {
    let mut out = Vec::with_capacity(messages.len() + 1);
    match protocol {
        ToolProtocol::Native => {
            let mut open_calls: VecDeque<String> = VecDeque::new();
            for (i, m) in messages.iter().enumerate() {
                match m.role {
                    Role::Assistant if !m.tool_calls.is_empty() => {
                        let calls: Vec<Value> = m
                            .tool_calls
                            .iter()
                            .enumerate()
                            .map(|(k, c)| {
                                let id = format!("call_{i}_{k}");
                                open_calls.push_back(id.clone());
                                json!({"id": id, "type": "function", "function": {"name": c.name, "arguments": c.args.to_string()}})
                            })
                            .collect();
                        out.push(json!({"role": "assistant", "content": m.content, "tool_calls": calls}));
                    }
                    Role::Tool => match open_calls.pop_front().or_else(|| call_shown_in_text(&mut out, i, tools)) {
                        Some(id) => out.push(json!({"role": "tool", "tool_call_id": id, "content": m.content})),
                        None => out.push(json!({"role": "user", "content": m.content})),
                    },
                    role => out.push(json!({"role": role.as_str(), "content": m.content})),
                }
            }
        }
        ToolProtocol::Text => {
            let offered: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
            let leading = messages.iter().take_while(|m| m.role == Role::System).count();
            let mut system: Vec<&str> = messages[..leading].iter().map(|m| m.content.as_str()).collect();
            let instructions = if tools.is_empty() { String::new() } else { text_protocol::instructions(tools) };
            if !instructions.is_empty() {
                system.push(&instructions);
            }
            if !system.is_empty() {
                out.push(json!({"role": "system", "content": system.join("\n\n")}));
            }
            for m in &messages[leading..] {
                match m.role {
                    Role::Assistant => {
                        // A call the text does not show (forced or rewritten by a hook) is
                        // appended in the protocol's form, so the model sees what was done.
                        let shown = text_protocol::parse(&m.content, &offered, true);
                        let hidden: Vec<ToolCall> = m.tool_calls.iter().filter(|c| !shown.contains(c)).cloned().collect();
                        let content = match (m.content.trim().is_empty(), hidden.is_empty()) {
                            (_, true) => m.content.clone(),
                            (true, false) => text_protocol::render_calls(&hidden),
                            (false, false) => format!("{}\n{}", m.content.trim_end(), text_protocol::render_calls(&hidden)),
                        };
                        out.push(json!({"role": "assistant", "content": content}));
                    }
                    Role::User | Role::Tool | Role::System => out.push(json!({"role": "user", "content": m.content})),
                }
            }
        }
    }
    out
}

/// One decoded completion.
#[derive(Debug)]
struct Completion {
    text: String,
    tool_calls: Vec<ToolCall>,
    logprobs: Vec<LogprobEntry>,
    prompt_tokens: u32,
    completion_tokens: Option<u32>,
    finish_reason: FinishReason,
    /// `prompt_token_ids` (vLLM's name, at the top level or on the choice).
    prompt_ids: Option<Vec<u32>>,
    /// `choices[0].token_ids`.
    token_ids: Option<Vec<u32>>,
    /// The weights the server named in [`CHECKPOINT_HEADER`].
    checkpoint: Option<String>,
    /// The grammar the server says it decoded in (`constrain`, `harness-s serve`'s field).
    constrained: Option<String>,
}

/// The response header in which `harness-s serve` names the weights that answered.
pub const CHECKPOINT_HEADER: &str = "x-harness-s-checkpoint";

#[derive(Debug, Deserialize)]
struct LogprobEntry {
    token: String,
    logprob: f64,
    /// llama.cpp's C++ server sends the sampled token id.
    #[serde(default)]
    id: Option<u32>,
}

impl LogprobEntry {
    fn carried_id(&self) -> Option<u32> {
        self.id.or_else(|| self.token.strip_prefix("token_id:").and_then(|n| n.parse().ok()))
    }
}

/// Decodes a chat-completion body; anything else is [`PolicyError::InvalidOutput`].
fn parse_completion(body: &str) -> Result<Completion, PolicyError> {
    #[derive(Deserialize)]
    struct Response {
        choices: Vec<Choice>,
        #[serde(default)]
        usage: Option<Usage>,
        #[serde(default)]
        prompt_token_ids: Option<Vec<u32>>,
        #[serde(default)]
        constrain: Option<String>,
    }
    #[derive(Deserialize)]
    struct Choice {
        message: ResponseMessage,
        #[serde(default)]
        finish_reason: Option<String>,
        #[serde(default)]
        logprobs: Option<ChoiceLogprobs>,
        #[serde(default)]
        token_ids: Option<Vec<u32>>,
        #[serde(default)]
        prompt_token_ids: Option<Vec<u32>>,
    }
    #[derive(Deserialize)]
    struct ResponseMessage {
        #[serde(default)]
        content: Option<String>,
        #[serde(default)]
        tool_calls: Option<Vec<ResponseToolCall>>,
    }
    #[derive(Deserialize)]
    struct ResponseToolCall {
        function: ResponseFunction,
    }
    #[derive(Deserialize)]
    struct ResponseFunction {
        name: String,
        #[serde(default)]
        arguments: Value,
    }
    #[derive(Deserialize)]
    struct ChoiceLogprobs {
        #[serde(default)]
        content: Option<Vec<LogprobEntry>>,
    }
    #[derive(Deserialize)]
    struct Usage {
        #[serde(default)]
        prompt_tokens: u32,
        #[serde(default)]
        completion_tokens: Option<u32>,
    }

    let response: Response = serde_json::from_str(body)
        .map_err(|e| PolicyError::InvalidOutput { detail: format!("the answer is not a chat completion ({e}): {}", excerpt(body)) })?;
    let Some(choice) = response.choices.into_iter().next() else {
        return Err(PolicyError::InvalidOutput { detail: format!("the completion has no choices: {}", excerpt(body)) });
    };
    let tool_calls = choice
        .message
        .tool_calls
        .unwrap_or_default()
        .into_iter()
        .map(|c| {
            // Arguments arrive as a JSON string; one the model garbled is passed on as the
            // raw string so the environment answers with an error observation.
            let args = match c.function.arguments {
                Value::String(s) => serde_json::from_str(&s).unwrap_or(Value::String(s)),
                Value::Null => json!({}),
                other => other,
            };
            ToolCall { name: c.function.name, args }
        })
        .collect();
    let finish_reason = match choice.finish_reason.as_deref() {
        Some("length") => FinishReason::Length,
        Some("tool_calls" | "function_call") => FinishReason::ToolCalls,
        _ => FinishReason::Stop,
    };
    Ok(Completion {
        text: choice.message.content.unwrap_or_default(),
        tool_calls,
        logprobs: choice.logprobs.and_then(|l| l.content).unwrap_or_default(),
        prompt_tokens: response.usage.as_ref().map(|u| u.prompt_tokens).unwrap_or(0),
        completion_tokens: response.usage.and_then(|u| u.completion_tokens),
        finish_reason,
        prompt_ids: response.prompt_token_ids.or(choice.prompt_token_ids),
        token_ids: choice.token_ids,
        checkpoint: None,
        constrained: response.constrain,
    })
}

/// Types an error status; context overflows become [`PolicyError::ContextLength`].
fn http_error(status: u16, body: &str, sent_key: bool) -> PolicyError {
    let parsed: Option<Value> = serde_json::from_str(body).ok();
    let message = parsed
        .as_ref()
        .and_then(|v| v.pointer("/error/message").or_else(|| v.get("detail")).or_else(|| v.get("message")))
        .map(|m| m.as_str().map(str::to_string).unwrap_or_else(|| m.to_string()))
        .unwrap_or_else(|| body.to_string());
    let code = parsed.as_ref().and_then(|v| v.pointer("/error/code")).and_then(Value::as_str).unwrap_or("");
    let lower = message.to_ascii_lowercase();
    if (400..500).contains(&status)
        && (code == "context_length_exceeded" || lower.contains("maximum context length") || lower.contains("exceed context window"))
    {
        // "Requested tokens (2100) exceed context window of 2048", "maximum context length
        // is 2048 tokens. However, you requested 2100 tokens": the larger number is the ask.
        let numbers: Vec<u64> = message.split(|c: char| !c.is_ascii_digit()).filter_map(|n| n.parse().ok()).collect();
        let tokens = numbers.iter().copied().max().unwrap_or(0);
        let limit = numbers.iter().copied().filter(|&n| n != tokens).max().unwrap_or(0);
        return PolicyError::ContextLength { tokens, limit };
    }
    let hint = match status {
        401 | 403 if sent_key => " (check the key in the variable named by api_key_env)",
        401 | 403 => " (the server wants a key: set api_key_env to the name of a variable holding it)",
        404 => " (check base_url, which must include the API prefix such as /v1, and the model name)",
        _ => "",
    };
    PolicyError::Http { status, detail: format!("{}{hint}", excerpt(&message)) }
}

fn excerpt(text: &str) -> String {
    const MAX: usize = 300;
    let text = text.trim();
    if text.len() <= MAX {
        return text.to_string();
    }
    let mut end = MAX;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes)", &text[..end], text.len())
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

#[cfg(test)]
mod tests;
