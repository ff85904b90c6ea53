"""`tforce eval`'s results (evaluate.evaluate's dict) as a Markdown report, the paper's tables (Table 1,
Fig. 5/6, Table 2), and as PNG figures of the same; evaluate.write puts both in the --out folder.
"""
from __future__ import annotations

from pathlib import Path


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
             f"{res['runs']} runs in {res['wall_s']:.0f} s"
             + (f" ({res['prefills']} of them prefilled their prompt; the others reused its KV cache)"
                if res.get("prefills") not in (None, res["runs"]) else "") + ".", ""]
    policies, tasks, contexts = cfg["policies"], cfg["tasks"], cfg["contexts"]

    def table(header, rows):
        lines.extend(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)])
        lines.extend("| " + " | ".join(str(c) for c in r) + " |" for r in rows)
        lines.append("")

    def get(rows, **kv):
        return next((r for r in rows if all(r.get(k) == v for k, v in kv.items())), None)

    def pm(r):
        return _f(r["acceptance"]) + ("" if r.get("acceptance_se") is None else f" ± {r['acceptance_se']:.3f}")

    def key_rate(t, c):  # share of needle runs (all policies) whose output starts with the key
        rates = [r["answer_rate"] for r in res["table1"]
                 if r["task"] == t and r["context"] == c and r.get("answer_rate") is not None]
        return _f(sum(rates) / len(rates), ".2f") if rates else "-"

    if "table1" in res:
        lines.append("## Acceptance by policy (Table 1)\n")
        table(["task", "context"] + policies + ["key in output"],
              [[t, c] + [pm(get(res["table1"], task=t, context=c, policy=p)) for p in policies] + [key_rate(t, c)]
               for t in tasks for c in contexts])
        lines.append("(± = standard error of the mean over the prompts. key in output: share of the needle runs "
                     "whose generated text starts with the key, i.e. how often the target itself retrieves it; the "
                     "same for every policy up to sampling, since the output is exact.)\n")
    if "budget" in res:
        lines.append(f"## Budget sweep (Fig. 6a): acceptance / tokens per verification ({tasks[0]}, "
                     f"context {max(contexts)})\n")
        table(["budget"] + policies,
              [[b] + [f"{_f(r['acceptance'])} / {_f(r['tokens_per_verification'], '.2f')}"
                      for p in policies for r in [get(res["budget"], policy=p, budget=b)]]
               for b in cfg["budgets"]])
    if "chunk_size" in res:
        lines.append("## Chunk size (Fig. 6b), retrieval policy\n")
        table(["chunk", "acceptance", "tokens/verification"],
              [[r["chunk_size"], _f(r["acceptance"]), _f(r["tokens_per_verification"], ".2f")]
               for r in res["chunk_size"]])
    if "gamma2" in res:
        lines.append("## gamma2 (retrieval drafts for the full cache)\n")
        table(["gamma2", "acceptance", "tokens/verification"],
              [[r["gamma2"], _f(r["acceptance"]), _f(r["tokens_per_verification"], ".2f")] for r in res["gamma2"]])
    if "gamma1" in res:
        lines.append(f"## gamma1 (triforce, gamma2={cfg['gamma2']})\n")
        table(["gamma1", "draft acceptance", "retrieval acceptance", "tokens/verification"],
              [[r["gamma1"], _f(r["draft_acceptance"]), _f(r["acceptance"]), _f(r["tokens_per_verification"], ".2f")]
               for r in res["gamma1"]])
    if "temperature" in res:
        lines.append(f"## Temperature (Table 2), context {max(contexts)}\n")
        table(["task", "temperature"] + policies,
              [[t, T] + [pm(get(res["temperature"], task=t, policy=p, temperature=T)) for p in policies]
               for t in tasks for T in cfg["temperatures"]])
    if "speed" in res:
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
    bottom = "n-gram lookup" if cfg.get("proposer") == "lookup" else "draft (small model)"  # the gamma1 sweep's

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(out / name, dpi=80)
        plt.close(fig)
        written.append(name)

    if "table1" in res:  # Table 1 as grouped bars: policy x (task, context)
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
                a1.plot(xs, [r[extra] for r in rs], "s--", label=bottom)
        a1.set_xlabel(key), a2.set_xlabel(key)
        a1.set_ylabel("acceptance"), a2.set_ylabel("tokens / full verification")
        a1.legend(fontsize=7)
        fig.suptitle(title, fontsize=9)
        save(fig, name)

    if "budget" in res:
        sweep(res["budget"], "budget", "budget.png", "vs budget (Fig. 6a)", by_policy=True)
    if "chunk_size" in res:
        sweep(res["chunk_size"], "chunk_size", "chunk_size.png", "vs chunk size, retrieval (Fig. 6b)")
    if "gamma2" in res:
        sweep(res["gamma2"], "gamma2", "gamma2.png", "vs gamma2, retrieval drafting")
    if "gamma1" in res:
        sweep(res["gamma1"], "gamma1", "gamma1.png", "vs gamma1, triforce", extra="draft_acceptance")
    if "temperature" in res:
        fig, axes = plt.subplots(1, len(cfg["tasks"]), figsize=(3.5 * len(cfg["tasks"]), 3), squeeze=False)
        for ax, t in zip(axes[0], cfg["tasks"]):
            for p in cfg["policies"]:
                rs = [r for r in res["temperature"] if r["task"] == t and r["policy"] == p]
                ax.plot([r["temperature"] for r in rs], [r["acceptance"] for r in rs], "o-", label=p)
            ax.set_xlabel("temperature"), ax.set_ylabel("acceptance"), ax.set_title(t, fontsize=9)
        axes[0][0].legend(fontsize=7)
        save(fig, "temperature.png")
    if "speed" in res:
        fig, ax = plt.subplots(figsize=(4, 3))
        for m in sorted({r["method"] for r in res["speed"]}):
            rs = [r for r in res["speed"] if r["method"] == m]
            ax.plot([r["context"] for r in rs], [r["ms_per_token"] for r in rs], "o-", label=m)
        ax.set_xlabel("context (tokens)"), ax.set_ylabel("ms / token"), ax.set_title("Speed (Fig. 5)", fontsize=9)
        ax.legend(fontsize=7)
        save(fig, "speed.png")
    return written
