#!/usr/bin/env python
"""Draft acceptance and ms/token of ar, naive and triforce on excerpts of the held-out books.

    python scripts/measure_draft.py                      # smollm2-135m-instruct with its registry draft

Each excerpt is ~--prompt-tokens tokens from the middle of one of the six held-out books (../shared/data/
books/*.txt, never trained on); every method runs `tforce run --temperature 0 --template none --json
--ignore-eos` on the same excerpts, one process each. Prints one row per excerpt and method, then the means.
Columns: book, method, prompt tokens, ms/token, draft acceptance, retrieval (middle level) acceptance.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_demo import BOOKS, read_books  # noqa: E402


def excerpts(tok, n_books: int, n_tokens: int) -> dict[str, str]:
    """n_tokens tokens from the middle of each of the first n_books held-out books, as text."""
    out = {}
    for name, text in list(read_books(BOOKS).items())[:n_books]:
        mid = len(text) // 2
        ids = tok(text[mid:mid + n_tokens * 8], add_special_tokens=False)["input_ids"]
        out[name] = tok.decode(ids[1:n_tokens + 1])  # from the second token: the first may be a split word
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--draft", help="default: the registry's")
    ap.add_argument("--methods", default="ar,naive,triforce")
    ap.add_argument("--books", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from tforce.model.registry import resolve

    tok = AutoTokenizer.from_pretrained(resolve(args.model))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for book, text in excerpts(tok, args.books, args.prompt_tokens).items():
            (Path(tmp) / book).write_text(text)
            for method in args.methods.split(","):
                cmd = ["tforce", "run", "-m", args.model, "--method", method, "--temperature", "0", "--template",
                       "none", "--json", "--ignore-eos", "-n", str(args.new_tokens), "-f", str(Path(tmp) / book),
                       "--threads", str(args.threads)] + (["--draft", args.draft] if args.draft else [])
                run = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
                stats = run["stats"]
                acc = stats["acceptance"]
                rows.append((book, method, run["prompt_tokens"], stats["ms_per_token"], acc["draft"], acc["retrieval"]))
                print(f"| {book} | {method} | {rows[-1][2]} | {rows[-1][3]:.1f} | {rows[-1][4]} | {rows[-1][5]} |",
                      flush=True)
    print("\nmeans over the excerpts:")
    for method in args.methods.split(","):
        mine = [r for r in rows if r[1] == method]
        ms = sum(r[3] for r in mine) / len(mine)
        drafts = [r[4] for r in mine if r[4] is not None]
        draft = f"{sum(drafts) / len(drafts):.3f}" if drafts else "-"
        print(f"| {method} | {ms:.1f} ms/token | draft acceptance {draft} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
