"""Pass-key retrieval under quantized projections: does greedy decoding after a needle prompt give the key,
with the file's values in float32 (--weights float), the GGUF's own int4 codes (auto) and int8?

`tforce eval`'s needle prompts (tforce.eval.run.prompts, seed 0: a five-digit key hidden in book text) at
each context length, at depths 20%, 50% and 80%; plain decoding (`ar`, greedy) of the key's length in
tokens; a prompt counts as retrieved when the output begins with the key's ids. EVALUATION.md quotes it.

    python scripts/quant_passkey.py [--model smollm2-135m-instruct] [--contexts 4000,7500]
"""
from __future__ import annotations

import argparse
import glob
import time
from pathlib import Path

import torch

import tforce
from tforce.eval.run import prompts

BOOKS = str(Path(__file__).resolve().parents[1].parent / "shared/data/books/*.txt")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="smollm2-135m-instruct")
    ap.add_argument("--contexts", default="4000,7500")
    ap.add_argument("--weights", default="float,auto,int8")
    ap.add_argument("--books", default=BOOKS)
    args = ap.parse_args()
    torch.set_num_threads(2)
    texts = [Path(f).read_text(encoding="utf-8", errors="replace") for f in sorted(glob.glob(args.books))]
    print("| weights | context | depth 0.2 | depth 0.5 | depth 0.8 | retrieved |")
    print("|---|---|---|---|---|---|")
    for weights in args.weights.split(","):
        loaded = tforce.load_model(args.model, weights=weights)
        for context in (int(c) for c in args.contexts.split(",")):
            cells, hits, t0 = [], 0, time.perf_counter()
            for p in (prompts("needle", loaded.tokenizer, texts, context, 0)[i] for i in (1, 4, 7)):
                out = tforce.generate(loaded, p["ids"], method="ar", max_new_tokens=len(p["answer"]),
                                      temperature=0, ignore_eos=True).tokens
                ok = out[:len(p["answer"])] == p["answer"]
                hits += ok
                cells.append(("yes " if ok else "no ") + repr(loaded.tokenizer.decode(out)))
            label = f"auto ({loaded.model.weights})" if weights == "auto" else weights
            print(f"| {label} | {context} | {' | '.join(cells)} | {hits}/3 |", flush=True)
            print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
