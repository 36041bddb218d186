//! The llama-family decoder: RMSNorm, RoPE (half-rotation or interleaved layout),
//! grouped-query attention with an optional q/k/v bias (qwen2), SwiGLU, tied or untied
//! embeddings, and a KV cache for incremental decoding.
//!
//! Parameters live in a [`tch::nn::VarStore`] under their Hugging Face names
//! (`model.layers.0.self_attn.q_proj.weight`, ...), so checkpoints are loadable by
//! transformers and vLLM as they are, and the learner trains the same variables.

use std::collections::HashMap;
use std::path::Path;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tch::{nn, Device, Kind, Tensor};

use crate::packed::{Packed, WeightFormat};

use crate::NativeError;

/// Architecture hyper-parameters, in `config.json` terms.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LlamaConfig {
    /// `llama` or `qwen2`.
    pub model_type: String,
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    pub num_key_value_heads: i64,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub max_position_embeddings: i64,
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry a bias (qwen2).
    pub attention_bias: bool,
    /// RoPE rotates adjacent pairs (ggml's llama layout) instead of the two halves of each
    /// head (Hugging Face layout). Loaders convert weights to the HF layout, so this is
    /// false for every loaded model; it exists for weights kept in the ggml layout.
    #[serde(default)]
    pub rope_interleaved: bool,
    pub bos_token_id: Option<i64>,
    pub eos_token_id: Option<i64>,
}

impl LlamaConfig {
    pub fn head_dim(&self) -> i64 {
        self.hidden_size / self.num_attention_heads
    }

    /// A small random-initialisable configuration for tests and benchmarks.
    pub fn tiny(vocab_size: i64, hidden_size: i64, layers: i64) -> Self {
        LlamaConfig {
            model_type: "llama".into(),
            vocab_size,
            hidden_size,
            intermediate_size: hidden_size * 2,
            num_hidden_layers: layers,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            max_position_embeddings: 2048,
            tie_word_embeddings: true,
            attention_bias: false,
            rope_interleaved: false,
            bos_token_id: None,
            eos_token_id: None,
        }
    }

    /// Checks the hyper-parameters fit together; errors name the field.
    pub fn validate(&self) -> Result<(), NativeError> {
        let bad = |field: &str, detail: String| Err(NativeError::Config { field: field.into(), detail });
        if !matches!(self.model_type.as_str(), "llama" | "qwen2") {
            return bad("model_type", format!("`{}` is not supported (llama, qwen2)", self.model_type));
        }
        for (f, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
        ] {
            if v <= 0 {
                return bad(f, format!("must be positive, is {v}"));
            }
        }
        if self.hidden_size % self.num_attention_heads != 0 || self.head_dim() % 2 != 0 {
            return bad("num_attention_heads", format!("hidden_size {} must split into heads of even size", self.hidden_size));
        }
        if self.num_attention_heads % self.num_key_value_heads != 0 {
            return bad(
                "num_key_value_heads",
                format!("{} does not divide num_attention_heads {}", self.num_key_value_heads, self.num_attention_heads),
            );
        }
        Ok(())
    }

    /// The Hugging Face `config.json` of this model (float32 weights).
    pub fn to_hf_json(&self) -> serde_json::Value {
        let arch = if self.model_type == "qwen2" { "Qwen2ForCausalLM" } else { "LlamaForCausalLM" };
        let mut v = serde_json::to_value(self).expect("config serialises");
        let o = v.as_object_mut().expect("object");
        o.remove("rope_interleaved");
        o.insert("architectures".into(), serde_json::json!([arch]));
        o.insert("hidden_act".into(), "silu".into());
        o.insert("torch_dtype".into(), "float32".into());
        o.insert("head_dim".into(), self.head_dim().into());
        if self.model_type == "qwen2" {
            o.remove("attention_bias");
        }
        v
    }

