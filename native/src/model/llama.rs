//! The llama-family decoder: RMSNorm, RoPE (half-rotation or interleaved layout),
//! grouped-query attention with an optional q/k/v bias (qwen2), SwiGLU, tied or untied
//! embeddings, and a KV cache for incremental decoding.
//!
//! Parameters live in a [`tch::nn::VarStore`] under their Hugging Face names
//! (`model.layers.0.self_attn.q_proj.weight`, ...), so checkpoints are loadable by
//! transformers and vLLM as they are, and the learner trains the same variables.

use std::collections::HashMap;
use std::path::Path;

use tch::{nn, Device, Kind, Tensor};

use crate::model::config::LlamaConfig;
use crate::model::layers::{head_norm, linear, mm, rms_norm, rope_angles, rotate_half, Linear};
use crate::model::PassRows;
use crate::NativeError;

pub(crate) struct Layer {
    pub(crate) input_norm: Tensor,
    pub(crate) q: Linear,
    pub(crate) k: Linear,
    pub(crate) v: Linear,
    pub(crate) q_bias: Option<Tensor>,
    pub(crate) k_bias: Option<Tensor>,
    pub(crate) v_bias: Option<Tensor>,
    /// Per-head RMSNorm weights `[head_dim]` of the queries and the keys (qwen3).
    pub(crate) q_norm: Option<Tensor>,
    pub(crate) k_norm: Option<Tensor>,
    pub(crate) o: Linear,
    pub(crate) post_norm: Tensor,
    pub(crate) gate: Linear,
    pub(crate) up: Linear,
    pub(crate) down: Linear,
}

/// Keys and values of past positions, one pair per layer, `[B, kv_heads, T, head_dim]`.
#[derive(Default)]
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
}

