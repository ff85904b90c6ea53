"""Checks the CPU cannot stand in for (CUDA only; they skip cleanly without a GPU).

The CPU code path of the offloaded cache runs plain copies; on CUDA the same steps go through pinned host
memory, a copy stream and events, where a missing wait shows up as stale or half-written K/V. These tests
compare that path with the plain full cache bit for bit, and run tensor parallelism over NCCL where two
GPUs exist. Graph replay vs eager is in test_graphs.py, flash vs SDPA in test_attention.py.

Then the paths first run on CUDA by scripts/gpu_features.sh (`-k features`): every batch method on chip,
wholly and partly offloaded, each row its prompt alone; KV snapshots across devices; a Conversation;
--deterministic. Greedy float32 comparisons of different forwards (a batch's rows, one prompt alone) rest
on no near tie between the tiny models' top two logits, as the same tests on the CPU do.
"""
from __future__ import annotations

import pytest
import torch

import tforce
from tforce.engine import placement
from tforce.cache import FullCache
from tforce.cache.offload import OffloadedCache
from tforce.config import Speculation
from tforce.engine.conversation import Conversation
from tforce.engine.session_plan import model_shape
from tforce.cache.rope import Rotary
from tforce.model.synthetic import make_checkpoint

pytestmark = pytest.mark.cuda


def _steps(model, cache, ids):
    """Prefill 300 tokens in three chunks, decode, verify 6 and keep 2, decode: every logit on the way."""
    out = []
    for a, b, keep in [(0, 100, 100), (100, 200, 100), (200, 300, 300 - 200), (300, 301, 1), (301, 307, 2),
                       (303, 304, 1)]:
        cache.begin(b - a)
        out.append(model(ids[:, a:b], cache))
        cache.commit(keep)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("resident", [0, 1])
def test_offloaded_cache_through_the_copy_stream_is_bit_identical(tiny_dir, dtype, resident):
    model = tforce.load_model(str(tiny_dir / "gqa"), device="cuda", dtype=dtype, tokenizer=False).model
    dims = (model.config.num_hidden_layers, model.n_kv_heads, model.head_dim)
    rotary = Rotary(model.config, 512, device="cuda")
    ids = torch.randint(3, 259, (1, 307), generator=torch.Generator().manual_seed(0)).cuda()
    ref = _steps(model, FullCache(*dims, capacity=512, rotary=rotary, dtype=dtype, device="cuda"), ids)
    off = OffloadedCache(*dims, capacity=512, rotary=rotary, resident=resident, dtype=dtype, device="cuda")
    assert off.copy_stream is not None  # the real asynchronous path, not the CPU's plain copies
    got = _steps(model, off, ids)
    torch.cuda.synchronize()
    for r, g in zip(ref, got):
        assert torch.equal(r, g)


