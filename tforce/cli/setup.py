"""What `tforce run` and `tforce chat` are given, checked before anything is loaded: the prompt read, the
models resolved (their configs and tokenizer, no weights), the options validated into one Setup, and the
notes said once the prompt has passed its checks."""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..config import AUTO, OPTIONS, RunConfig
from ..model.defaults import default_pair, notice
from ..model.registry import LOOKUP
from ..text.demo import NAME
from ..errors import UsageError
from .common import DTYPES, as_role, decode_text, pick_device, gpu_memory_note, parse_placement, say, set_threads


EMPTY_PROMPT = "the prompt is empty: give a prompt file, --prompt TEXT or text on stdin"


def read_prompt(prompt_file: Optional[str], prompt: Optional[str], default: Optional[str] = None,
                 empty: str = EMPTY_PROMPT) -> str:
    """The document (a file, `-` for stdin, or piped stdin) followed by --prompt, joined by a blank line.

    With nothing given (no file, no --prompt, nothing on stdin), `default` (the demo's excerpt) if there
    is one; a prompt or file that was given but is empty is a usage error (`empty`, its line), never replaced."""
    document = ""
    if prompt_file == "-" or (prompt_file is None and not sys.stdin.isatty()):
        try:
            data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
        except (OSError, ValueError):
            data = b""
        document = decode_text(data, "stdin")
    elif prompt_file is not None:
        path = Path(prompt_file).expanduser()
        try:
            data = path.read_bytes()
        except OSError as e:
            hint = " (--json and --ignore-eos are flags: they take no value)" \
                if prompt_file.lower() in ("true", "false", "yes", "no", "on", "off", "1", "0") else ""
            raise UsageError(f"cannot read prompt file {prompt_file}: {e.strerror or e}{hint}") from e
        document = decode_text(data, f"prompt file {prompt_file}")
    if prompt is not None:  # an argument's bytes that are not UTF-8 reach Python as lone surrogates
        prompt = decode_text(prompt.encode("utf-8", "surrogateescape"), "--prompt")
    parts = [p for p in (document, prompt or "") if p.strip()]
    if not parts and default is not None and prompt is None and prompt_file is None:
        say(f"tforce: no prompt given: using {NAME} and a question")
        return default
    if not parts:
        raise UsageError(empty)
    return "\n\n".join(parts)


def check_local(name: str, role: str) -> None:
    """A local folder or an unknown name is checked here, its error naming the role ("target model",
    "draft model"), before anything else; registry names and hub ids are fetched when loaded."""
    from ..model.registry import REGISTRY, resolve

    hub = name in REGISTRY or (name.count("/") == 1 and not name.startswith((".", "/", "~")))
    if Path(name).expanduser().exists() or not hub:
        as_role(role, resolve, name)


def default_draft(model: str) -> Optional[str]:
    """The registry's draft for a short name; for a folder `X-target`, a sibling `X-draft` if present."""
    from ..model.registry import REGISTRY

    if model in REGISTRY:
        return REGISTRY[model][1]
    path = Path(model).expanduser()
    if path.is_dir() and path.name.endswith("-target"):
        sibling = path.with_name(path.name[: -len("-target")] + "-draft")
        if (sibling / "config.json").is_file():
            return str(sibling)
    return None


@dataclass
class Setup:
    """A generation command's options, checked, with the models resolved (no weights read yet)."""

    target: str
    draft: Optional[str]  # None when the method needs none
    device: str
    dtype: Optional[str]  # None: the device's default
    world: int
    config: RunConfig  # the run's options, checked (its method may be auto: run plans it once models are loaded)
    demo: Optional[str]  # the draft the notice names when no --model was given (--draft, else the demo's)
    template: str = "auto"  # prompt_format.PromptFormat's
    system: Optional[str] = None
    stops: tuple = ()  # --stop strings (stops.StopStrings)
    gammas_given: dict = field(default_factory=dict)  # --gamma1/--gamma2 as given: --method auto keeps them
    auto_note: Optional[str] = None  # what --method auto became without a calibration (notices)
    weights: str = "auto"  # the target's projections: as loaded, or int8/int4 (model/quant.py)

    def target_files(self):
        """(folder, config, tokenizer) of the target, split over self.world ranks, without reading its
        weights: what every command checks its prompt and memory against before loading; a target without
        tokenizer files is refused."""
        path, config, tok = read_target(self.target, self.world)
        if tok is None:
            raise UsageError(f"{path} has no tokenizer: tforce needs the target's tokenizer files")
        return path, config, tok

    def load(self):
        """(target, draft or None) loaded as this command runs them, in this process."""
        from ..model.weights import load_model

        target = as_role("target model", load_model, self.target, device=self.device, dtype=self.dtype,
                          tokenizer=False, weights=self.weights)
        small = as_role("draft model", load_model, self.draft, device=self.device, dtype=self.dtype,
                         tokenizer=False) if self.draft else None
        return target, small

    def prompt_format(self, tok, path, snapshot_ids: Optional[list] = None):
        """How this command's text becomes tokens (the target's tokenizer `tok`, from folder `path`); with
        the token ids of a KV snapshot to reuse, as they were laid out (a template that writes the date: theirs)."""
        from ..text.format import PromptFormat

        fmt = PromptFormat(tok, self.template, self.system, name=str(path))
        return fmt if snapshot_ids is None else fmt.as_made(snapshot_ids)


