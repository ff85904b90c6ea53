"""What every command shares: option vocabularies, one-line errors, the device choice.

Discipline (DESIGN.md habit 10): data and --json go to stdout, nothing else does; progress and
diagnostics go to stderr; bad input is one line `tforce: error: ...` with exit 2 (usage) or 1 (runtime);
Ctrl-C exits 130; TFORCE_DEBUG=1 re-raises to show the traceback. Configuration is validated before any
model is loaded.
"""
from __future__ import annotations

import os
import sys
from typing import Optional

import typer

from ..errors import TforceError, UsageError

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "float16", "bfloat16")
OFFLOAD_HELP = "Full KV cache: auto (GPU while it fits, rest in pinned host memory) | on (all host) | off."
GPU_MEMORY_HELP = "Most GPU memory tforce may use, e.g. 24GiB, 24GB, 24000MiB."


def _placement_options(offload: str, gpu_memory: Optional[str]) -> dict:
    """--offload and --gpu-memory, checked, as generate's keyword arguments."""
    from ..bench import parse_size
    from ..placement import OFFLOAD_MODES

    if offload not in OFFLOAD_MODES:
        raise UsageError(f"--offload must be one of {', '.join(OFFLOAD_MODES)}, got {offload!r}")
    return {"offload": offload, "gpu_memory": None if gpu_memory is None else parse_size(gpu_memory)}


THREADS_HELP = ("CPU threads for torch (0 = torch's default). Small models on a busy machine run faster "
                "with 1: multi-threaded small matrix products spin against other processes.")


def _threads(n: int) -> None:
    if n < 0:
        raise UsageError(f"--threads must be >= 0, got {n}")
    if n:
        import torch

        torch.set_num_threads(n)


def _debug() -> bool:
    return os.environ.get("TFORCE_DEBUG", "") not in ("", "0")


def _guarded(body) -> None:
    """Run body(); turn failures into one stderr line and an exit code (no traceback unless TFORCE_DEBUG)."""
    try:
        body()
    except typer.Exit:
        raise
    except TforceError as e:
        if _debug():
            raise
        _say(f"tforce: error: {e}")
        raise typer.Exit(e.exit_code)
    except KeyboardInterrupt:
        if _debug():
            raise
        _say("tforce: interrupted")
        raise typer.Exit(130)
    except BrokenPipeError:  # the reader went away (`tforce run ... | head`): stop quietly
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        raise typer.Exit(1)
    except Exception as e:  # a bug or an environment failure: still one line, the traceback on request
        if _debug():
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        _say(f"tforce: error: {type(e).__name__}: {msg} (TFORCE_DEBUG=1 shows the traceback)")
        raise typer.Exit(1)


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _device(device: str) -> str:
    import torch

    if device not in DEVICES:
        raise UsageError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA GPU is available to torch")
    return device
