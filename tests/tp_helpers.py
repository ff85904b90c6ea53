"""What the tensor-parallel tests share (tests/parallel/test_parallel.py, tests/parallel/test_batch_tp.py): the tiny pair's
shapes and its checkpoints (the `paths` fixture), the pair loaded in this process (`single`), and the
generation options."""
from __future__ import annotations

import pytest

import tforce
from tforce.model.synthetic import make_checkpoint

TARGET = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
DRAFT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=512)
GEN = dict(max_new_tokens=16, budget=32, chunk_size=4, draft_budget=16, sinks=2, ignore_eos=True)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return make_checkpoint(root / "tiny-target", seed=11, **TARGET), make_checkpoint(root / "tiny-draft", seed=12,
                                                                                        **DRAFT)


@pytest.fixture(scope="module")
def single(paths):
    return tforce.load_model(str(paths[0])).model, tforce.load_model(str(paths[1])).model
