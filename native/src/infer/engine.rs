//! The rollout engine: continuous batching with prefix reuse, as vLLM and SGLang do it,
//! for the native policy on one device.
//!
//! One thread owns the model. Generation requests from any number of callers (the K
//! rollouts of a group, every episode of a stage, a worker's concurrent jobs) queue up;
//! each iteration the engine admits waiting requests, advances every prefilling sequence
//! by one chunk and then decodes one token for every decoding sequence in one forward
//! pass. Sequences join and leave between iterations. Each keeps its own KV cache
//! ([`SeqKv`]); a finished sequence's cache stays as an idle prefix that the next turn of
//! the same episode, or a sibling rollout with the same prompt, continues from instead of
//! prefilling the conversation again. Idle prefixes beyond `cache_tokens` positions of
//! buffer are evicted, least recently used first, which bounds the cache's memory.
//!
//! **Numerics do not depend on batch composition.** A row of a matrix product comes out
//! bitwise the same whatever the other rows hold *as long as the product's shape is the
//! same* (the tests check this on the backend); a change of shape may switch kernels and
//! round differently. So every pass has a fixed shape: decode steps run `decode_rows`
//! rows (padding the unused ones), prefill runs chunks of `chunk` rows that start at a
//! multiple of `chunk` (padding the last), and attention runs per sequence. A position's
//! keys and values are then a function of the tokens up to it only: copying them from
//! another sequence's cache gives exactly what computing them would, and a rollout's
//! tokens and log-probabilities are the same alone, in a batch of 16, with or without a
//! cache hit. That keeps runs reproducible (a resumed run equals an uninterrupted one) with
//! any number of concurrent episodes. Decode-computed positions (the replies) are not
//! reused: the next turn prefills from the last chunk boundary before them, so that every
//! position a prompt reuses was computed by an aligned prefill chunk.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use tch::Tensor;

use crate::infer::kv::{Segment, SeqKv};
use crate::infer::packed::WeightFormat;
use crate::infer::sampler::{sample_masked, sample_next, top_logprobs, validate, Finish, GenerateOptions, Generation};
use crate::infer::weights::EngineWeights;
use crate::model::Model;
use crate::NativeError;

/// Engine settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineConfig {
    /// Sequences generating at once; further requests wait.
    pub max_batch: usize,
    /// Rows of every decode pass (the fixed shape; more sequences take more passes). The
    /// CPU kernels (`int4`, and `f32` on the CPU) have no fixed shape and decode every sequence in one pass.
    pub decode_rows: usize,
    /// Rows of every prefill chunk (the fixed shape; chunks start at multiples of it). On
    /// the CPU kernels one pass carries a chunk of every prefilling sequence.
    pub chunk: usize,
    /// Positions (buffer capacity, not only the filled part) kept in idle cached prefixes;
    /// the least recently used go beyond it. SmolLM2-135M needs 46 KB per position.
    pub cache_tokens: usize,
    /// The format of the weights decoded with (see [`crate::infer::packed`]): `f32` rolls out with
    /// the learner's numerics (to ~1e-6 nats per token); `bf16` and `int4` trade a measured
    /// mismatch for speed.
    pub weights: WeightFormat,
    /// Threads of the engine's products: the CPU kernels' thread count (`int4`, `f32` on
    /// the CPU), and libtorch's on the engine thread otherwise (`None`: the machine's cores). A thread's
    /// OpenMP team size is its own setting, so the engine sets it on its thread; with
    /// several threads calling into libtorch, teams of more than one thread hand off
    /// through sleeps and a decode pass of hundreds of small operations slows down many
    /// times (see `harness-s bench serve`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub threads: Option<usize>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig { max_batch: 16, decode_rows: 8, chunk: 64, cache_tokens: 8_192, weights: WeightFormat::F32, threads: None }
    }
}

impl EngineConfig {
    pub fn validate(&self) -> Result<(), NativeError> {
        for (field, v) in [("max_batch", self.max_batch), ("decode_rows", self.decode_rows), ("chunk", self.chunk)] {
            if v == 0 {
                return Err(NativeError::Config { field: format!("engine.{field}"), detail: "must be at least 1".into() });
            }
        }
        Ok(())
    }
}

/// Counters since the engine started.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineStats {
    pub requests: u64,
    /// Prompt positions computed by prefill chunks (real rows only).
    pub prefill_tokens: u64,
    /// Prompt positions taken from a cached prefix instead of computed.
    pub reused_tokens: u64,
    /// Prefill passes (one per computed chunk on libtorch; one per step for all the
    /// sequences' chunks on the CPU kernels).
    pub prefill_passes: u64,
    pub prefill_seconds: f64,
    /// Tokens sampled.
    pub decode_tokens: u64,
    /// Decode passes and the real rows they carried (mean batch = rows / passes).
    pub decode_passes: u64,
    pub decode_rows: u64,
    pub decode_seconds: f64,
    pub evicted_prefixes: u64,
    /// Requests dropped because their caller went away (a client that disconnected): they
    /// stop decoding at the next step.
    #[serde(default)]
    pub cancelled: u64,
}

impl EngineStats {
    /// The counters accumulated since `before` (an earlier reading of the same engine).
    pub fn since(&self, before: &EngineStats) -> EngineStats {
        EngineStats {
            requests: self.requests - before.requests,
            prefill_tokens: self.prefill_tokens - before.prefill_tokens,
            reused_tokens: self.reused_tokens - before.reused_tokens,
            prefill_passes: self.prefill_passes - before.prefill_passes,
            prefill_seconds: self.prefill_seconds - before.prefill_seconds,
            decode_tokens: self.decode_tokens - before.decode_tokens,
            decode_passes: self.decode_passes - before.decode_passes,
            decode_rows: self.decode_rows - before.decode_rows,
            decode_seconds: self.decode_seconds - before.decode_seconds,
            evicted_prefixes: self.evicted_prefixes - before.evicted_prefixes,
            cancelled: self.cancelled - before.cancelled,
        }
    }
}

