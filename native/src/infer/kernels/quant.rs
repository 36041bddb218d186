//! Quantised matrix products, in the manner of llama.cpp: 4-bit (or 8-bit) weights in
//! groups of 32 times 8-bit activations, exact integer dot products per group, one float
//! scale per group.
//!
//! **Formats.** A [`QMatrix`] holds blocks of 32 weights `w ≈ d·u + m`, `u` unsigned:
//! 4-bit `u ∈ 0..=15` with `d = (max − min)/15, m = min` (GGUF's Q4_1), or 8-bit
//! `u ∈ 1..=255` with `d = amax/127, m = −128·d` (symmetric, like Q8_0). Activations
//! ([`QActs`]) are 8-bit per block, `x ≈ dx·q`, `q ∈ −127..=127` (Q8_1). One block's
//! product is `Σ w·x ≈ (d·dx)·Σ u·q + m·(dx·Σ q)`, so both formats share one kernel.
//!
//! **Layout.** Weights are stored in panels of 16 output rows, as llama.cpp's and oneDNN's
//! repacked GEMM kernels store them: in a panel's block, each four consecutive columns of
//! the 16 rows are 64 bytes, four bytes per row (the "VNNI layout"). One AVX-512 VNNI
//! instruction (`vpdpbusd`) then multiplies four columns of 16 outputs by one input's four
//! activations (broadcast), and the 16 outputs' integer sums stay in the register for a
//! whole block: per block and input row it is 8 such instructions and one float update,
//! against one float update per 64 products in a row-by-row layout. The same 512 bytes are
//! the weight tile of an AMX product (`tdpbsud`: 16 input rows × 32 columns × 16 outputs
//! in one instruction), which prefill passes use where the CPU has AMX. A 4-bit panel block
//! is 256 bytes: byte `i` holds value `i` in its low nibble and value `256 + i` in its high
//! nibble. Activations are plain rows.
//!
//! **Numerics do not depend on batch composition, thread count or path.** Every output
//! `y[a, o]` is `acc = 0; for each block: acc = fma(Σ u·q, d·dx, acc); acc = fma(m, dx·Σq,
//! acc)`, in block order, with the integer sums exact (at most 32·255·127 in size) and each
//! float operation rounded once. AMX, AVX-512, AVX2 and the portable loop compute exactly
//! that, so the engine's results are bitwise the same whatever else it decodes, however its
//! passes are split among threads, and on whichever of these CPUs it runs.

use super::{split, Shared};
use crate::infer::threads::Pool;

/// Values per quantisation block.
pub const BLOCK: usize = 32;
/// Output rows per stored panel.
const PANEL: usize = 16;
/// A panel block's values: 16 outputs × 32 columns, in 8 groups of 64 bytes.
const PANEL_BLOCK: usize = PANEL * BLOCK;

/// Weight bits of a [`QMatrix`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bits {
    Four,
    Eight,
}

/// Position, in a panel block's values, of output `o` (0..16), column `e` (0..32).
#[inline]
fn slot(o: usize, e: usize) -> usize {
    (e / 4) * 64 + o * 4 + e % 4
}

/// A quantised weight matrix `[rows, cols]` (one row per output feature); `rows` padded
/// with zero weights to whole panels, `cols` to whole blocks.
pub struct QMatrix {
    pub rows: usize,
    pub cols: usize,
    pub bits: Bits,
    blocks: usize,
    /// per panel and block: 256 (4-bit) or 512 (8-bit) bytes
    q: Vec<u8>,
    /// per panel and block, the 16 outputs': scale and offset (8-bit: −128 · scale)
    d: Vec<f32>,
    m: Vec<f32>,
}

impl QMatrix {
    /// Quantises `w` (`[rows, cols]`, row-major float32).
    pub fn quantize(w: &[f32], rows: usize, cols: usize, bits: Bits) -> QMatrix {
        assert_eq!(w.len(), rows * cols, "matrix data does not match its shape");
        let blocks = cols.div_ceil(BLOCK);
        let panels = rows.div_ceil(PANEL);
        let mut u = vec![0u8; panels * blocks * PANEL_BLOCK];
        let mut d = vec![0f32; panels * blocks * PANEL];
        let mut m = vec![0f32; panels * blocks * PANEL];
        for r in 0..rows {
            let (p, o) = (r / PANEL, r % PANEL);
            let row = &w[r * cols..(r + 1) * cols];
            for b in 0..blocks {
                let vals = &row[b * BLOCK..((b + 1) * BLOCK).min(cols)];
                let (scale, offset) = match bits {
                    Bits::Four => {
                        // a short last block is padded with zeros, which it must represent
                        let pad = if vals.len() < BLOCK { 0.0 } else { f32::NAN };
                        let lo = vals.iter().copied().fold(pad, f32::min);
                        let hi = vals.iter().copied().fold(pad, f32::max);
                        ((hi - lo) / 15.0, lo)
                    }
                    Bits::Eight => {
                        let amax = vals.iter().fold(0f32, |a, v| a.max(v.abs()));
                        let scale = amax / 127.0;
                        (scale, -128.0 * scale)
                    }
                };
                let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
                let at = (p * blocks + b) * PANEL_BLOCK;
                for e in 0..BLOCK {
                    let v = vals.get(e).copied().unwrap_or(0.0);
                    u[at + slot(o, e)] = match bits {
                        Bits::Four => super::round(((v - offset) * inv).clamp(0.0, 15.0)) as u8,
                        Bits::Eight => (super::round((v * inv).clamp(-127.0, 127.0)) as i32 + 128) as u8,
                    };
                }
                d[(p * blocks + b) * PANEL + o] = scale;
                m[(p * blocks + b) * PANEL + o] = offset;
            }
        }
        let q = match bits {
            Bits::Four => {
                u.chunks_exact(PANEL_BLOCK).flat_map(|v| (0..PANEL_BLOCK / 2).map(move |i| v[i] | (v[i + PANEL_BLOCK / 2] << 4))).collect()
            }
            Bits::Eight => u,
        };
        QMatrix { rows, cols, bits, blocks, q, d, m }
    }

