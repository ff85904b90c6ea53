"""What a KV snapshot must match (snapshot/format.py): the target's and the draft's architecture (config.json's
hash) and weights (a fingerprint of the loaded tensors, and one of the checkpoint's files), and the
tokenizer's files.

The tensors' fingerprint of a model split over tensor-parallel ranks is that of the ranks' shards, which
depends on how many there are; the files' fingerprint does not, so a snapshot made over one number of
ranks is matched by it when it is loaded into another (snapshot_io.load re-splits the KV heads).
"""
from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import torch

from ..errors import TforceError
from .format import sha256_hex

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt")


def _config_sha(config) -> str:
    """The architecture's hash: config.json's fields, less bookkeeping (names, versions, dtype)."""
    d = {k: v for k, v in config.to_dict().items()
         if not k.startswith("_") and k not in ("transformers_version", "dtype", "torch_dtype", "use_cache",
                                                 "architectures")}
    return sha256_hex(json.dumps(d, sort_keys=True, default=str).encode())


def weights_fingerprint(module) -> str:
    """A hash of each parameter's name, shape and first and last 64 values: two checkpoints of one
    architecture (a retrained model) differ here."""
    h = hashlib.sha256()
    for name, p in sorted(module.state_dict().items()):
        flat = p.detach().reshape(-1)
        h.update(f"{name}{tuple(p.shape)}".encode())
        h.update(torch.cat([flat[:64], flat[-64:]]).float().cpu().numpy().tobytes())
    return h.hexdigest()


TENSOR_EDGE = 512  # bytes read from each end of each tensor in a weight file: 64 values or more


def files_sha(path) -> str | None:
    """The hash of a model folder's weight files: their names, their safetensors headers (every tensor's
    name, dtype, shape and place) and each tensor's first and last TENSOR_EDGE bytes, so that it tells
    apart what weights_fingerprint (each tensor's first and last 64 values) does, however the model is
    split; None without a folder. Reads about 1 KiB per tensor, not the weights. A PyTorch .bin (a zip):
    its pickle (the tensors' names, dtypes, shapes and storages) and each storage's size and CRC-32, from
    the zip's directory."""
    if path is None:
        return None
    from ..model.weight_files import weight_files

    h = hashlib.sha256()
    try:
        for f in weight_files(Path(path)):
            if f.suffix == ".bin":
                _bin_sha(h, f)
                continue
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                header = fh.read(n)
                h.update(f.name.encode() + b"\0" + header)
                for name, info in sorted(json.loads(header).items()):
                    if name == "__metadata__":
                        continue
                    lo, hi = info["data_offsets"]
                    for at in (lo, max(lo, hi - TENSOR_EDGE)):
                        fh.seek(8 + n + at)
                        h.update(fh.read(min(TENSOR_EDGE, hi - at)))
    except (OSError, ValueError, KeyError, TypeError, TforceError, zipfile.BadZipFile):
        return None  # no (readable) weight files there: the tensors' fingerprint decides
    return h.hexdigest()


def _bin_sha(h, f: Path) -> None:
    with zipfile.ZipFile(f) as z:
        h.update(f.name.encode() + b"\0")
        for info in z.infolist():
            h.update(f"{info.filename} {info.file_size} {info.CRC}".encode())
            if info.filename.endswith("data.pkl"):
                h.update(z.read(info))


def _tokenizer_sha(path) -> str | None:
    """The hash of a model folder's tokenizer files; None when unknown (a bare module, no files)."""
    if path is None:
        return None
    files = [Path(path) / f for f in TOKENIZER_FILES if (Path(path) / f).is_file()]
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def _model_id(m) -> dict:
    module = m if isinstance(m, torch.nn.Module) else m.model
    path = getattr(m, "path", None)
    return {"name": str(path) if path is not None else type(module).__name__,
            "config_sha256": _config_sha(module.config), "weights": weights_fingerprint(module),
            "files_sha256": files_sha(path)}


def identity(target, draft=None, group=None) -> dict:
    """What a snapshot must match: target (a tforce.LoadedModel or a bare model), draft, tokenizer.
    group: the tensor-parallel ranks (parallel.Group) when target is one rank's shard; the target's
    fingerprint is then that of every rank's shard together (a collective)."""
    ident = {"target": _model_id(target), "draft": _model_id(draft) if draft is not None else None,
             "tokenizer_sha256": _tokenizer_sha(getattr(target, "path", None))}
    if group is not None and group.world > 1:
        ident["target"]["weights"] = sha256_hex(" ".join(group.gather(ident["target"]["weights"])).encode())
    return ident
