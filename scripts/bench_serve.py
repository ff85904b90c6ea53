"""`tforce serve` timed from a client: time to first streamed token of a question about a fresh document
(cold), of a second question about it (warm: its KV reused; the small draft's window is fed the document
again and marked where the questions branch off) and of a third (the draft's window restored from that
mark), and requests per second under a load of short requests from several clients. Beside it, `scripts/bench_chat.py BOOK TOKENS --peers hf` gives
transformers' cold and prefix-cache times on the same weights.

    python scripts/bench_serve.py [TOKENS] [REPEATS] [-- tforce serve options]
    (defaults: 3000-token documents, 5 repeats, the demo pair on the CPU with one thread; each repeat's
    document starts elsewhere in the demo excerpt, so that no cold question reuses another's KV)
"""
from __future__ import annotations

import re
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from openai import OpenAI
from transformers import AutoTokenizer

sys.path.insert(0, ".")
from tforce.model.defaults import demo_pair
from tforce.text.demo import EXCERPT  # noqa: E402

QUESTIONS = ("\n\nQuestion: who is the narrator?", "\n\nQuestion: where does the story happen?",
             "\n\nQuestion: what is the weather like?")
LOAD = (200, 8)  # requests, clients


def first_token_s(client: OpenAI, model: str, prompt: str) -> float:
    t0 = time.perf_counter()
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].text:
            return time.perf_counter() - t0
    raise RuntimeError("no text came")


def main() -> None:
    args = sys.argv[1:]
    extra = args[args.index("--") + 1:] if "--" in args else []
    args = args[:args.index("--")] if "--" in args else args
    tokens, repeats = (int(args[0]) if args else 3000), (int(args[1]) if len(args) > 1 else 5)
    server = subprocess.Popen([sys.executable, "-m", "tforce", "serve", "--port", "0", "--threads", "1",
                               "--temperature", "0", *extra], stderr=subprocess.PIPE, text=True)
    try:
        for line in server.stderr:
            found = re.search(r"serving (\S+) .* on (http://\S+/v1)", line)
            if found:
                break
        else:
            raise SystemExit("the server did not start")
        threading.Thread(target=server.stderr.read, daemon=True).start()  # its request lines: drained
        model, url = found.groups()
        client = OpenAI(base_url=url, api_key="unused", max_retries=0)
        tok = AutoTokenizer.from_pretrained(demo_pair()[0])
        ids = tok.encode(EXCERPT.read_text(encoding="utf-8"), add_special_tokens=False)
        step = max(1, (len(ids) - tokens) // max(1, repeats))
        times = [[], [], []]  # per question: cold, warm, warm with the draft's mark
        for r in range(repeats):
            doc = tok.decode(ids[r * step:r * step + tokens])
            for q, question in enumerate(QUESTIONS):
                times[q].append(first_token_s(client, model, doc + question))
        c, w, m = (statistics.median(t) for t in times)
        print(f"{model}, {tokens}-token documents, median of {repeats}: time to first token cold {c:.3f} s, "
              f"second question {w:.3f} s ({c / w:.1f}x), third {m:.3f} s ({c / m:.1f}x)")
        n, clients = LOAD
        t0 = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(lambda i: client.completions.create(model=model, prompt=f"Chapter {i}. The narrator",
                                                              max_tokens=8, temperature=0), range(n)))
        s = time.perf_counter() - t0
        print(f"{n} requests (8 tokens each) from {clients} clients in {s:.1f} s: {n / s:.1f} requests/s")
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
