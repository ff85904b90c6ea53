"""What a method's decode would cost at an assumed acceptance rate, from stage times measured at another.

Random (synthetic) weights give real stage times and meaningless acceptance: a random draft agrees with
a random target on almost nothing, so the measured ms/token says how slow a method is when it never
guesses right. The projection keeps what was measured (seconds per forward of each node, the rest of
the decode loop per forward, seconds per retrieval rebuild) and replaces the acceptance by an assumed
one, the same at every level (or one per level).

Acceptance means what the statistics report (statistics.acceptance): tokens accepted over tokens drafted,
a round counting all gamma of its drafted tokens, so a level's rounds yield 1 + gamma * acceptance
tokens on average, exactly. How those tokens spread over rounds follows the usual model of
speculative decoding (Leviathan et al., 2023): each drafted token accepted independently with the
probability alpha that gives that mean, so a round yields a + 1 tokens with P(a = k) = alpha^k (1 - alpha)
for k < gamma and alpha^gamma for a = gamma. The hierarchy is session.Session._compose's: a Drafter feeds
its node once per token; a SpecLevel round asks its proposer for gamma tokens (rounds until it has at
least that many: the surplus is dropped, its forwards still paid) and runs its node once. Expected
forwards per round follow from Wald's identity, and so do the tokens between retrieval rebuilds
(rebuild_interval: every rebuild_after tokens, or every REBUILD_WINDOW rounds where the acceptance is
under rebuild_below: low_acceptance_rule). What the model leaves out: real acceptance comes in runs (it
changes how many middle rounds a full round needs, not the full rounds' yield); a forward's cost does
not depend on how many tokens it catches up; near rebuild_below, some windows of rounds average on the
other side of it than the acceptance does (low_acceptance_rule's window_below_p). tests/auto/test_projection.py
checks the forward counts against the real levels driven by fixed distributions (independent
acceptance), and the rebuilds against the engine's.

A batch of B rows (rows=B) decodes in rounds of the top level over every live row; each row accepts on
its own, and a row that has its drafts sits the rest of the round out (levels.py), so a round runs as many
proposer rounds as its slowest row needs: E[max of B independent rows' rounds] from the distribution of
one row's (_rounds_max). That is exact for every hierarchy here, whose innermost proposer is a drafter (one
token per round, so the levels under the top one keep their rows in step). Every row has the same
acceptance. Not modelled: rows whose prompts differ in acceptance, so that the batch runs until its slowest
row is done, with fewer rows after the others finish (on the demo pair's 8 prompts at their measured
acceptance, a `naive` batch ran 1.57x the full forwards projected, a `triforce` batch 1.1x: BENCHMARKS.md),
and how a forward's cost depends on its rows (the measured mean cost per forward is used).
"""
from __future__ import annotations

from ..config import Speculation
from ..engine.levels import REBUILD_WINDOW


def _rate(level: tuple, rate) -> float:
    """The acceptance rate of a SpecLevel: rate itself, or from a dict by the statistics' names ("draft"
    where the level verifies the small draft's tokens, "retrieval" where it verifies the middle level's)."""
    if not isinstance(rate, dict):
        return rate
    return rate["draft" if level[1] in (("drafter", "draft"), ("lookup",)) else "retrieval"]


