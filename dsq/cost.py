"""The cost model (docs/cost-model.md, docs/spec.md §4): arithmetic and DRAM cost of a training
step, as ratios to a baseline's. Pure: it prices ``GemmRecord``s and reads no file.

    >>> import dsq.cost
    >>> with dsq.record_gemms() as recorder:
    ...     model(batch).sum().backward()
    >>> dsq.cost.ratios(recorder.gemms, {"q0": "bfp8", "q1": "bfp4", "q2": "bfp8", "q3": "fixed16"})
    (arith_ratio, dram_ratio)      # against fixed32 at every point (``FIXED32``)

Every recorded DSQ layer call (a ``GemmRecord``) stands for three GEMMs of ``batch * N * K * M``
MACs each. Arithmetic is ``MACs * c(fa, fb)`` for the GEMM's two operand formats:

* linear, ``x [N, K]``, ``W [M, K]``, ``g = q3(dy) [N, M]``:
    ``forward``  ``y  = q0(x) q0(W)^T``    c(q0, q0)
    ``grad_x``   ``dx = q2(g) q2(W)``      c(q2, q2)
    ``grad_w``   ``dW = g^T stash``        c(q3, q1)
* matmul (two activations), ``a [batch, N, K]``, ``b [batch, K, M]``, ``g [batch, N, M]``;
  both operands are stashed, and q2 applies to the backward operand that is not a stash:
    ``forward``  ``z  = q0(a) q0(b)``      c(q0, q0)
    ``grad_a``   ``da = q2(g) stash_b^T``  c(q2, q1)
    ``grad_b``   ``db = stash_a^T g``      c(q1, q3)

DRAM is the bits moved, each tensor at ``numel * bits_per_value`` of its format: the forward
GEMM reads its two operands (q0) and writes its output (q0) and the stash (q1: ``x``, or both
``a`` and ``b``), the stash write left out when q1 equals q0 (the q0 copy is the stash); each
backward GEMM reads ``g`` (q3) and its other operand (``W`` in q2, or a stash in q1) and writes
its gradient (q3). A ``CostModel`` holds the coefficients: ``DEFAULT_MODEL`` is the suite's
conf/cost/default.yaml (``DEFAULT_COEFFICIENTS``; a test keeps the two equal), and
``CostModel.from_dict`` builds another from a mapping of the same shape (the suite loads
conf/cost/<name>.yaml with it: ``dsq_cli.cost.load_cost_model``).

Costs are exact ``Fraction``s, so a uniform ``fixed<w>`` config gives exactly ``(w/32)**2`` and
``w/32`` against ``fixed32``; ratios are returned as floats.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from fractions import Fraction
from types import MappingProxyType

from dsq.engine.accounting import GemmRecord
from dsq.engine.config import POINTS
from dsq.formats import Format, parse_format

DRAM_SWITCHES = ("stash_write_when_q1_equals_q0", "flush_activation_grads", "activations_fp32")
ARITHMETIC_MODELS = ("bit_product", "additive")

# The coefficients of conf/cost/default.yaml, where each is justified (docs/cost-model.md
# derives them); tests/dsq_cli/cost/test_cost_library.py checks that the two agree.
DEFAULT_COEFFICIENTS: Mapping = MappingProxyType(
    {
        "arithmetic": MappingProxyType({"model": "bit_product", "scale": 1024}),
        "float_widths": MappingProxyType(
            {"fp32": 32, "fp16": 16, "bf16": 16, "e4m3": 8, "e5m2": 8}
        ),
        "dram": MappingProxyType(
            {
                "stash_write_when_q1_equals_q0": False,
                "flush_activation_grads": True,
                "activations_fp32": False,
            }
        ),
    }
)
# The default baseline: fixed32 at every point (docs/spec.md §4), as the suite's preset of that
# name.
FIXED32: Mapping[str, str] = MappingProxyType(dict.fromkeys(POINTS, "fixed32"))

Points = Mapping[str, "str | Format"]


@dataclasses.dataclass(frozen=True)
class CostModel:
    """The coefficients of a cost model: ``DEFAULT_MODEL``, or ``from_dict`` of a mapping shaped
    like conf/cost/default.yaml."""

    name: str
    arithmetic: str  # "bit_product": wa * wb / scale; "additive": (wa + wb) / scale
    scale: int
    # effective w of a format in c(fa, fb) where it is not the format's own ``cost_width``
    float_widths: Mapping[str, int]
    stash_write_when_q1_equals_q0: bool
    flush_activation_grads: bool
    activations_fp32: bool  # activations and their gradients move at 32 bits

    @classmethod
    def from_dict(cls, data: Mapping, name: str = "custom") -> CostModel:
        """A model from a mapping shaped like conf/cost/default.yaml (every key required); a
        missing or unknown key, or a value out of range, is a ValueError saying which."""
        _check_keys("cost model", data, {"arithmetic", "float_widths", "dram"})
        arithmetic, dram = data["arithmetic"], data["dram"]
        _check_keys("arithmetic", arithmetic, {"model", "scale"})
        _check_keys("dram", dram, set(DRAM_SWITCHES))
        for switch in DRAM_SWITCHES:
            if not isinstance(dram[switch], bool):
                raise ValueError(f"dram.{switch} must be true or false, got {dram[switch]!r}")
        if arithmetic["model"] not in ARITHMETIC_MODELS:
            raise ValueError(
                f"arithmetic model must be one of {ARITHMETIC_MODELS}, got {arithmetic['model']!r}"
            )
        scale = arithmetic["scale"]
        if not (isinstance(scale, int) and scale > 0):
            raise ValueError(f"arithmetic scale must be a positive int, got {scale!r}")
        if not isinstance(data["float_widths"], Mapping):
            raise ValueError(f"float_widths: expected a mapping, got {data['float_widths']!r}")
        widths = {}
        for spec, width in data["float_widths"].items():
            storage = parse_format(spec).cost_width  # a bad spec is a ValueError naming it
            # c grows with each width, so width >= storage width keeps a float at least as
            # expensive as fixed<storage width> (docs/spec.md §4)
            if not (isinstance(width, int) and width >= storage):
                raise ValueError(
                    f"float_widths.{spec} = {width!r} would make {spec} cheaper than "
                    f"fixed{int(storage)}; use an int >= {int(storage)}"
                )
            widths[parse_format(spec).spec] = width
        return cls(
            name=name,
            arithmetic=arithmetic["model"],
            scale=scale,
            float_widths=MappingProxyType(widths),
            stash_write_when_q1_equals_q0=dram["stash_write_when_q1_equals_q0"],
            flush_activation_grads=dram["flush_activation_grads"],
            activations_fp32=dram["activations_fp32"],
        )

    def to_dict(self) -> dict:
        """The coefficients as the mapping ``from_dict`` reads (plain dicts; no name)."""
        return {
            "arithmetic": {"model": self.arithmetic, "scale": self.scale},
            "float_widths": dict(self.float_widths),
            "dram": {switch: getattr(self, switch) for switch in DRAM_SWITCHES},
        }

    def width(self, fmt: Format) -> int:
        """The operand width w in c(fa, fb): the table's for the floats it lists, else the
        format's own ``cost_width`` (m for bfp<m>, the shared exponent add, once per block, left
        out; w for fixed<w> and fixed<w>f<f>; the element width for the MX formats and nvfp4,
        their scales left out likewise)."""
        return self.float_widths.get(fmt.spec, fmt.cost_width)

    def per_mac(self, fa: Format, fb: Format) -> Fraction:
        """c(fa, fb): the arithmetic cost of one multiply-accumulate."""
        wa, wb = self.width(fa), self.width(fb)
        if self.arithmetic == "bit_product":
            return Fraction(wa * wb, self.scale)
        return Fraction(wa + wb, self.scale)


def _check_keys(where: str, data: object, expected: set[str]) -> None:
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: expected a mapping with keys {sorted(expected)}, got {data!r}")
    if set(data) != expected:
        raise ValueError(
            f"{where}: expected keys {sorted(expected)}; missing {sorted(expected - set(data))}, "
            f"unknown {sorted(set(data) - expected)}"
        )


DEFAULT_MODEL = CostModel.from_dict(DEFAULT_COEFFICIENTS, name="default")


def bits_per_value(fmt: Format) -> Fraction:
    """DRAM bits per value, exactly: bits_per_value is m + E/B with B <= 4096 (docs/spec.md §1.2),
    so the nearest fraction with such a denominator undoes the float's rounding."""
    return Fraction(fmt.bits_per_value).limit_denominator(4096)