impl KvCache {
    /// Positions held.
    pub fn len(&self) -> i64 {
        self.layers.first().and_then(|l| l.as_ref()).map(|(k, _)| k.size()[2]).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A llama-family causal language model.
pub struct Llama {
    pub config: LlamaConfig,
    pub vs: nn::VarStore,
    pub(crate) embed: Tensor,
    pub(crate) layers: Vec<Layer>,
    pub(crate) norm: Tensor,
    pub(crate) lm_head: Option<Tensor>,
    /// The kind the matrix products and attention of [`Llama::forward`] and the learner's
    /// passes run in: `Float` (the default), or `BFloat16` for mixed precision as autocast
    /// does it (the float32 parameters are cast per pass and receive float32 gradients; the
    /// residual stream, norms and softmax stay float32). The engine's own copy of the
    /// weights is not affected.
    pub compute: Kind,
}

impl Llama {
    /// Builds the model with randomly initialised parameters: weights uniform with
    /// σ = 0.02, norms at 1. Drawn from a generator seeded by `seed` and the parameter's
    /// name, not from libtorch's global one, so the same seed gives the same model even
    /// while other threads draw random numbers.
    pub fn new(config: LlamaConfig, device: Device, seed: u64) -> Result<Self, NativeError> {
        let model = Self::zeros(config, device)?;
        crate::model::hf::randomize(&model.vs, seed, |name| name.ends_with("norm.weight").then_some(1.0));
        Ok(model)
    }

    /// Builds the model with every parameter zero (to be overwritten by a loader).
    fn zeros(config: LlamaConfig, device: Device) -> Result<Self, NativeError> {
        config.validate()?;
        let vs = nn::VarStore::new(device);
        let root = vs.root();
        let c = &config;
        let hd = c.head_dim();
        let init = nn::Init::Const(0.0);
        let m = &root / "model";
        let embed = (&m / "embed_tokens").var("weight", &[c.vocab_size, c.hidden_size], init);
        let mut layers = Vec::new();
        for i in 0..c.num_hidden_layers {
            let l = &(&m / "layers") / i;
            let a = &l / "self_attn";
            let mlp = &l / "mlp";
            let bias = |name: &str, n: i64| c.attention_bias.then(|| (&a / name).var("bias", &[n], nn::Init::Const(0.0)));
            let head_norm = |name: &str| c.qk_norm().then(|| (&a / name).var("weight", &[hd], nn::Init::Const(1.0)));
            layers.push(Layer {
                input_norm: (&l / "input_layernorm").var("weight", &[c.hidden_size], nn::Init::Const(1.0)),
                q: Linear::new((&a / "q_proj").var("weight", &[c.num_attention_heads * hd, c.hidden_size], init)),
                k: Linear::new((&a / "k_proj").var("weight", &[c.num_key_value_heads * hd, c.hidden_size], init)),
                v: Linear::new((&a / "v_proj").var("weight", &[c.num_key_value_heads * hd, c.hidden_size], init)),
                q_bias: bias("q_proj", c.num_attention_heads * hd),
                k_bias: bias("k_proj", c.num_key_value_heads * hd),
                v_bias: bias("v_proj", c.num_key_value_heads * hd),
                q_norm: head_norm("q_norm"),
                k_norm: head_norm("k_norm"),
                o: Linear::new((&a / "o_proj").var("weight", &[c.hidden_size, c.num_attention_heads * hd], init)),
                post_norm: (&l / "post_attention_layernorm").var("weight", &[c.hidden_size], nn::Init::Const(1.0)),
                gate: Linear::new((&mlp / "gate_proj").var("weight", &[c.intermediate_size, c.hidden_size], init)),
                up: Linear::new((&mlp / "up_proj").var("weight", &[c.intermediate_size, c.hidden_size], init)),
                down: Linear::new((&mlp / "down_proj").var("weight", &[c.hidden_size, c.intermediate_size], init)),
            });
        }
        let norm = (&m / "norm").var("weight", &[c.hidden_size], nn::Init::Const(1.0));
        let lm_head = (!c.tie_word_embeddings).then(|| (&root / "lm_head").var("weight", &[c.vocab_size, c.hidden_size], init));
        Ok(Llama { config, vs, embed, layers, norm, lm_head, compute: Kind::Float })
    }

    /// Builds the model and copies every parameter from `tensors` (HF names, any float
    /// kind). A missing tensor or a shape mismatch is an error naming `source` and the
    /// tensor; tensors the model does not use (e.g. a tied `lm_head.weight`) are ignored.
    pub fn from_tensors(
        config: LlamaConfig,
        tensors: &HashMap<String, Tensor>,
        device: Device,
        source: &Path,
    ) -> Result<Self, NativeError> {
        let model = Llama::zeros(config, device)?;
        model.copy_from(tensors, source)?;
        Ok(model)
    }

    /// Overwrites every parameter from `tensors` (see [`Llama::from_tensors`]).
    pub fn copy_from(&self, tensors: &HashMap<String, Tensor>, source: &Path) -> Result<(), NativeError> {
        crate::model::hf::fill(&self.vs, tensors, source)
    }

    /// A copy of this model with its own parameters (e.g. one per engine).
    pub fn clone_weights(&self) -> Result<Llama, NativeError> {
        let tensors: HashMap<String, Tensor> = self.named_tensors().into_iter().collect();
        Llama::from_tensors(self.config.clone(), &tensors, self.device(), Path::new("(in memory)"))
    }

    /// Parameters by HF name (shared storage, float32).
    pub fn named_tensors(&self) -> Vec<(String, Tensor)> {
        crate::model::hf::named(&self.vs)
    }

    pub fn device(&self) -> Device {
        self.vs.device()
    }

    /// Logits `[B, T, vocab]` of `tokens` `[B, T]` (i64) placed after the positions already in
    /// `cache` (which is extended). Without a cache the tokens start at position 0.
    pub fn forward(&self, tokens: &Tensor, cache: Option<&mut KvCache>) -> Tensor {
        self.logits_of(&self.hidden(tokens, cache))
    }

    /// Logits `[B, vocab]` of the last position only (the prompt's other positions need no
    /// LM head: about a tenth of a prefill's work for a 49k vocabulary).
    pub fn logits_last(&self, tokens: &Tensor, cache: Option<&mut KvCache>) -> Tensor {
        let h = self.hidden(tokens, cache);
        let t = h.size()[1];
        self.logits_of(&h.narrow(1, t - 1, 1).squeeze_dim(1))
    }

    /// The learner's teacher-forced pass ([`crate::model::CausalLm::pass`]): logits at `flat`
    /// positions of `rows` `[B, T]`, from position 0, or after `prefix` `[P]`. With a prefix,
    /// the linear layers run over the prefix and the rows as one matrix of P + B·T tokens;
    /// only attention tells them apart (the prefix attends causally to itself, each row to the
    /// whole prefix and causally to itself), so the prefix is computed once and its gradient
    /// gathers the contributions of every row.
    pub fn pass<'a>(&'a self, prefix: Option<&'a Tensor>, rows: &'a Tensor, flat: &'a Tensor) -> LlamaPass<'a> {
        let at = PassRows::new(prefix, rows, flat);
        let (t, p) = (at.t, at.p);
        let (rope_p, mask_p) = (self.rope_tables(0, p), (p > 0).then(|| self.causal_mask(0, p)));
        let (rope_r, mask_r) = (self.rope_tables(p, t), (t > 1 || p > 0).then(|| self.causal_mask(p, t)));
        LlamaPass { m: self, at, rope_p, mask_p, rope_r, mask_r }
    }

    /// One decoder layer on the residual stream `x` (`[.., hidden]`): pre-norm, the q, k and
    /// v projections (q and k normed per head where the family does it), `attention` (which places, rotates and attends them and returns `[..,
    /// heads · head_dim]` in `x`'s row layout), the output projection, and the SwiGLU MLP.
    /// Only attention differs between the full, cached and shared-prefix passes.
    fn layer(&self, l: &Layer, x: &Tensor, attention: impl FnOnce(Tensor, Tensor, Tensor) -> Tensor) -> Tensor {
        let eps = self.config.rms_norm_eps;
        let h = rms_norm(x, &l.input_norm, eps);
        let c = self.compute;
        let (q, k) = (linear(&h, &l.q, l.q_bias.as_ref(), c), linear(&h, &l.k, l.k_bias.as_ref(), c));
        let (q, k) =
            (head_norm(q, l.q_norm.as_ref(), self.config.head_dim(), eps), head_norm(k, l.k_norm.as_ref(), self.config.head_dim(), eps));
        let att = attention(q, k, linear(&h, &l.v, l.v_bias.as_ref(), c));
        let x = x + l.o.forward(&att, c);
        let h = rms_norm(&x, &l.post_norm, eps);
        let mlp = l.down.forward(&(l.gate.forward(&h, c).silu() * l.up.forward(&h, c)), c);
        x + mlp
    }

    /// Grouped-query attention of `q` `[B, heads, T, hd]` over `k`, `v` `[B, kv_heads, S, hd]`.
    fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>) -> Tensor {
        let n_rep = self.config.num_attention_heads / self.config.num_key_value_heads;
        let repeat = |x: &Tensor| if n_rep > 1 { x.repeat_interleave_self_int(n_rep, 1, None) } else { x.shallow_clone() };
        // `to_kind` returns the tensor itself when it already has the kind (float32).
        let c = self.compute;
        Tensor::scaled_dot_product_attention(&q.to_kind(c), &repeat(&k.to_kind(c)), &repeat(&v.to_kind(c)), mask, 0.0, false, None, false)
            .to_kind(Kind::Float)
    }

    /// `[len, start + len]`: whether query position `start + i` may attend to key position `j`.
    pub(crate) fn causal_mask(&self, start: i64, len: i64) -> Tensor {
        let q_pos = Tensor::arange_start(start, start + len, (Kind::Int64, self.device())).unsqueeze(1);
        Tensor::arange(start + len, (Kind::Int64, self.device())).unsqueeze(0).le_tensor(&q_pos)
    }

    /// Logits `[rows, vocab]` of final-norm hidden states `[rows, hidden]` (the LM head).
    pub fn logits_of(&self, h: &Tensor) -> Tensor {
        mm(h, self.lm_head.as_ref().unwrap_or(&self.embed), self.compute)
    }

    /// Final-norm hidden states `[B, T, hidden]`.
    fn hidden(&self, tokens: &Tensor, mut cache: Option<&mut KvCache>) -> Tensor {
        let c = &self.config;
        let (b, t) = tokens.size2().expect("tokens must be [B, T]");
        let start = cache.as_ref().map(|c| c.len()).unwrap_or(0);
        if let Some(cache) = cache.as_mut() {
            cache.layers.resize_with(self.layers.len(), || None);
        }
        let (hd, nh, nkv) = (c.head_dim(), c.num_attention_heads, c.num_key_value_heads);
        let (cos, sin) = self.rope_tables(start, t);
        let mask = (t > 1).then(|| self.causal_mask(start, t));
        let mut x = Tensor::embedding(&self.embed, tokens, -1, false, false);
        for (i, l) in self.layers.iter().enumerate() {
            x = self.layer(l, &x, |q, k, v| {
                let q = self.rope(&q.view([b, t, nh, hd]).transpose(1, 2), &cos, &sin);
                let mut k = self.rope(&k.view([b, t, nkv, hd]).transpose(1, 2), &cos, &sin);
                let mut v = v.view([b, t, nkv, hd]).transpose(1, 2);
                if let Some(cache) = cache.as_mut() {
                    if let Some((pk, pv)) = &cache.layers[i] {
                        k = Tensor::cat(&[pk, &k], 2);
                        v = Tensor::cat(&[pv, &v], 2);
                    }
                    cache.layers[i] = Some((k.shallow_clone(), v.shallow_clone()));
                }
                self.attend(&q, &k, &v, mask.as_ref()).transpose(1, 2).contiguous().view([b, t, nh * hd])
            });
        }
        rms_norm(&x, &self.norm, c.rms_norm_eps)
    }

    /// cos/sin of arbitrary positions, laid out as [`Llama::rope_tables`]'.
    pub(crate) fn rope_at(&self, pos: &[i64]) -> (Tensor, Tensor) {
        let pos = Tensor::from_slice(pos).to_device(self.device());
        let freqs = rope_angles(self.config.rope_theta, self.config.head_dim(), &pos);
        let freqs = if self.config.rope_interleaved { freqs } else { Tensor::cat(&[&freqs, &freqs], -1) };
        (freqs.cos(), freqs.sin())
    }

    /// cos/sin of positions `start..start+t`: `[t, head_dim]` for the half-rotation layout,
    /// `[t, head_dim/2]` for the interleaved one.
    pub(crate) fn rope_tables(&self, start: i64, t: i64) -> (Tensor, Tensor) {
        self.rope_at(&(start..start + t).collect::<Vec<_>>())
    }

    /// Rotary position embedding of `x` `[B, heads, T, head_dim]`.
    pub(crate) fn rope(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
        let hd = self.config.head_dim();
        if self.config.rope_interleaved {
            // ggml layout: rotate adjacent pairs (x0, x1) by the pair's frequency.
            let s = x.size();
            let pairs = x.view([s[0], s[1], s[2], hd / 2, 2]);
            let x0 = pairs.select(-1, 0);
            let x1 = pairs.select(-1, 1);
            let r0 = &x0 * cos - &x1 * sin;
            let r1 = &x0 * sin + &x1 * cos;
            Tensor::stack(&[r0, r1], -1).view([s[0], s[1], s[2], hd])
        } else {
            rotate_half(x, cos, sin)
        }
    }
}

/// [`Llama::pass`]: the rows after an optional shared prefix, with their RoPE tables and
/// masks computed once for every layer.
pub struct LlamaPass<'a> {
    m: &'a Llama,
    at: PassRows<'a>,
    rope_p: (Tensor, Tensor),
    mask_p: Option<Tensor>,
    rope_r: (Tensor, Tensor),
    mask_r: Option<Tensor>,
}

