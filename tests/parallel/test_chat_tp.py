"""`tforce chat --tp 2` and KV snapshots over tensor-parallel ranks, on the CPU (gloo, 2 spawned
processes): answers equal the single-process answers token for token (greedy; and sampled with a seed,
as test_parallel asserts for run: the ranks' logits are bitwise equal, and differ from the unsharded
model's only by summation order), with and without --keep-history; a snapshot written by 2 ranks loads
into 2 ranks (chat and run) and into one process, and one made in one process into 2 ranks, with a fresh
prefill's answers (a snapshot without its weight files' fingerprint is refused by another world size); ranks that disagree fail the answer; a rank that fails to write leaves no snapshot; Ctrl-C stops
an answer on every rank and the ranks go on; no worker process outlives the command, an error in a rank
or its parent's death.

Every launch starts two workers that import torch and transformers (seconds each), so each test makes
at most two."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from multiprocessing import resource_tracker
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from typer.testing import CliRunner

import tforce
from tforce.snapshot import identity as snapshot_identity, store as snapshot_io
from tforce.cli import app
from tforce.config import RunConfig, Sampling, Speculation
from tforce.parallel.conversation import ParallelConversation, conversation_worker
from tforce.engine.generate import Session
from tforce.errors import TforceError
from tforce.parallel.ranks import Ranks
from tforce.engine.events import Events

from chat_helpers import QUESTIONS, ROOT
from chat_helpers import models, target  # noqa: F401 (fixtures)
from cli_helpers import DOC, FAST, one_error_line

SAMPLED = ["--temperature", "0.9", "--top-p", "0.95", "--seed", "5"]


def _children() -> set[int]:
    """This process's child processes (from /proc), after starting multiprocessing's resource tracker (a
    child that the first spawn starts and that stays), so that only ranks come and go."""
    resource_tracker.ensure_running()
    me, out = str(os.getpid()), set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me:
            out.add(int(stat.parent.name))
    return out


def _invoke(args, input=None):
    """CliRunner's result; the command must leave no child process behind, however it ended."""
    before = _children()
    result = CliRunner().invoke(app, args, input=input)
    assert _children() <= before, "worker processes outlived the command"
    return result


def _chat(models, *args, tp=True, input="\n".join(QUESTIONS) + "\n"):
    base = ["chat", "-m", str(models / "tiny-target"), "--draft", str(models / "tiny-draft"), *FAST, "--json",
            "--method", "triforce"]
    return _invoke(base + list(args) + (["--tp", "2", "--device", "cpu"] if tp else []), input=input)


def _tokens(result) -> list[list[int]]:
    assert result.exit_code == 0, (result.output, result.exception)
    return [json.loads(line)["tokens"] for line in result.stdout.splitlines()]


def _question(target, q: str) -> list[int]:
    return target.tokenizer.encode("\n\n" + q, add_special_tokens=False)


def _greedy(target, ids: list[int]) -> list[int]:
    return tforce.generate(target.model, ids, method="ar", max_new_tokens=12, temperature=0).tokens


def _answers_follow_the_loaded_conversation(r, target, snapshot) -> None:
    """A --keep-history chat's answers, its document loaded whole from `snapshot`: each follows the
    conversation so far, as a fresh single-process prefill answers."""
    history = target.tokenizer.encode(DOC)
    for q, tokens in zip(QUESTIONS, _tokens(r), strict=True):
        history += _question(target, q)
        assert tokens == _greedy(target, history)
        history += tokens
    n = len(target.tokenizer.encode(DOC + "\n\n"))
    assert f"document: {n} tokens ({n} loaded from {snapshot}, 0 prefilled)" in r.stderr


def _run_reuses_the_document(models, target, snapshot) -> None:
    """`run --tp 2 --load-kv snapshot` after the document: a fresh prefill's answer, the document reused."""
    r = _invoke(["run", "-m", str(models / "tiny-target"), "--draft", str(models / "tiny-draft"), *FAST,
                 str(models / "doc.txt"), "-p", "And then?", "--json", "--tp", "2", "--device", "cpu",
                 "--load-kv", str(snapshot), "--method", "triforce"])
    assert r.exit_code == 0, r.output
    record = json.loads(r.stdout)
    assert record["tokens"] == _greedy(target, target.tokenizer.encode(DOC + "\n\nAnd then?"))
    assert record["stats"]["kv_reused"] == len(target.tokenizer.encode(DOC + "\n\n"))