@dataclasses.dataclass(frozen=True)
class GemmCost:
    """One GEMM: its name, MACs, operand specs, arithmetic cost and DRAM bits moved."""

    name: str
    macs: int
    operands: tuple[str, str]
    arith: Fraction
    dram_bits: Fraction


@dataclasses.dataclass
class CostTotals:
    macs: int = 0
    arith: Fraction = Fraction(0)
    dram_bits: Fraction = Fraction(0)

    def add(self, gemm: GemmCost) -> None:
        self.macs += gemm.macs
        self.arith += gemm.arith
        self.dram_bits += gemm.dram_bits

    def as_dict(self) -> dict:
        return {"macs": self.macs, "arith": float(self.arith), "dram_bits": float(self.dram_bits)}


@dataclasses.dataclass
class StepCost(CostTotals):
    """A training step's totals, and the same per record kind (``linear``, ``matmul``)."""

    by_kind: dict[str, CostTotals] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict:
        return {**super().as_dict(), "by_kind": {k: t.as_dict() for k, t in self.by_kind.items()}}


def _formats_in_force(record: GemmRecord, points: Points | None) -> dict[str, Format]:
    """The record's own formats, with ``points`` (some or all of q0..q3) taking precedence."""
    specs = {**dict(record.formats), **dict(points or {})}
    missing = [p for p in POINTS if p not in specs]
    if missing:
        raise ValueError(f"no format for {missing}: the record and points give {sorted(specs)}")
    for point in POINTS:
        if not isinstance(specs[point], (str, Format)):
            raise ValueError(
                f"{point}: expected a format spec, got {specs[point]!r} (a schedule: pass the "
                "level in force)"
            )
    return {p: parse_format(specs[p]) for p in POINTS}


