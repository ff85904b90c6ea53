"""ar vs triforce on this CPU for a demo target and its MHA variant (every KV head duplicated), with
the memory floor of each figure: bytes each level's step reads / the measured memory read rate.

The MHA variant: k_proj and v_proj output rows repeated per query group, num_key_value_heads set to
num_attention_heads. Query head j of the original attends with KV head j // group (transformers'
repeat_kv and attention.fold_heads agree), so repeating each KV head `group` times in place (head h becomes
heads h*group ... h*group + group - 1) computes the same function with `group` times the KV cache. The
full cache and ar are the same function; the retrieval cache chooses chunks per KV head by the sum of
its group's queries (retrieval.chunk_scores), so under a budget smaller than the context the variant
chooses per query head and the middle level's acceptance may differ.

    python scripts/cpu_kv_bench.py --models models --out benchmarks/cpu
    python scripts/cpu_kv_bench.py --models models --profile-only   # the profile at the longest length

Writes DATE_cpu_kv_bench.json and .md under --out.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import tforce  # noqa: E402
from tforce.engine import generate as engine  # noqa: E402
from tforce.engine.decode import decode as decode_rows  # noqa: E402
from tforce.cache import FullCache, RetrievalCache, StreamingCache  # noqa: E402
from tforce.config import RunConfig, Sampling  # noqa: E402
from tforce.cache.rope import Rotary  # noqa: E402
from tforce.engine.sampling import to_probs  # noqa: E402

BOOKS = ROOT.parent / "shared" / "data" / "books"
# (label, generate options): `tforce run`'s defaults, then budgets small enough to matter at 1K-4K tokens
METHODS = (("ar", dict(method="ar")), ("triforce", dict(method="triforce")),
           ("triforce b1024", dict(method="triforce", budget=1024)),
           ("triforce b512", dict(method="triforce", budget=512)))
# --what-if, at the longest length only: without top-p (no vocabulary sort per distribution; another
# distribution, so against ar without top-p), and longer speculation (fewer full verifications per token)
WHAT_IF = (("ar top-p 1", dict(method="ar", top_p=1.0)),
           ("triforce b512 top-p 1", dict(method="triforce", budget=512, top_p=1.0)),
           ("triforce b512 g1=3 g2=12", dict(method="triforce", budget=512, gamma1=3, gamma2=12)))


def baseline(label: str) -> str:
    """The ar run a method is compared with: the one with the same top-p."""
    return "ar top-p 1" if label.endswith("top-p 1") else "ar"


# --------------------------------------------------------------------------------------- the variant


def duplicate_kv_heads(state: dict, n_heads: int, n_kv: int, head_dim: int) -> dict:
    """The state dict with every k_proj/v_proj weight (and bias) repeated per query group: rows of KV head
    h, (head_dim, ...), become those of heads h*group ... h*group + group - 1."""
    group = n_heads // n_kv
    out = {}
    for name, t in state.items():
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            heads = t.reshape(n_kv, head_dim, *t.shape[1:])
            t = heads.repeat_interleave(group, dim=0).reshape(n_heads * head_dim, *t.shape[1:]).contiguous()
        out[name] = t
    return out


def write_mha_variant(src: Path, dst: Path) -> Path:
    """A copy of the checkpoint folder `src` in `dst` with num_key_value_heads = num_attention_heads."""
    config = json.loads((src / "config.json").read_text())
    n_heads, n_kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_heads
    dst.mkdir(parents=True, exist_ok=True)
    state = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(str(f)))
    save_file(duplicate_kv_heads(state, n_heads, n_kv, head_dim), str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    config["num_key_value_heads"] = n_heads
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, dst / f.name)
    return dst


# ---------------------------------------------------------------------------------------- bandwidth


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])  # the first is warm-up


def read_rates(threads: int, dram_bytes: int = 512 * 2**20, cache_bytes: int = 8 * 2**20) -> dict:
    """GB/s (1e9 bytes/s) of torch.sum over a float32 tensor on `threads` threads: a 512 MiB one (memory,
    far beyond the 32 MiB L3) and an 8 MiB one summed 16 times (L2/L3-resident); and a 512 MiB copy
    (bytes read + written)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        big = torch.ones(dram_bytes // 4)
        dst = torch.empty_like(big)
        small = torch.ones(cache_bytes // 4)
        return {
            "dram_read_gbps": dram_bytes / _median_s(big.sum, 5) / 1e9,
            "dram_copy_gbps": 2 * dram_bytes / _median_s(lambda: dst.copy_(big), 5) / 1e9,
            "cache_read_gbps": 16 * cache_bytes / _median_s(lambda: [small.sum() for _ in range(16)], 5) / 1e9,
            "how": f"torch.sum of float32 tensors on {threads} thread(s), median of 5 after a warm-up: "
                   f"{dram_bytes >> 20} MiB (dram_read), {cache_bytes >> 20} MiB x 16 (cache_read); "
                   f"dram_copy: {dram_bytes >> 20} MiB copy_, read + written bytes",
        }
    finally:
        torch.set_num_threads(old)


# ------------------------------------------------------------------------------------------ bytes


def weight_bytes(model) -> int:
    """Parameter bytes a forward reads: all but the input embedding (it reads one row per token)."""
    emb = model.model.embed_tokens.weight
    seen = {p.data_ptr(): p.nbytes for p in model.parameters()}
    tied = model.lm_head.weight.data_ptr() == emb.data_ptr()
    return sum(seen.values()) - (0 if tied else emb.nbytes)


def kv_token_bytes(model) -> int:
    """K + V of one token over all layers."""
    p = next(model.parameters())
    return 2 * len(model.model.layers) * model.n_kv_heads * model.head_dim * p.element_size()


def step_bytes(target, draft, context: int, budget: int, draft_budget: int) -> dict:
    """Bytes one forward of each node reads at `context` tokens: its weights and the KV its view spans
    (the full cache: the context; the retrieval cache: its whole budget buffer, masked; the draft's
    streaming cache: sinks + window, at most the context)."""
    return {"full": weight_bytes(target) + kv_token_bytes(target) * context,
            "retrieval": weight_bytes(target) + kv_token_bytes(target) * budget,
            "draft": weight_bytes(draft) + kv_token_bytes(draft) * min(context, draft_budget)}


def bytes_per_token(forwards: dict, tokens: int, per_step: dict) -> float:
    """Bytes read per generated token by the forwards actually run (rebuilds not counted)."""
    return sum(n * per_step[name] for name, n in forwards.items()) / tokens


# ------------------------------------------------------------------------------------------- runs


def book_ids(tokenizer, n: int, book: str, skip_chars: int = 20000) -> list[int]:
    """n tokens of a held-out book, after its first skip_chars characters (front matter)."""
    text = (BOOKS / f"{book}.txt").read_text(encoding="utf-8")[skip_chars:]
    ids = tokenizer.encode(text[: 8 * n + 1000])
    if len(ids) < n:
        raise SystemExit(f"{book}: fewer than {n} tokens after {skip_chars} characters")
    return ids[:n]


def one_run(target, draft, ids: list[int], options: dict, gen: int, temperature: float) -> dict:
    opts = {"top_p": 0.9, **options}
    method = opts.pop("method")
    out = tforce.generate(target, ids, draft=draft if method != "ar" else None, method=method,
                          max_new_tokens=gen, temperature=temperature, seed=0, ignore_eos=True, **opts)
    s = out.stats
    return {"ms_per_token": s["ms_per_token"], "tokens": len(out.tokens), "prefill_s": s["prefill_s"],
            "decode_s": s["decode_s"], "acceptance": s["acceptance"],
            "tokens_per_verification": s["tokens_per_verification"], "forwards": s["forwards"],
            "rebuilds": s["rebuilds"], "rebuild_s": s["rebuild_s"], "output": out.tokens}


def others_running() -> list[str]:
    """Other processes using CPU now (ps, highest first), for the record."""
    try:
        ps = subprocess.run(["ps", "-eo", "pid,pcpu,etime,args", "--sort=-pcpu"], capture_output=True, text=True,
                            timeout=10).stdout.splitlines()[1:8]
    except OSError:
        return []
    rows = [line.split(None, 1) for line in ps]
    return [" ".join(rest.split())[:160] for pid, rest in rows if int(pid) != os.getpid() and float(rest.split()[0]) >= 5]


def measure(models: dict, draft, tokenizer, args) -> list[dict]:
    """Every (length, temperature, model, method) once per repeat, interleaved so that the shared
    machine's slow spells fall on all of them alike."""
    prompts = {n: book_ids(tokenizer, n, args.book) for n in args.lengths}
    for name, target in models.items():  # warm-up: one-time costs land in no timed run
        for _, options in METHODS:
            one_run(target, draft, prompts[args.lengths[0]][:256], options, 4, 0.6)
    records = []
    for rep in range(args.repeats):
        for n in args.lengths:
            gen = min(args.gen, 4096 - n)
            for temperature in args.temperatures:
                for name, target in models.items():
                    methods = METHODS + (WHAT_IF if args.what_if and n == max(args.lengths) and temperature else ())
                    for label, options in methods:
                        r = one_run(target, draft, prompts[n], options, gen, temperature)
                        records.append({"repeat": rep, "prompt": n, "temperature": temperature, "model": name,
                                        "method": label, "budget": options.get("budget", 4096), **r})
                        print(f"rep {rep} {n:5d} t={temperature} {name:4s} {label:15s} "
                              f"{r['ms_per_token']:6.2f} ms/token", file=sys.stderr, flush=True)
    return records


def summarize(records: list[dict], models: dict, draft, rates: dict, gen: int) -> list[dict]:
    """Per (prompt, temperature, model, method): the median ms/token of the repeats beside its floor."""
    groups: dict = {}
    for r in records:
        groups.setdefault((r["prompt"], r["temperature"], r["model"], r["method"]), []).append(r)
    rows = []
    for (n, temperature, name, label), runs in groups.items():
        first = runs[0]
        target = models[name]
        context = n + first["tokens"] // 2  # mean context over the decode
        per_step = step_bytes(target, draft, context, first["budget"], 256)
        per_token = bytes_per_token(first["forwards"], first["tokens"], per_step)
        ms = statistics.median(r["ms_per_token"] for r in runs)
        floor = 1000 * per_token / (rates["dram_read_gbps"] * 1e9)
        rows.append({"prompt": n, "temperature": temperature, "model": name, "method": label,
                     "budget": first["budget"], "ms_per_token": ms, "ms_per_token_runs": [r["ms_per_token"] for r in runs],
                     "acceptance": first["acceptance"], "tokens_per_verification": first["tokens_per_verification"],
                     "forwards_per_token": {k: v / first["tokens"] for k, v in first["forwards"].items()},
                     "rebuilds": first["rebuilds"], "same_tokens_every_repeat": all(r["output"] == first["output"] for r in runs),
                     "step_bytes": {k: per_step[k] for k in first["forwards"]}, "bytes_per_token": per_token,
                     "floor_ms_per_token": floor, "measured_over_floor": ms / floor})
    for row in rows:
        ar = next(r for r in rows if (r["prompt"], r["temperature"], r["model"], r["method"]) ==
                  (row["prompt"], row["temperature"], row["model"], baseline(row["method"])))
        row["ratio_vs_ar"] = row["ms_per_token"] / ar["ms_per_token"]
        row["floor_ratio_vs_ar"] = row["floor_ms_per_token"] / ar["floor_ms_per_token"]
    order = [m for m, _ in METHODS + WHAT_IF]
    return sorted(rows, key=lambda r: (r["prompt"], r["temperature"], r["model"], order.index(r["method"])))


# ------------------------------------------------------------------------------ forward costs


def _forward_ms(model, cache, T: int, repeats: int = 21) -> float:
    """Median ms of a forward of T tokens (logits of all T) that commits nothing, so every one is alike."""
    ids = torch.randint(3, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(0))

    def step():
        cache.begin(T)
        model(ids, cache, last_n=T)
        cache.commit(0)

    return 1000 * _median_s(step, repeats)


def _filled(model, ids: list[int], capacity: int = 4096):
    cfg = model.config
    cache = FullCache(cfg.num_hidden_layers, model.n_kv_heads, model.head_dim, capacity,
                      Rotary(cfg, max_len=capacity))
    for start in range(0, len(ids), 512):
        chunk = torch.tensor(ids[start:start + 512])[None]
        cache.begin(chunk.shape[1])
        model(chunk, cache, last_n=0)
        cache.commit(chunk.shape[1])
    return cache


def forward_costs(models: dict, draft, ids: list[int], lengths: list[int], budget: int) -> dict:
    """ms per forward as each level runs it, outside the loop: the target over a full cache of 16 tokens
    (what a forward costs with almost no KV: weights and per-operator overhead) and of each length
    (T = 1 as ar, T = 7 as a full verification of gamma2 = 6), over a retrieval cache of `budget` slots
    at the longest length (T = 3: gamma1 = 2); the draft over its 256-slot streaming cache (T = 1); and
    turning 3 rows of logits into probabilities (top-p 0.9: a sort of the vocabulary per row)."""
    out = {}
    for name, model in models.items():
        row = {"full T=1 at 16": _forward_ms(model, _filled(model, ids[:16]), 1)}
        for n in sorted(lengths):  # the last cache, the longest, is the retrieval cache's source
            cache = _filled(model, ids[:n])
            row[f"full T=1 at {n}"] = _forward_ms(model, cache, 1)
            row[f"full T=7 at {n}"] = _forward_ms(model, cache, 7)
        cfg = model.config
        retrieval = RetrievalCache(cfg.num_hidden_layers, model.n_kv_heads, model.head_dim, budget, 8,
                                   cache.rotary)
        retrieval.rebuild(cache, [torch.randn(cfg.num_attention_heads, model.head_dim,
                                              generator=torch.Generator().manual_seed(i))
                                  for i in range(cfg.num_hidden_layers)])
        row[f"retrieval {budget} T=3 at {max(lengths)}"] = _forward_ms(model, retrieval, 3)
        out[name] = row
    dcfg = draft.config
    stream = StreamingCache(dcfg.num_hidden_layers, draft.n_kv_heads, draft.head_dim, budget=256, sinks=16,
                            rotary=Rotary(dcfg, max_len=4096), max_rollback=10, max_new=266)
    prompt = torch.tensor(ids[:256])[None]
    stream.begin(256)
    draft(prompt, stream, last_n=0)
    stream.commit(256)
    out["draft"] = {"streaming 256 T=1": _forward_ms(draft, stream, 1)}
    logits = torch.randn(3, models["gqa"].config.vocab_size, generator=torch.Generator().manual_seed(0))
    out["to_probs (3 rows)"] = {f"t=0.6 top-p {p}": 1000 * _median_s(lambda: to_probs(logits, Sampling(0.6, p)), 21)
                                for p in (0.9, 1.0)}
    return out


# ---------------------------------------------------------------------------------------- profile


class Timed:
    """Wraps a callable, adding its wall time and call count. CPU only: on CUDA the time would need a
    synchronisation around the call (kernels run asynchronously), which this does not do."""

    def __init__(self, fn, label: str, totals: dict):
        self.fn, self.label, self.totals = fn, label, totals

    def __call__(self, *a, **k):
        t0 = time.perf_counter()
        with torch.profiler.record_function(self.label):
            out = self.fn(*a, **k)
        s, n = self.totals.get(self.label, (0.0, 0))
        self.totals[self.label] = (s + time.perf_counter() - t0, n + 1)
        return out


def profile(target, draft, ids: list[int], options: dict, gen: int, temperature: float, top_ops: int = 18) -> dict:
    """Where one decode's time goes: per node, its forwards (node.runner) and the rest of node.probs
    (catch-up, truncation, logits -> probabilities); retrieval rebuilds; the remainder (drafting's
    sampling and host syncs, verification, the levels' Python). Timers wrap those objects of the session
    from outside; then the same decode again under torch.profiler for the operator table."""
    def session_with_timers(totals: dict):
        opts = {**options}
        method = opts.pop("method")
        s = engine.open_session(target, draft, len(ids), gen,
                                RunConfig.of(method=method, temperature=temperature, seed=0, **opts))
        s.prefill([ids])
        for node in (s.small, s.middle, s.full):
            if node is not None:
                node.runner = Timed(node.runner, f"{node.name} forward", totals)
                node.probs = Timed(node.probs, f"{node.name} probs", totals)
        if s.retrieval is not None:
            s._rebuild = Timed(s._rebuild, "rebuild", totals)
        return s

    def decode(s):
        t0 = time.perf_counter()
        [out] = decode_rows(s, [len(ids)], [gen], engine.generator(target, 0), set())
        return out, time.perf_counter() - t0

    totals: dict = {}
    out, wall = decode(session_with_timers(totals))
    parts = {}
    for label, (sec, n) in totals.items():
        if label.endswith(" probs"):
            fwd = totals[label.replace(" probs", " forward")][0]
            parts[label.replace(" probs", " probs minus forward")] = {"s": sec - fwd, "calls": n}
        else:
            parts[label] = {"s": sec, "calls": n}
    accounted = sum(p["s"] for p in parts.values())
    parts["rest (sampling, verify, host syncs, level Python)"] = {"s": wall - accounted, "calls": None}
    for p in parts.values():
        p["ms_per_token"] = 1000 * p["s"] / len(out)
        p["ms_per_call"] = 1000 * p["s"] / p["calls"] if p["calls"] else None
    s2 = session_with_timers({})
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        decode(s2)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top_ops)
    return {"wall_s": wall, "tokens": len(out), "ms_per_token": 1000 * wall / len(out), "parts": parts,
            "operators": table}


# --------------------------------------------------------------------------------------- markdown


def _mb(x: float) -> str:
    return f"{x / 1e6:.1f}"


def _procs(lines) -> str:
    return "; ".join(" ".join(line.split()) for line in lines or []) or "none"


def markdown(record: dict) -> str:
    rates = record["bandwidth"]
    lines = [f"# ar vs triforce on a 2-core CPU: demo target (GQA) and its MHA variant ({record['date']})", "",
             f"Machine: {record['machine']}; torch {record['torch']}; {record['threads']} thread; float32.",
             f"Command: `{record['command']}`", "",
             f"Prompts: {record['book']} (held out), {record['gen']} new tokens (fewer where 4096 would be passed), "
             f"top-p 0.9, seed 0, EOS ignored; {record['repeats']} interleaved repeats, median ms/token.",
             f"Memory read rate ({rates['how']}): {rates['dram_read_gbps']:.1f} GB/s from memory, "
             f"{rates['cache_read_gbps']:.1f} GB/s from cache; copy {rates['dram_copy_gbps']:.1f} GB/s.",
             "Floor = bytes read per generated token / the memory read rate; bytes per token = sum over nodes of "
             "(forwards per token x bytes per forward), the forwards counted in the run; bytes per forward = the "
             "weights it reads (all but the input embedding) + the KV its view spans (full: the context; retrieval: "
             "the whole budget buffer; draft: 256 slots). Rebuilds are not counted.", "",
             f"Other processes using >= 5% CPU (ps: %CPU, elapsed, command) at the start: "
             f"{_procs(record.get('others_running_at_start'))}; at the end: {_procs(record.get('others_running_at_end'))}.",
             "",
             f"Weights read per forward: target {_mb(record['weights']['target'])} MB (MHA variant "
             f"{_mb(record['weights']['target_mha'])} MB: k_proj and v_proj doubled), draft "
             f"{_mb(record['weights']['draft'])} MB; KV per token: GQA {record['kv_token_bytes']['gqa']} B, "
             f"MHA {record['kv_token_bytes']['mha']} B.",
             f"Greedy ar tokens, MHA variant vs original, equal per prompt length: {record.get('greedy_ar_equal')}.",
             "",
             "| prompt | t | model | method | ms/token (runs) | / ar | floor ms/token (/ ar) | measured / floor "
             "| accept draft | accept middle | tokens / full verif | forwards per token d/m/f | rebuilds "
             "| MB per forward d/m/f |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(x, fmt="{:.2f}"):
        return "-" if x is None else fmt.format(x)

    for r in record["summary"]:
        fw, sb = r["forwards_per_token"], r["step_bytes"]
        runs = ", ".join(f"{x:.2f}" for x in r["ms_per_token_runs"])
        lines.append(
            f"| {r['prompt']} | {r['temperature']} | {r['model']} | {r['method']} | {r['ms_per_token']:.2f} ({runs}) "
            f"| {r['ratio_vs_ar']:.2f} | {r['floor_ms_per_token']:.2f} ({r['floor_ratio_vs_ar']:.2f}) "
            f"| {r['measured_over_floor']:.1f} | {f(r['acceptance']['draft'], '{:.0%}')} "
            f"| {f(r['acceptance']['retrieval'], '{:.0%}')} | {f(r['tokens_per_verification'])} "
            f"| {'/'.join(f(fw.get(k)) for k in ('draft', 'retrieval', 'full'))} | {f(r['rebuilds'], '{}')} "
            f"| {'/'.join(_mb(sb[k]) if k in sb else '-' for k in ('draft', 'retrieval', 'full'))} |")
    costs = record.get("forward_costs")
    if costs:
        lines += ["", "## ms per forward, each level's forward alone (median of 21)", "",
                  "| model | forward | ms |", "|---|---|---|"]
        lines += [f"| {name} | {what} | {ms:.2f} |" for name, row in costs.items() for what, ms in row.items()]
    prof = record.get("profile")
    if prof:
        lines += ["", f"## Profile: {prof['what']}", "",
                  f"Decode {prof['wall_s']:.2f} s for {prof['tokens']} tokens = {prof['ms_per_token']:.2f} ms/token "
                  "(timers around the session's objects from outside; the model is not touched).", "",
                  "| part | s | calls | ms per call | ms per token |", "|---|---|---|---|---|"]
        for label, p in prof["parts"].items():
            lines.append(f"| {label} | {p['s']:.3f} | {f(p['calls'], '{}')} | {f(p['ms_per_call'])} "
                         f"| {p['ms_per_token']:.2f} |")
        lines += ["", "Operators (torch.profiler, the same decode again, by self CPU time):", "", "```",
                  prof["operators"].rstrip(), "```"]
        if prof.get("ar"):
            lines += ["", f"ar at the same length: {prof['ar']['ms_per_token']:.2f} ms/token; parts: " + ", ".join(
                f"{k} {p['ms_per_call']:.2f} ms/call" for k, p in prof["ar"]["parts"].items() if p["calls"])]
    if record.get("analysis"):
        lines += ["", "## Analysis", "", record["analysis"].strip()]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------- main


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=str(ROOT / "models"), help="folder holding demo-target and demo-draft")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "cpu"))
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 3900])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.6])
    ap.add_argument("--gen", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--book", default="war_and_peace")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--what-if", action="store_true", help="also WHAT_IF's runs at the longest length, t > 0")
    ap.add_argument("--profile-only", action="store_true", help="only the profile (at the longest length)")
    ap.add_argument("--profile-budget", type=int, default=512)
    ap.add_argument("--analysis", default=None, help="a markdown file appended to the report as its analysis")
    ap.add_argument("--render", default=None, metavar="JSON",
                    help="measure nothing: write the .md beside this record again (with --analysis, stored in it)")
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    args = ap.parse_args(argv)
    if args.render:
        path = Path(args.render)
        record = json.loads(path.read_text())
        if args.analysis:
            record["analysis"] = Path(args.analysis).read_text()
            path.write_text(json.dumps(record, indent=1) + "\n")
        path.with_suffix(".md").write_text(markdown({"summary": [], **record}))
        return record
    torch.set_num_threads(args.threads)
    src = Path(args.models)
    started = time.time()
    before = others_running()
    rates = read_rates(args.threads)
    print(f"memory read {rates['dram_read_gbps']:.1f} GB/s, cache {rates['cache_read_gbps']:.1f} GB/s",
          file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        variant = write_mha_variant(src / "demo-target", Path(tmp) / "demo-target-mha")
        gqa = tforce.load_model(str(src / "demo-target"))
        models = {"gqa": gqa.model, "mha": tforce.load_model(str(variant), tokenizer=False).model}
    draft = tforce.load_model(str(src / "demo-draft"), tokenizer=False).model
    record = {"date": args.date, "command": "python " + " ".join(["scripts/cpu_kv_bench.py"] + sys.argv[1:]),
              "machine": f"2-core CPU container ({platform.processor() or platform.machine()}, "
                         f"{os.cpu_count()} logical CPUs, 32 MiB L3)",
              "torch": torch.__version__, "threads": args.threads, "models": str(src), "book": args.book,
              "gen": args.gen, "repeats": args.repeats, "bandwidth": rates,
              "weights": {"target": weight_bytes(models["gqa"]), "target_mha": weight_bytes(models["mha"]),
                          "draft": weight_bytes(draft)},
              "kv_token_bytes": {k: kv_token_bytes(m) for k, m in models.items()},
              "others_running_at_start": before}
    if not args.profile_only:
        records = measure(models, draft, gqa.tokenizer, args)
        record["summary"] = summarize(records, models, draft, rates, args.gen)
        greedy_ar = {}
        for r in records:
            if r["method"] == "ar" and r["temperature"] == 0 and r["repeat"] == 0:
                greedy_ar.setdefault(r["prompt"], {})[r["model"]] = r["output"]
        record["greedy_ar_equal"] = {n: o["gqa"] == o["mha"] for n, o in greedy_ar.items()}
        record["runs"] = [{k: v for k, v in r.items() if k != "output"} for r in records]
    n = max(args.lengths)
    ids = book_ids(gqa.tokenizer, n, args.book)
    record["forward_costs"] = forward_costs(models, draft, ids, args.lengths, args.profile_budget)
    gen = min(args.gen, 4096 - n)
    options = dict(method="triforce", budget=args.profile_budget)
    prof = profile(models["mha"], draft, ids, options, gen, 0.6)
    prof["what"] = f"MHA variant, triforce budget {args.profile_budget}, {n} prompt tokens, {gen} new, t=0.6"
    prof["ar"] = profile(models["mha"], None, ids, dict(method="ar"), gen, 0.6, top_ops=0)
    prof["ar"].pop("operators")
    record["profile"] = prof
    record["others_running_at_end"] = others_running()
    record["wall_s"] = time.time() - started
    if args.analysis:
        record["analysis"] = Path(args.analysis).read_text()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{args.date}_cpu_kv_bench" + ("_profile" if args.profile_only else "")
    (out / f"{stem}.json").write_text(json.dumps(record, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown({"summary": [], **record}))
    print(f"wrote {out / stem}.json and .md ({record['wall_s']:.0f} s)", file=sys.stderr)
    return record


if __name__ == "__main__":
    main()
