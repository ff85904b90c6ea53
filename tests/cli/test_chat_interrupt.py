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

import pytest
from typer.testing import CliRunner

import tforce
from tforce.cli import app, chat

from chat_helpers import ARGS, QUESTIONS, ROOT, Chat, clean_text, clean_tokens, default_sigint, long_pair


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return long_pair(tmp_path_factory.mktemp("interrupt"))


@pytest.fixture(scope="module")
def target(models):
    return tforce.load_model(str(models / "tiny-target"))


@pytest.mark.parametrize("stdout_tty", [True, False])
def test_ctrl_c_stops_the_answer_and_the_chat_goes_on(models, target, stdout_tty):
    """stdout on the terminal (Python's readline edits the line) or on a pipe (the terminal's own line
    editing; the answers' text is then checked exactly)."""
    first, second = (clean_text(models, target, q) for q in QUESTIONS)
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
    monkeypatch.setattr(chat, "question_source", lambda *args: (iter(QUESTIONS), True))
    r = CliRunner().invoke(app, ["chat", str(models / "doc.txt"), "-m", str(models / "tiny-target"), *ARGS,
                                 "--json"] + (["--keep-history"] if keep_history else []))
    assert r.exit_code == 0, (r.output, r.exception)
    stopped, answered = (json.loads(line) for line in r.stdout.splitlines())
    path = str(models / "tiny-target")
    assert stopped["interrupted"] and stopped["stats"] is None and stopped["question"] == QUESTIONS[0]
    assert tuple(stopped["tokens"]) == clean_tokens(path, QUESTIONS[0])[:3]
    assert stopped["answer"] == target.tokenizer.decode(stopped["tokens"], skip_special_tokens=True)
    assert not answered["interrupted"] and tuple(answered["tokens"]) == clean_tokens(path, QUESTIONS[1])
    line = "tforce: interrupted: the answer stopped after 3 tokens"
    assert line in r.stderr and ("left out of the history" in r.stderr) == keep_history


def test_questions_from_a_pipe_still_end_on_ctrl_c(models):
    """Not a terminal: Ctrl-C ends tforce as before, with one line and exit 130."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TFORCE_DEBUG", None)
    proc = subprocess.Popen([sys.executable, "-m", "tforce", "chat", str(models / "doc.txt"), "-m",
                             str(models / "tiny-target"), *ARGS], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=default_sigint)
    proc.stdin.write((QUESTIONS[0] + "\n" + QUESTIONS[1] + "\n").encode())
    proc.stdin.flush()
    assert select.select([proc.stdout], [], [], 120)[0] and proc.stdout.read(1)  # the first answer is arriving
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert err.decode().strip().splitlines()[-1] == "tforce: interrupted" and b"Traceback" not in err
