"""`tforce eval`: acceptance measurements of the middle level on real text, for any target/draft pair.

The quantity (TriForce's Table 1, Fig. 6, Table 2): the acceptance rate of the middle level's drafts
when they are verified by the full cache, i.e. generate(method="retrieval") stats["acceptance"]
["retrieval"], for each middle-cache policy (cache/policies.py) at the same budget. Speed (Fig. 5):
ms/token of ar and triforce by context length on this machine.

Prompts: "pg19" is the first N tokens of each book (bos + text); "needle" is tforce.text.needle's passkey
prompt of N tokens at depths 10%..90% (the fillers cycle over the books). Every run is seeded; a
result is the mean over prompts of the per-run acceptance and tokens per full verification. write puts
the results in a folder: JSON, and the Markdown report and figures of eval/report.py.

PARTS names the measurements; EvalConfig.parts runs a subset. EvalConfig.reuse_prefill prefills each prompt
once: the first run of a prompt saves its caches as a KV snapshot (snapshot/format.py) in a temporary folder and
every later run of it (another policy, budget, gamma...) loads them and prefills nothing; the output is the
same (exact either way), the time is that of one prefill per prompt, and the folder holds the full KV
cache of every prompt (context x layers x KV heads x head size x 2 x the dtype's bytes each) until the end.
"""
from __future__ import annotations

import hashlib
import json
import random
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..config import Speculation
from ..auto.chooser import generate
from .report import markdown, plots
from ..text.needle import needle_prompt, random_key

TASKS = ("pg19", "needle")
PARTS = ("table1", "budget", "chunk_size", "gamma2", "gamma1", "temperature", "speed")
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
    parts: list[str] = field(default_factory=lambda: list(PARTS))  # which measurements to run
    reuse_prefill: bool = False  # one prefill per prompt, its caches reused through a KV snapshot
    proposer: str = "model"  # triforce's bottom level: the draft model, or "lookup" (n-gram, no model)


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
    def __init__(self, target, draft, tokenizer, texts: list[str], cfg: EvalConfig, progress=None,
                 kv_dir: Path | None = None):
        self.target, self.draft, self.tok, self.texts, self.cfg = target, draft, tokenizer, texts, cfg
        self.progress = progress or (lambda line: None)
        self.kv_dir = kv_dir  # where reuse_prefill's snapshots go (None: every run prefills)
        self._prompts: dict = {}
        self.runs = 0
        self.prefills = 0  # runs that prefilled their prompt (all of them without kv_dir)

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
        draft = self.draft if Speculation(method=method, proposer=c.proposer).uses_draft else None
        kv = self._snapshot(ids)
        r = generate(self.target, ids, draft=draft, proposer=c.proposer,
                     method=method, policy=policy, max_new_tokens=gen_len or c.gen_len, top_p=c.top_p, seed=c.seed,
                     ignore_eos=True, sinks=c.sinks, draft_budget=c.draft_budget, rebuild_every=c.rebuild_every,
                     cuda_graphs=False, **kv, **kw)
        self.runs += 1
        self.prefills += "load_kv" not in kv
        s = r.stats
        return {"acceptance": s["acceptance"]["retrieval"], "draft_acceptance": s["acceptance"]["draft"],
                "tokens_per_verification": s["tokens_per_verification"], "ms_per_token": s["ms_per_token"],
                "tokens": r.tokens}

    def _snapshot(self, ids) -> dict:
        """generate's save_kv (the prompt's first run) or load_kv (a later one); {} without kv_dir. One
        snapshot per prompt: a run of another method feeds the caches the snapshot lacks (a draft's)."""
        if self.kv_dir is None:
            return {}
        h = hashlib.sha256(json.dumps(list(map(int, ids))).encode()).hexdigest()[:24]
        folder = self.kv_dir / h
        return {"load_kv": folder} if folder.is_dir() else {"save_kv": folder}

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
    if not cfg.reuse_prefill:
        return _evaluate(Evaluator(target, draft, tokenizer, texts, cfg, progress))
    with tempfile.TemporaryDirectory(prefix="tforce-eval-kv-") as tmp:
        return _evaluate(Evaluator(target, draft, tokenizer, texts, cfg, progress, kv_dir=Path(tmp)))


def _evaluate(ev: Evaluator) -> dict:
    cfg = ev.cfg
    drafts = ev.draft is not None or cfg.proposer == "lookup"  # triforce has a bottom level
    say = ev.progress
    t0 = time.perf_counter()
    top = max(cfg.contexts)
    main = cfg.tasks[0]
    lim = cfg.sweep_prompts
    out: dict = {"config": asdict(cfg)}

    parts = set(cfg.parts)
    if "table1" in parts:
        say("table 1: acceptance by policy, task and context")
        out["table1"] = [dict(ev.point(task, ctx, policy=p), policy=p)
                         for task in cfg.tasks for ctx in cfg.contexts for p in cfg.policies]
    if "budget" in parts:
        say(f"budget sweep ({main}, context {top})")
        out["budget"] = [dict(ev.point(main, top, lim, policy=p, budget=b), policy=p, budget=b)
                         for p in cfg.policies for b in cfg.budgets]
    if "chunk_size" in parts:
        say("chunk-size sweep (retrieval)")
        out["chunk_size"] = [dict(ev.point(main, top, lim, chunk_size=c), chunk_size=c)
                             for c in cfg.chunk_sizes if c <= cfg.budget]
    if "gamma2" in parts:
        say("gamma2 sweep (retrieval drafting for the full cache)")
        out["gamma2"] = [dict(ev.point(main, top, lim, gamma2=g), gamma2=g) for g in cfg.gamma2s]
    if drafts and "gamma1" in parts:
        say(f"gamma1 sweep (triforce: {'lookup' if ev.draft is None else 'small draft'} -> retrieval -> full)")
        out["gamma1"] = [dict(ev.point(main, top, lim, method="triforce", gamma1=g), gamma1=g)
                         for g in cfg.gamma1s]
    if "temperature" in parts:
        say("temperature sweep")
        out["temperature"] = [dict(ev.point(task, top, lim, policy=p, temperature=t), policy=p, temperature=t)
                              for task in cfg.tasks for p in cfg.policies for t in cfg.temperatures]
    if "speed" in parts:
        say("speed: ar and triforce by context")
        methods = ["ar", "triforce"] if drafts else ["ar", "retrieval"]
        out["speed"] = [dict(ev.point(main, ctx, 1, method=m), method=m) for ctx in cfg.contexts for m in methods]
    out["runs"] = ev.runs
    out["prefills"] = ev.prefills
    out["wall_s"] = time.perf_counter() - t0
    return out


# ---------------------------------------------------------------------------------------------- output


def write(res: dict, out: Path, title: str = "tforce eval") -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    (out / "results.md").write_text(markdown(res, title) + "\n")
    return ["results.json", "results.md"] + plots(res, out)
