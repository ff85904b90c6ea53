"""`--method auto`: the method and gammas whose predicted decode is cheapest on this machine, for this
prompt's length (docs/auto.md).

Every candidate is exact (greedy: `ar`'s tokens; sampling: the target's distribution), so the choice
changes only the speed. The prediction is projection.predict: the stage costs a calibration measured
(calibration.py: short runs of each method on the prompt, cached per machine, models, dtype, device and
context bucket) and each level's acceptance, held at the same per-token rate when the gammas change
(projection.rate_at). The acceptance starts from the calibration's own runs on the prompt and moves
toward what later runs measured (calibration.remember). What is searched: gamma1 over GAMMA1 and
gamma2 over GAMMA2 (one given on the command line is kept); the budget is the one given (cut to the
context, Speculation.fitted), not searched: its effect on acceptance is not modelled.
"""
from __future__ import annotations

import functools
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import calibration
from ..config import METHODS, Speculation
from ..engine.generate import generate as run_one
from ..errors import UsageError
from .projection import predict, rate_at

GAMMA1 = (1, 2, 3, 4)
GAMMA2 = (2, 4, 6, 8, 10)
AR_MARGIN = 0.10  # pick(): how much faster than ar a speculative method must be predicted
ORDER = ("ar", "naive", "retrieval", "streaming", "triforce")  # ties go to the earlier, simpler method
assert sorted(ORDER) == sorted(METHODS)
# generate's options that the calibration's runs take from the run they plan for
RUN_OPTIONS = ("temperature", "top_p", "top_k", "budget", "chunk_size", "gamma1", "gamma2", "draft_budget", "sinks",
               "rebuild_every", "rebuild_below", "policy", "prefill_chunk", "offload", "gpu_memory", "cuda_graphs",
               "device_free", "deterministic")
# per method, the nodes that verify drafts and the gamma they verify (projection.hierarchy's levels)
VERIFIERS = {"ar": {}, "naive": {"full": "gamma2"}, "retrieval": {"full": "gamma2"},
             "streaming": {"streaming": "gamma1", "full": "gamma2"},
             "triforce": {"retrieval": "gamma1", "full": "gamma2"}}
SPEC_OPTIONS = ("budget", "chunk_size", "gamma1", "gamma2", "draft_budget", "sinks", "rebuild_every",
                "rebuild_below", "policy")


def uncalibrated(device: str, has_draft: bool) -> str:
    """Auto's method where it cannot calibrate in this process (tensor-parallel ranks, batches, chat):
    triforce on a GPU with a draft (the long-context setting it is built for), ar otherwise (on the 2-core
    CPU the project measures on, float32, ar was the fastest method at 880 to 3,300 prompt tokens)."""
    return "triforce" if device == "cuda" and has_draft else "ar"


def candidates(options: dict, has_draft: bool, exclude=()) -> list[str]:
    """The methods auto may choose with these options: those whose options check (a --policy only the
    retrieval cache has, a streaming budget under --sinks), with a draft where they need one."""
    out = []
    for method in ORDER:
        spec = Speculation(method=method, **{k: options[k] for k in SPEC_OPTIONS if k in options})
        if method in exclude or (spec.uses_draft and not has_draft):
            continue
        try:
            spec.validate()
        except UsageError:
            continue
        out.append(method)
    return out


def _grid(method: str, fixed: dict) -> list[dict]:
    if method == "ar":
        return [{}]
    g2 = [fixed["gamma2"]] if "gamma2" in fixed else GAMMA2
    if not Speculation(method=method).two_verifiers:  # one drafting level: gamma2 only
        return [{"gamma2": b} for b in g2]
    g1 = [fixed["gamma1"]] if "gamma1" in fixed else GAMMA1
    return [{"gamma1": a, "gamma2": b} for a in g1 for b in g2]


def predictions(entry: dict, methods, options: dict, total: int, fixed: dict) -> list[dict]:
    """Every candidate setting's predicted ms/token, cheapest first: each method of `methods` the entry
    measured, at each gamma of the grid (fixed: the gammas given, kept), for `total` tokens of context."""
    out = []
    one = (entry["methods"].get("ar") or {}).get("costs")
    floor = one["ms_per_forward"]["full"] if one else 0.0
    for method in methods:
        held = entry["methods"].get(method)
        if held is None or held["costs"] is None:
            continue
        for knobs in _grid(method, fixed):
            gammas = {"gamma1": knobs.get("gamma1", held["gamma1"]), "gamma2": knobs.get("gamma2", held["gamma2"])}
            spec = Speculation(method=method, **{**{k: options[k] for k in SPEC_OPTIONS if k in options}, **gammas})
            spec = spec.fitted(spec.capacity(total))  # as the Session fits it
            rate = {level: rate_at(r or 0.0, calibration.level_gamma(method, level, held),
                                   calibration.level_gamma(method, level, gammas))
                    for level, r in held["acceptance"].items()}
            costs = _at_gammas(held, gammas, method, target_slope(entry, method), floor)
            ms = predict(costs, spec, rate)["ms_per_token"]
            used = {k: v for k, v in gammas.items() if k in _grid(method, {"gamma1": 0, "gamma2": 0})[0]}
            out.append({"method": method, **used, "ms_per_token": ms,
                        "acceptance": rate if method != "ar" else None})
    out.sort(key=lambda c: (c["ms_per_token"], ORDER.index(c["method"])))
    return out


