//! Quantised matrix products of the CPU rollout engine, in the manner of llama.cpp: 4-bit
//! (or 8-bit) weights in groups of 32 times 8-bit activations, integer dot products per
//! group, one float scale per group.
//!
//! Why own kernels: a decode step of a 135M-parameter model is ~120 matrix-vector products
//! and ~400 small element-wise operations. Through libtorch each costs a dispatch of a few
//! microseconds, which alone is more than llama.cpp's whole step (7 ms); here a step is a
//! plain loop over memory, and one stream decodes at llama.cpp's speed.
//!
//! **Formats.** A [`QMatrix`] row holds groups ("blocks") of 32 weights `w ≈ d·u + m`,
//! `u` unsigned: 4-bit `u ∈ 0..=15` with `d = (max − min)/15, m = min` (GGUF's Q4_1), or
//! 8-bit `u ∈ 1..=255` with `d = amax/127, m = −128·d` (symmetric, like Q8_0). Activations
//! ([`QActs`]) are 8-bit per block, `x ≈ dx·q`, `q ∈ −127..=127` (Q8_1). The product of one
//! block is `Σ w·x ≈ d·dx·Σ u·q + m·dx·Σ q`, so both formats share one kernel. The
//! offset terms `Σ_b m_b·(dx·Σq)_b` of a row pair are one short float dot product over
//! blocks, added once per output (not once per block pair in the inner loop, where it would
//! cost as much as the scaled integer dot itself).
//!
//! **Layout.** Blocks go in pairs, 64 values, stored in the order that lets one AVX-512
//! VNNI instruction (`vpdpbusd`: 64 unsigned × signed byte products, summed in fours into
//! 16 lanes) leave block 0 in the even lanes and block 1 in the odd ones: then a pair's two
//! scales multiply all 16 lanes from one 64-bit broadcast. A 4-bit pair is 32 bytes: the
//! low nibbles are bytes 0..32 of that order, the high nibbles bytes 32..64.
//!
//! **Numerics do not depend on batch composition.** Every output row of every input row
//! is computed by the same sequence of operations whatever the other rows are, how many
//! there are, or how the rows are split among threads: the engine's results are bitwise
//! independent of what else it decodes. They may differ between CPUs with and without
//! AVX-512 VNNI (the AVX2 and portable kernels sum in other orders).

use crate::threads::Pool;

/// Values per quantisation block.
pub const BLOCK: usize = 32;
/// Values per stored block pair.
const PAIR: usize = 2 * BLOCK;

/// Weight bits of a [`QMatrix`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bits {
    Four,
    Eight,
}

/// Position, in a block pair's stored order, of value `e` (0..32) of block `parity` (0, 1):
/// lane `k` of the 16 four-byte lanes holds block `k % 2`, values `(k / 2)·4 ..+4`.
#[inline]
fn slot(parity: usize, e: usize) -> usize {
    (e / 4) * 8 + parity * 4 + e % 4
}

/// A quantised weight matrix `[rows, cols]` (one row per output feature), `cols` padded
/// with zero weights to a multiple of 64.
pub struct QMatrix {
    pub rows: usize,
    pub cols: usize,
    pub bits: Bits,
    pairs: usize,
    /// per row, `pairs` × 32 (4-bit) or 64 (8-bit) bytes
    q: Vec<u8>,
    /// per row and block: scale and offset (8-bit: −128 · scale)
    d: Vec<f32>,
    m: Vec<f32>,
}

impl QMatrix {
    /// Quantises `w` (`[rows, cols]`, row-major float32).
    pub fn quantize(w: &[f32], rows: usize, cols: usize, bits: Bits) -> QMatrix {
        assert_eq!(w.len(), rows * cols, "matrix data does not match its shape");
        let pairs = cols.div_ceil(PAIR);
        let blocks = 2 * pairs;
        let row_bytes = pairs * if bits == Bits::Four { BLOCK } else { PAIR };
        let mut q = vec![0u8; rows * row_bytes];
        let mut d = vec![0f32; rows * blocks];
        let mut m = vec![0f32; rows * blocks];
        let mut u = [0u8; PAIR];
        for r in 0..rows {
            let row = &w[r * cols..(r + 1) * cols];
            for p in 0..pairs {
                for parity in 0..2 {
                    let b = 2 * p + parity;
                    let start = (b * BLOCK).min(cols);
                    let vals = &row[start..((b + 1) * BLOCK).min(cols)];
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
                    for e in 0..BLOCK {
                        let v = vals.get(e).copied().unwrap_or(0.0);
                        u[slot(parity, e)] = match bits {
                            Bits::Four => round(((v - offset) * inv).clamp(0.0, 15.0)) as u8,
                            Bits::Eight => (round((v * inv).clamp(-127.0, 127.0)) as i32 + 128) as u8,
                        };
                    }
                    d[r * blocks + b] = scale;
                    m[r * blocks + b] = offset;
                }
                let out = &mut q[r * row_bytes..];
                match bits {
                    Bits::Four => {
                        for i in 0..BLOCK {
                            out[p * BLOCK + i] = u[i] | (u[i + BLOCK] << 4);
                        }
                    }
                    Bits::Eight => out[p * PAIR..(p + 1) * PAIR].copy_from_slice(&u),
                }
            }
        }
        QMatrix { rows, cols, bits, pairs, q, d, m }
    }

    /// The weights as float32 `[rows, cols]`, as the kernels see them.
    pub fn dequantize(&self) -> Vec<f32> {
        let blocks = 2 * self.pairs;
        let row_bytes = self.row_bytes();
        let mut w = vec![0f32; self.rows * self.cols];
        for r in 0..self.rows {
            for c in 0..self.cols {
                let (b, e) = (c / BLOCK, c % BLOCK);
                let (p, parity) = (b / 2, b % 2);
                let j = slot(parity, e);
                let base = &self.q[r * row_bytes..];
                let u = match self.bits {
                    Bits::Four => {
                        let byte = base[p * BLOCK + j % BLOCK];
                        if j < BLOCK {
                            byte & 0x0F
                        } else {
                            byte >> 4
                        }
                    }
                    Bits::Eight => base[p * PAIR + j],
                };
                w[r * self.cols + c] = self.d[r * blocks + b] * u as f32 + self.m[r * blocks + b];
            }
        }
        w
    }

    fn row_bytes(&self) -> usize {
        self.pairs * if self.bits == Bits::Four { BLOCK } else { PAIR }
    }
}

/// Activations `[rows, cols]` quantised for a product with a [`QMatrix`] of `cols` columns.
#[derive(Default)]
pub struct QActs {
    pub rows: usize,
    pairs: usize,
    q: Vec<i8>,
    /// per row and block: dx, and dx·Σq (what the weights' offset multiplies)
    dx: Vec<f32>,
    sx: Vec<f32>,
}

