//! The GRPO learner (paper §3.3, Appendix B): teacher-forced log-probabilities of policy
//! tokens in each trajectory's own harness context, the clipped objective with the TIS
//! weight, AdamW with gradient clipping, and micro-batches with gradient accumulation so
//! that long groups fit in memory (Eq. 15's normalisation is known up front, so the
//! accumulated gradient equals the full-batch one).
//!
//! The pure parts are in [`grpo`] (loss, advantages) and [`adamw`] (optimizer); this file
//! is the update loop. [`data`] turns stored trajectories into [`Sample`]s.

pub mod adamw;
pub mod data;
pub mod grpo;

use std::time::Instant;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use crate::model::lora::{self, AdapterConfig};
use crate::model::{CausalLm, Model, Pass};
use crate::NativeError;
pub use adamw::{AdamW, AdamWConfig};

/// One policy turn to train on: its generating context and the sampled completion.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Index into [`Batch::tasks`].
    pub task: usize,
    /// Prompt tokens exactly as the policy saw them (harness context included).
    pub context: Vec<u32>,
    /// Tokens the policy sampled.
    pub completion: Vec<u32>,
    /// Loss mask per completion token: false for harness-rewritten tokens.
    pub mask: Vec<bool>,
    /// Rollout log-probability q per completion token; empty when the backend gave none
    /// (then q = π_old and the TIS weight is 1).
    pub logq: Vec<f32>,
    /// GRPO advantage of the trajectory (Eq. 6).
    pub advantage: f64,
    /// The sampling temperature: π_θ and π_old are scored on logits / T, the distribution
    /// q was recorded under, so that the TIS weight is 1 when the weights are the same.
    pub temperature: f32,
    /// Eq. 15 multiplier of this row's tokens (1; under `rescue_context = "both"` the
    /// spec's weight of the context this copy of a rescue trajectory is scored in).
    pub scale: f64,
    /// `Some` when `context` is not the one the tokens were sampled in (a rescue row
    /// re-rendered under H0): the TIS weight becomes the context weight
    /// clip(π_old(y | c) / q(y | c_H), lo, hi) ([`grpo::context_weight`]) and the row's
    /// tokens are measured as a context shift, not as a rollout mismatch.
    pub shift: Option<ContextShift>,
}

/// Bounds of the truncated importance weight of a row scored in another context than it
/// was sampled in (Appendix B's TIS clip; `[algorithm] rescue_context_floor` / `_cap`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ContextShift {
    pub floor: f64,
    pub cap: f64,
}

/// One update's data: the tasks of the batch B (a task whose samples have no policy token
/// still counts in |B| and contributes zero) and their samples.
#[derive(Debug, Clone, Default)]
pub struct Batch {
    pub tasks: Vec<String>,
    pub samples: Vec<Sample>,
    /// Rescue trajectories scored in H0's context (`rescue_context = "h0"` / `"both"`).
    pub rendered_rows: u64,
    /// Rescue trajectories H0 could not re-render (a sibling that acted for the policy),
    /// kept in their generating context.
    pub kept_rows: u64,
}

/// Learner settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LearnerConfig {
    pub optimizer: AdamWConfig,
    /// Padded tokens per micro-batch (batch rows × longest row); at least one row each.
    /// Activations for the backward pass grow with it (about 2 MB per token for
    /// SmolLM2-135M), so it bounds the learner's memory.
    pub micro_batch_tokens: usize,
    /// Optimizer steps per batch; π_old stays the pre-update policy throughout.
    pub updates_per_batch: usize,
    pub seed: u64,
    /// Rows that start with the same tokens (the K rollouts of a group under one harness,
    /// one sibling's preamble across tasks) run that prefix forward and backward once per
    /// micro-batch instead of once per row ([`CausalLm::logits_at_shared`]); the gradient is
    /// the same within float rounding.
    pub share_prefixes: bool,
    /// The kind of the passes' matrix products and attention: `f32`, or `bf16` with float32
    /// parameters, gradients and AdamW moments (mixed precision, as autocast does it; where
    /// a GPU's bf16 units pay). π_old is then scored in bf16 too, so the measured
    /// training–inference mismatch against float32 rollouts grows to bf16's rounding.
    pub precision: Precision,
    /// A LoRA adapter to train instead of every weight (`[learner] adapter`): the base is
    /// frozen (stored in bf16 under `precision = "bf16"`), AdamW keeps moments of the
    /// adapter only, and checkpoints hold the adapter in PEFT's layout.
    pub adapter: Option<AdapterConfig>,
    /// `blocks`: keep only each decoder layer's input in the forward pass and run the layer
    /// again in the backward pass ([`Recompute`]); the gradient is the same.
    pub recompute: Recompute,
}

/// [`LearnerConfig::recompute`]: which activations the backward pass recomputes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    /// Keep every activation the backward pass needs (fastest, most memory).
    #[default]
    None,
    /// Keep each block's input only; the backward pass runs the blocks again one at a time,
    /// top down, and backpropagates sum(out · grad_out) through each.
    Blocks,
}

impl Default for LearnerConfig {
    fn default() -> Self {
        LearnerConfig {
            optimizer: AdamWConfig::default(),
            micro_batch_tokens: 1024,
            updates_per_batch: 1,
            seed: 0,
            share_prefixes: true,
            precision: Precision::F32,
            adapter: None,
            recompute: Recompute::None,
        }
    }
}

/// [`LearnerConfig::precision`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    #[default]
    F32,
    Bf16,
}

impl Precision {
    pub fn kind(self) -> Kind {
        match self {
            Precision::F32 => Kind::Float,
            Precision::Bf16 => Kind::BFloat16,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
        }
    }

    pub fn parse(s: &str, field: &str) -> Result<Self, NativeError> {
        match s {
            "f32" => Ok(Precision::F32),
            "bf16" => Ok(Precision::Bf16),
            other => Err(NativeError::Config { field: field.into(), detail: format!("`{other}` is not `f32` or `bf16`") }),
        }
    }
}

/// What one update did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    pub loss: f64,
    pub grad_norm: f64,
    pub policy_tokens: u64,
    pub tasks: u64,
    pub samples: u64,
    pub micro_batches: u64,
    /// Share of policy tokens whose ratio was outside [1 − η−, 1 + η+] at the last update.
    pub clip_fraction: f64,
    /// Training–inference mismatch over policy tokens with a rollout logprob: mean and max
    /// |log q − log π_old| (verl's `rollout_probs_diff`), and the share of those tokens
    /// whose TIS weight clip(π_old/q, 0, 2) was clipped at its cap (Eq. 16).
    pub mismatch_mean: f64,
    pub mismatch_max: f64,
    pub tis_clipped_share: f64,
    /// Policy tokens that had a rollout logprob (the mismatch is measured over these).
    pub mismatch_tokens: u64,
    /// Rows scored in another context than they were sampled in (rescue rows under H0):
    /// their policy tokens, the mean and max of the raw ratio π_old(y | c_H0) / q(y | c_H)
    /// and the share of tokens whose context weight was clipped at a bound.
    pub context_tokens: u64,
    pub context_ratio_mean: f64,
    pub context_ratio_max: f64,
    pub context_clipped_share: f64,
    /// Rescue trajectories scored under H0, and those kept in their generating context.
    pub rendered_rows: u64,
    pub kept_rows: u64,
    /// The policy's entropy (nats) at its policy tokens, mean over them: of π_old's whole
    /// next-token distribution at the sampling temperature. A collapse shows as a fall.
    pub entropy: f64,
    /// KL(π_old ‖ π_start) on the policy tokens, mean of the k3 estimator
    /// exp(r) − r − 1 with r = log π_start − log π_old (Schulman's low-variance, non-negative
    /// estimator; the tokens are samples of π_old up to the mismatch): how far the policy
    /// has moved from the one the run started with. Measured where the learner holds the
    /// start, a LoRA run (the base without its adapter); `kl_tokens` = 0 elsewhere.
    pub kl_to_start: f64,
    pub kl_tokens: u64,
    /// Tokens the learner ran forward and backward (context and completion of every
    /// sample it trained on, a prefix shared by the rows of a micro-batch once, per
    /// optimizer step; padding not counted): its cost in Table 9.
    pub forward_tokens: u64,
    pub seconds: f64,
}

