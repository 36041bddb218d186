//! The model's weights as the rollout engine decodes them: a copy of the matrices in one
//! [`WeightFormat`], fused where products share an input, and the forward pass over a
//! batch of rows from many sequences, each with its own KV cache ([`crate::infer::kv`]). `int4`, and
//! `f32` on the CPU, run on the CPU's own kernels ([`crate::infer::cpu`]); `bf16`, and
//! `f32` on a GPU, on libtorch. A hybrid model (Qwen3.5) runs its own forward pass on
//! libtorch, one sequence at a time with its own cache. The model itself knows nothing of this.

use tch::{Device, Kind, Tensor};

use crate::infer::cpu::{self, CpuWeights};
use crate::infer::kv::Segment;
use crate::infer::packed::{Packed, WeightFormat};
use crate::model::layers::{head_norm, rms_norm};
use crate::model::qwen3_5::{Qwen35, CHUNK};
use crate::model::Model;
use crate::NativeError;

/// One layer's matrices for the engine (see [`EngineWeights::new`]).
struct EngineLayer {
    qkv: Packed,
    qkv_bias: Option<Tensor>,
    o: Packed,
    gate_up: Packed,
    down: Packed,
}

/// The weights the rollout engine decodes with: a copy of the model's matrices in one
/// [`WeightFormat`] (norms and embeddings are the model's own). `int4`, and `f32` on the
/// CPU, run on the CPU's own kernels ([`crate::infer::cpu`]); `bf16`, and `f32` on a GPU, on
/// libtorch.
pub struct EngineWeights {
    pub format: WeightFormat,
    kernels: Kernels,
}

// One value per model, built once: the size of the larger variant costs nothing.
#[allow(clippy::large_enum_variant)]
enum Kernels {
    Torch {
        layers: Vec<EngineLayer>,
        head: Packed,
    },
    Cpu(CpuWeights),
    /// The model's own forward pass and float32 weights, per sequence (Qwen3.5).
    Model,
}

impl EngineWeights {
    /// Whether a pass computes each row on its own (the CPU kernels), so that passes need no
    /// fixed shape: the engine then puts every chunk or decode row of a step in one pass.
    pub fn rows_alone(&self) -> bool {
        matches!(self.kernels, Kernels::Cpu(_) | Kernels::Model)
    }

    /// Whether the products run on the engine's own CPU kernels (libtorch then only samples).
    pub fn cpu_kernels(&self) -> bool {
        matches!(self.kernels, Kernels::Cpu(_))
    }

    /// Logits `[rows, vocab]` of final-norm hidden states `[rows, hidden]`.
    pub fn logits_of(&self, model: &Model, h: &Tensor) -> Tensor {
        match (&self.kernels, model) {
            (Kernels::Torch { head, .. }, _) => head.apply(h),
            (Kernels::Cpu(c), _) => c.logits(h),
            // one product per row: a row's logits must not depend on how many rows the pass
            // has (libtorch's product picks its blocking by shape)
            (Kernels::Model, Model::Qwen35(m)) => {
                Tensor::cat(&(0..h.size()[0]).map(|r| m.logits_of(&h.narrow(0, r, 1))).collect::<Vec<_>>(), 0)
            }
            (Kernels::Model, Model::Llama(_)) => unreachable!("the model kernels run Qwen3.5"),
        }
    }
}

