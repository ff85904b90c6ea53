"""Weight-only int8 and int4 matrix products on the CPU against float32 and bfloat16, at SmolLM2-135M's shapes.

What the choice of a kernel for quantized weights rests on: PyTorch's own packed operators
(`_weight_int8pack_mm`: int8 per output channel; `_weight_int4pack_mm_for_cpu`: int4 in groups with a scale
and zero per group; both take float32 or bfloat16 activations) against F.linear in float32 and bfloat16, for 1 and 7 rows (a decode step, a
verification). ms per call, median of REPEAT timings of LOOPS calls after a warm-up, each call on another
copy of the weight (out of the caches, as in a forward); the weight bytes each form reads beside it. Also the largest error of each quantized product against float32 on the same
dequantized weights (the kernel's own arithmetic, not the quantization's).

    python scripts/cpu_quant_bench.py [THREADS]
"""
from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F

SHAPES = {"q/o 576x576": (576, 576), "k/v 192x576": (192, 576), "gate/up 1536x576": (1536, 576),
          "down 576x1536": (576, 1536), "head 49152x576": (49152, 576)}
GROUP = 32  # Q4_1's block
LOOPS, REPEAT = 20, 5


def ms(fn, args: list) -> float:
    """Median ms of fn(*a) over the copies in `args`, visited in turn: each call finds its weight out of
    the caches, as a forward does (its layers' weights, 540 MB in float32 for SmolLM2, fit no cache)."""
    fn(*args[0])
    times = []
    for _ in range(REPEAT):
        t = time.perf_counter()
        for i in range(LOOPS):
            fn(*args[i % len(args)])
        times.append((time.perf_counter() - t) / LOOPS * 1000)
    return statistics.median(times)


COLD_BYTES = 256e6  # copies of each weight, in its densest form, to spread calls over more than any cache

def int8(w: torch.Tensor):
    """Symmetric per-channel: (int8 (N, K), scales (N,))."""
    scale = w.abs().amax(1).clamp(min=1e-8) / 127
    return torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8), scale


def int4(w: torch.Tensor, group: int = GROUP):
    """Asymmetric groups: (packed, scales_and_zeros (K/g, N, 2) bf16, dequantized float32 weight).
    PyTorch's convention: w = (q - 8) * scale + zero, q in 0..15."""
    N, K = w.shape
    g = w.view(N, K // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    zero = lo + 8 * scale
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15)
    deq = ((q - 8) * scale[..., None] + zero[..., None]).view(N, K)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.view(N, K).to(torch.int32), 2)
    sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return packed, sz, deq


def main(threads: int) -> None:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {threads} threads, cpu {torch.backends.cpu.get_cpu_capability()}")
    print("| weight | rows | f32 | bf16 | int8 (x f32) | int8 (x bf16) | int4 g32 (x bf16) | int4 g32 (x f32) | MB f32/bf16/int8/int4 | "
          "int8 err | int4 err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, (N, K) in SHAPES.items():
        copies = max(2, min(LOOPS, int(COLD_BYTES // (N * K * 4))))
        ws = [torch.randn(N, K) * 0.05 for _ in range(copies)]
        q8 = [int8(w) for w in ws]
        q4 = [int4(w) for w in ws]
        wbs = [w.to(torch.bfloat16) for w in ws]
        for rows in (1, 7):
            x = torch.randn(rows, K)
            xb = x.to(torch.bfloat16)
            w8, s8 = q8[0]
            r8 = F.linear(x, w8.float() * s8[:, None])
            err8 = (torch.ops.aten._weight_int8pack_mm(x, w8, s8) - r8).abs().max().item()
            packed, sz, deq4 = q4[0]
            r4 = F.linear(xb.float(), deq4.to(torch.bfloat16).float())
            err4 = (torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, GROUP, sz).float() - r4).abs().max().item()
            cells = [ms(lambda w: F.linear(x, w), [(w,) for w in ws]),
                     ms(lambda w: F.linear(xb, w), [(w,) for w in wbs]),
                     ms(lambda w, s: torch.ops.aten._weight_int8pack_mm(x, w, s), q8),
                     ms(lambda w, s: torch.ops.aten._weight_int8pack_mm(xb, w, s), [(w, s.to(torch.bfloat16))
                                                                                     for w, s in q8]),
                     ms(lambda p, z: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, p, GROUP, z),
                        [(p, z) for p, z, _ in q4]),
                     ms(lambda p, z: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p, GROUP, z),
                        [(p, z.float()) for p, z, _ in q4])]
            mb = f"{N * K * 4 / 1e6:.2f}/{N * K * 2 / 1e6:.2f}/{N * K / 1e6:.2f}/{N * K / 2e6:.2f}"
            print(f"| {name} | {rows} | " + " | ".join(f"{c:.3f}" for c in cells) + f" | {mb} | {err8:.1e} | {err4:.1e} |",
                  flush=True)

if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else torch.get_num_threads())
