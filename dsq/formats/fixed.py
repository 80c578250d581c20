"""Static fixed point (docs/spec.md §1): ``fixed<w>f<f>``."""

from __future__ import annotations

import re

import torch

from .backends import select_backend
from .base import Format, PackedTensor, check_input, check_int_range, register


@register
class FixedStatic(Format):
    """``fixed<w>f<f>``: w-bit two's complement with f fractional bits.

    ``q = clamp(R(x * 2^f), -2^(w-1), 2^(w-1)-1) / 2^f``; NaN and infinities become NaN.
    Zero is +0.0 (two's complement has no -0). For w >= 26 the upper clamp bound is not a
    float32 and the exact value is rounded to the nearest float32. Storage: w bits per value,
    plus a 1-bit-per-value NaN mask only when the tensor holds NaN or infinity.
    """

    pattern = re.compile(r"fixed(\d+)f(\d+)")

    def __init__(self, width: int, frac_bits: int) -> None:
        self.width = width
        self.frac_bits = frac_bits
        self.spec = f"fixed{width}f{frac_bits}"
        self.bits_per_value = float(width)
        # integers of magnitude at most 2^(w-1) over 2^f: -2^(w-1) has one significant bit, the
        # others at most w - 1
        self.significant_bits = max(1, width - 1)

    @classmethod
    def from_match(cls, spec, match):
        w = check_int_range(spec, "w", int(match[1]), 2, 32)
        f = check_int_range(spec, "f", int(match[2]), 0, w - 1)
        return cls(w, f)

    def quantize(self, x, axis=-1, rounding="nearest", generator=None, *, backend=None):
        check_input(x, axis, rounding, generator)
        with torch.no_grad():
            path = select_backend(x, backend)
            return path.fixed_static_quantize(x, self.width, self.frac_bits, rounding, generator)

    def pack(self, x, axis=-1, rounding="nearest", generator=None, *, backend=None):
        axis = check_input(x, axis, rounding, generator)
        with torch.no_grad():
            path = select_backend(x, backend)
            integers, nan_mask = path.fixed_static_pack(
                x, self.width, self.frac_bits, rounding, generator
            )
        payload = {"integers": integers}
        if nan_mask is not None:
            payload["nan_mask"] = nan_mask
        return PackedTensor(self, tuple(x.shape), x.dtype, axis, payload)

    def _unpack(self, packed, backend=None):
        p = packed.payload
        with torch.no_grad():
            # a probe of the stored tensor's size: an empty one unpacks on the reference, as it
            # packed there (the fast paths assume at least one element)
            probe = p["integers"].new_empty(min(packed.numel(), 1), dtype=torch.float32)
            path = select_backend(probe, backend)
            return path.fixed_static_unpack(
                p["integers"],
                p.get("nan_mask"),
                self.width,
                self.frac_bits,
                packed.shape,
                packed.dtype,
            )