    /// The weights as float32 `[rows, cols]`, as the kernels see them.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut w = vec![0f32; self.rows * self.cols];
        for r in 0..self.rows {
            for c in 0..self.cols {
                let (p, o, b) = (r / PANEL, r % PANEL, c / BLOCK);
                let pb = p * self.blocks + b;
                let u = self.value(pb, slot(o, c % BLOCK));
                w[r * self.cols + c] = self.d[pb * PANEL + o] * u as f32 + self.m[pb * PANEL + o];
            }
        }
        w
    }

    /// Value `j` (0..512) of panel block `pb`.
    #[inline]
    fn value(&self, pb: usize, j: usize) -> u8 {
        match self.bits {
            Bits::Four => {
                let byte = self.q[pb * PANEL_BLOCK / 2 + j % (PANEL_BLOCK / 2)];
                if j < PANEL_BLOCK / 2 {
                    byte & 0x0F
                } else {
                    byte >> 4
                }
            }
            Bits::Eight => self.q[pb * PANEL_BLOCK + j],
        }
    }

    fn panels(&self) -> usize {
        self.rows.div_ceil(PANEL)
    }
}

/// Activations `[rows, cols]` quantised for a product with a [`QMatrix`] of `cols` columns.
#[derive(Default)]
pub struct QActs {
    pub rows: usize,
    blocks: usize,
    /// row-major, `blocks · 32` bytes per row (a short last block padded with zeros)
    q: Vec<i8>,
    /// per row and block: dx, dx·Σq (what the weights' offset multiplies) and Σq
    dx: Vec<f32>,
    sx: Vec<f32>,
    qs: Vec<i32>,
}

impl QActs {
    /// Quantises `x` (`[rows, cols]`, row-major) into this buffer, reusing its memory; rows
    /// are split among `pool`'s threads (each row is quantised on its own).
    pub fn quantize(&mut self, x: &[f32], rows: usize, cols: usize, pool: Option<&Pool>) {
        assert_eq!(x.len(), rows * cols, "activations do not match their shape");
        let blocks = cols.div_ceil(BLOCK);
        self.rows = rows;
        self.blocks = blocks;
        self.q.clear();
        self.q.resize(rows * blocks * BLOCK, 0);
        for v in [&mut self.dx, &mut self.sx] {
            v.clear();
            v.resize(rows * blocks, 0.0);
        }
        self.qs.clear();
        self.qs.resize(rows * blocks, 0);
        let (q, dx, sx, qs) = (
            Shared::new(self.q.as_mut_ptr()),
            Shared::new(self.dx.as_mut_ptr()),
            Shared::new(self.sx.as_mut_ptr()),
            Shared::new(self.qs.as_mut_ptr()),
        );
        // a few rows are not worth a hand-off
        split(rows, 1, pool.filter(|_| rows * cols >= 4096), |range| {
            for r in range {
                // SAFETY: row r's slices are written by this part only.
                let row = unsafe {
                    Row {
                        q: std::slice::from_raw_parts_mut(q.ptr().add(r * blocks * BLOCK), blocks * BLOCK),
                        dx: std::slice::from_raw_parts_mut(dx.ptr().add(r * blocks), blocks),
                        sx: std::slice::from_raw_parts_mut(sx.ptr().add(r * blocks), blocks),
                        qs: std::slice::from_raw_parts_mut(qs.ptr().add(r * blocks), blocks),
                    }
                };
                quantize_row(&x[r * cols..(r + 1) * cols], row);
            }
        });
    }
}

/// One row of [`QActs`] being written.
struct Row<'a> {
    q: &'a mut [i8],
    dx: &'a mut [f32],
    sx: &'a mut [f32],
    qs: &'a mut [i32],
}

/// One row of activations: per block of 32 values, 8-bit values, scale, scaled sum and sum.
/// Whole block pairs take the AVX-512 or AVX2 path where the CPU has it, with the same
/// operations value by value, so every path gives the same bytes.
fn quantize_row(row: &[f32], out: Row) {
    #[cfg(target_arch = "x86_64")]
    if super::vnni() || super::avx2() {
        let whole = row.len() / (2 * BLOCK);
        for p in 0..whole {
            let b = 2 * p;
            // SAFETY: pair p's 64 values, 64 bytes and two blocks' scales are in range.
            unsafe {
                let (x, q) = (row.as_ptr().add(b * BLOCK), out.q.as_mut_ptr().add(b * BLOCK));
                let (dx, sx, qs) = (&mut out.dx[b..b + 2], &mut out.sx[b..b + 2], &mut out.qs[b..b + 2]);
                if super::vnni() {
                    avx512::quantize_pair(x, q, dx, sx, qs)
                } else {
                    avx2::quantize_pair(x, q, dx, sx, qs)
                }
            };
        }
        quantize_blocks(row, out, 2 * whole);
        return;
    }
    quantize_blocks(row, out, 0);
}

