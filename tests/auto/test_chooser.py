"""chooser.py: the cheapest candidate from stand-in stage costs and acceptance (hand-computed cases), the
gammas it keeps and searches, the methods it may choose, and a new plan once runs have moved the
acceptance."""
from __future__ import annotations

import time

import pytest

from tforce.auto import calibration
from tforce.config import RunConfig
from tforce.auto.chooser import GAMMA1, GAMMA2, candidates, choose, predictions

OPTIONS = RunConfig.of(method="auto", temperature=0.0, max_new_tokens=64)
ALL = ["ar", "naive", "retrieval", "streaming", "triforce"]


def _method(nodes: dict, acceptance: dict | None, other: float = 0.0, rebuild: float | None = None) -> dict:
    return {"costs": {"ms_per_forward": nodes, "other_ms_per_forward": other, "rebuild_ms": rebuild},
            "gamma1": 2, "gamma2": 6, "acceptance": acceptance or {"draft": None, "retrieval": None},
            "ms_per_token": None, "tokens": 24}


def _entry(full: float, draft: float, middle: float, rate: float, lookup: float = 0.0) -> dict:
    """Stand-in costs; `lookup`: the acceptance of the lookup variants (no draft forwards; 0: never chosen)."""
    both = {"draft": rate, "retrieval": rate}
    return {"key": {}, "measured_at": 0.0, "calibration_s": 0.0, "methods": {
        "naive+lookup": _method({"full": full}, {"draft": lookup, "retrieval": None}),
        "triforce+lookup": _method({"retrieval": middle, "full": full}, {"draft": lookup, "retrieval": rate},
                                   rebuild=0.0),
        "ar": _method({"full": full}, None),
        "naive": _method({"draft": draft, "full": full}, {"draft": rate, "retrieval": None}),
        "retrieval": _method({"retrieval": middle, "full": full}, {"draft": None, "retrieval": rate}, rebuild=0.0),
        "streaming": _method({"draft": draft, "streaming": middle, "full": full}, both),
        "triforce": _method({"draft": draft, "retrieval": middle, "full": full}, both, rebuild=0.0)}}


def _best(entry, fixed=None, methods=ALL):
    return predictions(entry, methods, OPTIONS, 1000, fixed or {})[0]


def test_a_draft_that_is_never_right_loses_to_ar():
    # Nothing accepted: every round yields one token for its forwards, so each speculative method costs
    # more than ar's one full forward (10 ms) per token.
    best = _best(_entry(full=10.0, draft=1.0, middle=5.0, rate=0.0))
    assert best["method"] == "ar" and best["ms_per_token"] == pytest.approx(10.0)


def test_a_cheap_draft_that_is_always_right_wins_with_the_longest_gamma():
    # naive at full acceptance: a round of gamma2 draft forwards and one full forward yields gamma2 + 1
    # tokens: (gamma2 * 1 + 10) / (gamma2 + 1) ms/token, least at the grid's largest gamma2 (20/11). With
    # the middle level as dear as the full one, triforce and retrieval cannot beat that.
    entry = _entry(full=10.0, draft=1.0, middle=10.0, rate=1.0)
    best = _best(entry)
    top = max(GAMMA2)
    assert (best["method"], best["gamma2"]) == ("naive", top)
    assert best["ms_per_token"] == pytest.approx((top + 10) / (top + 1))
    every = predictions(entry, ALL, OPTIONS, 1000, {})
    assert best == min(every, key=lambda c: c["ms_per_token"])
    assert len([c for c in every if c["method"] == "triforce"]) == len(GAMMA1) * len(GAMMA2)


def test_given_gammas_are_kept():
    entry = _entry(full=10.0, draft=1.0, middle=10.0, rate=1.0)
    best = _best(entry, fixed={"gamma2": 4})
    assert (best["method"], best["gamma2"]) == ("naive", 4)
    assert best["ms_per_token"] == pytest.approx(14 / 5)
    assert {c["gamma1"] for c in predictions(entry, ["triforce"], OPTIONS, 1000, {"gamma1": 3})} == {3}


def test_acceptance_moves_between_gammas_at_one_per_token_rate():
    # Measured at gamma2 = 6 with rate 0.5: alpha with sum_{k<=6} alpha^k = 3; at gamma2 = 2 the rate is
    # (alpha + alpha^2) / 2, which is higher (the first drafts are the likeliest accepted).
    entry = _entry(full=10.0, draft=1.0, middle=10.0, rate=0.5)
    naive = {c["gamma2"]: c for c in predictions(entry, ["naive"], OPTIONS, 1000, {})}
    assert naive[6]["acceptance"]["draft"] == pytest.approx(0.5)
    assert naive[2]["acceptance"]["draft"] > 0.5


