"""The triton backend: the families' Triton kernels (``dsq.kernels``), for CUDA tensors, or CPU
tensors with ``TRITON_INTERPRET=1`` set before Triton is imported (tests).

This module holds what only the backend knows, and no family's kernels: whether it runs here
(`unavailable_reason`; without triton installed the module still loads and says why), and the
host-side preparation every family's kernels share: stochastic rounding's noise drawn with
``exact.uniform_noise`` (the same draws as every backend: one per element of ``x``, row-major in
``x``'s shape), and flat contiguous inputs. The families' kernels are in their own modules,
declared with their family (``bfp_triton.py``, ``fixed_triton.py``, ``mx_triton.py``). Empty
tensors never reach this backend (``backends.select_backend`` sends them to the reference).
"""

from __future__ import annotations

import os

import torch

try:  # the families' kernel modules: one that does not import makes the backend unavailable
    import dsq.kernels.bfp  # noqa: F401
    import dsq.kernels.mx  # noqa: F401
except Exception as err:  # triton is optional, and a broken install can raise anything
    _import_error: Exception | None = err
else:
    _import_error = None

from . import exact


def unavailable_reason(device_type: str) -> str | None:
    """Why the Triton kernels cannot run tensors of ``device_type`` here, or None when they can."""
    if _import_error is not None:
        return f"the Triton kernels do not import ({_import_error})"
    if device_type == "cuda":
        return None
    if device_type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return (
        f"the Triton kernels need CUDA tensors (got {device_type}; "
        "TRITON_INTERPRET=1 runs them on CPU)"
    )


def _stochastic(rounding: str) -> bool:
    if rounding == "nearest":
        return False
    if rounding == "stochastic":
        return True
    raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")


def noise(x: torch.Tensor, rounding: str, generator) -> torch.Tensor | None:
    return exact.uniform_noise(x, generator) if _stochastic(rounding) else None


def flat(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous().reshape(-1)
