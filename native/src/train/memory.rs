//! The learner's memory plan: from a model's configuration and the learner's settings, the
//! bytes of its weights, gradients, AdamW state, the activations one micro-batch keeps for
//! the backward pass (with and without recompute), the LM head's logits, and the rollout
//! engine's weights and cache; checked against a device's memory before any job runs, with
//! the settings that would make a run fit. Pure arithmetic on the configuration: a 9B
//! model's plan is made on a machine that could not hold it.
//!
//! The activation counts are those of this crate's own passes (`model/llama.rs`,
//! `model/qwen3_5.rs`): the tensors autograd keeps per token and layer, listed below per
//! architecture, and checked against the measured peak RSS of real steps
//! (`tests/memory_plan.rs`).

use crate::model::shape::ModelConfig;
use crate::train::learner::{LearnerConfig, Precision, Recompute};

/// What the process holds besides the plan's tensors: libtorch's CPU runtime and this
/// binary (measured: a learner process before its model), or the CUDA context.
pub const CPU_RUNTIME_BYTES: u64 = 320 << 20;
pub const CUDA_RUNTIME_BYTES: u64 = 700 << 20;

/// A learner's memory, by part, in bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct LearnerPlan {
    /// Parameters as stored: float32, or a frozen base in bf16 under an adapter with
    /// `precision = "bf16"`; plus the adapter's float32 factors.
    pub weights: u64,
    /// One float32 gradient per trainable parameter.
    pub gradients: u64,
    /// AdamW's two float32 moments per trainable parameter, and the step's temporaries.
    pub optimizer: u64,
    /// What the backward pass keeps of one micro-batch of `micro_batch_tokens` tokens.
    pub activations: u64,
    /// The LM head's logits over the micro-batch's scored positions (log-softmax and its
    /// gradient beside them).
    pub logits: u64,
    /// The runtime (libtorch, CUDA context).
    pub runtime: u64,
    /// Activation bytes per micro-batch token without recompute and with it.
    pub per_token_plain: u64,
    pub per_token_recompute: u64,
    pub trainable_parameters: u64,
    pub parameters: u64,
}

impl LearnerPlan {
    /// The predicted peak: everything at once in the backward pass of the last micro-batch.
    pub fn peak(&self) -> u64 {
        self.weights + self.gradients + self.optimizer + self.activations + self.logits + self.runtime
    }
}

/// Elements autograd keeps per token of one layer of `config`'s layer `layer` in this
/// crate's pass, float32 (see each line). `context`: the row length (attention's cost per
/// token where it is not fused).
fn layer_elements(config: &ModelConfig, layer: usize) -> u64 {
    match config {
        ModelConfig::Llama(c) => {
            let (h, i) = (c.hidden_size as u64, c.intermediate_size as u64);
            let q = (c.num_attention_heads * c.head_dim()) as u64;
            let kv = (c.num_key_value_heads * c.head_dim()) as u64;
            // two RMSNorms: input, normalised, weighted (3h each); q, k, v as attention
            // keeps them (k and v repeated to every head: 3q) and its output twice (the
            // fused kernel's and the heads' contiguous copy: 2q); the MLP's gate, SiLU, up and
            // product (4i); qwen3's per-head norms keep q and k twice more
            6 * h + 5 * q + 4 * i + if c.qk_norm() { 2 * (q + kv) } else { 0 }
        }
        ModelConfig::Qwen35(c) => {
            let (h, i) = (c.hidden_size as u64, c.intermediate_size as u64);
            let mlp = 6 * h + 4 * i;
            if c.full_attention[layer] {
                let q = (c.num_attention_heads * c.head_dim) as u64;
                // the query and its gate (2q), normed q and k, attention's inputs and output,
                // the gated output
                mlp + 9 * q
            } else {
                let (kd, vd) =
                    ((c.linear_num_key_heads * c.linear_key_head_dim) as u64, (c.linear_num_value_heads * c.linear_value_head_dim) as u64);
                let conv = 2 * kd + vd;
                let hv = c.linear_num_value_heads as u64;
                let chunk = crate::model::qwen3_5::CHUNK as u64;
                let state = hv * c.linear_key_head_dim as u64 * c.linear_value_head_dim as u64;
                // the projection, the convolution's input and SiLU (3·conv); the normalised
                // and scaled q and k, β-scaled k and v (4kd + 2vd); the chunk's attention
                // matrices per head (3·chunk per value head); the per-chunk states
                // (state / chunk per token, twice); z, the gated norm and its output (4vd)
                mlp + 3 * conv + 4 * kd + 6 * vd + 3 * hv * chunk + 2 * state / chunk
            }
        }
    }
}

