"""Loading checkpoints: sharded and single-file, tied embeddings, one tensor-parallel rank's slices, a real
trained model, load errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config

import tforce
from model_helpers import forward, full_cache, hf_logits, hf_model, random_ids
from tforce.model import weight_files, weights
from tforce.model.sharding import apply_tp
from tforce.model.synthetic import make_checkpoint

STORIES = Path(__file__).resolve().parents[2] / ".." / "shared" / "models" / "stories260K"
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


class _CountingFile:
    """safe_open that adds the bytes of every tensor it hands out (whole or sliced) to `read`."""

    def __init__(self, read: list, *args, **kwargs):
        self.read, self.file = read, _REAL_SAFE_OPEN(*args, **kwargs)

    def __enter__(self):
        self.inner = self.file.__enter__()
        return self

    def __exit__(self, *exc):
        return self.file.__exit__(*exc)

    def keys(self):
        return self.inner.keys()

    def get_tensor(self, key):
        return self._count(self.inner.get_tensor(key))

    def get_slice(self, key):
        part = self.inner.get_slice(key)
        return type("Slice", (), {"__getitem__": lambda _, index: self._count(part[index])})()

    def _count(self, tensor):
        self.read.append(tensor.nbytes)
        return tensor


_REAL_SAFE_OPEN = weight_files.safe_open


@pytest.mark.parametrize("bias", [False, True])
def test_tensor_parallel_rank_reads_only_its_slices(tmp_path, monkeypatch, bias):
    """load_model(rank=, world=) equals load-then-apply_tp bit for bit (row-parallel biases on rank 0 only)
    and reads from the files only the bytes that rank keeps."""
    path = make_checkpoint(tmp_path / "tiny", seed=5, attention_bias=bias, mlp_bias=bias)
    read = []
    monkeypatch.setattr(weight_files, "safe_open", lambda *a, **k: _CountingFile(read, *a, **k))
    whole = tforce.load_model(str(path), tokenizer=False).model
    whole_bytes = sum(read)
    assert whole_bytes == sum(t.nbytes for t in whole.state_dict().values())
    for rank in range(2):
        read.clear()
        sliced = tforce.load_model(str(path), tokenizer=False, rank=rank, world=2).model
        state = sliced.state_dict()
        assert sum(read) == sum(t.nbytes for t in state.values()) < whole_bytes
        expected = apply_tp(tforce.load_model(str(path), tokenizer=False).model, rank, 2).state_dict()
        assert state.keys() == expected.keys()
        assert all(torch.equal(t, expected[name]) for name, t in state.items())
        assert sliced.n_kv_heads == 1 and sliced.model.layers[0].self_attn.n_heads == 2
        assert (sliced.model.layers[0].self_attn.o_proj.bias is not None) == (bias and rank == 0)


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


def test_generation_config_end_of_sequence_stops_the_run(tiny_dir, tmp_path):
    """An end-of-turn id listed only in generation_config.json (as instruction-tuned models do) ends the
    run, as transformers' generate ends it; config.json's own id still does."""
    import shutil

    shutil.copytree(tiny_dir / "mha", tmp_path / "m")
    ids = list(range(3, 40))
    free = tforce.generate(tforce.load_model(str(tmp_path / "m")).model, ids, method="ar", max_new_tokens=12,
                           temperature=0, ignore_eos=True).tokens
    stop = free[4]
    assert stop not in free[:4] and stop != 2
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, stop]}))
    model = tforce.load_model(str(tmp_path / "m")).model
    assert model.config.eos_token_id == [2, stop]
    assert tforce.generate(model, ids, method="ar", max_new_tokens=12, temperature=0).tokens == free[:5]
    (tmp_path / "m" / "generation_config.json").write_text("[")
    with pytest.raises(tforce.errors.UsageError, match="generation_config.json"):
        tforce.load_model(str(tmp_path / "m"))


def test_heads_that_do_not_split_the_hidden_size_are_refused(tmp_path, monkeypatch):
    """tforce refuses such a config itself: transformers 5.4 and later refuse it when reading it, 5.0 to 5.3
    read it (and `tforce info` planned for it). Checked with such a config as those versions give it."""
    path = make_checkpoint(tmp_path / "m", tokenizer=False)
    config = weights.AutoConfig.from_pretrained(path)
    config.num_attention_heads = 3  # hidden 64: as an older transformers reads {"num_attention_heads": 3}
    monkeypatch.setattr(weights.AutoConfig, "from_pretrained", lambda *a, **k: config)
    with pytest.raises(tforce.errors.UsageError, match=r"hidden size \(64\) is not a multiple of the number of "
                                                       r"attention heads \(3\)"):
        weights.read_config(path)


def test_a_folder_without_vocabulary_has_no_tokenizer(tmp_path, monkeypatch):
    """None without tokenizer files, whatever transformers would make there (5.0 to 5.5 build an empty
    tokenizer of the model type instead of refusing); the tokenizer where its files are."""
    import transformers

    path = make_checkpoint(tmp_path / "m", tokenizer=False)
    assert weights.load_tokenizer(path) is None
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: object())
    assert weights.load_tokenizer(path) is None
    monkeypatch.undo()
    with_tok = make_checkpoint(tmp_path / "t")
    assert weights.load_tokenizer(with_tok).encode("hi", add_special_tokens=False)
