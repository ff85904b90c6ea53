"""`--draft lookup` through the engine (Speculation.proposer "lookup": session.py puts a LookupLevel where
the draft model's level would be): every drafting method's greedy tokens are plain decoding's, one prompt
and a batch, sampling follows the exact target distribution (chi-square), and the command line runs it
without a draft model."""
import json

import pytest

import tforce
from tforce.cli import app

from cli_helpers import models, runner  # noqa: F401
from exactness_helpers import N_TOKENS, SAMPLES, SMALL, check, draw, exact_joint
from lookup_helpers import REPEATING, SELF_SAMPLED

DRAFTING = ["naive", "triforce", "streaming"]


@pytest.mark.parametrize("method", DRAFTING)
def test_greedy_equals_plain_decoding_without_a_draft_model(tiny, method):
    kw = dict(max_new_tokens=40, temperature=0, ignore_eos=True)
    ar = tforce.generate(tiny["gqa"], REPEATING, method="ar", **kw)
    out = tforce.generate(tiny["gqa"], REPEATING, method=method, proposer="lookup", rebuild_every=8, **SMALL, **kw)
    assert out.tokens == ar.tokens
    assert out.stats["acceptance"]["draft"] > 0  # the lookup's drafts were verified, and some kept
    if method == "naive":  # one verification per round of up to gamma2 + 1 tokens: fewer than ar's forwards
        assert out.stats["forwards"]["full"] < ar.stats["forwards"]["full"]


@pytest.mark.parametrize("threshold", [0.3, 1.0])
def test_matches_declined_by_their_record_equal_plain_decoding(tiny, threshold):
    """--lookup-threshold 0.3: matches whose length has lately been wrong draft nothing; 1: no match has a
    perfect record (PRIOR), none drafts, every round one token of the full node's."""
    kw = dict(max_new_tokens=40, temperature=0, ignore_eos=True)
    ar = tforce.generate(tiny["gqa"], REPEATING, method="ar", **kw)
    out = tforce.generate(tiny["gqa"], REPEATING, method="triforce", proposer="lookup", lookup_threshold=threshold,
                          **SMALL, **kw)
    assert out.tokens == ar.tokens
    assert (out.stats["acceptance"]["draft"] is None) == (threshold == 1.0)


@pytest.mark.parametrize("threshold", [0.0, 0.5])
def test_batch_rows_equal_plain_decoding(tiny, threshold):
    prompts = [REPEATING, REPEATING[:20], [7, 8, 9, 7, 8]]
    kw = dict(max_new_tokens=24, temperature=0, ignore_eos=True)
    rows = tforce.generate_batch(tiny["gqa"], prompts, method="triforce", proposer="lookup", **SMALL, **kw,
                                 lookup_threshold=threshold)
    for prompt, row in zip(prompts, rows):
        assert row.tokens == tforce.generate(tiny["gqa"], prompt, method="ar", **kw).tokens


@pytest.mark.parametrize("method", ["naive", "triforce"])
def test_sampling_matches_target_distribution(small_vocab, method):
    target, _ = small_vocab
    samples, acc = draw(target, None, SELF_SAMPLED, method, SAMPLES, seed=5, proposer="lookup")
    pvals = check(samples, exact_joint(target, SELF_SAMPLED, N_TOKENS))
    assert min(pvals) > 1e-3, pvals
    assert 0.05 < acc < 0.99, acc  # drafts both kept and rejected: the test can tell


