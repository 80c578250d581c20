"""BFP's kernels on the c backend (backend_c.py): the C kernels hold the calls a training step
makes, BFP and fixed<w> with nearest rounding, E <= 8 and m <= 23, and codes of up to 8 bits
(docs/formats.md, "The C kernels"). Every function here decides, call by call, whether they hold
the call; any other call (stochastic rounding, E > 8, wider codes) runs the compile backend's
kernels (bfp_compile.py), handed the c backend's bit packer for the codes' second stage, so the
backend holds every operation of the family, each bit for bit the reference's. The layout is
``layout.py``'s, shared by every backend; the codes' streams are laid out as the compile
kernels' (``code_streams``).
"""

from __future__ import annotations

import math

import torch

from dsq.kernels import cpu

from . import bfp_compile as compiled
from . import bfp_reference as ref
from . import layout
from .backend_c import pack_codes as _pack_codes
from .backends import register_kernels


def _c_format(man_bits: int, exp_bits: int, most: int = 23) -> bool:
    """Whether the C kernels hold BFP(man_bits, exp_bits) with nearest rounding: E <= 8 (every
    block power a float32) and 2 <= m <= ``most`` (23: their rounding needs |v| < 2^22; 8 for
    codes, one byte each)."""
    return 2 <= man_bits <= most and exp_bits <= 8


def bfp_quantize(x, man_bits, exp_bits, block, axis, rounding="nearest", generator=None):
    if not (rounding == "nearest" and _c_format(man_bits, exp_bits)):
        return compiled.bfp_quantize(x, man_bits, exp_bits, block, axis, rounding, generator)
    if block is None:
        flat = x.detach().to(torch.float32).reshape(-1)
        return cpu.fixed_quantize(flat, man_bits, exp_bits).reshape(x.shape).to(x.dtype)
    if x.dim() > 1 and axis % x.dim() != x.dim() - 1:
        # blocks along a non-last axis, in x's own layout (no transposed copy in or out)
        x32 = x.detach().to(torch.float32)
        axis = axis % x.dim()
        outer, inner = math.prod(x.shape[:axis]), math.prod(x.shape[axis + 1 :])
        columns = x32.reshape(outer, x.shape[axis], inner)
        values = cpu.bfp_quantize_columns(columns, block, man_bits, exp_bits)
        return values.reshape(x.shape).to(x.dtype)
    blocks, n, moved_shape = layout.as_blocks(x, block, axis)
    values = cpu.bfp_quantize(blocks.reshape(-1, block), man_bits, exp_bits)
    return layout.from_blocks(values.reshape(blocks.shape), n, moved_shape, x.shape, axis, x.dtype)


def bfp_pack(x, man_bits, exp_bits, block, axis, rounding="nearest", generator=None):
    if block is not None and rounding == "nearest" and _c_format(man_bits, exp_bits, most=8):
        # the C kernels' codes (one byte each)
        blocks, n, _ = layout.as_blocks(x, block, axis)
        codes, exps = cpu.bfp_codes(blocks.reshape(-1, block), man_bits, exp_bits)
        rows = blocks.shape[0]
        return compiled.code_streams(codes, exps, rows, n, man_bits, exp_bits, _pack_codes)
    return compiled.bfp_pack(
        x, man_bits, exp_bits, block, axis, rounding, generator, pack_codes=_pack_codes
    )


def fusable_quantize_and_pack(x, q_args, axis, p_args, pack_axis) -> bool:
    """The compile backend's `fusable_quantize_and_pack`, and also a partial last block along the
    last axis where the C kernels hold both formats (`bfp_quantize_and_pack` pads the row with
    zeros for them)."""
    return compiled.fusable_quantize_and_pack(x, q_args, axis, p_args, pack_axis) or (
        ref.quantize_and_pack_layout(x, q_args, axis, p_args, pack_axis)
        and _c_holds_pair(q_args, p_args)
    )


def _c_holds_pair(q_args, p_args) -> bool:
    """Whether the C kernels hold both formats of a quantize-and-pack pair (the pack's codes
    up to 8 bits)."""
    (q_man, q_exp, _), (p_man, p_exp, _) = q_args, p_args
    return _c_format(q_man, q_exp) and _c_format(p_man, p_exp, most=8)


