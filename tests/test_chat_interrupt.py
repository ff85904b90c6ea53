"""Ctrl-C in `tforce chat` as a person presses it, under a pseudo-terminal that is the chat's controlling
terminal (so \\x03 typed there becomes SIGINT, as in a shell): while an answer streams it stops the answer and
the `> ` prompt comes back; at the prompt it drops the typed line; the next answer is the clean run's; Ctrl-D
ends the chat with exit 0. --json: the stopped answer's record says "interrupted". Questions from a pipe
keep the old behaviour: Ctrl-C ends tforce (exit 130)."""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from functools import lru_cache
from pathlib import Path

import pytest
from typer.testing import CliRunner

import tforce
from tforce.cli import app, chat

from test_chat import DOC, QUESTIONS, ROOT, _question
from test_cli import DRAFT, TARGET
from tforce.model.synthetic import make_checkpoint

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


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return long_pair(tmp_path_factory.mktemp("interrupt"))


@pytest.fixture(scope="module")
def target(models):
    return tforce.load_model(str(models / "tiny-target"))


def _default_sigint():
    """In the child before exec: SIGINT's default action, as a shell gives a command. An ignored SIGINT
    survives exec and Python then installs no KeyboardInterrupt, so a test process that inherited one (a
    test runner's worker) would make Ctrl-C do nothing here."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _controlling_terminal():  # in the child, after setsid: the pty on stdin becomes its controlling terminal
    import fcntl
    import termios

    _default_sigint()
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
            stderr=slave, start_new_session=True, preexec_fn=_controlling_terminal)
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
def _clean(path: str, question: str) -> tuple[int, ...]:
    target = tforce.load_model(path)
    ids = target.tokenizer.encode(DOC) + _question(target, question)
    return tuple(tforce.generate(target.model, ids, method="ar", max_new_tokens=N, temperature=0,
                                 ignore_eos=True).tokens)


def _clean_text(models, target, question: str) -> str:
    return target.tokenizer.decode(list(_clean(str(models / "tiny-target"), question)), skip_special_tokens=True)


@pytest.mark.parametrize("stdout_tty", [True, False])
def test_ctrl_c_stops_the_answer_and_the_chat_goes_on(models, target, stdout_tty):
    """stdout on the terminal (Python's readline edits the line) or on a pipe (the terminal's own line
    editing; the answers' text is then checked exactly)."""
    first, second = (_clean_text(models, target, q) for q in QUESTIONS)
    start = first[:3].encode()  # how the first answer begins: seen, it is streaming
    assert first[:3].isprintable()
    chat = Chat(models, stdout_tty)
    chat.expect(b"> ")
    chat.type((QUESTIONS[0] + "\n").encode())
    chat.expect(start, where="tty" if stdout_tty else "out")
    chat.type(b"\x03")
    chat.expect(b"tforce: interrupted: the answer stopped after")
    chat.expect(b"> ")
    chat.type(b"half a question")  # Ctrl-C at the prompt: the line is dropped, a fresh prompt comes
    chat.expect(b"half a question")  # echoed: it is being read
    chat.ctrl_c_at_prompt()
    assert chat.proc.poll() is None
    chat.type((QUESTIONS[1] + "\n").encode())
    chat.expect(b"time to first token", timeout=120)
    chat.expect(b"> ")
    assert chat.end() == 0
    tty = chat.seen["tty"].decode(errors="replace")
    assert tty.count("time to first token") == 1 and "Traceback" not in tty
    if stdout_tty:
        assert second[:3] in tty
    else:
        out = chat.seen["out"].decode()
        assert out.endswith("\n" + second + ("" if second.endswith("\n") else "\n"))
        partial = out[:-len(second) - 2]
        assert 0 < len(partial) < len(first) and first.startswith(partial)


@pytest.mark.parametrize("keep_history", [False, True])
def test_json_record_of_a_stopped_answer(models, target, monkeypatch, keep_history):
    """Questions from a terminal (stood in for), Ctrl-C (KeyboardInterrupt) after the first answer's third
    token batch: its record has "interrupted": true and the tokens so far; the next answer is the clean one."""
    calls = []

    class Stopping(chat.TextStream):
        def add(self, tokens):
            super().add(tokens)
            calls.append(1)
            if len(calls) == 3:
                raise KeyboardInterrupt

    monkeypatch.setattr(chat, "TextStream", Stopping)
    monkeypatch.setattr(chat, "_question_source", lambda *args: (iter(QUESTIONS), True))
    r = CliRunner().invoke(app, ["chat", str(models / "doc.txt"), "-m", str(models / "tiny-target"), *ARGS,
                                 "--json"] + (["--keep-history"] if keep_history else []))
    assert r.exit_code == 0, (r.output, r.exception)
    stopped, answered = (json.loads(line) for line in r.stdout.splitlines())
    path = str(models / "tiny-target")
    assert stopped["interrupted"] and stopped["stats"] is None and stopped["question"] == QUESTIONS[0]
    assert tuple(stopped["tokens"]) == _clean(path, QUESTIONS[0])[:3]
    assert stopped["answer"] == target.tokenizer.decode(stopped["tokens"], skip_special_tokens=True)
    assert not answered["interrupted"] and tuple(answered["tokens"]) == _clean(path, QUESTIONS[1])
    line = "tforce: interrupted: the answer stopped after 3 tokens"
    assert line in r.stderr and ("left out of the history" in r.stderr) == keep_history


def test_questions_from_a_pipe_still_end_on_ctrl_c(models):
    """Not a terminal: Ctrl-C ends tforce as before, with one line and exit 130."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TFORCE_DEBUG", None)
    proc = subprocess.Popen([sys.executable, "-m", "tforce", "chat", str(models / "doc.txt"), "-m",
                             str(models / "tiny-target"), *ARGS], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=_default_sigint)
    proc.stdin.write((QUESTIONS[0] + "\n" + QUESTIONS[1] + "\n").encode())
    proc.stdin.flush()
    assert select.select([proc.stdout], [], [], 120)[0] and proc.stdout.read(1)  # the first answer is arriving
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert err.decode().strip().splitlines()[-1] == "tforce: interrupted" and b"Traceback" not in err
