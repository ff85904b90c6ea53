"""On a CUDA GPU: does tforce's SDPA path (no flash-attn) materialise the attention scores?

For each shape, the extra device memory attend() allocates beyond its inputs and output, its time, and
whether the memory-efficient backend alone accepts the call. Also checks attend() against the float64
reference on fresh random inputs at a small size. Prints one JSON line per shape, a table last.

And a candidate for the prefill and verification gap (GPU queue item c), measured, not used by tforce:
the full cache's views are plain bottom-right causal (view.causal), which SDPA can take as a
`causal_lower_right` bias instead of a materialised mask, GQA through enable_gqa instead of folding; that
form may reach SDPA's flash backend. Per shape: its time, whether it runs with the flash backend alone,
and its largest difference from attend()'s output.

    python3 scripts/gpu_sdpa_probe.py > $OUT/sdpa_probe.jsonl
"""
from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

sys.path.insert(0, ".")
from tforce.model import attention  # noqa: E402
from tforce.model.attention import attend, attend_reference  # noqa: E402
from tforce.cache.base import CacheView  # noqa: E402


def view_for(T, S, h_kv, D, dtype, gen):
    k = torch.randn(1, S, h_kv, D, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(1, S, h_kv, D, device="cuda", dtype=dtype, generator=gen)
    mask = torch.ones(T, S, dtype=torch.bool, device="cuda").tril(S - T)[None]
    return CacheView(k, v, mask, causal=True)


def probe(T, S, h_q, h_kv, D=128, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(T * 7 + S)
    view = view_for(T, S, h_kv, D, dtype, gen)
    q = torch.randn(1, T, h_q, D, device="cuda", dtype=dtype, generator=gen)
    attend(q, view, use_flash=False)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = attend(q, view, use_flash=False)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - out.numel() * out.element_size()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        attend(q, view, use_flash=False)
    end.record()
    torch.cuda.synchronize()
    efficient = efficient_alone(q, view)
    scores = h_q * T * S * 4
    return {"T": T, "S": S, "h_q": h_q, "h_kv": h_kv, "dtype": str(dtype).split(".")[-1],
            "extra_bytes": extra, "float32_scores_bytes": scores, "ms": start.elapsed_time(end) / 5,
            "efficient_backend_accepts": efficient, **lower_right_probe(q, view, out)}


def lower_right(q, view, backends=None):
    """view (plain causal, the T queries the last T keys) as SDPA with a causal_lower_right bias, GQA by
    enable_gqa: (B, T, H_q, D), the layout attend() returns."""
    T, S, group = q.shape[1], view.k.shape[1], q.shape[2] // view.k.shape[2]
    with sdpa_kernel(backends) if backends else sdpa_kernel(attention._CUDA_BACKENDS):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), view.k.transpose(1, 2), view.v.transpose(1, 2),
                                             attn_mask=causal_lower_right(T, S), enable_gqa=group > 1)
    return out.transpose(1, 2)


def lower_right_probe(q, view, reference) -> dict:
    """The candidate's time (ms), whether the flash backend alone runs it, its max |difference| from attend()."""
    try:
        got = lower_right(q, view)
    except RuntimeError as e:
        return {"lower_right_error": str(e).splitlines()[0][:200]}
    try:
        lower_right(q, view, [SDPBackend.FLASH_ATTENTION])
        flash = True
    except RuntimeError:
        flash = False
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        lower_right(q, view)
    end.record()
    torch.cuda.synchronize()
    return {"lower_right_ms": start.elapsed_time(end) / 5, "lower_right_flash_alone": flash,
            "lower_right_max_diff": (got.float() - reference.float()).abs().max().item()}


def efficient_alone(q, view) -> bool:
    """Whether attend() runs with SDPA limited to the memory-efficient backend. attend() enters
    sdpa_kernel(attention._CUDA_BACKENDS) itself, which replaces whatever an outer sdpa_kernel allowed (MATH
    among them, so the call never failed): the list it enters is what is restricted here."""
    saved = attention._CUDA_BACKENDS
    attention._CUDA_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION]
    try:
        attend(q, view, use_flash=False)
        return True
    except RuntimeError:
        return False
    finally:
        attention._CUDA_BACKENDS = saved


def check_exact():
    errs = []
    for h_q, h_kv in ((32, 32), (32, 8)):
        gen = torch.Generator(device="cuda").manual_seed(h_kv)
        view = view_for(64, 4096, h_kv, 128, torch.float32, gen)
        q = torch.randn(1, 64, h_q, 128, device="cuda", generator=gen)
        got, ref = attend(q, view, use_flash=False).double(), attend_reference(q, view).double()
        errs.append(((got - ref).norm() / ref.norm()).item())
    return errs


if __name__ == "__main__":
    rows = []
    print(json.dumps({"relative_error_fp32_vs_float64": check_exact()}), flush=True)
    for h_q, h_kv in ((32, 32), (32, 8)):
        for S in (32768, 131072):
            for T in (1, 7, 512):
                r = probe(T, S, h_q, h_kv)
                rows.append(r)
                print(json.dumps(r), flush=True)
    print(f"{'h_q/h_kv':>9} {'S':>7} {'T':>4} {'extra MiB':>10} {'fp32 scores MiB':>16} {'ms':>8} efficient"
          f" {'lower-right ms':>14} flash-alone max-diff", file=sys.stderr)
    for r in rows:
        print(f"{r['h_q']:>4}/{r['h_kv']:<4} {r['S']:>7} {r['T']:>4} {r['extra_bytes'] / 2**20:>10.1f} "
              f"{r['float32_scores_bytes'] / 2**20:>16.1f} {r['ms']:>8.3f} {r['efficient_backend_accepts']!s:>9} "
              f"{r.get('lower_right_ms', float('nan')):>14.3f} {r.get('lower_right_flash_alone', '-')!s:>11} "
              f"{r.get('lower_right_max_diff', float('nan')):.2e}", file=sys.stderr)
