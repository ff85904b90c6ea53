"""Reading a KV snapshot's files with their checksums, the next ones on worker threads.

A 122K-token cache of Llama-2-7B is 64 GiB in 2 GiB layer files, and sha256 runs at about 1.2 GB/s on
one core (measured on the 2-core CPU here): checked one file after another, the load would take about a
minute of hashing alone. hashlib releases the GIL while it hashes, so files read and hashed on a few
threads, while the caller turns the previous one into tensors and copies them into place, take a
fraction of that on a machine with spare cores. Each file's bytes are still checked before any of its
tensors is used; a damaged or unreadable file raises the same one-line error when its turn comes.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from safetensors.torch import load as st_load

from ..errors import TforceError
from .format import sha256_hex

IN_FLIGHT_BYTES = 8 << 30  # host memory the files read ahead may hold at once
MAX_THREADS = 4


def threads_for(largest: int) -> int:
    """How many files are read ahead (one thread each) beside the one in use, the largest `largest` bytes:
    as many as there are spare cores, at most MAX_THREADS, and as many as fit in IN_FLIGHT_BYTES with the
    one in use; at least one."""
    return max(1, min(MAX_THREADS, (os.cpu_count() or 1) - 1, IN_FLIGHT_BYTES // max(largest, 1) - 1))


def checked_bytes(path: Path, manifest: dict, name: str) -> bytes:
    """A file's bytes, after their checksum matched the manifest's."""
    try:
        data = (path / name).read_bytes()
    except OSError as e:
        raise TforceError(f"--load-kv {path}: cannot read {name}: {e.strerror or e}") from e
    if sha256_hex(data) != manifest["files"].get(name):
        raise TforceError(f"--load-kv {path}: {name} is damaged (checksum mismatch): make the snapshot again")
    return data


class Reader:
    """A snapshot's files as tensors, `order` (the names a load will ask for, in turn) read and checked
    ahead on threads: as many files at once as there are spare cores (at most MAX_THREADS) and as fit
    in IN_FLIGHT_BYTES. A name outside `order`, or asked out of turn, is read when asked."""

    def __init__(self, path: Path, manifest: dict, order: list[str] = ()):
        self.path, self.manifest = path, manifest
        self.todo = list(order)
        self.pending: dict = {}
        self.ahead = threads_for(max((self._size(n) for n in self.todo), default=0))
        self.pool = ThreadPoolExecutor(self.ahead, thread_name_prefix="tforce-kv-read") if self.todo else None
        self._fill()

    def _size(self, name: str) -> int:
        try:
            return (self.path / name).stat().st_size
        except OSError:
            return 0  # reported when its turn comes

    def _fill(self) -> None:
        while self.todo and len(self.pending) < self.ahead:
            name = self.todo.pop(0)
            self.pending[name] = self.pool.submit(checked_bytes, self.path, self.manifest, name)

    def read(self, name: str) -> dict:
        """The tensors of file `name`, after its checksum matched."""
        future = self.pending.pop(name, None)
        if future is None and name in self.todo:  # asked out of turn: not read twice
            self.todo.remove(name)
        # the next file is queued before this one is waited for, so that a thread is already reading it while
        # this one becomes tensors (safetensors holds the GIL then: a file queued after would wait for it)
        self._fill()
        data = future.result() if future is not None else checked_bytes(self.path, self.manifest, name)
        return st_load(data)

    def close(self) -> None:
        """Stop reading ahead (an error, or a load that needed fewer files) and let the threads end."""
        if self.pool is not None:
            for future in self.pending.values():
                future.cancel()
            self.pending.clear()
            self.todo.clear()
            self.pool.shutdown(wait=True)
