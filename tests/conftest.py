"""Shared test helpers.

Triton kernels run on CPU tensors under TRITON_INTERPRET=1; set it before anything imports
triton, unless a GPU is present (then the kernels run for real on CUDA tensors).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, msg: str = "") -> None:
    """Equal bit for bit: same dtype and shape, same NaN positions, same bits elsewhere
    (so -0.0 and +0.0 differ)."""
    assert actual.dtype == expected.dtype, f"{msg}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{msg}: shape {actual.shape} != {expected.shape}"
    nan_a, nan_e = torch.isnan(actual), torch.isnan(expected)
    assert torch.equal(nan_a, nan_e), f"{msg}: NaN positions differ"
    a = actual.masked_fill(nan_a, 0).to(torch.float64)
    e = expected.masked_fill(nan_e, 0).to(torch.float64)
    torch.testing.assert_close(a, e, rtol=0, atol=0, msg=msg or None)
    assert torch.equal(torch.signbit(a), torch.signbit(e)), f"{msg}: signs of zero differ"


@pytest.fixture
def backend(request):
    """The path to pass as ``backend=`` for a test parametrized indirectly over path names;
    ``torch.compile`` is the compiled path with its C kernels switched off, so that the
    torch.compile kernels they replace stay tested."""
    if request.param != "torch.compile":
        yield request.param
        return
    from dsq_kernels import cpu

    with cpu.switched_off():
        yield "compiled"
