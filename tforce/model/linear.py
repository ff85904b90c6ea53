"""Linear: nn.Linear whose product, for a few rows of float32 on the CPU, is computed as W @ x^T.

Why: for 2 to 56 rows (a verification's gamma2 + 1 tokens, a batch's rows) PyTorch's CPU product x @ W^T
of a large weight ran 1.4-4.7x slower than (W @ x^T)^T on the same operands (2-core AVX2 CPU, torch
2.13, float32): 76.7 against 23.5 ms for 7 rows through Llama-2-7B's 11008 x 4096 MLP weight, 41.1
against 15.3 ms through SmolLM2's 49152 x 576 output head, while one row and 512 rows cost about the
same either way, and small weights the same within noise (BENCHMARKS.md, "CPU, the product of a few
rows"). With W on the left the weight is streamed once, as for one row.
The same products otherwise (another dtype or device, one row, a prefill chunk): nn.Linear's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Rows for which W @ x^T measured faster (2-56; 64 rounds up a batch of 8 rows x 8 tokens); one row and a
# prefill chunk of 512 measured the same either way and keep the plain product.
_FEW_ROWS = range(2, 65)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), x (..., in) -> (..., out), by W @ x^T where that measured faster."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows not in _FEW_ROWS or x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    out = (weight @ flat.t()).t()  # (rows, out), a transposed view
    if bias is not None:
        out = out + bias
    return out.contiguous().view(*x.shape[:-1], weight.shape[0])


class Linear(nn.Linear):
    """nn.Linear (the same parameters and state-dict names) computed by `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