impl QActs {
    /// Quantises `x` (`[rows, cols]`, row-major) into this buffer, reusing its memory; rows
    /// are split among `pool`'s threads (each row is quantised on its own).
    pub fn quantize(&mut self, x: &[f32], rows: usize, cols: usize, pool: Option<&Pool>) {
        assert_eq!(x.len(), rows * cols, "activations do not match their shape");
        let pairs = cols.div_ceil(PAIR);
        let blocks = 2 * pairs;
        self.rows = rows;
        self.pairs = pairs;
        self.q.clear();
        self.q.resize(rows * pairs * PAIR, 0);
        self.dx.clear();
        self.dx.resize(rows * blocks, 0.0);
        self.sx.clear();
        self.sx.resize(rows * blocks, 0.0);
        let (q, dx, sx) = (Shared::new(self.q.as_mut_ptr()), Shared::new(self.dx.as_mut_ptr()), Shared::new(self.sx.as_mut_ptr()));
        // a few rows are not worth a hand-off
        split(rows, 1, pool.filter(|_| rows * cols >= 4096), |range| {
            for r in range {
                // SAFETY: row r's slices are written by this part only.
                let (q, dx, sx) = unsafe {
                    (
                        std::slice::from_raw_parts_mut(q.ptr().add(r * pairs * PAIR), pairs * PAIR),
                        std::slice::from_raw_parts_mut(dx.ptr().add(r * blocks), blocks),
                        std::slice::from_raw_parts_mut(sx.ptr().add(r * blocks), blocks),
                    )
                };
                quantize_row(&x[r * cols..(r + 1) * cols], q, dx, sx);
            }
        });
    }
}

/// One row of activations: 8-bit values in the block-pair order, and per block its scale
/// and scaled sum. Whole block pairs take the AVX-512 or AVX2 path where the CPU has it,
/// with the same operations lane by lane, so every path gives the same bytes.
fn quantize_row(row: &[f32], q: &mut [i8], dx: &mut [f32], sx: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if vnni() {
        let whole = row.len() / PAIR;
        for p in 0..whole {
            // SAFETY: pair p's 64 values, 64 bytes and two scales are in range.
            unsafe {
                avx512::quantize_pair(
                    row.as_ptr().add(p * PAIR),
                    q.as_mut_ptr().add(p * PAIR),
                    &mut dx[2 * p..2 * p + 2],
                    &mut sx[2 * p..2 * p + 2],
                )
            };
        }
        quantize_blocks(row, q, dx, sx, 2 * whole);
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        let whole = row.len() / PAIR;
        for p in 0..whole {
            // SAFETY: as above.
            unsafe {
                avx2::quantize_pair(
                    row.as_ptr().add(p * PAIR),
                    q.as_mut_ptr().add(p * PAIR),
                    &mut dx[2 * p..2 * p + 2],
                    &mut sx[2 * p..2 * p + 2],
                )
            };
        }
        quantize_blocks(row, q, dx, sx, 2 * whole);
        return;
    }
    quantize_blocks(row, q, dx, sx, 0);
}

/// [`quantize_row`] from block `first` on, one value at a time.
fn quantize_blocks(row: &[f32], q: &mut [i8], dx: &mut [f32], sx: &mut [f32], first: usize) {
    let cols = row.len();
    for b in first..dx.len() {
        let start = (b * BLOCK).min(cols);
        let vals = &row[start..((b + 1) * BLOCK).min(cols)];
        let amax = vals.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        let out = &mut q[(b / 2) * PAIR..];
        let mut sum = 0i32;
        for (e, v) in vals.iter().enumerate() {
            let v = round((v * inv).clamp(-127.0, 127.0)) as i8;
            out[slot(b % 2, e)] = v;
            sum += v as i32;
        }
        dx[b] = d;
        sx[b] = d * sum as f32;
    }
}

/// `v` rounded to the nearest integer (ties to even) for |v| < 2²²: an addition instead of a
/// call to the C library's `roundf`, which the baseline x86-64 target compiles `round` to.
#[inline(always)]
fn round(v: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 · 2²³
    (v + MAGIC) - MAGIC
}

/// A raw pointer that may cross threads: each thread writes its own disjoint elements, or
/// all of them only read.
pub(crate) struct Shared<T>(*mut T);
unsafe impl<T> Send for Shared<T> {}
unsafe impl<T> Sync for Shared<T> {}
impl<T> Clone for Shared<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Shared<T> {}

impl<T> Shared<T> {
    pub(crate) fn new(p: *mut T) -> Self {
        Shared(p)
    }

    /// (A method, so that closures capture the wrapper and not its raw field.)
    pub(crate) fn ptr(self) -> *mut T {
        self.0
    }
}

/// The widest instruction set the kernels may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    Portable,
    Avx2,
    Avx512,
}

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }
}

/// The cap on the kernels' instruction set: `HARNESS_S_MAX_CPU_ISA` (`avx512`, `avx2` or
/// `portable`), to run and measure a narrower path on one machine (`harness-s bench
/// sampler`), as oneDNN's `ONEDNN_MAX_CPU_ISA` does; unset, the CPU decides. Read once.
pub fn max_isa() -> Isa {
    static CAP: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
    *CAP.get_or_init(|| match std::env::var("HARNESS_S_MAX_CPU_ISA") {
        Err(_) => Isa::Avx512,
        Ok(v) => match v.as_str() {
            "avx512" => Isa::Avx512,
            "avx2" => Isa::Avx2,
            "portable" => Isa::Portable,
            other => {
                tracing::warn!(value = other, "HARNESS_S_MAX_CPU_ISA is not avx512, avx2 or portable; ignored");
                Isa::Avx512
            }
        },
    })
}

/// The instruction set the kernels use on this CPU under [`max_isa`].
pub fn isa() -> Isa {
    #[cfg(target_arch = "x86_64")]
    if vnni() {
        return Isa::Avx512;
    } else if avx2() {
        return Isa::Avx2;
    }
    Isa::Portable
}

/// Whether the kernels take their AVX-512 path (with VNNI for the quantised products;
/// std caches the CPU's answer).
#[cfg(target_arch = "x86_64")]
pub fn vnni() -> bool {
    max_isa() >= Isa::Avx512
        && std::is_x86_feature_detected!("avx512f")
        && std::is_x86_feature_detected!("avx512bw")
        && std::is_x86_feature_detected!("avx512vnni")
}

/// Whether the kernels take their AVX2 path (the fallback without AVX-512 VNNI).
#[cfg(target_arch = "x86_64")]
pub fn avx2() -> bool {
    max_isa() >= Isa::Avx2 && std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
}

