//! Qwen3.5's text decoder (transformers' `qwen3_5`): a hybrid of Gated DeltaNet layers and
//! gated full-attention layers, [GDN, GDN, GDN, full] repeated (`layer_types`).
//!
//! - Full attention: `q_proj` gives each head's query and an output gate side by side; q and
//!   k pass a per-head RMSNorm; RoPE rotates the first `partial_rotary_factor` of each head
//!   (text positions: the multimodal rope sections reduce to 1-D); GQA; the output is
//!   multiplied by sigmoid(gate) before `o_proj`.
//! - Gated DeltaNet ([`crate::model::deltanet`]): `in_proj_qkv` through a causal depthwise
//!   convolution with SiLU; β = sigmoid(b), g = −exp(A_log)·softplus(a + dt_bias); the gated
//!   delta rule; an RMSNorm gated by SiLU(z); `out_proj`.
//! - Every RMSNorm but the gated one is zero-centred: x̂ · (1 + w).
//!
//! Parameters keep transformers' names in the layout of the folder they came from:
//! `Qwen3_5ForCausalLM`'s `model.layers.0.linear_attn.in_proj_qkv.weight`, or a released
//! `Qwen3_5ForConditionalGeneration` checkpoint's `model.language_model.layers.0…` (its
//! vision tower and MTP layer are not read). [`Qwen35Config::to_hf_json`] gives back the
//! folder's own `config.json`, so a checkpoint's weights go back where they came from
//! (transformers, or SGLang's `update_weights_from_disk` on the full model).

use std::collections::HashMap;
use std::path::Path;

use tch::{nn, Device, Kind, Tensor};

use crate::model::deltanet;
use crate::model::layers::{mm as mm_in, rms_norm, rope_angles, rotate_half, Linear};
use crate::NativeError;

/// The gated delta rule's chunk length for passes of more than one token (transformers').
pub const CHUNK: i64 = 64;

/// The text part of a Qwen3.5 `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen35Config {
    pub vocab_size: i64,
    pub hidden_size: i64,
    pub intermediate_size: i64,
    pub num_hidden_layers: i64,
    pub num_attention_heads: i64,
    pub num_key_value_heads: i64,
    pub head_dim: i64,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    /// The share of each head RoPE rotates (0.25).
    pub partial_rotary_factor: f64,
    pub linear_num_key_heads: i64,
    pub linear_num_value_heads: i64,
    pub linear_key_head_dim: i64,
    pub linear_value_head_dim: i64,
    pub linear_conv_kernel_dim: i64,
    /// One per layer: true for full attention, false for a Gated DeltaNet layer.
    pub full_attention: Vec<bool>,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: i64,
    /// Whether the parameters are named as in a released checkpoint
    /// (`model.language_model.*`, the text config under `text_config`).
    pub language_model: bool,
    /// The `config.json` read (`Null` for a config built in code).
    pub hf: serde_json::Value,
}

