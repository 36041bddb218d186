"""Runs llama-cpp-python's OpenAI-compatible server (`python3 -m llama_cpp.server ARGS`),
with one change to how it ranks log-probabilities.

Why: llama-cpp-python 0.3.36 builds each generated token's `logprobs` entry by sorting all
of the vocabulary's (logprob, token id) pairs with Python's `sorted` (49,152 pairs for
SmolLM2), and keeps only the first `logprobs` of them. That costs 120 ms per generated token
on a 2-core AMD EPYC without AVX-512, which is most of a request's time there: a 30-token
reply spends about 1 s in llama.cpp and about 4 s in that sort. Here the same ranking comes
from numpy: the pairs with the 128 largest logprobs (more than any caller keeps: OpenAI
allows 20), sorted as `sorted(pairs, reverse=True)` sorts them (by logprob descending,
equal logprobs by token id descending); the pairs after those are never read. Every other
call of `sorted` in the module is left alone. Nothing else changes: llama.cpp computes the logits, and llama-cpp-python builds the
responses.

    python3 infra/deploy/llama_server.py --model M.gguf --host 127.0.0.1 --port 18080 ...
"""

import builtins
import operator
import runpy

import numpy as np

import llama_cpp.llama as llama_module

_builtin_sorted = builtins.sorted

# The most entries a caller keeps: OpenAI allows 20 top log-probabilities (5 in the legacy
# completions API); the pairs after these are never read.
KEPT = 128


def _ranked(iterable, *, key=None, reverse=False):
    if key is not None or not reverse or not isinstance(iterable, zip):
        return _builtin_sorted(iterable, key=key, reverse=reverse)
    pairs = list(iterable)
    if len(pairs) <= KEPT or not all(type(p) is tuple and len(p) == 2 for p in pairs[:2]):
        return _builtin_sorted(pairs, reverse=True)
    values = np.fromiter(map(operator.itemgetter(0), pairs), dtype=np.float64, count=len(pairs))
    # the KEPT largest values (ties at the boundary: every pair with the boundary value)
    boundary = np.partition(values, len(values) - KEPT)[len(values) - KEPT]
    top = [pairs[i] for i in np.flatnonzero(values >= boundary).tolist()]
    return _builtin_sorted(top, reverse=True)


# `sorted` inside llama_cpp.llama resolves through the module's globals first.
llama_module.sorted = _ranked

if __name__ == "__main__":
    runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
