"""Whether this CPU computes bfloat16 natively, read from the kernel's description of it.

bfloat16 halves the bytes a CPU forward reads (weights and KV cache), but its matrix products are fast only
where the CPU has instructions for them: AVX512-BF16 or AMX-BF16 on x86, the BF16 extension on Arm.
Elsewhere oneDNN emulates them through float32 and the compute-bound parts of a run (the prefill) get
slower. `tforce info` and `tforce bench`'s report say which case a machine is; the CPU default stays
float32 (the rule for defaults wants a measurement on such a CPU beside transformers, which is still to be
made: BENCHMARKS.md).
"""
from __future__ import annotations

from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86 "flags"; Arm's "Features" says "bf16"


def flags(text: str | None = None) -> set[str] | None:
    """The first processor's flags (x86 `flags`, Arm `Features`), or None where /proc/cpuinfo or that line is
    not there."""
    if text is None:
        try:
            text = CPUINFO.read_text(errors="replace")
        except OSError:
            return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return None  # a processor that lists no flags there (some VMs, other architectures): unknown


def native_bf16(text: str | None = None) -> bool | None:
    """True where the CPU has bfloat16 matrix instructions, False where it has none, None where unknown."""
    found = flags(text)
    return None if found is None else bool(found & BF16_FLAGS)


def describe() -> dict:
    """{"capability": torch's kernel level (e.g. AVX2, AVX512), "bf16_native": bool | None}."""
    import torch

    return {"capability": torch.backends.cpu.get_cpu_capability(), "bf16_native": native_bf16()}