impl Qwen35Config {
    /// Reads `config.json`: a `qwen3_5_text` config, or a `qwen3_5` one with the text config
    /// under `text_config`. What this decoder does not run is refused with the field named.
    pub fn from_hf_json(path: &Path, text: &str) -> Result<Self, NativeError> {
        let top: serde_json::Value =
            serde_json::from_str(text).map_err(|e| NativeError::Format { path: path.into(), detail: format!("not JSON: {e}") })?;
        let model_type = top.get("model_type").and_then(|v| v.as_str()).unwrap_or_default();
        let v = match model_type {
            "qwen3_5_text" => &top,
            "qwen3_5" => {
                top.get("text_config").ok_or_else(|| NativeError::MissingMetadata { path: path.into(), key: "text_config".into() })?
            }
            other => return Err(NativeError::UnsupportedArchitecture { path: path.into(), arch: other.into() }),
        };
        let refuse = |field: &str, detail: String| NativeError::Config { field: format!("{}: {field}", path.display()), detail };
        let int = |k: &str| -> Result<i64, NativeError> {
            v.get(k).and_then(|x| x.as_i64()).ok_or_else(|| NativeError::MissingMetadata { path: path.into(), key: k.into() })
        };
        let rope = v.get("rope_parameters").cloned().unwrap_or_default();
        if let Some(t) = rope.get("rope_type").and_then(|t| t.as_str()).filter(|t| *t != "default") {
            return Err(refuse("rope_parameters.rope_type", format!("`{t}` RoPE scaling is not supported (default only)")));
        }
        if v.get("attention_bias").and_then(|b| b.as_bool()) == Some(true) {
            return Err(refuse("attention_bias", "Qwen3.5 attention without bias is what this decoder runs".into()));
        }
        if v.get("num_experts").and_then(|x| x.as_i64()).is_some_and(|n| n > 0) {
            return Err(refuse("num_experts", "the mixture-of-experts Qwen3.5 models are not supported".into()));
        }
        let layers = int("num_hidden_layers")?;
        let full_attention = match v.get("layer_types").and_then(|t| t.as_array()) {
            Some(types) => types
                .iter()
                .map(|t| match t.as_str() {
                    Some("full_attention") => Ok(true),
                    Some("linear_attention") => Ok(false),
                    other => Err(refuse("layer_types", format!("{other:?} is neither `full_attention` nor `linear_attention`"))),
                })
                .collect::<Result<Vec<_>, _>>()?,
            None => {
                let every = v.get("full_attention_interval").and_then(|x| x.as_i64()).unwrap_or(4);
                (0..layers).map(|i| (i + 1) % every == 0).collect()
            }
        };
        if full_attention.len() as i64 != layers {
            return Err(refuse("layer_types", format!("{} entries for {layers} layers", full_attention.len())));
        }
        let f = |k: &str, default: f64| v.get(k).and_then(|x| x.as_f64()).unwrap_or(default);
        let cfg = Qwen35Config {
            vocab_size: int("vocab_size")?,
            hidden_size: int("hidden_size")?,
            intermediate_size: int("intermediate_size")?,
            num_hidden_layers: layers,
            num_attention_heads: int("num_attention_heads")?,
            num_key_value_heads: int("num_key_value_heads")?,
            head_dim: int("head_dim")?,
            rms_norm_eps: f("rms_norm_eps", 1e-6),
            rope_theta: rope.get("rope_theta").and_then(|x| x.as_f64()).unwrap_or_else(|| f("rope_theta", 10_000_000.0)),
            partial_rotary_factor: rope
                .get("partial_rotary_factor")
                .and_then(|x| x.as_f64())
                .unwrap_or_else(|| f("partial_rotary_factor", 0.25)),
            linear_num_key_heads: int("linear_num_key_heads")?,
            linear_num_value_heads: int("linear_num_value_heads")?,
            linear_key_head_dim: int("linear_key_head_dim")?,
            linear_value_head_dim: int("linear_value_head_dim")?,
            linear_conv_kernel_dim: v.get("linear_conv_kernel_dim").and_then(|x| x.as_i64()).unwrap_or(4),
            full_attention,
            // the small sizes tie their embeddings; the flag sits at the top of a nested config
            tie_word_embeddings: v
                .get("tie_word_embeddings")
                .or_else(|| top.get("tie_word_embeddings"))
                .and_then(|x| x.as_bool())
                .unwrap_or(false),
            max_position_embeddings: v.get("max_position_embeddings").and_then(|x| x.as_i64()).unwrap_or(32768),
            language_model: model_type == "qwen3_5",
            hf: top.clone(),
        };
        cfg.validate().map_err(|e| NativeError::Format { path: path.into(), detail: e.to_string() })?;
        Ok(cfg)
    }

    /// The `config.json` of a folder of this model: the one it was read from, or for a
    /// config built in code a `qwen3_5_text` one (`Qwen3_5ForCausalLM`) of its fields.
    pub fn to_hf_json(&self) -> serde_json::Value {
        if !self.hf.is_null() {
            return self.hf.clone();
        }
        let types: Vec<&str> = self.full_attention.iter().map(|&f| if f { "full_attention" } else { "linear_attention" }).collect();
        serde_json::json!({
            "architectures": ["Qwen3_5ForCausalLM"],
            "model_type": "qwen3_5_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta, "partial_rotary_factor": self.partial_rotary_factor},
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "layer_types": types,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": false,
            "torch_dtype": "float32",
        })
    }