/// The learner's plan for `config` under `learner` on a device (`cuda`: its runtime), with
/// micro-batches of `learner.micro_batch_tokens` tokens of which `scored` are completion
/// tokens (the LM head's positions; at most the micro-batch).
pub fn learner_plan(config: &ModelConfig, learner: &LearnerConfig, cuda: bool, scored: u64) -> LearnerPlan {
    let parameters = config.parameters() as u64;
    let adapter: u64 = match &learner.adapter {
        Some(a) => a
            .targeted("learner.adapter", &config.linears())
            .map(|targets| {
                let shapes = config.linears();
                targets
                    .iter()
                    .filter_map(|t| shapes.iter().find(|(n, _, _)| n == t))
                    .map(|(_, out, inp)| (a.rank * (out + inp)) as u64)
                    .sum()
            })
            .unwrap_or(0),
        None => 0,
    };
    let (base_bytes, trainable) = match (&learner.adapter, learner.precision) {
        (Some(_), Precision::Bf16) => (2, adapter),
        (Some(_), Precision::F32) => (4, adapter),
        (None, _) => (4, parameters),
    };
    let layers = config.layers() as usize;
    let h = config.hidden() as u64;
    let per_layer: Vec<u64> = (0..layers).map(|l| layer_elements(config, l)).collect();
    // bf16 products keep their inputs in bf16 beside the float32 stream: about 3/4
    let elem = |n: u64| match learner.precision {
        Precision::F32 => 4 * n,
        Precision::Bf16 => 3 * n,
    };
    // the embedding output and the final norm (h each, 3h for the norm)
    let outer = 4 * h;
    let per_token_plain = elem(per_layer.iter().sum::<u64>() + outer);
    // recompute: every layer's input (float32), one layer's activations being recomputed
    let per_token_recompute = 4 * h * layers as u64 + elem(per_layer.iter().copied().max().unwrap_or(0) + outer);
    let per_token = match learner.recompute {
        Recompute::None => per_token_plain,
        Recompute::Blocks => per_token_recompute,
    };
    let tokens = learner.micro_batch_tokens as u64;
    let largest =
        config.linears().iter().map(|(_, o, i)| (o * i) as u64).chain([(config.vocab() * config.hidden()) as u64]).max().unwrap_or(0);
    LearnerPlan {
        weights: parameters * base_bytes + adapter * 4,
        gradients: trainable * 4,
        // two moments, and two temporaries of the largest parameter in the step
        optimizer: trainable * 8 + 2 * 4 * largest.min(trainable),
        activations: per_token * tokens,
        // logits, log-softmax, and the gradient of one of them, float32
        logits: 3 * 4 * scored.min(tokens) * config.vocab() as u64,
        runtime: if cuda { CUDA_RUNTIME_BYTES } else { CPU_RUNTIME_BYTES },
        per_token_plain,
        per_token_recompute,
        trainable_parameters: trainable,
        parameters,
    }
}

