//! The rollout engine's KV cache: one sequence's keys and values in preallocated buffers
//! that grow by doubling, and a sequence's share of a batched forward pass. A hybrid model's
//! sequence (Qwen3.5) carries the model's own cache instead, and the recurrent state of its
//! GDN layers at each prefill chunk boundary, so that a prefix can be continued from there.

use std::collections::BTreeMap;

use tch::{Device, Kind, Tensor};

use crate::model::qwen3_5::{Qwen35Cache, RecurrentState};
use crate::model::Model;

/// A Qwen3.5 sequence's state: the model's cache, and the GDN layers' recurrent state at the
/// positions kept with [`SeqKv::keep_state`] (a recurrent state cannot be cut back: a prefix
/// ends where a state was kept). Each kept state costs the GDN layers' state size (about
/// 20 MB at Qwen3.5-0.8B's shape); attention keys and values are shared, not copied.
pub(in crate::infer) struct Hybrid {
    pub(in crate::infer) cache: Qwen35Cache,
    states: BTreeMap<usize, RecurrentState>,
}

/// Keys and values of one sequence in preallocated per-layer buffers `[1, kv_heads,
/// capacity, head_dim]` that grow by doubling: the batching engine's cache. Positions at
/// and beyond `len` hold stale values that attention never reads.
pub struct SeqKv {
    pub(in crate::infer) k: Vec<Tensor>,
    pub(in crate::infer) v: Vec<Tensor>,
    pub(in crate::infer) len: usize,
    cap: usize,
    /// Qwen3.5: the model's cache and kept states (`k` and `v` are empty).
    pub(in crate::infer) hybrid: Option<Hybrid>,
}

impl SeqKv {
    pub fn new(model: &Model, capacity: usize) -> Self {
        let model = match model {
            Model::Llama(m) => m,
            Model::Qwen35(_) => {
                let states = BTreeMap::from([(0, RecurrentState::default())]);
                return SeqKv { k: vec![], v: vec![], len: 0, cap: 0, hybrid: Some(Hybrid { cache: Qwen35Cache::default(), states }) };
            }
        };
        let c = &model.config;
        let cap = capacity.max(1);
        let shape = [1, c.num_key_value_heads, cap as i64, c.head_dim()];
        let alloc = || (0..c.num_hidden_layers).map(|_| Tensor::zeros(shape, (Kind::Float, model.device()))).collect::<Vec<_>>();
        SeqKv { k: alloc(), v: alloc(), len: 0, cap, hybrid: None }
    }

    /// Keeps the recurrent state at the current length (a hybrid model's prefill chunk
    /// boundary), so that [`SeqKv::truncate`] and [`SeqKv::copy_range`] can end there.
    /// Nothing to keep for an attention-only model.
    pub fn keep_state(&mut self) {
        if let Some(h) = self.hybrid.as_mut() {
            h.states.insert(self.len, h.cache.recurrent_state());
        }
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets every position from `len` on. A hybrid model's cache goes back to the last
    /// kept state at or before `len` (see [`SeqKv::len`] for where it ends).
    pub fn truncate(&mut self, len: usize) {
        if let Some(h) = self.hybrid.as_mut() {
            let Some((&at, _)) = h.states.range(..=len.min(self.len)).next_back() else { return };
            if at < self.len {
                h.cache = h.cache.at(at as i64, &h.states[&at]);
            }
            h.states.retain(|&p, _| p <= at);
            self.len = at;
            return;
        }
        self.len = self.len.min(len);
    }

    /// Positions the buffers have room for (what the cache's memory is proportional to); a
    /// hybrid model's cache: the positions held.
    pub fn capacity(&self) -> usize {
        match self.hybrid {
            Some(_) => self.len,
            None => self.cap,
        }
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
    /// A hybrid model's caches take `other`'s state at `to`, which it must have kept.
    pub fn copy_range(&mut self, other: &SeqKv, from: usize, to: usize) {
        debug_assert!(self.len == from && other.len >= to);
        if let (Some(h), Some(o)) = (self.hybrid.as_mut(), other.hybrid.as_ref()) {
            let state = o.states.get(&to).expect("a hybrid prefix is copied to a kept state");
            h.cache = o.cache.at(to as i64, state);
            for (&p, s) in o.states.range(from + 1..=to) {
                h.states.insert(p, s.clone());
            }
            self.len = to;
            return;
        }
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
