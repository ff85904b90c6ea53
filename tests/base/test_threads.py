"""CPU threads for a command-line run (tforce/threads.py): all cores on a quiet machine, the cores busy
processes leave free beside them, followed while decoding; what the user set is kept."""
import json
import os
import subprocess
import sys
import time
from collections import namedtuple
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from tforce import threads
from tforce.cli import app
from tforce.errors import UsageError
from tforce.threads import Load

BUSY_LOOP = "import time\nend = time.time() + {s}\nwhile time.time() < end: pass"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = [os.path.join(ROOT, "models", "demo-target"), os.path.join(ROOT, "models", "demo-draft")]


@pytest.mark.parametrize("load, busy, free", [
    (Load(2, 0.0), False, 2), (Load(2, 0.3), False, 2), (Load(2, 1.0), True, 1), (Load(2, 2.0), True, 1),
    (Load(16, 1.0), True, 15), (Load(16, 2.6), True, 13), (Load(16, 0.4), False, 16), (Load(8, None), False, 8),
])
def test_free_cores(load, busy, free):
    assert load.busy is busy and load.free_cores == free


@pytest.fixture
def neighbour():
    """Another process keeping one core busy for the test's length."""
    proc = subprocess.Popen([sys.executable, "-c", BUSY_LOOP.format(s=60)])
    time.sleep(0.5)  # past its start-up
    yield proc
    proc.kill()
    proc.wait()


def test_a_busy_neighbour_is_seen(neighbour):
    seen = threads.look(0.5)
    assert seen.others is not None and seen.others >= 0.7, seen


def test_our_own_cpu_time_is_not_counted_as_another_process(monkeypatch):
    """System: 0.30 s busy over 0.2 s (1.5 cores), of which 0.18 s ours: others kept 0.6 cores busy."""
    System = namedtuple("System", "user system idle iowait")
    Own = namedtuple("Own", "user system")
    system = iter([System(10.0, 1.0, 50.0, 0.5), System(10.25, 1.05, 50.1, 0.6)])
    own = iter([Own(2.0, 0.1), Own(2.17, 0.11)])
    clock = iter([100.0, 100.2])
    fake = SimpleNamespace(cpu_times=lambda: next(system),
                           Process=lambda: SimpleNamespace(cpu_times=lambda: next(own)))
    monkeypatch.setitem(sys.modules, "psutil", fake)
    monkeypatch.setattr(threads.time, "monotonic", lambda: next(clock))
    assert threads.Meter().others() == pytest.approx(0.6)


class FakeMeter:
    def __init__(self, loads):
        self.loads = iter(loads)

    def others(self):
        return next(self.loads)


def test_the_governor_follows_a_neighbour_that_comes_and_goes(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "INTERVAL_S", 0.0)
    try:
        g = threads.Governor(FakeMeter([1.0, 1.1, 0.1, 2.0]), 4, Load(4, 0.0))
        assert g.threads == 4 == torch.get_num_threads()
        seen = []
        for _ in range(4):
            g.tick()
            seen.append(torch.get_num_threads())
        assert seen == [3, 3, 4, 2] and g.changes == 3
    finally:
        torch.set_num_threads(before)


def test_ticks_wait_for_the_interval(monkeypatch):
    before = torch.get_num_threads()
    try:
        g = threads.Governor(FakeMeter([1.0]), 2, Load(2, 0.0))
        g.tick()  # not yet due: the meter is not read
        assert g.threads == 2 and g.changes == 0
    finally:
        torch.set_num_threads(before)


def test_threads_from_the_environment(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("TFORCE_THREADS", "2")
        assert threads.choose(0)["threads"] == 2 and threads._governor is None
        assert threads.choose(1)["threads"] == 1  # --threads wins
        monkeypatch.setenv("TFORCE_THREADS", "two")
        with pytest.raises(UsageError):
            threads.choose(0)
    finally:
        torch.set_num_threads(before)


def test_requested_threads_are_kept_and_not_governed():
    before = torch.get_num_threads()
    try:
        c = threads.choose(2)
        assert c["threads"] == 2 and "set by you" in c["why"] and threads._governor is None
        threads.tick()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_importing_tforce_leaves_openmp_as_configured():
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    code = "import tforce, os; print(os.environ.get('OMP_WAIT_POLICY', 'unset'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "unset"


def _run_json(*extra):
    r = CliRunner().invoke(app, ["run", "-m", DEMO[0], "--draft", DEMO[1], "-p", "Once upon a time", "-n", "8",
                                 "--temperature", "0", "--method", "ar", "--json", *extra])
    assert r.exit_code == 0, (r.output, r.exception)
    return json.loads(r.stdout)["cpu_threads"]


@pytest.mark.skipif(threads.usable_cores() < 2, reason="one usable core: nothing to share")
def test_a_run_beside_a_busy_process_leaves_it_a_core(neighbour, monkeypatch):
    monkeypatch.delenv("TFORCE_THREADS")
    before = torch.get_num_threads()
    try:
        c = _run_json()
        assert c["threads"] <= c["cores"] - 1 and c["others_busy_cores"] >= threads.BUSY_CORES, c
        assert _run_json("--threads", "2")["threads"] == 2
    finally:
        torch.set_num_threads(before)


def test_info_says_what_a_run_would_start_with():
    out = subprocess.run([sys.executable, "-m", "tforce", "info"], env={**os.environ, "COLUMNS": "200"},
                         capture_output=True, text=True, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("cpu threads"))
    assert f"of {threads.usable_cores()} cores" in line and "followed while decoding" in line, line