/// The names of the learner's metrics in a run's metrics rows, defined once: the learn stage
/// writes them ([`StepMetrics::run_metrics`]) and the report and comparison read them.
pub mod metric {
    pub const POLICY_TOKENS_TRAINED: &str = "policy_tokens_trained";
    pub const TASKS: &str = "tasks";
    /// 1 when the update trained, 0 when no retained group had a policy token.
    pub const TRAINED: &str = "trained";
    pub const LOSS: &str = "loss";
    pub const GRAD_NORM: &str = "grad_norm";
    pub const CLIP_FRACTION: &str = "clip_fraction";
    pub const MISMATCH_MEAN: &str = "mismatch_mean";
    pub const MISMATCH_MAX: &str = "mismatch_max";
    pub const TIS_CLIPPED_SHARE: &str = "tis_clipped_share";
    pub const RESCUE_ROWS_UNDER_H0: &str = "rescue_rows_under_h0";
    pub const RESCUE_ROWS_KEPT: &str = "rescue_rows_kept";
    pub const CONTEXT_TOKENS: &str = "context_tokens";
    pub const CONTEXT_RATIO_MEAN: &str = "context_ratio_mean";
    pub const CONTEXT_RATIO_MAX: &str = "context_ratio_max";
    pub const CONTEXT_CLIPPED_SHARE: &str = "context_clipped_share";
    pub const ENTROPY: &str = "entropy";
    pub const KL_TO_START: &str = "kl_to_start";
}

/// [`StepMetrics::to_map`] and [`StepMetrics::from_map`] from one list of the fields: the
/// struct literal makes the compiler check the list is complete, so the two directions of
/// the manifest's metrics cannot disagree.
macro_rules! metrics_map {
    ($($field:ident: $t:ty),* $(,)?) => {
        // one list for every field: `as` is a no-op on the float ones
        #[allow(clippy::unnecessary_cast)]
        impl StepMetrics {
            /// The metrics a manifest recorded ([`StepMetrics::to_map`]); absent keys are 0.
            pub fn from_map(m: &std::collections::BTreeMap<String, f64>) -> Self {
                let f = |k: &str| m.get(k).copied().unwrap_or(0.0);
                StepMetrics { $($field: f(stringify!($field)) as $t),* }
            }

            pub fn to_map(&self) -> std::collections::BTreeMap<String, f64> {
                [$((stringify!($field), self.$field as f64)),*].into_iter().map(|(k, v)| (k.to_string(), v)).collect()
            }
        }
    };
}

metrics_map!(
    loss: f64,
    grad_norm: f64,
    policy_tokens: u64,
    tasks: u64,
    samples: u64,
    micro_batches: u64,
    clip_fraction: f64,
    mismatch_mean: f64,
    mismatch_max: f64,
    tis_clipped_share: f64,
    mismatch_tokens: u64,
    context_tokens: u64,
    context_ratio_mean: f64,
    context_ratio_max: f64,
    context_clipped_share: f64,
    rendered_rows: u64,
    kept_rows: u64,
    entropy: f64,
    kl_to_start: f64,
    kl_tokens: u64,
    forward_tokens: u64,
    seconds: f64,
);

impl StepMetrics {
    /// The metrics rows of one update. A step that trained nothing has no loss, gradient or
    /// mismatch to report: only that it trained nothing (the report shows "–" there, not a
    /// measured zero). The context columns appear when rescue rows were scored under H0.
    pub fn run_metrics(&self, trained: bool) -> Vec<(&'static str, f64)> {
        use metric::*;
        let mut values =
            vec![(POLICY_TOKENS_TRAINED, self.policy_tokens as f64), (TASKS, self.tasks as f64), (TRAINED, f64::from(u8::from(trained)))];
        if trained {
            values.extend([
                (LOSS, self.loss),
                (GRAD_NORM, self.grad_norm),
                (CLIP_FRACTION, self.clip_fraction),
                (MISMATCH_MEAN, self.mismatch_mean),
                (MISMATCH_MAX, self.mismatch_max),
                (TIS_CLIPPED_SHARE, self.tis_clipped_share),
                (ENTROPY, self.entropy),
            ]);
            if self.kl_tokens > 0 {
                values.push((KL_TO_START, self.kl_to_start));
            }
            if self.context_tokens > 0 || self.kept_rows > 0 {
                values.extend([
                    (RESCUE_ROWS_UNDER_H0, self.rendered_rows as f64),
                    (RESCUE_ROWS_KEPT, self.kept_rows as f64),
                    (CONTEXT_TOKENS, self.context_tokens as f64),
                    (CONTEXT_RATIO_MEAN, self.context_ratio_mean),
                    (CONTEXT_RATIO_MAX, self.context_ratio_max),
                    (CONTEXT_CLIPPED_SHARE, self.context_clipped_share),
                ]);
            }
        }
        values
    }
}

/// Model + optimizer + the learner's random state. Any [`CausalLm`] trains: a [`Model`] of
/// any family (the default: what the learn job loads), or one architecture's type itself
/// ([`crate::model::Llama`] for llama, qwen2 and qwen3, [`crate::model::qwen3_5::Qwen35`]).
pub struct Learner<M = Model> {
    pub model: M,
    pub optim: AdamW,
    pub config: LearnerConfig,
    pub rng: ChaCha8Rng,
}

/// Tensors of one micro-batch: the padded input rows and, flattened in (row, completion
/// token) order, where each completion token is predicted, the token, and its row's
/// temperature. Only those N positions go through the LM head.
struct MicroBatch {
    rows: Vec<usize>,
    /// `[P]` the tokens every row starts with, run once ([`CausalLm::logits_at_shared`]);
    /// None: P = 0.
    prefix: Option<Tensor>,
    /// `[rows, longest − 1]`: every token but the last of each padded row, from position P.
    input: Tensor,
    /// `[N]` flat index (row · (longest − 1) + column − P) of each completion token's prediction.
    flat: Tensor,
    /// `[N]` the completion tokens.
    targets: Tensor,
    /// `[N]` sampling temperature of each token's row.
    temperature: Tensor,
    /// Start of each row's tokens in the N vector.
    offsets: Vec<usize>,
}

impl<M: CausalLm> Learner<M> {
    /// The learner of `model` as it is: it trains the model's adapter if it has one
    /// ([`CausalLm::trainable`]), else every weight. [`Learner::from_base`] attaches
    /// `config.adapter`.
    pub fn new(mut model: M, config: LearnerConfig) -> Self {
        let rng = ChaCha8Rng::seed_from_u64(config.seed);
        model.set_compute(config.precision.kind());
        Learner { optim: AdamW::new(config.optimizer.clone()), model, config, rng }
    }