def bfp_quantize_and_pack(x, q_args, axis, p_args, pack_axis):
    """``bfp_quantize(x, *q_args, axis)`` and ``bfp_pack(x, *p_args, pack_axis)`` (nearest
    rounding), bit for bit, reading x once; see `fusable_quantize_and_pack` for when it applies.
    Returns (values, mantissa stream, exponent stream)."""
    if not _c_holds_pair(q_args, p_args):
        return compiled.bfp_quantize_and_pack(
            x, q_args, axis, p_args, pack_axis, pack_codes=_pack_codes
        )
    (_, _, q_block), (p_man, p_exp, p_block) = q_args, p_args
    x32 = x.detach().to(torch.float32)
    n, k = x32.shape[-2:]
    # the C kernels take a partial last block along k padded with zeros (no block's maximum
    # changes; the padded columns' stash codes are dropped below) and a partial last block of
    # rows as it is
    k_padded = -(-k // q_block) * q_block
    # x in its own strides where nothing is padded (an attention operand seen through a
    # transpose: the C kernels read it without a copy), else padded
    matrices = x32.reshape(-1, n, k)
    if k_padded != k:
        matrices = torch.nn.functional.pad(matrices, (0, k_padded - k))
    # the stream straight from the tiles when every block's and every row's codes start on a
    # byte
    direct = k == k_padded and (p_block * p_man) % 8 == 0 and (n * p_man) % 8 == 0
    values, stash, exps = cpu.bfp_quantize_and_pack(
        matrices, p_block, *q_args, p_man, p_exp, direct
    )
    if k_padded != k:
        values = values[:, :, :k]
    values = values.reshape(x.shape)
    if direct:
        mantissas, exponents = stash, _pack_codes(exps.reshape(-1), p_exp)
    else:
        stash, exps = stash[:, :k], exps[:, :k]  # [L, k, ...]: without the padded columns
        rows = matrices.shape[0] * k
        streams = compiled.code_streams(stash, exps, rows, n, p_man, p_exp, _pack_codes)
        mantissas, exponents = streams
    return values.to(x.dtype), mantissas, exponents


fusable_quantize_chain = compiled.fusable_quantize_chain


def bfp_quantize_chain(x, first_args, axis, second_args, second_axis):
    """(q = bfp_quantize(x, *first_args), bfp_quantize(q, *second_args, last axis)), nearest
    rounding, bit for bit, in one pass after the tensor's power; see `fusable_quantize_chain`."""
    f_man, f_exp, _ = first_args
    s_man, s_exp, s_block = second_args
    if not (_c_format(f_man, f_exp) and _c_format(s_man, s_exp)):
        return compiled.bfp_quantize_chain(x, first_args, axis, second_args, second_axis)
    flat = x.detach().to(torch.float32).reshape(-1)
    first, second = cpu.fixed_then_bfp(flat, f_man, f_exp, s_man, s_exp, s_block)
    return first.reshape(x.shape).to(x.dtype), second.reshape(x.shape).to(x.dtype)


# Values per row the C decode aims at when it joins rows: its per-row work (reading the row's
# codes and exponents out of the streams) is then small beside the row's values.
DECODE_ROW = 4096


@torch.compiler.assume_constant_result
def _threads() -> int:
    """torch's thread count. A compiled graph takes it as a constant (a torch function returning
    a number would break the graph): it decides how rows are joined, never a decoded value."""
    return torch.get_num_threads()


def _decode_rows_joined(rows: int, n: int, block: int) -> int:
    """How many consecutive rows of ``n`` values the C decode takes as one row: rows of whole
    blocks follow each other in both streams as one sequence of blocks, so ``g`` of them decode
    as one row of ``g * n`` (``g`` divides ``rows``, ``g * n`` at most DECODE_ROW, and at least
    as many rows are left as torch has threads, the kernel's tasks). An attention stash whose
    sentences are whole blocks long has thousands of rows of their length (the bench step's: 32
    values). 1 when a row ends in a partial block."""
    if n % block or n >= DECODE_ROW:
        return 1
    joined = max(1, min(rows // _threads(), DECODE_ROW // n))
    while rows % joined:
        joined -= 1
    return joined


def bfp_unpack(mantissas, exponents, man_bits, exp_bits, block, shape, axis, dtype):
    if block is None or not _c_format(man_bits, exp_bits, most=8):
        return compiled.bfp_unpack(
            mantissas, exponents, man_bits, exp_bits, block, shape, axis, dtype
        )
    numel = math.prod(shape)
    moved_shape = layout.moved_shape(shape, axis)
    n = moved_shape[-1]
    rows = numel // n
    joined = _decode_rows_joined(rows, n, block)
    values = cpu.bfp_decode(
        mantissas, exponents, rows // joined, n * joined, block, man_bits, exp_bits
    )
    return layout.from_blocks(values.reshape(rows, n), n, moved_shape, shape, axis, dtype)


# BFP's kernels on the c backend
register_kernels("c", "bfp", ref.KERNEL_NAMES, globals())