def test_run_draft_lookup_needs_no_draft_model(runner, models):  # noqa: F811
    """`tforce run --draft lookup`: no draft model is read (none is given or found), the answer is --method
    ar's, and the statistics report the lookup's acceptance as the draft level's."""
    base = ["run", "-m", str(models / "tiny-target"), "-p", "ab ab ab ab ab ab ab ab", "-n", "16", "-t", "0",
            "--ignore-eos", "--json"]
    ar = json.loads(runner.invoke(app, base + ["--method", "ar"]).stdout)
    result = runner.invoke(app, base + ["--method", "naive", "--draft", "lookup", "--lookup-max", "2"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["tokens"] == ar["tokens"] and out["method"] == "naive"
    assert out["stats"]["acceptance"]["draft"] is not None


@pytest.mark.parametrize("args, needle", [(["--lookup-min", "0"], "--lookup-min"),
                                          (["--lookup-min", "3", "--lookup-max", "2"], "--lookup-max"),
                                          (["--lookup-threshold", "1.5"], "--lookup-threshold must be in [0, 1]")])
def test_bad_lookup_sizes_are_one_line(runner, models, args, needle):  # noqa: F811
    from cli_helpers import one_error_line

    one_error_line(runner.invoke(app, ["run", "-m", str(models / "tiny-target"), "-p", "hi", "--method", "naive",
                                       "--draft", "lookup", *args]), 2, needle)


def test_a_registry_default_of_lookup_runs_without_a_draft_model(runner, models, monkeypatch):  # noqa: F811
    """A model whose registry draft is "lookup" (SmolLM2's, registry.py): `run` without --draft proposes by
    lookup and reads no draft model, though the folder has a sibling X-draft; --draft still names a model."""
    import tforce.cli.setup as setup
    from tforce.model.registry import LOOKUP

    base = ["run", "-m", str(models / "tiny-target"), "-p", "ab ab ab ab ab ab ab ab", "-n", "16", "-t", "0",
            "--ignore-eos", "--json", "--method", "naive"]
    with_model = json.loads(runner.invoke(app, base).stdout)  # the sibling tiny-draft, as before
    monkeypatch.setattr(setup, "default_draft", lambda model: LOOKUP)
    result = runner.invoke(app, base)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert "draft" in with_model["stats"]["forwards"] and "draft" not in out["stats"]["forwards"]
    assert out["tokens"] == with_model["tokens"] and out["stats"]["acceptance"]["draft"] is not None
    given = json.loads(runner.invoke(app, base + ["--draft", str(models / "tiny-draft")]).stdout)
    assert "draft" in given["stats"]["forwards"]


def test_a_registry_default_of_lookup_reaches_bench(runner, models, monkeypatch):  # noqa: F811
    import tforce.cli.bench as bench
    from cli_helpers import session_configs
    from tforce.model.registry import LOOKUP

    monkeypatch.setattr(bench, "default_draft", lambda model: LOOKUP)
    seen = session_configs(monkeypatch)
    result = runner.invoke(app, ["bench", "-m", str(models / "tiny-target"), "--device", "cpu", "--prompt-len",
                                 "40", "--gen-len", "4", "--methods", "naive,triforce", "--json"])
    assert result.exit_code == 0, (result.output, result.exception)
    assert seen and {c.speculation.proposer for c in seen} == {"lookup"}


def test_the_summary_says_lookup_ran(runner, models):  # noqa: F811
    """The stderr summary names the bottom level where lookup took the draft's place."""
    result = runner.invoke(app, ["run", "-m", str(models / "tiny-target"), "-p", "ab ab ab ab", "-n", "4", "-t", "0",
                                 "--method", "naive", "--draft", "lookup"])
    assert result.exit_code == 0, result.output
    assert "tforce: naive with lookup: 4 tokens after" in result.stderr


def test_bench_auto_with_lookup_checks_every_method_it_may_run_fits(runner, models, monkeypatch):  # noqa: F811
    """`bench --methods auto --draft lookup`: the calibration runs the drafting methods with lookup, so each is
    checked to fit before anything is built, though there is no draft model."""
    import tforce.cli.bench as bench

    checked = []
    monkeypatch.setattr(bench, "check_memory", lambda *a, **k: checked.append(a[6] if len(a) > 6 else k))
    result = runner.invoke(app, ["bench", "-m", str(models / "tiny-target"), "--device", "cpu", "--prompt-len", "40",
                                 "--gen-len", "4", "--methods", "auto", "--draft", "lookup", "--json"])
    assert result.exit_code == 0, (result.output, result.exception)
    assert {"naive", "triforce", "streaming"} <= set(checked), checked


def test_bench_auto_over_ranks_counts_lookup_as_a_bottom_level(runner, models, monkeypatch):  # noqa: F811
    """Over --tp ranks auto is not calibrated (chooser.uncalibrated: triforce on a GPU where there is a bottom
    level); `--draft lookup` is one, as in `tforce run --tp`, and the record says lookup ran."""
    from tforce.auto import chooser

    seen = []
    monkeypatch.setattr(chooser, "uncalibrated", lambda device, bottom: seen.append(bottom) or
                        ("naive" if bottom else "ar"))  # what a GPU would take, on the CPU
    result = runner.invoke(app, ["bench", "-m", str(models / "tiny-target"), "--tp", "2", "--device", "cpu",
                                 "--methods", "auto", "--draft", "lookup", "--prompt-len", "40", "--gen-len", "4",
                                 "--json"])
    assert result.exit_code == 0, (result.output, result.exception)
    (run,) = json.loads(result.stdout)["runs"]
    assert seen == [True] and run["auto"] == {"method": "naive", "calibrated_now": False, "proposer": "lookup"}
