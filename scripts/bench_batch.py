"""Batch vs one at a time: tokens/s of generate_batch over B prompts against generate over each in turn.

    python scripts/bench_batch.py [--batch 1 2 4 8] [--method ar] [--new 128] [--repeats 3] [--threads 1]

Prompts: the demo excerpt cut to B different lengths (from --prompt-tokens down by 10% per row), greedy,
EOS ignored, so every row makes --new tokens. Decode seconds only (prefill excluded), best of
--repeats; the batch's rows are checked equal to the one-at-a-time runs. Default models: the demo pair.
"""
from __future__ import annotations

import argparse
import json

import torch

import tforce
from tforce.demo import demo_pair, demo_prompt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--method", default="ar", choices=["ar", "naive"])
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=600)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target_dir, draft_dir = demo_pair()
    target = tforce.load_model(args.model or target_dir)
    draft = tforce.load_model(args.draft or draft_dir).model if args.method == "naive" else None
    ids = target.tokenizer.encode(demo_prompt())
    kw = dict(draft=draft, method=args.method, max_new_tokens=args.new, temperature=0, ignore_eos=True)
    for B in args.batch:
        prompts = [ids[: int(args.prompt_tokens * 0.9 ** b)] for b in range(B)]
        alone_s, batch_s, alone_tokens = float("inf"), float("inf"), None
        for _ in range(args.repeats):
            singles = [tforce.generate(target.model, p, **kw) for p in prompts]
            alone_s = min(alone_s, sum(r.stats["decode_s"] for r in singles))
            alone_tokens = [r.tokens for r in singles]
            rows = tforce.generate_batch(target.model, prompts, **kw)
            batch_s = min(batch_s, rows[0].stats["decode_s"])
            assert [r.tokens for r in rows] == alone_tokens, "a row differs from its prompt alone"
        n = sum(len(t) for t in alone_tokens)
        print(json.dumps({"batch": B, "method": args.method, "prompt_tokens": [len(p) for p in prompts],
                          "new_tokens": n, "one_at_a_time_tokens_per_s": round(n / alone_s, 1),
                          "batch_tokens_per_s": round(n / batch_s, 1), "speedup": round(alone_s / batch_s, 2),
                          "rows_equal": True}), flush=True)


if __name__ == "__main__":
    main()
