"""floors.py: the bytes and FLOPs behind bench's floors, against hand counts for Llama-2-7B's shape,
and bench's per-stage figures beside them."""
from __future__ import annotations

import pytest
import torch

import tforce
from tforce.bench import suite as b
from tforce.bench import run as bench_run
from tforce.bench.ceilings import Ceilings
from tforce.config import Speculation
from tforce.bench.floors import prefill_flops, step_floors_ms
from tforce.model.synthetic import make_config

GB = 1e9


def test_prefill_flops_of_llama2_7b():
    c = make_config("llama2-7b")
    n = 8192
    layers = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)  # q, k, v, o and the three MLP matrices
    assert layers == pytest.approx(6.48e9, rel=0.01)
    expected = 2 * layers * n + 32 * 2 * n * n * 4096 + 2 * 4096 * 32000
    assert prefill_flops(c, n) == expected
    assert prefill_flops(c, 2 * n) > 2 * prefill_flops(c, n)  # attention grows with the square
    # Attention's width is heads x head_dim, which need not be the hidden size.
    wide = make_config("llama2-7b", head_dim=256)
    width = 32 * 256
    layers = 32 * (2 * 4096 * width + 2 * 4096 * width + 3 * 4096 * 11008)
    assert prefill_flops(wide, n) == 2 * layers * n + 32 * 2 * n * n * width + 2 * 4096 * 32000


def test_step_floors_of_llama2_7b_at_122k():
    c, d = make_config("llama2-7b"), make_config("llama2-7b", **b.LLAMA_68M)
    spec = Speculation(budget=4096, draft_budget=256)
    f = step_floors_ms(c, d, 2, spec, 122880, bandwidth_gbps=1000.0)
    kv_token = 32 * 2 * 4096 * 2  # 512 KiB of K and V per token over 32 layers, bfloat16
    # A step reads the layers, the final norm and the output projection; of the input embedding table
    # only its tokens' rows (not counted).
    weights = 2 * (32 * (4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096) + 4096 + 32000 * 4096)
    assert f["full"] == pytest.approx(1000 * (weights + kv_token * 122880) / (1000 * GB))
    assert f["retrieval"] == pytest.approx(1000 * (weights + kv_token * 4096) / (1000 * GB))
    assert f["full"] / f["retrieval"] == pytest.approx(5.03, rel=0.01)  # 77.9 GB vs 15.5 GB: what TriForce lives on
    # Llama-68M: 2 layers of 768 and a 32000-token output projection (its input table, a third of its
    # bytes, is not read), 256 tokens of K and V.
    draft_weights = 2 * (2 * (4 * 768 * 768 + 3 * 768 * 3072 + 2 * 768) + 768 + 32000 * 768)
    assert f["draft"] == pytest.approx(1000 * (draft_weights + 2 * 2 * 768 * 2 * 256) / (1000 * GB))
    tied = make_config("llama2-7b", tie_word_embeddings=True)  # the one table is the output projection: read
    assert step_floors_ms(tied, d, 2, spec, 122880, 1000.0)["full"] == pytest.approx(f["full"])
    assert step_floors_ms(c, d, 2, spec, 122880, None) is None
    assert set(step_floors_ms(c, d, 2, Speculation(method="ar"), 1000, 1.0)) == {"full"}
    # a batch's forward reads the weights once and each fed row's KV
    rows = step_floors_ms(c, d, 2, spec, 122880, 1000.0, {"full": 8, "retrieval": 2.5})
    assert rows["full"] == pytest.approx(1000 * (weights + 8 * kv_token * 122880) / (1000 * GB))
    assert rows["retrieval"] == pytest.approx(1000 * (weights + 2.5 * kv_token * 4096) / (1000 * GB))
    assert rows["draft"] == pytest.approx(f["draft"])  # not given: one row


def test_bench_gives_each_stage_its_measured_step_beside_its_floor(tiny):
    target, draft = tiny["gqa"].model, tiny["draft"].model
    models = bench_run.Models.local(target, draft)
    ids = list(range(3, 203))
    spec = Speculation(budget=64, chunk_size=4, draft_budget=32, sinks=4)
    r = tforce.generate(target, ids, draft=draft, max_new_tokens=16, temperature=0.0, ignore_eos=True,
                        budget=64, chunk_size=4, draft_budget=32, sinks=4)
    got = bench_run.stage_floors(models, spec, len(ids), 16, r.stats, Ceilings(device_gbps=10.0, tflops=2.0))
    assert set(got["step_ms"]) == set(got["step_floor_ms"]) == {"draft", "retrieval", "full"}
    assert got["rows_per_forward"] == {"draft": 1, "retrieval": 1, "full": 1}  # one prompt: one row a forward
    for name, n in r.stats["forwards"].items():
        assert got["step_ms"][name] == pytest.approx(1000 * r.stats["stage_s"][name] / n)
    assert got["step_floor_ms"] == step_floors_ms(target.config, draft.config, 4, spec, 208, 10.0)
    assert got["prefill_flop_floor_s"] == pytest.approx(prefill_flops(target.config, 200) / 2e12)
    for name, over in got["step_overhead_ms"].items():
        assert over == pytest.approx(got["step_ms"][name] - got["step_floor_ms"][name])
    none = bench_run.stage_floors(models, spec, len(ids), 16, r.stats, Ceilings())  # no ceilings measured
    assert none["step_floor_ms"] is None and none["prefill_flop_floor_s"] is None and none["step_overhead_ms"] is None


def test_the_cpu_ceilings_are_measured_and_the_table_shows_each_forward_beside_its_floor():
    from tforce.cli.bench_table import floor_notes

    ceil = Ceilings.measure("cpu", torch.float32)
    assert ceil.h2d_gbps is None and 0.1 < ceil.device_gbps < 10_000 and 1e-4 < ceil.tflops < 1_000
    run = {"method": "triforce", "floors": {"step_ms": {"draft": 1.5, "full": 9.0},
                                            "step_floor_ms": {"draft": 0.5, "full": 6.0},
                                            "step_overhead_ms": {"draft": 1.0, "full": 3.0}}}
    lines = floor_notes({"device_gbps": 12.5, "runs": [run, {"method": "peer", "floors": None}]})
    assert lines == ["per forward, ms: measured = floor (weights + attended KV bytes / 12.5 GB/s measured) + overhead",
                     "  triforce: draft 1.50 = 0.50 + 1.00; full 9.00 = 6.00 + 3.00"]
    assert floor_notes({"device_gbps": None, "runs": [run]}) == []


def test_info_floor_reads_the_weights_a_step_reads():
    """tforce info's floor of plain decoding: the same weight bytes as a bench stage's floor, plus the
    resident KV (on chip: all of it)."""
    from tforce.bench.floors import step_weight_bytes

    c = make_config("llama2-7b")
    record = b.info_plan(c, 8192, 2, None, 2**40, offload="off", device_gbps=1000.0)
    kv = 32 * 2 * 4096 * 2 * 8192
    assert record["floor_device_s_per_token"] == pytest.approx((step_weight_bytes(c, 2) + kv) / 1e12)
