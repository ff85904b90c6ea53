"""Tensor parallelism at run time: a generation over ranks (generate_tp) and what every rank builds and
agrees on (its models, the engine callbacks it sends on, the device memory it plans with, the process
group as Group and AnyRank). With rank_worker.py (inside the worker processes) and sharding.py (how a
model is split: apply_tp), the only files that touch torch.distributed.

Exactness across ranks. Every rank runs the whole speculation loop itself (draft model replicated, same
seed, generators on the same device type), so sampling needs no communication provided the ranks see
bitwise-identical logits. They do: all_reduce leaves the same bits on every rank (ring allreduce, NCCL's
and gloo's, reduces each slice on one rank and then copies it to the others; with two ranks a + b == b + a
exactly anyway), and everything after the last all_reduce is replicated, deterministic computation.
`generate_tp` checks the assumption at the end (all ranks' tokens must agree) instead of trusting it.
Against the unsharded model the logits differ only by summation order (allclose, not bitwise).
The same holds only if every rank runs the same code path, so all ranks place their KV caches from one
figure, the least free device memory over the ranks (`agreed_free`). The plans are then equal: each
rank's planner (session_plan.plan_session) compares the plan's peak with a budget that both count this rank's own
measured CUDA context and loaded weight bytes (row-parallel biases stay on rank 0), so those terms
cancel and the comparison reads only the agreed figure and shapes that every rank shares (tested on the
CPU in test_placement.py, with the context and weights made to differ). Session still compares the
ranks' plans before it allocates a cache or runs the model (Group.check_plan) and refuses a
difference rather than merging the plans: a difference means that argument broke, and a merged plan
(the fewest resident layers) need not fit every rank, since the peak is not monotone in resident layers
(offloading the first layer adds two staging layers and the prefill's hidden states).

The processes (ranks.py): generate_tp runs one generation in workers started for it (launch);
parallel/conversation.py keeps workers serving a chat's questions (Ranks).
"""
from __future__ import annotations

import secrets

import psutil
import torch
import torch.distributed as dist

from ..errors import DoesNotFit, TforceError, UsageError
from ..engine.placement import GiB
from .ranks import launch

# the callbacks of events.Events that rank 0 sends on to the parent (`until` travels to every rank: each
# must end where the others do)
CALLBACKS = ("on_plan", "on_prefill", "on_tokens", "on_round", "on_row")


def all_equal(obj) -> bool:
    """Whether every rank passed an equal (picklable) object; a collective: all ranks must call it."""
    objs = [None] * dist.get_world_size()
    dist.all_gather_object(objs, obj)
    return all(o == objs[0] for o in objs)


def generate_worker(rank, world, model_path, draft_path, prompts, batch, device, dtype, config, names, until, free,
                     emit=None):
    """One rank of generate_tp (prompts: one prompt's ids) or generate_batch_tp (batch: a list of them).
    names: the callbacks the parent listens to; free: one device_free figure per rank (tests give the ranks
    different ones)."""
    from ..engine.batch import generate_batch
    from ..engine.events import Events
    from ..engine.generate import generate

    target, small, dev = rank_models(model_path, draft_path, device, dtype, rank, world)
    device_free = agreed_free(dev, free[rank], config.execution.gpu_memory)
    config = config.with_options(device_free=device_free, gpu_memory=None)  # folded into device_free
    events = Events(until=until, **rank_callbacks(rank, emit, names))
    if batch:
        result = generate_batch(target, prompts, config, draft=small, events=events, group=Group())
    else:
        result = generate(target, prompts, config, small, events, Group())
    tokens = [r.tokens for r in result] if batch else result.tokens
    if not all_equal(tokens):  # the plans were compared before prefill (Group.check_plan)
        raise TforceError("the tensor-parallel ranks generated different tokens: please report this")
    return result


def rank_models(model_path: str, draft_path: str | None, device: str, dtype, rank: int, world: int):
    """(target shard, draft or None, device) of one rank: the rank reads only its shard of the target
    from the files, straight to its device (cuda:rank on CUDA); the draft is replicated."""
    from ..model.weights import load_model

    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    target = load_model(model_path, device=str(dev), dtype=dtype, tokenizer=False, rank=rank, world=world)
    small = load_model(draft_path, device=str(dev), dtype=dtype, tokenizer=False) if draft_path else None
    return target, small, dev


def rank_callbacks(rank: int, emit, names) -> dict:
    """The engine callbacks named, on rank 0 each sending its call to the parent (emit); none elsewhere."""
    if rank != 0 or emit is None:
        return {}
    return {name: (lambda *a, name=name: emit((name, a))) for name in names}


