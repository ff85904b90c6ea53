"""The prefill yields the first token (engine/session.py: Session.prefill, Session.round): the forward that
feeds a prompt's last token also gives the distribution of the token after it, so the first new token costs
no forward over the full cache of its own. The same distribution whichever way the prefill ran: chunk by
chunk into the cache (token-major), layer by layer into an offloaded cache (prefill.py; bit for bit), a row
among ragged rows; and what the live view counts as prefilled is the whole prompt."""
from __future__ import annotations

import torch

import tforce
from model_helpers import random_ids
from tforce.cache import FullCache
from tforce.cache.rope import Rotary
from tforce.config import Execution, RunConfig, Sampling, Speculation
from tforce.engine.sampling import to_probs
from tforce.engine.session import Session
from tforce.engine.events import Events

PROMPTS = [random_ids(37, seed=1)[0].tolist(), random_ids(9, seed=2)[0].tolist(), random_ids(1, seed=3)[0].tolist()]
CHUNK = 8  # several chunks for the longest prompt, its last one partial


def _next(model, prompts, offload="off"):
    """The session's distributions of each prompt's next token after its prefill (rows: one per prompt)."""
    s = Session(model, None, max(map(len, prompts)), 4, RunConfig(speculation=Speculation(method="ar"), sampling=Sampling(), execution=Execution(prefill_chunk=CHUNK, offload=offload)), rows=len(prompts))
    s.prefill(prompts)
    return s, s.next


def _one_forward(model, prompt):
    """The reference: the whole prompt in one forward, its last position's distribution."""
    cfg = model.config
    cache = FullCache(cfg.num_hidden_layers, model.n_kv_heads, model.head_dim, len(prompt), Rotary(cfg))
    cache.begin(len(prompt))
    logits = model(torch.tensor([prompt]), cache, last_n=1)
    return to_probs(logits[0], Sampling())[0]


def test_the_prefill_gives_the_next_tokens_distribution(tiny):
    model = tiny["gqa"].model
    _, probs = _next(model, PROMPTS[:1])
    assert probs.shape == (1, model.config.vocab_size)
    # chunked (8 + 8 + 8 + 8 + 5 tokens) against one forward: equal up to the chunks' rounding
    torch.testing.assert_close(probs[0], _one_forward(model, PROMPTS[0]), rtol=0, atol=1e-6)


def test_ragged_rows_each_get_their_own_prompts_next_token(tiny):
    """Rows of 37, 9 and 1 tokens: each row's distribution is that of its own prompt alone, taken from the
    chunk that ends it (the 1-token row ends in the first chunk, the 37-token one in the fifth)."""
    model = tiny["gqa"].model
    _, rows = _next(model, PROMPTS)
    for b, prompt in enumerate(PROMPTS):
        torch.testing.assert_close(rows[b], _next(model, [prompt])[1][0], rtol=0, atol=1e-6)
    assert not torch.allclose(rows[0], rows[1])


def test_the_layer_major_prefill_gives_the_same_distribution_bit_for_bit(tiny):
    """Into an offloaded full cache the prefill runs layer by layer (prefill.py) over the same chunks: its
    last hidden states, and so the first token's distribution, are the token-major prefill's exactly."""
    model = tiny["gqa"].model
    s, layer_major = _next(model, PROMPTS, offload="on")
    assert s.plan.offloaded > 0
    assert torch.equal(layer_major, _next(model, PROMPTS)[1])


def test_the_first_token_costs_no_decode_forward_and_the_whole_prompt_counts_as_prefilled(tiny):
    model, prompt = tiny["gqa"], PROMPTS[0]
    seen = []
    one = tforce.generate(model, prompt, method="ar", max_new_tokens=1, temperature=0, ignore_eos=True,
                          prefill_chunk=CHUNK, events=Events(on_prefill=lambda done, total: seen.append((done, total))))
    assert len(one.tokens) == 1 and one.stats["forwards"] == {"full": 0} and one.stats["verifications"] == 0
    assert seen[-1] == (len(prompt), len(prompt))  # the live view's count ends at the prompt's length
    # greedy: the argmax of the whole prompt's one forward
    assert one.tokens == [int(_one_forward(model.model, prompt).argmax())]
    more = tforce.generate(model, prompt, method="ar", max_new_tokens=6, temperature=0, ignore_eos=True)
    assert more.tokens[:1] == one.tokens and more.stats["forwards"] == {"full": 5}
    assert more.stats["tokens_per_verification"] == 1.0  # the rounds' tokens over the rounds


def test_a_stop_that_keeps_none_of_the_first_token_counts_no_decoded_token(tiny):
    """until may end a row before its first token (keep 0): the row decoded nothing, so no rate is given
    (not a negative one), for one prompt and for a batch."""
    model = tiny["gqa"]
    one = tforce.generate(model, PROMPTS[0], method="ar", max_new_tokens=4, temperature=0, events=Events(until=lambda t: 0))
    assert one.tokens == [] and one.stats["ms_per_token"] is None and one.stats["tokens_per_s"] is None
    rows = tforce.generate_batch(model, PROMPTS[:2], method="ar", max_new_tokens=4, temperature=0,
                                 events=Events(until=lambda t: 0 if len(t) == 1 else None))
    assert [r.tokens for r in rows] == [[], []] and rows[0].stats["batch_tokens_per_s"] is None
