"""A draft whose embedding table is shorter than the target's (Qwen2.5-0.5B's 151,936 rows under the 7B's
152,064): greedy equals plain decoding, sampling follows the target's distribution, and the ids the draft
lacks (in the prompt and in what the target produces) reach it as a placeholder. Drafts with a larger
table or another tokenizer are refused in one line."""
from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import tforce
from tforce.cli import app
from tforce.model.synthetic import byte_tokenizer, make_checkpoint
from tforce.model.vocab import PLACEHOLDER, SharedVocabulary, check_tokenizers

from conftest import TINY
from exactness_helpers import SAMPLES, check, draw, exact_joint, vocab_pair
from model_helpers import hf_model

DRAFT_USERS = ["triforce", "naive", "streaming"]
SMALL = dict(budget=16, chunk_size=4, draft_budget=12, sinks=2, gamma1=2, gamma2=4, rebuild_every=8)
WIDE = 300  # the target's table: the 259 byte-tokenizer ids and 41 the draft (259 rows) lacks


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A target of 300 rows over the byte tokenizer (ids 259-299 are real rows the tokenizer never gives)."""
    root = tmp_path_factory.mktemp("wide")
    make_checkpoint(root / "target", seed=21, vocab_size=WIDE, **TINY["gqa"])
    return root / "target", tforce.load_model(str(root / "target"))


@pytest.fixture(scope="module")
def cut(wide, tmp_path_factory):
    """The target itself with its table cut to the byte tokenizer's 259 rows: it drafts the target's own
    choices (accepted) except where the target's choice is an id it lacks (rejected)."""
    path, _ = wide
    out = tmp_path_factory.mktemp("cut") / "draft"
    model = hf_model(path)
    model.resize_token_embeddings(259)
    model.save_pretrained(out)
    byte_tokenizer().save_pretrained(out)
    return out, tforce.load_model(str(out))


def test_mapping_pads_the_distribution_and_replaces_missing_ids():
    m = SharedVocabulary(own=4, size=6)
    assert m.ids(torch.tensor([0, 3, 4, 5])).tolist() == [0, 3, PLACEHOLDER, PLACEHOLDER]
    padded = m.logits(torch.zeros(2, 4))
    assert padded.shape == (2, 6)
    assert padded.softmax(-1)[:, 4:].sum() == 0 and torch.allclose(padded.softmax(-1)[:, :4], torch.tensor(0.25))


class _Tok:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return dict(self.vocab)


def test_tokenizers_are_compared_on_the_rows_both_tables_hold():
    base = {"a": 0, "b": 1, "c": 2}
    check_tokenizers(_Tok(base), _Tok({**base, "<pad>": 3}), "d", 3, 3)  # an added token past the table
    with pytest.raises(tforce.UsageError, match="1 tokens differ, e.g. '<pad>'"):
        check_tokenizers(_Tok(base), _Tok({**base, "<pad>": 3}), "d", 4, 4)
    with pytest.raises(tforce.UsageError, match="2 tokens differ"):
        check_tokenizers(_Tok(base), _Tok({"a": 0, "b": 2, "c": 1}), "d", 3, 3)


def test_a_tokenizer_missing_takes_only_the_targets_table_size():
    """Nothing to compare: the same table size is taken, another (a 16-row draft for a 512-row target ran
    at 0% acceptance when it was taken) is refused, naming the missing side."""
    check_tokenizers(None, _Tok({"a": 0}), "d", 3, 3)
    with pytest.raises(tforce.UsageError, match="the target's tokenizer is missing"):
        check_tokenizers(None, _Tok({"a": 0}), "d", 512, 16)
    with pytest.raises(tforce.UsageError, match="16 embedding rows, the target 512, and the draft's tokenizer"):
        check_tokenizers(_Tok({"a": 0}), None, "d", 512, 16)


def _prompt(seed: int, n: int = 29) -> list[int]:
    """Byte ids, then one id only the wide target has (the draft reads it as the placeholder)."""
    return torch.randint(3, 259, (n,), generator=torch.Generator().manual_seed(seed)).tolist() + [270]


# Caches that hold the whole sequence: a random draft agrees with its target only on identical contexts.
WHOLE = dict(budget=96, chunk_size=4, draft_budget=96, sinks=2)


