"""Tensor parallelism on the CPU (gloo, 2 spawned processes): a sharded forward's logits match the
unsharded model's, a rank loading only its slices equals load-then-apply_tp, greedy tokens with --tp 2
equal --tp 1 (ar and triforce), sampled tokens agree across ranks, ranks measuring different free memory
still plan alike, ranks whose plans differ anyway refuse before prefill, worker failures and a rank that never
starts surface as one line, and bad --tp / --gpus values are one usage line.

Starting workers costs seconds (each imports torch and transformers), so one launch runs every
in-worker check and the CLI test makes the only other one."""
from __future__ import annotations

import time

import pytest
import torch
from typer.testing import CliRunner

import tforce
from model_helpers import forward, full_cache, random_ids
from tforce.config import RunConfig
from tforce.cli import app
from tforce.errors import DoesNotFit, TforceError, UsageError
from tforce.engine import placement
from tforce.parallel.tp import generate_worker, rank_room
from tforce.parallel.ranks import launch
from tforce.model.sharding import apply_tp, check_tp
from tforce.model.synthetic import make_checkpoint

from tp_helpers import GEN, TARGET
from tp_helpers import paths, single  # noqa: F401 (fixtures)

PROMPT = random_ids(48, seed=7)[0].tolist()
SAMPLED = dict(temperature=0.9, top_p=0.95, seed=1234)


def _checks(rank, world, target_path, draft_path):
    """In each worker: one sharded forward's logits, greedy ar/triforce tokens, sampled triforce tokens."""
    target = apply_tp(tforce.load_model(target_path, tokenizer=False).model, rank, world)
    draft = tforce.load_model(draft_path, tokenizer=False).model
    out = {"kv_heads": target.n_kv_heads, "logits": forward(target, full_cache(target), torch.tensor([PROMPT]))}
    sliced = tforce.load_model(target_path, tokenizer=False, rank=rank, world=world).model
    whole = target.state_dict()
    out["sliced_weights_equal"] = sliced.state_dict().keys() == whole.keys() and all(
        torch.equal(t, whole[name]) for name, t in sliced.state_dict().items())
    out["sliced_logits"] = forward(sliced, full_cache(sliced), torch.tensor([PROMPT]))
    for method in ("ar", "triforce"):
        out[method] = tforce.generate(target, PROMPT, draft=draft, method=method, temperature=0, **GEN).tokens
    out["sampled"] = tforce.generate(target, PROMPT, draft=draft, method="triforce", **SAMPLED, **GEN).tokens
    return out


def _hang_rank_1(rank):
    if rank == 1:
        time.sleep(3600)  # a rank stuck before it starts (the parent ends it)


def _fail(rank, world):
    if rank == 1:
        raise ValueError("boom\nsecond line")
    torch.distributed.barrier()  # rank 0 would wait here for ever: the parent must end it


def _refuse(rank, world):
    if rank == 1:
        raise DoesNotFit("not enough GPU memory: stand-in")
    torch.distributed.barrier()


@pytest.fixture(scope="module")
def ranks(paths):
    return launch(_checks, 2, "gloo", str(paths[0]), str(paths[1]), all_ranks=True)


