"""A session's caches into a KV snapshot (the format: snapshot/format.py) and back into a fresh session.

What is not saved is rebuilt: the retrieval cache from the full cache (its chunk statistics are summed
again from the keys at the first rebuild, one read of each layer's keys); a streaming cache the snapshot
lacks or cannot restore (another method's, another draft, other --sinks or budgets) by prefilling it over
the prefix.

Writing streams one layer at a time (never the whole cache in an extra copy) into a temporary sibling
folder that is renamed into place once complete (under TP: once every rank has written its part; a rank
that fails makes every rank fail, and rank 0 removes the folder): a failed or killed run leaves no
snapshot, never a partial one (a killed one may leave the hidden temporary folder behind). An
existing snapshot at the path is replaced; anything else there is refused. Reading checks the manifest
against the running model first (a one-line refusal on any mismatch), then each file's checksum as it is
read, before its tensors are used.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save as st_save

from ..errors import TforceError
from .format import (FORMAT, MANIFEST, TP_VERSION, VERSION, manifest_sha, sha256_hex, check, check_target, read_manifest,
                     same_weights)
from .reader import Reader


# ------------------------------------------------------------------------------------------------- write

def _write(folder: Path, name: str, tensors: dict) -> str:
    data = st_save({k: t.detach().contiguous().cpu() for k, t in tensors.items()})
    with open(folder / name, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return sha256_hex(data)


def save(path, session, ident: dict, group=None) -> None:
    """Write the caches' prefix (what the full cache holds) to `path`, atomically. group: the
    tensor-parallel ranks (parallel.Group), every one of which calls save with its own session."""
    check_target(path)
    p = Path(path).expanduser()
    rank, world = (group.rank, group.world) if group is not None else (0, 1)
    tmp = None
    try:
        if rank == 0:
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent))
        if world == 1:
            files, streaming = _write_part(tmp, session, ident)
        else:
            tmp = Path(group.gather(str(tmp) if tmp is not None else None)[0])
            files, streaming = _gather_parts(path, tmp, session, ident, group)
        if rank == 0:
            full = session.full.cache
            P = full.length
            manifest = {"format": FORMAT, "version": VERSION if world == 1 else TP_VERSION, "tforce": _version(),
                        "target": ident["target"],
                        "tokenizer_sha256": ident["tokenizer_sha256"],
                        "dtype": str(full.k.dtype).replace("torch.", ""), "layers": full.n_layers,
                        "tokens": session.seq[:P].tolist(), "queries": P > 0, "streaming": streaming,
                        "files": files}
            if world > 1:
                manifest["world"] = world
            manifest["manifest_sha256"] = manifest_sha(manifest)
            with open(tmp / MANIFEST, "w") as f:
                json.dump(manifest, f)
                f.flush()
                os.fsync(f.fileno())
            _replace(tmp, p)
    except BaseException as e:
        if rank == 0 and tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):  # a full disk, a folder the system refuses: the user's problem, one line
            raise TforceError(f"--save-kv {path}: cannot write the snapshot: {e.strerror or e}") from e
        raise


def _write_part(folder: Path, session, ident: dict) -> tuple[dict, dict]:
    """Write this process's caches into `folder`, layer by layer: (file name -> sha256, the streaming
    caches' manifest entries)."""
    full = session.full.cache
    P = full.length
    files = {}
    queries = session.last_queries(P) if P else None
    for layer in range(full.n_layers):
        t = {"k": full.layer_keys(layer)[:, :P], "v": full.layer_values(layer)[:, :P]}
        if queries is not None:
            t["q"] = queries[layer]
        name = f"full-{layer:03d}.safetensors"
        files[name] = _write(folder, name, t)
    streaming = {}
    for node in session.streaming_nodes():
        state, c = node.cache.state(), node.cache
        name = f"{node.name}.safetensors"
        files[name] = _write(folder, name, {"k": state["k"], "v": state["v"]})
        model = ident["draft"] if node.name == "draft" else ident["target"]
        streaming[node.name] = {"length": state["length"], "offset": state["offset"], "sinks": c.sinks,
                                "window": c.window, "model": model}
    return files, streaming


