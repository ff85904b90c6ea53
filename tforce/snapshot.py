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
world size N; such a snapshot loads only into N ranks, and a single-process one only into one process.
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

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .errors import TforceError, UsageError

FORMAT = "tforce-kv"
VERSION = 1  # one process
TP_VERSION = 2  # per-rank parts (rank-R/): a tforce that reads only format 1 refuses it in one line
MANIFEST = "manifest.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt")


# ---------------------------------------------------------------------------------------------- identity

def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _config_sha(config) -> str:
    """The architecture's hash: config.json's fields, less bookkeeping (names, versions, dtype)."""
    d = {k: v for k, v in config.to_dict().items()
         if not k.startswith("_") and k not in ("transformers_version", "dtype", "torch_dtype", "use_cache",
                                                 "architectures")}
    return _sha(json.dumps(d, sort_keys=True, default=str).encode())


def _weights_fingerprint(module) -> str:
    """A hash of each parameter's name, shape and first and last 64 values: two checkpoints of one
    architecture (a retrained model) differ here."""
    h = hashlib.sha256()
    for name, p in sorted(module.state_dict().items()):
        flat = p.detach().reshape(-1)
        h.update(f"{name}{tuple(p.shape)}".encode())
        h.update(torch.cat([flat[:64], flat[-64:]]).float().cpu().numpy().tobytes())
    return h.hexdigest()


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
            "config_sha256": _config_sha(module.config), "weights": _weights_fingerprint(module)}


def identity(target, draft=None, group=None) -> dict:
    """What a snapshot must match: target (a tforce.LoadedModel or a bare model), draft, tokenizer.
    group: the tensor-parallel ranks (parallel.Group) when target is one rank's shard; the target's
    fingerprint is then that of every rank's shard together (a collective)."""
    ident = {"target": _model_id(target), "draft": _model_id(draft) if draft is not None else None,
             "tokenizer_sha256": _tokenizer_sha(getattr(target, "path", None))}
    if group is not None and group.world > 1:
        ident["target"]["weights"] = _sha(" ".join(group.gather(ident["target"]["weights"])).encode())
    return ident


# ------------------------------------------------------------------------------------------------- write

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


def _write(folder: Path, name: str, tensors: dict) -> str:
    data = st_save({k: t.detach().contiguous().cpu() for k, t in tensors.items()})
    with open(folder / name, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return _sha(data)


def _streaming_nodes(session):
    return [n for n in (session.middle, session.small) if n is not None and n.cache is not session.retrieval]


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
                        "dtype": str(full.k.dtype).replace("torch.", ""), "layers": len(full.queries),
                        "tokens": session.seq[:P].tolist(), "queries": P > 0, "streaming": streaming,
                        "files": files}
            if world > 1:
                manifest["world"] = world
            manifest["manifest_sha256"] = _manifest_sha(manifest)
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
    for layer in range(len(full.queries)):
        t = {"k": full.layer_keys(layer)[:, :P], "v": full.layer_values(layer)[:, :P]}
        if queries is not None:
            t["q"] = queries[layer]
        name = f"full-{layer:03d}.safetensors"
        files[name] = _write(folder, name, t)
    streaming = {}
    for node in _streaming_nodes(session):
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
    from . import __version__

    return __version__


# -------------------------------------------------------------------------------------------------- read

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
    if manifest.get("manifest_sha256") != _manifest_sha(manifest):
        raise TforceError(f"--load-kv {path}: {MANIFEST} is damaged (checksum mismatch): make the snapshot again")
    if manifest.get("version") != (VERSION if manifest.get("world", 1) == 1 else TP_VERSION):
        raise UsageError(f"--load-kv {path}: snapshot format {manifest.get('version')} (tforce "
                         f"{manifest.get('tforce')}); this tforce reads formats {VERSION} and {TP_VERSION} "
                         f"(split over ranks): make it again")
    return manifest


def _manifest_sha(manifest: dict) -> str:
    """The manifest's own checksum, over its other fields."""
    rest = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return _sha(json.dumps(rest, sort_keys=True).encode())


