//! The rollout engine's forward pass on the CPU with its own kernels ([`crate::infer::kernels`]):
//! the `int4` weight format (matrices 4-bit, the LM head 8-bit, times 8-bit activations)
//! and `f32` on the CPU (float32 products with the learner's weights as they are). Norms,
//! RoPE, attention and the residual stream are float32 loops; keys and values go straight
//! into the engine's per-sequence caches ([`SeqKv`]).
//!
//! Each row of a pass (one token of one sequence) is computed on its own: only the rows
//! that carry a real token are computed (padding costs nothing), a position's keys and
//! values come out the same from a prefill chunk as from a decode step, and a row's
//! result is bitwise independent of the other rows and of the thread count.

use tch::{Kind, Tensor};

use crate::infer::kernels::{self, dot, Bits, FMatrix, QActs, QMatrix, Shared};
use crate::infer::kv::Segment;
use crate::infer::packed::WeightFormat;
use crate::infer::threads::Pool;
use crate::model::Llama;
use crate::NativeError;

/// One weight matrix in the engine's format.
enum Matrix {
    Quant(QMatrix),
    Float(FMatrix),
}

impl Matrix {
    /// `y = x · Wᵀ` for `rows` rows of `x`; quantised matrices quantise `x` into `qa` first.
    fn apply(&self, x: &[f32], rows: usize, qa: &mut QActs, y: &mut [f32], pool: Option<&Pool>) {
        match self {
            Matrix::Quant(w) => {
                qa.quantize(x, rows, w.cols, pool);
                kernels::matmul(w, qa, y, pool);
            }
            Matrix::Float(w) => kernels::fmatmul(w, x, rows, y, pool),
        }
    }

    fn rows(&self) -> usize {
        match self {
            Matrix::Quant(w) => w.rows,
            Matrix::Float(w) => w.rows,
        }
    }
}

struct CpuLayer {
    input_norm: Vec<f32>,
    qkv: Matrix,
    qkv_bias: Option<Vec<f32>>,
    /// Per-head RMSNorm weights of the queries and the keys (qwen3).
    qk_norm: Option<(Vec<f32>, Vec<f32>)>,
    o: Matrix,
    post_norm: Vec<f32>,
    gate_up: Matrix,
    down: Matrix,
}

/// A model's weights for the CPU kernels.
pub struct CpuWeights {
    layers: Vec<CpuLayer>,
    norm: Vec<f32>,
    head: Matrix,
    /// float32 `[vocab, hidden]`, the model's own (shared, not copied)
    embed: Tensor,
    inv_freq: Vec<f32>,
    pool: Option<Pool>,
    /// The buffers of a pass, kept between passes: a prefill pass of several sequences
    /// needs tens of megabytes, and memory fresh from the OS costs a page clear per 4 KiB
    /// (a tenth of a prefill's time when every pass allocated anew).
    scratch: std::sync::Mutex<Scratch>,
}

#[derive(Default)]
struct Scratch {
    x: Vec<f32>,
    table: Vec<f32>,
    h: Vec<f32>,
    qkv: Vec<f32>,
    att: Vec<f32>,
    tmp: Vec<f32>,
    gu: Vec<f32>,
    act: Vec<f32>,
    logits: Vec<f32>,
    qa: QActs,
}

/// The first `len` values of `v`, grown if needed (contents unspecified: every use writes
/// them all before reading).
fn buf(v: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if v.len() < len {
        v.resize(len, 0.0);
    }
    &mut v[..len]
}

fn floats(t: &Tensor, name: &str) -> Result<Vec<f32>, NativeError> {
    let t = t.to_device(tch::Device::Cpu).to_kind(Kind::Float).contiguous().view([-1]);
    Vec::<f32>::try_from(&t)
        .map_err(|e| NativeError::Config { field: "rollout_weights".into(), detail: format!("cannot read `{name}`: {e}") })
}

/// The rows of `parts` stacked, quantised to `bits` (`None`: float32 as they are).
fn matrix(parts: &[&Tensor], bits: Option<Bits>, name: &str) -> Result<Matrix, NativeError> {
    let w = Tensor::cat(parts, 0);
    let (rows, cols) = w.size2()?;
    let (rows, cols) = (rows as usize, cols as usize);
    let v = floats(&w, name)?;
    Ok(match bits {
        Some(bits) => Matrix::Quant(QMatrix::quantize(&v, rows, cols, bits)),
        None => Matrix::Float(FMatrix::new(v, rows, cols)),
    })
}

