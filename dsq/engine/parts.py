"""Quantizing a part of a tensor (a tile of the attention's rows, a slice of an MLP's tokens) so
that each of its values is the one the whole tensor's quantization gives (docs/dsq.md,
"Attention in tiles" and "The MLP in slices").

A format with a scale per block gives a part's values when the part starts and ends on block
boundaries. A format whose scale spans the tensor (``fixed<w>``, NVFP4: ``whole_tensor_scale``)
needs the whole tensor's largest magnitude, which the caller finds by a pass over the parts first
and passes here as ``amax``.
"""

from __future__ import annotations

import contextlib

import torch

from .functions import _Point


def quantize_part(point: _Point, x: torch.Tensor, axis: int, amax) -> torch.Tensor:
    """``point.quantize(x, axis)`` where ``x`` is part of a tensor whose largest magnitude is
    ``amax`` (a 0-dim tensor; None where the format's scale does not span the tensor): one more
    slice holding ``amax`` rides along, across ``axis`` so that it forms blocks of its own, and
    the format sees the whole tensor's scale."""
    if amax is None:
        return point.quantize(x, axis)
    if _lends_its_first_value(point, x, amax):
        with _first_value_lent(point, x, amax) as mend:
            return mend(point.quantize(x, axis))
    across = -2 if axis in (-1, x.dim() - 1) else -1
    shape = list(x.shape)
    shape[across] = 1
    extra = torch.zeros(shape, dtype=x.dtype, device=x.device)
    extra.view(-1)[0] = amax
    out = point.quantize(torch.cat([x, extra], dim=across), axis)
    return out.narrow(across, 0, x.shape[across])


def _one_scale(point: _Point) -> bool:
    """Whether every value of ``point``'s format is rounded by one scale and nothing else: a
    single block over the tensor (``fixed<w>``), nearest rounding. Each quantized value is then
    a function of the value and that scale alone."""
    return point.rounding == "nearest" and getattr(point.fmt, "block", 0) is None


def _lends_its_first_value(point: _Point, x: torch.Tensor, amax) -> bool:
    """Whether `_first_value_lent` may quantize part ``x`` at the scale of ``amax``: a
    `_one_scale` format and a finite first value (a NaN or inf there makes every value NaN,
    which lending it would hide)."""
    return _one_scale(point) and bool(torch.isfinite(x[(0,) * x.dim()]))


@contextlib.contextmanager
def _first_value_lent(point: _Point, x: torch.Tensor, amax):
    """Quantizing part ``x`` at the scale of the whole tensor's largest magnitude ``amax``
    without a copy of ``x``: inside, ``x``'s first value is ``amax``, the largest magnitude;
    the block yields a function that writes, into a quantized result, that first value as
    ``point`` quantizes it beside ``amax``; on leaving, ``x`` gets its value back."""
    first = (0,) * x.dim()
    value = x[first].clone()
    alone = point.quantize(torch.stack([value, amax.to(value.dtype)]), 0)[0]
    x[first] = amax

    def mend(out: torch.Tensor) -> torch.Tensor:
        # a NaN or inf elsewhere makes every value NaN, the first one's too
        out[first] = torch.where(torch.isfinite(out[first]), alone, out[first])
        return out

    try:
        yield mend
    finally:
        x[first] = value


def quantize_chain_part(first: _Point, second: _Point, x: torch.Tensor, amax, second_amax):
    """``(g, quantize_part(second, g, -1, second_amax))`` with ``g = quantize_part(first, x,
    -2, amax)``: the incoming gradient of a tile in q3 and q2, in one pass where the formats'
    path fuses the two (`Format.quantize_chain`)."""
    if amax is None and second_amax is None:
        return first.quantize_chain(x, -2, second, -1)
    if second_amax is None and _lends_its_first_value(first, x, amax):
        with _first_value_lent(first, x, amax) as mend:
            g, g2 = first.quantize_chain(x, -2, second, -1)
        g = mend(g)
        row = (0,) * (x.dim() - 1)  # the blocks along the last axis that held the lent value
        g2[row] = second.quantize(g[row], -1)
        return g, g2
    g = quantize_part(first, x, -2, amax)
    return g, quantize_part(second, g, -1, second_amax)


def finite_largest_magnitude(x: torch.Tensor) -> torch.Tensor | None:
    """The largest magnitude of a non-empty ``x`` in one read (and no ``|x|`` tensor), or None
    where ``x`` holds a NaN or an infinity."""
    low, high = torch.aminmax(x)
    amax = torch.maximum(high, low.neg())
    return amax if bool(torch.isfinite(amax)) else None


def largest_magnitude(x: torch.Tensor) -> torch.Tensor:
    """The largest finite magnitude of ``x`` (the whole-tensor scales leave out the rest)."""
    amax = finite_largest_magnitude(x)
    if amax is not None:
        return amax
    return torch.where(torch.isfinite(x), x.abs(), 0.0).amax()
