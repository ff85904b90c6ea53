"""CUDA graphs for the cheap, frequent forwards: the small draft's steps and the middle level's.

The only file that touches torch.cuda.graph. A GraphRunner wraps one (model, cache) pair: the cache's
begin() runs eagerly and writes everything its update() reads into persistent buffers
(cache/base.py, StaticInputs), so a graph captured over `model(ids, cache)` replays with fresh
positions, slots and masks. One graph per (tokens, logits kept, cache shape key); while the cache's
shapes still change from step to step (a StreamingLLM window that is not full yet) it runs eagerly.
Sampling stays outside the graphs, so changing temperature or top-p needs no re-capture.

The engine captures the shapes it knows the decode will use right after prefill (`capture`), so that
warm-up and capture stay out of the timed decode; a shape first met later is captured then. Every
runner of a generation shares one memory pool (torch.cuda.graph_pool_handle()): safe because the graphs
replay one at a time on one stream and each graph's output buffer stays referenced by its runner, so a
later capture only reuses memory that earlier graphs use as scratch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def _graphable(ids: torch.Tensor) -> bool:
    """Whether a forward of these ids may run from a graph: on CUDA only (tests/gpu/test_gpu_semantics.py
    replays graphs on the CPU through a stand-in for torch.cuda.graph)."""
    return ids.is_cuda


@dataclass
class _Captured:
    graph: "torch.cuda.CUDAGraph"
    ids: torch.Tensor
    logits: torch.Tensor


class GraphRunner:
    def __init__(self, model, cache, pool=None, max_graphs: int = 16):
        self.model, self.cache, self.pool, self.max_graphs = model, cache, pool, max_graphs
        self.graphs: dict = {}
        self.replays = 0

    def __call__(self, ids: torch.Tensor, last_n: int | None):
        """Same contract as model(ids, cache, last_n) after cache.begin(T); the returned logits are a
        static buffer, valid until the next call."""
        shape_key = self.cache.graph_key()
        if not _graphable(ids) or shape_key is None or last_n == 0:
            return self.model(ids, self.cache, last_n=last_n)
        key = (ids.shape[1], last_n, shape_key)
        captured = self.graphs.get(key)
        if captured is None:
            if len(self.graphs) >= self.max_graphs:
                return self.model(ids, self.cache, last_n=last_n)
            captured = self.graphs[key] = self._capture(ids, last_n)
        captured.ids.copy_(ids)
        captured.graph.replay()
        self.replays += 1
        return captured.logits

    def capture(self, n_tokens: int, last_n: int) -> None:
        """Capture the graph for forwards of n_tokens at the cache's current length, ahead of use.

        Runs begin(n_tokens) and forwards of placeholder ids, then commits nothing: only the uncommitted
        slots of those n_tokens positions are written, which the next forward of that many tokens from
        this length writes again before it reads them (the caller picks shapes for which that holds).
        """
        device = self.cache.k.device
        self.cache.begin(n_tokens)
        shape_key = self.cache.graph_key()
        if shape_key is not None and (n_tokens, last_n, shape_key) not in self.graphs:
            ids = torch.zeros(self.cache.rows, n_tokens, dtype=torch.long, device=device)  # every live row
            self.graphs[(n_tokens, last_n, shape_key)] = self._capture(ids, last_n)
        self.cache.commit(0)

    def _capture(self, ids: torch.Tensor, last_n: int | None) -> _Captured:
        # Warm-up on a side stream (as torch.cuda.graph requires). Re-running a forward after the same
        # begin() writes the same K/V to the same slots, so warm-up and capture change nothing.
        static_ids = ids.clone()
        side = torch.cuda.Stream(ids.device)
        side.wait_stream(torch.cuda.current_stream(ids.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.model(static_ids, self.cache, last_n=last_n)
        torch.cuda.current_stream(ids.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.model(static_ids, self.cache, last_n=last_n)
        return _Captured(graph, static_ids, logits)
