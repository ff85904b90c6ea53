"""`python -m tforce run` as a person sees it (tests/cli/test_live.py, tests/cli/test_live_batch.py): started under
a pseudo-terminal, every byte it writes there fed to a terminal emulator (pyte)."""
from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pyte = pytest.importorskip("pyte")

ROOT = Path(__file__).resolve().parent.parent
COLS, ROWS = 48, 60  # narrow, so the demo's ~64-character lines wrap; tall, so nothing scrolls away


def spawn(args, stdout_tty: bool = True, size: tuple[int, int] = (COLS, ROWS)):
    """`python -m tforce run ARGS` with stderr (and stdout, unless stdout_tty is False: then a pipe) on a
    pty of size (columns, rows). Returns (process, pty master fd)."""
    import fcntl
    import pty
    import struct
    import termios

    cols, rows = size
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    env = dict(os.environ, TERM="xterm-256color", COLUMNS=str(cols), LINES=str(rows), PYTHONPATH=str(ROOT))
    env.pop("TFORCE_DEBUG", None)
    # SIGINT's default action in the child (an ignored one, inherited from a test runner's worker, would
    # survive exec and make Ctrl-C do nothing)
    proc = subprocess.Popen([sys.executable, "-m", "tforce", "run", *args], cwd=ROOT, env=env, stdin=slave,
                            stdout=slave if stdout_tty else subprocess.PIPE, stderr=slave, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    os.close(slave)
    return proc, master


def watch(proc, master, interrupt=None, timeout: float = 120.0, size: tuple[int, int] = (COLS, ROWS)):
    """Feed everything the child writes to its terminal into a pyte screen of size (columns, rows),
    snapshotting the screen after each read, and collect its stdout if that is a pipe; interrupt(snapshot)
    true sends Ctrl-C's SIGINT once. Returns (screen, snapshots, stdout bytes)."""
    screen = pyte.Screen(*size)
    stream = pyte.ByteStream(screen)
    snapshots, out = [], []
    fds = {master: "tty"}
    if proc.stdout is not None:
        fds[proc.stdout.fileno()] = "out"
    deadline = time.monotonic() + timeout
    while fds and time.monotonic() < deadline:
        ready, _, _ = select.select(list(fds), [], [], 0.5)
        if not ready and proc.poll() is not None:
            break
        for fd in ready:
            try:
                data = os.read(fd, 65536)
            except OSError:  # EIO: the child closed its end of the pty
                data = b""
            if not data:
                del fds[fd]
            elif fds[fd] == "out":
                out.append(data)
            else:
                stream.feed(data)
                snapshots.append(list(screen.display))
                if interrupt is not None and interrupt(snapshots[-1]):
                    os.killpg(proc.pid, signal.SIGINT)
                    interrupt = None
    os.close(master)
    proc.wait(timeout=30)
    return screen, snapshots, b"".join(out)


def squash(s: str) -> str:
    """Whitespace removed: the screen breaks long lines where the terminal wraps them."""
    return re.sub(r"\s+", "", s)