/// `y[a, o] = Σ_c x[a, c] · w[o, c]` for every input row `a` and output row `o`:
/// `y` is `[x.rows, w.rows]`, row-major. Output rows are split among `pool`'s threads.
pub fn matmul(w: &QMatrix, x: &QActs, y: &mut [f32], pool: Option<&Pool>) {
    assert_eq!(w.pairs, x.pairs, "activations were quantised for another column count");
    assert_eq!(y.len(), x.rows * w.rows, "output does not match the product's shape");
    let out = Shared::new(y.as_mut_ptr());
    let run = move |o0: usize, o1: usize| {
        // SAFETY: every (a, o) with o in o0..o1 is written by this call only.
        #[cfg(target_arch = "x86_64")]
        if vnni() {
            unsafe { avx512::rows(w, x, o0, o1, out.ptr()) };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if avx2() {
            unsafe { avx2::rows(w, x, o0, o1, out.ptr()) };
            return;
        }
        unsafe { portable_rows(w, x, o0, o1, out.ptr()) };
    };
    let pool = pool.filter(|_| w.rows >= 64);
    split(w.rows, 16, pool, |r| run(r.start, r.end));
}

/// Runs `f` on parts of `0..n` (contiguous, each a multiple of `align` long but the last)
/// on the calling thread and `pool`'s threads. The parts are several per thread, taken in
/// turn by whichever thread is free, so rows of unequal cost (attention over a prefill's
/// growing context) and threads of unequal speed still finish together; which thread
/// computes a part does not change its result.
pub fn split<F: Fn(std::ops::Range<usize>) + Sync>(n: usize, align: usize, pool: Option<&Pool>, f: F) {
    const PARTS_PER_THREAD: usize = 8;
    match pool {
        Some(pool) if n > align => {
            let per = n.div_ceil(pool.threads() * PARTS_PER_THREAD).div_ceil(align) * align;
            let parts = n.div_ceil(per);
            let next = std::sync::atomic::AtomicUsize::new(0);
            pool.run(&|_| loop {
                let p = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if p >= parts {
                    break;
                }
                f(p * per..((p + 1) * per).min(n));
            });
        }
        _ => f(0..n),
    }
}

/// The kernel without SIMD intrinsics (what the compiler vectorises of it).
unsafe fn portable_rows(w: &QMatrix, x: &QActs, o0: usize, o1: usize, y: *mut f32) {
    let blocks = 2 * w.pairs;
    let row_bytes = w.row_bytes();
    let mut u = [0u8; PAIR];
    for o in o0..o1 {
        let wq = &w.q[o * row_bytes..(o + 1) * row_bytes];
        let wd = &w.d[o * blocks..(o + 1) * blocks];
        for a in 0..x.rows {
            let xq = &x.q[a * w.pairs * PAIR..(a + 1) * w.pairs * PAIR];
            let (xd, xs) = (&x.dx[a * blocks..(a + 1) * blocks], &x.sx[a * blocks..(a + 1) * blocks]);
            let mut acc = 0f32;
            for p in 0..w.pairs {
                match w.bits {
                    Bits::Four => {
                        for i in 0..BLOCK {
                            let byte = wq[p * BLOCK + i];
                            u[i] = byte & 0x0F;
                            u[i + BLOCK] = byte >> 4;
                        }
                    }
                    Bits::Eight => u.copy_from_slice(&wq[p * PAIR..(p + 1) * PAIR]),
                }
                let mut sums = [0i32; 2];
                for j in 0..PAIR {
                    sums[(j / 4) % 2] += u[j] as i32 * xq[p * PAIR + j] as i32;
                }
                for (parity, s) in sums.iter().enumerate() {
                    let b = 2 * p + parity;
                    acc += *s as f32 * (wd[b] * xd[b]);
                }
            }
            let wm = &w.m[o * blocks..(o + 1) * blocks];
            *y.add(a * w.rows + o) = acc + wm.iter().zip(xs).map(|(m, s)| m * s).sum::<f32>();
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::*;
    use std::arch::x86_64::*;

    /// Output rows `o0..o1` for every input row: tiles of four input rows by one output
    /// row, and what is left of the input rows in tiles of four output rows by one input
    /// row, so that every tile keeps at least eight independent accumulators busy.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn rows(w: &QMatrix, x: &QActs, o0: usize, o1: usize, y: *mut f32) {
        match w.bits {
            Bits::Four => rows_of::<true>(w, x, o0, o1, y),
            Bits::Eight => rows_of::<false>(w, x, o0, o1, y),
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn rows_of<const FOUR: bool>(w: &QMatrix, x: &QActs, o0: usize, o1: usize, y: *mut f32) {
        let k = Kernel::<FOUR>::new(w, x, y);
        let full = x.rows / 4 * 4;
        // inputs in blocks that stay in the L1/L2 cache while every output row goes past
        // them (a prefill pass of several sequences has hundreds of rows)
        const INPUTS: usize = 16;
        for a0 in (0..full).step_by(INPUTS) {
            for o in o0..o1 {
                let mut a = a0;
                let end = full.min(a0 + INPUTS);
                while a + 8 <= end {
                    k.one_by::<8>(o, a);
                    a += 8;
                }
                while a < end {
                    k.one_by::<4>(o, a);
                    a += 4;
                }
            }
        }
        for a in full..x.rows {
            let mut o = o0;
            while o + 4 <= o1 {
                k.four_by_one(o, a);
                o += 4;
            }
            while o < o1 {
                k.one_by_one(o, a);
                o += 1;
            }
        }
    }

    /// The operands of one product, as raw pointers.
    struct Kernel<const FOUR: bool> {
        pairs: usize,
        out: usize,
        row_bytes: usize,
        wq: *const u8,
        wd: *const f32,
        wm: *const f32,
        xq: *const i8,
        xd: *const f32,
        xs: *const f32,
        y: *mut f32,
    }

    /// Two f32 (a block pair's values) broadcast to 16 lanes: even lanes the first.
    #[inline(always)]
    unsafe fn pair(p: *const f32) -> __m512 {
        _mm512_castpd_ps(_mm512_set1_pd((p as *const f64).read_unaligned()))
    }

    /// A block pair's 64 unsigned weights in the stored order.
    #[inline(always)]
    unsafe fn weights<const FOUR: bool>(p: *const u8) -> __m512i {
        if FOUR {
            // both halves hold the 32 bytes; the low half keeps the low nibbles, the high half
            // shifts the high ones down
            let v = _mm512_castsi256_si512(_mm256_loadu_si256(p as *const __m256i));
            let v = _mm512_shuffle_i64x2(v, v, 0b01_00_01_00);
            let shift = _mm512_set_epi64(
                4 * 0x0001_0001_0001_0001,
                4 * 0x0001_0001_0001_0001,
                4 * 0x0001_0001_0001_0001,
                4 * 0x0001_0001_0001_0001,
                0,
                0,
                0,
                0,
            );
            _mm512_and_si512(_mm512_srlv_epi16(v, shift), _mm512_set1_epi8(0x0F))
        } else {
            _mm512_loadu_si512(p as *const _)
        }
    }

    impl<const FOUR: bool> Kernel<FOUR> {
        #[inline(always)]
        unsafe fn new(w: &QMatrix, x: &QActs, y: *mut f32) -> Self {
            Kernel {
                pairs: w.pairs,
                out: w.rows,
                row_bytes: w.row_bytes(),
                wq: w.q.as_ptr(),
                wd: w.d.as_ptr(),
                wm: w.m.as_ptr(),
                xq: x.q.as_ptr(),
                xd: x.dx.as_ptr(),
                xs: x.sx.as_ptr(),
                y,
            }
        }

        /// Input `a`'s block pair `p`: its values and scales.
        #[inline(always)]
        unsafe fn input(&self, a: usize, p: usize) -> (__m512i, __m512) {
            (_mm512_loadu_si512(self.xq.add((a * self.pairs + p) * PAIR) as *const _), pair(self.xd.add(2 * (a * self.pairs + p))))
        }

        /// One output's weights `(wv, dw)` times one input's block pair `(xv, dx)`, added to
        /// the accumulator of scaled integer dots: the one operation sequence every tile
        /// shape uses.
        #[inline(always)]
        unsafe fn step(w: (__m512i, __m512), x: (__m512i, __m512), acc: &mut __m512) {
            let dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w.0, x.0));
            *acc = _mm512_fmadd_ps(dot, _mm512_mul_ps(w.1, x.1), *acc);
        }

        #[inline(always)]
        unsafe fn load(&self, o: usize, p: usize) -> (__m512i, __m512) {
            let step = if FOUR { BLOCK } else { PAIR };
            (weights::<FOUR>(self.wq.add(o * self.row_bytes + p * step)), pair(self.wd.add(2 * (o * self.pairs + p))))
        }

        /// The accumulated dots of output `o`, input `a`, plus the offset terms: `m` of the
        /// output's blocks times `dx·Σq` of the input's, 16 blocks at a time.
        #[inline(always)]
        unsafe fn store(&self, o: usize, a: usize, acc: __m512) {
            let blocks = 2 * self.pairs;
            let (m, s) = (self.wm.add(o * blocks), self.xs.add(a * blocks));
            let mut v = acc;
            let mut b = 0;
            while b + 16 <= blocks {
                v = _mm512_fmadd_ps(_mm512_loadu_ps(m.add(b)), _mm512_loadu_ps(s.add(b)), v);
                b += 16;
            }
            if b < blocks {
                let k = ((1u32 << (blocks - b)) - 1) as __mmask16;
                v = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, m.add(b)), _mm512_maskz_loadu_ps(k, s.add(b)), v);
            }
            *self.y.add(a * self.out + o) = _mm512_reduce_add_ps(v);
        }

        #[inline(always)]
        unsafe fn one_by_one(&self, o: usize, a: usize) {
            let mut acc = _mm512_setzero_ps();
            for p in 0..self.pairs {
                Self::step(self.load(o, p), self.input(a, p), &mut acc);
            }
            self.store(o, a, acc);
        }

        #[inline(always)]
        unsafe fn four_by_one(&self, o: usize, a: usize) {
            let mut acc = [_mm512_setzero_ps(); 4];
            for p in 0..self.pairs {
                let x = self.input(a, p);
                for t in 0..4 {
                    Self::step(self.load(o + t, p), x, &mut acc[t]);
                }
            }
            for t in 0..4 {
                self.store(o + t, a, acc[t]);
            }
        }

        /// Output `o` of inputs `a..a + N`: one weight load per block pair for `N` inputs.
        #[inline(always)]
        unsafe fn one_by<const N: usize>(&self, o: usize, a: usize) {
            let mut acc = [_mm512_setzero_ps(); N];
            for p in 0..self.pairs {
                let w = self.load(o, p);
                for t in 0..N {
                    Self::step(w, self.input(a + t, p), &mut acc[t]);
                }
            }
            for t in 0..N {
                self.store(o, a + t, acc[t]);
            }
        }
    }
    /// One whole block pair of [`super::quantize_row`]: 64 values at `x`, 64 bytes at `q`
    /// in the stored order, and the two blocks' `dx` and `sx`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn quantize_pair(x: *const f32, q: *mut i8, dx: &mut [f32], sx: &mut [f32]) {
        let magic = _mm512_set1_ps(12_582_912.0); // as in super::round
        let (lo, hi) = (_mm512_set1_ps(-127.0), _mm512_set1_ps(127.0));
        let mut bytes = [_mm_setzero_si128(); 4];
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
            bytes[2 * b] = _mm512_cvtepi32_epi8(q0);
            bytes[2 * b + 1] = _mm512_cvtepi32_epi8(q1);
            dx[b] = d;
            sx[b] = d * sum as f32;
        }
        // four-byte groups of the two blocks alternate (see super::slot)
        let v = _mm512_inserti32x4(_mm512_castsi128_si512(bytes[0]), bytes[1], 1);
        let v = _mm512_inserti32x4(_mm512_inserti32x4(v, bytes[2], 2), bytes[3], 3);
        let order = _mm512_set_epi32(15, 7, 14, 6, 13, 5, 12, 4, 11, 3, 10, 2, 9, 1, 8, 0);
        _mm512_storeu_si512(q as *mut _, _mm512_permutexvar_epi32(order, v));
    }
}

