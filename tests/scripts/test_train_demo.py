"""scripts/train_demo.py runs end to end in --config tiny and writes loadable checkpoints and the card;
its long-context phase rescales the target's RoPE, from scratch or continuing a pair (--extend)."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

import tforce

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_demo.py"


def _script():
    spec = importlib.util.spec_from_file_location("train_demo", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["train_demo"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


needs_books = pytest.mark.skipif(not (_script().BOOKS / "train").is_dir(), reason="no ../shared/data/books/train")


def _run(mod, *args):
    threads = torch.get_num_threads()
    try:
        return mod.main(["--config", "tiny", "--threads", "1", *args])
    finally:
        torch.set_num_threads(threads)


@needs_books
def test_tiny_end_to_end(tmp_path):
    assert _run(_script(), "--out", str(tmp_path)) == 0
    card = json.loads((tmp_path / "card.json").read_text())
    assert len(card["data"]["held_out_books"]) >= 1
    assert not set(card["data"]["held_out_books"]) & set(card["data"]["train_books"])
    for name in ("target", "draft"):
        loaded = tforce.load_model(str(tmp_path / f"demo-{name}"))
        assert loaded.tokenizer is not None and loaded.tokenizer.bos_token_id is not None
        assert loaded.config.vocab_size == card["vocab"]
        assert card[name]["train"]["steps"] == 3 and card[name]["perplexity"]["all"] > 1
        st = (tmp_path / f"demo-{name}" / "model.safetensors")
        from safetensors import safe_open
        with safe_open(str(st), "pt") as f:
            assert all(f.get_tensor(k).dtype == torch.float16 for k in f.keys())
    assert set(card["target"]["passkey_accuracy"]) == {"64", "96"}
    assert set(card["target"]["passkey_by_depth"]["96"]) == {"0.0-0.5", "0.5-1.0"}
    # the long phase: RoPE rescaled 128 -> 256 (YaRN), one step at 256 tokens; both configs say 256
    long = card["target"]["long_train"]
    assert long["steps"] == 1 and long["seq_len"] == 256
    assert long["rope"] == {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0,
                            "original_max_position_embeddings": 128}
    target = tforce.load_model(str(tmp_path / "demo-target"))
    assert target.config.rope_parameters["rope_type"] == "yarn" and target.config.max_position_embeddings == 256
    assert loaded.config.max_position_embeddings == 256  # the draft
    assert card["target"]["perplexity_before_long"]["all"] > 1 and card["target"]["perplexity_at_base_len"]["all"] > 1
    assert card["target"]["passkey_train"]["steps"] == 1 and card["target"]["passkey_train"]["seq_len"] == 96
    assert "passkey_train" not in card["draft"]
    ids = loaded.tokenizer.encode("Hello there")
    assert ids[0] == loaded.tokenizer.bos_token_id
    assert "# tforce demo pair" in (tmp_path / "README.md").read_text()


@needs_books
def test_extend_continues_a_pair(tmp_path):
    """--extend DIR: DIR's tokenizer and draft weights are kept, the target gains the long phase only;
    a pair whose context is already the config's is refused."""
    from dataclasses import replace

    from safetensors.torch import load_file

    mod = _script()
    mod.CONFIGS["tiny"] = replace(mod.CONFIGS["tiny"], long=None)  # a short-context base pair
    assert _run(mod, "--out", str(tmp_path / "base")) == 0
    mod = _script()
    assert _run(mod, "--extend", str(tmp_path / "base"), "--out", str(tmp_path / "long")) == 0
    base, card = json.loads((tmp_path / "base" / "card.json").read_text()), json.loads(
        (tmp_path / "long" / "card.json").read_text())
    assert base["target"]["max_position_embeddings"] == 128 and "long_train" not in base["target"]
    assert card["base"]["command"] == base["command"] and "--extend" in card["command"]  # --steps 3: all long
    assert card["target"]["train"] == base["target"]["train"]  # phase 1 comes from the base's card
    assert card["target"]["long_train"]["steps"] == 3 and card["target"]["max_position_embeddings"] == 256
    assert card["draft"]["max_position_embeddings"] == 256 and card["draft"]["perplexity"] == base["draft"]["perplexity"]
    for f in ("model.safetensors", "tokenizer.json"):
        assert (tmp_path / "long" / "demo-draft" / f).read_bytes() == (tmp_path / "base" / "demo-draft" / f).read_bytes()
    assert (tmp_path / "long" / "demo-target" / "tokenizer.json").read_bytes() == (
        tmp_path / "base" / "demo-target" / "tokenizer.json").read_bytes()
    new, old = (load_file(str(tmp_path / d / "demo-target" / "model.safetensors")) for d in ("long", "base"))
    assert set(new) == set(old) and any(not torch.equal(new[k], old[k]) for k in new)  # trained further
    assert "Long-context phase" in (tmp_path / "long" / "README.md").read_text()

    # --extend on a pair already at the config's context: its long phase continues (same RoPE), both
    # phases on the card, the episode options honoured
    assert _run(mod, "--extend", str(tmp_path / "long"), "--out", str(tmp_path / "more"), "--min-episode", "100",
                "--passkey-frac", "0.9") == 0
    more = json.loads((tmp_path / "more" / "card.json").read_text())
    assert more["target"]["long_train"] == card["target"]["long_train"]
    lm = more["target"]["long_train_more"]
    assert lm["steps"] == 3 and lm["min_episode"] == 100 and lm["passkey_frac"] == 0.9
    assert lm["rope"] == card["target"]["long_train"]["rope"] and more["target"]["max_position_embeddings"] == 256
    assert more["target"]["passkey_before_more"] == card["target"]["passkey_accuracy"]
    assert more["base"]["base"]["command"] == base["command"]  # the whole history
    readme = (tmp_path / "more" / "README.md").read_text()
    assert "Long phase, continued" in readme and base["command"] in readme
    longer, shorter = (load_file(str(tmp_path / d / "demo-target" / "model.safetensors")) for d in ("more", "long"))
    assert any(not torch.equal(longer[k], shorter[k]) for k in longer)

    mod.CONFIGS["tiny"] = replace(mod.CONFIGS["tiny"], long=replace(mod.CONFIGS["tiny"].long, seq_len=192))
    with pytest.raises(SystemExit, match="already has a context of 256"):
        _run(mod, "--extend", str(tmp_path / "long"), "--out", str(tmp_path / "again"))


def test_gpu_pair_fits_what_a_device_call_brings_back():
    """The `gpu` configuration's pair in fp16 must come back through the device tool's $OUT (8 files of
    16 MiB, 64 MiB in all; scripts/gpu_train.sh packs it in 15 MiB parts, its log and card beside)."""
    from transformers import LlamaConfig

    from tforce.engine.placement import weight_bytes

    setup = _script().CONFIGS["gpu"]
    total = 0
    for arch in (setup.target, setup.draft):
        cfg = LlamaConfig(vocab_size=setup.vocab, hidden_size=arch.hidden, intermediate_size=arch.intermediate,
                          num_hidden_layers=arch.layers, num_attention_heads=arch.heads,
                          num_key_value_heads=arch.kv_heads, tie_word_embeddings=arch.tie)
        total += weight_bytes(cfg, 2)
    assert total <= 6 * 15 * 2**20 - 2 * 2**20  # six parts at most, room for tokenizers and the card
    assert total <= 48 * 2**20  # with the repository and the books, a later call still carries it all
