"""KV snapshots: a prefilled prefix's caches on disk, so that a later run whose prompt extends the prefix
prefills only the rest.

A snapshot is a folder:
  manifest.json           format, tforce version, identity (the target's config hash and weights
                          fingerprint, the tokenizer files' hash, the cache dtype), the prefix's token ids,
                          the streaming caches' lengths, the sha256 of every other file and its own
  full-LLL.safetensors    layer LLL of the full cache: "k", "v" (1, P, H_kv, D), rotated as stored, and "q"
                          (H_q, D), the last prefix token's rotated query (what a retrieval rebuild scores with)
  draft.safetensors       the small draft's StreamingCache ("k", "v" rows), when the method had one;
  streaming.safetensors   likewise the middle level's StreamingCache of --method streaming
With the target split over tensor-parallel ranks (--tp N), each rank writes those files for its own KV
heads (and its copy of the replicated draft's cache) in a folder rank-R/, and the manifest records the
world size N. A snapshot loads into any number of ranks that splits the heads evenly (each rank cuts its
heads from the parts that hold them), matched to the model by its weight files' fingerprint
(snapshot/identity.py); one made by a tforce that did not record that loads only into as many ranks.

This file: the format, the manifest and the checks that refuse, in one line, a snapshot that does not fit
the run (another model, tokenizer, dtype or number of ranks; a damaged manifest) or a path that is not
one; snapshot/identity.py: what a snapshot must match (the models' and the tokenizer's hashes);
snapshot/store.py: writing the caches into a snapshot and loading them back.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from ..errors import TforceError, UsageError

FORMAT = "tforce-kv"
VERSION = 1  # one process
TP_VERSION = 2  # per-rank parts (rank-R/): a tforce that reads only format 1 refuses it in one line
MANIFEST = "manifest.json"


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------------------- before writing

def is_snapshot(path) -> bool:
    """A folder whose manifest is tforce's: another program's manifest.json does not make its folder one
    (a snapshot is replaced whole)."""
    try:
        return json.loads((Path(path).expanduser() / MANIFEST).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def check_target(path) -> None:
    """Refuse to write over anything but a snapshot or an empty folder, or where no folder can be made
    (before the work, not after it)."""
    p = Path(path).expanduser()
    if p.exists() and not is_snapshot(p) and not (p.is_dir() and not any(p.iterdir())):
        raise UsageError(f"--save-kv {path}: exists and is not a tforce KV snapshot; refusing to overwrite it")
    ancestor = next(a for a in p.absolute().parents if a.exists())  # the folders below it are made
    if not ancestor.is_dir():
        raise UsageError(f"--save-kv {path}: {ancestor} is not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UsageError(f"--save-kv {path}: cannot write in {ancestor}")


# ----------------------------------------------------------------------------------------------- reading

def read_manifest(path) -> dict:
    """The manifest of a snapshot folder, its format checked."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise UsageError(f"--load-kv {path}: a file, not a snapshot folder")
    if not p.is_dir():
        raise UsageError(f"--load-kv {path}: no such snapshot folder")
    if not (p / MANIFEST).is_file():
        raise UsageError(f"--load-kv {path}: not a readable tforce KV snapshot (no {MANIFEST})")
    try:
        manifest = json.loads((p / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise TforceError(f"--load-kv {path}: not a readable tforce KV snapshot ({type(e).__name__})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise TforceError(f"--load-kv {path}: not a tforce KV snapshot")
    if manifest.get("manifest_sha256") != manifest_sha(manifest):
        raise TforceError(f"--load-kv {path}: {MANIFEST} is damaged (checksum mismatch): make the snapshot again")
    if manifest.get("version") != (VERSION if manifest.get("world", 1) == 1 else TP_VERSION):
        raise UsageError(f"--load-kv {path}: snapshot format {manifest.get('version')} (tforce "
                         f"{manifest.get('tforce')}); this tforce reads formats {VERSION} and {TP_VERSION} "
                         f"(split over ranks): make it again")
    return manifest


def manifest_sha(manifest: dict) -> str:
    """The manifest's own checksum, over its other fields."""
    rest = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return sha256_hex(json.dumps(rest, sort_keys=True).encode())


def same_weights(manifest: dict, saved: dict, now: dict, world: int) -> bool:
    """Whether a model identity in the snapshot (`saved`, snapshot_identity._model_id's) and one of the run
    (`now`, over `world` ranks) are the same weights: by the loaded tensors within one split, else by the
    files (a world this snapshot could not be loaded into has been refused by check_world)."""
    if manifest.get("world", 1) == world:
        return saved["weights"] == now["weights"]
    return saved.get("files_sha256") is not None and saved.get("files_sha256") == now.get("files_sha256")


def check_world(path, manifest: dict, world: int) -> None:
    """Refuse, in one line, a snapshot made over another number of tensor-parallel ranks by a tforce that
    did not record its weight files' fingerprint (which matches a model however it is split; see
    snapshot/identity.py); one that did loads into any number (snapshot_io.load re-splits its KV heads)."""
    saved = manifest.get("world", 1)
    if saved != world and manifest["target"].get("files_sha256") is None:
        runs = {n: f"--tp {n}" if n > 1 else "one process (no --tp)" for n in (saved, world)}
        fix = f"pass --tp {saved}" if saved > 1 else "drop --tp"
        raise UsageError(f"--load-kv {path}: made with {runs[saved]}, this run has {runs[world]}: {fix} or make "
                         "the snapshot again")


def check_dtype(path, manifest: dict, want: str) -> None:
    """The cache's dtype (e.g. "float32") against the run's: known before any weights are read."""
    if manifest["dtype"] != want:
        raise UsageError(f"--load-kv {path}: its cache is {manifest['dtype']}, this run's is {want} "
                         f"(pass --dtype {manifest['dtype']})")


def check(path, manifest: dict, ident: dict, dtype: torch.dtype, world: int = 1) -> None:
    """Refuse a snapshot of another model, tokenizer or dtype, in one line. world: the run's number of
    tensor-parallel ranks; made over another, the weight files' fingerprints must match instead of the
    loaded tensors' (which depend on the split)."""
    saved, now = manifest["target"], ident["target"]
    if saved["config_sha256"] != now["config_sha256"]:
        raise UsageError(f"--load-kv {path}: made with another model ({saved['name']}; its config differs)")
    check_dtype(path, manifest, str(dtype).replace("torch.", ""))
    check_world(path, manifest, world)
    if manifest.get("world", 1) != world and now.get("files_sha256") is None:
        raise UsageError(f"--load-kv {path}: made over {manifest.get('world', 1)} rank(s), this run has {world}, "
                         "and its model was not loaded from a folder whose weight files could be compared")
    if not same_weights(manifest, saved, now, world):
        raise UsageError(f"--load-kv {path}: made with another model ({saved['name']}; same config, other weights)")
    a, b = manifest["tokenizer_sha256"], ident["tokenizer_sha256"]
    if a is not None and b is not None and a != b:
        raise UsageError(f"--load-kv {path}: made with another tokenizer")