impl crate::model::Pass for LlamaPass<'_> {
    /// `[P + B·T, hidden]` with a prefix (the prefix's tokens first), else `[B, T, hidden]`.
    fn input(&self) -> Tensor {
        Tensor::embedding(&self.m.embed, &self.at.tokens(), -1, false, false)
    }

    fn len(&self) -> usize {
        self.m.layers.len()
    }

    fn block(&self, i: usize, x: &Tensor) -> Tensor {
        let (m, b, t, p) = (self.m, self.at.b, self.at.t, self.at.p);
        let c = &m.config;
        let (hd, nh, nkv) = (c.head_dim(), c.num_attention_heads, c.num_key_value_heads);
        let ((cos_p, sin_p), (cos_r, sin_r)) = (&self.rope_p, &self.rope_r);
        m.layer(&m.layers[i], x, |q, k, v| {
            if self.at.prefix.is_none() {
                let q = m.rope(&q.view([b, t, nh, hd]).transpose(1, 2), cos_r, sin_r);
                let k = m.rope(&k.view([b, t, nkv, hd]).transpose(1, 2), cos_r, sin_r);
                let v = v.view([b, t, nkv, hd]).transpose(1, 2);
                return m.attend(&q, &k, &v, self.mask_r.as_ref()).transpose(1, 2).contiguous().view([b, t, nh * hd]);
            }
            let split = |y: &Tensor, heads: i64| {
                (y.narrow(0, 0, p).view([1, p, heads, hd]).transpose(1, 2), y.narrow(0, p, b * t).view([b, t, heads, hd]).transpose(1, 2))
            };
            let ((q_p, q_r), (k_p, k_r), (v_p, v_r)) = (split(&q, nh), split(&k, nkv), split(&v, nkv));
            let (q_p, k_p) = (m.rope(&q_p, cos_p, sin_p), m.rope(&k_p, cos_p, sin_p));
            let (q_r, k_r) = (m.rope(&q_r, cos_r, sin_r), m.rope(&k_r, cos_r, sin_r));
            let att_p = m.attend(&q_p, &k_p, &v_p, self.mask_p.as_ref());
            let k_all = Tensor::cat(&[k_p.expand([b, nkv, p, hd], false), k_r], 2);
            let v_all = Tensor::cat(&[v_p.expand([b, nkv, p, hd], false), v_r], 2);
            let att_r = m.attend(&q_r, &k_all, &v_all, self.mask_r.as_ref());
            Tensor::cat(&[att_p.transpose(1, 2).reshape([p, nh * hd]), att_r.transpose(1, 2).reshape([b * t, nh * hd])], 0)
        })
    }

    fn output(&self, x: &Tensor) -> Tensor {
        self.m.logits_of(&self.at.scored(x, |h| rms_norm(h, &self.m.norm, self.m.config.rms_norm_eps)))
    }
}

