"""The triton backend's kernels of the ``mx`` and ``nvfp4`` families (``dsq.kernels.mx``), bit for
bit the definitions in ``mx.py`` and ``nvfp4.py``.

The host moves the block axis last (a contiguous float32 copy where it is not already), computes
NVFP4's tensor scale with torch's own ops (a max and one float32 division, exact on any device)
and bit-packs the kernels' one-byte codes into the streams with torch's integer ops (unpacking
likewise). The kernels need CUDA tensors, or CPU tensors under TRITON_INTERPRET=1 (the tests).
Without triton nothing is registered, and these families run on the reference there.
"""

from __future__ import annotations

import functools
import math

import torch

from . import layout, mx, nvfp4
from .backends import register_kernel

try:
    from dsq.kernels import mx as kernels
except Exception:  # triton is optional (backend_triton.py says why it cannot run)
    kernels = None


def _shape(shape, axis: int) -> tuple[tuple[int, ...], int, int]:
    moved = layout.moved_shape(tuple(shape), axis)
    return moved, math.prod(moved) // moved[-1], moved[-1]


# ----------------------------------------------------------------------------- streams
def pack_stream(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``exact.pack_bits`` of one-byte codes at 4, 6 or 8 bits, with whole-byte groups."""
    codes = codes.reshape(-1)
    if bits == 8:
        return codes.clone()
    count, per = codes.numel(), 2 if bits == 4 else 4
    padded = torch.nn.functional.pad(codes, (0, -count % per)).to(torch.int32).reshape(-1, per)
    word = padded[:, 0]
    for i in range(1, per):
        word = word | (padded[:, i] << (bits * i))
    group = torch.stack([(word >> (8 * j)) & 0xFF for j in range(bits * per // 8)], dim=1)
    return group.reshape(-1).to(torch.uint8)[: (count * bits + 7) // 8]


def unpack_stream(stream: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first ``count`` one-byte codes of a stream at 4, 6 or 8 bits."""
    if bits == 8:
        return stream[:count].contiguous()
    per, size = (2, 1) if bits == 4 else (4, 3)
    groups = -(-count // per)
    data = torch.nn.functional.pad(stream, (0, groups * size - stream.numel()))
    data = data.to(torch.int32).reshape(groups, size)
    word = data[:, 0]
    for j in range(1, size):
        word = word | (data[:, j] << (8 * j))
    codes = torch.stack([(word >> (bits * i)) & ((1 << bits) - 1) for i in range(per)], dim=1)
    return codes.reshape(-1)[:count].to(torch.uint8).contiguous()


# ----------------------------------------------------------------------------- mx
@functools.cache
def _element(name: str) -> tuple:
    e = mx.ELEMENTS[name]
    return e.bits, e.man_bits, e.emin, e.emax, e.max_normal, e.integer


@functools.cache
def _table(name: str, device: torch.device) -> torch.Tensor:
    return mx.element_table(mx.ELEMENTS[name]).to(torch.float32).to(device)


def mx_quantize(x, element, block, axis):
    rows, moved = layout.as_rows(x, axis)
    values = kernels.mx_blocks(rows, block, _element(element), codes=False)
    return layout.from_rows(values, moved, x.shape, axis, x.dtype)


def mx_pack(x, element, block, axis):
    rows, _ = layout.as_rows(x, axis)
    codes, scales = kernels.mx_blocks(rows, block, _element(element), codes=True)
    return pack_stream(codes, mx.ELEMENTS[element].bits), scales


def mx_unpack(elements, scales, element, block, shape, axis, dtype):
    moved, rows, n = _shape(shape, axis)
    codes = unpack_stream(elements, mx.ELEMENTS[element].bits, rows * n)
    # 2^(code - 127) as float32 from its bits (2^-127 is the one subnormal), NaN for 255
    exponent = scales.to(torch.int32)
    factor = torch.where(exponent > 0, exponent << 23, 1 << 22).view(torch.float32)
    factor = torch.where(exponent == mx.SCALE_NAN, math.nan, factor)
    values = kernels.decode(codes, _table(element, codes.device), factor, rows, n, block)
    return layout.from_rows(values, moved, tuple(shape), axis, dtype)


# ----------------------------------------------------------------------------- nvfp4
def nvfp4_quantize(x, axis):
    rows, moved = layout.as_rows(x, axis)
    values = kernels.nvfp4_blocks(rows, nvfp4.tensor_scale(rows).reshape(1), codes=False)
    return layout.from_rows(values, moved, x.shape, axis, x.dtype)


def nvfp4_pack(x, axis):
    rows, _ = layout.as_rows(x, axis)
    s = nvfp4.tensor_scale(rows).reshape(1)
    codes, scales = kernels.nvfp4_blocks(rows, s, codes=True)
    return pack_stream(codes, 4), scales, s


def nvfp4_unpack(elements, scales, tensor_scale, shape, axis, dtype):
    moved, rows, n = _shape(shape, axis)
    codes = unpack_stream(elements, 4, rows * n)
    c = scales.view(torch.float8_e4m3fn).to(torch.float32)
    factor = torch.where(scales == nvfp4.SCALE_NAN, math.nan, tensor_scale * c)
    values = kernels.decode(codes, _table("fp4_e2m1", codes.device), factor, rows, n, 16)
    return layout.from_rows(values, moved, tuple(shape), axis, dtype)


if kernels is not None:
    for _family, _ops in {
        "mx": {"quantize": mx_quantize, "pack": mx_pack, "unpack": mx_unpack},
        "nvfp4": {"quantize": nvfp4_quantize, "pack": nvfp4_pack, "unpack": nvfp4_unpack},
    }.items():
        for _op, _fn in _ops.items():
            register_kernel("triton", _family, _op, _fn)
