"""Exact oracles of the MX formats and NVFP4 (docs/formats.md), in Fraction arithmetic.

Written from the docs, not from dsq/formats: every value is a Fraction, every rounding is
spelled out (to an element's grid, to E4M3, to float32), so an error in the reference's float64
or float32 tricks shows up as a disagreement here. Slow: a few thousand values per call.
"""

from __future__ import annotations

import math
from fractions import Fraction

# name: (exponent bits, mantissa bits, smallest normal exponent, largest power exponent,
# largest normal, integer element)
ELEMENTS = {
    "fp8_e4m3": (4, 3, -6, 8, Fraction(448), False),
    "fp8_e5m2": (5, 2, -14, 15, Fraction(57344), False),
    "fp6_e3m2": (3, 2, -2, 4, Fraction(28), False),
    "fp6_e2m3": (2, 3, 0, 2, Fraction(15, 2), False),
    "fp4_e2m1": (2, 1, 0, 2, Fraction(6), False),
    "int8": (0, 6, 0, 0, Fraction(127, 64), True),
}


def floor_log2(f: Fraction) -> int:
    """floor(log2 f) for f > 0, exactly."""
    e = f.numerator.bit_length() - f.denominator.bit_length()
    while Fraction(2) ** e > f:
        e -= 1
    while Fraction(2) ** (e + 1) <= f:
        e += 1
    return e


def round_half_even(f: Fraction) -> int:
    low = math.floor(f)
    rest = f - low
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and low % 2 == 1):
        return low + 1
    return low


def to_grid(f: Fraction, man_bits: int, emin: int) -> Fraction:
    """|f| rounded to the nearest n * 2^(max(floor(log2 |f|), emin) - man_bits), ties to even n,
    with f's sign (0 for 0)."""
    if f == 0:
        return Fraction(0)
    a = abs(f)
    quantum = Fraction(2) ** (max(floor_log2(a), emin) - man_bits)
    q = round_half_even(a / quantum) * quantum
    return q if f > 0 else -q


def round_element(f: Fraction, element: str) -> Fraction:
    """The element value nearest to f, ties to even, saturated to the largest normal."""
    _, man_bits, emin, _, largest, _ = ELEMENTS[element]
    q = to_grid(f, man_bits, emin)
    return max(-largest, min(largest, q))


def round_float32(f: Fraction) -> Fraction:
    """f rounded to float32 (nearest, ties to even, subnormals; beyond the largest: inf)."""
    q = to_grid(f, 23, -126)
    if abs(q) >= Fraction(2) ** 128:
        return Fraction(math.copysign(1, q)) * 2**200  # stands for infinity; never expected
    return q


def _signed(value: Fraction, like: float, keep_sign: bool = True) -> float:
    """``value`` as a float, a zero taking the sign of ``like`` (or +0.0)."""
    out = float(value)
    if out == 0:
        return math.copysign(0.0, like) if keep_sign else 0.0
    return out


def mx_block(values: list[float], element: str) -> list[float]:
    """One block of an MX format (docs/formats.md, "MX formats")."""
    _, _, _, emax, _, integer = ELEMENTS[element]
    if not all(math.isfinite(v) for v in values):
        return [math.nan] * len(values)
    exact = [Fraction(v) for v in values]
    a = max(abs(v) for v in exact)
    s = -127 if a == 0 else max(-127, min(127, floor_log2(a) - emax))
    scale = Fraction(2) ** s
    return [
        _signed(round_element(v / scale, element) * scale, x, keep_sign=not integer)
        for v, x in zip(exact, values)
    ]


def mx(rows: list[list[float]], element: str, block: int) -> list[list[float]]:
    """Blocks of ``block`` along each row (the last one may be partial)."""
    return [
        [q for i in range(0, len(row), block) for q in mx_block(row[i : i + block], element)]
        for row in rows
    ]


E4M3 = (3, -6)  # the block scale's type: mantissa bits, smallest normal exponent


def nvfp4(rows: list[list[float]]) -> list[list[float]]:
    """NVFP4 of a tensor given as rows, blocks of 16 along them (docs/formats.md, "NVFP4"):
    each float32 operation of the definition is an exact operation then `round_float32`."""
    finite = [abs(Fraction(v)) for row in rows for v in row if math.isfinite(v)]
    a = max(finite, default=Fraction(0))
    s = max(round_float32(a / 2688), Fraction(2) ** -121)
    out = []
    for row in rows:
        result = []
        for i in range(0, len(row), 16):
            block = row[i : i + 16]
            if not all(math.isfinite(v) for v in block):
                result += [math.nan] * len(block)
                continue
            b = max(abs(Fraction(v)) for v in block)
            t = round_float32(round_float32(b / 6) / s)
            t = max(Fraction(1, 64), min(Fraction(448), t))
            c = to_grid(t, *E4M3)  # in [2^-6, 448]: no saturation needed
            r = round_float32(round_float32(1 / s) / c)
            d = round_float32(s * c)
            for v in block:
                y = round_float32(Fraction(v) * r)
                e = round_element(max(Fraction(-6), min(Fraction(6), y)), "fp4_e2m1")
                result.append(_signed(round_float32(e * d), v))
        out.append(result)
    return out
