"""The `tforce` command line: `run` and `info`.

Discipline (DESIGN.md habit 10): generated text and --json go to stdout, nothing else does; progress and
diagnostics go to stderr; bad input is one line `tforce: error: ...` with exit 2 (usage) or 1 (runtime);
Ctrl-C exits 130; TFORCE_DEBUG=1 re-raises to show the traceback. Configuration is validated before any
model is loaded.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from .config import Sampling, Speculation
from .errors import TforceError, UsageError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Lossless hierarchical speculative decoding (TriForce) for long-context Llama models.")

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "float16", "bfloat16")
OFFLOAD_HELP = "Full KV cache: auto (GPU while it fits, rest in pinned host memory) | on (all host) | off."
GPU_MEMORY_HELP = "Most GPU memory tforce may use, e.g. 24GiB, 24GB, 24000MiB."


def _placement_options(offload: str, gpu_memory: Optional[str]) -> dict:
    """--offload and --gpu-memory, checked, as generate's keyword arguments."""
    from .bench import parse_size
    from .placement import OFFLOAD_MODES

    if offload not in OFFLOAD_MODES:
        raise UsageError(f"--offload must be one of {', '.join(OFFLOAD_MODES)}, got {offload!r}")
    return {"offload": offload, "gpu_memory": None if gpu_memory is None else parse_size(gpu_memory)}


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


# ---------------------------------------------------------------------------------------------- run


def _read_prompt(prompt_file: Optional[str], prompt: Optional[str]) -> str:
    """The document (a file, `-` for stdin, or piped stdin) followed by --prompt, joined by a blank line."""
    document = ""
    if prompt_file == "-" or (prompt_file is None and not sys.stdin.isatty()):
        try:
            document = sys.stdin.read()
        except (OSError, ValueError):
            document = ""
    elif prompt_file is not None:
        path = Path(prompt_file).expanduser()
        try:
            document = path.read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise UsageError(f"cannot read prompt file {prompt_file}: {e.strerror or e}") from e
    parts = [p for p in (document, prompt or "") if p.strip()]
    if not parts:
        raise UsageError("the prompt is empty: give a prompt file, --prompt TEXT or text on stdin")
    return "\n\n".join(parts)


def _default_draft(model: str) -> Optional[str]:
    """The registry's draft for a short name; for a folder `X-target`, a sibling `X-draft` if present."""
    from .weights import REGISTRY

    if model in REGISTRY:
        return REGISTRY[model][1]
    path = Path(model).expanduser()
    if path.is_dir() and path.name.endswith("-target"):
        sibling = path.with_name(path.name[: -len("-target")] + "-draft")
        if (sibling / "config.json").is_file():
            return str(sibling)
    return None


def _device(device: str) -> str:
    import torch

    if device not in DEVICES:
        raise UsageError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA GPU is available to torch")
    return device


class TextStream:
    """Decodes the whole generated id list after each accepted batch and writes only the new suffix."""

    def __init__(self, tokenizer, out, enabled: bool = True):
        self.tokenizer, self.out, self.enabled = tokenizer, out, enabled
        self.ids: list[int] = []
        self.printed = ""

    def text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def add(self, tokens: list[int]) -> None:
        self.ids += list(tokens)
        if self.enabled:
            text = self.text()
            self._emit(text[:-1] if text.endswith("\ufffd") else text)  # hold back a partial character

    def finish(self) -> str:
        text = self.text()
        if self.enabled:
            self._emit(text)
        return text

    def _emit(self, text: str) -> None:
        # If decoding revised earlier text (rare), what is written cannot be unwritten: go on past it.
        new = text[len(self.printed):]
        if new:
            self.out.write(new)
            self.out.flush()
            self.printed = text