@pytest.mark.parametrize("method", ["ar", "triforce", "retrieval"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_offloaded_generation_on_cuda_equals_on_chip(tiny_dir, method, temperature):
    target = tforce.load_model(str(tiny_dir / "gqa"), device="cuda", dtype=torch.float32)
    draft = tforce.load_model(str(tiny_dir / "draft"), device="cuda", dtype=torch.float32, tokenizer=False)
    prompt = list(range(3, 250))
    kw = dict(draft=draft.model, method=method, max_new_tokens=48, temperature=temperature, seed=5,
              ignore_eos=True, budget=64, chunk_size=8, draft_budget=32, sinks=4)
    on = tforce.generate(target, prompt, offload="on", **kw)
    off = tforce.generate(target, prompt, offload="off", **kw)
    assert on.stats["kv_offloaded_layers"] > 0 and off.stats["kv_offloaded_layers"] == 0
    assert on.tokens == off.tokens


@pytest.mark.parametrize("method", ["ar", "triforce"])
def test_offloaded_batch_on_cuda_equals_on_chip(tiny_dir, method):
    """A batch's layer-major prefill into pinned host memory (prefill.py) and per-step streaming through the
    copy stream (cache/offload.py): every row's greedy tokens are the all-resident batch's, whose
    prefill is token-major."""
    from tforce.engine.batch import generate_batch

    target = tforce.load_model(str(tiny_dir / "gqa"), device="cuda", dtype=torch.float32)
    draft = tforce.load_model(str(tiny_dir / "draft"), device="cuda", dtype=torch.float32, tokenizer=False)
    prompts = [list(range(3, 3 + n)) for n in (250, 1, 97)]
    kw = dict(draft=draft.model, method=method, max_new_tokens=32, temperature=0, ignore_eos=True, budget=64,
              chunk_size=8, draft_budget=32, sinks=4, prefill_chunk=64)
    on = generate_batch(target.model, prompts, offload="on", **kw)
    off = generate_batch(target.model, prompts, offload="off", **kw)
    assert on[0].stats["kv_offloaded_layers"] > 0 and off[0].stats["kv_offloaded_layers"] == 0
    assert [r.tokens for r in on] == [r.tokens for r in off]


def test_a_failed_host_registration_leaves_no_stale_cuda_error():
    """cudaHostRegister's error stays the runtime's last error until read; PyTorch reads it after the next
    kernel launch. host_tensor reads it when registration fails (offload._clear_last_error): registering
    pinned memory again fails (already registered), and the next kernel must still run."""
    from tforce.cache import offload

    t = offload.host_tensor((1024,), torch.float32, pin_for=torch.device("cuda"))
    assert int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.nbytes, 0)) != 0
    offload._clear_last_error()
    x = torch.ones(4, device="cuda") + 1  # raises the stale error if it was not cleared
    torch.cuda.synchronize()
    assert x.sum().item() == 8


def _nccl_tokens(rank, world, target_path, draft_path, prompt):
    from tforce.model.sharding import apply_tp

    dev = torch.device("cuda", rank)
    target = apply_tp(tforce.load_model(target_path, tokenizer=False).model, rank, world).to(dev)
    draft = tforce.load_model(draft_path, device=str(dev), tokenizer=False).model
    return [tforce.generate(target, prompt, draft=draft, method=m, max_new_tokens=24, temperature=0,
                            ignore_eos=True, budget=32, chunk_size=4, draft_budget=16, sinks=2,
                            cuda_graphs=False).tokens for m in ("ar", "triforce")]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_ranks_over_nccl_generate_the_single_gpu_tokens(tmp_path):
    from tforce.parallel.ranks import launch
    from tforce.model.synthetic import make_checkpoint

    t = make_checkpoint(tmp_path / "t", seed=11, num_attention_heads=4, num_key_value_heads=2)
    d = make_checkpoint(tmp_path / "d", seed=12, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1)
    prompt = list(range(3, 60))
    ranks = launch(_nccl_tokens, 2, "nccl", str(t), str(d), prompt, all_ranks=True)
    single = _nccl_tokens(0, 1, str(t), str(d), prompt)
    assert ranks[0] == ranks[1] == single


# ---- features first run on CUDA (scripts/gpu_features.sh runs these with -k features) -------------------

FEATURES_SMALL = dict(budget=16, chunk_size=4, gamma2=4, draft_budget=12, sinks=2, prefill_chunk=8)
FEATURES_GREEDY = dict(temperature=0, ignore_eos=True)


def _features_prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 259, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def features_six(tmp_path_factory):
    """A 6-layer float32 target on CUDA (with 2 layers, offloading one never saves memory) and the draft."""
    path = tmp_path_factory.mktemp("six") / "six"
    make_checkpoint(path, seed=5, num_hidden_layers=6)
    draft = tmp_path_factory.mktemp("draft") / "draft"
    make_checkpoint(draft, seed=4, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                    num_key_value_heads=1, num_hidden_layers=1)
    return (tforce.load_model(str(path), device="cuda", dtype=torch.float32, tokenizer=False).model,
            tforce.load_model(str(draft), device="cuda", dtype=torch.float32, tokenizer=False).model)


