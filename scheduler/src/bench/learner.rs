//! `harness-s bench learner`: policy tokens/s and peak memory of one GRPO step at a few
//! sequence lengths and group sizes, with micro-batching under a fixed token budget (so
//! memory stays flat as the group grows), on the CPU or a CUDA device, in float32 or
//! bf16 mixed precision. `--peer torch` runs a plain PyTorch step of the same model shape
//! and batch in the same run ([`TORCH_STEP`]) and prints the ratio per row.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use native::model::qwen3_5::{Qwen35, Qwen35Config};
use native::model::{CausalLm, Llama, LlamaConfig, Model};
use native::train::learner::{AdamWConfig, Batch, Learner, LearnerConfig, Precision, Recompute};

#[derive(Debug, Args)]
pub struct LearnerArgs {
    /// Model to train (GGUF or HF directory); default: a random llama of --shape.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Shape of the random model: `tiny` (--width, --layers, --vocab), `smollm2-135m`
    /// (SmolLM2-135M's: 576 wide, 30 layers, 9 heads, 3 key-value heads, 49152 tokens) or
    /// `qwen3-0.6b` (Qwen3-0.6B's: 1024 wide, 28 layers, 16 heads of 128, 8 key-value heads,
    /// per-head q/k norms, 151936 tokens), `qwen3.5-0.8b` or `qwen3.5-4b` (Qwen3.5's hybrid
    /// of Gated DeltaNet and gated attention: 1024 wide and 24 layers, 2560 wide and 32
    /// layers; 248320 tokens).
    #[arg(long, default_value = "tiny", value_parser = ["tiny", "smollm2-135m", "qwen3-0.6b", "qwen3.5-0.8b", "qwen3.5-4b"])]
    pub shape: String,
    /// Width of the random model.
    #[arg(long, default_value_t = 256)]
    pub width: i64,
    /// Layers of the random model.
    #[arg(long, default_value_t = 4)]
    pub layers: i64,
    /// Vocabulary of the random model.
    #[arg(long, default_value_t = 8192)]
    pub vocab: i64,
    /// Sequence lengths (context + completion), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "128,256,512")]
    pub seq_lens: Vec<usize>,
    /// Group sizes (trajectories per step), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "4,8")]
    pub groups: Vec<usize>,
    /// Padded tokens per micro-batch.
    #[arg(long, default_value_t = 1024)]
    pub micro_batch_tokens: usize,
    /// libtorch CPU threads.
    #[arg(long, default_value_t = 2)]
    pub threads: i32,
    /// `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// `f32`, or `bf16` mixed precision (float32 parameters and AdamW moments).
    #[arg(long, default_value = "f32")]
    pub precision: String,
    /// Untimed steps on the first row before measuring (kernel selection, allocator).
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// `torch`: a plain PyTorch step of the same model shape and batch, in the same run.
    #[arg(long, value_parser = ["torch"])]
    pub peer: Option<String>,
    /// Python interpreter of the peer (it needs `torch`).
    #[arg(long, env = "HARNESS_S_PYTHON", default_value = "python3")]
    pub python: String,
    /// Replay a stored run's step instead of the synthetic rows: one GRPO update on the
    /// retained groups of `--run`'s `--step` in this store (a folder or store URL), as the
    /// learn job would build it; prints its loss and gradient norm (to compare devices).
    #[arg(long, value_name = "STORE")]
    pub replay: Option<String>,
    /// The run whose step `--replay` trains on.
    #[arg(long, requires = "replay")]
    pub run: Option<String>,
    /// The step `--replay` trains on.
    #[arg(long, default_value_t = 1, requires = "replay")]
    pub step: u32,
    /// Tokenizer of `--replay` (GGUF or HF directory, e.g. a checkpoint's folder); default: --model.
    #[arg(long, requires = "replay")]
    pub tokenizer: Option<PathBuf>,
    /// `lora`: train a LoRA adapter of `--rank` on every linear layer, beside the
    /// full-weight learner in the same run (ratios against it).
    #[arg(long, default_value = "none", value_parser = ["none", "lora"])]
    pub adapter: String,
    /// The adapter's rank.
    #[arg(long, default_value_t = 64)]
    pub rank: i64,
    /// `blocks`: activation recompute, beside the plain learner in the same run.
    #[arg(long, default_value = "none", value_parser = ["none", "blocks"])]
    pub recompute: String,
    /// Check that a resume on this device is exact: update, checkpoint, update again; load the
    /// checkpoint and repeat the second update; print the largest weight difference.
    #[arg(long)]
    pub resume_check: bool,
}

