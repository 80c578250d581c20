"""The triton backend: the BFP and static fixed-point kernels on Triton (registered at the end).

Same signatures, semantics and return types as the end of ``reference.py``, bit for bit (values,
-0.0, NaN positions, packed bytes). The kernels live in ``dsq.kernels.bfp``; this module only
prepares their inputs on the host:

* the input becomes float32 (``x.to(torch.float32)``, as the reference does), the block axis is
  moved last and the result made contiguous (``block=None``: the tensor in its own row-major
  order, one block);
* stochastic rounding draws its noise with ``exact.uniform_noise`` (the same draws as every
  path: one per element of ``x``, row-major in ``x``'s shape) and moves it exactly like ``x``;
* results go back to ``x``'s shape (a view with the axis moved back) and dtype.

The kernels need CUDA tensors, or CPU tensors with ``TRITON_INTERPRET=1`` set before Triton is
imported (tests). Empty tensors never reach this backend (``backends.select_backend`` sends them
to the reference). Without triton installed the module still loads, and `unavailable_reason`
says why it cannot run.
"""

from __future__ import annotations

import math
import os

import torch

try:
    from dsq.kernels import bfp as kernels
except Exception as err:  # triton is optional, and a broken install can raise anything
    kernels, _import_error = None, err
else:
    _import_error = None

from . import exact, layout, reference
from .backends import register_kernel


def unavailable_reason(device_type: str) -> str | None:
    """Why the Triton kernels cannot run tensors of ``device_type`` here, or None when they can."""
    if _import_error is not None:
        return f"triton is not importable ({_import_error})"
    if device_type == "cuda":
        return None
    if device_type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return (
        f"the Triton kernels need CUDA tensors (got {device_type}; "
        "TRITON_INTERPRET=1 runs them on CPU)"
    )


def _stochastic(rounding: str) -> bool:
    if rounding == "nearest":
        return False
    if rounding == "stochastic":
        return True
    raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")


def _noise(x: torch.Tensor, rounding: str, generator) -> torch.Tensor | None:
    return exact.uniform_noise(x, generator) if _stochastic(rounding) else None


