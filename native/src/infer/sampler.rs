//! Autoregressive sampling with a KV cache: greedy or temperature + top-p with a seeded
//! generator, recording each sampled token's log-probability (the rollout probability q
//! that the learner's TIS weight of Appendix B, Eq. 16, divides by).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tch::{Device, IndexOp, Kind, Tensor};

use crate::model::{CausalLm, Model};
use crate::NativeError;

/// Sampling settings of one generation.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    /// 0 means greedy (arg-max).
    pub temperature: f64,
    pub top_p: f64,
    pub seed: u64,
}

impl GenerateOptions {
    pub fn greedy(max_tokens: usize) -> Self {
        GenerateOptions { max_tokens, temperature: 0.0, top_p: 1.0, seed: 0 }
    }
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// A stop token was sampled (it is not part of `tokens`) or the caller asked to stop.
    Stop,
    /// `max_tokens` or the model's context was reached.
    Length,
}

/// Sampled tokens with their log-probabilities.
#[derive(Debug, Clone)]
pub struct Generation {
    pub tokens: Vec<u32>,
    /// log q(token): under the temperature-scaled distribution before top-p truncation
    /// (temperature 1 for greedy decoding), aligned with `tokens`.
    pub logprobs: Vec<f32>,
    pub finish: Finish,
    /// The id that stopped generation, if any.
    pub stop_token: Option<u32>,
    /// The most likely tokens at each position with their log q (same distribution as
    /// `logprobs`), when the request asked for them; aligned with `tokens`.
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
}

impl Generation {
    /// Nothing generated yet.
    pub fn empty() -> Self {
        Generation { tokens: vec![], logprobs: vec![], finish: Finish::Length, stop_token: None, top_logprobs: vec![] }
    }
}

/// Logits `[vocab]` of the next token after `prompt` (float32, on the CPU).
pub fn next_token_logits(model: &Model, prompt: &[u32]) -> Result<Vec<f32>, NativeError> {
    let _g = tch::no_grad_guard();
    let ids = to_tensor(prompt, CausalLm::device(model));
    let logits = model.logits_last(&ids, &mut model.new_cache()).i(0).to_device(Device::Cpu).to_kind(Kind::Float);
    Ok(Vec::<f32>::try_from(&logits)?)
}

fn to_tensor(ids: &[u32], device: Device) -> Tensor {
    let v: Vec<i64> = ids.iter().map(|&i| i as i64).collect();
    Tensor::from_slice(&v).view([1, v.len() as i64]).to_device(device)
}

/// Checks the settings of a generation; errors name the setting.
pub fn validate(prompt: &[u32], opts: &GenerateOptions, limit: usize) -> Result<(), NativeError> {
    if prompt.is_empty() {
        return Err(NativeError::Config { field: "prompt".into(), detail: "is empty; give at least one token".into() });
    }
    if prompt.len() >= limit {
        return Err(NativeError::Config {
            field: "prompt".into(),
            detail: format!("{} tokens do not fit the model context of {limit}", prompt.len()),
        });
    }
    if !(opts.top_p > 0.0 && opts.top_p <= 1.0) {
        return Err(NativeError::Config { field: "top_p".into(), detail: format!("must be in (0, 1], is {}", opts.top_p) });
    }
    if opts.temperature < 0.0 || !opts.temperature.is_finite() {
        return Err(NativeError::Config { field: "temperature".into(), detail: format!("must be >= 0, is {}", opts.temperature) });
    }
    Ok(())
}

/// Draws the next token from `logits` `[vocab]`: arg-max when greedy, else temperature +
/// top-p with one uniform draw from `rng`. Returns the token and its log q.
pub fn sample_next(logits: &Tensor, opts: &GenerateOptions, rng: &mut ChaCha8Rng) -> Result<(u32, f32), NativeError> {
    // The softmax and the arg-max run where the logits are: a greedy token on a GPU reads
    // back two numbers, not the vocabulary row. Top-p draws on the host from the row.
    let logits = logits.to_kind(Kind::Float);
    Ok(if opts.temperature == 0.0 {
        let lp = logits.log_softmax(-1, Kind::Float);
        let id = lp.argmax(-1, false).int64_value(&[]);
        (id as u32, lp.double_value(&[id]) as f32)
    } else {
        let lp = (&logits / opts.temperature).log_softmax(-1, Kind::Float).to_device(Device::Cpu);
        let probs = Vec::<f32>::try_from(&lp.exp())?;
        let id = sample_top_p(&probs, opts.top_p, rng.random::<f64>());
        (id as u32, lp.double_value(&[id as i64]) as f32)
    })
}

/// [`sample_next`] over the tokens `allowed` keeps (constrained decoding): the draw is from
/// the temperature-scaled distribution renormalised over them, the arg-max among them when
/// greedy. The log q returned is the model's own, before the mask (what vLLM returns as raw
/// logprobs): it is what the learner recomputes, and the mask only decides what may be drawn.
pub fn sample_masked(logits: &Tensor, opts: &GenerateOptions, rng: &mut ChaCha8Rng, allowed: &[bool]) -> Result<(u32, f32), NativeError> {
    let t = if opts.temperature == 0.0 { 1.0 } else { opts.temperature };
    let lp = Vec::<f32>::try_from((logits.to_device(Device::Cpu).to_kind(Kind::Float) / t).log_softmax(-1, Kind::Float))?;
    let best = (0..lp.len()).filter(|&i| allowed.get(i) == Some(&true)).max_by(|&a, &b| lp[a].total_cmp(&lp[b]).then(b.cmp(&a)));
    let Some(best) = best else {
        return Err(NativeError::Config { field: "constrain".into(), detail: "the grammar allows no next token".into() });
    };
    if opts.temperature == 0.0 {
        return Ok((best as u32, lp[best]));
    }
    let mut probs: Vec<f32> = lp.iter().enumerate().map(|(i, l)| if allowed.get(i) == Some(&true) { l.exp() } else { 0.0 }).collect();
    let z: f32 = probs.iter().sum();
    let u = rng.random::<f64>();
    if z.is_nan() || z <= 0.0 {
        return Ok((best as u32, lp[best]));
    }
    probs.iter_mut().for_each(|p| *p /= z);
    let id = sample_top_p(&probs, opts.top_p, u);
    Ok((id as u32, lp[id]))
}

/// The `k` most likely next tokens with their log q, under the distribution whose log q
/// [`sample_next`] records (temperature-scaled, before top-p; temperature 1 when greedy).
pub fn top_logprobs(logits: &Tensor, opts: &GenerateOptions, k: usize) -> Result<Vec<(u32, f32)>, NativeError> {
    let t = if opts.temperature == 0.0 { 1.0 } else { opts.temperature };
    let lp = (logits.to_device(Device::Cpu).to_kind(Kind::Float) / t).log_softmax(-1, Kind::Float);
    let k = k.min(lp.size()[0] as usize) as i64;
    let (values, ids) = lp.topk(k, -1, true, true);
    let values = Vec::<f32>::try_from(&values)?;
    let ids = Vec::<i64>::try_from(&ids)?;
    Ok(ids.into_iter().zip(values).map(|(i, v)| (i as u32, v)).collect())
}

/// Generates after `prompt` until a token of `stop_ids`, `max_tokens`, the model context,
/// or `should_stop(tokens so far)` returning true (used for stop strings).
pub fn generate_with(
    model: &Model,
    prompt: &[u32],
    opts: &GenerateOptions,
    stop_ids: &[u32],
    mut should_stop: impl FnMut(&[u32]) -> bool,
) -> Result<Generation, NativeError> {
    let limit = model.max_positions();
    validate(prompt, opts, limit)?;
    let _g = tch::no_grad_guard();
    let mut rng = ChaCha8Rng::seed_from_u64(opts.seed);
    let mut cache = model.new_cache();
    let mut out = Generation::empty();
    let device = CausalLm::device(model);
    let mut logits = model.logits_last(&to_tensor(prompt, device), &mut cache).i(0);
    for _ in 0..opts.max_tokens {
        let (token, logprob) = sample_next(&logits, opts, &mut rng)?;
        if stop_ids.contains(&token) {
            out.finish = Finish::Stop;
            out.stop_token = Some(token);
            break;
        }
        out.tokens.push(token);
        out.logprobs.push(logprob);
        if should_stop(&out.tokens) {
            out.finish = Finish::Stop;
            break;
        }
        if prompt.len() + out.tokens.len() >= limit {
            break;
        }
        logits = model.logits_last(&to_tensor(&[token], device), &mut cache).i(0);
    }
    Ok(out)
}

/// [`generate_with`] without a stop callback.
pub fn generate(model: &Model, prompt: &[u32], opts: &GenerateOptions, stop_ids: &[u32]) -> Result<Generation, NativeError> {
    generate_with(model, prompt, opts, stop_ids, |_| false)
}

/// Nucleus sampling: the smallest set of most probable tokens whose mass reaches `top_p`,
/// renormalised, sampled with the uniform draw `u` in [0, 1).
pub fn sample_top_p(probs: &[f32], top_p: f64, u: f64) -> usize {
    let mut order = nucleus_candidates(probs, top_p);
    order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
    let mut kept = 0;
    let mut mass = 0f64;
    for &i in &order {
        mass += probs[i] as f64;
        kept += 1;
        if mass >= top_p {
            break;
        }
    }
    let target = u * mass;
    let mut acc = 0f64;
    for &i in &order[..kept] {
        acc += probs[i] as f64;
        if acc > target {
            return i;
        }
    }
    order[kept - 1]
}

/// Tokens that hold the nucleus: those at or above a threshold whose total mass exceeds
/// `top_p` (with a margin far above the sum's rounding). They are a prefix of the
/// descending order, so the nucleus is a prefix of them and sorting them alone gives the
/// full sort's result; usually a few hundred of a 49k vocabulary instead of all of it.
fn nucleus_candidates(probs: &[f32], top_p: f64) -> Vec<usize> {
    let mut tau = 1e-3f32;
    while tau > 1e-9 {
        let cand: Vec<usize> = (0..probs.len()).filter(|&i| probs[i] >= tau).collect();
        if cand.iter().map(|&i| probs[i] as f64).sum::<f64>() >= top_p + 1e-6 {
            return cand;
        }
        tau /= 100.0;
    }
    (0..probs.len()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Llama, LlamaConfig};

    #[test]
    fn top_p_keeps_the_nucleus_only() {
        let probs = [0.1f32, 0.5, 0.3, 0.1];
        // nucleus at 0.7: tokens 1 (0.5) and 2 (0.3), mass 0.8
        assert_eq!(sample_top_p(&probs, 0.7, 0.0), 1);
        assert_eq!(sample_top_p(&probs, 0.7, 0.6), 1); // 0.6·0.8 = 0.48 < 0.5
        assert_eq!(sample_top_p(&probs, 0.7, 0.7), 2); // 0.56 > 0.5
        assert_eq!(sample_top_p(&probs, 0.7, 0.999), 2);
        assert_eq!(sample_top_p(&probs, 1.0, 0.95), 3);
    }

    /// The thresholded candidate set gives the full sort's token for every draw.
    #[test]
    fn nucleus_from_candidates_equals_the_full_sort() {
        let mut rng = ChaCha8Rng::seed_from_u64(4);
        for case in 0..40 {
            let n = 5000;
            // peaked, flat and tied distributions
            let raw: Vec<f64> = (0..n)
                .map(|i| match case % 4 {
                    0 => (-(i as f64) / 50.0).exp(),
                    1 => 1.0,
                    2 => {
                        if i % 7 == 0 {
                            3.0
                        } else {
                            1e-6
                        }
                    }
                    _ => rng.random::<f64>().powi(30),
                })
                .collect();
            let z: f64 = raw.iter().sum();
            let probs: Vec<f32> = raw.iter().map(|p| (p / z) as f32).collect();
            for top_p in [0.5, 0.9, 0.95, 1.0] {
                let u = rng.random::<f64>();
                let mut order: Vec<usize> = (0..n).collect();
                order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
                let full = {
                    let (mut kept, mut mass) = (0, 0f64);
                    for &i in &order {
                        mass += probs[i] as f64;
                        kept += 1;
                        if mass >= top_p {
                            break;
                        }
                    }
                    let (target, mut acc) = (u * mass, 0f64);
                    order[..kept]
                        .iter()
                        .copied()
                        .find(|&i| {
                            acc += probs[i] as f64;
                            acc > target
                        })
                        .unwrap_or(order[kept - 1])
                };
                assert_eq!(sample_top_p(&probs, top_p, u), full, "case {case}, top_p {top_p}");
            }
        }
    }

    #[test]
    fn seeded_sampling_repeats_and_logprobs_are_consistent() {
        let m = Model::from(Llama::new(LlamaConfig::tiny(40, 32, 2), Device::Cpu, 3).unwrap());
        let opts = GenerateOptions { max_tokens: 12, temperature: 1.0, top_p: 0.9, seed: 11 };
        let a = generate(&m, &[1, 2, 3], &opts, &[]).unwrap();
        let b = generate(&m, &[1, 2, 3], &opts, &[]).unwrap();
        assert_eq!(a.tokens, b.tokens);
        assert_eq!(a.tokens.len(), 12);
        assert_eq!(a.finish, Finish::Length);
        // the recorded logprob equals a teacher-forced full pass over prompt + completion
        let mut all = vec![1u32, 2, 3];
        all.extend(&a.tokens);
        let ids = to_tensor(&all, Device::Cpu);
        let Model::Llama(llama) = &m else { unreachable!() };
        let lp = llama.forward(&ids, None).log_softmax(-1, Kind::Float);
        for (i, (&t, &q)) in a.tokens.iter().zip(&a.logprobs).enumerate() {
            let want = lp.double_value(&[0, (2 + i) as i64, t as i64]);
            assert!((want - q as f64).abs() < 1e-4, "token {i}: {want} vs {q}");
        }
    }

    #[test]
    fn greedy_stops_on_a_stop_token() {
        let m = Model::from(Llama::new(LlamaConfig::tiny(40, 32, 2), Device::Cpu, 3).unwrap());
        let free = generate(&m, &[5, 6], &GenerateOptions::greedy(5), &[]).unwrap();
        let stop = free.tokens[2];
        let g = generate(&m, &[5, 6], &GenerateOptions::greedy(5), &[stop]).unwrap();
        let first = free.tokens.iter().position(|&t| t == stop).unwrap();
        assert_eq!(g.tokens, free.tokens[..first]);
        assert_eq!(g.finish, Finish::Stop);
        assert_eq!(g.stop_token, Some(stop));
    }
}
