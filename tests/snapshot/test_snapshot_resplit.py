"""snapshot_io.Heads: a snapshot's per-rank parts cut for a run over another number of ranks (each rank
holds a contiguous block of the KV heads and one of the query heads, sharding.py's layout), checked
against the whole tensors for splits that do and do not nest (3 parts into 4 ranks, 4 into 3, ...).
The end-to-end loads over gloo ranks are in test_chat_tp.py."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save

from tforce.snapshot.format import sha256_hex
from tforce.snapshot.store import Heads

KV, Q = 12, 24  # heads: every split below divides both


def _whole() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"k": torch.randn(1, 5, KV, 4, generator=g), "v": torch.randn(1, 5, KV, 4, generator=g),
            "q": torch.randn(Q, 4, generator=g), "s": torch.randn(2, 1, 3, KV, 4, generator=g)}


def _snapshot(tmp_path, saved: int) -> dict:
    """A manifest whose files hold `saved` parts of _whole() (one file when saved is 1)."""
    whole, files = _whole(), {}
    for part in range(saved):
        t = {"k": whole["k"].chunk(saved, 2)[part], "v": whole["v"].chunk(saved, 2)[part],
             "q": whole["q"].chunk(saved, 0)[part]}
        name = f"rank-{part}/full-000.safetensors" if saved > 1 else "full-000.safetensors"
        stream = {"k": whole["s"].chunk(saved, 3)[part].contiguous(), "v": whole["s"].chunk(saved, 3)[part] + 1}
        stream_name = name.replace("full-000", "streaming")
        draft_name = name.replace("full-000", "draft")
        for n, tensors in ((name, t), (stream_name, stream), (draft_name, {"k": whole["k"], "v": whole["v"]})):
            data = save({k: v.contiguous() for k, v in tensors.items()})
            (tmp_path / n).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / n).write_bytes(data)
            files[n] = sha256_hex(data)
    return {"files": files, **({"world": saved} if saved > 1 else {})}


@pytest.mark.parametrize("saved, world", [(1, 2), (1, 3), (2, 1), (3, 4), (4, 3), (2, 6), (6, 4), (3, 3)])
def test_each_rank_gets_its_heads_from_the_parts(tmp_path, saved, world):
    manifest, whole = _snapshot(tmp_path, saved), _whole()
    for rank in range(world):
        heads = Heads(tmp_path, manifest, rank, world)
        t = heads.read("full-000.safetensors", {"k": 2, "v": 2, "q": 0})
        assert torch.equal(t["k"], whole["k"].chunk(world, 2)[rank])
        assert torch.equal(t["v"], whole["v"].chunk(world, 2)[rank])
        assert torch.equal(t["q"], whole["q"].chunk(world, 0)[rank])
        s = heads.read("streaming.safetensors", {"k": 3, "v": 3})
        assert torch.equal(s["k"], whole["s"].chunk(world, 3)[rank])
        assert torch.equal(s["v"], whole["s"].chunk(world, 3)[rank] + 1)
        d = heads.read("draft.safetensors", {})  # replicated: whole, from the first part
        assert torch.equal(d["k"], whole["k"]) and torch.equal(d["v"], whole["v"])


def test_a_damaged_part_is_refused_when_cut_from(tmp_path):
    from tforce.errors import TforceError

    manifest = _snapshot(tmp_path, 2)
    path = tmp_path / "rank-1" / "full-000.safetensors"
    path.write_bytes(path.read_bytes()[:-1] + b"\0")
    with pytest.raises(TforceError, match="checksum mismatch"):
        Heads(tmp_path, manifest, 0, 1).read("full-000.safetensors", {"k": 2, "v": 2, "q": 0})


def _checkpoint(folder, middle_first: float):
    """A folder with one weight file of three tensors, "b" between two larger than a MiB each."""
    from safetensors.torch import save_file

    folder.mkdir()
    g = torch.Generator().manual_seed(0)
    b = torch.randn(1000, generator=g)
    b[0] = middle_first
    save_file({"a": torch.randn(300_000, generator=g), "b": b, "c": torch.randn(300_000, generator=g)},
              folder / "model.safetensors")
    return folder


def test_the_files_fingerprint_sees_what_the_tensors_fingerprint_sees(tmp_path):
    """Two checkpoints that differ in the first value of a tensor in the middle of a weight file (a model
    edited in one layer, a fine-tune that froze the embeddings, lm_head and norms): the loaded tensors'
    fingerprint tells them apart, so the files' one (which matches them across splits) must too. It read
    only each file's first and last MiB."""
    from safetensors.torch import load_file

    from tforce.snapshot.identity import files_sha, weights_fingerprint

    a, b = _checkpoint(tmp_path / "a", 0.0), _checkpoint(tmp_path / "b", 1.0)
    as_module = [torch.nn.Module() for _ in range(2)]
    for m, folder in zip(as_module, (a, b)):
        for name, t in load_file(folder / "model.safetensors").items():
            m.register_buffer(name, t)
    assert weights_fingerprint(as_module[0]) != weights_fingerprint(as_module[1])
    assert files_sha(a) != files_sha(b)
    assert files_sha(a) == files_sha(_checkpoint(tmp_path / "a2", 0.0))


def test_across_splits_the_model_is_matched_by_its_files(tmp_path):
    """snapshot.check over another number of ranks: the weight files' fingerprints decide (the loaded
    tensors' differ with the split); a run whose model has no folder to compare is refused in one line."""
    from tforce.errors import UsageError
    from tforce.snapshot.format import check

    def ident(weights, files):
        return {"target": {"name": "m", "config_sha256": "c", "weights": weights, "files_sha256": files},
                "tokenizer_sha256": None}

    manifest = {"world": 2, "dtype": "float32", **ident("two ranks' shards", "A")}
    check(tmp_path, manifest, ident("one process", "A"), torch.float32, world=1)
    check(tmp_path, manifest, ident("two ranks' shards", "B"), torch.float32, world=2)  # one split: the tensors
    with pytest.raises(UsageError, match="same config, other weights"):
        check(tmp_path, manifest, ident("one process", "B"), torch.float32, world=1)
    with pytest.raises(UsageError, match="not loaded from a folder whose weight files could be compared"):
        check(tmp_path, manifest, ident("one process", None), torch.float32, world=1)
    with pytest.raises(UsageError, match="same config, other weights"):
        check(tmp_path, {**manifest, "world": 1}, ident("four ranks' shards", "B"), torch.float32, world=4)