@pytest.fixture(scope="module")
def saving_chat(models, tmp_path_factory):
    """(`chat --tp 2 BOOK --save-kv` answering both questions, the snapshot it wrote, its folder)."""
    root = tmp_path_factory.mktemp("tp-snap")
    return _chat(models, str(models / "doc.txt"), "--save-kv", str(root / "doc.kv")), root / "doc.kv", root


@pytest.fixture(scope="module")
def tp_snapshot(saving_chat):
    assert saving_chat[0].exit_code == 0, saving_chat[0].output
    return saving_chat[1]


def test_chat_tp2_answers_and_saves_the_document(saving_chat, target):
    """Each answer follows the document alone, as one process answers; the snapshot holds each rank's part."""
    r, snap, root = saving_chat
    doc = target.tokenizer.encode(DOC)
    assert _tokens(r) == [_greedy(target, doc + _question(target, q)) for q in QUESTIONS]
    assert "snapshot written to" in r.stderr
    manifest = json.loads((snap / "manifest.json").read_text())
    # the document's piece ends with the blank line its questions follow (prompt_format.document_ids)
    assert manifest["world"] == 2 and manifest["version"] == 2 and manifest["tokens"] == doc + _question(target, "")
    assert {name.split("/")[0] for name in manifest["files"]} == {"rank-0", "rank-1"}
    assert sorted(p.name for p in root.iterdir()) == ["doc.kv"]  # no temporary left


def test_tp2_snapshot_loads_into_tp2_chat_with_fresh_answers(models, target, tp_snapshot):
    """chat --tp 2 --load-kv (the document from the snapshot, not prefilled again) with --keep-history:
    each answer follows the conversation so far, as a fresh single-process prefill answers."""
    r = _chat(models, "--load-kv", str(tp_snapshot), "--keep-history")
    _answers_follow_the_loaded_conversation(r, target, tp_snapshot)


def test_tp2_snapshot_loads_into_tp2_run(models, target, tp_snapshot):
    _run_reuses_the_document(models, target, tp_snapshot)


def test_a_snapshot_loads_into_another_number_of_ranks(models, target, tp_snapshot, tmp_path):
    """Made over 2 ranks, loaded into one process (chat, with --keep-history); made in one process, loaded
    into 2 ranks (run): each rank cuts its KV heads from the parts that hold them, and the answers are a
    fresh prefill's. Before, each was refused in one line."""
    r = _chat(models, "--load-kv", str(tp_snapshot), "--keep-history", tp=False)
    _answers_follow_the_loaded_conversation(r, target, tp_snapshot)
    one = tmp_path / "one.kv"
    assert _chat(models, str(models / "doc.txt"), "--save-kv", str(one), tp=False, input="").exit_code == 0
    _run_reuses_the_document(models, target, one)


