"""Triton kernels for block floating point (BFP), dynamic fixed point and static fixed point.

These kernels implement, bit for bit, the semantics of ``dsq/formats/bfp_reference.py`` (SPEC 1,
1.1, 1.2) in float32 arithmetic. This module knows nothing of the formats above it: the host
glue (``dsq/formats/bfp_triton.py``, ``fixed_triton.py``) converts the input to float32, moves
the block axis last, makes it contiguous, draws the stochastic-rounding noise and calls the
launch functions at the end of this file with torch tensors and Python ints. Under
``TRITON_INTERPRET=1`` the same kernels run on CPU tensors (that is how the tests run them).

Layout seen by the kernels: a contiguous float32 tensor of ``N`` elements made of rows of ``n``
elements (the block axis, moved last); each row is cut into ``nb = ceil(n / B)`` blocks, the last
one possibly partial, and the blocks of all rows are numbered ``g = row * nb + col // B``. The
elements of consecutive blocks are consecutive in memory, so a range of blocks is a range of
memory. ``block=None`` (dynamic fixed point) is one block holding the whole tensor (GLOBAL).

Why float32 is exact here (the reference works in float64):

* ``e = floor(log2(max|x|))`` is read from the bits: the integer max of ``bits & 0x7FFFFFFF`` over
  a block is the bit pattern of ``max|x|`` for a finite block and is ``>= 0x7F800000`` iff the
  block holds a NaN or an infinity. Subnormal maxima take the exponent of their mantissa field.
* ``v = x * 2^k`` is computed as ``(x * 2^k1) * 2^k2`` with ``k1 = floor(k / 2)``, ``k2 = k - k1``,
  both powers normal float32 built from their exponent bits. Scaling up is exact. Scaling down can
  only underflow for values far below the block maximum (``|v| < 2^-126``): nearest rounding gives
  (signed) zero for them anyway, and stochastic rounding gives ``-1`` exactly when ``u == 0`` and
  ``x < 0``, a case handled explicitly.
* Rounding is done with a truncating float->int conversion (``|v| < 2^23``; larger floats are
  integers already) and exact comparisons; no libdevice, no magic-number additions.
* ``q * 2^-k`` is exact (two steps again): the true result is a float32 (see docs/formats.md).

Packing: a program owns ``8 * GROUPS`` consecutive elements, hence ``GROUPS * W`` whole bytes of a
``W``-bit stream; it assembles each group of 8 codes into ``W / S`` units of ``S`` bytes (4, 2 or
1) with shifts known at compile time and stores them. The BFP pack kernel first computes the
exponents of the blocks its elements touch (a [ROWS, BP] tile loop), writes their codes to a
global int16 array (which the exponent stream is then packed from), synchronizes its threads
with a barrier and reads them back (cache hits), so ``x`` is read from DRAM once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_ops import define

# Launch parameters (module globals so that tests can shrink them to exercise many programs).
# About 8 elements per thread keeps every kernel under ~64 registers (good occupancy on sm_90).
TILE_ELEMS = 2048  # elements per program of the BFP quantize tile kernel (ROWS * BP, at least BP)
PACK_GROUPS = 256  # groups of 8 elements per program of the pack kernels (8 * 256 = 2048)
ELEM_BLOCK = 2048  # elements per program of the elementwise kernels
REDUCE_BLOCK = 8192  # elements per program of the abs-max reduction (block=None)
NUM_WARPS = 8


# ============================================================================ device helpers
@triton.jit
def _pow2(n):
    """2^n as float32 for int32 n in [-126, 127], exact (built from the exponent bits)."""
    return ((n + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _abs_bits(x):
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _exp_code(maxbits, EMAX: tl.constexpr, ECODE_NAN: tl.constexpr):
    """Exponent code (e + EMAX, or ECODE_NAN) of a block from the int32 bits of max|x|."""
    biased = maxbits >> 23
    frac = maxbits & 0x7FFFFF
    # subnormal maximum: floor(log2(frac * 2^-149)) = floor(log2(frac)) - 149, frac exact in fp32
    sub = ((frac.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127) - 149
    e = tl.where(biased > 0, biased - 127, sub)
    e = tl.where(maxbits == 0, -EMAX, e)  # all-zero block: the canonical smallest exponent
    e = tl.minimum(tl.maximum(e, -EMAX), EMAX)
    return tl.where(maxbits < 0x7F800000, e + EMAX, ECODE_NAN)


@triton.jit
def _scale_exps(e, M: tl.constexpr):
    """(k1, k2) with k1 + k2 = (M - 2) - e, both powers of two normal in float32.

    e is limited to [-160, 190] first: below -149 only all-zero blocks exist (and any exponent
    gives zeros); for decoding arbitrary codes, results outside that range round to 0 / inf
    either way, so the limit never changes a result.
    """
    e = tl.minimum(tl.maximum(e, -160), 190)
    k = (M - 2) - e
    k1 = k >> 1  # floor(k / 2)
    return k1, k - k1


@triton.jit
def _round(v, x, u, STOCH: tl.constexpr):
    """R(v) as float32, zero keeping v's sign. Nearest: half to even. Stochastic: floor(v + u)."""
    vb = v.to(tl.uint32, bitcast=True)
    sign = vb & 0x80000000
    a = (vb & 0x7FFFFFFF).to(tl.float32, bitcast=True)  # |v|
    small = a < 8388608.0  # 2^23: larger floats are integers
    ti = tl.minimum(a, 8388608.0).to(tl.int32)
    ta = tl.where(small, ti.to(tl.float32), a)  # trunc(|v|)
    if STOCH:
        t = (ta.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)  # trunc(v)
        g = v - t  # exact, sign of v, |g| < 1
        up = (g >= 0.0) & (g >= 1.0 - u)  # 1 - u is exact: u is a multiple of 2^-24
        # (u == 0) & (x < 0) & (t == 0): v underflowed to -0.0 in float32, exact v is a tiny
        # negative number, floor(v + 0) = -1.
        down = ((g < 0.0) & (u < -g)) | ((u == 0.0) & (x < 0.0) & (t == 0.0))
        q = t + up.to(tl.float32) - down.to(tl.float32)
        q = ((q.to(tl.uint32, bitcast=True) & 0x7FFFFFFF) | sign).to(tl.float32, bitcast=True)
    else:
        f = a - ta
        up = (f > 0.5) | ((f == 0.5) & ((ti & 1) == 1))
        r = ta + up.to(tl.float32)
        q = (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return q


@triton.jit
def _bfp_core(x, u, e, M: tl.constexpr, EMAX: tl.constexpr, STOCH: tl.constexpr):
    """(q, k1, k2) for finite x of a block with shared exponent e: q = clamp(R(x * 2^k), +-L)."""
    if EMAX < 127:
        # e may be clamped below floor(log2(max|x|)): |x| >= 2^(EMAX+1) gives |v| >= 2^(M-1),
        # clamped to L anyway; limiting x there keeps v finite.
        x = tl.minimum(tl.maximum(x, -(2.0 ** (EMAX + 1))), 2.0 ** (EMAX + 1))
    k1, k2 = _scale_exps(e, M)
    v = (x * _pow2(k1)) * _pow2(k2)
    q = _round(v, x, u, STOCH)
    lim = 2.0 ** (M - 1) - 1.0  # as float32: exact for M <= 25, 2^(M-1) above (see _bfp_code)
    q = tl.minimum(tl.maximum(q, -lim), lim)
    return q, k1, k2


@triton.jit
def _bfp_value(q, k1, k2):
    return (q * _pow2(-k1)) * _pow2(-k2)


@triton.jit
def _bfp_code(q, M: tl.constexpr):
    """Sign-magnitude code: bit M-1 the sign of q (-0.0 included), bits 0..M-2 |q|."""
    qb = q.to(tl.uint32, bitcast=True)
    mag = (qb & 0x7FFFFFFF).to(tl.float32, bitcast=True).to(tl.uint32)
    mag = tl.minimum(mag, (1 << (M - 1)) - 1)
    return ((qb >> 31) << (M - 1)) | mag


@triton.jit
def _block_of(i, n, nb, B: tl.constexpr, EVEN: tl.constexpr):
    """Block number of flat element i (rows of n elements, nb blocks per row)."""
    if EVEN:
        g = i // B
    else:
        row = i // n
        g = row * nb + (i - row * n) // B
    return g


@triton.jit
def _block_tile(g, g_end, n, nb, B: tl.constexpr, BP: tl.constexpr, EVEN: tl.constexpr):
    """Offsets [len(g), BP] and mask of the elements of blocks g (g < g_end)."""
    c = tl.arange(0, BP)
    if EVEN:
        start = g * B
        mask = (g < g_end)[:, None] & (c < B)[None, :]
    else:
        row = g // nb
        bcol = g - row * nb
        start = row * n + bcol * B
        length = tl.minimum(n - bcol * B, B)
        mask = (g < g_end)[:, None] & (c[None, :] < length[:, None])
    return start[:, None] + c[None, :], mask


@triton.jit
def _split8(t, GB: tl.constexpr):
    """The 8 columns of a [GB, 8] tensor."""
    a, b = tl.split(tl.reshape(t, [GB, 4, 2]))  # columns 0,2,4,6 and 1,3,5,7
    a0, a1 = tl.split(tl.reshape(a, [GB, 2, 2]))  # 0,4 and 2,6
    b0, b1 = tl.split(tl.reshape(b, [GB, 2, 2]))  # 1,5 and 3,7
    c0, c4 = tl.split(a0)
    c2, c6 = tl.split(a1)
    c1, c5 = tl.split(b0)
    c3, c7 = tl.split(b1)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _store_packed(
    codes, out_ptr, group0, n_units, GB: tl.constexpr, W: tl.constexpr, S: tl.constexpr
):
    """Bit-pack [GB, 8] uint32 codes (< 2^W) of groups group0.. into S-byte units of a stream.

    Code c of group j occupies stream bits [(8 j + c) W, (8 j + c + 1) W), LSB first; a group
    is W bytes = W / S units of S bytes (little endian), stored at unit (group0 + j) * W/S + u.
    """
    cols = _split8(codes, GB)
    UB: tl.constexpr = 8 * S
    NU: tl.constexpr = W // S
    j = tl.arange(0, GB)
    for un in tl.static_range(NU):
        acc = tl.zeros([GB], dtype=tl.uint32)
        for c in tl.static_range(8):
            lo = c * W - un * UB  # where code c's bit 0 lands in this unit
            if lo < UB and lo + W > 0:
                if lo >= 0:
                    acc = acc | (cols[c] << lo)
                else:
                    acc = acc | (cols[c] >> (-lo))
        idx = (group0 + j) * NU + un
        if S == 4:
            val = acc.to(tl.int32, bitcast=True)
        elif S == 2:
            val = (acc & 0xFFFF).to(tl.int16)
        else:
            val = (acc & 0xFF).to(tl.uint8)
        tl.store(out_ptr + idx, val, mask=idx < n_units)


@triton.jit
def _read_codes(ptr, idx, mask, W: tl.constexpr):
    """Code idx of a W-bit stream of bytes (W <= 32), as uint32 (as uint64 for W > 25)."""
    q8 = idx // 8
    r8 = idx - q8 * 8
    byte = q8 * W + ((r8 * W) >> 3)  # (idx * W) // 8 without overflowing int32
    off = (r8 * W) & 7
    NBYTES: tl.constexpr = (W + 7 + 7) // 8
    if W > 25:
        acc = tl.zeros(idx.shape, dtype=tl.uint64)
        for t in tl.static_range(NBYTES):
            b = tl.load(ptr + byte + t, mask=mask & (t * 8 < off + W), other=0)
            acc = acc | (b.to(tl.uint64) << (8 * t))
        res = (acc >> off.to(tl.uint64)) & ((1 << W) - 1)
    else:
        acc = tl.zeros(idx.shape, dtype=tl.uint32)
        for t in tl.static_range(NBYTES):
            b = tl.load(ptr + byte + t, mask=mask & (t * 8 < off + W), other=0)
            acc = acc | (b.to(tl.uint32) << (8 * t))
        res = (acc >> off.to(tl.uint32)) & ((1 << W) - 1)
    return res


# ============================================================================ BFP kernels
@triton.jit
def _bfp_quantize_kernel(
    x_ptr,
    u_ptr,
    out_ptr,
    n_blocks,
    n,
    nb,
    M: tl.constexpr,
    EMAX: tl.constexpr,
    ECODE_NAN: tl.constexpr,
    B: tl.constexpr,
    BP: tl.constexpr,
    ROWS: tl.constexpr,
    EVEN: tl.constexpr,
    STOCH: tl.constexpr,
):
    """One pass: a tile of ROWS blocks x BP lanes; exponents in registers, values out."""
    g = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs, mask = _block_tile(g, n_blocks, n, nb, B, BP, EVEN)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    code = _exp_code(tl.max(_abs_bits(x), axis=1), EMAX, ECODE_NAN)
    finite = (code != ECODE_NAN)[:, None]
    e = (code - EMAX)[:, None]
    xs = tl.where(finite, x, 0.0)
    if STOCH:
        u = tl.load(u_ptr + offs, mask=mask, other=0.5)
    else:
        u = 0.0
    q, k1, k2 = _bfp_core(xs, u, e, M, EMAX, STOCH)
    out = tl.where(finite, _bfp_value(q, k1, k2), float("nan"))
    tl.store(out_ptr + offs, out, mask=mask)


@triton.jit
def _absmax_kernel(x_ptr, part_ptr, N, BLOCK: tl.constexpr):
    """Per-program max of the abs bit patterns (block=None: one block spanning the tensor)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i, mask=i < N, other=0.0)
    tl.store(part_ptr + tl.program_id(0), tl.max(_abs_bits(x), axis=0))


@triton.jit
def _global_ecode_kernel(maxbits_ptr, ecode_ptr, EMAX: tl.constexpr, ECODE_NAN: tl.constexpr):
    tl.store(ecode_ptr, _exp_code(tl.load(maxbits_ptr), EMAX, ECODE_NAN).to(tl.int16))


@triton.jit
def _bfp_quantize_global_kernel(
    x_ptr,
    u_ptr,
    out_ptr,
    maxbits_ptr,
    N,
    M: tl.constexpr,
    EMAX: tl.constexpr,
    ECODE_NAN: tl.constexpr,
    STOCH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < N
    code = _exp_code(tl.load(maxbits_ptr), EMAX, ECODE_NAN)
    finite = code != ECODE_NAN
    x = tl.load(x_ptr + i, mask=mask, other=0.0)
    xs = tl.where(finite, x, 0.0)
    if STOCH:
        u = tl.load(u_ptr + i, mask=mask, other=0.5)
    else:
        u = 0.0
    q, k1, k2 = _bfp_core(xs, u, code - EMAX, M, EMAX, STOCH)
    out = tl.where(finite, _bfp_value(q, k1, k2), float("nan"))
    tl.store(out_ptr + i, out, mask=mask)


@triton.jit
def _bfp_pack_kernel(
    x_ptr,
    u_ptr,
    ecode_ptr,
    out_ptr,
    N,
    n,
    nb,
    n_units,
    M: tl.constexpr,
    EMAX: tl.constexpr,
    ECODE_NAN: tl.constexpr,
    B: tl.constexpr,
    BP: tl.constexpr,
    ROWS: tl.constexpr,
    EVEN: tl.constexpr,
    GLOBAL: tl.constexpr,
    STOCH: tl.constexpr,
    GB: tl.constexpr,
    S: tl.constexpr,
):
    """Mantissa stream of 8 * GB elements per program (and, unless GLOBAL, their block codes)."""
    pid = tl.program_id(0)
    i0 = pid * (GB * 8)
    if not GLOBAL:
        # phase 1: exponent codes of every block that this program's elements touch
        g_lo = _block_of(i0, n, nb, B, EVEN)
        g_hi = _block_of(tl.minimum(i0 + GB * 8, N) - 1, n, nb, B, EVEN)
        for gs in range(g_lo, g_hi + 1, ROWS):
            g = gs + tl.arange(0, ROWS)
            offs, mask = _block_tile(g, g_hi + 1, n, nb, B, BP, EVEN)
            xb = tl.load(x_ptr + offs, mask=mask, other=0.0)
            code = _exp_code(tl.max(_abs_bits(xb), axis=1), EMAX, ECODE_NAN)
            tl.store(ecode_ptr + g, code.to(tl.int16), mask=g <= g_hi)
        tl.debug_barrier()  # the codes written above are read back by other threads below
    # phase 2: the codes of the elements, 8 per group, packed into whole bytes
    i = i0 + tl.arange(0, GB)[:, None] * 8 + tl.arange(0, 8)[None, :]
    mask = i < N
    x = tl.load(x_ptr + i, mask=mask, other=0.0)
    if GLOBAL:
        ecode = tl.load(ecode_ptr).to(tl.int32)
    else:
        ecode = tl.load(ecode_ptr + _block_of(i, n, nb, B, EVEN), mask=mask, other=0)
        ecode = ecode.to(tl.int32)
    finite = ecode != ECODE_NAN
    xs = tl.where(finite, x, 0.0)
    if STOCH:
        u = tl.load(u_ptr + i, mask=mask, other=0.5)
    else:
        u = 0.0
    q, k1, k2 = _bfp_core(xs, u, ecode - EMAX, M, EMAX, STOCH)
    codes = tl.where(finite & mask, _bfp_code(q, M), 0)
    _store_packed(codes.to(tl.uint32), out_ptr, pid * GB, n_units, GB, M, S)


@triton.jit
def _pack_codes_kernel(
    codes_ptr, out_ptr, count, n_units, W: tl.constexpr, S: tl.constexpr, GB: tl.constexpr
):
    """pack_bits of an integer array (the exponent codes) at W bits per code."""
    pid = tl.program_id(0)
    i = pid * (GB * 8) + tl.arange(0, GB)[:, None] * 8 + tl.arange(0, 8)[None, :]
    c = tl.load(codes_ptr + i, mask=i < count, other=0).to(tl.int32)
    _store_packed((c & ((1 << W) - 1)).to(tl.uint32), out_ptr, pid * GB, n_units, GB, W, S)


@triton.jit
def _bfp_unpack_kernel(
    man_ptr,
    exp_ptr,
    out_ptr,
    N,
    n,
    nb,
    M: tl.constexpr,
    E: tl.constexpr,
    EMAX: tl.constexpr,
    B: tl.constexpr,
    EVEN: tl.constexpr,
    GLOBAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < N
    code = _read_codes(man_ptr, i, mask, M)
    if GLOBAL:
        g = tl.zeros([BLOCK], dtype=tl.int32)
    else:
        g = _block_of(i, n, nb, B, EVEN)
    ecode = _read_codes(exp_ptr, g, mask, E).to(tl.int32)
    mag = (code & ((1 << (M - 1)) - 1)).to(tl.int32).to(tl.float32)
    # the sign set as a bit, so that a zero magnitude with its sign decodes to -0.0: a negation
    # may compile to 0 - mag on a GPU, which gives +0.0
    sign = (((code >> (M - 1)) & 1).to(tl.uint32)) << 31
    q = (mag.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    k1, k2 = _scale_exps(ecode - EMAX, M)
    out = tl.where(ecode == (1 << E) - 1, float("nan"), _bfp_value(q, k1, k2))
    tl.store(out_ptr + i, out, mask=mask)


# ============================================================================ fused pairs
@triton.jit
def _bfp_quantize_and_codes_kernel(
    x_ptr,
    out_ptr,
    codes_ptr,
    ecode_ptr,
    n,
    k,
    nb,
    QM: tl.constexpr,
    QEMAX: tl.constexpr,
    QECODE_NAN: tl.constexpr,
    QB: tl.constexpr,
    PM: tl.constexpr,
    PEMAX: tl.constexpr,
    PECODE_NAN: tl.constexpr,
    PB: tl.constexpr,
    PBP: tl.constexpr,
    TK: tl.constexpr,
):
    """One read of a tile of x [L, n, k]: PB rows (one stash block along n) by TK columns.

    Writes q = BFP(QM, QB) of the tile along k (x's layout) and the stash's codes, BFP(PM, PB)
    along n: mantissa codes in the moved layout [L, k, n] (the stream's order) and each column's
    exponent code at [L, k, nb]. Program (l * nb + jb, column tile)."""
    l = tl.program_id(0) // nb
    jb = tl.program_id(0) % nb
    lane = tl.arange(0, PBP)
    rows = jb * PB + lane
    cols = tl.program_id(1) * TK + tl.arange(0, TK)
    row_ok = (lane < PB) & (rows < n)
    col_ok = cols < k
    mask = row_ok[:, None] & col_ok[None, :]
    offs = (l * n + rows)[:, None] * k + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    # q0: blocks of QB along k
    xq = tl.reshape(x, [PBP, TK // QB, QB])
    qcode = _exp_code(tl.max(_abs_bits(xq), axis=2), QEMAX, QECODE_NAN)
    qfinite = (qcode != QECODE_NAN)[:, :, None]
    q, k1, k2 = _bfp_core(
        tl.where(qfinite, xq, 0.0), 0.0, (qcode - QEMAX)[:, :, None], QM, QEMAX, False
    )
    values = tl.where(qfinite, _bfp_value(q, k1, k2), float("nan"))
    tl.store(out_ptr + offs, tl.reshape(values, [PBP, TK]), mask=mask)
    # the stash: one block per column, the PB rows of this tile
    pcode = _exp_code(tl.max(_abs_bits(x), axis=0), PEMAX, PECODE_NAN)
    tl.store(ecode_ptr + (l * k + cols) * nb + jb, pcode.to(tl.int16), mask=col_ok)
    pfinite = (pcode != PECODE_NAN)[None, :]
    qp, _, _ = _bfp_core(tl.where(pfinite, x, 0.0), 0.0, (pcode - PEMAX)[None, :], PM, PEMAX, False)
    codes = tl.where(pfinite, _bfp_code(qp, PM), 0)
    moved = (l * k + cols)[None, :] * n + rows[:, None]
    tl.store(codes_ptr + moved, codes.to(codes_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _global_then_blocks_kernel(
    x_ptr,
    first_ptr,
    second_ptr,
    maxbits_ptr,
    n_blocks,
    FM: tl.constexpr,
    FEMAX: tl.constexpr,
    FECODE_NAN: tl.constexpr,
    SM: tl.constexpr,
    SEMAX: tl.constexpr,
    SECODE_NAN: tl.constexpr,
    SB: tl.constexpr,
    SBP: tl.constexpr,
    ROWS: tl.constexpr,
):
    """ROWS blocks of SB consecutive elements: first = BFP(FM) under the tensor's exponent (one
    block spanning it), second = first quantized again to BFP(SM, SB) per block."""
    g = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    lane = tl.arange(0, SBP)
    mask = (g < n_blocks)[:, None] & (lane < SB)[None, :]
    offs = g[:, None] * SB + lane[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    fcode = _exp_code(tl.load(maxbits_ptr), FEMAX, FECODE_NAN)
    ffinite = fcode != FECODE_NAN
    q, k1, k2 = _bfp_core(tl.where(ffinite, x, 0.0), 0.0, fcode - FEMAX, FM, FEMAX, False)
    first = tl.where(ffinite, _bfp_value(q, k1, k2), float("nan"))
    tl.store(first_ptr + offs, first, mask=mask)
    scode = _exp_code(tl.max(_abs_bits(tl.where(mask, first, 0.0)), axis=1), SEMAX, SECODE_NAN)
    sfinite = (scode != SECODE_NAN)[:, None]
    q2, j1, j2 = _bfp_core(
        tl.where(sfinite, first, 0.0), 0.0, (scode - SEMAX)[:, None], SM, SEMAX, False
    )
    second = tl.where(sfinite, _bfp_value(q2, j1, j2), float("nan"))
    tl.store(second_ptr + offs, second, mask=mask)


# ============================================================================ static fixed point
@triton.jit
def _fixed_core(x, u, W: tl.constexpr, F: tl.constexpr, STOCH: tl.constexpr):
    """(q, finite): q = clamp(R(x * 2^F), -2^(W-1), 2^(W-1)-1) in float32, +0.0 for zero."""
    finite = _abs_bits(x) < 0x7F800000
    # |x| >= 2^(W-F) gives |v| >= 2^W, clamped anyway; limiting x keeps v finite
    big = 2.0 ** (W - F)
    xs = tl.minimum(tl.maximum(tl.where(finite, x, 0.0), -big), big)
    v = xs * (2.0**F)
    q = _round(v, xs, u, STOCH)
    # float32(2^(W-1)-1) is 2^(W-1) for W >= 26, as the reference's float32 result
    q = tl.minimum(tl.maximum(q, -(2.0 ** (W - 1))), 2.0 ** (W - 1) - 1.0)
    q = tl.where(q == 0.0, 0.0, q)  # two's complement has one zero: +0.0
    return q, finite


@triton.jit
def _fixed_code(q, W: tl.constexpr):
    """W-bit two's-complement code of q, clamped to the exact integer range."""
    if W > 25:
        qi = tl.minimum(q.to(tl.int64), 2 ** (W - 1) - 1)
        code = (qi & ((1 << W) - 1)).to(tl.uint32)
    else:
        code = (q.to(tl.int32) & ((1 << W) - 1)).to(tl.uint32)
    return code


@triton.jit
def _fixed_quantize_kernel(
    x_ptr,
    u_ptr,
    out_ptr,
    N,
    W: tl.constexpr,
    F: tl.constexpr,
    STOCH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < N
    x = tl.load(x_ptr + i, mask=mask, other=0.0)
    if STOCH:
        u = tl.load(u_ptr + i, mask=mask, other=0.5)
    else:
        u = 0.0
    q, finite = _fixed_core(x, u, W, F, STOCH)
    out = tl.where(finite, q * (2.0**-F), float("nan"))
    tl.store(out_ptr + i, out, mask=mask)


@triton.jit
def _fixed_pack_kernel(
    x_ptr,
    u_ptr,
    out_ptr,
    nan_ptr,
    N,
    n_units,
    n_nan_bytes,
    W: tl.constexpr,
    F: tl.constexpr,
    STOCH: tl.constexpr,
    GB: tl.constexpr,
    S: tl.constexpr,
):
    pid = tl.program_id(0)
    i = pid * (GB * 8) + tl.arange(0, GB)[:, None] * 8 + tl.arange(0, 8)[None, :]
    mask = i < N
    x = tl.load(x_ptr + i, mask=mask, other=0.0)
    if STOCH:
        u = tl.load(u_ptr + i, mask=mask, other=0.5)
    else:
        u = 0.0
    q, finite = _fixed_core(x, u, W, F, STOCH)
    codes = tl.where(mask, _fixed_code(q, W), 0)
    _store_packed(codes, out_ptr, pid * GB, n_units, GB, W, S)
    nan_bits = (mask & ~finite).to(tl.uint32)
    _store_packed(nan_bits, nan_ptr, pid * GB, n_nan_bytes, GB, 1, 1)


@triton.jit
def _fixed_unpack_kernel(
    int_ptr,
    nan_ptr,
    out_ptr,
    N,
    W: tl.constexpr,
    F: tl.constexpr,
    HAS_NAN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < N
    code = _read_codes(int_ptr, i, mask, W)
    if W > 25:
        c = code.to(tl.int64)
    else:
        c = code.to(tl.int32)
    signed = c - ((c >> (W - 1)) << W)  # sign-extend
    out = signed.to(tl.float32) * (2.0**-F)
    if HAS_NAN:
        bit = (tl.load(nan_ptr + (i >> 3), mask=mask, other=0).to(tl.int32) >> (i & 7)) & 1
        out = tl.where(bit != 0, float("nan"), out)
    tl.store(out_ptr + i, out, mask=mask)


# ============================================================================ launch functions
_OPTS = {"enable_fp_fusion": False}


def _warps(elems: int) -> int:
    """NUM_WARPS, more for big tiles (at most 16 elements per thread up to 16 warps)."""
    return max(NUM_WARPS, min(16, elems // (16 * 32)))


def _check(x):
    if x.numel() >= 2**31:
        raise ValueError("the Triton kernels index with int32: tensors must hold < 2^31 elements")


def _unit_bytes(width: int) -> int:
    return 4 if width % 4 == 0 else (2 if width % 2 == 0 else 1)


def _stream(n_codes: int, width: int, device):
    """(uint8 buffer rounded up to whole units, its typed view, n_units, exact byte count)."""
    nbytes = (n_codes * width + 7) // 8
    s = _unit_bytes(width)
    n_units = (nbytes + s - 1) // s
    buf = torch.empty(n_units * s, dtype=torch.uint8, device=device)
    view = {4: torch.int32, 2: torch.int16, 1: torch.uint8}[s]
    return buf, buf.view(view), n_units, nbytes


def _bfp_consts(man_bits: int, exp_bits: int) -> dict:
    if not (2 <= man_bits <= 32 and 2 <= exp_bits <= 10):
        raise ValueError(f"unsupported BFP widths m={man_bits}, E={exp_bits}")
    emax = 2 ** (exp_bits - 1) - 1
    return {"M": man_bits, "EMAX": emax, "ECODE_NAN": 2**exp_bits - 1}


def _blocking(n: int, block: int) -> tuple[int, int, bool]:
    """(effective block size, blocks per row, EVEN). A block at least a row long is the row."""
    if n <= block:
        return n, 1, True
    return block, -(-n // block), n % block == 0


def bfp_quantize_blocks(x, u, n: int, man_bits: int, exp_bits: int, block: int):
    """BFP fake-quant of contiguous float32 ``x`` (rows of ``n``, blocks along rows)."""
    _check(x)
    out = torch.empty_like(x)
    N = x.numel()
    B, nb, even = _blocking(n, block)
    n_blocks = (N // n) * nb
    BP = triton.next_power_of_2(B)
    rows = max(1, TILE_ELEMS // BP)
    grid = (triton.cdiv(n_blocks, rows),)
    _bfp_quantize_kernel[grid](
        x,
        x if u is None else u,
        out,
        n_blocks,
        n,
        nb,
        **_bfp_consts(man_bits, exp_bits),
        B=B,
        BP=BP,
        ROWS=rows,
        EVEN=even,
        STOCH=u is not None,
        num_warps=_warps(rows * BP),
        **_OPTS,
    )
    return out


def _global_maxbits(x):
    N = x.numel()
    nprog = triton.cdiv(N, REDUCE_BLOCK)
    parts = torch.empty(nprog, dtype=torch.int32, device=x.device)
    _absmax_kernel[(nprog,)](x, parts, N, BLOCK=REDUCE_BLOCK, num_warps=8)
    return parts.amax().reshape(1)


def bfp_quantize_global(x, u, man_bits: int, exp_bits: int):
    """Dynamic fixed point: BFP with one block spanning all of contiguous float32 ``x``."""
    _check(x)
    out = torch.empty_like(x)
    N = x.numel()
    maxbits = _global_maxbits(x)
    _bfp_quantize_global_kernel[(triton.cdiv(N, ELEM_BLOCK),)](
        x,
        x if u is None else u,
        out,
        maxbits,
        N,
        **_bfp_consts(man_bits, exp_bits),
        STOCH=u is not None,
        BLOCK=ELEM_BLOCK,
        num_warps=_warps(ELEM_BLOCK),
        **_OPTS,
    )
    return out


def bfp_pack(x, u, n: int, man_bits: int, exp_bits: int, block: int | None):
    """(mantissa stream, exponent stream) of contiguous float32 ``x`` (rows of ``n``).

    ``block=None``: one block over all of ``x`` (``n`` is then ignored).
    """
    _check(x)
    consts = _bfp_consts(man_bits, exp_bits)
    N = x.numel()
    if block is None:
        B, nb, even, n_blocks, n = 1, 1, True, 1, N
        ecodes = torch.empty(1, dtype=torch.int16, device=x.device)
        _global_ecode_kernel[(1,)](
            _global_maxbits(x), ecodes, EMAX=consts["EMAX"], ECODE_NAN=consts["ECODE_NAN"]
        )
    else:
        B, nb, even = _blocking(n, block)
        n_blocks = (N // n) * nb
        ecodes = torch.empty(n_blocks, dtype=torch.int16, device=x.device)
    BP = triton.next_power_of_2(B)
    # 8 * gb elements per program, at least 2 blocks' worth up to B = 2048 (then at least one
    # block): blocks that straddle two programs have their exponent computed by both
    gb = triton.next_power_of_2(max(PACK_GROUPS, min(BP // 4, 512)))
    rows = max(1, (8 * gb) // BP)
    buf, view, n_units, nbytes = _stream(N, man_bits, x.device)
    _bfp_pack_kernel[(triton.cdiv(N, 8 * gb),)](
        x,
        x if u is None else u,
        ecodes,
        view,
        N,
        n,
        nb,
        n_units,
        **consts,
        B=B,
        BP=BP,
        ROWS=rows,
        EVEN=even,
        GLOBAL=block is None,
        STOCH=u is not None,
        GB=gb,
        S=_unit_bytes(man_bits),
        num_warps=_warps(8 * gb),
        **_OPTS,
    )
    return buf[:nbytes], _pack_codes(ecodes, exp_bits)


def _pack_codes(codes, width: int):
    """``pack_bits`` of a 1-D integer tensor (values < 2^width) as a uint8 stream."""
    buf, view, n_units, nbytes = _stream(codes.numel(), width, codes.device)
    gb = PACK_GROUPS
    _pack_codes_kernel[(triton.cdiv(codes.numel(), 8 * gb),)](
        codes,
        view,
        codes.numel(),
        n_units,
        W=width,
        S=_unit_bytes(width),
        GB=gb,
        num_warps=_warps(8 * gb),
    )
    return buf[:nbytes]


def bfp_unpack(
    mantissas, exponents, N: int, n: int, man_bits: int, exp_bits: int, block: int | None, device
):
    """Values (float32, flat, rows of ``n`` as packed) from the two streams of ``bfp_pack``."""
    consts = _bfp_consts(man_bits, exp_bits)
    out = torch.empty(N, dtype=torch.float32, device=device)
    if block is None:
        B, nb, even = 1, 1, True
    else:
        B, nb, even = _blocking(n, block)
    _bfp_unpack_kernel[(triton.cdiv(N, ELEM_BLOCK),)](
        mantissas,
        exponents,
        out,
        N,
        n,
        nb,
        M=man_bits,
        E=exp_bits,
        EMAX=consts["EMAX"],
        B=B,
        EVEN=even,
        GLOBAL=block is None,
        BLOCK=ELEM_BLOCK,
        num_warps=_warps(ELEM_BLOCK),
        **_OPTS,
    )
    return out


def _fixed_check(width: int, frac_bits: int):
    if not (2 <= width <= 32 and 0 <= frac_bits < width):
        raise ValueError(f"unsupported fixed point widths w={width}, f={frac_bits}")


def fixed_quantize(x, u, width: int, frac_bits: int):
    """Static fixed point fake-quant of contiguous float32 ``x``."""
    _check(x)
    _fixed_check(width, frac_bits)
    out = torch.empty_like(x)
    N = x.numel()
    _fixed_quantize_kernel[(triton.cdiv(N, ELEM_BLOCK),)](
        x,
        x if u is None else u,
        out,
        N,
        W=width,
        F=frac_bits,
        STOCH=u is not None,
        BLOCK=ELEM_BLOCK,
        num_warps=_warps(ELEM_BLOCK),
        **_OPTS,
    )
    return out


def fixed_pack(x, u, width: int, frac_bits: int):
    """(w-bit two's-complement stream, 1-bit non-finite mask stream) of contiguous ``x``."""
    _check(x)
    _fixed_check(width, frac_bits)
    N = x.numel()
    buf, view, n_units, nbytes = _stream(N, width, x.device)
    nan_buf, _, n_nan, _ = _stream(N, 1, x.device)
    gb = PACK_GROUPS
    _fixed_pack_kernel[(triton.cdiv(N, 8 * gb),)](
        x,
        x if u is None else u,
        view,
        nan_buf,
        N,
        n_units,
        n_nan,
        W=width,
        F=frac_bits,
        STOCH=u is not None,
        GB=gb,
        S=_unit_bytes(width),
        num_warps=_warps(8 * gb),
        **_OPTS,
    )
    return buf[:nbytes], nan_buf


def fixed_unpack(integers, nan_mask, N: int, width: int, frac_bits: int, device):
    _fixed_check(width, frac_bits)
    out = torch.empty(N, dtype=torch.float32, device=device)
    _fixed_unpack_kernel[(triton.cdiv(N, ELEM_BLOCK),)](
        integers,
        integers if nan_mask is None else nan_mask,
        out,
        N,
        W=width,
        F=frac_bits,
        HAS_NAN=nan_mask is not None,
        BLOCK=ELEM_BLOCK,
        num_warps=_warps(ELEM_BLOCK),
        **_OPTS,
    )
    return out


def _prefixed(prefix: str, consts: dict) -> dict:
    return {prefix + name: value for name, value in consts.items()}


def bfp_quantize_and_pack(x, q_args, p_args):
    """Fused pair of contiguous float32 ``x`` [L, n, k]: (BFP q_args along k, as x; the
    mantissa and exponent streams of BFP p_args along n, byte for byte as ``bfp_pack`` of x with
    n moved last). q_args = (m, E, B) with B a power of two dividing k; p_args = (m, E, B)."""
    _check(x)
    (q_man, q_exp, q_block), (p_man, p_exp, p_block) = q_args, p_args
    lead, n, k = x.shape
    nb = -(-n // p_block)
    out = torch.empty_like(x)
    # one narrow integer per code (the pack kernel reads any integer type): a quarter of the
    # traffic of int32 for stashes of up to 8 bits
    code_dtype = torch.uint8 if p_man <= 8 else torch.int16 if p_man <= 16 else torch.int32
    codes = torch.empty(x.numel(), dtype=code_dtype, device=x.device)
    ecodes = torch.empty(lead * k * nb, dtype=torch.int16, device=x.device)
    pbp = triton.next_power_of_2(p_block)
    tk = max(q_block, min(triton.next_power_of_2(k), max(q_block, TILE_ELEMS // pbp)))
    grid = (lead * nb, triton.cdiv(k, tk))
    _bfp_quantize_and_codes_kernel[grid](
        x,
        out,
        codes,
        ecodes,
        n,
        k,
        nb,
        **_prefixed("Q", _bfp_consts(q_man, q_exp)),
        QB=q_block,
        **_prefixed("P", _bfp_consts(p_man, p_exp)),
        PB=p_block,
        PBP=pbp,
        TK=tk,
        num_warps=_warps(pbp * tk),
        **_OPTS,
    )
    return out, _pack_codes(codes, p_man), _pack_codes(ecodes, p_exp)


def _bfp_quantize_chain(x, first_args, second_args):
    """Fused pair of contiguous float32 ``x`` (last axis a multiple of the second block):
    (first = BFP first_args with one block spanning x, BFP second_args of first along the last
    axis)."""
    _check(x)
    (f_man, f_exp, _), (s_man, s_exp, s_block) = first_args, second_args
    first, second = torch.empty_like(x), torch.empty_like(x)
    n_blocks = x.numel() // s_block
    sbp = triton.next_power_of_2(s_block)
    rows = max(1, TILE_ELEMS // sbp)
    _global_then_blocks_kernel[(triton.cdiv(n_blocks, rows),)](
        x,
        first,
        second,
        _global_maxbits(x),
        n_blocks,
        **_prefixed("F", _bfp_consts(f_man, f_exp)),
        **_prefixed("S", _bfp_consts(s_man, s_exp)),
        SB=s_block,
        SBP=sbp,
        ROWS=rows,
        num_warps=_warps(rows * sbp),
        **_OPTS,
    )
    return first, second


# ----------------------------------------------------------------------------- as torch ops
# Each launch above is registered as a torch custom op (``dsq::triton_*``) with a fake kernel
# that gives its outputs' shapes and dtypes, and the module's public names call the ops: a graph
# torch.compile traces meets an op it can place without running Triton, as the C kernels are
# (dsq/kernels/cpu.py). The launches stay the implementation, on CUDA or under the interpreter.
def _stream_fake(like: torch.Tensor, codes: int, width: int) -> torch.Tensor:
    return like.new_empty((codes * width + 7) // 8, dtype=torch.uint8)


def _pack_fake(x, u, n, man_bits, exp_bits, block):
    N = x.numel()
    count = 1 if block is None else (N // n) * _blocking(n, block)[1]
    return _stream_fake(x, N, man_bits), _stream_fake(x, count, exp_bits)


def _quantize_and_pack_fake(x, q_args, p_args):
    lead, n, k = x.shape
    p_man, p_exp, p_block = p_args
    nb = -(-n // p_block)
    return (torch.empty_like(x), _stream_fake(x, x.numel(), p_man),
            _stream_fake(x, lead * k * nb, p_exp))  # fmt: skip


_OPS = {
    "bfp_quantize_blocks": (
        "(Tensor x, Tensor? u, int n, int man_bits, int exp_bits, int block) -> Tensor",
        bfp_quantize_blocks,
        lambda x, u, n, man_bits, exp_bits, block: torch.empty_like(x),
    ),
    "bfp_quantize_global": (
        "(Tensor x, Tensor? u, int man_bits, int exp_bits) -> Tensor",
        bfp_quantize_global,
        lambda x, u, man_bits, exp_bits: torch.empty_like(x),
    ),
    "bfp_pack": (
        "(Tensor x, Tensor? u, int n, int man_bits, int exp_bits, int? block) -> (Tensor, Tensor)",
        bfp_pack,
        _pack_fake,
    ),
    "pack_codes": (
        "(Tensor codes, int width) -> Tensor",
        _pack_codes,
        lambda codes, width: _stream_fake(codes, codes.numel(), width),
    ),
    "bfp_unpack": (
        "(Tensor mantissas, Tensor exponents, int N, int n, int man_bits, int exp_bits, "
        "int? block, Device device) -> Tensor",
        bfp_unpack,
        lambda mantissas, exponents, N, n, m, e, block, device: mantissas.new_empty(
            N, dtype=torch.float32, device=device
        ),
    ),
    "fixed_quantize": (
        "(Tensor x, Tensor? u, int width, int frac_bits) -> Tensor",
        fixed_quantize,
        lambda x, u, width, frac_bits: torch.empty_like(x),
    ),
    "fixed_pack": (
        "(Tensor x, Tensor? u, int width, int frac_bits) -> (Tensor, Tensor)",
        fixed_pack,
        lambda x, u, width, frac_bits: (
            _stream_fake(x, x.numel(), width),
            _stream_fake(x, x.numel(), 1),
        ),
    ),
    "fixed_unpack": (
        "(Tensor integers, Tensor? nan_mask, int N, int width, int frac_bits, Device device) "
        "-> Tensor",
        fixed_unpack,
        lambda integers, nan_mask, N, width, frac_bits, device: integers.new_empty(
            N, dtype=torch.float32, device=device
        ),
    ),
    "bfp_quantize_and_pack": (
        "(Tensor x, int[] q_args, int[] p_args) -> (Tensor, Tensor, Tensor)",
        bfp_quantize_and_pack,
        _quantize_and_pack_fake,
    ),
    # the first format's block is the whole tensor (None in first_args): not an argument
    "bfp_quantize_chain": (
        "(Tensor x, int f_man, int f_exp, int s_man, int s_exp, int s_block) -> (Tensor, Tensor)",
        lambda x, f_man, f_exp, *second: _bfp_quantize_chain(x, (f_man, f_exp, None), second),
        lambda x, *args: (torch.empty_like(x), torch.empty_like(x)),
    ),
}
_chain_op = define("bfp_quantize_chain", *_OPS.pop("bfp_quantize_chain"))
for _name, (_schema, _launch, _fake) in _OPS.items():
    globals()[_name] = define(_name, _schema, _launch, _fake)


def bfp_quantize_chain(x, first_args, second_args):
    """`_bfp_quantize_chain` through its op (``dsq::triton_bfp_quantize_chain``)."""
    (f_man, f_exp, _), (s_man, s_exp, s_block) = first_args, second_args
    return _chain_op(x, f_man, f_exp, s_man, s_exp, s_block)