/// The PyTorch peer's script (`--peer torch`).
pub const TORCH_STEP: &str = include_str!("torch_step.py");

/// SmolLM2-135M's architecture (its `config.json`).
fn smollm2_135m() -> LlamaConfig {
    LlamaConfig {
        intermediate_size: 1536,
        num_attention_heads: 9,
        num_key_value_heads: 3,
        rope_theta: 100000.0,
        max_position_embeddings: 8192,
        ..LlamaConfig::tiny(49152, 576, 30)
    }
}

/// Qwen3-0.6B's shape (its `config.json`).
fn qwen3_0_6b() -> LlamaConfig {
    LlamaConfig {
        model_type: "qwen3".into(),
        intermediate_size: 3072,
        num_attention_heads: 16,
        num_key_value_heads: 8,
        explicit_head_dim: Some(128),
        rms_norm_eps: 1e-6,
        rope_theta: 1_000_000.0,
        max_position_embeddings: 40960,
        ..LlamaConfig::tiny(151_936, 1024, 28)
    }
}

/// One measured row of ours or the peer's.
#[derive(Debug, Clone, serde::Deserialize)]
struct Measured {
    len: usize,
    group: usize,
    micro: u64,
    tokens: u64,
    seconds: f64,
    peak_bytes: Option<u64>,
}

/// Device memory in use on CUDA device `n` by every process, from `nvidia-smi`: libtorch's
/// caching allocator keeps what a step reserved, so after a step this is its peak
/// reservation (tch has no binding for libtorch's allocator statistics).
fn gpu_memory_used(n: usize) -> Option<u64> {
    let out = std::process::Command::new("nvidia-smi")
        .args(["--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", &n.to_string()])
        .output()
        .ok()?;
    let mib: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().ok()?;
    Some(mib * 1024 * 1024)
}

/// Resets the kernel's peak-RSS counter (VmHWM) so that each row reports its own peak.
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

pub async fn run(args: LearnerArgs) -> anyhow::Result<u8> {
    let stored = match &args.replay {
        Some(url) => {
            let run = args.run.clone().context("--replay needs --run")?;
            let store = infra::store::open_store(&infra::store::absolute_url(url)).await.with_context(|| format!("--replay {url}"))?;
            let (groups, trajectories) = native::train::learn::read_step(store.as_ref(), &run, args.step)
                .await
                .with_context(|| format!("--replay: run `{run}` step {}", args.step))?;
            anyhow::ensure!(!groups.is_empty(), "--replay: run `{run}` has no groups at step {} in {url}", args.step);
            Some((run, groups, trajectories))
        }
        None => None,
    };
    tokio::task::spawn_blocking(move || run_blocking(&args, stored)).await?
}

type Stored = (String, Vec<schemas::Group>, Vec<schemas::Trajectory>);

