"""The memory plan: its items, peaks and placement decisions for given GPU and host memory sizes, and on a
tiny model on the CPU, its items against the bytes the engine's objects really allocate."""
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tforce.engine import placement
from tforce.bench.suite import synthetic_pair
from tforce.config import Execution, RunConfig, Sampling, Speculation
from tforce.engine.generate import Session
from tforce.engine.session_plan import model_shape
from tforce.errors import TforceError, UsageError
from tforce.engine.placement import GiB
from tforce.engine.prefill import prefill_layer_major
from tforce.model.synthetic import make_config

from placement_helpers import shapes, work

# Llama2-7B-128K: 32 layers, 32 KV heads of 128, fp16, 131072 slots -> 2 GiB of K+V per layer.
LAYER = placement.kv_layer_bytes(32, 128, 131072, 2)
ARCHS = ("llama2-7b", "llama2-13b", "llama3.1-8b")


def test_layer_bytes_match_the_paper():
    assert LAYER == 2 * GiB
    assert 32 * LAYER == 64 * GiB  # "64 GiB of KV cache for Llama2-7B at 128K"


def test_no_device_keeps_everything_in_place():
    target, draft = shapes("llama2-7b")
    p = placement.plan(target, work(122880), "auto", None, 100 * GiB, draft, context=0)
    assert (p.resident, p.host_bytes) == (32, 0)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("prompt", [32768, 65536, 122880])
@pytest.mark.parametrize("arch", ARCHS)
def test_plans_fit_a_24gib_gpu_or_refuse_in_one_line(arch, prompt, world):
    target, draft = shapes(arch, world)
    w = work(prompt)
    if arch == "llama2-13b" and world == 1:  # 24.2 GiB of fp16 weights
        with pytest.raises(TforceError, match=r"not enough GPU memory: .*\(target weights 24\.2 GiB") as e:
            placement.plan(target, w, "auto", 24 * GiB, 1024 * GiB, draft)
        assert "\n" not in str(e.value)
        return
    p = placement.plan(target, w, "auto", 24 * GiB, 1024 * GiB, draft)
    assert p.prefill_peak <= 24 * GiB and p.decode_peak <= 24 * GiB
    assert p.resident == target.layers or placement.layout(target, w, p.resident + 1, draft).peak > 24 * GiB
    assert p.host_bytes == p.offloaded * p.layer_bytes


