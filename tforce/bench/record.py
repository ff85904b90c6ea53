"""`tforce bench --record FILE`: the JSON report written as the bench goes, so a run cut short (a time
limit, Ctrl-C, an out-of-memory error in a later method) keeps the methods that finished.

After every method FILE holds the report so far with "complete": false; after the last, the whole report
(what --json prints) with "complete": true. Each write goes to a temporary file beside FILE, renamed over
it: FILE is always a whole JSON object, never half of one. A symlink FILE is followed (its target is
replaced, the link kept), and FILE gets the mode a new file gets under the umask. A write that fails (a
full disk) leaves FILE as it was and does not end the bench: the CLI warns, goes on, prints its report,
and then fails in one line.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path

from ..errors import UsageError


def check(path: str) -> Path:
    """The record's path, refused in one line before anything runs if it cannot be written."""
    p = Path(os.path.realpath(path))  # a symlink's target: renaming over the link would replace the link
    if p.is_dir():
        raise UsageError(f"--record {path}: is a directory")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"--record {path}: no such directory {str(parent)!r}")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise UsageError(f"--record {path}: not writable")
    return p


def write(path: Path, report: dict) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent if str(path.parent) else ".")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            os.fchmod(fh.fileno(), 0o666 & ~_umask())  # mkstemp's 0600 would become FILE's mode
            json.dump(report, fh)
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):  # already renamed (Ctrl-C just after the rename)
            os.unlink(tmp)
        raise


def _umask() -> int:
    """The process's umask, read without setting it where Linux shows it (os.umask sets it process-wide)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