fn run_blocking(args: &LearnerArgs, stored: Option<Stored>) -> anyhow::Result<u8> {
    anyhow::ensure!(
        !args.seq_lens.is_empty() && args.seq_lens.iter().all(|&l| l >= 2),
        "--seq-lens: every length must be at least 2 (a context token and a completion token)"
    );
    anyhow::ensure!(!args.groups.is_empty() && args.groups.iter().all(|&g| g > 0), "--groups must be positive");
    let device = native::device::resolve(&args.device, "--device")?;
    let precision = Precision::parse(&args.precision, "--precision")?;
    native::device::set_cpu_threads(args.threads);
    let model: Model = match &args.model {
        Some(p) => native::model::loader::load(p, device)?.0,
        None => model_of_shape(args, device)?,
    };
    let (layers, hidden) = model.shape();
    let vocab = model.vocab_size() as u32;
    let params: i64 = model.named_tensors().iter().map(|(_, t)| t.numel() as i64).sum();
    let full = LearnerConfig {
        optimizer: AdamWConfig { lr: 1e-5, ..Default::default() },
        micro_batch_tokens: args.micro_batch_tokens,
        precision,
        ..Default::default()
    };
    let cfg = LearnerConfig {
        adapter: (args.adapter == "lora")
            .then(|| native::model::lora::AdapterConfig::lora(args.rank, 2.0 * args.rank as f64, &["all-linear"])),
        recompute: if args.recompute == "blocks" { Recompute::Blocks } else { Recompute::None },
        ..full.clone()
    };
    let model_config = model.model_config();
    // the one asked for first, then the full-weight learner (when it differs): what the
    // heap keeps of the first is then below the second's peak
    let mut variants = vec![cfg.clone()];
    if cfg != full {
        variants.push(full.clone());
    }
    let seed_model = |device| -> anyhow::Result<Model> {
        Ok(match &args.model {
            Some(p) => native::model::loader::load(p, device)?.0,
            None => model_of_shape(args, device)?,
        })
    };
    let mut learner = Learner::from_base(model, cfg.clone())?;
    let header = format!(
        "model: {params} parameters ({} layers, {} wide)  device: {}  precision: {}  micro-batch budget: {} tokens  threads: {}",
        layers,
        hidden,
        native::device::name(device),
        precision.name(),
        args.micro_batch_tokens,
        args.threads
    );
    if let Some((run, groups, trajectories)) = stored {
        let path = args.tokenizer.as_ref().or(args.model.as_ref()).context("--replay needs --tokenizer (or --model)")?;
        let tok = native::model::loader::load_tokenizer(path).with_context(|| format!("--tokenizer {}", path.display()))?;
        let batch = native::train::learner::data::batch_from_groups(&groups, &trajectories, &tok, &Default::default())?;
        let largest = batch.samples.iter().flat_map(|s| s.context.iter().chain(&s.completion)).max().copied().unwrap_or(0);
        anyhow::ensure!(
            largest < vocab,
            "--replay: the stored tokens reach id {largest}, beyond the model's {vocab}-token vocabulary (--vocab, --shape or --model)"
        );
        let t = Instant::now();
        let m = learner.update(&batch)?;
        native::device::synchronize(device);
        anyhow::ensure!(m.policy_tokens > 0, "--replay: run `{run}` step {} has no retained group with a policy token", args.step);
        println!("{header}");
        println!(
            "replay of run `{run}` step {}: {} tasks, {} samples, {} policy tokens, {} micro-batches, {:.3} s",
            args.step,
            m.tasks,
            m.samples,
            m.policy_tokens,
            m.micro_batches,
            t.elapsed().as_secs_f64()
        );
        println!("loss={:.9} grad_norm={:.9} clip_fraction={:.6}", m.loss, m.grad_norm, m.clip_fraction);
        return Ok(0);
    }
    let rows: Vec<(usize, usize)> = args.seq_lens.iter().flat_map(|&l| args.groups.iter().map(move |&g| (l, g))).collect();
    let batch_of = |len: usize, group: usize| Batch::synthetic(len, group, vocab);
    if args.resume_check {
        println!("{header}");
        let (len, group) = rows[0];
        let d = resume_difference(learner, &batch_of(len, group), &batch_of(len, group + 1), device)?;
        println!(
            "resume on {}: largest weight difference after the resumed update {d:e} ({})",
            native::device::name(device),
            if d == 0.0 { "bit-identical" } else { "NOT bit-identical" }
        );
        return Ok(if d == 0.0 { 0 } else { 1 });
    }
    // each variant on its own model of the same weights, one after the other
    // the peer's model: the same llama-family shape, or transformers' own of the same config
    let (peer_key, peer_model) = match &learner.model {
        Model::Llama(m) => {
            let config = &m.config;
            let shape = serde_json::json!({
                "vocab": config.vocab_size, "hidden": config.hidden_size, "inter": config.intermediate_size,
                "layers": config.num_hidden_layers, "heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads,
                "eps": config.rms_norm_eps, "rope_theta": config.rope_theta, "tie": config.tie_word_embeddings,
                "head_dim": config.head_dim(), "qk_norm": config.qk_norm(),
            });
            ("config", shape)
        }
        Model::Qwen35(m) => ("hf_config", m.config.to_hf_json()),
    };
    drop(learner);
    let mut measured: Vec<(LearnerConfig, Vec<Measured>)> = vec![];
    for variant in &variants {
        trim_heap();
        let mut learner = Learner::from_base(seed_model(device)?, variant.clone())?;
        for _ in 0..args.warmup {
            learner.update(&batch_of(rows[0].0, rows[0].1))?;
        }
        native::device::synchronize(device);
        let mut ours = vec![];
        for &(len, group) in &rows {
            let batch = batch_of(len, group);
            reset_peak_rss();
            let t = Instant::now();
            let m = learner.update(&batch)?;
            native::device::synchronize(device);
            let seconds = t.elapsed().as_secs_f64();
            let peak_bytes = match device {
                native::device::Device::Cuda(n) => gpu_memory_used(n),
                _ => crate::bench::peak_rss_bytes(),
            };
            ours.push(Measured { len, group, micro: m.micro_batches, tokens: m.policy_tokens, seconds, peak_bytes });
        }
        drop(learner);
        measured.push((variant.clone(), ours));
    }
    // printed and compared with the full-weight learner first
    measured.reverse();
    let ours = measured.iter().find(|(c, _)| *c == full).map(|(_, rows)| rows.clone()).unwrap_or_default();
    // Give the freed model back to the system before the peer starts beside this process:
    // glibc keeps freed blocks below its mmap threshold in its heap (GBs at 0.8B parameters),
    // and the two processes would not fit together.
    trim_heap();

    let peer = match &args.peer {
        Some(_) => {
            eprintln!("PyTorch step of the same model and batch ...");
            let mut spec = serde_json::json!({
                "device": native::device::name(device),
                "precision": precision.name(),
                "threads": args.threads,
                "micro_batch_tokens": args.micro_batch_tokens,
                "warmup": args.warmup,
                "rows": rows,
            });
            spec[peer_key] = peer_model.clone();
            let out = super::reference::run_python(
                &args.python,
                "the PyTorch peer",
                TORCH_STEP,
                &[spec.to_string()],
                "the PyTorch process crashed; run it alone with the same --python to see why",
            )?;
            let measured = String::from_utf8_lossy(&out)
                .lines()
                .map(serde_json::from_str::<Measured>)
                .collect::<Result<Vec<_>, _>>()
                .context("the PyTorch peer printed a line that is not a row")?;
            Some(measured)
        }
        None => None,
    };

    let memory = if device.is_cuda() { "GPU memory" } else { "peak RSS" };
    println!("{header}");
    print!("{:>8} {:>6} {:>6} {:>11} {:>9} {:>13} {:>12}", "seq len", "group", "micro", "policy tok", "seconds", "policy tok/s", memory);
    if peer.is_some() {
        print!(" {:>13} {:>12} {:>8}", "torch tok/s", "torch mem", "× torch");
    }
    println!();
    let mem = |b: Option<u64>| b.map(crate::bench::human_bytes).unwrap_or_else(|| "n/a".into());
    for (i, r) in ours.iter().enumerate() {
        let rate = r.tokens as f64 / r.seconds;
        print!("{:>8} {:>6} {:>6} {:>11} {:>9.3} {:>13.1} {:>12}", r.len, r.group, r.micro, r.tokens, r.seconds, rate, mem(r.peak_bytes));
        if let Some(theirs) = peer.as_ref().and_then(|p| p.get(i)) {
            let peer_rate = theirs.tokens as f64 / theirs.seconds;
            print!(" {:>13.1} {:>12} {:>8.2}", peer_rate, mem(theirs.peak_bytes), rate / peer_rate);
        }
        println!();
    }
    if device.is_cuda() {
        println!("GPU memory: ours is the device's memory in use after the step (nvidia-smi, the caching allocator's reservation); torch's is its peak allocation.");
    }
    print_variants(&measured, &model_config, device.is_cuda(), memory);
    Ok(0)
}

