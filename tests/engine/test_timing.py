"""timing.py without a GPU: which stream its CUDA events are recorded on, and how their times are summed,
with torch.cuda's Event and current_stream replaced by fakes (the real ones: tests/auto/test_projection.py's
CUDA test)."""
from __future__ import annotations

import pytest
import torch

from tforce.engine import timing


class _Event:
    """A CUDA event whose elapsed time is the difference of the fake clock at its record()."""
    clock = [0.0]

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.stream = self.at = None

    def record(self, stream=None):
        self.stream, self.at = stream, _Event.clock[0]

    def query(self):
        return True

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return end.at - self.at


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("stream of", device))


def test_events_go_on_the_timed_devices_stream(fake_cuda):
    # A model on cuda:1 queues its kernels on cuda:1's current stream: the events must be recorded there,
    # not on the current device's (cuda:0 unless set), which Event.record() alone would take.
    device = torch.device("cuda:1")
    timer = timing.ForwardTimer(device)
    start = timer.start()
    _Event.clock[0] += 2.5  # ms
    timer.stop(start)
    assert [e.stream for e in timer.pending[0]] == [("stream of", device)] * 2
    assert timer.seconds() == pytest.approx(0.0025) and timer.pending == []


def test_median_ms_times_on_the_devices_stream(fake_cuda, monkeypatch):
    device, events, durations = torch.device("cuda:1"), [], iter([9.0, 1.0, 3.0, 2.0])
    real = timing.cuda_event
    monkeypatch.setattr(timing, "cuda_event", lambda d: events.append(real(d)) or events[-1])

    def fn():  # the first call is the warm-up: left out of the median
        _Event.clock[0] += next(durations)

    assert timing.median_ms(fn, device, repeats=3) == 2.0
    assert len(events) == 8 and {e.stream for e in events} == {("stream of", device)}
