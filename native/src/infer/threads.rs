//! The CPU kernels' helper threads: a fork-join pool whose threads spin between the
//! products of a forward pass, as ggml's thread pool and OpenMP's do.
//!
//! Why not rayon: a decode step is ~150 products of 20–200 µs each. Handing one to a
//! rayon pool from the engine's thread costs 10–20 µs (the helper has gone to sleep
//! between products and must be woken, and the caller sleeps on a condition variable
//! while it waits), which ate the second thread's gain (measured on 2 cores: an empty
//! hand-off 10–22 µs through rayon, under 1 µs here). Here a hand-off is a store to an
//! atomic counter that the helpers are spinning on; they spin for [`SPIN`] after their
//! last part, then park, so an idle engine burns no CPU.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a helper spins for the next part before it parks.
const SPIN: Duration = Duration::from_millis(2);

/// A part's work: called with the part's index (1.. on helpers, 0 on the caller).
type Job = dyn Fn(usize) + Sync;

struct State {
    /// bumped once per [`Pool::run`]; a helper runs a part when it sees a new value
    generation: AtomicU64,
    /// the current job, valid while `pending > 0` (a `*const Job` with its lifetime erased)
    job: Mutex<Option<JobPtr>>,
    /// helpers that have not finished the current job's part
    pending: AtomicUsize,
    /// a helper's part panicked
    panicked: AtomicBool,
    stop: AtomicBool,
    /// parked helpers wait here for the next generation
    parked: Mutex<usize>,
    wake: Condvar,
}

#[derive(Clone, Copy)]
struct JobPtr(*const Job);
// SAFETY: the pointee is `Sync`, and `Pool::run` keeps it alive until every helper is done.
unsafe impl Send for JobPtr {}

/// `threads − 1` helper threads beside the calling one.
pub struct Pool {
    state: Arc<State>,
    helpers: Vec<JoinHandle<()>>,
}

impl Pool {
    /// A pool for products on `threads` threads (`None` for one: no hand-offs at all).
    pub fn new(threads: usize) -> Option<Pool> {
        if threads < 2 {
            return None;
        }
        let state = Arc::new(State {
            generation: AtomicU64::new(0),
            job: Mutex::new(None),
            pending: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            parked: Mutex::new(0),
            wake: Condvar::new(),
        });
        let mut helpers = vec![];
        for part in 1..threads {
            let s = state.clone();
            let h = std::thread::Builder::new().name(format!("harness-s-kernel-{part}")).spawn(move || helper(&s, part));
            match h {
                Ok(h) => helpers.push(h),
                Err(_) => break, // fewer helpers: the parts are sized by how many started
            }
        }
        (!helpers.is_empty()).then_some(Pool { state, helpers })
    }

    /// Threads a [`Pool::run`] splits over, the caller's included.
    pub fn threads(&self) -> usize {
        self.helpers.len() + 1
    }

    /// Runs `f(part)` for every part `0..self.threads()`: part 0 on the calling thread, the
    /// others on the helpers; returns when all are done, and re-raises a helper's panic.
    pub fn run(&self, f: &(dyn Fn(usize) + Sync)) {
        let s = &*self.state;
        // SAFETY: only the lifetime is erased; `Wait` below keeps `f` borrowed until every
        // helper has finished with it, on the way out of a panic too.
        let ptr: *const Job = unsafe { std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), *const Job>(f) };
        *s.job.lock().unwrap_or_else(|e| e.into_inner()) = Some(JobPtr(ptr));
        s.pending.store(self.helpers.len(), Ordering::Relaxed);
        s.panicked.store(false, Ordering::Relaxed);
        s.generation.fetch_add(1, Ordering::Release);
        if *s.parked.lock().unwrap_or_else(|e| e.into_inner()) > 0 {
            s.wake.notify_all();
        }
        struct Wait<'a>(&'a State);
        impl Drop for Wait<'_> {
            fn drop(&mut self) {
                while self.0.pending.load(Ordering::Acquire) > 0 {
                    std::hint::spin_loop();
                }
            }
        }
        let wait = Wait(s);
        f(0);
        drop(wait);
        if s.panicked.swap(false, Ordering::Relaxed) {
            resume_unwind(Box::new("a kernel thread panicked"));
        }
    }
}

