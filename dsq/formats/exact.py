"""The exact arithmetic every format's definition is written in: rounding (to nearest, and
stochastic with 24-bit noise), powers of two built from exponent bits, and bit packing. The
BFP and fixed-point definitions (bfp_reference.py, fixed_reference.py) and the MX and NVFP4
definitions (mx.py, nvfp4.py) import it; it imports nothing of theirs."""

from __future__ import annotations

import torch

NOISE_BITS = 24


# ----------------------------------------------------------------------------- rounding
def uniform_noise(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """u in [0, 1) for each element of ``x``: r / 2^24 with r a uniform 24-bit integer."""
    r = torch.randint(
        0, 2**NOISE_BITS, x.shape, generator=generator, device=x.device, dtype=torch.int32
    )
    return r.to(torch.float32) * 2.0**-NOISE_BITS


def round_nearest(v: torch.Tensor) -> torch.Tensor:
    """Round half to even (torch.round), keeping the sign of zero."""
    return torch.round(v)


def round_stochastic(v: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """floor(v + u), computed without ever rounding v + u.

    Write v = t + g with t = trunc(v) and g = v - t (both exact, g has v's sign, |g| < 1).
    Then floor(v + u) = t + floor(g + u), and floor(g + u) is 1 when g >= 1 - u (g >= 0), -1 when
    u < -g (g < 0), else 0. ``1 - u`` is exact because u is a multiple of 2^-24.
    """
    u = u.to(v.dtype)
    t = torch.trunc(v)
    g = v - t
    up = (g >= 0) & (g >= 1 - u)
    down = (g < 0) & (u < -g)
    q = t + up.to(v.dtype) - down.to(v.dtype)
    return torch.copysign(q, v)  # zero keeps the input's sign


def apply_rounding(v: torch.Tensor, rounding: str, u: torch.Tensor | None) -> torch.Tensor:
    if rounding == "nearest":
        return round_nearest(v)
    assert u is not None
    return round_stochastic(v, u)


# ----------------------------------------------------------------------------- helpers
def exact_float64(x: torch.Tensor) -> torch.Tensor:
    """The input as float32 values (docs/spec.md §1: results are float32), held in float64."""
    return x.to(torch.float32).to(torch.float64)


def pow2(k: torch.Tensor) -> torch.Tensor:
    """2^k as float64 for integer k in [-1022, 1023], built from the exponent bits (exact)."""
    return ((k.to(torch.int64) + 1023) << 52).view(torch.float64)


def floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2(a)) for a > 0, exactly (frexp: a = f * 2^p with f in [0.5, 1))."""
    _, p = torch.frexp(a)
    return p.to(torch.int64) - 1


# ----------------------------------------------------------------------------- bit packing
def pack_bits(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Concatenate the low ``width`` bits of each code into a byte stream.

    Bit b of the stream is bit (b mod 8) of byte b // 8 (least significant bit first), and
    code i occupies stream bits [i * width, (i + 1) * width), its least significant bit first.
    The last byte is zero-padded. Result: uint8, ceil(n * width / 8) bytes.
    """
    codes = codes.reshape(-1).to(torch.int64)
    shifts = torch.arange(width, device=codes.device)
    bits = ((codes[:, None] >> shifts) & 1).to(torch.uint8).reshape(-1)
    bits = torch.nn.functional.pad(bits, (0, (-bits.numel()) % 8))
    weights = (1 << torch.arange(8, device=codes.device)).to(torch.int32)
    return (bits.reshape(-1, 8).to(torch.int32) * weights).sum(-1).to(torch.uint8)


def unpack_bits(stream: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """Inverse of ``pack_bits``: the first ``count`` codes, as int64."""
    shifts = torch.arange(8, device=stream.device)
    bits = ((stream.to(torch.int64)[:, None] >> shifts) & 1).reshape(-1)[: count * width]
    weights = 1 << torch.arange(width, device=stream.device, dtype=torch.int64)
    return (bits.reshape(count, width) * weights).sum(-1)
