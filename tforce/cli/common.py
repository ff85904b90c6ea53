"""What every command shares: option vocabularies, one-line errors, the device choice.

Discipline (docs/architecture.md, "The command line's output"): data and --json go to stdout, nothing else does;
progress and diagnostics go to stderr; bad input is one line `tforce: error: ...` with exit 2 (usage) or 1
(runtime); Ctrl-C exits 130; TFORCE_DEBUG=1 re-raises to show the traceback. Configuration is validated before
any model is loaded.
"""
from __future__ import annotations

import os
import sys
from typing import Optional

import typer

from ..errors import DoesNotFit, TforceError, UsageError

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "float16", "bfloat16")
OFFLOAD_HELP = "Full KV cache: auto (GPU while it fits, rest in pinned host memory) | on (all host) | off."
GPU_MEMORY_HELP = "Most GPU memory tforce may use, e.g. 24GiB, 24GB, 24000MiB (CUDA runs only)."


def flag(name: str, help: str):
    """A boolean option that takes no value: its help shows no `<bool>` type."""
    return typer.Option(False, name, help=help, metavar="")


def parse_placement(offload: str, gpu_memory: Optional[str]) -> dict:
    """--offload and --gpu-memory, checked, as generate's keyword arguments."""
    from ..bench.suite import parse_size
    from ..config import OFFLOAD_MODES

    if offload not in OFFLOAD_MODES:
        raise UsageError(f"--offload must be one of {', '.join(OFFLOAD_MODES)}, got {offload!r}")
    return {"offload": offload, "gpu_memory": None if gpu_memory is None else parse_size(gpu_memory)}


THREADS_HELP = ("CPU threads for torch. 0 (the default): all cores on a quiet machine, the cores other "
                "processes leave free on a busy one, followed while decoding. TFORCE_THREADS=N: as --threads N.")


def set_threads(n: int) -> None:
    if n < 0:
        raise UsageError(f"--threads must be >= 0, got {n}")
    from ..threads import choose

    choose(n)


def gpu_memory_note(gpu_memory: Optional[str], device: str) -> None:
    if gpu_memory is not None and device != "cuda":
        say(f"tforce: note: --gpu-memory has no effect on a {device} run (it caps GPU memory)")


def decode_text(data: bytes, source: str) -> str:
    """Prompt bytes -> text, the same for a file and for stdin: NUL bytes mean a binary file (refused,
    exit 2); text that is not UTF-8 (Latin-1, say) is decoded with U+FFFD for each undecodable byte and
    one warning line on stderr."""
    if b"\0" in data:
        raise UsageError(f"{source} is not text (it holds NUL bytes): tforce reads UTF-8 text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        say(f"tforce: warning: {source} is not valid UTF-8 (first bad byte at offset {e.start}): "
             "undecodable bytes are replaced with U+FFFD")
        return data.decode("utf-8", errors="replace")


def as_role(role: str, fn, *args, **kwargs):
    """fn(*args, **kwargs), its errors prefixed with `role` ("target model", "draft model")."""
    try:
        return fn(*args, **kwargs)
    except TforceError as e:
        raise type(e)(f"{role}: {e}") from e


def _host_available() -> int:
    import psutil

    return psutil.virtual_memory().available


def check_memory(target_config, draft_config, tokens: int, dtype_bytes: int, device: str, run,
                  method: Optional[str] = None, rows: int = 1) -> None:
    """Refuse, before any weights are built or read, a run that cannot fit in memory: `run` (config.RunConfig,
    the user's options: its method unless `method` is given, budgets, gammas, prefill chunk, offload and
    --gpu-memory), planned as the session will plan it (tforce.bench.suite.info_plan, itemised in placement.py:
    a retrieval cache only for triforce and retrieval, a draft only for the methods that use one): on the
    CPU every item lives in host memory; on CUDA the device items must fit its free memory (or --gpu-memory)
    and the offloaded KV layers the available host memory. rows: sequences of `tokens` tokens decoded
    together (a batch). A refusal is errors.DoesNotFit."""
    import dataclasses
    from ..bench.suite import info_plan
    from ..engine.placement import CONTEXT_BYTES, GiB

    def gib(n: int) -> str:
        return f"{n / GiB:.1f} GiB"

    host_free = _host_available()
    cuda = device == "cuda"
    gpu_free = None
    if cuda:  # untested on CUDA
        import torch

        gpu_free = torch.cuda.mem_get_info()[0] + CONTEXT_BYTES  # the context already holds its share
        gpu_memory = run.execution.gpu_memory
        gpu_free = gpu_free if gpu_memory is None else min(gpu_free, gpu_memory)
    spec = dataclasses.replace(run.speculation, method=method or run.method)
    plan = info_plan(target_config, tokens, dtype_bytes, gpu_free, host_free, run.execution.offload,
                     draft_config=draft_config, context_bytes=CONTEXT_BYTES if cuda else 0,
                     attention="sdpa" if cuda else "math", rows=rows, spec=spec,
                     prefill_chunk=run.execution.prefill_chunk)
    if "error" in plan:
        raise DoesNotFit(plan["error"])
    if not cuda:
        need = plan["peak_bytes"] + plan["host_kv_bytes"]
        if need > host_free:
            batch = f"{rows} x {tokens}" if rows > 1 else f"{tokens}"
            raise DoesNotFit(f"not enough memory: {gib(need)} needed (target weights {gib(plan['weights_bytes'])}, "
                              f"KV cache for {batch} tokens {gib(plan['kv_bytes'])}, the rest in `tforce info`'s "
                              f"plan), {gib(host_free)} available")
    elif not plan["host_fits"]:
        raise DoesNotFit(f"not enough host memory for the offloaded KV cache: {gib(plan['host_kv_bytes'])} "
                          f"needed, {gib(host_free)} available")


def debug_on() -> bool:
    return os.environ.get("TFORCE_DEBUG", "") not in ("", "0")


def guarded(body) -> None:
    """Run body(); turn failures into one stderr line and an exit code (no traceback unless TFORCE_DEBUG)."""
    try:
        body()
    except typer.Exit:
        raise
    except TforceError as e:
        if debug_on():
            raise
        say(f"tforce: error: {e}")
        raise typer.Exit(e.exit_code)
    except KeyboardInterrupt:
        if debug_on():
            raise
        say("tforce: interrupted")
        raise typer.Exit(130)
    except BrokenPipeError:  # the reader went away (`tforce run ... | head`): stop quietly
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        raise typer.Exit(1)
    except Exception as e:  # a bug or an environment failure: still one line, the traceback on request
        if debug_on():
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        say(f"tforce: error: {type(e).__name__}: {msg} (TFORCE_DEBUG=1 shows the traceback)")
        raise typer.Exit(1)


def say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def pick_device(device: str) -> str:
    import torch

    if device not in DEVICES:
        raise UsageError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA GPU is available to torch")
    return device
