"""Cold vs warm time to first token, and a KV snapshot's load time vs prefill, on a book excerpt.

cold: generate() over document + the second question (the document prefilled again, as `tforce run` does);
warm: Conversation.ask() of a second question after a first one, the document prefilled once (`tforce chat`);
prefill vs load: a Conversation built by prefilling the document, or by loading its snapshot.
Each figure is the median of REPEATS runs (CPU runs on a shared machine are noisy), one thread.

    python scripts/bench_chat.py BOOK.txt [TOKENS] [METHOD] [REPEATS] [START]
    (defaults: 900 tokens, triforce, 5 runs; the excerpt starts at the first occurrence of START, e.g. a
    chapter's first words, else at the beginning)
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, ".")
import tforce  # noqa: E402
from tforce.conversation import Conversation  # noqa: E402
from tforce.demo import demo_pair  # noqa: E402

QUESTIONS = ("\n\nQuestion: who is the narrator?", "\n\nWhere do the crowds of water-gazers stand?")


def main() -> None:
    book = Path(sys.argv[1]).read_text(encoding="utf-8")
    if len(sys.argv) > 5:
        book = book[max(0, book.find(sys.argv[5])):]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 900
    method = sys.argv[3] if len(sys.argv) > 3 else "triforce"
    repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 5
    torch.set_num_threads(1)
    target_dir, draft_dir = demo_pair()
    target, draft = tforce.load_model(target_dir), tforce.load_model(draft_dir, tokenizer=False)
    tok = target.tokenizer
    doc = tok.encode(book)[:n]
    q, q2 = (tok.encode(x, add_special_tokens=False) for x in QUESTIONS)
    opts = dict(draft=draft, method=method, temperature=0, ignore_eos=True)
    snap = Path(tempfile.mkdtemp()) / "doc.kv"
    Conversation(target, doc, room=64, save_kv=snap, **opts)
    cold, warm, warm_prefill, prefill, load = [], [], [], [], []
    for _ in range(repeats):
        first = []
        t0 = time.perf_counter()
        tforce.generate(target, doc + q2, max_new_tokens=8, on_token=lambda t: first or first.append(time.perf_counter()),
                        **opts)
        cold.append(first[0] - t0)
        conv = Conversation(target, doc, room=64, **opts)
        prefill.append(conv.prefill_s)
        conv.ask(q, 8)  # the first question after the document
        stats = conv.ask(q2, 8).stats  # and another: the caches came back to the document's end
        warm.append(stats["ttft_s"])
        warm_prefill.append(stats["prefill_s"])
        load.append(Conversation(target, None, room=64, load_kv=snap, **opts).prefill_s)
    size = sum(f.stat().st_size for f in snap.iterdir())
    med = statistics.median
    print(f"{method}, document {len(doc)} tokens, questions {len(q)} and {len(q2)} tokens, median of {repeats}:")
    print(f"  time to first token: cold {med(cold):.3f} s, warm {med(warm):.3f} s ({med(cold) / med(warm):.1f}x; "
          f"of which {med(warm_prefill):.3f} s returning to the document and prefilling the question)")
    print(f"  document: prefill {med(prefill):.3f} s, snapshot load {med(load):.3f} s ({size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
