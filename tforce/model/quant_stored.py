"""Loading a folder whose projections are stored quantized (a converted GGUF: gguf_tensors.py; its list in
gguf_convert.QUANTIZED) into the model being loaded (weights.load_model)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..errors import TforceError
from .linear import Linear
from .quant import SCHEMES, QuantLinear, dequantize_stored, device_problem

QUANTIZED = "quantization.json"  # {module: {"scheme", "source", "how"}}, written by gguf_convert
# A quantized module's tensors, and a Q8_0 tensor's (gguf_tensors.q8_blocks): kept in their stored dtypes when read.
STORED = (".qweight", ".scales", ".q8", ".q8_scales")


def expand_q8(state: dict, dtype: torch.dtype) -> None:
    """Each name.q8 / name.q8_scales pair of `state` -> name (N, K) in dtype: every value d q, exact in
    float32."""
    for key in [k for k in state if k.endswith(".q8")]:
        name = key[:-len(".q8")]
        q, d = state.pop(key), state.pop(f"{name}.q8_scales")
        N, K = q.shape
        state[name] = (q.float().view(N, -1, 32) * d.float()[..., None]).view(N, K).to(dtype)


def read_quantized(path: Path) -> dict:
    """The folder's quantized projections, {} for a folder that has none."""
    try:
        return json.loads((path / QUANTIZED).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise TforceError(f"cannot read {path / QUANTIZED}: {e}") from e


def install(model: nn.Module, state: dict, quantized: dict, weights: str | None, dtype: torch.dtype,
            device: torch.device) -> str:
    """Replace each quantized module of `model` (on the meta device) by its stored form on `device` (packed
    for its kernel there), taking its tensors out of `state`. Kept quantized unless `weights` names the
    other scheme (re-quantized from the stored values); where the scheme's kernel cannot run
    (quant.device_problem: int4 on a GPU older than compute capability 8.0) or with `weights` "float", a
    plain projection in `dtype` of the dequantized values. Returns what the model's projections are: a
    scheme, "mixed", or "auto" (none quantized)."""
    schemes = set()
    for module, info in quantized.items():
        try:
            scheme, q, scales = info["scheme"], state.pop(f"{module}.qweight"), state.pop(f"{module}.scales")
        except (KeyError, TypeError) as e:
            raise TforceError(f"the quantized weights of {module} are incomplete ({e})") from e
        bias = state.pop(f"{module}.bias", None)
        want = weights if weights in SCHEMES else None if weights == "float" else scheme
        want = None if want is None or device_problem(want, device) else want
        if want == scheme:
            new = QuantLinear.stored(scheme, *(t if t is None else t.to(device) for t in (q, scales, bias)))
        else:  # from the stored values in their own precision (a mapped GGUF block's: the file's, float32)
            new = _plain(dequantize_stored(scheme, q, scales), bias, dtype if want is None else torch.float32)
            new = new if want is None else QuantLinear(new.to(device), want)
        parent, _, name = module.rpartition(".")
        setattr(model.get_submodule(parent), name, new)
        schemes.add(want)
    if not schemes or schemes == {None}:
        return "auto"
    return schemes.pop() if len(schemes) == 1 else "mixed"


def _plain(w: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> Linear:
    """A floating-point Linear in dtype of weight w (N, K)."""
    lin = Linear(w.shape[1], w.shape[0], bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(w.to(dtype), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.detach().to(dtype), requires_grad=False)
    return lin