def _read(path: Path, manifest: dict, name: str) -> dict:
    """A file's tensors, after its checksum matched the manifest's."""
    try:
        data = (path / name).read_bytes()
    except OSError as e:
        raise TforceError(f"--load-kv {path}: cannot read {name}: {e.strerror or e}") from e
    if _sha(data) != manifest["files"].get(name):
        raise TforceError(f"--load-kv {path}: {name} is damaged (checksum mismatch): make the snapshot again")
    return st_load(data)


def check_world(path, manifest: dict, world: int) -> None:
    """Refuse, in one line, a snapshot made over another number of tensor-parallel ranks."""
    saved = manifest.get("world", 1)
    if saved != world:
        runs = {n: f"--tp {n}" if n > 1 else "one process (no --tp)" for n in (saved, world)}
        fix = f"pass --tp {saved}" if saved > 1 else "drop --tp"
        raise UsageError(f"--load-kv {path}: made with {runs[saved]}, this run has {runs[world]}: {fix} or make "
                         "the snapshot again")


def check_dtype(path, manifest: dict, want: str) -> None:
    """The cache's dtype (e.g. "float32") against the run's: known before any weights are read."""
    if manifest["dtype"] != want:
        raise UsageError(f"--load-kv {path}: its cache is {manifest['dtype']}, this run's is {want} "
                         f"(pass --dtype {manifest['dtype']})")


def check(path, manifest: dict, ident: dict, dtype: torch.dtype) -> None:
    """Refuse a snapshot of another model, tokenizer or dtype, in one line."""
    saved, now = manifest["target"], ident["target"]
    if saved["config_sha256"] != now["config_sha256"]:
        raise UsageError(f"--load-kv {path}: made with another model ({saved['name']}; its config differs)")
    check_dtype(path, manifest, str(dtype).replace("torch.", ""))
    if saved["weights"] != now["weights"]:
        raise UsageError(f"--load-kv {path}: made with another model ({saved['name']}; same config, other weights)")
    a, b = manifest["tokenizer_sha256"], ident["tokenizer_sha256"]
    if a is not None and b is not None and a != b:
        raise UsageError(f"--load-kv {path}: made with another tokenizer")


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    diff = (torch.tensor(a[:n]) != torch.tensor(b[:n])).nonzero()
    return int(diff[0]) if len(diff) else n


def load(path, session, prompt: torch.Tensor, upto: int, ident: dict, group=None) -> tuple[int, int]:
    """Fill a fresh session's caches from the snapshot at `path`, as far as its prefix matches prompt[:upto];
    returns (that many tokens, the prefix's length). session.prefill(prompt) then feeds only the rest.
    group: the tensor-parallel ranks (parallel.Group); each loads its own KV heads."""
    p = Path(path).expanduser()
    manifest = read_manifest(p)
    full = session.full.cache
    world = group.world if group is not None else 1
    check_world(path, manifest, world)
    check(path, manifest, ident, full.k.dtype)
    part = f"{_rank_folder(group.rank)}/" if world > 1 else ""
    prefix = manifest["tokens"]
    c = common_prefix(prefix, prompt[:upto].tolist())
    device = full.k.device
    queries = []
    for layer in range(manifest["layers"]):
        t = _read(p, manifest, f"{part}full-{layer:03d}.safetensors")
        full.write_layer(layer, t["k"][:, :c], t["v"][:, :c])  # copied where the layer lives
        if "q" in t:
            queries.append(t["q"].to(device))
    full.commit_written(c)
    session.full.adopt(prompt, c)
    if c == len(prefix) and manifest["queries"]:
        session.loaded_queries = (c, queries)
    ids = torch.tensor(prefix, dtype=torch.long)
    for node in _streaming_nodes(session):
        info = manifest["streaming"].get(node.name)
        model = ident["draft"] if node.name == "draft" else ident["target"]
        same = info is not None and model is not None and all(
            info["model"][k] == model[k] for k in ("config_sha256", "weights"))
        if (not same or info["sinks"] != node.cache.sinks
                or info["window"] != node.cache.window or info["length"] > len(node.tokens)):
            continue  # session.prefill feeds it from the start
        t = _read(p, manifest, f"{part}{node.name}.safetensors")
        state = {"k": t["k"], "v": t["v"], "length": info["length"], "offset": info["offset"]}
        if node.cache.fits(state):
            node.cache.restore(state)
            node.adopt(ids, info["length"])
    return c, len(prefix)
