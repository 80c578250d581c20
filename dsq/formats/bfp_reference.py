"""BFP's definition (``bfp<m>[e<E>][b<B>]`` and ``fixed<w>``, bfp.py): docs/spec.md §1.1 written as
PyTorch, the family's reference kernels, registered by bfp.py.

Every other backend (``c`` and ``compile`` on CPU, ``triton``; see ``backends.py``) is tested bit
for bit against the functions here. They favour clarity over speed:

* The arithmetic is float64. Inputs are first made float32 (exact for fp16/bf16/fp32;
  round-to-nearest-even for float64), and every float32 value times any power of two in
  [2^-200, 2^200] is exact in float64, so ``x * 2^k``, the rounding and the rescaling are the
  exact arithmetic that docs/spec.md §1.1 defines. The float64 result is then exactly
  representable in float32 (see docs/formats.md), and the final cast to the input dtype is
  round-to-nearest-even.
* Stochastic rounding ``R(v) = floor(v + u)`` uses ``u = r / 2^24`` with ``r`` a uniform 24-bit
  integer drawn by ``torch.randint`` from the caller's generator, one draw per element of ``x`` in
  row-major order of ``x``'s own shape. Every path uses the same draws, so results agree bit for
  bit across paths for the same generator state.
* A value that rounds to zero keeps the sign of its input (-0.0 stays -0.0), so that
  sign-magnitude storage round-trips exactly.
"""

from __future__ import annotations

import math

import torch

from . import exact, layout


