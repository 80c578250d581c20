"""Block floating point and dynamic fixed point (docs/spec.md §1, 1.1, 1.2)."""

from __future__ import annotations

import re

import torch

from .backends import select_backend
from .base import Format, PackedTensor, check_input, check_int_range, register


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
            path = select_backend(x, backend)
            return path.bfp_quantize(x, *self._args(), axis, rounding, generator)

    def pack(self, x, axis=-1, rounding="nearest", generator=None, *, backend=None):
        axis = check_input(x, axis, rounding, generator)
        with torch.no_grad():
            path = select_backend(x, backend)
            mantissas, exponents = path.bfp_pack(x, *self._args(), axis, rounding, generator)
        payload = {"mantissas": mantissas, "exponents": exponents}
        return PackedTensor(self, tuple(x.shape), x.dtype, axis, payload)

    def _pair(self, x, axis, other, other_axis, backend):
        """(the backend to run the pair on, its arguments (x, args, axis, other args, other axis)
        with both axes made non-negative), or None when ``other`` is not BFP: only BFP pairs
        have fused kernels."""
        if not isinstance(other, BFP):
            return None
        axis = check_input(x, axis, "nearest", None)
        other_axis = check_input(x, other_axis, "nearest", None)
        return select_backend(x, backend), (x, self._args(), axis, other._args(), other_axis)

    def quantize_and_pack(
        self, x, axis, stash, stash_axis, *, rounding="nearest", stash_rounding="nearest",
        generator=None, stash_generator=None, backend=None,
    ):  # fmt: skip
        pair = self._pair(x, axis, stash, stash_axis, backend)
        # the fused kernels round to nearest
        if rounding == stash_rounding == "nearest" and pair is not None:
            path, args = pair
            if path.fusable_quantize_and_pack(*args):
                with torch.no_grad():
                    values, mantissas, exponents = path.bfp_quantize_and_pack(*args)
                payload = {"mantissas": mantissas, "exponents": exponents}
                return values, PackedTensor(stash, tuple(x.shape), x.dtype, args[-1], payload)
        return super().quantize_and_pack(
            x, axis, stash, stash_axis, rounding=rounding, stash_rounding=stash_rounding,
            generator=generator, stash_generator=stash_generator, backend=backend,
        )  # fmt: skip

    def quantize_chain(
        self, x, axis, second, second_axis, *, rounding="nearest", second_rounding="nearest",
        generator=None, second_generator=None, backend=None,
    ):  # fmt: skip
        pair = self._pair(x, axis, second, second_axis, backend)
        if rounding == second_rounding == "nearest" and pair is not None:
            path, args = pair
            if path.fusable_quantize_chain(*args):
                with torch.no_grad():
                    return path.bfp_quantize_chain(*args)
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
            path = select_backend(probe, backend)
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
