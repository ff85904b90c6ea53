"""Host syncs in a decode step (sync.py): every device -> host transfer goes through transfer.host, once per
drafted token and once per verification; the caches build positions, slots, cos/sin and masks on their
own device; with CUDA, any other sync in a decode round raises."""
from __future__ import annotations

import pytest
import torch

import tforce
from tforce.cache import FullCache, RetrievalCache, StreamingCache
from tforce.config import Execution, RunConfig, Sampling, Speculation
from tforce.engine.generate import Session
from tforce.engine import levels, session as session_module, speculative
from tforce.cache.rope import Rotary
from tforce.engine.speculative import verify


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """Records scalar reads (.item(), int(t), indexing by a 0-dim tensor) and copies across devices."""

    def __init__(self):
        super().__init__()
        self.scalar_reads, self.cross_device, self.scalar_devices = 0, [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.aten._local_scalar_dense.default:
            self.scalar_reads += 1
            self.scalar_devices.append(args[0].device.type)
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        if len({t.device for t in tensors}) > 1:
            self.cross_device.append(str(func))
        return out


def _counting(monkeypatch, module):
    calls = []

    def host(t):
        calls.append(t.numel())
        return t.tolist()

    monkeypatch.setattr(module, "host", host)
    return calls


@pytest.mark.parametrize("k,accept", [(3, "some"), (3, "all"), (0, "all")])
def test_verify_reads_the_device_once(monkeypatch, k, accept):
    """One transfer (n accepted, next token) and no hidden scalar read: indexing the candidates by the
    0-dim count was an .item() before the fix."""
    calls = _counting(monkeypatch, speculative)
    g = torch.Generator().manual_seed(k)
    q = torch.rand(k, 7, generator=g).softmax(-1)
    p = torch.rand(k + 1, 7, generator=g).softmax(-1)
    if accept == "all":
        p[:k] = q
    with _Ops() as ops:
        x = torch.multinomial(q, 1, generator=g)[:, 0] if k else torch.zeros(0, dtype=torch.long)
        [n_accepted], _ = verify(x[None], q[None], p[None], g)
    assert calls == [2] and ops.scalar_reads == 0
    assert 0 <= n_accepted <= k


def _caches(cfg, device):
    rotary = Rotary(cfg, max_len=256, device=device)
    dims = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads)
    return {
        "full": FullCache(*dims, capacity=64, rotary=rotary, device=device),
        "retrieval": RetrievalCache(*dims, budget=32, chunk_size=4, rotary=rotary, device=device),
        "streaming": StreamingCache(*dims, budget=16, sinks=4, rotary=rotary, max_rollback=8, max_new=8,
                                    device=device),
    }


@pytest.mark.parametrize("kind", ["full", "retrieval", "streaming"])
@pytest.mark.parametrize("n", [1, 3])
def test_begin_builds_its_inputs_on_the_cache_device(tiny, kind, n):
    """On the meta device, any host tensor copied in (positions, slots, cos/sin, masks built on the CPU
    and moved: a host -> device copy per forward on CUDA) shows as an op mixing devices. The rows' lengths
    live on the host (cache/rows.py); no value is read from the device."""
    cache = _caches(tiny["gqa"].model.config, "meta")[kind]
    for _ in range(3):  # past the streaming window's sinks, with committed tokens
        with _Ops() as ops:
            cache.begin(n)
        assert ops.cross_device == [] and set(ops.scalar_devices) <= {"cpu"}, (ops.cross_device, ops.scalar_devices)
        cache.commit(n)


def _levels(session):
    return [lv for lv in (session.verifies_draft, session.verifies_middle) if lv is not None]


@pytest.mark.parametrize("method,offload,deterministic", [
    ("triforce", "off", False), ("triforce", "on", True), ("ar", "off", False), ("ar", "on", False),
    ("naive", "off", True), ("retrieval", "on", False), ("streaming", "off", False)])
