"""CPU threading chosen per run from the load other processes put on the machine.

Two knobs matter for small, memory-light forwards on a CPU (measured on the 2-core test machine, numbers
in BENCHMARKS.md, "CPU threading"):
- OpenMP's wait policy. Spinning workers (OpenMP's default: spin a while, then sleep) are fastest on a
  quiet machine; beside a busy process they fight it for the cores and a run collapses. Sleeping workers
  (`PASSIVE`) survive the busy machine but make every small forward on a quiet one wait for threads to
  wake (plain decoding about 2x slower). The policy is read once, when torch loads OpenMP, so it is chosen
  on import of tforce, before torch.
- torch's thread count: beside busy processes, the cores they leave free.

So a run looks at the machine for a moment (SAMPLE_S) when tforce is imported: quiet, it keeps OpenMP's
and torch's defaults; busy (others keep at least BUSY_CORES cores busy), it sets `PASSIVE` and, in the
CLI, as many threads as there are free cores. What the user set (`OMP_WAIT_POLICY`, `--threads`) is kept.
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Optional

SAMPLE_S = 0.12
BUSY_CORES = 0.5


@dataclass(frozen=True)
class Load:
    """What one look at the machine saw."""
    cores: int  # cores this process may run on
    others: Optional[float]  # cores other processes kept busy over the sample; None when not sampled

    @property
    def busy(self) -> bool:
        return self.others is not None and self.others >= BUSY_CORES

    @property
    def free_cores(self) -> int:
        """Cores left to this run: all on a quiet machine, else those the others leave (at least one)."""
        if not self.busy:
            return self.cores
        return max(1, self.cores - math.ceil(self.others - 0.25))


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _busy_seconds(t) -> float:
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def look(sample_s: float = SAMPLE_S) -> Load:
    """The cores other processes keep busy: the system's busy CPU time over a short sleep, less ours."""
    cores = usable_cores()
    try:
        import psutil
    except ImportError:
        return Load(cores, None)
    me = psutil.Process()
    s0, m0 = psutil.cpu_times(), me.cpu_times()
    time.sleep(sample_s)
    s1, m1 = psutil.cpu_times(), me.cpu_times()
    own = (m1.user + m1.system) - (m0.user + m0.system)
    others = max(0.0, _busy_seconds(s1) - _busy_seconds(s0) - own) / sample_s
    return Load(cores, min(others, float(psutil.cpu_count() or cores)))


@dataclass(frozen=True)
class WaitChoice:
    policy: Optional[str]  # the OMP_WAIT_POLICY in force; None: OpenMP's default
    why: str


_load: Optional[Load] = None
_wait: Optional[WaitChoice] = None


def choose_wait_policy() -> WaitChoice:
    """Once per process, on import of tforce: set OMP_WAIT_POLICY=PASSIVE on a busy machine."""
    global _load, _wait
    if _wait is not None:
        return _wait
    if "OMP_WAIT_POLICY" in os.environ:
        _wait = WaitChoice(os.environ["OMP_WAIT_POLICY"], "set by you")
    elif "torch" in sys.modules:
        _wait = WaitChoice(None, "torch was loaded before tforce, so its OpenMP runtime was already set up")
    elif usable_cores() < 2:
        _wait = WaitChoice(None, "one core: no worker threads to wait")
    else:
        _load = look()
        if _load.busy:
            os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
            _wait = WaitChoice("PASSIVE", "busy machine")
        else:
            _wait = WaitChoice(None, "quiet machine" if _load.others is not None else "psutil missing: not looked")
    return _wait


def load() -> Load:
    """The look taken on import (or a fresh one when none was taken)."""
    global _load
    if _load is None:
        _load = look()
    return _load


def choose_threads(requested: int) -> tuple[int, str]:
    """torch's thread count for a run: what the user asked for, else the free cores beside busy processes
    (torch's default, the usable cores, on a quiet machine)."""
    import torch

    if requested:
        torch.set_num_threads(requested)
        return requested, "set by you"
    seen = load()
    if seen.busy:
        n = seen.free_cores
        torch.set_num_threads(n)
        return n, f"the free cores: others kept {seen.others:.1f} of {seen.cores} busy"
    return torch.get_num_threads(), "torch's default"


def describe() -> dict:
    """For `tforce info`: what a run started now would use."""
    import torch

    wait = choose_wait_policy()
    seen = load()
    return {"cores": seen.cores, "others_busy_cores": seen.others,
            "omp_wait_policy": wait.policy or "OpenMP's default (spin, then sleep)", "omp_wait_why": wait.why,
            "threads": seen.free_cores if seen.busy else torch.get_num_threads()}
