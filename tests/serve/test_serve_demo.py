"""`tforce serve` on the trained demo pair (models/): the second question about a ~3,000-token document
streams its first chunk in at most a third of the first question's time (its KV is reused), and a bounded
load (200 requests from 8 clients) brings no error and no growth of the server's memory, one at a time and
with `--max-batch 8` (every batched answer the unbatched server's)."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from serve_helpers import DEMO, Server

pytestmark = pytest.mark.skipif(not (DEMO / "demo-target" / "config.json").is_file(), reason="no demo pair")


@pytest.fixture(scope="module")
def server():
    s = Server("-m", str(DEMO / "demo-target"), "--budget", "256", "--draft-budget", "192", "--temperature", "0")
    yield s
    assert s.stop() == 0


def _document(tokens: int = 3000) -> str:
    from transformers import AutoTokenizer

    from tforce.text.demo import EXCERPT

    tok = AutoTokenizer.from_pretrained(DEMO / "demo-target")
    ids = tok.encode(EXCERPT.read_text(encoding="utf-8"), add_special_tokens=False)
    assert len(ids) >= tokens
    return tok.decode(ids[:tokens])


def _first_chunk_s(server, prompt: str) -> tuple[float, dict]:
    """Seconds from sending the request to its first streamed text, and the last chunk's tforce statistics."""
    t0 = time.perf_counter()
    first, last = None, None
    for chunk in server.client().completions.create(model=server.model(), prompt=prompt, max_tokens=8,
                                                    temperature=0, stream=True):
        if first is None and chunk.choices and chunk.choices[0].text:
            first = time.perf_counter() - t0
        last = chunk
    return first, last.model_extra["tforce"]


def test_second_question_reuses_the_document(server):
    doc = _document()
    cold, stats1 = _first_chunk_s(server, doc + "\n\nQuestion: who is Pip?")
    warm, stats2 = _first_chunk_s(server, doc + "\n\nQuestion: where does the story happen?")
    print(f"first chunk: cold {cold:.2f} s, warm {warm:.2f} s; prefilled {stats1['prefilled_tokens']} then "
          f"{stats2['prefilled_tokens']} tokens")
    assert stats1["prefix_reused"] <= 1 and stats1["prefilled_tokens"] >= 3000
    assert stats2["prefix_reused"] >= 3000 and stats2["prefilled_tokens"] < 20
    assert warm <= cold / 3, (cold, warm)


PROMPTS = [f"Chapter {i}. The narrator walked" for i in range(200)]
ANSWERS: dict = {}  # the unbatched server's answers, for the batched one's test


def test_bounded_load_no_error_no_growth(server):
    ANSWERS.update(zip(PROMPTS, _load(server)))


def test_bounded_load_batched_no_error_no_growth_answers_unchanged(server):
    batched = Server("-m", str(DEMO / "demo-target"), "--budget", "256", "--draft-budget", "192", "--temperature",
                     "0", "--max-batch", "8")
    try:
        answers = _load(batched)
    finally:
        assert batched.stop() == 0
    if not ANSWERS:  # run alone: the unbatched answers now
        ANSWERS.update(zip(PROMPTS, _load(server)))
    assert answers == [ANSWERS[p] for p in PROMPTS]


def _load(server) -> list[str]:
    """The 200 prompts from 8 clients: no error, at most 120 s, RSS after 200 within 10% of after 20; the answers."""
    prompts = PROMPTS
    proc = psutil.Process(server.proc.pid)
    client = server.client()

    def ask(prompt: str) -> str:
        r = client.completions.create(model=server.model(), prompt=prompt, max_tokens=8, temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length")
        return r.choices[0].text

    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        first = list(pool.map(ask, prompts[:20]))
        rss_20 = proc.memory_info().rss
        answers = list(pool.map(ask, prompts[20:]))
    elapsed = time.monotonic() - t0
    rss_200 = proc.memory_info().rss
    print(f"200 requests in {elapsed:.1f} s ({200 / elapsed:.1f} requests/s); RSS {rss_20 / 2**20:.0f} MiB after 20, "
          f"{rss_200 / 2**20:.0f} MiB after 200")
    assert len(answers) == 180 and all(isinstance(a, str) for a in answers)
    assert elapsed < 120
    assert rss_200 <= 1.1 * rss_20
    return first + answers
