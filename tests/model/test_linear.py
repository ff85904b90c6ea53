"""linear / Linear (W @ x^T for a few float32 rows on the CPU) against F.linear / nn.Linear."""
from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tforce.model.linear import Linear, linear


@pytest.mark.parametrize("rows", [1, 2, 7, 64, 65, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_f_linear(rows, bias):
    """Every row count, with and without bias, in (B, T, in) form: the values of F.linear within float32
    rounding (another summation order), the same shape, contiguous."""
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(300, 96, generator=g), torch.randn(300, generator=g) if bias else None
    x = torch.randn(1, rows, 96, generator=g)
    got = linear(x, w, b)
    assert got.shape == (1, rows, 300) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-4, rtol=1e-5)


def test_other_dtypes_and_one_row_are_f_linear_exactly():
    """Outside the measured cases (float32 on the CPU: one row by a weight of 1 MiB or more, 2-64 rows) the
    product is F.linear's own, bit for bit: another dtype, a small weight, a prefill chunk, one thread."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, generator=g)
    for x, weight in ((torch.randn(1, 7, 32, generator=g).bfloat16(), w.bfloat16()),
                      (torch.randn(1, 1, 32, generator=g), w),
                      (torch.randn(1, 512, 32, generator=g), w)):
        assert torch.equal(linear(x, weight), F.linear(x, weight))
    big, x = torch.randn(1024, 256, generator=g), torch.randn(1, 1, 256, generator=g)
    with threads(1):
        assert torch.equal(linear(x, big), F.linear(x, big))


@pytest.mark.parametrize("bias", [False, True])
def test_one_row_split_across_threads(bias, monkeypatch):
    """One row by a large weight on 2 threads: the weight's row blocks as one batched product (module
    docstring); F.linear's values within float32 rounding, in the caller's shape. A weight whose rows do not
    divide into the threads' blocks takes F.linear."""
    batched, bmm = [], torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda a, b: batched.append(a.shape) or bmm(a, b))
    g = torch.Generator().manual_seed(1)
    for rows_of_w in (1024, 1023):
        w = torch.randn(rows_of_w, 256, generator=g)
        b = torch.randn(rows_of_w, generator=g) if bias else None
        x = torch.randn(1, 1, 256, generator=g)
        with threads(2):
            got = linear(x, w, b)
        assert got.shape == (1, 1, rows_of_w) and got.is_contiguous()
        torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-4, rtol=1e-5)
        if rows_of_w % 2:
            assert torch.equal(got, F.linear(x, w, b))
    assert batched == [(2, 512, 256)]  # the 1024-row weight only, as two blocks


@contextmanager
def threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_linear_module_keeps_nn_linear_parameters():
    """Checkpoints load into Linear as into nn.Linear: the same state-dict names and shapes."""
    plain, ours = nn.Linear(8, 4), Linear(8, 4)
    ours.load_state_dict(plain.state_dict())
    assert ours.state_dict().keys() == plain.state_dict().keys()
    x = torch.randn(3, 8)
    torch.testing.assert_close(ours(x), plain(x))