def test_an_older_snapshot_of_another_number_of_ranks_is_refused_in_one_line(models, tp_snapshot, tmp_path):
    """A snapshot without the weight files' fingerprint (tforce before it was recorded) matches its model
    only within its own split."""
    old = tmp_path / "old.kv"
    shutil.copytree(tp_snapshot, old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["target"]["files_sha256"]
    manifest["manifest_sha256"] = tforce.snapshot.format.manifest_sha(manifest)
    (old / "manifest.json").write_text(json.dumps(manifest))
    one_error_line(_chat(models, "--load-kv", str(old), tp=False), 2,
                   "made with --tp 2, this run has one process (no --tp): pass --tp 2")


def test_sampled_answers_equal_the_single_process_ones(models):
    """Every rank samples with the seed the parent sends (the workers check per answer that all ranks
    agree); with --seed, each answer is the single-process chat's."""
    tp = _tokens(_chat(models, str(models / "doc.txt"), *SAMPLED))
    assert tp == _tokens(_chat(models, str(models / "doc.txt"), *SAMPLED, tp=False))


def test_unseeded_answers_agree_across_ranks(models):
    """Without --seed each answer is sampled with a seed the parent draws and sends every rank (ranks
    drawing their own would part ways: the per-answer check, or collectives out of step, would fail)."""
    r = _chat(models, str(models / "doc.txt"), *SAMPLED[:4])
    assert len(_tokens(r)) == 2


def test_a_failing_rank_ends_the_chat_in_one_line(models, tp_snapshot, tmp_path):
    """Rank 1 finds its part of the snapshot damaged while rank 0 goes on into the prefill's first
    all_reduce: one line names rank 1's error, and no rank outlives the command (_invoke)."""
    damaged = tmp_path / "damaged.kv"
    shutil.copytree(tp_snapshot, damaged)
    f = damaged / "rank-1" / "full-001.safetensors"
    data = bytearray(f.read_bytes())
    data[-10] ^= 1
    f.write_bytes(bytes(data))
    one_error_line(_chat(models, "--load-kv", str(damaged)), 1, "rank-1/full-001.safetensors is damaged")


def test_ctrl_c_stops_an_answer_and_the_ranks_go_on(models, target):
    """ParallelConversation (the library's chat over ranks): the ranks ignore SIGINT; Ctrl-C (to the
    parent) while an answer streams stops it on every rank and the ranks wait for the next question, which
    is answered as if the stopped one had never been asked (here with keep_history); an exception from a
    callback ends every rank at once."""
    doc = target.tokenizer.encode(DOC)
    before = _children()
    with ParallelConversation(models / "tiny-target", None, doc, 2, method="ar", temperature=0, ignore_eos=True,
                              keep_history=True, room=400) as conv:
        for p in conv.ranks.procs:  # a terminal's Ctrl-C reaches them too: only the parent may act on it
            sigign = next(line for line in Path(f"/proc/{p.pid}/status").read_text().splitlines()
                          if line.startswith("SigIgn:"))
            assert int(sigign.split()[1], 16) & (1 << (signal.SIGINT - 1))
        pressed = []

        def ctrl_c(r, tokens, acceptance):  # once: a second Ctrl-C would end the ranks
            if not pressed:
                pressed.append(os.kill(os.getpid(), signal.SIGINT))

        with pytest.raises(KeyboardInterrupt):  # 300 one-token rounds: the ranks see the stop long before
            conv.ask(_question(target, QUESTIONS[0]), 300, Events(on_tokens=ctrl_c))
        ids = doc + _question(target, QUESTIONS[1])
        assert conv.ask(_question(target, QUESTIONS[1]), 12).tokens == _greedy(target, ids)

        def fail(r, tokens, acceptance):
            raise ValueError("a callback failed")

        with pytest.raises(ValueError):
            conv.ask(_question(target, QUESTIONS[0]), 12, Events(on_tokens=fail))
        assert _children() <= before
        with pytest.raises(TforceError, match="have ended"):
            conv.ask(_question(target, QUESTIONS[1]), 12)


def test_ctrl_c_at_a_terminal_stops_an_answer_as_in_one_process(tmp_path, monkeypatch):
    """test_chat_interrupt's terminal session (a pty as the chat's controlling terminal: Ctrl-C reaches
    the ranks too), with --tp 2: Ctrl-C stops the first answer, drops a half-typed line, and the second
    answer is the clean one. Its models: that module's, with room for answers that last seconds."""
    import chat_helpers

    models = chat_helpers.long_pair(tmp_path)
    target = tforce.load_model(str(models / "tiny-target"))

    monkeypatch.setattr(chat_helpers, "ARGS", chat_helpers.ARGS + ["--tp", "2", "--device", "cpu"])
    first, second = (chat_helpers.clean_text(models, target, q) for q in QUESTIONS)
    chat = chat_helpers.Chat(models, stdout_tty=False)
    chat.expect(b"> ")
    chat.type((QUESTIONS[0] + "\n").encode())
    chat.expect(first[:3].encode(), where="out")
    chat.type(b"\x03")
    chat.expect(b"tforce: interrupted: the answer stopped after")
    chat.expect(b"> ")
    chat.type(b"half a question")
    chat.expect(b"half a question")
    chat.ctrl_c_at_prompt()
    chat.type((QUESTIONS[1] + "\n").encode())
    chat.expect(b"time to first token", timeout=120)
    chat.expect(b"> ")
    assert chat.end() == 0
    out = chat.seen["out"].decode()
    assert out.endswith("\n" + second + ("" if second.endswith("\n") else "\n"))
    assert "Traceback" not in chat.seen["tty"].decode(errors="replace")


def _idle(rank, world):
    """A serving worker that answers every command with None."""
    while True:
        yield None


def test_serving_ranks_exit_when_their_parent_is_killed(tmp_path):
    code = ("import os, sys\n"
            "from tforce.parallel.ranks import Ranks\n"
            "from test_chat_tp import _idle\n"
            "ranks = Ranks(_idle, 2, 'gloo', serve=True)\n"
            "ranks.collect()\n"
            "print(*(p.pid for p in ranks.procs), flush=True)\n"
            "os.kill(os.getpid(), 9)\n")
    here = Path(__file__).resolve().parent  # this module, for _idle; the support modules it imports
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(here), str(ROOT / "tests")]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    pids = [int(x) for x in out.stdout.split()]
    assert len(pids) == 2, out.stderr
    deadline = time.monotonic() + 15
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_running(pid) for pid in pids)


