"""PyTorch .bin checkpoints (single and sharded) written from a safetensors checkpoint, as 2023-era
long-context models ship them."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file


def to_bin(src: Path, dst: Path, shards: int = 1, keep: tuple = ("config.json",)) -> Path:
    """src's model.safetensors written as pytorch_model.bin, or as `shards` files named by
    pytorch_model.bin.index.json (the layout of transformers' save_pretrained(safe_serialization=False),
    which transformers 5 no longer writes); the `keep` files copied."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in keep:
        shutil.copy(src / name, dst / name)
    state = load_file(src / "model.safetensors")
    if shards == 1:
        torch.save(state, dst / "pytorch_model.bin")
        return dst
    names, weight_map = list(state), {}
    for i in range(shards):
        file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {k: state[k] for k in names[i::shards]}
        torch.save(part, dst / file)
        weight_map.update(dict.fromkeys(part, file))
    (dst / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst
