"""CUDA's asynchronous semantics, simulated on the CPU, over the real code paths (no GPU needed).

Copy stream (cache/offload.py): a copy issued on the side stream runs only when
something waits for it (the compute stream waiting on its event, a stream or device synchronize), as if
the copy engine were arbitrarily slow. A missing wait then reads stale K/V and changes tokens.

CUDA graphs (graphs.py): capture records every aten op with the very tensors it reads and writes; replay
re-runs those ops on those tensors, copying fresh results into the captured outputs, so a Python value
or a tensor address taken at capture is baked in, as on a GPU. A host sync inside capture raises.

Each simulation first shows it can fail (a wait removed, a static input made fresh per step)."""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import tforce
import tforce.engine.nodes
import tforce.engine.batch
import tforce.engine.conversation
import tforce.engine.graphs
import tforce.engine.session
from tforce.cache import FullCache
from tforce.cache.offload import OffloadedCache
from tforce.cache.rope import Rotary

from model_helpers import run_steps

# ---- copy stream ---------------------------------------------------------------------------------


class _Copies:
    """Copies issued on the side stream, run in order when waited for."""

    def __init__(self):
        self.queue, self.issued, self.done, self.active = [], 0, 0, False

    def run(self, upto=None):
        upto = self.issued if upto is None else upto
        while self.done < upto:
            self.queue.pop(0)()
            self.done += 1


class _Event:
    def __init__(self, copies, enable_timing=False):
        self.copies, self.mark = copies, 0

    def record(self, stream=None):
        self.mark = self.copies.issued if isinstance(stream, _Stream) and not stream.compute else 0

    def synchronize(self):
        self.copies.run(self.mark)


class _Stream:
    def __init__(self, copies, compute=False):
        self.copies, self.compute, self.device = copies, compute, torch.device("cpu")

    def wait_stream(self, other):  # the compute stream's work so far is done (the CPU ran it eagerly)
        if self.compute and not other.compute:
            self.copies.run()

    def wait_event(self, event):
        if self.compute:
            self.copies.run(event.mark)

    def synchronize(self):
        self.copies.run()


class _Defer(TorchFunctionMode):
    def __init__(self, copies):
        super().__init__()
        self.copies = copies

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_ and self.copies.active:
            dst, src = args[0], args[1]
            self.copies.queue.append(lambda: dst.copy_(src))
            self.copies.issued += 1
            return dst
        return func(*args, **(kwargs or {}))


@pytest.fixture
def copy_stream(monkeypatch):
    """The offloaded caches get a side stream whose copies run only when waited for."""
    copies = _Copies()
    compute = _Stream(copies, compute=True)

    @contextlib.contextmanager
    def on(stream):
        copies.active = True
        with _Defer(copies):
            try:
                yield
            finally:
                copies.active = False

    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=False: _Event(copies))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "stream", on)
    def init(self, *a, _init=OffloadedCache.__init__, **k):
        _init(self, *a, **k)
        self.copy_stream = _Stream(copies)
    monkeypatch.setattr(OffloadedCache, "__init__", init)
    # _sync_device is a no-op on the CPU: it does not drain the copies either, so nothing may rely on it
    return copies


def _offloaded_steps(tiny, resident):
    model = tiny["gqa"].model
    dims = (model.config.num_hidden_layers, model.n_kv_heads, model.head_dim)
    rotary = Rotary(model.config, 64)
    ids = torch.randint(3, 259, (1, 22), generator=torch.Generator().manual_seed(0))
    ref = run_steps(model, FullCache(*dims, capacity=64, rotary=rotary), ids)
    got = run_steps(model, OffloadedCache(*dims, capacity=64, rotary=rotary, resident=resident), ids)
    return all(torch.equal(r, g) for r, g in zip(ref, got))


def test_the_copy_stream_simulation_catches_a_missing_wait(tiny, copy_stream, monkeypatch):
    from tforce.cache.offload import StagedLayers

    def enter_without_waiting(self, layer):
        j = self._slot(layer)
        self._prefetch(layer + 1)
        return j, layer - self.resident

    monkeypatch.setattr(StagedLayers, "_enter", enter_without_waiting)
    prompt, kw = list(range(5, 45)), dict(method="ar", max_new_tokens=8, temperature=0.0, ignore_eos=True)
    on = tforce.generate(tiny["gqa"], prompt, offload="on", **kw).tokens
    monkeypatch.undo()
    assert on != tforce.generate(tiny["gqa"], prompt, offload="off", **kw).tokens


