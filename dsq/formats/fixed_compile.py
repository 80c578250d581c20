"""Static fixed point's kernels (``fixed<w>f<f>``, fixed.py) on the compile backend
(backend_compile.py): the reference semantics in float32, fused by torch.compile (CPU), exact by
construction (tests check them bit for bit). The c backend runs them too.
"""

from __future__ import annotations

import math
import struct

import torch

from . import exact, fixed_reference
from .backend_compile import code_dtype, code_stream, rounded, run, unpack_codes
from .backends import register_kernels


def _fixed_static_fn(x, u, width: int, frac_bits: int):
    """(integers as float32 in [-2^(w-1), 2^(w-1)-1] or +-2^(w-1) for w>=26, finite)."""
    finite = torch.isfinite(x)
    v = torch.where(finite, x, 0.0) * 2.0**frac_bits
    q = rounded(v, u, x)
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
    return codes.to(code_dtype(width)), finite.all(), (~finite).to(torch.uint8)


def _fixed_static_decode_fn(codes, width: int, frac_bits: int):
    codes = codes.to(torch.int64)
    signed = codes - ((codes >> (width - 1)) << width)  # sign-extend two's complement
    return signed.to(torch.float32) * 2.0**-frac_bits


def fixed_static_quantize(x, width, frac_bits, rounding="nearest", generator=None):
    x32 = x.detach().to(torch.float32).reshape(-1)  # detached: see _rows
    u = exact.uniform_noise(x, generator).reshape(-1) if rounding == "stochastic" else None
    dyn = ((x32, 0),) + (((u, 0),) if u is not None else ())
    out = run(_fixed_static_quantize_fn, x32, u, width, frac_bits, dynamic_dims=dyn)
    return out.reshape(x.shape).to(x.dtype)


def fixed_static_pack(x, width, frac_bits, rounding="nearest", generator=None, *, pack_codes=None):
    x32 = x.detach().to(torch.float32).reshape(-1)  # detached: see _rows
    u = exact.uniform_noise(x, generator).reshape(-1) if rounding == "stochastic" else None
    dyn = ((x32, 0),) + (((u, 0),) if u is not None else ())
    codes, all_finite, nonfinite = run(
        _fixed_static_codes_fn, x32, u, width, frac_bits, dynamic_dims=dyn
    )
    pack_codes = pack_codes or code_stream
    nan_mask = None if bool(all_finite) else pack_codes(nonfinite, 1)
    return pack_codes(codes, width), nan_mask


def fixed_static_unpack(integers, nan_mask, width, frac_bits, shape, dtype):
    numel = math.prod(shape)
    codes = unpack_codes(integers, width, numel)
    values = run(_fixed_static_decode_fn, codes, width, frac_bits, dynamic_dims=((codes, 0),))
    if nan_mask is not None:
        mask = unpack_codes(nan_mask, 1, numel).bool()
        values = torch.where(mask, math.nan, values)
    return values.reshape(shape).to(dtype)


# static fixed point's kernels on the compile backend
register_kernels("compile", "fixed_static", fixed_reference.KERNEL_NAMES, globals())
