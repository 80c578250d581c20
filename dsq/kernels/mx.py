"""Triton kernels for the OCP MX formats and NVFP4 (docs/formats.md, "MX formats", "NVFP4").

They compute, bit for bit, what ``dsq/formats/mx.py`` and ``dsq/formats/nvfp4.py`` define, for
float32 rows [R, n] with the blocks along the rows (the last one of each row may be partial):
the values of quantize, the codes of a pack (one byte each, with one scale code per block) and
the values of an unpack from its codes. Like ``bfp.py`` this module knows nothing of the formats
above it: the host glue (``dsq/formats/mx_triton.py``) lays the tensor out, computes NVFP4's
tensor scale and bit-packs the codes. Under ``TRITON_INTERPRET=1`` the kernels run on CPU
tensors (the tests).

A program takes a tile of G blocks by BP lanes (BP the block length rounded up to a power of
two, the extra lanes masked). Why float32 is exact, step by step as in ``mx_cpu.c``'s header,
with two differences of means: rounding to the element's grid scales |v| by 2^-k (exact) and
rounds the integer part by truncation and an exact comparison of the remainder with 1/2, as
``bfp.py`` does, rather than by a magic-number addition; NVFP4's divisions are ``div_rn``
(correctly rounded, where a GPU's default division may not be).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_ops import define

TILE_ELEMS = 2048  # lanes per program (G blocks * BP)
DECODE_BLOCK = 2048  # elements per program of the decode kernel
NUM_WARPS = 4


@triton.jit
def _pow2(n):
    """2^n as float32 for int32 n in [-126, 127], exact."""
    return ((n + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _scale_by_pow2(x, n):
    """x * 2^n for int32 n in [-254, 254], as two exact normal powers (an underflow far below
    the values that matter rounds to a zero of the same sign either way)."""
    n1 = n >> 1
    return x * _pow2(n1) * _pow2(n - n1)


@triton.jit
def _element_round(v, M: tl.constexpr, EMIN: tl.constexpr, MAXN: tl.constexpr,
                   INTEGER: tl.constexpr):  # fmt: skip
    """E(v): nearest element value to v (finite), ties to even, saturated, sign kept (INT8: +0)."""
    vb = v.to(tl.uint32, bitcast=True)
    sign = vb & 0x80000000
    a = (vb & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    ev = ((a.to(tl.int32, bitcast=True) >> 23) - 127).to(tl.int32)
    k = tl.maximum(ev, EMIN) - M
    w = _scale_by_pow2(a, -k)  # |v| / 2^k < 2^(M + 1): exact
    ti = w.to(tl.int32)  # truncation
    f = w - ti.to(tl.float32)  # exact
    up = (f > 0.5) | ((f == 0.5) & ((ti & 1) == 1))
    r = _scale_by_pow2((ti + up.to(tl.int32)).to(tl.float32), k)
    r = tl.minimum(r, MAXN)
    if INTEGER:
        return tl.where(
            r == 0.0, 0.0, (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
        )
    return (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _element_code(q, BITS: tl.constexpr, M: tl.constexpr, EMIN: tl.constexpr,
                  INTEGER: tl.constexpr):  # fmt: skip
    """The code (int32, low BITS bits) of an element value q on the grid."""
    if INTEGER:
        return (q * 64.0).to(tl.int32) & 0xFF
    qb = q.to(tl.uint32, bitcast=True)
    sign = ((qb >> 31) << (BITS - 1)).to(tl.int32)
    u = (qb & 0x7FFFFFFF).to(tl.int32)
    biased = u >> 23
    normal = ((biased - 127 - EMIN + 1) << M) | ((u >> (23 - M)) & ((1 << M) - 1))
    steps = _scale_by_pow2(u.to(tl.float32, bitcast=True), tl.full(u.shape, M - EMIN, tl.int32))
    subnormal = tl.minimum(steps, 255.0).to(tl.int32)
    return sign | tl.where(biased - 127 >= EMIN, normal, subnormal)


@triton.jit
def _tile(pid, total, n, nb, B: tl.constexpr, BP: tl.constexpr, G: tl.constexpr):
    """(element offsets [G, BP], mask, block ids [G]) of program pid's tile of blocks."""
    g = pid * G + tl.arange(0, G)
    lane = tl.arange(0, BP)
    row, col = g // nb, (g % nb) * B
    offsets = row[:, None] * n + col[:, None] + lane[None, :]
    mask = (g[:, None] < total) & (lane[None, :] < B) & (col[:, None] + lane[None, :] < n)
    return offsets, mask, g