    /// The text config of a shape: `0.8b`, `4b` and `9b` are the released models' (random
    /// weights for benchmarks), `tiny` a test size; `vocab_size` overrides the vocabulary.
    pub fn shape(name: &str, vocab_size: Option<i64>) -> Result<Self, NativeError> {
        // (hidden, intermediate, layers, heads, kv heads, linear value heads, tied)
        let (h, i, l, nh, nkv, hv, tied, vocab) = match name {
            "tiny" => (32, 64, 4, 4, 2, 4, true, 64),
            "0.8b" => (1024, 3584, 24, 8, 2, 16, true, 248_320),
            "4b" => (2560, 9216, 32, 16, 4, 32, true, 248_320),
            "9b" => (4096, 12288, 32, 16, 4, 32, false, 248_320),
            other => {
                return Err(NativeError::Config {
                    field: "shape".into(),
                    detail: format!("`{other}` is not a Qwen3.5 shape (tiny, 0.8b, 4b, 9b)"),
                })
            }
        };
        let (hd, dk, hk) = if name == "tiny" { (16, 8, 2) } else { (256, 128, 16) };
        let cfg = Qwen35Config {
            vocab_size: vocab_size.unwrap_or(vocab),
            hidden_size: h,
            intermediate_size: i,
            num_hidden_layers: l,
            num_attention_heads: nh,
            num_key_value_heads: nkv,
            head_dim: hd,
            rms_norm_eps: 1e-6,
            rope_theta: 10_000_000.0,
            partial_rotary_factor: 0.25,
            linear_num_key_heads: hk,
            linear_num_value_heads: hv,
            linear_key_head_dim: dk,
            linear_value_head_dim: dk,
            linear_conv_kernel_dim: 4,
            full_attention: (0..l).map(|i| (i + 1) % 4 == 0).collect(),
            tie_word_embeddings: tied,
            max_position_embeddings: if name == "tiny" { 4096 } else { 262_144 },
            language_model: false,
            hf: serde_json::Value::Null,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The rotated width of each head: an even number of dimensions.
    pub fn rotary_dim(&self) -> i64 {
        (self.head_dim as f64 * self.partial_rotary_factor) as i64
    }

    pub fn validate(&self) -> Result<(), NativeError> {
        let bad = |field: &str, detail: String| Err(NativeError::Config { field: field.into(), detail });
        if self.num_attention_heads % self.num_key_value_heads != 0 {
            return bad("num_key_value_heads", format!("{} does not divide num_attention_heads", self.num_key_value_heads));
        }
        if self.linear_num_value_heads % self.linear_num_key_heads != 0 {
            return bad("linear_num_key_heads", format!("{} does not divide linear_num_value_heads", self.linear_num_key_heads));
        }
        let rd = self.rotary_dim();
        if rd <= 0 || rd % 2 != 0 || rd > self.head_dim {
            return bad("partial_rotary_factor", format!("rotates {rd} of {} dimensions; it must be an even share", self.head_dim));
        }
        Ok(())
    }
}

struct Attention {
    /// `[heads · 2 · head_dim, hidden]`: per head, the query rows then the gate rows.
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_norm: Tensor,
    k_norm: Tensor,
}

struct DeltaNet {
    in_qkv: Linear,
    in_z: Linear,
    in_b: Linear,
    in_a: Linear,
    /// `[conv_dim, 1, kernel]`
    conv: Tensor,
    dt_bias: Tensor,
    a_log: Tensor,
    /// The gated RMSNorm's weight `[value_head_dim]` (not zero-centred).
    norm: Tensor,
    out: Linear,
}

enum Mixer {
    Attention(Attention),
    DeltaNet(DeltaNet),
}

struct Layer {
    input_norm: Tensor,
    mixer: Mixer,
    post_norm: Tensor,
    gate: Linear,
    up: Linear,
    down: Linear,
}

/// What a sequence carries between passes: keys and values of the attention layers, the
/// convolution inputs and the recurrent state of the GDN layers.
#[derive(Default)]
pub struct Qwen35Cache {
    layers: Vec<Option<(Tensor, Tensor)>>,
    /// Positions held.
    len: i64,
}

impl Qwen35Cache {
    pub fn len(&self) -> i64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The recurrent part of the state (each GDN layer's convolution inputs and delta-rule
    /// state; nothing of the attention layers): what a cache at this length needs besides
    /// the keys and values. Shares the tensors (no layer writes a state in place).
    pub fn recurrent_state(&self) -> RecurrentState {
        RecurrentState(
            self.layers
                .iter()
                .map(|l| l.as_ref().filter(|(x, _)| recurrent(x)).map(|(x, y)| (x.shallow_clone(), y.shallow_clone())))
                .collect(),
        )
    }

    /// The cache of the first `len` positions of this one, given the recurrent state at
    /// `len` (taken by [`Qwen35Cache::recurrent_state`] when the cache held `len` positions):
    /// the attention layers' keys and values are narrowed, the GDN layers take `state`.
    pub fn at(&self, len: i64, state: &RecurrentState) -> Qwen35Cache {
        assert!(len <= self.len, "a cache of {} positions has no state at {len}", self.len);
        let layers = self
            .layers
            .iter()
            .zip(state.0.iter().chain(std::iter::repeat(&None)))
            .map(|(l, s)| match (l, s) {
                (_, Some((x, y))) => Some((x.shallow_clone(), y.shallow_clone())),
                (Some((k, v)), None) if !recurrent(k) => Some((k.narrow(2, 0, len), v.narrow(2, 0, len))),
                _ => None,
            })
            .collect();
        Qwen35Cache { layers, len }
    }
}

/// Whether a cache slot whose first tensor is `x` is a GDN layer's (convolution inputs
/// `[B, C, K − 1]`, then the state) rather than an attention layer's (keys `[B, H, T, D]`).
fn recurrent(x: &Tensor) -> bool {
    x.dim() == 3
}

/// [`Qwen35Cache::recurrent_state`]: the GDN layers' states at one length.
#[derive(Default)]
pub struct RecurrentState(Vec<Option<(Tensor, Tensor)>>);

impl Clone for RecurrentState {
    /// Shares the tensors (states are replaced, never written in place).
    fn clone(&self) -> Self {
        RecurrentState(self.0.iter().map(|l| l.as_ref().map(|(x, y)| (x.shallow_clone(), y.shallow_clone()))).collect())
    }
}

/// The learner's passes: the gated delta rule in chunks of [`CHUNK`]; a
/// shared prefix runs once and its state (keys and values, convolution inputs, recurrent
/// state) starts every row.
impl crate::model::CausalLm for Qwen35 {
    fn device(&self) -> Device {
        Qwen35::device(self)
    }

    fn set_compute(&mut self, kind: Kind) {
        self.compute = kind;
    }

    fn named_tensors(&self) -> Vec<(String, Tensor)> {
        Qwen35::named_tensors(self)
    }

    fn pass<'a>(&'a self, prefix: Option<&'a Tensor>, rows: &'a Tensor, flat: &'a Tensor) -> Box<dyn crate::model::Pass + 'a> {
        let at = crate::model::PassRows::new(prefix, rows, flat);
        let (rope_p, rope_r) = (self.rope(0, at.p), self.rope(at.p, at.t));
        Box::new(Qwen35Pass { m: self, at, rope_p, rope_r })
    }
}

/// [`crate::model::CausalLm::pass`] of Qwen3.5: with a prefix, the residual stream is the
/// prefix's `[P, hidden]` and the rows' `[B·T, hidden]` one after the other; each block runs
/// the prefix, then the rows from the prefix's state of that layer (keys and values,
/// convolution inputs, recurrent state).
struct Qwen35Pass<'a> {
    m: &'a Qwen35,
    at: crate::model::PassRows<'a>,
    rope_p: (Tensor, Tensor),
    rope_r: (Tensor, Tensor),
}

impl crate::model::Pass for Qwen35Pass<'_> {
    fn input(&self) -> Tensor {
        Tensor::embedding(&self.m.embed, &self.at.tokens(), -1, false, false)
    }

    fn len(&self) -> usize {
        self.m.layers.len()
    }

    fn block(&self, i: usize, x: &Tensor) -> Tensor {
        let (m, l, b, t, p) = (self.m, &self.m.layers[i], self.at.b, self.at.t, self.at.p);
        let ((cos_p, sin_p), (cos_r, sin_r)) = (&self.rope_p, &self.rope_r);
        if self.at.prefix.is_none() {
            return m.block(l, x, (b, t, 0), (cos_r, sin_r), None, CHUNK);
        }
        let hidden = x.size()[1];
        let mut slot = None;
        let xp = m.block(l, &x.narrow(0, 0, p).view([1, p, hidden]), (1, p, 0), (cos_p, sin_p), Some(&mut slot), CHUNK);
        if let Some((s1, s2)) = slot.as_mut() {
            (*s1, *s2) = (expand_rows(s1, b), expand_rows(s2, b));
        }
        let xr = m.block(l, &x.narrow(0, p, b * t).view([b, t, hidden]), (b, t, p), (cos_r, sin_r), Some(&mut slot), CHUNK);
        Tensor::cat(&[xp.view([p, hidden]), xr.view([b * t, hidden])], 0)
    }

    fn output(&self, x: &Tensor) -> Tensor {
        self.m.logits_of(&self.at.scored(x, |h| norm(h, &self.m.norm, self.m.config.rms_norm_eps)))
    }
}

/// The state of one sequence `[1, ..]` as the start of `b` rows.
fn expand_rows(t: &Tensor, b: i64) -> Tensor {
    let mut shape = t.size();
    shape[0] = b;
    t.expand(shape.as_slice(), false)
}

/// Qwen3.5's text decoder.
pub struct Qwen35 {
    pub config: Qwen35Config,
    pub vs: nn::VarStore,
    embed: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Option<Tensor>,
    /// The kind the matrix products run in (`Float`, or `BFloat16` for the learner's mixed
    /// precision); norms, the gated delta rule and the residual stream stay float32.
    pub compute: Kind,
}

/// The zero-centred RMSNorm of Qwen3.5: x̂ · (1 + w).
fn norm(x: &Tensor, w: &Tensor, eps: f64) -> Tensor {
    rms_norm(x, &(w + 1.0), eps)
}

impl Qwen35 {
    /// The model with every parameter zero, under transformers' names.
    fn zeros(config: Qwen35Config, device: Device) -> Result<Self, NativeError> {
        config.validate()?;
        let vs = nn::VarStore::new(device);
        let root = vs.root();
        let c = &config;
        let z = nn::Init::Const(0.0);
        // a released checkpoint's text model sits under `model.language_model`
        let m = if c.language_model { &root / "model" / "language_model" } else { &root / "model" };
        let embed = (&m / "embed_tokens").var("weight", &[c.vocab_size, c.hidden_size], z);
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (kd, vd) = (c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim);
        let mut layers = vec![];
        for (i, &full) in c.full_attention.iter().enumerate() {
            let l = &(&m / "layers") / i;
            let w = |module: &str, rows: i64, cols: i64| {
                Linear::new(module.split('.').fold(l.clone(), |p, seg| &p / seg).var("weight", &[rows, cols], z))
            };
            let mixer = if full {
                let a = |name: &str| format!("self_attn.{name}");
                Mixer::Attention(Attention {
                    q: w(&a("q_proj"), c.num_attention_heads * hd * 2, h),
                    k: w(&a("k_proj"), c.num_key_value_heads * hd, h),
                    v: w(&a("v_proj"), c.num_key_value_heads * hd, h),
                    o: w(&a("o_proj"), h, c.num_attention_heads * hd),
                    q_norm: (&l / "self_attn" / "q_norm").var("weight", &[hd], z),
                    k_norm: (&l / "self_attn" / "k_norm").var("weight", &[hd], z),
                })
            } else {
                let g = &l / "linear_attn";
                let conv_dim = 2 * kd + vd;
                Mixer::DeltaNet(DeltaNet {
                    in_qkv: Linear::new((&g / "in_proj_qkv").var("weight", &[conv_dim, h], z)),
                    in_z: Linear::new((&g / "in_proj_z").var("weight", &[vd, h], z)),
                    in_b: Linear::new((&g / "in_proj_b").var("weight", &[c.linear_num_value_heads, h], z)),
                    in_a: Linear::new((&g / "in_proj_a").var("weight", &[c.linear_num_value_heads, h], z)),
                    conv: (&g / "conv1d").var("weight", &[conv_dim, 1, c.linear_conv_kernel_dim], z),
                    dt_bias: g.var("dt_bias", &[c.linear_num_value_heads], z),
                    a_log: g.var("A_log", &[c.linear_num_value_heads], z),
                    norm: (&g / "norm").var("weight", &[c.linear_value_head_dim], z),
                    out: Linear::new((&g / "out_proj").var("weight", &[h, vd], z)),
                })
            };
            layers.push(Layer {
                input_norm: (&l / "input_layernorm").var("weight", &[h], z),
                mixer,
                post_norm: (&l / "post_attention_layernorm").var("weight", &[h], z),
                gate: w("mlp.gate_proj", c.intermediate_size, h),
                up: w("mlp.up_proj", c.intermediate_size, h),
                down: w("mlp.down_proj", h, c.intermediate_size),
            });
        }
        let norm = (&m / "norm").var("weight", &[h], z);
        let lm_head = (!c.tie_word_embeddings).then(|| (&root / "lm_head").var("weight", &[c.vocab_size, h], z));
        Ok(Qwen35 { config, vs, embed, layers, norm, lm_head, compute: Kind::Float })
    }

