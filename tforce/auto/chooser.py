"""`--method auto`: the method and gammas whose predicted decode is cheapest on this machine, for this
prompt's length (docs/auto.md).

Every candidate is exact (greedy: `ar`'s tokens; sampling: the target's distribution), so the choice
changes only the speed. The prediction is projection.predict: the stage costs a calibration measured
(calibration.py: short runs of each method on the prompt, cached per machine, models, dtype, device and
context bucket) and each level's acceptance, held at the same per-token rate when the gammas change
(projection.rate_at). The acceptance starts from the calibration's own runs on the prompt and moves
toward what later runs measured (calibration.remember). What is searched: gamma1 over GAMMA1 and
gamma2 over GAMMA2 (one given on the command line is kept); the budget is the one given (cut to the
context, Speculation.fitted), not searched: its effect on acceptance is not modelled. With a draft model,
the bottom level is searched too: LOOKED_UP's methods are also timed with n-gram lookup in the draft's
place (the calibration entry's "naive+lookup", calibration.split), and a candidate that runs so carries
"proposer": "lookup". A method with lookup at its bottom level (so, or by --draft lookup) is predicted at
the gammas it was timed with only.
"""
from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from . import calibration
from ..config import AUTO, METHODS, RunConfig, Speculation
from ..engine.events import Events
from ..engine.generate import Result, configured, generate as run_one
from ..errors import UsageError
from .projection import predict, rate_at

GAMMA1 = (1, 2, 3, 4)
GAMMA2 = (2, 4, 6, 8, 10)
AR_MARGIN = 0.10  # pick(): how much faster than ar a speculative method must be predicted
# The methods auto also times with n-gram lookup at the bottom level where a draft model is given: neither
# bottom level won everywhere on SmolLM2 (BENCHMARKS.md, "The default bottom level of SmolLM2"); streaming,
# the slowest method in every calibration measured there, is left out (a calibration run less)
LOOKED_UP = ("naive", "triforce")
ORDER = ("ar", "naive", "retrieval", "streaming", "triforce")  # ties go to the earlier, simpler method
assert sorted(ORDER) == sorted(METHODS)
# per method, the nodes that verify drafts and the gamma they verify (Speculation.hierarchy's levels)
VERIFIERS = {"ar": {}, "naive": {"full": "gamma2"}, "retrieval": {"full": "gamma2"},
             "streaming": {"streaming": "gamma1", "full": "gamma2"},
             "triforce": {"retrieval": "gamma1", "full": "gamma2"}}


def uncalibrated(device: str, has_draft: bool) -> str:
    """Auto's method where it cannot calibrate in this process (tensor-parallel ranks, batches, chat):
    triforce on a GPU with a draft (the long-context setting it is built for), ar otherwise (on the 2-core
    CPU the project measures on, float32, ar was the fastest method at 880 to 3,300 prompt tokens)."""
    return "triforce" if device == "cuda" and has_draft else "ar"


def candidates(config: RunConfig, has_draft: bool, exclude=()) -> list[str]:
    """The methods auto may choose with this configuration: those whose options check (a --policy only the
    retrieval cache has, a streaming budget under --sinks), with a proposer where they need one (has_draft:
    a draft model; or the configuration's n-gram lookup); with a draft model, also LOOKED_UP's methods
    with lookup in its place ("naive+lookup"; exclude names methods, so it leaves out both forms)."""
    out = []
    for method in ORDER:
        spec = replace(config.speculation, method=method)
        if method in exclude or (spec.uses_draft and not has_draft):
            continue
        try:
            spec.validate()
        except UsageError:
            continue
        out.append(method)
    if has_draft and config.speculation.proposer == "model":
        out += [m + calibration.LOOKED for m in LOOKED_UP if m in out]
    return out


def options_of(candidate: dict) -> dict:
    """What a candidate setting runs with: its method, proposer (a lookup variant) and gammas."""
    return {k: candidate[k] for k in ("method", "proposer", "gamma1", "gamma2") if k in candidate}


def _grid(method: str, fixed: dict) -> list[dict]:
    if method == "ar":
        return [{}]
    g2 = [fixed["gamma2"]] if "gamma2" in fixed else GAMMA2
    if not Speculation(method=method).two_verifiers:  # one drafting level: gamma2 only
        return [{"gamma2": b} for b in g2]
    g1 = [fixed["gamma1"]] if "gamma1" in fixed else GAMMA1
    return [{"gamma1": a, "gamma2": b} for a in g1 for b in g2]


