"""Weight-only quantized projections: int8 per output channel, int4 in groups of 32, on the CPU and CUDA.

Why: a decode step reads every weight once, and on a CPU most of a short-context step is those reads
(SmolLM2-135M in float32: 513 MiB of weights against 44 MiB of KV cache at 1,000 tokens). The kernels are
PyTorch's own packed operators (`_weight_int8pack_mm`; `_weight_int4pack_mm_for_cpu` with its packing
`_convert_weight_to_int4pack_for_cpu`), chosen by measurement on a 2-core AVX2 CPU (BENCHMARKS.md,
"Weight-only int8 and int4 products"): both are fast only with bfloat16 activations (with float32 ones
they take a reference path, 4-24x slower than float32 weights), and then about 3x faster than float32
for SmolLM2's output-head shape. So a quantized projection rounds its input to bfloat16, multiplies,
and returns its output in the input's dtype.

What is quantized: the seven projections of every layer (q, k, v, o, gate, up, down). The embedding
table and the output head keep the model's dtype: the head's logits must stay float32 (network.
float32_logits), which these kernels cannot give without the slow path.

Formats (docs/architecture.md, "Weights"):
- int8: q = round(w / s) in [-127, 127], s = max |w| of the output channel / 127 (rounded up to bfloat16);
  w ~ q * s.
- int4: per group of 32 inputs of an output channel, lo/hi its range, scale = (hi - lo) / 15,
  q = round((w - lo) / scale) in [0, 15]; PyTorch's convention stores zero = lo + 8 * scale and computes
  w ~ (q - 8) * scale + zero. Scales and zeros are bfloat16, as the kernel takes them.

On CUDA (tests/model/test_quant_cuda.py passed on an H200; figures in BENCHMARKS.md, GPU log, 2026-11-28):
- int4 runs PyTorch's tinygemm kernel (`_weight_int4pack_mm`, packed by `_convert_weight_to_int4pack`;
  aten/src/ATen/native/cuda/int4mm.cu), with the same groups, bfloat16 scales and zeros, and the same
  w = (q - 8) * scale + zero (the kernel rounds each dequantized weight to bfloat16 before its tensor-core
  product). Its packing takes the codes two to a byte with column 2j in the HIGH nibble (the kernel's
  pack reads byte v's high nibble as the even k; torchao packs `q[:, ::2] << 4 | q[:, 1::2]`), the
  opposite of pack_int4, so cuda_nibbles swaps them. It needs compute capability 8.0 (bfloat16 mma.sync)
  and bfloat16 activations; every row count takes it (no DEQUANTIZE_ROWS, which is the CPU's measurement):
  a 2,048-token prefill of a 7B model measured 7.4x slower than in bfloat16 on an H200, since the
  kernel is built for a few rows and its packed layout cannot be dequantized cheaply.
- int8 keeps its codes (1 byte a weight, half of bfloat16: what int8 is for on a GPU is room for the KV
  cache) and multiplies by the weight dequantized per call, q.to(bfloat16) * scale, in cuBLAS: the CUDA
  `_weight_int8pack_mm` of torch 2.11 (pytorch#159325, 2025) is a float32 loop with one thread per
  output walking all of K alone, its weight reads uncoalesced (pytorch#190529, 2026, proposes a rewrite),
  so a decode step's one row would leave most of the GPU idle.
The packed int4 layout differs between the CPU and CUDA, so a QuantLinear is packed for the device it is
built on, and moving one across (Module.to) packs it again from its codes.

Exactness is relative to the model as quantized: every level of the hierarchy runs these same
projections, so speculative decoding reproduces plain decoding of the quantized model (tests/model/test_quant.py).
"""
from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UsageError

SCHEMES = ("int8", "int4")
# --weights: auto (as the checkpoint has them: in --dtype, or a GGUF's kept quantized), float (in --dtype, a
# GGUF's dequantized), or a scheme
CHOICES = ("auto", "float") + SCHEMES
GROUP = 32  # int4 group: Q4_0/Q4_1's block, the smallest the kernel takes
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_COMPUTE = torch.bfloat16  # the activations' dtype the kernels are fast in
# From this many rows (a prefill chunk) a projection dequantizes its weight and multiplies in the input's
# dtype: the packed kernels are fast for a few rows and slow for many; dequantizing measured faster from 256
# rows for every SmolLM2 shape and both schemes (BENCHMARKS.md, "A GGUF kept quantized")
DEQUANTIZE_ROWS = 256