    /// Loads a Hugging Face folder (`config.json` and safetensors, any float dtype):
    /// `Qwen3_5ForCausalLM`'s names, or a released checkpoint's `model.language_model.*`.
    pub fn load(dir: &Path, device: Device) -> Result<Self, NativeError> {
        match crate::model::hf::load_model(dir, device)? {
            crate::model::Model::Qwen35(m) => Ok(m),
            other => Err(NativeError::UnsupportedArchitecture { path: dir.join("config.json"), arch: other.architecture() }),
        }
    }

    /// Builds the model and copies every parameter from `tensors` (transformers' names in
    /// the config's layout, any float kind); a missing tensor or a wrong shape is an error
    /// naming `source` and the tensor.
    pub fn from_tensors(
        config: Qwen35Config,
        tensors: &HashMap<String, Tensor>,
        device: Device,
        source: &Path,
    ) -> Result<Self, NativeError> {
        let model = Self::zeros(config, device)?;
        crate::model::hf::fill(&model.vs, tensors, source)?;
        Ok(model)
    }

    /// The model with random parameters drawn from `seed` (each parameter's values from its
    /// name, as [`crate::model::Llama::new`] does): matrices with σ = 0.02, the zero-centred
    /// norms at 0 and the gated norm at 1 (scale 1), the decay at A = 1, dt_bias = 1.
    pub fn new(config: Qwen35Config, device: Device, seed: u64) -> Result<Self, NativeError> {
        let model = Self::zeros(config, device)?;
        crate::model::hf::randomize(&model.vs, seed, |name| {
            if name.ends_with("linear_attn.norm.weight") || name.ends_with("dt_bias") {
                Some(1.0)
            } else if name.ends_with("norm.weight") || name.ends_with("A_log") {
                Some(0.0)
            } else {
                None
            }
        });
        Ok(model)
    }

