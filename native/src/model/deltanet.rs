//! The gated delta rule of Gated DeltaNet (Yang, Kautz and Hatamizadeh, 2024), the linear
//! attention of Qwen3.5's hybrid layers, in its two forms side by side: chunked (prefill and
//! training: a few matrix products per chunk) and recurrent (decoding: one state update per
//! token). Both start from and return the recurrent state `S` `[B, Hv, Dk, Dv]`, so a
//! sequence can be split anywhere (a shared prefix, then its continuations).
//!
//! Per token t and value head: S ← exp(g_t)·S; S ← S + β_t·k_t ⊗ (v_t − Sᵀk_t); o_t = Sᵀq_t,
//! with q and k L2-normalised and q scaled by 1/√Dk (transformers' `torch_*_gated_delta_rule`
//! with `use_qk_l2norm_in_kernel`). Float32 throughout.

use tch::{Kind, Tensor};

/// `x · rsqrt(Σx² + eps)` over the last dimension (the FLA library's L2 norm).
pub(crate) fn l2norm(x: &Tensor, eps: f64) -> Tensor {
    x * ((x * x).sum_dim_intlist(-1, true, Kind::Float) + eps).rsqrt()
}

/// The shared preparation of both forms: q and k repeated over the value heads they serve,
/// every input `[B, H, T, ..]` in float32, q and k normalised, q scaled.
fn prepare(q: &Tensor, k: &Tensor, v: &Tensor, g: &Tensor, beta: &Tensor) -> [Tensor; 5] {
    let (hk, hv) = (k.size()[2], v.size()[2]);
    let repeat = |x: &Tensor| if hv != hk { x.repeat_interleave_self_int(hv / hk, 2, None) } else { x.shallow_clone() };
    let heads_first = |x: Tensor| x.transpose(1, 2).to_kind(Kind::Float).contiguous();
    let q = l2norm(&heads_first(repeat(q)), 1e-6);
    let k = l2norm(&heads_first(repeat(k)), 1e-6);
    let scale = (q.size()[3] as f64).powf(-0.5);
    [q * scale, k, heads_first(v.shallow_clone()), heads_first(g.shallow_clone()), heads_first(beta.shallow_clone())]
}

/// The zero state of `B` sequences, `[B, Hv, Dk, Dv]`.
fn zero_state(q: &Tensor, v: &Tensor) -> Tensor {
    let (b, hv, dk, dv) = (q.size()[0], q.size()[1], q.size()[3], v.size()[3]);
    Tensor::zeros([b, hv, dk, dv], (Kind::Float, q.device()))
}

/// The recurrent form: q, k `[B, T, Hk, Dk]`, v `[B, T, Hv, Dv]`, g (log decay) and beta
/// `[B, T, Hv]`, `state` `[B, Hv, Dk, Dv]` (zero when `None`). Returns the output
/// `[B, T, Hv, Dv]` and the state after the last token.
pub fn recurrent(q: &Tensor, k: &Tensor, v: &Tensor, g: &Tensor, beta: &Tensor, state: Option<&Tensor>) -> (Tensor, Tensor) {
    let [q, k, v, g, beta] = prepare(q, k, v, g, beta);
    let mut s = state.map(|s| s.to_kind(Kind::Float)).unwrap_or_else(|| zero_state(&q, &v));
    let t = q.size()[2];
    let mut out = Vec::with_capacity(t as usize);
    for i in 0..t {
        let (q_t, k_t, v_t) = (q.select(2, i), k.select(2, i), v.select(2, i));
        s = s * g.select(2, i).exp().unsqueeze(-1).unsqueeze(-1);
        let kv = (&s * k_t.unsqueeze(-1)).sum_dim_intlist(-2, false, Kind::Float);
        let delta = (v_t - kv) * beta.select(2, i).unsqueeze(-1);
        s = s + k_t.unsqueeze(-1) * delta.unsqueeze(-2);
        out.push((&s * q_t.unsqueeze(-1)).sum_dim_intlist(-2, false, Kind::Float));
    }
    (Tensor::stack(&out, 2).transpose(1, 2).contiguous(), s)
}