impl CpuWeights {
    /// `model`'s matrices in `format` (`int4` quantises them, `f32` copies them); products
    /// run on `threads` threads.
    pub fn new(model: &Llama, format: WeightFormat, threads: usize) -> Result<CpuWeights, NativeError> {
        if model.device() != tch::Device::Cpu {
            return Err(NativeError::Config {
                field: "rollout_weights".into(),
                detail: format!("the CPU kernels do not run `{}` on a GPU; there use f32 or bf16", format.name()),
            });
        }
        let (bits, head_bits) = match format {
            WeightFormat::Int4 => (Some(Bits::Four), Some(Bits::Eight)),
            WeightFormat::F32 => (None, None),
            WeightFormat::Bf16 => {
                return Err(NativeError::Config {
                    field: "rollout_weights".into(),
                    detail: "bf16 runs on libtorch, not on the CPU kernels".into(),
                })
            }
        };
        let _g = tch::no_grad_guard();
        let c = &model.config;
        let mut layers = Vec::with_capacity(model.layers.len());
        for (i, l) in model.layers.iter().enumerate() {
            let name = |m: &str| format!("model.layers.{i}.{m}");
            let qkv_bias = match (&l.q_bias, &l.k_bias, &l.v_bias) {
                (Some(q), Some(k), Some(v)) => Some(floats(&Tensor::cat(&[q, k, v], 0), &name("self_attn.qkv_bias"))?),
                _ => None,
            };
            layers.push(CpuLayer {
                input_norm: floats(&l.input_norm, &name("input_layernorm"))?,
                qkv: matrix(&[&l.q.weight, &l.k.weight, &l.v.weight], bits, &name("self_attn.qkv"))?,
                qkv_bias,
                qk_norm: match (&l.q_norm, &l.k_norm) {
                    (Some(q), Some(k)) => Some((floats(q, &name("self_attn.q_norm"))?, floats(k, &name("self_attn.k_norm"))?)),
                    _ => None,
                },
                o: matrix(&[&l.o.weight], bits, &name("self_attn.o_proj"))?,
                post_norm: floats(&l.post_norm, &name("post_attention_layernorm"))?,
                gate_up: matrix(&[&l.gate.weight, &l.up.weight], bits, &name("mlp.gate_up"))?,
                down: matrix(&[&l.down.weight], bits, &name("mlp.down_proj"))?,
            });
        }
        // (int4) 4-bit logits over a 49k vocabulary cost more quality than the head's share of
        // the time is worth: the head is 8-bit
        let head = matrix(&[model.lm_head.as_ref().unwrap_or(&model.embed)], head_bits, "lm_head")?;
        let hd = c.head_dim() as usize;
        let theta = c.rope_theta as f32;
        let inv_freq = (0..hd / 2).map(|i| 1.0 / theta.powf((2 * i) as f32 / hd as f32)).collect();
        let embed = model.embed.to_kind(Kind::Float).contiguous();
        Ok(CpuWeights {
            layers,
            norm: floats(&model.norm, "model.norm")?,
            head,
            embed,
            inv_freq,
            pool: Pool::new(threads),
            scratch: Default::default(),
        })
    }

    /// Logits `[rows, vocab]` of final-norm hidden states `[rows, hidden]`.
    pub fn logits(&self, h: &Tensor) -> Tensor {
        let (rows, _) = h.size2().expect("hidden states [rows, hidden]");
        let x = Vec::<f32>::try_from(&h.to_kind(Kind::Float).contiguous().view([-1])).expect("float32 hidden states");
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let Scratch { qa, logits, .. } = &mut *scratch;
        let y = buf(logits, rows as usize * self.head.rows());
        self.head.apply(&x, rows as usize, qa, y, self.pool.as_ref());
        Tensor::from_slice(y).view([rows, self.head.rows() as i64])
    }

    fn embed_row(&self, token: u32, out: &mut [f32]) {
        let hidden = out.len();
        // SAFETY: a contiguous float32 CPU tensor [vocab, hidden]; `token` is checked against vocab.
        let vocab = self.embed.size()[0] as usize;
        assert!((token as usize) < vocab, "token {token} is beyond the vocabulary ({vocab})");
        let src = unsafe { std::slice::from_raw_parts((self.embed.data_ptr() as *const f32).add(token as usize * hidden), hidden) };
        out.copy_from_slice(src);
    }
}

