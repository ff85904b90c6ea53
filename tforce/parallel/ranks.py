"""The processes of tensor parallelism: `world` spawned workers joined by a process group (gloo on CPU,
NCCL on CUDA with rank r on cuda:r), seen from the parent; what runs inside a worker is rank_worker.py.

A worker runs one function and sends back its result (launch), or serves: a generator that answers the
parent's commands, each from the worker's own queue, until told to stop (Ranks(serve=True); a tforce chat
over ranks). Events a worker emits reach the parent as they happen. Start-up has a limit (spawn, imports,
the process group and one checked all_reduce). A worker's failure, a death or a start-up past its limit
ends every worker at once and is raised as one TforceError (the worker's traceback chained), and so does
an exception in the parent while it waits (Ctrl-C included, unless the caller handles a first one:
Ranks.collect's on_interrupt); a serving worker whose parent has gone exits by itself. Workers ignore
SIGINT (a terminal's Ctrl-C reaches every process of its group): the parent alone decides what it does.
"""
from __future__ import annotations

import pickle
import queue as queue_mod
import signal
import socket
import threading
import time
from contextlib import contextmanager

import torch
import torch.multiprocessing as mp

from ..errors import TforceError, UsageError
from .rank_worker import P2P_HINT, worker_main

START_TIMEOUT_S = 120.0  # spawn, imports, process group and a test all_reduce (launch's start_timeout_s)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerTraceback(Exception):
    """A worker's traceback as text, chained under the parent's one-line error (seen with TFORCE_DEBUG=1)."""


def launch(fn, world: int, backend: str, *args, on_event=None, all_ranks: bool = False, grace_s: float = 2.0,
           start_timeout_s: float = START_TIMEOUT_S, _on_spawn=None):
    """Run fn(rank, world, *args) in `world` spawned processes joined by a process group (gloo on CPU,
    nccl on CUDA with rank r on cuda:r); return rank 0's return value (every rank's, in order, with
    all_ranks). fn must be importable (module level). With on_event, fn also gets emit=callable, and
    every emit(event) in a worker calls on_event(event) here, in order. A worker's failure is raised
    here as one TforceError (its message; the worker's traceback chained), and the other workers are
    ended rather than left waiting. So is a start-up that takes over start_timeout_s (spawn, imports,
    the process group and one test all_reduce), naming the ranks that did not start. _on_spawn: a test
    hook, an importable callable run first in each worker with its rank."""
    ranks = Ranks(fn, world, backend, *args, on_event=on_event, grace_s=grace_s, start_timeout_s=start_timeout_s,
                  _on_spawn=_on_spawn)
    try:
        results = ranks.collect()
    finally:
        ranks.close()
    return results if all_ranks else results[0]


