"""Tensor parallelism, applied from outside to a built model (gpt-fast's `apply_tp`); the only file that
touches torch.distributed.

Layout (Megatron): each rank holds a contiguous block of KV heads together with the query heads of their
GQA groups (q/k/v_proj column-parallel), the matching input columns of o_proj (row-parallel), and a block
of the MLP's intermediate features (gate/up_proj column-parallel, down_proj row-parallel). An all_reduce
after o_proj and after down_proj gives every rank the full hidden state; embeddings and lm_head are
replicated, so every rank computes the full logits. Each rank's caches hold only its KV heads (the model
reads its head count from k_proj), so with offloading each GPU streams its half over its own PCIe link.

Exactness across ranks. Every rank runs the whole speculation loop itself (draft model replicated, same
seed, generators on the same device type), so sampling needs no communication provided the ranks see
bitwise-identical logits. They do: all_reduce leaves the same bits on every rank (ring allreduce, NCCL's
and gloo's, reduces each slice on one rank and then copies it to the others; with two ranks a + b == b + a
exactly anyway), and everything after the last all_reduce is replicated, deterministic computation.
`generate_tp` checks the assumption at the end (all ranks' tokens must agree) instead of trusting it.
Against the unsharded model the logits differ only by summation order (allclose, not bitwise).
The same holds only if every rank runs the same code path, so all ranks place their KV caches from one
figure, the least free device memory over the ranks (`_agreed_free`), and the end check compares the
plans as well as the tokens.

Loading: each rank reads from the safetensors files only its slice of every sharded weight
(`tp_slices`, used by weights.load_model(rank=, world=)); embeddings, norms and lm_head whole.
Start-up has a limit (`launch`'s start_timeout_s) and ends in one all_reduce whose sums are checked.
"""
from __future__ import annotations

import os
import pickle
import queue as queue_mod
import secrets
import socket
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from .errors import TforceError, UsageError

EVENTS = ("on_token", "on_prefill", "on_round", "on_plan")
START_TIMEOUT_S = 120.0  # spawn, imports, process group and a test all_reduce (launch's start_timeout_s)
COLLECTIVE_TIMEOUT_S = 600  # a worker waiting this long in one collective (or the rendezvous) fails itself
P2P_HINT = "GPUs without working peer-to-peer access (e.g. RTX 4090 pairs) need NCCL_P2P_DISABLE=1"


def check_tp(config, world: int) -> None:
    """UsageError (one line) unless the model's heads and MLP split evenly over `world` ranks."""
    if world < 1:
        raise UsageError(f"tensor parallelism needs at least 1 rank, got {world}")
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    if kv % world or heads % world:
        raise UsageError(f"cannot split {heads} query heads and {kv} KV heads over {world} ranks: "
                         f"both must divide by {world}")
    if config.intermediate_size % world:
        raise UsageError(f"cannot split the MLP's {config.intermediate_size} features over {world} ranks")


# ------------------------------------------------------------------------------------------ sharding


def _shard_rows(linear: nn.Linear, start: int, end: int) -> None:
    """Column-parallel: keep output features [start, end) (weight rows and bias)."""
    linear.weight = nn.Parameter(linear.weight.data[start:end].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data[start:end].clone(), requires_grad=False)
    linear.out_features = end - start


def _shard_cols(linear: nn.Linear, start: int, end: int, rank: int) -> None:
    """Row-parallel: keep input features [start, end); the bias stays on rank 0 only, so the sum adds it once."""
    linear.weight = nn.Parameter(linear.weight.data[:, start:end].clone(), requires_grad=False)
    if linear.bias is not None and rank != 0:
        linear.bias = None
    linear.in_features = end - start
    linear.register_forward_hook(_all_reduce_output)