    /// `x · wᵀ` in [`Qwen35::compute`], float32 out.
    fn mm(&self, x: &Tensor, w: &Tensor) -> Tensor {
        mm_in(x, w, self.compute)
    }

    /// A linear layer (with its adapter, if any) in [`Qwen35::compute`], float32 out.
    fn lin(&self, x: &Tensor, w: &Linear) -> Tensor {
        w.forward(x, self.compute)
    }

    /// Parameters by transformers' name.
    pub fn named_tensors(&self) -> Vec<(String, Tensor)> {
        crate::model::hf::named(&self.vs)
    }

    pub fn device(&self) -> Device {
        self.vs.device()
    }

    /// Logits `[B, T, vocab]` of `tokens` `[B, T]` placed after the positions in `cache`
    /// (which is extended); without a cache the tokens start at position 0. `chunk`: the
    /// gated delta rule's chunk length for passes of more than one token (64 in
    /// transformers; any length gives the same result within float rounding).
    pub fn forward(&self, tokens: &Tensor, cache: Option<&mut Qwen35Cache>, chunk: i64) -> Tensor {
        self.logits_of(&self.hidden(tokens, cache, chunk))
    }

    /// Logits of final-norm hidden states (the LM head).
    pub fn logits_of(&self, h: &Tensor) -> Tensor {
        self.mm(h, self.lm_head.as_ref().unwrap_or(&self.embed))
    }

