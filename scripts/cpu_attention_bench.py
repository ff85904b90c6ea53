"""One layer's attention on the CPU, ms per call: attend() against other forms of the same attention.

    python scripts/cpu_attention_bench.py [threads]     # SmolLM2-135M's shape: 9 query heads, 3 KV heads, D 64

Forms: attend() (the GQA fold, the view's mask); SDPA with a lower-right causal bias and enable_gqa (the
form attend() uses on CUDA); SDPA over K/V copied to (B, H_kv, S, D) beforehand (the layout SDPA's CPU
kernel reads contiguously; the copy is not timed); plain matrix products. Each error is against float64.
"""
from __future__ import annotations

import math
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
from tforce.cache.base import CacheView, visibility  # noqa: E402
from tforce.model.attention import fold_heads, fold_mask, attend, attend_reference, lower_right  # noqa: E402

H_Q, H_KV, D = 9, 3, 64


def ms(f, n=30) -> float:
    for _ in range(3):
        f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e3


def main(threads: int) -> None:
    torch.set_num_threads(threads)
    print(f"torch {torch.__version__}, {threads} threads; heads {H_Q}/{H_KV}, head dim {D}; ms per call")
    for dtype in (torch.float32, torch.bfloat16):
        for S in (1000, 7500):
            for T in (1, 7):
                g = torch.Generator().manual_seed(S + T)
                k, v = (torch.randn(1, S, H_KV, D, generator=g).to(dtype) for _ in range(2))
                q = torch.randn(1, T, H_Q, D, generator=g).to(dtype)
                mask = visibility(torch.arange(S)[None], torch.arange(S - T, S)) if T > 1 else None
                view = CacheView(k, v, mask, causal=True)
                kc, vc = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
                folded_mask = fold_mask(view, H_Q // H_KV)  # attend()'s fold of the heads and the mask

                def contiguous():
                    return F.scaled_dot_product_attention(fold_heads(q, H_KV), kc, vc, attn_mask=folded_mask)

                def products():
                    s = torch.matmul(fold_heads(q, H_KV), k.permute(0, 2, 3, 1)).float() / math.sqrt(D)
                    if folded_mask is not None:
                        s = s.masked_fill(~folded_mask, float("-inf"))
                    return torch.matmul(s.softmax(-1).to(dtype), v.transpose(1, 2))

                ref = attend_reference(q.double(), CacheView(k.double(), v.double(), mask))
                err = (lower_right(q, view).double() - ref).abs().max().item()
                print(f"{str(dtype)[6:]:9s} keys {S:5d} queries {T}: attend {ms(lambda: attend(q, view)):.3f} | "
                      f"lower-right {ms(lambda: lower_right(q, view)):.3f} (err {err:.1e}) | "
                      f"(B, H, S, D) K/V {ms(contiguous):.3f} | products {ms(products):.3f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
