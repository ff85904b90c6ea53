"""Checks the CPU cannot stand in for (CUDA only; they skip cleanly without a GPU).

The CPU code path of the offloaded cache runs plain copies; on CUDA the same steps go through pinned host
memory, a copy stream and events, where a missing wait shows up as stale or half-written K/V. These tests
compare that path with the plain full cache bit for bit, and run tensor parallelism over NCCL where two
GPUs exist. Graph replay vs eager is in test_graphs.py, flash vs SDPA in test_attention.py.
"""
from __future__ import annotations

import pytest
import torch

import tforce
from tforce.cache import FullCache
from tforce.cache.offload import OffloadedCache
from tforce.rope import Rotary

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
    copy stream (cache/rows_offload.py): every row's greedy tokens are the all-resident batch's, whose
    prefill is token-major."""
    from tforce.batch import generate_batch

    target = tforce.load_model(str(tiny_dir / "gqa"), device="cuda", dtype=torch.float32)
    draft = tforce.load_model(str(tiny_dir / "draft"), device="cuda", dtype=torch.float32, tokenizer=False)
    prompts = [list(range(3, 3 + n)) for n in (250, 1, 97)]
    kw = dict(draft=draft.model, method=method, max_new_tokens=32, temperature=0, ignore_eos=True, budget=64,
              chunk_size=8, draft_budget=32, sinks=4, prefill_chunk=64)
    on = generate_batch(target.model, prompts, offload="on", **kw)
    off = generate_batch(target.model, prompts, offload="off", **kw)
    assert on[0].stats["kv_offloaded_layers"] > 0 and off[0].stats["kv_offloaded_layers"] == 0
    assert [r.tokens for r in on] == [r.tokens for r in off]


def _nccl_tokens(rank, world, target_path, draft_path, prompt):
    from tforce.parallel import apply_tp

    dev = torch.device("cuda", rank)
    target = apply_tp(tforce.load_model(target_path, tokenizer=False).model, rank, world).to(dev)
    draft = tforce.load_model(draft_path, device=str(dev), tokenizer=False).model
    return [tforce.generate(target, prompt, draft=draft, method=m, max_new_tokens=24, temperature=0,
                            ignore_eos=True, budget=32, chunk_size=4, draft_budget=16, sinks=2,
                            cuda_graphs=False).tokens for m in ("ar", "triforce")]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_ranks_over_nccl_generate_the_single_gpu_tokens(tmp_path):
    from tforce.parallel import launch
    from tforce.synthetic import make_checkpoint

    t = make_checkpoint(tmp_path / "t", seed=11, num_attention_heads=4, num_key_value_heads=2)
    d = make_checkpoint(tmp_path / "d", seed=12, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1)
    prompt = list(range(3, 60))
    ranks = launch(_nccl_tokens, 2, "nccl", str(t), str(d), prompt, all_ranks=True)
    single = _nccl_tokens(0, 1, str(t), str(d), prompt)
    assert ranks[0] == ranks[1] == single
