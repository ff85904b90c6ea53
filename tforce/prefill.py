"""Layer-major prefill: every layer runs over the whole prompt before the next one starts.

Token-major chunked prefill re-reads the KV prefix of every layer for every chunk; with the KV cache in
host memory that is PCIe traffic quadratic in the prompt. Layer-major order keeps one layer's K/V for
the whole prompt on the device in a scratch cache, runs that layer chunk by chunk, then hands the
layer to the real cache, which sends an offloaded layer to host memory exactly once: traffic linear
in the prompt. The chunks are the same as token-major prefill's, so the results are bit-identical.
Device memory: the prompt's hidden states plus one layer's K/V, which an offloaded cache's first
staging buffer holds (it is idle until the first forward after prefill), so only the hidden states
are new (placement.py counts them as "prefill hidden states").

Two entry points over one loop (`_run_layers`): `prefill_layer_major` for one prompt into a FullCache /
OffloadedCache, `prefill_rows_layer_major` for a batch's rows of different lengths into a RowsCache /
RowsOffloadedCache (cache/batched.py, cache/rows_offload.py). What crosses PCIe for an offloaded layer,
either way: device -> host, each row's prompt K/V once (write_layer, one copy per row); host -> device,
nothing (attention within the prefill reads the layer's K/V from the scratch, on the device).
"""
from __future__ import annotations

import torch

from .cache import FullCache
from .cache.batched import RowsCache


class _AsLayerZero:
    """Lets a decoder layer with any index write into the one-layer scratch cache."""

    def __init__(self, scratch):
        self.scratch = scratch

    def update(self, layer, q, k, v):
        return self.scratch.update(0, q, k, v)


def _scratch(model, full, n: int, rows: int | None = None):
    """A one-layer cache for n tokens (a FullCache, or a RowsCache of `rows` rows), and the device bytes it
    allocated: its storage is the first staging buffer of an offloaded cache (nothing new), else its own."""
    stage_k = getattr(full, "stage_k", None)
    dims = (model.n_kv_heads, model.head_dim)
    make = (lambda cap, dev: FullCache(1, *dims, cap, full.rotary, full.k.dtype, dev)) if rows is None else \
        (lambda cap, dev: RowsCache(1, rows, *dims, cap, full.rotary, full.k.dtype, dev))
    if stage_k is None:
        scratch = make(n, full.k.device)
        return scratch, scratch.k.nbytes + scratch.v.nbytes
    scratch = make(0, stage_k.device)
    scratch.k, scratch.v = stage_k[:1, :, :n], full.stage_v[:1, :, :n]  # (1, B, n, H_kv, D) views
    scratch.capacity = n
    return scratch, 0


def _run_layers(model, x: torch.Tensor, scratch, steps, restart, hand_over, progress, total: int) -> None:
    """x (B, N, hidden) through every layer in place: per layer the scratch restarts empty (restart()),
    takes the chunks steps = [(a, b, counts, done)]: positions [a, b) of x, each row committing counts
    of them, `done` token-layers of the layer finished after it; then hand_over(layer) takes the layer."""
    layers = model.model.layers
    alias = _AsLayerZero(scratch)
    for i, layer in enumerate(layers):
        restart()
        for a, b, counts, done in steps:
            scratch.begin(b - a)
            # contiguous: with B > 1 rows the slice is strided, and token-major prefill feeds a layer a
            # fresh tensor (the same GEMM inputs, whatever path a strided input would take)
            x[:, a:b] = layer(x[:, a:b].contiguous(), alias)
            scratch.commit(counts)
            if progress:
                progress(i * total + done, len(layers) * total)
        hand_over(i)


@torch.inference_mode()
def prefill_layer_major(model, ids: torch.Tensor, full: FullCache, chunk: int, progress=None,
                        on_layer=None) -> int:
    """Append ids (N,) to `full` (which must be empty); progress(done, total) in token-layers;
    on_layer(i, keys) sees each layer's rotated keys (1, N, H_kv, D) on the device before they leave.
    Returns the device bytes it allocated beyond the model's own activations (hidden states, scratch)."""
    assert full.length == 0, "layer-major prefill starts from an empty cache"
    n = len(ids)
    scratch, scratch_bytes = _scratch(model, full, n)
    x = model.model.embed_tokens(ids[None].to(scratch.k.device))  # (1, N, hidden)

    def hand_over(i):
        if on_layer:
            on_layer(i, scratch.k[0, :, :n])
        full.write_layer(i, scratch.k[0, :, :n], scratch.v[0, :, :n])
        full.queries[i] = scratch.queries[0]

    steps = [(a, min(a + chunk, n), min(a + chunk, n) - a, min(a + chunk, n)) for a in range(0, n, chunk)]
    _run_layers(model, x, scratch, steps, lambda: scratch.truncate(0), hand_over, progress, n)
    full.query_pos = scratch.query_pos
    full.commit_written(n)
    return x.nbytes + scratch_bytes


@torch.inference_mode()
def prefill_rows_layer_major(model, seqs: list[list[int]], full: RowsCache, chunk: int, progress=None,
                             on_layer=None) -> int:
    """Row b of `full` (every row empty, one per sequence) takes seqs[b], in the chunks RowsNode.hold feeds
    token-major (every row's next `chunk` tokens per forward, padded at the end to the longest: the row
    rule of cache/base.py), so each row's K/V and kept queries are bit-identical to hold's. progress as
    prefill_layer_major's (token-layers of all rows); on_layer(i, keys) sees each layer's rotated keys
    (B, N, H_kv, D) on the device before they leave, row b's first len(seqs[b]) real (N: the longest).
    Returns the device bytes it allocated beyond the model's own activations (hidden states, scratch)."""
    B, lengths = len(seqs), [len(s) for s in seqs]
    assert full.rows == B and not full.lengths[:B].any(), "layer-major prefill starts from empty rows"
    N = max(lengths)
    scratch, scratch_bytes = _scratch(model, full, N, rows=B)
    ids = torch.tensor([s + [0] * (N - len(s)) for s in seqs], dtype=torch.long)  # (B, N), padded at the end
    x = model.model.embed_tokens(ids.to(scratch.k.device))  # (B, N, hidden)
    queries: list[tuple[int, list[torch.Tensor]] | None] = [None] * B

    def hand_over(i):
        keys, values = scratch.k[0, :, :N], scratch.v[0, :, :N]
        if on_layer:
            on_layer(i, keys)
        full.write_layer(i, keys, values, lengths)
        for b, held in enumerate(scratch.row_queries):  # row b's last real chunk's queries, this layer's
            if held is not None:
                queries[b] = (held[0], (queries[b][1] if i else []) + held[1])

    steps = []
    for a in range(0, N, chunk):
        counts = [max(0, min(chunk, n - a)) for n in lengths]
        steps.append((a, a + max(counts), torch.tensor(counts), sum(min(a + chunk, n) for n in lengths)))
    zero = torch.zeros(B, dtype=torch.long)
    _run_layers(model, x, scratch, steps, lambda: scratch.truncate(zero), hand_over, progress, sum(lengths))
    full.row_queries[:B] = queries
    full.commit_written(lengths)
    return x.nbytes + scratch_bytes
