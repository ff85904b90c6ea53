"""`tforce bench` and `tforce info`'s placement plan through Typer's CliRunner, on the CPU with the tiny
random-weight architecture: one JSON object with every field, one run per method, labelled synthetic."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tforce.bench.suite import parse_size
from tforce.cli import app
from tforce.errors import UsageError
from tforce.model.synthetic import make_checkpoint

from cli_helpers import BENCH, session_configs

RUN_FIELDS = {"method", "ms_per_token", "speedup_vs_ar", "acceptance", "tokens_per_verification", "prefill_s",
              "h2d_gbps", "gpu_mem_gib", "pinned_gib", "floor_ms_per_verification", "placement", "rebuild_s",
              "rebuilds", "prefill_rebuild_s", "forwards", "stage_s", "projection", "gpu_reserved_gib",
              "planned_peak_gib", "auto"}


@pytest.fixture(scope="module")
def runner():
    return CliRunner()


@pytest.fixture(scope="module")
def report(runner):
    result = runner.invoke(app, BENCH + ["--json"])
    assert result.exit_code == 0, (result.output, result.exception)
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1
    return json.loads(lines[0])


def test_bench_json_has_every_field(report):
    assert {"device", "h2d_peak_gbps", "synthetic", "runs", "warmup_s"} <= set(report)
    assert report["synthetic"] is True and report["h2d_peak_gbps"] is None
    assert [r["method"] for r in report["runs"]] == ["ar", "triforce", "naive", "retrieval", "streaming", "auto"]
    assert report["runs"][-1]["auto"]["method"] in report["methods"] and report["runs"][0]["auto"] is None
    for r in report["runs"]:
        assert RUN_FIELDS <= set(r), RUN_FIELDS - set(r)
        assert r["ms_per_token"] > 0 and r["prefill_s"] >= 0 and r["tokens_per_verification"] >= 1
        assert r["h2d_gbps"] is None and r["gpu_mem_gib"] is None  # CPU: nothing crosses a PCIe bus
        assert r["gpu_reserved_gib"] is None and r["planned_peak_gib"] > 0  # the plan for the CPU's memory
        assert r["speedup_vs_ar"] == pytest.approx(report["runs"][0]["ms_per_token"] / r["ms_per_token"])
    ar = report["runs"][0]
    assert ar["speedup_vs_ar"] == 1.0 and ar["tokens_per_verification"] == 1.0
    assert ar["rebuilds"] is None and ar["rebuild_s"] is None  # no retrieval cache
    for r in report["runs"][1], report["runs"][3]:  # triforce, retrieval: rebuilt at prefill, maybe later
        assert r["prefill_rebuild_s"] > 0 and r["rebuilds"] >= 0 and r["rebuild_s"] >= 0
    assert set(report["runs"][1]["acceptance"]) == {"draft", "retrieval"}
    for r in report["runs"]:  # stage times per node, and the projection from them (tests/auto/test_projection.py)
        assert set(r["stage_s"]) == set(r["forwards"]) and sum(r["stage_s"].values()) <= r["decode_s"]
        p = r["projection"]
        assert p["acceptance"] == report["project"] == 0.92 and p["ms_per_token"] > 0
    assert report["runs"][0]["projection"]["speedup_vs_ar"] == 1.0


def test_bench_table_says_synthetic(runner):
    result = runner.invoke(app, BENCH + ["--methods", "retrieval,ar", "--gen-len", "4"])
    assert result.exit_code == 0, (result.output, result.exception)
    assert "SYNTHETIC (random weights)" in result.stdout
    assert result.stdout.index("ar ") < result.stdout.index("retrieval")  # ar first: the baseline
    assert "rebuild" in result.stdout
    assert "SYNTHETIC" in result.stderr  # diagnostics go to stderr, the table to stdout
    assert "projected" in result.stdout and "@0.92" in result.stdout and "projected = NOT" in result.stdout


def test_bench_offload_on_cpu(runner):
    result = runner.invoke(app, BENCH + ["--methods", "triforce", "--gen-len", "4", "--offload", "on", "--json"])
    assert result.exit_code == 0, (result.output, result.exception)
    obj = json.loads(result.stdout)
    run = obj["runs"][0]
    assert run["speedup_vs_ar"] is None  # no ar in --methods
    assert run["h2d_gbps"] is None and run["floor_ms_per_verification"] is None
    assert run["placement"]["resident_layers"] == 0 and run["placement"]["offloaded_layers"] == 2
    assert run["placement"]["device_kv_gib"] > 0 and "gpu_kv_gib" not in run["placement"]  # a CPU run
    assert run["pinned_gib"] > 0


@pytest.mark.parametrize("args, needle", [
    (["--gpu-memory", "lots"], "--gpu-memory"),
    (["--gpu-memory", "24XB"], "--gpu-memory"),
    (["--methods", "ar,fast"], "--methods"),
    (["--offload", "maybe"], "--offload"),
    (["--gpus", "2"], "--gpus runs on CUDA"),
    (["--tp", "2"], "needs --model"),
    (["--prompt-len", "4000", "--gen-len", "200"], "exceeds the model's context"),
    (["--project", "1.5"], "--project"),
    (["--project", "high"], "--project"),
    (["--prefill-chunk", "0"], "--prefill-chunk"),
])
def test_bench_bad_options_are_one_line(runner, args, needle):
    result = runner.invoke(app, BENCH + args)
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tforce: error: ") and needle in lines[0], result.stderr
    assert result.stdout == ""


def test_bench_refuses_what_cannot_fit_before_building(runner, monkeypatch):
    """llama2-7b in float32 on a 24 GiB CPU box: one line with the figures, nothing built."""
    def no_building(*a, **k):
        raise AssertionError("models built")

    monkeypatch.setattr("tforce.cli.common._host_available", lambda: 24 * 2**30)
    monkeypatch.setattr("tforce.bench.suite.synthetic_pair", no_building)
    result = runner.invoke(app, ["bench", "--synthetic", "llama2-7b", "--device", "cpu", "--prompt-len", "1000",
                                 "--gen-len", "24"])
    assert result.exit_code == 1, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tforce: error: not enough memory: "), result.stderr
    assert "target weights 25.1 GiB" in lines[0] and "KV cache for 1024 tokens 1.0 GiB" in lines[0]
    assert "24.0 GiB available" in lines[0]


def test_bench_table_fits_80_columns(runner):
    """Every number of the report is printed whole (never cut to '1.…') in a terminal of 80 columns."""
    from tforce.cli.bench_table import bench_rows

    args = BENCH + ["--methods", "ar,triforce", "--gen-len", "4", "--threads", "1"]
    result = runner.invoke(app, args, env={"COLUMNS": "80"})
    assert result.exit_code == 0, (result.output, result.exception)
    assert "…" not in result.stdout and max(len(line) for line in result.stdout.splitlines()) <= 80
    report = json.loads(runner.invoke(app, args + ["--json"]).stdout)
    report["runs"][0]["ms_per_token"] = 12345.6  # wider figures than the tiny model's
    report["runs"][1]["placement"].update(resident_layers=80, offloaded_layers=120)
    from io import StringIO

    from rich.console import Console

    from tforce.cli.bench_table import print_bench

    out = StringIO()
    print_bench(report, Console(file=out, width=80))
    text = out.getvalue()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80
    cells = {line.strip() for line in text.replace("│", "\n").splitlines()}
    for row in bench_rows(report):
        assert set(row) <= cells, set(row) - cells
    assert "12345.6" in cells and "80/120" in cells


def test_bench_warm_up_line_counts_the_prompt(runner):
    result = runner.invoke(app, BENCH + ["--methods", "ar", "--gen-len", "2"])
    assert result.exit_code == 0, (result.output, result.exception)
    assert "on the first 200 prompt tokens" in result.stderr


def test_bench_takes_one_model_source(runner, tmp_path):
    result = runner.invoke(app, ["bench", "-m", str(tmp_path), "--synthetic", "tiny", "--device", "cpu"])
    assert result.exit_code == 2 and "give --model or --synthetic ARCH, not both" in result.stderr


def test_bench_without_a_model_times_the_demo_pair_on_its_excerpt(runner, monkeypatch):
    """Neither --model nor --synthetic was a usage error while run and chat default to the demo pair: bench
    now times that pair too, on its excerpt (3300 tokens of it by default, as `make demo`), and says so."""
    import tforce.bench.suite
    from tforce.model.defaults import demo_pair
    from tforce.text.demo import EXCERPT

    seen = []
    real = tforce.bench.suite.prompt_ids

    def spy(n, vocab, tokenizer=None, text=None, seed=0):
        seen.append((n, text))
        return real(n, vocab, tokenizer, text, seed)

    monkeypatch.setattr(tforce.bench.suite, "prompt_ids", spy)
    result = runner.invoke(app, ["bench", "--device", "cpu", "--gen-len", "4", "--methods", "ar,triforce",
                                 "--temperature", "0", "--threads", "1", "--json"])
    assert result.exit_code == 0, (result.output, result.exception)
    target, draft = demo_pair()
    assert result.stderr.splitlines()[:2] == [
        f"tforce: no --model given: using the trained demo pair {target} (draft: {draft}; small models trained by "
        "scripts/train_demo.py, see models/README.md)",
        "tforce: bench: no --prompt-file given: timing 3300 tokens of the demo's excerpt (Great Expectations, "
        "chapters 1-2)"]
    assert seen == [(3300, EXCERPT.read_text(encoding="utf-8").strip())]
    obj = json.loads(result.stdout)
    assert obj["model"] == target and obj["synthetic"] is False
    assert [r["method"] for r in obj["runs"]] == ["ar", "triforce"] and obj["runs"][1]["acceptance"]["draft"] > 0


def test_bench_on_the_demo_pair_refuses_in_one_line(runner):
    """The demo notice and the excerpt's line came before the check that the prompt and generation fit the
    demo target's context, so a refused bench printed them above its error."""
    r = runner.invoke(app, ["bench", "--device", "cpu", "--gen-len", "5000", "--methods", "ar"])
    assert r.exit_code == 2, (r.output, r.exception)
    assert r.stderr.strip().splitlines() == [
        "tforce: error: --prompt-len 3300 + --gen-len 5000 exceeds the model's context (4096 tokens)"], r.stderr


