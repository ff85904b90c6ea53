"""host_tensor (cache/offload.py) with a stand-in for torch.cuda.cudart(): what it registers, when it
unregisters, and what a failed registration leaves behind (the real calls: tests/gpu/test_cuda.py)."""
from __future__ import annotations

import gc

import pytest
import torch

from tforce.cache import offload
from tforce.errors import TforceError


class _Cudart:
    def __init__(self, register_error=0):
        self.register_error, self.calls = register_error, []

    def cudaHostRegister(self, ptr, size, flags):
        self.calls.append(("register", ptr, size))
        if self.register_error:
            self.last_error = self.register_error  # the runtime keeps it as its last error
        return self.register_error

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return 0

    def cudaGetLastError(self):
        self.calls.append(("get_last_error",))
        error, self.last_error = getattr(self, "last_error", 0), 0
        return error


@pytest.fixture
def cudart(monkeypatch):
    fake = _Cudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: fake.calls.append(("synchronize",)))
    return fake


def test_registers_exactly_its_bytes_and_unregisters_when_freed(cudart):
    t = offload.host_tensor((2, 3, 4), torch.bfloat16, pin_for=torch.device("cuda"))
    ptr = t.data_ptr()
    assert cudart.calls == [("register", ptr, 2 * 3 * 4 * 2)] and not t.any()
    del t
    gc.collect()
    assert cudart.calls[1:] == [("synchronize",), ("unregister", ptr)]  # no copy may still use the pages


def test_a_failed_registration_raises_and_leaves_no_cuda_error_behind(cudart):
    # cudaHostRegister's error stays the runtime's "last error" until read: PyTorch's check after the next
    # kernel launch would then fail an unrelated operation with it.
    cudart.register_error = 2  # cudaErrorMemoryAllocation
    with pytest.raises(TforceError, match="cannot pin"):
        offload.host_tensor((1024,), torch.float32, pin_for=torch.device("cuda"))
    assert cudart.calls[-1] == ("get_last_error",) and cudart.last_error == 0


def test_no_pinning_without_a_cuda_device(cudart):
    t = offload.host_tensor((5,), torch.float32)
    assert cudart.calls == [] and t.shape == (5,)
