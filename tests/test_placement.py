"""The placement planner's decisions for given GPU and host memory sizes."""
import pytest

from tforce import placement
from tforce.errors import TforceError, UsageError
from tforce.placement import GiB

# Llama2-7B-128K: 32 layers, 32 KV heads of 128, fp16, 131072 slots -> 2 GiB of K+V per layer.
LAYER = placement.kv_layer_bytes(32, 128, 131072, 2)


def test_layer_bytes_match_the_paper():
    assert LAYER == 2 * GiB
    assert 32 * LAYER == 64 * GiB  # "64 GiB of KV cache for Llama2-7B at 128K"


def test_cpu_keeps_everything_in_place():
    p = placement.plan(32, LAYER, "auto", None, 0, 100 * GiB)
    assert (p.resident, p.host_bytes) == (32, 0)


def test_rtx4090_budget_offloads_most_layers():
    # 24 GiB card, 13.5 GiB of weights + 1 GiB retrieval + 1 GiB margin resident: 8.5 GiB left,
    # of which 4 GiB go to two staging buffers: 2 layers stay.
    p = placement.plan(32, LAYER, "auto", 24 * GiB, int(15.5 * GiB), 128 * GiB)
    assert p.resident == 2 and p.offloaded == 30
    assert p.gpu_bytes == 4 * LAYER and p.host_bytes == 30 * LAYER


def test_large_card_keeps_everything_on_chip():
    p = placement.plan(32, LAYER, "auto", 78 * GiB, int(12.5 * GiB), 128 * GiB)
    assert p.resident == 32 and p.host_bytes == 0 and p.gpu_bytes == 64 * GiB


def test_forced_modes():
    on = placement.plan(32, LAYER, "on", 78 * GiB, 0, 128 * GiB)
    assert on.resident == 0 and on.gpu_bytes == 2 * LAYER and on.host_bytes == 64 * GiB
    with pytest.raises(TforceError, match="not enough GPU memory"):
        placement.plan(32, LAYER, "off", 24 * GiB, 14 * GiB, 128 * GiB)


def test_host_memory_shortage_names_the_sizes():
    with pytest.raises(TforceError, match=r"64\.0 GiB needed, 32\.0 GiB available"):
        placement.plan(32, LAYER, "on", 24 * GiB, 14 * GiB, 32 * GiB)


def test_bad_mode():
    with pytest.raises(UsageError):
        placement.plan(32, LAYER, "sometimes", None, 0, GiB)
