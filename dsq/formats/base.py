"""The format registry, the packed-tensor container and input validation.

A number format is one small registered class (see ``register``). ``parse_format`` walks the
registry in order and returns the first class whose pattern accepts the spec string; the
grammar that errors and ``dsq format --help`` show is the registered classes' ``grammar`` lines
joined (`grammar`). A class declares what the rest of the library asks of a format: its
``family`` (the key its kernels are registered under, ``backends.register_kernel``), its
``bits_per_value`` (storage, which the cost model's DRAM term reads), ``cost_width`` (its
operand width in the cost model's arithmetic term) and ``significant_bits`` (which GEMM units
hold its values exactly, ``exact_in``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import ClassVar

import torch

ROUNDINGS = ("nearest", "stochastic")

# The compute dtypes a GEMM unit can multiply in, by the significant bits each holds exactly
# (docs/formats.md, "Exact compute dtypes"): bf16 (8), TF32 (11), and bf16x2 (16: a value held
# as an exact pair hi + lo of bf16 numbers, multiplied as two GEMMs). All three have float32's
# exponent range; a value below 2^-126 in magnitude (subnormal there) is outside every claim, and
# for bf16x2 one below 2^-111 (its low part, up to 15 binary places lower, would be subnormal).
COMPUTE_DTYPES = {"bf16": 8, "tf32": 11, "bf16x2": 16}


def exact_dtypes(significant_bits: int) -> frozenset[str]:
    """The compute dtypes that hold every value of ``significant_bits`` bits exactly."""
    return frozenset(name for name, bits in COMPUTE_DTYPES.items() if significant_bits <= bits)


class Format:
    """A number format. Subclasses set ``pattern`` and implement the four methods below."""

    #: Regular expression (full match, lower-case input) of the specs this class accepts.
    pattern: ClassVar[re.Pattern[str]]
    #: This class's line of the grammar (docs/spec.md §1), e.g. ``fixed<w> (2<=w<=32)``.
    grammar: ClassVar[str]
    #: The format family whose kernels run this class's operations (``backends.kernel``), or
    #: None for a format that needs none (the floating casts).
    family: ClassVar[str | None] = None
    #: Canonical spec string of this instance, e.g. ``bfp4e8b16``.
    spec: str
    #: Storage cost in bits per value (docs/spec.md §1.2).
    bits_per_value: float
    #: The most significant bits any value of the format has (its leading one included).
    significant_bits: int
    #: The operand width w of the cost model's c(fa, fb) (docs/cost-model.md): the bits of the
    #: multiplier an operand of this format needs, without the shared scale (added once per block).
    cost_width: int
    #: Whether a value's quantization depends on the largest magnitude of the whole tensor (a scale
    #: spanning it), not only on its block: quantizing a part of the tensor alone then differs
    #: from quantizing the whole (docs/dsq.md, "Attention in tiles").
    whole_tensor_scale: ClassVar[bool] = False

    @property
    def exact_in(self) -> frozenset[str]:
        """The compute dtypes (``COMPUTE_DTYPES``) that hold every value of this format exactly,
        down to 2^-126 in magnitude: a GEMM of two operands that share one of them can run in it
        and give the float32 GEMM's result (docs/dsq.md, "GEMM units")."""
        return exact_dtypes(self.significant_bits)

    @classmethod
    def from_match(cls, spec: str, match: re.Match[str]) -> Format:
        raise NotImplementedError

    def quantize(
        self,
        x: torch.Tensor,
        axis: int = -1,
        rounding: str = "nearest",
        generator: torch.Generator | None = None,
        *,
        backend: str | None = None,
    ) -> torch.Tensor:
        """Fake-quantize ``x``: the values of this format, in ``x``'s shape and dtype."""
        raise NotImplementedError

    def pack(
        self,
        x: torch.Tensor,
        axis: int = -1,
        rounding: str = "nearest",
        generator: torch.Generator | None = None,
        *,
        backend: str | None = None,
    ) -> PackedTensor:
        """Store ``x`` in this format for real; ``pack(x).unpack() == quantize(x)`` bit for bit."""
        raise NotImplementedError

    def _unpack(self, packed: PackedTensor, backend: str | None = None) -> torch.Tensor:
        raise NotImplementedError

    def quantize_and_pack(
        self,
        x: torch.Tensor,
        axis: int,
        stash: Format,
        stash_axis: int,
        *,
        rounding: str = "nearest",
        stash_rounding: str = "nearest",
        generator: torch.Generator | None = None,
        stash_generator: torch.Generator | None = None,
        backend: str | None = None,
    ) -> tuple[torch.Tensor, PackedTensor]:
        """``(self.quantize(x, axis, rounding, generator), stash.pack(x, stash_axis,
        stash_rounding, stash_generator))``, bit for bit, in that order (stochastic rounding
        draws its noise in it): a GEMM input and its stash. A format whose path can compute both
        from one read of ``x`` overrides this where it can (``BFP``: nearest rounding); any other
        pair runs the two calls."""
        return (
            self.quantize(x, axis, rounding, generator, backend=backend),
            stash.pack(x, stash_axis, stash_rounding, stash_generator, backend=backend),
        )

    def quantize_chain(
        self,
        x: torch.Tensor,
        axis: int,
        second: Format,
        second_axis: int,
        *,
        rounding: str = "nearest",
        second_rounding: str = "nearest",
        generator: torch.Generator | None = None,
        second_generator: torch.Generator | None = None,
        backend: str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q, second.quantize(q, second_axis, second_rounding, second_generator))`` with
        ``q = self.quantize(x, axis, rounding, generator)``, bit for bit: an incoming gradient as
        fetched and as a GEMM input. A format whose path computes both in one pass overrides
        this where it can (``BFP``: nearest rounding)."""
        first = self.quantize(x, axis, rounding, generator, backend=backend)
        return first, second.quantize(
            first, second_axis, second_rounding, second_generator, backend=backend
        )

    def __repr__(self) -> str:
        return f"parse_format({self.spec!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Format) and other.spec == self.spec

    def __hash__(self) -> int:
        return hash(self.spec)


@dataclasses.dataclass
class PackedTensor:
    """A tensor stored in a format: the payload tensors hold every bit that is kept.

    ``payload`` maps names to the tensors actually held (bit-packed ``uint8`` streams for BFP and
    fixed point, the narrow tensor itself for floating formats). ``shape``, ``dtype``, ``axis``
    and the format are the small header needed to rebuild the values.
    """

    fmt: Format
    shape: tuple[int, ...]
    dtype: torch.dtype
    axis: int
    payload: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        """Bytes held by the payload (the header is a few Python ints)."""
        return sum(t.numel() * t.element_size() for t in self.payload.values())

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def unpack(self, *, backend: str | None = None) -> torch.Tensor:
        """The stored values as a tensor of the original shape and dtype."""
        return self.fmt._unpack(self, backend=backend)


_REGISTRY: list[type[Format]] = []


def register(cls: type[Format]) -> type[Format]:
    """Class decorator: make a format class reachable from ``parse_format``."""
    _REGISTRY.append(cls)
    return cls


def registered_formats() -> list[type[Format]]:
    return list(_REGISTRY)


def grammar() -> str:
    """The spec grammar: the registered classes' ``grammar`` lines, in parse order, joined by
    ``|`` (a line shared by two classes, such as a subclass's inherited one, once)."""
    lines: list[str] = []
    for cls in _REGISTRY:
        if cls.grammar not in lines:
            lines.append(cls.grammar)
    return " | ".join(lines)


def _invalid(spec: object, why: str = "") -> ValueError:
    detail = f" ({why})" if why else ""
    return ValueError(f"invalid format spec {spec!r}{detail}; grammar: {grammar()}")


_CACHE: dict[str, Format] = {}


def parse_format(spec: str | Format) -> Format:
    """Parse a spec string (case-insensitive, docs/spec.md §1 grammar) into a ``Format``."""
    if isinstance(spec, Format):
        return spec
    if not isinstance(spec, str):
        raise _invalid(spec, "not a string")
    key = spec.strip().lower()
    if key in _CACHE:
        return _CACHE[key]
    for cls in _REGISTRY:
        match = cls.pattern.fullmatch(key)
        if match is not None:
            fmt = cls.from_match(spec, match)
            _CACHE[key] = fmt
            return fmt
    raise _invalid(spec)


def check_int_range(spec: str, name: str, value: int, lo: int, hi: int) -> int:
    if not lo <= value <= hi:
        raise _invalid(spec, f"{name}={value} is outside [{lo}, {hi}]")
    return value


def check_input(x: object, axis: int, rounding: str, generator: object) -> int:
    """Validate a quantizer's arguments; return the axis normalised to ``[0, x.dim())``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(
            f"quantization needs a floating tensor, got dtype {x.dtype}; convert it with .float()"
        )
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise TypeError(f"axis must be an int, got {type(axis).__name__}")
    ndim = max(x.dim(), 1)
    if not -ndim <= axis < ndim:
        raise IndexError(
            f"axis {axis} is out of range for a tensor with {x.dim()} dimensions "
            f"(valid: {-ndim}..{ndim - 1})"
        )
    return axis % ndim