def _flat(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous().reshape(-1)


# ----------------------------------------------------------------------------- BFP
def bfp_quantize(x, man_bits, exp_bits, block, axis, rounding="nearest", generator=None):
    """docs/spec.md §1.1; ``block=None``: one block spanning the whole tensor (dynamic fixed)."""
    u = _noise(x, rounding, generator)
    x32 = x.to(torch.float32)
    if block is None:
        out = kernels.bfp_quantize_global(_flat(x32), _flat(u), man_bits, exp_bits)
        return out.reshape(x.shape).to(x.dtype)
    moved = layout.axis_last(x32, axis)
    out = kernels.bfp_quantize_blocks(
        moved, layout.axis_last(u, axis), moved.shape[-1], man_bits, exp_bits, block
    )
    return layout.axis_back(out, x.shape, axis).to(x.dtype)


def bfp_pack(x, man_bits, exp_bits, block, axis, rounding="nearest", generator=None):
    """(mantissa stream, exponent stream), byte for byte as ``reference.bfp_pack``."""
    u = _noise(x, rounding, generator)
    x32 = x.to(torch.float32)
    if block is None:
        return kernels.bfp_pack(_flat(x32), _flat(u), x32.numel(), man_bits, exp_bits, None)
    moved = layout.axis_last(x32, axis)
    return kernels.bfp_pack(
        moved, layout.axis_last(u, axis), moved.shape[-1], man_bits, exp_bits, block
    )


def bfp_unpack(mantissas, exponents, man_bits, exp_bits, block, shape, axis, dtype):
    shape = tuple(shape)
    numel = math.prod(shape)
    mantissas, exponents = mantissas.contiguous(), exponents.contiguous()
    if block is None:
        out = kernels.bfp_unpack(
            mantissas, exponents, numel, numel, man_bits, exp_bits, None, mantissas.device
        )
        return out.reshape(shape).to(dtype)
    moved_shape = layout.moved_shape(shape, axis)
    out = kernels.bfp_unpack(
        mantissas,
        exponents,
        numel,
        moved_shape[-1],
        man_bits,
        exp_bits,
        block,
        mantissas.device,
    )
    return layout.axis_back(out.reshape(moved_shape), shape, axis).to(dtype)


# ----------------------------------------------------------------------------- fused pairs
def fusable_quantize_and_pack(x, q_args, axis, p_args, pack_axis) -> bool:
    """Whether `bfp_quantize_and_pack` runs ``x``: the pair's layout
    (`reference.quantize_and_pack_layout`) with the quantizer's block a power of two that tiles
    the last axis (the kernel reshapes its tile by it)."""
    q_block = q_args[2]
    layout = reference.quantize_and_pack_layout(x, q_args, axis, p_args, pack_axis)
    return layout and q_block & (q_block - 1) == 0 and x.shape[-1] % q_block == 0


def bfp_quantize_and_pack(x, q_args, axis, p_args, pack_axis):
    """(bfp_quantize(x, *q_args, axis), *bfp_pack(x, *p_args, pack_axis)), nearest rounding,
    from one read of x (docs/formats.md, "Fused pairs")."""
    x32 = x.to(torch.float32).contiguous()
    rows = x32.reshape(-1, x.shape[-2], x.shape[-1])
    values, mantissas, exponents = kernels.bfp_quantize_and_pack(rows, q_args, p_args)
    return values.reshape(x.shape).to(x.dtype), mantissas, exponents


def fusable_quantize_chain(x, first_args, axis, second_args, second_axis) -> bool:
    """Whether `bfp_quantize_chain` runs ``x``: the pair's layout
    (`reference.quantize_chain_layout`)."""
    return reference.quantize_chain_layout(x, first_args, axis, second_args, second_axis)


def bfp_quantize_chain(x, first_args, axis, second_args, second_axis):
    """(g = bfp_quantize(x, *first_args), bfp_quantize(g, *second_args, last axis)), nearest
    rounding, in one pass after the tensor's maximum."""
    first, second = kernels.bfp_quantize_chain(_flat(x.to(torch.float32)), first_args, second_args)
    return first.reshape(x.shape).to(x.dtype), second.reshape(x.shape).to(x.dtype)


# ----------------------------------------------------------------------------- static fixed
def fixed_static_quantize(x, width, frac_bits, rounding="nearest", generator=None):
    u = _noise(x, rounding, generator)
    out = kernels.fixed_quantize(_flat(x.to(torch.float32)), _flat(u), width, frac_bits)
    return out.reshape(x.shape).to(x.dtype)


def fixed_static_pack(x, width, frac_bits, rounding="nearest", generator=None):
    """(two's-complement stream of w bits per element, NaN bitmask stream or None)."""
    u = _noise(x, rounding, generator)
    stream, nan_mask = kernels.fixed_pack(_flat(x.to(torch.float32)), _flat(u), width, frac_bits)
    if not bool(nan_mask.any()):  # the only host sync: the return type depends on it
        nan_mask = None
    return stream, nan_mask


def fixed_static_unpack(integers, nan_mask, width, frac_bits, shape, dtype):
    shape = tuple(shape)
    integers = integers.contiguous()
    nan_mask = None if nan_mask is None else nan_mask.contiguous()
    out = kernels.fixed_unpack(
        integers, nan_mask, math.prod(shape), width, frac_bits, integers.device
    )
    return out.reshape(shape).to(dtype)


for _family, _ops in {
    "bfp": {
        "quantize": bfp_quantize,
        "pack": bfp_pack,
        "unpack": bfp_unpack,
        "fusable_quantize_and_pack": fusable_quantize_and_pack,
        "quantize_and_pack": bfp_quantize_and_pack,
        "fusable_quantize_chain": fusable_quantize_chain,
        "quantize_chain": bfp_quantize_chain,
    },
    "fixed_static": {
        "quantize": fixed_static_quantize,
        "pack": fixed_static_pack,
        "unpack": fixed_static_unpack,
    },
}.items():
    for _op, _fn in _ops.items():
        register_kernel("triton", _family, _op, _fn)