def predictions(entry: dict, methods, config: RunConfig, total: int, fixed: dict) -> list[dict]:
    """Every candidate setting's predicted ms/token, cheapest first: each method of `methods` the entry
    measured, at each gamma of the grid (fixed: the gammas given, kept), for `total` tokens of context."""
    out = []
    one = (entry["methods"].get("ar") or {}).get("costs")
    floor = one["ms_per_forward"]["full"] if one else 0.0
    for name in methods:
        held = entry["methods"].get(name)
        if held is None or held["costs"] is None:
            continue
        method, extra = calibration.split(name)
        # Lookup's drafts come right in runs (a right token is mostly followed by right ones), not at one rate
        # per token: its acceptance is not moved between gammas, only taken where it was measured (a gamma
        # given is kept). Moved from its calibration's gamma1 2 to 1 on the demo question, it predicted
        # triforce with lookup at 105 ms/token; that ran at 144 (acceptance 0.07), ar at about 110.
        base = replace(config.speculation, method=method, **extra)
        grid = [{k: fixed.get(k, held[k]) for k in ("gamma1", "gamma2")}] if base.looks_up else _grid(method, fixed)
        for knobs in grid:
            gammas = {"gamma1": knobs.get("gamma1", held["gamma1"]), "gamma2": knobs.get("gamma2", held["gamma2"])}
            spec = replace(base, **gammas)
            spec = spec.fitted(spec.capacity(total))  # as the Session fits it
            rate = {level: rate_at(r or 0.0, calibration.level_gamma(method, level, held),
                                   calibration.level_gamma(method, level, gammas))
                    for level, r in held["acceptance"].items()}
            costs = at_gammas(held, gammas, method, target_slope(entry, name), floor)
            ms = predict(costs, spec, rate)["ms_per_token"]
            used = {k: v for k, v in gammas.items() if k in _grid(method, {"gamma1": 0, "gamma2": 0})[0]}
            out.append({"method": method, **extra, **used, "ms_per_token": ms,
                        "acceptance": rate if method != "ar" else None})
    out.sort(key=_rank)
    return out


def _rank(c: dict) -> tuple:
    """Cheapest first; ties go to the earlier, simpler method, and to its draft model before lookup."""
    return c["ms_per_token"], ORDER.index(c["method"]), "proposer" in c


def target_slope(entry: dict, name: str) -> float:
    """Milliseconds a target forward costs per token it is fed, for the entry's method `name`: the line
    through ar's full-cache forward (fed 1 token) and the method's own verification (fed gamma2 + 1), at
    least 0; 0 without ar or for ar. Each method's own two points, not a figure pooled over methods: one
    disturbed calibration run (a neighbour, a thread change) then moves only its own method's prediction."""
    one = (entry["methods"].get("ar") or {}).get("costs")
    held = entry["methods"].get(name)
    if one is None or name == "ar" or held is None or held["costs"] is None:
        return 0.0
    return max(0.0, (held["costs"]["ms_per_forward"]["full"] - one["ms_per_forward"]["full"]) / held["gamma2"])


def at_gammas(held: dict, gammas: dict, method: str, slope: float, floor: float) -> dict:
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
    def looked(self) -> bool:
        """--draft lookup: every drafting method runs with lookup, under its own name (the entry's key says)."""
        return self.entry["key"].get("proposer") == "lookup"

    def applied(self, config: RunConfig) -> RunConfig:
        """The run's configuration with the chosen method, proposer and gammas, starting from the
        calibration's snapshot of the prompt's prefill where it kept one (choose's kv_dir)."""
        chosen = config.with_options(**options_of(self.best))
        return chosen if self.snapshot is None else chosen.with_options(load_kv=self.snapshot)

    def record(self) -> dict:
        """For --json and bench: the choice, the alternatives' predictions, the calibration."""
        return {**options_of(self.best), "predicted_ms_per_token": self.best["ms_per_token"],
                "candidates": self.candidates,
                "calibrated_now": self.measured_now, "calibration_s": self.entry.get("calibration_s"),
                "measured_at": self.entry["measured_at"], "cache": self.cache, "cache_error": self.cache_error}

    def line(self) -> str:
        """The one stderr line: the choice, the others' predictions, where the stage costs came from."""
        def setting(c):
            knobs = ", ".join(f"{k} {c[k]}" for k in ("gamma1", "gamma2") if k in c)
            lookup = "proposer" in c or (self.looked and Speculation(method=c["method"]).drafts)
            return f"{c['method']}" + (" with lookup" if lookup else "") + (f" ({knobs})" if knobs else "")

        others = "; ".join(f"{setting(c)} {c['ms_per_token']:.1f}" for c in self.candidates if c is not self.best)
        cheapest = self.candidates[0]
        kept = "" if cheapest is self.best else \
            f" (kept: {setting(cheapest)} is predicted faster by less than {AR_MARGIN:.0%})"
        when = f"measured now in {self.entry['calibration_s']:.1f} s" if self.measured_now else \
            "measured " + time.strftime("%Y-%m-%d %H:%M", time.localtime(self.entry["measured_at"]))
        return (f"tforce: auto: {setting(self.best)}, predicted {self.best['ms_per_token']:.1f} ms/token{kept}"
                + (f"; others: {others}" if others else "") + f" (stage costs {when}"
                + (f"; not cached: {self.cache_error}" if self.cache_error else "") + ")")

    def remember(self, stats: dict, tokens: int) -> None:
        """Folds the run's measured acceptance into the cached entry (calibration.remember)."""
        if self.cache is None or self.best["method"] == "ar":
            return
        gammas = {k: self.best[k] for k in ("gamma1", "gamma2") if k in self.best}
        try:
            calibration.remember(self.entry, calibration.entry_name(self.best), stats["acceptance"], tokens, gammas,
                                 self.folder)
        except OSError:  # a cache that went read-only since: the run's output is what matters
            pass