fn helper(s: &State, part: usize) {
    let mut seen = 0u64;
    loop {
        // spin, then park, until a new generation (or the stop flag) appears
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            if s.stop.load(Ordering::Acquire) {
                return;
            }
            if s.generation.load(Ordering::Acquire) != seen {
                break;
            }
            std::hint::spin_loop();
            spins += 1;
            if spins.is_multiple_of(1024) && start.elapsed() > SPIN {
                let mut parked = s.parked.lock().unwrap_or_else(|e| e.into_inner());
                *parked += 1;
                while s.generation.load(Ordering::Acquire) == seen && !s.stop.load(Ordering::Acquire) {
                    parked = s.wake.wait(parked).unwrap_or_else(|e| e.into_inner());
                }
                *parked -= 1;
            }
        }
        seen = s.generation.load(Ordering::Acquire);
        let job = *s.job.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(JobPtr(f)) = job {
            // SAFETY: `Pool::run` keeps the job alive until `pending` reaches zero.
            let f = unsafe { &*f };
            if catch_unwind(AssertUnwindSafe(|| f(part))).is_err() {
                s.panicked.store(true, Ordering::Relaxed);
            }
        }
        s.pending.fetch_sub(1, Ordering::Release);
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::Release);
        {
            let _parked = self.state.parked.lock().unwrap_or_else(|e| e.into_inner());
            self.state.wake.notify_all();
        }
        for h in self.helpers.drain(..) {
            let _ = h.join();
        }
    }
}

/// Makes libtorch's operations on the calling thread run on this thread alone, leaving
/// every other thread's setting (a learner's in the same process) as it is.
///
/// Why: after each of its parallel operations libtorch's OpenMP threads spin for the next
/// one, on the cores the kernels' helpers need; the engine's sampling then cost the second
/// thread's whole gain (measured: one stream decoded as fast on two threads as on one).
/// `tch::set_num_threads` would also change the count that threads which have not used
/// libtorch yet start with, so this sets the thread's OpenMP count directly.
pub fn torch_on_this_thread_alone() {
    // libtorch applies its global count to a thread on its first call; let that happen first
    let _ = tch::get_num_threads();
    #[cfg(unix)]
    {
        // SAFETY: dlsym with a NUL-terminated name; the symbol, where libtorch's OpenMP
        // runtime exports it, has OpenMP's signature `void omp_set_num_threads(int)`.
        unsafe {
            let f = libc::dlsym(libc::RTLD_DEFAULT, c"omp_set_num_threads".as_ptr());
            if !f.is_null() {
                let set: extern "C" fn(libc::c_int) = std::mem::transmute(f);
                set(1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torch_runs_alone_on_this_thread_only() {
        let before = tch::get_num_threads();
        let here = std::thread::spawn(|| {
            torch_on_this_thread_alone();
            tch::get_num_threads()
        })
        .join()
        .unwrap();
        assert_eq!(here, 1);
        let fresh = std::thread::spawn(tch::get_num_threads).join().unwrap();
        assert_eq!(fresh, before, "another thread's count changed");
    }

    #[test]
    fn every_part_runs_once_per_call_on_its_own_thread() {
        let pool = Pool::new(3).expect("helpers start");
        assert_eq!(pool.threads(), 3);
        for _ in 0..1000 {
            let hits: Vec<AtomicUsize> = (0..3).map(|_| AtomicUsize::new(0)).collect();
            pool.run(&|p| {
                hits[p].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
        assert!(Pool::new(1).is_none());
    }

    #[test]
    fn parked_helpers_wake_for_the_next_call() {
        let pool = Pool::new(2).expect("helpers start");
        std::thread::sleep(SPIN * 3);
        let n = AtomicUsize::new(0);
        pool.run(&|_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn a_helper_panic_reaches_the_caller_and_the_pool_stays_usable() {
        let pool = Pool::new(2).expect("helpers start");
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(&|p| {
                if p == 1 {
                    panic!("part 1 fails");
                }
            })
        }));
        assert!(r.is_err());
        let n = AtomicUsize::new(0);
        pool.run(&|_| {
            n.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(n.load(Ordering::Relaxed), 2);
    }
}