/// The learners side by side: per row, each one's tokens/s and peak memory, the memory
/// plan's prediction of that peak, and both as ratios to the full-weight learner's.
fn print_variants(measured: &[(LearnerConfig, Vec<Measured>)], config: &native::model::shape::ModelConfig, cuda: bool, memory: &str) {
    use native::train::memory::{human, learner_plan};
    let name = |c: &LearnerConfig| {
        let adapter = c.adapter.as_ref().map(|a| format!("LoRA r{}", a.rank)).unwrap_or_else(|| "full".into());
        let recompute = if c.recompute == Recompute::Blocks { " + recompute" } else { "" };
        format!("{adapter}{recompute}")
    };
    println!();
    println!(
        "{:<22} {:>8} {:>6} {:>13} {:>12} {:>12} {:>11} {:>10} {:>10}",
        "learner", "seq len", "group", "policy tok/s", memory, "plan", "plan/meas", "× speed", "× memory"
    );
    let (_, base) = &measured[0];
    for (c, rows) in measured {
        for (r, b) in rows.iter().zip(base) {
            // the micro-batch the plan describes: as many whole rows as the budget holds
            let tokens = ((c.micro_batch_tokens / r.len).clamp(1, r.group) * r.len) as u64;
            let plan =
                learner_plan(config, &LearnerConfig { micro_batch_tokens: tokens as usize, ..c.clone() }, cuda, tokens - tokens / 2).peak();
            let rate = r.tokens as f64 / r.seconds;
            let speed = rate / (b.tokens as f64 / b.seconds);
            let ratio = |x: Option<u64>, y: Option<u64>| match (x, y) {
                (Some(x), Some(y)) if y > 0 => format!("{:.2}", x as f64 / y as f64),
                _ => "n/a".into(),
            };
            println!(
                "{:<22} {:>8} {:>6} {:>13.1} {:>12} {:>12} {:>11} {:>10.2} {:>10}",
                name(c),
                r.len,
                r.group,
                rate,
                r.peak_bytes.map(human).unwrap_or_else(|| "n/a".into()),
                human(plan),
                ratio(Some(plan), r.peak_bytes),
                speed,
                ratio(r.peak_bytes, b.peak_bytes)
            );
        }
    }
}

