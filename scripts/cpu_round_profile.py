"""Profile decode rounds of one method on the CPU after a real prefill: where a round's time goes.

SmolLM2-135M-Instruct over N tokens of Middlemarch (its registry draft where the method has a draft level),
default engine knobs, greedy; two rounds of warm-up, then torch.profiler over three rounds (the table
sorted by self CPU time).

    python scripts/cpu_round_profile.py [int8|int4|-] [N] [METHOD] [BUDGET]
    # default: as loaded, 7500, retrieval, the default middle budget
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import tforce
from tforce.config import RunConfig, Sampling, Speculation
from tforce.engine.generate import Session
from tforce.model.registry import REGISTRY

MODEL = "smollm2-135m-instruct"
BOOK = Path(__file__).resolve().parents[2] / "shared/data/books/middlemarch.txt"


def main(weights: str | None, n: int, method: str, budget: int | None) -> None:
    torch.set_num_threads(2)
    target = tforce.load_model(MODEL, weights=weights)
    text = BOOK.read_text(encoding="utf-8")
    ids = target.tokenizer.encode(text[len(text) // 3:len(text) // 3 + 40 * n], add_special_tokens=False)[:n]
    spec = Speculation(method=method, **({} if budget is None else {"budget": budget}))
    draft = tforce.load_model(REGISTRY[MODEL][1], tokenizer=False).model if spec.uses_draft else None
    print(spec, f"weights {weights or 'as loaded'}, {len(ids)} tokens")
    session = Session(target.model, draft, len(ids), 64, RunConfig(speculation=spec, sampling=Sampling(temperature=0)))
    t = time.perf_counter()
    session.prefill([ids])
    print(f"prefill {time.perf_counter() - t:.1f} s")
    gen, got = torch.Generator().manual_seed(0), []
    for _ in range(2):
        got += session.round([len(ids) + len(got)], gen)[0]
    with profile(activities=[ProfilerActivity.CPU]) as p:
        t, before = time.perf_counter(), len(got)
        for _ in range(3):
            got += session.round([len(ids) + len(got)], gen)[0]
        print(f"3 rounds: {time.perf_counter() - t:.2f} s, {len(got) - before} tokens")
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0] if a and a[0] != "-" else None, int(a[1]) if len(a) > 1 else 7500, a[2] if len(a) > 2 else "retrieval",
         int(a[3]) if len(a) > 3 else None)
