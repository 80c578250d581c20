"""The OCP Microscaling (MX) formats (docs/formats.md, "MX formats"): the family ``mx``.

``mx<element>[b<B>]``: blocks of B values (default 32) along an axis share one E8M0 scale
X = 2^s; each value keeps one element of a narrow type (``ELEMENTS``). For each block (a
trailing partial block is a block of its own):

1. a NaN or an infinity anywhere in the block makes the scale NaN (code 255): every element
   decodes as NaN;
2. a = max |x_i|; s = floor(log2 a) - emax, emax the exponent of the element type's largest
   power of two; a zero block takes s = -127 (any s gives zeros; this one is canonical);
3. s is clamped to [-127, 127], the E8M0 range (127 is never reached from a float32 input);
4. each q_i = X * E(x_i / X), E rounding to the nearest element value, ties to even, and
   saturating to the element type's largest normal (its largest finite value).

The element types are sign-magnitude minifloats (a value that rounds to zero keeps its sign),
and INT8, two's complement with an implicit scale 2^-6 whose range is kept symmetric
(-127/64 .. 127/64; its zero is +0.0). Storage: the elements bit-packed at their width, then one
byte per block: ``bits_per_value = w + 8 / B`` (mxfp4_e2m1: 4.25, mxfp6_*: 6.25, mxfp8_* and
mxint8: 8.25).

This module is the family's definition: the reference kernels below are registered under the
``reference`` backend; the faster kernels live in ``mx_c.py`` (the C kernels, ``c`` backend) and
``mx_triton.py`` (``triton``). They work in float64 as bfp_reference.py does: x / X and the
rounding are exact there, and every result q_i is a float32 number (an element of at most 7
significant bits times 2^s with s >= -127 lies on float32's grid, subnormals included).
"""

from __future__ import annotations

import dataclasses
import math
import re

import torch

from . import exact, layout
from .backends import declare_family, kernel_for, register_kernel
from .base import Format, PackedTensor, check_input, check_int_range, register

SCALE_BIAS = 127  # E8M0: code c is 2^(c - 127), c in [0, 254]; 255 is NaN
SCALE_NAN = 255
SCALE_MIN, SCALE_MAX = -127, 127


@dataclasses.dataclass(frozen=True)
class Element:
    """An element type: a sign-magnitude minifloat with ``exp_bits`` exponent and ``man_bits``
    mantissa bits (or INT8: ``integer``), its largest normal ``max_normal``.

    Its values are n * 2^(max(e, emin) - man_bits) for integers n, with e the value's own binade
    (floor(log2 |v|)) and emin the smallest normal exponent; INT8 is the same rule with emin = 0
    and man_bits = 6 (the grid 2^-6 below 2). ``emax`` is the exponent of the largest power of
    two, the OCP spec's emax_elem."""

    name: str
    bits: int
    exp_bits: int
    man_bits: int
    emin: int
    emax: int
    max_normal: float
    integer: bool = False

    @property
    def significant_bits(self) -> int:
        """Bits of the widest element value: its mantissa and the leading one (INT8: 7)."""
        return self.man_bits + 1

    @property
    def bias(self) -> int:
        return 1 - self.emin


ELEMENTS = {
    e.name: e
    for e in (
        # e4m3 has no infinity; its top code with all mantissa bits set is NaN: 448 = 1.75 * 2^8
        Element("fp8_e4m3", 8, 4, 3, -6, 8, 448.0),
        Element("fp8_e5m2", 8, 5, 2, -14, 15, 57344.0),
        Element("fp6_e3m2", 6, 3, 2, -2, 4, 28.0),
        Element("fp6_e2m3", 6, 2, 3, 0, 2, 7.5),
        Element("fp4_e2m1", 4, 2, 1, 0, 2, 6.0),
        Element("int8", 8, 0, 6, 0, 0, 127 / 64, integer=True),
    )
}


# ----------------------------------------------------------------------------- elements
def element_round(v: torch.Tensor, element: Element) -> torch.Tensor:
    """E(v): the nearest element value to float64 ``v`` (exact), ties to even, saturated to
    +-max_normal; the sign of a zero kept (INT8: +0.0). NaN stays NaN."""
    magnitude = v.abs()
    _, p = torch.frexp(magnitude)  # magnitude = f * 2^p, f in [0.5, 1): floor(log2) = p - 1
    k = torch.clamp(p.to(torch.int64) - 1, min=element.emin) - element.man_bits
    q = exact.round_nearest(v * exact.pow2(-k)) * exact.pow2(k)
    q = q.clamp(-element.max_normal, element.max_normal)
    return q + 0.0 if element.integer else q