class Ranks:
    """`world` spawned workers joined by a process group, from the parent's side (launch's machinery).

    collect() waits for every rank's next result. Without serve, that is fn's return value (launch).
    With serve, fn is a generator function and the workers persist: each rank sends what its generator
    yields, and send(command) hands every rank's generator the next command (the value of its yield)
    until close() sends None. Events (emit) reach on_event while collect() waits. Any failure (a
    worker's error, a death, a start-up past its limit, an interrupt here) ends every worker at once
    and is raised as one TforceError; close() (or leaving a `with` block) ends them too, waiting for
    them to exit after a normal end."""

    def __init__(self, fn, world: int, backend: str, *args, on_event=None, serve: bool = False,
                 grace_s: float = 2.0, start_timeout_s: float = START_TIMEOUT_S, _on_spawn=None):
        if backend not in ("gloo", "nccl"):
            raise UsageError(f"backend must be gloo or nccl, got {backend!r}")
        ctx = mp.get_context("spawn")
        self.q = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(world)] if serve else []
        port, threads = _free_port(), max(1, torch.get_num_threads() // world)
        self.procs = [ctx.Process(target=worker_main, args=(r, world, backend, port, threads, self.q, fn, args,
                                                        on_event is not None, _on_spawn,
                                                        self.inboxes[r] if serve else None), daemon=True)
                      for r in range(world)]
        with _sigint_ignored():  # inherited by the workers (SIG_IGN survives exec; Python then keeps it)
            for p in self.procs:
                p.start()
        self.world, self.backend, self.on_event, self.grace_s = world, backend, on_event, grace_s
        self.start_timeout_s, self.start_by = start_timeout_s, time.monotonic() + start_timeout_s
        self.up, self.joined, self.closed = set(), set(), False

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        self.close(wait_s=10.0 if kind is None else 2.0)  # after a failure here: a short wait, then kill

    def send(self, command) -> None:
        self._check_open()
        for inbox in self.inboxes:
            inbox.put(command)

    def collect(self, on_interrupt=None) -> list:
        """Every rank's next result, in rank order. on_interrupt: called at a first Ctrl-C (SIGINT, in the
        main thread) while waiting, instead of the KeyboardInterrupt that ends the ranks; the results are
        still collected and returned (on_interrupt is to make the ranks cut their work short, and its
        caller to tell from the results what came of it); a second Ctrl-C ends the ranks."""
        self._check_open()
        world, procs = self.world, self.procs
        results, errors, died, stop_at, late = {}, [], None, None, None
        ok = told = False
        with _sigint_counted(on_interrupt is not None) as pressed:
            try:
                while len(results) < world and (stop_at is None or time.monotonic() < stop_at):
                    if pressed and not told:
                        told = True
                        on_interrupt()
                    if stop_at is None and len(self.joined) < world and time.monotonic() > self.start_by:
                        late = TforceError(_late_start(world, self.up, self.start_timeout_s, self.backend))
                        break
                    try:
                        kind, rank, payload = self.q.get(timeout=0.05)
                    except queue_mod.Empty:
                        dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                        if dead and died is None:  # its error message, if any, may still be in the pipe
                            died = TforceError(f"rank {dead[0][0]} died (exit code {dead[0][1]})")
                            stop_at = min(stop_at or float("inf"), time.monotonic() + self.grace_s)
                        continue
                    if kind == "up":
                        self.up.add(rank)
                    elif kind == "joined":
                        self.joined.add(rank)
                    elif kind == "event":
                        self.on_event(pickle.loads(payload))
                    elif kind == "result":
                        results[rank] = pickle.loads(payload)
                    else:  # wait a moment for the other ranks' errors: the root cause may come second
                        errors.append(payload)
                        stop_at = min(stop_at or float("inf"), time.monotonic() + 0.25)
                ok = len(results) == world and not errors
            finally:
                if not ok:
                    self.close(wait_s=0.0)
        if errors:  # a message meant for the user (a TforceError) beats fallout on the other ranks
            err, text, _ = next((e for e in errors if e[2]), errors[0])
            raise err from WorkerTraceback(text)
        if not ok:
            raise late or died or TforceError("the workers stopped without a result")
        return [results[r] for r in range(world)]

    def _check_open(self) -> None:
        if self.closed:
            raise TforceError("the tensor-parallel ranks have ended (after an error or Ctrl-C): start again")

    def close(self, wait_s: float = 10.0) -> None:
        """Tell serving workers to stop, join every worker (up to wait_s in all), then end what still runs."""
        if self.closed:
            return
        self.closed = True
        for inbox in self.inboxes:
            inbox.put(None)
        _end(self.procs, self.q, wait_s)
        for inbox in self.inboxes:
            inbox.close()
            inbox.cancel_join_thread()


@contextmanager
def _sigint_ignored():
    """SIGINT ignored within (in the main thread; elsewhere signals cannot be set, nor arrive)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


@contextmanager
def _sigint_counted(enabled: bool):
    """Within, with enabled (in the main thread), a first SIGINT appends to the list yielded instead of
    raising KeyboardInterrupt (which could land between taking a message off the queue and keeping it); a
    second one raises it."""
    pressed: list = []
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield pressed
        return

    def handler(signum, frame):
        if pressed:
            raise KeyboardInterrupt
        pressed.append(1)

    old = signal.signal(signal.SIGINT, handler)
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, old)


def _late_start(world: int, up: set, limit_s: float, backend: str) -> str:
    """The one-line message for a start-up past its limit: the ranks that never ran, else the group."""
    missing = [str(r) for r in range(world) if r not in up]
    if missing:
        return f"rank{'s' if len(missing) > 1 else ''} {', '.join(missing)} did not start within {limit_s:g} s"
    hint = f"; {P2P_HINT}" if backend == "nccl" else ""
    return f"the {world} ranks did not join their process group within {limit_s:g} s{hint}"


def _end(procs, q, wait_s: float) -> None:
    """Join the workers (up to wait_s in all), then end whatever still runs."""
    deadline = time.monotonic() + wait_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    q.close()
    q.cancel_join_thread()
