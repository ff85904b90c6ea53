"""scripts/train_demo.py runs end to end in --config tiny and writes loadable checkpoints and the card."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

import tforce

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "train_demo.py"


def _script():
    spec = importlib.util.spec_from_file_location("train_demo", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["train_demo"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(not (_script().BOOKS / "train").is_dir(), reason="no ../shared/data/books/train")
def test_tiny_end_to_end(tmp_path):
    threads = torch.get_num_threads()
    try:
        assert _script().main(["--config", "tiny", "--out", str(tmp_path), "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
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
    assert card["target"]["passkey_train"]["steps"] == 1 and card["target"]["passkey_train"]["seq_len"] == 96
    assert "passkey_train" not in card["draft"]
    ids = loaded.tokenizer.encode("Hello there")
    assert ids[0] == loaded.tokenizer.bos_token_id
    assert "# tforce demo pair" in (tmp_path / "README.md").read_text()
