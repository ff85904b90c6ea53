"""The `tforce` command line: run, chat, serve, info, bench, eval, tune (one module each; shared parts in common.py)."""
from __future__ import annotations

import os
import sys

from . import bench, chat, eval, info, run, serve, tune  # noqa: F401  (registers the commands)

from .app import app
from .common import say

__all__ = ["app", "main"]


def _closed_streams() -> None:
    """Started with a standard stream closed (`<&-`, `2>&-`, some service managers), Python sets it to None.
    Each is reopened on /dev/null in order (taking the lowest free descriptor: its own): stdin reads as
    empty and stderr drops the diagnostics; stdout is where the data goes, so without it the run ends."""
    stdout_closed = sys.stdout is None
    if sys.stdin is None:
        sys.stdin = open(os.open(os.devnull, os.O_RDONLY), encoding="utf-8")
    if stdout_closed:  # opened first, so that stderr's takes descriptor 2, not 1
        sys.stdout = open(os.open(os.devnull, os.O_WRONLY), "w")
    if sys.stderr is None:
        sys.stderr = open(os.open(os.devnull, os.O_WRONLY), "w")
    if stdout_closed:
        say("tforce: error: stdout is closed: the output has nowhere to go")
        sys.exit(1)


def main() -> None:
    """Entry point. Click's own usage errors (a bad option value, an unknown option) also become one line."""
    try:  # recent Typer vendors its own Click
        from typer._click import exceptions as cx
    except ImportError:
        from click import exceptions as cx

    _closed_streams()
    try:
        code = app(standalone_mode=False)
    except getattr(cx, "NoArgsIsHelpError", ()) as e:  # `tforce` alone: the help, on stderr
        e.show()
        code = 2
    except cx.UsageError as e:
        say(f"tforce: error: {e.format_message()}" + (f" (see '{e.ctx.command_path} --help')" if e.ctx else ""))
        code = 2
    except KeyboardInterrupt:
        say("tforce: interrupted")
        code = 130
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
