"""The c backend: the C kernels (torch custom ops ``dsq::*``, ``dsq.kernels.cpu``) for CPU tensors.

This module holds what only the backend knows, and no family's kernels: whether it runs here
(`unavailable_reason`: the compile backend's reason, as every call the C kernels do not hold runs
the compile backend's kernels, or why the C kernels do not build) and its bit packer for the
codes' second stage (`pack_codes`), handed to the compile backend's kernels. The families' C
kernels are in their own modules, declared with their family (``bfp_c.py``, ``fixed_c.py``,
``mx_c.py``); docs/formats.md, "The C kernels", says which calls they hold.
"""

from __future__ import annotations

import torch

from dsq.kernels import cpu

from . import backend_compile
from .memo import memo


@memo
def unavailable_reason(device_type: str) -> str | None:
    """Why this backend cannot run tensors of ``device_type`` here (the compile backend's reason,
    as it runs the calls the C kernels do not hold, or why the kernels do not build), or None."""
    return backend_compile.unavailable_reason(device_type) or cpu.build_failure()


def pack_codes(codes: torch.Tensor, width: int) -> torch.Tensor:
    """The compile backend's stage 2 of pack (`backend_compile.code_stream`), with one-byte codes
    of other widths than 8 packed by the C kernels."""
    if codes.dtype == torch.uint8 and width < 8:
        return cpu.pack_codes(codes.contiguous(), width)
    return backend_compile.code_stream(codes, width)
