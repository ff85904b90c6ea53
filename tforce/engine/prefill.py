"""Layer-major prefill: every layer runs over the whole prompt before the next one starts.

Token-major chunked prefill re-reads the KV prefix of every layer for every chunk; with the KV cache in
host memory that is PCIe traffic quadratic in the prompt. Layer-major order keeps one layer's K/V for
the whole prompt on the device in a scratch cache, runs that layer chunk by chunk, then hands the
layer to the real cache, which sends an offloaded layer to host memory exactly once: traffic linear
in the prompt. The chunks are the same as token-major prefill's, so the results are bit-identical.
Device memory: the prompt's hidden states plus one layer's K/V, which an offloaded cache's first
staging buffer holds (it is idle until the first forward after prefill), so only the hidden states
are new (placement.py counts them as "prefill hidden states").

Rows of different lengths take the chunks token-major prefill feeds them (every row's next `chunk`
tokens per forward, padded at the end to the longest: the row rule of docs/architecture.md), so each row's K/V
and kept queries are bit-identical to token-major prefill's. What crosses PCIe for an offloaded layer:
device -> host, each row's prompt K/V once (write_layer, one copy per row); host -> device, nothing
(attention within the prefill reads the layer's K/V from the scratch, on the device).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..cache import FullCache
from ..cache.rows import per_row
from .rowwise import prefill_rows


class _AsLayerZero:
    """Lets a decoder layer with any index write into the one-layer scratch cache."""

    def __init__(self, scratch):
        self.scratch = scratch

    def update(self, layer, q, k, v):
        return self.scratch.update(0, q, k, v)


def _scratch(model, full, n: int, rows: int):
    """A one-layer FullCache of `rows` rows for n tokens, and the device bytes it allocated: its storage is
    the first staging buffer of an offloaded cache (nothing new), else its own."""
    stage_k = getattr(full, "stage_k", None)
    dims = (model.n_kv_heads, model.head_dim)
    if stage_k is None:
        scratch = FullCache(1, *dims, n, full.rotary, full.k.dtype, full.k.device, rows)
        return scratch, scratch.k.nbytes + scratch.v.nbytes
    scratch = FullCache(1, *dims, 0, full.rotary, full.k.dtype, stage_k.device, rows)
    scratch.k, scratch.v = stage_k[:1, :, :n], full.stage_v[:1, :, :n]  # (1, B, n, H_kv, D) views
    scratch.capacity = n
    return scratch, 0


def _run_layers(model, x: torch.Tensor, scratch, steps, restart, hand_over, progress, total: int,
                rowwise: bool = False) -> None:
    """x (B, N, hidden) through every layer in place: per layer the scratch restarts empty (restart()),
    takes the chunks steps = [(a, b, counts, done)]: positions [a, b) of x, each row committing counts
    of them, `done` token-layers of the layer finished after it; then hand_over(layer) takes the layer.
    rowwise: each row's chunk alone, as the row-wise verifier prefills rows (rowwise.py)."""
    layers = model.model.layers
    alias = _AsLayerZero(scratch)
    for i, layer in enumerate(layers):
        restart()
        for a, b, counts, done in steps:
            scratch.begin(b - a)
            if rowwise:
                prefill_rows(layer, x, a, per_row(counts, scratch.rows), alias, scratch.lengths[:scratch.rows])
            else:
                # contiguous: with B > 1 rows the slice is strided, and token-major prefill feeds a layer a
                # fresh tensor (the same GEMM inputs, whatever path a strided input would take)
                x[:, a:b] = layer(x[:, a:b].contiguous(), alias)
            scratch.commit(counts)
            if progress:
                progress(i * total + done, len(layers) * total)
        hand_over(i)


class Prefilled(NamedTuple):
    allocated: int  # device bytes beyond the model's own activations (hidden states, scratch)
    last: torch.Tensor  # (B, 1, hidden): each row's final hidden states at its last token, for its next token


@torch.inference_mode()
def prefill_layer_major(model, seqs, full: FullCache, chunk: int, progress=None, on_layer=None,
                        rowwise: bool = False) -> Prefilled:
    """Row b of `full` (every row empty, one per sequence) takes seqs[b] (token ids: a list or a 1-D
    tensor); progress(done, total) in token-layers of all rows; on_layer(i, keys) sees each layer's rotated
    keys (B, N, H_kv, D) on the device before they leave, row b's first len(seqs[b]) real (N: the longest).
    rowwise (deterministic, rows > 1): each row's chunks computed alone, bit for bit its prefill alone."""
    seqs = [s.tolist() if torch.is_tensor(s) else list(s) for s in seqs]
    B, lengths = len(seqs), [len(s) for s in seqs]
    assert full.rows == B and not any(full.lengths[:B]), "layer-major prefill starts from empty rows"
    N = max(lengths)
    scratch, scratch_bytes = _scratch(model, full, N, B)
    ids = torch.tensor([s + [0] * (N - len(s)) for s in seqs], dtype=torch.long)  # (B, N), padded at the end
    x = model.model.embed_tokens(ids.to(scratch.k.device))  # (B, N, hidden)
    queries: list[tuple[int, int, list[torch.Tensor]] | None] = [None] * B

    def hand_over(i):
        keys, values = scratch.k[0, :, :N], scratch.v[0, :, :N]
        if on_layer:
            on_layer(i, keys)
        full.write_layer(i, keys, values, lengths)
        for b, held in enumerate(scratch.row_queries):  # row b's last real chunk's queries, this layer's
            if held is not None:
                queries[b] = (held[0], held[1], (queries[b][2] if i else []) + held[2])

    steps = []
    for a in range(0, N, chunk):
        counts = [max(0, min(chunk, n - a)) for n in lengths]
        steps.append((a, a + max(counts), counts[0] if B == 1 else torch.tensor(counts),
                      sum(min(a + chunk, n) for n in lengths)))
    _run_layers(model, x, scratch, steps, lambda: scratch.truncate(0), hand_over, progress, sum(lengths),
                rowwise and B > 1)
    full.row_queries[:B] = queries
    full.commit_written(lengths)
    last = x[torch.arange(B, device=x.device), torch.tensor(lengths, device=x.device) - 1][:, None]
    return Prefilled(x.nbytes + scratch_bytes, last)