@pytest.mark.parametrize("method", DRAFT_USERS)
def test_greedy_equals_plain_decoding(wide, cut, method):
    (_, target), (_, draft) = wide, cut
    assert draft.config.vocab_size == 259 < WIDE
    prompt, kw = _prompt(1), dict(max_new_tokens=48, temperature=0, ignore_eos=True)
    ar = tforce.generate(target, prompt, method="ar", **kw).tokens
    assert any(t >= 259 for t in ar)  # the target produces ids the draft lacks: they reach the draft too
    for budgets in (SMALL, WHOLE):
        out = tforce.generate(target, prompt, draft=draft, method=method, **budgets, **kw)
        assert out.tokens == ar
    assert 0 < out.stats["acceptance"]["draft"] < 1  # the draft's proposals are used, and some rejected


@pytest.mark.parametrize("method", DRAFT_USERS)
def test_batch_greedy_equals_plain_decoding(wide, cut, method):
    (_, target), (_, draft) = wide, cut
    prompts, kw = [_prompt(2), _prompt(3, 17)], dict(max_new_tokens=24, temperature=0, ignore_eos=True)
    rows = tforce.generate_batch(target, prompts, draft=draft, method=method, **SMALL, **kw)
    for prompt, row in zip(prompts, rows):
        assert row.tokens == tforce.generate(target, prompt, method="ar", **kw).tokens


@pytest.fixture(scope="module")
def short_draft(tmp_path_factory):
    """Six ids; the draft's table holds the first four."""
    return vocab_pair(tmp_path_factory.mktemp("v6short"), draft_vocab=4)


PROMPT = [1, 4, 2, 0, 5, 3, 3, 1, 0, 2, 4, 4, 5, 1, 2, 0, 3, 5, 2, 1, 0, 4, 3]  # 4 and 5: not in the draft


@pytest.mark.parametrize("method", DRAFT_USERS)
def test_sampling_matches_target_distribution(short_draft, method):
    target, draft = short_draft
    joint = exact_joint(target, PROMPT, 3)
    samples, acc = draw(target, draft, PROMPT, method, SAMPLES, seed=4)
    assert min(check(samples, joint)) > 1e-3
    assert 0.1 < acc < 0.95, acc
    assert any(4 in s or 5 in s for s in samples)  # the ids only the target has are produced


def _refusal(result, needle: str) -> None:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], result.stderr


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, wide):
    """A draft whose table is larger than the target's, one with another tokenizer (two ids swapped), and
    one with a 16-row table and no tokenizer files (nothing to compare it by)."""
    root = tmp_path_factory.mktemp("pairs")
    make_checkpoint(root / "larger", seed=5, vocab_size=WIDE + 1, **TINY["draft"])
    make_checkpoint(root / "no-tokenizer", seed=7, vocab_size=16, tokenizer=False, **TINY["draft"])
    other = make_checkpoint(root / "other-tokenizer", seed=6, **TINY["draft"])
    data = json.loads((other / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(data))
    return root


@pytest.mark.parametrize("command", ["run", "bench"])
def test_cli_refuses_a_larger_table_and_another_tokenizer(wide, pairs, command):
    path, _ = wide
    args = ["-p", "hi"] if command == "run" else ["--prompt-len", "16", "--gen-len", "2", "--methods", "triforce"]
    runner = CliRunner()
    for draft, needle in (("larger", "is larger than the target's (300)"), ("other-tokenizer", "another tokenizer"),
                          ("no-tokenizer", "16 embedding rows, the target 300, and the draft's tokenizer is missing")):
        _refusal(runner.invoke(app, [command, "-m", str(path), "--draft", str(pairs / draft), *args]), needle)


def test_cli_runs_a_shorter_draft_as_plain_decoding(wide, cut):
    """`tforce run` with the 259-row draft under the 300-row target: the tokens of --method ar."""
    path, _ = wide
    runner = CliRunner()
    outs = {}
    for method in ("ar", "triforce"):
        result = runner.invoke(app, ["run", "-m", str(path), "--draft", str(cut[0]), "-p", "The sea",
                                     "-n", "24", "--temperature", "0", "--ignore-eos", "--json", "--method", method,
                                     "--budget", "16", "--chunk-size", "4", "--draft-budget", "12", "--sinks", "2"])
        assert result.exit_code == 0, result.output
        outs[method] = json.loads(result.stdout)["tokens"]
    assert len(outs["ar"]) == 24 and outs["triforce"] == outs["ar"]


def test_api_refuses_another_tokenizer(wide, pairs):
    _, target = wide
    other = tforce.load_model(str(pairs / "other-tokenizer"))
    with pytest.raises(tforce.UsageError, match="another tokenizer"):
        tforce.generate(target, [5, 6, 7], draft=other, method="triforce", max_new_tokens=2)