/// [`quantize_row`] from block `first` on, one value at a time.
fn quantize_blocks(row: &[f32], out: Row, first: usize) {
    let cols = row.len();
    for b in first..out.dx.len() {
        let vals = &row[b * BLOCK..((b + 1) * BLOCK).min(cols)];
        let amax = vals.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for (e, v) in vals.iter().enumerate() {
            let v = super::round((v * inv).clamp(-127.0, 127.0)) as i8;
            out.q[b * BLOCK + e] = v;
            sum += v as i32;
        }
        out.dx[b] = d;
        out.sx[b] = d * sum as f32;
        out.qs[b] = sum;
    }
}

/// `y[a, o] = Σ_c x[a, c] · w[o, c]` for every input row `a` and output row `o`:
/// `y` is `[x.rows, w.rows]`, row-major. Panels of output rows are split among `pool`'s
/// threads.
pub fn matmul(w: &QMatrix, x: &QActs, y: &mut [f32], pool: Option<&Pool>) {
    assert_eq!(w.blocks, x.blocks, "activations were quantised for another column count");
    assert_eq!(y.len(), x.rows * w.rows, "output does not match the product's shape");
    let out = Shared::new(y.as_mut_ptr());
    let run = move |p0: usize, p1: usize| {
        // SAFETY: every (a, o) with o in panels p0..p1 is written by this call only.
        #[cfg(target_arch = "x86_64")]
        if super::amx() && x.rows >= PANEL {
            unsafe { amx::rows(w, x, p0, p1, out.ptr()) };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if super::vnni() {
            unsafe { avx512::rows(w, x, 0, p0, p1, out.ptr()) };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if super::avx2() {
            unsafe { avx2::rows(w, x, p0, p1, out.ptr()) };
            return;
        }
        unsafe { portable_rows(w, x, p0, p1, out.ptr()) };
    };
    let pool = pool.filter(|_| w.rows >= 64);
    split(w.panels(), 1, pool, |r| run(r.start, r.end));
}

/// The tiles of the SIMD kernels, as `(first input, inputs, panel)`: inputs `a0..rows` in
/// groups of 32 that stay in the L1/L2 cache while panels `p0..p1` go past them, each group
/// cut into tiles of at most `most` inputs.
fn tiles(a0: usize, rows: usize, p0: usize, p1: usize, most: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    const INPUTS: usize = 32;
    (a0..rows).step_by(INPUTS).flat_map(move |g| {
        let end = rows.min(g + INPUTS);
        (p0..p1).flat_map(move |p| (g..end).step_by(most).map(move |a| (a, most.min(end - a), p)))
    })
}

/// The kernel without SIMD intrinsics: the defining loop, one output at a time.
unsafe fn portable_rows(w: &QMatrix, x: &QActs, p0: usize, p1: usize, y: *mut f32) {
    let stride = x.blocks * BLOCK;
    for r in p0 * PANEL..(p1 * PANEL).min(w.rows) {
        let (p, o) = (r / PANEL, r % PANEL);
        for a in 0..x.rows {
            let mut acc = 0f32;
            for b in 0..w.blocks {
                let pb = p * w.blocks + b;
                let xq = &x.q[a * stride + b * BLOCK..][..BLOCK];
                let s: i32 = (0..BLOCK).map(|e| w.value(pb, slot(o, e)) as i32 * xq[e] as i32).sum();
                let xb = a * x.blocks + b;
                acc = (s as f32).mul_add(w.d[pb * PANEL + o] * x.dx[xb], acc);
                acc = w.m[pb * PANEL + o].mul_add(x.sx[xb], acc);
            }
            *y.add(a * w.rows + r) = acc;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::*;
    use std::arch::x86_64::*;

    /// Inputs `a0..` of output panels `p0..p1`, in tiles of up to 8 inputs by one panel:
    /// the panel's weights are loaded (and unpacked) once per block for the tile's inputs.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn rows(w: &QMatrix, x: &QActs, a0: usize, p0: usize, p1: usize, y: *mut f32) {
        match w.bits {
            Bits::Four => rows_of::<true>(w, x, a0, p0, p1, y),
            Bits::Eight => rows_of::<false>(w, x, a0, p0, p1, y),
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn rows_of<const FOUR: bool>(w: &QMatrix, x: &QActs, a0: usize, p0: usize, p1: usize, y: *mut f32) {
        for (a, n, p) in tiles(a0, x.rows, p0, p1, 8) {
            match n {
                1 => tile::<FOUR, 1>(w, x, a, p, y),
                2 => tile::<FOUR, 2>(w, x, a, p, y),
                3 => tile::<FOUR, 3>(w, x, a, p, y),
                4 => tile::<FOUR, 4>(w, x, a, p, y),
                5 => tile::<FOUR, 5>(w, x, a, p, y),
                6 => tile::<FOUR, 6>(w, x, a, p, y),
                7 => tile::<FOUR, 7>(w, x, a, p, y),
                _ => tile::<FOUR, 8>(w, x, a, p, y),
            }
        }
    }

    /// The 8 groups (4 columns of the 16 outputs each) of panel block `pb`, unpacked.
    #[inline(always)]
    pub(super) unsafe fn weights<const FOUR: bool>(w: &QMatrix, pb: usize) -> [__m512i; 8] {
        let mut v = [_mm512_setzero_si512(); 8];
        if FOUR {
            let at = w.q.as_ptr().add(pb * PANEL_BLOCK / 2);
            let nib = _mm512_set1_epi8(0x0F);
            for c in 0..4 {
                let packed = _mm512_loadu_si512(at.add(64 * c) as *const _);
                v[c] = _mm512_and_si512(packed, nib);
                v[c + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nib);
            }
        } else {
            let at = w.q.as_ptr().add(pb * PANEL_BLOCK);
            for (g, v) in v.iter_mut().enumerate() {
                *v = _mm512_loadu_si512(at.add(64 * g) as *const _);
            }
        }
        v
    }

    /// One block's float update of one input row and the 16 outputs: the one operation
    /// sequence of every path (see the module's numerics).
    #[inline(always)]
    pub(super) unsafe fn update(acc: __m512, sums: __m512i, wd: __m512, wm: __m512, x: &QActs, xb: usize) -> __m512 {
        let acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(wd, _mm512_set1_ps(*x.dx.get_unchecked(xb))), acc);
        _mm512_fmadd_ps(wm, _mm512_set1_ps(*x.sx.get_unchecked(xb)), acc)
    }

    /// Output panel `p`'s 16 values of input `a`, into `y` (the padding rows of a last panel
    /// are not written).
    #[inline(always)]
    pub(super) unsafe fn store(w: &QMatrix, a: usize, p: usize, v: __m512, y: *mut f32) {
        let o = p * PANEL;
        let at = y.add(a * w.rows + o);
        if o + PANEL <= w.rows {
            _mm512_storeu_ps(at, v);
        } else {
            _mm512_mask_storeu_ps(at, ((1u32 << (w.rows - o)) - 1) as __mmask16, v);
        }
    }

    /// Inputs `a..a + N` times panel `p`.
    #[inline(always)]
    unsafe fn tile<const FOUR: bool, const N: usize>(w: &QMatrix, x: &QActs, a: usize, p: usize, y: *mut f32) {
        let stride = x.blocks * BLOCK;
        let mut acc = [_mm512_setzero_ps(); N];
        for b in 0..w.blocks {
            let pb = p * w.blocks + b;
            let wv = weights::<FOUR>(w, pb);
            let wd = _mm512_loadu_ps(w.d.as_ptr().add(pb * PANEL));
            let wm = _mm512_loadu_ps(w.m.as_ptr().add(pb * PANEL));
            for (t, acc) in acc.iter_mut().enumerate() {
                let xq = x.q.as_ptr().add((a + t) * stride + b * BLOCK) as *const i32;
                // two chains of four, added at the end (integers: exact in any order)
                let (mut s0, mut s1) = (_mm512_setzero_si512(), _mm512_setzero_si512());
                for g in 0..4 {
                    s0 = _mm512_dpbusd_epi32(s0, wv[g], _mm512_set1_epi32(xq.add(g).read_unaligned()));
                    s1 = _mm512_dpbusd_epi32(s1, wv[g + 4], _mm512_set1_epi32(xq.add(g + 4).read_unaligned()));
                }
                *acc = update(*acc, _mm512_add_epi32(s0, s1), wd, wm, x, (a + t) * x.blocks + b);
            }
        }
        for (t, acc) in acc.iter().enumerate() {
            store(w, a + t, p, *acc, y);
        }
    }

    /// One whole block pair of [`super::quantize_row`]: 64 values at `x`, 64 bytes at `q`,
    /// and the two blocks' `dx`, `sx` and `qs`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn quantize_pair(x: *const f32, q: *mut i8, dx: &mut [f32], sx: &mut [f32], qs: &mut [i32]) {
        let magic = _mm512_set1_ps(12_582_912.0); // as in kernels::round
        let (lo, hi) = (_mm512_set1_ps(-127.0), _mm512_set1_ps(127.0));
        for b in 0..2 {
            let v0 = _mm512_loadu_ps(x.add(b * BLOCK));
            let v1 = _mm512_loadu_ps(x.add(b * BLOCK + 16));
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            let d = amax / 127.0;
            let inv = _mm512_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
            let quant = |v: __m512| {
                let c = _mm512_max_ps(_mm512_min_ps(_mm512_mul_ps(v, inv), hi), lo);
                _mm512_cvtps_epi32(_mm512_sub_ps(_mm512_add_ps(c, magic), magic))
            };
            let (q0, q1) = (quant(v0), quant(v1));
            let sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
            _mm_storeu_si128(q.add(b * BLOCK) as *mut __m128i, _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128(q.add(b * BLOCK + 16) as *mut __m128i, _mm512_cvtepi32_epi8(q1));
            dx[b] = d;
            sx[b] = d * sum as f32;
            qs[b] = sum;
        }
    }
}

/// Prefill products on Intel AMX: the integer sums of 16 input rows × 16 outputs × one
/// block are one `tdpbsud` (activations signed, weights unsigned), written to memory and
/// scaled there by the AVX-512 kernel's own float update, so the results are bitwise
/// those of the other paths. Tiles are programmed by inline assembly (the AMX intrinsics are
/// not stable Rust); the tile state is configured and released within each call.
#[cfg(target_arch = "x86_64")]
mod amx {
    use super::avx512::{store, update, weights};
    use super::*;
    use std::arch::asm;
    use std::arch::x86_64::*;

    /// Blocks whose integer sums one round computes (one result tile each).
    const ROUND: usize = 4;
    /// Input rows per group: a panel's unpacked weights are reused for all of them.
    const INPUTS: usize = 128;

    /// The tile configuration (palette 1): tiles 0–3 the 16 × 16 int32 sums, 4 and 6 the
    /// activations (16 rows × 32 bytes), 5 and 7 the weights (8 rows of 4 columns × 16
    /// outputs).
    #[repr(C, align(64))]
    struct Config {
        palette: u8,
        start_row: u8,
        reserved: [u8; 14],
        colsb: [u16; 16],
        rows: [u8; 16],
    }

    static CONFIG: Config = {
        let mut colsb = [0u16; 16];
        let mut rows = [0u8; 16];
        let mut t = 0;
        while t < 8 {
            (colsb[t], rows[t]) = match t {
                0..=3 => (64, 16),
                4 | 6 => (32, 16),
                _ => (64, 8),
            };
            t += 1;
        }
        Config { palette: 1, start_row: 0, reserved: [0; 14], colsb, rows }
    };

    /// Output panels `p0..p1` of every input: whole groups of 16 inputs on AMX, the rest
    /// on the AVX-512 kernel.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn rows(w: &QMatrix, x: &QActs, p0: usize, p1: usize, y: *mut f32) {
        let full = x.rows / PANEL * PANEL;
        asm!("ldtilecfg [{}]", in(reg) &raw const CONFIG, options(nostack, readonly));
        // a 4-bit panel's weights unpacked to bytes, as the tiles load them
        let mut unpacked = vec![0u8; if w.bits == Bits::Four { w.blocks * PANEL_BLOCK } else { 0 }];
        for g in (0..full).step_by(INPUTS) {
            for p in p0..p1 {
                let panel = match w.bits {
                    Bits::Four => {
                        for b in 0..w.blocks {
                            let v = weights::<true>(w, p * w.blocks + b);
                            for (i, v) in v.iter().enumerate() {
                                _mm512_storeu_si512(unpacked.as_mut_ptr().add(b * PANEL_BLOCK + 64 * i) as *mut _, *v);
                            }
                        }
                        unpacked.as_ptr()
                    }
                    Bits::Eight => w.q.as_ptr().add(p * w.blocks * PANEL_BLOCK),
                };
                for a in (g..full.min(g + INPUTS)).step_by(PANEL) {
                    tile(w, x, panel, a, p, y);
                }
            }
        }
        asm!("tilerelease", options(nostack, nomem));
        if full < x.rows {
            super::avx512::rows(w, x, full, p0, p1, y);
        }
    }

    /// Inputs `a..a + 16` times panel `p`, whose weights are unpacked at `panel`.
    #[inline(always)]
    unsafe fn tile(w: &QMatrix, x: &QActs, panel: *const u8, a: usize, p: usize, y: *mut f32) {
        let stride = x.blocks * BLOCK;
        let xq = x.q.as_ptr().add(a * stride) as *const u8;
        let mut sums = Sums([0; ROUND * PANEL * PANEL]);
        let mut acc = [_mm512_setzero_ps(); PANEL];
        for b0 in (0..w.blocks).step_by(ROUND) {
            // blocks past the end repeat the last one; their sums are not used
            let at = |j: usize| (b0 + j).min(w.blocks - 1);
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                "tileloadd tmm4, [{a0} + {stride}]",
                "tileloadd tmm5, [{w0} + {w_stride}]",
                "tdpbsud tmm0, tmm4, tmm5",
                "tileloadd tmm6, [{a1} + {stride}]",
                "tileloadd tmm7, [{w1} + {w_stride}]",
                "tdpbsud tmm1, tmm6, tmm7",
                "tileloadd tmm4, [{a2} + {stride}]",
                "tileloadd tmm5, [{w2} + {w_stride}]",
                "tdpbsud tmm2, tmm4, tmm5",
                "tileloadd tmm6, [{a3} + {stride}]",
                "tileloadd tmm7, [{w3} + {w_stride}]",
                "tdpbsud tmm3, tmm6, tmm7",
                "tilestored [{s} + {w_stride}], tmm0",
                "tilestored [{s} + {w_stride} + 1024], tmm1",
                "tilestored [{s} + {w_stride} + 2048], tmm2",
                "tilestored [{s} + {w_stride} + 3072], tmm3",
                a0 = in(reg) xq.add(at(0) * BLOCK),
                a1 = in(reg) xq.add(at(1) * BLOCK),
                a2 = in(reg) xq.add(at(2) * BLOCK),
                a3 = in(reg) xq.add(at(3) * BLOCK),
                w0 = in(reg) panel.add(at(0) * PANEL_BLOCK),
                w1 = in(reg) panel.add(at(1) * PANEL_BLOCK),
                w2 = in(reg) panel.add(at(2) * PANEL_BLOCK),
                w3 = in(reg) panel.add(at(3) * PANEL_BLOCK),
                stride = in(reg) stride,
                w_stride = in(reg) 64usize,
                s = in(reg) sums.0.as_mut_ptr(),
                options(nostack),
            );
            for j in 0..ROUND.min(w.blocks - b0) {
                let pb = p * w.blocks + b0 + j;
                let wd = _mm512_loadu_ps(w.d.as_ptr().add(pb * PANEL));
                let wm = _mm512_loadu_ps(w.m.as_ptr().add(pb * PANEL));
                for (t, acc) in acc.iter_mut().enumerate() {
                    let s = _mm512_load_si512(sums.0.as_ptr().add((j * PANEL + t) * PANEL) as *const _);
                    *acc = update(*acc, s, wd, wm, x, (a + t) * x.blocks + b0 + j);
                }
            }
        }
        for (t, acc) in acc.iter().enumerate() {
            store(w, a + t, p, *acc, y);
        }
    }

    /// One product of each kind the kernel uses, on zeros (see `kernels::amx`).
    pub(in crate::infer::kernels) unsafe fn probe() {
        let mut zeros = Sums([0; ROUND * PANEL * PANEL]);
        asm!(
            "ldtilecfg [{c}]",
            "tileloadd tmm4, [{z} + {stride}]",
            "tileloadd tmm5, [{z} + {stride}]",
            "tilezero tmm0",
            "tdpbsud tmm0, tmm4, tmm5",
            "tilestored [{z} + {stride}], tmm0",
            "tilerelease",
            c = in(reg) &raw const CONFIG,
            z = in(reg) zeros.0.as_mut_ptr(),
            stride = in(reg) 64usize,
            options(nostack),
        );
    }

    /// Four result tiles, aligned for vector loads.
    #[repr(C, align(64))]
    struct Sums([i32; ROUND * PANEL * PANEL]);
}

#[cfg(target_arch = "x86_64")]
pub(super) use amx::probe as amx_probe;

/// The kernel for CPUs with AVX2 but without AVX-512 VNNI: a group of 4 columns of the
/// panel's 16 outputs is two 256-bit halves, and `vpmaddubsw` + `vpmaddwd` make the same
/// four-byte sums as `vpdpbusd`. 4-bit weights sum a whole block in 16 bits (at most
/// 8·2·15·127 = 30480 in size, so exactly); `vpmaddubsw` would saturate on 8-bit weights, so
/// they go in signed (`u − 128`) and get `128·Σq` back.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn rows(w: &QMatrix, x: &QActs, p0: usize, p1: usize, y: *mut f32) {
        match w.bits {
            Bits::Four => rows_of::<true>(w, x, p0, p1, y),
            Bits::Eight => rows_of::<false>(w, x, p0, p1, y),
        }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn rows_of<const FOUR: bool>(w: &QMatrix, x: &QActs, p0: usize, p1: usize, y: *mut f32) {
        for (a, n, p) in tiles(0, x.rows, p0, p1, 4) {
            match n {
                1 => tile::<FOUR, 1>(w, x, a, p, y),
                2 => tile::<FOUR, 2>(w, x, a, p, y),
                3 => tile::<FOUR, 3>(w, x, a, p, y),
                _ => tile::<FOUR, 4>(w, x, a, p, y),
            }
        }
    }

    /// Inputs `a..a + N` times panel `p`: per block, group `c` and group `c + 4` of the
    /// weights (one load for 4-bit) for all `N` inputs.
    #[inline(always)]
    unsafe fn tile<const FOUR: bool, const N: usize>(w: &QMatrix, x: &QActs, a: usize, p: usize, y: *mut f32) {
        let stride = x.blocks * BLOCK;
        let ones = _mm256_set1_epi16(1);
        let nib = _mm256_set1_epi8(0x0F);
        let flip = _mm256_set1_epi8(-128);
        let mut acc = [[_mm256_setzero_ps(); 2]; N];
        for b in 0..w.blocks {
            let pb = p * w.blocks + b;
            // per input and half: 16-bit sums (4-bit) or 32-bit sums (8-bit)
            let mut s = [[_mm256_setzero_si256(); 2]; N];
            for c in 0..4 {
                // the two groups' halves: [group c lo, group c hi, group c+4 lo, group c+4 hi]
                let wv: [__m256i; 4] = if FOUR {
                    let at = w.q.as_ptr().add(pb * PANEL_BLOCK / 2 + 64 * c);
                    let (l, h) = (_mm256_loadu_si256(at as *const _), _mm256_loadu_si256(at.add(32) as *const _));
                    [
                        _mm256_and_si256(l, nib),
                        _mm256_and_si256(h, nib),
                        _mm256_and_si256(_mm256_srli_epi16(l, 4), nib),
                        _mm256_and_si256(_mm256_srli_epi16(h, 4), nib),
                    ]
                } else {
                    let at = w.q.as_ptr().add(pb * PANEL_BLOCK);
                    let (lo, hi) = (at.add(64 * c) as *const __m256i, at.add(64 * (c + 4)) as *const __m256i);
                    [
                        _mm256_xor_si256(_mm256_loadu_si256(lo), flip),
                        _mm256_xor_si256(_mm256_loadu_si256(lo.add(1)), flip),
                        _mm256_xor_si256(_mm256_loadu_si256(hi), flip),
                        _mm256_xor_si256(_mm256_loadu_si256(hi.add(1)), flip),
                    ]
                };
                for (t, s) in s.iter_mut().enumerate() {
                    let xq = x.q.as_ptr().add((a + t) * stride + b * BLOCK) as *const i32;
                    let (x0, x1) = (_mm256_set1_epi32(xq.add(c).read_unaligned()), _mm256_set1_epi32(xq.add(c + 4).read_unaligned()));
                    for h in 0..2 {
                        if FOUR {
                            let d = _mm256_add_epi16(_mm256_maddubs_epi16(wv[h], x0), _mm256_maddubs_epi16(wv[2 + h], x1));
                            s[h] = _mm256_add_epi16(s[h], d);
                        } else {
                            s[h] = _mm256_add_epi32(s[h], _mm256_add_epi32(signed(wv[h], x0, ones), signed(wv[2 + h], x1, ones)));
                        }
                    }
                }
            }
            let wd = [_mm256_loadu_ps(w.d.as_ptr().add(pb * PANEL)), _mm256_loadu_ps(w.d.as_ptr().add(pb * PANEL + 8))];
            let wm = [_mm256_loadu_ps(w.m.as_ptr().add(pb * PANEL)), _mm256_loadu_ps(w.m.as_ptr().add(pb * PANEL + 8))];
            for t in 0..N {
                let xb = (a + t) * x.blocks + b;
                let (dx, sx) = (_mm256_set1_ps(*x.dx.get_unchecked(xb)), _mm256_set1_ps(*x.sx.get_unchecked(xb)));
                for h in 0..2 {
                    let sums = if FOUR {
                        _mm256_madd_epi16(s[t][h], ones)
                    } else {
                        _mm256_add_epi32(s[t][h], _mm256_set1_epi32(128 * *x.qs.get_unchecked(xb)))
                    };
                    let v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(wd[h], dx), acc[t][h]);
                    acc[t][h] = _mm256_fmadd_ps(wm[h], sx, v);
                }
            }
        }
        let o = p * PANEL;
        for (t, acc) in acc.iter().enumerate() {
            let at = y.add((a + t) * w.rows + o);
            if o + PANEL <= w.rows {
                _mm256_storeu_ps(at, acc[0]);
                _mm256_storeu_ps(at.add(8), acc[1]);
            } else {
                let mut v = [0f32; PANEL];
                _mm256_storeu_ps(v.as_mut_ptr(), acc[0]);
                _mm256_storeu_ps(v.as_mut_ptr().add(8), acc[1]);
                std::ptr::copy_nonoverlapping(v.as_ptr(), at, w.rows - o);
            }
        }
    }

    /// The four-byte sums of signed weights `w` times activations `x`, as 32-bit lanes.
    #[inline(always)]
    unsafe fn signed(w: __m256i, x: __m256i, ones: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w)), ones)
    }

    /// One whole block pair of [`super::quantize_row`], as `avx512::quantize_pair`: the same
    /// operations value by value, so the same bytes as the scalar loop.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn quantize_pair(x: *const f32, q: *mut i8, dx: &mut [f32], sx: &mut [f32], qs: &mut [i32]) {
        let magic = _mm256_set1_ps(12_582_912.0); // as in kernels::round
        let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
        let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
        for b in 0..2 {
            let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(x.add(b * BLOCK + 8 * i)));
            let m = _mm256_max_ps(
                _mm256_max_ps(_mm256_and_ps(v[0], abs), _mm256_and_ps(v[1], abs)),
                _mm256_max_ps(_mm256_and_ps(v[2], abs), _mm256_and_ps(v[3], abs)),
            );
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
            let d = amax / 127.0;
            let inv = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
            let q8: [__m256i; 4] = std::array::from_fn(|i| {
                let c = _mm256_max_ps(_mm256_min_ps(_mm256_mul_ps(v[i], inv), hi), lo);
                _mm256_cvtps_epi32(_mm256_sub_ps(_mm256_add_ps(c, magic), magic))
            });
            let s = _mm256_add_epi32(_mm256_add_epi32(q8[0], q8[1]), _mm256_add_epi32(q8[2], q8[3]));
            let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
            let sum = _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01)));
            dx[b] = d;
            sx[b] = d * sum as f32;
            qs[b] = sum;
            // 32 values in order: the packs work per 128-bit lane, a dword permute restores it
            let bytes = _mm256_packs_epi16(_mm256_packs_epi32(q8[0], q8[1]), _mm256_packs_epi32(q8[2], q8[3]));
            let bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(q.add(b * BLOCK) as *mut __m256i, bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn data(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    fn reference(w: &[f32], x: &[f32], rows: usize, cols: usize, n: usize) -> Vec<f32> {
        let mut y = vec![0f32; n * rows];
        for a in 0..n {
            for o in 0..rows {
                y[a * rows + o] = (0..cols).map(|c| w[o * cols + c] * x[a * cols + c]).sum();
            }
        }
        y
    }

    fn acts(x: &[f32], n: usize, cols: usize) -> QActs {
        let mut qa = QActs::default();
        qa.quantize(x, n, cols, None);
        qa
    }

    #[test]
    fn quantised_products_approximate_the_float_product() {
        for (rows, cols) in [(48, 576), (5, 40), (70, 96)] {
            let w = data(rows * cols, 1);
            let x = data(6 * cols, 2);
            let want = reference(&w, &x, rows, cols, 6);
            let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
            for (bits, tol) in [(Bits::Four, 0.15), (Bits::Eight, 0.03)] {
                let qm = QMatrix::quantize(&w, rows, cols, bits);
                // the dequantised weights are within half a step of the originals
                let dq = qm.dequantize();
                let step = if bits == Bits::Four { 2.0 / 15.0 } else { 1.0 / 127.0 };
                assert!(dq.iter().zip(&w).all(|(a, b)| (a - b).abs() <= step * 0.5 + 1e-6), "{bits:?}");
                let qa = acts(&x, 6, cols);
                let mut y = vec![0f32; 6 * rows];
                matmul(&qm, &qa, &mut y, None);
                let err = y.iter().zip(&want).fold(0f32, |a, (g, t)| a.max((g - t).abs())) / scale;
                assert!(err < tol && err > 0.0, "{bits:?} [{rows}, {cols}]: relative error {err}");
                // against the dequantised matrix the error is the activations' rounding only
                let exact = reference(&dq, &x, rows, cols, 6);
                let err = y.iter().zip(&exact).fold(0f32, |a, (g, t)| a.max((g - t).abs())) / scale;
                assert!(err < 0.02, "{bits:?}: activation rounding {err}");
            }
        }
    }

    /// A row's outputs are bitwise the same alone (the AVX-512 or AVX2 kernel), among 37
    /// others (two groups of 16 on AMX where the CPU has it, the rest not) and on two
    /// threads.
    #[test]
    fn a_row_does_not_depend_on_the_others_or_the_threads() {
        let (rows, cols, n) = (160, 128, 37);
        for bits in [Bits::Four, Bits::Eight] {
            let w = QMatrix::quantize(&data(rows * cols, 3), rows, cols, bits);
            let x = data(n * cols, 4);
            let all = acts(&x, n, cols);
            let mut y_all = vec![0f32; n * rows];
            matmul(&w, &all, &mut y_all, None);
            let two = Pool::new(2);
            let mut y_par = vec![0f32; n * rows];
            matmul(&w, &all, &mut y_par, two.as_ref());
            assert_eq!(y_all, y_par, "{bits:?}");
            for a in 0..n {
                let one = acts(&x[a * cols..(a + 1) * cols], 1, cols);
                let mut y = vec![0f32; rows];
                matmul(&w, &one, &mut y, None);
                assert_eq!(y, y_all[a * rows..(a + 1) * rows], "{bits:?} row {a}");
            }
        }
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn vector_and_scalar_quantisation_give_the_same_bytes() {
        assert!(super::super::vnni() || super::super::avx2(), "this test checks a vector path; the CPU has neither AVX-512 VNNI nor AVX2");
        for cols in [64, 100, 576, 1536] {
            let mut row = data(cols, cols as u64);
            row[..32].iter_mut().for_each(|v| *v = 0.0); // a zero block
            row[40] = 3.0; // a block with an outlier
            let blocks = cols.div_ceil(BLOCK);
            let mut a = (vec![0i8; blocks * BLOCK], vec![0f32; blocks], vec![0f32; blocks], vec![0i32; blocks]);
            let mut b = a.clone();
            quantize_row(&row, Row { q: &mut a.0, dx: &mut a.1, sx: &mut a.2, qs: &mut a.3 });
            quantize_blocks(&row, Row { q: &mut b.0, dx: &mut b.1, sx: &mut b.2, qs: &mut b.3 }, 0);
            assert_eq!(a, b, "{cols} columns");
        }
    }

    /// Every path the CPU has gives the portable loop's bits, on shapes with a short last
    /// panel and a short last block, and with 16-row groups for AMX.
    #[test]
    fn every_path_gives_the_same_bits() {
        for (rows, cols, n) in [(32, 192, 5), (70, 96, 37), (5, 40, 17)] {
            let x = data(n * cols, 6);
            let qa = acts(&x, n, cols);
            for bits in [Bits::Four, Bits::Eight] {
                let w = QMatrix::quantize(&data(rows * cols, 5), rows, cols, bits);
                let panels = w.panels();
                let mut want = vec![0f32; n * rows];
                unsafe { portable_rows(&w, &qa, 0, panels, want.as_mut_ptr()) };
                let mut fast = vec![0f32; n * rows];
                matmul(&w, &qa, &mut fast, None);
                assert_eq!(fast, want, "{bits:?} [{rows}, {cols}] × {n}: {}", super::super::isa().name());
                #[cfg(target_arch = "x86_64")]
                {
                    let mut paths: Vec<(&str, Vec<f32>)> = vec![];
                    if super::super::avx2() {
                        let mut y = vec![0f32; n * rows];
                        unsafe { avx2::rows(&w, &qa, 0, panels, y.as_mut_ptr()) };
                        paths.push(("avx2", y));
                    }
                    if super::super::vnni() {
                        let mut y = vec![0f32; n * rows];
                        unsafe { avx512::rows(&w, &qa, 0, 0, panels, y.as_mut_ptr()) };
                        paths.push(("avx512", y));
                    }
                    if super::super::amx() {
                        let mut y = vec![0f32; n * rows];
                        unsafe { amx::rows(&w, &qa, 0, panels, y.as_mut_ptr()) };
                        paths.push(("amx", y));
                    }
                    for (name, y) in paths {
                        assert_eq!(y, want, "{bits:?} [{rows}, {cols}] × {n}: {name}");
                    }
                }
            }
        }
    }
}
