"""What the chat tests share: the tiny pair and its document (the `models` and `target` fixtures, for
tests/cli/test_chat.py and tests/parallel/test_chat_tp.py), the questions and their ids as chat appends them; and
`tforce chat` under a pseudo-terminal that is its controlling terminal, as a person types Ctrl-C there
(tests/cli/test_chat_interrupt.py, and with --tp 2 tests/parallel/test_chat_tp.py), with the clean answers to compare."""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from functools import lru_cache
from pathlib import Path

import pytest

import tforce
from tforce.model.synthetic import make_checkpoint

from cli_helpers import DOC, DRAFT, TARGET

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = ["Who wrote this?", "What age was it?"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    make_checkpoint(root / "tiny-target", seed=0, **TARGET)
    make_checkpoint(root / "tiny-draft", seed=1, **DRAFT)
    (root / "doc.txt").write_text(DOC)
    return root


@pytest.fixture(scope="module")
def target(models):
    return tforce.load_model(str(models / "tiny-target"))


def question_ids(target, q: str) -> list[int]:
    return target.tokenizer.encode("\n\n" + q, add_special_tokens=False)


# ---- `tforce chat` at a terminal ----------------------------------------------------------------------

# --ignore-eos: every answer runs to N tokens, seconds on the tiny model, so Ctrl-C comes mid-answer even on
# a loaded machine (200 tokens took 0.55 s there, and a whole answer once ended before the Ctrl-C came)
N = 1000
ARGS = ["--method", "ar", "--threads", "1", "--temperature", "0", "--ignore-eos", "-n", str(N)]


def long_pair(root: Path) -> Path:
    """test_chat's tiny pair and document in `root`, with the room for N tokens after the document and a
    question."""
    make_checkpoint(root / "tiny-target", seed=0, **dict(TARGET, max_position_embeddings=2048))
    make_checkpoint(root / "tiny-draft", seed=1, **dict(DRAFT, max_position_embeddings=2048))
    (root / "doc.txt").write_text(DOC)
    return root


def default_sigint():
    """In the child before exec: SIGINT's default action, as a shell gives a command. An ignored SIGINT
    survives exec and Python then installs no KeyboardInterrupt, so a test process that inherited one (a
    test runner's worker) would make Ctrl-C do nothing here."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def controlling_terminal():  # in the child, after setsid: the pty on stdin becomes its controlling terminal
    import fcntl
    import termios

    default_sigint()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Chat:
    """`tforce chat` on the tiny target with stdin and stderr on a pty, stdout there too or on a pipe."""

    def __init__(self, models, stdout_tty: bool):
        import pty

        self.master, slave = pty.openpty()
        env = dict(os.environ, TERM="xterm-256color", PYTHONPATH=str(ROOT))
        env.pop("TFORCE_DEBUG", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tforce", "chat", str(models / "doc.txt"), "-m", str(models / "tiny-target"),
             *ARGS], cwd=ROOT, env=env, stdin=slave, stdout=slave if stdout_tty else subprocess.PIPE,
            stderr=slave, start_new_session=True, preexec_fn=controlling_terminal)
        os.close(slave)
        self.seen = {"tty": b"", "out": b""}
        self.read_to = {"tty": 0, "out": 0}  # what wait_for has matched so far
        self.fds = {self.master: "tty"}
        if not stdout_tty:
            self.fds[self.proc.stdout.fileno()] = "out"

    def wait_for(self, needle: bytes, where: str = "tty", timeout: float = 60) -> bool:
        """Read what the chat writes until `needle` comes after what earlier waits matched, on the terminal
        (or stdout's pipe); whether it came within the timeout."""
        deadline = time.monotonic() + timeout
        while (at := self.seen[where].find(needle, self.read_to[where])) < 0:
            if time.monotonic() > deadline or not self.fds:
                return False
            for fd in select.select(list(self.fds), [], [], 0.2)[0]:
                try:
                    data = os.read(fd, 65536)
                except OSError:  # the terminal closed: the chat exited
                    data = b""
                self.seen[self.fds[fd]] += data
                if not data:
                    del self.fds[fd]
        self.read_to[where] = at + len(needle)
        return True

    def expect(self, needle: bytes, where: str = "tty", timeout: float = 60) -> None:
        assert self.wait_for(needle, where, timeout), f"no {needle!r} in {self.seen[where][-300:]!r}"

    def ctrl_c_at_prompt(self) -> None:
        """Ctrl-C, again if no fresh prompt comes: Python's readline acts on a SIGINT that arrives while it
        handles a key only at the next key or signal."""
        for _ in range(5):
            self.type(b"\x03")
            if self.wait_for(b"> ", timeout=3):
                return
        raise AssertionError(f"no fresh prompt: {self.seen['tty'][-300:]!r}")

    def type(self, data: bytes) -> None:
        os.write(self.master, data)

    def end(self) -> int:
        """Ctrl-D at the prompt; the exit code once the chat exited (its output read to the end)."""
        self.type(b"\x04")
        self.wait_for(b"never", timeout=30)
        code = self.proc.wait(timeout=30)
        os.close(self.master)
        return code


@lru_cache
def clean_tokens(path: str, question: str) -> tuple[int, ...]:
    target = tforce.load_model(path)
    ids = target.tokenizer.encode(DOC) + question_ids(target, question)
    return tuple(tforce.generate(target.model, ids, method="ar", max_new_tokens=N, temperature=0,
                                 ignore_eos=True).tokens)


def clean_text(models, target, question: str) -> str:
    return target.tokenizer.decode(list(clean_tokens(str(models / "tiny-target"), question)), skip_special_tokens=True)