def element_codes(q: torch.Tensor, element: Element) -> torch.Tensor:
    """The ``element.bits``-bit codes (int64) of element values ``q`` (float64, finite): for a
    minifloat, sign | biased exponent | mantissa, the bits of torch's float8 types for the fp8
    elements; for INT8, two's complement of 64 q."""
    if element.integer:
        return (q * 64).to(torch.int64) & 0xFF
    sign = torch.signbit(q).to(torch.int64) << (element.bits - 1)
    magnitude = q.abs()
    _, p = torch.frexp(magnitude)
    e = torch.clamp(p.to(torch.int64) - 1, min=element.emin)  # subnormals: the emin grid
    field = torch.where(magnitude >= 2.0**element.emin, e + element.bias, 0)
    scaled = (magnitude * exact.pow2(element.man_bits - e)).to(torch.int64)  # n, exact
    mantissa = scaled & ((1 << element.man_bits) - 1)
    return sign | (field << element.man_bits) | mantissa


def element_table(element: Element) -> torch.Tensor:
    """The value of every code, float64 [2^bits] (e4m3's NaN codes: NaN)."""
    codes = torch.arange(2**element.bits, dtype=torch.int64)
    if element.integer:
        return (codes - ((codes >> 7) << 8)).to(torch.float64) / 64
    sign = (codes >> (element.bits - 1)) & 1
    field = (codes >> element.man_bits) & ((1 << element.exp_bits) - 1)
    mantissa = (codes & ((1 << element.man_bits) - 1)).to(torch.float64)
    normal = field > 0
    n = torch.where(normal, mantissa + 2**element.man_bits, mantissa)
    e = torch.where(normal, field - element.bias, element.emin)
    values = n * exact.pow2(e - element.man_bits)
    values = torch.where(sign == 1, -values, values)
    if element.name == "fp8_e4m3":
        values = torch.where(codes & 0x7F == 0x7F, math.nan, values)
    return values


# ----------------------------------------------------------------------------- the definition
def mx_scales(blocks: torch.Tensor, element: Element) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, finite) per block of float64 ``blocks`` [..., B]: the scale exponent (int64, steps
    2-3 of the module docstring) and whether the block holds finite values only."""
    finite = torch.isfinite(blocks).all(dim=-1, keepdim=True)
    a = blocks.abs().amax(dim=-1, keepdim=True)
    a = torch.where(finite, a, torch.ones_like(a))
    s = torch.where(a > 0, exact.floor_log2(a) - element.emax, SCALE_MIN)
    return s.clamp(SCALE_MIN, SCALE_MAX), finite


def _encode(x: torch.Tensor, element: Element, block: int, axis: int):
    """(q, s, finite, n): the element values [..., n_blocks, B] (float64), scales and
    finiteness [..., n_blocks, 1] of x's blocks along ``axis``, and the axis length."""
    work, n = layout.blocks_along(exact.exact_float64(x), axis, block)
    s, finite = mx_scales(work, element)
    q = element_round(torch.where(finite, work, 0.0) * exact.pow2(-s), element)
    return q, s, finite, n


def quantize(x: torch.Tensor, element: str, block: int, axis: int) -> torch.Tensor:
    """The values of mx<element>b<block> of ``x`` along ``axis``, in x's shape and dtype."""
    if x.numel() == 0:
        return x.clone()
    q, s, finite, n = _encode(x, ELEMENTS[element], block, axis)
    values = torch.where(finite, q * exact.pow2(s), math.nan)
    return layout.unblock(values, n, x.shape, axis).to(torch.float32).to(x.dtype)


