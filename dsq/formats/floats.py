"""Floating formats: fp32 (identity), IEEE half, bfloat16 and the two 8-bit floats.

Their quantizers are torch's own casts, which are already single fused kernels on every device,
so every path uses them (dispatch has nothing faster to offer): ``backend`` chooses nothing here,
but it is checked as on the other formats (an unknown name, or an unknown ``DSQ_BACKEND``, is a
ValueError). Stochastic rounding is defined for BFP and fixed point only (docs/spec.md §1.1);
asking for it here is a ValueError.
"""

from __future__ import annotations

import re

import torch

from .backends import requested_backend
from .base import Format, PackedTensor, check_input, register

_MANTISSA_BITS = {
    torch.float32: 23,
    torch.float16: 10,
    torch.bfloat16: 7,
    torch.float8_e4m3fn: 3,
    torch.float8_e5m2: 2,
}


class FloatCast(Format):
    """Round to ``dtype`` (round to nearest even) and back. Subclasses set the class fields."""

    name: str
    dtype: torch.dtype
    #: Largest finite value; inputs are clamped to +-max first (8-bit floats saturate).
    saturate_at: float | None = None

    def __init__(self) -> None:
        self.spec = self.name
        self.bits_per_value = float(torch.finfo(self.dtype).bits)
        # the stored mantissa bits and the leading one (subnormals have fewer)
        self.significant_bits = _MANTISSA_BITS[self.dtype] + 1
        # the storage width: a float costs at least the fixed point of its width (the cost
        # model's float_widths may price one higher, docs/cost-model.md)
        self.cost_width = int(self.bits_per_value)

    @classmethod
    def from_match(cls, spec, match):
        return cls()

    def _cast(self, x: torch.Tensor) -> torch.Tensor:
        if self.saturate_at is not None:
            x = x.clamp(-self.saturate_at, self.saturate_at)  # clamp keeps NaN; inf -> max
        return x.to(self.dtype)

    def _check(self, x, axis, rounding, generator, backend):
        requested_backend(backend)  # one implementation on every path, but no unknown names
        axis = check_input(x, axis, rounding, generator)
        if rounding != "nearest":
            raise ValueError(
                f"{self.spec} supports rounding='nearest' only; stochastic rounding is defined "
                "for bfp and fixed formats"
            )
        return axis

    def quantize(self, x, axis=-1, rounding="nearest", generator=None, *, backend=None):
        self._check(x, axis, rounding, generator, backend)
        with torch.no_grad():
            return self._cast(x).to(x.dtype)

    def pack(self, x, axis=-1, rounding="nearest", generator=None, *, backend=None):
        axis = self._check(x, axis, rounding, generator, backend)
        with torch.no_grad():
            values = self._cast(x)
            if values.data_ptr() == x.data_ptr():
                values = values.clone()  # the identity: own the storage
        return PackedTensor(self, tuple(x.shape), x.dtype, axis, {"values": values})

    def _unpack(self, packed, backend=None):
        requested_backend(backend)
        return packed.payload["values"].to(packed.dtype)


@register
class FP32(FloatCast):
    """fp32: the identity (no quantization, any input dtype). Packed storage is a copy."""

    name = grammar = "fp32"
    dtype, pattern = torch.float32, re.compile("fp32")

    def _cast(self, x: torch.Tensor) -> torch.Tensor:
        return x  # the identity, whatever the input dtype (float64 stays exact)


@register
class FP16(FloatCast):
    """fp16: IEEE binary16, round to nearest even: ``x.to(torch.float16)``. 16 bits."""

    name = grammar = "fp16"
    dtype, pattern = torch.float16, re.compile("fp16")


@register
class BF16(FloatCast):
    """bf16: bfloat16, round to nearest even: ``x.to(torch.bfloat16)``. 16 bits."""

    name = grammar = "bf16"
    dtype, pattern = torch.bfloat16, re.compile("bf16")


@register
class E4M3(FloatCast):
    """e4m3: ``clamp(x, -448, 448).to(torch.float8_e4m3fn)``: saturating, NaN stays NaN. 8 bits."""

    name = grammar = "e4m3"
    dtype, pattern = torch.float8_e4m3fn, re.compile("e4m3")
    saturate_at = 448.0


@register
class E5M2(FloatCast):
    """e5m2: ``clamp(x, -57344, 57344).to(torch.float8_e5m2)``: saturating, NaN stays NaN."""

    name = grammar = "e5m2"
    dtype, pattern = torch.float8_e5m2, re.compile("e5m2")
    saturate_at = 57344.0
