"""`tforce serve --kv-dir DIR`: prompts' KV caches kept on disk as KV snapshots (snapshot/format.py), so that a
document asked about before a restart is not prefilled again after it.

A prompt that fed at least `min_tokens` new tokens to the caches (a document, not a chat turn: writing a
snapshot costs a pass over the whole prefix's KV) is saved right after its prefill, in a folder named by
its tokens' hash. A request whose prompt shares a longer prefix with a snapshot than with what the
session holds starts from that snapshot (loaded and verified as `--load-kv` loads one: the same model,
tokenizer and dtype, every file's checksum). The folder is kept under `limit` bytes by removing the
least recently used snapshots (written or loaded) first; the one just written is always kept.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from ..snapshot import format as snapshot, store as snapshot_io
from ..errors import TforceError


def shared_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many leading tokens two id tensors share."""
    n = min(len(a), len(b))
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0]) if len(diff) else n


class KVStore:
    def __init__(self, folder, limit: int, min_tokens: int, ident: dict, log: Callable[[str], None]):
        """ident: what a snapshot must match (snapshot_identity.identity of the served models)."""
        self.folder = Path(folder).expanduser()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.limit, self.min_tokens, self.ident, self.log = limit, min_tokens, ident, log
        self.index: dict[Path, torch.Tensor] = {}  # snapshot folder -> its prefix's token ids
        for path in sorted(self.folder.iterdir()):
            if snapshot.is_snapshot(path):
                try:
                    self.index[path] = torch.tensor(snapshot.read_manifest(path)["tokens"], dtype=torch.long)
                except TforceError as e:
                    log(f"tforce: serve: --kv-dir: {path.name} skipped: {e}")

    def restore(self, session, prompt: torch.Tensor, held: int) -> Optional[int]:
        """Load the snapshot sharing the longest prefix with prompt[:-1] when it shares more than the `held`
        tokens the session has of it; the tokens reused from it, or None."""
        best = max(self.index.items(), key=lambda item: shared_prefix(item[1], prompt[:-1]), default=None)
        if best is None or shared_prefix(best[1], prompt[:-1]) <= held:
            return None
        path = best[0]
        session.full.cache.truncate(0)  # a snapshot loads into empty caches
        session.full.adopt(prompt[None], [0])
        try:
            reused, _ = snapshot_io.load(path, session, prompt, len(prompt) - 1, self.ident)
        except TforceError as e:  # another model's, or damaged: not used again
            self.log(f"tforce: serve: --kv-dir: {path.name} not loaded: {e}")
            del self.index[path]
            return None
        os.utime(path)
        return reused

    def save(self, session) -> None:
        """Keep what the session's caches hold (a prompt, after its prefill)."""
        tokens = session.seq[:session.full.cache.length].clone()
        path = self.folder / hashlib.sha256(tokens.numpy().tobytes()).hexdigest()[:24]
        t0 = time.perf_counter()
        try:
            snapshot_io.save(path, session, self.ident)
        except TforceError as e:  # a full disk: the answer goes on without its snapshot
            self.log(f"tforce: serve: --kv-dir: not saved: {e}")
            return
        self.index[path] = tokens
        self.log(f"tforce: serve: --kv-dir: {len(tokens)} tokens saved to {path.name} in "
                 f"{time.perf_counter() - t0:.2f} s")
        self._evict(keep=path)

    def _evict(self, keep: Path) -> None:
        def size(p: Path) -> int:
            return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())

        sizes = {p: size(p) for p in self.index}
        for path in sorted(self.index, key=lambda p: p.stat().st_mtime):  # least recently used first
            if sum(sizes.values()) <= self.limit:
                break
            if path != keep:
                shutil.rmtree(path, ignore_errors=True)
                del self.index[path], sizes[path]
