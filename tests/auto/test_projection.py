"""projection.py: its expected forwards per token against the real levels (levels.py) driven by fixed
distributions under which each drafted token is accepted independently with probability alpha, at the
acceptance rates those levels report; its hierarchy against the engine's composition; and a
projection at the measured acceptance against a run's own stage times."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import tforce
from tforce.config import METHODS, RunConfig, Sampling, Speculation
from tforce.engine.decode import decode
from tforce.engine.generate import Session, open_session
from tforce.cache.rows import Rows
from tforce.engine.lookup import LookupLevel
from tforce.engine.levels import Drafter, SpecLevel
from tforce.engine.node import Node
from tforce.auto.projection import (forwards_per_token, low_acceptance_rule, per_token, project,
                                      rebuild_interval)

# Fixed next-token distributions over 4 tokens: sum(min(DRAFT, MIDDLE)) = sum(MIDDLE, FULL) = alpha,
# whatever came before, so every drafted token is accepted independently with probability alpha.


def _dists(alpha: float) -> dict[str, torch.Tensor]:
    return {"draft": torch.tensor([alpha, 1 - alpha, 0, 0]),
            "retrieval": torch.tensor([alpha, 0, 1 - alpha, 0]),
            "streaming": torch.tensor([alpha, 0, 1 - alpha, 0]),
            "full": torch.tensor([alpha, 0, 0, 1 - alpha])}


class _Cache(Rows):
    def __init__(self):
        self._init_rows(1)

    def begin(self, n, counts=None):
        self.pending = n


def _node(name: str, probs: torch.Tensor, capacity: int) -> Node:
    logits = probs.log()

    def runner(ids, last_n):
        return logits.expand(1, max(last_n, 1), len(probs))

    model = torch.nn.Linear(1, 1)  # only its parameters' device is read
    return Node(name, model, _Cache(), Sampling(temperature=1.0, top_p=1.0), capacity, runner=runner)


def _build(level: tuple, nodes: dict):
    if level[0] == "drafter":
        return Drafter(nodes[level[1]])
    _, proposer, node, gamma = level
    return SpecLevel(_build(proposer, nodes), nodes[node], gamma)


def _measured(spec: Speculation, alpha: float, n_tokens: int) -> tuple[dict[str, float], dict]:
    """Forwards per token of each node, and each level's acceptance rate as the statistics report it."""
    capacity = n_tokens + 64
    nodes = {name: _node(name, p, capacity) for name, p in _dists(alpha).items()}
    top = _build(spec.hierarchy(), nodes)
    seq, gen = torch.zeros(1, capacity, dtype=torch.long), torch.Generator().manual_seed(0)
    n = 1
    while n < n_tokens:
        n += len(top.round(seq, [n], gen)[0][0])
    rates = {}
    level = top
    while isinstance(level, SpecLevel):
        key = "draft" if isinstance(level.proposer, Drafter) and level.proposer.node.name == "draft" else "retrieval"
        rates[key] = level.stats.acceptance()
        level = level.proposer
    return {name: node.forwards / (n - 1) for name, node in nodes.items() if node.forwards}, rates


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_forwards_at_certain_acceptance_are_exact(method, alpha):
    spec = Speculation(method=method, gamma1=2, gamma2=6)
    measured, rates = _measured(spec, alpha, 600)
    assert all(r == alpha for r in rates.values())
    expected = forwards_per_token(spec, alpha)
    assert measured.keys() == expected.keys()
    for name in expected:  # the last round may overshoot 600 tokens: counts are per token actually made
        assert measured[name] == pytest.approx(expected[name], rel=0.02), name


@pytest.mark.parametrize("method", ["triforce", "naive", "retrieval"])
@pytest.mark.parametrize("alpha", [0.5, 0.92])
@pytest.mark.parametrize("gammas", [(2, 6), (3, 5)])
def test_forwards_at_the_levels_measured_acceptance(method, alpha, gammas):
    spec = Speculation(method=method, gamma1=gammas[0], gamma2=gammas[1])
    measured, rates = _measured(spec, alpha, 6000)
    expected = forwards_per_token(spec, rates)
    # At the rates these rounds measured, the counts agree within 0.4% (seeded); 1% still separates the
    # model from plausible wrong ones, e.g. one that drops the surplus of the middle rounds (expected
    # rounds = gamma2 / tokens per round: 6% to 31% fewer draft and middle forwards here).
    for name in expected:
        assert measured[name] == pytest.approx(expected[name], rel=0.01), name


def test_rate_is_the_statistics_acceptance():
    # A rate r means rounds of gamma accept r * gamma tokens on average: 1 + gamma * r per verification.
    for rate in (0.1, 0.5, 0.92):
        f = forwards_per_token(Speculation(method="retrieval", gamma2=6), rate)
        assert 1 / f["full"] == pytest.approx(1 + 6 * rate)
        assert sum(per_token(rate, 6) ** k for k in range(1, 7)) == pytest.approx(6 * rate)


