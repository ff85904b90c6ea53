"""The one driver of a generation on an open Session: prefill what its caches do not hold yet of each
prompt, the decode loop, and each row's statistics. Used for a prompt or a batch (generate.run_rows, once it has
opened the session and loaded a snapshot), for a conversation's question (conversation.py) and for a
server request (serve/worker.py), whose sessions keep what earlier prompts left in the caches."""
from __future__ import annotations

import time
from dataclasses import replace

import torch

from .decode import decode
from .events import Events
from .session import sync_device
from .statistics import row_stats


def drive(session, prompts, max_new: list[int], gen: torch.Generator, eos: set[int], events: Events = Events(),
          t0: float | None = None, after_prefill=None) -> tuple[list[list[int]], list[dict]]:
    """(each prompt's new tokens, each prompt's statistics): statistics.row_stats, with prefill_s counted
    from t0 (default: now; a caller that loaded a snapshot first counts from before it), ttft_s (from t0 to
    the row's first token), prompt_tokens and prefilled_tokens (what was fed beyond what the caches held).
    after_prefill() runs between the prefill and the decode loop, outside both times (a snapshot written)."""
    device = next(session.target.parameters()).device
    t0 = time.perf_counter() if t0 is None else t0
    kept = session.prefill(prompts, events.on_prefill)
    sync_device(device)
    t1 = time.perf_counter()
    if after_prefill is not None:
        after_prefill()
    first: dict[int, float] = {}

    def on_tokens(r, tokens, acceptance):
        first.setdefault(r, time.perf_counter())
        if events.on_tokens:
            events.on_tokens(r, tokens, acceptance)

    before = session.counts()
    t2 = time.perf_counter()
    outs = decode(session, [len(p) for p in prompts], max_new, gen, eos, replace(events, on_tokens=on_tokens))
    sync_device(device)
    t3 = time.perf_counter()
    return outs, [{**row_stats(session, r, outs, t1 - t0, t3 - t2, before), "ttft_s": first.get(r, t3) - t0,
                   "prompt_tokens": len(p), "prefilled_tokens": len(p) - kept[r]} for r, p in enumerate(prompts)]