    /// The learner of a base model: with `config.adapter`, a fresh adapter is attached and
    /// the base frozen (in bf16 under `precision = "bf16"`); errors name `learner.adapter`.
    pub fn from_base(mut model: M, config: LearnerConfig) -> Result<Self, NativeError> {
        if let Some(adapter) = &config.adapter {
            lora::attach(&mut model, adapter, config.seed, config.precision.kind(), "learner.adapter")?;
        }
        Ok(Learner::new(model, config))
    }

    fn device(&self) -> Device {
        self.model.device()
    }

    /// Groups sample indices into micro-batches under the padded-token budget, each with
    /// the length of the prefix its rows share (0: none). Without prefix sharing the rows
    /// keep `order`; with it they are sorted by their tokens, so that rows with a common
    /// start are neighbours, and cut into runs that share a prefix ([`shared_runs`]).
    fn plan(&self, order: &[usize], samples: &[Sample]) -> Vec<(Vec<usize>, usize)> {
        let tokens = |i: usize| samples[i].context.iter().chain(&samples[i].completion);
        if !self.config.share_prefixes {
            return pack(order, 0, samples, self.config.micro_batch_tokens);
        }
        let mut sorted = order.to_vec();
        sorted.sort_by(|&a, &b| tokens(a).cmp(tokens(b)));
        let mut out = vec![];
        let mut alone = vec![];
        for (rows, prefix) in shared_runs(&sorted, samples) {
            if rows.len() == 1 {
                alone.extend(rows);
            } else {
                out.extend(pack(&rows, prefix, samples, self.config.micro_batch_tokens));
            }
        }
        out.extend(pack(&alone, 0, samples, self.config.micro_batch_tokens));
        // A run cut into micro-batches may leave a row on its own: it needs no prefix.
        out.into_iter().map(|(rows, p)| if rows.len() == 1 { (rows, 0) } else { (rows, p) }).collect()
    }

    /// The micro-batch of `rows`, whose first `prefix` tokens are the same (at most the
    /// shortest context − 1, so that every prediction falls after the prefix).
    fn tensors(&self, rows: &[usize], prefix: usize, samples: &[Sample]) -> MicroBatch {
        let longest = rows.iter().map(|&i| samples[i].context.len() + samples[i].completion.len() - prefix).max().unwrap_or(2).max(2);
        let cols = longest - 1;
        let mut ids = vec![0i64; rows.len() * longest];
        let (mut flat, mut targets, mut temps, mut offsets) = (vec![], vec![], vec![], vec![]);
        for (r, &i) in rows.iter().enumerate() {
            let s = &samples[i];
            for (j, &t) in s.context.iter().chain(&s.completion).skip(prefix).enumerate() {
                ids[r * longest + j] = t as i64;
            }
            offsets.push(flat.len());
            let temperature = data::scoring_temperature(s.temperature);
            for (j, &t) in s.completion.iter().enumerate() {
                // completion token j is predicted at position context + j − 1 (context ≥ 1),
                // column context + j − 1 − prefix of the row's tokens after the prefix
                flat.push((r * cols + s.context.len() + j - 1 - prefix) as i64);
                targets.push(t as i64);
                temps.push(temperature);
            }
        }
        let dev = self.device();
        let input = Tensor::from_slice(&ids).view([rows.len() as i64, longest as i64]).narrow(1, 0, cols as i64).to_device(dev);
        let prefix = (prefix > 0).then(|| {
            let first = &samples[rows[0]];
            let p: Vec<i64> = first.context.iter().chain(&first.completion).take(prefix).map(|&t| t as i64).collect();
            Tensor::from_slice(&p).to_device(dev)
        });
        MicroBatch {
            rows: rows.to_vec(),
            prefix,
            input,
            flat: Tensor::from_slice(&flat).to_device(dev),
            targets: Tensor::from_slice(&targets).to_device(dev),
            temperature: Tensor::from_slice(&temps).to_device(dev),
            offsets,
        }
    }

    /// log π(token) `[N]` of every completion token at its row's sampling temperature.
    fn token_logprobs(&self, mb: &MicroBatch) -> Tensor {
        Self::logprobs_of(mb, &self.model.pass(mb.prefix.as_ref(), &mb.input, &mb.flat).run())
    }

    /// log π(token) `[N]` from the logits `[N, vocab]` of the micro-batch's positions.
    fn logprobs_of(mb: &MicroBatch, logits: &Tensor) -> Tensor {
        let logits = logits.to_kind(Kind::Float) / mb.temperature.unsqueeze(-1);
        logits.log_softmax(-1, Kind::Float).gather(-1, &mb.targets.unsqueeze(-1), false).squeeze_dim(-1)
    }

    /// Entropy (nats) `[N]` of the next-token distribution at each position, at the row's
    /// temperature, without gradient; in slices of rows so that no second `[N, vocab]`
    /// tensor is held at once.
    fn entropy_of(mb: &MicroBatch, logits: &Tensor) -> Tensor {
        let _g = tch::no_grad_guard();
        let n = logits.size()[0];
        let mut parts = vec![];
        let mut start = 0;
        while start < n {
            let len = (n - start).min(256);
            let l = logits.narrow(0, start, len).detach().to_kind(Kind::Float) / mb.temperature.narrow(0, start, len).unsqueeze(-1);
            let lp = l.log_softmax(-1, Kind::Float);
            parts.push(-(lp.exp() * &lp).sum_dim_intlist([-1i64].as_slice(), false, Kind::Float));
            start += len;
        }
        // a micro-batch holds at least one completion token (rows without any are left out)
        Tensor::cat(&parts, 0)
    }

    /// log π_start `[N]` of every micro-batch's tokens: the base without its adapter (a LoRA
    /// run); None when the learner trains every weight (it holds no starting policy).
    fn start_logprobs(&mut self, batches: &[MicroBatch]) -> Option<Vec<Tensor>> {
        if !lora::is_adapted(&self.model) {
            return None;
        }
        let _g = tch::no_grad_guard();
        Some(lora::without_adapters(&mut self.model, |m| {
            batches.iter().map(|mb| Self::logprobs_of(mb, &m.pass(mb.prefix.as_ref(), &mb.input, &mb.flat).run()).detach()).collect()
        }))
    }

    /// Forward and backward of one micro-batch: `loss_of` turns the token log-probabilities
    /// `[N]` into the loss, whose gradient is accumulated into the trainable parameters.
    /// Returns the loss and the log-probabilities (detached). Under `recompute = "blocks"`
    /// the pass keeps only each block's input ([`backward_in_blocks`]).
    fn forward_backward(
        &self,
        mb: &MicroBatch,
        entropy: bool,
        loss_of: impl FnOnce(&Tensor) -> Tensor,
    ) -> (Tensor, Tensor, Option<Tensor>) {
        let pass = self.model.pass(mb.prefix.as_ref(), &mb.input, &mb.flat);
        let (mut logp, mut ent) = (None, None);
        let loss = {
            let head = |logits: &Tensor| {
                if entropy {
                    ent = Some(Self::entropy_of(mb, logits));
                }
                let lp = Self::logprobs_of(mb, logits);
                let loss = loss_of(&lp);
                logp = Some(lp.detach());
                loss
            };
            match self.config.recompute {
                Recompute::None => {
                    let loss = head(&pass.run());
                    loss.backward();
                    loss.detach()
                }
                Recompute::Blocks => backward_in_blocks(pass.as_ref(), head),
            }
        };
        (loss, logp.expect("the head ran"), ent)
    }

