"""`--method auto` as a user sees it (Typer's CliRunner, tiny random checkpoints): the default method, greedy
tokens equal to ar's, the one stderr line naming the choice and the alternatives' predictions, --json's
record, sampling equal to the chosen method's, bad options refused in one line; `tforce tune`'s table and
`tforce bench --methods ar,auto`."""
from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

import tforce
from tforce.cli import app
from tforce.config import METHODS

DOC = "It was the best of times, it was the worst of times, it was the age of wisdom. " * 4
FAST = ["--budget", "64", "--draft-budget", "32", "--sinks", "4", "-n", "12"]


@pytest.fixture(scope="module")
def models(tiny_dir, tmp_path_factory):
    """The session's tiny checkpoints (conftest.py) and a document."""
    root = tmp_path_factory.mktemp("auto")
    for name in ("gqa", "draft"):
        (root / name).symlink_to(tiny_dir / name)
    (root / "doc.txt").write_text(DOC)
    return root


@pytest.fixture(scope="module")
def runner():
    return CliRunner()


def _run(runner, models, *args):
    return runner.invoke(app, ["run", "-m", str(models / "gqa"), "--draft", str(models / "draft"),
                               str(models / "doc.txt"), *FAST, *args])


def _auto_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("tforce: auto: ")]


def test_auto_is_the_default_and_greedy_equals_ar(runner, models):
    r = _run(runner, models, "--temperature", "0", "--json")
    assert r.exit_code == 0, (r.output, r.exception)
    obj = json.loads(r.stdout)
    chosen = obj["auto"]
    assert obj["method"] == chosen["method"] in METHODS
    assert {c["method"] for c in chosen["candidates"]} == set(METHODS)
    assert chosen["predicted_ms_per_token"] == min(c["ms_per_token"] for c in chosen["candidates"])
    ar = _run(runner, models, "--temperature", "0", "--json", "--method", "ar")
    assert json.loads(ar.stdout)["tokens"] == obj["tokens"] and len(obj["tokens"]) == 12
    assert json.loads(ar.stdout)["auto"] is None


def test_one_stderr_line_says_the_choice_and_the_others(runner, models):
    r = _run(runner, models, "--temperature", "0")
    assert r.exit_code == 0, (r.output, r.exception)
    [line] = _auto_lines(r.stderr)
    setting = line.removeprefix("tforce: auto: ").split(", predicted")[0]  # "naive with lookup (gamma2 6)"
    shown = setting.split(" (")[0]  # the method, and "with lookup" where lookup took the draft's place
    chosen = shown.split(" ")[0]
    assert chosen in METHODS and shown in (chosen, chosen + " with lookup") and "ms/token" in line
    for m in METHODS:  # the alternatives' predictions beside the choice
        assert re.search(rf"(auto: |; |others: ){m}\b[^;]* \d+\.\d", line), (m, line)
    assert f"tforce: {shown}: 12 tokens" in r.stderr  # the summary names the method that ran


def test_sampling_is_the_chosen_methods(runner, models):
    """auto runs the chosen method with the user's seed: its sample is that method's, token for token, so
    auto inherits its exactness (tests/engine/test_exactness.py's chi-square tests)."""
    r = _run(runner, models, "--temperature", "0.8", "--seed", "7", "--json")
    assert r.exit_code == 0, (r.output, r.exception)
    obj = json.loads(r.stdout)
    knobs = [x for k in ("gamma1", "gamma2") if k in obj["auto"] for x in (f"--{k}", str(obj["auto"][k]))]
    same = _run(runner, models, "--temperature", "0.8", "--seed", "7", "--json", "--method", obj["method"], *knobs)
    assert json.loads(same.stdout)["tokens"] == obj["tokens"]


@pytest.mark.parametrize("args, needle", [
    (["--gamma1", "0"], "--gamma1 must be positive"),
    (["--gamma2", "-1"], "--gamma2 must be positive"),
    (["--method", "auto", "--budget", "0"], "--budget must be positive"),
    (["--method", "autp"], "choose one of auto, "),
])
def test_bad_options_are_one_line(runner, models, args, needle):
    r = _run(runner, models, *args)
    assert r.exit_code == 2, (r.output, r.exception)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tforce: error: ") and needle in lines[0], r.stderr
    assert r.stdout == ""


def test_without_a_calibration_auto_says_what_it_took(runner, models, tmp_path):
    batch = tmp_path / "batch.jsonl"
    batch.write_text(json.dumps({"prompt": "Hello"}) + "\n")
    r = runner.invoke(app, ["run", "-m", str(models / "gqa"), "--draft", str(models / "draft"),
                            "--batch", str(batch), *FAST, "--temperature", "0"])
    assert r.exit_code == 0, (r.output, r.exception)
    assert _auto_lines(r.stderr) == ["tforce: auto: ar (this command runs no calibration: on a GPU with a draft "
                                     "triforce, otherwise ar; --method chooses)"]


def test_tune_prints_predicted_beside_measured(runner, models):
    args = ["tune", str(models / "doc.txt"), "-m", str(models / "gqa"), "--draft",
            str(models / "draft"), "-n", "8", "--budget", "64"]
    r = runner.invoke(app, args + ["--json"])
    assert r.exit_code == 0, (r.output, r.exception)
    report = json.loads(r.stdout)
    assert report["auto"]["calibrated_now"] is True  # tune measures again, whatever the cache holds
    rows = report["candidates"]
    assert [c["method"] for c in rows] == [c["method"] for c in report["auto"]["candidates"]]
    assert all(c["ms_per_token"] > 0 and c["measured_ms_per_token"] > 0 for c in rows)
    table = runner.invoke(app, args)
    assert table.exit_code == 0, (table.output, table.exception)
    lines = table.stdout.splitlines()
    assert lines[0].split()[:5] == ["method", "gamma1", "gamma2", "predicted", "measured"]
    assert len(lines) == 1 + len(METHODS) + 2 and sum(line.endswith("(auto)") for line in lines) == 1
    assert {line.split()[0] for line in lines[1:]} == set(METHODS) | {"naive+lookup", "triforce+lookup"}


def test_bench_runs_auto_beside_the_others(runner):
    r = runner.invoke(app, ["bench", "--synthetic", "tiny", "--device", "cpu", "--prompt-len", "200", "--gen-len",
                            "8", "--methods", "ar,auto", "--json"])
    assert r.exit_code == 0, (r.output, r.exception)
    ar, auto = json.loads(r.stdout)["runs"]
    assert ar["method"] == "ar" and ar["auto"] is None
    assert auto["method"] == "auto" and auto["auto"]["method"] in METHODS
    assert auto["projection"] is None or set(auto["projection"]["forwards_per_token"]) >= {"full"}


def test_api_generate_auto_equals_ar(tiny):
    ids = list(range(3, 203))
    opts = dict(max_new_tokens=12, temperature=0.0, budget=64, chunk_size=4, draft_budget=32, sinks=4)
    auto = tforce.generate(tiny["gqa"], ids, draft=tiny["draft"], method="auto", **opts)
    assert auto.stats["auto"]["method"] in METHODS
    assert auto.tokens == tforce.generate(tiny["gqa"], ids, method="ar", **opts).tokens