impl crate::model::lora::Adaptable for Llama {
    fn linears(&self) -> Vec<(String, &Linear)> {
        let mut out = vec![];
        for (i, l) in self.layers.iter().enumerate() {
            let n = |m: &str| format!("model.layers.{i}.{m}");
            out.extend([
                (n("self_attn.q_proj"), &l.q),
                (n("self_attn.k_proj"), &l.k),
                (n("self_attn.v_proj"), &l.v),
                (n("self_attn.o_proj"), &l.o),
                (n("mlp.gate_proj"), &l.gate),
                (n("mlp.up_proj"), &l.up),
                (n("mlp.down_proj"), &l.down),
            ]);
        }
        out
    }

    fn linears_mut(&mut self) -> Vec<(String, &mut Linear)> {
        let mut out = vec![];
        for (i, l) in self.layers.iter_mut().enumerate() {
            let n = |m: &str| format!("model.layers.{i}.{m}");
            out.extend([
                (n("self_attn.q_proj"), &mut l.q),
                (n("self_attn.k_proj"), &mut l.k),
                (n("self_attn.v_proj"), &mut l.v),
                (n("self_attn.o_proj"), &mut l.o),
                (n("mlp.gate_proj"), &mut l.gate),
                (n("mlp.up_proj"), &mut l.up),
                (n("mlp.down_proj"), &mut l.down),
            ]);
        }
        out
    }