    /// `[N]` tensor of `value(sample, sample index, token index)` in the micro-batch's order.
    fn scatter(&self, mb: &MicroBatch, samples: &[Sample], value: impl Fn(&Sample, usize, usize) -> f32) -> Tensor {
        let mut out = vec![];
        for &i in &mb.rows {
            out.extend((0..samples[i].completion.len()).map(|j| value(&samples[i], i, j)));
        }
        Tensor::from_slice(&out).to_device(self.device())
    }

    /// Splits an `[N]` vector of this micro-batch back into its rows' tokens.
    fn per_row(mb: &MicroBatch, samples: &[Sample], t: &Tensor, out: &mut [Vec<f32>]) -> Result<(), NativeError> {
        let v = Vec::<f32>::try_from(t.to_device(Device::Cpu).to_kind(Kind::Float).contiguous())?;
        for (r, &i) in mb.rows.iter().enumerate() {
            out[i] = v[mb.offsets[r]..mb.offsets[r] + samples[i].completion.len()].to_vec();
        }
        Ok(())
    }

    /// Checks the batch; errors name the sample.
    fn validate(batch: &Batch) -> Result<(), NativeError> {
        for (k, s) in batch.samples.iter().enumerate() {
            if s.task >= batch.tasks.len() {
                return Err(NativeError::Input(format!("sample {k} refers to task {} of {}", s.task, batch.tasks.len())));
            }
            if s.mask.len() != s.completion.len() || (!s.logq.is_empty() && s.logq.len() != s.completion.len()) {
                return Err(NativeError::Input(format!(
                    "sample {k} (task `{}`): {} completion tokens but {} mask entries and {} rollout logprobs",
                    batch.tasks[s.task],
                    s.completion.len(),
                    s.mask.len(),
                    s.logq.len()
                )));
            }
            if s.context.is_empty() && !s.completion.is_empty() {
                return Err(NativeError::Input(format!(
                    "sample {k} (task `{}`) has no context to predict its first token from",
                    batch.tasks[s.task]
                )));
            }
            if !s.advantage.is_finite() {
                return Err(NativeError::Input(format!("sample {k} (task `{}`) has advantage {}", batch.tasks[s.task], s.advantage)));
            }
        }
        Ok(())
    }

    /// One GRPO update on `batch` (Appendix B, Eq. 15): π_old is the policy before the
    /// update; `updates_per_batch` optimizer steps each accumulate the gradient over all
    /// micro-batches, clip it and apply AdamW.
    pub fn update(&mut self, batch: &Batch) -> Result<StepMetrics, NativeError> {
        Self::validate(batch)?;
        let started = Instant::now();
        let samples = &batch.samples;
        let n_tasks = batch.tasks.len();
        let task_of: Vec<usize> = samples.iter().map(|s| s.task).collect();
        let masks: Vec<Vec<bool>> = samples.iter().map(|s| s.mask.clone()).collect();
        let scales: Vec<f64> = samples.iter().map(|s| s.scale).collect();
        let weights = grpo::token_weights(&task_of, &masks, &scales, n_tasks);
        let policy_tokens: u64 = masks.iter().map(|m| m.iter().filter(|b| **b).count() as u64).sum();
        let mut metrics = StepMetrics {
            tasks: n_tasks as u64,
            samples: samples.len() as u64,
            policy_tokens,
            rendered_rows: batch.rendered_rows,
            kept_rows: batch.kept_rows,
            ..Default::default()
        };
        if policy_tokens == 0 {
            metrics.seconds = started.elapsed().as_secs_f64();
            return Ok(metrics);
        }
        let mut order: Vec<usize> = (0..samples.len()).filter(|&i| !samples[i].completion.is_empty()).collect();
        order.shuffle(&mut self.rng);
        let plan = self.plan(&order, samples);
        metrics.micro_batches = plan.len() as u64;
        let per_pass: usize = plan
            .iter()
            .map(|(rows, prefix)| {
                prefix + rows.iter().map(|&i| samples[i].context.len() + samples[i].completion.len() - prefix).sum::<usize>()
            })
            .sum();
        metrics.forward_tokens = (per_pass * self.config.updates_per_batch.max(1)) as u64;
        let batches: Vec<MicroBatch> = plan.iter().map(|(rows, prefix)| self.tensors(rows, *prefix, samples)).collect();
        let start = self.start_logprobs(&batches);
        let (mut entropy_sum, mut kl_sum) = (0f64, 0f64);

        // π_old is the pre-update policy. The first pass's forward runs with those very
        // parameters, so its detached log-probabilities are π_old (ratio 1, gradient of
        // ρ·A): no separate scoring pass. Later passes reuse them.
        let mut old: Vec<Vec<f32>> = vec![vec![]; samples.len()];
        let params = self.model.trainable();
        for pass in 0..self.config.updates_per_batch.max(1) {
            AdamW::zero_grad(&params);
            let mut loss_total = 0f64;
            let mut clipped = 0f64;
            for (b, mb) in batches.iter().enumerate() {
                let adv = self.scatter(mb, samples, |s, _, _| s.advantage as f32);
                let weight = self.scatter(mb, samples, |_, i, j| weights[i][j] as f32);
                let bounds = |s: &Sample| s.shift.map(|c| (c.floor, c.cap)).unwrap_or((0.0, grpo::TIS_CAP));
                let lo = self.scatter(mb, samples, |s, _, _| bounds(s).0 as f32);
                let hi = self.scatter(mb, samples, |s, _, _| bounds(s).1 as f32);
                let (mut scored, mut filed) = (None, Ok(()));
                let (loss, logp, ent) = self.forward_backward(mb, pass == 0, |logp| {
                    // π_old: on the first pass the forward's own values (ratio 1), stored
                    // for the later passes
                    let logp_old = if pass == 0 {
                        let detached = logp.detach();
                        filed = Self::per_row(mb, samples, &detached, &mut old);
                        detached
                    } else {
                        self.scatter(mb, samples, |_, i, j| old[i][j])
                    };
                    let logq = match filed {
                        Ok(()) => self.scatter(mb, samples, |s, i, j| if s.logq.is_empty() { old[i][j] } else { s.logq[j] }),
                        Err(_) => logp_old.shallow_clone(),
                    };
                    let loss = grpo::grpo_loss_bounded(logp, &logp_old, &logq, &adv, &weight, &lo, &hi);
                    scored = Some(logp_old);
                    loss
                });
                filed?;
                let logp_old = scored.expect("the loss ran");
                loss_total += loss.double_value(&[]);
                let _g = tch::no_grad_guard();
                let ratio = (&logp - &logp_old).exp();
                let outside = ratio.lt(1.0 - grpo::ETA_MINUS).logical_or(&ratio.gt(1.0 + grpo::ETA_PLUS));
                clipped += outside.logical_and(&weight.gt(0.0)).sum(Kind::Float).double_value(&[]);
                if pass == 0 {
                    // π_old's entropy and its k3 distance to the start, over policy tokens
                    let policy = self.scatter(mb, samples, |s, _, j| f32::from(u8::from(s.mask[j])));
                    if let Some(ent) = ent {
                        entropy_sum += (ent * &policy).sum(Kind::Double).double_value(&[]);
                    }
                    if let Some(start) = &start {
                        let r = &start[b] - &logp_old;
                        let k3 = r.exp() - &r - 1.0;
                        kl_sum += (k3 * &policy).sum(Kind::Double).double_value(&[]);
                    }
                }
            }
            metrics.grad_norm = self.optim.clip_grad_norm(&params);
            self.optim.step(&params);
            metrics.loss = loss_total;
            metrics.clip_fraction = clipped / policy_tokens as f64;
        }
        let m = mismatch(samples, &old);
        (metrics.mismatch_mean, metrics.mismatch_max, metrics.tis_clipped_share, metrics.mismatch_tokens) = m;
        let c = context_shift(samples, &old);
        (metrics.context_ratio_mean, metrics.context_ratio_max, metrics.context_clipped_share, metrics.context_tokens) = c;
        metrics.entropy = entropy_sum / policy_tokens as f64;
        if start.is_some() {
            metrics.kl_to_start = kl_sum / policy_tokens as f64;
            metrics.kl_tokens = policy_tokens;
        }
        AdamW::zero_grad(&params);
        metrics.seconds = started.elapsed().as_secs_f64();
        tracing::info!(
            loss = metrics.loss,
            grad_norm = metrics.grad_norm,
            policy_tokens,
            micro_batches = metrics.micro_batches,
            mismatch_mean = metrics.mismatch_mean,
            mismatch_max = metrics.mismatch_max,
            // 0 when no trained row carries its sampler's log-probabilities (rows scored in
            // another context than they were sampled in): then the two figures above are not
            // measured
            mismatch_tokens = metrics.mismatch_tokens,
            entropy = metrics.entropy,
            kl_to_start = metrics.kl_to_start,
            seconds = metrics.seconds,
            "GRPO update"
        );
        Ok(metrics)
    }

