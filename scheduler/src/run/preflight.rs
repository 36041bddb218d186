//! Before a run's first stage: every service its spec names must answer — the
//! environment's database server or environment server, the policy endpoint, the LLM voters, profiler and
//! proposer. One error lists each unreachable service by its spec key, so that a run never
//! records episodes against a server that is not there (and then trains on nothing).
//! The store and the broker are checked where they are opened.

use std::time::Duration;

use jobs::policy::openai::OpenAiConfig;

use super::spec::RunSpec;

/// How long one service may take to answer.
const TIMEOUT: Duration = Duration::from_secs(10);

/// Checks every service of `spec`; the error names each one that did not answer.
pub async fn check(spec: &RunSpec) -> anyhow::Result<()> {
    let mut problems: Vec<String> = vec![];
    if spec.environment.engine == super::spec::DbEngine::Mysql {
        if let Some(url) = &spec.environment.db_url {
            if let Err(e) = jobs::env::dbbench::check_server(url, TIMEOUT).await {
                problems.push(format!("environment.db_url: {e}"));
            }
        }
    }
    if spec.environment.is_http() {
        if let Some(url) = &spec.environment.url {
            if let Err(e) = jobs::env::http::probe(url, TIMEOUT).await {
                problems.push(format!("environment.url: {e}"));
            }
        }
    }
    let mut endpoints: Vec<(String, OpenAiConfig)> = vec![];
    if spec.policy.backend == super::spec::Backend::Openai {
        endpoints.push(("policy.base_url".into(), spec.policy.openai_config()));
    }
    for (i, v) in spec.router.voters.iter().enumerate() {
        endpoints.push((format!("router.voters[{i}]"), v.openai_config()));
    }
    if let Some(p) = &spec.router.profiler {
        endpoints.push(("router.profiler".into(), p.openai_config()));
    }
    if let Some(llm) = spec.evolution.as_ref().and_then(|e| e.llm.as_ref()) {
        endpoints.push(("evolution.llm".into(), llm.openai_config()));
    }
    if let Some(config) = spec.editor_training.as_ref().and_then(|e| e.endpoint_config()) {
        endpoints.push(("editor_training.endpoint".into(), config));
    }
    for (key, mut config) in endpoints {
        config.connect_timeout_s = TIMEOUT.as_secs_f64();
        let outcome = match jobs::policy::openai::OpenAiPolicy::new(config) {
            Ok(p) => p.probe().await,
            Err(e) => Err(e),
        };
        if let Err(e) = outcome {
            problems.push(format!("{key}: {e}"));
        }
    }
    if problems.is_empty() {
        return Ok(());
    }
    anyhow::bail!("{} service(s) the run needs did not answer; nothing was run:\n  {}", problems.len(), problems.join("\n  "))
}
