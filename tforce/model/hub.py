"""Fetching a model from the Hugging Face hub into its cache: the config and tokenizer files, and with them
the weights in one format (safetensors when the repository has them, else PyTorch .bin). huggingface_hub
shows its own progress bars and resumes an interrupted download from what is already in the cache."""
from __future__ import annotations

from pathlib import Path

from ..errors import TforceError, UsageError
from .weight_files import weight_files

CONFIG_FILES = ["config.json", "generation_config.json"]
TOKENIZER_FILES = ["tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                   "tekken.json", "chat_template*"]
# Connection failures by class name: huggingface_hub raises its HTTP client's (httpx's, earlier requests').
NETWORK_ERRORS = ("TransportError", "ConnectionError", "Timeout", "TimeoutException")


def fetch(repo: str, weights: bool = True) -> Path:
    """The cached snapshot of repo when it holds what is asked for (config.json, and with weights=True a
    complete set of weight files), else one downloaded now."""
    from huggingface_hub import snapshot_download

    try:
        cached = Path(snapshot_download(repo, local_files_only=True))
        if _holds(cached, weights):
            return cached
    except Exception:  # not in the cache, or not usable there: the hub decides below
        pass
    try:  # the small files first: an unreachable hub, a missing or gated repository fail fast here (listing
        # the files retries for about 20 s first)
        folder = Path(snapshot_download(repo, allow_patterns=CONFIG_FILES + TOKENIZER_FILES))
        if weights:
            patterns = CONFIG_FILES + TOKENIZER_FILES + _weight_patterns(repo)
            folder = Path(snapshot_download(repo, allow_patterns=patterns))
        return folder
    except Exception as e:
        raise _hub_error(repo, e) from e


def _holds(folder: Path, weights: bool) -> bool:
    if not (folder / "config.json").is_file():
        return False
    if not weights:
        return True
    try:
        return all(f.is_file() for f in weight_files(folder))
    except TforceError:
        return False


def _weight_patterns(repo: str) -> list[str]:
    """The weights to download, decided from the repository's files: its safetensors when it has any (with
    transformers' names, model*.safetensors, when it has those: a consolidated.safetensors beside them is
    another layout of the same weights), else its PyTorch .bin files."""
    from huggingface_hub import HfApi

    root = [f for f in HfApi().list_repo_files(repo) if "/" not in f]
    safetensors = [f for f in root if f.endswith(".safetensors")]
    if safetensors:
        named = any(f.startswith("model") for f in safetensors)
        return ["model.safetensors.index.json", "model*.safetensors" if named else "*.safetensors"]
    return ["pytorch_model.bin.index.json", "pytorch_model*.bin"]


def _hub_error(repo: str, e: Exception) -> TforceError:
    """One line for what went wrong fetching repo."""
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, OfflineModeIsEnabled,
                                        RepositoryNotFoundError)

    if isinstance(e, GatedRepoError):  # before RepositoryNotFoundError: a subclass of it
        return TforceError(f"{repo} is gated: accept its licence on https://huggingface.co/{repo} and log in "
                           "with `hf auth login` (or set HF_TOKEN)")
    if isinstance(e, RepositoryNotFoundError):
        return UsageError(f"no such repository on the Hugging Face hub: {repo} (a private one needs "
                          "`hf auth login` or HF_TOKEN)")
    elsewhere = "download it elsewhere and pass its folder with --model"
    if isinstance(e, (LocalEntryNotFoundError, OfflineModeIsEnabled)) or any(
            c.__name__ in NETWORK_ERRORS for c in type(e).__mro__):
        return TforceError(f"cannot reach the Hugging Face hub to fetch {repo} ({type(e).__name__}): {elsewhere}")
    reason = (str(e).strip().splitlines() or [""])[0]
    return TforceError(f"cannot fetch {repo} from the Hugging Face hub ({type(e).__name__}: {reason}): {elsewhere}")