/// Stops generation when it returns true for the tokens so far (stop strings).
pub type StopFn = Box<dyn FnMut(&[u32]) -> bool + Send>;

/// Which tokens may come next (constrained decoding): the engine asks before each draw
/// and reports the token drawn.
pub trait Constraint: Send {
    /// Whether token `id` may come next.
    fn allows(&self, id: u32) -> bool;
    /// Whether the generation may end here (a stop token may come next).
    fn may_stop(&self) -> bool;
    /// Records the token drawn.
    fn advance(&mut self, id: u32);
    /// Sets `allowed[id]` to [`Constraint::allows`] for every token (a constraint may
    /// answer many tokens at once faster than one by one).
    fn mask(&self, allowed: &mut [bool]) {
        for (id, a) in allowed.iter_mut().enumerate() {
            *a = self.allows(id as u32);
        }
    }
}

/// One generation.
pub struct Request {
    pub prompt: Vec<u32>,
    pub opts: GenerateOptions,
    pub stop_ids: Vec<u32>,
    pub should_stop: Option<StopFn>,
    /// Also record this many most likely tokens at each position (0: none).
    pub top_logprobs: usize,
    /// Draw only tokens this allows.
    pub constraint: Option<Box<dyn Constraint>>,
}

impl Request {
    /// A generation of `prompt` with no stop tokens and no top log-probabilities.
    pub fn new(prompt: Vec<u32>, opts: GenerateOptions) -> Self {
        Request { prompt, opts, stop_ids: vec![], should_stop: None, top_logprobs: 0, constraint: None }
    }
}

type Reply = tokio::sync::oneshot::Sender<Result<Generation, NativeError>>;

enum Msg {
    Generate(Request, Reply),
    Stats(mpsc::Sender<EngineStats>),
}

/// Handle to the engine thread. Dropping the last handle stops the thread after the
/// requests in flight.
pub struct Engine {
    tx: Mutex<mpsc::Sender<Msg>>,
    thread: Option<JoinHandle<()>>,
}

impl Engine {
    /// Starts the engine thread with `model`.
    pub fn start(model: Model, config: EngineConfig) -> Result<Arc<Engine>, NativeError> {
        config.validate()?;
        let threads = config.threads.unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
        let weights = EngineWeights::new(&model, config.weights, threads)?;
        let (tx, rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("native-engine".into())
            .spawn(move || {
                if weights.cpu_kernels() {
                    // the CPU kernels: libtorch only samples here, one row at a time
                    crate::infer::threads::torch_on_this_thread_alone();
                } else if let Some(n) = config.threads {
                    tch::set_num_threads(n as i32);
                }
                let _g = tch::no_grad_guard();
                Worker {
                    model,
                    weights,
                    config,
                    seqs: vec![],
                    idle: vec![],
                    waiting: VecDeque::new(),
                    stats: EngineStats::default(),
                    clock: 0,
                }
                .run(rx)
            })
            .map_err(|e| NativeError::Config { field: "engine".into(), detail: format!("cannot start the engine thread: {e}") })?;
        Ok(Arc::new(Engine { tx: Mutex::new(tx), thread: Some(thread) }))
    }

    fn send(&self, m: Msg) -> bool {
        self.tx.lock().unwrap_or_else(|p| p.into_inner()).send(m).is_ok()
    }

    /// Queues a generation; the receiver gets its result.
    pub fn submit(&self, req: Request) -> tokio::sync::oneshot::Receiver<Result<Generation, NativeError>> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        // A stopped engine drops the reply sender, which the receiver reports.
        let _ = self.send(Msg::Generate(req, tx));
        rx
    }

    /// Generates and waits (for synchronous callers: benches, tests).
    pub fn generate(&self, req: Request) -> Result<Generation, NativeError> {
        self.submit(req).blocking_recv().unwrap_or_else(|_| Err(stopped()))
    }

