"""Helpers shared by the tests: random prompts; run our model through a cache, and HF's; set a model's EOS
for a while; record the device -> host transfers of a run."""
from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import AutoModelForCausalLM

from tforce.cache import FullCache
from tforce.cache.rope import Rotary

VOCAB = 259  # the tiny checkpoints' byte vocabulary


def random_ids(n: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    """(1, n) token ids from a fixed seed."""
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def ids(n, seed=0):
    return torch.randint(3, 259, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 259, (n,), generator=g).tolist() for n in lengths]


def rotary_for(model, max_len: int | None = None) -> Rotary:
    return Rotary(model.config, max_len=max_len)


def full_cache(model, capacity: int = 128, rotary: Rotary | None = None) -> FullCache:
    cfg = model.config
    return FullCache(cfg.num_hidden_layers, model.n_kv_heads, model.head_dim, capacity,
                     rotary or rotary_for(model, capacity))


def forward(model, cache, ids: torch.Tensor, keep: int | None = None) -> torch.Tensor:
    """begin / forward / commit: logits (1, T, V) of ids (1, T); commits `keep` (default all) tokens."""
    T = ids.shape[1]
    cache.begin(T)
    logits = model(ids, cache)
    cache.commit(T if keep is None else keep)
    return logits


def run_steps(model, cache, ids):
    """Prefill 17 tokens, decode 1, verify 4 and keep 2, decode 1 more: every logit along the way."""
    out = []
    for a, b, keep in [(0, 17, 17), (17, 18, 1), (18, 22, 2), (20, 21, 1)]:
        cache.begin(b - a)
        out.append(model(ids[:, a:b], cache))
        cache.commit(keep)
    return out


def feed(model, cache, ids: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """Feed ids (1, T) in consecutive chunks of the given sizes; the logits of every position (1, T, V)."""
    assert sum(chunks) == ids.shape[1]
    out, start = [], 0
    for n in chunks:
        out.append(forward(model, cache, ids[:, start:start + n]))
        start += n
    return torch.cat(out, dim=1)


def hf_model(path):
    """transformers' own *ForCausalLM of the checkpoint's family, in float32."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    return hf(ids).logits.float()


def count_rowwise_runners(monkeypatch) -> list:
    """Patch the engine so every RowwiseRunner it builds (deterministic=True) appends to the returned list."""
    import tforce.engine.session
    from tforce.engine.rowwise import RowwiseRunner

    built = []

    class Counted(RowwiseRunner):
        def __init__(self, *a):
            built.append(1)
            super().__init__(*a)

    monkeypatch.setattr(tforce.engine.nodes, "RowwiseRunner", Counted)
    return built


@contextmanager
def eos_token(model, token: int):
    """The model's config says `token` is its EOS inside the block (to stop rows at a known token)."""
    old = model.config.eos_token_id
    model.config.eos_token_id = token
    try:
        yield
    finally:
        model.config.eos_token_id = old


def record_host(monkeypatch) -> list[int]:
    """The sizes of every device -> host transfer (transfer.host) the levels, the verifications and the first
    tokens (drawn from the prefill's distributions, engine/session.py) make."""
    import tforce.engine.levels
    import tforce.engine.session
    import tforce.engine.speculative

    calls = []

    def host(t):
        calls.append(t.numel())
        return t.tolist()

    monkeypatch.setattr(tforce.engine.levels, "host", host)
    monkeypatch.setattr(tforce.engine.speculative, "host", host)
    monkeypatch.setattr(tforce.engine.session, "host", host)
    return calls
