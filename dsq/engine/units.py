"""Which unit runs each quantized GEMM, and running it there (docs/dsq.md, "GEMM units").

A GEMM whose two operands hold only values of a compute dtype (``Format.exact_in``) gives, on a
unit that multiplies in that dtype and accumulates in float32, the float32 GEMM's result up to
the order of the float32 sums: every product is exact. So each GEMM of ``dsq_linear`` and
``dsq_matmul`` is planned from the formats of its two operands in force at that call
(`plan`), and run on the fastest unit that is exact for both (`gemm`):

======== ================================================ ========================================
unit     runs on                                           when both operands are exact in
======== ================================================ ========================================
bf16     CPU: oneDNN's bf16 matmul (``formats.compute``);   bf16
         CUDA: ``torch.mm(..., out_dtype=float32)``
tf32     CUDA: float32 GEMM with TF32 allowed for that call tf32 (and not both in bf16)
bf16x2   the wider operand split into an exact pair hi +    bf16 for one, bf16x2 for the other
         lo of bf16 numbers, two bf16 GEMMs summed (CPU:
         ``compute.bf16x2_gemm``)
fp32     float32, as torch runs it                          anything else, or ``gemm_unit=fp32``
======== ================================================ ========================================

The CPU offers ``bf16`` where it has bf16 dot-product instructions and the oneDNN kernels load,
and ``bf16x2`` where two bf16 GEMMs and the split also beat one float32 GEMM: on AMD EPYC Zen 5, not
where bf16 GEMMs run only about 2x float32 and two of them cost what one float32 GEMM does
(measured in docs/benchmarks.md; ``compute.cpu_split_pays``). CUDA offers all three from
compute capability 8.0 (Ampere).

Exactness is also checked where the values are converted (`gemm`): a value that is not a number
of the unit's dtype, or one below 2^-63 in magnitude (a product of two such could fall below
float32's normal range, where bf16 units flush to zero), sends that call to float32 instead,
logged once per reason. Every call is counted by GEMM kind and unit (`tally`); result.json
reports the counts. Nothing here changes a global setting: TF32 is allowed inside one call only
(`_tf32_allowed`) and put back even on error.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging

import torch

from dsq.formats import Format, compute
from dsq.warn_once import warn_once

# quant.gemm_unit: auto picks a unit per GEMM; fp32 runs every GEMM in float32
SETTINGS = ("auto", "fp32")
# The GEMM kinds of the two DSQ functions (docs/spec.md §2), in the order they run.
GEMM_KINDS = (
    "linear.forward", "linear.dx", "linear.dw", "matmul.forward", "matmul.da", "matmul.db"
)  # fmt: skip
REDUCED_UNITS = ("bf16", "tf32", "bf16x2")  # preference order: the narrowest exact unit first
MIN_CUDA_CAPABILITY = (8, 0)
# A value below this in magnitude (and not zero) sends its GEMM to float32: the product of two
# values at least this large is at least 2^-126, a normal float32 number.
SMALLEST = 2.0**-63
# A GEMM whose matrices have fewer multiply-adds each stays in float32: converting and calling
# cost about 0.1 ms, more than a bf16 unit saves below this size (docs/benchmarks.md, "GEMM
# units": a 256x256x256 GEMM gains 1.1x, attention's 30x64x30 matrices lose).
MIN_MACS = 2**24
# `gemm_by_rows`: a slice of an operand made by rows holds about this many values (4 MiB in
# float32) and a multiple of this many rows
SLICE_ELEMENTS = 2**20
SLICE_ROWS = 64

LOGGER = "dsq.engine"
log = logging.getLogger(LOGGER)


@dataclasses.dataclass(frozen=True)
class GemmPlan:
    """How one GEMM ``a @ b`` runs: its ``unit``, and for bf16x2 which operand is split
    (``"a"`` or ``"b"``: the one exact in bf16x2 only)."""

    unit: str
    split: str | None = None


FP32 = GemmPlan("fp32")


# -- what the machine offers --------------------------------------------------------------------
def cpu_unavailable_reason() -> str | None:
    """Why the CPU has no exact bf16 GEMM here, or None when it has one."""
    return compute.cpu_bf16_unavailable_reason()


def cuda_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def torch_version() -> tuple[int, int]:
    """The installed torch's (major, minor) release, e.g. ``(2, 13)`` for ``2.13.0+cpu``."""
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return major, minor


def torch_at_least(major: int, minor: int) -> bool:
    """Whether the installed torch is release ``major.minor`` or later."""
    return torch_version() >= (major, minor)


