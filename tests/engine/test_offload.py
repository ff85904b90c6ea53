"""The offloaded full cache (CPU code path) against the plain full cache: bit for bit."""
import pytest
import torch

import tforce
from tforce.engine import placement
from tforce.cache import FullCache
from tforce.cache.offload import OffloadedCache
from tforce.cache.rope import Rotary
from tforce.engine.events import Events

from model_helpers import run_steps


@pytest.mark.parametrize("resident", [0, 1, 2])
def test_offloaded_logits_are_bit_identical(tiny, resident):
    model = tiny["gqa"].model
    dims = (model.config.num_hidden_layers, model.n_kv_heads, model.head_dim)
    rotary = Rotary(model.config, 64)
    ids = torch.randint(3, 259, (1, 22), generator=torch.Generator().manual_seed(0))
    full = FullCache(*dims, capacity=64, rotary=rotary)
    ref = run_steps(model, full, ids)
    off = OffloadedCache(*dims, capacity=64, rotary=rotary, resident=resident)
    got = run_steps(model, off, ids)
    for r, g in zip(ref, got):
        assert torch.equal(r, g)
    assert off.length == full.length == 21
    for layer in range(dims[0]):  # wherever a layer lives, it holds the committed tokens' K/V
        L = off.length
        assert torch.equal(off.layer_keys(layer)[:, :L], full.layer_keys(layer)[:, :L])
        assert torch.equal(off.layer_values(layer)[:, :L], full.layer_values(layer)[:, :L])


