"""Fixed point (docs/formats.md): dynamic, ``fixed<w>`` (BFP with one block spanning the tensor,
so BFP's kernels run it), and static, ``fixed<w>f<f>`` (its own kernels)."""

from __future__ import annotations

import re

import torch

from . import fixed_reference as reference
from .backends import declare_family, kernel_for, register_kernels
from .base import Format, PackedTensor, check_input, check_int_range, register
from .bfp import BFP

register_kernels("reference", "fixed_static", reference.KERNEL_NAMES, vars(reference))
declare_family("fixed_static", {
    "compile": "dsq.formats.fixed_compile",
    "c": "dsq.formats.fixed_c",
    "triton": "dsq.formats.fixed_triton",
})  # fmt: skip


@register
class FixedDynamic(BFP):
    """``fixed<w>``: dynamic fixed point, exactly ``bfp<w>`` with one block spanning the tensor.

    One 8-bit exponent for the whole tensor (``axis`` is irrelevant); w-bit sign-magnitude
    mantissas. ``bits_per_value = w`` (the single exponent is not counted per value).
    """

    pattern = re.compile(r"fixed(\d+)")
    grammar = "fixed<w> (2<=w<=32)"

    def __init__(self, width: int) -> None:
        super().__init__(width, 8, None)
        self.spec = f"fixed{width}"
        self.bits_per_value = float(width)

    @classmethod
    def from_match(cls, spec, match):
        return cls(check_int_range(spec, "w", int(match[1]), 2, 32))


@register
class FixedStatic(Format):
    """``fixed<w>f<f>``: w-bit two's complement with f fractional bits.

    ``q = clamp(R(x * 2^f), -2^(w-1), 2^(w-1)-1) / 2^f``; NaN and infinities become NaN.
    Zero is +0.0 (two's complement has no -0). For w >= 26 the upper clamp bound is not a
    float32 and the exact value is rounded to the nearest float32. Storage: w bits per value,
    plus a 1-bit-per-value NaN mask only when the tensor holds NaN or infinity.
    """

    pattern = re.compile(r"fixed(\d+)f(\d+)")
    grammar = "fixed<w>f<f> (2<=w<=32, 0<=f<w)"
    family = "fixed_static"

    def __init__(self, width: int, frac_bits: int) -> None:
        self.width = width
        self.frac_bits = frac_bits
        self.spec = f"fixed{width}f{frac_bits}"
        self.bits_per_value = float(width)
        # integers of magnitude at most 2^(w-1) over 2^f: -2^(w-1) has one significant bit, the
        # others at most w - 1
        self.significant_bits = max(1, width - 1)
        self.cost_width = width

    @classmethod
    def from_match(cls, spec, match):
        w = check_int_range(spec, "w", int(match[1]), 2, 32)
        f = check_int_range(spec, "f", int(match[2]), 0, w - 1)
        return cls(w, f)

    def quantize(self, x, axis=-1, rounding="nearest", generator=None, *, backend=None):
        check_input(x, axis, rounding, generator)
        with torch.no_grad():
            run = kernel_for(x, backend, self.family, "quantize")
            return run(x, self.width, self.frac_bits, rounding, generator)

    def pack(self, x, axis=-1, rounding="nearest", generator=None, *, backend=None):
        axis = check_input(x, axis, rounding, generator)
        with torch.no_grad():
            run = kernel_for(x, backend, self.family, "pack")
            integers, nan_mask = run(x, self.width, self.frac_bits, rounding, generator)
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
            run = kernel_for(probe, backend, self.family, "unpack")
            return run(
                p["integers"],
                p.get("nan_mask"),
                self.width,
                self.frac_bits,
                packed.shape,
                packed.dtype,
            )
