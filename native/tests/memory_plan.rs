//! The memory plan against the memory a learner really takes: three learner configurations
//! (full weights, a LoRA adapter, full weights with recompute), each in a process of its
//! own, one warm update and then one measured update; the measured peak RSS above the
//! process's RSS before its model (the runtime) against the plan's peak above its runtime
//! constant. Within 15 %.
//!
//! The plan counts the tensors alive at the peak. The children run with the `harness-s`
//! binary's allocator settings (two malloc arenas, transparent huge pages for libtorch's
//! buffers) and with glibc's mmap threshold fixed at 1 MiB, so that a freed buffer goes back
//! to the system and the RSS is what is alive. With glibc's default (a threshold that rises
//! to the size of freed buffers, which then stay in the heap for reuse: faster, see
//! docs/BENCHMARKS.md) the RSS of the same steps runs higher than what is alive.

use native::model::lora::{AdapterConfig, ALL_LINEAR};
use native::model::{CausalLm, Llama, LlamaConfig};
use native::train::learner::{AdamWConfig, Batch, Learner, LearnerConfig, Recompute};
use native::train::memory::{human, learner_plan, CPU_RUNTIME_BYTES};
use tch::Device;

const CHILD: &str = "HARNESS_S_MEMORY_PLAN_CONFIG";
const ROW: usize = 512;
const ROWS: usize = 4;
const MICRO: usize = 1024;

fn model_config() -> LlamaConfig {
    LlamaConfig::tiny(8192, 512, 8)
}

fn configs() -> Vec<(&'static str, LearnerConfig)> {
    let base = LearnerConfig { optimizer: AdamWConfig { lr: 1e-5, ..Default::default() }, micro_batch_tokens: MICRO, ..Default::default() };
    vec![
        ("full", base.clone()),
        ("lora", LearnerConfig { adapter: Some(AdapterConfig::lora(16, 32.0, &[ALL_LINEAR])), ..base.clone() }),
        ("full + recompute", LearnerConfig { recompute: Recompute::Blocks, ..base }),
    ]
}

fn rss_kib(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status.lines().find_map(|l| l.strip_prefix(field)).unwrap().trim().trim_end_matches("kB").trim().parse().unwrap()
}

/// In the child: the runtime's RSS, then the peak RSS of a steady-state update (bytes).
fn measure(config: LearnerConfig) -> (u64, u64) {
    native::device::set_cpu_threads(2);
    let runtime = rss_kib("VmRSS:") * 1024;
    let mut learner = Learner::from_base(Llama::new(model_config(), Device::Cpu, 1).unwrap(), config).unwrap();
    let b = Batch::synthetic(ROW, ROWS, 8192);
    learner.update(&b).unwrap();
    unsafe_trim();
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
    let m = learner.update(&b).unwrap();
    assert!(m.policy_tokens > 0 && m.micro_batches == (ROW * ROWS / MICRO) as u64, "{m:?}");
    assert!(learner.model.trainable().iter().all(|(_, t)| t.requires_grad()));
    (runtime, rss_kib("VmHWM:") * 1024)
}

fn unsafe_trim() {
    extern "C" {
        fn malloc_trim(pad: usize) -> i32;
    }
    // SAFETY: malloc_trim only returns free heap pages to the kernel.
    unsafe {
        malloc_trim(0);
    }
}

#[test]
fn the_plan_predicts_the_learners_peak_rss_within_15_percent() {
    if let Ok(i) = std::env::var(CHILD) {
        let (runtime, peak) = measure(configs()[i.parse::<usize>().unwrap()].1.clone());
        println!("\nMEASURED {runtime} {peak}");
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let config = native::model::shape::ModelConfig::Llama(model_config());
    let mut report = vec![];
    for (i, (name, learner)) in configs().into_iter().enumerate() {
        let out = std::process::Command::new(&exe)
            .args(["--exact", "the_plan_predicts_the_learners_peak_rss_within_15_percent", "--nocapture", "--test-threads", "1"])
            .env(CHILD, i.to_string())
            // the allocator settings of the `harness-s` binary (scheduler/src/main.rs)
            .env("THP_MEM_ALLOC_ENABLE", "1")
            .env("MALLOC_ARENA_MAX", "2")
            .env("MALLOC_MMAP_THRESHOLD_", "1048576")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text
            .lines()
            .find_map(|l| l.split("MEASURED ").nth(1))
            .unwrap_or_else(|| panic!("{name}: {text}\n{}", String::from_utf8_lossy(&out.stderr)));
        let v: Vec<u64> = line.split_whitespace().take(2).map(|x| x.parse().unwrap_or_else(|_| panic!("{name}: `{line}`"))).collect();
        let measured = v[1] - v[0];
        let plan = learner_plan(&config, &learner, false, (MICRO / 2) as u64);
        let predicted = plan.peak() - CPU_RUNTIME_BYTES;
        let error = predicted as f64 / measured as f64 - 1.0;
        report.push(format!(
            "{name}: predicted {} measured {} ({:+.1} %); runtime {}",
            human(predicted),
            human(measured),
            100.0 * error,
            human(v[0])
        ));
        assert!(error.abs() <= 0.15, "{}", report.join("\n"));
    }
    println!("{}", report.join("\n"));
}
