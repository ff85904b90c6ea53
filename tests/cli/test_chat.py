"""`tforce chat` and the snapshot options of `tforce run`, through Typer's CliRunner (and once under a
pseudo-terminal, as a person types): answers are the target's greedy continuations of the document and
the question, questions come from stdin, a file or the terminal, and errors are one line."""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

import tforce
from tforce.cli import app, chat_input
from tforce.model.synthetic import make_checkpoint

from chat_helpers import QUESTIONS, ROOT, question_ids
from chat_helpers import models, target  # noqa: F401 (fixtures)
from cli_helpers import DOC, FAST, TARGET, one_error_line


def _chat(models, *args, input=None):
    base = ["chat", "-m", str(models / "tiny-target"), "--draft", str(models / "tiny-draft"), *FAST, "--method",
            "triforce"]
    return CliRunner().invoke(app, base + list(args), input=input)


def _answer(target, ids: list[int]) -> list[int]:
    return tforce.generate(target.model, ids, method="ar", max_new_tokens=12, temperature=0).tokens


def _records(result) -> list[dict]:
    assert result.exit_code == 0, (result.output, result.exception)
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_each_answer_follows_the_document_alone(models, target):
    r = _chat(models, str(models / "doc.txt"), "--json", input="\n".join(QUESTIONS) + "\n\n")
    records = _records(r)
    doc = target.tokenizer.encode(DOC)
    assert [x["question"] for x in records] == QUESTIONS
    for x in records:
        assert x["tokens"] == _answer(target, doc + question_ids(target, x["question"]))
        assert x["stats"]["prefilled_tokens"] < len(question_ids(target, x["question"]))
    assert r.stderr.count("time to first token") == 0  # --json: the statistics are in the records


def test_keep_history_follows_the_conversation(models, target):
    records = _records(_chat(models, str(models / "doc.txt"), "--json", "--keep-history",
                             input="\n".join(QUESTIONS) + "\n"))
    history = target.tokenizer.encode(DOC)
    for x in records:
        history += question_ids(target, x["question"])
        assert x["tokens"] == _answer(target, history)
        history += x["tokens"]


def test_text_answers_and_time_to_first_token(models, target):
    r = _chat(models, str(models / "doc.txt"), input=QUESTIONS[0] + "\n")
    assert r.exit_code == 0, r.output
    doc = target.tokenizer.encode(DOC)
    text = target.tokenizer.decode(_answer(target, doc + question_ids(target, QUESTIONS[0])), skip_special_tokens=True)
    assert r.stdout == text + ("" if text.endswith("\n") else "\n")
    assert "tforce: document: " in r.stderr and "time to first token" in r.stderr


def test_document_on_stdin_takes_questions_from_a_file_or_refuses(models, target, tmp_path, monkeypatch):
    def no_terminal():
        raise OSError("no tty")

    monkeypatch.setattr(chat_input, "_open_terminal", no_terminal)
    one_error_line(_chat(models, input=DOC), 2, "--questions FILE")
    one_error_line(_chat(models, "-", "--questions", "-", input=DOC), 2, "--questions FILE")
    (tmp_path / "q.txt").write_text(QUESTIONS[1] + "\n")
    records = _records(_chat(models, "--questions", str(tmp_path / "q.txt"), "--json", input=DOC))
    doc = target.tokenizer.encode(DOC)
    assert records[0]["tokens"] == _answer(target, doc + question_ids(target, QUESTIONS[1]))


def test_chat_saves_and_loads_the_document(models, tmp_path):
    snap = str(tmp_path / "doc.kv")
    first = _records(_chat(models, str(models / "doc.txt"), "--json", "--save-kv", snap, input=QUESTIONS[0]))
    r = _chat(models, "--json", "--load-kv", snap, input=QUESTIONS[0])  # no BOOK: the snapshot's document
    assert _records(r)[0]["tokens"] == first[0]["tokens"]
    assert "loaded from" in r.stderr