/// One computed row of a pass: pass row `row` is position `pos` of segment `seg`.
struct Row {
    seg: usize,
    row: usize,
    pos: usize,
}

fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    for (xr, or) in x.chunks_exact(w.len()).zip(out.chunks_exact_mut(w.len())) {
        let var = dot(xr, xr) / w.len() as f32;
        let r = 1.0 / (var + eps).sqrt();
        for ((o, v), g) in or.iter_mut().zip(xr).zip(w) {
            *o = v * r * g;
        }
    }
}

/// [`rms_norm`] of one row in place (a head's queries or keys).
fn rms_norm_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    let var = dot(x, x) / w.len() as f32;
    let r = 1.0 / (var + eps).sqrt();
    for (v, g) in x.iter_mut().zip(w) {
        *v *= r * g;
    }
}

/// `f(r, row)` for every row `r` of `out` (`[rows, width]`), rows split among `pool`'s
/// threads.
fn each_row(out: &mut [f32], width: usize, pool: Option<&Pool>, f: impl Fn(usize, &mut [f32]) + Sync) {
    let rows = out.len() / width;
    let p = Shared::new(out.as_mut_ptr());
    kernels::split(rows, 1, pool.filter(|_| out.len() >= 4096), |range| {
        for r in range {
            // SAFETY: row r is written by this part only.
            f(r, unsafe { std::slice::from_raw_parts_mut(p.ptr().add(r * width), width) });
        }
    });
}

/// `(cos, sin)` of every rotation frequency at `pos`: one row of a pass's RoPE table,
/// computed once and used by every head of every layer.
fn rope_row(pos: usize, inv_freq: &[f32], out: &mut [f32]) {
    let (cos, sin) = out.split_at_mut(inv_freq.len());
    for (i, f) in inv_freq.iter().enumerate() {
        (sin[i], cos[i]) = (pos as f32 * f).sin_cos();
    }
}

/// Rotates one head `x` by a [`rope_row`] (HF half rotation, or ggml's adjacent pairs).
fn rope(x: &mut [f32], table: &[f32], interleaved: bool) {
    let half = table.len() / 2;
    let (cos, sin) = table.split_at(half);
    for i in 0..half {
        let (a, b) = if interleaved { (2 * i, 2 * i + 1) } else { (i, i + half) };
        let (x0, x1) = (x[a], x[b]);
        x[a] = x0 * cos[i] - x1 * sin[i];
        x[b] = x1 * cos[i] + x0 * sin[i];
    }
}