def test_bench_fits_its_default_prompt_to_a_short_context(runner, tmp_path):
    """`tforce bench -m MODEL` with a context under the default 122,880 tokens was refused with an error
    naming a --prompt-len the user never typed; the default is now cut to what the context leaves, and
    stderr says so. A --prompt-len that is typed is still refused."""
    make_checkpoint(tmp_path / "short", seed=0, max_position_embeddings=256)
    args = ["bench", "-m", str(tmp_path / "short"), "--device", "cpu", "--methods", "ar", "--gen-len", "8"]
    r = runner.invoke(app, args + ["--json"])
    assert r.exit_code == 0, (r.output, r.exception)
    assert json.loads(r.stdout)["prompt_tokens"] == 248
    assert ("tforce: note: the model's context (256 tokens) is shorter than the default --prompt-len 122880 + "
            "--gen-len 8: benchmarking prompts of 248 tokens") in r.stderr
    r = runner.invoke(app, args + ["--prompt-len", "250"])
    assert r.exit_code == 2 and "--prompt-len 250 + --gen-len 8 exceeds the model's context (256 tokens)" in r.stderr


def test_bench_split_over_ranks(runner, tmp_path):
    """--tp 2 on the CPU: the target split over two gloo ranks (tforce.parallel.tp.generate_tp)."""
    make_checkpoint(tmp_path / "target", seed=0, num_key_value_heads=2)
    result = runner.invoke(app, ["bench", "-m", str(tmp_path / "target"), "--tp", "2", "--device", "cpu",
                                 "--methods", "retrieval", "--prompt-len", "100", "--gen-len", "4", "--json"])
    assert result.exit_code == 0, (result.output, result.exception)
    obj = json.loads(result.stdout)
    assert obj["synthetic"] is False and obj["ranks"] == 2 and obj["warmup_s"] is None
    (run,) = obj["runs"]
    assert run["method"] == "retrieval" and run["tokens"] == 4 and run["speedup_vs_ar"] is None
    assert run["placement"]["ranks"] == 2


