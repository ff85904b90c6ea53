"""snapshot_read.Reader: a snapshot's files read and checksummed ahead on threads, in the order a load
asks for them; tensors equal to a plain read, a damaged file refused when its turn comes, and no
thread left behind however the load ends."""
from __future__ import annotations

import threading

import pytest
import torch
from safetensors.torch import save

from tforce.snapshot import reader as snapshot_read
from tforce.errors import TforceError
from tforce.snapshot.format import sha256_hex
from tforce.snapshot.reader import Reader

NAMES = [f"full-{i:03d}.safetensors" for i in range(6)]


def _folder(tmp_path) -> dict:
    files = {}
    for i, name in enumerate(NAMES):
        data = save({"k": torch.full((1, 4, 2, 3), float(i)), "v": torch.arange(24.0).view(1, 4, 2, 3) + i})
        (tmp_path / name).write_bytes(data)
        files[name] = sha256_hex(data)
    return {"files": files}


def _readers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("tforce-kv-read")]


def test_files_come_in_order_equal_to_a_plain_read_and_hashed_on_threads(tmp_path, monkeypatch):
    manifest = _folder(tmp_path)
    hashed_on = []
    checked = snapshot_read.checked_bytes

    def recording(path, manifest, name):
        hashed_on.append(threading.current_thread().name)
        return checked(path, manifest, name)

    monkeypatch.setattr(snapshot_read, "checked_bytes", recording)
    monkeypatch.setattr(snapshot_read.os, "cpu_count", lambda: 4)
    reader = Reader(tmp_path, manifest, NAMES)
    assert reader.ahead == 3
    for i, name in enumerate(NAMES):
        t = reader.read(name)
        assert torch.equal(t["k"], torch.full((1, 4, 2, 3), float(i)))
        assert torch.equal(t["v"], torch.arange(24.0).view(1, 4, 2, 3) + i)
    reader.close()
    assert len(hashed_on) == len(NAMES) and all(n.startswith("tforce-kv-read") for n in hashed_on)
    assert not _readers()


def test_a_damaged_file_is_refused_at_its_turn_and_no_thread_stays(tmp_path):
    manifest = _folder(tmp_path)
    damaged = tmp_path / NAMES[3]
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"\1")
    reader = Reader(tmp_path, manifest, NAMES)
    for name in NAMES[:3]:  # the files before it are whole and come as they are
        reader.read(name)
    with pytest.raises(TforceError, match=f"{NAMES[3]} is damaged"):
        reader.read(NAMES[3])
    reader.close()
    assert not _readers()
    other = tmp_path / "other"
    other.mkdir()
    manifest = _folder(other)
    (other / NAMES[5]).unlink()  # a file gone: the ones before it come, then one line for it
    reader = Reader(other, manifest, NAMES)
    for name in NAMES[:5]:
        reader.read(name)
    with pytest.raises(TforceError, match=f"cannot read {NAMES[5]}"):
        reader.read(NAMES[5])
    reader.close()
    assert not _readers()


def test_read_ahead_holds_at_most_its_share_of_memory(tmp_path, monkeypatch):
    manifest = _folder(tmp_path)
    size = (tmp_path / NAMES[0]).stat().st_size
    monkeypatch.setattr(snapshot_read.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(snapshot_read, "IN_FLIGHT_BYTES", 3 * size)  # the file in use and two ahead
    assert Reader(tmp_path, manifest, NAMES).ahead == 2
    monkeypatch.setattr(snapshot_read.os, "cpu_count", lambda: 1)  # no spare core: still one file ahead
    assert Reader(tmp_path, manifest, NAMES).ahead == 1


def test_a_file_asked_out_of_turn_is_not_read_twice(tmp_path, monkeypatch):
    manifest = _folder(tmp_path)
    reads = []
    checked = snapshot_read.checked_bytes
    monkeypatch.setattr(snapshot_read, "checked_bytes", lambda p, m, n: reads.append(n) or checked(p, m, n))
    monkeypatch.setattr(snapshot_read.os, "cpu_count", lambda: 2)  # one file ahead
    reader = Reader(tmp_path, manifest, NAMES)
    reader.read(NAMES[4])
    for name in NAMES[:4] + NAMES[5:]:
        reader.read(name)
    reader.close()
    assert sorted(reads) == NAMES
