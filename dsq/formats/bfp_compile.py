"""BFP's kernels on the compile backend (backend_compile.py): the reference semantics in float32,
fused by torch.compile (CPU).

Its functions also serve the c backend's BFP kernels (``bfp_c.py``), which run here every call
the C kernels do not hold, handing in their own bit packer (``pack_codes``) for the codes'
second stage.

Eager PyTorch runs a quantizer as ~15 passes over memory; torch.compile fuses the block max,
the exponent, the rounding and the rescaling into one loop over the blocks, so quantize runs near
``x.clone()`` speed. ``pack`` and ``unpack`` run in two compiled stages each (block quantizer ->
one narrow integer per code -> bit packing; bytes -> codes -> decode over the block layout),
which measured 2-3x faster than single kernels (see docs/benchmarks.md). It works in float32
instead of the reference's float64, and stays exact by construction (tests check it bit for bit):

* the block exponent comes from the float max of |x| (NaN propagates, so ``a < inf`` tells a
  finite block) reinterpreted as bits; subnormal maxima read their exponent from the mantissa
  field converted to float;
* ``x * 2^k`` is done as ``x * 2^k1 * 2^k2`` with both powers normal floats built from bits,
  exact except for an underflow far below the block's max, where rounding yields 0 anyway;
  stochastic rounding adds the one case where that underflow would change the result.

Shapes: the kernels see blocks as [rows x blocks per row, B], one dynamic dimension, so
translation batches of any length (and stashes blocked along the tokens) reuse the compiled
kernels; inputs arrive detached and contiguous, so neither requires_grad nor a view's strides
make a new variant. A new format (m, E, B) compiles once, plus once for a tensor of one block.
"""

from __future__ import annotations

import math
import sys

import torch

from . import bfp_reference as ref
from . import exact, layout
from .backend_compile import code_dtype, code_stream, rounded, run, unpack_codes
from .backends import register_kernels


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """2^k as float32 for integer k in [-126, 127], from the exponent bits (exact)."""
    return ((k + 127) << 23).view(torch.float32)


