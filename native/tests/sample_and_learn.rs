//! Sampling and learning together, as a run does them: the engine's sampler (`infer`) draws
//! the completions the learner (`train`) updates on. The two rooms never import each other;
//! this test, outside both, is where they meet.

use native::infer::sampler::{generate, GenerateOptions};
use native::model::qwen3_5::{Qwen35, Qwen35Config};
use native::model::{Llama, LlamaConfig, Model};
use native::train::learner::{grpo, AdamWConfig, Batch, Learner, LearnerConfig, Sample};
use tch::Device;

/// A tiny random model learns a rewarded completion: each step samples a group of 8
/// completions of a fixed prompt; reward 1 when the completion starts with token 7.
/// After 20 GRPO steps the probability of token 7 rises well above its start.
#[test]
fn tiny_model_learns_a_rewarded_completion() {
    learns_a_rewarded_completion(Llama::new(LlamaConfig::tiny(32, 64, 2), Device::Cpu, 1).unwrap().into(), 20);
}

/// The same with a tiny Qwen3.5 (sampled on its recurrent form, trained on its chunked
/// one); from its initialisation (σ = 0.02 through zero-centred norms) it takes 40 steps.
#[test]
fn tiny_qwen3_5_learns_a_rewarded_completion() {
    learns_a_rewarded_completion(Qwen35::new(Qwen35Config::shape("tiny", Some(32)).unwrap(), Device::Cpu, 1).unwrap().into(), 40);
}

fn learns_a_rewarded_completion(model: Model, steps: u64) {
    let cfg = LearnerConfig {
        optimizer: AdamWConfig { lr: 1e-2, weight_decay: 0.0, ..Default::default() },
        micro_batch_tokens: 24,
        ..Default::default()
    };
    let mut learner = Learner::new(model, cfg);
    let prompt = [1u32, 2, 3];
    let p_target = |l: &Learner| l.sequence_logprob(&prompt, &[7]).exp();
    let start = p_target(&learner);
    for step in 0..steps {
        let mut samples = vec![];
        let mut rewards = vec![];
        for k in 0..8u64 {
            let opts = GenerateOptions { max_tokens: 3, temperature: 1.0, top_p: 1.0, seed: step * 100 + k };
            let g = generate(&learner.model, &prompt, &opts, &[]).unwrap();
            rewards.push(if g.tokens[0] == 7 { 1.0 } else { 0.0 });
            samples.push(Sample {
                task: 0,
                context: prompt.to_vec(),
                mask: vec![true; g.tokens.len()],
                completion: g.tokens,
                logq: g.logprobs,
                advantage: 0.0,
                temperature: 1.0,
                scale: 1.0,
                shift: None,
            });
        }
        for (s, a) in samples.iter_mut().zip(grpo::group_advantages(&rewards)) {
            s.advantage = a;
        }
        let m = learner.update(&Batch { tasks: vec!["t".into()], samples, ..Default::default() }).unwrap();
        assert!(m.micro_batches >= 2, "the token budget splits the group");
        // q was sampled by the very weights π_old is scored with: no mismatch
        assert!(m.mismatch_tokens > 0 && m.mismatch_max < 1e-4 && m.tis_clipped_share == 0.0, "{m:?}");
    }
    let end = p_target(&learner);
    assert!(end > 0.5 && end > 5.0 * start, "p(target) went from {start:.4} to {end:.4}");
}
