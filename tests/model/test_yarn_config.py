"""Yarn-Llama-2's config.json as published (legacy `type`, and `finetuned`, which only its own remote code
reads): read without transformers' "Unrecognized keys" line on stderr, and giving transformers' logits."""
from __future__ import annotations

import subprocess
import sys

import torch

import tforce
from model_helpers import forward, full_cache, hf_logits, hf_model, random_ids
from tforce.model.synthetic import make_checkpoint

YARN_128K = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "finetuned": True}


def test_yarn_finetuned_config_is_read_quietly_and_matches_transformers(tmp_path):
    path = make_checkpoint(tmp_path / "yarn", seed=5, num_key_value_heads=2, rope_scaling=YARN_128K)
    assert '"finetuned": true' in (path / "config.json").read_text()
    r = subprocess.run([sys.executable, "-m", "tforce", "run", "-m", str(path), "--method", "ar", "-p", "hello",
                        "-n", "2", "--temperature", "0"], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    assert "Unrecognized keys" not in r.stderr and r.stderr.count("\n") == 1, r.stderr  # the summary line only
    ids = random_ids(40, seed=2)
    loaded = tforce.load_model(str(path))
    torch.testing.assert_close(forward(loaded.model, full_cache(loaded.model), ids), hf_logits(hf_model(path), ids),
                               atol=1e-4, rtol=1e-4)