def _running(pid: int) -> bool:
    """Whether pid is a live process (a zombie awaiting its reaper is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _skewed_worker(rank, world, *args, emit=None):
    """conversation_worker whose rank 1 samples every answer with another seed."""
    server = conversation_worker(rank, world, *args, emit=emit)
    command = yield next(server)
    while True:
        ids, max_new, seed, names, until = command
        command = yield server.send((ids, max_new, seed + rank, names, until))


def test_ranks_that_disagree_fail_the_answer_and_end(models, target):
    """With --method ar every rank makes the same collectives whatever it samples (one token a forward,
    EOS ignored), so ranks sampling with different seeds reach the end of the answer, and its check."""
    doc = target.tokenizer.encode(DOC)
    config = RunConfig.of(method="ar", temperature=0.9, top_p=0.95, seed=5, budget=64, ignore_eos=True)
    before = _children()
    stop = mp.get_context("spawn").Event()  # referenced until the workers have it
    ranks = Ranks(_skewed_worker, 2, "gloo", str(models / "tiny-target"), None, doc, "cpu", torch.float32,
                  config, dict(room=64), [None, None], False, stop, serve=True)
    with ranks:
        ranks.collect()
        ranks.send((_question(target, QUESTIONS[0]), 12, 7, (), None))
        with pytest.raises(TforceError, match="^the tensor-parallel ranks answered with different tokens"):
            ranks.collect()
    assert _children() <= before
    with pytest.raises(TforceError, match="have ended"):
        ranks.send(None)


class _ThreadGroup:
    """Threads standing in for ranks (the snapshot modules' view of parallel.Group): gather meets at a barrier."""

    def __init__(self, rank: int, slots: list, barrier: threading.Barrier):
        self.rank, self.world, self.slots, self.barrier = rank, len(slots), slots, barrier

    def gather(self, obj) -> list:
        self.slots[self.rank] = obj
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


def test_a_rank_that_fails_to_write_fails_every_rank_and_leaves_no_snapshot(tiny, tmp_path, monkeypatch):
    prompt = torch.randint(3, 259, (20,), generator=torch.Generator().manual_seed(0))
    session = Session(tiny["gqa"].model, None, 20, 4, RunConfig(speculation=Speculation(method="ar", budget=16), sampling=Sampling(temperature=0)))
    session.prefill([prompt])
    ident = snapshot_identity.identity(tiny["gqa"])
    write = snapshot_io._write

    def disk_full_on_rank_1(folder, name, tensors):
        if folder.name == "rank-1" and name == "full-001.safetensors":
            raise OSError(28, "No space left on device")
        return write(folder, name, tensors)

    monkeypatch.setattr(snapshot_io, "_write", disk_full_on_rank_1)
    slots, barrier, errors = [None, None], threading.Barrier(2, timeout=30), [None, None]

    def rank(r):
        try:
            snapshot_io.save(tmp_path / "s", session, ident, _ThreadGroup(r, slots, barrier))
        except TforceError as e:
            errors[r] = str(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors[0] == errors[1] and errors[0].endswith(
        "rank 1 could not write its KV heads: OSError: [Errno 28] No space left on device")
    assert list(tmp_path.iterdir()) == []
