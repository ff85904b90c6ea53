"""On a CUDA GPU: can the full cache's one-token forward be replayed from a CUDA graph without flash-attn?

On-chip `ar` is bound by the host: some 1,400 kernel launches per forward cost 15-28 ms beyond the
forward's byte floor (BENCHMARKS.md, GPU log, 2026-11-27). The draft and middle levels already replay
CUDA graphs; the full cache cannot, because its attention reads a growing number of keys and a graph
replays fixed shapes. A fixed-shape call exists without flash-attn: ATen's own flash kernel
(`torch.ops.aten._flash_attention_forward`) takes the keys of the whole buffer and `seqused_k`, a device
tensor saying how many of them are real. This probe checks, before anything in tforce depends on it:

1. exactness: that call with seqused_k = L equals SDPA over the first L keys (one query, and 7 queries
   bottom-right causal), GQA heads included;
2. that it replays from a CUDA graph with L changed between replays (only the tensor's value changes);
3. its time inside a graph at the buffer's full size against SDPA on exactly L keys, per layer, and a
   32-layer stack of graphed calls against 32 eager ones (the launch cost a graph removes).

    python3 scripts/gpu_graph_probe.py > $OUT/graph_probe.jsonl
"""
from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

FLASH = torch.ops.aten._flash_attention_forward
_CU: dict = {}  # (queries, keys, device) -> the cumulative lengths, made once


def seqused(q, k, v, used: torch.Tensor, causal: bool) -> torch.Tensor:
    """q (1, T, H, D), k/v (1, C, H_kv, D) of which the first used[0] keys count -> (1, T, H, D)."""
    T, C = q.shape[1], k.shape[1]
    key = (T, C, q.device)
    if key not in _CU:  # made before any capture: a graph cannot copy from pageable host memory
        _CU[key] = (torch.tensor([0, T], dtype=torch.int32, device=q.device),
                    torch.tensor([0, C], dtype=torch.int32, device=q.device))
    cu_q, cu_k = _CU[key]
    out = FLASH(q[0], k[0], v[0], cu_q, cu_k, T, C, 0.0, causal, False, seqused_k=used)[0]
    return out.unsqueeze(0)


def sdpa(q, k, v, L: int) -> torch.Tensor:
    T = q.shape[1]
    kk, vv = k[:, :L].transpose(1, 2), v[:, :L].transpose(1, 2)
    bias = causal_lower_right(T, L) if T > 1 else None
    out = F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, attn_mask=bias,
                                         enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def timed(fn, n=20) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def case(C: int, L: int, T: int, h_q=32, h_kv=8, D=128, dtype=torch.bfloat16) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(C + L + T)
    q = torch.randn(1, T, h_q, D, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(1, C, h_kv, D, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(1, C, h_kv, D, device="cuda", dtype=dtype, generator=gen)
    used = torch.tensor([L], dtype=torch.int32, device="cuda")
    row = {"capacity": C, "keys": L, "queries": T, "h_q": h_q, "h_kv": h_kv}
    try:
        got = seqused(q, k, v, used, causal=T > 1)
    except (RuntimeError, TypeError) as e:
        return {**row, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    ref = sdpa(q, k, v, L)
    row["max_diff"] = (got.float() - ref.float()).abs().max().item()
    # graph: capture at L, replay at L - 1 after changing only the tensor
    static_out = torch.empty_like(got)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        static_out.copy_(seqused(q, k, v, used, T > 1))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out.copy_(seqused(q, k, v, used, T > 1))
    used.fill_(L - 1)
    graph.replay()
    torch.cuda.synchronize()
    row["graph_replay_max_diff"] = (static_out.float() - sdpa(q, k, v, L - 1).float()).abs().max().item()
    used.fill_(L)
    row["graph_ms"] = timed(graph.replay)
    row["eager_seqused_ms"] = timed(lambda: seqused(q, k, v, used, T > 1))
    row["sdpa_exact_len_ms"] = timed(lambda: sdpa(q, k, v, L))
    return row


def stack(layers=32, C=8192, L=8000) -> dict:
    """32 graphed calls in one graph against 32 eager calls: what the launches cost."""
    q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    ks = [torch.randn(1, C, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(layers)]
    used = torch.tensor([L], dtype=torch.int32, device="cuda")
    eager = lambda: [seqused(q, k, k, used, False) for k in ks]  # noqa: E731
    eager()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eager()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        eager()
    return {"stack_layers": layers, "capacity": C, "keys": L, "eager_ms": timed(eager), "graph_ms": timed(graph.replay)}


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("gpu_graph_probe: needs a CUDA device")
    print(json.dumps({"torch": torch.__version__, "device": torch.cuda.get_device_name()}), flush=True)
    for C, L, T in ((8192, 8000, 1), (8192, 8000, 7), (131072, 122880, 1), (131072, 122880, 7)):
        print(json.dumps(case(C, L, T)), flush=True)
    try:
        print(json.dumps(stack()), flush=True)
    except RuntimeError as e:
        print(json.dumps({"stack_error": str(e).splitlines()[0][:200]}), flush=True)
