//! Weight sync with an inference endpoint, for training a policy that is served behind one.
//!
//! Why: at scale the learner runs apart from the inference servers that sample rollouts; after
//! each learn step the servers must load the new checkpoint before the next update samples,
//! or the learner trains on rollouts of weights it has already left behind.
//!
//! Two protocols, both spoken by `harness-s serve`: SGLang's (`weight_sync = "sglang"`)
//! - `POST {root}/update_weights_from_disk {"model_path"}` → `{"success", "message"}`;
//! - `GET {root}/get_model_info` → `{"model_path", ...}`: the weights served now;
//!
//! and vLLM's LoRA protocol for a run that trains an adapter (`weight_sync = "lora"`):
//! - `POST {root}/v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace": true}`;
//! - `GET {root}/v1/models`: the adapter's entry, its `root` the folder it was loaded from.
//!
//! [`Endpoint::ensure`] reads what the server serves and loads the wanted weights only when
//! they differ, so it is cheap to call before every stage that samples (a restarted server,
//! a resumed run and the step after a learn job are the same case). Failures are typed:
//! an unreachable server is retried with backoff within a budget; a server that refuses the
//! weights, or answers with other weights after loading, is an error at once.

use std::time::{Duration, Instant};

use backon::{ExponentialBuilder, Retryable};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// How a trained policy's new weights reach its endpoint (`[policy] weight_sync`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightSync {
    /// The endpoint's weights never change (rollout-only runs).
    #[default]
    None,
    /// SGLang's `/update_weights_from_disk` and `/get_model_info` (also `harness-s serve`).
    Sglang,
    /// vLLM's LoRA protocol, for a run that trains an adapter (`[learner.adapter]`): each
    /// checkpoint's adapter folder is loaded in place under one name ([`adapter_name`]) with
    /// `POST /v1/load_lora_adapter` and checked in `GET /v1/models` (its `root`); rollouts of
    /// a trained step ask for that name, the starting weights' rollouts for the base model.
    /// vLLM (with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`) and `harness-s serve` speak it.
    Lora,
}

/// The name a run's adapter is served under beside `model`, the base's.
pub fn adapter_name(model: &str) -> String {
    format!("{model}-lora")
}

/// Why an endpoint could not be brought to the wanted weights.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error("cannot reach the policy endpoint {}: {}", infra::redact_url(.endpoint), infra::redact_text(.detail))]
    Unreachable { endpoint: String, detail: String },
    #[error("the policy endpoint {} refused to load {}: {message}", infra::redact_url(.endpoint), infra::redact_url(.model_path))]
    Refused { endpoint: String, model_path: String, message: String },
    #[error("the policy endpoint {} serves {} after loading {}; it did not take the new weights", infra::redact_url(.endpoint), infra::redact_url(.serving), infra::redact_url(.model_path))]
    NotLoaded { endpoint: String, model_path: String, serving: String },
    #[error("the policy endpoint {} does not speak the weight-update protocol ({}); weight_sync = \"sglang\" needs /update_weights_from_disk and /get_model_info (SGLang, harness-s serve), weight_sync = \"lora\" /v1/load_lora_adapter and /v1/models (vLLM, harness-s serve)", infra::redact_url(.endpoint), infra::redact_text(.detail))]
    Protocol { endpoint: String, detail: String },
}

impl infra::Transient for SyncError {
    /// Whether trying again later may succeed (the server is restarting or overloaded).
    fn is_transient(&self) -> bool {
        matches!(self, SyncError::Unreachable { .. })
    }
}

/// One inference server's weight-update routes.
#[derive(Debug, Clone)]
pub struct Endpoint {
    root: String,
    http: reqwest::Client,
    api_key: Option<String>,
}

impl Endpoint {
    /// `base_url` is the policy's (`http://host:port/v1`); the routes live at its root.
    /// Loading weights can take minutes on a large model: each request may take `timeout`.
    pub fn new(base_url: &str, api_key: Option<String>, timeout: Duration) -> Result<Endpoint, SyncError> {
        let root = server_root(base_url);
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(Duration::from_secs(10))
            .build()
            .map_err(|e| SyncError::Protocol { endpoint: root.clone(), detail: format!("cannot build an HTTP client: {e}") })?;
        Ok(Endpoint { root, http, api_key })
    }

    pub fn root(&self) -> &str {
        &self.root
    }