def _mul_pow2(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """x * 2^k for int32 k in [-252, 254]: two normal powers of two, each product exact."""
    k1 = k >> 1  # floor(k / 2)
    return x * _pow2(k1) * _pow2(k - k1)


def _block_exponent(blocks: torch.Tensor, exp_bits: int):
    """(e, finite) per block of ``blocks`` [..., B] float32, as reference.bfp_exponents.

    The max is taken on floats (vectorised; NaN propagates, so ``a < inf`` is the finiteness
    test) and only the per-block max is reinterpreted as bits.
    """
    emax = 2 ** (exp_bits - 1) - 1
    a = blocks.abs().amax(dim=-1, keepdim=True)
    finite = a < math.inf
    max_bits = a.view(torch.int32)
    biased = max_bits >> 23
    # subnormal max: value = field * 2^-149, and float(field) is exact (field < 2^23)
    sub_e = ((max_bits.to(torch.float32).view(torch.int32) >> 23) - 127) - 149
    e = torch.where(biased > 0, biased - 127, sub_e)
    e = torch.where(max_bits == 0, -emax, e)
    return e.clamp(-emax, emax), finite


def _bfp_integers(blocks, u, man_bits: int, exp_bits: int, exponent=None):
    """(q, e, k, finite); ``exponent`` = (e, finite) computed beforehand, or None to compute it
    per block of ``blocks`` [..., B]."""
    limit = 2 ** (man_bits - 1) - 1
    e, finite = _block_exponent(blocks, exp_bits) if exponent is None else exponent
    k = (man_bits - 2) - e
    q = rounded(_mul_pow2(blocks, k), u, blocks).clamp(-limit, limit)
    return q, e, k, finite


def _exponent_fn(blocks, exp_bits: int):
    """The shared exponent of a whole-tensor block, as 0-dim tensors (e, finite)."""
    e, finite = _block_exponent(blocks.reshape(1, -1), exp_bits)
    return e.reshape(()), finite.reshape(())


def _by_block_power(u, exp_bits: int, exponent) -> bool:
    """Whether `_bfp_nearest` applies: nearest rounding, per-block exponents, and E <= 8 (whose
    powers 2^e, e in [-127, 127], are all float32 values, so that every product is exact)."""
    return u is None and exponent is None and exp_bits <= 8


def _block_power(blocks: torch.Tensor, exp_bits: int):
    """(p, finite) per block of ``blocks`` [..., B] float32: p = 2^e as a float32, e the block
    exponent of reference.bfp_exponents.

    Built from masks and float products only: the exponent field of max|x| alone is
    2^floor(log2 max|x|); a subnormal max is scaled by 2^64 first and back after (both exact);
    the clamp to [-emax, emax] is a clamp of p. `_block_exponent`'s integer shifts compile to
    scalar code per block, which made the quantizer compute-bound.
    """
    emax = 2 ** (exp_bits - 1) - 1
    a = blocks.abs().amax(dim=-1, keepdim=True)
    finite = a < math.inf
    a = torch.where(finite, a, 0.0)
    small = a < 2.0**-126
    scaled = torch.where(small, a * 2.0**64, a)
    p = (scaled.view(torch.int32) & 0x7F800000).view(torch.float32)
    p = torch.where(small, p * 2.0**-64, p)
    return p.clamp(2.0**-emax, 2.0**emax), finite


def _rounded(x, p, man_bits: int):
    """The integers q = clamp(round(x / 2^(e - (m-2)))) of ``x`` under the power p = 2^e.

    x / p is exact unless it underflows, far below the block's max, where it rounds to a zero of
    the same sign either way; the scaling by 2^(m-2) and the rounding are exact."""
    limit = 2 ** (man_bits - 1) - 1
    return torch.round(x / p * 2.0 ** (man_bits - 2)).clamp(-limit, limit)


def _from_power(q, p, finite, man_bits: int):
    """The values q * 2^(e - (m-2)): q * 2^(2-m) is exact (q < 2^24) and one product by p rounds
    once, to the reference's exact value (representable in float32 for E <= 8: a multiple of
    2^-149); NaN for a block that held NaN or inf."""
    return torch.where(finite, q * 2.0 ** (2 - man_bits) * p, math.nan)


def _bfp_nearest(blocks, man_bits: int, exp_bits: int):
    """(q, p, finite): the integers `_rounded` of each block and the block powers p."""
    p, finite = _block_power(blocks, exp_bits)
    return _rounded(blocks, p, man_bits), p, finite


def _power_exponent(p: torch.Tensor) -> torch.Tensor:
    """e (int32) of a power of two p = 2^e, e >= -127 (2^-127 is the one subnormal p)."""
    biased = p.view(torch.int32) >> 23
    return torch.where(biased > 0, biased - 127, -127)


def _power_fn(flat, exp_bits: int):
    """The shared power 2^e of a whole-tensor block, as 0-dim tensors (p, finite)."""
    p, finite = _block_power(flat.reshape(1, -1), exp_bits)
    return p.reshape(()), finite.reshape(())


def _quantize_by_power_fn(flat, p, finite, man_bits: int):
    """fixed<w> with w <= 24 and nearest rounding, elementwise given the tensor's power p."""
    return _from_power(_rounded(flat, p, man_bits), p, finite, man_bits)


def _bfp_quantize_fn(blocks, u, man_bits: int, exp_bits: int, exponent=None):
    if _by_block_power(u, exp_bits, exponent):
        q, p, finite = _bfp_nearest(blocks, man_bits, exp_bits)
        return _from_power(q, p, finite, man_bits)
    q, _, k, finite = _bfp_integers(blocks, u, man_bits, exp_bits, exponent)
    return torch.where(finite, _mul_pow2(q, -k), math.nan)


def _bfp_codes_fn(blocks, u, man_bits: int, exp_bits: int, exponent=None):
    """Stage 1 of pack: blocks [R, n_blocks, B] -> mantissa codes [R, n_blocks, B] and exponent
    codes [R, n_blocks, 1], in the narrowest integer dtype.

    Packing runs in two stages on purpose: writing one byte per code and then bit-packing that
    compact buffer is 2-3x faster than one fused kernel, where inductor either materialises
    float32 codes (4 bytes each) or falls back to scalar loops for the strided bit gathers.
    Flattening happens on the host: a reshape inside the graph also costs a scalar loop.
    """
    if _by_block_power(u, exp_bits, exponent):
        q, p, finite = _bfp_nearest(blocks, man_bits, exp_bits)
        e = _power_exponent(p)
    else:
        q, e, _, finite = _bfp_integers(blocks, u, man_bits, exp_bits, exponent)
    # the sign of q is the sign of x (rounding and clamping keep it), -0.0 included; this is
    # vectorised, where torch.signbit compiles to a scalar loop
    negative = (blocks < 0) | ((blocks == 0) & (1.0 / blocks < 0))
    if man_bits <= 24:  # float arithmetic is exact below 2^24 and much faster than int64 vectors
        codes = negative.to(torch.float32) * 2.0 ** (man_bits - 1) + q.abs()
        codes = torch.where(finite, codes, 0.0).to(torch.int32)
    else:
        codes = (negative.to(torch.int64) << (man_bits - 1)) | q.abs().to(torch.int64)
        codes = torch.where(finite, codes, 0)
    emax = 2 ** (exp_bits - 1) - 1
    exps = torch.where(finite, e + emax, 2**exp_bits - 1).to(torch.int32)
    exps = exps.to(code_dtype(exp_bits))
    if code_dtype(man_bits) == torch.int16:
        # two byte planes: inductor's vectorised int16 store is ~7x slower than two uint8 ones
        return ((codes & 0xFF).to(torch.uint8), (codes >> 8).to(torch.uint8)), exps
    return codes.to(code_dtype(man_bits)), exps


def _bfp_decode_fn(codes, exps, man_bits: int, exp_bits: int):
    """codes [R, n_blocks, B] int, exps [R, n_blocks, 1] int -> float32 values."""
    emax = 2 ** (exp_bits - 1) - 1
    codes = codes.to(torch.int64 if man_bits > 31 else torch.int32)
    exps = exps.to(torch.int32)
    sign = (codes >> (man_bits - 1)) & 1
    magnitude = (codes & ((1 << (man_bits - 1)) - 1)).to(torch.float32)
    q = torch.where(sign == 1, -magnitude, magnitude)
    values = _mul_pow2(q, (exps - (emax + man_bits - 2)).to(torch.int32))
    return torch.where(exps == 2**exp_bits - 1, math.nan, values)


def _join_planes(codes) -> torch.Tensor:
    """The int16 codes of ``_bfp_codes_fn``'s two byte planes (low, high), little-endian."""
    if isinstance(codes, tuple):
        low, high = codes
        if sys.byteorder != "little":
            return (low.to(torch.int32) | (high.to(torch.int32) << 8)).to(torch.int16)
        return torch.stack((low, high), dim=-1).view(torch.int16).squeeze(-1)
    return codes


def _noise_rows(x, generator, block, axis):
    return layout.as_blocks(exact.uniform_noise(x, generator), block, axis)[0]


def _run_blocks(fn, blocks, u, *args):
    """Run a per-block ``fn`` on blocks [R, n_blocks, B] (and noise ``u`` alike) as one dynamic
    dimension of R * n_blocks blocks; its outputs [R * n_blocks, ...] come back as
    [R, n_blocks, ...]. One dynamic dimension instead of two: torch.compile specialises a size
    of 1, so rows of a single block (a layer norm's saved statistics) would compile apart."""
    flat = blocks.reshape(-1, blocks.shape[-1])
    u_flat = None if u is None else u.reshape(-1, u.shape[-1])
    dyn = ((flat, 0),) + (((u_flat, 0),) if u_flat is not None else ())
    out = run(fn, flat, u_flat, *args, dynamic_dims=dyn)
    return _unflatten_blocks(out, blocks.shape[:2])


def _unflatten_blocks(out, lead):
    if isinstance(out, tuple):
        return tuple(_unflatten_blocks(t, lead) for t in out)
    return out.reshape(*lead, out.shape[-1])


def _run_whole_tensor(fn, blocks, u, man_bits: int, exp_bits: int):
    """fixed<w> (one block spanning the tensor): reduce to the exponent first, then run ``fn``
    elementwise with it. One fused kernel over a single giant block of symbolic length runs
    3x to 8x slower."""
    flat = blocks.reshape(-1)
    exponent = run(_exponent_fn, flat, exp_bits, dynamic_dims=((flat, 0),))
    u_flat = None if u is None else u.reshape(-1)
    dyn = ((flat, 0),) + (((u_flat, 0),) if u_flat is not None else ())
    return run(fn, flat, u_flat, man_bits, exp_bits, exponent, dynamic_dims=dyn)


def eager_bfp_quantizer(x: torch.Tensor, man_bits: int, exp_bits: int, block: int | None):
    """A function of no arguments that runs this path's BFP quantization of ``x`` (blocks along
    the last axis) eagerly, without torch.compile: what the same float32 code costs in plain
    PyTorch (``dsq bench quant``'s eager column). The blocks are laid out once, outside it."""
    blocks, _, _ = layout.as_blocks(x, block, -1)
    return lambda: _bfp_quantize_fn(blocks, None, man_bits, exp_bits)


def bfp_quantize(x, man_bits, exp_bits, block, axis, rounding="nearest", generator=None):
    if block is None and rounding == "nearest" and exp_bits <= 8 and man_bits <= 24:
        # fixed<w>: its power first, then one elementwise pass (`_rounded`, `_from_power`)
        flat = x.detach().to(torch.float32).reshape(-1)
        p, finite = run(_power_fn, flat, exp_bits, dynamic_dims=((flat, 0),))
        out = run(_quantize_by_power_fn, flat, p, finite, man_bits, dynamic_dims=((flat, 0),))
        return out.reshape(x.shape).to(x.dtype)
    blocks, n, moved_shape = layout.as_blocks(x, block, axis)
    u = _noise_rows(x, generator, block, axis) if rounding == "stochastic" else None
    if block is None:
        values = _run_whole_tensor(_bfp_quantize_fn, blocks, u, man_bits, exp_bits)
        return values.reshape(x.shape).to(x.dtype)
    values = _run_blocks(_bfp_quantize_fn, blocks, u, man_bits, exp_bits)
    return layout.from_blocks(values, n, moved_shape, x.shape, axis, x.dtype)


def bfp_pack(
    x, man_bits, exp_bits, block, axis, rounding="nearest", generator=None, *, pack_codes=None
):
    """(mantissa stream, exponent stream); ``pack_codes`` bit-packs the codes (default
    `code_stream`: a caller with a faster packer hands it in)."""
    pack_codes = pack_codes or code_stream
    blocks, n, _ = layout.as_blocks(x, block, axis)
    u = _noise_rows(x, generator, block, axis) if rounding == "stochastic" else None
    if block is None:
        codes, exps = _run_whole_tensor(_bfp_codes_fn, blocks, u, man_bits, exp_bits)
        codes = _join_planes(codes)
        return pack_codes(codes, man_bits), pack_codes(exps.reshape(-1), exp_bits)
    codes, exps = _run_blocks(_bfp_codes_fn, blocks, u, man_bits, exp_bits)
    return code_streams(codes, exps, blocks.shape[0], n, man_bits, exp_bits, pack_codes)


def code_streams(codes, exps, rows: int, n: int, man_bits: int, exp_bits: int, pack_codes=None):
    """Stage 2 of a per-block pack: the mantissa and exponent streams of codes laid out as
    ``rows`` padded rows of ``n`` (the padding of each row's partial last block is not
    stored), bit-packed by ``pack_codes`` (default `code_stream`)."""
    pack_codes = pack_codes or code_stream
    codes = _join_planes(codes).reshape(rows, -1)
    if codes.shape[1] != n:
        codes = codes[:, :n]
    return pack_codes(codes.reshape(-1), man_bits), pack_codes(exps.reshape(-1), exp_bits)


def _quantize_and_codes_fn(rows, q_man: int, q_exp: int, q_block: int, p_man: int, p_exp: int):
    """One kernel over ``rows`` [L, N / Bp, Bp, K]: the values of BFP(q_man, q_exp, q_block)
    along K, as [L * N * K / Bq, Bq], and the pack codes of BFP(p_man, p_exp, Bp) along N in
    the stream's order, [L, K, N / Bp, Bp] (and exponents [L, K, N / Bp, 1]): `_bfp_codes_fn` on
    the transposed view, which inductor reads in place instead of copying the floats first."""
    values = _bfp_quantize_fn(rows.reshape(-1, q_block), None, q_man, q_exp)
    codes, exps = _bfp_codes_fn(rows.permute(0, 3, 1, 2), None, p_man, p_exp)
    return values, codes, exps


def fusable_quantize_and_pack(x, q_args, axis, p_args, pack_axis) -> bool:
    """Whether `bfp_quantize_and_pack` runs ``x`` (else the caller quantizes and packs apart):
    the pair's layout (`reference.quantize_and_pack_layout`) with E <= 8 for both formats and
    the quantizer's blocks tiling the last axis (a compiled kernel is specialised on the padded
    length, which for an attention product changes with every batch)."""
    (_, q_exp, q_block), (_, p_exp, _) = q_args, p_args
    layout = ref.quantize_and_pack_layout(x, q_args, axis, p_args, pack_axis)
    return layout and max(q_exp, p_exp) <= 8 and x.shape[-1] % q_block == 0


def bfp_quantize_and_pack(x, q_args, axis, p_args, pack_axis, *, pack_codes=None):
    """``bfp_quantize(x, *q_args, axis)`` and ``bfp_pack(x, *p_args, pack_axis)`` (nearest
    rounding), bit for bit, reading x once; see `fusable_quantize_and_pack` for when it applies.
    Returns (values, mantissa stream, exponent stream)."""
    p_man, p_exp, p_block = p_args
    x32 = x.detach().to(torch.float32)
    n, k = x32.shape[-2:]
    n_blocks = -(-n // p_block)
    matrices = x32.reshape(-1, n, k)
    if n_blocks * p_block != n:
        matrices = torch.nn.functional.pad(matrices, (0, 0, 0, n_blocks * p_block - n))
    rows = matrices.contiguous().reshape(matrices.shape[0], n_blocks, p_block, k)
    dyn = ((rows, 0), (rows, 1))
    fn = _quantize_and_codes_fn
    values, codes, exps = run(fn, rows, *q_args, p_man, p_exp, dynamic_dims=dyn)
    values = values.reshape(rows.shape[0], n_blocks * p_block, k)[:, :n].reshape(x.shape)
    mantissas, exponents = code_streams(codes, exps, rows.shape[0] * k, n, p_man, p_exp, pack_codes)
    return values.to(x.dtype), mantissas, exponents


def _by_power_then_bfp_fn(rows, p, finite, man_bits: int, s_man: int, s_exp: int):
    """One elementwise pass over ``rows`` [R, Bs]: fixed<man_bits> under the tensor's power p
    (`_quantize_by_power_fn`), and that result quantized again to BFP(s_man, s_exp, Bs) along
    the rows."""
    first = _quantize_by_power_fn(rows, p, finite, man_bits)
    return first, _bfp_quantize_fn(first, None, s_man, s_exp)


def fusable_quantize_chain(x, first_args, axis, second_args, second_axis) -> bool:
    """Whether `bfp_quantize_chain` runs ``x``: the pair's layout
    (`reference.quantize_chain_layout`), the first format with w <= 24, both with E <= 8."""
    (f_man, f_exp, _), (_, s_exp, _) = first_args, second_args
    layout = ref.quantize_chain_layout(x, first_args, axis, second_args, second_axis)
    return layout and f_man <= 24 and max(f_exp, s_exp) <= 8


def bfp_quantize_chain(x, first_args, axis, second_args, second_axis):
    """(q = bfp_quantize(x, *first_args), bfp_quantize(q, *second_args, last axis)), nearest
    rounding, bit for bit, in one pass after the tensor's power; see `fusable_quantize_chain`."""
    f_man, f_exp, _ = first_args
    s_man, s_exp, s_block = second_args
    flat = x.detach().to(torch.float32).reshape(-1)
    p, finite = run(_power_fn, flat, f_exp, dynamic_dims=((flat, 0),))
    rows = flat.reshape(-1, s_block)
    first, second = run(
        _by_power_then_bfp_fn, rows, p, finite, f_man, s_man, s_exp, dynamic_dims=((rows, 0),)
    )
    return first.reshape(x.shape).to(x.dtype), second.reshape(x.shape).to(x.dtype)


def bfp_unpack(mantissas, exponents, man_bits, exp_bits, block, shape, axis, dtype):
    numel = math.prod(shape)
    if block is None:
        codes = unpack_codes(mantissas, man_bits, numel).reshape(1, 1, numel)
        exps = unpack_codes(exponents, exp_bits, 1).reshape(1, 1, 1)
        dyn = ((codes, 2),)
        values = run(_bfp_decode_fn, codes, exps, man_bits, exp_bits, dynamic_dims=dyn)
        return values.reshape(shape).to(dtype)
    moved_shape = layout.moved_shape(shape, axis)
    n = moved_shape[-1]
    n_blocks = -(-n // block)
    rows = numel // n
    codes = unpack_codes(mantissas, man_bits, numel).reshape(rows, n)
    if n_blocks * block != n:
        codes = torch.nn.functional.pad(codes, (0, n_blocks * block - n))
    codes = codes.reshape(rows * n_blocks, block)
    exps = unpack_codes(exponents, exp_bits, rows * n_blocks).reshape(rows * n_blocks, 1)
    dyn = ((codes, 0), (exps, 0))  # one dynamic dimension of blocks, as in _run_blocks
    values = run(_bfp_decode_fn, codes, exps, man_bits, exp_bits, dynamic_dims=dyn)
    return layout.from_blocks(
        values.reshape(rows, n_blocks, block), n, moved_shape, shape, axis, dtype
    )


# BFP's kernels on the compile backend (docs/formats.md, "Implementations: the backends")
register_kernels("compile", "bfp", ref.KERNEL_NAMES, globals())