def target_slope(entry: dict, method: str) -> float:
    """Milliseconds a target forward costs per token it is fed, for `method`: the line through ar's full-cache
    forward (fed 1 token) and the method's own verification (fed gamma2 + 1), at least 0; 0 without ar or
    for ar. Each method's own two points, not a figure pooled over methods: one disturbed calibration run
    (a neighbour, a thread change) then moves only its own method's prediction."""
    one = (entry["methods"].get("ar") or {}).get("costs")
    held = entry["methods"].get(method)
    if one is None or method == "ar" or held is None or held["costs"] is None:
        return 0.0
    return max(0.0, (held["costs"]["ms_per_forward"]["full"] - one["ms_per_forward"]["full"]) / held["gamma2"])


def _at_gammas(held: dict, gammas: dict, method: str, slope: float, floor: float) -> dict:
    """A method's stage costs at other gammas than it was measured at: each target forward that verifies
    gamma drafts is fed gamma + 1 tokens, so it costs `slope` ms more per added token (target_slope: measured
    on the full cache's forward, applied to the middle level's too: the same network), and never less than
    `floor` (ar's forward fed one token, 0 without ar). Drafters' forwards are fed one or two tokens whatever
    the gammas."""
    costs, fed = held["costs"], VERIFIERS[method]
    per = {node: max(floor if node == "full" else 0.0, ms + slope * (gammas[fed[node]] - held[fed[node]]))
           if node in fed else ms for node, ms in costs["ms_per_forward"].items()}
    return {**costs, "ms_per_forward": per}


@dataclass
class Choice:
    """What auto chose and why: the cheapest candidate, every method's best, where the costs came from."""

    best: dict
    candidates: list[dict]  # the cheapest setting of each method, cheapest first
    entry: dict
    measured_now: bool
    cache: str | None  # the entry's file; None when it could not be written
    cache_error: str | None = None
    folder: object = field(default=None, repr=False)
    snapshot: Path | None = None  # the prompt's prefill the calibration kept (choose's kv_dir), for the run to load

    @property
    def options(self) -> dict:
        """generate's options for the chosen setting."""
        return {"method": self.best["method"],
                **{k: self.best[k] for k in ("gamma1", "gamma2") if k in self.best}}

    def record(self) -> dict:
        """For --json and bench: the choice, the alternatives' predictions, the calibration."""
        return {"method": self.best["method"], **{k: self.best[k] for k in ("gamma1", "gamma2") if k in self.best},
                "predicted_ms_per_token": self.best["ms_per_token"], "candidates": self.candidates,
                "calibrated_now": self.measured_now, "calibration_s": self.entry.get("calibration_s"),
                "measured_at": self.entry["measured_at"], "cache": self.cache, "cache_error": self.cache_error}

    def line(self) -> str:
        """The one stderr line: the choice, the others' predictions, where the stage costs came from."""
        def setting(c):
            knobs = ", ".join(f"{k} {c[k]}" for k in ("gamma1", "gamma2") if k in c)
            return f"{c['method']}" + (f" ({knobs})" if knobs else "")

        others = "; ".join(f"{setting(c)} {c['ms_per_token']:.1f}" for c in self.candidates if c is not self.best)
        cheapest = self.candidates[0]
        kept = "" if cheapest is self.best else \
            f" (kept: {cheapest['method']} is predicted faster by less than {AR_MARGIN:.0%})"
        when = f"measured now in {self.entry['calibration_s']:.1f} s" if self.measured_now else \
            "measured " + time.strftime("%Y-%m-%d %H:%M", time.localtime(self.entry["measured_at"]))
        return (f"tforce: auto: {setting(self.best)}, predicted {self.best['ms_per_token']:.1f} ms/token{kept}"
                + (f"; others: {others}" if others else "") + f" (stage costs {when}"
                + (f"; not cached: {self.cache_error}" if self.cache_error else "") + ")")

    def run_kv(self) -> dict:
        """generate's load_kv for the run: the calibration's snapshot of the prompt, where it kept one."""
        return {} if self.snapshot is None else {"load_kv": self.snapshot}

    def remember(self, stats: dict, tokens: int) -> None:
        """Folds the run's measured acceptance into the cached entry (calibration.remember)."""
        if self.cache is None or self.best["method"] == "ar":
            return
        gammas = {k: self.best[k] for k in ("gamma1", "gamma2") if k in self.best}
        try:
            calibration.remember(self.entry, self.best["method"], stats["acceptance"], tokens, gammas, self.folder)
        except OSError:  # a cache that went read-only since: the run's output is what matters
            pass