impl EngineWeights {
    /// The engine's copy of the weights in `format`, with the products that share an input
    /// fused (q, k and v into one matrix; gate and up into another): fewer, larger products
    /// per layer. `threads`: the CPU kernels' thread count (`int4`, and `f32` on the CPU).
    pub fn new(model: &Model, format: WeightFormat, threads: usize) -> Result<EngineWeights, NativeError> {
        if crate::model::lora::is_adapted(model) {
            return Err(NativeError::Config {
                field: "engine.weights".into(),
                detail: "the model has an unmerged LoRA adapter: the engine samples merged weights (model::lora::merge)".into(),
            });
        }
        let model = match model {
            Model::Llama(m) => m,
            Model::Qwen35(_) if format == WeightFormat::F32 => return Ok(EngineWeights { format, kernels: Kernels::Model }),
            Model::Qwen35(_) => {
                return Err(NativeError::Config {
                    field: "engine.weights".into(),
                    detail: format!(
                        "`{}`: the engine decodes Qwen3.5 with the model's own float32 weights on libtorch; set weights = \"f32\"",
                        format.name()
                    ),
                })
            }
        };
        // int4 exists on the CPU kernels only; f32 on the CPU runs there too (libtorch's CPU
        // product at a decode step's few rows costs a copy of every weight matrix per call)
        let on_cpu = model.device() == Device::Cpu;
        if format == WeightFormat::Int4 || (format == WeightFormat::F32 && on_cpu) {
            return Ok(EngineWeights { format, kernels: Kernels::Cpu(CpuWeights::new(model, format, threads)?) });
        }
        let _g = tch::no_grad_guard();
        let mut layers = Vec::with_capacity(model.layers.len());
        for l in &model.layers {
            let qkv_bias = match (&l.q_bias, &l.k_bias, &l.v_bias) {
                (Some(q), Some(k), Some(v)) => Some(Tensor::cat(&[q, k, v], 0)),
                _ => None,
            };
            layers.push(EngineLayer {
                qkv: Packed::new(&Tensor::cat(&[&l.q.weight, &l.k.weight, &l.v.weight], 0), format),
                qkv_bias,
                o: Packed::new(&l.o.weight, format),
                gate_up: Packed::new(&Tensor::cat(&[&l.gate.weight, &l.up.weight], 0), format),
                down: Packed::new(&l.down.weight, format),
            });
        }
        let head = Packed::new(model.lm_head.as_ref().unwrap_or(&model.embed), format);
        Ok(EngineWeights { format, kernels: Kernels::Torch { layers, head } })
    }