def test_candidates_follow_the_options_and_the_draft():
    assert candidates(OPTIONS, has_draft=True) == ALL + ["naive+lookup", "triforce+lookup"]
    assert candidates(OPTIONS, has_draft=False) == ["ar", "retrieval"]
    assert candidates(OPTIONS, has_draft=True, exclude={"triforce"}) == ALL[:-1] + ["naive+lookup"]
    # --draft lookup: the drafting methods with lookup, under their own names (no model to weigh it against)
    assert candidates(OPTIONS.with_options(proposer="lookup"), has_draft=False) == ALL
    # a middle-cache policy: only the methods that have a retrieval cache
    topk = OPTIONS.with_options(policy="topk")
    assert candidates(topk, has_draft=True) == ["retrieval", "triforce", "triforce+lookup"]
    # a streaming budget no larger than its sinks
    assert "streaming" not in candidates(OPTIONS.with_options(budget=16, sinks=16, chunk_size=8), has_draft=True)


def test_runs_that_accept_less_change_the_next_plan(tiny, tmp_path, monkeypatch):
    """choose reads the cached entry; a run that accepted nothing, folded in (calibration.remember), makes
    the next plan ar where the calibration's acceptance made it naive."""
    target, draft = tiny["gqa"], tiny["draft"]
    ids = list(range(3, 203))
    entry = _entry(full=10.0, draft=1.0, middle=100.0, rate=1.0)  # a middle level too dear to win
    entry.update(key=calibration.key(target, draft, len(ids), OPTIONS), measured_at=time.time())
    calibration.write(entry, tmp_path)
    monkeypatch.setattr(calibration, "measure", lambda *a: pytest.fail("measured again: the cache was not read"))
    first = choose(target, draft, ids, OPTIONS, folder=tmp_path)
    assert first.best["method"] == "naive" and not first.measured_now
    first.remember({"acceptance": {"draft": 0.0, "retrieval": None}}, tokens=calibration.MEMORY_TOKENS * 4)
    again = choose(target, draft, ids, OPTIONS, folder=tmp_path)
    # the calibration's 24 tokens at 1.0 beside the run's 4,096 at 0
    assert again.entry["methods"]["naive"]["acceptance"]["draft"] == pytest.approx(24 / (24 + 4096))
    assert again.best["method"] == "ar"