    /// Final-norm hidden states `[B, T, hidden]` (see [`Qwen35::forward`]).
    pub fn hidden(&self, tokens: &Tensor, mut cache: Option<&mut Qwen35Cache>, chunk: i64) -> Tensor {
        let c = &self.config;
        let (b, t) = tokens.size2().expect("tokens must be [B, T]");
        let start = cache.as_ref().map_or(0, |c| c.len);
        if let Some(cache) = cache.as_mut() {
            cache.layers.resize_with(self.layers.len(), || None);
        }
        let (cos, sin) = self.rope(start, t);
        let mut x = Tensor::embedding(&self.embed, tokens, -1, false, false);
        for (i, l) in self.layers.iter().enumerate() {
            x = self.block(l, &x, (b, t, start), (&cos, &sin), cache.as_mut().map(|c| &mut c.layers[i]), chunk);
        }
        if let Some(cache) = cache.as_mut() {
            cache.len += t;
        }
        norm(&x, &self.norm, c.rms_norm_eps)
    }

    /// One decoder layer on the residual stream `x` `[B, T, hidden]` at positions
    /// `start..start + T`: the mixer (gated attention or a GDN layer, continuing `slot`'s
    /// state where there is one) and the MLP, each after its norm.
    fn block(
        &self,
        l: &Layer,
        x: &Tensor,
        (b, t, start): (i64, i64, i64),
        (cos, sin): (&Tensor, &Tensor),
        slot: Option<&mut Option<(Tensor, Tensor)>>,
        chunk: i64,
    ) -> Tensor {
        let eps = self.config.rms_norm_eps;
        let h = norm(x, &l.input_norm, eps);
        let mixed = match &l.mixer {
            Mixer::Attention(a) => self.attention(a, &h, (b, t, start), (cos, sin), slot),
            Mixer::DeltaNet(d) => self.deltanet(d, &h, (b, t), slot, chunk),
        };
        let x = x + mixed;
        let h = norm(&x, &l.post_norm, eps);
        &x + self.lin(&(self.lin(&h, &l.gate).silu() * self.lin(&h, &l.up)), &l.down)
    }