def gemm_costs(
    record: GemmRecord, points: Points | None = None, *, model: CostModel | None = None
) -> list[GemmCost]:
    """The three GEMMs of one record (forward, then the two backward ones), priced with the
    record's formats or, where given, ``points`` (to re-price a step under another config).
    ``model`` defaults to ``DEFAULT_MODEL``."""
    model = model or DEFAULT_MODEL
    f = _formats_in_force(record, points)
    b0, b1, b2, b3 = (bits_per_value(f[p]) for p in POINTS)  # DRAM bits per value at q0..q3
    # activations_fp32: the activations and their gradients live in fp32 between the GEMMs (the
    # elementwise ops of docs/spec.md §2 run in fp32), so there is no q0 copy of x to serve as the
    # stash
    act_fwd = Fraction(32) if model.activations_fp32 else b0  # x (a, b) read, y (z) written
    act_grad = Fraction(32) if model.activations_fp32 else b3  # g read, dx (da, db) written
    write_stash = (
        f["q1"] != f["q0"] or model.stash_write_when_q1_equals_q0 or model.activations_fp32
    )
    flush = 1 if model.flush_activation_grads else 0
    macs = record.macs

    def gemm(name, fa, fb, dram_bits) -> GemmCost:
        arith = macs * model.per_mac(f[fa], f[fb])
        return GemmCost(name, macs, (f[fa].spec, f[fb].spec), arith, dram_bits)

    batch, n, k, m = record.batch, record.n, record.k, record.m
    if record.kind == "linear":
        # elements of x (= dx = the stash), of W (= dW), of y (= g)
        n_x, n_w, n_g = batch * n * k, m * k, batch * n * m
        n_stash = n_x if write_stash else 0
        return [
            gemm("forward", "q0", "q0", (n_x + n_g) * act_fwd + n_w * b0 + n_stash * b1),
            gemm("grad_x", "q2", "q2", n_g * act_grad + n_w * b2 + flush * n_x * act_grad),
            gemm("grad_w", "q3", "q1", n_g * act_grad + n_x * b1 + n_w * b3),
        ]
    if record.kind == "matmul":
        # elements of a (= da = stash_a), of b (= db = stash_b), of z (= g)
        n_a, n_b, n_g = batch * n * k, batch * k * m, batch * n * m
        n_stash = n_a + n_b if write_stash else 0
        return [
            gemm("forward", "q0", "q0", (n_a + n_b + n_g) * act_fwd + n_stash * b1),
            gemm("grad_a", "q2", "q1", n_g * act_grad + n_b * b1 + flush * n_a * act_grad),
            gemm("grad_b", "q1", "q3", n_g * act_grad + n_a * b1 + flush * n_b * act_grad),
        ]
    raise ValueError(f"unknown GEMM record kind {record.kind!r}; expected 'linear' or 'matmul'")