    /// Reads a Hugging Face `config.json` (llama or qwen2).
    pub fn from_hf_json(path: &Path, text: &str) -> Result<Self, NativeError> {
        let v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| NativeError::Format { path: path.into(), detail: format!("not JSON: {e}") })?;
        let field = |k: &str| v.get(k).ok_or_else(|| NativeError::MissingMetadata { path: path.into(), key: k.into() });
        let int = |k: &str| -> Result<i64, NativeError> {
            field(k)?.as_i64().ok_or_else(|| NativeError::Format { path: path.into(), detail: format!("`{k}` must be an integer") })
        };
        let model_type = field("model_type")?.as_str().unwrap_or_default().to_string();
        if !matches!(model_type.as_str(), "llama" | "qwen2") {
            return Err(NativeError::UnsupportedArchitecture { path: path.into(), arch: model_type });
        }
        let heads = int("num_attention_heads")?;
        let first_id =
            |k: &str| v.get(k).and_then(|x| x.as_i64().or_else(|| x.as_array().and_then(|a| a.first()).and_then(|y| y.as_i64())));
        let cfg = LlamaConfig {
            vocab_size: int("vocab_size")?,
            hidden_size: int("hidden_size")?,
            intermediate_size: int("intermediate_size")?,
            num_hidden_layers: int("num_hidden_layers")?,
            num_attention_heads: heads,
            num_key_value_heads: v.get("num_key_value_heads").and_then(|x| x.as_i64()).unwrap_or(heads),
            rms_norm_eps: v.get("rms_norm_eps").and_then(|x| x.as_f64()).unwrap_or(1e-6),
            rope_theta: v.get("rope_theta").and_then(|x| x.as_f64()).unwrap_or(10000.0),
            max_position_embeddings: v.get("max_position_embeddings").and_then(|x| x.as_i64()).unwrap_or(2048),
            tie_word_embeddings: v.get("tie_word_embeddings").and_then(|x| x.as_bool()).unwrap_or(false),
            attention_bias: model_type == "qwen2" || v.get("attention_bias").and_then(|x| x.as_bool()).unwrap_or(false),
            rope_interleaved: false,
            bos_token_id: first_id("bos_token_id"),
            eos_token_id: first_id("eos_token_id"),
            model_type,
        };
        cfg.validate().map_err(|e| NativeError::Format { path: path.into(), detail: e.to_string() })?;
        Ok(cfg)
    }
}