def _room_for(model, draft, method, lengths, max_new, resident):
    """device_free that leaves room for exactly `resident` layers of the batch's full cache (as batch.py
    plans it on CUDA in float32: SDPA, and the CUDA graph pool for the methods with a draft or middle level), beside
    the weights."""
    spec = Speculation(method=method, **{k: v for k, v in FEATURES_SMALL.items() if k != "prefill_chunk"})
    total = max(lengths) + max_new
    work = placement.Work(total + spec.max_lookahead + 1, max(lengths) - 1, spec, FEATURES_SMALL["prefill_chunk"], True, "sdpa", rows=len(lengths))
    shape, small = model_shape(model), (model_shape(draft) if spec.uses_draft else None)
    # a context of 1 byte: layout counts the graph pool only beside a CUDA context, as the session's plan does
    # (its context is in the budget and in the peak alike)
    peak = placement.layout(shape, work, resident, small, 1).peak - 1
    return peak - shape.weights - (small.weights if small else 0)


@pytest.mark.parametrize("method", ["ar", "naive", "triforce", "retrieval", "streaming"])
@pytest.mark.parametrize("where", ["chip", "host", "part"])
def test_features_batch_rows_on_cuda_equal_each_prompt_alone(features_six, method, where):
    """generate_batch on CUDA, the full cache on chip, wholly in pinned host memory, or half and half (3 of 6
    layers streamed through the copy stream, layer-major prefill): every row is its prompt alone."""
    from tforce.engine.batch import generate_batch

    model, draft = features_six
    lengths, max_new = (1, 13, 37, 5), 20
    prompts = _features_prompts(lengths, seed=4)
    place = {"chip": dict(offload="off"), "host": dict(offload="on"),
             "part": dict(device_free=_room_for(model, draft, method, lengths, max_new, 3))}[where]
    rows = generate_batch(model, prompts, draft=draft, method=method, max_new_tokens=max_new, **place,
                          **FEATURES_SMALL, **FEATURES_GREEDY)
    offloaded = rows[0].stats["kv_offloaded_layers"]
    assert offloaded == {"chip": 0, "host": 6, "part": 3}[where]
    for prompt, row in zip(prompts, rows):
        alone = tforce.generate(model, prompt, method="ar", max_new_tokens=max_new, **FEATURES_GREEDY)
        assert row.tokens == alone.tokens


def test_features_offloaded_rows_are_gathered_into_pinned_memory(features_six):
    """A batch's rebuild reads of an offloaded layer land in page-locked memory (no pageable bounce)."""
    from tforce.cache.offload import OffloadedCache

    model = features_six[0]
    dims = (model.config.num_hidden_layers, model.n_kv_heads, model.head_dim)
    full = OffloadedCache(*dims, 64, Rotary(model.config, 64, device="cuda"), resident=0, device="cuda", rows=2)
    k, v = full.gather_rows(0, torch.zeros(5, model.n_kv_heads, dtype=torch.long, device="cuda"), row=1)
    assert k.is_pinned() and v.is_pinned() and k.shape == (1, 5, model.n_kv_heads, model.head_dim)


@pytest.mark.parametrize("method", ["ar", "triforce", "streaming"])
def test_features_snapshot_moves_between_cuda_and_cpu(tiny_dir, tmp_path, method):
    """A KV snapshot saved on CUDA loads on CUDA (on chip and offloaded) and on the CPU, one saved on the CPU
    loads on CUDA, each giving the tokens a fresh prefill gives on the loading device."""
    def models(device):
        return (tforce.load_model(str(tiny_dir / "gqa"), device=device, dtype=torch.float32),
                tforce.load_model(str(tiny_dir / "draft"), device=device, dtype=torch.float32, tokenizer=False))

    on = {"cuda": models("cuda"), "cpu": models("cpu")}
    prefix, prompt = _features_prompts([40])[0], _features_prompts([40])[0] + _features_prompts([9], seed=1)[0]
    kw = dict(method=method, max_new_tokens=24, rebuild_every=8, **FEATURES_SMALL, **FEATURES_GREEDY)
    for device in on:
        target, draft = on[device]
        tforce.generate(target, prefix, draft=draft, save_kv=tmp_path / device, **kw)
    for saved, loaded, offload in [("cuda", "cuda", "off"), ("cuda", "cuda", "on"), ("cuda", "cpu", "off"),
                                   ("cpu", "cuda", "off")]:
        target, draft = on[loaded]
        fresh = tforce.generate(target, prompt, draft=draft, offload=offload, **kw)
        got = tforce.generate(target, prompt, draft=draft, offload=offload, load_kv=tmp_path / saved, **kw)
        assert got.stats["kv_reused"] == 40, (saved, loaded, offload)  # all of the prefix's tokens
        assert got.tokens == fresh.tokens, (saved, loaded, offload)


