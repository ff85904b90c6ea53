"""`tforce serve --max-batch N` from clients' side: the same requests (each a question about another part of
the demo excerpt, greedy) sent one at a time, then from N clients at once to a server without batching
(--max-batch 1: they queue) and to one with --max-batch N (they join the running batch). Prints total
throughput, each request's time to first streamed text, and whether every answer equals its one-at-a-time
answer; --json FILE writes the figures.

    python scripts/bench_serve_batch.py [--clients 8] [--prompt-tokens 300] [--new 32] [--json F] [-- serve options]
    (default model: `tforce serve`'s, SmolLM2-135M-Instruct with its draft; threads: the server's default)
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from openai import OpenAI

sys.path.insert(0, ".")
from tforce.text.demo import EXCERPT  # noqa: E402


def start(extra: list[str]):
    server = subprocess.Popen([sys.executable, "-m", "tforce", "serve", "--port", "0", "--temperature", "0", *extra],
                              stderr=subprocess.PIPE, text=True)
    for line in server.stderr:
        found = re.search(r"serving (\S+) .* on (http://\S+/v1)", line)
        if found:
            threading.Thread(target=server.stderr.read, daemon=True).start()
            print(line.strip())
            return server, found.group(1), OpenAI(base_url=found.group(2), api_key="unused", max_retries=0,
                                                  timeout=3600)
    raise SystemExit("the server did not start")


def ask(client, model, prompt, new, t_sent):
    """(answer text, seconds from t_sent to its first streamed text (to its end if it has none), to its end,
    tokens)."""
    first, parts, tokens = None, [], 0
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=new, temperature=0, stream=True,
                                           stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].text:
            first = first or time.perf_counter() - t_sent
            parts.append(chunk.choices[0].text)
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter() - t_sent
    return "".join(parts), end if first is None else first, end, tokens  # no text: its end


def together(client, model, prompts, new):
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: ask(client, model, p, new, t0), prompts))
    return got, time.perf_counter() - t0


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser()
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=300)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--json")
    a = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    words = EXCERPT.read_text(encoding="utf-8").split()
    n_words = int(a.prompt_tokens * 0.75)  # about a token and a third per word of this English
    prompts = [" ".join(words[i * 97:i * 97 + n_words]) + "\n\nQuestion: who speaks here?\nAnswer:"
               for i in range(a.clients)]
    out = {"clients": a.clients, "prompt_words": n_words, "new": a.new, "serve_options": extra}
    for label, batch in (("queued", 1), ("batched", a.clients)):
        server, model, client = start([*extra, "--max-batch", str(batch)])
        try:
            ask(client, model, prompts[0], 2, time.perf_counter())  # warm-up
            if label == "queued":
                t0 = time.perf_counter()
                alone = [ask(client, model, q, a.new, time.perf_counter()) for q in prompts]
                s = time.perf_counter() - t0
                n = sum(x[3] for x in alone)
                out["one_at_a_time"] = {"s": s, "tokens": n, "tokens_per_s": n / s,
                                        "ttft_s": [x[1] for x in alone]}
            got, s = together(client, model, prompts, a.new)
            n = sum(x[3] for x in got)
            out[label] = {"s": s, "tokens": n, "tokens_per_s": n / s, "ttft_s": [x[1] for x in got],
                          "equal_one_at_a_time": [x[0] == y[0] for x, y in zip(got, alone)]}
        finally:
            server.terminate()
            server.wait(60)
    one = out["one_at_a_time"]
    print(f"{model}, {a.clients} prompts of about {a.prompt_tokens} tokens, {a.new} new each, greedy")
    print(f"one at a time: {one['tokens_per_s']:.1f} tokens/s ({one['s']:.1f} s)")
    for label in ("queued", "batched"):
        r = out[label]
        print(f"{a.clients} clients at once, {label}: {r['tokens_per_s']:.1f} tokens/s ({r['s']:.1f} s, "
              f"{r['tokens_per_s'] / one['tokens_per_s']:.2f}x one at a time); time to first text median "
              f"{statistics.median(r['ttft_s']):.2f} s, max {max(r['ttft_s']):.2f} s; answers equal one at a time: "
              f"{sum(r['equal_one_at_a_time'])}/{a.clients}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
