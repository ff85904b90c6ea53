"""`tforce bench --record FILE`: the JSON report written as the bench goes, so a run cut short (a time
limit, Ctrl-C, an out-of-memory error in a later method) keeps the methods that finished.

After every method FILE holds the report so far with "complete": false; after the last, the whole report
(what --json prints) with "complete": true. Each write goes to a temporary file beside FILE, renamed over
it: FILE is always a whole JSON object, never half of one.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from .errors import UsageError


def check(path: str) -> Path:
    """The record's path, refused in one line before anything runs if it cannot be written."""
    p = Path(path)
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
            json.dump(report, fh)
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
