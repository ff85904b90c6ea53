"""Linear: nn.Linear whose product of float32 rows on the CPU takes the form that measured fastest there.

Why, for one row (every decode step's projections and output head): PyTorch's CPU product of one row by a
large float32 weight ran on one thread (MKL's matrix-vector kernel: 17.6 ms on one thread and 15.9 on two
for SmolLM2's 49152 x 576 output head, 2-core AVX2 CPU, torch 2.13), half the memory's read rate. Seen as a
batch of row blocks, W (N, K) -> (blocks, N / blocks, K), the same product is a batched one that PyTorch
splits across threads: 7.2 ms for that head, at the rate a plain sum of the weight reads it (7.0 ms);
0.43 -> 0.26 ms for a 1536 x 576 MLP weight; no change for weights under a megabyte (BENCHMARKS.md, "CPU,
one row across threads").
Why, for 2 to 64 rows (a verification's gamma2 + 1 tokens, a batch's rows): x @ W^T of a large weight ran
1.4-4.7x slower than (W @ x^T)^T on the same operands (76.7 against 23.5 ms for 7 rows through Llama-2-7B's
11008 x 4096 MLP weight, 41.1 against 15.3 ms through SmolLM2's head), while 512 rows cost about the same
either way (BENCHMARKS.md, "CPU, the product of a few rows"). With W on the left the weight is streamed once,
as for one row.
The same products otherwise (another dtype or device, a prefill chunk): nn.Linear's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Rows for which W @ x^T measured faster (2-56; 64 rounds up a batch of 8 rows x 8 tokens); a prefill chunk of
# 512 measured the same either way and keeps the plain product.
_FEW_ROWS = range(2, 65)
# Weights from this many elements (1 MiB of float32) gained from the row-block split for one row (576 x 576
# and up); a 192 x 576 one did not.
_SPLIT_ELEMENTS = 1 << 18


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), x (..., in) -> (..., out), in the form that measured faster (module
    docstring)."""
    # the cheapest tests first: every projection of every forward passes here (is_cpu: device.type cost 1.5
    # us a call on this CPU, is_cpu 0.2)
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or not x.is_cpu:
        return F.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows == 1:
        if weight.numel() < _SPLIT_ELEMENTS:
            return F.linear(x, weight, bias)
        return _one_row(x, weight, bias)
    if rows not in _FEW_ROWS:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    out = (weight @ flat.t()).t()  # (rows, out), a transposed view
    if bias is not None:
        out = out + bias
    return out.contiguous().view(*x.shape[:-1], weight.shape[0])


def _one_row(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One row by W as `blocks` row blocks of W, one batched product PyTorch splits across its threads."""
    N, K = weight.shape
    blocks = torch.get_num_threads()
    if blocks < 2 or N % blocks or not weight.is_contiguous():
        return F.linear(x, weight, bias)
    # the column as x.reshape(1, K).t(), strides (1, K): a (K, 1) view with strides (1, 1) took a path 2.7x
    # slower in the same bmm (23.6 against 8.7 ms for the head above)
    column = x.reshape(1, K).t().expand(blocks, K, 1)
    out = torch.bmm(weight.view(blocks, N // blocks, K), column)
    out = out.view(*x.shape[:-1], N)
    return out if bias is None else out + bias


class Linear(nn.Linear):
    """nn.Linear (the same parameters and state-dict names) computed by `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