/// The kernel for CPUs with AVX2 but without AVX-512 VNNI: a block pair is two 256-bit
/// halves, and `vpmaddubsw` + `vpmaddwd` make the same four-byte lane sums as `vpdpbusd`.
/// `vpmaddubsw` saturates at 16 bits, so 8-bit weights go in signed (`u − 128`, which
/// also cancels their offset term). Tiles as in the AVX-512 kernel, sized for 16 registers:
/// four inputs by one output row, and the inputs left over four outputs by one input.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn rows(w: &QMatrix, x: &QActs, o0: usize, o1: usize, y: *mut f32) {
        match w.bits {
            Bits::Four => rows_of::<true>(w, x, o0, o1, y),
            Bits::Eight => rows_of::<false>(w, x, o0, o1, y),
        }
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn rows_of<const FOUR: bool>(w: &QMatrix, x: &QActs, o0: usize, o1: usize, y: *mut f32) {
        let k = Kernel::<FOUR>::new(w, x, y);
        let full = x.rows / 4 * 4;
        // inputs in blocks that stay in the cache while every output row goes past them
        const INPUTS: usize = 16;
        for a0 in (0..full).step_by(INPUTS) {
            for o in o0..o1 {
                let mut a = a0;
                while a < full.min(a0 + INPUTS) {
                    k.one_by::<4>(o, a);
                    a += 4;
                }
            }
        }
        for a in full..x.rows {
            let mut o = o0;
            while o + 4 <= o1 {
                k.four_by_one(o, a);
                o += 4;
            }
            while o < o1 {
                k.one_by_one(o, a);
                o += 1;
            }
        }
    }

    /// Two f32 (a block pair's values) broadcast to 8 lanes: even lanes the first.
    #[inline(always)]
    unsafe fn pair(p: *const f32) -> __m256 {
        _mm256_castpd_ps(_mm256_set1_pd((p as *const f64).read_unaligned()))
    }

    #[inline(always)]
    pub(super) unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    /// The operands of one product, as raw pointers.
    struct Kernel<const FOUR: bool> {
        pairs: usize,
        out: usize,
        row_bytes: usize,
        wq: *const u8,
        wd: *const f32,
        wm: *const f32,
        xq: *const i8,
        xd: *const f32,
        xs: *const f32,
        y: *mut f32,
    }

    /// One output's block pair: its two 256-bit weight halves (4-bit: unpacked nibbles;
    /// 8-bit: `u − 128`) and scales.
    type W = (__m256i, __m256i, __m256);
    /// One input's block pair: its two halves and scales.
    type X = (__m256i, __m256i, __m256);

    impl<const FOUR: bool> Kernel<FOUR> {
        #[inline(always)]
        unsafe fn new(w: &QMatrix, x: &QActs, y: *mut f32) -> Self {
            Kernel {
                pairs: w.pairs,
                out: w.rows,
                row_bytes: w.row_bytes(),
                wq: w.q.as_ptr(),
                wd: w.d.as_ptr(),
                wm: w.m.as_ptr(),
                xq: x.q.as_ptr(),
                xd: x.dx.as_ptr(),
                xs: x.sx.as_ptr(),
                y,
            }
        }

        #[inline(always)]
        unsafe fn load(&self, o: usize, p: usize) -> W {
            let b = 2 * (o * self.pairs + p);
            let dw = pair(self.wd.add(b));
            if FOUR {
                let v = _mm256_loadu_si256(self.wq.add(o * self.row_bytes + p * BLOCK) as *const __m256i);
                let nib = _mm256_set1_epi8(0x0F);
                (_mm256_and_si256(v, nib), _mm256_and_si256(_mm256_srli_epi16(v, 4), nib), dw)
            } else {
                let flip = _mm256_set1_epi8(-128);
                let at = self.wq.add(o * self.row_bytes + p * PAIR);
                let s0 = _mm256_xor_si256(_mm256_loadu_si256(at as *const __m256i), flip);
                let s1 = _mm256_xor_si256(_mm256_loadu_si256(at.add(32) as *const __m256i), flip);
                (s0, s1, dw)
            }
        }

        #[inline(always)]
        unsafe fn input(&self, a: usize, p: usize) -> X {
            let at = self.xq.add((a * self.pairs + p) * PAIR);
            (
                _mm256_loadu_si256(at as *const __m256i),
                _mm256_loadu_si256(at.add(32) as *const __m256i),
                pair(self.xd.add(2 * (a * self.pairs + p))),
            )
        }

        /// One output's weights times one input's block pair, added to `acc` (scaled integer
        /// dots): the one operation sequence every tile shape uses.
        #[inline(always)]
        unsafe fn step(w: W, x: X, acc: &mut __m256) {
            let ones = _mm256_set1_epi16(1);
            // both halves alternate block 0 and block 1 lane by lane, so their sums add
            let dot = if FOUR {
                // 16-bit pair sums of 4-bit weights are at most 2·15·127 = 3810 in size, so
                // the halves add in 16 bits (exactly) before one widening
                let d = _mm256_add_epi16(_mm256_maddubs_epi16(w.0, x.0), _mm256_maddubs_epi16(w.1, x.1));
                _mm256_madd_epi16(d, ones)
            } else {
                let d0 = _mm256_maddubs_epi16(_mm256_abs_epi8(w.0), _mm256_sign_epi8(x.0, w.0));
                let d1 = _mm256_maddubs_epi16(_mm256_abs_epi8(w.1), _mm256_sign_epi8(x.1, w.1));
                _mm256_add_epi32(_mm256_madd_epi16(d0, ones), _mm256_madd_epi16(d1, ones))
            };
            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(w.2, x.2), *acc);
        }

        /// The accumulated dots of output `o`, input `a`, plus (4-bit) the offset terms, 8
        /// blocks at a time; signed 8-bit weights have none.
        #[inline(always)]
        unsafe fn store(&self, o: usize, a: usize, acc: __m256) {
            let mut v = acc;
            let mut tail = 0f32;
            if FOUR {
                let blocks = 2 * self.pairs;
                let (m, s) = (self.wm.add(o * blocks), self.xs.add(a * blocks));
                let mut b = 0;
                while b + 8 <= blocks {
                    v = _mm256_fmadd_ps(_mm256_loadu_ps(m.add(b)), _mm256_loadu_ps(s.add(b)), v);
                    b += 8;
                }
                while b < blocks {
                    tail += *m.add(b) * *s.add(b);
                    b += 1;
                }
            }
            *self.y.add(a * self.out + o) = hsum(v) + tail;
        }

        #[inline(always)]
        unsafe fn one_by_one(&self, o: usize, a: usize) {
            let mut acc = _mm256_setzero_ps();
            for p in 0..self.pairs {
                Self::step(self.load(o, p), self.input(a, p), &mut acc);
            }
            self.store(o, a, acc);
        }

        #[inline(always)]
        unsafe fn four_by_one(&self, o: usize, a: usize) {
            let mut acc = [_mm256_setzero_ps(); 4];
            for p in 0..self.pairs {
                let x = self.input(a, p);
                for t in 0..4 {
                    Self::step(self.load(o + t, p), x, &mut acc[t]);
                }
            }
            for t in 0..4 {
                self.store(o + t, a, acc[t]);
            }
        }

        /// Output `o` of inputs `a..a + N`: one weight load and unpack per block pair for
        /// `N` inputs.
        #[inline(always)]
        unsafe fn one_by<const N: usize>(&self, o: usize, a: usize) {
            let mut acc = [_mm256_setzero_ps(); N];
            for p in 0..self.pairs {
                let w = self.load(o, p);
                for t in 0..N {
                    Self::step(w, self.input(a + t, p), &mut acc[t]);
                }
            }
            for t in 0..N {
                self.store(o, a + t, acc[t]);
            }
        }
    }

    /// One whole block pair of [`super::quantize_row`], as `avx512::quantize_pair`: the same
    /// operations value by value, so the same bytes as the scalar loop.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn quantize_pair(x: *const f32, q: *mut i8, dx: &mut [f32], sx: &mut [f32]) {
        let magic = _mm256_set1_ps(12_582_912.0); // as in super::round
        let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
        let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
        let mut packed = [_mm256_setzero_si256(); 2];
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
            let q: [__m256i; 4] = std::array::from_fn(|i| {
                let c = _mm256_max_ps(_mm256_min_ps(_mm256_mul_ps(v[i], inv), hi), lo);
                _mm256_cvtps_epi32(_mm256_sub_ps(_mm256_add_ps(c, magic), magic))
            });
            let s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
            let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
            let sum = _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01)));
            dx[b] = d;
            sx[b] = d * sum as f32;
            // 32 values in order: the packs work per 128-bit lane, a dword permute restores it
            let bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            packed[b] = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        }
        // four-byte groups of the two blocks alternate (see super::slot)
        let (l, h) = (_mm256_unpacklo_epi32(packed[0], packed[1]), _mm256_unpackhi_epi32(packed[0], packed[1]));
        _mm256_storeu_si256(q as *mut __m256i, _mm256_permute2x128_si256(l, h, 0x20));
        _mm256_storeu_si256(q.add(32) as *mut __m256i, _mm256_permute2x128_si256(l, h, 0x31));
    }
}

