"""x @ W^T (F.linear) against (W @ x^T)^T on the CPU, float32, ms per product, for a few row counts.

    python scripts/cpu_linear_bench.py [threads]

Shapes: SmolLM2-135M's attention, MLP and output-head weights, Llama-2-7B's MLP weight and a 32000-word head.
tforce.model.linear uses the second form for 2-64 rows (docs in that module).
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from cpu_attention_bench import ms  # noqa: E402 (this folder is on sys.path when run as a script)

SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576), (11008, 4096), (32000, 2048)]
ROWS = (1, 2, 4, 7, 16, 56, 128, 512)


def main(threads: int) -> None:
    torch.set_num_threads(threads)
    print(f"torch {torch.__version__}, {threads} threads, float32; ms: x @ W^T / (W @ x^T)^T")
    for out_f, in_f in SHAPES:
        w = torch.randn(out_f, in_f)
        reps = 5 if out_f * in_f > 10**7 else 30
        cells = []
        for rows in ROWS:
            x = torch.randn(rows, in_f)
            plain = ms(lambda: F.linear(x, w), reps)
            left = ms(lambda: (w @ x.t()).t().contiguous(), reps)
            cells.append(f"{rows}: {plain:.2f}/{left:.2f}")
        print(f"W {out_f}x{in_f}  " + " | ".join(cells))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
