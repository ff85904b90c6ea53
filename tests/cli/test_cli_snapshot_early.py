"""A KV snapshot that cannot serve the run is refused before any weights are read (README: options are
checked before any model is loaded)."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

from tforce.cli import app

from user_errors_helpers import one_error_line, run_hi
from user_errors_helpers import models  # noqa: F401 (fixture)


def test_load_kv_of_another_dtype_is_refused_before_loading(models, tmp_path, monkeypatch):
    """The dtype is in the manifest: it was compared only after both models' weights were read."""
    import tforce.model.weights

    runner = CliRunner()
    snap = tmp_path / "snap"
    assert run_hi(runner, models, "--save-kv", str(snap)).exit_code == 0

    def no_loading(*a, **k):
        raise AssertionError("weights read before the snapshot was checked")

    monkeypatch.setattr(tforce.model.weights, "load_model", no_loading)
    needle = f"--load-kv {snap}: its cache is float32, this run's is bfloat16 (pass --dtype float32)"
    one_error_line(run_hi(runner, models, "--load-kv", str(snap), "--dtype", "bfloat16"), 2, needle)
    doc = str(models / "doc.txt")
    r = runner.invoke(app, ["chat", doc, "-q", doc, "-m", str(models / "tiny-target"), "--load-kv", str(snap),
                            "--dtype", "bfloat16"])
    one_error_line(r, 2, needle)


@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_load_kv_of_the_same_dtype_still_loads(models, tmp_path, dtype):
    runner = CliRunner()
    snap = tmp_path / "snap"
    assert run_hi(runner, models, "--save-kv", str(snap)).exit_code == 0
    r = run_hi(runner, models, "--load-kv", str(snap), "--dtype", dtype)
    assert r.exit_code == 0 and "KV snapshot" in r.stderr, r.output