def _gather_parts(path, tmp: Path, session, ident: dict, group) -> tuple[dict, dict]:
    """Every rank writes its part into tmp/rank-R/; then all learn every rank's files (named by their
    folder) or, if any rank failed, all raise that rank's error (so that none waits for the others)."""
    try:
        folder = tmp / _rank_folder(group.rank)
        folder.mkdir()
        part = _write_part(folder, session, ident)
    except Exception as e:
        part = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
    parts = group.gather(part)
    failed = next(((r, x) for r, x in enumerate(parts) if isinstance(x, str)), None)
    if failed is not None:
        raise TforceError(f"--save-kv {path}: rank {failed[0]} could not write its KV heads: {failed[1]}")
    files = {f"{_rank_folder(r)}/{name}": sha for r, (part_files, _) in enumerate(parts)
             for name, sha in part_files.items()}
    return files, parts[0][1]


def _rank_folder(rank: int) -> str:
    return f"rank-{rank}"


def _replace(tmp: Path, p: Path) -> None:
    """Rename the complete snapshot `tmp` to `p`, replacing a snapshot there."""
    old = None
    if p.exists():
        old = p.with_name(f".{p.name}.old-{os.getpid()}")
        os.rename(p, old)
    os.rename(tmp, p)
    if old is not None:
        shutil.rmtree(old)


def _version() -> str:
    from ..version import __version__

    return __version__


# -------------------------------------------------------------------------------------------------- read

