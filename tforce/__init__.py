"""tforce: lossless hierarchical speculative decoding (TriForce) for long-context Llama models."""
from .batch import generate_batch
from .conversation import Conversation
from .engine import Result, generate
from .errors import DoesNotFit, TforceError, UsageError
from .prompt_format import PromptFormat
from .weights import LoadedModel, load_model

__all__ = ["generate", "generate_batch", "Conversation", "load_model", "LoadedModel", "PromptFormat", "Result",
           "TforceError", "UsageError", "DoesNotFit"]
__version__ = "0.1.0"
