"""attend(q, view): attention of fresh queries over what a cache hands back.

flash-attn on CUDA when it is installed and the view's mask is plain causal (`flash_attn_func`, causal and
bottom-right aligned) or causal per row over each row's own count of keys (`flash_attn_with_kvcache` with
cache_seqlens: rows of different lengths); else, on CUDA, a plain causal view of several queries through SDPA's
flash backend with a lower-right causal bias (`lower_right`); PyTorch SDPA with the view's mask otherwise (and
for the retrieval cache's per-head masks), with each KV head's query heads folded into the query axis so that
memory stays O(S x H_kv);
`attend_reference` is the plain-math oracle the tests compare against.
Layouts are the ones fixed in docs/architecture.md: q (B, T, H_q, D), view.k / view.v (B, S, H_kv, D).
"""
from __future__ import annotations

import math
import warnings
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from ..cache.base import CacheView

# SDPA's backends on CUDA, cuDNN's left out: on an H100 with torch 2.11 it was PyTorch's first choice and
# cost 2.7 ms of host time per call (a new cuDNN graph for every key length, i.e. every decode step):
# 92 ms/token for Llama-2-7B on chip at 8K where the weights read in 5 ms (BENCHMARKS.md, GPU log).
_CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_FLASH_DTYPES = (torch.float16, torch.bfloat16)  # what flash kernels (flash-attn's and SDPA's) take

try:  # optional: the `gpu` extra
    from flash_attn import flash_attn_func
except ImportError:  # pragma: no cover - depends on the machine
    flash_attn_func = None
try:  # apart: a flash-attn without it still runs the causal views
    from flash_attn import flash_attn_with_kvcache
except ImportError:  # pragma: no cover - depends on the machine
    flash_attn_with_kvcache = None


def fold_heads(q: torch.Tensor, n_kv: int) -> torch.Tensor:
    """q (B, T, H_q, D) -> (B, H_kv, group * T, D): each KV head's query heads stacked along the query
    axis (row g * T + t is query head h * group + g at token t), so that SDPA sees as many query heads
    as KV heads and never needs K/V repeated per query head."""
    B, T, n_heads, D = q.shape
    return q.view(B, T, n_kv, n_heads // n_kv, D).permute(0, 2, 3, 1, 4).reshape(B, n_kv, -1, D)


def _unfold(out: torch.Tensor, T: int) -> torch.Tensor:
    """(B, H_kv, group * T, D) -> (B, T, H_q, D), the inverse of fold_heads."""
    B, n_kv, _, D = out.shape
    return out.view(B, n_kv, -1, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, -1, D)


def _batch_mask(m: torch.Tensor) -> torch.Tensor:
    """A view's mask as (B_m, H_m, T, S): (H_m, T, S) is the same for every row (B_m = 1); a batched
    cache's (B, 1, T, S) has one per row (docs/architecture.md, rows of different lengths)."""
    return m if m.dim() == 4 else m[None]


def fold_mask(view: CacheView, group: int) -> torch.Tensor | None:
    """view.mask, H_m in {1, H_kv} -> (B_m, H_m, group * T, S) for the folded queries: every query
    head of a group has its KV head's mask. Its size is that of the scores, never of K/V."""
    if view.mask is None:
        return None
    m = _batch_mask(view.mask)
    B, H, T, S = m.shape
    return m[:, :, None].expand(B, H, group, T, S).reshape(B, H, group * T, S)


def _sdpa_mask(view: CacheView, n_heads: int) -> torch.Tensor | None:
    """view.mask, H_m in {1, H_kv} -> (B_m, 1 or H_q, T, S), one mask per query head."""
    if view.mask is None:
        return None
    m = _batch_mask(view.mask)
    if m.shape[1] > 1:  # one mask per KV head: repeat for the query heads of its group
        m = m.repeat_interleave(n_heads // m.shape[1], dim=1)
    return m


def lower_right(q: torch.Tensor, view: CacheView) -> torch.Tensor:
    """A plain causal view (view.causal: the T queries are the last T keys) as SDPA with a
    `causal_lower_right` bias and GQA by enable_gqa: no mask materialised, K/V not repeated.
    q (B, T, H_q, D) -> (B, T, H_q, D)."""
    T, S = q.shape[1], view.k.shape[1]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), view.k.transpose(1, 2), view.v.transpose(1, 2),
                                         attn_mask=causal_lower_right(T, S), enable_gqa=q.shape[2] != view.k.shape[2])
    return out.transpose(1, 2)