def test_run_saves_and_loads_a_snapshot(models, tmp_path):
    base = ["run", "-m", str(models / "tiny-target"), "--draft", str(models / "tiny-draft"), "--method", "triforce",
            *FAST, str(models / "doc.txt"), "--json"]
    snap = str(tmp_path / "run.kv")
    saved = CliRunner().invoke(app, base + ["--save-kv", snap])
    loaded = CliRunner().invoke(app, base + ["--load-kv", snap, "-p", "And then?"])
    fresh = CliRunner().invoke(app, base + ["-p", "And then?"])
    assert saved.exit_code == loaded.exit_code == fresh.exit_code == 0, loaded.output
    assert json.loads(loaded.stdout)["tokens"] == json.loads(fresh.stdout)["tokens"]
    # the snapshot holds the saved run's whole prompt, the question's prompt extends it
    assert json.loads(loaded.stdout)["stats"]["kv_reused"] == json.loads(saved.stdout)["prompt_tokens"]
    assert "written to" in saved.stderr and "reused" in loaded.stderr and "leaves" not in loaded.stderr
    other = CliRunner().invoke(app, base[:-2] + ["--json", "-p", "Something else", "--load-kv", snap],
                               input="A different document.")
    assert other.exit_code == 0 and "leaves the snapshot's" in other.stderr, other.stderr


def test_snapshot_refusals_are_one_line(models, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "a.txt").write_text("x")
    one_error_line(_chat(models, str(models / "doc.txt"), "--save-kv", str(mine), input="q\n"), 2, "refusing")
    one_error_line(_chat(models, "--load-kv", str(tmp_path / "none"), input="q\n"), 2, "no such snapshot")
    base = ["run", "-m", str(models / "tiny-target"), "--method", "ar", str(models / "doc.txt")]
    one_error_line(CliRunner().invoke(app, base + ["--tp", "2", "--device", "cpu", "--save-kv", str(mine)]), 2,
                   "refusing")  # before any rank starts
    one_error_line(_chat(models, str(models / "doc.txt"), "--room", "1", input="q\n"), 2, "--room")


def test_a_room_the_context_cannot_hold_is_said_the_default_is_not(models, target):
    """--room 5000 on a 512-token model was cut to what the context leaves without a word; the default
    (4096) is cut silently, since nobody asked for it."""
    n = len(target.tokenizer.encode(DOC + "\n\n"))
    asked = _chat(models, str(models / "doc.txt"), "--room", "5000", "--json", input="Who?\n")
    assert asked.exit_code == 0, asked.output
    assert (f"tforce: note: the model's context (512 tokens) leaves room for {512 - n} tokens of questions and "
            f"answers after the {n}-token document, not the --room 5000 asked for") in asked.stderr
    default = _chat(models, str(models / "doc.txt"), "--json", input="Who?\n")
    assert default.exit_code == 0 and "tforce: note: the model's context" not in default.stderr
    assert json.loads(default.stdout)["tokens"] == json.loads(asked.stdout)["tokens"]