/// Returns the heap's free pages to the system (glibc keeps freed blocks in its heap), so
/// that the next peak RSS measures the next learner alone.
fn trim_heap() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only returns free heap pages to the kernel.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// The random model of `--shape` (and `--width`, `--layers`, `--vocab` for `tiny`).
fn model_of_shape(args: &LearnerArgs, device: native::device::Device) -> anyhow::Result<Model> {
    Ok(match args.shape.as_str() {
        "smollm2-135m" => Llama::new(smollm2_135m(), device, 0)?.into(),
        "qwen3-0.6b" => Llama::new(qwen3_0_6b(), device, 0)?.into(),
        s if s.starts_with("qwen3.5-") => Qwen35::new(Qwen35Config::shape(&s["qwen3.5-".len()..], None)?, device, 0)?.into(),
        _ => Llama::new(LlamaConfig::tiny(args.vocab, args.width, args.layers), device, 0)?.into(),
    })
}

/// Updates on `first`, checkpoints into a temporary store, updates on `second`; then loads
/// the checkpoint on `device` and repeats the second update. Returns the largest absolute
/// difference between the two results' weights (0: the resume is exact).
fn resume_difference(mut learner: Learner, first: &Batch, second: &Batch, device: native::device::Device) -> anyhow::Result<f64> {
    let dir = tempfile::tempdir()?;
    let store = infra::store::LocalStore::new(dir.path())?;
    let rt = tokio::runtime::Handle::current();
    learner.update(first)?;
    let info = native::train::checkpoint::SaveInfo {
        run_id: "resume-check".into(),
        step: 1,
        parent: None,
        data_cursor: 0,
        metrics: Default::default(),
        dtype: Default::default(),
        base_model: String::new(),
    };
    rt.block_on(native::train::checkpoint::save(&store, &learner, None, &info))?;
    learner.update(second)?;
    let config = learner.config.clone();
    let mut resumed = rt.block_on(native::train::checkpoint::load(&store, "resume-check", 1, device, config))?.learner;
    resumed.update(second)?;
    let mut largest = 0f64;
    for ((name, a), (_, b)) in learner.model.named_tensors().iter().zip(resumed.model.named_tensors()) {
        let d = (a - &b).abs().max().double_value(&[]);
        anyhow::ensure!(d.is_finite(), "`{name}` is not finite after the resumed update");
        largest = largest.max(d);
    }
    Ok(largest)
}
