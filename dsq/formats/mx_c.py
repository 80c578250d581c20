"""The c backend's kernels of the ``mx`` and ``nvfp4`` families: the C kernels of
``dsq.kernels.mx_cpu`` (docs/formats.md, "The C kernels"), bit for bit the definitions in
``mx.py`` and ``nvfp4.py``.

The host moves the block axis last and hands the kernels float32 rows [R, n] (contiguous: a
block axis that is not the last costs one transposed copy in, and the values one out); they
return new tensors in the same layout. Where the kernels do not build, nothing is registered
and these families run on the reference, as a backend without a kernel does (one logged line).
"""

from __future__ import annotations

import functools
import math

import torch

from dsq.kernels import mx_cpu

from . import layout, mx, nvfp4
from .backends import register_kernel


@functools.cache
def _element(name: str) -> tuple:
    """mx_cpu.c's Element of an element type: (bits, m, emin, emax, largest normal, INT8?)."""
    e = mx.ELEMENTS[name]
    return e.bits, e.man_bits, e.emin, e.emax, e.max_normal, e.integer


@functools.cache
def _table(name: str) -> torch.Tensor:
    """Every code's value, float32 (exact: at most 7 significant bits, normal exponents)."""
    return mx.element_table(mx.ELEMENTS[name]).to(torch.float32)


def mx_quantize(x, element, block, axis):
    rows, moved = layout.as_rows(x, axis)
    values = mx_cpu.mx_quantize(rows, block, _element(element))
    return layout.from_rows(values, moved, x.shape, axis, x.dtype)


def mx_pack(x, element, block, axis):
    rows, _ = layout.as_rows(x, axis)
    return mx_cpu.mx_pack(rows, block, _element(element))


def mx_unpack(elements, scales, element, block, shape, axis, dtype):
    moved = layout.moved_shape(tuple(shape), axis)
    n = moved[-1]
    rows = math.prod(moved) // n
    bits = mx.ELEMENTS[element].bits
    values = mx_cpu.mx_decode(elements, scales, _table(element), rows, n, block, bits)
    return layout.from_rows(values, moved, tuple(shape), axis, dtype)


def nvfp4_quantize(x, axis):
    rows, moved = layout.as_rows(x, axis)
    values = mx_cpu.nvfp4_quantize(rows, mx_cpu.nvfp4_scale(rows))
    return layout.from_rows(values, moved, x.shape, axis, x.dtype)


def nvfp4_pack(x, axis):
    rows, _ = layout.as_rows(x, axis)
    s = mx_cpu.nvfp4_scale(rows)
    stream, scales = mx_cpu.nvfp4_pack(rows, s)
    return stream, scales, s


@functools.cache
def _nvfp4_tables() -> tuple[torch.Tensor, torch.Tensor]:
    e2m1 = _table("fp4_e2m1")
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    return e2m1, e4m3


def nvfp4_unpack(elements, scales, tensor_scale, shape, axis, dtype):
    moved = layout.moved_shape(tuple(shape), axis)
    n = moved[-1]
    rows = math.prod(moved) // n
    values = mx_cpu.nvfp4_decode(elements, scales, tensor_scale, *_nvfp4_tables(), rows, n)
    return layout.from_rows(values, moved, tuple(shape), axis, dtype)


def _side(fmt) -> tuple[tuple, float]:
    """mx_cpu.c's Side of a format: (nvfp4, block, bits, m, emin, emax, INT8?), largest normal."""
    if fmt.family == "nvfp4":
        return (1, nvfp4.BLOCK, 4, 1, 0, 2, 0), 6.0
    e = fmt.element
    return (0, fmt.block, e.bits, e.man_bits, e.emin, e.emax, int(e.integer)), e.max_normal


def fusable_quantize_and_pack(x, fmt, axis, stash, stash_axis) -> bool:
    """Every pair of the engine's layout (`mx.pair_layout`)."""
    return mx.pair_layout(x, axis, stash_axis)


def quantize_and_pack(x, fmt, axis, stash, stash_axis):
    """(fmt.quantize(x, last axis), the payload of stash.pack(x, the axis before)), bit for bit,
    reading x once (``dsq::mx_quantize_and_pack``)."""
    x32 = x.detach().to(torch.float32)
    n, k = x32.shape[-2:]
    matrices = x32.reshape(-1, n, k)
    s = mx_cpu.nvfp4_scale(matrices) if "nvfp4" in (fmt.family, stash.family) else None
    scale = 1.0 if s is None else float(s)
    (q, q_max), (p, p_max) = _side(fmt), _side(stash)
    values, stream, scales = mx_cpu.mx_quantize_and_pack(matrices, q, q_max, scale, p, p_max, scale)
    payload = {"elements": stream, "scales": scales}
    if stash.family == "nvfp4":
        payload["tensor_scale"] = s
    return values.reshape(x.shape).to(x.dtype), payload


if mx_cpu.build_failure() is None:
    _pair = {
        "fusable_quantize_and_pack": fusable_quantize_and_pack,
        "quantize_and_pack": quantize_and_pack,
    }
    for _family, _ops in {
        "mx": {"quantize": mx_quantize, "pack": mx_pack, "unpack": mx_unpack, **_pair},
        "nvfp4": {"quantize": nvfp4_quantize, "pack": nvfp4_pack, "unpack": nvfp4_unpack, **_pair},
    }.items():
        for _op, _fn in _ops.items():
            register_kernel("c", _family, _op, _fn)