class Heads:
    """A snapshot's per-layer files as one rank of a run over `world` ranks holds them: its own part's when
    the snapshot was made over as many ranks (or both in one process); else cut from the parts that hold
    its heads. Rank r of n holds the r-th of n contiguous blocks of the KV heads and of the query heads
    (sharding.py's layout), which n divides (sharding.check_tp). The files of `layers` full-cache layers
    are read ahead in the order load asks for them (snapshot_read.Reader); close() when done."""

    def __init__(self, path: Path, manifest: dict, rank: int, world: int, layers: int = 0):
        self.path, self.manifest, self.rank, self.world = path, manifest, rank, world
        self.saved = manifest.get("world", 1)
        order = [self._name(p, f"full-{layer:03d}.safetensors") for layer in range(layers) for p in self._parts()]
        self.reader = Reader(path, manifest, order)

    def close(self) -> None:
        self.reader.close()

    def _name(self, part: int, name: str) -> str:
        return f"{_rank_folder(part)}/{name}" if self.saved > 1 else name

    def _parts(self) -> list[int]:
        """The parts that hold this rank's heads (its own when the split is the same)."""
        r, W, S = self.rank, self.world, self.saved
        if S == W:
            return [r]
        # [r/W, (r+1)/W) and [p/S, (p+1)/S) overlap
        return [p for p in range(S) if r * S < (p + 1) * W and p * W < (r + 1) * S]

    def _file(self, part: int, name: str) -> dict:
        return self.reader.read(self._name(part, name))

    def read(self, name: str, dims: dict) -> dict:
        """The tensors of file `name` for this rank. dims: each tensor's heads dimension; {}: the file is
        whole in every part (the replicated draft's cache), read from the first."""
        r, W, S = self.rank, self.world, self.saved
        if S == W or not dims:
            return self._file(r if S == W else 0, name)
        pieces: dict[str, list] = {}
        for p in self._parts():
            t = self._file(p, name)
            for key, dim in ((k, d) for k, d in dims.items() if k in t):  # "q" only for a non-empty prefix
                total = t[key].shape[dim] * S
                lo, hi = max(r * total // W, p * total // S), min((r + 1) * total // W, (p + 1) * total // S)
                pieces.setdefault(key, []).append(t[key].narrow(dim, lo - p * total // S, hi - lo))
        return {key: torch.cat(v, dim=dims[key]) for key, v in pieces.items()}


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    diff = (torch.tensor(a[:n]) != torch.tensor(b[:n])).nonzero()
    return int(diff[0]) if len(diff) else n


def load(path, session, prompt: torch.Tensor, upto: int, ident: dict, group=None) -> tuple[int, int]:
    """Fill a fresh one-row session's caches from the snapshot at `path`, as far as its prefix matches
    prompt[:upto]; returns (that many tokens, the prefix's length). session.prefill(prompt) then feeds only
    the rest. group: the tensor-parallel ranks (parallel.Group); each loads its own KV heads, cut from the
    parts that hold them when the snapshot was made over another number of ranks (or in one process)."""
    reused, length = load_rows(path, session, [prompt], [upto], ident, group)
    return reused[0], length


def load_rows(path, session, prompts: list[torch.Tensor], upto: list[int], ident: dict, group=None
              ) -> tuple[list[int], int]:
    """load for a session of one row per prompt (questions about one loaded document): each row b takes
    the prefix as far as it matches prompts[b][:upto[b]]; returns (those counts, the prefix's length).
    The snapshot is read once: each layer's K/V are written into every row that uses them."""
    p = Path(path).expanduser()
    manifest = read_manifest(p)
    full = session.full.cache
    rank, world = (group.rank, group.world) if group is not None else (0, 1)
    check(path, manifest, ident, full.k.dtype, world)
    heads = Heads(p, manifest, rank, world, manifest["layers"])
    try:
        prefix = manifest["tokens"]
        c = [common_prefix(prefix, p[:u].tolist()) for p, u in zip(prompts, upto)]
        B, top = len(prompts), max(c)
        device = full.k.device
        queries = []
        for layer in range(manifest["layers"]):
            t = heads.read(f"full-{layer:03d}.safetensors", {"k": 2, "v": 2, "q": 0})
            k, v = (t[x][:, :top].expand(B, -1, -1, -1) for x in ("k", "v"))  # the one saved row, for every row
            full.write_layer(layer, k, v, c)  # copied where the layer lives
            if "q" in t:
                queries.append(t["q"].to(device))
        full.commit_written(c)
        whole = c[0] == len(prefix) and manifest["queries"]  # row 0 holds the prefix token whose queries were saved
        session.adopt_prefix(torch.tensor(prefix[:top], dtype=torch.long).expand(B, -1), c, queries if whole else None)
        # the streaming caches hold the state at the prefix's end; each row keeps what its prompt shares of it
        # (Session.prefill's catch-up rolls it back), the same rule for one row and many
        _load_streaming(session, manifest, ident, heads, world, [common_prefix(prefix, p.tolist()) for p in prompts])
    finally:
        heads.close()
    return c, len(prefix)


def _load_streaming(session, manifest: dict, ident: dict, heads: Heads, world: int, shared: list[int]) -> None:
    """Restore the streaming caches the snapshot holds for this session's models and budgets into every row
    b whose prompt shares shared[b] > 0 tokens with the prefix and that can roll back to them (within the
    cache's reach: the tokens that left its window do not come back); the others are left for
    session.prefill to feed from the start."""
    ids = torch.tensor(manifest["tokens"], dtype=torch.long)
    for node in session.streaming_nodes():
        info = manifest["streaming"].get(node.name)
        model = ident["draft"] if node.name == "draft" else ident["target"]
        # the draft is whole on every rank: its tensors' fingerprint does not depend on the split, and its
        # cache is read from the first part; the target's streaming cache holds the rank's heads
        same = info is not None and model is not None and info["model"]["config_sha256"] == model["config_sha256"] \
            and (info["model"]["weights"] == model["weights"] if node.name == "draft"
                 else same_weights(manifest, info["model"], model, world))
        if (not same or info["sinks"] != node.cache.sinks
                or info["window"] != node.cache.window or info["length"] > node.tokens.shape[1]):
            continue  # session.prefill feeds it from the start
        t = heads.read(f"{node.name}.safetensors", {} if node.name == "draft" else {"k": 3, "v": 3})
        state = {"k": t["k"], "v": t["v"], "length": info["length"], "offset": info["offset"]}
        if not node.cache.fits(state):
            continue
        rows = [b for b, k in enumerate(shared) if k and node.cache.reachable_from(state, k)]
        if rows:
            node.cache.restore(state, rows)
            node.adopt(ids[None].expand(len(rows), -1), [info["length"]] * len(rows), rows)
