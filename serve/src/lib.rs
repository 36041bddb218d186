//! `harness-s serve`: an OpenAI-compatible HTTP server over the native batching engine.
//!
//! Why it exists: at scale rollouts come from inference servers and the learner runs
//! apart; this server is that inference server for the native model, so the same spec
//! that samples in process can sample through an endpoint, and a learner can push new
//! weights into it between updates.
//!
//! - `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`, `GET /health`.
//!   Concurrent requests are decoded together by the engine (continuous batching);
//!   `logprobs` / `top_logprobs`, and the sampled token ids (`return_token_ids`, as vLLM
//!   names it; each log-probability entry also carries its `id`, as llama.cpp's server
//!   does). Tools go through the text protocol (the model has no tool-call channel) and
//!   come back as `tool_calls`.
//! - `POST /update_weights_from_disk {"model_path"}` (SGLang's request and response): a
//!   checkpoint folder, a GGUF file, or a store URL (`file://`, `s3://`) of a checkpoint
//!   folder as the learner writes it. The new weights get their own engine; requests in
//!   flight finish on the old weights, requests that arrive after the reply use the new
//!   ones. `/v1/models` and the `x-harness-s-checkpoint` header (and each response's
//!   `system_fingerprint`) name the loaded checkpoint.
//!   A LoRA adapter folder (PEFT's `adapter_config.json` and `adapter_model.safetensors`, as a
//!   LoRA run's checkpoint holds them) is loaded over the weights the server started with and
//!   merged: a LoRA run syncs its adapter, not full weights.
//! - `POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace"}` and
//!   `POST /v1/unload_lora_adapter {"lora_name"}` (vLLM's): an adapter over the base, served
//!   as `model = lora_name` beside the base; `/v1/models` lists it with its `parent`.
//! - Bad requests get HTTP 400 with the OpenAI error body naming the field, never a crash.
//!
//! [`env`] is the other server of this crate: `harness-s env serve`, the DBBench
//! environment over AgentBench's controller protocol (same HTTP stack, no model).

pub mod env;
pub mod openai;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

use jobs::policy::PolicyError;
use native::infer::engine::EngineConfig;
use native::infer::policy::NativePolicy;
use native::model::Tokenizer;
use openai::BadRequest;

/// Why the server could not start or load weights.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Native(#[from] native::NativeError),
    #[error("{0}")]
    Weights(String),
}

/// The loaded weights: a policy (engine + tokenizer) and the checkpoint it names.
struct Loaded {
    policy: NativePolicy,
    checkpoint: String,
}

/// What the handlers share.
pub struct AppState {
    /// The name clients send as `model`.
    served_name: String,
    current: RwLock<Arc<Loaded>>,
    /// The weights the server started with: what an adapter is loaded over.
    base: PathBuf,
    /// LoRA adapters loaded by name (`/v1/load_lora_adapter`), each merged into its own copy
    /// of the base weights; a request names one as its `model`.
    adapters: RwLock<std::collections::BTreeMap<String, Arc<Loaded>>>,
    device: native::device::Device,
    engine: EngineConfig,
    /// The most reply tokens one request may ask for (`harness-s serve --max-tokens`).
    max_tokens: u32,
    /// One weight update at a time.
    updating: tokio::sync::Mutex<()>,
    counter: AtomicU64,
}

impl AppState {
    /// Loads `model` (a GGUF file or a safetensors folder) and starts its engine; a request
    /// may ask for at most `max_tokens` reply tokens (and never beyond the model's context).
    pub fn load(
        model: &Path,
        served_name: String,
        device: native::device::Device,
        engine: EngineConfig,
        max_tokens: u32,
    ) -> Result<Arc<AppState>, ServeError> {
        let policy = NativePolicy::load(model, device, engine.clone())?;
        let loaded = Loaded { policy, checkpoint: model.display().to_string() };
        Ok(Arc::new(AppState {
            served_name,
            current: RwLock::new(Arc::new(loaded)),
            base: model.to_path_buf(),
            adapters: Default::default(),
            device,
            engine,
            max_tokens: max_tokens.max(1),
            updating: Default::default(),
            counter: AtomicU64::new(0),
        }))
    }

