"""`tforce eval`: acceptance measurements of the middle level on real text, for any target/draft pair.

The quantity (TriForce's Table 1, Fig. 6, Table 2): the acceptance rate of the middle level's drafts
when they are verified by the full cache, i.e. generate(method="retrieval") stats["acceptance"]
["retrieval"], for each middle-cache policy (cache/policies.py) at the same budget. Speed (Fig. 5):
ms/token of ar and triforce by context length on this machine.

Prompts: "pg19" is the first N tokens of each book (bos + text); "needle" is tforce.needle's passkey
prompt of N tokens at depths 10%..90% (the fillers cycle over the books). Every run is seeded; a
result is the mean over prompts of the per-run acceptance and tokens per full verification.
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .engine import generate
from .needle import needle_prompt, random_key

TASKS = ("pg19", "needle")
DEPTHS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


@dataclass
class EvalConfig:
    tasks: list[str]
    contexts: list[int]
    policies: list[str]
    budgets: list[int]
    chunk_sizes: list[int]
    gamma1s: list[int]
    gamma2s: list[int]
    temperatures: list[float]
    gen_len: int = 32
    # needle prompts generate this many tokens; 0: the key's length + 1 (the answer and what follows
    # it), so that acceptance measures the answer, where dropping the needle matters (paper, Table 1)
    needle_gen_len: int = 0
    budget: int = 128  # the fixed budget of Table 1 and of the other sweeps
    chunk_size: int = 8
    gamma1: int = 2
    gamma2: int = 6
    temperature: float = 0.6  # Table 1 and the sweeps; --temperatures is Table 2
    top_p: float = 0.9
    sinks: int = 4  # StreamingLLM policy's attention sinks
    draft_budget: int = 256
    sweep_prompts: int = 3  # prompts per task at each sweep point (Table 1 uses all)
    rebuild_every: int = 128  # the middle cache is re-selected every N tokens (engine default 128)
    seed: int = 0
    books: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------- prompts


def _book_ids(tokenizer, text: str, n: int) -> list[int]:
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    ids = bos + list(tokenizer.encode(text[: 40 * n + 1000], add_special_tokens=False))
    if len(ids) < n:
        raise ValueError(f"a book is too short for a {n}-token prompt")
    return ids[:n]


def prompts(task: str, tokenizer, texts: list[str], context: int, seed: int = 0) -> list[dict]:
    """[{ids, label, answer}] for one task at one context length."""
    if task == "pg19":
        return [{"ids": _book_ids(tokenizer, t, context), "label": f"book{i}", "answer": None}
                for i, t in enumerate(texts)]
    out = []
    for i, depth in enumerate(DEPTHS):
        key = random_key(random.Random(seed * 1000 + i))
        text = texts[i % len(texts)]
        ids, answer = needle_prompt(tokenizer, text[: 40 * context + 1000], context, depth, key, seed=seed + i)
        out.append({"ids": ids, "label": f"depth{depth:.1f}", "answer": answer})
    return out


# ---------------------------------------------------------------------------------------------- runs


class Evaluator:
    def __init__(self, target, draft, tokenizer, texts: list[str], cfg: EvalConfig, progress=None):
        self.target, self.draft, self.tok, self.texts, self.cfg = target, draft, tokenizer, texts, cfg
        self.progress = progress or (lambda line: None)
        self._prompts: dict = {}
        self.runs = 0

    def prompts(self, task: str, context: int, limit: int | None = None) -> list[dict]:
        key = (task, context)
        if key not in self._prompts:
            self._prompts[key] = prompts(task, self.tok, self.texts, context, self.cfg.seed)
        ps = self._prompts[key]
        if limit is None or limit >= len(ps):
            return ps
        step = len(ps) / limit  # spread over the books / depths
        return [ps[int(i * step)] for i in range(limit)]

    def one(self, ids, method="retrieval", policy="retrieval", gen_len=None, **over) -> dict:
        c = self.cfg
        kw = dict(budget=c.budget, chunk_size=c.chunk_size, gamma1=c.gamma1, gamma2=c.gamma2,
                  temperature=c.temperature)
        kw.update(over)
        kw["chunk_size"] = min(kw["chunk_size"], kw["budget"])
        r = generate(self.target, ids, draft=self.draft if method in ("triforce", "naive", "streaming") else None,
                     method=method, policy=policy, max_new_tokens=gen_len or c.gen_len, top_p=c.top_p, seed=c.seed,
                     ignore_eos=True, sinks=c.sinks, draft_budget=c.draft_budget, rebuild_every=c.rebuild_every,
                     cuda_graphs=False, **kw)
        self.runs += 1
        s = r.stats
        return {"acceptance": s["acceptance"]["retrieval"], "draft_acceptance": s["acceptance"]["draft"],
                "tokens_per_verification": s["tokens_per_verification"], "ms_per_token": s["ms_per_token"],
                "tokens": r.tokens}

    def point(self, task, context, limit=None, **run) -> dict:
        """Mean over the prompts of one task and context of one setting."""
        ps = self.prompts(task, context, limit)
        rs = [self.one(p["ids"], gen_len=self._gen_len(p), **run) for p in ps]
        answered = [r["tokens"][:len(p["answer"])] == p["answer"] for p, r in zip(ps, rs) if p["answer"]]

        def mean(k):
            xs = [r[k] for r in rs if r[k] is not None]
            return sum(xs) / len(xs) if xs else None

        def se(k):  # standard error of the mean over prompts (prompt-to-prompt and sampling spread)
            xs = [r[k] for r in rs if r[k] is not None]
            if len(xs) < 2:
                return None
            m = sum(xs) / len(xs)
            return (sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs)) ** 0.5

        return {"task": task, "context": context, "prompts": len(rs), "acceptance": mean("acceptance"),
                "acceptance_se": se("acceptance"),
                "draft_acceptance": mean("draft_acceptance"),
                "tokens_per_verification": mean("tokens_per_verification"), "ms_per_token": mean("ms_per_token"),
                "answer_rate": sum(answered) / len(answered) if answered else None}

    def _gen_len(self, prompt: dict) -> int:
        if prompt["answer"] is None:
            return self.cfg.gen_len
        return self.cfg.needle_gen_len or len(prompt["answer"]) + 1


def evaluate(target, draft, tokenizer, texts: list[str], cfg: EvalConfig, progress=None) -> dict:
    ev = Evaluator(target, draft, tokenizer, texts, cfg, progress)
    say = ev.progress
    t0 = time.perf_counter()
    top = max(cfg.contexts)
    main = cfg.tasks[0]
    lim = cfg.sweep_prompts
    out: dict = {"config": asdict(cfg)}

    say("table 1: acceptance by policy, task and context")
    out["table1"] = [dict(ev.point(task, ctx, policy=p), policy=p)
                     for task in cfg.tasks for ctx in cfg.contexts for p in cfg.policies]
    say(f"budget sweep ({main}, context {top})")
    out["budget"] = [dict(ev.point(main, top, lim, policy=p, budget=b), policy=p, budget=b)
                     for p in cfg.policies for b in cfg.budgets]
    say("chunk-size sweep (retrieval)")
    out["chunk_size"] = [dict(ev.point(main, top, lim, chunk_size=c), chunk_size=c)
                         for c in cfg.chunk_sizes if c <= cfg.budget]
    say("gamma2 sweep (retrieval drafting for the full cache)")
    out["gamma2"] = [dict(ev.point(main, top, lim, gamma2=g), gamma2=g) for g in cfg.gamma2s]
    if draft is not None:
        say("gamma1 sweep (triforce: small draft -> retrieval -> full)")
        out["gamma1"] = [dict(ev.point(main, top, lim, method="triforce", gamma1=g), gamma1=g)
                         for g in cfg.gamma1s]
    say("temperature sweep")
    out["temperature"] = [dict(ev.point(task, top, lim, policy=p, temperature=t), policy=p, temperature=t)
                          for task in cfg.tasks for p in cfg.policies for t in cfg.temperatures]
    say("speed: ar and triforce by context")
    methods = ["ar", "triforce"] if draft is not None else ["ar", "retrieval"]
    out["speed"] = [dict(ev.point(main, ctx, 1, method=m), method=m) for ctx in cfg.contexts for m in methods]
    out["runs"] = ev.runs
    out["wall_s"] = time.perf_counter() - t0
    return out


# ---------------------------------------------------------------------------------------------- output


def _f(x, fmt=".3f"):
    return "-" if x is None else format(x, fmt)


def markdown(res: dict, title: str = "tforce eval") -> str:
    cfg = res["config"]
    lines = [f"# {title}", "",
             f"Acceptance = middle level (policy cache of budget {cfg['budget']}, chunk {cfg['chunk_size']}) "
             f"drafting gamma2={cfg['gamma2']} tokens for the full cache, temperature {cfg['temperature']}, "
             f"top-p {cfg['top_p']}, {cfg['gen_len']} generated tokens per pg19 prompt and "
             f"{cfg.get('needle_gen_len') or 'the key + 1'} per needle prompt, cache re-selected every "
             f"{cfg['rebuild_every']} tokens; mean over prompts. "
             f"{res['runs']} runs in {res['wall_s']:.0f} s.", ""]
    policies, tasks, contexts = cfg["policies"], cfg["tasks"], cfg["contexts"]

    def table(header, rows):
        lines.extend(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)])
        lines.extend("| " + " | ".join(str(c) for c in r) + " |" for r in rows)
        lines.append("")

    def get(rows, **kv):
        return next((r for r in rows if all(r.get(k) == v for k, v in kv.items())), None)

    lines.append("## Acceptance by policy (Table 1)\n")
    def pm(r):
        return _f(r["acceptance"]) + ("" if r.get("acceptance_se") is None else f" ± {r['acceptance_se']:.3f}")

    def key_rate(t, c):  # share of needle runs (all policies) whose output starts with the key
        rates = [r["answer_rate"] for r in res["table1"]
                 if r["task"] == t and r["context"] == c and r.get("answer_rate") is not None]
        return _f(sum(rates) / len(rates), ".2f") if rates else "-"

    table(["task", "context"] + policies + ["key in output"],
          [[t, c] + [pm(get(res["table1"], task=t, context=c, policy=p)) for p in policies] + [key_rate(t, c)]
           for t in tasks for c in contexts])
    lines.append("(± = standard error of the mean over the prompts. key in output: share of the needle runs whose "
                 "generated text starts with the key, i.e. how often the target itself retrieves it; the same "
                 "for every policy up to sampling, since the output is exact.)\n")
    lines.append(f"## Budget sweep (Fig. 6a): acceptance / tokens per verification ({tasks[0]}, "
                 f"context {max(contexts)})\n")
    table(["budget"] + policies,
          [[b] + [f"{_f(r['acceptance'])} / {_f(r['tokens_per_verification'], '.2f')}"
                  for p in policies for r in [get(res["budget"], policy=p, budget=b)]]
           for b in cfg["budgets"]])
    lines.append("## Chunk size (Fig. 6b), retrieval policy\n")
    table(["chunk", "acceptance", "tokens/verification"],
          [[r["chunk_size"], _f(r["acceptance"]), _f(r["tokens_per_verification"], ".2f")] for r in res["chunk_size"]])
    lines.append("## gamma2 (retrieval drafts for the full cache)\n")
    table(["gamma2", "acceptance", "tokens/verification"],
          [[r["gamma2"], _f(r["acceptance"]), _f(r["tokens_per_verification"], ".2f")] for r in res["gamma2"]])
    if "gamma1" in res:
        lines.append(f"## gamma1 (triforce, gamma2={cfg['gamma2']})\n")
        table(["gamma1", "draft acceptance", "retrieval acceptance", "tokens/verification"],
              [[r["gamma1"], _f(r["draft_acceptance"]), _f(r["acceptance"]), _f(r["tokens_per_verification"], ".2f")]
               for r in res["gamma1"]])
    lines.append(f"## Temperature (Table 2), context {max(contexts)}\n")
    table(["task", "temperature"] + policies,
          [[t, T] + [pm(get(res["temperature"], task=t, policy=p, temperature=T)) for p in policies]
           for t in tasks for T in cfg["temperatures"]])
    lines.append("## Speed (Fig. 5), ms/token on this machine\n")
    methods = sorted({r["method"] for r in res["speed"]}, key=["ar", "triforce", "retrieval"].index)
    table(["context"] + methods, [[c] + [_f(get(res["speed"], context=c, method=m)["ms_per_token"], ".1f")
                                         for m in methods] for c in contexts])
    return "\n".join(lines)


def plots(res: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = res["config"]
    written = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out / name, dpi=80)
        plt.close(fig)
        written.append(name)

    # Table 1 as grouped bars: policy x (task, context)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    groups = [(t, c) for t in cfg["tasks"] for c in cfg["contexts"]]
    w = 0.8 / len(cfg["policies"])
    for i, p in enumerate(cfg["policies"]):
        ys = [next(r["acceptance"] or 0 for r in res["table1"] if r["policy"] == p and r["task"] == t
                   and r["context"] == c) for t, c in groups]
        ax.bar([g + i * w for g in range(len(groups))], ys, w, label=p)
    ax.set_xticks([g + 0.4 - w / 2 for g in range(len(groups))], [f"{t}\n{c}" for t, c in groups], fontsize=8)
    ax.set_ylabel("acceptance")
    ax.set_title(f"Acceptance by policy (budget {cfg['budget']})")
    ax.legend(fontsize=7)
    save(fig, "table1_policies.png")

    def sweep(rows, key, name, title, by_policy=False, extra=None):
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(7, 3))
        series = cfg["policies"] if by_policy else [None]
        for p in series:
            rs = [r for r in rows if p is None or r["policy"] == p]
            xs = [r[key] for r in rs]
            a1.plot(xs, [r["acceptance"] for r in rs], "o-", label=p or "retrieval")
            a2.plot(xs, [r["tokens_per_verification"] for r in rs], "o-", label=p or "retrieval")
            if extra:
                a1.plot(xs, [r[extra] for r in rs], "s--", label="draft (small model)")
        a1.set_xlabel(key), a2.set_xlabel(key)
        a1.set_ylabel("acceptance"), a2.set_ylabel("tokens / full verification")
        a1.legend(fontsize=7)
        fig.suptitle(title, fontsize=9)
        save(fig, name)

    sweep(res["budget"], "budget", "budget.png", "vs budget (Fig. 6a)", by_policy=True)
    sweep(res["chunk_size"], "chunk_size", "chunk_size.png", "vs chunk size, retrieval (Fig. 6b)")
    sweep(res["gamma2"], "gamma2", "gamma2.png", "vs gamma2, retrieval drafting")
    if "gamma1" in res:
        sweep(res["gamma1"], "gamma1", "gamma1.png", "vs gamma1, triforce", extra="draft_acceptance")
    fig, axes = plt.subplots(1, len(cfg["tasks"]), figsize=(3.5 * len(cfg["tasks"]), 3), squeeze=False)
    for ax, t in zip(axes[0], cfg["tasks"]):
        for p in cfg["policies"]:
            rs = [r for r in res["temperature"] if r["task"] == t and r["policy"] == p]
            ax.plot([r["temperature"] for r in rs], [r["acceptance"] for r in rs], "o-", label=p)
        ax.set_xlabel("temperature"), ax.set_ylabel("acceptance"), ax.set_title(t, fontsize=9)
    axes[0][0].legend(fontsize=7)
    save(fig, "temperature.png")
    fig, ax = plt.subplots(figsize=(4, 3))
    for m in sorted({r["method"] for r in res["speed"]}):
        rs = [r for r in res["speed"] if r["method"] == m]
        ax.plot([r["context"] for r in rs], [r["ms_per_token"] for r in rs], "o-", label=m)
    ax.set_xlabel("context (tokens)"), ax.set_ylabel("ms / token"), ax.set_title("Speed (Fig. 5)", fontsize=9)
    ax.legend(fontsize=7)
    save(fig, "speed.png")
    return written


def write(res: dict, out: Path, title: str = "tforce eval") -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "results.md").write_text(markdown(res, title) + "\n")
    return ["results.json", "results.md"] + plots(res, out)
