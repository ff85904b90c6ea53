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

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from .errors import TforceError, UsageError

EVENTS = ("on_token", "on_prefill", "on_round")


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


def apply_tp(model, rank: int, world: int):
    """Shard a built tforce Llama in place for rank `rank` of `world`; returns it. world == 1: unchanged.

    The process group must be initialised before the model's first forward (not before this call)."""
    model = getattr(model, "model", model) if not isinstance(model, nn.Module) else model
    check_tp(model.config, world)
    if not 0 <= rank < world:
        raise UsageError(f"rank {rank} is outside 0..{world - 1}")
    if world == 1:
        return model
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        d = attn.head_dim
        n_q, n_kv = attn.n_heads // world, attn.n_kv // world  # local heads; GQA groups stay whole
        _shard_rows(attn.q_proj, rank * n_q * d, (rank + 1) * n_q * d)
        _shard_rows(attn.k_proj, rank * n_kv * d, (rank + 1) * n_kv * d)
        _shard_rows(attn.v_proj, rank * n_kv * d, (rank + 1) * n_kv * d)
        _shard_cols(attn.o_proj, rank * n_q * d, (rank + 1) * n_q * d, rank)
        attn.n_heads, attn.n_kv = n_q, n_kv
        f = mlp.gate_proj.out_features // world
        _shard_rows(mlp.gate_proj, rank * f, (rank + 1) * f)
        _shard_rows(mlp.up_proj, rank * f, (rank + 1) * f)
        _shard_cols(mlp.down_proj, rank * f, (rank + 1) * f, rank)
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


def _worker(rank, world, backend, port, threads, q, fn, args, emit_events):
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
            extra = {"device_id": torch.device("cuda", rank)}
        else:
            torch.set_num_threads(threads)
            extra = {}
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                **extra)
        kwargs = {"emit": lambda event: q.put(("event", rank, pickle.dumps(event)))} if emit_events else {}
        # Plain pickle: tensors travel by value (a queue would share them through this process, which
        # is about to exit).
        value = pickle.dumps(fn(rank, world, *args, **kwargs))
    except BaseException as e:
        q.put(("error", rank, (*_portable(rank, e), isinstance(e, TforceError))))
        _leave(q, 1)  # the parent ends the other ranks
    q.put(("result", rank, value))
    dist.destroy_process_group()
    _leave(q, 0)


def _leave(q, code: int) -> None:
    """Flush what this worker sent, then exit at once (skipping a slow interpreter teardown; after an
    error, also any teardown that would wait on ranks stuck in a collective)."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    q.close()
    q.join_thread()
    os._exit(code)


def launch(fn, world: int, backend: str, *args, on_event=None, all_ranks: bool = False, grace_s: float = 2.0):
    """Run fn(rank, world, *args) in `world` spawned processes joined by a process group (gloo on CPU,
    nccl on CUDA with rank r on cuda:r); return rank 0's return value (every rank's, in order, with
    all_ranks). fn must be importable (module level). With on_event, fn also gets emit=callable, and
    every emit(event) in a worker calls on_event(event) here, in order. A worker's failure is raised
    here as one TforceError (its message; the worker's traceback chained), and the other workers are
    ended rather than left waiting."""
    if backend not in ("gloo", "nccl"):
        raise UsageError(f"backend must be gloo or nccl, got {backend!r}")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port, threads = _free_port(), max(1, torch.get_num_threads() // world)
    procs = [ctx.Process(target=_worker, args=(r, world, backend, port, threads, q, fn, args, on_event is not None),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results, errors, died, stop_at = {}, [], None, None
    ok = False
    try:
        while len(results) < world and (stop_at is None or time.monotonic() < stop_at):
            try:
                kind, rank, payload = q.get(timeout=0.05)
            except queue_mod.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead and died is None:  # its error message, if any, may still be in the pipe
                    died = TforceError(f"rank {dead[0][0]} died (exit code {dead[0][1]})")
                    stop_at = min(stop_at or float("inf"), time.monotonic() + grace_s)
                continue
            if kind == "event":
                on_event(pickle.loads(payload))
            elif kind == "result":
                results[rank] = pickle.loads(payload)
            else:  # wait a moment for the other ranks' errors: the root cause may come second
                errors.append(payload)
                stop_at = min(stop_at or float("inf"), time.monotonic() + 0.25)
        ok = len(results) == world
    finally:
        _end(procs, q, wait_s=10.0 if ok else 0.0)
    if errors:  # a message meant for the user (a TforceError) beats fallout on the other ranks
        err, text, _ = next((e for e in errors if e[2]), errors[0])
        raise err from WorkerTraceback(text)
    if not ok:
        raise died or TforceError("the workers stopped without a result")
    return [results[r] for r in range(world)] if all_ranks else results[0]


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


def _generate_worker(rank, world, model_path, draft_path, prompt_ids, device, dtype, options, events, emit=None):
    from .engine import generate
    from .weights import load_model

    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    # Load on the host and shard there: a GPU never holds more than its shard of the target.
    target = load_model(model_path, device="cpu", dtype=dtype, tokenizer=False).model
    apply_tp(target, rank, world).to(dev)
    small = load_model(draft_path, device=str(dev), dtype=dtype, tokenizer=False).model if draft_path else None
    callbacks = {}
    if rank == 0 and emit is not None:
        callbacks = {name: (lambda *a, name=name: emit((name, a))) for name in events}
    result = generate(target, prompt_ids, draft=small, **options, **callbacks)
    if not all_equal(result.tokens):
        raise TforceError("the tensor-parallel ranks generated different tokens (their logits were not "
                          "bitwise identical): please report this")
    return result


def generate_tp(model_path: str, draft_path: str | None, prompt_ids, world: int, device: str = "cpu",
                dtype: torch.dtype | str | None = None, **generate_kwargs):
    """tforce.generate with the target split over `world` processes (gloo on CPU, NCCL on CUDA, rank r
    on cuda:r); the draft is replicated. Returns rank 0's Result. on_token / on_prefill / on_round
    callbacks run here, in this process, as rank 0 produces the events. A missing seed is drawn here,
    so every rank samples with the same one."""
    if device not in ("cpu", "cuda"):
        raise UsageError(f"tensor parallelism runs on cpu or cuda, got {device!r}")
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    dtype = dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
    callbacks = {name: generate_kwargs.pop(name) for name in EVENTS if generate_kwargs.get(name) is not None}
    generate_kwargs.pop("draft", None)
    for name in EVENTS:
        generate_kwargs.pop(name, None)
    if generate_kwargs.get("seed") is None:
        generate_kwargs["seed"] = secrets.randbits(63)
    if device == "cuda":  # all_reduce inside a captured graph is untested here: eager unless asked
        generate_kwargs.setdefault("cuda_graphs", False)

    def on_event(event):
        name, args = event
        callbacks[name](*args)

    backend = "nccl" if device == "cuda" else "gloo"
    return launch(_generate_worker, world, backend, str(model_path), str(draft_path) if draft_path else None,
                  list(prompt_ids), device, dtype, generate_kwargs, tuple(callbacks),
                  on_event=on_event if callbacks else None)
