"""tforce: lossless hierarchical speculative decoding (TriForce) for long-context Llama models."""
import os

# Before torch loads its OpenMP runtime (read once, at load): idle OpenMP threads sleep instead of
# spinning. With the default spin-wait, a CPU run whose cores are shared with another busy process ran
# 30-40x slower on the 2-core test machine (an 875-token prompt, 32 tokens: 364-454 ms/token spinning,
# 11-12 ms/token passive, 2026-11-23). A value the user set is kept; importing torch before tforce
# leaves torch's runtime as it was configured.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from .batch import generate_batch
from .conversation import Conversation
from .engine import Result, generate
from .errors import DoesNotFit, TforceError, UsageError
from .prompt_format import PromptFormat
from .weights import LoadedModel, load_model

__all__ = ["generate", "generate_batch", "Conversation", "load_model", "LoadedModel", "PromptFormat", "Result",
           "TforceError", "UsageError", "DoesNotFit"]
__version__ = "0.1.0"