    /// log π_θ of every completion token of each sample at the sample's temperature, under
    /// the current parameters and without gradient: π_old of Eq. 7, as an update computes
    /// it. Empty for samples without completion tokens.
    pub fn score(&self, samples: &[Sample]) -> Vec<Vec<f32>> {
        let order: Vec<usize> =
            (0..samples.len()).filter(|&i| !samples[i].completion.is_empty() && !samples[i].context.is_empty()).collect();
        let _g = tch::no_grad_guard();
        let mut old = vec![vec![]; samples.len()];
        for (rows, prefix) in self.plan(&order, samples) {
            let mb = self.tensors(&rows, prefix, samples);
            Self::per_row(&mb, samples, &self.token_logprobs(&mb), &mut old).expect("log-probabilities are a float tensor");
        }
        old
    }

    /// Mean log-probability of `completion` after `context` under the current parameters.
    pub fn sequence_logprob(&self, context: &[u32], completion: &[u32]) -> f64 {
        let _g = tch::no_grad_guard();
        let s = Sample {
            task: 0,
            context: context.to_vec(),
            completion: completion.to_vec(),
            mask: vec![true; completion.len()],
            logq: vec![],
            advantage: 0.0,
            temperature: 1.0,
            scale: 1.0,
            shift: None,
        };
        let mb = self.tensors(&[0], 0, std::slice::from_ref(&s));
        self.token_logprobs(&mb).sum(Kind::Double).double_value(&[]) / completion.len().max(1) as f64
    }

    /// Serialisable state of the learner's generator.
    pub fn rng_state(&self) -> String {
        serde_json::json!({
            "seed": hex::encode(self.rng.get_seed()),
            "stream": self.rng.get_stream(),
            "word_pos": self.rng.get_word_pos().to_string(),
        })
        .to_string()
    }

    /// Restores the generator from [`Learner::rng_state`]'s text.
    pub fn set_rng_state(&mut self, state: &str) -> Result<(), NativeError> {
        let bad = |d: &str| NativeError::Config { field: "rng_state".into(), detail: d.to_string() };
        let v: serde_json::Value = serde_json::from_str(state).map_err(|e| bad(&e.to_string()))?;
        let seed: [u8; 32] = hex::decode(v["seed"].as_str().unwrap_or_default())
            .ok()
            .and_then(|b| b.try_into().ok())
            .ok_or_else(|| bad("`seed` must be 64 hex digits"))?;
        let stream = v["stream"].as_u64().ok_or_else(|| bad("`stream` must be an integer"))?;
        let word_pos: u128 =
            v["word_pos"].as_str().and_then(|s| s.parse().ok()).ok_or_else(|| bad("`word_pos` must be an integer string"))?;
        let mut rng = ChaCha8Rng::from_seed(seed);
        rng.set_stream(stream);
        rng.set_word_pos(word_pos);
        self.rng = rng;
        Ok(())
    }
}

/// Rows shorter than this share no prefix: the saving would not pay for a second pass.
const MIN_SHARED_PREFIX: usize = 16;

/// Cuts `sorted` (rows in token order) into runs that share a prefix, with its length. A
/// row joins the run before it when the run's prefix, shortened to what the row shares
/// (and to its context − 1, so that all its predictions fall after the prefix), stays at
/// least [`MIN_SHARED_PREFIX`] long and computes no more tokens than the row alone:
/// n rows with prefix P cost Σ len − (n − 1)·P, so the row joins iff n·P' ≥ (n − 1)·P.
fn shared_runs(sorted: &[usize], samples: &[Sample]) -> Vec<(Vec<usize>, usize)> {
    let tokens = |i: usize| -> Vec<u32> { samples[i].context.iter().chain(&samples[i].completion).copied().collect() };
    let mut runs: Vec<(Vec<usize>, usize)> = vec![];
    let mut prev: Vec<u32> = vec![];
    for &i in sorted {
        let t = tokens(i);
        let cap = samples[i].context.len() - 1;
        let common = prev.iter().zip(&t).take_while(|(a, b)| a == b).count().min(cap);
        prev = t;
        if let Some((rows, prefix)) = runs.last_mut() {
            let n = rows.len();
            let shared = if n == 1 { common.min(samples[rows[0]].context.len() - 1) } else { common.min(*prefix) };
            if shared >= MIN_SHARED_PREFIX && (n == 1 || n * shared >= (n - 1) * *prefix) {
                rows.push(i);
                *prefix = shared;
                continue;
            }
        }
        runs.push((vec![i], 0));
    }
    runs
}

/// Packs `rows` (sharing `prefix` tokens) into micro-batches of at most `budget` padded
/// tokens (prefix + rows × longest remainder), at least one row each, in order.
fn pack(rows: &[usize], prefix: usize, samples: &[Sample], budget: usize) -> Vec<(Vec<usize>, usize)> {
    let mut out: Vec<(Vec<usize>, usize)> = vec![];
    let mut cur: Vec<usize> = vec![];
    let mut longest = 0usize;
    for &i in rows {
        let len = samples[i].context.len() + samples[i].completion.len() - prefix;
        let new_longest = longest.max(len);
        if !cur.is_empty() && prefix + new_longest * (cur.len() + 1) > budget {
            out.push((std::mem::take(&mut cur), prefix));
            longest = len;
        } else {
            longest = new_longest;
        }
        cur.push(i);
    }
    if !cur.is_empty() {
        out.push((cur, prefix));
    }
    out
}