class Progress:
    """A rich Live panel on stderr (terminals only): prefill progress, tokens, speed, acceptance."""

    def __init__(self, max_new: int, method: str, keep_live: bool):
        from rich.console import Console
        from rich.live import Live

        self.console = Console(stderr=True)
        self.max_new, self.method, self.keep_live = max_new, method, keep_live
        self.prefill = (0, 0)
        self.tokens = self.rounds = 0
        self.t_decode: float | None = None
        self.stats: dict | None = None
        self.live = Live(self._panel(), console=self.console, refresh_per_second=8, transient=not keep_live,
                         redirect_stdout=False, redirect_stderr=False)
        self.live.start()

    def on_prefill(self, done: int, total: int) -> None:
        self.prefill = (done, total)
        self._update()

    def on_token(self, tokens: list[int]) -> None:
        if self.t_decode is None:
            self.t_decode = time.perf_counter()
            if not self.keep_live:  # stdout is this terminal too: let the text stream undisturbed
                self.live.stop()
        self.tokens += len(tokens)
        self.rounds += 1
        self._update()

    def finish(self, stats: dict) -> None:
        self.stats = stats
        if self.keep_live:
            self.live.update(self._panel(), refresh=True)
            self.live.stop()
        else:  # the live panel was transient: print the final one
            self.live.stop()
            self.console.print(self._panel())

    def _update(self) -> None:
        if self.live.is_started:
            self.live.update(self._panel())

    def _panel(self):
        from rich.panel import Panel
        from rich.table import Table

        t = Table.grid(padding=(0, 2))
        t.add_column(style="bold")
        t.add_column()
        done, total = self.prefill
        t.add_row("prefill", f"{done}/{total} tokens" if total else "...")
        t.add_row("generated", f"{self.tokens}/{self.max_new} tokens")
        s = self.stats
        if s is None and self.t_decode is not None and self.tokens:
            elapsed = time.perf_counter() - self.t_decode
            s = {"ms_per_token": 1000 * elapsed / self.tokens, "tokens_per_s": self.tokens / elapsed if elapsed else None,
                 "acceptance": {}, "tokens_per_verification": None}
        if s is not None:
            if s.get("ms_per_token") is not None:
                t.add_row("speed", f"{s['ms_per_token'] / 1000:.4f} s/token, {s['tokens_per_s']:.1f} tokens/s")
            for level, rate in (s.get("acceptance") or {}).items():
                if rate is not None:
                    t.add_row(f"accept {level}", f"{rate:.1%}")
            tpv = s.get("tokens_per_verification")
            if tpv is None and self.rounds:
                tpv = self.tokens / self.rounds
            if tpv is not None:
                t.add_row("tokens/verify", f"{tpv:.2f}")
        return Panel(t, title=f"tforce {self.method}", expand=False)


def _summary_line(n: int, n_prompt: int, method: str, stats: dict) -> str:
    def f(x, fmt):
        return "n/a" if x is None else format(x, fmt)

    acc = ", ".join(f"{k} {f(v, '.1%')}" for k, v in stats["acceptance"].items() if v is not None)
    return (f"tforce: {method}: {n} tokens after {n_prompt} prompt tokens; prefill {stats['prefill_s']:.2f} s; "
            f"decode {stats['decode_s']:.2f} s ({f(stats['ms_per_token'], '.1f')} ms/token, "
            f"{f(stats['tokens_per_s'], '.1f')} tokens/s); "
            f"{f(stats['tokens_per_verification'], '.2f')} tokens/verification"
            + (f"; acceptance: {acc}" if acc else ""))