def torch_mm_takes_out_dtype() -> bool:
    """Whether torch.mm and torch.bmm take ``out_dtype`` (bf16 in, float32 out): torch 2.8+."""
    return torch_at_least(2, 8)


def offered_units(device: torch.device) -> tuple[str, ...]:
    """The reduced units a GEMM on ``device`` may take, in preference order (none: float32)."""
    if device.type == "cpu":
        reason = cpu_unavailable_reason()
        if reason is None:
            return ("bf16", "bf16x2") if compute.cpu_split_pays() else ("bf16",)
        warn_once(LOGGER, f"dsq: quantized GEMMs run in float32 on this CPU: {reason}")
        return ()
    if device.type == "cuda":
        capability = cuda_capability(device)
        if tuple(capability) >= MIN_CUDA_CAPABILITY:
            if torch_mm_takes_out_dtype():
                return REDUCED_UNITS  # all three
            warn_once(
                LOGGER,
                "dsq: bf16 GEMMs need torch.mm(..., out_dtype=) (torch 2.8 and later); this "
                f"torch {torch.__version__} runs quantized GEMMs on TF32 or in float32",
            )
            return ("tf32",)
        warn_once(
            LOGGER,
            f"dsq: quantized GEMMs run in float32 on this GPU: compute capability "
            f"{capability[0]}.{capability[1]} has no bf16 or TF32 tensor cores (8.0 and later do)",
        )
    return ()


def plan(
    a: Format, b: Format, device: torch.device, setting: str = "auto", macs: int = MIN_MACS
) -> GemmPlan:
    """The unit for ``a @ b`` whose operands hold values of formats ``a`` and ``b`` and whose
    matrices (each of a batch) take ``macs`` multiply-adds."""
    if setting not in SETTINGS:
        raise ValueError(f"gemm_unit must be one of {SETTINGS}, got {setting!r}")
    if setting == "fp32" or macs < MIN_MACS:
        return FP32
    exact = _exact_plans(a, b)
    if not any(exact):  # no unit could take these formats: the device need not be asked
        return FP32
    for unit in offered_units(device):
        how = exact[REDUCED_UNITS.index(unit)]
        if how is not None:
            return how
    return FP32


@functools.cache
def _exact_plans(a: Format, b: Format) -> tuple[GemmPlan | None, ...]:
    """`_exact_plan` of every reduced unit, in REDUCED_UNITS' order: a function of the two
    formats only, asked three times per layer call, so kept."""
    return tuple(_exact_plan(unit, a, b) for unit in REDUCED_UNITS)


def _exact_plan(unit: str, a: Format, b: Format) -> GemmPlan | None:
    """``unit``'s plan for operands of formats ``a`` and ``b``, or None when it is not exact for
    them (bf16x2 splits the operand that is exact in bf16x2 only)."""
    if unit != "bf16x2":
        return GemmPlan(unit) if unit in a.exact_in and unit in b.exact_in else None
    if "bf16" in a.exact_in and "bf16x2" in b.exact_in:
        return GemmPlan(unit, split="b")
    if "bf16x2" in a.exact_in and "bf16" in b.exact_in:
        return GemmPlan(unit, split="a")
    return None


# -- what ran where -----------------------------------------------------------------------------
_TALLY: collections.Counter[tuple[str, str]] = collections.Counter()


def tally() -> dict[str, dict[str, int]]:
    """GEMMs run in this process so far: {GEMM kind: {unit: count}}."""
    counts: dict[str, dict[str, int]] = {}
    for (kind, unit), count in sorted(_TALLY.items()):
        counts.setdefault(kind, {})[unit] = count
    return counts