def int8_weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) -> (q int8 (N, K), scales bfloat16 (N,)). The kernel's scales are bfloat16: each is rounded
    up to one (so max |w| / scale stays within 127) and the weight quantized against it."""
    w = w.float().contiguous()  # the kernel takes contiguous codes only (a transposed weight would give strided ones)
    amax = w.abs().amax(1)
    exact = torch.where(amax > 0, amax / 127, torch.ones_like(amax))  # an all-zero row: any scale, q = 0
    scale = exact.to(_COMPUTE)
    scale = torch.where(scale.float() < exact, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)
    return torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8), scale


def int4_weights(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) -> (q int32 (N, K) in 0..15, scales_and_zeros bfloat16 (K / group, N, 2))."""
    w = w.float()
    N, K = w.shape
    g = w.view(N, K // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    # the kernel's scale and zero are bfloat16: quantize against the rounded values it will use; a constant
    # group (hi == lo) gets scale 1, its value carried by the zero
    scale = torch.where(hi > lo, (hi - lo) / 15, torch.ones_like(hi)).to(torch.bfloat16).float()
    zero = (lo + 8 * scale).to(torch.bfloat16).float()
    q = torch.round((g - zero[..., None]) / scale[..., None] + 8).clamp(0, 15)
    sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return q.view(N, K).to(torch.int32), sz


def shape_problem(scheme: str, in_features: int, out_features: int, device: str = "cpu") -> str | None:
    """Why the scheme's kernel on `device` ("cpu" or "cuda") cannot take a weight of this shape, or None.
    The CPU's rules imply CUDA's, so a model quantized for the CPU runs on either."""
    if device == "cuda":
        if scheme == "int4" and in_features % GROUP:  # then inner_k_tiles(K) finds 2 tiles (32 inputs) at least
            return f"int4 needs input features in multiples of {GROUP}, got {in_features}"
        if scheme == "int4" and out_features % 8:  # the kernel's n-tiles: scales and output are n-tiles * 8 wide
            return f"int4 on CUDA needs output features in multiples of 8, got {out_features}"
        return None  # int8 on CUDA is a plain product (module docstring)
    if scheme == "int8":
        # _weight_int8pack_mm read out of bounds (a segmentation fault) for 7 rows of 172 inputs on torch
        # 2.13's CPU build; 8, 168, 176 and 200 inputs ran right
        return f"int8 needs input features in multiples of 8, got {in_features}" if in_features % 8 else None
    if in_features % GROUP:
        return f"int4 needs input features in multiples of {GROUP}, got {in_features}"
    if out_features % 16:  # the packing's rule (_convert_weight_to_int4pack_for_cpu)
        return f"int4 needs output features in multiples of 16, got {out_features}"
    return None


def device_problem(scheme: str, device) -> str | None:
    """Why the scheme's projections cannot run on `device`, or None."""
    device = torch.device(device)
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"quantized weights run on the CPU and CUDA, not {device.type}"
    if not torch.cuda.is_available():
        return "no CUDA device is available"
    capability = torch.cuda.get_device_capability(device)
    if scheme == "int4" and capability < (8, 0):  # tinygemm is built for sm_80 and later only
        return f"int4 on CUDA needs compute capability 8.0 or later, this GPU has {capability[0]}.{capability[1]}"
    return None


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes (N, K) in 0..15 -> uint8 (N, K / 2), column 2j in the low nibble, 2j + 1 in the high: the
    form stored on disk (each device's kernel has its own packing, made at load: _kernel_pack)."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """pack_int4's inverse -> int32 (N, K), the kernel packer's input."""
    return torch.stack([packed & 0x0F, packed >> 4], -1).flatten(1).to(torch.int32)


def cuda_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """pack_int4's bytes -> `_convert_weight_to_int4pack`'s input: the same codes two to a byte, column 2j in
    the high nibble and 2j + 1 in the low one (its own involution: swapping twice gives the bytes back)."""
    return ((packed & 0x0F) << 4) | (packed >> 4)


def inner_k_tiles(K: int) -> int:
    """The CUDA packing's k-tiles (of 16 inputs) per lane load: 8, 4 or 2, the largest that divides K (the
    kernel needs K a multiple of 16 times it; more tiles make wider loads, 16 bytes at 8)."""
    return next(t for t in (8, 4, 2) if K % (16 * t) == 0)


def _kernel_pack(packed: torch.Tensor) -> torch.Tensor:
    """pack_int4's bytes (N, K / 2) -> the int4 kernel's own layout on their device."""
    if packed.device.type == "cuda":
        return torch.ops.aten._convert_weight_to_int4pack(cuda_nibbles(packed).contiguous(),
                                                           inner_k_tiles(packed.shape[1] * 2))
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(packed), 2)


@lru_cache(maxsize=None)
def kernel_block(N: int, K: int) -> int | None:
    """How the CPU build's int4 packing lays out a (N, K) weight: it interleaves blocks of output channels
    (for each input k, byte j of a block holds channel j in its low nibble and j + block/2 in its high one;
    the block is 32 on AVX2 builds and 64 on AVX-512 ones, by PyTorch's int4mm_kernel.cpp). The layout is
    that build's private business, so it is found by packing probe codes of this shape and reading them
    back: the block that reads them exactly, or None (then codes are read through the kernel itself). Blocks
    are laid out one after another, so 128 rows (two blocks of either size) stand for any multiple of 128."""
    rows = 128 if N % 128 == 0 else N  # a probe of a few hundred kilobytes, not a copy of a 7B projection
    probe = torch.randint(0, 16, (rows, K), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 2)
    for block in (32, 64, 16):
        if rows % block == 0 and packed.numel() == rows * K // 2 \
                and torch.equal(_read_packed(packed, rows, K, block), probe):
            return block
    return None


def _read_packed(packed: torch.Tensor, N: int, K: int, block: int, dtype=torch.int32) -> torch.Tensor:
    """The kernel's packed int4 weight -> codes (N, K) in `dtype`, in the layout kernel_block found."""
    u = packed.reshape(N // block, K, block // 2)
    codes = torch.empty(N // block, block, K, dtype=dtype)
    codes[:, :block // 2] = (u & 0x0F).transpose(1, 2)
    codes[:, block // 2:] = (u >> 4).transpose(1, 2)
    return codes.view(N, K)


def dequantize_stored(scheme: str, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight (N, K) of a stored form (QuantLinear.stored's arguments), in the scales' own
    precision (a GGUF's mapped blocks keep theirs in float32: gguf_tensors.py)."""
    if scheme == "int8":
        return qweight.float() * scales.float()[:, None]
    scale, zero = (scales[..., i].float().t().repeat_interleave(GROUP, 1) for i in (0, 1))
    return (unpack_int4(qweight).float() - 8) * scale + zero


class QuantLinear(nn.Module):
    """A projection y = x W^T (+ b) with W held as int8 or int4 (module docstring)."""

    def __init__(self, linear: nn.Linear, scheme: str):
        w = linear.weight.detach()
        problem = scheme in SCHEMES and (device_problem(scheme, w.device) or shape_problem(
            scheme, linear.in_features, linear.out_features, w.device.type))
        if problem:
            raise ValueError(problem)
        if scheme == "int8":
            q, scales = int8_weights(w)
        elif scheme == "int4":
            q, scales = int4_weights(w)
            q = pack_int4(q)
        else:
            raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
        self._build(scheme, q, scales, linear.bias)

    @classmethod
    def stored(cls, scheme: str, qweight: torch.Tensor, scales: torch.Tensor,
               bias: torch.Tensor | None = None) -> "QuantLinear":
        """From the stored form: qweight int8 (N, K) for int8, uint8 (N, K / 2) (pack_int4) for int4; packed
        for the device qweight is on (where scales and bias must be too)."""
        self = cls.__new__(cls)
        self._build(scheme, qweight, scales, bias)
        return self

    def _build(self, scheme, q, scales, bias) -> None:
        super().__init__()
        N, K = q.shape[0], q.shape[1] * (2 if scheme == "int4" else 1)
        self.scheme, self.in_features, self.out_features = scheme, K, N
        # contiguous: the CUDA kernel reads the scales' memory as (K / GROUP, N, 2) whatever their strides
        self.register_buffer("scales", scales.to(_COMPUTE).contiguous())
        self.register_buffer("qweight", q.to(torch.int8) if scheme == "int8" else _kernel_pack(q))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def stored_form(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(qweight, scales) as `stored` takes them back."""
        if self.scheme == "int8":
            return self.qweight, self.scales
        return pack_int4(self.codes()), self.scales

    def codes(self, dtype=torch.int32) -> torch.Tensor:
        """The int4 codes (N, K) in 0..15, in `dtype`: on the CPU read from the packed layout where kernel_block
        knows it, else (and on CUDA) through the kernel: W^T = I W^T with unit scales and zero 0 gives q - 8
        exactly (small integers are exact in bfloat16)."""
        cuda = self.qweight.is_cuda
        block = None if cuda else kernel_block(self.out_features, self.in_features)
        if block is not None:
            return _read_packed(self.qweight, self.out_features, self.in_features, block, dtype)
        eye = torch.eye(self.in_features, dtype=_COMPUTE, device=self.qweight.device)
        ones = torch.stack([torch.ones_like(self.scales[..., 0]), torch.zeros_like(self.scales[..., 0])], -1)
        mm = torch.ops.aten._weight_int4pack_mm if cuda else torch.ops.aten._weight_int4pack_mm_for_cpu
        w = mm(eye, self.qweight, GROUP, ones).float().t()
        return (w + 8).round().to(dtype).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight.is_cuda:
            rows = x.reshape(-1, self.in_features).to(_COMPUTE).contiguous()  # the kernel takes contiguous rows
            if self.scheme == "int8":
                y = F.linear(rows, self.qweight.to(_COMPUTE) * self.scales.unsqueeze(1))
            else:
                y = torch.ops.aten._weight_int4pack_mm(rows, self.qweight, GROUP, self.scales)
            return self._biased(y.to(x.dtype).view(*x.shape[:-1], self.out_features))
        if x.numel() >= DEQUANTIZE_ROWS * self.in_features and self._readable():
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, self.dequantized().to(x.dtype), bias)
        rows = x.reshape(-1, self.in_features).to(_COMPUTE)
        if self.scheme == "int8":
            y = torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.qweight, GROUP, self.scales)
        return self._biased(y.to(x.dtype).view(*x.shape[:-1], self.out_features))

    def _biased(self, y: torch.Tensor) -> torch.Tensor:
        """y plus the bias in y's dtype: a float32 bias must not turn a bfloat16 product into float32."""
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def _readable(self) -> bool:
        """Whether the weight can be read back without the kernel (int8 always; int4 where kernel_block
        knows the packing)."""
        return self.scheme == "int8" or kernel_block(self.out_features, self.in_features) is not None

    def dequantized(self) -> torch.Tensor:
        """The float32 weight (N, K) this module multiplies by: the reference of its products, and the weight
        of a prefill chunk's product on the CPU (DEQUANTIZE_ROWS). On CUDA the products round it to bfloat16
        first (module docstring)."""
        if self.scheme == "int8":
            return dequantize_stored("int8", self.qweight, self.scales)
        N, K = self.out_features, self.in_features
        codes = self.codes(torch.float32)
        scale, zero = (self.scales[..., i].float().t()[:, :, None] for i in (0, 1))  # (N, K / GROUP, 1)
        return codes.view(N, K // GROUP, GROUP).sub_(8).mul_(scale).add_(zero).view(N, K)

    def _apply(self, fn, recurse=True):
        """Module.to, .cuda, .cpu: int4's packed layout is the device's own, so a weight moved between the CPU
        and CUDA is packed again from its stored form (a model moved whole gets the layout of where it goes)."""
        old = self.qweight.device
        new = fn(torch.empty(0, dtype=torch.uint8, device=old)).device  # where fn sends a buffer
        if new.type == old.type:
            return super()._apply(fn, recurse)
        problem = device_problem(self.scheme, new) or shape_problem(self.scheme, self.in_features,
                                                                    self.out_features, new.type)
        if problem:
            raise ValueError(problem)
        if self.scheme == "int8":  # the same codes on every device
            return super()._apply(fn, recurse)
        self._buffers["qweight"] = self.stored_form()[0]
        super()._apply(fn, recurse)
        self._buffers["qweight"] = _kernel_pack(self.qweight)
        return self

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}"


def check_weights(weights: str) -> None:
    """--weights, checked (UsageError, one line)."""
    if weights not in CHOICES:
        raise UsageError(f"--weights must be {', '.join(CHOICES)}, got {weights!r}")


def check_device(scheme: str, device) -> None:
    """Refuse (UsageError, one line) a scheme whose projections cannot run on `device` (device_problem)."""
    problem = device_problem(scheme, device)
    if problem:
        raise UsageError(f"--weights {scheme}: {problem}")


def quantize(model: nn.Module, scheme: str) -> nn.Module:
    """Replace every layer's floating-point projections of `model` (network.Llama) by QuantLinear, in place
    (those already QuantLinear, a GGUF's as quant_stored.install left them in this scheme, stay); returns it.
    A shape the scheme cannot take is refused (UsageError) before anything is replaced."""
    device = next(model.parameters()).device
    check_device(scheme, device)
    if getattr(model, "weights", "auto") != "auto":
        raise UsageError(f"the model's projections are {model.weights} already")
    kernel = "_weight_int8pack_mm" if scheme == "int8" else "_weight_int4pack_mm_for_cpu"
    if device.type == "cpu" and not hasattr(torch.ops.aten, kernel):
        raise UsageError(f"--weights {scheme} needs torch >= 2.6 (its {kernel}); this is torch {torch.__version__}")
    layer = model.model.layers[0]
    for parent in (layer.self_attn, layer.mlp):
        for name in PROJECTIONS:
            p = getattr(parent, name, None)
            problem = p is not None and shape_problem(scheme, p.in_features, p.out_features, device.type)
            if problem:
                raise UsageError(f"--weights {scheme}: {name}: {problem}")
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in PROJECTIONS:
                p = getattr(parent, name, None)
                if p is not None and not isinstance(p, QuantLinear):
                    setattr(parent, name, QuantLinear(p, scheme))
    model.weights = scheme
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes a decode step reads of the model's weights: its parameters and buffers, but an untied input
    embedding table (a step reads one row of it)."""
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    total = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())
                if t.device.type != "meta")
    table = model.model.embed_tokens.weight
    return total - (0 if tied else table.numel() * table.element_size())