/// Training–inference mismatch over policy tokens that carry a rollout logprob: mean and
/// max |log q − log π_old|, the share of tokens whose TIS weight clip(π_old/q, 0, 2) hit
/// its cap (Eq. 16), and how many tokens were measured.
pub fn mismatch(samples: &[Sample], old: &[Vec<f32>]) -> (f64, f64, f64, u64) {
    let (mut sum, mut max, mut capped, mut n) = (0f64, 0f64, 0u64, 0u64);
    for (s, o) in samples.iter().zip(old) {
        if s.shift.is_some() || s.logq.is_empty() || o.len() != s.logq.len() {
            continue;
        }
        for (j, &m) in s.mask.iter().enumerate() {
            if m {
                let d = (s.logq[j] as f64 - o[j] as f64).abs();
                sum += d;
                max = max.max(d);
                n += 1;
                if grpo::tis_weight(o[j] as f64, s.logq[j] as f64) >= grpo::TIS_CAP {
                    capped += 1;
                }
            }
        }
    }
    if n == 0 {
        return (0.0, 0.0, 0.0, 0);
    }
    (sum / n as f64, max, capped as f64 / n as f64, n)
}

impl Batch {
    /// A synthetic batch for benchmarks and memory measurements: one task, `group` rows of
    /// `len` tokens (half context, half completion, every completion token the policy's),
    /// different from their first token on (nothing to share), rewards alternating 0 and 1
    /// (Eq. 6's advantages).
    pub fn synthetic(len: usize, group: usize, vocab: u32) -> Batch {
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
        let mut batch = Batch { tasks: vec!["synthetic".into()], samples, ..Default::default() };
        for (s, a) in batch.samples.iter_mut().zip(grpo::group_advantages(&rewards)) {
            s.advantage = a;
        }
        batch
    }
}

/// Forward and backward of `pass` keeping only each block's input (activation recompute):
/// the blocks run without a graph, the head's loss (`head` of the logits) backpropagates to
/// the last block's output, and then, top down, each block runs again from its stored input
/// and backpropagates sum(out · grad_out), which gives its parameters' gradients and the
/// gradient of its input. The embedding's gradient comes last. The parameter gradients are
/// those of one whole backward pass; the memory is one block's activations plus every
/// block's input. Returns the loss, detached.
pub fn backward_in_blocks(pass: &dyn Pass, head: impl FnOnce(&Tensor) -> Tensor) -> Tensor {
    let embedded = pass.input();
    let mut inputs = Vec::with_capacity(pass.len());
    let top = {
        let _g = tch::no_grad_guard();
        let mut x = embedded.detach();
        for i in 0..pass.len() {
            let next = pass.block(i, &x);
            inputs.push(x);
            x = next;
        }
        x
    };
    let top = top.set_requires_grad(true);
    let loss = head(&pass.output(&top));
    loss.backward();
    let mut grad = top.grad();
    for (i, x) in inputs.into_iter().enumerate().rev() {
        let x = x.set_requires_grad(true);
        (pass.block(i, &x) * &grad).sum(Kind::Float).backward();
        grad = x.grad();
    }
    if embedded.requires_grad() {
        (embedded * grad).sum(Kind::Float).backward();
    }
    loss.detach()
}

