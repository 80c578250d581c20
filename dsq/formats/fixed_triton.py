"""Static fixed point's kernels on the triton backend (backend_triton.py; ``dsq.kernels.bfp``
holds them beside BFP's), bit for bit the reference's."""

from __future__ import annotations

import math

import torch

try:
    from dsq.kernels import bfp as kernels
except Exception:  # triton is optional (backend_triton.py says why it cannot run)
    kernels = None

from . import fixed_reference
from .backend_triton import flat, noise
from .backends import register_kernels


def fixed_static_quantize(x, width, frac_bits, rounding="nearest", generator=None):
    u = noise(x, rounding, generator)
    out = kernels.fixed_quantize(flat(x.to(torch.float32)), flat(u), width, frac_bits)
    return out.reshape(x.shape).to(x.dtype)


def fixed_static_pack(x, width, frac_bits, rounding="nearest", generator=None):
    """(two's-complement stream of w bits per element, NaN bitmask stream or None)."""
    u = noise(x, rounding, generator)
    stream, nan_mask = kernels.fixed_pack(flat(x.to(torch.float32)), flat(u), width, frac_bits)
    if not bool(nan_mask.any()):  # the only host sync: the return type depends on it
        nan_mask = None
    return stream, nan_mask


def fixed_static_unpack(integers, nan_mask, width, frac_bits, shape, dtype):
    shape = tuple(shape)
    integers = integers.contiguous()
    nan_mask = None if nan_mask is None else nan_mask.contiguous()
    out = kernels.fixed_unpack(
        integers, nan_mask, math.prod(shape), width, frac_bits, integers.device
    )
    return out.reshape(shape).to(dtype)


register_kernels("triton", "fixed_static", fixed_reference.KERNEL_NAMES, globals())