    fn current(&self) -> Arc<Loaded> {
        self.current.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The names a request may give as `model`: the served model's, then each adapter's.
    fn names(&self) -> Vec<String> {
        let adapters = self.adapters.read().unwrap_or_else(|e| e.into_inner());
        std::iter::once(self.served_name.clone()).chain(adapters.keys().cloned()).collect()
    }

    /// The weights a request for `model` samples: the served model's, or an adapter's.
    fn weights_for(&self, model: &str) -> Arc<Loaded> {
        match self.adapters.read().unwrap_or_else(|e| e.into_inner()).get(model) {
            Some(loaded) => loaded.clone(),
            None => self.current(),
        }
    }

    /// The checkpoint the server samples from now.
    pub fn checkpoint(&self) -> String {
        self.current().checkpoint.clone()
    }

    /// What a request may ask of the loaded model and this server.
    fn limits(&self, loaded: &Loaded) -> openai::Limits {
        openai::Limits { context: loaded.policy.context_limit(), vocab: loaded.policy.vocab_size(), max_tokens: self.max_tokens }
    }

    fn next_id(&self, prefix: &str) -> String {
        format!("{prefix}-{}", self.counter.fetch_add(1, Ordering::Relaxed))
    }
}

/// The routes.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/update_weights_from_disk", post(update_weights))
        .route("/v1/load_lora_adapter", post(load_lora_adapter))
        .route("/v1/unload_lora_adapter", post(unload_lora_adapter))
        .route("/get_model_info", get(model_info))
        .with_state(state)
}

/// Serves on `listener` until `shutdown` resolves; requests in flight then finish.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(state)).with_graceful_shutdown(shutdown).await
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

fn error(e: BadRequest) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::BAD_REQUEST);
    (status, Json(e.body())).into_response()
}

fn policy_error(e: PolicyError) -> Response {
    match e {
        PolicyError::ContextLength { tokens, limit } => {
            error(BadRequest::field("messages", format!("the prompt has {tokens} tokens; the model's context is {limit}")))
        }
        other => {
            tracing::warn!(error = %other, "generation failed");
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                Json(json!({"error": {"message": other.to_string(), "type": "server_error", "param": null, "code": null}})),
            )
                .into_response()
        }
    }
}

fn with_checkpoint(body: Value, checkpoint: &str) -> Response {
    let mut headers = HeaderMap::new();
    if let Ok(v) = HeaderValue::from_str(checkpoint) {
        headers.insert("x-harness-s-checkpoint", v);
    }
    (headers, Json(body)).into_response()
}

/// Liveness, the loaded checkpoint, and the engine's counters (requests, tokens decoded,
/// requests cancelled because their client went away).
async fn health(State(state): State<Arc<AppState>>) -> Response {
    let loaded = state.current();
    // the engine answers between steps: off the async workers
    let policy = loaded.policy.clone();
    let engine = tokio::task::spawn_blocking(move || policy.stats()).await.unwrap_or_default();
    Json(json!({"status": "ok", "checkpoint": loaded.checkpoint, "max_tokens": state.max_tokens, "engine": engine})).into_response()
}

async fn models(State(state): State<Arc<AppState>>) -> Response {
    let checkpoint = state.checkpoint();
    let mut data =
        vec![json!({"id": state.served_name, "object": "model", "created": 0, "owned_by": "harness-s", "checkpoint": checkpoint})];
    for (name, loaded) in state.adapters.read().unwrap_or_else(|e| e.into_inner()).iter() {
        // vLLM lists a LoRA adapter with its base as `parent` and its path as `root`
        data.push(json!({"id": name, "object": "model", "created": 0, "owned_by": "harness-s", "parent": state.served_name, "root": loaded.checkpoint, "checkpoint": loaded.checkpoint}));
    }
    let body = json!({"object": "list", "data": data});
    with_checkpoint(body, &checkpoint)
}

async fn model_info(State(state): State<Arc<AppState>>) -> Response {
    Json(json!({"model_path": state.checkpoint(), "tokenizer_path": state.checkpoint(), "is_generation": true})).into_response()
}

/// Token id → its text, for log-probability entries.
fn pieces(tok: &Tokenizer) -> impl Fn(u32) -> String + '_ {
    move |id| tok.decode(&[id]).unwrap_or_default()
}

