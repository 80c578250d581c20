"""Block floating point and dynamic fixed point (docs/spec.md §1, 1.1, 1.2)."""

from __future__ import annotations

import re

import torch

from .base import Format, PackedTensor, check_input, check_int_range, register
from .dispatch import select_path


@register
class BFP(Format):
    """``bfp<m>[e<E>][b<B>]``: blocks of B values share one E-bit exponent; m bits per element.

    Along ``axis``, consecutive blocks of B elements (a trailing partial block is a block).
    For each block: a NaN or infinity makes the whole block NaN; a = max |x_i|; if a == 0 the
    block is zero; e = clamp(floor(log2 a), -(2^(E-1)-1), 2^(E-1)-1); scale = 2^(e - (m-2));
    q_i = clamp(R(x_i / scale), -(2^(m-1)-1), 2^(m-1)-1) * scale.
    So the largest element keeps m-1 magnitude bits (its leading one included) and the sign.
    Storage: m-bit sign-magnitude mantissas plus one E-bit exponent per block:
    ``bits_per_value = m + E / B``.
    """

    pattern = re.compile(r"bfp(\d+)(?:e(\d+))?(?:b(\d+))?")

    def __init__(self, man_bits: int, exp_bits: int = 8, block: int | None = 16) -> None:
        self.man_bits = man_bits
        self.exp_bits = exp_bits
        self.block = block
        self.spec = f"bfp{man_bits}e{exp_bits}b{block}"
        self.bits_per_value = man_bits + exp_bits / block if block else float(man_bits)
        # |q| <= 2^(m-1) - 1 times a power of two: m - 1 significant bits
        self.significant_bits = man_bits - 1

    @classmethod
    def from_match(cls, spec, match):
        m = check_int_range(spec, "m", int(match[1]), 2, 24)
        e = check_int_range(spec, "E", int(match[2] or 8), 2, 10)
        b = check_int_range(spec, "B", int(match[3] or 16), 1, 4096)
        return cls(m, e, b)

    def _args(self):
        return self.man_bits, self.exp_bits, self.block

    def quantize(self, x, axis=-1, rounding="nearest", generator=None, *, backend=None):
        axis = check_input(x, axis, rounding, generator)
        with torch.no_grad():
            path = select_path(x, backend)
            return path.bfp_quantize(x, *self._args(), axis, rounding, generator)

    def pack(self, x, axis=-1, rounding="nearest", generator=None, *, backend=None):
        axis = check_input(x, axis, rounding, generator)
        with torch.no_grad():
            path = select_path(x, backend)
            mantissas, exponents = path.bfp_pack(x, *self._args(), axis, rounding, generator)
        payload = {"mantissas": mantissas, "exponents": exponents}
        return PackedTensor(self, tuple(x.shape), x.dtype, axis, payload)

    def _fused(self, pair: str, x, axis, other, other_axis, backend):
        """(the path's ``bfp_<pair>`` run on x, ``other_axis`` made non-negative), or None when
        the path has no such pair or ``fusable_<pair>`` says it does not cover the two formats
        and axes (both take (x, args, axis, other args, other axis))."""
        axis = check_input(x, axis, "nearest", None)
        other_axis = check_input(x, other_axis, "nearest", None)
        path = select_path(x, backend)
        fused = getattr(path, f"bfp_{pair}", None)
        if fused is None or not isinstance(other, BFP):
            return None
        args = (x, self._args(), axis, other._args(), other_axis)
        if not getattr(path, f"fusable_{pair}")(*args):
            return None
        with torch.no_grad():
            return fused(*args), other_axis

    def quantize_and_pack(
        self, x, axis, stash, stash_axis, *, rounding="nearest", stash_rounding="nearest",
        generator=None, stash_generator=None, backend=None,
    ):  # fmt: skip
        if rounding == stash_rounding == "nearest":  # the fused kernels round to nearest
            out = self._fused("quantize_and_pack", x, axis, stash, stash_axis, backend)
            if out is not None:
                (values, mantissas, exponents), stash_axis = out
                payload = {"mantissas": mantissas, "exponents": exponents}
                return values, PackedTensor(stash, tuple(x.shape), x.dtype, stash_axis, payload)
        return super().quantize_and_pack(
            x, axis, stash, stash_axis, rounding=rounding, stash_rounding=stash_rounding,
            generator=generator, stash_generator=stash_generator, backend=backend,
        )  # fmt: skip

    def quantize_chain(
        self, x, axis, second, second_axis, *, rounding="nearest", second_rounding="nearest",
        generator=None, second_generator=None, backend=None,
    ):  # fmt: skip
        if rounding == second_rounding == "nearest":  # the fused kernels round to nearest
            out = self._fused("quantize_chain", x, axis, second, second_axis, backend)
            if out is not None:
                return out[0]
        return super().quantize_chain(
            x, axis, second, second_axis, rounding=rounding, second_rounding=second_rounding,
            generator=generator, second_generator=second_generator, backend=backend,
        )  # fmt: skip

    def _unpack(self, packed, backend=None):
        p = packed.payload
        with torch.no_grad():
            # a probe of the stored tensor's size: an empty one unpacks on the reference, as it
            # packed there (the fast paths assume at least one element)
            probe = p["mantissas"].new_empty(min(packed.numel(), 1), dtype=torch.float32)
            path = select_path(probe, backend)
            return path.bfp_unpack(
                p["mantissas"],
                p["exponents"],
                *self._args(),
                packed.shape,
                packed.axis,
                packed.dtype,
            )


@register
class FixedDynamic(BFP):
    """``fixed<w>``: dynamic fixed point, exactly ``bfp<w>`` with one block spanning the tensor.

    One 8-bit exponent for the whole tensor (``axis`` is irrelevant); w-bit sign-magnitude
    mantissas. ``bits_per_value = w`` (the single exponent is not counted per value).
    """

    pattern = re.compile(r"fixed(\d+)")

    def __init__(self, width: int) -> None:
        super().__init__(width, 8, None)
        self.spec = f"fixed{width}"
        self.bits_per_value = float(width)

    @classmethod
    def from_match(cls, spec, match):
        return cls(check_int_range(spec, "w", int(match[1]), 2, 32))