    /// Sends `request` with the key: the status and the text of a reply that is neither a
    /// transport failure nor a server in trouble (5xx, 429), which are `Unreachable`.
    async fn exchange(&self, request: reqwest::RequestBuilder) -> Result<(u16, String), SyncError> {
        let request = match &self.api_key {
            Some(k) => request.bearer_auth(k),
            None => request,
        };
        let unreachable = |e: reqwest::Error| SyncError::Unreachable { endpoint: self.root.clone(), detail: e.to_string() };
        let response = request.send().await.map_err(unreachable)?;
        let status = response.status().as_u16();
        let text = response.text().await.map_err(unreachable)?;
        if status >= 500 || status == 429 {
            return Err(SyncError::Unreachable {
                endpoint: self.root.clone(),
                detail: format!("HTTP {status}: {}", text.chars().take(300).collect::<String>()),
            });
        }
        Ok((status, text))
    }

    /// [`Endpoint::exchange`] of a route that answers JSON.
    async fn send(&self, request: reqwest::RequestBuilder) -> Result<(u16, Value), SyncError> {
        let (status, text) = self.exchange(request).await?;
        let body = serde_json::from_str(&text).map_err(|_| SyncError::Protocol {
            endpoint: self.root.clone(),
            detail: format!("HTTP {status}, not JSON: {}", text.chars().take(200).collect::<String>()),
        })?;
        Ok((status, body))
    }

    /// The weights the server serves now (`model_path` of `/get_model_info`).
    pub async fn serving(&self) -> Result<String, SyncError> {
        let (status, body) = self.send(self.http.get(format!("{}/get_model_info", self.root))).await?;
        match body.get("model_path").and_then(Value::as_str) {
            Some(p) if status == 200 => Ok(p.to_string()),
            _ => Err(SyncError::Protocol {
                endpoint: self.root.clone(),
                detail: format!("GET /get_model_info answered HTTP {status} without a model_path"),
            }),
        }
    }

    /// Asks the server to load `model_path` (in-flight requests finish on the old weights).
    pub async fn load(&self, model_path: &str) -> Result<(), SyncError> {
        let url = format!("{}/update_weights_from_disk", self.root);
        let (status, body) = self.send(self.http.post(url).json(&json!({"model_path": model_path}))).await?;
        let message = body.get("message").and_then(Value::as_str).unwrap_or("").to_string();
        match body.get("success").and_then(Value::as_bool) {
            Some(true) => Ok(()),
            Some(false) => Err(SyncError::Refused { endpoint: self.root.clone(), model_path: model_path.into(), message }),
            None if status == 404 => {
                Err(SyncError::Protocol { endpoint: self.root.clone(), detail: "POST /update_weights_from_disk answered 404".into() })
            }
            None => Err(SyncError::Protocol {
                endpoint: self.root.clone(),
                detail: format!("POST /update_weights_from_disk answered HTTP {status} without `success`"),
            }),
        }
    }

    /// The path the adapter `name` was loaded from (`root` of its `/v1/models` entry, as vLLM
    /// lists LoRA adapters), or None when no adapter of that name is loaded.
    pub async fn serving_adapter(&self, name: &str) -> Result<Option<String>, SyncError> {
        let (status, body) = self.send(self.http.get(format!("{}/v1/models", self.root))).await?;
        let Some(models) = body.get("data").and_then(Value::as_array).filter(|_| status == 200) else {
            return Err(SyncError::Protocol {
                endpoint: self.root.clone(),
                detail: format!("GET /v1/models answered HTTP {status} without `data`"),
            });
        };
        Ok(models
            .iter()
            .find(|m| m.get("id").and_then(Value::as_str) == Some(name))
            .map(|m| m.get("root").and_then(Value::as_str).unwrap_or_default().to_string()))
    }

    /// Asks the server to load the adapter folder `path` as `name`, in place of one loaded
    /// under that name (vLLM's `/v1/load_lora_adapter`, which answers 200 with a sentence).
    pub async fn load_adapter(&self, name: &str, path: &str) -> Result<(), SyncError> {
        let url = format!("{}/v1/load_lora_adapter", self.root);
        let (status, text) =
            self.exchange(self.http.post(url).json(&json!({"lora_name": name, "lora_path": path, "load_inplace": true}))).await?;
        match status {
            200 => Ok(()),
            404 | 405 => Err(SyncError::Protocol {
                endpoint: self.root.clone(),
                detail: format!("POST /v1/load_lora_adapter answered {status}; vLLM serves it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora"),
            }),
            _ => Err(SyncError::Refused { endpoint: self.root.clone(), model_path: path.into(), message: text.chars().take(500).collect() }),
        }
    }

