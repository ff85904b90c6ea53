"""The Python API's bad arguments raise tforce.UsageError (README, Python API), not an error from deep in
a forward: token ids outside the target's vocabulary in generate, generate_batch and Conversation."""
from __future__ import annotations

import pytest

import tforce
from tforce.model.synthetic import make_checkpoint

TARGET = dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("api") / "tiny-target", seed=0, **TARGET)
    return tforce.load_model(str(path), tokenizer=False).model


@pytest.mark.parametrize("bad", [-1, "vocab"])
def test_ids_outside_the_vocabulary_are_a_usage_error(target, bad):
    bad = target.config.vocab_size if bad == "vocab" else bad
    ids = [1, 5, bad, 7]
    needle = f"token id {bad}, outside the model's vocabulary"
    with pytest.raises(tforce.UsageError, match=needle):
        tforce.generate(target, ids, method="ar", max_new_tokens=2, temperature=0)
    with pytest.raises(tforce.UsageError, match=needle):
        tforce.generate_batch(target, [[1, 2], ids], method="ar", max_new_tokens=2, temperature=0)
    with pytest.raises(tforce.UsageError, match=needle):
        tforce.Conversation(target, ids, method="ar", room=16)
    conv = tforce.Conversation(target, [1, 2, 3], method="ar", room=16, temperature=0)
    with pytest.raises(tforce.UsageError, match=needle):
        conv.ask([4, bad], 2)
    assert conv.ask([4, 5], 2).tokens == tforce.generate(target, [1, 2, 3, 4, 5], method="ar", max_new_tokens=2,
                                                         temperature=0).tokens  # the refusal changed nothing
