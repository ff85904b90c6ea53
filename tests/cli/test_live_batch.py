"""`tforce run --batch`'s live status as a person sees it: the CLI under a pseudo-terminal, every byte it
writes to the terminal fed to a terminal emulator (pyte, as tests/cli/test_live.py). The status shows the
prefill, then rows done and the batch's tokens/s while rows are still running, and stays at the end; stdout's
JSON lines are what they are without a terminal, never interleaved with it; without a terminal there is no
live view, only the summary line."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from tforce.cli import app
from tforce.model.defaults import demo_pair
from tforce.text.demo import demo_prompt

from live_helpers import ROOT, spawn, squash, watch

pyte = pytest.importorskip("pyte")

SIZE = (160, 120)  # wide enough for the status on one row; tall enough that the JSON lines stay on screen
BUDGETS = (20, 90, 160)  # rows finish one after another: the status counts them while others still run


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    try:
        target, draft = demo_pair()
    except Exception as e:  # the trained demo pair (models/) is part of the checkout: its absence is a failure
        pytest.fail(str(e))
    folder = tmp_path_factory.mktemp("live-batch")
    (folder / "doc.txt").write_text(demo_prompt()[:3000], encoding="utf-8")  # a prefill that takes chunks
    lines = [{"file": str(folder / "doc.txt"), "prompt": "Go on.", "id": "doc"}, {"prompt": "It was", "id": 2},
             {"prompt": "The sea", "id": "sea"}]
    path = folder / "batch.jsonl"
    path.write_text("".join(json.dumps({**line, "max_new_tokens": n}) + "\n" for line, n in zip(lines, BUDGETS)))
    return ["--batch", str(path), "-m", target, "--draft", draft, "--method", "triforce", "-t", "0",
            "--threads", "1"]


@pytest.fixture(scope="module")
def expected(batch) -> list[dict]:
    """The records of a run without a terminal (CliRunner: no live view), less their measured stats."""
    r = CliRunner().invoke(app, ["run", *batch])
    assert r.exit_code == 0, r.output
    return [_untimed(json.loads(line)) for line in r.stdout.splitlines()]


def _untimed(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "stats"}


def _rows_done(text: str) -> list[int]:
    return [int(k) for k, n in re.findall(r"rows (\d+)/(\d+) done", text) if int(n) == len(BUDGETS)]


@pytest.mark.parametrize("stdout_tty", [False, True])
def test_batch_status_shows_rows_done_and_tokens_per_s(batch, expected, stdout_tty):
    proc, master = spawn(batch, stdout_tty=stdout_tty, size=SIZE)
    screen, snapshots, out = watch(proc, master, size=SIZE)
    lines = [line.rstrip() for line in screen.display]
    final = "\n".join(lines)
    assert proc.returncode == 0, final
    texts = ["\n".join(s) for s in snapshots]
    assert any(re.search(r"prefill \d+/\d+ tokens", t) and not _rows_done(t)[0] for t in texts), final
    mid = [t for t in texts if "tokens/s" in t and 0 < _rows_done(t)[0] < len(BUDGETS)]
    assert mid, "no status with rows done while rows still ran:\n" + "\n---\n".join(texts[-3:])
    assert _rows_done(final) == [len(BUDGETS)] and re.search(r"\d/\d+ tokens · [\d.]+ tokens/s · accept", final)
    assert re.search(r"tforce: triforce: batch of 3 prompts: \d+ tokens", final)  # the summary line, as before
    if not stdout_tty:  # a file or pipe: exactly the lines, valid JSON, as without a terminal
        assert b"\x1b" not in out
        assert [_untimed(json.loads(line)) for line in out.decode().splitlines()] == expected
        return
    status = max(i for i, line in enumerate(lines) if "rows 3/3 done" in line)
    first = min(i for i, line in enumerate(lines) if line.startswith('{"id":'))
    assert status < first  # the lines come after the status has ended, none of it between them
    shown = squash("\n".join(lines[first:]))
    for record in expected:  # each line whole on screen, up to its stats (wrapped at the terminal's width)
        assert squash(json.dumps(record)[:-1]) in shown


def test_no_terminal_no_live_view(batch, expected):
    """stderr a pipe: the summary line only (no status, no escape sequences); stdout the same lines."""
    r = subprocess.run([sys.executable, "-m", "tforce", "run", *batch], cwd=ROOT, capture_output=True, text=True,
                       stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("tforce: triforce: batch of 3 prompts:")
    assert "\x1b" not in r.stderr and "rows" not in r.stderr
    assert [_untimed(json.loads(line)) for line in r.stdout.splitlines()] == expected


def test_status_counts_across_the_batches_of_a_split_file(monkeypatch):
    """A file run as consecutive batches (batch_groups.py): prefill tokens, rows done, tokens and acceptance
    count over the whole file; a batch the engine refused whole starts again as its halves, uncounted."""
    from tforce.cli import live

    clock = iter([10.0, 12.0, 20.0, 21.0])  # decoding: 10 -> 12 (batch 1), 20 -> 21 (batch 2, so far)
    monkeypatch.setattr(live.time, "perf_counter", lambda: next(clock))
    status = live.Status([11, 5, 1, 21], [10] * 4, "triforce")  # prefills the whole prompts: 38 tokens
    assert status.fields() == ["prefill 0/38 tokens", "rows 0/4 done"]
    status.start(range(0, 4))  # refused whole by the engine: runs as two batches
    status.start(range(0, 2))
    status.on_prefill(7, 14)  # half its token-layers: half its 16 tokens
    assert status.fields() == ["prefill 8/38 tokens", "rows 0/4 done"]
    status.on_prefill(14, 14)  # decoding starts (10.0)
    status.on_round({0: [1, 2], 1: [3]}, {"draft": (3, 8), "retrieval": None})
    status.on_row()
    status.on_round({0: [4]}, {"draft": (4, 12), "retrieval": None})
    status.on_row()
    status.end()  # 12.0: 2 s of decoding
    status.start(range(2, 4))
    # tokens/s counts each row's tokens after its first (the prefill's), as the final figure: 2 in 2 s
    assert status.fields() == ["prefill 16/38 tokens", "rows 2/4 done", "4/40 tokens", "1.0 tokens/s",
                               "accept draft 33.3%"]
    status.on_prefill(20, 20)  # 20.0
    status.on_round({2: [5, 6], 3: [7, 8, 9, 10]}, {"draft": (5, 8), "retrieval": None})
    # 10 tokens, 2 + 4 of them decoded in 2 + 1 s; (4 + 5) of (12 + 8) drafts accepted
    assert status.fields() == ["rows 2/4 done", "10/40 tokens", "2.0 tokens/s", "accept draft 45.0%"]