    /// Brings the server to serve the adapter folder `path` as `name` (see [`Endpoint::ensure`]).
    pub async fn ensure_adapter(&self, name: &str, path: &str, budget: Duration) -> Result<bool, SyncError> {
        self.retrying(budget, || async {
            if self.serving_adapter(name).await?.is_some_and(|root| same_weights(&root, path)) {
                return Ok(false);
            }
            self.load_adapter(name, path).await?;
            match self.serving_adapter(name).await? {
                Some(root) if same_weights(&root, path) => Ok(true),
                other => Err(SyncError::NotLoaded {
                    endpoint: self.root.clone(),
                    model_path: path.into(),
                    serving: other.unwrap_or_else(|| format!("no adapter `{name}`")),
                }),
            }
        })
        .await
    }

    /// Brings the server to `model_path`: nothing when it serves it already, else a load
    /// and a check that it now serves it. Unreachable servers are retried with backoff
    /// while `budget` lasts. Returns whether weights were loaded.
    pub async fn ensure(&self, model_path: &str, budget: Duration) -> Result<bool, SyncError> {
        self.retrying(budget, || async {
            if same_weights(&self.serving().await?, model_path) {
                return Ok(false);
            }
            self.load(model_path).await?;
            let serving = self.serving().await?;
            if !same_weights(&serving, model_path) {
                return Err(SyncError::NotLoaded { endpoint: self.root.clone(), model_path: model_path.into(), serving });
            }
            Ok(true)
        })
        .await
    }

    /// Runs `attempt` until it succeeds, fails for good, or `budget` is spent: an unreachable
    /// server is tried again with backoff (0.5 s doubling to 10 s, jittered).
    async fn retrying<Fut: std::future::Future<Output = Result<bool, SyncError>>>(
        &self,
        budget: Duration,
        attempt: impl FnMut() -> Fut,
    ) -> Result<bool, SyncError> {
        let started = Instant::now();
        let backoff = ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(500))
            .with_max_delay(Duration::from_secs(10))
            .with_max_times(usize::MAX)
            .with_jitter();
        attempt
            .retry(backoff)
            .sleep(tokio::time::sleep)
            .when(<SyncError as infra::Transient>::is_transient)
            .adjust(|_, delay| delay.filter(|d| started.elapsed() + *d < budget))
            .notify(|e, delay| tracing::warn!(endpoint = %self.root, error = %e, retry_in_ms = delay.as_millis() as u64, "weight sync: endpoint not ready; retrying"))
            .await
    }
}

/// A server's root URL from an OpenAI base URL (`http://host:port/v1` → `http://host:port`),
/// where its tokenizer and weight-update routes live.
pub fn server_root(base_url: &str) -> String {
    let base = base_url.trim_end_matches('/');
    base.strip_suffix("/v1").unwrap_or(base).to_string()
}

/// Whether two weight references name the same weights: equal as written, or as URLs once
/// normalised (a server may print a URL it was sent in its canonical form, without a
/// password).
pub fn same_weights(a: &str, b: &str) -> bool {
    let normal = |s: &str| url::Url::parse(s).map(|u| infra::redact_url(u.as_str())).unwrap_or_else(|_| s.to_string());
    a == b || normal(a) == normal(b)
}

/// What to send as `model_path` for a checkpoint folder at `folder_url` of a store: a local
/// store's folder as a plain path (SGLang and `harness-s serve` read it in place, on a
/// filesystem the servers share), any other store's URL as it is (`harness-s serve` fetches
/// `s3://` folders itself).
pub fn model_path_of(folder_url: &str) -> String {
    match folder_url.strip_prefix("file://") {
        Some(path) => path.to_string(),
        None => folder_url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_folders_are_sent_as_paths_and_others_as_urls() {
        assert_eq!(model_path_of("file:///data/runs/r/checkpoints/step=1"), "/data/runs/r/checkpoints/step=1");
        assert_eq!(
            model_path_of("s3://b/p/runs/r/checkpoints/step=1?endpoint=http://127.0.0.1:8333"),
            "s3://b/p/runs/r/checkpoints/step=1?endpoint=http://127.0.0.1:8333"
        );
    }

    #[tokio::test]
    async fn an_unreachable_endpoint_is_retried_within_the_budget_then_typed() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        let e = Endpoint::new(&format!("http://127.0.0.1:{port}/v1"), None, Duration::from_secs(2)).unwrap();
        assert_eq!(e.root(), format!("http://127.0.0.1:{port}"));
        let started = Instant::now();
        let err = e.ensure("/x", Duration::from_millis(1500)).await.unwrap_err();
        assert!(matches!(err, SyncError::Unreachable { .. }), "{err}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}
