"""The caches and nodes of one generation, built from its memory plan: the full cache (resident, or with
layers offloaded to host memory), the middle level's retrieval or streaming cache, the small draft's
StreamingLLM cache or n-gram lookup (docs/architecture.md, "Levels and the session"). session.Session
composes them into levels and runs their lifecycle."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import placement
from ..cache import FullCache, RetrievalCache, StreamingCache
from ..cache.offload import OffloadedCache
from ..cache.policies import make_select
from ..cache.rope import Rotary
from ..model.attention import flash_attn_func, flash_attn_with_kvcache
from ..model.vocab import shared_vocabulary
from .graphs import GraphRunner
from .lookup import LookupLevel
from .node import Node
from .rowwise import RowwiseRunner
from .session_plan import plan_session


@dataclass
class Nodes:
    plan: placement.Plan
    full: Node
    middle: Node | None  # retrieval or streaming; None without a middle level
    small: Node | None  # the draft model's; None without one
    retrieval: RetrievalCache | None  # the middle node's cache when it retrieves
    lookup: LookupLevel | None  # n-gram lookup in place of a draft model


def build_nodes(target, draft, prompt_len: int, total: int, capacity: int, spec, sampling, run, rows: int,
                group=None) -> Nodes:
    """The nodes of a generation of `total` tokens (the longest row's prompt and budget) in caches of
    `capacity` slots, for `rows` rows: spec (fitted), sampling and run (config.Execution) as
    Session takes them. The memory plan comes first; with group (tensor-parallel ranks) every rank's
    must agree before any cache is allocated."""
    cfg = target.config
    prefill_chunk = run.prefill_chunk
    p = next(target.parameters())
    dims = (cfg.num_hidden_layers, target.n_kv_heads, target.head_dim)
    rotary = Rotary(cfg, max_len=total, device=p.device)
    cuda = p.device.type == "cuda"
    # flash-attn for any row count where it has its kvcache kernel (rows of different lengths:
    # cache_seqlens). CUDA graphs for any row count: a graph is captured per live row count and replayed
    # while the rows share one view (graph_key); docs/architecture.md, the fast path.
    flash = (cuda and flash_attn_func is not None and p.dtype != torch.float32
             and (rows == 1 or flash_attn_with_kvcache is not None))
    graphs = run.cuda_graphs and cuda
    kernel = "flash" if flash else "sdpa" if cuda else "math"
    work = placement.Work(capacity, prompt_len, spec, prefill_chunk, graphs, kernel, rows=rows)
    plan = plan_session(target, draft, work, run.offload, run.gpu_memory, run.device_free)
    if group is not None:
        group.check_plan(plan)
    pool = torch.cuda.graph_pool_handle() if graphs else None  # one pool for every GraphRunner
    if plan.resident == plan.n_layers:
        full = FullCache(*dims, capacity=capacity, rotary=rotary, dtype=p.dtype, device=p.device, rows=rows)
    else:
        full = OffloadedCache(*dims, capacity=capacity, rotary=rotary, resident=plan.resident,
                              dtype=p.dtype, device=p.device, rows=rows)
    # deterministic: verify row by row, exactly as one-token decoding computes each logit (rowwise.py)
    full_node = Node("full", target, full, sampling, capacity, prefill_chunk,
                     RowwiseRunner(target, full) if run.deterministic else None)
    middle = small = retrieval = None
    if spec.middle == "retrieval":
        retrieval = RetrievalCache(*dims, budget=spec.budget, chunk_size=spec.chunk_size,
                                        rotary=rotary, dtype=p.dtype, device=p.device,
                                        select=make_select(spec.policy, spec.sinks),
                                        shared=spec.policy == "shared",
                                        recompute_stats=plan.recompute_stats, rows=rows)
        middle = Node("retrieval", target, retrieval, sampling, capacity, prefill_chunk,
                           _runner(target, retrieval, graphs, pool))
    elif spec.middle == "streaming":
        cache = StreamingCache(*dims, budget=spec.budget, sinks=spec.sinks, rotary=rotary,
                               max_rollback=spec.max_lookahead, max_new=prefill_chunk + spec.max_lookahead,
                               dtype=p.dtype, device=p.device, rows=rows)
        middle = Node("streaming", target, cache, sampling, capacity, prefill_chunk,
                           _runner(target, cache, graphs, pool))
    if spec.uses_draft:
        dcfg, dp = draft.config, next(draft.parameters())
        chunk = min(prefill_chunk, spec.draft_budget)
        cache = StreamingCache(dcfg.num_hidden_layers, draft.n_kv_heads, draft.head_dim,
                               budget=spec.draft_budget, sinks=spec.sinks,
                               rotary=Rotary(dcfg, max_len=total, device=dp.device),
                               max_rollback=spec.max_lookahead, max_new=chunk + spec.max_lookahead,
                               dtype=dp.dtype, device=dp.device, rows=rows)
        small = Node("draft", draft, cache, sampling, capacity, chunk, _runner(draft, cache, graphs, pool),
                          shared_vocabulary(draft, cfg.vocab_size))
    # n-gram lookup in place of a draft model (lookup.py): the verifier's vocabulary, on its device
    lookup = LookupLevel(cfg.vocab_size, p.device, rows, spec.lookup_max, spec.lookup_min, spec.lookup_threshold) \
        if spec.looks_up else None
    return Nodes(plan, full_node, middle, small, retrieval, lookup)


def _runner(model, cache, enabled: bool, pool):
    """CUDA graphs for the draft and middle levels' forwards (never the full cache's)."""
    on_cuda = next(model.parameters()).device.type == "cuda"
    return GraphRunner(model, cache, pool) if enabled and on_cuda else None
