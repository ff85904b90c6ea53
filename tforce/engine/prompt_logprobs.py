"""A prompt's own log-probabilities (what a server echoes with `echo: true, logprobs: N`): for each prompt
token after the first, the target's log-softmax at the position before it, and that position's N likeliest
tokens.

They come from one plain forward of the target over the prompt in a KV cache of their own, not from the
session's prefill: a server's session holds what earlier requests left and feeds only what it does not
hold, so the logits of a reused prefix are never computed there. The forward runs in chunks, so that at
most V x chunk logits exist at a time.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from ..cache import FullCache
from ..transfer import to_device


@torch.inference_mode()
def prompt_logprobs(model, ids: list, top: int, rotary, chunk: int = 512,
                    check: Optional[Callable[[], None]] = None) -> list:
    """[(token, log-probability or None, [(id, log-probability)] x top)] per prompt token: the first has
    None (nothing precedes it) and no alternatives. rotary: the session's (the same frequencies); check()
    after each chunk (a cancelled request raises there)."""
    p = next(model.parameters())
    n = len(ids)
    out = [(int(ids[0]), None, [])]
    # the last token's own logits predict the answer's first token: not a prompt token's, not computed
    cache = FullCache(model.config.num_hidden_layers, model.n_kv_heads, model.head_dim, max(n - 1, 1), rotary,
                      p.dtype, p.device)
    seq = to_device(torch.tensor(ids, dtype=torch.long), p.device)
    for s in range(0, n - 1, chunk):
        e = min(s + chunk, n - 1)
        cache.begin(e - s)
        logits = model(seq[None, s:e], cache)[0]  # (T, V): position i's distribution of token i + 1
        cache.commit(e - s)
        lp = torch.log_softmax(logits.float(), -1)
        following = seq[s + 1:e + 1]
        picked = lp.gather(1, following[:, None])[:, 0].tolist()
        alts = [[]] * (e - s)
        if top:
            values, idx = lp.topk(top, -1)
            alts = [list(zip(i, v)) for i, v in zip(idx.tolist(), values.tolist())]
        out.extend(zip(following.tolist(), picked, alts))
        if check is not None:
            check()
    return out
