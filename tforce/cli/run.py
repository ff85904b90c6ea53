"""`tforce run`: a prompt in, the target's exact continuation streamed out."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from ..config import Sampling, Speculation
from ..demo import demo_pair, demo_prompt
from ..errors import UsageError
from .app import app
from .common import (DTYPES, GPU_MEMORY_HELP, OFFLOAD_HELP, THREADS_HELP, _as_role, _check_memory, _decode_text,
                     _device, _gpu_memory_note, _guarded, _placement_options, _say, _threads, flag)
from .batch_run import check_options, read_batch, run_batch
from .live import Progress, TextStream, _summary_line


def _read_prompt(prompt_file: Optional[str], prompt: Optional[str], default: Optional[str] = None) -> str:
    """The document (a file, `-` for stdin, or piped stdin) followed by --prompt, joined by a blank line.

    With nothing given (no file, no --prompt, nothing on stdin), `default` (the demo's excerpt) if there
    is one; a prompt or file that was given but is empty is a usage error, never replaced."""
    document = ""
    if prompt_file == "-" or (prompt_file is None and not sys.stdin.isatty()):
        try:
            data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
        except (OSError, ValueError):
            data = b""
        document = _decode_text(data, "stdin")
    elif prompt_file is not None:
        path = Path(prompt_file).expanduser()
        try:
            data = path.read_bytes()
        except OSError as e:
            hint = " (--json and --ignore-eos are flags: they take no value)" \
                if prompt_file.lower() in ("true", "false", "yes", "no", "on", "off", "1", "0") else ""
            raise UsageError(f"cannot read prompt file {prompt_file}: {e.strerror or e}{hint}") from e
        document = _decode_text(data, f"prompt file {prompt_file}")
    parts = [p for p in (document, prompt or "") if p.strip()]
    if not parts and default is not None and prompt is None and prompt_file is None:
        _say("tforce: no prompt given: using the demo's excerpt (Great Expectations, chapter 1) and a question")
        return default
    if not parts:
        raise UsageError("the prompt is empty: give a prompt file, --prompt TEXT or text on stdin")
    return "\n\n".join(parts)


def _check_local(name: str, role: str) -> None:
    """A local folder or an unknown name is checked here, its error naming the role ("target model",
    "draft model"), before anything else; registry names and hub ids are fetched when loaded."""
    from ..weights import REGISTRY, resolve

    hub = name in REGISTRY or (name.count("/") == 1 and not name.startswith((".", "/", "~")))
    if Path(name).expanduser().exists() or not hub:
        _as_role(role, resolve, name)


def _default_draft(model: str) -> Optional[str]:
    """The registry's draft for a short name; for a folder `X-target`, a sibling `X-draft` if present."""
    from ..weights import REGISTRY

    if model in REGISTRY:
        return REGISTRY[model][1]
    path = Path(model).expanduser()
    if path.is_dir() and path.name.endswith("-target"):
        sibling = path.with_name(path.name[: -len("-target")] + "-draft")
        if (sibling / "config.json").is_file():
            return str(sibling)
    return None


@app.command()
def run(
    prompt_file_arg: Optional[str] = typer.Argument(None, metavar="[PROMPT_FILE]",
                                                    help="Document to read ('-' = stdin)."),
    prompt_file: Optional[str] = typer.Option(None, "--prompt-file", "-f", help="Document to read ('-' = stdin)."),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="Text placed after the document."),
    model: Optional[str] = typer.Option(None, "--model", "-m",
                                        help="Target: a folder, hub id or short name (default: the demo pair)."),
    draft: Optional[str] = typer.Option(None, "--draft", help="Small draft model (default: the registry's)."),
    method: str = typer.Option("triforce", "--method", help="triforce | ar | retrieval | streaming | naive"),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n", help="Most tokens to generate."),
    temperature: float = typer.Option(0.6, "--temperature", "-t", help="0 = greedy."),
    top_p: float = typer.Option(0.9, "--top-p", help="Nucleus sampling, in (0, 1]."),
    top_k: int = typer.Option(0, "--top-k", help="0 = off."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed."),
    ignore_eos: bool = flag("--ignore-eos", "Keep going past end-of-sequence."),
    budget: int = typer.Option(4096, "--budget", help="Retrieval (or streaming) cache of the middle level."),
    chunk_size: int = typer.Option(8, "--chunk-size", help="Retrieval chunk size."),
    gamma1: int = typer.Option(2, "--gamma1", help="Draft tokens per middle-level verification."),
    gamma2: int = typer.Option(6, "--gamma2", help="Tokens per full-cache verification."),
    draft_budget: int = typer.Option(256, "--draft-budget", help="StreamingLLM cache of the small draft."),
    sinks: int = typer.Option(16, "--sinks", help="Attention-sink tokens of streaming caches."),
    rebuild_every: int = typer.Option(128, "--rebuild-every", help="Rebuild the retrieval cache every N tokens."),
    rebuild_below: float = typer.Option(0.3, "--rebuild-below", help="... or when acceptance falls below this."),
    policy: str = typer.Option("retrieval", "--policy",
                               help="Middle cache's selection: retrieval, shared, topk, streaming, h2o."),
    deterministic: bool = flag("--deterministic", "Verify row by row, each logit bit for bit what one-token "
                                                   "decoding computes: greedy output equals --method ar's in any "
                                                   "dtype (costs weight reads per verification)."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda"),
    threads: int = typer.Option(0, "--threads", help=THREADS_HELP),
    dtype: str = typer.Option("auto", "--dtype", help="auto | float32 | float16 | bfloat16"),
    offload: str = typer.Option("auto", "--offload", help=OFFLOAD_HELP),
    gpu_memory: Optional[str] = typer.Option(None, "--gpu-memory", help=GPU_MEMORY_HELP),
    as_json: bool = flag("--json", "Print one JSON object instead of streaming text."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel ranks (processes); with --device cpu they use gloo."),
    gpus: Optional[int] = typer.Option(None, "--gpus", help="Split the target over N GPUs (--tp N --device cuda)."),
    batch: Optional[str] = typer.Option(None, "--batch", help="JSON-lines file of prompts ('-' = stdin), one "
                                        "{\"prompt\" and/or \"file\", \"id\", \"max_new_tokens\"} a line, run as "
                                        "one batch; "
                                        "one JSON line out per prompt (--method ar or naive)."),
) -> None:
    """Generate text after a (long) prompt, streaming it to stdout."""
    def body():
        if prompt_file_arg is not None and prompt_file is not None and prompt_file_arg != prompt_file:
            raise UsageError("give the prompt file once: as an argument or with --prompt-file")
        spec = Speculation(method=method, gamma1=gamma1, gamma2=gamma2, budget=budget, chunk_size=chunk_size,
                           draft_budget=draft_budget, sinks=sinks, rebuild_every=rebuild_every,
                           rebuild_below=rebuild_below, policy=policy)
        spec.validate()
        Sampling(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed).validate()
        if max_new_tokens < 0:
            raise UsageError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
        if dtype not in DTYPES:
            raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        placement_options = _placement_options(offload, gpu_memory)
        _threads(threads)
        world, dev = _parallel(tp, gpus, device)
        if batch is not None:
            check_options(method, world, prompt_file_arg is not None or prompt_file is not None or prompt is not None,
                          deterministic)
        target_name = model
        if model is None:
            target_name, demo_draft = demo_pair()
        else:  # the target first: a missing target folder is not a missing draft
            _check_local(model, "target model")
        if draft is not None and spec.uses_draft:
            _check_local(draft, "draft model")
        draft_name = draft if draft is not None else _default_draft(target_name)
        if spec.uses_draft and draft_name is None:
            raise UsageError(f"method {method!r} needs a draft model: pass --draft, or use --method retrieval or ar")
        if batch is not None:
            return run_batch(read_batch(batch), target_name, draft_name if spec.uses_draft else None, dev,
                             None if dtype == "auto" else dtype, dict(
                                 method=method, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                 top_k=top_k, seed=seed, ignore_eos=ignore_eos, gamma2=gamma2, sinks=sinks,
                                 draft_budget=draft_budget, budget=budget, **placement_options))
        # the prompt before any notice, so that a bad prompt is the only line
        text = _read_prompt(prompt_file if prompt_file is not None else prompt_file_arg, prompt,
                            demo_prompt() if model is None else None)
        _gpu_memory_note(gpu_memory, dev)
        if model is None:
            _say(f"tforce: no --model given: using the trained demo pair {target_name} (draft: {draft or demo_draft}; "
                 "small models trained by scripts/train_demo.py, see models/README.md)")
        _run(text, target_name, draft_name if spec.uses_draft else None, dev, None if dtype == "auto" else dtype,
             as_json, dict(method=method, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                           top_k=top_k, seed=seed, ignore_eos=ignore_eos, budget=budget, chunk_size=chunk_size,
                           gamma1=gamma1, gamma2=gamma2, draft_budget=draft_budget, sinks=sinks,
                           rebuild_every=rebuild_every, rebuild_below=rebuild_below, policy=policy,
                           deterministic=deterministic, **placement_options),
             world)

    _guarded(body)


def _parallel(tp: int, gpus: Optional[int], device: str) -> tuple[int, str]:
    """--tp / --gpus / --device -> (ranks, device), checked against the GPUs torch sees."""
    import torch

    if tp < 1:
        raise UsageError(f"--tp must be >= 1, got {tp}")
    world = tp
    if gpus is not None:
        if gpus < 1:
            raise UsageError(f"--gpus must be >= 1, got {gpus}")
        if device not in ("auto", "cuda"):
            raise UsageError(f"--gpus runs on CUDA, not --device {device} (for CPU ranks use --tp N --device cpu)")
        if tp not in (1, gpus):
            raise UsageError(f"--gpus {gpus} and --tp {tp} disagree: give one of them")
        world, device = gpus, "cuda"
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    dev = "cuda" if device == "cuda" and world > 1 else _device(device)
    if dev == "cuda" and world > count:
        raise UsageError(f"{world} ranks on CUDA need {world} GPUs; torch sees {count} "
                         f"(--tp {world} --device cpu runs them on the CPU)")
    return world, dev


def _read_config(name: str, role: str):
    """(folder, config) of a model without reading its weights; errors name the role."""
    from transformers import AutoConfig

    from ..weights import resolve

    path = _as_role(role, resolve, name)
    try:
        return path, AutoConfig.from_pretrained(path)
    except Exception as e:
        reason = (str(e).strip().splitlines() or [""])[0]
        raise UsageError(f"{role}: cannot read {path / 'config.json'}: {reason}") from e


def _tp_target(model: str, world: int):
    """(folder, config, tokenizer) of the target without loading weights; split over world > 1 ranks,
    the heads must split."""
    from ..parallel import check_tp
    from ..weights import _load_tokenizer

    path, config = _read_config(model, "target model")
    if world > 1:
        check_tp(config, world)
    return path, config, _load_tokenizer(path)


def _dtype_bytes(dtype: Optional[str], device: str) -> int:
    import torch

    return torch.empty((), dtype=getattr(torch, dtype or ("bfloat16" if device == "cuda" else "float32"))).element_size()


def _run(text: str, model: str, draft: Optional[str], device: str, dtype: Optional[str], as_json: bool,
         options: dict, world: int = 1) -> None:
    from ..engine import generate
    from ..weights import load_model, resolve

    path, config, tok = _tp_target(model, world)  # no weights yet: the prompt and memory are checked first
    if tok is None:
        raise UsageError(f"{path} has no tokenizer: tforce needs the target's tokenizer files")
    ids = list(tok.encode(text))
    context = config.max_position_embeddings
    if len(ids) >= context:
        raise UsageError(f"the prompt is {len(ids)} tokens; the model's context is {context}")
    max_new = min(options["max_new_tokens"], context - len(ids))
    if max_new < options["max_new_tokens"]:
        _say(f"tforce: note: the model's context ({context} tokens) leaves room for {max_new} new tokens after "
             f"the {len(ids)}-token prompt, not the {options['max_new_tokens']} asked for")
    if world == 1:  # split runs: the workers load the weights
        draft_config = _read_config(draft, "draft model")[1] if draft else None
        _check_memory(config, draft_config, len(ids) + max_new, _dtype_bytes(dtype, device), device,
                      options["offload"], options["gpu_memory"], options["budget"], options["method"])
        target = _as_role("target model", load_model, model, device=device, dtype=dtype, tokenizer=False)
    small = _as_role("draft model", load_model, draft, device=device, dtype=dtype, tokenizer=False) \
        if draft and world == 1 else None
    stream = TextStream(tok, sys.stdout, enabled=not as_json)
    progress = Progress(max_new, options["method"], stream, shared=sys.stdout.isatty() and _shared_with_stderr()) \
        if sys.stderr.isatty() and not as_json else None
    callbacks = dict(on_token=stream.add, on_prefill=progress.on_prefill if progress else None,
                     on_round=progress.on_round if progress else None, on_plan=progress.on_plan if progress else None)
    try:
        if world > 1:
            from ..parallel import generate_tp

            result = generate_tp(str(path), str(resolve(draft)) if draft else None, ids, world, device, dtype,
                                 **callbacks, **options)
        else:
            result = generate(target.model, ids, draft=small.model if small else None, **callbacks, **options)
        out = stream.finish()
    except BaseException:  # end the live view and keep the text written so far (Ctrl-C, errors)
        if progress:
            progress.close()
        _end_line(stream.printed)
        raise
    if as_json:
        record = {"text": out, "tokens": result.tokens, "prompt_tokens": len(ids), "method": options["method"],
                  "device": device, "stats": result.stats}
        sys.stdout.write(json.dumps(record) + "\n")
        sys.stdout.flush()
        return
    _end_line(out)
    if progress:
        progress.finish(result.stats)
    else:
        _say(_summary_line(len(result.tokens), len(ids), options["method"], result.stats))


def _end_line(text: str) -> None:
    """On a terminal, or a file or pipe shared with stderr, end the text's line so that what stderr writes
    next (the summary, an interruption notice) starts a line of its own."""
    if (sys.stdout.isatty() or _shared_with_stderr()) and text and not text.endswith("\n"):
        sys.stdout.write("\n")
        sys.stdout.flush()


def _shared_with_stderr() -> bool:
    """stdout and stderr write to the same file or pipe (`2>&1`): end the text's line before the
    summary, as on a terminal. A file or pipe of its own gets the text exactly as generated."""
    try:
        a, b = os.fstat(sys.stdout.fileno()), os.fstat(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):  # captured streams without a descriptor
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


# --------------------------------------------------------------------------------------------- info