/// Final-norm hidden states `[ids.len(), hidden]` of one engine pass (see
/// [`EngineWeights::forward`](crate::infer::weights::EngineWeights::forward)); rows no segment's real tokens cover stay zero.
pub fn forward(model: &Llama, w: &CpuWeights, ids: &[u32], segments: &mut [Segment<'_>]) -> Tensor {
    let c = &model.config;
    let (hidden, hd) = (c.hidden_size as usize, c.head_dim() as usize);
    let (heads, kv_heads, inter) = (c.num_attention_heads as usize, c.num_key_value_heads as usize, c.intermediate_size as usize);
    let group = heads / kv_heads;
    let qkv_dim = (heads + 2 * kv_heads) * hd;
    let eps = c.rms_norm_eps as f32;
    let pool = w.pool.as_ref();

    let mut rows = vec![];
    for (si, s) in segments.iter_mut().enumerate() {
        s.cache.reserve(s.cache.len() + s.rows);
        for r in 0..s.attend {
            rows.push(Row { seg: si, row: s.first + r, pos: s.cache.len() + r });
        }
    }
    let n = rows.len();
    let mut scratch = w.scratch.lock().unwrap_or_else(|e| e.into_inner());
    let Scratch { x, table, h, qkv, att, tmp, gu, act, qa, .. } = &mut *scratch;
    let x = buf(x, n * hidden);
    for (r, row) in rows.iter().enumerate() {
        w.embed_row(ids[row.row], &mut x[r * hidden..(r + 1) * hidden]);
    }
    let table = buf(table, n * hd);
    let inv_freq = &w.inv_freq;
    each_row(table, hd, pool, |r, t| rope_row(rows[r].pos, inv_freq, t));
    let (h, qkv, att) = (buf(h, n * hidden), buf(qkv, n * qkv_dim), buf(att, n * heads * hd));
    let (tmp, gu, act) = (buf(tmp, n * hidden), buf(gu, n * 2 * inter), buf(act, n * inter));
    let scale = 1.0 / (hd as f32).sqrt();
    for (li, l) in w.layers.iter().enumerate() {
        each_row(h, hidden, pool, |r, out| rms_norm(&x[r * hidden..(r + 1) * hidden], &l.input_norm, eps, out));
        l.qkv.apply(h, n, qa, qkv, pool);
        // bias, rotation, and this position's keys and values into its sequence's cache
        let caches: Vec<(Shared<f32>, Shared<f32>, usize)> = segments
            .iter_mut()
            .map(|s| {
                let (k, v, cap) = s.cache.layer(li);
                (Shared::new(k.as_mut_ptr()), Shared::new(v.as_mut_ptr()), cap)
            })
            .collect();
        let (rows_ref, caches_ref, table_ref) = (&rows, &caches, &*table);
        each_row(qkv, qkv_dim, pool, |r, v| {
            let row = &rows_ref[r];
            if let Some(b) = &l.qkv_bias {
                v.iter_mut().zip(b).for_each(|(a, b)| *a += b);
            }
            let t = &table_ref[r * hd..(r + 1) * hd];
            for (i, head) in v[..(heads + kv_heads) * hd].chunks_exact_mut(hd).enumerate() {
                if let Some((qn, kn)) = &l.qk_norm {
                    rms_norm_in_place(head, if i < heads { qn } else { kn }, eps);
                }
                rope(head, t, c.rope_interleaved);
            }
            let (k, v) = v[heads * hd..].split_at(kv_heads * hd);
            let (kb, vb, cap) = caches_ref[row.seg];
            for g in 0..kv_heads {
                let at = (g * cap + row.pos) * hd;
                // SAFETY: position row.pos of each kv head is this row's alone; the buffers
                // hold cap positions per head (reserved above).
                unsafe {
                    std::ptr::copy_nonoverlapping(k[g * hd..].as_ptr(), kb.ptr().add(at), hd);
                    std::ptr::copy_nonoverlapping(v[g * hd..].as_ptr(), vb.ptr().add(at), hd);
                }
            }
        });
        // the caches are read-only from here on in this layer
        let (qkv_ref, caches) = (&*qkv, &caches);
        let att_out = Shared::new(att.as_mut_ptr());
        kernels::split(n, 1, pool, move |range| {
            let mut scores = vec![];
            for r in range {
                let row = &rows_ref[r];
                let (kb, vb, cap) = caches[row.seg];
                let len = row.pos + 1;
                scores.resize(len, 0f32);
                for head in 0..heads {
                    let q = &qkv_ref[r * qkv_dim + head * hd..r * qkv_dim + (head + 1) * hd];
                    let g = head / group;
                    // SAFETY: positions 0..len of kv head g are written (this layer) and only read here.
                    let keys = unsafe { std::slice::from_raw_parts(kb.ptr().add(g * cap * hd), len * hd) };
                    let values = unsafe { std::slice::from_raw_parts(vb.ptr().add(g * cap * hd), len * hd) };
                    // SAFETY: row r's output is written by this part only.
                    let out = unsafe { std::slice::from_raw_parts_mut(att_out.ptr().add(r * heads * hd + head * hd), hd) };
                    kernels::attend(q, keys, values, scale, &mut scores, out);
                }
            }
        });
        l.o.apply(att, n, qa, tmp, pool);
        x.iter_mut().zip(&*tmp).for_each(|(a, b)| *a += b);
        each_row(h, hidden, pool, |r, out| rms_norm(&x[r * hidden..(r + 1) * hidden], &l.post_norm, eps, out));
        l.gate_up.apply(h, n, qa, gu, pool);
        each_row(act, inter, pool, |r, out| {
            let (gate, up) = gu[r * 2 * inter..(r + 1) * 2 * inter].split_at(inter);
            for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
                *o = g / (1.0 + (-g).exp()) * u;
            }
        });
        l.down.apply(act, n, qa, tmp, pool);
        x.iter_mut().zip(&*tmp).for_each(|(a, b)| *a += b);
    }
    for s in segments.iter_mut() {
        s.cache.advance(s.attend);
    }
    rms_norm(x, &w.norm, eps, h);
    let mut out = vec![0f32; ids.len() * hidden];
    for (r, row) in rows.iter().enumerate() {
        out[row.row * hidden..(row.row + 1) * hidden].copy_from_slice(&h[r * hidden..(r + 1) * hidden]);
    }
    Tensor::from_slice(&out).view([ids.len() as i64, hidden as i64])
}