async fn chat(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let run = async {
        let v = openai::body(&body)?;
        openai::only_known(&v, &[openai::SAMPLING_FIELDS, openai::CHAT_FIELDS])?;
        let req: openai::ChatRequest = openai::parse(&v)?;
        let s: openai::Sampling = openai::parse(&v)?;
        let names = state.names();
        let sampling = openai::sampling(&s, &names.iter().map(String::as_str).collect::<Vec<_>>(), 512.min(state.max_tokens))?;
        let return_ids = s.return_token_ids.unwrap_or(false);
        let limit_field = s.limit_field();
        let messages = openai::messages(&req)?;
        let tools = openai::tools(&req)?;
        let top = openai::chat_top_logprobs(&req)?;
        let model = s.model.clone().unwrap_or_default();
        Ok::<_, BadRequest>((req.logprobs.unwrap_or(false), sampling, return_ids, messages, tools, top, limit_field, model))
    };
    let (logprobs, sampling, return_ids, messages, tools, top, limit_field, model) = match run.await {
        Ok(x) => x,
        Err(e) => return error(e),
    };
    let loaded = state.weights_for(&model);
    let tok = loaded.policy.tokenizer().clone();
    let prompt = match native::model::chat::prompt_ids(&tok, &messages, &tools) {
        Ok(p) => p,
        Err(e) => return error(BadRequest::field("messages", e.to_string())),
    };
    if let Err(e) = openai::fits(&prompt, sampling.max_tokens, limit_field, state.limits(&loaded)) {
        return error(e);
    }
    let (gen, text) = match loaded.policy.generate(prompt.clone(), &sampling, top).await {
        Ok(x) => x,
        Err(e) => return policy_error(e),
    };
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
    let calls = if names.is_empty() { vec![] } else { jobs::policy::text_protocol::parse(&text, &names, true) };
    let piece = pieces(&tok);
    let lp = logprobs.then(|| openai::chat_logprobs(&gen, &piece));
    let meta = openai::Meta {
        id: state.next_id("chatcmpl"),
        created: now(),
        model: &model,
        checkpoint: &loaded.checkpoint,
        prompt: &prompt,
        return_token_ids: return_ids,
        constrain: sampling.constrain,
    };
    with_checkpoint(openai::chat_response(&meta, &gen, &text, &calls, lp), &loaded.checkpoint)
}

async fn completions(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let parsed = (|| {
        let v = openai::body(&body)?;
        openai::only_known(&v, &[openai::SAMPLING_FIELDS, openai::COMPLETION_FIELDS])?;
        let req: openai::CompletionRequest = openai::parse(&v)?;
        let s: openai::Sampling = openai::parse(&v)?;
        let names = state.names();
        let sampling = openai::sampling(&s, &names.iter().map(String::as_str).collect::<Vec<_>>(), 16.min(state.max_tokens))?;
        if req.echo == Some(true) {
            return Err(BadRequest::field("echo", "is not supported"));
        }
        if let Some(k) = req.logprobs.filter(|&k| k > 5) {
            return Err(BadRequest::field("logprobs", format!("at most 5, is {k}")));
        }
        let limit_field = s.limit_field();
        Ok((req, sampling, s.return_token_ids.unwrap_or(false), limit_field, s.model.clone().unwrap_or_default()))
    })();
    let (req, sampling, return_ids, limit_field, model) = match parsed {
        Ok(x) => x,
        Err(e) => return error(e),
    };
    let loaded = state.weights_for(&model);
    let tok = loaded.policy.tokenizer().clone();
    let prompt = match &req.prompt {
        openai::Prompt::Ids(ids) if !ids.is_empty() => Ok(ids.clone()),
        openai::Prompt::Text(t) => tok.encode(t).map_err(|e| BadRequest::field("prompt", e.to_string())),
        openai::Prompt::Texts(ts) if ts.len() == 1 => tok.encode(&ts[0]).map_err(|e| BadRequest::field("prompt", e.to_string())),
        openai::Prompt::Texts(_) => {
            Err(BadRequest::field("prompt", "give one prompt per request (the engine batches concurrent requests)"))
        }
        openai::Prompt::Ids(_) => Err(BadRequest::field("prompt", "is empty")),
    };
    let prompt = match prompt {
        Ok(p) if p.is_empty() => return error(BadRequest::field("prompt", "is empty")),
        Ok(p) => p,
        Err(e) => return error(e),
    };
    if let Err(e) = openai::fits(&prompt, sampling.max_tokens, limit_field, state.limits(&loaded)) {
        return error(e);
    }
    let top = req.logprobs.unwrap_or(0) as usize;
    let (gen, text) = match loaded.policy.generate(prompt.clone(), &sampling, top).await {
        Ok(x) => x,
        Err(e) => return policy_error(e),
    };
    let piece = pieces(&tok);
    let meta = openai::Meta {
        id: state.next_id("cmpl"),
        created: now(),
        model: &model,
        checkpoint: &loaded.checkpoint,
        prompt: &prompt,
        return_token_ids: return_ids,
        constrain: sampling.constrain,
    };
    with_checkpoint(openai::completion_response(&meta, &gen, &text, req.logprobs, &piece), &loaded.checkpoint)
}