@pytest.mark.parametrize("method,offload", [("ar", "off"), ("triforce", "off"), ("triforce", "on"),
                                            ("streaming", "off"), ("naive", "off")])
def test_features_conversation_on_cuda_equals_generate(tiny_dir, method, offload):
    """Conversation.ask on CUDA (CUDA graphs on for the draft and middle levels, the caches returned to the
    document's end between questions) answers as generate() over document + question does."""
    target = tforce.load_model(str(tiny_dir / "gqa"), device="cuda", dtype=torch.float32)
    draft = tforce.load_model(str(tiny_dir / "draft"), device="cuda", dtype=torch.float32, tokenizer=False)
    doc = _features_prompts([45])[0]
    kw = dict(draft=draft, method=method, offload=offload, rebuild_every=8, **FEATURES_SMALL, **FEATURES_GREEDY)
    conv = Conversation(target, doc, room=200, **kw)
    for n, seed in ((1, 3), (9, 4), (3, 5)):
        question = _features_prompts([n], seed=seed)[0]
        got = conv.ask(question, max_new_tokens=24)
        assert got.tokens == tforce.generate(target, doc + question, max_new_tokens=24, **kw).tokens


@pytest.mark.parametrize("method", ["triforce", "retrieval"])
@pytest.mark.parametrize("offload", ["off", "on"])
def test_features_deterministic_on_cuda_repeats_and_equals_ar_in_bfloat16(tiny_dir, method, offload):
    """--deterministic on CUDA in bfloat16: two runs give the same tokens, and they are greedy ar's
    (row-wise verification computes each logit as one-token decoding does: rowwise.py)."""
    target = tforce.load_model(str(tiny_dir / "gqa"), device="cuda", dtype=torch.bfloat16)
    draft = tforce.load_model(str(tiny_dir / "draft"), device="cuda", dtype=torch.bfloat16, tokenizer=False)
    prompt = _features_prompts([120])[0]
    kw = dict(max_new_tokens=40, offload=offload, **FEATURES_SMALL, **FEATURES_GREEDY)
    runs = [tforce.generate(target, prompt, draft=draft, method=method, deterministic=True, **kw) for _ in range(2)]
    assert runs[0].tokens == runs[1].tokens
    assert runs[0].tokens == tforce.generate(target, prompt, method="ar", **kw).tokens


@pytest.mark.parametrize("batch", [None, 2])
def test_features_bench_on_cuda_sets_reserved_memory_beside_the_plan(batch):
    """tforce bench (and bench --batch) on CUDA: each run's allocator peaks, reserved >= allocated, beside
    the plan's predicted peak less the CUDA context."""
    import json

    from typer.testing import CliRunner

    from tforce.cli import app

    args = ["bench", "--synthetic", "tiny", "--device", "cuda", "--dtype", "float32", "--prompt-len", "200",
            "--gen-len", "8", "--temperature", "0", "--methods", "ar,triforce", "--budget", "32", "--chunk-size", "4",
            "--draft-budget", "24", "--json"] + ([] if batch is None else ["--batch", str(batch)])
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, (result.output, result.exception)
    for run in json.loads(result.stdout)["runs"]:
        assert run["gpu_reserved_gib"] >= run["gpu_mem_gib"] > 0 and run["planned_peak_gib"] > 0, run
