"""Tensor comparisons stricter than torch.testing's defaults."""

from __future__ import annotations

import torch


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
