"""One generation over B rows, for `generate` (one prompt: B = 1) and `generate_batch` (a row per prompt):
the Session for the checked configuration, a KV snapshot loaded into its rows, the prefill, a snapshot
saved, the decode loop, and each row's statistics. The callers check their arguments and shape the
results; everything between is here, once (docs/architecture.md, "How one run flows").
"""
from __future__ import annotations

import time

import torch

from ..config import Sampling, Speculation
from ..errors import UsageError
from .decode import decode
from .statistics import acceptance, level_counts, placement_stats, row_stats
from .session import Session, _sync_device


def run(target, draft, prompts: list[list[int]], max_new: list[int], spec: Speculation, sampling: Sampling,
        gen: torch.Generator, eos: set[int], *, prefill_chunk: int = 512, offload: str = "auto",
        gpu_memory: int | None = None, cuda_graphs: bool = True, device_free: int | None = None,
        deterministic: bool = False, group=None, identity=None, load_kv=None, save_kv=None, on_plan=None,
        on_prefill=None, on_tokens=None, on_round=None, on_row=None, until=None
        ) -> tuple[list[list[int]], list[dict]]:
    """(each prompt's new tokens, each prompt's statistics) of one Session over the prompts (token-id lists,
    checked; max_new: each one's budget, fitted to the context). Options and callbacks as generate's and
    generate_batch's: on_plan(placement) before the prefill; on_prefill(done, total); on_tokens(r, tokens,
    acceptance) after each round for every row that took part (acceptance: the row's so far per level);
    on_round({r: tokens}, counts) after each round (counts: statistics.level_counts); on_row(r, tokens) once a
    row is finished; until as decode's. load_kv: a snapshot read once into every row that starts with its
    prefix; save_kv (one prompt): the caches after the prefill; identity: the models' (snapshot/identity.py)."""
    B, longest = len(prompts), max(map(len, prompts))
    if save_kv is not None and B > 1:
        raise UsageError("a KV snapshot is saved from one prompt, not a batch")
    from ..snapshot import store as snapshot_io

    total = max(len(p) + m for p, m in zip(prompts, max_new))
    # planned for B rows before anything is allocated: raises when the rows do not fit
    session = Session(target, draft, longest, total - longest, spec, sampling, prefill_chunk, offload, gpu_memory,
                      cuda_graphs, device_free, deterministic, group, rows=B)
    if on_plan:
        on_plan(placement_stats(session.plan))
    device = next(target.parameters()).device
    t0 = time.perf_counter()
    kv: list[dict] = [{} for _ in prompts]
    if load_kv is not None:
        rows = [torch.tensor(p, dtype=torch.long) for p in prompts]
        reused, length = snapshot_io.load_rows(load_kv, session, rows, [len(p) - 1 for p in prompts], identity, group)
        _sync_device(device)
        kv = [{"kv_reused": c, "kv_snapshot_tokens": length, "load_kv_s": time.perf_counter() - t0} for c in reused]
    session.prefill(prompts, on_prefill)
    _sync_device(device)
    t1 = time.perf_counter()
    if save_kv is not None:
        snapshot_io.save(save_kv, session, identity, group)
        kv[0]["save_kv_s"] = time.perf_counter() - t1
    before = session.counts()
    t2 = time.perf_counter()
    told = (lambda r, tokens: on_tokens(r, tokens, acceptance(session, r))) if on_tokens else None
    counted = (lambda tokens: on_round(tokens, level_counts(session))) if on_round else None
    outs = decode(session, [len(p) for p in prompts], max_new, gen, eos, until, told, on_row, counted)
    _sync_device(device)
    t3 = time.perf_counter()
    return outs, [{**row_stats(session, r, outs, t1 - t0, t3 - t2, before), "batch_size": B, **kv[r]}
                  for r in range(B)]
