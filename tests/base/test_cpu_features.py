"""Whether the CPU computes bfloat16 natively (tforce/cpu_features.py), from /proc/cpuinfo's text."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from tforce import cpu_features
from tforce.cli import app

X86 = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse2 avx2 avx512f {extra}\nbogomips\t: 4000\n"
ARM = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd sve {extra}\nCPU implementer\t: 0x41\n"


@pytest.mark.parametrize("text, expected", [
    (X86.format(extra=""), False),  # AVX512 without its BF16 extension (and this container's AVX2 EPYC)
    (X86.format(extra="avx512_bf16"), True),  # Cooper Lake, Zen 4
    (X86.format(extra="amx_bf16 amx_tile"), True),  # Sapphire Rapids
    (ARM.format(extra=""), False),
    (ARM.format(extra="bf16 i8mm"), True),  # Graviton 3, Neoverse V1
    ("processor\t: 0\n", None),  # no flags line: unknown
])
def test_bf16_from_the_flags(text, expected):
    assert cpu_features.native_bf16(text) is expected


def test_unknown_without_cpuinfo(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_features, "CPUINFO", tmp_path / "absent")
    assert cpu_features.native_bf16() is None and cpu_features.flags() is None


def test_flags_of_the_first_processor_only():
    two = X86.format(extra="") + "\n" + X86.format(extra="avx512_bf16")
    assert "avx512_bf16" not in cpu_features.flags(two)


@pytest.mark.parametrize("native, shown", [(True, "bfloat16 native"), (False, "bfloat16 emulated"),
                                           (None, "bfloat16 unknown")])
def test_info_says_it(monkeypatch, native, shown):
    monkeypatch.setattr(cpu_features, "native_bf16", lambda text=None: native)
    runner = CliRunner()
    r = runner.invoke(app, ["info", "--json"])
    assert r.exit_code == 0, r.output
    cpu = json.loads(r.stdout)["cpu"]
    assert cpu["bf16_native"] is native and cpu["capability"]  # e.g. "AVX2"
    r = runner.invoke(app, ["info"], terminal_width=200)
    assert r.exit_code == 0 and shown in " ".join(r.stdout.split()), r.stdout