    pub fn stats(&self) -> EngineStats {
        let (tx, rx) = mpsc::channel();
        if self.send(Msg::Stats(tx)) {
            rx.recv().unwrap_or_default()
        } else {
            EngineStats::default()
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // Closing the channel ends the thread's loop once its work is done.
        let (dead, _) = mpsc::channel();
        *self.tx.lock().unwrap_or_else(|p| p.into_inner()) = dead;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn stopped() -> NativeError {
    NativeError::Config { field: "engine".into(), detail: "the generation engine stopped (a panic in its thread); see the log".into() }
}

enum Phase {
    /// Positions `0..cache.len()` are computed; the next chunk starts there.
    Prefill,
    /// `next` was sampled and is fed at the next decode pass.
    Decode { next: u32 },
}

struct Seq {
    req: Request,
    reply: Reply,
    rng: ChaCha8Rng,
    cache: SeqKv,
    out: Generation,
    phase: Phase,
}

/// A finished sequence's cache, kept for reuse: positions `0..prefilled` of `prompt` came
/// from aligned prefill chunks (the reply's positions are never reused).
struct Idle {
    cache: SeqKv,
    prompt: Vec<u32>,
    prefilled: usize,
    last_used: u64,
}

struct Worker {
    model: Model,
    weights: EngineWeights,
    config: EngineConfig,
    seqs: Vec<Seq>,
    idle: Vec<Idle>,
    waiting: VecDeque<(Request, Reply)>,
    stats: EngineStats,
    clock: u64,
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl Worker {
    fn run(mut self, rx: mpsc::Receiver<Msg>) {
        loop {
            if self.seqs.is_empty() && self.waiting.is_empty() {
                match rx.recv() {
                    Ok(m) => self.handle(m),
                    Err(_) => return,
                }
            }
            while let Ok(m) = rx.try_recv() {
                self.handle(m);
            }
            self.cancel_abandoned();
            self.admit();
            self.prefill();
            self.decode();
            self.evict();
        }
    }

    fn handle(&mut self, m: Msg) {
        match m {
            Msg::Generate(req, reply) => self.waiting.push_back((req, reply)),
            Msg::Stats(tx) => {
                let _ = tx.send(self.stats.clone());
            }
        }
    }

    /// Drops the requests whose caller no longer waits for the reply (its receiver is gone:
    /// an HTTP client that disconnected, a rollout that was cancelled): nothing decodes for
    /// nobody. A dropped sequence's computed prefix stays as an idle prefix.
    fn cancel_abandoned(&mut self) {
        let before = self.waiting.len();
        self.waiting.retain(|(_, reply)| !reply.is_closed());
        self.stats.cancelled += (before - self.waiting.len()) as u64;
        for i in (0..self.seqs.len()).rev() {
            if self.seqs[i].reply.is_closed() {
                self.stats.cancelled += 1;
                self.finish(i, Err(NativeError::Config { field: "engine".into(), detail: "cancelled: the caller went away".into() }));
            }
        }
    }

    fn limit(&self) -> usize {
        self.model.max_positions()
    }

    /// Positions of `prompt` that may come from a cache whose first `prefilled` positions
    /// match it for `common` tokens: whole chunks, and never the prompt's last chunk (its
    /// last row gives the first token's logits).
    fn reusable(&self, prompt: &[u32], common: usize, prefilled: usize) -> usize {
        let c = self.config.chunk;
        let cap = (prompt.len() - 1) / c * c;
        (common.min(prefilled) / c * c).min(cap)
    }

    fn admit(&mut self) {
        while self.seqs.len() < self.config.max_batch {
            let Some((req, reply)) = self.waiting.pop_front() else { return };
            self.stats.requests += 1;
            if let Err(e) = validate(&req.prompt, &req.opts, self.limit()) {
                let _ = reply.send(Err(e));
                continue;
            }
            // Continue from the idle prefix that covers most of the prompt, if any.
            let best = self
                .idle
                .iter()
                .enumerate()
                .map(|(i, e)| (self.reusable(&req.prompt, common_prefix(&e.prompt, &req.prompt), e.prefilled), i))
                .max();
            let cache = match best {
                Some((n, i)) if n > 0 => {
                    let mut e = self.idle.swap_remove(i);
                    e.cache.truncate(n);
                    self.stats.reused_tokens += n as u64;
                    e.cache
                }
                // room for the padded last prefill chunk and every reply token the context takes
                // (a reply ends at the context's end, whatever max_tokens says)
                _ => SeqKv::new(
                    &self.model,
                    (req.prompt.len().div_ceil(self.config.chunk) * self.config.chunk)
                        .max(req.prompt.len().saturating_add(req.opts.max_tokens).min(self.limit())),
                ),
            };
            let rng = ChaCha8Rng::seed_from_u64(req.opts.seed);
            self.seqs.push(Seq { req, reply, rng, cache, out: Generation::empty(), phase: Phase::Prefill });
        }
    }

    /// Advances every prefilling sequence by one chunk: copied from another sequence's or an
    /// idle prefix's cache when one holds the same tokens there, computed otherwise.
    fn prefill(&mut self) {
        let started = Instant::now();
        if self.weights.rows_alone() {
            self.prefill_together();
        } else {
            self.prefill_each();
        }
        self.stats.prefill_seconds += started.elapsed().as_secs_f64();
    }

    /// [`Worker::prefill`] on kernels that compute every row alone: all the computed chunks
    /// go into one pass (the weights are read once for all of them, and no padding rows),
    /// with the same results as one pass each. A chunk that another sequence in the pass
    /// computes (the K rollouts of a group share their prompt) is copied from it after the
    /// pass instead.
    fn prefill_together(&mut self) {
        let c = self.config.chunk;
        // (sequence, from, to)
        let mut pass: Vec<(usize, usize, usize)> = vec![];
        let mut copy_after = vec![];
        for i in 0..self.seqs.len() {
            if !matches!(self.seqs[i].phase, Phase::Prefill) {
                continue;
            }
            let from = self.seqs[i].cache.len();
            let prompt = &self.seqs[i].req.prompt;
            let to = (from + c).min(prompt.len());
            if to < prompt.len() {
                if self.copy_chunk(i, from, to) {
                    continue;
                }
                let prompt = &self.seqs[i].req.prompt[..to];
                if pass.iter().any(|&(j, f, t)| (f, t) == (from, to) && self.seqs[j].req.prompt[..to] == *prompt) {
                    copy_after.push((i, from, to));
                    continue;
                }
            }
            pass.push((i, from, to));
        }
        if pass.is_empty() {
            return;
        }
        let mut ids = vec![];
        let mut picks = vec![];
        // pass rows of the sequences whose prompt ends in this chunk (their first token's logits)
        let mut last = vec![];
        for &(i, from, to) in &pass {
            picks.push((i, ids.len(), to - from));
            ids.extend_from_slice(&self.seqs[i].req.prompt[from..to]);
            if to == self.seqs[i].req.prompt.len() {
                last.push((i, ids.len() - 1));
            }
        }
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            let mut segs = segments(&mut self.seqs, &picks);
            let h = self.weights.forward(&self.model, &ids, &mut segs);
            let rows: Vec<i64> = last.iter().map(|&(_, r)| r as i64).collect();
            (!rows.is_empty()).then(|| self.weights.logits_of(&self.model, &h.index_select(0, &Tensor::from_slice(&rows))))
        }));
        self.stats.prefill_tokens += ids.len() as u64;
        self.stats.prefill_passes += 1;
        match outcome {
            Ok(logits) => {
                for &(i, _, to) in &pass {
                    if to.is_multiple_of(c) {
                        self.seqs[i].cache.keep_state();
                    }
                }
                for (i, from, to) in copy_after {
                    self.copy_chunk(i, from, to);
                }
                // `pass` and `last` are in index order; highest first, so that a finished
                // sequence's removal keeps the others' indices
                if let Some(logits) = logits {
                    for (k, &(i, _)) in last.iter().enumerate().rev() {
                        self.sample(i, &logits.get(k as i64));
                    }
                }
            }
            Err(p) => {
                let text = panic_text(p);
                for &(i, _, _) in pass.iter().rev() {
                    self.fail(i, text.clone());
                }
            }
        }
    }

    /// [`Worker::prefill`] one sequence at a time, each chunk a pass of `chunk` rows.
    fn prefill_each(&mut self) {
        let c = self.config.chunk;
        let mut i = 0;
        while i < self.seqs.len() {
            if !matches!(self.seqs[i].phase, Phase::Prefill) {
                i += 1;
                continue;
            }
            let from = self.seqs[i].cache.len();
            let prompt_len = self.seqs[i].req.prompt.len();
            let to = (from + c).min(prompt_len);
            if to < prompt_len && self.copy_chunk(i, from, to) {
                i += 1;
                continue;
            }
            let result = catch_unwind(AssertUnwindSafe(|| {
                let s = &mut self.seqs[i];
                let mut ids = s.req.prompt[from..to].to_vec();
                ids.resize(c, 0);
                let real = to - from;
                let mut seg = [Segment { cache: &mut s.cache, first: 0, rows: c, attend: real }];
                let h = self.weights.forward(&self.model, &ids, &mut seg);
                if to.is_multiple_of(c) {
                    s.cache.keep_state();
                }
                (to == prompt_len).then(|| self.weights.logits_of(&self.model, &h.narrow(0, real as i64 - 1, 1)).squeeze_dim(0))
            }));
            self.stats.prefill_tokens += (to - from) as u64;
            self.stats.prefill_passes += 1;
            match result {
                Ok(None) => i += 1,
                Ok(Some(logits)) => {
                    if self.sample(i, &logits) {
                        i += 1;
                    }
                }
                Err(p) => self.fail(i, panic_text(p)),
            }
        }
    }

    /// Copies positions `from..to` of sequence `i`'s prompt from a cache that holds them
    /// (prefill-computed, same tokens up to `to`). False when none does.
    fn copy_chunk(&mut self, i: usize, from: usize, to: usize) -> bool {
        let prompt = &self.seqs[i].req.prompt[..to];
        let covers = |tokens: &[u32], prefilled: usize| prefilled >= to && tokens.len() >= to && tokens[..to] == *prompt;
        let donor_seq = (0..self.seqs.len()).find(|&j| {
            j != i && {
                let d = &self.seqs[j];
                let prefilled = match d.phase {
                    Phase::Prefill => d.cache.len(),
                    Phase::Decode { .. } => d.req.prompt.len(),
                };
                covers(&d.req.prompt, prefilled)
            }
        });
        if let Some(j) = donor_seq {
            let (a, b) = if i < j {
                let (x, y) = self.seqs.split_at_mut(j);
                (&mut x[i], &y[0])
            } else {
                let (x, y) = self.seqs.split_at_mut(i);
                (&mut y[0], &x[j])
            };
            a.cache.copy_range(&b.cache, from, to);
        } else if let Some(e) = self.idle.iter_mut().find(|e| covers(&e.prompt, e.prefilled)) {
            e.last_used = self.clock;
            self.seqs[i].cache.copy_range(&e.cache, from, to);
        } else {
            return false;
        }
        self.stats.reused_tokens += (to - from) as u64;
        true
    }

    /// One decode pass per `decode_rows` decoding sequences (one for all of them on kernels
    /// that compute every row alone: no fixed shape to keep).
    fn decode(&mut self) {
        let started = Instant::now();
        let active: Vec<usize> = (0..self.seqs.len()).filter(|&i| matches!(self.seqs[i].phase, Phase::Decode { .. })).collect();
        let rows = if self.weights.rows_alone() { active.len().max(1) } else { self.config.decode_rows };
        let mut results: Vec<(usize, Result<Tensor, String>)> = vec![];
        for group in active.chunks(rows) {
            let mut ids = vec![0u32; rows];
            for (r, &i) in group.iter().enumerate() {
                if let Phase::Decode { next } = self.seqs[i].phase {
                    ids[r] = next;
                }
            }
            let outcome = catch_unwind(AssertUnwindSafe(|| {
                let picks: Vec<(usize, usize, usize)> = group.iter().enumerate().map(|(r, &i)| (i, r, 1)).collect();
                let mut segs = segments(&mut self.seqs, &picks);
                let h = self.weights.forward(&self.model, &ids, &mut segs);
                self.weights.logits_of(&self.model, &h)
            }));
            self.stats.decode_passes += 1;
            self.stats.decode_rows += group.len() as u64;
            match outcome {
                Ok(logits) => {
                    for (r, &i) in group.iter().enumerate() {
                        results.push((i, Ok(logits.get(r as i64))));
                    }
                }
                Err(p) => {
                    let text = panic_text(p);
                    results.extend(group.iter().map(|&i| (i, Err(text.clone()))));
                }
            }
        }
        self.stats.decode_seconds += started.elapsed().as_secs_f64();
        // Highest index first, so that removing a finished sequence keeps the others' indices.
        results.sort_by_key(|r| std::cmp::Reverse(r.0));
        for (i, r) in results {
            match r {
                Ok(logits) => {
                    self.sample(i, &logits);
                }
                Err(text) => self.fail(i, text),
            }
        }
    }

    /// Samples sequence `i`'s next token from `logits`; finishes the sequence when it stops.
    /// True when the sequence goes on.
    fn sample(&mut self, i: usize, logits: &Tensor) -> bool {
        let limit = self.limit();
        let s = &mut self.seqs[i];
        let drawn = match s.req.constraint.as_ref() {
            None => sample_next(logits, &s.req.opts, &mut s.rng),
            Some(c) => {
                let vocab = logits.size()[0] as u32;
                let stops = &s.req.stop_ids;
                let mask = catch_unwind(AssertUnwindSafe(|| {
                    let mut allowed = vec![false; vocab as usize];
                    c.mask(&mut allowed);
                    let may_stop = c.may_stop();
                    for &id in stops {
                        if let Some(a) = allowed.get_mut(id as usize) {
                            *a = may_stop;
                        }
                    }
                    allowed
                }));
                match mask {
                    Ok(allowed) => sample_masked(logits, &s.req.opts, &mut s.rng, &allowed),
                    Err(p) => {
                        self.fail(i, format!("the decoding constraint panicked: {}", panic_text(p)));
                        return false;
                    }
                }
            }
        };
        let (token, logprob) = match drawn {
            Ok(x) => x,
            Err(e) => {
                self.finish(i, Err(e));
                return false;
            }
        };
        self.stats.decode_tokens += 1;
        let s = &mut self.seqs[i];
        let top = match s.req.top_logprobs {
            0 => None,
            k => match top_logprobs(logits, &s.req.opts, k) {
                Ok(t) => Some(t),
                Err(e) => {
                    self.finish(i, Err(e));
                    return false;
                }
            },
        };
        let s = &mut self.seqs[i];
        if s.req.stop_ids.contains(&token) {
            s.out.finish = Finish::Stop;
            s.out.stop_token = Some(token);
            return self.done(i);
        }
        if let Some(c) = s.req.constraint.as_mut() {
            c.advance(token);
        }
        s.out.tokens.push(token);
        s.out.logprobs.push(logprob);
        s.out.top_logprobs.extend(top);
        let stop = match s.req.should_stop.as_mut() {
            Some(f) => match catch_unwind(AssertUnwindSafe(|| f(&s.out.tokens))) {
                Ok(b) => b,
                Err(p) => {
                    self.fail(i, format!("the stop check panicked: {}", panic_text(p)));
                    return false;
                }
            },
            None => false,
        };
        let s = &mut self.seqs[i];
        if stop {
            s.out.finish = Finish::Stop;
            return self.done(i);
        }
        if s.out.tokens.len() >= s.req.opts.max_tokens || s.req.prompt.len() + s.out.tokens.len() >= limit {
            s.out.finish = Finish::Length;
            return self.done(i);
        }
        s.phase = Phase::Decode { next: token };
        true
    }

    fn done(&mut self, i: usize) -> bool {
        let out = std::mem::replace(&mut self.seqs[i].out, Generation::empty());
        self.finish(i, Ok(out));
        false
    }

    fn fail(&mut self, i: usize, text: String) {
        tracing::warn!(error = %text, "a generation failed in the engine; the other sequences go on");
        self.finish(i, Err(NativeError::Config { field: "engine".into(), detail: format!("generation failed: {text}") }));
    }

    /// Removes sequence `i`, replies, and keeps its cache as an idle prefix.
    fn finish(&mut self, i: usize, result: Result<Generation, NativeError>) {
        let s = self.seqs.swap_remove(i);
        // the positions of an unfinished prefill are prefill-computed too
        let prefilled = s.cache.len().min(s.req.prompt.len());
        let _ = s.reply.send(result);
        self.clock += 1;
        if prefilled >= self.config.chunk {
            self.idle.push(Idle { cache: s.cache, prompt: s.req.prompt, prefilled, last_used: self.clock });
        }
    }

    /// Drops the least recently used idle prefixes beyond the token cap.
    fn evict(&mut self) {
        let mut held: usize = self.idle.iter().map(|e| e.cache.capacity()).sum();
        while held > self.config.cache_tokens {
            let Some((k, _)) = self.idle.iter().enumerate().min_by_key(|(_, e)| e.last_used) else { break };
            held -= self.idle[k].cache.capacity();
            self.idle.swap_remove(k);
            self.stats.evicted_prefixes += 1;
        }
    }
}

/// Pass segments over the caches of `seqs[i]` for each `(i, first row, rows)` of `picks`
/// (`i` ascending; every row real).
fn segments<'a>(seqs: &'a mut [Seq], picks: &[(usize, usize, usize)]) -> Vec<Segment<'a>> {
    let mut segs = vec![];
    let mut rest: &mut [Seq] = seqs;
    let mut base = 0;
    for &(i, first, rows) in picks {
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(i - base);
        let (s, after) = tail.split_first_mut().expect("index in range");
        segs.push(Segment { cache: &mut s.cache, first, rows, attend: rows });
        rest = after;
        base = i + 1;
    }
    segs
}

