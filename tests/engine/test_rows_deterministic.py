"""deterministic=True for a batch (rowwise.py): every logit the full cache computes for a row is bit for bit
the one plain decoding (`ar`) of that prompt alone computes after the same tokens, in float32 and bfloat16,
with prompts of different lengths (the rows are ragged while they verify), the full cache resident or partly
offloaded (layer-major prefill); so every greedy row is `generate(method="ar")` of its prompt alone, token for
token. The control: without it, a bfloat16 batch's logits are not one-token decoding's (a greedy token then
matches only where no near-tie falls within that difference; the random tiny models have none, so the
logits are compared, not only the tokens)."""
from __future__ import annotations

import copy

import pytest
import torch

import tforce
import tforce.engine.nodes
import tforce.engine.node as node_module
import tforce.engine.session
from tforce.config import Speculation
from tforce.engine import placement
from tforce.engine.batch import generate_batch
from tforce.engine.session_plan import plan_session, model_shape
from tforce.model.synthetic import make_checkpoint

from model_helpers import prompts_of

LENGTHS = (1, 13, 37, 5)  # a one-token prompt (nothing to prefill), lengths not a multiple of the chunk
OPTS = dict(max_new_tokens=16, temperature=0, ignore_eos=True, draft_budget=12, sinks=2, gamma2=4, gamma1=2,
            budget=16, chunk_size=4, prefill_chunk=8)


@pytest.fixture
def full_logits(monkeypatch):
    """record(into) -> the full cache's logits go into `into`: context (the tokens before) -> every logit
    vector computed after it, copied as computed (before sampling turns greedy logits into one-hot)."""
    feeding, into = [], [None]
    feed, next_of, to_probs = node_module.Node._feed, node_module.Node.next_of, node_module.to_probs

    def recorded_feed(self, seq, ends, last, prefill=False, want=None, alone=False):
        rows = range(len(ends)) if want is None else want  # the rows whose logits come back, in order
        feeding.append((self.name, seq, list(rows), [ends[b] for b in rows], last,
                        [self.cache.lengths[b] for b in rows]))
        try:
            return feed(self, seq, ends, last, prefill, want, alone)
        finally:
            feeding.pop()

    def recorded_next_of(self, hidden):  # a layer-major prefill's first token, after the rows' whole prompts
        B = len(hidden)
        feeding.append((self.name, self.tokens, list(range(B)), [self.held(b) for b in range(B)], 1, [-1] * B))
        try:
            return next_of(self, hidden)
        finally:
            feeding.pop()

    def recorded_probs(logits, sampling):
        name, seq, rows, ends, last, starts = feeding[-1]
        if name == "full":
            grid = logits.view(len(ends), last, -1)
            for j, (b, end) in enumerate(zip(rows, ends)):
                if end == starts[j]:  # a prefill chunk this row fed nothing of: its logits are not computed
                    continue
                for i in range(last):
                    context = tuple(seq[b, :end - last + i + 1].tolist())
                    into[0].setdefault(context, []).append(grid[j, i].clone())
        return to_probs(logits, sampling)

    monkeypatch.setattr(node_module.Node, "_feed", recorded_feed)
    monkeypatch.setattr(node_module.Node, "next_of", recorded_next_of)
    monkeypatch.setattr(node_module, "to_probs", recorded_probs)

    def record(target: dict) -> dict:
        into[0] = target
        return target
    return record


def models(tiny, dtype):
    if dtype == torch.float32:
        return tiny["gqa"].model, tiny["draft"].model
    return (copy.deepcopy(tiny["gqa"].model).to(dtype), copy.deepcopy(tiny["draft"].model).to(dtype))


