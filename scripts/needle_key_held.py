"""Per layer, does each policy's middle cache hold the pass key right after prefill? (EVALUATION.md.)

Builds `tforce eval`'s needle prompts (tforce.eval.run.prompts, seed 0) at one context and, for depths
20%, 50% and 80%, prints per policy how many layers hold all of the key's tokens and how many hold none
of them (in any KV head), from needle_ablation.key_held, budget 256, one thread.

    python scripts/needle_key_held.py 4000 [-m smollm2-135m-instruct]
"""
from __future__ import annotations

import argparse
import glob
from pathlib import Path

import torch

from needle_ablation import key_held
from tforce import load_model
from tforce.eval.run import prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("context", type=int)
    ap.add_argument("-m", "--model", default="smollm2-135m-instruct")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--books", default="../shared/data/books/*.txt")
    args = ap.parse_args()
    torch.set_num_threads(1)
    t = load_model(args.model, device="cpu", dtype="float32")
    texts = [Path(f).read_text(encoding="utf-8", errors="replace") for f in sorted(glob.glob(args.books))]
    ps = prompts("needle", t.tokenizer, texts, args.context, 0)
    n = t.model.config.num_hidden_layers
    for i in (1, 4, 7):  # depths 0.2, 0.5, 0.8
        ids, ans = ps[i]["ids"], ps[i]["answer"]
        at = max(j for j in range(len(ids)) if ids[j:j + len(ans)] == ans)  # the needle's key
        for policy in ("retrieval", "shared", "topk"):
            shares = key_held(t.model, ids, range(at, at + len(ans)), policy, args.budget)
            print(args.context, ps[i]["label"], policy, f"layers holding all of the key: "
                  f"{sum(x == 1.0 for x in shares)}/{n}, none: {sum(x == 0.0 for x in shares)}/{n} "
                  f"missing in layers:", [layer for layer, x in enumerate(shares) if x == 0.0], flush=True)


if __name__ == "__main__":
    main()