    /// Final-norm hidden states `[rows, hidden]` of one engine pass over `ids` (one token
    /// per row; rows no segment covers are padding) of `model` with these matrices. Every matrix
    /// product runs on all rows at once, so its shape is the pass's fixed row count whatever
    /// the sequences in it: with a fixed shape a row's result does not depend on the other
    /// rows (measured bitwise on this backend for every weight format; see the engine's
    /// tests), which makes the engine's numerics independent of batch composition.
    /// Attention runs per segment against its own cache.
    pub fn forward(&self, model: &Model, ids: &[u32], segments: &mut [Segment<'_>]) -> Tensor {
        let (model, layers) = match (&self.kernels, model) {
            (Kernels::Model, Model::Qwen35(m)) => return hybrid_forward(m, ids, segments),
            (Kernels::Cpu(c), Model::Llama(m)) => return cpu::forward(m, c, ids, segments),
            (Kernels::Torch { layers, .. }, Model::Llama(m)) => (m, layers),
            _ => unreachable!("the kernels were built for this model (EngineWeights::new)"),
        };
        let c = &model.config;
        let m = ids.len() as i64;
        let hd = c.head_dim();
        let (heads, kv_heads) = (c.num_attention_heads, c.num_key_value_heads);
        let dev = model.device();
        let mut pos = vec![0i64; ids.len()];
        for s in segments.iter_mut() {
            s.cache.reserve(s.cache.len + s.rows);
            for r in 0..s.rows {
                pos[s.first + r] = (s.cache.len + r) as i64;
            }
        }
        let (cos, sin) = model.rope_at(&pos);
        let tokens: Vec<i64> = ids.iter().map(|&t| t as i64).collect();
        let mut x = Tensor::embedding(&model.embed, &Tensor::from_slice(&tokens).to_device(dev), -1, false, false);
        let masks: Vec<Option<Tensor>> =
            segments.iter().map(|s| (s.rows > 1).then(|| model.causal_mask(s.cache.len as i64, s.rows as i64))).collect();
        let att = Tensor::zeros([1, heads, m, hd], (Kind::Float, dev));
        for (i, (l, pl)) in model.layers.iter().zip(layers).enumerate() {
            let h = rms_norm(&x, &l.input_norm, c.rms_norm_eps);
            let mut qkv = pl.qkv.apply(&h);
            if let Some(b) = &pl.qkv_bias {
                qkv = qkv + b;
            }
            // q and k (normed per head where the family does it) rotate together:
            // [1, heads + kv_heads, rows, head_dim]
            let qk = match (&l.q_norm, &l.k_norm) {
                (Some(qn), Some(kn)) => Tensor::cat(
                    &[
                        head_norm(qkv.narrow(1, 0, heads * hd), Some(qn), hd, c.rms_norm_eps),
                        head_norm(qkv.narrow(1, heads * hd, kv_heads * hd), Some(kn), hd, c.rms_norm_eps),
                    ],
                    1,
                ),
                _ => qkv.narrow(1, 0, (heads + kv_heads) * hd),
            };
            let qk = qk.reshape([1, m, heads + kv_heads, hd]).transpose(1, 2);
            let qk = model.rope(&qk, &cos, &sin);
            let (q, k) = (qk.narrow(1, 0, heads), qk.narrow(1, heads, kv_heads));
            let v = qkv.narrow(1, (heads + kv_heads) * hd, kv_heads * hd).view([1, m, kv_heads, hd]).transpose(1, 2);
            for (s, mask) in segments.iter_mut().zip(&masks) {
                let (first, rows, start) = (s.first as i64, s.rows as i64, s.cache.len as i64);
                s.cache.k[i].narrow(2, start, rows).copy_(&k.narrow(2, first, rows));
                s.cache.v[i].narrow(2, start, rows).copy_(&v.narrow(2, first, rows));
                let keys = s.cache.k[i].narrow(2, 0, start + rows);
                let values = s.cache.v[i].narrow(2, 0, start + rows);
                let o =
                    Tensor::scaled_dot_product_attention(&q.narrow(2, first, rows), &keys, &values, mask.as_ref(), 0.0, false, None, true);
                att.narrow(2, first, rows).copy_(&o);
            }
            let a = att.transpose(1, 2).contiguous().view([m, heads * hd]);
            x = x + pl.o.apply(&a);
            let h = rms_norm(&x, &l.post_norm, c.rms_norm_eps);
            let gu = pl.gate_up.apply(&h);
            let n = c.intermediate_size;
            x = &x + pl.down.apply(&(gu.narrow(1, 0, n).silu() * gu.narrow(1, n, n)));
        }
        for s in segments.iter_mut() {
            s.cache.len += s.attend;
        }
        rms_norm(&x, &model.norm, c.rms_norm_eps)
    }
}

/// [`EngineWeights::forward`] of a hybrid model: each segment runs alone on the model's own
/// pass, continuing its sequence's cache (so no row depends on another sequence); the
/// gated delta rule takes prefill chunks in chunks of [`CHUNK`] as the learner does.
fn hybrid_forward(m: &Qwen35, ids: &[u32], segments: &mut [Segment<'_>]) -> Tensor {
    let dev = m.device();
    let out = Tensor::zeros([ids.len() as i64, m.config.hidden_size], (Kind::Float, dev));
    for s in segments.iter_mut() {
        let tokens: Vec<i64> = ids[s.first..s.first + s.attend].iter().map(|&t| t as i64).collect();
        let hybrid = s.cache.hybrid.as_mut().expect("a Qwen3.5 sequence has a hybrid cache");
        let h = m.hidden(&Tensor::from_slice(&tokens).view([1, -1]).to_device(dev), Some(&mut hybrid.cache), CHUNK);
        out.narrow(0, s.first as i64, s.attend as i64).copy_(&h.squeeze_dim(0));
        s.cache.len += s.attend;
    }
    out
}