def compare_with_ar_alone(record, target, draft, method, deterministic, policy=None, **kw):
    """Runs the batch (its middle cache's policy: `policy`, None for the default) and each prompt alone
    with `ar`. Returns (each row's tokens, each prompt's alone, the logit vectors of the batch at a context ar
    computed too, how many of them differ from ar's bit for bit)."""
    prompts = prompts_of(LENGTHS, seed=5)
    opts = {**OPTS, **kw}
    alone = record({})
    ar = [tforce.generate(target, p, method="ar", **opts).tokens for p in prompts]
    batch = record({})
    chosen = {} if policy is None else {"policy": policy}
    rows = generate_batch(target, prompts, draft=draft, method=method, deterministic=deterministic, **chosen, **opts)
    compared = [(x, alone[c][0]) for c, xs in batch.items() if c in alone for x in xs]
    return [r.tokens for r in rows], ar, len(compared), sum(not torch.equal(x, y) for x, y in compared)


def check_rows_are_ar_alone(record, target, draft, method, **kw) -> None:
    """With deterministic: each row's tokens are its prompt's alone, every token's distribution came from
    the full cache in both runs, and every logit vector the batch computed where ar alone did is ar's."""
    rows, ar, compared, differ = compare_with_ar_alone(record, target, draft, method, True, **kw)
    assert rows == ar and all(len(tokens) == OPTS["max_new_tokens"] for tokens in ar)
    assert compared >= len(LENGTHS) * OPTS["max_new_tokens"] and differ == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", ["ar", "naive", "retrieval", "triforce", "streaming", "triforce+h2o"])
def test_deterministic_rows_compute_ar_alone_logits_bit_for_bit(tiny, full_logits, dtype, method):
    target, draft = models(tiny, dtype)
    method, _, policy = method.partition("+")
    check_rows_are_ar_alone(full_logits, target, draft, method, policy=policy or None)


def test_without_it_bf16_batch_logits_are_not_one_token_decodings(tiny, full_logits):
    """The control: the same comparison fails without row-wise verification (here even a greedy token
    differs: a near-tie within the batched forward's rounding)."""
    target, draft = models(tiny, torch.bfloat16)
    rows, ar, compared, differ = compare_with_ar_alone(full_logits, target, draft, "triforce", False)
    assert compared and differ > 0


@pytest.fixture(scope="module")
def six_layers(tmp_path_factory):
    path = tmp_path_factory.mktemp("six") / "six"
    make_checkpoint(path, seed=5, num_hidden_layers=6)
    return tforce.load_model(str(path)).model


def room_for_three_layers(target, draft, method: str) -> int:
    """device_free leaving room for 3 of the 6 layers of the batch's KV: 3 resident, 3 in host memory (as
    tests/engine/test_batch.py's partly offloaded rows)."""
    spec = Speculation(method=method, budget=16, chunk_size=4, gamma1=2, gamma2=4, draft_budget=12, sinks=2)
    work = placement.Work(max(LENGTHS) + OPTS["max_new_tokens"] + spec.max_lookahead + 1, max(LENGTHS) - 1, spec, OPTS["prefill_chunk"], False, "math", rows=len(LENGTHS))
    shape, small = model_shape(target), (model_shape(draft) if draft is not None else None)
    return placement.layout(shape, work, 3, small, 0).peak - shape.weights - (small.weights if small else 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", ["ar", "triforce"])
def test_partly_offloaded_deterministic_rows_are_ar_alone(tiny, six_layers, full_logits, monkeypatch, dtype,
                                                          method):
    target = six_layers if dtype == torch.float32 else copy.deepcopy(six_layers).to(dtype)
    draft = models(tiny, dtype)[1] if method == "triforce" else None
    plans = []
    monkeypatch.setattr(tforce.engine.nodes, "plan_session", lambda *a: plans.append(plan_session(*a)) or plans[-1])
    room = room_for_three_layers(target, draft, method)
    check_rows_are_ar_alone(full_logits, target, draft, method, device_free=room)
    assert (plans[-1].resident, plans[-1].offloaded) == (3, 3)  # the batch's plan (ar alone's come first)
