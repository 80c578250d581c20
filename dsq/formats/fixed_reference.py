"""Static fixed point's definition (``fixed<w>f<f>``, fixed.py): docs/spec.md §1 written as
PyTorch, the family's reference kernels, registered by fixed.py. As BFP's (bfp_reference.py), the
arithmetic is float64 on inputs first made float32, and stochastic rounding draws one
``exact.uniform_noise`` value per element; two's complement has no -0.0.
"""

from __future__ import annotations

import math

import torch

from . import exact


def fixed_static_integers(
    x: torch.Tensor, width: int, frac_bits: int, rounding: str, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(integers, finite) with integers = clamp(R(x * 2^f), -2^(w-1), 2^(w-1)-1), in float64."""
    xd = exact.exact_float64(x)
    u = exact.uniform_noise(x, generator) if rounding == "stochastic" else None
    finite = torch.isfinite(xd)
    v = torch.where(finite, xd, torch.zeros_like(xd)) * 2.0**frac_bits
    q = exact.apply_rounding(v, rounding, u)
    q = q.clamp(-(2.0 ** (width - 1)), 2.0 ** (width - 1) - 1)
    return q + 0.0, finite  # + 0.0 turns -0.0 into +0.0: two's complement has one zero


def fixed_static_quantize(
    x: torch.Tensor, width: int, frac_bits: int, rounding: str, generator: torch.Generator | None
) -> torch.Tensor:
    q, finite = fixed_static_integers(x, width, frac_bits, rounding, generator)
    values = torch.where(finite, q * 2.0**-frac_bits, math.nan)
    # w >= 26 only: the clamp bound 2^(w-1)-1 is not a float32; the exact value is rounded.
    return values.to(torch.float32).to(x.dtype)


def fixed_static_pack(x, width, frac_bits, rounding="nearest", generator=None):
    """(two's-complement stream of w bits per element, NaN bitmask stream or None). On the meta
    device, which has shapes and no values, the payload of a tensor of numbers (no mask): what
    a stash of that shape holds, for the accounting's records (docs/dsq.md, "The MLP in
    slices")."""
    q, finite = fixed_static_integers(x, width, frac_bits, rounding, generator)
    codes = q.to(torch.int64).reshape(-1) & ((1 << width) - 1)
    nan_mask = None
    if x.device.type != "meta" and not bool(finite.all()):
        nan_mask = exact.pack_bits((~finite).reshape(-1).to(torch.int64), 1)
    return exact.pack_bits(codes, width), nan_mask


def fixed_static_unpack(integers, nan_mask, width, frac_bits, shape, dtype):
    numel = math.prod(shape)
    codes = exact.unpack_bits(integers, width, numel)
    signed = codes - ((codes >> (width - 1)) << width)  # sign-extend two's complement
    values = signed.to(torch.float64) * 2.0**-frac_bits
    if nan_mask is not None:
        values = torch.where(exact.unpack_bits(nan_mask, 1, numel).bool(), math.nan, values)
    return values.reshape(shape).to(torch.float32).to(dtype)


# The family's operations and the name of each one's function, in this module as in every
# backend's module of static fixed-point kernels (backends.register_kernels)
KERNEL_NAMES = {
    "quantize": "fixed_static_quantize",
    "pack": "fixed_static_pack",
    "unpack": "fixed_static_unpack",
}