pub(crate) struct Layer {
    pub(crate) input_norm: Tensor,
    pub(crate) q: Tensor,
    pub(crate) k: Tensor,
    pub(crate) v: Tensor,
    pub(crate) q_bias: Option<Tensor>,
    pub(crate) k_bias: Option<Tensor>,
    pub(crate) v_bias: Option<Tensor>,
    pub(crate) o: Tensor,
    pub(crate) post_norm: Tensor,
    pub(crate) gate: Tensor,
    pub(crate) up: Tensor,
    pub(crate) down: Tensor,
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

/// Keys and values of one sequence in preallocated per-layer buffers `[1, kv_heads,
/// capacity, head_dim]` that grow by doubling: the batching engine's cache. Positions at
/// and beyond `len` hold stale values that attention never reads.
pub struct SeqKv {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    len: usize,
    cap: usize,
}

impl SeqKv {
    pub fn new(model: &Llama, capacity: usize) -> Self {
        let c = &model.config;
        let cap = capacity.max(1);
        let shape = [1, c.num_key_value_heads, cap as i64, c.head_dim()];
        let alloc = || (0..c.num_hidden_layers).map(|_| Tensor::zeros(shape, (Kind::Float, model.device()))).collect::<Vec<_>>();
        SeqKv { k: alloc(), v: alloc(), len: 0, cap }
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets every position from `len` on.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Positions the buffers have room for (what the cache's memory is proportional to).
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Layer `i`'s key and value buffers `[kv_heads, capacity, head_dim]` and the capacity
    /// (for the CPU kernels, which write them directly).
    pub(crate) fn layer(&mut self, i: usize) -> (&mut [f32], &mut [f32], usize) {
        let n = self.k[i].numel();
        let (k, v) = (&self.k[i], &self.v[i]);
        assert!(k.device() == Device::Cpu && k.kind() == Kind::Float && k.is_contiguous() && v.is_contiguous());
        // SAFETY: contiguous float32 CPU buffers of `n` values that this cache owns and
        // `&mut self` borrows exclusively.
        unsafe {
            (
                std::slice::from_raw_parts_mut(k.data_ptr() as *mut f32, n),
                std::slice::from_raw_parts_mut(v.data_ptr() as *mut f32, n),
                self.cap,
            )
        }
    }

    /// Counts `n` more positions as held (written through [`SeqKv::layer`]).
    pub(crate) fn advance(&mut self, n: usize) {
        debug_assert!(self.len + n <= self.cap);
        self.len += n;
    }

    /// Makes room for `n` positions, keeping those held.
    pub(crate) fn reserve(&mut self, n: usize) {
        if n <= self.cap {
            return;
        }
        let cap = n.max(self.cap * 2);
        for buf in self.k.iter_mut().chain(self.v.iter_mut()) {
            let s = buf.size();
            let grown = Tensor::zeros([s[0], s[1], cap as i64, s[3]], (Kind::Float, buf.device()));
            grown.narrow(2, 0, self.len as i64).copy_(&buf.narrow(2, 0, self.len as i64));
            *buf = grown;
        }
        self.cap = cap;
    }

    /// Copies positions `from..to` of `other` (the same model's) into this cache, which must
    /// hold exactly `from` positions: exact values, no recomputation.
    pub fn copy_range(&mut self, other: &SeqKv, from: usize, to: usize) {
        debug_assert!(self.len == from && other.len >= to);
        self.reserve(to);
        let _g = tch::no_grad_guard();
        let n = (to - from) as i64;
        for (dst, src) in self.k.iter_mut().zip(&other.k).chain(self.v.iter_mut().zip(&other.v)) {
            dst.narrow(2, from as i64, n).copy_(&src.narrow(2, from as i64, n));
        }
        self.len = to;
    }
}

/// One sequence's share of an engine forward pass: `rows` consecutive rows of the pass,
/// starting at row `first`, are its next tokens (positions `cache.len()..`); `attend` of
/// them are real and advance the cache (the rest are padding of a fixed-shape chunk).
pub struct Segment<'a> {
    pub cache: &'a mut SeqKv,
    pub first: usize,
    pub rows: usize,
    pub attend: usize,
}

/// One layer's matrices for the engine (see [`Llama::engine_weights`]).
struct EngineLayer {
    qkv: Packed,
    qkv_bias: Option<Tensor>,
    o: Packed,
    gate_up: Packed,
    down: Packed,
}

/// The weights the rollout engine decodes with: a copy of the model's matrices in one
/// [`WeightFormat`] (norms and embeddings are the model's own). `int4`, and `f32` on the
/// CPU, run on the CPU's own kernels ([`crate::cpu`]); `bf16`, and `f32` on a GPU, on
/// libtorch.
pub struct EngineWeights {
    pub format: WeightFormat,
    kernels: Kernels,
}

// One value per model, built once: the size of the larger variant costs nothing.
#[allow(clippy::large_enum_variant)]
enum Kernels {
    Torch { layers: Vec<EngineLayer>, head: Packed },
    Cpu(crate::cpu::CpuWeights),
}

impl EngineWeights {
    /// Whether a pass computes each row on its own (the CPU kernels), so that passes need no
    /// fixed shape: the engine then puts every chunk or decode row of a step in one pass.
    pub fn rows_alone(&self) -> bool {
        matches!(self.kernels, Kernels::Cpu(_))
    }

