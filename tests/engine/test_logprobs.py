"""Session.record_logprobs: each generated token's raw log-probabilities are the target's own log-softmax at
its position (one plain forward over the whole sequence), for every method and temperature, taken from the
forwards that decided the tokens; off by default, and refused for a session of several rows."""
import pytest
import torch

from tforce.cache import FullCache
from tforce.cache.rope import Rotary
from tforce.engine.decode import decode
from tforce.engine.events import Events
from tforce.engine.generate import generator, open_session
from tforce.errors import TforceError
from tforce.config import RunConfig


def _reference(model, seq: list, start: int) -> torch.Tensor:
    cache = FullCache(model.config.num_hidden_layers, model.n_kv_heads, model.head_dim, len(seq),
                      Rotary(model.config, len(seq)))
    cache.begin(len(seq))
    return torch.log_softmax(model(torch.tensor([seq]), cache)[0].float(), -1)[start - 1:len(seq) - 1]


@pytest.mark.parametrize("method", ["ar", "triforce", "retrieval", "naive", "streaming"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_recorded_logprobs_are_the_targets(tiny, method, temperature):
    target, draft = tiny["gqa"].model, tiny["draft"].model
    prompt = list(range(5, 85))
    s = open_session(target, draft if method != "retrieval" else None, 160, 1, RunConfig.of(method=method, budget=32, draft_budget=16, sinks=4, chunk_size=4, temperature=temperature, top_p=0.9, top_k=0, seed=1))
    s.record_logprobs(True)
    s.prefill([torch.tensor(prompt)])
    rows = []
    [out] = decode(s, [len(prompt)], [24], generator(target, 1), set(),
                   Events(on_tokens=lambda r, tokens, a: rows.extend(s.logprobs[0][:len(tokens)])))
    got = torch.stack(rows)  # (24, V): one row per token
    assert got.shape == (len(out), target.config.vocab_size)
    assert (got - _reference(target, prompt + out, len(prompt))).abs().max() < 1e-4
    if temperature == 0:
        assert got.argmax(-1).tolist() == out


def test_off_by_default_and_one_row_only(tiny):
    target = tiny["gqa"].model
    s = open_session(target, None, 64, 1, RunConfig.of(method="ar", temperature=0.0))
    s.prefill([torch.tensor(list(range(5, 15)))])
    decode(s, [10], [3], generator(target, 1), set())
    assert s.logprobs is None and s.full.logprobs is None
    from tforce.config import Sampling, Speculation
    from tforce.engine.session import Session

    two = Session(target, None, 32, 8, RunConfig(speculation=Speculation(method="ar"), sampling=Sampling(temperature=0.0)), rows=2)
    with pytest.raises(TforceError, match="one row"):
        two.record_logprobs(True)


@pytest.mark.parametrize("method", ["ar", "triforce"])
def test_recorded_logprobs_equal_transformers(tiny_dir, tiny, method):
    """The same values as transformers' own model on the same weights computes (float32, CPU)."""
    from transformers import AutoModelForCausalLM

    target, draft = tiny["gqa"].model, tiny["draft"].model
    prompt = list(range(5, 65))
    s = open_session(target, draft, 100, 1, RunConfig.of(method=method, budget=32, draft_budget=16, sinks=4, chunk_size=4, temperature=0.7, top_p=0.9, seed=3))
    s.record_logprobs(True)
    s.prefill([torch.tensor(prompt)])
    rows = []
    [out] = decode(s, [len(prompt)], [16], generator(target, 3), set(),
                   Events(on_tokens=lambda r, tokens, a: rows.extend(s.logprobs[0][:len(tokens)])))
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir / "gqa", dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out])).logits[0].float()
    ref = torch.log_softmax(logits, -1)[len(prompt) - 1:-1]
    assert (torch.stack(rows) - ref).abs().max() < 1e-4