/// The chunked form (same arguments and results as [`recurrent`]): within each chunk of
/// `chunk` tokens the delta rule's updates are one triangular solve (the UT transform),
/// across chunks the state carries over. Equal to the recurrent form within float rounding.
pub fn chunked(q: &Tensor, k: &Tensor, v: &Tensor, g: &Tensor, beta: &Tensor, state: Option<&Tensor>, chunk: i64) -> (Tensor, Tensor) {
    let [q, k, v, g, beta] = prepare(q, k, v, g, beta);
    let (b, h, t, dk) = (q.size()[0], q.size()[1], q.size()[2], q.size()[3]);
    let dv = v.size()[3];
    let pad = (chunk - t % chunk) % chunk;
    let n = (t + pad) / chunk;
    let pad_t = |x: &Tensor| if pad == 0 { x.shallow_clone() } else { x.constant_pad_nd([0, 0, 0, pad]) };
    let (q, k, v) = (pad_t(&q), pad_t(&k), pad_t(&v));
    let (beta, g) = if pad == 0 { (beta, g) } else { (beta.constant_pad_nd([0, pad]), g.constant_pad_nd([0, pad])) };
    let v_beta = &v * beta.unsqueeze(-1);
    let k_beta = &k * beta.unsqueeze(-1);
    let chunks = |x: &Tensor, d: i64| x.reshape([b, h, n, chunk, d]);
    let (q, k, k_beta, v_beta) = (chunks(&q, dk), chunks(&k, dk), chunks(&k_beta, dk), chunks(&v_beta, dv));
    let cum = g.reshape([b, h, n, chunk]).cumsum(3, Kind::Float);
    let upper = Tensor::ones([chunk, chunk], (Kind::Bool, q.device())).triu(1);
    // exp(cum_i − cum_j) for j ≤ i: the decay between two positions of a chunk
    let decay = (cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill(&upper, f64::NEG_INFINITY).exp();
    let system = k_beta.matmul(&k.transpose(-1, -2)) * &decay;
    let intra = q.matmul(&k.transpose(-1, -2)) * &decay;
    let decayed_k_beta = &k_beta * cum.exp().unsqueeze(-1);
    let new_values = system.linalg_solve_triangular(&v_beta, false, true, true);
    let k_cumdecay = system.linalg_solve_triangular(&decayed_k_beta, false, true, true);
    let mut s = state.map(|s| s.to_kind(Kind::Float)).unwrap_or_else(|| Tensor::zeros([b, h, dk, dv], (Kind::Float, q.device())));
    let q = q * cum.exp().unsqueeze(-1);
    let last = cum.narrow(3, chunk - 1, 1);
    let k = k * (&last - &cum).exp().unsqueeze(-1);
    let chunk_decay = last.exp().unsqueeze(-1);
    let mut out = Vec::with_capacity(n as usize);
    for i in 0..n {
        let v_new = new_values.select(2, i) - k_cumdecay.select(2, i).matmul(&s);
        out.push(q.select(2, i).matmul(&s) + intra.select(2, i).matmul(&v_new));
        s = s * chunk_decay.select(2, i) + k.select(2, i).transpose(-1, -2).matmul(&v_new);
    }
    let out = Tensor::stack(&out, 2).reshape([b, h, n * chunk, dv]).narrow(2, 0, t);
    (out.transpose(1, 2).contiguous(), s)
}

/// A depthwise causal convolution over `x` `[B, C, T]` with `weight` `[C, 1, K]`, continuing
/// from `state`, the K − 1 inputs before `x` `[B, C, K − 1]` (zeros at a sequence's start).
/// Returns the SiLU of the convolution `[B, C, T]` and the new state.
pub fn causal_conv(x: &Tensor, weight: &Tensor, state: Option<&Tensor>) -> (Tensor, Tensor) {
    let (b, c, _) = x.size3().expect("x is [B, C, T]");
    let k = weight.size()[2];
    let state = state.map(Tensor::shallow_clone).unwrap_or_else(|| Tensor::zeros([b, c, k - 1], (x.kind(), x.device())));
    let full = Tensor::cat(&[state, x.shallow_clone()], 2);
    let out = full.conv1d(weight, None::<Tensor>, [1], [0], [1], c);
    let len = full.size()[2];
    (out.silu(), full.narrow(2, len - (k - 1), k - 1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    fn inputs(t: i64, seed: i64) -> [Tensor; 5] {
        tch::manual_seed(seed);
        let opts = (Kind::Float, Device::Cpu);
        let (b, hk, hv, dk, dv) = (2, 2, 4, 8, 6);
        [
            Tensor::randn([b, t, hk, dk], opts),
            Tensor::randn([b, t, hk, dk], opts),
            Tensor::randn([b, t, hv, dv], opts),
            -Tensor::rand([b, t, hv], opts) * 0.5,
            Tensor::rand([b, t, hv], opts),
        ]
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        (a - b).abs().max().double_value(&[])
    }

    #[test]
    fn chunked_and_recurrent_forms_agree_across_chunks_and_padding() {
        let [q, k, v, g, beta] = inputs(11, 3);
        let (want, want_s) = recurrent(&q, &k, &v, &g, &beta, None);
        for chunk in [1, 4, 5, 64] {
            let (out, s) = chunked(&q, &k, &v, &g, &beta, None, chunk);
            assert!(max_diff(&out, &want) < 1e-4, "chunk {chunk}: output differs by {}", max_diff(&out, &want));
            assert!(max_diff(&s, &want_s) < 1e-4, "chunk {chunk}: state differs by {}", max_diff(&s, &want_s));
        }
    }

    #[test]
    fn a_sequence_split_anywhere_continues_from_its_state() {
        let [q, k, v, g, beta] = inputs(9, 5);
        let (whole, whole_s) = chunked(&q, &k, &v, &g, &beta, None, 4);
        let part = |x: &Tensor, from: i64, len: i64| x.narrow(1, from, len);
        let (a, s) = chunked(&part(&q, 0, 6), &part(&k, 0, 6), &part(&v, 0, 6), &part(&g, 0, 6), &part(&beta, 0, 6), None, 4);
        let (b, s) = recurrent(&part(&q, 6, 3), &part(&k, 6, 3), &part(&v, 6, 3), &part(&g, 6, 3), &part(&beta, 6, 3), Some(&s));
        assert!(max_diff(&Tensor::cat(&[a, b], 1), &whole) < 1e-4);
        assert!(max_diff(&s, &whole_s) < 1e-4);
    }

    #[test]
    fn the_convolution_continues_from_its_state() {
        tch::manual_seed(1);
        let x = Tensor::randn([1, 3, 7], (Kind::Float, Device::Cpu));
        let w = Tensor::randn([3, 1, 4], (Kind::Float, Device::Cpu));
        let (whole, _) = causal_conv(&x, &w, None);
        let (a, s) = causal_conv(&x.narrow(2, 0, 5), &w, None);
        let (b, _) = causal_conv(&x.narrow(2, 5, 2), &w, Some(&s));
        assert!(max_diff(&Tensor::cat(&[a, b], 2), &whole) < 1e-6);
        // causal: the first output sees only the first input
        let y = x.copy();
        let _ = y.narrow(2, 3, 4).fill_(9.0);
        assert!(max_diff(&causal_conv(&y, &w, None).0.narrow(2, 0, 3), &whole.narrow(2, 0, 3)) < 1e-6);
    }
}