def per_token(rate: float, gamma: int) -> float:
    """The independent per-token acceptance alpha whose rounds of gamma accept rate * gamma tokens on
    average: E[a] = sum_{k=1..gamma} alpha^k, increasing in alpha (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid ** k for k in range(1, gamma + 1)) < rate * gamma:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def rate_at(rate: float, gamma: int, other: int) -> float:
    """The acceptance rate rounds of `other` drafted tokens would report where rounds of `gamma` report
    `rate`: the same independent per-token acceptance (per_token), so sum_{k=1..other} alpha^k / other."""
    if gamma == other:
        return rate
    alpha = per_token(rate, gamma)
    return sum(alpha ** k for k in range(1, other + 1)) / other


def _round_tokens(level: tuple, rate) -> dict[int, float]:
    """Distribution of the tokens one round of `level` yields."""
    if level[0] == "drafter":
        return {1: 1.0}
    gamma = level[3]
    alpha = per_token(_rate(level, rate), gamma)
    dist = {k + 1: alpha ** k * (1 - alpha) for k in range(gamma)}
    dist[gamma + 1] = alpha ** gamma
    return dist


def _mean_tokens(level: tuple, rate) -> float:
    """Expected tokens one round of `level` yields."""
    return sum(n * p for n, p in _round_tokens(level, rate).items())


def _rounds_for(level: tuple, k: int, rate, most: int | None = None) -> float:
    """Expected rounds of `level` until it has yielded at least k tokens, or has run `most` rounds."""
    if level[0] == "lookup":  # the k tokens asked for, in one proposal
        return 1.0
    dist = _round_tokens(level, rate)
    e = [0.0] * (k + 1)  # e[need]: expected rounds until `need` more tokens (bottom up: k may be large)
    if most is None:
        for need in range(1, k + 1):
            e[need] = 1.0 + sum(p * e[max(0, need - n)] for n, p in dist.items())
        return e[k]
    for _ in range(most):  # e[need] with one more round allowed, from e with one fewer
        e = [0.0] + [1.0 + sum(p * e[max(0, need - n)] for n, p in dist.items()) for need in range(1, k + 1)]
    return e[k]


def _rounds_max(level: tuple, k: int, rate, rows: int) -> float:
    """Expected rounds of `level` until each of `rows` independent rows has yielded at least k tokens: the
    maximum of the rows' rounds, E[max] = sum over m of P(some row needs more than m rounds)."""
    if level[0] == "lookup":
        return 1.0
    dist = _round_tokens(level, rate)
    have = {0: 1.0}  # the distribution of min(tokens after m rounds, k)
    total = 0.0
    for _ in range(k):  # every round yields at least one token: no row needs more than k
        total += 1.0 - have.get(k, 0.0) ** rows  # P(not every row is done within m rounds)
        step: dict[int, float] = {}
        for s, p in have.items():
            for n, q in dist.items():
                step[min(k, s + n)] = step.get(min(k, s + n), 0.0) + p * q
        have = step
    return total


def _round_forwards(level: tuple, rate, rows: int = 1) -> dict[str, float]:
    """Expected forwards per node of one round of `level` over `rows` rows (module docstring)."""
    if level[0] == "lookup":
        return {}
    if level[0] == "drafter":
        return {level[1]: 1.0}
    _, proposer, node, gamma = level
    rounds = _rounds_for(proposer, gamma, rate) if rows == 1 else _rounds_max(proposer, gamma, rate, rows)
    out = {name: rounds * f for name, f in _round_forwards(proposer, rate, rows).items()}
    out[node] = out.get(node, 0.0) + 1.0
    return out


def forwards_per_token(spec: Speculation, rate, rows: int = 1) -> dict[str, float]:
    """Expected forwards of each node per generated token (of all rows, for a batch of `rows`) at acceptance
    rate `rate`: one for every level, or {"draft": a, "retrieval": b} as the statistics name the levels
    (None for a level not there)."""
    for a in (rate.values() if isinstance(rate, dict) else [rate]):
        if a is not None and not 0 <= a <= 1:
            raise ValueError(f"acceptance must be in [0, 1], got {a}")
    top = spec.hierarchy()
    tokens = rows * _mean_tokens(top, rate)
    return {name: f / tokens for name, f in _round_forwards(top, rate, rows).items()}


def low_acceptance_rule(spec: Speculation, rate, window: int = REBUILD_WINDOW) -> dict:
    """Session._maybe_rebuild's second rule at acceptance `rate`: it rebuilds when the level verifying the
    middle level (the top level of triforce and retrieval) has run `window` rounds since the last rebuild
    and their mean acceptance is under spec.rebuild_below. A window's mean is `rate` in expectation, so the
    projection takes the rule as active exactly when rate < rebuild_below: then every window ends in a
    rebuild, else none does. window_below_p, the chance that one window of independent rounds averages
    under rebuild_below, says how far the truth is from that step (exact when it is 0 or 1; near the
    threshold, windows fall on either side of it)."""
    top = spec.hierarchy()
    rate = _rate(top, rate)
    rounds = _round_tokens(top, rate)
    sums = {0: 1.0}  # the distribution of the tokens a window's rounds accept
    for _ in range(window):
        step: dict[int, float] = {}
        for total, p in sums.items():
            for n, q in rounds.items():
                step[total + n - 1] = step.get(total + n - 1, 0.0) + p * q
        sums = step
    below = sum(p for total, p in sums.items() if total / (top[3] * window) < spec.rebuild_below)
    return {"active": rate < spec.rebuild_below, "rebuild_below": spec.rebuild_below, "window_rounds": window,
            "window_below_p": below}


