//! `harness-s bench learner`: policy tokens/s and peak memory of one GRPO step at a few
//! sequence lengths and group sizes, with micro-batching under a fixed token budget (so
//! memory stays flat as the group grows).

use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use native::learner::{grpo, AdamWConfig, Batch, Learner, LearnerConfig, Sample};
use native::model::{Llama, LlamaConfig};

#[derive(Debug, Args)]
pub struct LearnerArgs {
    /// Model to train (GGUF or HF directory); default: a random llama of --width/--layers.
    #[arg(long)]
    pub model: Option<PathBuf>,
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
}

/// Resets the kernel's peak-RSS counter (VmHWM) so that each row reports its own peak.
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

pub async fn run(args: LearnerArgs) -> anyhow::Result<u8> {
    tokio::task::spawn_blocking(move || run_blocking(&args)).await?
}

fn run_blocking(args: &LearnerArgs) -> anyhow::Result<u8> {
    native::device::set_cpu_threads(args.threads);
    let model = match &args.model {
        Some(p) => native::loader::load(p, native::device::Device::Cpu)?.0,
        None => Llama::new(LlamaConfig::tiny(args.vocab, args.width, args.layers), native::device::Device::Cpu, 0)?,
    };
    let vocab = model.config.vocab_size as u32;
    let params: i64 = model.named_tensors().iter().map(|(_, t)| t.numel() as i64).sum();
    let cfg = LearnerConfig {
        optimizer: AdamWConfig { lr: 1e-5, ..Default::default() },
        micro_batch_tokens: args.micro_batch_tokens,
        ..Default::default()
    };
    let mut learner = Learner::new(model, cfg);
    println!("model: {} parameters  micro-batch budget: {} tokens  threads: {}", params, args.micro_batch_tokens, args.threads);
    println!(
        "{:>8} {:>6} {:>8} {:>13} {:>9} {:>13} {:>12}",
        "seq len", "group", "micro", "policy tok", "seconds", "policy tok/s", "peak RSS"
    );
    for &len in &args.seq_lens {
        for &group in &args.groups {
            let ctx = len / 2;
            let samples: Vec<Sample> = (0..group)
                .map(|j| Sample {
                    task: 0,
                    context: (0..ctx).map(|i| ((i * 31 + j) as u32) % vocab).collect(),
                    completion: (0..len - ctx).map(|i| ((i * 17 + j * 7) as u32) % vocab).collect(),
                    mask: vec![true; len - ctx],
                    logq: vec![],
                    advantage: 0.0,
                    temperature: 1.0,
                    scale: 1.0,
                    shift: None,
                })
                .collect();
            let rewards: Vec<f64> = (0..group).map(|j| (j % 2) as f64).collect();
            let mut batch = Batch { tasks: vec!["bench".into()], samples, ..Default::default() };
            for (s, a) in batch.samples.iter_mut().zip(grpo::group_advantages(&rewards)) {
                s.advantage = a;
            }
            reset_peak_rss();
            let t = Instant::now();
            let m = learner.update(&batch)?;
            let secs = t.elapsed().as_secs_f64();
            let peak = crate::bench::peak_rss_bytes().map(crate::bench::human_bytes).unwrap_or_else(|| "n/a".into());
            println!(
                "{len:>8} {group:>6} {:>8} {:>13} {secs:>9.2} {:>13.1} {peak:>12}",
                m.micro_batches,
                m.policy_tokens,
                m.policy_tokens as f64 / secs
            );
        }
    }
    Ok(0)
}