fn panic_text(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_else(|| "panic".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::infer::sampler::generate;
    use crate::model::qwen3_5::{Qwen35, Qwen35Config};
    use crate::model::{Llama, LlamaConfig};
    use tch::Device;

    fn model() -> Model {
        Llama::new(LlamaConfig::tiny(64, 32, 2), Device::Cpu, 5).unwrap().into()
    }

    /// A tiny Qwen3.5: GDN layers and gated attention, on the model's own pass.
    fn hybrid() -> Model {
        Qwen35::new(Qwen35Config::shape("tiny", Some(64)).unwrap(), Device::Cpu, 5).unwrap().into()
    }

    fn small() -> EngineConfig {
        EngineConfig { max_batch: 6, decode_rows: 4, chunk: 4, cache_tokens: 1_000, weights: WeightFormat::F32, threads: None }
    }

    fn req(prompt: Vec<u32>, seed: u64, max_tokens: usize) -> Request {
        Request::new(prompt, GenerateOptions { max_tokens, temperature: 1.0, top_p: 0.95, seed })
    }

    fn prompt(n: usize, salt: u32) -> Vec<u32> {
        (0..n as u32).map(|i| (i * 7 + salt) % 60 + 1).collect()
    }

    /// Alone on a fresh engine.
    fn alone(r: Request, config: &EngineConfig) -> Generation {
        alone_on(model, r, config)
    }

    fn alone_on(make: fn() -> Model, r: Request, config: &EngineConfig) -> Generation {
        Engine::start(make(), config.clone()).unwrap().generate(r).unwrap()
    }

    /// Sequences of different lengths join while another is decoding; each comes out
    /// bitwise as it does alone, and with float32 weights within 1e-4 of the single-stream
    /// sampler.
    fn batched_generation_equals_generation_alone(weights: WeightFormat, make: fn() -> Model) {
        let config = EngineConfig { weights, ..small() };
        let engine = Engine::start(make(), config.clone()).unwrap();
        let (started_tx, started_rx) = mpsc::channel();
        let mut first = req(prompt(9, 1), 1, 24);
        let started = Mutex::new(Some(started_tx));
        first.should_stop = Some(Box::new(move |ids: &[u32]| {
            if ids.len() == 5 {
                if let Some(tx) = started.lock().unwrap().take() {
                    let _ = tx.send(());
                }
            }
            false
        }));
        let a = engine.submit(first);
        started_rx.recv().unwrap();
        let others: Vec<_> = [(3, 2), (14, 3), (6, 4), (11, 5), (2, 6), (17, 7)]
            .iter()
            .map(|&(n, s)| (n, s, engine.submit(req(prompt(n, s as u32), s, 16))))
            .collect();
        let a = a.blocking_recv().unwrap().unwrap();
        assert_eq!(a.tokens.len(), 24);
        assert_eq!(a.tokens, alone_on(make, req(prompt(9, 1), 1, 24), &config).tokens);
        let stats = engine.stats();
        for (n, s, rx) in others {
            let got = rx.blocking_recv().unwrap().unwrap();
            let want = alone_on(make, req(prompt(n, s as u32), s, 16), &config);
            assert_eq!(got.tokens, want.tokens, "prompt of {n} tokens");
            assert_eq!(got.logprobs, want.logprobs, "prompt of {n} tokens: log-probabilities differ bitwise");
            if weights != WeightFormat::F32 {
                continue;
            }
            // against the single-stream sampler (another code path, other shapes)
            let single = generate(&make(), &prompt(n, s as u32), &req(vec![], s, 16).opts, &[]).unwrap();
            let shared = got.tokens.iter().zip(&single.tokens).take_while(|(x, y)| x == y).count();
            for j in 0..shared {
                assert!((got.logprobs[j] - single.logprobs[j]).abs() < 1e-4, "token {j}: {} vs {}", got.logprobs[j], single.logprobs[j]);
            }
            assert!(shared >= 8, "engine and single-stream sampling part after {shared} tokens");
        }
        assert!(stats.decode_rows > stats.decode_passes, "sequences were decoded together: {stats:?}");
    }

    #[test]
    fn batched_generation_equals_generation_alone_f32() {
        batched_generation_equals_generation_alone(WeightFormat::F32, model);
    }

    #[test]
    fn hybrid_batched_generation_equals_generation_alone() {
        batched_generation_equals_generation_alone(WeightFormat::F32, hybrid);
    }

    #[test]
    fn batched_generation_equals_generation_alone_bf16() {
        batched_generation_equals_generation_alone(WeightFormat::Bf16, model);
    }

    #[test]
    fn batched_generation_equals_generation_alone_int4() {
        batched_generation_equals_generation_alone(WeightFormat::Int4, model);
    }

    /// With 64-value heads (the SIMD attention path), several kernel threads and a mix of
    /// prefilling and decoding sequences, int4 generations are still bitwise those alone.
    #[test]
    fn int4_with_wide_heads_and_threads_equals_generation_alone() {
        let wide = || {
            Model::from(
                Llama::new(LlamaConfig { num_attention_heads: 4, num_key_value_heads: 2, ..LlamaConfig::tiny(96, 256, 2) }, Device::Cpu, 9)
                    .unwrap(),
            )
        };
        let config = EngineConfig { weights: WeightFormat::Int4, threads: Some(2), ..small() };
        let engine = Engine::start(wide(), config.clone()).unwrap();
        let rxs: Vec<_> = [(5, 1), (19, 2), (2, 3), (33, 4), (9, 5)]
            .iter()
            .map(|&(n, s)| (n, s, engine.submit(req(prompt(n, s as u32), s, 12))))
            .collect();
        for (n, s, rx) in rxs {
            let got = rx.blocking_recv().unwrap().unwrap();
            let one = Engine::start(wide(), EngineConfig { threads: Some(1), ..config.clone() }).unwrap();
            let want = one.generate(req(prompt(n, s as u32), s, 12)).unwrap();
            assert_eq!((got.tokens, got.logprobs), (want.tokens, want.logprobs), "prompt of {n} tokens");
        }
        // and close to the float32 engine on the first token
        let f32_first = Engine::start(wide(), small()).unwrap().generate(Request::new(prompt(10, 3), GenerateOptions::greedy(1))).unwrap();
        let int4_first = Engine::start(wide(), config).unwrap().generate(Request::new(prompt(10, 3), GenerateOptions::greedy(1))).unwrap();
        let d = (f32_first.logprobs[0] - int4_first.logprobs[0]).abs();
        assert!(d < 0.5 && d > 0.0, "|Δ log p| = {d}");
    }

    /// Cheaper formats round, but stay close to the float32 engine: the first token's
    /// log-probabilities of a greedy decode agree to the format's precision.
    #[test]
    fn cheaper_weight_formats_stay_close_to_float32() {
        let f32_first = alone(Request::new(prompt(10, 3), GenerateOptions::greedy(1)), &small());
        for (weights, tol) in [(WeightFormat::Bf16, 0.05), (WeightFormat::Int4, 0.5)] {
            let got = alone(Request::new(prompt(10, 3), GenerateOptions::greedy(1)), &EngineConfig { weights, ..small() });
            let d = (got.logprobs[0] - f32_first.logprobs[0]).abs();
            assert!(d < tol && d > 0.0, "{weights:?}: |Δ log p| = {d}");
        }
    }

    /// Greedy decoding through the engine equals the single-stream sampler's wherever the
    /// top-2 logit margin is above the tolerance.
    #[test]
    fn greedy_matches_the_single_stream_sampler() {
        greedy_matches_the_single_stream_sampler_on(model);
        greedy_matches_the_single_stream_sampler_on(hybrid);
    }

    fn greedy_matches_the_single_stream_sampler_on(model: fn() -> Model) {
        let engine = Engine::start(model(), small()).unwrap();
        let rxs: Vec<_> = (0..5).map(|s| engine.submit(Request::new(prompt(5 + 3 * s, s as u32), GenerateOptions::greedy(12)))).collect();
        for (s, rx) in rxs.into_iter().enumerate() {
            let got = rx.blocking_recv().unwrap().unwrap();
            let want = generate(&model(), &prompt(5 + 3 * s, s as u32), &GenerateOptions::greedy(12), &[]).unwrap();
            assert_eq!(got.tokens, want.tokens);
            for (x, y) in got.logprobs.iter().zip(&want.logprobs) {
                assert!((x - y).abs() < 1e-4);
            }
        }
    }

    /// The second turn of a conversation continues from the first turn's cached prefix:
    /// fewer positions prefilled, the same result as a cold engine, also when the cache is
    /// too small to keep anything.
    #[test]
    fn prefix_reuse_gives_the_cold_result() {
        prefix_reuse_gives_the_cold_result_on(model);
    }

    /// A hybrid model's prefix continues from the GDN state kept at its last chunk boundary.
    #[test]
    fn hybrid_prefix_reuse_gives_the_cold_result() {
        prefix_reuse_gives_the_cold_result_on(hybrid);
    }

    fn prefix_reuse_gives_the_cold_result_on(model: fn() -> Model) {
        let alone = |r, c: &EngineConfig| alone_on(model, r, c);
        let turn1 = prompt(13, 3);
        let engine = Engine::start(model(), small()).unwrap();
        let g1 = engine.generate(req(turn1.clone(), 1, 6)).unwrap();
        let mut turn2 = turn1.clone();
        turn2.extend(&g1.tokens);
        turn2.extend([9, 9, 4, 2, 7]);
        let before = engine.stats();
        let warm = engine.generate(req(turn2.clone(), 2, 8)).unwrap();
        let after = engine.stats();
        // 13 prompt positions were prefill-computed: 12 (three chunks) are reused
        assert_eq!(after.reused_tokens - before.reused_tokens, 12);
        assert_eq!(after.prefill_tokens - before.prefill_tokens, (turn2.len() - 12) as u64);
        let cold = alone(req(turn2.clone(), 2, 8), &small());
        assert_eq!((warm.tokens.clone(), warm.logprobs.clone()), (cold.tokens.clone(), cold.logprobs.clone()));
        // a cache with no room evicts at once and still gives the same result
        let tight = Engine::start(model(), EngineConfig { cache_tokens: 0, ..small() }).unwrap();
        tight.generate(req(turn1, 1, 6)).unwrap();
        let evicted = tight.generate(req(turn2, 2, 8)).unwrap();
        assert_eq!(tight.stats().reused_tokens, 0);
        assert!(tight.stats().evicted_prefixes >= 1);
        assert_eq!((evicted.tokens, evicted.logprobs), (cold.tokens, cold.logprobs));
    }

    /// K rollouts of one prompt share its prefill: chunks are copied, not recomputed (on the
    /// CPU kernels too, where the rollouts' chunks would otherwise share one pass).
    fn a_group_shares_its_prompt_prefill(weights: WeightFormat, model: fn() -> Model) {
        let alone = |r, c: &EngineConfig| alone_on(model, r, c);
        let config = EngineConfig { weights, ..small() };
        let engine = Engine::start(model(), config.clone()).unwrap();
        let p = prompt(21, 8);
        let rxs: Vec<_> = (0..4).map(|k| engine.submit(req(p.clone(), k, 5))).collect();
        let outs: Vec<Generation> = rxs.into_iter().map(|rx| rx.blocking_recv().unwrap().unwrap()).collect();
        let st = engine.stats();
        // 21 positions: the first rollout computes them; the others copy 20 (five chunks)
        // and compute the last chunk's one position
        assert_eq!(st.reused_tokens, 3 * 20, "{st:?}");
        assert_eq!(st.prefill_tokens, 21 + 3, "{st:?}");
        for (k, o) in outs.iter().enumerate() {
            let want = alone(req(p.clone(), k as u64, 5), &config);
            assert_eq!((&o.tokens, &o.logprobs), (&want.tokens, &want.logprobs));
        }
    }

    #[test]
    fn a_group_shares_its_prompt_prefill_f32() {
        a_group_shares_its_prompt_prefill(WeightFormat::F32, model);
        a_group_shares_its_prompt_prefill(WeightFormat::F32, hybrid);
    }

    #[test]
    fn a_group_shares_its_prompt_prefill_int4() {
        a_group_shares_its_prompt_prefill(WeightFormat::Int4, model);
    }

    /// On the CPU kernels every prefilling sequence's chunk goes into one pass and every
    /// decoding sequence into one decode pass, with the results each has alone.
    #[test]
    fn int4_puts_all_sequences_of_a_step_in_one_pass() {
        let config = EngineConfig { weights: WeightFormat::Int4, threads: Some(2), max_batch: 6, decode_rows: 2, ..small() };
        let engine = Engine::start(model(), config.clone()).unwrap();
        let before = engine.stats();
        let (go_tx, go_rx) = mpsc::channel::<()>();
        // a first request holds the engine in its stop check until the others are queued,
        // so that all six are admitted in the same step
        let go = Mutex::new(Some(go_rx));
        let mut first = req(prompt(8, 40), 40, 6);
        first.should_stop = Some(Box::new(move |_: &[u32]| {
            if let Some(rx) = go.lock().unwrap().take() {
                let _ = rx.recv();
            }
            false
        }));
        let a = engine.submit(first);
        let sizes = [(12, 41), (8, 42), (16, 43), (5, 44), (12, 45)];
        let rxs: Vec<_> = sizes.iter().map(|&(n, s)| (n, s, engine.submit(req(prompt(n, s as u32), s, 6)))).collect();
        go_tx.send(()).unwrap();
        let mut outs = vec![(8, 40, a.blocking_recv().unwrap().unwrap())];
        outs.extend(rxs.into_iter().map(|(n, s, rx)| (n, s, rx.blocking_recv().unwrap().unwrap())));
        let st = engine.stats().since(&before);
        // prompts of up to 16 tokens in chunks of 4: the five later ones need at most four passes
        assert!(st.prefill_passes <= 2 + 4, "{st:?}");
        assert!(st.decode_rows > 2 * st.decode_passes, "more than decode_rows rows per pass: {st:?}");
        for (n, s, got) in outs {
            let want = alone(req(prompt(n, s as u32), s, 6), &config);
            assert_eq!((got.tokens, got.logprobs), (want.tokens, want.logprobs), "prompt of {n} tokens");
        }
    }

    /// A bad setting or a panicking stop check fails that request only.
    #[test]
    fn one_failing_request_leaves_the_others_alone() {
        let engine = Engine::start(model(), small()).unwrap();
        let good = engine.submit(req(prompt(7, 1), 1, 10));
        let mut bad = req(prompt(7, 2), 2, 10);
        bad.opts.top_p = 0.0;
        let bad = engine.submit(bad);
        let mut panics = req(prompt(9, 3), 3, 10);
        panics.should_stop = Some(Box::new(|ids: &[u32]| if ids.len() == 3 { panic!("stop check broke") } else { false }));
        let panics = engine.submit(panics);
        let err = bad.blocking_recv().unwrap().unwrap_err().to_string();
        assert!(err.contains("top_p"), "{err}");
        let err = panics.blocking_recv().unwrap().unwrap_err().to_string();
        assert!(err.contains("stop check broke"), "{err}");
        assert_eq!(good.blocking_recv().unwrap().unwrap().tokens, alone(req(prompt(7, 1), 1, 10), &small()).tokens);
        let after = engine.generate(req(prompt(5, 4), 4, 4)).unwrap();
        assert_eq!(after.tokens.len(), 4);
    }

    /// A request whose caller goes away stops decoding at the next step; the engine serves
    /// the next request as before.
    #[test]
    fn an_abandoned_request_stops_decoding() {
        let engine = Engine::start(model(), small()).unwrap();
        let limit = model().max_positions();
        let long = engine.submit(req(prompt(5, 1), 1, limit - 5));
        while engine.stats().decode_tokens == 0 {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        drop(long);
        // and one dropped before the engine saw it
        drop(engine.submit(req(prompt(6, 2), 2, limit - 6)));
        let after = engine.generate(req(prompt(5, 4), 4, 4)).unwrap();
        assert_eq!(after.tokens, alone(req(prompt(5, 4), 4, 4), &small()).tokens);
        let stats = engine.stats();
        assert_eq!(stats.cancelled, 2, "{stats:?}");
        assert!(stats.decode_tokens < (limit - 5) as u64, "the abandoned request decoded to its end: {stats:?}");
    }

    /// Tokens a constraint allows: only even ids here, and no stop until 6 tokens.
    struct Even(usize);

    impl Constraint for Even {
        fn allows(&self, id: u32) -> bool {
            id.is_multiple_of(2)
        }
        fn may_stop(&self) -> bool {
            self.0 >= 6
        }
        fn advance(&mut self, _id: u32) {
            self.0 += 1;
        }
    }

    #[test]
    fn a_constraint_decides_what_is_drawn_and_the_logprobs_stay_the_models() {
        let engine = Engine::start(model(), small()).unwrap();
        let mut r = req(prompt(7, 3), 9, 12);
        r.constraint = Some(Box::new(Even(0)));
        let got = engine.generate(r).unwrap();
        assert_eq!(got.tokens.len(), 12);
        assert!(got.tokens.iter().all(|t| t.is_multiple_of(2)), "{:?}", got.tokens);
        // The first token's log q is the model's own, unmasked, distribution's.
        let logits = crate::infer::sampler::next_token_logits(&model(), &prompt(7, 3)).unwrap();
        let lp = Tensor::from_slice(&logits).log_softmax(-1, tch::Kind::Float);
        let want = lp.double_value(&[got.tokens[0] as i64]) as f32;
        assert!((got.logprobs[0] - want).abs() < 1e-4, "{} vs {want}", got.logprobs[0]);
        // A constraint that panics fails its own request only.
        struct Panics;
        impl Constraint for Panics {
            fn allows(&self, _id: u32) -> bool {
                panic!("broken grammar")
            }
            fn may_stop(&self) -> bool {
                false
            }
            fn advance(&mut self, _id: u32) {}
        }
        let mut bad = req(prompt(5, 1), 1, 4);
        bad.constraint = Some(Box::new(Panics));
        let err = engine.generate(bad).unwrap_err().to_string();
        assert!(err.contains("broken grammar"), "{err}");
        assert_eq!(engine.generate(req(prompt(5, 1), 1, 4)).unwrap().tokens.len(), 4);
    }
}
