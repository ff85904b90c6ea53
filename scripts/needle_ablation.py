"""Which layers' keys does the target need to answer a passkey prompt? (EVALUATION.md, "needle".)

Builds needle prompts (tforce.text.needle) and decodes the answer greedily with method "retrieval" and a
middle cache larger than the context, so the middle level holds every token except the ones this
script removes: the key and 8 tokens either side (the needle sentence) in a chosen set of layers, or
the last 16 prompt tokens in one layer. The printed number is the middle level's acceptance by the full cache (1.0 when
nothing needed is missing). Output stays exact whatever is removed; only acceptance changes.

    python scripts/needle_ablation.py -m models/demo-target --context 512 --depths 0.2,0.5,0.8
"""
from __future__ import annotations

import argparse
import glob
from pathlib import Path

import torch

from tforce import load_model
from tforce.config import Execution, RunConfig, Sampling, Speculation
from tforce.engine.generate import Session
from tforce.text.needle import needle_prompt


class Without:
    """A middle-cache select rule: every committed token except `drop` positions in `layers`, newest first."""

    def __init__(self, layers: set[int], drop: set[int]):
        self.layers, self.drop = layers, drop

    def __call__(self, layer, keys, length, query, budget):
        gone = self.drop if layer in self.layers else set()
        keep = [p for p in range(length - 1, -1, -1) if p not in gone][:budget]
        return torch.tensor(keep, device=keys.device).expand(keys.shape[1], len(keep)).clone()


def acceptance(model, ids: list[int], n_new: int, select) -> tuple[float, list[int]]:
    spec = Speculation(method="retrieval", budget=len(ids) + 64, chunk_size=8, gamma2=6)
    session = Session(model, None, len(ids), n_new + 8, RunConfig(speculation=spec, sampling=Sampling(temperature=0.0), execution=Execution(cuda_graphs=False)))
    session.retrieval.select = select
    session.prefill([ids])
    got, gen = [], torch.Generator().manual_seed(0)
    while len(got) < n_new:
        got += session.round([len(ids) + len(got)], gen)[0]
    stats = session.top.stats
    return stats.accepted[0] / max(stats.drafted[0], 1), got[:n_new]


def key_held(model, ids: list[int], key_at: range, policy: str, budget: int) -> list[float]:
    """Per layer: the share of the key's ids (over KV heads) the policy's cache holds after prefill."""
    spec = Speculation(method="retrieval", budget=budget, chunk_size=8, gamma2=6, policy=policy, sinks=4)
    session = Session(model, None, len(ids), 8, RunConfig(speculation=spec, sampling=Sampling(temperature=0.0), execution=Execution(cuda_graphs=False)))
    session.prefill([ids])
    pos = session.retrieval.key_pos[:, 0]  # (layers, H_kv, budget): the one row's
    return [sum(int((pos[layer] == p).any(-1).sum()) for p in key_at) / (len(key_at) * pos.shape[1])
            for layer in range(pos.shape[0])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="models/demo-target")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--depths", default="0.2,0.5,0.8")
    ap.add_argument("--key", default="40718")
    ap.add_argument("--books", default="../shared/data/books/*.txt")
    ap.add_argument("--budget", type=int, default=128, help="Budget of the key-held table.")
    args = ap.parse_args()
    torch.set_num_threads(1)
    loaded = load_model(args.model)
    model, tok = loaded.model, loaded.tokenizer
    filler = "\n\n".join(Path(f).read_text(encoding="utf-8") for f in sorted(glob.glob(args.books)))
    n_layers = model.config.num_hidden_layers
    removals = {"nothing": (set(), "")} | {f"the needle, layer {i}": ({i}, "needle") for i in range(n_layers)}
    removals["the needle, all layers"] = (set(range(n_layers)), "needle")
    removals |= {f"last 16 prompt tokens, layer {i}": ({i}, "recent") for i in range(n_layers)}
    depths = [float(d) for d in args.depths.split(",")]
    table, answers = {name: [] for name in removals}, []
    policies = ("retrieval", "shared", "topk", "streaming")
    held = {p: [] for p in policies}
    for depth in depths:
        ids, answer = needle_prompt(tok, filler, args.context, depth, args.key)
        at = next(i for i in range(len(ids)) if ids[i:i + len(answer)] == answer)  # the key's first id
        spans = {"": set(), "needle": set(range(at - 8, at + len(answer) + 8)),  # the key sentence and around
                 "recent": set(range(len(ids) - 17, len(ids) - 1))}
        for name, (layers, span) in removals.items():
            acc, out = acceptance(model, ids, len(answer) + 1, Without(layers, spans[span]))
            table[name].append(f"{acc:.2f}")
        for policy in policies:
            shares = key_held(model, ids, range(at, at + len(answer)), policy, args.budget)
            held[policy].append(" / ".join(f"{x:.1f}" for x in shares))
        answers.append(tok.decode(out[:len(answer)]) + ("" if out[:len(answer)] == answer else " (wrong)"))
    print(f"{args.model}, context {args.context}, key {args.key}: middle-level acceptance, greedy, "
          f"{len(answer) + 1} tokens\n")
    print("| removed from the middle cache | " + " | ".join(f"depth {d:.1f}" for d in depths) + " |")
    print("|---|" + "---|" * len(depths))
    for name, cells in table.items():
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("| (target's answer) | " + " | ".join(answers) + " |")
    print(f"\nShare of the key's ids held by each policy's cache (budget {args.budget}) after prefill, "
          "per layer 0 / 1 / ...:\n")
    print("| policy | " + " | ".join(f"depth {d:.1f}" for d in depths) + " |")
    print("|---|" + "---|" * len(depths))
    for policy, cells in held.items():
        print(f"| {policy} | " + " | ".join(cells) + " |")

if __name__ == "__main__":
    main()