def rebuild_interval(spec: Speculation, rate, window: int = REBUILD_WINDOW) -> float:
    """Expected tokens between retrieval rebuilds. Session._maybe_rebuild rebuilds before the first round
    that starts with at least spec.rebuild_after() tokens committed since the last rebuild (at least one:
    with a threshold of zero or less it rebuilds before every round), or, where low_acceptance_rule is
    active, `window` rounds after the last rebuild, whichever comes first; rounds commit several tokens,
    so the interval is the tokens of the rounds until then: E[rounds] x E[tokens per round] (Wald's
    identity)."""
    top = spec.hierarchy()
    most = window if low_acceptance_rule(spec, rate, window)["active"] else None
    return _rounds_for(top, max(1, spec.rebuild_after()), rate, most) * _mean_tokens(top, rate)


def project(stats: dict, spec: Speculation, rate, rows: int = 1) -> dict | None:
    """The projected decode cost at acceptance `rate` (forwards_per_token's) from one run's statistics
    (statistics.row_stats; a batch of `rows` rows: the batch's), or None when the run timed too little to project
    from (a node that ran no forward while decoding)."""
    costs = stage_costs(stats)
    return None if costs is None else predict(costs, spec, rate, rows)


def stage_costs(stats: dict) -> dict | None:
    """What a run's statistics (engine._stats) say each step of its decode costs: milliseconds per forward
    of each node, of the rest of the loop per forward, of one retrieval rebuild (None without a retrieval
    cache); None when the run timed too little (a node that ran no forward while decoding)."""
    forwards, stage_s = stats["forwards"], stats["stage_s"]
    if any(n == 0 for n in forwards.values()) or not stats["decode_s"]:
        return None
    rebuild_s = stats["rebuild_s"] or 0.0
    # The decode loop outside forwards and rebuilds (sampling, verification, host syncs, Python), per forward.
    other = max(0.0, stats["decode_s"] - sum(stage_s.values()) - rebuild_s) / sum(forwards.values())
    rebuild = None
    if stats["rebuild_s"] is not None:
        rebuild = 1000 * (rebuild_s / stats["rebuilds"] if stats["rebuilds"] else stats["prefill_rebuild_s"] or 0.0)
    return {"ms_per_forward": {name: 1000 * stage_s[name] / n for name, n in forwards.items()},
            "other_ms_per_forward": 1000 * other, "rebuild_ms": rebuild}


def predict(costs: dict, spec: Speculation, rate, rows: int = 1) -> dict:
    """The decode cost per token (of all rows, for a batch of `rows`) of `spec` at acceptance `rate` from step
    costs (stage_costs': rebuild_ms is one row's rebuild, and each row rebuilds once per interval of its own
    tokens)."""
    per_forward, other = costs["ms_per_forward"], costs["other_ms_per_forward"]
    need = forwards_per_token(spec, rate, rows)
    ms = {name: f * (per_forward[name] + other) for name, f in need.items()}
    rebuilds = {"rebuilds_per_token": None, "low_acceptance_rebuilds": None}  # no retrieval cache
    if costs["rebuild_ms"] is not None:
        rebuilds = {"rebuilds_per_token": 1 / rebuild_interval(spec, rate),
                    "low_acceptance_rebuilds": low_acceptance_rule(spec, rate)}
        ms["rebuilds"] = costs["rebuild_ms"] * rebuilds["rebuilds_per_token"]
    return {
        "acceptance": rate,
        "rows": rows,
        "ms_per_token": sum(ms.values()),
        "tokens_per_verification": 1 / (rows * need["full"]),  # one row's
        "forwards_per_token": need,
        "ms_per_token_by_stage": ms,
        "ms_per_forward": dict(per_forward),
        "other_ms_per_forward": other,
        **rebuilds,
    }
