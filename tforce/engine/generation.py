"""One generation over B rows, for `generate` (one prompt: B = 1) and `generate_batch` (a row per prompt):
the Session for the checked configuration, a KV snapshot loaded into its rows, the prefill, a snapshot
saved, the decode loop, and each row's statistics. The callers check their arguments and shape the
results; everything between is here, once (docs/architecture.md, "How one run flows").
"""
from __future__ import annotations

import time

import torch

from ..config import RunConfig
from ..errors import UsageError
from .driver import drive
from .events import Events
from .statistics import placement_stats
from .session import Session, sync_device


def run(target, draft, prompts: list[list[int]], max_new: list[int], config: RunConfig, gen: torch.Generator,
        eos: set[int], events: Events = Events(), group=None, identity=None) -> tuple[list[list[int]], list[dict]]:
    """(each prompt's new tokens, each prompt's statistics) of one Session over the prompts (token-id lists,
    checked; max_new: each one's budget, fitted to the context), telling `events` as it goes (events.py).
    config.load_kv: a snapshot read once into every row that starts with its prefix; config.save_kv (one
    prompt): the caches after the prefill; identity: the models' (snapshot/identity.py)."""
    B, longest = len(prompts), max(map(len, prompts))
    load_kv, save_kv = config.load_kv, config.save_kv
    if save_kv is not None and B > 1:
        raise UsageError("a KV snapshot is saved from one prompt, not a batch")
    from ..snapshot import store as snapshot_io

    total = max(len(p) + m for p, m in zip(prompts, max_new))
    # planned for B rows before anything is allocated: raises when the rows do not fit
    session = Session(target, draft, longest, total - longest, config, group, rows=B)
    if events.on_plan:
        events.on_plan(placement_stats(session.plan))
    device = next(target.parameters()).device
    t0 = time.perf_counter()
    kv: list[dict] = [{} for _ in prompts]
    if load_kv is not None:
        rows = [torch.tensor(p, dtype=torch.long) for p in prompts]
        reused, length = snapshot_io.load_rows(load_kv, session, rows, [len(p) - 1 for p in prompts], identity, group)
        sync_device(device)
        kv = [{"kv_reused": c, "kv_snapshot_tokens": length, "load_kv_s": time.perf_counter() - t0} for c in reused]
    saved = {}

    def save() -> None:
        t = time.perf_counter()
        snapshot_io.save(save_kv, session, identity, group)
        saved["save_kv_s"] = time.perf_counter() - t

    outs, stats = drive(session, prompts, max_new, gen, eos, events, t0, save if save_kv is not None else None)
    return outs, [{**s, "batch_size": B, **kv[r], **saved} for r, s in enumerate(stats)]
