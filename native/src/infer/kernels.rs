//! The CPU rollout engine's kernels: matrix products (quantised in [`quant`], float32 in
//! [`fmatmul`]), attention over a sequence's cache, and the instruction-set choice they share.
//!
//! Why own kernels: a decode step of a 135M-parameter model is ~120 matrix-vector products
//! and ~400 small element-wise operations. Through libtorch each costs a dispatch of a few
//! microseconds, which alone is more than llama.cpp's whole step (7 ms); here a step is a
//! plain loop over memory, and one stream decodes at llama.cpp's speed.
//!
//! **Numerics do not depend on batch composition.** Every output row of every input row
//! is computed by the same sequence of operations whatever the other rows are, how many
//! there are, or how the rows are split among threads: the engine's results are bitwise
//! independent of what else it decodes. The quantised products are also bitwise the same
//! on every path ([`quant`]); the float32 product and attention may differ between CPUs
//! with and without AVX-512 (they sum in other lane orders).

mod quant;

#[cfg(target_arch = "x86_64")]
use quant::amx_probe;
pub use quant::{matmul, Bits, QActs, QMatrix, BLOCK};

use crate::infer::threads::Pool;

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
    /// AVX-512 with Intel AMX for the quantised products of prefill passes
    Amx,
}

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Amx => "amx",
        }
    }
}

/// The cap on the kernels' instruction set: `HARNESS_S_MAX_CPU_ISA` (`amx`, `avx512`, `avx2`
/// or `portable`), to run and measure a narrower path on one machine (`harness-s bench
/// sampler`), as oneDNN's `ONEDNN_MAX_CPU_ISA` does; unset, the CPU decides. Read once.
pub fn max_isa() -> Isa {
    static CAP: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
    *CAP.get_or_init(|| match std::env::var("HARNESS_S_MAX_CPU_ISA") {
        Err(_) => Isa::Amx,
        Ok(v) => match [Isa::Amx, Isa::Avx512, Isa::Avx2, Isa::Portable].into_iter().find(|i| i.name() == v) {
            Some(isa) => isa,
            None => {
                tracing::warn!(value = v, "HARNESS_S_MAX_CPU_ISA is not amx, avx512, avx2 or portable; ignored");
                Isa::Amx
            }
        },
    })
}

/// The instruction set the kernels use on this CPU under [`max_isa`].
pub fn isa() -> Isa {
    #[cfg(target_arch = "x86_64")]
    if amx() {
        return Isa::Amx;
    } else if vnni() {
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

/// Whether quantised products of 16 or more rows take the AMX path: the AVX-512 path is
/// taken, the CPU has AMX-TILE and AMX-INT8, the OS enables their state, and Linux grants
/// this process the tile data (`ARCH_REQ_XCOMP_PERM`, asked once). Some virtual machines
/// list AMX and refuse it; the request fails there and the AVX-512 path is kept.
#[cfg(target_arch = "x86_64")]
pub fn amx() -> bool {
    static USABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    max_isa() >= Isa::Amx && vnni() && *USABLE.get_or_init(amx_usable)
}

#[cfg(target_arch = "x86_64")]
fn amx_usable() -> bool {
    use std::arch::x86_64::{__cpuid_count, _xgetbv};
    // CPUID.7.0:EDX bits 24 (AMX-TILE) and 25 (AMX-INT8); CPUID.1:ECX bit 27 (OSXSAVE)
    let listed = __cpuid_count(7, 0).edx >> 24 & 3 == 3 && __cpuid_count(1, 0).ecx >> 27 & 1 == 1;
    // XCR0 bits 17 and 18: the OS saves the tile configuration and data
    // SAFETY: OSXSAVE says XGETBV is available.
    if !listed || unsafe { _xgetbv(0) } >> 17 & 3 != 3 {
        return false;
    }
    #[cfg(target_os = "linux")]
    {
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: a plain system call with integer arguments.
        if unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) } != 0 {
            tracing::info!(error = %std::io::Error::last_os_error(), "the CPU lists AMX but the OS does not grant it; prefill uses AVX-512");
            return false;
        }
        // a hypervisor may still refuse the instructions (invalid opcode): try them in a
        // child process, which inherits the permission, before this one relies on them
        // SAFETY: the child runs the probe's instructions and `_exit` only, which is safe
        // after a fork of a threaded process.
        let ran = unsafe {
            match libc::fork() {
                0 => {
                    amx_probe();
                    libc::_exit(0)
                }
                -1 => false,
                child => {
                    let mut status = 0;
                    libc::waitpid(child, &mut status, 0) == child && libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0
                }
            }
        };
        if !ran {
            tracing::info!("the CPU lists AMX and the OS grants it, but its instructions fail here; prefill uses AVX-512");
        }
        ran
    }
    #[cfg(not(target_os = "linux"))]
    false
}

/// Whether the kernels take their AVX2 path (the fallback without AVX-512 VNNI).
#[cfg(target_arch = "x86_64")]
pub fn avx2() -> bool {
    max_isa() >= Isa::Avx2 && std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
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

/// The sum of an AVX2 register's 8 lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn hsum256(v: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
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
        hsum256(v)
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