@pytest.mark.parametrize("resident", [0, 1])
def test_offloaded_logits_through_a_slow_copy_stream(tiny, copy_stream, resident):
    assert _offloaded_steps(tiny, resident) and copy_stream.issued > 0


@pytest.mark.parametrize("method,deterministic", [("ar", False), ("triforce", False), ("retrieval", True)])
def test_offloaded_generation_through_a_slow_copy_stream(tiny, copy_stream, monkeypatch, method, deterministic):
    """Layer-major prefill, streaming every forward, retrieval rebuilds reading host memory, row-wise
    verification."""
    kw = dict(draft=tiny["draft"], method=method, max_new_tokens=24, temperature=0.0, ignore_eos=True,
              budget=16, chunk_size=4, rebuild_every=4, deterministic=deterministic)
    prompt = list(range(5, 45))
    on = tforce.generate(tiny["gqa"], prompt, offload="on", **kw).tokens
    assert copy_stream.issued > 0
    monkeypatch.undo()
    assert on == tforce.generate(tiny["gqa"], prompt, offload="off", **kw).tokens


@pytest.mark.parametrize("method", ["ar", "triforce"])
def test_offloaded_batch_through_a_slow_copy_stream(tiny, copy_stream, monkeypatch, method):
    """Rows of different lengths and budgets: per-row streaming, write-backs, keep() as rows finish."""
    from tforce.engine.batch import generate_batch

    prompts = [list(range(3, 3 + n)) for n in (25, 1, 17, 9)]
    kw = dict(draft=tiny["draft"].model, method=method, max_new_tokens=[5, 16, 9, 12], temperature=0,
              ignore_eos=True, budget=16, chunk_size=4, draft_budget=12, sinks=2, prefill_chunk=8, rebuild_every=4)
    on = [r.tokens for r in generate_batch(tiny["gqa"].model, prompts, offload="on", **kw)]
    assert copy_stream.issued > 0
    monkeypatch.undo()
    assert on == [r.tokens for r in generate_batch(tiny["gqa"].model, prompts, offload="off", **kw)]


def test_offloaded_conversation_and_snapshot_through_a_slow_copy_stream(tiny, copy_stream, monkeypatch, tmp_path):
    from tforce.engine.conversation import Conversation

    doc, qs = list(range(5, 45)), [list(range(50, 53)), [7]]
    kw = dict(draft=tiny["draft"], method="triforce", temperature=0.0, budget=16, chunk_size=4, rebuild_every=4,
              draft_budget=12, sinks=2, prefill_chunk=8, ignore_eos=True, max_new_tokens=12)
    conv = Conversation(tiny["gqa"], doc, room=100, offload="on", save_kv=tmp_path / "kv",
                        **{k: v for k, v in kw.items() if k != "max_new_tokens"})
    got = [conv.ask(q, max_new_tokens=12).tokens for q in qs]
    loaded = [tforce.generate(tiny["gqa"], doc + q, offload="on", load_kv=tmp_path / "kv", **kw).tokens for q in qs]
    monkeypatch.undo()
    ref = [tforce.generate(tiny["gqa"], doc + q, offload="off", **kw).tokens for q in qs]
    assert got == ref and loaded == ref


# ---- CUDA graphs ---------------------------------------------------------------------------------

_SYNCS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default, torch.ops.aten.nonzero.default}


class _Graph:
    def __init__(self):
        self.ops = []

    def replay(self):
        with torch.inference_mode():
            for func, args, kwargs, out in self.ops:
                res = func(*args, **kwargs)
                read = {a.untyped_storage().data_ptr() for a in tree_flatten((args, kwargs))[0]
                        if isinstance(a, torch.Tensor)}
                for o, r in zip(tree_flatten(out)[0], tree_flatten(res)[0]):
                    # a view or an in-place result already lives where the capture's did
                    if isinstance(r, torch.Tensor) and r.untyped_storage().data_ptr() not in read:
                        o.copy_(r)


class _Record(TorchDispatchMode):
    def __init__(self, graph):
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SYNCS:
            raise RuntimeError(f"host sync inside CUDA graph capture: {func}")
        out = func(*args, **kwargs)
        self.graph.ops.append((func, args, kwargs, out))
        return out


class _SideStream:
    def __init__(self, device=None):
        self.device = device

    def wait_stream(self, other):
        pass


@pytest.fixture
def cpu_graphs(monkeypatch):
    """Every draft and middle level runs through a GraphRunner whose graphs are _Graph; returns the runners."""
    runners = []

    def runner(model, cache, enabled, pool):
        runners.append(tforce.engine.graphs.GraphRunner(model, cache, pool))
        return runners[-1]

    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: _Record(graph))
    monkeypatch.setattr(torch.cuda, "Stream", _SideStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _SideStream(device))
    monkeypatch.setattr(tforce.engine.nodes, "_runner", runner)
    monkeypatch.setattr(tforce.engine.graphs, "_graphable", lambda ids: True)
    return runners


