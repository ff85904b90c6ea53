"""calibration.py: an entry is written atomically and read back under its key; a stale, damaged, foreign
or incomplete one is not used; a real calibration on the tiny pair measures every method once and is
then read from the cache, until refreshed; a run's acceptance is folded in."""
from __future__ import annotations

import json

import pytest

from tforce.config import RunConfig
from tforce.auto import calibration
from tforce.auto.calibration import entry_name
from tforce.auto.chooser import choose

OPTIONS = dict(method="auto", temperature=0.0, max_new_tokens=16, budget=64, chunk_size=4, draft_budget=32, sinks=4)
CONFIG = RunConfig.of(**OPTIONS)
METHODS = ["ar", "naive", "retrieval", "streaming", "triforce"]
TIMED = METHODS + ["naive+lookup", "triforce+lookup"]  # with a draft model: lookup in its place too


def _entry(k: dict, at: float) -> dict:
    held = {"costs": {"ms_per_forward": {"full": 1.0}, "other_ms_per_forward": 0.1, "rebuild_ms": None},
            "gamma1": 2, "gamma2": 6, "acceptance": {"draft": 0.5, "retrieval": 0.5}, "ms_per_token": 1.1,
            "tokens": 24}
    return {"key": k, "measured_at": at, "calibration_s": 1.0, "methods": {m: dict(held) for m in METHODS}}


@pytest.fixture
def key(tiny):
    return calibration.key(tiny["gqa"], tiny["draft"], 300, CONFIG)


def test_written_atomically_and_read_back(tmp_path, key):
    path = calibration.write(_entry(key, 1000.0), tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left beside it
    assert calibration.read(key, METHODS, tmp_path, now=1000.0 + 3600)["measured_at"] == 1000.0


def test_stale_damaged_foreign_or_incomplete_entries_are_measured_again(tmp_path, key):
    path = calibration.write(_entry(key, 1000.0), tmp_path)
    assert calibration.read(key, METHODS, tmp_path, now=1000.0 + calibration.STALE_AFTER_S + 1) is None
    assert calibration.read(key, METHODS, tmp_path, now=999.0) is None  # from the future: a clock was wrong
    assert calibration.read(key, METHODS + ["other"], tmp_path, now=1000.0) is None
    other = dict(key, context=key["context"] + 1)  # another context bucket: another file
    assert calibration.path_of(other, tmp_path) != path
    assert calibration.read(other, METHODS, tmp_path, now=1000.0) is None
    calibration.path_of(other, tmp_path).write_text(path.read_text())  # a file under another key's name
    assert calibration.read(other, METHODS, tmp_path, now=1000.0) is None
    path.write_text(path.read_text()[:40])  # cut short
    assert calibration.read(key, METHODS, tmp_path, now=1000.0) is None


def test_key_names_machine_models_and_context(tiny, key):
    assert key == calibration.key(tiny["gqa"].model, tiny["draft"].model, 300, CONFIG)  # a module or a LoadedModel
    assert key["target"] != calibration.key(tiny["mha"], tiny["draft"], 300, CONFIG)["target"]
    assert key["draft"] != calibration.key(tiny["gqa"], None, 300, CONFIG)["draft"]
    assert {key["dtype"], key["device"], key["greedy"]} == {"float32", "cpu", True}
    assert calibration.context_bucket(1100) == calibration.context_bucket(1400) != calibration.context_bucket(3300)


def test_remember_folds_a_run_into_the_acceptance(tmp_path, key):
    entry = _entry(key, 1000.0)
    calibration.remember(entry, "triforce", {"draft": 1.0, "retrieval": 0.0}, 24, {"gamma1": 2, "gamma2": 6}, tmp_path)
    held = json.loads(calibration.path_of(key, tmp_path).read_text())["methods"]["triforce"]
    assert held["acceptance"] == {"draft": pytest.approx(0.75), "retrieval": pytest.approx(0.25)}
    assert held["tokens"] == 48


def test_a_calibration_is_measured_once_then_read(tiny, tmp_path, monkeypatch):
    ids = [3 + i % 250 for i in range(300)]
    calls = []
    measure = calibration.measure
    monkeypatch.setattr(calibration, "measure", lambda *a: calls.append(a[1]) or measure(*a))
    first = choose(tiny["gqa"], tiny["draft"], ids, CONFIG, folder=tmp_path)
    assert first.measured_now and calls == [TIMED]
    for method in TIMED:
        held = first.entry["methods"][method]
        assert held["costs"]["ms_per_forward"]["full"] > 0 and held["tokens"] == calibration.CAL_TOKENS
    assert "draft" not in first.entry["methods"]["naive+lookup"]["costs"]["ms_per_forward"]  # no draft model ran
    assert first.best in first.candidates and {entry_name(c) for c in first.candidates} == set(TIMED)
    again = choose(tiny["gqa"], tiny["draft"], ids[:280], CONFIG, folder=tmp_path)  # the same context bucket
    assert not again.measured_now and len(calls) == 1 and again.entry == first.entry
    fresh = choose(tiny["gqa"], tiny["draft"], ids, CONFIG, folder=tmp_path, refresh=True)
    assert fresh.measured_now and len(calls) == 2


def test_the_methods_and_the_run_share_one_prefill_and_stay_exact(tiny, tmp_path, monkeypatch):
    """With kv_dir, the first timed method saves the prompt's prefill and the others load it, as does the run
    (chooser.generate): each method accepts what it accepts after its own prefill, and the run is ar's tokens."""
    from tforce.auto import chooser
    from tforce.engine.generate import generate

    ids = [3 + (7 * i) % 250 for i in range(300)]
    alone = choose(tiny["gqa"], tiny["draft"], ids, CONFIG, folder=tmp_path / "alone")
    loads = []
    monkeypatch.setattr(chooser, "run_one", lambda *a: loads.append(a[2].load_kv) or generate(*a))  # (target, ids, config, ...)
    shared = choose(tiny["gqa"], tiny["draft"], ids, CONFIG, folder=tmp_path / "shared", kv_dir=tmp_path / "kv")
    timed = [kv for kv in loads if kv is not None]
    assert len(timed) == len(TIMED) - 1 and shared.snapshot is not None and shared.applied(CONFIG).load_kv == timed[0]
    for method in TIMED:
        assert shared.entry["methods"][method]["acceptance"] == alone.entry["methods"][method]["acceptance"]
    monkeypatch.setattr(calibration, "shares_prefill", lambda target, n: True)
    result = chooser.generate(tiny["gqa"], ids, draft=tiny["draft"], **{**OPTIONS, "max_new_tokens": 24})
    ar = generate(tiny["gqa"], ids, RunConfig.of(method="ar", temperature=0.0, max_new_tokens=24))
    assert result.tokens == ar.tokens and result.stats["kv_reused"] == len(ids) - 1


def test_a_prompt_whose_kv_cache_is_large_is_prefilled_by_each_method(tiny, monkeypatch):
    monkeypatch.setattr(calibration, "SHARED_PREFILL_MAX_BYTES", 1000)
    assert calibration.shares_prefill(tiny["gqa"], 1) and not calibration.shares_prefill(tiny["gqa"], 10_000)