/// The largest `micro_batch_tokens` (a multiple of 64, at least 64) whose plan fits in
/// `device_bytes`, or None when not even 64 tokens fit.
pub fn largest_micro_batch(config: &ModelConfig, learner: &LearnerConfig, cuda: bool, device_bytes: u64) -> Option<usize> {
    let fits = |tokens: usize| {
        let l = LearnerConfig { micro_batch_tokens: tokens, ..learner.clone() };
        learner_plan(config, &l, cuda, tokens as u64).peak() <= device_bytes
    };
    if !fits(64) {
        return None;
    }
    let (mut lo, mut hi) = (1usize, 1 << 20);
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if fits(mid * 64) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    Some(lo * 64)
}

/// The rollout engine's memory on its device: its copy of the weights in the format it
/// decodes (`bytes_per_weight`: 4 for f32, 2 for bf16, about 0.6 for int4) and the cache of
/// `sequences` sequences of `tokens` tokens each.
pub fn engine_bytes(config: &ModelConfig, bytes_per_weight: f64, sequences: u64, tokens: u64) -> u64 {
    let weights = (config.parameters() as f64 * bytes_per_weight) as u64;
    let cache = sequences * (tokens * config.kv_elements_per_token() as u64 + config.state_elements_per_sequence() as u64) * 4;
    weights + cache
}

/// Bytes as a user reads them: `12.3 GB`, `538 MB`, `74 kB`.
pub fn human(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= 1e9 {
        format!("{:.1} GB", b / 1e9)
    } else if b >= 1e6 {
        format!("{:.0} MB", b / 1e6)
    } else {
        format!("{:.0} kB", b / 1e3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::lora::{AdapterConfig, ALL_LINEAR};
    use crate::model::qwen3_5::Qwen35Config;

    /// The targets by the plan: Qwen3.5-4B with LoRA rank 64 at 4,096-token rows in
    /// ≤ 40 GB; 9B in ≤ 80 GB; full-weight 9B does not fit 80 GB.
    #[test]
    fn the_papers_policies_fit_one_gpu_with_lora_and_recompute() {
        let lora = |shape: &str| {
            let config = ModelConfig::Qwen35(Qwen35Config::shape(shape, None).unwrap());
            let learner = LearnerConfig {
                adapter: Some(AdapterConfig::lora(64, 128.0, &[ALL_LINEAR])),
                recompute: Recompute::Blocks,
                precision: Precision::Bf16,
                micro_batch_tokens: 4096,
                ..Default::default()
            };
            (learner_plan(&config, &learner, true, 2048), config)
        };
        let (four, _) = lora("4b");
        eprintln!("Qwen3.5-4B, LoRA r64 + recompute, 4096-token micro-batch: {} ({four:?})", human(four.peak()));
        assert!(four.peak() <= 40_000_000_000, "{four:?}: {}", human(four.peak()));
        let (nine, config) = lora("9b");
        eprintln!("Qwen3.5-9B, LoRA r64 + recompute, 4096-token micro-batch: {} ({nine:?})", human(nine.peak()));
        assert!(nine.peak() <= 80_000_000_000, "{nine:?}: {}", human(nine.peak()));
        let full = learner_plan(&config, &LearnerConfig { micro_batch_tokens: 4096, ..Default::default() }, true, 2048);
        eprintln!("Qwen3.5-9B, full weights, 4096-token micro-batch: {} ({full:?})", human(full.peak()));
        assert!(full.peak() > 80_000_000_000, "full-weight 9B: {}", human(full.peak()));
        // recompute keeps ≥ 3× less activation memory per token
        assert!(nine.per_token_plain >= 3 * nine.per_token_recompute, "{nine:?}");
    }

    #[test]
    fn auto_picks_the_largest_micro_batch_that_fits() {
        let config = ModelConfig::Llama(crate::model::LlamaConfig::tiny(8192, 512, 8));
        let learner = LearnerConfig::default();
        let budget = learner_plan(&config, &LearnerConfig { micro_batch_tokens: 3000, ..learner.clone() }, false, 3000).peak();
        let picked = largest_micro_batch(&config, &learner, false, budget).unwrap();
        assert!((2944..=3000).contains(&picked), "{picked}");
        assert_eq!(largest_micro_batch(&config, &learner, false, 1 << 20), None);
    }
}