GRAPH_KW = dict(max_new_tokens=40, temperature=0.8, seed=1, ignore_eos=True, budget=32, chunk_size=4,
                draft_budget=24, sinks=4)


def test_the_graph_simulation_catches_an_input_baked_at_capture(tiny, cpu_graphs, monkeypatch):
    from tforce.cache.base import StaticInputs

    monkeypatch.setattr(StaticInputs, "_static", lambda self, name, value: value)  # fresh tensors each step
    prompt = list(range(3, 120))
    graphed = tforce.generate(tiny["gqa"], prompt, draft=tiny["draft"], method="retrieval", **GRAPH_KW).tokens
    assert sum(r.replays for r in cpu_graphs) > 0
    monkeypatch.undo()
    assert graphed != tforce.generate(tiny["gqa"], prompt, draft=tiny["draft"], method="retrieval",
                                      cuda_graphs=False, **GRAPH_KW).tokens


@pytest.mark.parametrize("method", ["triforce", "retrieval", "streaming", "naive"])
@pytest.mark.parametrize("prompt_len", [117, 7])  # 7: the draft's window fills during the decode
def test_graph_replay_on_the_cpu_equals_eager(tiny, cpu_graphs, monkeypatch, method, prompt_len):
    prompt = list(range(3, 3 + prompt_len))
    graphed = tforce.generate(tiny["gqa"], prompt, draft=tiny["draft"], method=method, **GRAPH_KW).tokens
    assert sum(r.replays for r in cpu_graphs) > 0
    monkeypatch.undo()
    assert graphed == tforce.generate(tiny["gqa"], prompt, draft=tiny["draft"], method=method, cuda_graphs=False,
                                      **GRAPH_KW).tokens


@pytest.mark.parametrize("method", ["triforce", "streaming"])
def test_graphed_conversation_on_the_cpu_equals_generate(tiny, cpu_graphs, monkeypatch, method):
    """Graphs captured for the document survive the caches' returns to its end between questions."""
    from tforce.engine.conversation import Conversation

    doc, qs = list(range(5, 50)), [[9], list(range(60, 69)), [7, 8, 9]]
    kw = dict(draft=tiny["draft"], method=method, rebuild_every=8, temperature=0, ignore_eos=True, budget=16,
              chunk_size=4, gamma2=4, draft_budget=12, sinks=2, prefill_chunk=8)
    conv = Conversation(tiny["gqa"], doc, room=200, **kw)
    got = [conv.ask(q, max_new_tokens=24).tokens for q in qs]
    assert sum(r.replays for r in cpu_graphs) > 0
    monkeypatch.undo()
    assert got == [tforce.generate(tiny["gqa"], doc + q, max_new_tokens=24, cuda_graphs=False, **kw).tokens
                   for q in qs]


@pytest.mark.parametrize("method", ["triforce", "retrieval", "streaming"])
def test_graphed_rows_on_the_cpu_equal_eager(tiny, cpu_graphs, monkeypatch, method):
    """Rows of one length replay graphs captured for every live row (then per row count, as finished rows
    are compacted away); ragged forwards and forwards over some rows run eagerly. Two rows are one prompt
    (they stay in step, so their forwards replay), two others differ and finish earlier. Greedy rows' tokens
    are fixed by the full cache whatever the drafts were: each row's acceptance and verifications show a
    draft or middle level replaying stale inputs."""
    from tforce.engine.batch import generate_batch

    same = list(range(3, 120))
    prompts = [same, list(range(130, 247)), same, list(range(40, 157))]
    kw = dict(draft=tiny["draft"], method=method, max_new_tokens=[40, 20, 40, 25], temperature=0, ignore_eos=True,
              budget=32, chunk_size=4, draft_budget=24, sinks=4)
    row = lambda r: (r.tokens, r.stats["acceptance"], r.stats["verifications"])  # noqa: E731
    graphed = [row(r) for r in generate_batch(tiny["gqa"], prompts, **kw)]
    assert sum(r.replays for r in cpu_graphs) > 0
    rows_captured = {key[2][-1] for r in cpu_graphs for key in r.graphs}  # graph_key ends in the row count
    assert {4, 2} <= rows_captured, rows_captured
    monkeypatch.undo()
    assert graphed == [row(r) for r in generate_batch(tiny["gqa"], prompts, cuda_graphs=False, **kw)]