def test_the_surplus_of_a_middle_round_is_paid_for():
    # gamma1 = 4, gamma2 = 6 at full acceptance: middle rounds yield 5 tokens, two are needed for 6
    # (4 surplus dropped): 8 draft and 2 middle forwards per full verification of 7 tokens.
    f = forwards_per_token(Speculation(gamma1=4, gamma2=6), 1.0)
    assert f == pytest.approx({"draft": 8 / 7, "retrieval": 2 / 7, "full": 1 / 7})


def _describe(level):
    if isinstance(level, Drafter):
        return ("drafter", level.node.name)
    if isinstance(level, LookupLevel):
        return ("lookup",)
    return ("spec", _describe(level.proposer), level.node.name, level.gamma)


@pytest.mark.parametrize("proposer", ["model", "lookup"])
@pytest.mark.parametrize("method", METHODS)
def test_hierarchy_is_the_engines(tiny, method, proposer):
    spec = Speculation(method=method, gamma1=3, gamma2=5, budget=64, chunk_size=4, draft_budget=32, sinks=4,
                       proposer=proposer)
    draft = tiny["draft"].model if spec.uses_draft else None
    session = Session(tiny["gqa"].model, draft, 100, 8, RunConfig(speculation=spec, sampling=Sampling()))
    assert _describe(session.top) == spec.hierarchy()


def test_a_lookup_round_costs_no_draft_forward():
    """naive with n-gram lookup: per token, only the full cache's verifications (1 / tokens per round)."""
    f = forwards_per_token(Speculation(method="naive", gamma2=4, proposer="lookup"), 1.0)
    assert f == pytest.approx({"full": 1 / 5})


