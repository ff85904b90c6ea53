"""Cold vs warm time to first token, and a KV snapshot's load time vs prefill, on a book excerpt.

cold: generate() over document + the second question (the document prefilled again, as `tforce run` does);
warm: Conversation.ask() of a second question after a first one, the document prefilled once (`tforce chat`);
prefill vs load: a Conversation built by prefilling the document, or by loading its snapshot.
--peers hf: transformers beside it, on the same weights (tforce/bench/peers.py's hf_model): cold, generate() over
document + the second question; warm, its documented prefix-cache reuse (the document prefilled once into
a DynamicCache, copied with copy.deepcopy for each question, then generate() over document + question
with that copy); its greedy answer compared with tforce's token for token.
Each figure is the median of REPEATS runs (CPU runs on a shared machine are noisy; one thread there).

    python scripts/bench_chat.py BOOK.txt [TOKENS] [METHOD] [REPEATS] [START] [--synthetic ARCH]
        [--device cpu|cuda] [--dtype D] [--budget N] [--draft-budget N] [--peers hf] [--json FILE]
    (defaults: 900 tokens, triforce, 5 runs, the demo pair on the CPU in float32; the excerpt starts at the
    first occurrence of START, e.g. a chapter's first words, else at the beginning. --synthetic: random
    weights of a `tforce bench --synthetic` architecture and its draft, with the byte tokenizer, e.g.
    llama2-7b on cuda in bfloat16: its times are real, its answers meaningless. --json FILE: the medians
    written to FILE as one JSON object, beside the lines printed)
"""
from __future__ import annotations

import argparse
import copy
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, ".")
import tforce  # noqa: E402
from tforce.bench.suite import synthetic_pair  # noqa: E402
from tforce.engine.conversation import Conversation  # noqa: E402
from tforce.model.defaults import demo_pair  # noqa: E402
from tforce.model.synthetic import byte_tokenizer  # noqa: E402
from tforce.engine.events import Events  # noqa: E402

QUESTIONS = ("\n\nQuestion: who is the narrator?", "\n\nWhere do the crowds of water-gazers stand?")


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Time to first token with and without the document's KV kept.")
    p.add_argument("book")
    p.add_argument("tokens", nargs="?", type=int, default=900)
    p.add_argument("method", nargs="?", default="triforce")
    p.add_argument("repeats", nargs="?", type=int, default=5)
    p.add_argument("start", nargs="?")
    p.add_argument("--synthetic", help="random weights of this architecture (tforce bench's) and the byte tokenizer")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", help="default: bfloat16 on cuda, float32 on the cpu")
    p.add_argument("--budget", type=int, default=4096)
    p.add_argument("--draft-budget", type=int, default=256)
    p.add_argument("--peers", choices=["hf"], help="transformers' generate beside it, cold and with its prefix cache")
    p.add_argument("--json", help="write the medians to this file as one JSON object")
    return p.parse_args()


def models(a: argparse.Namespace, dtype: torch.dtype):
    """(target, draft, tokenizer): the demo pair, or random weights of a synthetic architecture."""
    if a.synthetic:
        target, draft = synthetic_pair(a.synthetic, a.device, dtype)
        return target, draft, byte_tokenizer()
    target_dir, draft_dir = demo_pair()
    target = tforce.load_model(target_dir, device=a.device, dtype=dtype)
    draft = tforce.load_model(draft_dir, device=a.device, dtype=dtype, tokenizer=False)
    return target, draft, target.tokenizer


def hf_side(target, doc: list[int], question: list[int], repeats: int, device: str) -> dict:
    """transformers' cold and warm time to first token (medians of `repeats`) and its warm greedy answer."""
    from transformers import DynamicCache

    from tforce.bench.peers import hf_model, no_eos

    hf = hf_model(target if isinstance(target, torch.nn.Module) else target.model)  # a LoadedModel, or random weights

    def timed(ids: list[int], cache=None, new: int = 1) -> tuple[list[int], float]:
        x = torch.tensor([ids], device=device)
        sync()
        t0 = time.perf_counter()
        past = copy.deepcopy(cache) if cache is not None else None  # each question starts from the document
        config = no_eos()  # greedy (its default), to max_new_tokens
        config.max_new_tokens = new
        out = hf.generate(x, attention_mask=torch.ones_like(x), past_key_values=past, generation_config=config)
        sync()
        return out[0, len(ids):].tolist(), time.perf_counter() - t0

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    with torch.no_grad():
        cache = DynamicCache()
        t0 = time.perf_counter()
        hf(torch.tensor([doc], device=device), past_key_values=cache, use_cache=True)
        sync()
        prefill = time.perf_counter() - t0
        timed(doc[:64] + question, None)  # warm-up
        cold = [timed(doc + question)[1] for _ in range(repeats)]
        warm = [timed(doc + question, cache)[1] for _ in range(repeats)]
        answer = timed(doc + question, cache, 8)[0]
    med = statistics.median
    return {"ttft_cold_s": med(cold), "ttft_warm_s": med(warm), "document_prefill_s": prefill, "answer": answer}


