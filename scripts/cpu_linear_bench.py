"""Forms of the same float32 product on the CPU, ms per product, for a few row counts.

    python scripts/cpu_linear_bench.py [threads]

x @ W^T (F.linear) / (W @ x^T)^T / for one row also W's row blocks as one batched product (as many blocks as
threads). Shapes: SmolLM2-135M's attention, MLP and output-head weights, its draft's head, Llama-2-7B's MLP
weight and a 32000-word head. Each call reads another copy of the weight (out of the caches, as in a forward).
tforce.model.linear takes the batched form for one row and the second form for 2-64 rows (docs in that module).
"""
from __future__ import annotations

import itertools
import sys

import torch
import torch.nn.functional as F

from cpu_attention_bench import ms  # noqa: E402 (this folder is on sys.path when run as a script)

SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576), (49152, 256), (11008, 4096), (32000, 2048)]
ROWS = (1, 2, 4, 7, 16, 56, 128, 512)


def blocks(x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
    """One row (1, K) by w (N, K) as n row blocks of w in one bmm (tforce.model.linear's one-row form)."""
    N, K = w.shape
    return torch.bmm(w.view(n, N // n, K), x.t().expand(n, K, 1)).view(1, N)


def main(threads: int) -> None:
    torch.set_num_threads(threads)
    print(f"torch {torch.__version__}, {threads} threads, float32; ms: x @ W^T / (W @ x^T)^T [/ row blocks]")
    for out_f, in_f in SHAPES:
        copies = max(2, min(8, int(2e8 // (out_f * in_f * 4))))  # 200 MB of copies, beyond any cache
        ws = itertools.cycle([torch.randn(out_f, in_f) for _ in range(copies)])
        reps = 5 if out_f * in_f > 10**7 else 30
        cells = []
        for rows in ROWS:
            x = torch.randn(rows, in_f)
            plain = ms(lambda: F.linear(x, next(ws)), reps)
            left = ms(lambda: (next(ws) @ x.t()).t().contiguous(), reps)
            cell = f"{rows}: {plain:.2f}/{left:.2f}"
            if rows == 1 and threads > 1 and out_f % threads == 0:
                cell += f"/{ms(lambda: blocks(x, next(ws), threads), reps):.2f}"
            cells.append(cell)
        print(f"W {out_f}x{in_f}  " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
