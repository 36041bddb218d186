use native::kernels::{matmul, Bits, QActs, QMatrix};
use std::time::Instant;
fn main() {
    let threads: usize = std::env::args().nth(1).map(|s| s.parse().unwrap()).unwrap_or(1);
    f32bench(threads);
    let pool = native::threads::Pool::new(threads);
    for &(rows_out, cols, n) in &[(960usize, 576usize, 512usize), (3072, 576, 8)] {
        let w: Vec<f32> = (0..rows_out * cols).map(|i| ((i * 7919 % 1000) as f32 / 1000.0 - 0.5)).collect();
        let x: Vec<f32> = (0..n * cols).map(|i| ((i * 104729 % 997) as f32 / 997.0 - 0.5)).collect();
        let qm = QMatrix::quantize(&w, rows_out, cols, Bits::Four);
        let mut qa = QActs::default();
        qa.quantize(&x, n, cols, None);
        let mut y = vec![0f32; n * rows_out];
        matmul(&qm, &qa, &mut y, pool.as_ref());
        let iters = (2_000_000_000 / (rows_out * cols * n)).max(3);
        let t = Instant::now();
        for _ in 0..iters { matmul(&qm, &qa, &mut y, pool.as_ref()); }
        let s = t.elapsed().as_secs_f64() / iters as f64;
        println!("{rows_out}x{cols} x {n} rows: {:.3} ms  {:.1} GMAC/s", s * 1e3, (rows_out * cols * n) as f64 / s / 1e9);
    }
}
#[allow(dead_code)]
fn f32bench(threads: usize) {
    use native::kernels::{fmatmul, FMatrix};
    let pool = native::threads::Pool::new(threads);
    for &(rows_out, cols, n) in &[(960usize, 576usize, 512usize), (3072, 576, 512), (576, 1536, 512), (960, 576, 8), (3072, 576, 8), (3072, 576, 1)] {
        let w: Vec<f32> = (0..rows_out * cols).map(|i| ((i * 7919 % 1000) as f32 / 1000.0 - 0.5)).collect();
        let x: Vec<f32> = (0..n * cols).map(|i| ((i * 104729 % 997) as f32 / 997.0 - 0.5)).collect();
        let fm = FMatrix::new(w, rows_out, cols);
        let mut y = vec![0f32; n * rows_out];
        fmatmul(&fm, &x, n, &mut y, pool.as_ref());
        let iters = (2_000_000_000 / (rows_out * cols * n)).max(20);
        let t = Instant::now();
        for _ in 0..iters { fmatmul(&fm, &x, n, &mut y, pool.as_ref()); }
        let s = t.elapsed().as_secs_f64() / iters as f64;
        println!("f32 {rows_out}x{cols} x {n} rows: {:.3} ms  {:.1} GMAC/s", s * 1e3, (rows_out * cols * n) as f64 / s / 1e9);
    }
}