def test_parse_size():
    assert parse_size("24GiB") == 24 * 2**30
    assert parse_size("24GB") == 24 * 10**9
    assert parse_size("24000MiB") == 24000 * 2**20
    assert parse_size("1.5g") == int(1.5 * 2**30)
    for bad in ("", "GiB", "-1GiB", "0", "12 parsecs"):
        with pytest.raises(UsageError):
            parse_size(bad)


def test_info_plans_offloaded_layers(runner):
    args = ["info", "--synthetic", "llama2-7b", "--context", "131072", "--gpu-memory", "24GiB"]
    result = runner.invoke(app, args + ["--json"])
    assert result.exit_code == 0, (result.output, result.exception)
    plan = json.loads(result.stdout)["plan"]
    assert plan["kv_bytes"] == 64 * 2**30
    assert 0 < plan["offloaded_layers"] < 32 and plan["resident_layers"] + plan["offloaded_layers"] == 32
    assert plan["host_kv_bytes"] == plan["offloaded_layers"] * 2 * 2**30
    text = " ".join(runner.invoke(app, args).stdout.split())  # rich wraps at 80 columns
    assert "placement plan" in text and "in pinned host memory" in text and "64.00 GiB" in text
    assert "RANDOM WEIGHTS" in text


def test_run_takes_placement_options(runner):
    result = runner.invoke(app, ["run", "-m", "nowhere", "-p", "hi", "--gpu-memory", "lots"])
    assert result.exit_code == 2 and "--gpu-memory" in result.stderr


