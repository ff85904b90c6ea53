"""A model folder's weight files as publishers ship them: safetensors (model.safetensors or shards named by
model.safetensors.index.json) or PyTorch pickles (pytorch_model.bin or shards named by
pytorch_model.bin.index.json), read one tensor at a time, whole or one tensor-parallel rank's slice."""
from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import TforceError, UsageError
from .quant_stored import STORED

SAFETENSORS = ("model.safetensors.index.json", "*.safetensors")
PYTORCH = ("pytorch_model.bin.index.json", "pytorch_model*.bin")
READS = "tforce reads float16/bfloat16/float32 checkpoints as safetensors or PyTorch .bin files"


def refuse_quantized(config, path: Path) -> None:
    """A GPTQ/AWQ/bitsandbytes checkpoint holds packed integers under other names: refused by its method
    rather than as weights that do not match."""
    quant = getattr(config, "quantization_config", None)
    if quant:
        method = (quant if isinstance(quant, dict) else vars(quant)).get("quant_method", "an unknown method")
        raise UsageError(f"{path} is quantized ({method}, config.json's quantization_config): {READS}")


def _set(path: Path, kind: tuple[str, str]) -> tuple[list[Path], list[Path]]:
    """(files of one format, those its index names that are not in the folder)."""
    index, pattern = path / kind[0], kind[1]
    if not index.is_file():
        return sorted(path.glob(pattern)), []
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UsageError(f"cannot read {index}: not a JSON object with a weight_map") from e
    files = [path / n for n in names]
    return files, [f for f in files if not f.is_file()]


def weight_files(path: Path) -> list[Path]:
    """The weight files to read: the safetensors set when the folder has one, else the PyTorch set. An index
    that names files the folder lacks (a download cut short) is refused, naming them."""
    for kind in (SAFETENSORS, PYTORCH):
        files, missing = _set(path, kind)
        if missing:
            raise TforceError(f"{path / kind[0]} names weight files that are not there: {_few(missing, 3)} "
                              "(the download was cut short? fetch them again)")
        if files:
            return files
    found = sorted(f.name for f in path.iterdir() if f.is_file() and f.name != "config.json")
    raise UsageError(f"{path} holds no weights (found config.json and {_few(found, 8) or 'nothing else'}): {READS} "
                     "(model*.safetensors, pytorch_model*.bin)")


def _few(items: list, n: int) -> str:
    """The first n items, and how many more."""
    return ", ".join(str(i) for i in items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def other_format(path: Path, files: list[Path]) -> str:
    """Names the other format's files when the folder holds both (said when the chosen set is incomplete:
    the weights may be split between them)."""
    other = PYTORCH if files[0].suffix == ".safetensors" else SAFETENSORS
    rest = sorted(path.glob(other[1]))
    return (f"; it also holds {_few([f.name for f in rest], 3)}: tforce reads one complete set, "
            "safetensors or .bin, not halves of both") if rest else ""


def read_tensors(f: Path, slices: dict, dtype: torch.dtype):
    """(name, tensor in dtype) of each tensor of file f that this rank keeps: whole, or its
    slices[name] = (dim, start, end) part; a name mapped to None is skipped.

    safetensors reads a slice without the rest. A .bin is mapped (torch.load mmap=True), not read, and
    each kept tensor (or slice) is copied out: host memory holds what the rank keeps plus the mapped pages
    touched, which the kernel may drop. A dim-0 slice touches its rows' pages only; a dim-1 slice (columns)
    touches the whole tensor. weights_only=True: a pickle that needs anything but tensors is refused
    unloaded, so no code in it runs."""
    if f.suffix == ".safetensors":
        yield from _read_safetensors(f, slices, dtype)
        return
    try:
        state = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        raise UsageError(f"refused {f}: it needs more than tensors to load (pickled code or objects), and "
                         f"tforce runs no code from a checkpoint; {READS}") from e
    except (OSError, RuntimeError, EOFError, ValueError) as e:
        raise _unreadable(f, e) from e
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise UsageError(f"{f} is not a PyTorch state dict (names -> tensors): {READS}")
    for key, tensor in state.items():
        if key in slices and slices[key] is None:
            continue
        yield key, _cast(key, _cut(tensor, slices.get(key)), dtype, copy=True)


def _read_safetensors(f: Path, slices: dict, dtype: torch.dtype):
    try:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for key in sf.keys():
                if key in slices and slices[key] is None:
                    continue
                cut = slices.get(key)
                yield key, _cast(key, sf.get_tensor(key) if cut is None else _cut(sf.get_slice(key), cut), dtype)
    except (SafetensorError, OSError) as e:  # safetensors names neither the file nor what is wrong with it
        raise _unreadable(f, e) from e


def _cast(key: str, t: torch.Tensor, dtype: torch.dtype, copy: bool = False) -> torch.Tensor:
    """t in dtype; a quantized module's codes and scales (quant_stored.STORED) as stored."""
    if key.endswith(STORED) or not t.is_floating_point():
        return t.clone() if copy else t
    return t.to(dtype, copy=copy)


def _unreadable(f: Path, e: Exception) -> TforceError:
    reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return TforceError(f"cannot read the weights in {f} ({reason}): the file is missing, truncated or corrupt")


def _cut(tensor, cut: tuple[int, int, int] | None):
    """The slice [start, end) along dim (0 or 1) of a tensor or safetensors slice."""
    if cut is None:
        return tensor
    dim, start, end = cut
    return tensor[start:end] if dim == 0 else tensor[:, start:end]