/// The float vector operations [`attend_with`] needs, for one register width.
#[cfg(target_arch = "x86_64")]
trait Lanes {
    type V: Copy;
    const WIDTH: usize;
    unsafe fn zero() -> Self::V;
    unsafe fn splat(v: f32) -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    unsafe fn store(p: *mut f32, v: Self::V);
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V;
    unsafe fn fmadd(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    unsafe fn sum(v: Self::V) -> f32;
    /// Whether [`Lanes::sums16`] is worth a block of 16 keys (32 registers: AVX-512).
    const BLOCKS: bool;
    /// The 16 sums of `v` into `out[..16]`, in one transposing reduction.
    unsafe fn sums16(v: &[Self::V; 16], out: *mut f32);
}

#[cfg(target_arch = "x86_64")]
struct Avx512;
#[cfg(target_arch = "x86_64")]
struct Avx2;

#[cfg(target_arch = "x86_64")]
impl Lanes for Avx512 {
    type V = std::arch::x86_64::__m512;
    const WIDTH: usize = 16;
    #[inline(always)]
    unsafe fn zero() -> Self::V {
        std::arch::x86_64::_mm512_setzero_ps()
    }
    #[inline(always)]
    unsafe fn splat(v: f32) -> Self::V {
        std::arch::x86_64::_mm512_set1_ps(v)
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self::V {
        std::arch::x86_64::_mm512_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: Self::V) {
        std::arch::x86_64::_mm512_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V {
        std::arch::x86_64::_mm512_mul_ps(a, b)
    }
    #[inline(always)]
    unsafe fn fmadd(a: Self::V, b: Self::V, c: Self::V) -> Self::V {
        std::arch::x86_64::_mm512_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn sum(v: Self::V) -> f32 {
        std::arch::x86_64::_mm512_reduce_add_ps(v)
    }
    const BLOCKS: bool = true;
    #[inline(always)]
    unsafe fn sums16(v: &[Self::V; 16], out: *mut f32) {
        use std::arch::x86_64::*;
        // 16 → 8: within each 128-bit lane, [v2i, v2i+1, v2i, v2i+1] partials
        let a: [__m512; 8] =
            std::array::from_fn(|i| _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1])));
        // 8 → 4: within each 128-bit lane, the partials of vectors 4j..4j+4 in order
        let b: [__m512; 4] = std::array::from_fn(|j| {
            let (x, y) = (_mm512_castps_pd(a[2 * j]), _mm512_castps_pd(a[2 * j + 1]));
            _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)))
        });
        // the four 128-bit lanes of each, added across
        let d01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x44), _mm512_shuffle_f32x4(b[0], b[1], 0xEE));
        let d23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x44), _mm512_shuffle_f32x4(b[2], b[3], 0xEE));
        _mm512_storeu_ps(out, _mm512_add_ps(_mm512_shuffle_f32x4(d01, d23, 0x88), _mm512_shuffle_f32x4(d01, d23, 0xDD)));
    }
}