    /// cos/sin `[T, rotary_dim]` of positions `start..start + t` (the half-rotation layout).
    fn rope(&self, start: i64, t: i64) -> (Tensor, Tensor) {
        let pos = Tensor::arange_start(start, start + t, (Kind::Int64, self.device()));
        let freqs = rope_angles(self.config.rope_theta, self.config.rotary_dim(), &pos);
        let freqs = Tensor::cat(&[&freqs, &freqs], -1);
        (freqs.cos(), freqs.sin())
    }

    /// Rotates the first `rotary_dim` of each head of `x` `[B, H, T, head_dim]`.
    fn rotate(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
        let (rd, hd) = (self.config.rotary_dim(), self.config.head_dim);
        Tensor::cat(&[rotate_half(&x.narrow(-1, 0, rd), cos, sin), x.narrow(-1, rd, hd - rd)], -1)
    }

    fn attention(
        &self,
        a: &Attention,
        h: &Tensor,
        (b, t, start): (i64, i64, i64),
        (cos, sin): (&Tensor, &Tensor),
        slot: Option<&mut Option<(Tensor, Tensor)>>,
    ) -> Tensor {
        let c = &self.config;
        let (nh, nkv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let qg = self.lin(h, &a.q).view([b, t, nh, 2 * hd]);
        let gate = qg.narrow(-1, hd, hd).reshape([b, t, nh * hd]);
        let q = norm(&qg.narrow(-1, 0, hd), &a.q_norm, c.rms_norm_eps).transpose(1, 2);
        let k = norm(&self.lin(h, &a.k).view([b, t, nkv, hd]), &a.k_norm, c.rms_norm_eps).transpose(1, 2);
        let mut v = self.lin(h, &a.v).view([b, t, nkv, hd]).transpose(1, 2);
        let q = self.rotate(&q, cos, sin);
        let mut k = self.rotate(&k, cos, sin);
        if let Some(slot) = slot {
            if let Some((pk, pv)) = slot.as_ref() {
                k = Tensor::cat(&[pk, &k], 2);
                v = Tensor::cat(&[pv, &v], 2);
            }
            *slot = Some((k.shallow_clone(), v.shallow_clone()));
        }
        let rep = nh / nkv;
        let repeat = |x: &Tensor| if rep > 1 { x.repeat_interleave_self_int(rep, 1, None) } else { x.shallow_clone() };
        let mask = (t > 1).then(|| {
            let q_pos = Tensor::arange_start(start, start + t, (Kind::Int64, self.device())).unsqueeze(1);
            Tensor::arange(start + t, (Kind::Int64, self.device())).unsqueeze(0).le_tensor(&q_pos)
        });
        let att = Tensor::scaled_dot_product_attention(&q, &repeat(&k), &repeat(&v), mask.as_ref(), 0.0, false, None, false);
        let att = att.transpose(1, 2).contiguous().view([b, t, nh * hd]);
        self.lin(&(att * gate.sigmoid()), &a.o)
    }

    fn deltanet(&self, d: &DeltaNet, h: &Tensor, (b, t): (i64, i64), slot: Option<&mut Option<(Tensor, Tensor)>>, chunk: i64) -> Tensor {
        let c = &self.config;
        let (hk, hv, dk, dv) = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim);
        let (kd, vd) = (hk * dk, hv * dv);
        let (conv_state, state) = match slot.as_ref().and_then(|s| s.as_ref()) {
            Some((conv, s)) => (Some(conv.shallow_clone()), Some(s.shallow_clone())),
            None => (None, None),
        };
        let (mixed, conv_state) = deltanet::causal_conv(&self.lin(h, &d.in_qkv).transpose(1, 2), &d.conv, conv_state.as_ref());
        let mixed = mixed.transpose(1, 2);
        let q = mixed.narrow(-1, 0, kd).reshape([b, t, hk, dk]);
        let k = mixed.narrow(-1, kd, kd).reshape([b, t, hk, dk]);
        let v = mixed.narrow(-1, 2 * kd, vd).reshape([b, t, hv, dv]);
        let beta = self.lin(h, &d.in_b).sigmoid();
        let g = -d.a_log.exp() * (self.lin(h, &d.in_a) + &d.dt_bias).softplus();
        let (out, state) = match &state {
            Some(s) if t == 1 => deltanet::recurrent(&q, &k, &v, &g, &beta, Some(s)),
            s => deltanet::chunked(&q, &k, &v, &g, &beta, s.as_ref(), chunk),
        };
        if let Some(slot) = slot {
            *slot = Some((conv_state, state));
        }
        // the gated RMSNorm: x̂ · w · SiLU(z), per value head
        let z = self.lin(h, &d.in_z).reshape([b, t, hv, dv]);
        let out = rms_norm(&out, &d.norm, c.rms_norm_eps) * z.silu();
        self.lin(&out.reshape([b, t, vd]), &d.out)
    }
}

impl Qwen35 {
    /// The module-name prefix of the decoder's layers (`model`, or `model.language_model`
    /// in a released checkpoint's layout).
    fn layer_prefix(&self) -> &'static str {
        if self.config.language_model {
            "model.language_model.layers"
        } else {
            "model.layers"
        }
    }
}

