"""Fetching from the Hugging Face hub, with huggingface_hub's snapshot_download and file listing replaced
(the hub is unreachable here): which files are asked for (.bin only when the repository has no
safetensors; no weights for `tforce info`), the cache used when it holds them, and one line for a gated,
missing or unreachable repository."""
from __future__ import annotations

import json
import re
import shutil

import huggingface_hub
import pytest
from huggingface_hub import errors as hub_errors
from typer.testing import CliRunner

import tforce
from tforce.model import registry
from tforce.cli import app
from tforce.model.hub import fetch
from tforce.model.synthetic import make_checkpoint

from cli_helpers import one_error_line

REPO = "someone/llama-128k"
SAFETENSORS_REPO = ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                    "model.safetensors.index.json", "pytorch_model-00001-of-00002.bin",
                    "pytorch_model.bin.index.json", "tokenizer.model", "original/consolidated.00.pth"]
BIN_REPO = ["config.json", "generation_config.json", "pytorch_model.bin", "tokenizer.model",
            "tokenizer_config.json", "training_args.bin"]


class FakeHub:
    """snapshot_download and HfApi().list_repo_files as the hub answers them: the calls are recorded; the
    snapshot is `folder` (offline: only what `cached` holds, else LocalEntryNotFoundError)."""

    def __init__(self, monkeypatch, folder, files=(), cached=None, error=None):
        self.folder, self.files, self.cached, self.error, self.calls = folder, list(files), cached, error, []
        monkeypatch.setattr(huggingface_hub, "snapshot_download", self.snapshot_download)
        monkeypatch.setattr(huggingface_hub, "HfApi", lambda: self)

    def snapshot_download(self, repo, allow_patterns=None, local_files_only=False):
        self.calls.append(("local" if local_files_only else "hub", repo, allow_patterns))
        if local_files_only:
            if self.cached is None:
                raise hub_errors.LocalEntryNotFoundError("not in the cache")
            return str(self.cached)
        if self.error is not None:
            raise self.error
        return str(self.folder)

    def list_repo_files(self, repo):
        self.calls.append(("list", repo, None))
        return self.files

    def downloads(self) -> list:
        return [patterns for kind, _, patterns in self.calls if kind == "hub"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("hub") / "m", seed=2)


def _weights(patterns) -> list:
    return [p for p in patterns if "safetensors" in p or ".bin" in p]


def test_safetensors_are_fetched_when_the_repository_has_them(monkeypatch, model):
    hub = FakeHub(monkeypatch, model, SAFETENSORS_REPO)
    assert fetch(REPO) == model
    assert _weights(hub.downloads()[0]) == []  # config and tokenizer first
    assert _weights(hub.downloads()[-1]) == ["model.safetensors.index.json", "model*.safetensors"]


def test_bin_is_fetched_only_without_safetensors(monkeypatch, model):
    hub = FakeHub(monkeypatch, model, BIN_REPO)
    fetch(REPO)
    patterns = hub.downloads()[-1]
    assert _weights(patterns) == ["pytorch_model.bin.index.json", "pytorch_model*.bin"]
    assert {"config.json", "generation_config.json", "tokenizer*"} <= set(patterns)


def test_a_cached_snapshot_with_its_weights_is_used_offline(monkeypatch, model):
    hub = FakeHub(monkeypatch, model, cached=model, error=hub_errors.LocalEntryNotFoundError("offline"))
    assert registry.resolve(REPO) == model and hub.downloads() == []


def test_a_cached_snapshot_without_weights_is_completed(monkeypatch, model, tmp_path):
    config_only = tmp_path / "snap"
    config_only.mkdir()
    shutil.copy(model / "config.json", config_only)
    hub = FakeHub(monkeypatch, model, BIN_REPO, cached=config_only)
    assert fetch(REPO) == model and _weights(hub.downloads()[-1])
    assert fetch(REPO, weights=False) == config_only  # the config is all info needs


@pytest.mark.parametrize("error,code,needle", [
    (hub_errors.GatedRepoError, 1, f"{REPO} is gated: accept its licence on https://huggingface.co/{REPO} and "
                                   "log in with `hf auth login` (or set HF_TOKEN)"),
    (hub_errors.RepositoryNotFoundError, 2, f"no such repository on the Hugging Face hub: {REPO}"),
    (hub_errors.LocalEntryNotFoundError, 1, f"cannot reach the Hugging Face hub to fetch {REPO} "
                                            "(LocalEntryNotFoundError): download it elsewhere and pass its folder"),
    (type("ConnectError", (type("TransportError", (Exception,), {}),), {}), 1,
     "cannot reach the Hugging Face hub"),
])
def test_hub_failures_are_one_line(monkeypatch, model, error, code, needle):
    FakeHub(monkeypatch, model, error=error.__new__(error, "the hub's own message"))
    with pytest.raises(tforce.TforceError) as info:
        registry.resolve(REPO)
    assert needle in str(info.value) and info.value.exit_code == code
    one_error_line(CliRunner().invoke(app, ["run", "-m", REPO, "-p", "hi", "--method", "ar"]), code, needle)


def test_info_fetches_no_weights_and_says_the_plan_is_from_the_config(monkeypatch, model, tmp_path):
    snap = tmp_path / "snap"
    snap.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model / name, snap)
    hub = FakeHub(monkeypatch, snap, BIN_REPO)
    r = CliRunner().invoke(app, ["info", "-m", REPO, "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["model"]["planned_from"] == "config.json"
    assert all(_weights(p) == [] for p in hub.downloads()) and hub.downloads()
    assert not any(kind == "list" for kind, _, _ in hub.calls)
    r = CliRunner().invoke(app, ["info", "-m", REPO], env={"COLUMNS": "200"})
    assert re.search(r"planned from +the model's config.json, not its weights \(neither downloaded nor read\)",
                     r.stdout), r.stdout


def test_run_fetches_the_weights(monkeypatch, model):
    hub = FakeHub(monkeypatch, model, SAFETENSORS_REPO)
    r = CliRunner().invoke(app, ["run", "-m", REPO, "-p", "hi", "--method", "ar", "-n", "2", "--json"])
    assert r.exit_code == 0, r.output
    assert any(_weights(p) for p in hub.downloads())