#[cfg(target_arch = "x86_64")]
impl Lanes for Avx2 {
    type V = std::arch::x86_64::__m256;
    const WIDTH: usize = 8;
    #[inline(always)]
    unsafe fn zero() -> Self::V {
        std::arch::x86_64::_mm256_setzero_ps()
    }
    #[inline(always)]
    unsafe fn splat(v: f32) -> Self::V {
        std::arch::x86_64::_mm256_set1_ps(v)
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self::V {
        std::arch::x86_64::_mm256_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: Self::V) {
        std::arch::x86_64::_mm256_storeu_ps(p, v)
    }
    #[inline(always)]
    unsafe fn mul(a: Self::V, b: Self::V) -> Self::V {
        std::arch::x86_64::_mm256_mul_ps(a, b)
    }
    #[inline(always)]
    unsafe fn fmadd(a: Self::V, b: Self::V, c: Self::V) -> Self::V {
        std::arch::x86_64::_mm256_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn sum(v: Self::V) -> f32 {
        avx2::hsum(v)
    }
    const BLOCKS: bool = false;
    #[inline(always)]
    unsafe fn sums16(v: &[Self::V; 16], out: *mut f32) {
        for (i, x) in v.iter().enumerate() {
            *out.add(i) = Self::sum(*x);
        }
    }
}

/// [`attend`] for a head of `N` vectors of `L::WIDTH` values; inlined into the
/// `target_feature` functions below, which give it the instructions.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn attend_with<L: Lanes, const N: usize>(q: &[f32], keys: &[f32], values: &[f32], scale: f32, scores: &mut [f32], out: &mut [f32]) {
    let (w, hd, len) = (L::WIDTH, N * L::WIDTH, scores.len());
    debug_assert!(q.len() == hd && keys.len() >= len * hd && values.len() >= len * hd && out.len() == hd);
    let mut qv = [L::zero(); N];
    for c in 0..N {
        qv[c] = L::load(q.as_ptr().add(w * c));
    }
    let mut max = f32::NEG_INFINITY;
    // blocks of 16 keys reduce their 16 dot products together (a position's score is
    // computed the same way whatever else the engine runs: its block depends on its
    // position and the row's length only)
    let blocked = if L::BLOCKS { len / 16 * 16 } else { 0 };
    for t0 in (0..blocked).step_by(16) {
        let acc: [L::V; 16] = std::array::from_fn(|i| {
            let k = keys.as_ptr().add((t0 + i) * hd);
            let mut acc = L::mul(qv[0], L::load(k));
            for c in 1..N {
                acc = L::fmadd(qv[c], L::load(k.add(w * c)), acc);
            }
            acc
        });
        L::sums16(&acc, scores.as_mut_ptr().add(t0));
        for s in &mut scores[t0..t0 + 16] {
            *s *= scale;
            max = max.max(*s);
        }
    }
    for t in blocked..len {
        let k = keys.as_ptr().add(t * hd);
        let mut acc = L::mul(qv[0], L::load(k));
        for c in 1..N {
            acc = L::fmadd(qv[c], L::load(k.add(w * c)), acc);
        }
        let s = L::sum(acc) * scale;
        scores[t] = s;
        max = max.max(s);
    }
    let mut total = 0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        total += *s;
    }
    let mut acc = [L::zero(); N];
    for t in 0..len {
        let p = L::splat(scores[t] / total);
        let v = values.as_ptr().add(t * hd);
        for c in 0..N {
            acc[c] = L::fmadd(p, L::load(v.add(w * c)), acc[c]);
        }
    }
    for c in 0..N {
        L::store(out.as_mut_ptr().add(w * c), acc[c]);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn attend_avx512<const N: usize>(q: &[f32], keys: &[f32], values: &[f32], scale: f32, scores: &mut [f32], out: &mut [f32]) {
    attend_with::<Avx512, N>(q, keys, values, scale, scores, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_avx2<const N: usize>(q: &[f32], keys: &[f32], values: &[f32], scale: f32, scores: &mut [f32], out: &mut [f32]) {
    attend_with::<Avx2, N>(q, keys, values, scale, scores, out)
}

/// One attention head of one query row: `out = softmax(scale · q·Kᵀ) · V` over the `len`
/// positions of `keys` and `values` (`[len, hd]` each); `scores` is scratch space.
pub fn attend(q: &[f32], keys: &[f32], values: &[f32], scale: f32, scores: &mut Vec<f32>, out: &mut [f32]) {
    let hd = q.len();
    let len = keys.len() / hd;
    scores.resize(len, 0.0);
    #[cfg(target_arch = "x86_64")]
    if vnni() {
        match hd {
            // SAFETY: the AVX-512 check above; lengths as asserted by the slices' shapes
            64 => return unsafe { attend_avx512::<4>(q, keys, values, scale, scores, out) },
            128 => return unsafe { attend_avx512::<8>(q, keys, values, scale, scores, out) },
            _ => {}
        }
    }
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        match hd {
            // SAFETY: the AVX2 check above; lengths as asserted by the slices' shapes
            64 => return unsafe { attend_avx2::<8>(q, keys, values, scale, scores, out) },
            128 => return unsafe { attend_avx2::<16>(q, keys, values, scale, scores, out) },
            _ => {}
        }
    }
    let mut max = f32::NEG_INFINITY;
    for (s, k) in scores.iter_mut().zip(keys.chunks_exact(hd)) {
        *s = q.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * scale;
        max = max.max(*s);
    }
    let total: f32 = scores
        .iter_mut()
        .map(|s| {
            *s = (*s - max).exp();
            *s
        })
        .sum();
    out.fill(0.0);
    for (s, v) in scores.iter().zip(values.chunks_exact(hd)) {
        let p = s / total;
        out.iter_mut().zip(v).for_each(|(o, v)| *o += p * v);
    }
}

/// A float32 weight matrix `[rows, cols]` (one row per output feature) for [`fmatmul`]:
/// the `f32` weight format on the CPU kernels.
pub struct FMatrix {
    pub rows: usize,
    pub cols: usize,
    w: Vec<f32>,
}

impl FMatrix {
    pub fn new(w: Vec<f32>, rows: usize, cols: usize) -> FMatrix {
        assert_eq!(w.len(), rows * cols, "matrix data does not match its shape");
        FMatrix { rows, cols, w }
    }
}

/// `y[a, o] = Σ_c x[a, c] · w[o, c]` in float32 for every input row `a` of `x` (`[rows,
/// w.cols]`) and output row `o`: `y` is `[rows, w.rows]`. Each output is one vector
/// accumulator over `c` (lane `i` sums the columns `≡ i` modulo the vector width, in
/// column order), then a fixed reduction of the lanes, whatever tile computes it: as in
/// [`matmul`], results are bitwise independent of the other rows and of the thread
/// count (they may differ between AVX-512, AVX2 and the portable loop).
///
/// Why not libtorch's product: at the engine's row counts (a decode step's handful of
/// rows) MKL packs the whole weight matrix on every call, and on CPUs where it takes its
/// generic path (AMD's) that copy costs twice the product (`harness-s bench sampler`:
/// 5.5 decode tokens/s for one stream).
pub fn fmatmul(w: &FMatrix, x: &[f32], rows: usize, y: &mut [f32], pool: Option<&Pool>) {
    assert_eq!(x.len(), rows * w.cols, "activations do not match the product's shape");
    assert_eq!(y.len(), rows * w.rows, "output does not match the product's shape");
    let out = Shared::new(y.as_mut_ptr());
    let run = move |o0: usize, o1: usize| {
        // SAFETY: every (a, o) with o in o0..o1 is written by this call only; the shapes
        // are asserted above.
        #[cfg(target_arch = "x86_64")]
        if vnni() {
            unsafe { frows_avx512(w, x.as_ptr(), rows, o0, o1, out.ptr()) };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if avx2() {
            unsafe { frows_avx2(w, x.as_ptr(), rows, o0, o1, out.ptr()) };
            return;
        }
        unsafe { frows_portable(w, x.as_ptr(), rows, o0, o1, out.ptr()) };
    };
    let pool = pool.filter(|_| w.rows >= 64);
    split(w.rows, 16, pool, |r| run(r.start, r.end));
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn frows_avx512(w: &FMatrix, x: *const f32, n: usize, o0: usize, o1: usize, y: *mut f32) {
    // 32 registers: 4 × 4 accumulators, 4 weight vectors, 1 input vector
    frows::<Avx512, 4>(w, x, n, o0, o1, y)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn frows_avx2(w: &FMatrix, x: *const f32, n: usize, o0: usize, o1: usize, y: *mut f32) {
    // 16 registers: 4 × 2 accumulators, 2 weight vectors, 1 input vector
    frows::<Avx2, 2>(w, x, n, o0, o1, y)
}

/// Output rows `o0..o1` of every input row: tiles of 4 inputs by `TO` outputs (one weight
/// load per 4 inputs, one input load per `TO` outputs), inputs in blocks that stay in the
/// cache while the outputs go past them.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn frows<L: Lanes, const TO: usize>(w: &FMatrix, x: *const f32, n: usize, o0: usize, o1: usize, y: *mut f32) {
    const INPUTS: usize = 16;
    for a0 in (0..n).step_by(INPUTS) {
        let a1 = (a0 + INPUTS).min(n);
        let mut o = o0;
        while o + TO <= o1 {
            let mut a = a0;
            while a + 4 <= a1 {
                ftile::<L, 4, TO>(w, x, a, o, y);
                a += 4;
            }
            match a1 - a {
                3 => ftile::<L, 3, TO>(w, x, a, o, y),
                2 => ftile::<L, 2, TO>(w, x, a, o, y),
                1 => ftile::<L, 1, TO>(w, x, a, o, y),
                _ => {}
            }
            o += TO;
        }
        for o in o..o1 {
            for a in a0..a1 {
                ftile::<L, 1, 1>(w, x, a, o, y);
            }
        }
    }
}

/// Inputs `a..a + A` times outputs `o..o + O`: the one operation sequence per output.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn ftile<L: Lanes, const A: usize, const O: usize>(w: &FMatrix, x: *const f32, a: usize, o: usize, y: *mut f32) {
    let cols = w.cols;
    let full = cols / L::WIDTH * L::WIDTH;
    let wp = w.w.as_ptr();
    let mut acc = [[L::zero(); O]; A];
    let mut c = 0;
    while c < full {
        let wv: [L::V; O] = std::array::from_fn(|j| L::load(wp.add((o + j) * cols + c)));
        for (i, acc) in acc.iter_mut().enumerate() {
            let xv = L::load(x.add((a + i) * cols + c));
            for j in 0..O {
                acc[j] = L::fmadd(xv, wv[j], acc[j]);
            }
        }
        c += L::WIDTH;
    }
    for (i, acc) in acc.iter().enumerate() {
        for (j, acc) in acc.iter().enumerate() {
            let mut tail = 0f32;
            for c in full..cols {
                tail += *x.add((a + i) * cols + c) * *wp.add((o + j) * cols + c);
            }
            *y.add((a + i) * w.rows + o + j) = L::sum(*acc) + tail;
        }
    }
}

/// [`fmatmul`] without SIMD intrinsics: each output one [`dot`].
unsafe fn frows_portable(w: &FMatrix, x: *const f32, n: usize, o0: usize, o1: usize, y: *mut f32) {
    for a in 0..n {
        let xr = std::slice::from_raw_parts(x.add(a * w.cols), w.cols);
        for o in o0..o1 {
            *y.add(a * w.rows + o) = dot(xr, &w.w[o * w.cols..(o + 1) * w.cols]);
        }
    }
}

/// `Σ a·b` in 16 lanes (a plain float sum is sequential; lanes let the compiler vectorise).
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..16 {
            acc[i] += x[i] * y[i];
        }
    }
    // a tree, not a chain: 16 → 8 → 4 → 2 → 1
    let mut n = 16;
    while n > 1 {
        n /= 2;
        for i in 0..n {
            acc[i] += acc[i + n];
        }
    }
    acc[0] + tail
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
                let mut qa = QActs::default();
                qa.quantize(&x, 6, cols, None);
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

    #[test]
    fn a_row_does_not_depend_on_the_others_or_the_threads() {
        let (rows, cols) = (160, 128);
        let w = QMatrix::quantize(&data(rows * cols, 3), rows, cols, Bits::Four);
        let x = data(7 * cols, 4);
        let mut all = QActs::default();
        all.quantize(&x, 7, cols, None);
        let mut y_all = vec![0f32; 7 * rows];
        matmul(&w, &all, &mut y_all, None);
        let two = Pool::new(2);
        let mut y_par = vec![0f32; 7 * rows];
        matmul(&w, &all, &mut y_par, two.as_ref());
        assert_eq!(y_all, y_par);
        for a in 0..7 {
            let mut one = QActs::default();
            one.quantize(&x[a * cols..(a + 1) * cols], 1, cols, None);
            let mut y = vec![0f32; rows];
            matmul(&w, &one, &mut y, None);
            assert_eq!(y, y_all[a * rows..(a + 1) * rows], "row {a}");
        }
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn vector_and_scalar_quantisation_give_the_same_bytes() {
        assert!(vnni() || avx2(), "this test checks a vector path; the CPU has neither AVX-512 VNNI nor AVX2");
        for cols in [64, 100, 576, 1536] {
            let mut row = data(cols, cols as u64);
            row[..32].iter_mut().for_each(|v| *v = 0.0); // a zero block
            row[40] = 3.0; // a block with an outlier
            let pairs = cols.div_ceil(PAIR);
            let (mut qa, mut qb) = (vec![0i8; pairs * PAIR], vec![0i8; pairs * PAIR]);
            let (mut da, mut db, mut sa, mut sb) =
                (vec![0f32; 2 * pairs], vec![0f32; 2 * pairs], vec![0f32; 2 * pairs], vec![0f32; 2 * pairs]);
            quantize_row(&row, &mut qa, &mut da, &mut sa);
            quantize_blocks(&row, &mut qb, &mut db, &mut sb, 0);
            assert_eq!((qa, da, sa), (qb, db, sb), "{cols} columns");
        }
    }

    #[test]
    fn portable_avx2_and_vnni_kernels_agree() {
        let (rows, cols) = (32, 192);
        let x = data(5 * cols, 6);
        let mut qa = QActs::default();
        qa.quantize(&x, 5, cols, None);
        for bits in [Bits::Four, Bits::Eight] {
            let w = QMatrix::quantize(&data(rows * cols, 5), rows, cols, bits);
            let mut fast = vec![0f32; 5 * rows];
            matmul(&w, &qa, &mut fast, None);
            let mut slow = vec![0f32; 5 * rows];
            unsafe { portable_rows(&w, &qa, 0, rows, slow.as_mut_ptr()) };
            #[cfg(target_arch = "x86_64")]
            if avx2() {
                let mut mid = vec![0f32; 5 * rows];
                unsafe { avx2::rows(&w, &qa, 0, rows, mid.as_mut_ptr()) };
                for (m, s) in mid.iter().zip(&slow) {
                    assert!((m - s).abs() <= 1e-4 * s.abs().max(1.0), "{bits:?} avx2: {m} vs {s}");
                }
            }
            for (f, s) in fast.iter().zip(&slow) {
                assert!((f - s).abs() <= 1e-4 * s.abs().max(1.0), "{bits:?}: {f} vs {s}");
            }
        }
    }

    /// The float32 product equals a float64 reference to float32 rounding on every tile
    /// shape (row and column counts that leave edges, a column tail), every path agrees,
    /// and a row's outputs are bitwise the same alone, among others and on two threads.
    #[test]
    fn the_float_product_is_exact_and_a_row_does_not_depend_on_the_others() {
        for (rows, cols, n) in [(70, 576, 9), (5, 40, 3), (64, 100, 17), (1, 16, 1)] {
            let (wv, x) = (data(rows * cols, 10), data(n * cols, 11));
            let w = FMatrix::new(wv.clone(), rows, cols);
            let mut y = vec![0f32; n * rows];
            fmatmul(&w, &x, n, &mut y, None);
            for a in 0..n {
                for o in 0..rows {
                    let want: f64 = (0..cols).map(|c| wv[o * cols + c] as f64 * x[a * cols + c] as f64).sum();
                    let got = y[a * rows + o] as f64;
                    assert!((got - want).abs() < 1e-5 * cols as f64, "[{rows}, {cols}] × {n}: ({a}, {o}) {got} vs {want}");
                }
            }
            let two = Pool::new(2);
            let mut y_par = vec![0f32; n * rows];
            fmatmul(&w, &x, n, &mut y_par, two.as_ref());
            assert_eq!(y, y_par, "[{rows}, {cols}] × {n} on two threads");
            for a in 0..n {
                let mut one = vec![0f32; rows];
                fmatmul(&w, &x[a * cols..(a + 1) * cols], 1, &mut one, None);
                assert_eq!(one, y[a * rows..(a + 1) * rows], "[{rows}, {cols}]: row {a} alone");
            }
            let mut slow = vec![0f32; n * rows];
            unsafe { frows_portable(&w, x.as_ptr(), n, 0, rows, slow.as_mut_ptr()) };
            #[cfg(target_arch = "x86_64")]
            if avx2() {
                let mut mid = vec![0f32; n * rows];
                unsafe { frows_avx2(&w, x.as_ptr(), n, 0, rows, mid.as_mut_ptr()) };
                for (m, s) in mid.iter().zip(&slow) {
                    assert!((m - s).abs() <= 1e-5 * s.abs().max(1.0), "avx2: {m} vs {s}");
                }
            }
            for (f, s) in y.iter().zip(&slow) {
                assert!((f - s).abs() <= 1e-5 * s.abs().max(1.0), "{f} vs {s}");
            }
        }
    }

    #[test]
    fn attention_is_a_softmax_weighted_sum_of_values() {
        for hd in [64, 128, 24] {
            let len = 37;
            let (q, k, v) = (data(hd, 7), data(len * hd, 8), data(len * hd, 9));
            let mut out = vec![0f32; hd];
            attend(&q, &k, &v, 0.125, &mut vec![], &mut out);
            let s: Vec<f64> = (0..len).map(|t| (0..hd).map(|c| (q[c] * k[t * hd + c]) as f64).sum::<f64>() * 0.125).collect();
            let max = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - max).exp()).collect();
            let total: f64 = e.iter().sum();
            for c in 0..hd {
                let want: f64 = (0..len).map(|t| e[t] / total * v[t * hd + c] as f64).sum();
                assert!((out[c] as f64 - want).abs() < 1e-5, "hd {hd}, value {c}: {} vs {want}", out[c]);
            }
        }
    }
}
