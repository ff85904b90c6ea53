"""Chunk statistics for retrieval rebuilds: the float32 key sum of every complete chunk, per layer and KV head.

A rebuild scores chunks by (group query) . (chunk mean key). Computing the means from the keys reads the
whole context, which for a layer in host memory is a PCIe-sized read per layer per rebuild. Instead the
sums of complete chunks are kept here, computed once per chunk from its own rows: at prefill from the
keys while they are still on the device (`observe`), later from the rows committed since the last update
(`update`, which reads only those rows). A rebuild then reads the sums plus the few rows of the partial
last chunk, and fetches only the selected rows' K/V.

Sums add a chunk's rows one at a time in order (`chunk_sums`): every output element is the same chain of
float32 additions however many chunks are summed at once and on whatever device, so the incremental
statistics are bit-identical to a from-scratch computation.

Where they live: with the layer's KV. A resident layer's sums sit on its device; an offloaded layer's in
host memory (pinned when the device is CUDA) and are copied to the device, where the query is, to score.
Size per layer: `chunk_stats_bytes(capacity, chunk, n_kv, head_dim)`: a quarter of the layer's keys in
bfloat16, 7.5 GiB for Llama-2-7B at 122,880 tokens. When the plan has no room for the resident layers'
sums (placement.plan: the whole cache on an 80 GB device at 122K tokens), they are not kept
(`recompute_resident`): each rebuild sums such a layer's chunks from its keys, on the device, with the
same chain of additions (bit-identical means), reading the layer's keys once instead of keeping sums.

Rows below the length the statistics cover must not change except by truncation seen at the next
update (`truncate`): the engine rebuilds only from committed tokens, which are final.
"""
from __future__ import annotations

import torch


def chunk_stats_bytes(capacity: int, chunk: int, n_kv: int, head_dim: int) -> int:
    """Bytes of one layer's statistics: a float32 (H_kv, D) sum per complete chunk of `capacity` tokens."""
    return (capacity // chunk) * n_kv * head_dim * 4


def chunk_sums(rows: torch.Tensor, chunk: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """rows (n * chunk, H_kv, D) -> float32 sums (n, H_kv, D), adding each chunk's rows in order (into `out`
    if given, on rows' device)."""
    x = rows.view(-1, chunk, *rows.shape[1:])
    total = x[:, 0].to(torch.float32, copy=True) if out is None else out.copy_(x[:, 0])
    for j in range(1, chunk):
        total += x[:, j]
    return total


class ChunkStats:
    """Key sums (capacity // chunk, H_kv, D) per layer, with the number of chunks each holds; a layer whose
    home is None keeps none (its sums are taken from its keys at every `means`)."""

    def __init__(self, homes: list[torch.device | None], capacity: int, chunk: int, n_kv: int, head_dim: int,
                 pin: bool = False):
        self.chunk, self.row_shape = chunk, (n_kv, head_dim)
        shape = (capacity // chunk, n_kv, head_dim)
        # Ordinary tensors even when first used inside the inference-mode prefill: rebuilds outside it
        # write into them.
        with torch.inference_mode(False):
            self.sums = [None if home is None else
                         torch.zeros(shape, dtype=torch.float32, device=home, pin_memory=pin and home.type == "cpu")
                         for home in homes]
        self.chunks = [0] * len(homes)  # complete chunks summed, per layer (kept ones)

    @classmethod
    def for_cache(cls, full, chunk: int, recompute_resident: bool = False) -> "ChunkStats":
        """Statistics shaped for a FullCache (or OffloadedCache), each layer's next to its KV; with
        recompute_resident, none kept for the layers on the compute device."""
        homes = [full.kv_home(layer) for layer in range(full.n_layers)]
        return cls(kept_homes(homes, full.k.device, recompute_resident), full.capacity, chunk, *full.k.shape[-2:],
                   pin=full.k.device.type == "cuda")

    def truncate(self, length: int) -> None:
        """Forget chunks not wholly below `length` (the full cache was rolled back under them)."""
        self.chunks = [min(n, length // self.chunk) for n in self.chunks]

    def observe(self, layer: int, keys: torch.Tensor, start: int) -> None:
        """keys (B, n, H_kv, D) of positions [start, start + n), wherever they are (e.g. on the device at
        prefill): sum the complete chunks that start at or after what the layer holds."""
        c = self.chunk
        if self.sums[layer] is None:
            return
        assert start <= self.chunks[layer] * c, "rows missing between the statistics and these keys"
        first = self.chunks[layer]
        last = (start + keys.shape[1]) // c
        if last <= first:
            return
        rows = keys[0, first * c - start:last * c - start]
        self.sums[layer][first:last].copy_(chunk_sums(rows, c))
        self.chunks[layer] = last

    def update(self, layer: int, full, length: int) -> None:
        """Sum the chunks completed since the last update, reading only their rows from `full`."""
        first, last = self.chunks[layer], length // self.chunk
        if last > first and self.sums[layer] is not None:
            self.observe(layer, full.read_keys(layer, first * self.chunk, last * self.chunk), first * self.chunk)

    def means(self, layer: int, full, length: int, device) -> torch.Tensor:
        """Chunk mean keys (ceil(length / chunk), H_kv, D) float32 on `device`; the partial last chunk's
        from its few rows. update(layer, full, length) must have run. One layer's means are the only
        scratch of this size (placement: "retrieval chunk statistics")."""
        c, n = self.chunk, length // self.chunk
        means = torch.empty((-(-length // c), *self.row_shape), dtype=torch.float32, device=device)
        if self.sums[layer] is None:  # not kept: the layer's keys are on `device`
            chunk_sums(full.read_keys(layer, 0, n * c)[0], c, out=means[:n])
        else:
            assert self.chunks[layer] >= n, "update() first"
            means[:n].copy_(self.sums[layer][:n], non_blocking=True)
        means[:n].div_(c)
        if length > n * c:
            rows = full.read_keys(layer, n * c, length)[0]  # (r < chunk, H_kv, D)
            means[n] = chunk_sums(rows, length - n * c)[0].to(device) / (length - n * c)
        return means


def kept_homes(homes: list[torch.device], device: torch.device, recompute_resident: bool) -> list[torch.device | None]:
    """Where each layer's sums live, given its KV's home: there, or nowhere (None) for a layer on the compute
    `device` when recompute_resident."""
    return [None if recompute_resident and home == device else home for home in homes]