def test_projection_at_the_measured_acceptance_uses_the_runs_stage_times(tiny):
    ids = torch.randint(0, 259, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    opts = dict(method="triforce", max_new_tokens=48, temperature=0.0, ignore_eos=True, budget=64, chunk_size=4,
                draft_budget=32, sinks=4)
    r = tforce.generate(tiny["gqa"], ids, draft=tiny["draft"], **opts)
    s = r.stats
    assert set(s["stage_s"]) == {"draft", "retrieval", "full"} and all(v > 0 for v in s["stage_s"].values())
    assert sum(s["stage_s"].values()) <= s["decode_s"]
    spec = Speculation(method="triforce", budget=64, chunk_size=4, draft_budget=32, sinks=4)
    p = project(s, spec, 0.5)
    # Each stage's cost is its measured seconds per forward (plus the loop's share) times the forwards needed.
    need = forwards_per_token(spec, 0.5)
    for name in need:
        per = 1000 * s["stage_s"][name] / s["forwards"][name] + p["other_ms_per_forward"]
        assert p["ms_per_token_by_stage"][name] == pytest.approx(need[name] * per)
    assert p["ms_per_token"] == pytest.approx(sum(p["ms_per_token_by_stage"].values()))
    assert p["tokens_per_verification"] == pytest.approx(1 / need["full"])
    # More acceptance, fewer forwards per token, less time.
    assert project(s, spec, 0.95)["ms_per_token"] < project(s, spec, 0.5)["ms_per_token"]


@pytest.mark.parametrize("every, budget, n_prompt, n_new, interval",
                         [(8, 4096, 200, 112, 14), (20, 4096, 200, 112, 21), (128, 64, 6, 63, 56)])
def test_rebuild_interval_is_the_sessions(tiny, every, budget, n_prompt, n_new, interval):
    # The target drafting for itself, greedily: every token accepted, rounds of gamma2 + 1 = 7 tokens.
    # Rebuilds come before the first round with `every` new tokens, or with more than budget - chunk -
    # lookahead (64 - 4 - 10 = 50): after 2, 3 or 8 rounds, not every 8, 20 or 51 tokens. (The short
    # prompt keeps the small budget's retrieval cache exact until its rebuild, so that all is accepted.)
    m = tiny["gqa"].model
    ids = torch.randint(0, 259, (n_prompt,), generator=torch.Generator().manual_seed(3))
    session = open_session(m, m, n_prompt, n_new, RunConfig.of(method="triforce", temperature=0.0, budget=budget, chunk_size=4, draft_budget=512, sinks=4, rebuild_every=every, rebuild_below=0.0))
    at = []  # the full cache's length at each rebuild, the prefill's first
    rebuild = session._rebuild
    session._rebuild = lambda live: (at.append(session.full.cache.length), rebuild(live))
    session.prefill([ids])
    decode(session, [n_prompt], [n_new], torch.Generator().manual_seed(0), set())
    assert session.verifies_draft.stats.acceptance() == session.verifies_middle.stats.acceptance() == 1.0
    assert len(at) >= 2 and {b - a for a, b in zip(at, at[1:])} == {interval}
    spec = Speculation(method="triforce", budget=budget, chunk_size=4, draft_budget=512, sinks=4,
                       rebuild_every=every, rebuild_below=0.0)
    assert rebuild_interval(spec, 1.0) == pytest.approx(interval)


@pytest.mark.parametrize("method", ["triforce", "retrieval"])
def test_projected_rebuilds_at_a_low_measured_acceptance_are_the_runs(tiny, method):
    """The random tiny pair, greedy: the retrieval level accepts almost nothing (measured under 0.05), so
    Session._maybe_rebuild rebuilds every 8 verifications (its low-acceptance rule) rather than every 51
    tokens (the budget's rule). Projected at the measured acceptance, the rebuilds per token times the
    tokens is the run's count within one (a long-run rate: the run's first interval starts at its
    prefill, its last is cut off by its end), and so are the rebuild seconds."""
    ids = torch.randint(0, 259, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    opts = dict(budget=64, chunk_size=4, draft_budget=32, sinks=4)
    r = tforce.generate(tiny["gqa"], ids, draft=tiny["draft"], method=method, max_new_tokens=96, temperature=0.0,
                        ignore_eos=True, **opts)
    s, n = r.stats, len(r.tokens)
    spec = Speculation(method=method, **opts)
    spec = spec.fitted(spec.capacity(300 + 96))  # as the Session fitted it
    assert s["acceptance"]["retrieval"] < 0.05 and spec.rebuild_after() == 51
    assert s["rebuilds"] >= 8  # the budget's rule alone: at most one in 96 tokens
    p = project(s, spec, s["acceptance"])
    assert p["low_acceptance_rebuilds"] == {"active": True, "rebuild_below": 0.3, "window_rounds": 8,
                                            "window_below_p": pytest.approx(1.0)}
    assert abs(p["rebuilds_per_token"] * n - s["rebuilds"]) <= 1
    one_ms = 1000 * s["rebuild_s"] / s["rebuilds"]
    assert abs(p["ms_per_token_by_stage"]["rebuilds"] * n - 1000 * s["rebuild_s"]) <= one_ms * 1.0001


def test_the_low_acceptance_rule_is_inactive_at_the_papers_acceptance():
    """At 0.92 a window of 8 verifications averages under 0.3 with a chance under one in a million: the rule is reported
    inactive and the rebuilds come every rebuild_after tokens; just under 0.3 it is active and a rebuild
    comes at the latest 8 rounds after the last."""
    spec = Speculation()
    high = low_acceptance_rule(spec, 0.92)
    assert high["active"] is False and high["window_below_p"] < 1e-6
    assert rebuild_interval(spec, 0.92) == pytest.approx(rebuild_interval(replace(spec, rebuild_below=0.0), 0.92))
    assert low_acceptance_rule(spec, 0.29)["active"] is True
    assert rebuild_interval(spec, 0.29) == pytest.approx(8 * (1 + 6 * 0.29))  # 8 rounds well within 128 tokens
    assert rebuild_interval(spec, 0.0) == pytest.approx(8)
    # One drafted token a round (gamma2 = 1), accepted half the time: a window of 2 rounds averages under
    # 0.3 only when neither is accepted, a quarter of the time.
    half = low_acceptance_rule(Speculation(method="retrieval", gamma2=1), 0.5, window=2)
    assert half == {"active": False, "rebuild_below": 0.3, "window_rounds": 2, "window_below_p": pytest.approx(0.25)}
    # The rule reads the acceptance of the level verifying the middle level's tokens, not the draft's.
    assert low_acceptance_rule(spec, {"draft": 0.0, "retrieval": 0.9})["active"] is False


def test_rebuild_interval_averages_over_round_sizes():
    # One independent token per round (retrieval, gamma2 = 1, alpha 1/2): rounds of 1 or 2 tokens, each
    # half the time. A threshold of 2 is reached after 2 tokens (2 rounds of 1, a quarter; a round of 2,
    # half) or 3 (a round of 1, then one of 2: a quarter): 2.25 tokens on average.
    spec = Speculation(method="retrieval", gamma2=1, rebuild_every=2)
    assert rebuild_interval(spec, 0.5) == pytest.approx(2.25)
    # No recursion limit for a long interval.
    assert rebuild_interval(Speculation(rebuild_every=5000, budget=1 << 20), 0.92) > 5000


def test_one_acceptance_per_level():
    spec = Speculation(gamma1=2, gamma2=6)
    # The middle level always right, the draft never: each middle round yields one token (its own), so a
    # full round of 7 tokens takes 6 middle rounds of 2 draft forwards each.
    f = forwards_per_token(spec, {"draft": 0.0, "retrieval": 1.0})
    assert f == pytest.approx({"draft": 12 / 7, "retrieval": 6 / 7, "full": 1 / 7})
    assert forwards_per_token(spec, {"draft": 0.7, "retrieval": 0.7}) == forwards_per_token(spec, 0.7)
    naive = Speculation(method="naive", gamma2=6)
    assert forwards_per_token(naive, {"draft": 1.0, "retrieval": 0.0}) == forwards_per_token(naive, 1.0)


@pytest.mark.cuda
@pytest.mark.parametrize("fold_at", [256, 2])
def test_stage_times_on_cuda(tiny_dir, monkeypatch, fold_at):
    """CUDA events around each forward, folded as they complete (fold_at 2: during the decode), read after."""
    monkeypatch.setattr("tforce.engine.timing.FOLD_AT", fold_at)
    target = tforce.load_model(str(tiny_dir / "gqa"), device="cuda").model
    draft = tforce.load_model(str(tiny_dir / "draft"), device="cuda").model
    ids = [3 + i % 250 for i in range(300)]  # inside the tiny models' 259-id vocabulary
    r = tforce.generate(target, ids, draft=draft, method="triforce", max_new_tokens=32, temperature=0.0,
                        ignore_eos=True, budget=64, chunk_size=4, draft_budget=32, sinks=4)
    s = r.stats
    assert set(s["stage_s"]) == {"draft", "retrieval", "full"} and all(v > 0 for v in s["stage_s"].values())
    assert sum(s["stage_s"].values()) <= s["decode_s"]


class _Rows(Rows):
    """B rows; the draft and middle nodes' caches run forwards over some rows, as the streaming and retrieval
    caches do (rows that have their drafts sit the round out), the full node's feeds every row."""

    def __init__(self, rows: int, subsets: bool):
        self._init_rows(rows)
        self.subsets = subsets

    def begin(self, n, counts=None, rows=None):
        self.pending = n


def _batch_node(name: str, probs: torch.Tensor, capacity: int, rows: int) -> Node:
    logits = probs.log()

    def runner(ids, last_n):
        return logits.expand(ids.shape[0], last_n or ids.shape[1], len(probs))

    return Node(name, torch.nn.Linear(1, 1), _Rows(rows, name != "full"), Sampling(temperature=1.0, top_p=1.0),
                capacity, runner=runner)


@pytest.mark.parametrize("method", ["triforce", "naive", "retrieval"])
@pytest.mark.parametrize("alpha", [0.5, 0.92])
def test_a_batchs_forwards_are_its_slowest_rows(method, alpha):
    """B rows through the real levels, each drafted token accepted independently: the batch's forwards per
    token of all rows are forwards_per_token(rows=B)'s, which counts E[max over the rows] proposer rounds;
    the one-row model (rounds of the mean row) is too low by far for triforce."""
    B, rounds = 8, 400
    spec = Speculation(method=method, gamma1=2, gamma2=6)
    capacity = rounds * (spec.gamma2 + 1) + 64
    nodes = {name: _batch_node(name, p, capacity, B) for name, p in _dists(alpha).items()}
    def build(level):
        if level[0] == "drafter":
            return Drafter(nodes[level[1]])
        return SpecLevel(build(level[1]), nodes[level[2]], level[3], ids=list(range(B)), n_prompts=B)

    top = build(spec.hierarchy())
    seq, gen = torch.zeros(B, capacity, dtype=torch.long), torch.Generator().manual_seed(0)
    n = [1] * B
    for _ in range(rounds):
        tokens, _ = top.round(seq, n, gen)
        n = [nb + len(t) for nb, t in zip(n, tokens)]
    made = sum(nb - 1 for nb in n)
    measured = {name: node.forwards / made for name, node in nodes.items() if node.forwards}
    rates, level = {}, top  # each level's acceptance over all rows, as the statistics report it
    while isinstance(level, SpecLevel):
        key = "draft" if isinstance(level.proposer, Drafter) and level.proposer.node.name == "draft" else "retrieval"
        rates[key] = sum(level.stats.accepted) / sum(level.stats.drafted)
        level = level.proposer
    expected = forwards_per_token(spec, rates, rows=B)
    assert measured.keys() == expected.keys()
    for name in expected:
        assert measured[name] == pytest.approx(expected[name], rel=0.01), name
    if method == "triforce":  # the slowest of 8 rows, not the mean row: the one-row model is far too low
        one = {name: f / B for name, f in forwards_per_token(spec, rates).items()}
        assert measured["retrieval"] > 1.15 * one["retrieval"] and measured["full"] == pytest.approx(one["full"], 0.03)
