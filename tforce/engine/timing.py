"""Seconds spent in a node's forwards, without making the device wait.

On CUDA a forward is bracketed by two timing events recorded on its device's current stream (where that
device's kernels are queued; Event.record() without a stream would take the current device's, which a
model on another device, e.g. --device cuda:1, never uses); their elapsed time
is read only when asked (after the caller has synchronised the device), and pairs that have already
completed are folded into a running total as the list grows, with Event.query(), which never blocks.
On the CPU the forward has run when the call returns: perf_counter brackets it.

The figure is the device's time from the forward's first kernel to its last, gaps included (a
launch-bound forward counts its launch gaps): what the stage costs the decode loop, not a kernel sum.
"""
from __future__ import annotations

import statistics
import time

import torch

FOLD_AT = 256  # pending event pairs before the completed ones are folded into the total


def cuda_event(device: torch.device) -> torch.cuda.Event:
    """A timing event recorded now on `device`'s current stream."""
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


def median_ms(fn, device: torch.device, repeats: int) -> float:
    """Median milliseconds of fn() on `device` over `repeats` calls after one warm-up: CUDA events on a
    CUDA device, the clock on the CPU (its work is done when the call returns)."""
    times, cuda = [], torch.device(device).type == "cuda"
    for _ in range(repeats + 1):
        if not cuda:
            t0 = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - t0))
            continue
        start = cuda_event(device)
        fn()
        end = cuda_event(device)
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[1:])


class ForwardTimer:
    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.total = 0.0  # seconds of forwards already folded in
        self.pending: list[tuple] = []  # CUDA: (start, end) events not yet read

    def start(self):
        return cuda_event(self.device) if self.cuda else time.perf_counter()

    def stop(self, start) -> None:
        if not self.cuda:
            self.total += time.perf_counter() - start
            return
        self.pending.append((start, cuda_event(self.device)))
        if len(self.pending) >= FOLD_AT:
            self._fold(wait=False)

    def _fold(self, wait: bool) -> None:
        keep = []
        for start, end in self.pending:
            if wait or end.query():
                end.synchronize()  # elapsed_time raises on an event not yet completed
                self.total += start.elapsed_time(end) / 1000  # milliseconds
            else:
                keep.append((start, end))
        self.pending = keep

    def seconds(self) -> float:
        """Total so far; on CUDA call it after the device has finished the timed work."""
        if self.pending:
            self._fold(wait=True)
        return self.total