def _all_reduce_output(module, inputs, output: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(output)  # sum of the ranks' partial products; identical bits on every rank
    return output


def _layer_cuts(layer, rank: int, world: int) -> dict[str, tuple[int, int, int]]:
    """One decoder layer's sharded linears -> (dim, start, end): the weight slice rank keeps (dim 0:
    output features, column-parallel; dim 1: input features, row-parallel). Read from the unsharded layer."""
    attn, mlp = layer.self_attn, layer.mlp
    d = attn.head_dim
    n_q, n_kv = attn.n_heads // world, attn.n_kv // world  # local heads; GQA groups stay whole
    f = mlp.gate_proj.out_features // world
    q, kv, ff = (rank * n_q * d, (rank + 1) * n_q * d), (rank * n_kv * d, (rank + 1) * n_kv * d), \
        (rank * f, (rank + 1) * f)
    return {"self_attn.q_proj": (0, *q), "self_attn.k_proj": (0, *kv), "self_attn.v_proj": (0, *kv),
            "self_attn.o_proj": (1, *q), "mlp.gate_proj": (0, *ff), "mlp.up_proj": (0, *ff),
            "mlp.down_proj": (1, *ff)}


def tp_slices(model, rank: int, world: int) -> dict[str, tuple[int, int, int] | None]:
    """Checkpoint tensor name -> (dim, start, end) of the part rank keeps under apply_tp, or None for a
    tensor it drops (a row-parallel bias off rank 0); tensors not named are replicated whole. Read from
    an unsharded model (the meta device will do): weights.load_model reads only these slices."""
    model = getattr(model, "model", model) if not isinstance(model, nn.Module) else model
    out = {}
    for i, layer in enumerate(model.model.layers):
        for name, (dim, start, end) in _layer_cuts(layer, rank, world).items():
            prefix = f"model.layers.{i}.{name}"
            out[f"{prefix}.weight"] = (dim, start, end)
            if layer.get_submodule(name).bias is None:
                continue
            if dim == 0:
                out[f"{prefix}.bias"] = (0, start, end)
            elif rank != 0:  # row-parallel: the sum over ranks adds rank 0's whole bias once
                out[f"{prefix}.bias"] = None
    return out


def apply_tp(model, rank: int, world: int):
    """Shard a built tforce Llama in place for rank `rank` of `world`; returns it. world == 1: unchanged.
    Works on a model on the meta device too (shapes only; weights.load_model then assigns the slices).

    The process group must be initialised before the model's first forward (not before this call)."""
    model = getattr(model, "model", model) if not isinstance(model, nn.Module) else model
    check_tp(model.config, world)
    if not 0 <= rank < world:
        raise UsageError(f"rank {rank} is outside 0..{world - 1}")
    if world == 1:
        return model
    for layer in model.model.layers:
        for name, (dim, start, end) in _layer_cuts(layer, rank, world).items():
            linear = layer.get_submodule(name)
            if dim == 0:
                _shard_rows(linear, start, end)
            else:
                _shard_cols(linear, start, end, rank)
        attn = layer.self_attn
        attn.n_heads, attn.n_kv = attn.n_heads // world, attn.n_kv // world
    return model


def all_equal(obj) -> bool:
    """Whether every rank passed an equal (picklable) object; a collective: all ranks must call it."""
    objs = [None] * dist.get_world_size()
    dist.all_gather_object(objs, obj)
    return all(o == objs[0] for o in objs)


# ----------------------------------------------------------------------------------------- processes


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerTraceback(Exception):
    """A worker's traceback as text, chained under the parent's one-line error (seen with TFORCE_DEBUG=1)."""


def _portable(rank: int, e: BaseException) -> tuple[TforceError, str]:
    """A worker's exception -> (a picklable one-line TforceError, the traceback text)."""
    text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    if isinstance(e, TforceError):
        err = (UsageError if isinstance(e, UsageError) else TforceError)(str(e))
    elif isinstance(e, KeyboardInterrupt):
        err = TforceError(f"rank {rank}: interrupted")
    else:
        msg = (str(e).strip().splitlines() or [""])[0]
        err = TforceError(f"rank {rank}: {type(e).__name__}: {msg}")
    return err, text


def _worker(rank, world, backend, port, threads, q, fn, args, emit_events, on_spawn, inbox=None):
    try:
        if on_spawn is not None:
            on_spawn(rank)
        if backend == "nccl":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
            extra = {"device_id": device}
        else:
            torch.set_num_threads(threads)
            device, extra = torch.device("cpu"), {}
        q.put(("up", rank, None))
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S), **extra)
        _check_link(rank, world, device)
        q.put(("joined", rank, None))
        kwargs = {"emit": lambda event: q.put(("event", rank, pickle.dumps(event)))} if emit_events else {}
        if inbox is None:
            # Plain pickle: tensors travel by value (a queue would share them through this process, which
            # is about to exit).
            q.put(("result", rank, pickle.dumps(fn(rank, world, *args, **kwargs))))
        else:
            _serve(rank, q, inbox, fn(rank, world, *args, **kwargs))
    except BaseException as e:
        q.put(("error", rank, (*_portable(rank, e), isinstance(e, TforceError))))
        _leave(q, 1)  # the parent ends the other ranks
    dist.destroy_process_group()
    _leave(q, 0)