def main() -> None:
    a = arguments()
    book = Path(a.book).read_text(encoding="utf-8")
    if a.start:
        book = book[max(0, book.find(a.start)):]
    n, method, repeats = a.tokens, a.method, a.repeats
    if a.device == "cpu":
        torch.set_num_threads(1)
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if a.device.startswith("cuda") else torch.float32)
    target, draft, tok = models(a, dtype)
    doc = tok.encode(book)[:n]
    q, q2 = (tok.encode(x, add_special_tokens=False) for x in QUESTIONS)
    opts = dict(draft=draft, method=method, temperature=0, ignore_eos=True, budget=a.budget,
                draft_budget=a.draft_budget)
    snap = Path(tempfile.mkdtemp()) / "doc.kv"
    Conversation(target, doc, room=64, save_kv=snap, **opts)
    cold, warm, warm_prefill, prefill, load = [], [], [], [], []
    for _ in range(repeats):
        first = []
        t0 = time.perf_counter()
        tforce.generate(target, doc + q2, max_new_tokens=8, **opts,
                        events=Events(on_tokens=lambda r, t, a: first or first.append(time.perf_counter())))
        cold.append(first[0] - t0)
        conv = Conversation(target, doc, room=64, **opts)
        prefill.append(conv.prefill_s)
        conv.ask(q, 8)  # the first question after the document
        result = conv.ask(q2, 8)  # and another: the caches came back to the document's end
        stats, answer = result.stats, result.tokens
        warm.append(stats["ttft_s"])
        warm_prefill.append(stats["prefill_s"])
        load.append(Conversation(target, None, room=64, load_kv=snap, **opts).prefill_s)
    size = sum(f.stat().st_size for f in snap.iterdir())
    shutil.rmtree(snap.parent)
    med = statistics.median
    print(f"{method}, document {len(doc)} tokens, questions {len(q)} and {len(q2)} tokens, median of {repeats}:")
    print(f"  time to first token: cold {med(cold):.3f} s, warm {med(warm):.3f} s ({med(cold) / med(warm):.1f}x; "
          f"of which {med(warm_prefill):.3f} s returning to the document and prefilling the question)")
    print(f"  document: prefill {med(prefill):.3f} s, snapshot load {med(load):.3f} s ({size / 2**20:.1f} MiB)")
    hf = hf_side(target, doc, q2, repeats, a.device) if a.peers else None
    if hf is not None:
        from tforce.bench.peers import compare, transformers_version

        hf["vs_tforce"] = compare(hf.pop("answer"), answer)
        hf["transformers"] = transformers_version()
        print(f"  transformers {hf['transformers']} on the same weights: time to first token cold "
              f"{hf['ttft_cold_s']:.3f} s, warm {hf['ttft_warm_s']:.3f} s (its prefix cache, deep-copied per "
              f"question); document prefill {hf['document_prefill_s']:.3f} s; greedy answer vs tforce's: "
              f"{hf['vs_tforce']}")
    if a.json:
        record = {"method": method, "model": a.synthetic or "demo pair", "device": a.device,
                  "dtype": str(dtype).removeprefix("torch."),
                  "document_tokens": len(doc), "repeats": repeats, "ttft_cold_s": med(cold), "ttft_warm_s": med(warm),
                  "warm_prefill_s": med(warm_prefill), "document_prefill_s": med(prefill),
                  "snapshot_load_s": med(load), "snapshot_mib": size / 2**20, "hf": hf}
        Path(a.json).write_text(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