@app.command()
def run(
    prompt_file_arg: Optional[str] = typer.Argument(None, metavar="[PROMPT_FILE]",
                                                    help="Document to read ('-' = stdin)."),
    prompt_file: Optional[str] = typer.Option(None, "--prompt-file", "-f", help="Document to read ('-' = stdin)."),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="Text placed after the document."),
    model: str = typer.Option(..., "--model", "-m", help="Target: a folder, hub id or short name."),
    draft: Optional[str] = typer.Option(None, "--draft", help="Small draft model (default: the registry's)."),
    method: str = typer.Option("triforce", "--method", help="triforce | ar | retrieval | streaming | naive"),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n", help="Most tokens to generate."),
    temperature: float = typer.Option(0.6, "--temperature", "-t", help="0 = greedy."),
    top_p: float = typer.Option(0.9, "--top-p", help="Nucleus sampling, in (0, 1]."),
    top_k: int = typer.Option(0, "--top-k", help="0 = off."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Keep going past end-of-sequence."),
    budget: int = typer.Option(4096, "--budget", help="Retrieval (or streaming) cache of the middle level."),
    chunk_size: int = typer.Option(8, "--chunk-size", help="Retrieval chunk size."),
    gamma1: int = typer.Option(2, "--gamma1", help="Draft tokens per middle-level verification."),
    gamma2: int = typer.Option(6, "--gamma2", help="Tokens per full-cache verification."),
    draft_budget: int = typer.Option(256, "--draft-budget", help="StreamingLLM cache of the small draft."),
    sinks: int = typer.Option(16, "--sinks", help="Attention-sink tokens of streaming caches."),
    rebuild_every: int = typer.Option(128, "--rebuild-every", help="Rebuild the retrieval cache every N tokens."),
    rebuild_below: float = typer.Option(0.3, "--rebuild-below", help="... or when acceptance falls below this."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda"),
    dtype: str = typer.Option("auto", "--dtype", help="auto | float32 | float16 | bfloat16"),
    offload: str = typer.Option("auto", "--offload", help=OFFLOAD_HELP),
    gpu_memory: Optional[str] = typer.Option(None, "--gpu-memory", help=GPU_MEMORY_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel ranks (processes); with --device cpu they use gloo."),
    gpus: Optional[int] = typer.Option(None, "--gpus", help="Split the target over N GPUs (--tp N --device cuda)."),
) -> None:
    """Generate text after a (long) prompt, streaming it to stdout."""
    def body():
        if prompt_file_arg is not None and prompt_file is not None and prompt_file_arg != prompt_file:
            raise UsageError("give the prompt file once: as an argument or with --prompt-file")
        spec = Speculation(method=method, gamma1=gamma1, gamma2=gamma2, budget=budget, chunk_size=chunk_size,
                           draft_budget=draft_budget, sinks=sinks, rebuild_every=rebuild_every,
                           rebuild_below=rebuild_below)
        spec.validate()
        Sampling(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed).validate()
        if max_new_tokens < 0:
            raise UsageError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
        if dtype not in DTYPES:
            raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        placement_options = _placement_options(offload, gpu_memory)
        world, dev = _parallel(tp, gpus, device)
        draft_name = draft if draft is not None else _default_draft(model)
        if spec.uses_draft and draft_name is None:
            raise UsageError(f"method {method!r} needs a draft model: pass --draft, or use --method retrieval or ar")
        text = _read_prompt(prompt_file if prompt_file is not None else prompt_file_arg, prompt)
        _run(text, model, draft_name if spec.uses_draft else None, dev, None if dtype == "auto" else dtype,
             as_json, dict(method=method, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                           top_k=top_k, seed=seed, ignore_eos=ignore_eos, budget=budget, chunk_size=chunk_size,
                           gamma1=gamma1, gamma2=gamma2, draft_budget=draft_budget, sinks=sinks,
                           rebuild_every=rebuild_every, rebuild_below=rebuild_below, **placement_options),
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


def _tp_target(model: str, world: int):
    """For a split target: (folder, config, tokenizer) without loading weights; the heads must split."""
    from transformers import AutoConfig

    from .parallel import check_tp
    from .weights import _load_tokenizer, resolve

    path = resolve(model)
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:
        raise UsageError(f"cannot read {path / 'config.json'}: {(str(e).strip().splitlines() or [''])[0]}") from e
    check_tp(config, world)
    return path, config, _load_tokenizer(path)


def _run(text: str, model: str, draft: Optional[str], device: str, dtype: Optional[str], as_json: bool,
         options: dict, world: int = 1) -> None:
    from .engine import generate
    from .weights import load_model, resolve

    if world > 1:  # the workers load the weights: here only the config and tokenizer
        path, config, tok = _tp_target(model, world)
    else:
        target = load_model(model, device=device, dtype=dtype)
        path, config, tok = target.path, target.config, target.tokenizer
    if tok is None:
        raise UsageError(f"{path} has no tokenizer: tforce needs the target's tokenizer files")
    ids = list(tok.encode(text))
    context = config.max_position_embeddings
    if len(ids) >= context:
        raise UsageError(f"the prompt is {len(ids)} tokens; the model's context is {context}")
    small = load_model(draft, device=device, dtype=dtype, tokenizer=False) if draft and world == 1 else None
    max_new = min(options["max_new_tokens"], context - len(ids))
    stream = TextStream(tok, sys.stdout, enabled=not as_json)
    progress = Progress(max_new, options["method"], keep_live=not sys.stdout.isatty()) \
        if sys.stderr.isatty() and not as_json else None

    def on_token(tokens):
        stream.add(tokens)
        if progress:
            progress.on_token(tokens)

    on_prefill = progress.on_prefill if progress else None
    try:
        if world > 1:
            from .parallel import generate_tp

            result = generate_tp(str(path), str(resolve(draft)) if draft else None, ids, world, device, dtype,
                                 on_token=on_token, on_prefill=on_prefill, **options)
        else:
            result = generate(target.model, ids, draft=small.model if small else None, on_token=on_token,
                              on_prefill=on_prefill, **options)
    except BaseException:
        if progress:
            progress.live.stop()
        raise
    out = stream.finish()
    if as_json:
        record = {"text": out, "tokens": result.tokens, "prompt_tokens": len(ids), "method": options["method"],
                  "stats": result.stats}
        sys.stdout.write(json.dumps(record) + "\n")
        sys.stdout.flush()
        return
    if sys.stdout.isatty() and out and not out.endswith("\n"):
        sys.stdout.write("\n")
        sys.stdout.flush()
    if progress:
        progress.finish(result.stats)
    else:
        _say(_summary_line(len(result.tokens), len(ids), options["method"], result.stats))


# --------------------------------------------------------------------------------------------- info


def _arch(config, context: int, dtype: str) -> dict:
    import torch

    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    elem = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * elem  # keys and values, every layer
    return {
        "model_type": config.model_type,
        "layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": config.vocab_size,
        "context": config.max_position_embeddings,
        "rope_type": rope_type,
        "rope_theta": rope.get("rope_theta", getattr(config, "rope_theta", None)),
        "synthetic": bool(getattr(config, "tforce_synthetic", False)),
        "kv_dtype": dtype,
        "kv_bytes_per_token": per_token,
        "kv_context": context,
        "kv_bytes_for_context": per_token * context,
    }


def _info_plan(config, context: int, dtype: str, budget: int, host_free: int, offload: str,
               gpu_memory: Optional[int]) -> dict:
    import torch

    from .bench import device_bandwidth_gbps, h2d_peak_gbps, info_plan

    cuda = torch.cuda.is_available()
    gpu_free = torch.cuda.mem_get_info(0)[0] if cuda else None
    if gpu_memory is not None:
        gpu_free = gpu_memory if gpu_free is None else min(gpu_free, gpu_memory)
    elem = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    h2d, dev = (h2d_peak_gbps("cuda:0"), device_bandwidth_gbps("cuda:0")) if cuda else (None, None)
    return {"h2d_gbps": h2d, "device_gbps": dev, "offload": offload,
            **info_plan(config, context, elem, gpu_free, host_free, offload, budget, h2d, dev)}


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


@app.command()
def info(
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Also describe this model (config only)."),
    synthetic: Optional[str] = typer.Option(None, "--synthetic", help="... or this architecture (bench's "
                                                                       "--synthetic names)."),
    context: int = typer.Option(131072, "--context", help="Context length for the KV-cache size."),
    dtype: str = typer.Option("bfloat16", "--dtype", help="KV-cache dtype: float32 | float16 | bfloat16"),
    gpu_memory: Optional[str] = typer.Option(None, "--gpu-memory", help="GPU memory to plan for (default: "
                                                                         "the free memory of GPU 0)."),
    offload: str = typer.Option("auto", "--offload", help=OFFLOAD_HELP),
    budget: int = typer.Option(4096, "--budget", help="Retrieval cache size (resident beside the full cache)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Versions, devices, host memory, measured H2D bandwidth and (with --model or --synthetic) the model's
    shape, KV-cache size, placement plan and the s/token floor of plain offloaded decoding."""
    def body():
        import platform

        import psutil
        import torch
        import transformers

        from . import __version__

        if context <= 0:
            raise UsageError(f"--context must be positive, got {context}")
        if dtype not in DTYPES[1:]:
            raise UsageError(f"--dtype must be one of {', '.join(DTYPES[1:])}, got {dtype!r}")
        if model is not None and synthetic is not None:
            raise UsageError("give --model or --synthetic, not both")
        placement_options = _placement_options(offload, gpu_memory)
        gpus = [{"name": torch.cuda.get_device_name(i),
                 "memory_bytes": torch.cuda.get_device_properties(i).total_memory}
                for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
        mem = psutil.virtual_memory()
        record = {"tforce": __version__, "python": platform.python_version(), "torch": torch.__version__,
                  "transformers": transformers.__version__, "cpu_cores": os.cpu_count(), "cuda_devices": gpus,
                  "host_memory_bytes": mem.total, "host_memory_available_bytes": mem.available}
        if model is not None:
            from transformers import AutoConfig

            from .weights import resolve

            path = resolve(model)
            try:
                config = AutoConfig.from_pretrained(path)
            except Exception as e:
                raise UsageError(f"cannot read {path / 'config.json'}: {e}") from e
            record["model"] = {"name": model, "path": str(path), **_arch(config, context, dtype)}
        if synthetic is not None:
            from .synthetic import ARCHITECTURES, make_config

            if synthetic not in ARCHITECTURES:
                raise UsageError(f"--synthetic must be one of {', '.join(ARCHITECTURES)}, got {synthetic!r}")
            config = make_config(synthetic)
            record["model"] = {"name": f"synthetic:{synthetic}", "path": None, **_arch(config, context, dtype)}
        if "model" in record:
            record["plan"] = _info_plan(config, context, dtype, budget, mem.available, **placement_options)
        if as_json:
            sys.stdout.write(json.dumps(record) + "\n")
            return
        _print_info(record)

    _guarded(body)


def _print_info(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    t.add_row("tforce", r["tforce"])
    t.add_row("python / torch / transformers", f"{r['python']} / {r['torch']} / {r['transformers']}")
    t.add_row("cpu cores", str(r["cpu_cores"]))
    gpus = ", ".join(f"{g['name']} ({_gib(g['memory_bytes'])})" for g in r["cuda_devices"]) or "none"
    t.add_row("cuda devices", gpus)
    t.add_row("host memory", f"{_gib(r['host_memory_bytes'])} ({_gib(r['host_memory_available_bytes'])} available)")
    m = r.get("model")
    if m:
        where = f" ({m['path']})" if m["path"] else ""
        t.add_row("model", f"{m['name']}{where}" + ("  [RANDOM WEIGHTS]" if m["synthetic"] else ""))
        t.add_row("architecture", f"{m['model_type']}: {m['layers']} layers, hidden {m['hidden_size']}, "
                                  f"{m['heads']} heads, {m['kv_heads']} kv heads, head dim {m['head_dim']}")
        t.add_row("context / rope", f"{m['context']} tokens, rope {m['rope_type']} (theta {m['rope_theta']})")
        t.add_row("kv cache", f"{m['kv_bytes_per_token']} bytes/token ({m['kv_dtype']}); "
                              f"{_gib(m['kv_bytes_for_context'])} for {m['kv_context']} tokens")
    p = r.get("plan")
    if p:
        _plan_rows(t, p)
    Console().print(t)


def _plan_rows(t, p: dict) -> None:
    def rate(x):
        return "unmeasured (no CUDA GPU)" if x is None else f"{x:.1f} GB/s"

    def secs(x):
        return "unmeasured" if x is None else f"{x:.4f} s/token"

    budget = "no GPU (plan for the CPU)" if p["gpu_budget_bytes"] is None else _gib(p["gpu_budget_bytes"])
    t.add_row("H2D (pinned) / device memory", f"{rate(p['h2d_gbps'])} / {rate(p['device_gbps'])}")
    t.add_row("placement budget", f"GPU {budget}; weights {_gib(p['weights_bytes'])}, resident besides the "
                                  f"full cache {_gib(p['fixed_gpu_bytes'])}; offload {p['offload']}")
    if "error" in p:
        t.add_row("placement plan", f"does not fit: {p['error']}")
        return
    host = "" if p["host_fits"] else f"  (host memory too small: {_gib(p['host_available_bytes'])} available)"
    t.add_row("placement plan", f"{p['describe']} of {_gib(p['kv_bytes'])} KV for {p['context']} tokens{host}")
    t.add_row("floor, plain offloaded decoding",
              f"{secs(p['floor_s_per_token'])} = KV over H2D {secs(p['floor_h2d_s_per_token'])} "
              f"+ weights and resident KV from device memory {secs(p['floor_device_s_per_token'])}")


# -------------------------------------------------------------------------------------------- bench


@app.command()
def bench(
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Target: a folder, hub id or short name."),
    draft: Optional[str] = typer.Option(None, "--draft", help="Small draft model (default: the registry's)."),
    synthetic: Optional[str] = typer.Option(None, "--synthetic",
                                            help="Random weights of an architecture: llama2-7b | llama2-13b | "
                                                 "llama3.1-8b | tiny (results are labelled synthetic)."),
    gpus: Optional[int] = typer.Option(None, "--gpus", help="Split the target over N GPUs (--tp N --device "
                                                             "cuda; needs --model)."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel ranks (processes); with --device cpu they use gloo."),
    prompt_len: int = typer.Option(122880, "--prompt-len", help="Prompt tokens."),
    gen_len: int = typer.Option(256, "--gen-len", help="Tokens generated per method (EOS ignored)."),
    methods: str = typer.Option("ar,triforce,naive,retrieval,streaming", "--methods",
                                help="Comma-separated; ar runs first and is the speed-up baseline."),
    temperature: float = typer.Option(0.6, "--temperature", "-t", help="0 = greedy."),
    top_p: float = typer.Option(0.9, "--top-p", help="Nucleus sampling, in (0, 1]."),
    prompt_file: Optional[str] = typer.Option(None, "--prompt-file", "-f",
                                              help="A real text, tokenized and repeated/cut to --prompt-len "
                                                   "(default: random ids)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the weights, the prompt and sampling."),
    budget: int = typer.Option(4096, "--budget", help="Retrieval (or streaming) cache of the middle level."),
    chunk_size: int = typer.Option(8, "--chunk-size", help="Retrieval chunk size."),
    gamma1: int = typer.Option(2, "--gamma1", help="Draft tokens per middle-level verification."),
    gamma2: int = typer.Option(6, "--gamma2", help="Tokens per full-cache verification."),
    draft_budget: int = typer.Option(256, "--draft-budget", help="StreamingLLM cache of the small draft."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda"),
    dtype: str = typer.Option("auto", "--dtype", help="auto (bfloat16 on CUDA, float32 on CPU) | float32 | "
                                                      "float16 | bfloat16"),
    offload: str = typer.Option("auto", "--offload", help=OFFLOAD_HELP),
    gpu_memory: Optional[str] = typer.Option(None, "--gpu-memory", help=GPU_MEMORY_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Time every method on one prompt: ms/token, speed-up over ar, acceptance, H2D GB/s, memory."""
    def body():
        from . import bench as b

        if (model is None) == (synthetic is None):
            raise UsageError("give one of --model or --synthetic ARCH")
        if prompt_len < 1 or gen_len < 1:
            raise UsageError(f"--prompt-len and --gen-len must be >= 1, got {prompt_len} and {gen_len}")
        if dtype not in DTYPES:
            raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        names = b.parse_methods(methods)
        engine = dict(budget=budget, chunk_size=chunk_size, gamma1=gamma1, gamma2=gamma2, draft_budget=draft_budget)
        for m in names:
            Speculation(method=m, **engine).validate()
        Sampling(temperature=temperature, top_p=top_p, seed=seed).validate()
        cfg = b.BenchConfig(methods=names, prompt_len=prompt_len, gen_len=gen_len, temperature=temperature,
                            top_p=top_p, seed=seed, engine=engine, **_placement_options(offload, gpu_memory))
        text = None if prompt_file is None else _read_prompt(prompt_file, None)
        world, dev = _parallel(tp, gpus, device)
        if world > 1 and synthetic is not None:
            raise UsageError("--gpus/--tp > 1 needs --model (a checkpoint folder the ranks load); "
                             "--synthetic models are built in one process")
        record = _bench(b, cfg, model, draft, synthetic, dev, dtype, text, world)
        if as_json:
            sys.stdout.write(json.dumps(record) + "\n")
            sys.stdout.flush()
            return
        _print_bench(record)

    _guarded(body)


def _bench(b, cfg, model: Optional[str], draft: Optional[str], synthetic: Optional[str], device: str,
           dtype: str, text: Optional[str], world: int = 1) -> dict:
    import torch

    from .synthetic import ARCHITECTURES

    uses_draft = any(Speculation(method=m).uses_draft for m in cfg.methods)
    if synthetic is not None:
        if synthetic not in ARCHITECTURES:
            raise UsageError(f"--synthetic must be one of {', '.join(ARCHITECTURES)}, got {synthetic!r}")
        torch_dtype = getattr(torch, dtype) if dtype != "auto" else (torch.bfloat16 if device == "cuda"
                                                                     else torch.float32)
        _say(f"tforce: bench: building a random-weight {synthetic} target and draft on {device} (SYNTHETIC)")
        models = b.Models.local(*b.synthetic_pair(synthetic, device, torch_dtype, cfg.seed))
        config, tokenizer, name = models.target.config, None, f"synthetic:{synthetic}"
    else:
        from .weights import load_model, resolve

        draft_name = draft if draft is not None else _default_draft(model)
        if uses_draft and draft_name is None:
            raise UsageError("the methods need a draft model: pass --draft, or drop triforce, naive and streaming")
        torch_dtype = None if dtype == "auto" else getattr(torch, dtype)
        if world > 1:  # the ranks load the weights: here only the config and tokenizer
            path, config, tokenizer = _tp_target(model, world)
            torch_dtype = torch_dtype or (torch.bfloat16 if device == "cuda" else torch.float32)
            models = b.Models.split(config, str(path), str(resolve(draft_name)) if uses_draft else None, world,
                                    device, torch_dtype)
        else:
            loaded = load_model(model, device=device, dtype=torch_dtype)
            small = load_model(draft_name, device=device, dtype=torch_dtype, tokenizer=False).model \
                if uses_draft else None
            models, config, tokenizer = b.Models.local(loaded.model, small), loaded.config, loaded.tokenizer
        name = model
    context = config.max_position_embeddings
    if cfg.prompt_len >= context:
        raise UsageError(f"--prompt-len {cfg.prompt_len} reaches the model's context ({context} tokens)")
    ids = b.prompt_ids(cfg.prompt_len, config.vocab_size, tokenizer, text, cfg.seed)
    return b.bench(models, ids, cfg, synthetic is not None, name,
                   progress=lambda line: _say(f"tforce: bench: {line}"))


def _print_bench(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    def f(x, fmt, suffix=""):
        return "-" if x is None else format(x, fmt) + suffix

    peak = r["h2d_peak_gbps"]
    title = (f"tforce bench: {r['model']} on {r['device']}, {r['prompt_tokens']} prompt + {r['gen_len']} tokens, "
             f"{r['dtype']}, temperature {r['temperature']}" + ("  SYNTHETIC (random weights)" if r["synthetic"]
                                                                else ""))
    t = Table(title=title, caption=f"pinned H2D peak: {f(peak, '.1f', ' GB/s')}; floor = offloaded KV bytes "
                                   f"per verification / peak; warm-up {f(r['warmup_s'], '.1f', ' s')} (not in the runs); "
                                   f"'-' = not applicable or not measured")
    for col in ("method", "ms/token", "speed-up vs ar", "accept draft", "accept retrieval", "tokens/verif",
                "prefill s", "H2D GB/s (peak)", "floor ms/verif", "GPU GiB", "pinned GiB", "KV layers GPU/host"):
        t.add_column(col, justify="left" if col == "method" else "right")
    for run in r["runs"]:
        acc = run["acceptance"]
        h2d = "-" if run["h2d_gbps"] is None else f"{run['h2d_gbps']:.1f} ({f(peak, '.1f')})"
        pl = run["placement"]
        t.add_row(run["method"], f(run["ms_per_token"], ".1f"), f(run["speedup_vs_ar"], ".2f", "x"),
                  f(acc.get("draft"), ".1%"), f(acc.get("retrieval"), ".1%"),
                  f(run["tokens_per_verification"], ".2f"), f(run["prefill_s"], ".2f"), h2d,
                  f(run["floor_ms_per_verification"], ".1f"), f(run["gpu_mem_gib"], ".1f"),
                  f(run["pinned_gib"], ".2f"), f"{pl['resident_layers']}/{pl['offloaded_layers']}")
    Console(width=None if sys.stdout.isatty() else 200).print(t)


def main() -> None:
    """Entry point. Click's own usage errors (a bad option value, an unknown option) also become one line."""
    try:  # recent Typer vendors its own Click
        from typer._click import exceptions as cx
    except ImportError:
        from click import exceptions as cx

    try:
        code = app(standalone_mode=False)
    except getattr(cx, "NoArgsIsHelpError", ()):  # Typer has printed the help already
        code = 2
    except cx.UsageError as e:
        _say(f"tforce: error: {e.format_message()}" + (f" (see '{e.ctx.command_path} --help')" if e.ctx else ""))
        code = 2
    except KeyboardInterrupt:
        _say("tforce: interrupted")
        code = 130
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
