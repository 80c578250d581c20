"""Block floating point (docs/formats.md; docs/spec.md, "BFP quantization", "Packed storage").

``fixed<w>``, one block spanning the tensor, is a BFP format kept with fixed point (fixed.py)."""

from __future__ import annotations

import re

import torch

from . import bfp_reference as reference
from .backends import declare_family, kernel_for, register_kernels
from .base import Format, PackedTensor, check_input, check_int_range, register

# The definition (bfp_reference.py) is the family's reference kernels; each backend's are in a
# module of their own, declared below and imported when that backend first runs the family.
register_kernels("reference", "bfp", reference.KERNEL_NAMES, vars(reference))
declare_family("bfp", {
    "compile": "dsq.formats.bfp_compile",
    "c": "dsq.formats.bfp_c",
    "triton": "dsq.formats.bfp_triton",
})  # fmt: skip


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
    grammar = "bfp<m>[e<E>][b<B>] (2<=m<=24, 2<=E<=10, 1<=B<=4096)"
    family = "bfp"

    def __init__(self, man_bits: int, exp_bits: int = 8, block: int | None = 16) -> None:
        self.man_bits = man_bits
        self.exp_bits = exp_bits
        self.block = block
        self.spec = f"bfp{man_bits}e{exp_bits}b{block}"
        self.bits_per_value = man_bits + exp_bits / block if block else float(man_bits)
        # |q| <= 2^(m-1) - 1 times a power of two: m - 1 significant bits
        self.significant_bits = man_bits - 1
        # the m-bit mantissas multiply; the shared exponents add, once per block (left out)
        self.cost_width = man_bits

    @property
    def whole_tensor_scale(self) -> bool:  # no block: one exponent spans the tensor (fixed<w>)
        return self.block is None

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
            run = kernel_for(x, backend, self.family, "quantize")
            return run(x, *self._args(), axis, rounding, generator)

    def pack(self, x, axis=-1, rounding="nearest", generator=None, *, backend=None):
        axis = check_input(x, axis, rounding, generator)
        with torch.no_grad():
            run = kernel_for(x, backend, self.family, "pack")
            mantissas, exponents = run(x, *self._args(), axis, rounding, generator)
        payload = {"mantissas": mantissas, "exponents": exponents}
        return PackedTensor(self, tuple(x.shape), x.dtype, axis, payload)

    def _pair(self, x, axis, other, other_axis, backend, op):
        """(the fusability test and the fused kernel of pair ``op`` on the backend that runs x,
        its arguments (x, args, axis, other args, other axis) with both axes made
        non-negative), or None when ``other`` is not BFP: only BFP pairs have fused kernels."""
        if not isinstance(other, BFP):
            return None
        axis = check_input(x, axis, "nearest", None)
        other_axis = check_input(x, other_axis, "nearest", None)
        fusable = kernel_for(x, backend, self.family, f"fusable_{op}")
        fused = kernel_for(x, backend, self.family, op)
        return fusable, fused, (x, self._args(), axis, other._args(), other_axis)

    def quantize_and_pack(
        self, x, axis, stash, stash_axis, *, rounding="nearest", stash_rounding="nearest",
        generator=None, stash_generator=None, backend=None,
    ):  # fmt: skip
        pair = self._pair(x, axis, stash, stash_axis, backend, "quantize_and_pack")
        # the fused kernels round to nearest
        if rounding == stash_rounding == "nearest" and pair is not None:
            fusable, fused, args = pair
            if fusable(*args):
                with torch.no_grad():
                    values, mantissas, exponents = fused(*args)
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
        pair = self._pair(x, axis, second, second_axis, backend, "quantize_chain")
        if rounding == second_rounding == "nearest" and pair is not None:
            fusable, fused, args = pair
            if fusable(*args):
                with torch.no_grad():
                    return fused(*args)
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
            run = kernel_for(probe, backend, self.family, "unpack")
            return run(
                p["mantissas"],
                p["exponents"],
                *self._args(),
                packed.shape,
                packed.axis,
                packed.dtype,
            )
