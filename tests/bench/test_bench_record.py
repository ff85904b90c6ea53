"""`tforce bench --record FILE`: the report written after every method, so a bench cut short keeps the
methods that finished; whole JSON objects only; bad paths refused before anything runs."""
from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import tforce.bench.suite
import tforce.bench.run
from tforce.cli import app

from cli_helpers import BENCH

SUMMARY = Path(__file__).resolve().parents[2] / "scripts" / "bench_summary.py"


@pytest.fixture(scope="module")
def runner():
    return CliRunner()


def test_the_record_is_what_json_prints(runner, tmp_path):
    path = tmp_path / "r.json"
    result = runner.invoke(app, BENCH + ["--methods", "ar,retrieval", "--gen-len", "4", "--json", "--record",
                                         str(path)])
    assert result.exit_code == 0, (result.output, result.exception)
    printed, recorded = json.loads(result.stdout), json.loads(path.read_text())
    assert recorded == printed and recorded["complete"] is True
    assert [r["method"] for r in recorded["runs"]] == recorded["methods"] == ["ar", "retrieval"]
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temporary file left beside it


def test_a_bench_cut_short_keeps_the_methods_that_finished(runner, tmp_path, monkeypatch):
    """The third method dies (as a time limit or an out-of-memory error would end it): FILE holds the
    first two, marked incomplete, with ar's speed-up over itself; bench_summary says it was cut short."""
    run_one = tforce.bench.run.run_one

    def dies_third(models, ids, method, *a, **k):
        if method == "streaming":
            raise KeyboardInterrupt
        return run_one(models, ids, method, *a, **k)

    monkeypatch.setattr(tforce.bench.suite, "run_one", dies_third)  # where bench() looks it up
    path = tmp_path / "r.json"
    path.write_text("an older record, replaced by the first whole one\n")
    result = runner.invoke(app, BENCH + ["--methods", "ar,naive,streaming", "--gen-len", "4", "--record",
                                         str(path)])
    assert result.exit_code == 130, (result.output, result.exception)
    rec = json.loads(path.read_text())
    assert rec["complete"] is False and [r["method"] for r in rec["runs"]] == ["ar", "naive"]
    assert rec["runs"][0]["speedup_vs_ar"] == 1.0 and rec["runs"][1]["speedup_vs_ar"] > 0
    done = subprocess.run([sys.executable, str(SUMMARY), str(path)], capture_output=True, text=True)
    assert done.returncode == 0 and "CUT SHORT: 2 of 3 methods finished" in done.stdout
    assert "| naive |" in done.stdout


@pytest.mark.parametrize("where,needle", [("dir", "is a directory"), ("missing/r.json", "no such directory")])
def test_an_unwritable_record_is_refused_before_the_bench(runner, tmp_path, monkeypatch, where, needle):
    (tmp_path / "dir").mkdir()
    monkeypatch.setattr(tforce.bench.suite, "bench", lambda *a, **k: pytest.fail("the bench ran"))
    result = runner.invoke(app, BENCH + ["--record", str(tmp_path / where)])
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tforce: error: --record") and needle in lines[0]


def test_a_batch_bench_cut_short_keeps_its_finished_methods(runner, tmp_path, monkeypatch):
    import tforce.bench.batch

    run_batch = tforce.bench.batch.run_batch

    def dies_second(models, prompts, method, cfg, ceil):
        if method == "naive":
            raise KeyboardInterrupt
        return run_batch(models, prompts, method, cfg, ceil)

    monkeypatch.setattr(tforce.bench.batch, "run_batch", dies_second)
    path = tmp_path / "b.json"
    result = runner.invoke(app, BENCH + ["--batch", "2", "--methods", "ar,naive", "--gen-len", "4", "--record",
                                         str(path)])
    assert result.exit_code == 130, (result.output, result.exception)
    rec = json.loads(path.read_text())
    assert rec["complete"] is False and rec["batch"] == 2 and [r["method"] for r in rec["runs"]] == ["ar"]


def test_a_record_through_a_symlink_writes_its_target_with_ordinary_permissions(tmp_path):
    """The rename lands on the link's target (the link stays a link), and FILE gets the umask's mode, not
    mkstemp's 0600."""
    from tforce.bench import record as bench_record

    (tmp_path / "runs").mkdir()
    target, link = tmp_path / "runs" / "r.json", tmp_path / "latest.json"
    target.write_text("{}\n")
    link.symlink_to(target)
    old = os.umask(0o022)
    try:
        bench_record.write(bench_record.check(str(link)), {"complete": True})
    finally:
        os.umask(old)
    assert link.is_symlink() and json.loads(target.read_text()) == {"complete": True}
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.json", "runs"]


def test_a_record_that_cannot_be_written_loses_neither_the_bench_nor_its_output(runner, tmp_path, monkeypatch):
    """Disk full at every write: every method still runs, --json still prints the whole report, and the
    failure is one line with exit 1 (the record was asked for and is not there)."""
    from tforce.bench import record as bench_record

    def full(path, report):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(bench_record, "write", full)
    path = tmp_path / "r.json"
    result = runner.invoke(app, BENCH + ["--methods", "ar,naive", "--gen-len", "4", "--json", "--record",
                                         str(path)])
    assert result.exit_code == 1, (result.output, result.exception)
    printed = json.loads(result.stdout)
    assert printed["complete"] is True and [r["method"] for r in printed["runs"]] == ["ar", "naive"]
    errors = [line for line in result.stderr.splitlines() if "--record" in line]
    assert errors and all("No space left" in line for line in errors)
    assert errors[-1].startswith("tforce: error: --record")
