"""Hugging Face checkpoints -> our Llama: config.json (parsed by transformers), single or sharded
safetensors or PyTorch .bin (weight_files.py), loaded onto the meta device and assigned (no random init, no
double copy), then cast."""
from __future__ import annotations

import json
import logging
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig

from ..errors import TforceError, UsageError
from .families import FAMILIES, sliding_window
from .network import Llama
from .quant import SCHEMES, check_device, check_weights, quantize
from .quant_stored import expand_q8, install, read_quantized
from .registry import resolve
from .weight_files import other_format, read_tensors, refuse_quantized, weight_files

@dataclass
class LoadedModel:
    model: Llama
    tokenizer: object | None
    path: Path
    name: str

    @property
    def config(self):
        return self.model.config


def read_config(path: Path):
    """The config of a model folder, refused unless tforce runs it: checked here, before anything (the
    memory plan, `tforce info`) reads a Llama's fields from it. Never with remote code: a config whose
    auto_map names its own classes is read as its model_type's transformers config."""
    try:
        with _quiet_yarn_finetuned():
            config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    except Exception as e:  # transformers' messages run to several lines: keep the first (errors.py: one line),
        # and the second where the first only introduces it ("Class validation error for validator ...:")
        lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
        reason = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]
        raise UsageError(f"cannot read {path / 'config.json'}: {reason}") from e
    if config.model_type not in FAMILIES:
        raise UsageError(f"{path}: model type {config.model_type!r} is not a Llama-family model "
                         f"(tforce runs {', '.join(FAMILIES)})")
    # transformers 5.4 on refuse it for a Llama; 5.0 to 5.3 read it. Qwen3 names its head size (head_dim),
    # which need not divide the hidden size
    if config.model_type != "qwen3" and config.hidden_size % config.num_attention_heads:
        raise UsageError(f"cannot read {path / 'config.json'}: the hidden size ({config.hidden_size}) is not a "
                         f"multiple of the number of attention heads ({config.num_attention_heads})")
    window = sliding_window(config)
    if window and window < config.max_position_embeddings:
        raise UsageError(f"{path}: sliding-window attention ({window} tokens, shorter than the "
                         f"{config.max_position_embeddings}-token context) is not supported")
    refuse_quantized(config, path)
    _add_generation_eos(config, path)
    return config


@contextmanager
def _quiet_yarn_finetuned():
    """Yarn-Llama-2's configs carry rope_scaling's `finetuned`, which only their own remote code reads (for
    its dynamic YaRN); the static YaRN that transformers and tforce compute ignores it, and transformers
    says so on stderr at every command ("Unrecognized keys ... {'finetuned'}"). That line alone is dropped."""
    logger = logging.getLogger("transformers.modeling_rope_utils")
    logger.addFilter(_not_finetuned)
    try:
        yield
    finally:
        logger.removeFilter(_not_finetuned)


