"""Prompt-lookup drafting's own cost at a long prompt (tforce/engine/lookup.py, ngram.py), on the CPU.

    python scripts/lookup_bench.py [prompt tokens, default 100000]

Per token stream (uniform over 128,256 ids: few n-gram matches; Zipf: many) and n_max: the prompt's
indexing (LookupLevel.prefill), then, over 300 rounds each keeping a random 0..K of the drafts and writing
another token after them, the matcher per proposal of K = 6 tokens (draft_lengths: the row's rollback,
lookups, index updates) and the proposal after it with its one-hot labels (R, K, V).
"""
from __future__ import annotations

import sys
import time

import numpy as np
import torch

sys.path.insert(0, ".")
from tforce.engine.lookup import LookupLevel  # noqa: E402

V, K, ROUNDS = 128256, 6, 300


def bench(tokens: np.ndarray, L: int, n_max: int, rng) -> str:
    level, seq, n = LookupLevel(V, "cpu", n_max=n_max), torch.tensor(tokens[None].copy()), [L]
    t0 = time.perf_counter()
    level.prefill(seq, n)
    index_s = time.perf_counter() - t0
    matcher, proposal = [], []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        level.draft_lengths(seq, n, K, [0])
        t1 = time.perf_counter()
        level.propose(seq, n, K, None, [0])
        matcher.append(t1 - t0)
        proposal.append(time.perf_counter() - t1)
        kept = int(rng.integers(0, K + 1))
        seq[0, n[0] + kept] = int(tokens[n[0] + kept])  # the verifier's own token after the drafts it kept
        n[0] += kept + 1
    m, p = np.array(matcher) * 1e6, np.array(proposal) * 1e6
    return (f"n_max {n_max}: index {index_s * 1e3:6.1f} ms | matcher median {np.median(m):4.0f} us, p90 "
            f"{np.percentile(m, 90):4.0f} | proposal with labels median {np.median(p):4.0f} us, "
            f"p90 {np.percentile(p, 90):4.0f}")


def main() -> None:
    L = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    rng = np.random.default_rng(0)
    extra = L + (K + 1) * ROUNDS + K
    streams = {"uniform": rng.integers(0, V, extra), "zipf": np.minimum(rng.zipf(1.3, extra), V - 1)}
    for name, tokens in streams.items():
        for n_max in (3, 5):
            print(f"{name:8s} {L} tokens, {bench(tokens, L, n_max, rng)}")


if __name__ == "__main__":
    main()