def step_cost(
    records: Iterable[GemmRecord], points: Points | None = None, *, model: CostModel | None = None
) -> StepCost:
    """Totals over every GEMM of ``records`` (one training step), overall and per kind."""
    total = StepCost()
    for record in records:
        kind_total = total.by_kind.setdefault(record.kind, CostTotals())
        for gemm in gemm_costs(record, points, model=model):
            total.add(gemm)
            kind_total.add(gemm)
    return total


def _exact_ratios(
    records: Sequence[GemmRecord], points: Points | None, baseline: Points, model: CostModel
) -> tuple[Fraction, Fraction]:
    cost = step_cost(records, points, model=model)
    base = step_cost(records, baseline, model=model)
    if base.arith == 0 or base.dram_bits == 0:
        raise ValueError("no GEMMs to price: the baseline cost is zero (were any recorded?)")
    return cost.arith / base.arith, cost.dram_bits / base.dram_bits


def ratios(
    records: Sequence[GemmRecord],
    points: Points | None = None,
    baseline: Points = FIXED32,
    *,
    model: CostModel | None = None,
) -> tuple[float, float]:
    """(arithmetic, DRAM) cost of ``records`` under ``points`` over the same under ``baseline``
    (the points q0..q3 of the baseline config; fixed32 at every point by default)."""
    arith, dram = _exact_ratios(list(records), points, baseline, model or DEFAULT_MODEL)
    return float(arith), float(dram)


def scheduled_cost(
    records: Sequence[GemmRecord],
    segments: Sequence[tuple[Points, int]],
    baseline: Points = FIXED32,
    *,
    model: CostModel | None = None,
) -> dict:
    """A scheduled run's cost: the update-weighted mean of the ratios of the segments it ran,
    each ``(points in force, updates run with them)`` (docs/spec.md §4). With no updates at all,
    the first segment's ratios. Returns ``{arith_ratio, dram_ratio, baseline}`` (the baseline's
    points; the suite's result.json records its preset's name there instead)."""
    records, model = list(records), model or DEFAULT_MODEL
    if not segments:
        raise ValueError("scheduled_cost needs at least one (points, updates) segment")
    if any(updates < 0 for _, updates in segments):
        raise ValueError(f"segment updates must be >= 0, got {[u for _, u in segments]}")
    total_updates = sum(updates for _, updates in segments)
    if total_updates == 0:  # e.g. a run stopped before its first update: price its start
        segments, total_updates = [(segments[0][0], 1)], 1
    arith = dram = Fraction(0)
    for points, updates in segments:
        seg_arith, seg_dram = _exact_ratios(records, points, baseline, model)
        arith += updates * seg_arith
        dram += updates * seg_dram
    return {
        "arith_ratio": float(arith / total_updates),
        "dram_ratio": float(dram / total_updates),
        "baseline": dict(baseline),
    }


# -- a run's record (result.json's cost and stash_bits_mean, docs/spec.md §5) ---------------------
def unpriced(baseline_name: str) -> dict:
    """The cost of a run that has not recorded a training step yet."""
    return {"arith_ratio": None, "dram_ratio": None, "baseline": baseline_name}


def run_cost(
    gemm_shapes: Sequence[Mapping] | None,
    segments: Sequence[tuple[Points, int]],
    baseline: Points = FIXED32,
    *,
    baseline_name: str = "fixed32",
    model: CostModel | None = None,
) -> dict:
    """A run's cost as result.json records it: ``scheduled_cost`` over the precision segments it
    trained (``(points in force, updates)`` pairs, as ``PrecisionHistory`` keeps them), priced
    on the GEMMs of one recorded update (``GemmRecord.to_dict()``s), with the baseline by name
    and ``gemms_per_step`` (three GEMMs a record); ``unpriced`` when nothing was recorded.
    ``dsq train`` and the Hugging Face callback both record this, so a table prices their runs
    alike."""
    if not gemm_shapes or not segments:
        return unpriced(baseline_name)
    records = [GemmRecord.from_dict(dict(g)) for g in gemm_shapes]
    cost = scheduled_cost(records, [(points, n) for points, n in segments], baseline, model=model)
    cost["baseline"] = baseline_name
    cost["gemms_per_step"] = len(records) * 3  # the forward GEMM and two backward ones
    return cost


def stash_bits_mean(segments: Sequence[tuple[Points, int]]) -> float | None:
    """Update-weighted mean bits per value of the stash format (q1) over a run's segments; None
    before its first update."""
    total = sum(updates for _, updates in segments)
    if not total:
        return None
    bits = sum(parse_format(points["q1"]).bits_per_value * n for points, n in segments)
    return bits / total
