"""ms per forward of a model over a full cache already holding N tokens: one new token (plain decoding's
step) and seven (a verification of gamma2 = 6), without a prefill (the cache holds random keys and values:
the time does not depend on them).

    python scripts/cpu_forward_bench.py 1000,4000,7500 [float32|bfloat16] [model] [prof|-] [int8|int4]

model: a name or folder `tforce.load_model` takes (default smollm2-135m-instruct); prof: also a
torch.profiler table of five forwards of each size at each length; int8|int4: the layers' projections
quantized (tforce/model/quant.py). To compare two trees, run it under each
(PYTHONPATH=<tree>), alternating.
"""
from __future__ import annotations

import sys
import time

import torch

import tforce
from tforce.cache.full import FullCache
from tforce.cache.rope import Rotary


def main(lengths: list[int], dtype: torch.dtype, name: str, prof: bool, weights: str | None) -> None:
    torch.set_num_threads(2)
    model = tforce.load_model(name, device="cpu", dtype=dtype, weights=weights).model
    layers, heads, dim = model.config.num_hidden_layers, model.n_kv_heads, model.head_dim
    print(f"{tforce.__file__}: {name}, {dtype}, weights {weights or 'as loaded'}, torch {torch.__version__}, "
          "2 threads")
    for n in lengths:
        cache = FullCache(layers, heads, dim, n + 16, Rotary(model.config, n + 16, device="cpu"), dtype=dtype)
        g = torch.Generator().manual_seed(0)
        for layer in range(layers):
            cache.write_layer(layer, torch.randn(1, n, heads, dim, generator=g).to(dtype),
                              torch.randn(1, n, heads, dim, generator=g).to(dtype))
        cache.commit_written(n)

        def step(t: int) -> None:  # never committed: every step writes the same slots
            cache.begin(t)
            model(torch.full((1, t), 100), cache, last_n=1)

        for t in (1, 7):
            for _ in range(3):
                step(t)
            start, reps = time.perf_counter(), 15
            for _ in range(reps):
                step(t)
            print(f"N={n} T={t}: {(time.perf_counter() - start) / reps * 1e3:.1f} ms/forward")
        if prof:
            from torch.profiler import ProfilerActivity, profile

            for t in (1, 7):
                with profile(activities=[ProfilerActivity.CPU]) as p:
                    for _ in range(5):
                        step(t)
                print(f"N={n} T={t}, five forwards:")
                print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))


if __name__ == "__main__":
    args = sys.argv[1:]
    main([int(x) for x in args[0].split(",")], getattr(torch, args[1] if len(args) > 1 else "float32"),
         args[2] if len(args) > 2 else "smollm2-135m-instruct", len(args) > 3 and args[3] == "prof",
         args[4] if len(args) > 4 else None)
