"""NVFP4 (docs/formats.md, "NVFP4"): the family ``nvfp4``.

FP4 E2M1 elements in blocks of 16 along an axis, each block with an E4M3 scale, the tensor with
a float32 scale: NVIDIA's two-level recipe, in the arithmetic torchao's ``nvfp4_quantize``
uses, every step a float32 operation rounded to nearest even (fl):

1. A = max |x_i| over the tensor's finite values (0 when there is none);
   s = max(fl(A / 2688), 2^-121): 2688 = 448 * 6, the largest E4M3 times the largest E2M1;
2. per block: c = E4M3(clamp(fl(fl(b / 6) / s), 2^-6, 448)), b = max |x_i| of the block and
   E4M3 the cast to float8_e4m3fn (nearest even);
3. per value: e_i = E2M1(clamp(fl(x_i * r), -6, 6)), r = fl(fl(1 / s) / c), E2M1 rounding to
   the nearest of 0, 0.5, 1, 1.5, 2, 3, 4, 6 (ties to even, the sign of a zero kept);
4. q_i = fl(e_i * fl(s * c)), as torchao's dequantization computes it.

A block holding a NaN or an infinity decodes as NaN (its scale code is E4M3's NaN, 0x7F); such
values are left out of A. The floor 2^-121 on s keeps every intermediate finite: torchao's
r overflows where A is below about 5e-34 (in the blocks whose c is 2^-6) and its 1 / s below
about 8e-36, and an all-zero tensor gives it NaN; from A = 2688 * 2^-121 (about 1e-33) up, the
two agree bit for bit. Storage: the E2M1 codes two per byte (the first in the low nibble), one
E4M3 byte per block and the float32 s: ``bits_per_value = 4 + 8 / 16 = 4.5`` (s aside).

Unlike the MX formats, the values q_i are products with the float32 s, of up to 24 significant
bits: no reduced GEMM unit holds them exactly, and their GEMMs run in float32.
"""

from __future__ import annotations

import math
import re

import torch

from . import exact, layout, mx
from .backends import declare_family, kernel_for, register_kernel
from .base import Format, PackedTensor, check_input, register
from .mx import ELEMENTS, block_index, element_codes, element_round, element_table, restore

BLOCK = 16
E2M1 = ELEMENTS["fp4_e2m1"]
TENSOR_SCALE_DIVISOR = 2688.0  # 448 * 6
TENSOR_SCALE_MIN = 2.0**-121  # 1 / s < 2^121 and r < 2^127: no float32 overflow
SCALE_MIN, SCALE_MAX = 2.0**-6, 448.0  # E4M3's smallest normal and largest value
SCALE_NAN = 0x7F  # float8_e4m3fn's NaN


def fdiv(a, b) -> torch.Tensor:
    """a / b, float32, rounded once: a number given as a Python float becomes a tensor on the
    other's device (torch on CUDA multiplies by the reciprocal of a CPU scalar divisor)."""
    like = a if isinstance(a, torch.Tensor) else b
    a, b = (
        t if isinstance(t, torch.Tensor) else torch.full((), t, device=like.device) for t in (a, b)
    )
    return torch.div(a, b)


def tensor_scale(x32: torch.Tensor) -> torch.Tensor:
    """s (float32, 0-dim) of float32 ``x32``: step 1 of the module docstring."""
    magnitude = torch.where(torch.isfinite(x32), x32.abs(), 0.0)
    a = magnitude.amax() if x32.numel() else torch.zeros((), device=x32.device)
    return torch.clamp(fdiv(a, TENSOR_SCALE_DIVISOR), min=TENSOR_SCALE_MIN)


