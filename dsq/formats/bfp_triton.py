"""BFP's kernels on the triton backend (backend_triton.py), registered at the end.

Same signatures, semantics and return types as the end of ``bfp_reference.py``, bit for bit (values,
-0.0, NaN positions, packed bytes). The kernels live in ``dsq.kernels.bfp``; this module only
prepares their inputs on the host:

* the input becomes float32 (``x.to(torch.float32)``, as the reference does), the block axis is
  moved last and the result made contiguous (``block=None``: the tensor in its own row-major
  order, one block);
* stochastic rounding draws its noise as the backend does (``backend_triton.noise``) and moves
  it exactly like ``x``;
* results go back to ``x``'s shape (a view with the axis moved back) and dtype.

Without triton installed the module still loads; the backend says why it cannot run.
"""

from __future__ import annotations

import math

import torch

try:
    from dsq.kernels import bfp as kernels
except Exception:  # triton is optional (backend_triton.py says why it cannot run)
    kernels = None

from . import bfp_reference as reference
from . import layout
from .backend_triton import flat, noise
from .backends import register_kernels


def bfp_quantize(x, man_bits, exp_bits, block, axis, rounding="nearest", generator=None):
    """docs/spec.md §1.1; ``block=None``: one block spanning the whole tensor (dynamic fixed)."""
    u = noise(x, rounding, generator)
    x32 = x.to(torch.float32)
    if block is None:
        out = kernels.bfp_quantize_global(flat(x32), flat(u), man_bits, exp_bits)
        return out.reshape(x.shape).to(x.dtype)
    moved = layout.axis_last(x32, axis)
    out = kernels.bfp_quantize_blocks(
        moved, layout.axis_last(u, axis), moved.shape[-1], man_bits, exp_bits, block
    )
    return layout.axis_back(out, x.shape, axis).to(x.dtype)


def bfp_pack(x, man_bits, exp_bits, block, axis, rounding="nearest", generator=None):
    """(mantissa stream, exponent stream), byte for byte as ``reference.bfp_pack``."""
    u = noise(x, rounding, generator)
    x32 = x.to(torch.float32)
    if block is None:
        return kernels.bfp_pack(flat(x32), flat(u), x32.numel(), man_bits, exp_bits, None)
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
    first, second = kernels.bfp_quantize_chain(flat(x.to(torch.float32)), first_args, second_args)
    return first.reshape(x.shape).to(x.dtype), second.reshape(x.shape).to(x.dtype)


register_kernels("triton", "bfp", reference.KERNEL_NAMES, globals())
