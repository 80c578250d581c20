"""Few-bit codes of an activation's derivative, held for the backward pass in place of the
activation's input (docs/dsq.md, "Derivative codes": ``quant.saved.activation=derivative3``).

SiLU's and GELU's backward passes read their input ``x`` only to compute the derivative:
``dx = dy * f'(x)``. A ``k``-bit code holds, for each value, which of ``2^k`` levels lies nearest
to ``f'(x)``, and the backward pass multiplies ``dy`` by that level (Novikov et al., "Few-bit
backward", ICML 2022). The levels are a Lloyd-Max quantizer of ``f'(X)`` for ``X`` standard
normal: each level the mean of ``f'`` over the values nearest to it, found by iterating from the
quantiles (`derivative_code`). So for every input

    |f'(x) - level(x)| <= error_bound,

where ``error_bound`` is the largest distance from a level to the edge of the derivative values
it serves: half the widest gap between two neighbouring levels, or the distance from the lowest
(highest) level to the least (greatest) value ``f'`` takes. It depends on the function and the
bits, not on the data (`DerivativeCode.error_bound`; SiLU at 3 bits: 0.077, of a derivative
ranging over [-0.10, 1.10]). The forward pass is the activation's own kernel, so outputs are
unchanged; only ``dx`` changes, by at most ``|dy| * error_bound`` a value (in float32; a bf16
gradient adds its own rounding of the product). A NaN input gets a level, not NaN, as its
derivative (its output is NaN still).

The error is not unbiased where the data sit far out: the outermost levels lie beyond the
derivative's limits (SiLU at 3 bits: -0.041 and 1.041, where f' tends to 0 and 1), so a
strongly positive input's gradient is scaled by 1.041 and a strongly negative one passes
-0.041 of ``dy`` where the exact gradient is 0; both within the bound.

Each code is fitted on first use, once per process (0.14 s for SiLU at 3 bits, under a second
for every function at 4 bits on the CPUs measured).

The codes are packed: eight ``k``-bit codes in ``k`` bytes (`pack_codes`), so 3 bits hold 0.375
bytes a value, against 1.06 for ``bfp8`` and 4 for float32.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

# The activations with a code: their forward kernel and the kernel of their derivative
# (``aten``'s backward with an incoming gradient of ones), by name.
FUNCTIONS = {
    "silu": (F.silu, lambda x: torch.ops.aten.silu_backward(torch.ones_like(x), x)),
    "gelu": (
        F.gelu,
        lambda x: torch.ops.aten.gelu_backward(torch.ones_like(x), x, approximate="none"),
    ),
    "gelu_tanh": (
        functools.partial(F.gelu, approximate="tanh"),
        lambda x: torch.ops.aten.gelu_backward(torch.ones_like(x), x, approximate="tanh"),
    ),
}
BITS = (1, 2, 3, 4)
# values coded or decoded at once (a multiple of 8, so that a slice packs into whole bytes): the
# temporaries of a slice, about 30 bytes a value, do not grow with the tensor (an input or
# gradient that is not contiguous is copied whole first)
SLICE = 2**20
# the grid the levels are fitted on: f' there is within 1e-12 of its limits (0 and 1) at both
# ends, and the step resolves the derivative's turns
_GRID = (-12.0, 12.0, 480_001)


@dataclasses.dataclass(frozen=True)
class DerivativeCode:
    """``bits``-bit codes of ``function``'s derivative: its ``levels`` (ascending, float32), the
    ``bounds`` between neighbouring levels (their midpoints: a derivative value is coded as the
    level nearest to it) and the ``error_bound`` of every coded derivative (module docstring)."""

    function: str
    bits: int
    levels: tuple[float, ...]
    bounds: tuple[float, ...]
    error_bound: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return FUNCTIONS[self.function][0](x)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The packed codes of ``f'(x)`` (`pack_codes`), f' computed in float32, a slice of
        `SLICE` values at a time (so that the float32 derivative and the integer codes exist
        for one slice only, not for the whole tensor)."""
        flat = x.detach().reshape(-1)
        packed = torch.empty(-(-flat.numel() // 8), self.bits, dtype=torch.uint8, device=x.device)
        for start in range(0, flat.numel(), SLICE):
            derivative = FUNCTIONS[self.function][1](flat[start : start + SLICE].float())
            codes = self.nearest_levels(derivative)
            group = start // 8
            packed[group : group + -(-codes.numel() // 8)] = pack_codes(codes, self.bits)
        return packed

    def nearest_levels(self, derivative: torch.Tensor) -> torch.Tensor:
        """The index of the level nearest each float32 derivative value, as uint8: the number of
        bounds below it (``torch.bucketize``'s answer, NaN included, which gets the highest
        level), counted as the bounds minus those at or above it, a comparison a bound (on the
        CPU several times faster than bucketize's search a value)."""
        at_or_above = torch.zeros(derivative.shape, dtype=torch.uint8, device=derivative.device)
        for bound in self.bounds:
            at_or_above += derivative <= bound
        return len(self.bounds) - at_or_above

    def decode(self, packed: torch.Tensor, shape: torch.Size, dtype) -> torch.Tensor:
        """The level of each value that `encode` coded, of ``shape`` and ``dtype``."""
        codes = unpack_codes(packed, self.bits, shape)
        return _at(_float32(self.levels, packed.device), codes).to(dtype)

    def times_levels(self, grad: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """``grad * decode(packed)``, a slice of `SLICE` values at a time: only the product is
        as large as ``grad``. The product is taken in float32 and rounded once to ``grad``'s
        dtype (a level rounded to bf16 first would move it by up to 0.004)."""
        levels = _float32(self.levels, grad.device)
        flat = grad.reshape(-1)
        out = torch.empty_like(flat)
        for start in range(0, flat.numel(), SLICE):
            part = flat[start : start + SLICE]
            group = start // 8
            codes = unpack_codes(packed[group : group + -(-part.numel() // 8)], self.bits,
                                 part.shape)  # fmt: skip
            out[start : start + SLICE] = part.float() * _at(levels, codes)
        return out.view(grad.shape)


def _at(levels: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """``levels[codes]``, of ``codes``' shape; int32 indices (``levels[codes]`` would take
    int64 ones)."""
    return torch.index_select(levels, 0, codes.reshape(-1)).view(codes.shape)


@functools.lru_cache(maxsize=64)
def _float32(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """``values`` as a float32 tensor on ``device``, made once (a copy to an accelerator waits
    for it)."""
    return torch.tensor(values, dtype=torch.float32, device=device)


@functools.cache
def derivative_code(function: str, bits: int, iterations: int = 300) -> DerivativeCode:
    """The Lloyd-Max code of ``function``'s derivative in ``bits`` bits under a standard normal
    input (module docstring), fitted in float64 on a fine grid and rounded to float32."""
    if function not in FUNCTIONS:
        raise ValueError(
            f"no derivative code for {function!r}; the coded functions: {list(FUNCTIONS)}"
        )
    if bits not in BITS:
        raise ValueError(f"derivative codes take {BITS} bits, not {bits}")
    x = torch.linspace(*_GRID, dtype=torch.float64)
    weight = torch.exp(-x * x / 2)
    derivative = FUNCTIONS[function][1](x)
    count = 2**bits
    # start from the derivative's weighted quantiles, then alternate nearest-level regions and
    # their weighted means until the levels stop moving
    order = torch.argsort(derivative)
    cumulative = torch.cumsum(weight[order], 0) / weight.sum()
    at = torch.searchsorted(cumulative, (torch.arange(count, dtype=torch.float64) + 0.5) / count)
    levels = derivative[order][at.clamp(max=len(x) - 1)]
    for _ in range(iterations):
        region = torch.bucketize(derivative, (levels[1:] + levels[:-1]) / 2)
        mass = torch.zeros(count, dtype=torch.float64).index_add_(0, region, weight)
        total = torch.zeros(count, dtype=torch.float64).index_add_(0, region, weight * derivative)
        moved = torch.where(mass > 0, total / mass.clamp(min=1e-300), levels)
        if (moved - levels).abs().max() < 1e-12:
            break
        levels = moved
    levels32 = levels.float()
    bounds32 = (levels32[1:] + levels32[:-1]) / 2
    least, greatest = derivative.min().float().view(1), derivative.max().float().view(1)
    edges = torch.cat([least, bounds32, greatest])
    # each level serves the values from the bound below it to the bound above it
    error = torch.maximum(levels32 - edges[:-1], edges[1:] - levels32).max()
    return DerivativeCode(function, bits, tuple(levels32.tolist()), tuple(bounds32.tolist()),
                          float(error))  # fmt: skip


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes below ``2**bits`` as uint8, eight codes in ``bits`` bytes: code ``i`` of a
    group of eight at bits ``bits*i`` of the group's little-endian word (row-major; the last
    group padded with zeros). That is the stream of the formats' exact packing
    (``dsq.formats.exact.pack_bits``: code ``i`` at stream bits ``[i*bits, (i+1)*bits)``), here
    in whole-tensor torch operations on any device."""
    flat = codes.reshape(-1)
    pad = -flat.numel() % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    # int32 words: a 4-bit code shifted by 28 wraps to a negative number, and the sum of codes
    # in disjoint bits is their bitwise or all the same; the masks below drop the sign's copies
    shifts = torch.arange(8, device=codes.device, dtype=torch.int32) * bits
    word = (flat.view(-1, 8).to(torch.int32) << shifts).sum(1, keepdim=True, dtype=torch.int32)
    byte_shifts = torch.arange(bits, device=codes.device, dtype=torch.int32) * 8
    return ((word >> byte_shifts) & 0xFF).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, shape: torch.Size) -> torch.Tensor:
    """The int32 codes of ``shape`` that `pack_codes` packed."""
    byte_shifts = torch.arange(bits, device=packed.device, dtype=torch.int32) * 8
    word = (packed.to(torch.int32) << byte_shifts).sum(1, keepdim=True, dtype=torch.int32)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32) * bits
    codes = (word >> shifts) & (2**bits - 1)
    return codes.reshape(-1)[: shape.numel()].reshape(shape)


class _CodedActivation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, code: DerivativeCode, function):
        ctx.code = code
        ctx.save_for_backward(code.encode(x))
        return function(x)  # autograd records nothing inside: the function saves nothing

    @staticmethod
    def backward(ctx, grad):
        (packed,) = ctx.saved_tensors
        return ctx.code.times_levels(grad.contiguous(), packed), None, None


def coded_activation(x: torch.Tensor, code: DerivativeCode, function=None) -> torch.Tensor:
    """``function(x)`` (default: ``code``'s activation, by torch's kernel), its backward pass
    holding ``code``'s packed codes of the derivative instead of ``x`` (module docstring); just
    ``function(x)`` where no gradient flows. ``function`` computes ``code``'s activation by
    another formula (``transformers``' NewGELUActivation writes GELU's tanh form out): its outputs
    are its own, bit for bit, and the derivative is coded as the activation's."""
    function = function or code.forward
    if not torch.is_grad_enabled() or not x.requires_grad:
        return function(x)
    return _CodedActivation.apply(x, code, function)