def test_host_transfers_per_round_are_bounded(tiny, monkeypatch, method, offload, deterministic):
    """Every method, the offloaded full cache and row-wise verification (rowwise.py) included: in each
    round, transfer.host is called once per drafted token (levels.Drafter) and once per verification
    (speculative.verify), and for nothing else; so a round costs 1 transfer for ar, gamma2 + 1 for
    naive and retrieval, and (gamma1 + 1) per middle round + 1 for triforce and streaming, with at most
    gamma2 middle rounds."""
    drafted = _counting(monkeypatch, levels)
    verified = _counting(monkeypatch, speculative)
    g1, g2 = 2, 5
    spec = Speculation(method=method, gamma1=g1, gamma2=g2, budget=32, chunk_size=4, draft_budget=24, sinks=4)
    session = Session(tiny["gqa"].model, tiny["draft"].model, 80, 30, RunConfig(speculation=spec, sampling=Sampling(temperature=0.8), execution=Execution(offload=offload, deterministic=deterministic)))
    assert (session.plan.offloaded > 0) == (offload == "on")
    prompt = torch.arange(3, 83)
    session.prefill([prompt])
    firsts = _counting(monkeypatch, session_module)
    drafter_rounds = []
    real_round = levels.Drafter.round
    monkeypatch.setattr(levels.Drafter, "round",
                        lambda self, *a: drafter_rounds.append(1) or real_round(self, *a))
    gen, n, rounds = torch.Generator().manual_seed(0), len(prompt), 0
    # the first round draws every row's first token from the prefill's distributions: one transfer
    n += len(session.round([n], gen)[0])
    assert firsts == [1] and drafted == verified == []
    while n < len(prompt) + 30:
        calls0 = len(drafted) + len(verified)
        middle0 = session.verifies_draft.stats.rounds[0] if session.verifies_draft else 0
        n += len(session.round([n], gen)[0])
        rounds += 1
        calls = len(drafted) + len(verified) - calls0
        if method == "ar":
            assert calls == 1
        elif method in ("naive", "retrieval"):
            assert calls == g2 + 1
        else:
            middle_rounds = session.verifies_draft.stats.rounds[0] - middle0  # the level verifying the draft
            assert 1 <= middle_rounds <= g2
            assert calls == (g1 + 1) * middle_rounds + 1
    assert drafted == [1] * len(drafter_rounds)  # one token per transfer
    assert verified == [2] * sum(lv.stats.rounds[0] for lv in _levels(session))  # (n accepted, next token)
    assert rounds >= 3


@pytest.mark.cuda
@pytest.mark.parametrize("method,cuda_graphs,offload,deterministic", [
    ("triforce", False, "off", False), ("triforce", True, "off", False), ("triforce", True, "on", True),
    ("ar", False, "off", False), ("ar", False, "on", False)])
def test_decode_round_syncs_only_through_host(tiny_dir, method, cuda_graphs, offload, deterministic):
    """torch.cuda.set_sync_debug_mode("error") around decode rounds: a sync anywhere but transfer.host raises
    (the offloaded full cache's copies and row-wise verification included)."""
    target = tforce.load_model(str(tiny_dir / "gqa"), device="cuda").model
    draft = tforce.load_model(str(tiny_dir / "draft"), device="cuda").model
    # No retrieval rebuild in these rounds (budget roomy, rebuild_every large): a rebuild is not a step.
    spec = Speculation(method=method, gamma1=2, gamma2=5, budget=96, chunk_size=4, draft_budget=24, sinks=4,
                       rebuild_every=10_000, rebuild_below=0.0)
    session = Session(target, draft, 200, 30, RunConfig(speculation=spec, sampling=Sampling(temperature=0.8), execution=Execution(cuda_graphs=cuda_graphs, offload=offload, deterministic=deterministic)))
    assert (session.plan.offloaded > 0) == (offload == "on")
    prompt = torch.arange(3, 203)
    session.prefill([prompt])
    gen, n = torch.Generator(device="cuda").manual_seed(0), len(prompt)
    n += len(session.round([n], gen)[0])  # first round: graphs of shapes first met now are captured here
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            n += len(session.round([n], gen)[0])
    finally:
        torch.cuda.set_sync_debug_mode(0)
