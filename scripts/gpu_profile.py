"""Profile decoding on a CUDA GPU (GPU work queue, item c): where a decode step's time goes.

Synthetic Llama-2-7B weights (random: times are real, acceptance is not). For each case, one warm-up
generate, then one profiled generate; writes the profiler's tables to $OUT/profile_<case>.txt and prints
a summary: wall ms/token, device-busy ms/token, host syncs and copies per token.

    OUT=out python3 scripts/gpu_profile.py [PROMPT_LEN] [CASES: method:offload,...]
"""
from __future__ import annotations

import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, ".")
import tforce  # noqa: E402
from tforce.bench.suite import prompt_ids, synthetic_pair  # noqa: E402

SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy ")


def main():
    out_dir = os.environ.get("OUT", "out")
    os.makedirs(out_dir, exist_ok=True)
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    cases = (sys.argv[2] if len(sys.argv) > 2 else "ar:off,ar:on,triforce:on,triforce:off").split(",")
    target, draft = synthetic_pair("llama2-7b", "cuda", torch.bfloat16)
    ids = prompt_ids(n, target.config.vocab_size)
    new = 24
    for case in cases:
        method, offload = case.split(":")
        kw = dict(draft=draft, method=method, temperature=0.6, seed=0, ignore_eos=True, offload=offload)
        tforce.generate(target, ids[:512], max_new_tokens=8, **kw)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            res = tforce.generate(target, ids, max_new_tokens=new, **kw)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        ka = prof.key_averages()
        with open(f"{out_dir}/profile_{method}_{offload}.txt", "w") as f:
            f.write(f"{case} prompt {n} new {new} stats {res.stats}\n\n")
            f.write(ka.table(sort_by="self_cpu_time_total", row_limit=30) + "\n\n")
            f.write(ka.table(sort_by="self_cuda_time_total", row_limit=30) + "\n")
        counts = {e.key: e.count for e in ka if any(e.key.startswith(s.strip()) for s in SYNC_OPS)}
        device_ms = sum(e.self_device_time_total for e in ka) / 1000
        s = res.stats
        print(f"{case:14} prompt {n}: prefill {s['prefill_s']:.2f} s, decode {s['ms_per_token']:.1f} ms/token "
              f"(profiled wall {wall:.2f} s; device busy {device_ms:.0f} ms in all), "
              f"verifications {s['verifications']}, rebuilds {s['rebuilds']} ({s['rebuild_s']}) syncs {counts}",
              flush=True)
        top = sorted(ka, key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
        print("   top host:", ", ".join(f"{e.key} {e.self_cpu_time_total / 1000:.0f}ms x{e.count}" for e in top))
        topd = sorted(ka, key=lambda e: e.self_device_time_total, reverse=True)[:8]
        print("   top device:", ", ".join(f"{e.key[:40]} {e.self_device_time_total / 1000:.0f}ms x{e.count}"
                                          for e in topd), flush=True)


if __name__ == "__main__":
    main()