# (device, dtype, head dim, GQA) -> whether SDPA's flash backend takes lower_right's call there; decided
# by the first call of each kind (flash needs a recent GPU, and the head dims and dtypes it supports).
_FLASH_TAKES_LOWER_RIGHT: dict[tuple, bool] = {}


def _flash_lower_right(q: torch.Tensor, view: CacheView) -> torch.Tensor | None:
    """lower_right() through SDPA's flash backend alone, or None where that backend does not take it.
    Why: on an H200 (torch 2.11) the masked call below ran the memory-efficient kernel at about 11x the
    K/V read time for 7 queries over 131,072 keys, this form at the read time (docs/architecture.md,
    "Attention"). Flash alone, since SDPA's other routes for this bias either fail on GQA or
    materialise the mask and run the math backend."""
    kind = (q.device, q.dtype, q.shape[-1], q.shape[2] != view.k.shape[2])
    if not _FLASH_TAKES_LOWER_RIGHT.get(kind, True):
        return None
    try:
        # a refusal also warns about each check that failed: the fallback is the answer, not the warnings
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = lower_right(q, view)
    except RuntimeError:
        _FLASH_TAKES_LOWER_RIGHT[kind] = False
        return None
    _FLASH_TAKES_LOWER_RIGHT[kind] = True
    return out


def flash_usable(q: torch.Tensor, view: CacheView) -> bool:
    kernel = flash_attn_with_kvcache if view.seqlens is not None else flash_attn_func if view.causal else None
    return kernel is not None and q.is_cuda and q.dtype in _FLASH_DTYPES


def attend(q: torch.Tensor, view: CacheView, use_flash: bool = True) -> torch.Tensor:
    """q (B, T, H_q, D) -> (B, T, H_q, D)."""
    if use_flash and flash_usable(q, view):
        # Same layout as ours, GQA native; causal=True aligns the T queries with the last T keys (of each
        # row's seqlens[b] with rows of different lengths; the keys beyond are not read).
        if view.seqlens is not None:
            return flash_attn_with_kvcache(q, view.k, view.v, cache_seqlens=view.seqlens, causal=True)
        return flash_attn_func(q, view.k, view.v, causal=q.shape[1] > 1)
    # CUDA only: on the CPU this form measured slower than the fold below (float32, 7 queries over 7,500
    # keys: 7.7 against 5.5 ms; BENCHMARKS.md, "Attention on the CPU").
    if q.is_cuda and q.dtype in _FLASH_DTYPES and view.causal and view.seqlens is None and q.shape[1] > 1:
        out = _flash_lower_right(q, view)
        if out is not None:
            return out
    # GQA folded into the query axis rather than SDPA's enable_gqa: with a mask, enable_gqa sends SDPA to
    # its math backend, which repeats K/V per query head and upcasts them to float32 (gigabytes per layer
    # at 128K tokens); folded, the heads match and the memory-efficient backend takes the mask.
    T, n_kv = q.shape[1], view.k.shape[2]
    with sdpa_kernel(_CUDA_BACKENDS) if q.is_cuda else nullcontext():
        out = F.scaled_dot_product_attention(
            fold_heads(q, n_kv),  # (B, H_kv, group * T, D)
            view.k.transpose(1, 2),  # (B, H_kv, S, D)
            view.v.transpose(1, 2),
            attn_mask=fold_mask(view, q.shape[2] // n_kv),
        )
    return _unfold(out, T)


def attend_reference(q: torch.Tensor, view: CacheView) -> torch.Tensor:
    """The same function in plain float64 math: softmax(q k^T / sqrt(D)) v with the view's mask."""
    n_heads, n_kv = q.shape[2], view.k.shape[2]
    group = n_heads // n_kv
    k = view.k.double().repeat_interleave(group, dim=2)  # (B, S, H_q, D)
    v = view.v.double().repeat_interleave(group, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q.double(), k) / math.sqrt(q.shape[-1])
    mask = _sdpa_mask(view, n_heads)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v).to(q.dtype)