def _serve(rank: int, q, inbox, server) -> None:
    """Send the parent what the generator `server` yields, sending the generator the parent's next command
    each time, until that command is None or the parent is gone (an orphan would hold its memory for ever)."""
    value = next(server)
    while True:
        q.put(("result", rank, pickle.dumps(value)))
        command = _next_command(inbox)
        if command is None:
            server.close()
            return
        value = server.send(command)


def _next_command(inbox):
    """The parent's next command, or None once the parent has exited."""
    while True:
        try:
            return inbox.get(timeout=1.0)
        except queue_mod.Empty:
            if not mp.parent_process().is_alive():
                return None


def _check_link(rank: int, world: int, device: torch.device) -> None:
    """One 1 MiB all_reduce before any work, checked: a link that hangs does so inside the start-up
    limit, and one that corrupts data fails here instead of in the model's sums."""
    x = torch.arange(1 << 18, dtype=torch.float32, device=device)
    expected = world * x + world * (world - 1) // 2  # exact in float32: every value stays below 2 ** 24
    x += rank
    dist.all_reduce(x)
    if not torch.equal(x, expected):
        raise TforceError(f"rank {rank}: a test all_reduce returned wrong sums: {P2P_HINT}")


def _leave(q, code: int) -> None:
    """Flush what this worker sent, then exit at once (skipping a slow interpreter teardown; after an
    error, also any teardown that would wait on ranks stuck in a collective)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    q.close()
    q.join_thread()
    os._exit(code)


def launch(fn, world: int, backend: str, *args, on_event=None, all_ranks: bool = False, grace_s: float = 2.0,
           start_timeout_s: float = START_TIMEOUT_S, _on_spawn=None):
    """Run fn(rank, world, *args) in `world` spawned processes joined by a process group (gloo on CPU,
    nccl on CUDA with rank r on cuda:r); return rank 0's return value (every rank's, in order, with
    all_ranks). fn must be importable (module level). With on_event, fn also gets emit=callable, and
    every emit(event) in a worker calls on_event(event) here, in order. A worker's failure is raised
    here as one TforceError (its message; the worker's traceback chained), and the other workers are
    ended rather than left waiting. So is a start-up that takes over start_timeout_s (spawn, imports,
    the process group and one test all_reduce), naming the ranks that did not start. _on_spawn: a test
    hook, an importable callable run first in each worker with its rank."""
    ranks = Ranks(fn, world, backend, *args, on_event=on_event, grace_s=grace_s, start_timeout_s=start_timeout_s,
                  _on_spawn=_on_spawn)
    try:
        results = ranks.collect()
    finally:
        ranks.close()
    return results if all_ranks else results[0]


class Ranks:
    """`world` spawned workers joined by a process group, from the parent's side (launch's machinery).

    collect() waits for every rank's next result. Without serve, that is fn's return value (launch).
    With serve, fn is a generator function and the workers persist: each rank sends what its generator
    yields, and send(command) hands every rank's generator the next command (the value of its yield)
    until close() sends None. Events (emit) reach on_event while collect() waits. Any failure (a
    worker's error, a death, a start-up past its limit, an interrupt here) ends every worker at once
    and is raised as one TforceError; close() (or leaving a `with` block) ends them too, waiting for
    them to exit after a normal end."""

    def __init__(self, fn, world: int, backend: str, *args, on_event=None, serve: bool = False,
                 grace_s: float = 2.0, start_timeout_s: float = START_TIMEOUT_S, _on_spawn=None):
        if backend not in ("gloo", "nccl"):
            raise UsageError(f"backend must be gloo or nccl, got {backend!r}")
        ctx = mp.get_context("spawn")
        self.q = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(world)] if serve else []
        port, threads = _free_port(), max(1, torch.get_num_threads() // world)
        self.procs = [ctx.Process(target=_worker, args=(r, world, backend, port, threads, self.q, fn, args,
                                                        on_event is not None, _on_spawn,
                                                        self.inboxes[r] if serve else None), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()
        self.world, self.backend, self.on_event, self.grace_s = world, backend, on_event, grace_s
        self.start_timeout_s, self.start_by = start_timeout_s, time.monotonic() + start_timeout_s
        self.up, self.joined, self.closed = set(), set(), False

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        self.close(wait_s=10.0 if kind is None else 0.0)

    def send(self, command) -> None:
        self._check_open()
        for inbox in self.inboxes:
            inbox.put(command)

    def collect(self) -> list:
        """Every rank's next result, in rank order."""
        self._check_open()
        world, procs = self.world, self.procs
        results, errors, died, stop_at, late = {}, [], None, None, None
        ok = False
        try:
            while len(results) < world and (stop_at is None or time.monotonic() < stop_at):
                if stop_at is None and len(self.joined) < world and time.monotonic() > self.start_by:
                    late = TforceError(_late_start(world, self.up, self.start_timeout_s, self.backend))
                    break
                try:
                    kind, rank, payload = self.q.get(timeout=0.05)
                except queue_mod.Empty:
                    dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                    if dead and died is None:  # its error message, if any, may still be in the pipe
                        died = TforceError(f"rank {dead[0][0]} died (exit code {dead[0][1]})")
                        stop_at = min(stop_at or float("inf"), time.monotonic() + self.grace_s)
                    continue
                if kind == "up":
                    self.up.add(rank)
                elif kind == "joined":
                    self.joined.add(rank)
                elif kind == "event":
                    self.on_event(pickle.loads(payload))
                elif kind == "result":
                    results[rank] = pickle.loads(payload)
                else:  # wait a moment for the other ranks' errors: the root cause may come second
                    errors.append(payload)
                    stop_at = min(stop_at or float("inf"), time.monotonic() + 0.25)
            ok = len(results) == world and not errors
        finally:
            if not ok:
                self.close(wait_s=0.0)
        if errors:  # a message meant for the user (a TforceError) beats fallout on the other ranks
            err, text, _ = next((e for e in errors if e[2]), errors[0])
            raise err from WorkerTraceback(text)
        if not ok:
            raise late or died or TforceError("the workers stopped without a result")
        return [results[r] for r in range(world)]

    def _check_open(self) -> None:
        if self.closed:
            raise TforceError("the tensor-parallel ranks have ended (after an error or Ctrl-C): start again")

    def close(self, wait_s: float = 10.0) -> None:
        """Tell serving workers to stop, join every worker (up to wait_s in all), then end what still runs."""
        if self.closed:
            return
        self.closed = True
        for inbox in self.inboxes:
            inbox.put(None)
        _end(self.procs, self.q, wait_s)
        for inbox in self.inboxes:
            inbox.close()
            inbox.cancel_join_thread()


def _late_start(world: int, up: set, limit_s: float, backend: str) -> str:
    """The one-line message for a start-up past its limit: the ranks that never ran, else the group."""
    missing = [str(r) for r in range(world) if r not in up]
    if missing:
        return f"rank{'s' if len(missing) > 1 else ''} {', '.join(missing)} did not start within {limit_s:g} s"
    hint = f"; {P2P_HINT}" if backend == "nccl" else ""
    return f"the {world} ranks did not join their process group within {limit_s:g} s{hint}"


def _end(procs, q, wait_s: float) -> None:
    """Join the workers (up to wait_s in all), then end whatever still runs."""
    deadline = time.monotonic() + wait_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    q.close()
    q.cancel_join_thread()


# ---------------------------------------------------------------------------------------- generation


def _generate_worker(rank, world, model_path, draft_path, prompt_ids, device, dtype, options, events, free,
                     emit=None):
    """One rank of generate_tp. free: one device_free figure per rank (tests give the ranks different ones)."""
    from .engine import generate

    target, small, dev = rank_models(model_path, draft_path, device, dtype, rank, world)
    options = dict(options)
    device_free = _agreed_free(dev, free[rank], options.pop("gpu_memory", None))
    result = generate(target, prompt_ids, draft=small, device_free=device_free, group=Group(), **options,
                      **rank_callbacks(rank, emit, events))
    plan = (result.stats["kv_resident_layers"], result.stats["kv_offloaded_layers"])
    if not all_equal((result.tokens, plan)):
        raise TforceError("the tensor-parallel ranks generated different tokens or placed their KV caches "
                          "differently: please report this")
    return result


def rank_models(model_path: str, draft_path: str | None, device: str, dtype, rank: int, world: int):
    """(target shard, draft or None, device) of one rank: the rank reads only its shard of the target
    from the files, straight to its device (cuda:rank on CUDA); the draft is replicated."""
    from .weights import load_model

    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    target = load_model(model_path, device=str(dev), dtype=dtype, tokenizer=False, rank=rank, world=world)
    small = load_model(draft_path, device=str(dev), dtype=dtype, tokenizer=False) if draft_path else None
    return target, small, dev


def rank_callbacks(rank: int, emit, names) -> dict:
    """The engine callbacks named, on rank 0 each sending its call to the parent (emit); none elsewhere."""
    if rank != 0 or emit is None:
        return {}
    return {name: (lambda *a, name=name: emit((name, a))) for name in names}


class Group:
    """The process group as snapshot.py sees it (this rank, the world size, a gather), so that snapshot.py
    need not touch torch.distributed. Gathers are collectives: every rank must make the same ones."""

    def __init__(self):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def gather(self, obj) -> list:
        """Every rank's (picklable) obj, in rank order."""
        objs = [None] * self.world
        dist.all_gather_object(objs, obj)
        return objs


def _agreed_free(dev: torch.device, given: int | None, gpu_memory: int | None) -> int | None:
    """The device memory every rank plans with: the least any rank may use (a collective).

    A rank that plans from its own free memory may offload where another does not; the two then run
    different prefill paths and their all_reduces pair up wrongly (gloo: an error or the same wrong
    tokens on every rank; NCCL: a hang or silent corruption). So each rank measures (or takes `given`),
    applies gpu_memory as the engine would (less what this rank has allocated, which differs by the
    row-parallel biases), and all plan with the minimum, gpu_memory already folded in. None: no rank
    has a figure (a CPU run), which plans the whole cache as resident."""
    free = given
    if free is None and dev.type == "cuda":
        free = torch.cuda.mem_get_info(dev)[0]
    if free is not None and gpu_memory is not None:
        free = min(free, gpu_memory - (torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0))
    frees = [None] * dist.get_world_size()
    dist.all_gather_object(frees, free)
    known = [f for f in frees if f is not None]
    return min(known) if known else None


def tp_options(device: str, dtype, options: dict, world: int):
    """The checked device, the dtype (default: bfloat16 on CUDA, float32 on CPU) and generate's options as
    every rank gets them: a seed drawn here when none was given (every rank samples with the same one),
    eager on CUDA (all_reduce inside a captured graph is untested here), device_free taken out as one
    figure per rank (None: measured there). Returns (dtype, options, free)."""
    if device not in ("cpu", "cuda"):
        raise UsageError(f"tensor parallelism runs on cpu or cuda, got {device!r}")
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    options = dict(options)
    free = [options.pop("device_free", None)] * world
    if options.get("seed") is None:
        options["seed"] = secrets.randbits(63)
    if device == "cuda":
        options.setdefault("cuda_graphs", False)
    return dtype or (torch.bfloat16 if device == "cuda" else torch.float32), options, free


def generate_tp(model_path: str, draft_path: str | None, prompt_ids, world: int, device: str = "cpu",
                dtype: torch.dtype | str | None = None, **generate_kwargs):
    """tforce.generate with the target split over `world` processes (gloo on CPU, NCCL on CUDA, rank r
    on cuda:r); the draft is replicated. Returns rank 0's Result. on_token / on_prefill / on_round / on_plan
    callbacks run here, in this process, as rank 0 produces the events. A missing seed is drawn here,
    so every rank samples with the same one. Every rank plans its KV cache from the least free device
    memory over the ranks (device_free, when given, stands for every rank's measure; _agreed_free).
    KV snapshots (load_kv, save_kv) hold each rank's KV heads in a folder of its own (snapshot.py)."""
    callbacks = {name: generate_kwargs.pop(name) for name in EVENTS if generate_kwargs.get(name) is not None}
    generate_kwargs.pop("draft", None)
    for name in EVENTS:
        generate_kwargs.pop(name, None)
    dtype, generate_kwargs, free = tp_options(device, dtype, generate_kwargs, world)

    def on_event(event):
        name, args = event
        callbacks[name](*args)

    backend = "nccl" if device == "cuda" else "gloo"
    return launch(_generate_worker, world, backend, str(model_path), str(draft_path) if draft_path else None,
                  list(prompt_ids), device, dtype, generate_kwargs, tuple(callbacks), free,
                  on_event=on_event if callbacks else None)