    fn base_vars(&self) -> &nn::VarStore {
        &self.vs
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::gguf::{permute_qk, unpermute_qk};
    use crate::model::CausalLm;

    fn tiny() -> Llama {
        Llama::new(LlamaConfig::tiny(50, 32, 2), Device::Cpu, 7).unwrap()
    }

    #[test]
    fn kv_cache_gives_the_same_logits_as_a_full_pass() {
        let m = tiny();
        let toks = Tensor::from_slice(&[1i64, 5, 9, 3, 7]).view([1, 5]);
        let full = m.forward(&toks, None);
        let mut cache = KvCache::default();
        let a = m.forward(&toks.narrow(1, 0, 3), Some(&mut cache));
        let b = m.forward(&toks.narrow(1, 3, 1), Some(&mut cache));
        let c = m.forward(&toks.narrow(1, 4, 1), Some(&mut cache));
        let inc = Tensor::cat(&[a, b, c], 1);
        assert_eq!(cache.len(), 5);
        let diff = (full - inc).abs().max().double_value(&[]);
        assert!(diff < 1e-5, "max diff {diff}");
    }

    #[test]
    fn a_shared_prefix_gives_the_logits_and_gradients_of_separate_rows() {
        let m = tiny();
        let prefix = [3i64, 8, 1, 4, 4];
        let rest = [[5i64, 9, 2, 11], [7, 6, 0, 0]];
        // Unshared: two full rows of 9 tokens, logits at positions 5..9 of each.
        let full: Vec<i64> = rest.iter().flat_map(|r| prefix.iter().chain(r).copied()).collect();
        let flat_full = Tensor::from_slice(&[5i64, 6, 7, 8, 14, 15, 16, 17]);
        let flat_shared = Tensor::from_slice(&[0i64, 1, 2, 3, 4, 5, 6, 7]);
        let params = m.named_tensors();
        let grads = |logits: Tensor| -> Vec<Tensor> {
            for (_, p) in &params {
                let mut g = p.grad();
                if g.defined() {
                    let _ = g.zero_();
                }
            }
            (&logits * &logits).sum(Kind::Float).backward();
            params.iter().map(|(_, p)| p.grad().copy()).collect()
        };
        let a = m.logits_at(&Tensor::from_slice(&full).view([2, 9]), &flat_full);
        let b = m.logits_at_shared(&Tensor::from_slice(&prefix), &Tensor::from_slice(&rest.concat()).view([2, 4]), &flat_shared);
        let diff = (&a - &b).abs().max().double_value(&[]);
        assert!(diff < 1e-5, "logits differ by {diff}");
        for ((n, _), (x, y)) in params.iter().zip(grads(a).iter().zip(grads(b))) {
            let d = (x - &y).abs().max().double_value(&[]);
            assert!(d < 1e-4 * (1.0 + x.abs().max().double_value(&[])), "gradient of {n} differs by {d}");
        }
    }

    #[test]
    fn causal_mask_hides_future_tokens() {
        let m = tiny();
        let a = m.forward(&Tensor::from_slice(&[1i64, 2, 3, 4]).view([1, 4]), None);
        let b = m.forward(&Tensor::from_slice(&[1i64, 2, 3, 40]).view([1, 4]), None);
        let same = (a.narrow(1, 0, 3) - b.narrow(1, 0, 3)).abs().max().double_value(&[]);
        let last = (a.narrow(1, 3, 1) - b.narrow(1, 3, 1)).abs().max().double_value(&[]);
        assert!(same < 1e-6 && last > 1e-4, "prefix diff {same}, last diff {last}");
    }

    #[test]
    fn interleaved_rope_on_permuted_weights_equals_half_rotation() {
        let m = tiny();
        let mut cfg = m.config.clone();
        cfg.rope_interleaved = true;
        let mut tensors: HashMap<String, Tensor> = m.named_tensors().into_iter().collect();
        for (name, t) in tensors.iter_mut() {
            if name.ends_with("q_proj.weight") {
                *t = permute_qk(t, cfg.num_attention_heads);
            } else if name.ends_with("k_proj.weight") {
                *t = permute_qk(t, cfg.num_key_value_heads);
            }
        }
        let ggml = Llama::from_tensors(cfg, &tensors, Device::Cpu, Path::new("test")).unwrap();
        let toks = Tensor::from_slice(&[4i64, 8, 15, 16, 23, 42]).view([1, 6]);
        let diff = (m.forward(&toks, None) - ggml.forward(&toks, None)).abs().max().double_value(&[]);
        assert!(diff < 1e-5, "max diff {diff}");
        let w = Tensor::arange(24, (Kind::Float, Device::Cpu)).view([8, 3]);
        assert!(unpermute_qk(&permute_qk(&w, 2), 2).equal(&w));
    }

    #[test]
    fn missing_tensor_is_named() {
        let m = tiny();
        let mut tensors: HashMap<String, Tensor> = m.named_tensors().into_iter().collect();
        tensors.remove("model.layers.1.mlp.up_proj.weight");
        let err = Llama::from_tensors(m.config.clone(), &tensors, Device::Cpu, Path::new("w.safetensors")).err().unwrap().to_string();
        assert!(err.contains("w.safetensors") && err.contains("model.layers.1.mlp.up_proj.weight"), "{err}");
    }
}
