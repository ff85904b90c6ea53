"""CPU threading chosen per run (tforce/threads.py): sleeping OpenMP workers and the free cores on a busy
machine, OpenMP's and torch's defaults on a quiet one, and what the user set always kept."""
import os
import subprocess
import sys
import time

import pytest
import torch

from tforce import threads
from tforce.threads import Load

BUSY_LOOP = "import time\nend = time.time() + {s}\nwhile time.time() < end: pass"


@pytest.mark.parametrize("load, busy, free", [
    (Load(2, 0.0), False, 2), (Load(2, 0.3), False, 2), (Load(2, 1.0), True, 1), (Load(2, 2.0), True, 1),
    (Load(16, 1.0), True, 15), (Load(16, 2.6), True, 13), (Load(16, 0.4), False, 16), (Load(8, None), False, 8),
])
def test_free_cores(load, busy, free):
    assert load.busy is busy and load.free_cores == free


def busy_neighbour(seconds: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", BUSY_LOOP.format(s=seconds)])
    time.sleep(0.5)  # past its start-up
    return proc


def test_a_busy_neighbour_is_seen_and_our_own_work_is_not():
    proc = busy_neighbour(3)
    try:
        seen = threads.look(0.5)
    finally:
        proc.kill()
        proc.wait()
    assert seen.others is not None and seen.others >= 0.7, seen


def test_our_own_cpu_time_is_not_counted_as_another_process(monkeypatch):
    """System: 0.30 s busy over the 0.2 s sample (1.5 cores), of which 0.18 s ours: others kept 0.6 busy."""
    from collections import namedtuple
    from types import SimpleNamespace

    System = namedtuple("System", "user system idle iowait")
    Own = namedtuple("Own", "user system")
    system = iter([System(10.0, 1.0, 50.0, 0.5), System(10.25, 1.05, 50.1, 0.6)])
    own = iter([Own(2.0, 0.1), Own(2.17, 0.11)])
    fake = SimpleNamespace(cpu_times=lambda: next(system), Process=lambda: SimpleNamespace(cpu_times=lambda: next(own)),
                           cpu_count=lambda: 2)
    monkeypatch.setitem(sys.modules, "psutil", fake)
    monkeypatch.setattr(threads.time, "sleep", lambda s: None)
    seen = threads.look(0.2)
    assert seen.others == pytest.approx(0.6) and seen.busy


def _import_policy(env: dict) -> str:
    code = "import tforce, os; print(os.environ.get('OMP_WAIT_POLICY', 'unset'))"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_a_busy_machine_gets_sleeping_openmp_workers_and_a_set_policy_is_kept():
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    proc = busy_neighbour(15)
    try:
        assert _import_policy(env) == "PASSIVE"
        assert _import_policy({**env, "OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE"
    finally:
        proc.kill()
        proc.wait()


def test_a_quiet_machine_keeps_openmp_default(monkeypatch):
    """The decision itself, with the look stubbed (a test machine running other tests is never quiet)."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(threads, "_wait", None)
    monkeypatch.setattr(threads.sys, "modules", {k: v for k, v in sys.modules.items() if k != "torch"})
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    monkeypatch.setattr(threads, "look", lambda sample_s=0: Load(2, 0.1))
    assert threads.choose_wait_policy() == threads.WaitChoice(None, "quiet machine")
    assert "OMP_WAIT_POLICY" not in os.environ
    monkeypatch.setattr(threads, "_wait", None)
    monkeypatch.setattr(threads, "look", lambda sample_s=0: Load(2, 1.2))
    assert threads.choose_wait_policy().policy == "PASSIVE" == os.environ["OMP_WAIT_POLICY"]


def test_thread_count(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(threads, "_load", Load(4, 1.0))
        assert threads.choose_threads(0)[0] == 3 == torch.get_num_threads()
        assert threads.choose_threads(2) == (2, "set by you") and torch.get_num_threads() == 2
        torch.set_num_threads(before)
        monkeypatch.setattr(threads, "_load", Load(4, 0.0))
        assert threads.choose_threads(0) == (before, "torch's default")
    finally:
        torch.set_num_threads(before)


def test_info_says_what_a_run_will_use():
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-m", "tforce", "info"], env={**env, "OMP_WAIT_POLICY": "PASSIVE",
                                                                       "COLUMNS": "200"},
                         capture_output=True, text=True, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("cpu threads"))
    assert "OpenMP wait: PASSIVE (set by you)" in line, line