@triton.jit
def _mx_kernel(x_ptr, out_ptr, codes_ptr, scales_ptr, total, n, nb, B: tl.constexpr,
               BP: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr, M: tl.constexpr,
               EMIN: tl.constexpr, EMAX: tl.constexpr, MAXN: tl.constexpr,
               INTEGER: tl.constexpr, CODES: tl.constexpr):  # fmt: skip
    offsets, mask, g = _tile(tl.program_id(0), total, n, nb, B, BP, G)
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    amax = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
    finite = amax < 0x7F800000
    s = tl.minimum(tl.maximum((amax >> 23) - 127 - EMAX, -127), 127)
    v = _scale_by_pow2(tl.where(finite[:, None], x, 0.0), -s[:, None])
    q = _element_round(v, M, EMIN, MAXN, INTEGER)
    if CODES:
        code = tl.where(finite[:, None], _element_code(q, BITS, M, EMIN, INTEGER), 0)
        tl.store(codes_ptr + offsets, code.to(tl.uint8), mask=mask)
        tl.store(scales_ptr + g, tl.where(finite, s + 127, 255).to(tl.uint8), mask=g < total)
    else:
        values = _scale_by_pow2(q, s[:, None])
        tl.store(out_ptr + offsets, tl.where(finite[:, None], values, float("nan")), mask=mask)


@triton.jit
def _nvfp4_kernel(x_ptr, s_ptr, out_ptr, codes_ptr, scales_ptr, total, n, nb,
                  G: tl.constexpr, CODES: tl.constexpr):  # fmt: skip
    offsets, mask, g = _tile(tl.program_id(0), total, n, nb, 16, 16, G)
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    s = tl.load(s_ptr)
    bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    finite = tl.max(bits, axis=1) < 0x7F800000
    b = tl.max(tl.where(bits < 0x7F800000, bits, 0), axis=1).to(tl.float32, bitcast=True)
    t = tl.math.div_rn(tl.math.div_rn(b, 6.0), s)
    t = tl.minimum(tl.maximum(t, 0.015625), 448.0)
    c = _element_round(t, 3, -6, 448.0, False)  # E4M3: t is positive and normal
    r = tl.math.div_rn(tl.math.div_rn(1.0, s), c)
    e = _element_round(tl.where(finite[:, None], x, 0.0) * r[:, None], 1, 0, 6.0, False)
    if CODES:
        code = tl.where(finite[:, None], _element_code(e, 4, 1, 0, False), 0)
        tl.store(codes_ptr + offsets, code.to(tl.uint8), mask=mask)
        scale = tl.where(finite, _element_code(c, 8, 3, -6, False), 0x7F)
        tl.store(scales_ptr + g, scale.to(tl.uint8), mask=g < total)
    else:
        values = e * (s * c)[:, None]
        tl.store(out_ptr + offsets, tl.where(finite[:, None], values, float("nan")), mask=mask)


