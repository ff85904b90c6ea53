"""Loading checkpoints: sharded and single-file, tied embeddings, a real trained model, load errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config

import tforce
from model_helpers import forward, full_cache, hf_logits, hf_model, random_ids
from tforce.synthetic import make_checkpoint

STORIES = Path(__file__).resolve().parent.parent / ".." / "shared" / "models" / "stories260K"
# From its README.md: greedy ids for "Once upon a time" (BOS + 6 prompt tokens, then 24 new tokens),
# and the first five logits after the prompt.
STORIES_GREEDY = [1, 348, 342, 364, 305, 261, 397, 439, 261, 399, 294, 316, 427, 285, 391, 405, 431, 313, 381,
                  266, 268, 363, 345, 312, 385, 309, 425, 267, 346, 263, 378]
STORIES_LOGITS = [-14.419, -3.8668, -14.4216, -14.4182, -14.4208]


def logits_of(loaded, ids):
    return forward(loaded.model, full_cache(loaded.model), ids)


def test_sharded_checkpoint_equals_single_file(tiny_dir, tmp_path):
    hf_model(tiny_dir / "gqa").save_pretrained(tmp_path, max_shard_size="40KB")
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    sharded, single = tforce.load_model(str(tmp_path)), tforce.load_model(str(tiny_dir / "gqa"))
    single_state = single.model.state_dict()
    for name, tensor in sharded.model.state_dict().items():
        assert torch.equal(tensor, single_state[name]), name
    ids = random_ids(21, seed=1)
    assert torch.equal(logits_of(sharded, ids), logits_of(single, ids))


def test_tied_embeddings_load(tmp_path):
    path = make_checkpoint(tmp_path / "tied", seed=3, tie_word_embeddings=True)
    loaded = tforce.load_model(str(path))
    model = loaded.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.device.type == "cpu" and model.lm_head.weight.abs().sum() > 0
    ids = random_ids(17, seed=2)
    torch.testing.assert_close(logits_of(loaded, ids), hf_logits(hf_model(path), ids), atol=1e-4, rtol=1e-4)


def test_dtype_is_applied_and_ties_survive(tmp_path):
    path = make_checkpoint(tmp_path / "tied", seed=3, tie_word_embeddings=True)
    model = tforce.load_model(str(path), dtype="bfloat16", tokenizer=False).model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.fixture(scope="module")
def stories():
    if not (STORIES / "config.json").is_file():
        pytest.skip(f"the real checkpoint {STORIES} is absent (shared/models/stories260K)")
    return tforce.load_model(str(STORIES))


def test_stories260k_matches_transformers(stories):
    assert stories.config.tie_word_embeddings
    assert stories.model.lm_head.weight is stories.model.model.embed_tokens.weight
    text = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."
    ids = torch.tensor([stories.tokenizer(text).input_ids])
    ours = logits_of(stories, ids)
    torch.testing.assert_close(ours, hf_logits(hf_model(STORIES), ids), atol=1e-4, rtol=1e-4)
    # A trained model: the text is far likelier than uniform (log 512 = 6.24 nats/token).
    loss = torch.nn.functional.cross_entropy(ours[0, :-1], ids[0, 1:])
    assert loss < 2.0


def test_stories260k_documented_greedy_output(stories):
    prompt = stories.tokenizer("Once upon a time").input_ids
    assert prompt == STORIES_GREEDY[:7]
    logits = logits_of(stories, torch.tensor([prompt]))
    torch.testing.assert_close(logits[0, -1, :5], torch.tensor(STORIES_LOGITS), atol=1e-3, rtol=0)
    out = tforce.generate(stories, prompt, method="ar", temperature=0, max_new_tokens=24, ignore_eos=True)
    assert prompt + out.tokens == STORIES_GREEDY


def _load_error(name: str) -> str:
    with pytest.raises(tforce.UsageError) as info:
        tforce.load_model(name)
    message = str(info.value)
    assert message and "\n" not in message, message
    return message


def test_missing_folder(tmp_path):
    assert "no-such-folder" in _load_error(str(tmp_path / "no-such-folder"))


def test_folder_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert "config.json" in _load_error(str(tmp_path))


def test_unknown_short_name():
    message = _load_error("llama9-1t")
    assert "llama9-1t" in message and "llama3.1-8b-instruct" in message  # names the known ones


def test_non_llama_model_type(tmp_path):
    GPT2Config().save_pretrained(tmp_path)
    assert "gpt2" in _load_error(str(tmp_path))


def test_unrecognised_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "not-a-real-architecture"}))
    assert "not-a-real-architecture" in _load_error(str(tmp_path))


def test_broken_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    assert "config.json" in _load_error(str(tmp_path))


def test_no_weights(tmp_path):
    make_checkpoint(tmp_path, tokenizer=False)
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    assert "safetensors" in _load_error(str(tmp_path))


@pytest.mark.parametrize("keep", [100, None])  # a cut header, a cut body
def test_truncated_weights_name_the_file(tmp_path, keep):
    path = make_checkpoint(tmp_path / "cut", seed=0)
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: keep or len(data) // 2])
    with pytest.raises(tforce.TforceError) as info:
        tforce.load_model(str(path))
    assert str(weights) in str(info.value) and "truncated or corrupt" in str(info.value)


def test_missing_shard_names_the_file(tiny_dir, tmp_path):
    hf_model(tiny_dir / "gqa").save_pretrained(tmp_path, max_shard_size="40KB")
    shard = sorted(tmp_path.glob("*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(tforce.TforceError) as info:
        tforce.load_model(str(tmp_path))
    assert str(shard) in str(info.value)