def test_bench_times_row_wise_verification_beside_the_plain_one(runner, monkeypatch):
    """--methods triforce,triforce+det: the deterministic mode's cost, measured side by side in one run."""
    from model_helpers import count_rowwise_runners
    from tforce.bench.suite import parse_methods
    from tforce.bench.run import split_method

    built = count_rowwise_runners(monkeypatch)

    assert parse_methods("triforce+det,ar") == ("ar", "triforce+det")
    assert split_method("retrieval+det") == ("retrieval", True) and split_method("ar") == ("ar", False)
    with pytest.raises(UsageError):
        parse_methods("ar+det2")
    result = runner.invoke(app, BENCH + ["--methods", "ar,triforce,triforce+det", "--temperature", "0", "--json"])
    assert result.exit_code == 0, (result.output, result.exception)
    runs = json.loads(result.stdout.strip().splitlines()[-1])["runs"]
    assert [r["method"] for r in runs] == ["ar", "triforce", "triforce+det"]
    assert all(r["ms_per_token"] > 0 for r in runs)
    assert len(built) == 2  # triforce+det's warm-up and timed run, and nothing else


def test_bench_summary_tabulates_a_record(report, tmp_path):
    """scripts/bench_summary.py: one markdown row per run, stages beside their floors, the projection labelled."""
    import subprocess
    import sys
    from pathlib import Path

    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_summary.py"
    out = subprocess.run([sys.executable, str(script), str(path)], capture_output=True, text=True, check=True).stdout
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| method")]
    assert [row.split(" | ")[0][2:] for row in rows] == [r["method"] for r in report["runs"]]
    assert "projected ms/token @0.92" in out and "SYNTHETIC" in out
    assert "draft " in rows[1] and "retrieval " in rows[1] and "full " in rows[1]  # triforce's three stages


def test_bench_summary_tabulates_the_good_records_beside_a_bad_one(report, tmp_path):
    """A record it cannot tabulate (a --batch record, an empty file from a bench cut short) is one line and
    exit 1; the other records' tables still come."""
    import subprocess
    import sys
    from pathlib import Path

    good, batch, empty = tmp_path / "good.json", tmp_path / "batch.json", tmp_path / "empty.json"
    good.write_text(json.dumps(report))
    batch.write_text(json.dumps({**report, "runs": [{"method": "ar", "batch_tokens_per_s": 1.0}]}))
    empty.write_text("")
    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_summary.py"
    done = subprocess.run([sys.executable, str(script), str(batch), str(empty), str(good)], capture_output=True,
                          text=True)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert f"{batch}: not a record of single runs" in done.stdout and f"{empty}: not a bench record" in done.stdout
    assert "`good.json`" in done.stdout and "| triforce |" in done.stdout


def test_bench_lookup_lengths_reach_the_engine(runner, monkeypatch):
    """--lookup-max/--lookup-min as `run` takes them; a pair out of order is one line and exit 2."""
    seen = session_configs(monkeypatch)
    result = runner.invoke(app, BENCH + ["--methods", "naive", "--draft", "lookup", "--gen-len", "2",
                                         "--lookup-max", "4", "--lookup-min", "2"])
    assert result.exit_code == 0, (result.output, result.exception)
    assert seen and {(c.speculation.lookup_max, c.speculation.lookup_min, c.speculation.proposer) for c in seen} \
        == {(4, 2, "lookup")}
    bad = runner.invoke(app, BENCH + ["--methods", "naive", "--draft", "lookup", "--lookup-min", "5"])
    assert bad.exit_code == 2 and "--lookup-min and --lookup-max" in bad.output


def test_bench_prefill_chunk_reaches_the_engine(runner, monkeypatch):
    seen = session_configs(monkeypatch)
    result = runner.invoke(app, BENCH + ["--methods", "ar", "--gen-len", "2", "--prefill-chunk", "64"])
    assert result.exit_code == 0, (result.output, result.exception)
    assert seen and {c.execution.prefill_chunk for c in seen} == {64}