def test_the_prefill_peak_counts_what_the_old_margin_hid():
    """Llama-2-7B at 122,880 + 256 tokens on 24 GiB: the prompt's hidden states, the staging buffers, the
    chunk statistics and the CUDA context are items, and the plan's peak fits with them."""
    target, draft = shapes("llama2-7b")
    p = placement.plan(target, work(122880), "auto", 24 * GiB, 1024 * GiB, draft)
    assert p.item("prefill hidden states") == 122880 * 4096 * 2
    assert p.item("staging buffers (2 layers)") == 2 * p.layer_bytes
    assert p.item("CUDA context") == placement.CONTEXT_BYTES
    stats = placement.chunk_stat_bytes(p.layer_bytes // (2 * 32 * 128 * 2), 8, 32, 128)
    assert p.item("retrieval chunk statistics") == (p.resident + 1) * stats
    assert p.prefill_peak == sum(i.bytes for i in p.items if i.phase != "decode") <= 24 * GiB


def test_tensor_parallel_ranks_hold_half_the_kv_and_layers_but_all_embeddings():
    one, _ = shapes("llama2-13b", 1)
    two, _ = shapes("llama2-13b", 2)
    embeddings = 2 * 32000 * 5120 * 2  # embed_tokens + lm_head, on every rank
    assert two.kv_heads == 20 and two.heads == 20 and two.intermediate == 13824 // 2
    assert 2 * two.weights - embeddings == pytest.approx(one.weights, rel=1e-4)


def test_ranks_with_different_contexts_and_weights_plan_alike_from_one_room():
    """Why tensor-parallel ranks planning from one agreed room (parallel.tp.agreed_free) plan alike: on CUDA
    each rank's budget is its loaded weights + its measured CUDA context + the room (session.plan_session), and
    the plan's peak counts those same two, so they cancel. Rank 1 here has 300 MiB more context and
    1 MiB less weights (row-parallel biases stay on rank 0); for every room around each boundary between
    plans (resident layers, chunk statistics kept or recomputed, none fitting), both pick the same."""
    target, draft = shapes("llama2-7b", world=2)
    w = work(65536)
    ranks = [(target, 600 * 2**20), (replace(target, weights=target.weights - 2**20), 900 * 2**20)]

    def choice(shape, context, room):
        try:
            p = placement.plan(shape, w, "auto", shape.weights + draft.weights + context + room, 2**50, draft,
                               context)
        except TforceError:
            return None
        return p.resident, p.recompute_stats

    edges = [placement.layout(target, w, r, draft, 0, recompute_stats=rec).peak - target.weights - draft.weights
             for r in range(target.layers + 1) for rec in (False, True)]
    rooms = [e + d for e in edges for d in (-1, 0, 1)]
    choices = {room: [choice(shape, context, room) for shape, context in ranks] for room in rooms}
    assert all(a == b for a, b in choices.values())
    assert {a for a, _ in choices.values()} >= {None, (0, False), (target.layers, False), (target.layers, True)}


def test_forced_modes():
    target, draft = shapes("llama2-7b")
    on = placement.plan(target, work(122880), "on", 78 * GiB, 128 * GiB, draft)
    assert on.resident == 0 and on.gpu_bytes == 2 * on.layer_bytes and on.host_bytes == 32 * on.layer_bytes
    with pytest.raises(TforceError, match="not enough GPU memory"):
        placement.plan(target, work(122880), "off", 24 * GiB, 128 * GiB, draft)


def test_host_memory_shortage_names_the_sizes():
    target, draft = shapes("llama2-7b")
    with pytest.raises(TforceError, match=r"64\.0 GiB needed, 32\.0 GiB available"):
        placement.plan(target, placement.Work(131072, 131072), "on", 24 * GiB, 32 * GiB, draft)


SDPA_PROBE = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "2026-11-23_h100_sdpa_probe.jsonl"


def test_sdpa_scratch_is_what_an_h100_allocated():
    """The planner's SDPA scratch (Work.attention "sdpa") against the extra bytes attend() allocated on an
    H100 (scripts/gpu_sdpa_probe.py; torch 2.11, bf16, no flash-attn), MHA and GQA, 1 to 512 queries
    over 32K and 128K keys: within 4 MiB or 10%. The float32 scores once assumed are 10-60x more."""
    rows = [json.loads(line) for line in SDPA_PROBE.read_text().splitlines() if '"extra_bytes"' in line]
    assert len(rows) == 12
    for r in rows:
        s = placement.Shape(layers=1, hidden=4096, heads=r["h_q"], kv_heads=r["h_kv"], head_dim=128,
                            intermediate=11008, vocab=32000, dtype_bytes=2, weights=0)
        w = placement.Work(r["S"], r["S"], attention="sdpa")
        flash = placement.Work(r["S"], r["S"], attention="flash")
        scratch = (placement._activations(s, w, r["T"], r["S"])
                   - placement._activations(s, flash, r["T"], r["S"]))
        assert abs(scratch - r["extra_bytes"]) <= max(4 << 20, 0.1 * r["extra_bytes"]), r


def test_24gib_plan_at_128k_fits_with_sdpa_and_not_with_materialised_scores():
    target, draft = shapes("llama2-7b")
    sdpa = placement.Work(131072, 131072, attention="sdpa")
    p = placement.plan(target, sdpa, "auto", 24 * GiB, 128 * GiB, draft)
    assert max(p.prefill_peak, p.decode_peak) <= 24 * GiB and p.offloaded > 0
    with pytest.raises(TforceError, match="not enough GPU memory"):
        placement.plan(target, placement.Work(131072, 131072, attention="math"), "auto", 24 * GiB, 128 * GiB,
                       draft)


def test_bad_mode():
    target, _ = shapes("llama2-7b")
    with pytest.raises(UsageError):
        placement.plan(target, work(1024), "sometimes", None, GiB)


# ----------------------------------------------------------------- the plan against what is allocated


def _session(prompt_len: int, resident: int | None):
    """A triforce Session on the tiny pair (5 target layers); `resident` layers of KV on the "device"
    (None: no device, all in place), through device_free as tensor-parallel ranks pass it."""
    target, draft = synthetic_pair("tiny", "cpu", torch.float32)
    target_cfg = make_config("tiny", num_hidden_layers=5)
    target = type(target)(target_cfg).eval()
    spec, chunk = Speculation(budget=64, draft_budget=32, sinks=4), 16
    device_free = None
    if resident is not None:
        w = placement.Work(prompt_len + 8 + spec.max_lookahead + 1, prompt_len, spec, chunk, False, "math")
        shape, small = model_shape(target), model_shape(draft)
        device_free = placement.layout(shape, w, resident, small, 0).peak - shape.weights - small.weights
    s = Session(target, draft, prompt_len, 8, RunConfig(speculation=spec, sampling=Sampling(), execution=Execution(prefill_chunk=chunk, offload="auto", gpu_memory=None, cuda_graphs=False, device_free=device_free)))
    return s, target


def _nbytes(*tensors) -> int:
    return sum(t.nbytes for t in tensors)


@pytest.mark.parametrize("resident", [None, 2, 0])
def test_items_equal_the_bytes_the_caches_and_prefill_allocate(resident):
    n = 40
    s, target = _session(n, resident)
    p, full = s.plan, s.full.cache
    assert p.resident == (5 if resident is None else resident)
    assert p.item("full KV, resident layers") == _nbytes(full.k, full.v)
    staging = _nbytes(full.stage_k, full.stage_v) if p.offloaded else 0
    assert p.item("staging buffers (2 layers)") == staging
    r = s.retrieval
    assert p.item("retrieval cache and key positions") == _nbytes(r.k, r.v, r.key_pos)
    assert p.item("draft StreamingLLM cache") == _nbytes(s.small.cache.k, s.small.cache.v)
    assert p.item("target weights") == _nbytes(*target.parameters())
    if p.offloaded:  # the layer-major prefill: the prompt's hidden states, K/V in a staging slot
        ids = torch.arange(3, n + 3)[:n]  # the whole prompt: its prefill yields the first token
        allocated = prefill_layer_major(target, [ids], full, s.full.prefill_chunk).allocated
        assert allocated == p.item("prefill hidden states") + p.item("prefill K/V scratch (a staging slot)")
        assert allocated == n * target.config.hidden_size * 4


def test_host_storage_is_one_tensor_per_offloaded_layer_and_totals_the_plan():
    s, _ = _session(40, 2)
    full = s.full.cache
    assert isinstance(full.host_k, list) and len(full.host_k) == len(full.host_v) == s.plan.offloaded == 3
    assert all(t.shape == full.host_k[0].shape and t.shape[0] == 1 for t in full.host_k + full.host_v)
    assert full.host_bytes == _nbytes(*full.host_k, *full.host_v) == s.plan.host_bytes


# ----------------------------------------------------------------------------------------- tforce info


def _info(args):
    import json

    from typer.testing import CliRunner

    from tforce.cli import app

    runner = CliRunner()
    r = runner.invoke(app, ["info", *args, "--json"])
    assert r.exit_code == 0, (r.output, r.exception)
    text = runner.invoke(app, ["info", *args], env={"COLUMNS": "200"}).stdout
    return json.loads(r.stdout), text


def test_info_prints_an_itemised_plan_under_the_budget():
    obj, text = _info(["--synthetic", "llama2-7b", "--gpu-memory", "24GiB", "--context", "131072"])
    p = obj["plan"]
    if torch.cuda.is_available():
        pytest.skip("plans the local GPU")
    names = [i["name"] for i in p["items"]]
    for name in ("CUDA context", "target weights", "draft weights", "full KV, resident layers",
                 "staging buffers (2 layers)", "retrieval cache and key positions", "retrieval chunk statistics",
                 "rebuild scratch", "draft StreamingLLM cache", "prefill hidden states", "decode activations",
                 "logits and probabilities", "CUDA graph pools (estimate)"):
        assert name in names
        assert f"  {name}" in text
    assert p["prefill_peak_bytes"] <= 24 * GiB and p["decode_peak_bytes"] <= 24 * GiB
    assert p["budget_bytes"] == 24 * GiB and p["host_pinned_bytes"] == p["offloaded_layers"] * 2 * GiB
    assert "prefill peak" in text and "decode peak" in text and "24.00 GiB" in text


def test_info_plans_one_rank_of_two_and_refuses_13b_on_one():
    one, text = _info(["--synthetic", "llama2-13b", "--gpu-memory", "24GiB", "--context", "122880"])
    assert "not enough GPU memory" in one["plan"]["error"] and "does not fit" in text
    two, _ = _info(["--synthetic", "llama2-13b", "--gpu-memory", "24GiB", "--context", "122880", "--gpus", "2"])
    assert "error" not in two["plan"] and two["plan"]["peak_bytes"] <= 24 * GiB and two["plan"]["ranks"] == 2


def test_info_sizes_the_cache_for_the_models_own_context(tiny_dir):
    obj, _ = _info(["-m", str(sorted(tiny_dir.iterdir())[0])])
    assert obj["model"]["kv_context"] == obj["model"]["context"] == obj["plan"]["context"] != 131072


def test_info_plans_the_draft_run_would_use(tmp_path):
    """For a folder X-target beside X-draft (the demo pair's layout), run's default draft is X-draft, and
    info plans it: it planned a 68M-parameter draft (0.05 GiB for the demo pair's 0.6M)."""
    from tforce.model.synthetic import make_checkpoint
    from tforce.model.weights import read_config

    make_checkpoint(tmp_path / "p-target", seed=0, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)
    make_checkpoint(tmp_path / "p-draft", seed=1, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1)
    obj, _ = _info(["-m", str(tmp_path / "p-target")])
    items = {i["name"]: i["bytes"] for i in obj["plan"]["items"]}
    assert items["draft weights"] == placement.Shape.of(read_config(tmp_path / "p-draft"), 2).weights
    alone = tmp_path / "alone"  # no sibling draft: the paper's 68M draft, as before
    make_checkpoint(alone, seed=0, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)
    obj, _ = _info(["-m", str(alone)])
    items = {i["name"]: i["bytes"] for i in obj["plan"]["items"]}
    assert items["draft weights"] > 10 * placement.Shape.of(read_config(tmp_path / "p-draft"), 2).weights


def test_info_plans_no_draft_model_where_the_default_draft_is_lookup(tmp_path, monkeypatch):
    """A model whose registry draft is n-gram lookup (SmolLM2's): run reads no draft model, so info plans none."""
    import tforce.cli.setup as setup
    from tforce.model.registry import LOOKUP
    from tforce.model.synthetic import make_checkpoint

    make_checkpoint(tmp_path / "p-target", seed=0, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)
    monkeypatch.setattr(setup, "default_draft", lambda model: LOOKUP)
    obj, _ = _info(["-m", str(tmp_path / "p-target")])
    names = {i["name"] for i in obj["plan"]["items"]}
    assert "target weights" in names and not any("draft" in n for n in names), names


def test_a_batch_is_planned_with_every_per_row_item_times_its_rows():
    shape = placement.Shape.of(make_config("llama2-7b"), 2)
    one = placement.Work(capacity=32768, prompt=32767, spec=Speculation(method="naive"))
    four = placement.Work(capacity=32768, prompt=32767, rows=4, spec=Speculation(method="naive"))
    draft = placement.Shape.of(make_config("tiny"), 2)
    a, b = placement.layout(shape, one, 20, draft), placement.layout(shape, four, 20, draft)
    for name in ("full KV, resident layers", "staging buffers (2 layers)", "draft StreamingLLM cache",
                 "logits and probabilities"):
        assert b.item(name) == 4 * a.item(name) > 0, name
    assert b.item("target weights") == a.item("target weights") and b.host_bytes == 4 * a.host_bytes


@pytest.mark.parametrize("method, items", [
    ("triforce", ("retrieval cache and key positions", "stored queries", "draft StreamingLLM cache")),
    ("streaming", ("middle StreamingLLM cache", "stored queries"))])
def test_a_batch_counts_the_middle_caches_and_queries_of_every_row(method, items):
    """session.py keeps a retrieval (or streaming) cache, chunk statistics and stored queries per row."""
    shape, draft = placement.Shape.of(make_config("llama2-7b"), 2), placement.Shape.of(make_config("tiny"), 2)
    one = placement.layout(shape, placement.Work(capacity=32768, prompt=32767, spec=Speculation(method=method)), 20, draft)
    four = placement.layout(shape, placement.Work(capacity=32768, prompt=32767, rows=4, spec=Speculation(method=method)), 20, draft)
    for name in items:
        assert four.item(name) == 4 * one.item(name) > 0, name
    if method == "triforce":  # every row's kept statistics; one layer of means, the rows rebuilt in turn
        scratch = placement.chunk_stat_bytes(32768, 8, 32, 128)
        assert four.item("retrieval chunk statistics") - scratch == 4 * (one.item("retrieval chunk statistics")
                                                                         - scratch) == 4 * 20 * scratch


def test_info_plans_a_batch():
    args = ["--synthetic", "llama2-7b", "--gpu-memory", "80GiB", "--context", "32768"]
    one, _ = _info(args)
    four, text = _info(args + ["--batch", "4"])
    if torch.cuda.is_available():
        pytest.skip("plans the local GPU")
    assert four["plan"]["kv_bytes"] == 4 * one["plan"]["kv_bytes"] and four["plan"]["rows"] == 4
    assert four["plan"]["resident_layers"] < one["plan"]["resident_layers"] == 32
    assert "4 x 32768 tokens" in text


def test_generate_reports_the_plans_peak_beside_its_placement(tiny, monkeypatch):
    """stats carry the plan's predicted device peak and its CUDA-context share (none on a CPU run), which
    bench sets beside torch.cuda.max_memory_reserved."""
    import tforce
    import tforce.engine.session

    plans = []
    real = tforce.engine.nodes.plan_session
    monkeypatch.setattr(tforce.engine.nodes, "plan_session", lambda *a: plans.append(real(*a)) or plans[-1])
    stats = tforce.generate(tiny["gqa"], list(range(3, 40)), method="ar", max_new_tokens=2, temperature=0).stats
    assert stats["plan_peak_bytes"] == plans[0].peak > 0 and stats["plan_context_bytes"] == 0


@pytest.mark.parametrize("weights", ["auto", "int8", "int4"])
def test_weight_bytes_from_the_config_are_the_built_models(tmp_path, weights):
    """What `tforce info --weights` plans from a config is what the model holds once built and quantized
    (model/quant.py): its parameters and buffers, tied table once."""
    import tforce
    from tforce.model.synthetic import make_checkpoint

    path = make_checkpoint(tmp_path / "m", seed=1, tokenizer=False, hidden_size=64, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    loaded = tforce.load_model(str(path), weights=None if weights == "auto" else weights, tokenizer=False)
    assert model_shape(loaded.model).weights == placement.weight_bytes(loaded.config, 4, weights=weights)