class AnyRank:
    """Whether any rank says yes, all ranks asking at the same point (a collective): one all_reduce (MAX)
    of a CPU integer over a gloo group of its own (an NCCL group would need a device tensor and a sync)."""

    def __init__(self):
        self.group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None

    def __call__(self, yes: bool) -> bool:
        t = torch.tensor([int(yes)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())


class Group:
    """The process group as the snapshot modules and session.py see it (this rank, the world size, a gather, the plan
    check), so that they need not touch torch.distributed. Gathers are collectives: every rank must make
    the same ones."""

    def __init__(self):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def gather(self, obj) -> list:
        """Every rank's (picklable) obj, in rank order."""
        objs = [None] * self.world
        dist.all_gather_object(objs, obj)
        return objs

    def check_plan(self, plan) -> None:
        """One TforceError line on every rank unless all ranks' memory plans (placement.Plan) keep the same
        layers resident and the same chunk statistics (see the module's docstring for why not a merge)."""
        gathered = self.gather((plan.resident, plan.recompute_stats, plan.host_bytes,
                                psutil.virtual_memory().available))
        plans = [(resident, recompute) for resident, recompute, _, _ in gathered]
        if len(set(plans)) > 1:
            each = "; ".join(f"rank {r}: {resident}/{plan.n_layers} layers resident"
                             + (", chunk statistics recomputed" if recompute else "")
                             for r, (resident, recompute) in enumerate(plans))
            raise TforceError(f"the tensor-parallel ranks planned different KV caches ({each}): "
                              f"please report this")
        # Each rank checked its own offloaded KV against the host's available memory (placement.plan); the
        # ranks share one host and none has pinned anything yet, so together they must fit it.
        need, available = sum(g[2] for g in gathered), min(g[3] for g in gathered)
        if need > available:
            raise DoesNotFit(f"not enough host memory for the offloaded KV cache: {need / GiB:.1f} GiB needed by "
                              f"the {self.world} ranks together, {available / GiB:.1f} GiB available")


def agreed_free(dev: torch.device, given: int | None, gpu_memory: int | None) -> int | None:
    """The device memory every rank plans with: the least any rank may use (a collective).

    A rank that plans from its own free memory may offload where another does not; the two then run
    different prefill paths and their all_reduces pair up wrongly (gloo: an error or the same wrong
    tokens on every rank; NCCL: a hang or silent corruption). So every rank plans with the minimum of
    the ranks' figures (rank_room), gpu_memory already folded in. None: no rank has a figure (a CPU
    run), which plans the whole cache as resident."""
    frees = [None] * dist.get_world_size()
    dist.all_gather_object(frees, rank_room(dev, given, gpu_memory))
    known = [f for f in frees if f is not None]
    return min(known) if known else None


def rank_room(dev: torch.device, given: int | None, gpu_memory: int | None) -> int | None:
    """This rank's room for the caches and activations beside what it holds: its free memory (or `given`),
    and with gpu_memory, no more than gpu_memory less what this rank has allocated (its shard: row-parallel
    biases make it differ) and, on CUDA, less its context, as session_plan.plan_session caps one process: gpu_memory
    bounds everything on the device, the context included."""
    if dev.type != "cuda":
        room, cap = given, gpu_memory
    else:
        free, total = torch.cuda.mem_get_info(dev)
        context = total - free - torch.cuda.memory_reserved(dev)  # as session_plan.plan_session measures it
        room = free if given is None else given
        cap = None if gpu_memory is None else gpu_memory - torch.cuda.memory_allocated(dev) - context
    return room if room is None or cap is None else min(room, cap)


def tp_options(device: str, dtype, config, world: int):
    """The checked device, the dtype (default: bfloat16 on CUDA, float32 on CPU) and the configuration
    (config.RunConfig) as every rank gets it: a seed drawn here when none was given (every rank samples
    with the same one), eager on CUDA (all_reduce inside a captured graph is untested here), device_free
    taken out as one figure per rank (None: measured there). Returns (dtype, config, free)."""
    if device not in ("cpu", "cuda"):
        raise UsageError(f"tensor parallelism runs on cpu or cuda, got {device!r}")
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    free = [config.execution.device_free] * world
    config = config.with_options(device_free=None)
    if config.sampling.seed is None:
        config = config.with_options(seed=secrets.randbits(63))
    if device == "cuda":
        config = config.with_options(cuda_graphs=False)
    return dtype or (torch.bfloat16 if device == "cuda" else torch.float32), config, free


def generate_tp(model_path: str, draft_path: str | None, prompt_ids, world: int, device: str = "cpu",
                dtype: torch.dtype | str | None = None, config=None, events=None, **options):
    """tforce.generate with the target split over `world` processes (gloo on CPU, NCCL on CUDA, rank r
    on cuda:r); the draft is replicated. Returns rank 0's Result. The events' callbacks run here, in this
    process, as rank 0 produces them. A missing seed is drawn here, so every rank samples with the same
    one. Every rank plans its KV cache from the least free device memory over the ranks (device_free, when
    given, stands for every rank's measure; agreed_free). KV snapshots (load_kv, save_kv) hold each
    rank's KV heads in a folder of its own (snapshot/format.py)."""
    return _launch(model_path, draft_path, list(prompt_ids), False, world, device, dtype, config, events, options)


def generate_batch_tp(model_path: str, draft_path: str | None, prompts, world: int, device: str = "cpu",
                      dtype: torch.dtype | str | None = None, config=None, events=None, **options):
    """tforce.generate_batch with the target split over `world` processes, as generate_tp runs one prompt:
    every rank runs the whole batch on its KV heads. Returns rank 0's Results."""
    prompts = [list(map(int, p)) for p in prompts]
    return _launch(model_path, draft_path, prompts, True, world, device, dtype, config, events, options)


def _launch(model_path, draft_path, prompts, batch: bool, world: int, device: str, dtype, config, events, options):
    from ..config import RunConfig
    from ..engine.events import Events

    if config is None:
        config = RunConfig.of(method="ar") if batch else RunConfig()  # generate_batch's default method is ar
    config = config.with_options(**options)
    events = events or Events()
    callbacks = {name: getattr(events, name) for name in CALLBACKS if getattr(events, name) is not None}
    dtype, config, free = tp_options(device, dtype, config, world)

    def on_event(event):
        name, args = event
        callbacks[name](*args)

    backend = "nccl" if device == "cuda" else "gloo"
    return launch(generate_worker, world, backend, str(model_path), str(draft_path) if draft_path else None,
                  prompts, batch, device, dtype, config, tuple(callbacks), events.until, free,
                  on_event=on_event if callbacks else None)