def encode(x: torch.Tensor, element: str, block: int, axis: int):
    """The codes ``pack`` stores, before bit-packing: (element codes, scale codes), int64 and
    flat. Element codes in row-major order of x with ``axis`` moved last (no padding), 0 in a
    block holding NaN or an infinity; one scale code per block in the same order, s + 127, or
    255 for such a block."""
    elem = ELEMENTS[element]
    q, s, finite, n = _encode(x, elem, block, axis)
    codes = torch.where(finite, element_codes(q, elem), 0)
    codes = codes.reshape(*codes.shape[:-2], -1)[..., :n].reshape(-1)
    scales = torch.where(finite, s + SCALE_BIAS, SCALE_NAN).reshape(-1)
    return codes, scales


def pack(x: torch.Tensor, element: str, block: int, axis: int):
    """(elements, scales): the element codes bit-packed at the element's width
    (``exact.pack_bits``: mxfp4 two per byte, the first in the low nibble; mxfp6 four in
    three bytes) and the scale codes, one uint8 per block."""
    if x.numel() == 0:
        empty = torch.empty(0, dtype=torch.uint8, device=x.device)
        return empty, empty.clone()
    codes, scales = encode(x, element, block, axis)
    return exact.pack_bits(codes, ELEMENTS[element].bits), scales.to(torch.uint8)


