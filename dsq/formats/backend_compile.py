"""The compile backend: the reference semantics in float32, fused by torch.compile (CPU).

Its functions also serve the c backend (``backend_c.py``), which runs here every call its C
kernels do not hold, handing in its own bit packer (``pack_codes``) for the codes' second stage.

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
Index arithmetic never divides by a symbolic size (that costs 3x in unpack).
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import struct
import sys

import torch

from . import exact, layout
from . import reference as ref
from .backends import register_kernel

_RECOMPILE_LIMIT = 256  # one compiled variant per format, row length and noise on/off


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


def _round(v: torch.Tensor, u: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    if u is None:
        return torch.round(v)  # half to even
    t = torch.trunc(v)
    g = v - t
    up = (g >= 0) & (g >= 1 - u)
    # (u == 0) & (x < 0) & (t == 0): v underflowed to -0.0; exactly, floor(tiny negative) = -1
    down = ((g < 0) & (u < -g)) | ((u == 0) & (x < 0) & (t == 0))
    q = t + up.to(torch.float32) - down.to(torch.float32)
    return torch.copysign(q, v)


def _bfp_integers(blocks, u, man_bits: int, exp_bits: int, exponent=None):
    """(q, e, k, finite); ``exponent`` = (e, finite) computed beforehand, or None to compute it
    per block of ``blocks`` [..., B]."""
    limit = 2 ** (man_bits - 1) - 1
    e, finite = _block_exponent(blocks, exp_bits) if exponent is None else exponent
    k = (man_bits - 2) - e
    q = _round(_mul_pow2(blocks, k), u, blocks).clamp(-limit, limit)
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


def _code_dtype(width: int) -> torch.dtype:
    """Narrowest integer dtype holding a ``width``-bit code (int32 wraps for width 32)."""
    return torch.uint8 if width <= 8 else torch.int16 if width <= 16 else torch.int32


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
    exps = exps.to(_code_dtype(exp_bits))
    if _code_dtype(man_bits) == torch.int16:
        # two byte planes: inductor's vectorised int16 store is ~7x slower than two uint8 ones
        return ((codes & 0xFF).to(torch.uint8), (codes >> 8).to(torch.uint8)), exps
    return codes.to(_code_dtype(man_bits)), exps


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


def _word_plan(width: int) -> tuple[int, int] | None:
    """For unpacking: ``g`` codes per int64 word when whole bytes fit: (g, bytes used), or None.

    On a little-endian machine the next ``g * width / 8`` bytes of the stream, zero-extended to 8,
    are one int64 word from which ``(word >> (width * arange(g))) & mask`` extracts the codes in
    one vectorised step. Odd widths above 8 need more than 64 bits per byte-aligned group and use
    the byte gather instead.
    """
    if sys.byteorder != "little":
        return None
    per_group = 8 // math.gcd(width, 8)
    if per_group * width > 64:
        return None
    g = per_group * (64 // (per_group * width))
    return g, g * width // 8


def _join_planes(codes) -> torch.Tensor:
    """The int16 codes of ``_bfp_codes_fn``'s two byte planes (low, high), little-endian."""
    if isinstance(codes, tuple):
        low, high = codes
        if sys.byteorder != "little":
            return (low.to(torch.int32) | (high.to(torch.int32) << 8)).to(torch.int16)
        return torch.stack((low, high), dim=-1).view(torch.int16).squeeze(-1)
    return codes