    /// Logits `[rows, vocab]` of final-norm hidden states `[rows, hidden]`.
    pub fn logits_of(&self, h: &Tensor) -> Tensor {
        match &self.kernels {
            Kernels::Torch { head, .. } => head.apply(h),
            Kernels::Cpu(c) => c.logits(h),
        }
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
    /// residual stream, norms and softmax stay float32). The engine's own weights
    /// ([`Llama::engine_weights`]) are not affected.
    pub compute: Kind,
}

impl Llama {
    /// Builds the model with randomly initialised parameters: weights uniform with
    /// σ = 0.02, norms at 1. Drawn from a generator seeded by `seed` and the parameter's
    /// name, not from libtorch's global one, so the same seed gives the same model even
    /// while other threads draw random numbers.
    pub fn new(config: LlamaConfig, device: Device, seed: u64) -> Result<Self, NativeError> {
        let model = Self::zeros(config, device)?;
        let _guard = tch::no_grad_guard();
        for (name, mut var) in model.named_tensors() {
            if name.ends_with("norm.weight") {
                let _ = var.fill_(1.0);
                continue;
            }
            let mut h = Sha256::new();
            h.update(seed.to_le_bytes());
            h.update(name.as_bytes());
            let mut rng = ChaCha8Rng::from_seed(h.finalize().into());
            // uniform on [−a, a] has σ = a/√3
            let a = 0.02f32 * 3f32.sqrt();
            let values: Vec<f32> = (0..var.numel()).map(|_| (rng.random::<f32>() * 2.0 - 1.0) * a).collect();
            var.copy_(&Tensor::from_slice(&values).view(var.size().as_slice()).to_device(device));
        }
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
            layers.push(Layer {
                input_norm: (&l / "input_layernorm").var("weight", &[c.hidden_size], nn::Init::Const(1.0)),
                q: (&a / "q_proj").var("weight", &[c.num_attention_heads * hd, c.hidden_size], init),
                k: (&a / "k_proj").var("weight", &[c.num_key_value_heads * hd, c.hidden_size], init),
                v: (&a / "v_proj").var("weight", &[c.num_key_value_heads * hd, c.hidden_size], init),
                q_bias: bias("q_proj", c.num_attention_heads * hd),
                k_bias: bias("k_proj", c.num_key_value_heads * hd),
                v_bias: bias("v_proj", c.num_key_value_heads * hd),
                o: (&a / "o_proj").var("weight", &[c.hidden_size, c.num_attention_heads * hd], init),
                post_norm: (&l / "post_attention_layernorm").var("weight", &[c.hidden_size], nn::Init::Const(1.0)),
                gate: (&mlp / "gate_proj").var("weight", &[c.intermediate_size, c.hidden_size], init),
                up: (&mlp / "up_proj").var("weight", &[c.intermediate_size, c.hidden_size], init),
                down: (&mlp / "down_proj").var("weight", &[c.hidden_size, c.intermediate_size], init),
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
        let _guard = tch::no_grad_guard();
        for (name, mut var) in self.vs.variables() {
            let src = tensors.get(&name).ok_or_else(|| NativeError::MissingTensor { path: source.into(), tensor: name.clone() })?;
            if src.size() != var.size() {
                return Err(NativeError::Shape { path: source.into(), tensor: name, expected: var.size(), got: src.size() });
            }
            var.f_copy_(&src.to_kind(Kind::Float))?;
        }
        Ok(())
    }

    /// A copy of this model with its own parameters (e.g. one per engine).
    pub fn clone_weights(&self) -> Result<Llama, NativeError> {
        let tensors: HashMap<String, Tensor> = self.named_tensors().into_iter().collect();
        Llama::from_tensors(self.config.clone(), &tensors, self.device(), Path::new("(in memory)"))
    }

    /// Parameters by HF name (shared storage, float32).
    pub fn named_tensors(&self) -> Vec<(String, Tensor)> {
        let mut v: Vec<_> = self.vs.variables().into_iter().collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
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

    /// Logits `[N, vocab]` at `flat` positions `[N]` (row · T + column) of `tokens` `[B, T]`,
    /// from position 0: the learner's teacher-forced scores of the completion tokens only.
    pub fn logits_at(&self, tokens: &Tensor, flat: &Tensor) -> Tensor {
        let h = self.hidden(tokens, None);
        let hidden = h.size()[2];
        self.logits_of(&h.view([-1, hidden]).index_select(0, flat))
    }

    /// [`Llama::logits_at`] for rows that all start with `prefix` `[P]`: `rows` `[B, T]`
    /// holds what follows the prefix (row tokens from position P on) and `flat` indexes it.
    /// The prefix is computed once and every row attends to its keys and values, so its
    /// gradient gathers the contributions of every row. Equal to the unshared pass within
    /// float rounding.
    pub fn logits_at_shared(&self, prefix: &Tensor, rows: &Tensor, flat: &Tensor) -> Tensor {
        let h = self.hidden_shared(prefix, rows);
        let hidden = h.size()[2];
        self.logits_of(&h.view([-1, hidden]).index_select(0, flat))
    }

    /// Final-norm hidden states `[B, T, hidden]` of `rows` `[B, T]` placed after the shared
    /// `prefix` `[P]`. The linear layers run over the prefix and the rows as one matrix of
    /// P + B·T tokens; only attention tells them apart (the prefix attends causally to
    /// itself, each row to the whole prefix and causally to itself).
    fn hidden_shared(&self, prefix: &Tensor, rows: &Tensor) -> Tensor {
        let c = &self.config;
        let p = prefix.size1().expect("prefix must be [P]");
        let (b, t) = rows.size2().expect("rows must be [B, T]");
        let hd = c.head_dim();
        let (nh, nkv) = (c.num_attention_heads, c.num_key_value_heads);
        let (cos_p, sin_p) = self.rope_tables(0, p);
        let (cos_r, sin_r) = self.rope_tables(p, t);
        let (mask_p, mask_r) = (self.causal_mask(0, p), self.causal_mask(p, t));
        let split = |y: &Tensor, heads: i64| {
            (y.narrow(0, 0, p).view([1, p, heads, hd]).transpose(1, 2), y.narrow(0, p, b * t).view([b, t, heads, hd]).transpose(1, 2))
        };
        let tokens = Tensor::cat(&[prefix.shallow_clone(), rows.reshape([-1])], 0);
        let mut x = Tensor::embedding(&self.embed, &tokens, -1, false, false);
        for l in &self.layers {
            x = self.layer(l, &x, |q, k, v| {
                let ((q_p, q_r), (k_p, k_r), (v_p, v_r)) = (split(&q, nh), split(&k, nkv), split(&v, nkv));
                let (q_p, k_p) = (self.rope(&q_p, &cos_p, &sin_p), self.rope(&k_p, &cos_p, &sin_p));
                let (q_r, k_r) = (self.rope(&q_r, &cos_r, &sin_r), self.rope(&k_r, &cos_r, &sin_r));
                let att_p = self.attend(&q_p, &k_p, &v_p, Some(&mask_p));
                let k_all = Tensor::cat(&[k_p.expand([b, nkv, p, hd], false), k_r], 2);
                let v_all = Tensor::cat(&[v_p.expand([b, nkv, p, hd], false), v_r], 2);
                let att_r = self.attend(&q_r, &k_all, &v_all, Some(&mask_r));
                Tensor::cat(&[att_p.transpose(1, 2).reshape([p, nh * hd]), att_r.transpose(1, 2).reshape([b * t, nh * hd])], 0)
            });
        }
        rms_norm(&x.narrow(0, p, b * t), &self.norm, c.rms_norm_eps).view([b, t, -1])
    }

    /// One decoder layer on the residual stream `x` (`[.., hidden]`): pre-norm, the q, k and
    /// v projections, `attention` (which places, rotates and attends them and returns `[..,
    /// heads · head_dim]` in `x`'s row layout), the output projection, and the SwiGLU MLP.
    /// Only attention differs between the full, cached and shared-prefix passes.
    fn layer(&self, l: &Layer, x: &Tensor, attention: impl FnOnce(Tensor, Tensor, Tensor) -> Tensor) -> Tensor {
        let eps = self.config.rms_norm_eps;
        let h = rms_norm(x, &l.input_norm, eps);
        let c = self.compute;
        let att = attention(
            linear(&h, &l.q, l.q_bias.as_ref(), c),
            linear(&h, &l.k, l.k_bias.as_ref(), c),
            linear(&h, &l.v, l.v_bias.as_ref(), c),
        );
        let x = x + mm(&att, &l.o, c);
        let h = rms_norm(&x, &l.post_norm, eps);
        let mlp = mm(&(mm(&h, &l.gate, c).silu() * mm(&h, &l.up, c)), &l.down, c);
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
    fn causal_mask(&self, start: i64, len: i64) -> Tensor {
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

    /// The engine's copy of the weights in `format`, with the products that share an input
    /// fused (q, k and v into one matrix; gate and up into another): fewer, larger products
    /// per layer. `threads`: the CPU kernels' thread count (`int4`, and `f32` on the CPU).
    pub fn engine_weights(&self, format: WeightFormat, threads: usize) -> Result<EngineWeights, NativeError> {
        // int4 exists on the CPU kernels only; f32 on the CPU runs there too (libtorch's CPU
        // product at a decode step's few rows costs a copy of every weight matrix per call)
        let on_cpu = self.device() == tch::Device::Cpu;
        if format == WeightFormat::Int4 || (format == WeightFormat::F32 && on_cpu) {
            return Ok(EngineWeights { format, kernels: Kernels::Cpu(crate::cpu::CpuWeights::new(self, format, threads)?) });
        }
        let _g = tch::no_grad_guard();
        let mut layers = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            let qkv_bias = match (&l.q_bias, &l.k_bias, &l.v_bias) {
                (Some(q), Some(k), Some(v)) => Some(Tensor::cat(&[q, k, v], 0)),
                _ => None,
            };
            layers.push(EngineLayer {
                qkv: Packed::new(&Tensor::cat(&[&l.q, &l.k, &l.v], 0), format),
                qkv_bias,
                o: Packed::new(&l.o, format),
                gate_up: Packed::new(&Tensor::cat(&[&l.gate, &l.up], 0), format),
                down: Packed::new(&l.down, format),
            });
        }
        let head = Packed::new(self.lm_head.as_ref().unwrap_or(&self.embed), format);
        Ok(EngineWeights { format, kernels: Kernels::Torch { layers, head } })
    }

    /// Final-norm hidden states `[rows, hidden]` of one engine pass over `ids` (one token
    /// per row; rows no segment covers are padding), with the matrices of `w`. Every matrix
    /// product runs on all rows at once, so its shape is the pass's fixed row count whatever
    /// the sequences in it: with a fixed shape a row's result does not depend on the other
    /// rows (measured bitwise on this backend for every weight format; see the engine's
    /// tests), which makes the engine's numerics independent of batch composition.
    /// Attention runs per segment against its own cache.
    pub fn forward_rows(&self, w: &EngineWeights, ids: &[u32], segments: &mut [Segment<'_>]) -> Tensor {
        let layers = match &w.kernels {
            Kernels::Cpu(c) => return crate::cpu::forward(self, c, ids, segments),
            Kernels::Torch { layers, .. } => layers,
        };
        let c = &self.config;
        let m = ids.len() as i64;
        let hd = c.head_dim();
        let (heads, kv_heads) = (c.num_attention_heads, c.num_key_value_heads);
        let dev = self.device();
        let mut pos = vec![0i64; ids.len()];
        for s in segments.iter_mut() {
            s.cache.reserve(s.cache.len + s.rows);
            for r in 0..s.rows {
                pos[s.first + r] = (s.cache.len + r) as i64;
            }
        }
        let (cos, sin) = self.rope_at(&pos);
        let tokens: Vec<i64> = ids.iter().map(|&t| t as i64).collect();
        let mut x = Tensor::embedding(&self.embed, &Tensor::from_slice(&tokens).to_device(dev), -1, false, false);
        let masks: Vec<Option<Tensor>> =
            segments.iter().map(|s| (s.rows > 1).then(|| self.causal_mask(s.cache.len as i64, s.rows as i64))).collect();
        let att = Tensor::zeros([1, heads, m, hd], (Kind::Float, dev));
        for (i, (l, pl)) in self.layers.iter().zip(layers).enumerate() {
            let h = rms_norm(&x, &l.input_norm, c.rms_norm_eps);
            let mut qkv = pl.qkv.apply(&h);
            if let Some(b) = &pl.qkv_bias {
                qkv = qkv + b;
            }
            // q and k rotate together: [1, heads + kv_heads, rows, head_dim]
            let qk = qkv.narrow(1, 0, (heads + kv_heads) * hd).view([1, m, heads + kv_heads, hd]).transpose(1, 2);
            let qk = self.rope(&qk, &cos, &sin);
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
        rms_norm(&x, &self.norm, c.rms_norm_eps)
    }

    /// cos/sin of arbitrary positions, laid out as [`Llama::rope_tables`]'.
    fn rope_at(&self, pos: &[i64]) -> (Tensor, Tensor) {
        let hd = self.config.head_dim();
        let dev = self.device();
        let exponent = Tensor::arange_start_step(0, hd, 2, (Kind::Float, dev)) / hd as f64;
        let inv_freq = Tensor::from(self.config.rope_theta as f32).to_device(dev).pow(&exponent).reciprocal();
        let pos = Tensor::from_slice(pos).to_kind(Kind::Float).to_device(dev);
        let freqs = pos.outer(&inv_freq);
        let freqs = if self.config.rope_interleaved { freqs } else { Tensor::cat(&[&freqs, &freqs], -1) };
        (freqs.cos(), freqs.sin())
    }

    /// cos/sin of positions `start..start+t`: `[t, head_dim]` for the half-rotation layout,
    /// `[t, head_dim/2]` for the interleaved one.
    fn rope_tables(&self, start: i64, t: i64) -> (Tensor, Tensor) {
        self.rope_at(&(start..start + t).collect::<Vec<_>>())
    }

    /// Rotary position embedding of `x` `[B, heads, T, head_dim]`.
    fn rope(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
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
            // HF layout: rotate the first half of each head against the second.
            let x1 = x.narrow(-1, 0, hd / 2);
            let x2 = x.narrow(-1, hd / 2, hd / 2);
            let rotated = Tensor::cat(&[-x2, x1], -1);
            x * cos + rotated * sin
        }
    }
}

fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Tensor {
    let var = x.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
    x * (var + eps).rsqrt() * w
}

/// x · wᵀ in `kind` (float32 out): the mixed-precision product of [`Llama::compute`]. With
/// `kind` float32 every `to_kind` returns its tensor itself: the plain product.
fn mm(x: &Tensor, w: &Tensor, kind: Kind) -> Tensor {
    x.to_kind(kind).matmul(&w.to_kind(kind).tr()).to_kind(Kind::Float)
}

fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>, kind: Kind) -> Tensor {
    let y = mm(x, w, kind);
    match b {
        Some(b) => y + b,
        None => y,
    }
}

/// ggml's llama q/k row order → HF's: ggml stores each head's rows as interleaved
/// (re, im) pairs, HF as two halves (the inverse of the converter's `permute`).
pub fn unpermute_qk(w: &Tensor, heads: i64) -> Tensor {
    let s = w.size();
    let rows = s[0];
    let rest: Vec<i64> = s[1..].to_vec();
    let mut shape = vec![heads, rows / heads / 2, 2];
    shape.extend(&rest);
    w.reshape(&shape).transpose(1, 2).reshape(&s)
}

/// HF's q/k row order → ggml's (the converter's `permute`).
pub fn permute_qk(w: &Tensor, heads: i64) -> Tensor {
    let s = w.size();
    let rows = s[0];
    let rest: Vec<i64> = s[1..].to_vec();
    let mut shape = vec![heads, 2, rows / heads / 2];
    shape.extend(&rest);
    w.reshape(&shape).transpose(1, 2).reshape(&s)
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn config_round_trips_through_hf_json() {
        let mut cfg = LlamaConfig::tiny(50, 32, 2);
        cfg.model_type = "qwen2".into();
        cfg.attention_bias = true;
        let text = cfg.to_hf_json().to_string();
        let back = LlamaConfig::from_hf_json(Path::new("config.json"), &text).unwrap();
        assert_eq!(back, cfg);
        let err = LlamaConfig::from_hf_json(Path::new("config.json"), r#"{"model_type":"gpt2"}"#).unwrap_err().to_string();
        assert!(err.contains("gpt2"), "{err}");
    }
}