def check_fits(n: int, context: int, what: str = "the prompt") -> None:
    """A prompt of n tokens must leave the model's context room for one token."""
    if n >= context:
        raise UsageError(f"{what} is {n} tokens; the model's context is {context}")


def notices(setup: Setup, fmt, serving: bool = False) -> None:
    """The command's stderr notes (--gpu-memory off CUDA, the demo pair, greedy's exactness in a 16-bit
    dtype, the chat template laying the prompt out): after the prompt's checks, the template's included, so
    that a refused prompt's error is the only line. serving: `tforce serve`'s, where only chat requests
    take the template."""
    gpu_memory_note(setup.config.execution.gpu_memory, setup.device)
    if setup.demo is not None:
        say(notice(setup.target, setup.demo))
    _exactness_note(setup)
    if fmt.templated and serving:
        say(f"tforce: chat requests follow {setup.target}'s chat template; completions take the text as it is")
    elif fmt.templated:
        # the model as the user named it: a GGUF file's or a Hub id's folder is a cache path they never typed
        say(f"tforce: the prompt follows {setup.target}'s chat template (--template none: the text as it is)")
    if fmt.snapshot_date is not None:
        say(f"tforce: the chat template writes the date: the prompt has the KV snapshot's ({fmt.snapshot_date}), "
             "which its cache was computed with")
    if setup.auto_note is not None:
        say(setup.auto_note)


def configure(p: dict, calibrate: bool = True) -> Setup:
    """Checks the shared options (options.py) of `run` and `chat`, given as their parameters by name.
    --method auto stays auto where the command plans it from measured costs (calibrate: `run` of one
    prompt in one process, once its models are loaded); elsewhere it becomes chooser.uncalibrated's
    method here, and notices() says so."""
    given = {k: p[k] for k in ("gamma1", "gamma2") if p[k] is not None}  # auto keeps them; the others are planned
    config = RunConfig.of(**{k: p[k] for k in OPTIONS if k in p and k not in ("gamma1", "gamma2", "gpu_memory")},
                          **given)
    config.validate()
    spec = config.speculation
    if p["dtype"] not in DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {p['dtype']!r}")
    system = _check_template(p["template"], p["system"])
    stops = tuple(unescape(decode_text(s.encode("utf-8", "surrogateescape"), "--stop")) for s in p["stop"] or ())
    if "" in stops:
        raise UsageError("--stop takes a non-empty string")
    config = config.with_options(**parse_placement(p["offload"], p["gpu_memory"]))
    set_threads(p["threads"])
    world, dev = parallel_ranks(p["tp"], p["gpus"], p["device"])
    from ..model.quant import SCHEMES, check_device, check_weights

    weights = p.get("weights", "auto")
    check_weights(weights)
    if weights in SCHEMES and world > 1:
        raise UsageError(f"--weights {weights} runs in one process only, so far (no --tp/--gpus)")
    if weights in SCHEMES:
        check_device(weights, dev)
    dtype = _dtype_name(None if p["dtype"] == "auto" else p["dtype"], dev)
    _check_snapshots(p["save_kv"], p["load_kv"], world, dtype)
    model, draft, demo_draft = p["model"], p["draft"], None
    target_name = model
    if model is None:
        target_name, demo_draft = default_pair()
    else:  # the target first: a missing target folder is not a missing draft
        check_local(model, "target model")
    draft_name = draft if draft is not None else default_draft(target_name)
    if draft_name == LOOKUP:  # no draft model: the bottom level proposes by n-gram lookup (engine/lookup.py)
        config, draft_name = config.with_options(proposer="lookup"), None
        spec = config.speculation
    elif draft is not None and (spec.uses_draft or spec.method == AUTO):  # auto takes a draft where one is given
        check_local(draft, "draft model")
    if spec.uses_draft and draft_name is None:
        raise UsageError(f"method {spec.method!r} needs a draft model: pass --draft, or use --method retrieval or ar")
    auto_note = None
    if spec.method == AUTO and (not calibrate or world > 1):
        from ..auto.chooser import uncalibrated

        config = config.with_options(method=uncalibrated(dev, draft_name is not None or spec.proposer == "lookup"))
        why = "--tp/--gpus ranks" if world > 1 else "this command"
        auto_note = (f"tforce: auto: {config.method} ({why} runs no calibration: on a GPU with a draft "
                     "triforce, otherwise ar; --method chooses)")
    uses_draft = config.method == AUTO or config.speculation.uses_draft
    named = (draft or demo_draft) if model is None else None  # the draft the demo notice names
    return Setup(target_name, draft_name if uses_draft else None, dev, None if p["dtype"] == "auto" else p["dtype"],
                 world, config, named, p["template"], system, stops, given, auto_note, weights)