/// One layer's linear layers by their names under the layer (transformers' modules).
macro_rules! qwen35_linears {
    ($layer:expr, $($r:tt)*) => {{
        let l = $layer;
        let mut out = vec![];
        match $($r)* l.mixer {
            Mixer::Attention(a) => out.extend([
                ("self_attn.q_proj", $($r)* a.q),
                ("self_attn.k_proj", $($r)* a.k),
                ("self_attn.v_proj", $($r)* a.v),
                ("self_attn.o_proj", $($r)* a.o),
            ]),
            Mixer::DeltaNet(d) => out.extend([
                ("linear_attn.in_proj_qkv", $($r)* d.in_qkv),
                ("linear_attn.in_proj_z", $($r)* d.in_z),
                ("linear_attn.in_proj_b", $($r)* d.in_b),
                ("linear_attn.in_proj_a", $($r)* d.in_a),
                ("linear_attn.out_proj", $($r)* d.out),
            ]),
        }
        out.extend([("mlp.gate_proj", $($r)* l.gate), ("mlp.up_proj", $($r)* l.up), ("mlp.down_proj", $($r)* l.down)]);
        out
    }};
}

impl crate::model::lora::Adaptable for Qwen35 {
    fn linears(&self) -> Vec<(String, &Linear)> {
        let prefix = self.layer_prefix();
        let mut out = vec![];
        for (i, l) in self.layers.iter().enumerate() {
            out.extend(qwen35_linears!(l, &).into_iter().map(|(m, lin)| (format!("{prefix}.{i}.{m}"), lin)));
        }
        out
    }

    fn linears_mut(&mut self) -> Vec<(String, &mut Linear)> {
        let prefix = self.layer_prefix();
        let mut out = vec![];
        for (i, l) in self.layers.iter_mut().enumerate() {
            out.extend(qwen35_linears!(l, &mut).into_iter().map(|(m, lin)| (format!("{prefix}.{i}.{m}"), lin)));
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

    fn text_config() -> serde_json::Value {
        serde_json::json!({
            "model_type": "qwen3_5_text", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
        })
    }

    fn parse(v: &serde_json::Value) -> Result<Qwen35Config, NativeError> {
        Qwen35Config::from_hf_json(Path::new("config.json"), &v.to_string())
    }

    #[test]
    fn a_released_checkpoint_nests_its_text_config_and_the_layer_pattern_has_a_default() {
        let flat = parse(&text_config()).unwrap();
        assert_eq!(flat.full_attention, [false, false, false, true], "every fourth layer is full attention");
        assert_eq!(flat.rotary_dim(), 4);
        let nested =
            serde_json::json!({"model_type": "qwen3_5", "tie_word_embeddings": true, "text_config": text_config(), "vision_config": {}});
        let c = parse(&nested).unwrap();
        assert!(c.tie_word_embeddings, "the top-level flag of a nested config counts");
        assert!(c.language_model && !flat.language_model, "a nested config's weights are `model.language_model.*`");
        assert_eq!(c.to_hf_json(), nested, "the folder's own config.json is written back");
        assert_eq!(Qwen35Config { tie_word_embeddings: false, language_model: false, hf: flat.hf.clone(), ..c }, flat);
    }

    #[test]
    fn what_the_decoder_does_not_run_is_refused_by_field() {
        for (field, value, named) in [
            ("num_experts", serde_json::json!(64), "num_experts"),
            ("attention_bias", serde_json::json!(true), "attention_bias"),
            (
                "layer_types",
                serde_json::json!(["linear_attention", "sliding_attention", "full_attention", "full_attention"]),
                "layer_types",
            ),
            ("rope_parameters", serde_json::json!({"rope_type": "yarn", "rope_theta": 1e7}), "rope_type"),
        ] {
            let mut v = text_config();
            v[field] = value;
            let err = parse(&v).unwrap_err().to_string();
            assert!(err.contains(named), "{field}: {err}");
        }
        let err = parse(&serde_json::json!({"model_type": "qwen3_next"})).unwrap_err().to_string();
        assert!(err.contains("qwen3_next"), "{err}");
    }
}