def block_scales(blocks: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(c, finite) per block of float32 ``blocks`` [..., 16]: the E4M3 scale as float32 (step 2)
    and whether the block holds finite values only."""
    finite = torch.isfinite(blocks).all(dim=-1, keepdim=True)
    b = torch.where(torch.isfinite(blocks), blocks.abs(), 0.0).amax(dim=-1, keepdim=True)
    t = torch.clamp(fdiv(fdiv(b, 6.0), s), SCALE_MIN, SCALE_MAX)
    return t.to(torch.float8_e4m3fn).to(torch.float32), finite


def _encode(x: torch.Tensor, axis: int):
    """(e, c, s, finite, n): element values [..., n_blocks, 16] (float64, exact), block scales
    [..., n_blocks, 1] (float32), the tensor scale, finiteness per block, the axis length."""
    x32 = x.detach().to(torch.float32)
    s = tensor_scale(x32)
    blocks, n = layout.blocks_along(x32, axis, BLOCK)
    c, finite = block_scales(blocks, s)
    r = fdiv(fdiv(1.0, s), c)
    y = torch.clamp(torch.where(finite, blocks, 0.0) * r, -6.0, 6.0)
    e = element_round(y.to(torch.float64), E2M1)
    return e, c, s, finite, n


def quantize(x: torch.Tensor, axis: int) -> torch.Tensor:
    """The values of nvfp4 of ``x`` (blocks along ``axis``), in x's shape and dtype."""
    if x.numel() == 0:
        return x.clone()
    e, c, s, finite, n = _encode(x, axis)
    values = torch.where(finite, e.to(torch.float32) * (s * c), math.nan)
    return layout.unblock(values, n, x.shape, axis).to(x.dtype)


def pack(x: torch.Tensor, axis: int):
    """(elements, scales, tensor_scale): the E2M1 codes, two per byte, the first in the low
    nibble (row-major order of x with ``axis`` moved last; 0 in a NaN block); one E4M3 code per
    block in the same order (uint8; 0x7F for a block holding NaN or an infinity); s as a
    float32 tensor of one element."""
    if x.numel() == 0:
        empty = torch.empty(0, dtype=torch.uint8, device=x.device)
        return empty, empty.clone(), torch.ones(1, dtype=torch.float32, device=x.device)
    e, c, s, finite, n = _encode(x, axis)
    codes = torch.where(finite, element_codes(e, E2M1), 0)
    codes = codes.reshape(*codes.shape[:-2], -1)[..., :n].reshape(-1)
    scale_codes = c.to(torch.float8_e4m3fn).view(torch.uint8)
    scale_codes = torch.where(finite, scale_codes, SCALE_NAN).reshape(-1)
    return exact.pack_bits(codes, E2M1.bits), scale_codes, s.reshape(1)


def unpack(elements, scales, tensor_scale_, shape, axis: int, dtype):
    """The values stored by ``pack``, in ``shape`` and ``dtype``."""
    numel = math.prod(shape)
    if numel == 0:
        return torch.empty(shape, dtype=dtype, device=elements.device)
    codes = exact.unpack_bits(elements, E2M1.bits, numel)
    e = element_table(E2M1).to(torch.float32).to(codes.device)[codes]
    index = block_index(tuple(shape), axis, BLOCK, codes.device)
    scale_codes = scales[index]
    c = scale_codes.view(torch.float8_e4m3fn).to(torch.float32)
    values = torch.where(scale_codes == SCALE_NAN, math.nan, e * (tensor_scale_ * c))
    return restore(values, tuple(shape), axis, dtype)


for _op, _fn in {
    "quantize": quantize,
    "pack": pack,
    "unpack": unpack,
    "fusable_quantize_and_pack": mx.fusable_quantize_and_pack,
    "quantize_and_pack": mx.quantize_and_pack,
}.items():
    register_kernel("reference", "nvfp4", _op, _fn)
declare_family("nvfp4", {"c": "dsq.formats.mx_c", "triton": "dsq.formats.mx_triton"})


@register
class NVFP4(mx.BlockScaledPairs, Format):
    """``nvfp4``: E2M1 elements, an E4M3 scale per 16 and a float32 scale per tensor (NVIDIA's
    NVFP4 as torchao computes it); ``bits_per_value = 4.5``, the tensor's scale aside."""

    pattern = re.compile("nvfp4")
    grammar = "nvfp4"
    family = "nvfp4"
    whole_tensor_scale = True  # its float32 scale spans the tensor

    def __init__(self) -> None:
        self.spec = "nvfp4"
        self.block = BLOCK
        self.bits_per_value = E2M1.bits + 8 / BLOCK
        # e * fl(s * c): up to float32's 24 bits (module docstring)
        self.significant_bits = 24
        self.cost_width = E2M1.bits

    @classmethod
    def from_match(cls, spec, match):
        return cls()

    def _check(self, x, axis, rounding, generator):
        axis = check_input(x, axis, rounding, generator)
        if rounding != "nearest":
            raise ValueError(
                "nvfp4 supports rounding='nearest' only; stochastic rounding is defined for bfp "
                "and fixed formats"
            )
        return axis

    def quantize(self, x, axis=-1, rounding="nearest", generator=None, *, backend=None):
        axis = self._check(x, axis, rounding, generator)
        with torch.no_grad():
            return kernel_for(x, backend, self.family, "quantize")(x, axis)

    def pack(self, x, axis=-1, rounding="nearest", generator=None, *, backend=None):
        axis = self._check(x, axis, rounding, generator)
        with torch.no_grad():
            elements, scales, s = kernel_for(x, backend, self.family, "pack")(x, axis)
        payload = {"elements": elements, "scales": scales, "tensor_scale": s}
        return PackedTensor(self, tuple(x.shape), x.dtype, axis, payload)

    def _unpack(self, packed, backend=None):
        p = packed.payload
        with torch.no_grad():
            probe = p["elements"].new_empty(min(packed.numel(), 1), dtype=torch.float32)
            run = kernel_for(probe, backend, self.family, "unpack")
            return run(
                p["elements"], p["scales"], p["tensor_scale"], packed.shape, packed.axis,
                packed.dtype,
            )  # fmt: skip