def unescape(text: str) -> str:
    """A --stop string as typed: `--stop '\\n'` is a newline (a shell passes the two characters), `\\t` a
    tab, `\\\\` a backslash; everything else as it is."""
    return re.sub(r"\\(n|t|\\)", lambda m: {"n": "\n", "t": "\t", "\\": "\\"}[m.group(1)], text)


def _check_template(template: str, system: Optional[str]) -> Optional[str]:
    """--template and --system checked before anything is read; the system message as text."""
    from ..text.format import TEMPLATES

    if template not in TEMPLATES:
        raise UsageError(f"--template must be one of {', '.join(TEMPLATES)}, got {template!r}")
    if system is None:
        return None
    if template == "none":
        raise UsageError("--system needs a chat template (not --template none)")
    return decode_text(system.encode("utf-8", "surrogateescape"), "--system")


def _check_snapshots(save_kv: Optional[str], load_kv: Optional[str], world: int, dtype: str) -> None:
    """Refuse a --save-kv path that is not a snapshot and a --load-kv snapshot of another world size or
    dtype (or none) before any weights are read or ranks started; the engine checks the model's identity."""
    from ..snapshot.format import check_dtype, check_target, check_world, read_manifest

    if save_kv is not None:
        check_target(save_kv)
    if load_kv is not None:
        manifest = read_manifest(load_kv)
        check_world(load_kv, manifest, world)
        check_dtype(load_kv, manifest, dtype)


def _exactness_note(setup: Setup) -> None:
    """Greedy speculation in a 16-bit dtype or with quantized weights, said where it is run: a verification's
    logits round differently from one-token decoding's (README, Exactness), so a near-tie can flip a token."""
    o = setup.config
    dtype = _dtype_name(setup.dtype, setup.device)
    # quantized projections compute in bfloat16 (model/quant.py), whatever the dtype
    weights = setup.weights
    if weights == "auto":
        from ..model.quant_stored import read_quantized
        from ..model.registry import resolve

        weights = "the GGUF's quantized" if read_quantized(resolve(setup.target, weights=False)) else weights
    rounding = dtype if weights in ("auto", "float") else f"{weights} weights (bfloat16 products)"
    if o.sampling.greedy and o.method != "ar" and not o.execution.deterministic and rounding != "float32":
        say(f"tforce: note: greedy in {rounding}: the tokens are plain decoding's (--method ar) except where its "
             "two best logits nearly tie; --deterministic makes them plain decoding's bit for bit")


def parallel_ranks(tp: int, gpus: Optional[int], device: str) -> tuple[int, str]:
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
    dev = "cuda" if device == "cuda" and world > 1 else pick_device(device)
    if dev == "cuda" and world > count:
        raise UsageError(f"{world} ranks on CUDA need {world} GPUs; torch sees {count} "
                         f"(--tp {world} --device cpu runs them on the CPU)")
    return world, dev


def _read_config(name: str, role: str):
    """(folder, config) of a model without reading its weights; errors name the role."""
    from ..model.registry import resolve
    from ..model.weights import read_config

    path = as_role(role, resolve, name)
    return path, as_role(role, read_config, path)


def read_draft_config(draft: str, target_config, target_tok):
    """The draft's config, checked against the target's before any weights are read: an embedding table no
    larger than the target's and the same tokenizer (vocab.py)."""
    from ..model.vocab import check_sizes, check_tokenizers
    from ..model.weights import load_tokenizer

    path, config = _read_config(draft, "draft model")
    check_sizes(target_config.vocab_size, config.vocab_size)
    check_tokenizers(target_tok, load_tokenizer(path), str(path), target_config.vocab_size, config.vocab_size)
    return config


def read_target(model: str, world: int):
    """(folder, config, tokenizer) of the target without loading weights; split over world > 1 ranks,
    the heads must split."""
    from ..model.sharding import check_tp
    from ..model.weights import load_tokenizer

    path, config = _read_config(model, "target model")
    if world > 1:
        check_tp(config, world)
    return path, config, load_tokenizer(path)


def _dtype_name(dtype: Optional[str], device: str) -> str:
    """The dtype a run uses: the one given, else the device's default (as load_model chooses it)."""
    return dtype or ("bfloat16" if device == "cuda" else "float32")


def dtype_bytes(dtype: Optional[str], device: str) -> int:
    import torch

    return torch.empty((), dtype=getattr(torch, _dtype_name(dtype, device))).element_size()
