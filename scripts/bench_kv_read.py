"""How fast a KV snapshot's files are read and checksummed: one after another, and with
snapshot_read.Reader (the next files read and hashed on threads while the current one becomes tensors).

    python scripts/bench_kv_read.py [FILES] [MIB_PER_FILE] [REPEATS] [--json FILE]
    (defaults: 8 files of 128 MiB, median of 3; the files are written to a temporary folder first and
    read once before timing, so both runs read from the page cache, as a load soon after a save does)

Beside each rate, its floor: the bytes over sha256's measured single-core rate times the threads that
can hash at once (the cores, at most Reader's threads + the caller). A 122K-token Llama-2-7B cache is
64 GiB in 32 files of 2 GiB.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save

sys.path.insert(0, ".")
from tforce.snapshot import reader as snapshot_read  # noqa: E402
from tforce.snapshot.format import sha256_hex  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("files", nargs="?", type=int, default=8)
    p.add_argument("mib", nargs="?", type=int, default=128)
    p.add_argument("repeats", nargs="?", type=int, default=3)
    p.add_argument("--json")
    a = p.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="tforce-kv-read-"))
    names, files = [f"full-{i:03d}.safetensors" for i in range(a.files)], {}
    for name in names:
        data = save({"k": torch.randn(a.mib << 18)})  # float32: 4 bytes each, a.mib MiB
        (folder / name).write_bytes(data)
        files[name] = sha256_hex(data)
    manifest = {"files": files}
    total = sum((folder / n).stat().st_size for n in names)

    def one_by_one():
        for name in names:
            st_load(snapshot_read.checked_bytes(folder, manifest, name))

    def ahead():
        reader = snapshot_read.Reader(folder, manifest, names)
        try:
            for name in names:
                reader.read(name)
        finally:
            reader.close()

    def timed(fn) -> float:
        times = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    one_by_one()  # into the page cache
    block = os.urandom(256 << 20)
    t0 = time.perf_counter()
    hashlib.sha256(block).digest()
    sha_rate = len(block) / (time.perf_counter() - t0)
    threads = snapshot_read.threads_for(max((folder / n).stat().st_size for n in names))
    hashers = min(os.cpu_count() or 1, threads)
    record = {"files": a.files, "bytes": total, "cores": os.cpu_count(), "reader_threads": threads,
              "sha256_gb_s": sha_rate / 1e9, "one_by_one_s": timed(one_by_one), "ahead_s": timed(ahead),
              "floor_one_by_one_s": total / sha_rate, "floor_ahead_s": total / (sha_rate * hashers)}
    for f in folder.iterdir():
        f.unlink()
    folder.rmdir()
    print(f"{a.files} files, {total / 2**30:.2f} GiB, {record['cores']} cores; sha256 {record['sha256_gb_s']:.2f} GB/s "
          f"on one core")
    print(f"  one after another: {record['one_by_one_s']:.2f} s ({total / record['one_by_one_s'] / 1e9:.2f} GB/s; "
          f"floor {record['floor_one_by_one_s']:.2f} s)")
    print(f"  read ahead ({threads} threads): {record['ahead_s']:.2f} s ({total / record['ahead_s'] / 1e9:.2f} GB/s; "
          f"floor {record['floor_ahead_s']:.2f} s); {record['one_by_one_s'] / record['ahead_s']:.2f}x")
    if a.json:
        Path(a.json).write_text(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