def code_stream(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Stage 2 of pack, on the host: the byte stream of flat integer ``codes`` (``_code_dtype``).

    Widths 8, 16 and 32 are already the stream (a view, little-endian); other one-byte codes are
    read eight at a time as int64 words (`_pack_bytes_fn`); the others run the compiled byte
    gather over the compact codes, padded to whole groups first.
    """
    # a flat slice such as codes[:, :1].reshape(-1) can be a strided view: the byte view needs
    # unit stride, and a strided stream would hold on to the whole padded buffer of codes
    codes = codes.contiguous()
    if width in (8, 16, 32) and sys.byteorder == "little":
        return codes.view(torch.uint8)
    count = codes.shape[0]
    if width < 8 and codes.dtype == torch.uint8 and sys.byteorder == "little":
        if count % 8:
            codes = torch.nn.functional.pad(codes, (0, 8 - count % 8))
        elif codes.storage_offset() % 8:  # a slice: an int64 view needs an 8-byte offset
            codes = codes.clone()
        words = codes.view(torch.int64)
        stream = _run(_pack_bytes_fn, words, width, dynamic_dims=((words, 0),))
        return stream.reshape(-1).view(torch.uint8)[: (count * width + 7) // 8]
    per_group, _ = _group(width)
    if count % per_group:
        codes = torch.nn.functional.pad(codes, (0, per_group - count % per_group))
    groups = codes.reshape(-1, per_group)
    stream = _run(_pack_groups, groups, width, dynamic_dims=((groups, 0),))
    return stream.reshape(-1)[: (count * width + 7) // 8]


def _unpack_input(stream: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """On the host: what ``_unpack_codes_fn`` reads: int64 words [G] (``_word_plan``), or the
    stream cut into byte groups [G, bytes per group] (``_group``), zero-padded at the end."""
    plan = _word_plan(width)
    if plan is None:
        per_group, group_bytes = _group(width)
        groups = -(-count // per_group)
        if stream.numel() != groups * group_bytes:
            stream = torch.nn.functional.pad(stream, (0, groups * group_bytes - stream.numel()))
        return stream.reshape(groups, group_bytes)
    g, used = plan
    groups = -(-count // g)
    if used == 8 and stream.numel() == groups * 8:
        return stream.view(torch.int64)  # already whole words: no copy
    words = torch.zeros(groups, 8, dtype=torch.uint8, device=stream.device)
    if used == 8:
        words.reshape(-1)[: stream.numel()].copy_(stream)
    else:
        compact = torch.zeros(groups * used, dtype=torch.uint8, device=stream.device)
        compact[: stream.numel()].copy_(stream)
        words[:, :used].copy_(compact.reshape(groups, used))
    return words.view(torch.int64).reshape(groups)


def _unpack_codes_fn(packed: torch.Tensor, width: int) -> torch.Tensor:
    """Stage 1 of unpack: codes [G, per group] from ``_unpack_input``'s words or byte groups,
    in a narrow dtype (the decode stage reads them back)."""
    plan = _word_plan(width)
    mask = (1 << width) - 1
    if plan is None:
        per_group, group_bytes = _group(width)
        stream = packed.to(torch.int64)
        out = []
        for i in range(per_group):
            code = None
            for j in range(group_bytes):
                shift = 8 * j - width * i  # where byte j's bit 0 lands relative to code i's bit 0
                if shift >= width or shift + 8 <= 0:
                    continue
                part = stream[:, j] << shift if shift >= 0 else stream[:, j] >> -shift
                code = part if code is None else code | part
            out.append(code & mask)
        codes = torch.stack(out, dim=1)
    else:
        g, _ = plan
        shifts = torch.arange(g, device=packed.device, dtype=torch.int64) * width
        codes = (packed[:, None] >> shifts) & mask
    dtype = torch.uint8 if width <= 8 else torch.int32 if width <= 31 else torch.int64
    return codes.to(dtype)


def _unpack_codes(stream: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """The first ``count`` codes of a stream (two compiled-friendly steps, no symbolic sizes)."""
    if width == 8:  # one code per byte, in order: the stream is the codes (no pass, no copy)
        if stream.numel() < count:
            raise ValueError(f"a stream of {stream.numel()} bytes holds fewer than {count} codes")
        return stream[:count]
    packed = _unpack_input(stream, width, count)
    codes = _run(_unpack_codes_fn, packed, width, dynamic_dims=((packed, 0),))
    return codes.reshape(-1)[:count]


def _group(width: int) -> tuple[int, int]:
    """Smallest run of codes that fills whole bytes: (codes per group, bytes per group)."""
    codes = 8 // math.gcd(width, 8)
    return codes, codes * width // 8


def _pack_bytes_fn(words: torch.Tensor, width: int) -> torch.Tensor:
    """exact.pack_bits for codes of ``width`` < 8 bits held one per byte, read as int64
    ``words`` [G] of 8 codes each (little-endian): each word's 8 * width bits, as int32 [G]
    for width 4, uint8 [G] for width 1, else [G, width] bytes. Whole words keep every load
    contiguous and vectorised: 1.4x (width 6) to 4x (width 4) faster than `_pack_groups`'
    strided per-code reads (docs/benchmarks.md), except at width 2, where both run alike."""
    mask = (1 << width) - 1
    bits = None
    for i in range(8):
        part = ((words >> (8 * i)) & mask) << (width * i)
        bits = part if bits is None else bits | part
    if width == 4:
        return bits.to(torch.int32)
    if width == 1:
        return bits.to(torch.uint8)
    # int16 for width 2 would be one store, but inductor's vectorised int16 store is slow
    return torch.stack([((bits >> (8 * j)) & 0xFF).to(torch.uint8) for j in range(width)], 1)


def _pack_groups(codes: torch.Tensor, width: int) -> torch.Tensor:
    """exact.pack_bits for codes [G, per_group]: each output byte ORs the codes overlapping
    it (shifts fixed at trace time). Returns [G, bytes per group] uint8."""
    per_group, group_bytes = _group(width)
    work = torch.int32 if width <= 24 else torch.int64  # shifted codes stay below 2^(width+8)
    codes = codes.to(work) & ((1 << width) - 1)  # narrow dtypes may have wrapped
    out = []
    for j in range(group_bytes):
        byte = None
        for i in range(per_group):
            shift = width * i - 8 * j  # where code i's bit 0 lands relative to byte j's bit 0
            if shift >= 8 or shift + width <= 0:
                continue  # no overlap
            part = codes[:, i] << shift if shift >= 0 else codes[:, i] >> -shift
            byte = part if byte is None else byte | part
        out.append((byte & 0xFF).to(torch.uint8))
    return torch.stack(out, dim=1)


def _fixed_static_fn(x, u, width: int, frac_bits: int):
    """(integers as float32 in [-2^(w-1), 2^(w-1)-1] or +-2^(w-1) for w>=26, finite)."""
    finite = torch.isfinite(x)
    v = torch.where(finite, x, 0.0) * 2.0**frac_bits
    q = _round(v, u, x)
    # clamp in float32: 2^(w-1) - 1 rounds to 2^(w-1) for w >= 26, as the reference's cast does
    q = q.clamp(-(2.0 ** (width - 1)), _float32(2.0 ** (width - 1) - 1))
    return q + 0.0, finite  # + 0.0: two's complement has no -0


def _float32(value: float) -> float:
    """``value`` rounded to the nearest float32."""
    return struct.unpack("f", struct.pack("f", value))[0]


def _fixed_static_quantize_fn(x, u, width: int, frac_bits: int):
    q, finite = _fixed_static_fn(x, u, width, frac_bits)
    return torch.where(finite, q * 2.0**-frac_bits, math.nan)


def _fixed_static_codes_fn(x, u, width: int, frac_bits: int):
    """Stage 1 of pack: (two's-complement codes, all finite?, non-finite mask as 0/1 codes)."""
    q, finite = _fixed_static_fn(x, u, width, frac_bits)
    # the w >= 26 top bound 2^(w-1) (from the float32 clamp) stores as 2^(w-1)-1, the reference's
    # exact integer; it unpacks to the same float32 value
    if width <= 24:  # exact in float32, and vectorised: q + 2^w is the code of a negative q
        codes = torch.where(q < 0, q + 2.0**width, q).to(torch.int32)
    else:
        top = 2 ** (width - 1) - 1
        codes = q.to(torch.int64).clamp(max=top) & ((1 << width) - 1)
    return codes.to(_code_dtype(width)), finite.all(), (~finite).to(torch.uint8)


def _fixed_static_decode_fn(codes, width: int, frac_bits: int):
    codes = codes.to(torch.int64)
    signed = codes - ((codes >> (width - 1)) << width)  # sign-extend two's complement
    return signed.to(torch.float32) * 2.0**-frac_bits


@functools.cache
def _compiled(fn):
    return torch.compile(fn, dynamic=False, fullgraph=True)


def _run(fn, *args, dynamic_dims=()):
    """Run ``fn`` compiled, with the leading dims of its tensor arguments marked dynamic."""
    for tensor, dim in dynamic_dims:
        torch._dynamo.maybe_mark_dynamic(tensor, dim)
    # The limit matters only when a call compiles. Set as a plain attribute and put back:
    # config.patch's context manager costs about 20 us, a third of a small call.
    config = torch._dynamo.config
    prior = config.recompile_limit
    if prior >= _RECOMPILE_LIMIT:
        return _compiled(fn)(*args)
    config.recompile_limit = _RECOMPILE_LIMIT
    try:
        return _compiled(fn)(*args)
    finally:
        config.recompile_limit = prior


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
    out = _run(fn, flat, u_flat, *args, dynamic_dims=dyn)
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
    exponent = _run(_exponent_fn, flat, exp_bits, dynamic_dims=((flat, 0),))
    u_flat = None if u is None else u.reshape(-1)
    dyn = ((flat, 0),) + (((u_flat, 0),) if u_flat is not None else ())
    return _run(fn, flat, u_flat, man_bits, exp_bits, exponent, dynamic_dims=dyn)


# ----------------------------------------------------------------------------- interface
@functools.cache
def unavailable_reason(device_type: str) -> str | None:
    """Why this backend cannot run tensors of ``device_type`` here, or None when it can."""
    if device_type != "cpu":
        return f"its kernels are for CPU tensors (got {device_type})"
    try:
        import torch._dynamo  # noqa: F401
    except Exception as err:  # pragma: no cover - depends on the torch build
        return f"torch.compile is unavailable ({err})"
    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile does not support this Python"
    if shutil.which(os.environ.get("CXX", "g++")) is None and shutil.which("gcc") is None:
        return "no C++ compiler for torch.compile's CPU backend"
    return None


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
        p, finite = _run(_power_fn, flat, exp_bits, dynamic_dims=((flat, 0),))
        out = _run(_quantize_by_power_fn, flat, p, finite, man_bits, dynamic_dims=((flat, 0),))
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
    values, codes, exps = _run(fn, rows, *q_args, p_man, p_exp, dynamic_dims=dyn)
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
    p, finite = _run(_power_fn, flat, f_exp, dynamic_dims=((flat, 0),))
    rows = flat.reshape(-1, s_block)
    first, second = _run(
        _by_power_then_bfp_fn, rows, p, finite, f_man, s_man, s_exp, dynamic_dims=((rows, 0),)
    )
    return first.reshape(x.shape).to(x.dtype), second.reshape(x.shape).to(x.dtype)


def bfp_unpack(mantissas, exponents, man_bits, exp_bits, block, shape, axis, dtype):
    numel = math.prod(shape)
    if block is None:
        codes = _unpack_codes(mantissas, man_bits, numel).reshape(1, 1, numel)
        exps = _unpack_codes(exponents, exp_bits, 1).reshape(1, 1, 1)
        dyn = ((codes, 2),)
        values = _run(_bfp_decode_fn, codes, exps, man_bits, exp_bits, dynamic_dims=dyn)
        return values.reshape(shape).to(dtype)
    moved_shape = layout.moved_shape(shape, axis)
    n = moved_shape[-1]
    n_blocks = -(-n // block)
    rows = numel // n
    codes = _unpack_codes(mantissas, man_bits, numel).reshape(rows, n)
    if n_blocks * block != n:
        codes = torch.nn.functional.pad(codes, (0, n_blocks * block - n))
    codes = codes.reshape(rows * n_blocks, block)
    exps = _unpack_codes(exponents, exp_bits, rows * n_blocks).reshape(rows * n_blocks, 1)
    dyn = ((codes, 0), (exps, 0))  # one dynamic dimension of blocks, as in _run_blocks
    values = _run(_bfp_decode_fn, codes, exps, man_bits, exp_bits, dynamic_dims=dyn)
    return layout.from_blocks(
        values.reshape(rows, n_blocks, block), n, moved_shape, shape, axis, dtype
    )


def fixed_static_quantize(x, width, frac_bits, rounding="nearest", generator=None):
    x32 = x.detach().to(torch.float32).reshape(-1)  # detached: see _rows
    u = exact.uniform_noise(x, generator).reshape(-1) if rounding == "stochastic" else None
    dyn = ((x32, 0),) + (((u, 0),) if u is not None else ())
    out = _run(_fixed_static_quantize_fn, x32, u, width, frac_bits, dynamic_dims=dyn)
    return out.reshape(x.shape).to(x.dtype)


def fixed_static_pack(x, width, frac_bits, rounding="nearest", generator=None, *, pack_codes=None):
    x32 = x.detach().to(torch.float32).reshape(-1)  # detached: see _rows
    u = exact.uniform_noise(x, generator).reshape(-1) if rounding == "stochastic" else None
    dyn = ((x32, 0),) + (((u, 0),) if u is not None else ())
    codes, all_finite, nonfinite = _run(
        _fixed_static_codes_fn, x32, u, width, frac_bits, dynamic_dims=dyn
    )
    pack_codes = pack_codes or code_stream
    nan_mask = None if bool(all_finite) else pack_codes(nonfinite, 1)
    return pack_codes(codes, width), nan_mask


def fixed_static_unpack(integers, nan_mask, width, frac_bits, shape, dtype):
    numel = math.prod(shape)
    codes = _unpack_codes(integers, width, numel)
    values = _run(_fixed_static_decode_fn, codes, width, frac_bits, dynamic_dims=((codes, 0),))
    if nan_mask is not None:
        mask = _unpack_codes(nan_mask, 1, numel).bool()
        values = torch.where(mask, math.nan, values)
    return values.reshape(shape).to(dtype)


# The compile backend's kernels (docs/formats.md, "Implementations: the backends").
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
        register_kernel("compile", _family, _op, _fn)