#[derive(serde::Deserialize)]
struct UpdateRequest {
    model_path: String,
    /// Accepted for SGLang compatibility; the format comes from the files.
    #[serde(default)]
    #[allow(dead_code)]
    load_format: Option<String>,
}

/// SGLang's `/update_weights_from_disk`: `{"success", "message", "num_paused_requests"}`.
async fn update_weights(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let req: UpdateRequest = match openai::body(&body).and_then(|v| openai::parse(&v)) {
        Ok(r) => r,
        Err(e) => return error(e),
    };
    let _one = state.updating.lock().await;
    // Clients that find the server on other weights may all ask for the same ones at once
    // (after a restart): the first loads them, the others are answered without a reload.
    let current = state.checkpoint();
    if current == infra::redact_url(&req.model_path) {
        return with_checkpoint(
            json!({"success": true, "message": format!("already serving {current}"), "num_paused_requests": 0}),
            &current,
        );
    }
    let started = std::time::Instant::now();
    match load_weights(&state, &req.model_path).await {
        Ok(loaded) => {
            let checkpoint = loaded.checkpoint.clone();
            *state.current.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(loaded);
            tracing::info!(checkpoint = %checkpoint, seconds = started.elapsed().as_secs_f64(), "weights updated");
            with_checkpoint(json!({"success": true, "message": format!("loaded {checkpoint}"), "num_paused_requests": 0}), &checkpoint)
        }
        Err(e) => {
            tracing::warn!(error = %e, "weight update refused; the old weights stay");
            (StatusCode::BAD_REQUEST, Json(json!({"success": false, "message": format!("model_path: {e}; the server keeps serving {}", state.checkpoint()), "num_paused_requests": 0}))).into_response()
        }
    }
}

/// vLLM's `POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace"}`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct LoadLoraRequest {
    lora_name: String,
    lora_path: String,
    /// Replace an adapter already loaded under this name (vLLM's flag); without it a taken
    /// name is refused.
    #[serde(default)]
    load_inplace: bool,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct UnloadLoraRequest {
    lora_name: String,
    /// Accepted for vLLM compatibility (adapters are named here).
    #[serde(default)]
    #[allow(dead_code)]
    lora_int_id: Option<u64>,
}

/// vLLM's `/v1/load_lora_adapter`: loads a PEFT adapter folder (or a LoRA run's checkpoint,
/// by path or store URL) over the served base, merged into a copy of its weights, and
/// serves it as `model = lora_name`. Answers as vLLM does: 200 with a sentence, 400 with an
/// error body.
async fn load_lora_adapter(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let req: LoadLoraRequest = match openai::body(&body).and_then(|v| openai::parse(&v)) {
        Ok(r) => r,
        Err(e) => return error(e),
    };
    if req.lora_name.is_empty() || req.lora_name == state.served_name {
        return error(BadRequest::field("lora_name", format!("`{}` is empty or the served model's own name", req.lora_name)));
    }
    let _one = state.updating.lock().await;
    if !req.load_inplace && state.adapters.read().unwrap_or_else(|e| e.into_inner()).contains_key(&req.lora_name) {
        return error(BadRequest::field(
            "lora_name",
            format!("the LoRA adapter `{}` is already loaded; unload it first or send load_inplace = true", req.lora_name),
        ));
    }
    let started = std::time::Instant::now();
    match load_weights(&state, &req.lora_path).await {
        Ok(loaded) => {
            tracing::info!(name = %req.lora_name, path = %loaded.checkpoint, seconds = started.elapsed().as_secs_f64(), "LoRA adapter loaded");
            state.adapters.write().unwrap_or_else(|e| e.into_inner()).insert(req.lora_name.clone(), Arc::new(loaded));
            (StatusCode::OK, format!("Success: LoRA adapter '{}' added successfully.", req.lora_name)).into_response()
        }
        Err(e) => error(BadRequest::field("lora_path", format!("{e}"))),
    }
}

