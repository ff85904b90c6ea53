"""One GGUF file -> a checkpoint folder: config.json, the tokenizer with its chat template and
generation_config.json with the end-of-sequence ids (all read by transformers' GGUF support), and
model.safetensors with the layers' projections kept quantized (gguf_tensors.py), listed in
quant_stored.QUANTIZED."""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from ..errors import TforceError, UsageError
from .families import FAMILIES, kv_heads
from .quant_stored import QUANTIZED

# The metadata keys of the ids generation ends at: llama.cpp stops at each (end of text, turn, message).
EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def require_gguf() -> None:
    """transformers' GGUF support needs the gguf and accelerate packages, which tforce does not otherwise."""
    try:
        import accelerate  # noqa: F401
        import gguf  # noqa: F401
    except ImportError as e:
        raise UsageError("reading a GGUF file needs the gguf and accelerate packages: pip install gguf accelerate") \
            from e


def check_file(file: Path) -> list[int]:
    """The end-of-sequence ids in the file's metadata, read without converting its tensors; a GGUF of a model
    tforce does not run, or with a tensor type the gguf package cannot dequantize, is refused here, before
    anything is converted."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(file))
        fields = reader.fields
        arch = fields["general.architecture"].contents()
        eos = [int(fields[key].contents()) for key in EOS_KEYS if key in fields]
    except Exception as e:  # the reader's errors (bad magic, a short file) are one line with the file's name
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UsageError(f"cannot read {file}: not a GGUF file ({reason})") from e
    if arch not in FAMILIES:
        raise UsageError(f"{file}: GGUF architecture {arch!r} is not a Llama-family model tforce runs")
    for t in reader.tensors:
        if not _readable(t.tensor_type):
            raise UsageError(f"{file}: tensor {t.name} is stored as {t.tensor_type.name}, which the gguf package "
                             "cannot dequantize, so tforce cannot read it")
    return list(dict.fromkeys(eos))


@lru_cache(maxsize=None)
def _readable(qtype) -> bool:
    """Whether the gguf package dequantizes this tensor type (it lacks some: Q8_1, Q8_K, the integer types),
    tried on one zero block."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, quants

    if qtype not in GGML_QUANT_SIZES:
        return False
    try:
        quants.dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def convert(file: Path, out: Path, eos: list[int]) -> None:
    """Writes the checkpoint of GGUF `file` into the empty folder `out` (eos: check_file's)."""
    try:
        config, tokenizer = _load(file)
    except Exception as e:  # transformers' messages run to several lines
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise TforceError(f"cannot convert {file} with transformers ({type(e).__name__}: {reason})") from e
    if config.model_type not in FAMILIES:
        raise UsageError(f"{file}: model type {config.model_type!r} is not a Llama-family model tforce runs")
    from safetensors.torch import save_file

    from .gguf_tensors import read_state

    try:
        state, quantized = read_state(file, config.model_type, config.num_attention_heads, kv_heads(config))
    except (ValueError, NotImplementedError) as e:  # a tensor type or shape the reader cannot take
        raise TforceError(f"cannot read the tensors of {file}: {e}") from e
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / QUANTIZED).write_text(json.dumps(quantized, indent=1) + "\n")
    config.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    if eos:
        generation = {"bos_token_id": config.bos_token_id, "eos_token_id": eos if len(eos) > 1 else eos[0]}
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def _load(file: Path):
    """(config, tokenizer or None) as transformers reads them from the file's metadata."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(file.parent, gguf_file=file.name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    except Exception:  # a file without tokenizer metadata: the model runs on token ids
        tokenizer = None
    return config, tokenizer
