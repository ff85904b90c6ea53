"""What int8 and int4 projections cost in quality: perplexity of one text under the model with float32
projections (a GGUF's dequantized: --weights float) and quantized (tforce/model/quant.py; for a GGUF also as
it loads by default, `auto`: Q4_0/Q4_1 kept code for code), and how often greedy next-token choices agree.

One forward over the whole text per variant (a prefill through tforce's own model and full cache), then
the log-likelihood of each token given the ones before it. The quantized products go through the packed
kernels for every row, as a decode step's do (a prefill chunk's would dequantize: quant.DEQUANTIZE_ROWS).
Agreement: the fraction of positions where
the quantized model's argmax equals float32's.

    python scripts/quant_quality.py [MODEL] [TEXT_FILE] [TOKENS]
    # default: smollm2-135m-instruct, ../shared/data/books/middlemarch.txt, 2000 tokens
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

import tforce
from tforce.cache.full import FullCache
from tforce.model import quant
from tforce.cache.rope import Rotary


def logits_of(model, ids: list[int]) -> torch.Tensor:
    n = len(ids)
    cache = FullCache(model.config.num_hidden_layers, model.n_kv_heads, model.head_dim, n,
                      Rotary(model.config, n, device="cpu"))
    cache.begin(n)
    return model(torch.tensor([ids]), cache)[0]  # (n, V) float32


def main(name: str, text_file: str, n: int) -> None:
    torch.set_num_threads(2)
    quant.DEQUANTIZE_ROWS = 1 << 62  # the kernels, as in decoding
    loaded = tforce.load_model(name, weights="float")
    text = Path(text_file).read_text(encoding="utf-8")
    start = len(text) // 3  # away from the book's front matter
    ids = loaded.tokenizer.encode(text[start:start + 20 * n], add_special_tokens=False)[:n]
    reference = None
    print(f"{name}, {len(ids)} tokens of {Path(text_file).name} from character {start}, float32 activations")
    print("| weights | perplexity | greedy agreement with float32 |")
    print("|---|---|---|")
    for weights in ("float", "auto", "int8", "int4"):
        model = loaded.model if weights == "float" else tforce.load_model(name, weights=weights).model
        logits = logits_of(model, ids)
        nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
        top = logits[:-1].argmax(-1)
        if reference is None:
            reference = top
        agree = (top == reference).float().mean().item()
        label = {"float": "float32", "auto": f"auto ({model.weights})"}.get(weights, weights)
        print(f"| {label} | {math.exp(nll.item()):.3f} | {agree:.3f} |",
              flush=True)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0] if a else "smollm2-135m-instruct",
         a[1] if len(a) > 1 else str(Path(__file__).resolve().parents[1].parent / "shared/data/books/middlemarch.txt"),
         int(a[2]) if len(a) > 2 else 2000)