def test_sharded_forward_matches_unsharded(ranks, single):
    target, _ = single
    expected = forward(target, full_cache(target), torch.tensor([PROMPT]))
    for out in ranks:
        assert out["kv_heads"] == 1  # each rank caches its half of the KV heads
        torch.testing.assert_close(out["logits"], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(ranks[0]["logits"], ranks[1]["logits"])  # bitwise: the ranks sample alike


def test_rank_reading_its_slices_equals_load_then_apply_tp(ranks):
    for out in ranks:
        assert out["sliced_weights_equal"]
        assert torch.equal(out["sliced_logits"], out["logits"])


@pytest.mark.parametrize("method", ["ar", "triforce"])
def test_greedy_tp2_equals_tp1(ranks, single, method):
    target, draft = single
    expected = tforce.generate(target, PROMPT, draft=draft, method=method, temperature=0, **GEN).tokens
    assert len(expected) == GEN["max_new_tokens"]
    assert ranks[0][method] == expected and ranks[1][method] == expected


def test_sampled_tokens_identical_across_ranks(ranks, single):
    assert ranks[0]["sampled"] == ranks[1]["sampled"]
    target, draft = single
    assert ranks[0]["sampled"] == tforce.generate(target, PROMPT, draft=draft, method="triforce", **SAMPLED,
                                                  **GEN).tokens


def test_worker_error_is_one_line_not_a_hang():
    with pytest.raises(TforceError) as info:
        launch(_fail, 2, "gloo")
    assert str(info.value) == "rank 1: ValueError: boom"
    assert "Traceback" in str(info.value.__cause__)  # the worker's traceback, for TFORCE_DEBUG=1


def test_a_ranks_memory_refusal_arrives_as_one():
    """A rank's DoesNotFit is raised here as DoesNotFit (not a plain TforceError), so that `run --batch
    --tp N` runs a batch the ranks refuse as smaller batches (cli/batch_groups.run_groups)."""
    with pytest.raises(DoesNotFit, match="^not enough GPU memory: stand-in$"):
        launch(_refuse, 2, "gloo")


FIVE = dict(temperature=0, max_new_tokens=12, ignore_eos=True, budget=32, prefill_chunk=16)


@pytest.fixture(scope="module")
def five(tmp_path_factory):
    """A 5-layer target, a prompt of 48 prefill tokens (3 chunks of 16), and room(method, resident,
    recompute): the device_free that leaves one rank's shard room for exactly that plan, from the planner
    itself (session_plan.plan_session on a CPU run: budget = weights + device_free, no CUDA context)."""
    from tforce.config import Speculation
    from tforce.engine.session_plan import model_shape

    path = make_checkpoint(tmp_path_factory.mktemp("five") / "five-layers", seed=13, num_hidden_layers=5, **TARGET)
    prompt = random_ids(49, seed=8)[0].tolist()
    shard = model_shape(apply_tp(tforce.load_model(str(path), tokenizer=False).model, 0, 2))

    def room(method, resident, recompute=False):
        spec = Speculation(method=method, budget=FIVE["budget"])
        capacity = spec.capacity(len(prompt) + FIVE["max_new_tokens"])
        work = placement.Work(capacity, len(prompt), spec.fitted(capacity), FIVE["prefill_chunk"], False, "math")
        return placement.layout(shard, work, resident, None, 0, recompute_stats=recompute).peak - shard.weights

    return path, prompt, room


def test_ranks_with_different_free_memory_plan_alike(five):
    """Rank 0 measures room for 2 of 5 KV layers (plus staging), rank 1 for all 5: alone, rank 0 would
    offload 3 layers (layer-major prefill) and rank 1 none (token-major), and their all_reduces would
    pair up wrongly. Both must plan with the smaller figure and produce ar's tokens."""
    path, prompt, room = five
    kw = dict(FIVE, method="ar")
    expected = tforce.generate(tforce.load_model(str(path), tokenizer=False).model, prompt, **kw)
    assert expected.stats["kv_offloaded_layers"] == 0
    free = [room("ar", 2), room("ar", 5)]  # rank 0: 2 staging + 2 layers; rank 1: all 5
    results = launch(generate_worker, 2, "gloo", str(path), None, prompt, False, "cpu", torch.float32,
                     RunConfig.of(**kw, seed=0), (), None, free, all_ranks=True)
    for result in results:
        assert (result.stats["kv_resident_layers"], result.stats["kv_offloaded_layers"]) == (2, 3)
        assert result.tokens == expected.tokens


def _fail_at_prefill(rank) -> None:
    """In a rank's process: a prefill that only fails, naming the rank that reached it."""
    import tforce.engine.session

    def prefill(self, *a, **k):
        raise RuntimeError(f"rank {rank} reached prefill")

    tforce.engine.session.Session.prefill = prefill


def _unagreed_worker(rank, world, *args):
    """generate_worker with each rank planning from its own figure (_agreed_free bypassed), as ranks whose
    plans differ despite it would, and a prefill that only fails, naming the rank that reached it."""
    import tforce.parallel.tp

    tforce.parallel.tp.agreed_free = lambda dev, given, gpu_memory: given
    _fail_at_prefill(rank)
    return generate_worker(rank, world, *args)


@pytest.mark.parametrize("method, rooms, plans", [
    ("ar", ((2, False), (5, False)), "rank 0: 2/5 layers resident; rank 1: 5/5 layers resident"),
    ("retrieval", ((5, True), (5, False)),
     "rank 0: 5/5 layers resident, chunk statistics recomputed; rank 1: 5/5 layers resident"),
])
def test_ranks_that_plan_differently_refuse_before_prefill(five, method, rooms, plans):
    """Different resident layers (different prefill paths: mismatched all_reduces) or different chunk
    statistics: every rank refuses with one line naming each rank's plan before any rank prefills. (Before
    the check ran in Session, the ranks reached prefill and only the end of generation compared them, and
    not the chunk statistics.)"""
    path, prompt, room = five
    free = [room(method, *r) for r in rooms]
    with pytest.raises(TforceError) as info:
        launch(_unagreed_worker, 2, "gloo", str(path), None, prompt, False, "cpu", torch.float32,
               RunConfig.of(**FIVE, method=method, seed=0), (), None, free)
    assert str(info.value) == f"the tensor-parallel ranks planned different KV caches ({plans}): please report this"


def _tight_host_worker(rank, world, available, *args):
    """generate_worker on a host with `available` bytes of memory (psutil stood in), and a prefill that
    only fails, naming the rank that reached it."""
    import types

    import psutil

    psutil.virtual_memory = lambda: types.SimpleNamespace(available=available)
    _fail_at_prefill(rank)
    return generate_worker(rank, world, *args)


def test_ranks_offloading_more_than_the_host_holds_together_refuse_before_prefill(five):
    """Each rank's offloaded layers fit the host alone; both ranks' together do not: one line before
    anything is pinned (each rank checked only its own before). With room for both, prefill is reached."""
    path, prompt, room = five
    free = [room("ar", 2)] * 2  # 3 of 5 layers offloaded on each rank
    args = (str(path), None, prompt, False, "cpu", torch.float32, RunConfig.of(**FIVE, method="ar", seed=0), (), None, free)
    host = launch(generate_worker, 2, "gloo", *args).stats["kv_host_bytes"]  # one rank's
    assert host > 0
    with pytest.raises(DoesNotFit, match="needed by the 2 ranks together"):
        launch(_tight_host_worker, 2, "gloo", int(1.5 * host), *args)
    with pytest.raises(TforceError, match="reached prefill"):
        launch(_tight_host_worker, 2, "gloo", 2 * host, *args)


def test_gpu_memory_caps_a_ranks_room_with_its_context_as_in_one_process(monkeypatch):
    """--gpu-memory caps everything on the device, the CUDA context included: one process plans with
    budget = min(weights + context + room, gpu_memory) (session_plan.plan_session), so its caches and activations get
    at most gpu_memory - weights - context. A rank's figure must leave it the same (not the context more).
    torch.cuda's memory queries are stood in for (no GPU): 80 GiB, 60 free, 15 reserved, 14 allocated."""
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: (60 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev: 15 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev: 14 * gib)
    dev, weights, context = torch.device("cuda", 0), 14 * gib, 80 * gib - 60 * gib - 15 * gib
    one_process = min(weights + context + 60 * gib, 30 * gib) - weights - context
    assert rank_room(dev, None, 30 * gib) == one_process == 11 * gib
    assert rank_room(dev, None, None) == 60 * gib
    assert rank_room(dev, 8 * gib, 30 * gib) == 8 * gib  # a given figure under the cap stands
    assert rank_room(torch.device("cpu"), 8 * gib, 6 * gib) == 6 * gib  # no context on the CPU


def test_rank_that_never_starts_is_one_line_within_the_limit():
    t0 = time.monotonic()
    with pytest.raises(TforceError, match=r"^ranks? (0, )?1 did not start within 15 s$"):
        launch(_fail, 2, "gloo", start_timeout_s=15, _on_spawn=_hang_rank_1)
    assert time.monotonic() - t0 < 25


@pytest.mark.cuda
def test_bandwidth_probes_leave_no_cached_device_memory():
    """bench measures H2D peak in the parent before launching ranks; memory its allocator kept on cuda:0
    would shrink rank 0's free-memory figure (and so every rank's agreed plan)."""
    from tforce.bench.ceilings import device_bandwidth_gbps, h2d_peak_gbps

    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(0)
    assert h2d_peak_gbps("cuda:0", nbytes=64 << 20, repeats=1) > 0
    assert device_bandwidth_gbps("cuda:0", nbytes=64 << 20, repeats=1) > 0
    assert torch.cuda.memory_reserved(0) == before


def test_check_tp(single):
    config = single[0].config
    check_tp(config, 2)
    for world, needle in ((3, "divide by 3"), (4, "divide by 4"), (0, "at least 1")):
        with pytest.raises(UsageError, match=needle):
            check_tp(config, world)


def test_cli_tp2_streams_the_tp1_tokens(paths, single):
    target, draft = single
    tok = tforce.load_model(str(paths[0]), tokenizer=True).tokenizer
    text = "It was the best of times, it was the worst of times."
    expected = tforce.generate(target, tok.encode(text), draft=draft, temperature=0, **GEN).tokens
    args = ["run", "-m", str(paths[0]), "--draft", str(paths[1]), "-p", text, "--tp", "2", "--device", "cpu",
            "-t", "0", "-n", "16", "--budget", "32", "--chunk-size", "4", "--draft-budget", "16", "--sinks", "2",
            "--ignore-eos", "--method", "triforce"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    # stdout is written only from the tokens rank 0 streams back as it accepts them
    assert result.stdout == tok.decode(expected, skip_special_tokens=True)
    assert "16 tokens after" in result.stderr


@pytest.mark.parametrize("args, needle", [
    (["--tp", "3", "--device", "cpu"], "cannot split 4 query heads and 2 KV heads over 3 ranks"),
    (["--tp", "0", "--device", "cpu"], "--tp must be >= 1"),
    (["--gpus", "0"], "--gpus must be >= 1"),
    (["--gpus", "2", "--device", "cpu"], "--gpus runs on CUDA"),
    (["--gpus", "2", "--tp", "4"], "disagree"),
    (["--gpus", "64"], "torch sees"),
])
def test_bad_tp_is_one_usage_line(paths, args, needle):
    result = CliRunner().invoke(app, ["run", "-m", str(paths[0]), "--draft", str(paths[1]), "-p", "hi"] + args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tforce: error: ") and needle in lines[0], result.stderr
    assert result.stdout == ""