def test_with_a_draft_model_lookup_is_weighed_in_its_place(tiny, tmp_path, monkeypatch):
    """A lookup that is always right and costs no draft forward beats the draft model: the choice runs naive
    with proposer lookup, says so, keeps greedy ar's tokens and folds its acceptance into "naive+lookup"."""
    from tforce.auto.chooser import generate
    from tforce.engine.generate import generate as engine_generate

    target, draft = tiny["gqa"], tiny["draft"]
    ids = [3 + i % 40 for i in range(200)]  # repeats: lookup finds matches
    monkeypatch.setattr(calibration, "cache_dir", lambda: tmp_path)  # where generate's choose reads
    monkeypatch.setattr(calibration, "measure", lambda *a: pytest.fail("measured: the entry was not read"))
    entry = _entry(full=10.0, draft=1.0, middle=100.0, rate=0.5, lookup=1.0)
    entry.update(key=calibration.key(target, draft, len(ids), OPTIONS), measured_at=time.time())
    calibration.write(entry, tmp_path)
    choice = choose(target, draft, ids, OPTIONS, folder=tmp_path)
    assert (choice.best["method"], choice.best.get("proposer")) == ("naive", "lookup")
    assert choice.applied(OPTIONS).speculation.proposer == "lookup" and choice.record()["proposer"] == "lookup"
    assert "auto: naive with lookup (gamma2 6)" in choice.line()  # where it was timed: not moved between gammas
    every = predictions(entry, ["naive+lookup", "triforce+lookup"], OPTIONS, 1000, {})
    assert [(c["method"], c.get("gamma1"), c["gamma2"]) for c in every] == [("naive", None, 6), ("triforce", 2, 6)]
    fixed = predictions(entry, ["naive+lookup"], OPTIONS, 1000, {"gamma2": 4})
    assert [c["gamma2"] for c in fixed] == [4]
    looked = OPTIONS.with_options(proposer="lookup")  # --draft lookup: the same, under the methods' own names
    assert [c["gamma2"] for c in predictions(entry, ["naive"], looked, 1000, {})] == [6]
    alone = _entry(full=10.0, draft=0.0, middle=100.0, rate=1.0)  # naive's "draft" level is lookup here
    alone.update(key=calibration.key(target, None, len(ids), looked), measured_at=time.time())
    calibration.write(alone, tmp_path)
    own = choose(target, None, ids, looked, folder=tmp_path, exclude={"triforce"})
    assert own.best["method"] == "naive" and "proposer" not in own.best and own.looked
    assert "auto: naive with lookup (gamma2 6)" in own.line() and "retrieval (gamma2" in own.line()
    assert len(predictions(entry, ["retrieval"], looked, 1000, {})) == len(GAMMA2)  # no lookup in it
    assert any(c["method"] == "naive" and "proposer" not in c for c in choice.candidates)  # the model's, beside it
    choice.remember({"acceptance": {"draft": 0.0, "retrieval": None}}, tokens=calibration.MEMORY_TOKENS * 4)
    held = calibration.read(entry["key"], list(entry["methods"]), tmp_path)["methods"]
    assert held["naive+lookup"]["acceptance"]["draft"] < 0.01 and held["naive"]["acceptance"]["draft"] == 0.5
    calibration.write(entry, tmp_path)  # lookup right again
    kw = dict(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    out = generate(target, ids, method="auto", draft=draft, **kw)
    assert out.stats["auto"]["proposer"] == "lookup" and "draft" not in out.stats["forwards"]
    assert out.tokens == engine_generate(target, ids, RunConfig.of(method="ar", **kw)).tokens


def test_a_verification_fed_fewer_tokens_costs_less():
    # ar's full forward (1 token) 10 ms, the others' (gamma2 + 1 = 7 tokens) 16 ms: 1 ms per token fed. At
    # gamma2 = 2 naive's verification is fed 3 tokens: 12 ms; at full acceptance, rounds of 2 draft
    # forwards (1 ms) and one verification yield 3 tokens: (2 + 12) / 3 ms/token.
    entry = _entry(full=10.0, draft=1.0, middle=100.0, rate=1.0)
    for method in ALL[1:]:
        entry["methods"][method]["costs"]["ms_per_forward"]["full"] = 16.0
    naive = {c["gamma2"]: c for c in predictions(entry, ["naive"], OPTIONS, 1000, {})}
    assert naive[2]["ms_per_token"] == pytest.approx((2 + 12) / 3)
    assert naive[10]["ms_per_token"] == pytest.approx((10 + 20) / 11)


def test_each_method_s_verification_cost_follows_its_own_calibration_and_never_undercuts_ar():
    """A disturbed calibration of one method (streaming's full forward 30 ms where the others' are 5-8) moves
    only its own prediction, and a verification fed fewer tokens never costs less than ar's forward."""
    from tforce.auto.chooser import target_slope

    entry = _entry(full=2.0, draft=0.5, middle=3.0, rate=0.5)
    for method, full in (("naive", 5.0), ("retrieval", 5.0), ("streaming", 30.0), ("triforce", 8.0)):
        entry["methods"][method]["costs"]["ms_per_forward"]["full"] = full
    assert target_slope(entry, "naive") == pytest.approx(3.0 / 6) and target_slope(entry, "ar") == 0.0
    naive = {c["gamma2"]: c for c in predictions(entry, ["naive"], OPTIONS, 1000, {})}
    alone = _entry(full=2.0, draft=0.5, middle=3.0, rate=0.5)
    alone["methods"] = {m: alone["methods"][m] for m in ("ar", "naive")}
    alone["methods"]["naive"]["costs"]["ms_per_forward"]["full"] = 5.0
    assert naive == {c["gamma2"]: c for c in predictions(alone, ["naive"], OPTIONS, 1000, {})}
    steep = _entry(full=2.0, draft=0.5, middle=3.0, rate=0.5)
    steep["methods"]["naive"]["costs"]["ms_per_forward"]["full"] = 2.0 + 6 * 3.0  # 3 ms per token fed
    from tforce.auto.chooser import at_gammas
    at2 = at_gammas(steep["methods"]["naive"], {"gamma1": 2, "gamma2": 2}, "naive", 3.0, 2.0)
    assert at2["ms_per_forward"]["full"] == pytest.approx(2.0 + 2 * 3.0)
    low = at_gammas(steep["methods"]["naive"], {"gamma1": 2, "gamma2": 2}, "naive", 10.0, 2.0)
    assert low["ms_per_forward"]["full"] == 2.0  # extrapolated below ar's one-token forward: held at it


def test_ar_is_kept_unless_a_speculative_method_is_predicted_clearly_faster():
    from tforce.auto.chooser import AR_MARGIN, pick

    ar = {"method": "ar", "ms_per_token": 10.0}
    close = {"method": "naive", "gamma2": 2, "ms_per_token": 10.0 / (1 + AR_MARGIN / 2)}
    clear = {"method": "triforce", "gamma1": 2, "gamma2": 6, "ms_per_token": 10.0 / (1 + 2 * AR_MARGIN)}
    assert pick({"ar": ar, "naive": close}) is ar
    assert pick({"ar": ar, "naive": close, "triforce": clear}) is clear
    assert pick({"naive": close}) is close  # no ar among the candidates