def choose(target, draft, ids, options: dict, fixed: dict | None = None, exclude=(), refresh: bool = False,
           folder=None, kv_dir=None) -> Choice:
    """The cheapest candidate for generating after `ids` with generate's `options`; the stage costs from the
    cache, else measured now and cached (refresh: measured now whatever the cache holds). fixed: gammas the
    user gave, kept; exclude: methods not to consider (e.g. whose caches do not fit in memory).
    kv_dir: an empty folder where a calibration may keep the prompt's prefill as a KV snapshot, so that the
    methods it times (and then the run, through Choice.snapshot) prefill the prompt once between them, not
    once each; it is used where the snapshot is small (calibration.shares_prefill) and neither
    load_kv nor save_kv is among the options. None: every timed run prefills."""
    fixed = fixed or {}
    methods = candidates(options, draft is not None, exclude)
    if not methods:
        raise UsageError("--method auto: no method runs with these options")
    k = calibration.key(target, draft, len(ids), options)
    entry = None if refresh else calibration.read(k, methods, folder)
    measured_now = entry is None
    run_options = {name: options[name] for name in RUN_OPTIONS if name in options}
    gammas = {"gamma1": options.get("gamma1", Speculation.gamma1), "gamma2": options.get("gamma2", Speculation.gamma2)}

    snapshot = None
    if measured_now and kv_dir is not None and options.get("load_kv") is None and options.get("save_kv") is None \
            and calibration.shares_prefill(target, len(ids)):
        snapshot = Path(kv_dir) / "prompt"

    def run(method, n, new):
        uses_draft = Speculation(method=method).uses_draft
        kv = {}
        if snapshot is not None and not n:  # the whole prompt: prefilled by the first method, loaded by the rest
            kv = {"load_kv": snapshot} if snapshot.is_dir() else {"save_kv": snapshot}
        return run_one(target, ids[:n] if n else ids, draft=draft if uses_draft else None,
                        **{**run_options, "method": method, "max_new_tokens": new, "ignore_eos": True, "seed": 0},
                        **kv)

    path, error = calibration.path_of(k, folder), None
    if measured_now:
        entry = calibration.measure(run, methods, k, gammas)
        try:
            calibration.write(entry, folder)
        except OSError as e:
            path, error = None, f"cannot write {path.parent}: {e.strerror or e}"
    total = len(ids) + options.get("max_new_tokens", 256)
    ranked = predictions(entry, methods, options, total, fixed)
    if not ranked:
        raise UsageError("--method auto: the calibration timed no method (is the prompt near the context's end?)")
    best_of = {}
    for c in ranked:
        best_of.setdefault(c["method"], c)
    return Choice(pick(best_of), list(best_of.values()), entry, measured_now, None if path is None else str(path),
                  error, folder, snapshot if snapshot is not None and snapshot.is_dir() else None)


def pick(best_of: dict) -> dict:
    """The cheapest setting, except that ar is kept unless the cheapest is predicted more than AR_MARGIN
    faster: a speculative method's prediction rests on an acceptance estimated from a few tokens and on
    stage costs from one short run each (on the 2-core CPU, 16-token calibrations under load were off by
    up to 25%), while ar's cost has no acceptance in it."""
    best = min(best_of.values(), key=lambda c: (c["ms_per_token"], ORDER.index(c["method"])))
    ar = best_of.get("ar")
    return ar if ar is not None and ar["ms_per_token"] <= best["ms_per_token"] * (1 + AR_MARGIN) else best


@functools.wraps(run_one)
def generate(target, prompt_ids, *, draft=None, method: str = "triforce", **options):
    if method != "auto":
        return run_one(target, prompt_ids, draft=draft, method=method, **options)
    if options.get("group") is not None:  # each rank would time its own share and might choose differently
        raise UsageError("method 'auto' is not planned across tensor-parallel ranks: pass a method")
    ids = list(prompt_ids)
    with tempfile.TemporaryDirectory(prefix="tforce-auto-") as kv_dir:
        choice = choose(target, draft, ids, options, kv_dir=kv_dir)
        uses_draft = Speculation(method=choice.best["method"]).uses_draft
        result = run_one(target, ids, draft=draft if uses_draft else None,
                         **{**options, **choice.options, **choice.run_kv()})
    choice.remember(result.stats, len(result.tokens))
    result.stats["auto"] = choice.record()
    return result


generate.__doc__ = (run_one.__doc__ or "") + """

This is the engine's generate (engine/generate.py) with `--method auto` resolved first, above the engine:
choose() picks the method and gammas, the run's acceptance is folded into the calibration cache, and
stats["auto"] holds the choice (Choice.record). tforce.generate is this function."""