def _not_finetuned(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not (message.startswith("Unrecognized keys") and message.endswith("{'finetuned'}"))


def _add_generation_eos(config, path: Path) -> None:
    """Adds generation_config.json's end-of-sequence ids to config.eos_token_id, which the engine stops at.
    transformers' generate stops at generation_config's; an instruction-tuned model may list its end of
    turn only there, and a run that goes on past it is not what the model alone gives."""
    f = path / "generation_config.json"
    if not f.is_file():
        return
    try:
        eos = json.loads(f.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError) as e:
        raise UsageError(f"cannot read {f}: not a JSON object") from e
    ids = []
    for value in (config.eos_token_id, eos):
        for i in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(i, int) and not isinstance(i, bool) and i not in ids:
                ids.append(i)
    if ids:
        config.eos_token_id = ids if len(ids) > 1 else ids[0]


def load_model(name_or_path: str, device: str = "cpu", dtype: torch.dtype | str | None = None,
               tokenizer: bool = True, rank: int = 0, world: int = 1, weights: str | None = None) -> LoadedModel:
    """Load a checkpoint of one of the FAMILIES. dtype defaults to float32 on CPU and bfloat16 on CUDA.
    weights (quant.CHOICES): "int8" or "int4" quantizes the layers' projections after loading (quant.py; on
    the CPU or CUDA, one rank); None or "auto" keeps them as the folder has them: in dtype, or as stored
    quantized by a GGUF conversion (quant_stored.py; dequantized to dtype where the kernel cannot run);
    "float": in dtype.

    world > 1: the model of tensor-parallel rank `rank` (sharding.apply_tp's layout), reading from the
    files only that rank's slice of each sharded weight, the rest whole (weight_files.read_tensors: what
    that costs in host memory for each format)."""
    if weights is not None:
        check_weights(weights)
    if weights in SCHEMES and world > 1:
        raise UsageError(f"--weights {weights} runs in one process only, so far")
    if weights in SCHEMES:  # before anything is read
        check_device(weights, device)
    path = resolve(name_or_path)
    config = read_config(path)
    quantized = read_quantized(path)
    if quantized and world > 1:
        raise UsageError(f"{name_or_path}: a model with quantized weights (a GGUF file) runs on one device, so far")
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    dtype = dtype or (torch.bfloat16 if str(device).startswith("cuda") else torch.float32)
    with torch.device("meta"):
        model = Llama(config)
    slices = {}
    if world > 1:
        from .sharding import apply_tp, tp_slices

        slices = tp_slices(model, rank, world)
        apply_tp(model, rank, world)  # on the meta device: the shard's shapes, no memory
    state = {}
    files = weight_files(path)
    for f in files:
        state.update(read_tensors(f, slices, dtype))
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    kept = "auto"
    if quantized:
        expand_q8(state, dtype)  # read_tensors gave every other float tensor in dtype already
        kept = install(model, state, quantized, weights, dtype, torch.device(device))
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")
               and m.rpartition(".")[0] not in quantized]
    unexpected = [u for u in unexpected if "rotary_emb" not in u]
    if missing or unexpected:
        raise TforceError(f"{path}: weights do not match a {config.model_type} model "
                          f"(missing {missing[:3]}, unexpected {unexpected[:3]}){other_format(path, files)}")
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(device).eval()
    if weights in SCHEMES:  # a float model's projections, or those a GGUF kept in floating point
        quantize(model, weights)
    else:
        model.weights = kept
    tok = load_tokenizer(path) if tokenizer else None
    return LoadedModel(model, tok, path, name_or_path)


# The files a tokenizer's vocabulary is read from (a Llama's tokenizer.json or SentencePiece tokenizer.model,
# Mistral's tekken.json, a BPE vocab.json).
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "tekken.json", "vocab.json")


def load_tokenizer(path: Path):
    """The folder's tokenizer, or None when it has none. A folder without vocabulary files has none: asked
    for one there, transformers 5.0 to 5.5 build an empty tokenizer of the config's model type (a
    CodeLlamaTokenizer with no vocabulary but its special tokens, for a Llama) instead of refusing, and a run
    would go on with it."""
    from transformers import AutoTokenizer

    if not any((path / name).is_file() for name in VOCABULARY_FILES):
        return None
    if (path / "tokenizer.model").is_file() and not (path / "tokenizer.json").is_file():
        _need_sentencepiece(path)
    try:
        with _quiet_yarn_finetuned():  # it reads config.json too
            return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except Exception:
        return None


def _need_sentencepiece(path: Path) -> None:
    """transformers converts a SentencePiece tokenizer.model with sentencepiece and protobuf; without
    either it falls back to tiktoken's reader and fails saying tiktoken is required."""
    import importlib

    absent = []
    for name, module in (("sentencepiece", "sentencepiece"), ("protobuf", "google.protobuf")):
        try:
            importlib.import_module(module)
        except ImportError:
            absent.append(name)
    if absent:
        raise TforceError(f"{path}'s tokenizer is a SentencePiece tokenizer.model: reading it needs the "
                          f"sentencepiece and protobuf packages ({' and '.join(absent)} missing): "
                          "pip install sentencepiece protobuf")