def block_index(shape: tuple[int, ...], axis: int, block: int, device) -> torch.Tensor:
    """For each element of a tensor of ``shape`` in row-major order with ``axis`` moved last,
    the index of its block in the same order (int64, flat)."""
    moved = layout.moved_shape(shape, axis)
    n = moved[-1]
    rows = math.prod(moved) // max(n, 1)
    n_blocks = max(1, -(-n // block))
    within = torch.arange(n, device=device) // block
    return (torch.arange(rows, device=device)[:, None] * n_blocks + within[None, :]).reshape(-1)


def restore(values: torch.Tensor, shape: tuple[int, ...], axis: int, dtype) -> torch.Tensor:
    """Flat values in the moved order (axis last) back to ``shape`` and ``dtype``."""
    return layout.from_rows(values.to(torch.float32), layout.moved_shape(shape, axis), shape, axis,
                            dtype)  # fmt: skip


def unpack(elements, scales, element: str, block: int, shape, axis: int, dtype):
    """The values stored by ``pack``, in ``shape`` and ``dtype``."""
    numel = math.prod(shape)
    if numel == 0:
        return torch.empty(shape, dtype=dtype, device=elements.device)
    elem = ELEMENTS[element]
    codes = exact.unpack_bits(elements, elem.bits, numel)
    per_element = scales.to(torch.int64)[block_index(tuple(shape), axis, block, codes.device)]
    table = element_table(elem).to(codes.device)
    values = table[codes] * exact.pow2(per_element - SCALE_BIAS)
    values = torch.where(per_element == SCALE_NAN, math.nan, values)
    return restore(values, tuple(shape), axis, dtype)


# ----------------------------------------------------------------------------- the fused pair
# A GEMM input and its stash (Format.quantize_and_pack) when both formats are block-scaled (MX or
# NVFP4): a backend may compute both from one read of x; the kernels take the two formats.
PAIR_FAMILIES = ("mx", "nvfp4")


def fusable_quantize_and_pack(x, fmt, axis, stash, stash_axis) -> bool:
    """The reference fuses nothing: the pair runs as its two calls."""
    return False


def quantize_and_pack(x, fmt, axis, stash, stash_axis):
    """The pair's definition: (fmt.quantize(x, axis), stash.pack(x, stash_axis)'s payload), which
    every fused kernel equals bit for bit."""
    packed = stash.pack(x, stash_axis, backend="reference")
    return fmt.quantize(x, axis, backend="reference"), packed.payload


def pair_layout(x, axis, stash_axis) -> bool:
    """What the fused kernels need: the GEMM input's blocks along the last axis and the stash's
    along the one before (the engine's q0 and q1 of a linear or attention operand)."""
    return x.dim() >= 2 and x.numel() > 0 and axis == x.dim() - 1 and stash_axis == x.dim() - 2


class BlockScaledPairs:
    """``quantize_and_pack`` through the family's fused kernel where the stash is block-scaled
    too and both round to nearest; the two calls otherwise (``Format.quantize_and_pack``)."""

    def quantize_and_pack(
        self, x, axis, stash, stash_axis, *, rounding="nearest", stash_rounding="nearest",
        generator=None, stash_generator=None, backend=None,
    ):  # fmt: skip
        if stash.family in PAIR_FAMILIES and rounding == stash_rounding == "nearest":
            args = (x, self, check_input(x, axis, rounding, None), stash)
            args = (*args, check_input(x, stash_axis, rounding, None))
            if kernel_for(x, backend, self.family, "fusable_quantize_and_pack")(*args):
                with torch.no_grad():
                    values, payload = kernel_for(x, backend, self.family, "quantize_and_pack")(
                        *args
                    )
                return values, PackedTensor(stash, tuple(x.shape), x.dtype, args[-1], payload)
        return super().quantize_and_pack(
            x, axis, stash, stash_axis, rounding=rounding, stash_rounding=stash_rounding,
            generator=generator, stash_generator=stash_generator, backend=backend,
        )  # fmt: skip


for _op, _fn in {
    "quantize": quantize,
    "pack": pack,
    "unpack": unpack,
    "fusable_quantize_and_pack": fusable_quantize_and_pack,
    "quantize_and_pack": quantize_and_pack,
}.items():
    register_kernel("reference", "mx", _op, _fn)
declare_family("mx", {"c": "dsq.formats.mx_c", "triton": "dsq.formats.mx_triton"})


# ----------------------------------------------------------------------------- the format
def _nearest_only(spec: str, rounding: str) -> None:
    if rounding != "nearest":
        raise ValueError(
            f"{spec} supports rounding='nearest' only (the OCP MX conversion rounds to nearest "
            "even); stochastic rounding is defined for bfp and fixed formats"
        )


@register
class MX(BlockScaledPairs, Format):
    """``mx<element>[b<B>]``: an OCP MX format, blocks of B (default 32) sharing an E8M0 scale.

    ``bits_per_value = w + 8 / B``, w the element's width; the module docstring states the
    conversion. The canonical spec leaves the default block out: ``mxfp8_e4m3``,
    ``mxfp4_e2m1b16``.
    """

    pattern = re.compile(r"mx(fp8_e4m3|fp8_e5m2|fp6_e3m2|fp6_e2m3|fp4_e2m1|int8)(?:b(\d+))?")
    grammar = (
        "mxfp8_e4m3 | mxfp8_e5m2 | mxfp6_e3m2 | mxfp6_e2m3 | mxfp4_e2m1 | mxint8, each [b<B>] "
        "(1<=B<=4096, B=32 by default)"
    )
    family = "mx"
    BLOCK = 32

    def __init__(self, element: str, block: int = BLOCK) -> None:
        self.element = ELEMENTS[element]
        self.block = block
        self.spec = f"mx{element}" + ("" if block == self.BLOCK else f"b{block}")
        self.bits_per_value = self.element.bits + 8 / block
        self.significant_bits = self.element.significant_bits
        # the elements multiply; the scales add, once per block (left out, as BFP's exponents)
        self.cost_width = self.element.bits

    @classmethod
    def from_match(cls, spec, match):
        block = check_int_range(spec, "B", int(match[2] or cls.BLOCK), 1, 4096)
        return cls(match[1], block)

    def _args(self):
        return self.element.name, self.block

    def quantize(self, x, axis=-1, rounding="nearest", generator=None, *, backend=None):
        axis = check_input(x, axis, rounding, generator)
        _nearest_only(self.spec, rounding)
        with torch.no_grad():
            return kernel_for(x, backend, self.family, "quantize")(x, *self._args(), axis)

    def pack(self, x, axis=-1, rounding="nearest", generator=None, *, backend=None):
        axis = check_input(x, axis, rounding, generator)
        _nearest_only(self.spec, rounding)
        with torch.no_grad():
            elements, scales = kernel_for(x, backend, self.family, "pack")(x, *self._args(), axis)
        payload = {"elements": elements, "scales": scales}
        return PackedTensor(self, tuple(x.shape), x.dtype, axis, payload)

    def _unpack(self, packed, backend=None):
        p = packed.payload
        with torch.no_grad():
            # a probe of the stored tensor's size: an empty one unpacks on the reference
            probe = p["elements"].new_empty(min(packed.numel(), 1), dtype=torch.float32)
            run = kernel_for(probe, backend, self.family, "unpack")
            return run(
                p["elements"], p["scales"], *self._args(), packed.shape, packed.axis, packed.dtype
            )