/// vLLM's `/v1/unload_lora_adapter`: 200, or 404 naming the adapters loaded.
async fn unload_lora_adapter(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let req: UnloadLoraRequest = match openai::body(&body).and_then(|v| openai::parse(&v)) {
        Ok(r) => r,
        Err(e) => return error(e),
    };
    let _one = state.updating.lock().await;
    let mut adapters = state.adapters.write().unwrap_or_else(|e| e.into_inner());
    if adapters.remove(&req.lora_name).is_none() {
        let loaded = adapters.keys().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ");
        return error(BadRequest {
            status: 404,
            param: Some("lora_name".into()),
            message: format!(
                "lora_name: no LoRA adapter `{}` is loaded (loaded: {})",
                req.lora_name,
                if loaded.is_empty() { "none".into() } else { loaded }
            ),
            code: None,
        });
    }
    (StatusCode::OK, format!("Success: LoRA adapter '{}' removed successfully.", req.lora_name)).into_response()
}

/// Loads new weights for the served model: a GGUF file or checkpoint folder on disk, or a
/// store URL of a checkpoint folder (copied to a temporary folder first). The tokenizer
/// stays the one the server started with (the same model, trained further).
async fn load_weights(state: &AppState, model_path: &str) -> Result<Loaded, ServeError> {
    let (dir, _tmp) = if model_path.contains("://") {
        let tmp = tempfile::tempdir().map_err(|e| ServeError::Weights(format!("cannot make a temporary folder: {e}")))?;
        fetch_folder(model_path, tmp.path()).await?;
        (tmp.path().to_path_buf(), Some(tmp))
    } else {
        (PathBuf::from(model_path), None)
    };
    if !dir.exists() {
        return Err(ServeError::Weights(format!(
            "{} does not exist (give a checkpoint folder, a GGUF file, or a file:// or s3:// URL of a checkpoint folder)",
            dir.display()
        )));
    }
    let tokenizer = state.current().policy.tokenizer().clone();
    let (device, engine, name) = (state.device, state.engine.clone(), model_path.to_string());
    let base = state.base.clone();
    let policy = tokio::task::spawn_blocking(move || -> Result<NativePolicy, ServeError> {
        let model = if native::model::lora::is_adapter_folder(&dir) {
            // an adapter (PEFT's folder, or a LoRA run's checkpoint) over the served base, merged
            let mut model = native::model::loader::load_model(&base, device)?;
            native::model::lora::load_folder(&mut model, &dir)?;
            native::model::lora::merge(&mut model);
            model
        } else if dir.is_dir() {
            native::model::hf::load_model(&dir, device)?
        } else {
            native::model::loader::load(&dir, device)?.0
        };
        Ok(NativePolicy::with_tokenizer(model, tokenizer, name, engine)?)
    })
    .await
    .map_err(|e| ServeError::Weights(format!("the loading thread failed: {e}")))??;
    Ok(Loaded { policy, checkpoint: infra::redact_url(model_path) })
}

/// Copies every object under a store URL into `into` (the weights and config of a
/// checkpoint folder; the optimizer state is left out).
async fn fetch_folder(url: &str, into: &Path) -> Result<(), ServeError> {
    let fail = |e: infra::store::StoreError| ServeError::Weights(e.to_string());
    let store = infra::store::open_store(url).await.map_err(fail)?;
    let objects = store.list("").await.map_err(fail)?;
    let wanted: Vec<_> = objects.iter().filter(|o| !o.key.contains('/') && o.key != native::train::checkpoint::OPTIMIZER_FILE).collect();
    let (model, adapter) = (native::train::checkpoint::MODEL_FILE, native::model::lora::ADAPTER_FILE);
    if !wanted.iter().any(|o| o.key == model || o.key == adapter) {
        return Err(ServeError::Weights(format!("no {model} or {adapter} under {}", infra::redact_url(url))));
    }
    for o in wanted {
        let bytes = store.get(&o.key).await.map_err(fail)?;
        tokio::fs::write(into.join(&o.key), &bytes)
            .await
            .map_err(|e| ServeError::Weights(format!("cannot write {}: {e}", into.join(&o.key).display())))?;
    }
    Ok(())
}
