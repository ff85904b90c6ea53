"""What runs inside each worker process of ranks.py: set the device, join the process group, check the
link with one all_reduce, then run fn once or serve its generator, sending everything to the parent's
queue (start-up steps, events, results, a failure as one line and its traceback) and leaving with
os._exit. Kept apart from ranks.py (the parent's side): none of this runs in the parent. With
parallel/tp.py and sharding.py, the only files that touch torch.distributed.
"""
from __future__ import annotations

import os
import pickle
import queue as queue_mod
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import DoesNotFit, TforceError, UsageError

COLLECTIVE_TIMEOUT_S = 600  # a worker waiting this long in one collective (or the rendezvous) fails itself
P2P_HINT = "GPUs without working peer-to-peer access (e.g. RTX 4090 pairs) need NCCL_P2P_DISABLE=1"


def _portable(rank: int, e: BaseException) -> tuple[TforceError, str]:
    """A worker's exception -> (a picklable one-line TforceError, the traceback text)."""
    text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    if isinstance(e, TforceError):  # its class kept: a DoesNotFit lets `run --batch` retry smaller batches
        err = next(c for c in (UsageError, DoesNotFit, TforceError) if isinstance(e, c))(str(e))
    elif isinstance(e, KeyboardInterrupt):
        err = TforceError(f"rank {rank}: interrupted")
    else:
        msg = (str(e).strip().splitlines() or [""])[0]
        err = TforceError(f"rank {rank}: {type(e).__name__}: {msg}")
    return err, text


def worker_main(rank, world, backend, port, threads, q, fn, args, emit_events, on_spawn, inbox=None):
    try:
        if on_spawn is not None:
            on_spawn(rank)
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
            extra = {"device_id": device}
        else:
            torch.set_num_threads(threads)
            device, extra = torch.device("cpu"), {}
        q.put(("up", rank, None))
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S), **extra)
        _check_link(rank, world, device)
        q.put(("joined", rank, None))
        kwargs = {"emit": lambda event: q.put(("event", rank, pickle.dumps(event)))} if emit_events else {}
        if inbox is None:
            # Plain pickle: tensors travel by value (a queue would share them through this process, which
            # is about to exit).
            q.put(("result", rank, pickle.dumps(fn(rank, world, *args, **kwargs))))
        else:
            _serve(rank, q, inbox, fn(rank, world, *args, **kwargs))
    except BaseException as e:
        q.put(("error", rank, (*_portable(rank, e), isinstance(e, TforceError))))
        _leave(q, 1)  # the parent ends the other ranks
    dist.destroy_process_group()
    _leave(q, 0)


def _serve(rank: int, q, inbox, server) -> None:
    """Send the parent what the generator `server` yields, sending the generator the parent's next command
    each time, until that command is None or the parent is gone (an orphan would hold its memory for ever)."""
    value = next(server)
    while True:
        q.put(("result", rank, pickle.dumps(value)))
        command = _next_command(inbox)
        if command is None:
            server.close()
            return
        value = server.send(command)


def _next_command(inbox):
    """The parent's next command, or None once the parent has exited."""
    while True:
        try:
            return inbox.get(timeout=1.0)
        except queue_mod.Empty:
            if not mp.parent_process().is_alive():
                return None


def _check_link(rank: int, world: int, device: torch.device) -> None:
    """One 1 MiB all_reduce before any work, checked: a link that hangs does so inside the start-up
    limit, and one that corrupts data fails here instead of in the model's sums."""
    x = torch.arange(1 << 18, dtype=torch.float32, device=device)
    expected = world * x + world * (world - 1) // 2  # exact in float32: every value stays below 2 ** 24
    x += rank
    dist.all_reduce(x)
    if not torch.equal(x, expected):
        raise TforceError(f"rank {rank}: a test all_reduce returned wrong sums: {P2P_HINT}")


def _leave(q, code: int) -> None:
    """Flush what this worker sent, then exit at once (skipping a slow interpreter teardown; after an
    error, also any teardown that would wait on ranks stuck in a collective)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    q.close()
    q.join_thread()
    os._exit(code)
