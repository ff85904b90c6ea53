"""PyTorch .bin checkpoints (single and sharded, as 2023-era long-context models ship them): they load as
the safetensors do, one tensor-parallel rank's slice included; a pickle that needs code is refused unrun;
mixed, cut-short, quantized and weight-less folders are refused in one line."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import tforce
from tforce.cli import app
from tforce.model.sharding import apply_tp
from tforce.snapshot.identity import files_sha
from tforce.model.synthetic import make_checkpoint

from bin_files import to_bin
from cli_helpers import one_error_line


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("bin") / "st", seed=4, tokenizer=False)


def _same_weights(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(t, sb[k]) for k, t in sa.items())


@pytest.mark.parametrize("shards", [1, 3])
def test_bin_loads_as_the_safetensors_do(src, tmp_path, shards):
    path = to_bin(src, tmp_path / "bin", shards)
    assert not list(path.glob("*.safetensors"))
    loaded = tforce.load_model(str(path), tokenizer=False)
    _same_weights(loaded.model, tforce.load_model(str(src), tokenizer=False).model)
    assert loaded.model.model.embed_tokens.weight.device.type == "cpu"


def test_bin_rank_slices_equal_apply_tp(src, tmp_path):
    path = to_bin(src, tmp_path / "bin", 2)
    whole = tforce.load_model(str(src), tokenizer=False).model
    for rank in range(2):
        sliced = tforce.load_model(str(path), tokenizer=False, rank=rank, world=2).model
        _same_weights(sliced, apply_tp(tforce.load_model(str(src), tokenizer=False).model, rank, 2))
    assert sliced.model.layers[0].self_attn.n_heads == whole.model.layers[0].self_attn.n_heads // 2


def test_safetensors_are_preferred_when_complete(src, tmp_path):
    path = to_bin(src, tmp_path / "both")
    shutil.copy(src / "model.safetensors", path)
    torch.save({"junk": torch.zeros(1)}, path / "pytorch_model.bin")  # would not load: so it was not read
    _same_weights(tforce.load_model(str(path), tokenizer=False).model,
                  tforce.load_model(str(src), tokenizer=False).model)


class Evil:
    """Unpickling it runs os.system (its __reduce__): what a malicious checkpoint does."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_a_pickle_that_runs_code_is_refused_unrun(src, tmp_path):
    path = to_bin(src, tmp_path / "evil")
    marker = tmp_path / "ran"
    state = torch.load(path / "pytorch_model.bin", weights_only=True)
    torch.save({**state, "model.norm.weight": Evil(marker)}, path / "pytorch_model.bin")
    with pytest.raises(tforce.UsageError, match="pytorch_model.bin: it needs more than tensors") as info:
        tforce.load_model(str(path), tokenizer=False)
    assert str(path / "pytorch_model.bin") in str(info.value) and "\n" not in str(info.value)
    assert not marker.exists()


def test_the_cli_refuses_it_in_one_line(src, tmp_path):
    path = to_bin(src, tmp_path / "evil")
    marker = tmp_path / "ran"
    torch.save({"model.norm.weight": Evil(marker)}, path / "pytorch_model.bin")
    shutil.copy(make_checkpoint(tmp_path / "tok", seed=4) / "tokenizer.json", path)
    r = CliRunner().invoke(app, ["run", "-m", str(path), "-p", "hi", "--method", "ar", "-n", "2"])
    one_error_line(r, 2, f"refused {path / 'pytorch_model.bin'}: it needs more than tensors")
    assert not marker.exists()


def _refused(path: Path, error=tforce.TforceError) -> str:
    with pytest.raises(error) as info:
        tforce.load_model(str(path), tokenizer=False)
    message = str(info.value)
    assert message and "\n" not in message, message
    return message


def test_mixed_halves_are_refused(src, tmp_path):
    path = to_bin(src, tmp_path / "mixed")
    state = load_file(src / "model.safetensors")
    names = sorted(state)
    save_file({k: state[k] for k in names[::2]}, path / "model.safetensors")
    torch.save({k: state[k] for k in names[1::2]}, path / "pytorch_model.bin")
    message = _refused(path)
    assert "missing" in message and "pytorch_model.bin" in message and "not halves of both" in message


@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
def test_an_index_naming_missing_files_is_refused(src, tmp_path, fmt):
    if fmt == "bin":
        path = to_bin(src, tmp_path / "cut", 3)
    else:
        path = tmp_path / "cut"
        from transformers import LlamaForCausalLM

        LlamaForCausalLM.from_pretrained(src).save_pretrained(path, max_shard_size="100KB")
    shard = sorted(path.glob(f"*.{fmt}"))[1]
    shard.unlink()
    message = _refused(path)
    assert str(shard) in message and "names weight files that are not there" in message


def test_a_truncated_bin_names_the_file(src, tmp_path):
    path = to_bin(src, tmp_path / "cut")
    f = path / "pytorch_model.bin"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    message = _refused(path)
    assert str(f) in message and "truncated or corrupt" in message


def test_a_quantized_folder_is_refused_by_its_method(src, tmp_path):
    path = to_bin(src, tmp_path / "gptq")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (path / "config.json").write_text(json.dumps(config))
    message = _refused(path, tforce.UsageError)
    assert "quantized (gptq" in message and "safetensors or PyTorch .bin" in message
    one_error_line(CliRunner().invoke(app, ["info", "-m", str(path)]), 2, "quantized (gptq")


def test_a_folder_without_weights_names_what_it_holds(src, tmp_path):
    path = tmp_path / "none"
    path.mkdir()
    shutil.copy(src / "config.json", path)
    (path / "model.gguf").write_bytes(b"GGUF")
    (path / "consolidated.00.pth").write_bytes(b"")
    message = _refused(path, tforce.UsageError)
    assert "holds no weights (found config.json and consolidated.00.pth, model.gguf)" in message
    assert "safetensors or PyTorch .bin" in message


def test_files_fingerprint_of_bin_folders(src, tmp_path):
    """A .bin folder's files hash is the same for the same weights and differs for other weights, without
    reading the tensors (the zip's directory and pickle)."""
    a, a2 = to_bin(src, tmp_path / "a"), to_bin(src, tmp_path / "a2")
    b = to_bin(make_checkpoint(tmp_path / "other", seed=5, tokenizer=False), tmp_path / "b")
    assert files_sha(a) is not None and files_sha(a) == files_sha(a2) != files_sha(b)
