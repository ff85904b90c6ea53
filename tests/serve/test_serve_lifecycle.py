"""`tforce serve` under disconnects and signals: a dropped stream cancels its generation and the server
answers the next request as it would have; a request whose client leaves while it waits in the queue is
never run; SIGTERM ends the in-flight stream cleanly ([DONE]) and the process exits 0 within 15 s, also
every row of a running batch (--max-batch)."""
from __future__ import annotations

import signal
import subprocess
import threading
import time

import httpx
import pytest

from serve_helpers import FAST, Server, tiny_pair
from tforce.model.synthetic import byte_tokenizer

DOC = "It was the best of times, it was the worst of times."
LONG = {"prompt": DOC, "max_tokens": 4000, "temperature": 0}  # with --ignore-eos: seconds of work


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("serve-life"), context=4096)


def _server(pair, *more: str) -> Server:
    target, draft = pair
    return Server("-m", str(target), "--draft", str(draft), *FAST, "--ignore-eos", "--method", "ar", *more)


@pytest.fixture(scope="module")
def server(pair):
    s = _server(pair)
    yield s
    assert s.stop() == 0


def _answer(server, prompt: str, n: int = 8) -> str:
    r = server.post("/completions", {"prompt": prompt, "max_tokens": n, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_dropped_stream_cancels_its_generation(server):
    want = _answer(server, DOC)
    with server.http.stream("POST", "/completions", json=dict(LONG, stream=True)) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        next(lines)  # the first event: generating
        lines.close()  # closes the response: the client goes away
    line = server.wait_line("the client went away; cancelled")
    assert "POST /v1/completions" in line
    assert not any(" 4000 tokens after" in l for l in server.lines)  # it did not run to the end
    assert _answer(server, DOC) == want  # the caches it left change nothing


def test_request_left_in_the_queue_never_runs(server):
    """A request waits behind a long stream; its client gives up (a timeout) before its turn."""
    prompt = "Q" * 76
    n = len(byte_tokenizer().encode(prompt))  # its prompt tokens: its stderr lines say so
    with server.http.stream("POST", "/completions", json=dict(LONG, stream=True)) as r:
        lines = r.iter_lines()  # kept: a line iterator that is dropped closes the response
        next(lines)
        with pytest.raises(httpx.ReadTimeout):
            server.http.post("/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=0.5)
        assert "the client went away; cancelled" in server.wait_line(f"({n} prompt tokens")  # while it waited
    _answer(server, DOC)  # the long stream dropped too: the queue's next turn is this one
    assert not any(f"after {n} prompt tokens" in l for l in server.lines)


@pytest.mark.parametrize("batch", [1, 3])
def test_sigterm_ends_streams_cleanly_and_exits_0(pair, batch):
    """With --max-batch 3, two streams run as rows of one batch: both end, each with its last chunk."""
    server = _server(pair, "--max-batch", str(batch))
    streams = [[] for _ in range(1 if batch == 1 else 2)]

    def stream(events):
        with server.http.stream("POST", "/completions", json=dict(LONG, stream=True)) as r:
            events.extend(line for line in r.iter_lines() if line.startswith("data: "))

    readers = [threading.Thread(target=stream, args=(events,)) for events in streams]
    for reader in readers:
        reader.start()
    while not all(streams):
        time.sleep(0.01)
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    try:
        code = server.proc.wait(15)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        raise AssertionError("still running 15 s after SIGTERM:\n" + "\n".join(server.lines))
    for reader in readers:
        reader.join(5)
    assert code == 0, "\n".join(server.lines)
    assert time.monotonic() - t0 < 15
    for events in streams:
        assert events[-1] == "data: [DONE]"
        assert '"finish_reason": "length"' in events[-2] and '"server_stopped": true' in events[-2]
        assert ('"batched": true' in events[-2]) == (batch > 1)
    assert "tforce: serve: stopped" in server.lines
    assert not any("Traceback" in l for l in server.lines), "\n".join(server.lines)