def merge_tallies(*tallies: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """The sum of several `tally` results (a resumed run adds its own to the checkpoint's)."""
    total: collections.Counter[tuple[str, str]] = collections.Counter()
    for counts in tallies:
        for kind, units in (counts or {}).items():
            for unit, count in units.items():
                total[(kind, unit)] += count
    merged: dict[str, dict[str, int]] = {}
    for (kind, unit), count in sorted(total.items()):
        if count:
            merged.setdefault(kind, {})[unit] = count
    return merged


def negated(counts: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """``counts`` with every count negated: ``merge_tallies(now, negated(then))`` is what ran
    between two tallies."""
    return {kind: {unit: -n for unit, n in units.items()} for kind, units in counts.items()}


def count(kind: str, unit: str, calls: int = 1) -> None:
    """Count ``calls`` GEMMs of ``kind`` run on ``unit`` by a kernel of its own (the tiled
    attention's Triton kernels, whose GEMMs are float32), as `gemm` counts its calls."""
    _TALLY[(kind, unit)] += calls


# -- running a GEMM -----------------------------------------------------------------------------
def gemm(a: torch.Tensor, b: torch.Tensor, how: GemmPlan, kind: str, bias=None) -> torch.Tensor:
    """``a @ b`` (+ ``bias``) in float32, on the unit of ``how`` when every value passes the
    exactness check there, else in float32. ``a`` [..., m, k], ``b`` [..., k, n]; ``bias`` [n]
    only with 2-D operands. ``kind`` (one of GEMM_KINDS) is what the call is counted as."""
    out, unit = _gemm(a, b, how, bias)
    _TALLY[(kind, unit)] += 1
    return out


def gemm_by_rows(a_rows, rows: int, cols: int, b: torch.Tensor, how: GemmPlan, kind: str):
    """``a @ b`` as `gemm` runs it, for a 2-D ``a [rows, cols]`` made a slice of rows at a time
    by ``a_rows(slice)``: no whole ``a`` (nor its converted copies) exists, only a slice of at
    most about `SLICE_ELEMENTS` values. Each output row is the same dot products as in one
    GEMM; whether the unit sums them in the same order for fewer rows is the unit's choice
    (the bf16 unit gives the same bits; a float32 GEMM of fewer than about 192 rows rounded some
    rows' sums differently on the Xeon, and one of a few rows runs a matrix-vector kernel, so
    `row_slices` joins a last slice under `SLICE_ROWS` rows to the one before). Counted as one
    GEMM, on ``how``'s unit unless a slice ran in float32."""
    step = max(SLICE_ROWS, SLICE_ELEMENTS // max(1, cols) // SLICE_ROWS * SLICE_ROWS)
    if step >= rows:
        return gemm(a_rows(slice(0, rows)), b, how, kind)
    by_rows = RowsOfGemm(b, how)
    out = None
    for part_rows in row_slices(rows, step):
        part = by_rows(a_rows(part_rows))
        if out is None:
            out = part.new_empty(rows, part.shape[-1])
        out[part_rows] = part
    by_rows.count(kind)
    return out


def row_slices(rows: int, step: int) -> list[slice]:
    """``rows`` rows ``step`` at a time, a last part of fewer than `SLICE_ROWS` rows joined to
    the one before: a GEMM of a few rows may run another kernel (a matrix-vector product), whose
    bits differ from the same rows' in a larger GEMM (measured on the Xeon at 1 to 8 rows; a
    float32 GEMM of up to about 192 rows can still differ in some rows' last bits)."""
    starts = list(range(0, rows, step))
    if len(starts) > 1 and rows - starts[-1] < SLICE_ROWS:
        starts.pop()
    return [slice(a, b) for a, b in zip(starts, [*starts[1:], rows])]


class RowsOfGemm:
    """One GEMM ``a @ b`` run a part at a time (`gemm_by_rows`, an MLP in slices): each call runs
    a part as `gemm` would, and `count` counts them all as one GEMM, on ``how``'s unit unless a
    part ran in float32. A ``b`` shared by every part is converted for the CPU's bf16 unit
    once, not once a part; with ``b`` None each call gives its own (the parts of a sum over
    the reduction dimension). ``bias`` [n] is added to every part."""

    def __init__(self, b: torch.Tensor | None, how: GemmPlan, bias: torch.Tensor | None = None):
        self.b, self.how, self.bias, self.units = b, how, bias, set()
        self.b_ready = None
        shared = b is not None and b.device.type == "cpu" and b.dtype == torch.float32
        if shared and how.unit in ("bf16", "bf16x2"):
            self.b_ready = compute.prepared_b(b, how.split if how.unit == "bf16x2" else None)

    def __call__(self, a_part: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        if b is None:
            b, b_ready = self.b, self.b_ready
        else:
            b_ready = None
        out, unit = _gemm(a_part, b, self.how, self.bias, b_ready)
        self.units.add(unit)
        return out

    def count(self, kind: str) -> None:
        """Count the parts run so far as one GEMM of ``kind`` (none ran: nothing counted)."""
        if self.units:
            _TALLY[(kind, "fp32" if "fp32" in self.units else self.how.unit)] += 1


def _gemm(a, b, how: GemmPlan, bias, b_ready=None):
    """(``a @ b`` + ``bias``, the unit it ran on): `gemm` without the count. ``b_ready``: ``b``
    converted for the CPU's bf16 unit beforehand (`compute.prepared_b`)."""
    out = None
    # the units are exact for float32 operands (a float64 model keeps its float64 GEMMs)
    float32 = a.dtype == b.dtype == torch.float32 and (bias is None or bias.dtype == a.dtype)
    if how.unit != "fp32" and float32:
        if a.device.type == "cpu":
            out = _run_cpu(a, b, how, bias, b_ready)
        else:
            out = _run_cuda(a, b, how, bias)
    unit = how.unit
    if out is None:
        unit = "fp32"
        out = torch.addmm(bias, a, b) if bias is not None else torch.matmul(a, b)
    return out, unit


def _fallback(how: GemmPlan) -> None:
    warn_once(
        LOGGER,
        f"dsq: a GEMM planned on {how.unit} ran in float32: an operand held a value that is not "
        f"a {how.unit} number or is below 2^-63 in magnitude, or the unit refused the call "
        f'(docs/dsq.md, "GEMM units")',
    )


def _run_cpu(a, b, how: GemmPlan, bias, b_ready=None):
    if how.unit not in ("bf16", "bf16x2"):
        raise ValueError(f"the CPU has no {how.unit} unit")
    if a.shape[:-2] != b.shape[:-2]:  # broadcast batch dimensions: torch's matmul handles them
        return None
    if how.unit == "bf16":
        out = compute.bf16_gemm(a, b, bias, b_ready)
    else:
        out = compute.bf16x2_gemm(a, b, how.split, bias, b_ready)
    if out is None:
        _fallback(how)
    return out


# CUDA: torch's own ops. The checks read the values back (one synchronisation per operand).
def fits(x: torch.Tensor, dtype: str) -> bool:
    """Whether every value of ``x`` (float32) is a number of ``dtype`` (``bf16`` or ``tf32``)
    whose magnitude is zero or at least SMALLEST (NaN and infinities pass)."""
    drop = {"bf16": 16, "tf32": 13}[dtype]  # low bits of float32's mantissa the dtype lacks
    bits = x.contiguous().view(torch.int32)
    magnitude = x.abs()
    exact = (bits & ((1 << drop) - 1)) == 0
    in_range = (magnitude == 0) | (magnitude >= SMALLEST) | ~torch.isfinite(x)
    return bool((exact & in_range).all())


def split_bf16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(hi, lo) as float32 tensors holding bf16 numbers, ``hi + lo == x`` exactly; None when x
    has a value of more than 16 significant bits or one below SMALLEST (the operands that
    the split GEMMs of bf16x2 run on)."""
    bits = x.contiguous().view(torch.int32)
    hi = (bits & -65536).view(torch.float32)  # 0xFFFF0000: the top 16 bits
    finite = torch.isfinite(x)
    lo = torch.where(finite, x - hi, torch.zeros_like(x))
    hi = torch.where(finite, hi, x)
    if not (fits(hi, "bf16") and fits(lo, "bf16")):
        return None
    return hi, lo


@contextlib.contextmanager
def _tf32_allowed():
    """TF32 for float32 GEMMs inside the block only; the setting is put back even on error."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        before = matmul.fp32_precision
        matmul.fp32_precision = "tf32"
        try:
            yield
        finally:
            matmul.fp32_precision = before
    else:  # torch before 2.9
        before = matmul.allow_tf32
        matmul.allow_tf32 = True
        try:
            yield
        finally:
            matmul.allow_tf32 = before


def _mm_bf16(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
    if a.dim() == 2:
        return torch.mm(a16, b16, out_dtype=torch.float32)
    lead = a.shape[:-2]
    out = torch.bmm(
        a16.reshape(-1, *a.shape[-2:]), b16.reshape(-1, *b.shape[-2:]), out_dtype=torch.float32
    )
    return out.reshape(*lead, a.shape[-2], b.shape[-1])


def _run_cuda(a, b, how: GemmPlan, bias):
    if how.unit == "tf32":
        if not (fits(a, "tf32") and fits(b, "tf32")):
            _fallback(how)
            return None
        with _tf32_allowed():
            return torch.addmm(bias, a, b) if bias is not None else torch.matmul(a, b)
    if how.unit == "bf16":
        if not (fits(a, "bf16") and fits(b, "bf16")):
            _fallback(how)
            return None
        out = _mm_bf16(a, b)
    else:  # bf16x2: the wider operand as hi + lo, two exact GEMMs summed in float32
        wide, narrow = (a, b) if how.split == "a" else (b, a)
        parts = split_bf16(wide)
        if parts is None or not fits(narrow, "bf16"):
            _fallback(how)
            return None
        if how.split == "a":
            out = _mm_bf16(parts[0], b) + _mm_bf16(parts[1], b)
        else:
            out = _mm_bf16(a, parts[0]) + _mm_bf16(a, parts[1])
    return out + bias if bias is not None else out