/// The context shift of rows scored in another context than they were sampled in (rescue
/// rows under H0): over their policy tokens, the mean and max of the raw ratio
/// π_old(y | c) / q(y | c_H), the share whose context weight was clipped at a bound, and how
/// many tokens were measured.
pub fn context_shift(samples: &[Sample], old: &[Vec<f32>]) -> (f64, f64, f64, u64) {
    let (mut sum, mut max, mut clipped, mut n) = (0f64, 0f64, 0u64, 0u64);
    for (s, o) in samples.iter().zip(old) {
        let Some(shift) = s.shift else { continue };
        if s.logq.is_empty() || o.len() != s.logq.len() {
            continue;
        }
        for (j, &m) in s.mask.iter().enumerate() {
            if m {
                let ratio = (o[j] as f64 - s.logq[j] as f64).exp();
                sum += ratio;
                max = max.max(ratio);
                n += 1;
                if ratio <= shift.floor || ratio >= shift.cap {
                    clipped += 1;
                }
            }
        }
    }
    if n == 0 {
        return (0.0, 0.0, 0.0, 0);
    }
    (sum / n as f64, max, clipped as f64 / n as f64, n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Llama, LlamaConfig};

    fn tiny(seed: u64) -> Llama {
        Llama::new(LlamaConfig::tiny(32, 64, 2), Device::Cpu, seed).unwrap()
    }

    impl Sample {
        /// A test sample whose completion tokens are all the policy's, without rollout
        /// log-probabilities (q = π_old), at temperature 1.
        pub(crate) fn plain(task: usize, context: &[u32], completion: &[u32], advantage: f64) -> Sample {
            Sample {
                task,
                context: context.to_vec(),
                completion: completion.to_vec(),
                mask: vec![true; completion.len()],
                logq: vec![],
                advantage,
                temperature: 1.0,
                scale: 1.0,
                shift: None,
            }
        }
    }

    fn batch() -> Batch {
        Batch {
            tasks: vec!["a".into(), "b".into()],
            samples: vec![
                Sample {
                    task: 0,
                    context: vec![1, 2],
                    completion: vec![3, 4, 5],
                    mask: vec![true, false, true],
                    logq: vec![-3.0, -3.0, -3.5],
                    advantage: 1.0,
                    temperature: 1.0,
                    scale: 1.0,
                    shift: None,
                },
                Sample::plain(0, &[2], &[6], -1.0),
                Sample {
                    task: 1,
                    context: vec![9, 9, 9],
                    completion: vec![1, 2],
                    mask: vec![true, true],
                    logq: vec![-4.0, -4.0],
                    advantage: 0.5,
                    temperature: 1.0,
                    scale: 1.0,
                    shift: None,
                },
            ],
            ..Default::default()
        }
    }

    /// Eq. 15 by hand: J = (1/|B|) Σ_x (1/N_x) Σ_tokens ρ·A·w. On the first pass ρ = 1 and,
    /// without rollout logprobs, w = 1. Task `a` has tokens with A = +1, +1, −1 (N_a = 3);
    /// task `b` is in the batch with no policy token (its group had no reward contrast), so
    /// |B| = 2 and loss = −(1 + 1 − 1) / (2 · 3) = −1/6, not the −1/3 of dividing by the
    /// tasks that have tokens.
    #[test]
    fn eq15_divides_by_every_task_of_the_batch() {
        let batch = Batch {
            tasks: vec!["a".into(), "b".into()],
            samples: vec![Sample::plain(0, &[1, 2], &[3, 4], 1.0), Sample::plain(0, &[2], &[6], -1.0)],
            ..Default::default()
        };
        let mut l = Learner::new(tiny(3), LearnerConfig::default());
        let m = l.update(&batch).unwrap();
        assert_eq!((m.tasks, m.policy_tokens), (2, 3));
        assert!((m.loss + 1.0 / 6.0).abs() < 1e-6, "loss {}", m.loss);
        let mut alone = Learner::new(tiny(3), LearnerConfig::default());
        let m = alone.update(&Batch { tasks: vec!["a".into()], ..batch }).unwrap();
        assert!((m.loss + 1.0 / 3.0).abs() < 1e-6, "loss {}", m.loss);
    }

    /// A two-turn episode as one row (turn 2's context = turn 1's context, its reply and a
    /// tool result) scores every policy token as the two per-turn rows do, and the update
    /// is the same: the in-between tokens are masked and count nowhere.
    #[test]
    fn merged_turns_score_and_train_like_separate_ones() {
        let turn1 = Sample {
            task: 0,
            context: vec![1, 2, 3],
            completion: vec![4, 5],
            mask: vec![true, true],
            logq: vec![-3.0, -3.1],
            advantage: 1.0,
            temperature: 0.7,
            scale: 1.0,
            shift: None,
        };
        let turn2 = Sample {
            task: 0,
            context: vec![1, 2, 3, 4, 5, 9, 8],
            completion: vec![6, 7, 10],
            mask: vec![true, false, true],
            logq: vec![-3.2, -3.3, -3.4],
            advantage: 1.0,
            temperature: 0.7,
            scale: 1.0,
            shift: None,
        };
        let other = Sample {
            task: 0,
            context: vec![1, 2],
            completion: vec![11],
            mask: vec![true],
            logq: vec![-2.0],
            advantage: -1.0,
            temperature: 0.7,
            scale: 1.0,
            shift: None,
        };
        let separate = vec![turn1.clone(), turn2.clone(), other.clone()];
        let merged = data::merge_shared_prefixes(separate.clone());
        assert_eq!(merged.len(), 2, "the two turns fold, the other trajectory's row stays");
        assert_eq!(merged[0].completion, vec![4, 5, 9, 8, 6, 7, 10]);
        assert_eq!(merged[0].mask, vec![true, true, false, false, true, false, true]);
        let l = Learner::new(tiny(4), LearnerConfig::default());
        let (a, b) = (l.score(&separate), l.score(&merged));
        let folded: Vec<f32> = a[0].iter().chain(&a[1]).copied().collect();
        let policy: Vec<f32> = b[0].iter().enumerate().filter(|(j, _)| !(2..4).contains(j)).map(|(_, v)| *v).collect();
        for (x, y) in folded.iter().zip(&policy) {
            assert!((x - y).abs() < 1e-5, "{folded:?} vs {policy:?}");
        }
        let tasks = vec!["t".to_string()];
        let m1 = Learner::new(tiny(4), LearnerConfig::default())
            .update(&Batch { tasks: tasks.clone(), samples: separate, ..Default::default() })
            .unwrap();
        let m2 = Learner::new(tiny(4), LearnerConfig::default()).update(&Batch { tasks, samples: merged, ..Default::default() }).unwrap();
        assert_eq!((m1.policy_tokens, m1.mismatch_tokens), (m2.policy_tokens, m2.mismatch_tokens));
        assert!((m1.loss - m2.loss).abs() < 1e-6 && (m1.grad_norm - m2.grad_norm).abs() < 1e-4 * m1.grad_norm, "{m1:?} vs {m2:?}");
        // a context that does not extend the previous row (a re-tokenised reply) stays apart
        let mut retokenised = turn2;
        retokenised.context[4] = 12;
        assert_eq!(data::merge_shared_prefixes(vec![turn1, retokenised]).len(), 2);
    }

    /// Entropy is that of the whole next-token distribution: ln(vocab) for a policy whose
    /// logits are all equal, less for the random tiny model, never below 0. KL to the start
    /// is measured for a LoRA learner only: exactly 0 while its adapter is fresh (B = 0),
    /// above 0 once an update moved the adapter; full fine-tuning reports no KL tokens.
    #[test]
    fn entropy_and_kl_to_the_start() {
        let vocab = LlamaConfig::tiny(32, 64, 2).vocab_size as f64;
        let cfg = LearnerConfig { optimizer: AdamWConfig { lr: 1e-2, ..Default::default() }, ..Default::default() };
        let mut full = Learner::new(tiny(7), cfg.clone());
        let m = full.update(&batch()).unwrap();
        assert!(m.entropy > 0.0 && m.entropy < vocab.ln(), "{}", m.entropy);
        assert_eq!((m.kl_tokens, m.kl_to_start), (0, 0.0));
        assert!(m.run_metrics(true).iter().any(|(k, _)| *k == metric::ENTROPY));
        assert!(!m.run_metrics(true).iter().any(|(k, _)| *k == metric::KL_TO_START));

        let lora = LearnerConfig { adapter: Some(AdapterConfig::lora(4, 8.0, &[lora::ALL_LINEAR])), ..cfg };
        let mut adapted = Learner::from_base(tiny(7), lora).unwrap();
        let first = adapted.update(&batch()).unwrap();
        assert_eq!(first.kl_tokens, first.policy_tokens);
        assert_eq!(first.kl_to_start, 0.0, "a fresh adapter is the start");
        assert!((first.entropy - m.entropy).abs() < 1e-6, "the same start, the same entropy: {} vs {}", first.entropy, m.entropy);
        let second = adapted.update(&batch()).unwrap();
        assert!(second.kl_to_start > 0.0 && second.kl_to_start.is_finite(), "{second:?}");
        assert!(second.run_metrics(true).iter().any(|(k, v)| *k == metric::KL_TO_START && *v == second.kl_to_start));
        // the scales are back: the adapter still changes the outputs
        let s = Sample::plain(0, &[1, 2], &[3], 0.0);
        let with = adapted.score(std::slice::from_ref(&s))[0][0];
        lora::without_adapters(&mut adapted.model, |_| ());
        assert_eq!(adapted.score(std::slice::from_ref(&s))[0][0], with);
    }

    #[test]
    fn uniform_logits_have_the_entropy_of_the_vocabulary() {
        let mb = MicroBatch {
            rows: vec![0],
            prefix: None,
            input: Tensor::zeros([1, 1], (Kind::Int64, Device::Cpu)),
            flat: Tensor::from_slice(&[0i64, 0]),
            targets: Tensor::from_slice(&[0i64, 0]),
            temperature: Tensor::from_slice(&[1.0f32, 0.5]),
            offsets: vec![0],
        };
        let logits = Tensor::from_slice(&[0.0f32; 10]).view([2, 5]);
        let e = Vec::<f32>::try_from(Learner::<Llama>::entropy_of(&mb, &logits)).unwrap();
        for v in e {
            assert!((v as f64 - 5f64.ln()).abs() < 1e-6, "{v}");
        }
        let peaked = Tensor::from_slice(&[100.0f32, 0.0, 0.0, 0.0, 0.0, 100.0, 0.0, 0.0, 0.0, 0.0]).view([2, 5]);
        let e = Vec::<f32>::try_from(Learner::<Llama>::entropy_of(&mb, &peaked)).unwrap();
        assert!(e.iter().all(|v| *v >= 0.0 && *v < 1e-6), "{e:?}");
    }

    #[test]
    fn mismatch_by_hand() {
        let sample = |mask: Vec<bool>, logq: Vec<f32>| Sample {
            task: 0,
            context: vec![1],
            completion: vec![2; mask.len()],
            mask,
            logq,
            advantage: 0.0,
            temperature: 1.0,
            scale: 1.0,
            shift: None,
        };
        let samples =
            vec![sample(vec![true, true, false], vec![-1.0, -2.0, -9.0]), sample(vec![true], vec![]), sample(vec![true], vec![-3.0])];
        // |Δ| = 0.5, 0.1 (the masked token and the row without q are not measured), 1.0;
        // the last token's TIS weight exp(−2 + 3) = e > 2 is capped.
        let old = vec![vec![-1.5, -2.1, 0.0], vec![-1.0], vec![-2.0]];
        let (mean, max, capped, n) = mismatch(&samples, &old);
        assert_eq!(n, 3);
        assert!((mean - 1.6 / 3.0).abs() < 1e-6 && (max - 1.0).abs() < 1e-6, "{mean} {max}");
        assert!((capped - 1.0 / 3.0).abs() < 1e-9);
    }

    #[test]
    fn bf16_precision_keeps_float32_parameters_and_follows_the_float32_update() {
        let cfg = LearnerConfig { optimizer: AdamWConfig { lr: 1e-2, ..Default::default() }, ..Default::default() };
        let mut full = Learner::new(tiny(6), cfg.clone());
        let mut mixed = Learner::new(tiny(6), LearnerConfig { precision: Precision::Bf16, ..cfg });
        assert_eq!(mixed.model.compute, Kind::BFloat16);
        let a = full.update(&batch()).unwrap();
        let b = mixed.update(&batch()).unwrap();
        assert!(b.policy_tokens > 0 && b.loss.is_finite() && b.grad_norm > 0.0, "{b:?}");
        // bf16 keeps 8 bits of mantissa: the loss and gradient norm agree to about 1e-2.
        assert!((a.loss - b.loss).abs() < 2e-2 * a.loss.abs().max(1e-3), "{} vs {}", a.loss, b.loss);
        assert!((a.grad_norm - b.grad_norm).abs() < 5e-2 * a.grad_norm, "{} vs {}", a.grad_norm, b.grad_norm);
        let before = tiny(6).named_tensors();
        let mut moved = 0;
        for ((n, x), (_, y)) in mixed.model.named_tensors().iter().zip(&before) {
            assert_eq!(x.kind(), Kind::Float, "{n} is a float32 master weight");
            moved += usize::from(!x.equal(y));
        }
        assert!(moved > 0, "the mixed-precision update changed no weight");
        assert!(Precision::parse("fp8", "learner.precision").unwrap_err().to_string().contains("learner.precision"));
    }

    #[test]
    fn micro_batching_gives_the_full_batch_gradient() {
        let cfg =
            LearnerConfig { optimizer: AdamWConfig { lr: 1e-2, ..Default::default() }, micro_batch_tokens: 1_000, ..Default::default() };
        let mut one = Learner::new(tiny(5), cfg.clone());
        let mut many = Learner::new(tiny(5), LearnerConfig { micro_batch_tokens: 1, ..cfg });
        let a = one.update(&batch()).unwrap();
        let b = many.update(&batch()).unwrap();
        assert_eq!((a.micro_batches, b.micro_batches), (1, 3));
        assert!((a.loss - b.loss).abs() < 1e-6 && (a.grad_norm - b.grad_norm).abs() < 1e-5 * a.grad_norm.max(1.0), "{a:?} vs {b:?}");
        for ((n, x), (_, y)) in one.model.named_tensors().iter().zip(many.model.named_tensors()) {
            // Adam's first step moves each weight by about ±lr whatever the gradient's size,
            // so float-rounding differences of near-zero gradients show at a fraction of lr.
            let d = (x - y).abs().max().double_value(&[]);
            assert!(d < 1e-4, "{n}: {d}");
        }
    }

    #[test]
    fn shared_prefixes_train_like_separate_rows_on_fewer_tokens() {
        // Three rows of one task under one 20-token preamble, one row of another task.
        let preamble: Vec<u32> = (0..20).map(|i| (i * 7 % 30 + 1) as u32).collect();
        let row = |task: usize, tail: &[u32], completion: Vec<u32>, advantage: f64| Sample {
            task,
            context: preamble.iter().chain(tail).copied().collect(),
            mask: vec![true; completion.len()],
            logq: vec![],
            completion,
            advantage,
            temperature: 1.0,
            scale: 1.0,
            shift: None,
        };
        let batch = Batch {
            tasks: vec!["a".into(), "b".into()],
            samples: vec![
                row(0, &[5, 6], vec![7, 8, 9], 1.0),
                row(0, &[5, 6], vec![9, 8], -1.0),
                row(0, &[5, 7, 3], vec![2], 0.5),
                Sample {
                    task: 1,
                    context: vec![4, 4, 4],
                    completion: vec![1, 2],
                    mask: vec![true, true],
                    logq: vec![],
                    advantage: 1.0,
                    temperature: 1.0,
                    scale: 1.0,
                    shift: None,
                },
            ],
            ..Default::default()
        };
        let cfg = LearnerConfig { optimizer: AdamWConfig { lr: 1e-2, ..Default::default() }, ..Default::default() };
        let mut shared = Learner::new(tiny(3), cfg.clone());
        let mut separate = Learner::new(tiny(3), LearnerConfig { share_prefixes: false, ..cfg });
        // Scores (π_old) through the shared plan equal the separate ones.
        for (x, y) in shared.score(&batch.samples).iter().flatten().zip(separate.score(&batch.samples).iter().flatten()) {
            assert!((x - y).abs() < 1e-5, "{x} vs {y}");
        }
        let a = shared.update(&batch).unwrap();
        let b = separate.update(&batch).unwrap();
        // The three rows share their 21 first tokens (the preamble and token 5): counted once.
        let lens: u64 = batch.samples.iter().map(|s| (s.context.len() + s.completion.len()) as u64).sum();
        assert_eq!(b.forward_tokens, lens);
        assert_eq!(a.forward_tokens, lens - 2 * 21, "{a:?}");
        assert!(a.policy_tokens > 0 && (a.loss - b.loss).abs() < 1e-6, "{a:?} vs {b:?}");
        assert!((a.grad_norm - b.grad_norm).abs() < 1e-5 * b.grad_norm.max(1.0), "{a:?} vs {b:?}");
        let start = tiny(3).named_tensors();
        for ((n, x), (_, y)) in shared.model.named_tensors().iter().zip(separate.model.named_tensors()) {
            let d = (x - y).abs().max().double_value(&[]);
            assert!(d < 1e-4, "{n}: {d}");
        }
        assert!(shared.model.named_tensors().iter().zip(&start).any(|((_, x), (_, s))| !x.equal(s)), "the update changed no weight");
    }

    #[test]
    fn same_start_and_seed_give_bit_identical_weights() {
        let run = || {
            let mut l = Learner::new(
                tiny(9),
                LearnerConfig {
                    optimizer: AdamWConfig { lr: 1e-2, ..Default::default() },
                    micro_batch_tokens: 8,
                    seed: 4,
                    ..Default::default()
                },
            );
            l.update(&batch()).unwrap();
            l.update(&batch()).unwrap();
            l.model.named_tensors()
        };
        let (a, b) = (run(), run());
        for ((n, x), (_, y)) in a.iter().zip(&b) {
            assert!(x.equal(y), "{n} differs");
        }
    }

    #[test]
    fn bad_samples_are_rejected_by_name() {
        let mut l = Learner::new(tiny(2), LearnerConfig::default());
        let mut b = batch();
        b.samples[1].mask = vec![true, true];
        let err = l.update(&b).unwrap_err().to_string();
        assert!(err.contains("sample 1") && err.contains("task `a`"), "{err}");
    }

    #[test]
    fn rng_state_round_trips() {
        let mut l = Learner::new(tiny(2), LearnerConfig::default());
        l.update(&batch()).unwrap();
        let state = l.rng_state();
        let mut other = Learner::new(tiny(2), LearnerConfig { seed: 99, ..Default::default() });
        other.set_rng_state(&state).unwrap();
        assert_eq!(other.rng_state(), state);
    }
}
