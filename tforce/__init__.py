"""tforce: lossless hierarchical speculative decoding (TriForce) for long-context Llama-family models.

The Python API (docs/python-api.md) is imported on first use, so `import tforce` and `tforce --help` do not
load torch."""
from __future__ import annotations

import importlib

from .errors import DoesNotFit, TforceError, UsageError
from .version import __version__

_LAZY = {  # name -> the module that defines it
    "generate": "tforce.auto.chooser", "Result": "tforce.engine.generate", "generate_batch": "tforce.engine.batch",
    "Conversation": "tforce.engine.conversation", "PromptFormat": "tforce.text.format",
    "LoadedModel": "tforce.model.weights", "load_model": "tforce.model.weights", "RunConfig": "tforce.config",
    "Events": "tforce.engine.events",
}

__all__ = ["generate", "generate_batch", "Conversation", "RunConfig", "Events", "load_model", "LoadedModel",
           "PromptFormat", "Result",
           "TforceError", "UsageError", "DoesNotFit", "__version__"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'tforce' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # the next access is a plain lookup
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