def choose(target, draft, ids, config: RunConfig, fixed: dict | None = None, exclude=(), refresh: bool = False,
           folder=None, kv_dir=None, events: Events | None = None) -> Choice:
    """The cheapest candidate for generating after `ids` with `config`; the stage costs from the
    cache, else measured now and cached (refresh: measured now whatever the cache holds). fixed: gammas the
    user gave, kept; exclude: methods not to consider (e.g. whose caches do not fit in memory).
    kv_dir: an empty folder where a calibration may keep the prompt's prefill as a KV snapshot, so that the
    methods it times (and then the run, through Choice.snapshot) prefill the prompt once between them, not
    once each; it is used where the snapshot is small (calibration.shares_prefill) and neither
    load_kv nor save_kv is set. None: every timed run prefills. events: of the run's callbacks, the timed
    runs take on_step only (the command line's thread governor)."""
    fixed = fixed or {}
    methods = candidates(config, draft is not None, exclude)
    if not methods:
        raise UsageError("--method auto: no method runs with these options")
    k = calibration.key(target, draft, len(ids), config)
    entry = None if refresh else calibration.read(k, methods, folder)
    measured_now = entry is None
    gammas = {"gamma1": config.speculation.gamma1, "gamma2": config.speculation.gamma2}

    snapshot = None
    if measured_now and kv_dir is not None and config.load_kv is None and config.save_kv is None \
            and calibration.shares_prefill(target, len(ids)):
        snapshot = Path(kv_dir) / "prompt"

    def run(name, n, new):
        method, extra = calibration.split(name)
        timed = config.with_options(method=method, **extra, max_new_tokens=new, ignore_eos=True, seed=0)
        if snapshot is not None and not n:  # the whole prompt: prefilled by the first method, loaded by the rest
            timed = timed.with_options(**{"load_kv" if snapshot.is_dir() else "save_kv": snapshot})
        return run_one(target, ids[:n] if n else ids, timed, draft if timed.speculation.uses_draft else None,
                       Events(on_step=events.on_step if events else None))

    path, error = calibration.path_of(k, folder), None
    if measured_now:
        entry = calibration.measure(run, methods, k, gammas)
        try:
            calibration.write(entry, folder)
        except OSError as e:
            path, error = None, f"cannot write {path.parent}: {e.strerror or e}"
    total = len(ids) + config.max_new_tokens
    ranked = predictions(entry, methods, config, total, fixed)
    if not ranked:
        raise UsageError("--method auto: the calibration timed no method (is the prompt near the context's end?)")
    best_of = {}
    for c in ranked:
        best_of.setdefault(calibration.entry_name(c), c)
    return Choice(pick(best_of), list(best_of.values()), entry, measured_now, None if path is None else str(path),
                  error, folder, snapshot if snapshot is not None and snapshot.is_dir() else None)


def pick(best_of: dict) -> dict:
    """The cheapest setting, except that ar is kept unless the cheapest is predicted more than AR_MARGIN
    faster: a speculative method's prediction rests on an acceptance estimated from a few tokens and on
    stage costs from one short run each (on the 2-core CPU, 16-token calibrations under load were off by
    up to 25%), while ar's cost has no acceptance in it."""
    best = min(best_of.values(), key=_rank)
    ar = best_of.get("ar")
    return ar if ar is not None and ar["ms_per_token"] <= best["ms_per_token"] * (1 + AR_MARGIN) else best


def generate(target, prompt_ids, config: RunConfig | None = None, *, draft=None, events: Events | None = None,
             group=None, **options) -> Result:
    """Generate after prompt_ids with `config` and the flat options beside it (RunConfig.with_options; as
    transformers' generate takes a GenerationConfig and keyword arguments that change it): the engine's
    generate (engine/generate.py, whose docstring says what each option does), with method "auto"
    resolved first, above the engine: choose() picks the method and gammas, the run's acceptance is folded
    into the calibration cache, and stats["auto"] holds the choice (Choice.record). tforce.generate is
    this function."""
    config = configured(config, options)
    if config.method != AUTO:
        return run_one(target, prompt_ids, config, draft, events, group)
    if group is not None:  # each rank would time its own share and might choose differently
        raise UsageError("method 'auto' is not planned across tensor-parallel ranks: pass a method")
    ids = list(prompt_ids)
    with tempfile.TemporaryDirectory(prefix="tforce-auto-") as kv_dir:
        choice = choose(target, draft, ids, config, kv_dir=kv_dir, events=events)
        chosen = choice.applied(config)
        result = run_one(target, ids, chosen, draft if chosen.speculation.uses_draft else None, events)
    choice.remember(result.stats, len(result.tokens))
    result.stats["auto"] = choice.record()
    return result