@triton.jit
def _decode_kernel(codes_ptr, table_ptr, factor_ptr, out_ptr, count, n, nb, B: tl.constexpr,
                   BLOCK: tl.constexpr):  # fmt: skip
    """out[i] = table[code i] * factor[the block of i] (the factor NaN for a NaN block)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < count
    code = tl.load(codes_ptr + i, mask=mask, other=0).to(tl.int32)
    block = (i // n) * nb + (i % n) // B
    value = tl.load(table_ptr + code, mask=mask, other=0.0)
    factor = tl.load(factor_ptr + block, mask=mask, other=1.0)
    tl.store(out_ptr + i, value * factor, mask=mask)


# ----------------------------------------------------------------------------- launches
def _grid(rows: int, n: int, block: int, bp: int):
    nb = -(-n // block)
    total = rows * nb
    g = max(1, TILE_ELEMS // bp)
    return nb, total, g, (triton.cdiv(total, g),)


def _mx_blocks(rows: torch.Tensor, block: int, element: tuple, codes: bool):
    """For float32 ``rows`` [R, n] (contiguous): the values of MX(element, block), or (codes
    [R, n] uint8, scale codes [R * nb] uint8). ``element`` is (bits, m, emin, emax, largest
    normal, INT8?)."""
    r, n = rows.shape
    bp = triton.next_power_of_2(block)
    nb, total, g, grid = _grid(r, n, block, bp)
    bits, m, emin, emax, maxn, integer = element
    if codes:
        out = torch.empty(r, n, dtype=torch.uint8, device=rows.device)
        scales = torch.empty(total, dtype=torch.uint8, device=rows.device)
        args = (rows, rows, out, scales)
    else:
        out = torch.empty_like(rows)
        args = (rows, out, out, out)
    _mx_kernel[grid](*args, total, n, nb, block, bp, g, bits, m, emin, emax, maxn, integer, codes,
                     num_warps=NUM_WARPS)  # fmt: skip
    return (out, scales) if codes else out


def _nvfp4_blocks(rows: torch.Tensor, s: torch.Tensor, codes: bool):
    """NVFP4 of float32 ``rows`` [R, n] under the tensor scale ``s`` (one float32): the values,
    or (codes [R, n] uint8, E4M3 scale codes [R * nb] uint8)."""
    r, n = rows.shape
    nb, total, g, grid = _grid(r, n, 16, 16)
    if codes:
        out = torch.empty(r, n, dtype=torch.uint8, device=rows.device)
        scales = torch.empty(total, dtype=torch.uint8, device=rows.device)
        args = (rows, s, rows, out, scales)
    else:
        out = torch.empty_like(rows)
        args = (rows, s, out, out, out)
    _nvfp4_kernel[grid](*args, total, n, nb, g, codes, num_warps=NUM_WARPS)
    return (out, scales) if codes else out


def _decode(codes: torch.Tensor, table: torch.Tensor, factor: torch.Tensor, rows: int, n: int,
           block: int) -> torch.Tensor:  # fmt: skip
    """Values [rows, n] float32: table[code] * factor[block] for codes [rows * n] (uint8)."""
    out = torch.empty(rows, n, dtype=torch.float32, device=codes.device)
    count = rows * n
    nb = -(-n // block)
    grid = (triton.cdiv(count, DECODE_BLOCK),)
    _decode_kernel[grid](codes, table, factor, out, count, n, nb, block, DECODE_BLOCK,
                         num_warps=NUM_WARPS)  # fmt: skip
    return out


# ----------------------------------------------------------------------------- as torch ops
# The launches above as torch custom ops (``dsq::triton_*``) with fake kernels, as dsq/kernels/
# bfp.py registers its own: the public names call the ops, each with one return type (values, or
# codes and scale codes).


def _codes_fake(rows, n_blocks_of):
    r, n = rows.shape
    return (rows.new_empty(r, n, dtype=torch.uint8),
            rows.new_empty(r * n_blocks_of(n), dtype=torch.uint8))  # fmt: skip


_ELEMENT = "int bits, int m, int emin, int emax, float largest, bool integer"
_mx_values = define(
    "mx_values", f"(Tensor rows, int block, {_ELEMENT}) -> Tensor",
    lambda rows, block, *element: _mx_blocks(rows, block, element, codes=False),
    lambda rows, block, *element: torch.empty_like(rows),
)  # fmt: skip
_mx_codes = define(
    "mx_codes", f"(Tensor rows, int block, {_ELEMENT}) -> (Tensor, Tensor)",
    lambda rows, block, *element: _mx_blocks(rows, block, element, codes=True),
    lambda rows, block, *element: _codes_fake(rows, lambda n: -(-n // block)),
)  # fmt: skip
_nvfp4_values = define(
    "nvfp4_values", "(Tensor rows, Tensor s) -> Tensor",
    lambda rows, s: _nvfp4_blocks(rows, s, codes=False),
    lambda rows, s: torch.empty_like(rows),
)  # fmt: skip
_nvfp4_codes = define(
    "nvfp4_codes", "(Tensor rows, Tensor s) -> (Tensor, Tensor)",
    lambda rows, s: _nvfp4_blocks(rows, s, codes=True),
    lambda rows, s: _codes_fake(rows, lambda n: -(-n // 16)),
)  # fmt: skip
decode = define(
    "mx_decode",
    "(Tensor codes, Tensor table, Tensor factor, int rows, int n, int block) -> Tensor",
    _decode,
    lambda codes, table, factor, rows, n, block: codes.new_empty(rows, n, dtype=torch.float32),
)


def mx_blocks(rows: torch.Tensor, block: int, element: tuple, codes: bool):
    """`_mx_blocks` through its ops (``dsq::triton_mx_values``, ``dsq::triton_mx_codes``)."""
    bits, m, emin, emax, largest, integer = element
    element = (int(bits), int(m), int(emin), int(emax), float(largest), bool(integer))
    return (_mx_codes if codes else _mx_values)(rows, block, *element)


def nvfp4_blocks(rows: torch.Tensor, s: torch.Tensor, codes: bool):
    """`_nvfp4_blocks` through its ops (``dsq::triton_nvfp4_values``, ``..._codes``)."""
    return (_nvfp4_codes if codes else _nvfp4_values)(rows, s)