def test_questions_typed_at_a_terminal(models, target):
    """Under a pseudo-terminal: a `> ` prompt, the answer, Ctrl-D ends the chat with exit 0."""
    import pty

    master, slave = pty.openpty()
    env = dict(os.environ, TERM="xterm-256color", PYTHONPATH=str(ROOT))
    env.pop("TFORCE_DEBUG", None)
    proc = subprocess.Popen([sys.executable, "-m", "tforce", "chat", str(models / "doc.txt"), "-m",
                             str(models / "tiny-target"), "--method", "ar", "--threads", "1", *FAST],
                            cwd=ROOT, env=env, stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    seen = b""

    def read_until(needle: bytes, count: int = 1, timeout: float = 120) -> None:
        nonlocal seen
        deadline = time.monotonic() + timeout
        while seen.count(needle) < count and time.monotonic() < deadline:
            if select.select([master], [], [], 0.5)[0]:
                try:
                    seen += os.read(master, 65536)
                except OSError:
                    return

    read_until(b"> ")
    os.write(master, (QUESTIONS[0] + "\n").encode())
    read_until(b"time to first token")
    read_until(b"> ", count=2)  # readline waits for the next question: Ctrl-D there ends the chat
    time.sleep(0.5)
    os.write(master, b"\x04")
    read_until(b"never", timeout=10)  # drain the terminal while the process exits
    assert proc.wait(timeout=60) == 0
    os.close(master)
    doc = target.tokenizer.encode(DOC)
    text = target.tokenizer.decode(_answer(target, doc + question_ids(target, QUESTIONS[0])), skip_special_tokens=True)
    shown = seen.decode(errors="replace").replace("\r\n", "\n")
    assert text.split("\n")[0][:20] in shown


def _driven_chat(models, *extra):
    """`tforce chat` run as a program drives it: stdin and stderr are pipes, stdout goes to a pipe too."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TFORCE_DEBUG", None)
    return subprocess.Popen([sys.executable, "-m", "tforce", "chat", str(models / "doc.txt"), "-m",
                             str(models / "tiny-target"), "--method", "ar", "--threads", "1", "--json", *FAST,
                             *extra], cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def _stderr_line_with(proc, needle: str, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([proc.stderr], [], [], 0.5)[0]:
            line = proc.stderr.readline().decode()
            if needle in line or not line:
                return line
    proc.kill()
    raise AssertionError(f"no stderr line with {needle!r} in {timeout} s")


def test_a_program_may_ask_after_the_prefilled_line(models, target):
    """A client that sends its first question only once chat says the document is prefilled. chat waited for
    that question before loading anything (to refuse an empty stdin early), and the client for the line:
    both waited forever. Now a pipe with nothing in it yet is read after the prefill."""
    proc = _driven_chat(models)
    try:
        assert "prefilled" in _stderr_line_with(proc, "tforce: document: ")
        proc.stdin.write((QUESTIONS[0] + "\n").encode())
        proc.stdin.flush()
        assert select.select([proc.stdout], [], [], 120)[0], "no answer in 120 s"
        record = json.loads(proc.stdout.readline())
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
    finally:
        proc.kill()
    doc = target.tokenizer.encode(DOC)
    assert record["tokens"] == _answer(target, doc + question_ids(target, QUESTIONS[0]))


def test_a_pipe_closed_after_the_prefill_without_a_question_is_one_line(models):
    proc = _driven_chat(models)
    try:
        assert "prefilled" in _stderr_line_with(proc, "tforce: document: ")
        proc.stdin.close()
        assert proc.wait(timeout=60) == 2
        err = proc.stderr.read().decode()
    finally:
        proc.kill()
    assert err == "tforce: error: stdin holds no questions (one a line): pipe them, or give --questions FILE\n"
    assert proc.stdout.read() == b""


@pytest.mark.parametrize("early, rest", [(QUESTIONS[0][:9], QUESTIONS[0][9:] + "\n"),
                                         ("\n \n", QUESTIONS[0] + "\n")])
def test_a_program_may_ask_after_the_prefilled_line_having_sent_no_whole_question(models, target, early, rest):
    """What a program wrote before the "prefilled" line holds no whole question yet (a question's first part,
    blank lines): chat waited for one before loading anything, and the program for the line."""
    proc = _driven_chat(models)
    try:
        proc.stdin.write(early.encode())
        proc.stdin.flush()
        time.sleep(0.5)  # in the pipe before chat looks
        assert "prefilled" in _stderr_line_with(proc, "tforce: document: ", timeout=60)
        proc.stdin.write(rest.encode())
        proc.stdin.close()
        assert select.select([proc.stdout], [], [], 120)[0], "no answer in 120 s"
        record = json.loads(proc.stdout.readline())
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
    finally:
        proc.kill()
    doc = target.tokenizer.encode(DOC)
    assert record["tokens"] == _answer(target, doc + question_ids(target, QUESTIONS[0]))


@pytest.mark.parametrize("held", [b"", b"\n \n\n"])
def test_a_pipe_already_closed_without_a_question_is_refused_before_the_prefill(models, held):
    r, w = os.pipe()
    os.write(w, held)
    os.close(w)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TFORCE_DEBUG", None)
    with os.fdopen(r, "rb") as stdin:
        done = subprocess.run([sys.executable, "-m", "tforce", "chat", str(models / "doc.txt"), "-m",
                               str(models / "tiny-target"), "--method", "ar", *FAST], cwd=ROOT, env=env,
                              stdin=stdin, capture_output=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.decode() == f"tforce: error: {chat_input.NO_QUESTIONS}\n"  # no "prefilled" line before it


def test_quantized_weights_answer_as_the_quantized_model(models, monkeypatch):
    """--weights reaches chat's load: the target's projections are int8 and the answers are its own."""
    import tforce.model.weights as weights

    schemes = []
    quantize = weights.quantize
    monkeypatch.setattr(weights, "quantize",
                        lambda model, scheme, **kw: schemes.append(scheme) or quantize(model, scheme, **kw))
    target = make_checkpoint(models / "tiny-target-128", seed=0, **dict(TARGET, intermediate_size=128))
    r = CliRunner().invoke(app, ["chat", "-m", str(target), "--draft", str(models / "tiny-draft"), *FAST,
                                 "--method", "triforce", str(models / "doc.txt"), "--json", "--weights", "int8"],
                           input=QUESTIONS[0] + "\n\n")
    (x,) = _records(r)
    assert schemes == ["int8"]  # the target only: the draft stays in its dtype
    quant = tforce.load_model(str(target), weights="int8")
    assert x["tokens"] == _answer(quant, quant.tokenizer.encode(DOC) + question_ids(quant, x["question"]))