@pytest.mark.parametrize("method", ["ar", "triforce", "retrieval"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_offloaded_tokens_are_identical(tiny, method, temperature):
    prompt = list(range(5, 45))
    kw = dict(draft=tiny["draft"], method=method, max_new_tokens=24, temperature=temperature, seed=3,
              ignore_eos=True, budget=16, chunk_size=4)
    on = tforce.generate(tiny["gqa"], prompt, offload="on", **kw).tokens
    off = tforce.generate(tiny["gqa"], prompt, offload="off", **kw).tokens
    assert on == off


@pytest.mark.parametrize("resident", [0, 1])
@pytest.mark.parametrize("n", [1, 7, 40])
def test_layer_major_prefill_is_bit_identical(tiny, resident, n):
    """Layer-major prefill (linear host traffic) fills the cache exactly as token-major prefill does."""
    from tforce.engine.prefill import prefill_layer_major

    model = tiny["gqa"].model
    dims = (model.config.num_hidden_layers, model.n_kv_heads, model.head_dim)
    rotary = Rotary(model.config, 64)
    ids = torch.randint(3, 259, (n,), generator=torch.Generator().manual_seed(n))
    full = FullCache(*dims, capacity=64, rotary=rotary)
    for a in range(0, n, 16):  # token-major, same 16-token chunks
        b = min(a + 16, n)
        full.begin(b - a)
        model(ids[None, a:b], full, last_n=0)
        full.commit(b - a)
    off = OffloadedCache(*dims, capacity=64, rotary=rotary, resident=resident)
    seen = []
    prefill_layer_major(model, [ids], off, chunk=16, progress=lambda d, t: seen.append((d, t)))
    assert off.length == full.length == n and seen[-1] == (dims[0] * n, dims[0] * n)
    for layer in range(dims[0]):
        assert torch.equal(off.layer_keys(layer)[:, :n], full.layer_keys(layer)[:, :n])
        assert torch.equal(off.layer_values(layer)[:, :n], full.layer_values(layer)[:, :n])
        assert torch.equal(off.query_at(0, n - 1)[layer], full.query_at(0, n - 1)[layer])
    nxt = torch.tensor([[5]])
    for cache in (full, off):
        cache.begin(1)
    assert torch.equal(model(nxt, full), model(nxt, off))



def test_device_free_plans_a_cpu_run_as_if_a_device_had_that_room():
    """device_free (what tensor-parallel ranks agree on) drives the planner on a CPU run too."""
    from tforce.config import Speculation
    from tforce.engine.session_plan import model_shape
    from tforce.model.network import Llama
    from tforce.model.synthetic import make_config

    torch.manual_seed(0)
    model = Llama(make_config("tiny", num_hidden_layers=5, num_key_value_heads=2)).eval()
    prompt, kw = list(range(5, 45)), dict(method="ar", max_new_tokens=8, temperature=0.0, ignore_eos=True)
    ref = tforce.generate(model, prompt, **kw)
    assert ref.stats["kv_offloaded_layers"] == 0
    # The room beside the weights that the plan with 2 resident layers (and 2 staging buffers) needs.
    work = placement.Work(len(prompt) + 8 + Speculation().max_lookahead + 1, len(prompt), Speculation(method="ar"), cuda_graphs=False, attention="math")
    shape = model_shape(model)
    room = placement.layout(shape, work, 2, context=0).peak - shape.weights
    events = []
    tight = tforce.generate(model, prompt, device_free=room, **kw,
                            events=Events(on_plan=lambda p: events.append(("plan", p)),
                                          on_prefill=lambda done, total: events.append(("prefill", done))))
    assert (tight.stats["kv_resident_layers"], tight.stats["kv_offloaded_layers"]) == (2, 3)
    # The placement is reported once, before prefill, as the statistics state it.
    assert events[0] == ("plan", {k: v for k, v in tight.stats.items() if k.startswith("kv_")})
    assert [e for e, _ in events].count("plan") == 1 and events[1][0] == "prefill"
    layer = placement.kv_layer_bytes(2, model.head_dim, work.capacity, 4)
    assert tight.stats["kv_device_bytes"] == (2 + 2) * layer  # resident layers and the staging buffers
    assert "kv_gpu_bytes" not in tight.stats  # named for the run's device: a CPU run has no GPU
    assert tight.tokens == ref.tokens


@pytest.mark.parametrize("counts", [None, [9, 4, 6]])  # rows of one length, rows of three
def test_every_host_device_copy_of_rows_is_one_contiguous_run(tiny, monkeypatch, counts):
    """A strided copy between host and device is made contiguous in pageable memory first and crosses
    synchronously (27x slower for 4 offloaded rows on an H200): each staged or written-back block is one
    contiguous run on both sides, and together they still give the full cache's logits."""
    from tforce.cache import offload

    seen = []
    real = offload.copy_on

    def watch(stream, pairs, record=False):
        seen.extend(pairs)
        return real(stream, pairs, record)

    monkeypatch.setattr(offload, "copy_on", watch)
    model = tiny["gqa"].model
    dims = (model.config.num_hidden_layers, model.n_kv_heads, model.head_dim)
    rotary = Rotary(model.config, 64)
    ids = torch.randint(3, 259, (3, 12), generator=torch.Generator().manual_seed(1))
    caches = [FullCache(*dims, capacity=64, rotary=rotary, rows=3),
              OffloadedCache(*dims, capacity=64, rotary=rotary, resident=1, rows=3)]
    logits = []
    for cache in caches:
        out = []
        cache.begin(9, counts)  # the prompts: 9 tokens each, or 9, 4 and 6
        out.append(model(ids[:, :9], cache))
        cache.commit(9 if counts is None else counts)
        for step in (9, 10):  # two decode steps for every row
            cache.begin(1)
            out.append(model(ids[:, step:step + 1], cache))
            cache.commit(1)
        logits.append(out)
    for r, g in zip(*logits):
        assert torch.equal(r, g)
    assert len(seen) >= 2 * 3 * 2 * (dims[0] - 1)  # two decode steps, K and V, three rows, each offloaded layer
    for dst, src in seen:
        assert dst.is_contiguous() and src.is_contiguous(), (dst.shape, dst.stride(), src.shape, src.stride())
