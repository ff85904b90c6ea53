"""CPU threads for a command-line run, chosen from the load other processes put on the machine, and
re-chosen while it decodes.

A decode step on a CPU is many small forwards, each a handful of multi-threaded matrix products that end
in a barrier. On a quiet machine torch's default (one thread per core, OpenMP's spin-then-sleep wait)
is the fastest setting; beside a busy process one of those threads shares a core with it and every
barrier waits for the thread that lost its core, so a 2-thread run beside one busy process is slower
than a 1-thread run (BENCHMARKS.md, "CPU threading", has the table). With one thread there is no barrier
and no worker to spin, whatever the wait policy, so tforce leaves the wait policy alone and changes only
the thread count: all usable cores while others keep fewer than BUSY_CORES cores busy, else the cores
they leave free (at least one).

The load is the system's busy CPU time less this process's own, over SAMPLE_S when a run starts and then
over each INTERVAL_S of decoding (`tick`, once per round: a clock read, and two /proc reads when due),
so a neighbour that starts or stops mid-run is followed within about INTERVAL_S. What the user set
(`--threads N`, or TFORCE_THREADS=N) is kept and never re-chosen. Library calls (`tforce.generate`) are not governed: the
thread count is then the caller's, as torch's is.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Optional

SAMPLE_S = 0.1
INTERVAL_S = 0.5
BUSY_CORES = 0.5


@dataclass(frozen=True)
class Load:
    """What one look at the machine saw."""
    cores: int  # cores this process may run on
    others: Optional[float]  # cores other processes kept busy; None where psutil is missing

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


class Meter:
    """Busy CPU seconds of the whole system and of this process, read from the kernel's counters."""

    def __init__(self):
        import psutil

        self._psutil, self._me = psutil, psutil.Process()
        self._last = self._read()

    def _read(self) -> tuple[float, float, float]:
        s, m = self._psutil.cpu_times(), self._me.cpu_times()
        busy = sum(s) - s.idle - getattr(s, "iowait", 0.0)
        return time.monotonic(), busy, m.user + m.system

    def others(self) -> float:
        """Cores other processes kept busy since the previous call (or since the meter was made)."""
        now = self._read()
        (t0, busy0, own0), (t1, busy1, own1) = self._last, now
        self._last = now
        if t1 <= t0:
            return 0.0
        return max(0.0, (busy1 - busy0) - (own1 - own0)) / (t1 - t0)


def _sample(sample_s: float) -> tuple[Optional[Meter], Load]:
    """The meter (None without psutil) and the cores other processes kept busy over a short sleep."""
    cores = usable_cores()
    try:
        meter = Meter()
    except ImportError:
        return None, Load(cores, None)
    time.sleep(sample_s)
    return meter, Load(cores, meter.others())


def look(sample_s: float = SAMPLE_S) -> Load:
    """The cores other processes keep busy over a short sleep."""
    return _sample(sample_s)[1]


class Governor:
    """Sets torch's thread count to the free cores when a run starts and again every INTERVAL_S."""

    def __init__(self, meter: Meter, cores: int, first: Load):
        self.meter, self.cores, self.seen, self.changes = meter, cores, first, 0
        self.due = time.monotonic() + INTERVAL_S
        self.threads = self._set(first.free_cores)

    def _set(self, n: int) -> int:
        import torch

        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        return n

    def tick(self) -> None:
        now = time.monotonic()
        if now < self.due:
            return
        self.due = now + INTERVAL_S
        self.seen = Load(self.cores, self.meter.others())
        n = self.seen.free_cores
        if n != self.threads:
            self.threads, self.changes = self._set(n), self.changes + 1


_governor: Optional[Governor] = None
_choice = {"threads": None, "why": "not chosen: a library call keeps torch's setting"}


def choose(requested: int) -> dict:
    """The CLI's choice for this run: `requested` threads when given (kept), else the free cores, followed
    while decoding (tick). Returns what `choice()` reports."""
    import torch

    global _governor
    _governor = None
    requested = requested or _from_env()
    if requested:
        torch.set_num_threads(requested)
        _choice.update(threads=requested, why="set by you (--threads or TFORCE_THREADS)")
        return choice()
    meter, first = _sample(SAMPLE_S)
    if meter is None:
        _choice.update(threads=torch.get_num_threads(), why="torch's default (psutil missing: load not seen)")
        return choice()
    _governor = Governor(meter, first.cores, first)
    _choice.update(threads=None, why="followed while decoding: all cores on a quiet machine, the free ones "
                                     "beside busy processes")
    return choice()


def _from_env() -> int:
    """TFORCE_THREADS: a fixed thread count for every run (as --threads N), e.g. for reproducible timings."""
    value = os.environ.get("TFORCE_THREADS", "").strip()
    if not value:
        return 0
    if not value.isdigit():
        from .errors import UsageError

        raise UsageError(f"TFORCE_THREADS must be a whole number of threads, got {value!r}")
    return int(value)


def tick() -> None:
    """Once per decode round (the command line installs it as events.Events.on_step): re-choose the thread
    count when INTERVAL_S has passed (a no-op unless the CLI chose threads for this run)."""
    if _governor is not None:
        _governor.tick()


def choice() -> dict:
    """What this run uses: threads now, why, and the load last seen (for --json and tforce info)."""
    import torch

    g = _governor
    return {"threads": torch.get_num_threads(), "why": _choice["why"],
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "cores": g.cores if g else usable_cores(),
            "others_busy_cores": None if g is None or g.seen.others is None else round(g.seen.others, 2),
            "changes": g.changes if g else 0}