def bfp_exponents(blocks: torch.Tensor, exp_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared exponent and finiteness of each block (docs/spec.md §1.1 steps 1-3).

    Returns (e, finite), shaped like ``blocks`` with the last dim reduced to 1. All-zero blocks
    get e = -(2^(E-1)-1), the smallest exponent: any exponent gives zeros, this one is canonical.
    """
    emax = 2 ** (exp_bits - 1) - 1
    finite = torch.isfinite(blocks).all(dim=-1, keepdim=True)
    a = blocks.abs().amax(dim=-1, keepdim=True)
    a = torch.where(finite, a, torch.ones_like(a))
    e = torch.where(a > 0, exact.floor_log2(a), torch.full_like(a, -emax, dtype=torch.int64))
    return e.clamp(-emax, emax), finite


def bfp_integers(
    blocks: torch.Tensor, e: torch.Tensor, man_bits: int, rounding: str, u: torch.Tensor | None
) -> torch.Tensor:
    """The signed integers q_i = clamp(R(x_i / scale), -L, L), scale = 2^(e - (m - 2))."""
    limit = 2 ** (man_bits - 1) - 1
    v = blocks * exact.pow2((man_bits - 2) - e)  # x / scale, exact in float64
    q = exact.apply_rounding(v, rounding, u)
    return q.clamp(-limit, limit)


def bfp_quantize(
    x: torch.Tensor,
    man_bits: int,
    exp_bits: int,
    block: int | None,
    axis: int,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """docs/spec.md §1.1; ``block=None``: one block spanning the whole tensor (dynamic fixed)."""
    if x.numel() == 0:
        return x.clone()
    work, u_work, n, axis_used = _bfp_layout(x, block, axis, rounding, generator)
    e, finite = bfp_exponents(work, exp_bits)
    q = bfp_integers(work, e, man_bits, rounding, u_work)
    values = q * exact.pow2(e - (man_bits - 2))
    values = torch.where(finite, values, torch.full_like(values, math.nan))
    return _bfp_restore(values, n, x, axis_used, block)


def _bfp_layout(x, block, axis, rounding, generator):
    """float64 blocks of x (and of the noise) along axis; for block=None one whole-tensor block."""
    xd = exact.exact_float64(x)
    u = exact.uniform_noise(x, generator) if rounding == "stochastic" else None
    if block is None:
        flat = xd.reshape(1, -1)
        return flat, (u.reshape(1, -1) if u is not None else None), flat.shape[-1], None
    work, n = layout.blocks_along(xd, axis, block)
    u_work = layout.blocks_along(u, axis, block)[0] if u is not None else None
    return work, u_work, n, axis


def _bfp_restore(values, n, x, axis, block):
    if block is None:
        out = values.reshape(x.shape)
    else:
        out = layout.unblock(values, n, x.shape, axis)
    return out.to(torch.float32).to(x.dtype)


def bfp_encode(
    x: torch.Tensor,
    man_bits: int,
    exp_bits: int,
    block: int | None,
    axis: int,
    rounding: str = "nearest",
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The integer codes that ``pack`` stores (docs/spec.md §1.2), before bit-packing.

    Returns (mantissa_codes, exponent_codes), both int64 and flat:
    * one mantissa per element, in row-major order of x with ``axis`` moved last (no padding):
      sign-magnitude, bit m-1 the sign, bits 0..m-2 the magnitude;
    * one exponent per block, in the same order: e + (2^(E-1)-1), and 2^E - 1 for a block
      that holds a NaN or an infinity.
    """
    work, u_work, n, _ = _bfp_layout(x, block, axis, rounding, generator)
    e, finite = bfp_exponents(work, exp_bits)
    q = bfp_integers(work, e, man_bits, rounding, u_work)
    sign = torch.signbit(q).to(torch.int64)
    magnitude = q.abs().to(torch.int64)
    codes = (sign << (man_bits - 1)) | magnitude
    codes = torch.where(finite, codes, torch.zeros_like(codes))
    codes = codes.reshape(*codes.shape[:-2], -1)[..., :n].reshape(-1)
    emax = 2 ** (exp_bits - 1) - 1
    exps = torch.where(finite, e + emax, torch.full_like(e, 2**exp_bits - 1)).reshape(-1)
    return codes, exps


def bfp_decode(
    codes: torch.Tensor,
    exps: torch.Tensor,
    man_bits: int,
    exp_bits: int,
    block: int | None,
    shape: tuple[int, ...],
    axis: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Values from the codes of ``bfp_encode`` (the inverse of the packing step)."""
    emax = 2 ** (exp_bits - 1) - 1
    numel = math.prod(shape)
    codes = codes.to(torch.int64)
    exps = exps.to(torch.int64)
    sign = (codes >> (man_bits - 1)) & 1
    magnitude = (codes & ((1 << (man_bits - 1)) - 1)).to(torch.float64)
    q = torch.where(sign.bool(), -magnitude, magnitude)
    if block is None:
        e_elem = exps.expand(numel)
    else:
        moved_shape = layout.moved_shape(shape, axis)
        n = moved_shape[-1]
        n_blocks = max(1, math.ceil(n / block))
        block_index = torch.arange(n, device=codes.device) // block
        row = torch.arange(numel // max(n, 1), device=codes.device)
        e_elem = exps.reshape(-1, n_blocks)[row[:, None], block_index[None, :]].reshape(-1)
    values = q * exact.pow2(e_elem - emax - (man_bits - 2))
    values = torch.where(e_elem == 2**exp_bits - 1, math.nan, values)
    if block is None:
        out = values.reshape(shape)
    else:
        out = layout.from_rows(values, layout.moved_shape(shape, axis), shape, axis, values.dtype)
    return out.to(torch.float32).to(dtype)


# Every backend offers `bfp_quantize_and_pack` and `bfp_quantize_chain` with a `fusable_*` test
# each (docs/formats.md, "Fused pairs"); these are the layouts every fused kernel needs.
def quantize_and_pack_layout(x, q_args, axis, p_args, pack_axis) -> bool:
    """A quantizer with per-block BFP along the last axis and a stash with per-block BFP along
    the axis before it. The quantizer's last block along a row may be partial (an attention
    product over a length that is not a multiple of the block): a kernel that needs whole blocks
    pads the row with zeros, which leave every block's maximum, hence every value, unchanged."""
    (_, _, q_block), (_, _, p_block) = q_args, p_args
    return (
        x.dim() >= 2
        and x.numel() > 0
        and axis == x.dim() - 1
        and pack_axis == x.dim() - 2
        and q_block is not None
        and p_block is not None
    )


def quantize_chain_layout(x, first_args, axis, second_args, second_axis) -> bool:
    """A whole-tensor first format (fixed<w>) and a second with per-block BFP along the last
    axis, its blocks tiling it."""
    f_block, s_block = first_args[2], second_args[2]
    return (
        x.dim() >= 1
        and x.numel() > 0
        and f_block is None
        and s_block is not None
        and second_axis == x.dim() - 1
        and x.shape[-1] % s_block == 0
    )


# The family's reference kernels (registered by bfp.py): every backend's BFP kernels have these
# signatures (backends.py). Payload layouts are documented in docs/formats.md and are identical,
# byte for byte, on every backend.
def fusable_quantize_and_pack(x, q_args, axis, p_args, pack_axis) -> bool:
    """The reference fuses nothing: a format runs its pairs as the two calls."""
    return False


def bfp_quantize_and_pack(x, q_args, axis, p_args, pack_axis):
    """The pair's definition: (bfp_quantize(x, *q_args, axis), *bfp_pack(x, *p_args, pack_axis)),
    nearest rounding, which every fused kernel equals bit for bit."""
    return (bfp_quantize(x, *q_args, axis), *bfp_pack(x, *p_args, pack_axis))


def fusable_quantize_chain(x, first_args, axis, second_args, second_axis) -> bool:
    """The reference fuses nothing: a format runs its pairs as the two calls."""
    return False


def bfp_quantize_chain(x, first_args, axis, second_args, second_axis):
    """The pair's definition: (q = bfp_quantize(x, *first_args, axis), bfp_quantize(q,
    *second_args, second_axis)), nearest rounding, which every fused kernel equals."""
    first = bfp_quantize(x, *first_args, axis)
    return first, bfp_quantize(first, *second_args, second_axis)


def bfp_pack(x, man_bits, exp_bits, block, axis, rounding="nearest", generator=None):
    """(mantissa stream, exponent stream): ``exact.pack_bits`` of the codes of ``bfp_encode``."""
    if x.numel() == 0:
        empty = torch.empty(0, dtype=torch.uint8, device=x.device)
        return empty, empty.clone()
    codes, exps = bfp_encode(x, man_bits, exp_bits, block, axis, rounding, generator)
    return exact.pack_bits(codes, man_bits), exact.pack_bits(exps, exp_bits)


def bfp_unpack(mantissas, exponents, man_bits, exp_bits, block, shape, axis, dtype):
    numel = math.prod(shape)
    if numel == 0:
        return torch.empty(shape, dtype=dtype, device=mantissas.device)
    moved = layout.moved_shape(shape, axis) if block is not None else (1, numel)
    n_exps = 1 if block is None else (numel // max(moved[-1], 1)) * max(1, -(-moved[-1] // block))
    codes = exact.unpack_bits(mantissas, man_bits, numel)
    exps = exact.unpack_bits(exponents, exp_bits, n_exps)
    return bfp_decode(codes, exps, man_bits, exp_bits, block, shape, axis, dtype)


# The family's operations and the name of each one's function, in this module as in every
# backend's module of BFP kernels (backends.register_kernels)
KERNEL_NAMES = {
    "quantize": "bfp_quantize",
    "pack": "bfp_pack",
    "unpack": "bfp_unpack",
    "fusable_quantize_and_pack": "fusable_quantize_and_pack",
    "quantize_and_pack": "bfp_quantize_and_pack",
    "fusable_quantize_chain": "fusable_quantize_chain",
    "quantize_chain": "bfp_quantize_chain",
}
