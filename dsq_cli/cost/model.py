"""The Table 1 cost model (docs/spec.md §4): arithmetic and DRAM cost of a training step, as ratios.

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
its gradient (q3). Coefficients live in conf/cost/<name>.yaml; conf/cost/elementwise_fp32.yaml
moves the activations and their gradients at 32 bits instead (``activations_fp32``).

Costs are exact ``Fraction``s, so a uniform ``fixed<w>`` config gives exactly ``(w/32)**2`` and
``w/32`` against ``fixed32``; ratios are returned as floats.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping, Sequence
from fractions import Fraction
from types import MappingProxyType

import yaml

from dsq.engine.accounting import GemmRecord
from dsq.engine.config import POINTS
from dsq.formats import Format, parse_format
from dsq.formats.bfp import BFP
from dsq.formats.fixed import FixedStatic
from dsq.formats.floats import FloatCast
from dsq_cli.presets import BASELINE_PRESET, CONF_DIR, at_first_level, load_quant_preset

DRAM_SWITCHES = ("stash_write_when_q1_equals_q0", "flush_activation_grads", "activations_fp32")
ARITHMETIC_MODELS = ("bit_product", "additive")
FLOAT_SPECS = ("fp32", "fp16", "bf16", "e4m3", "e5m2")  # every floating format needs a width
COST_DIR = CONF_DIR / "cost"
DEFAULT_BASELINE = BASELINE_PRESET

Points = Mapping[str, "str | Format"]


@dataclasses.dataclass(frozen=True)
class CostModel:
    """The coefficients of conf/cost/<name>.yaml."""

    name: str
    arithmetic: str  # "bit_product": wa * wb / scale; "additive": (wa + wb) / scale
    scale: int
    float_widths: Mapping[str, int]  # effective w of each floating format in c(fa, fb)
    stash_write_when_q1_equals_q0: bool
    flush_activation_grads: bool
    activations_fp32: bool  # activations and their gradients move at 32 bits (see default.yaml)

    @classmethod
    def load(cls, name: str = "default") -> CostModel:
        """The model of conf/cost/NAME.yaml; an unknown name is a ValueError listing them all."""
        return _load_cached(name)

    @classmethod
    def from_dict(cls, data: Mapping, name: str = "custom") -> CostModel:
        """A model from a mapping shaped like conf/cost/default.yaml (every key required)."""
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
        _check_keys("float_widths", data["float_widths"], set(FLOAT_SPECS))
        widths = {}
        for spec, width in data["float_widths"].items():
            storage = parse_format(spec).bits_per_value
            # c grows with each width, so width >= storage width keeps a float at least as
            # expensive as fixed<storage width> (docs/spec.md §4)
            if not (isinstance(width, int) and width >= storage):
                raise ValueError(
                    f"float_widths.{spec} = {width!r} would make {spec} cheaper than "
                    f"fixed{int(storage)}; use an int >= {int(storage)}"
                )
            widths[spec] = width
        return cls(
            name=name,
            arithmetic=arithmetic["model"],
            scale=scale,
            float_widths=MappingProxyType(widths),
            stash_write_when_q1_equals_q0=dram["stash_write_when_q1_equals_q0"],
            flush_activation_grads=dram["flush_activation_grads"],
            activations_fp32=dram["activations_fp32"],
        )

    def width(self, fmt: Format) -> int:
        """The operand width w in c(fa, fb): m for bfp<m> (the shared exponent add, once per
        block, is left out), w for fixed<w> and fixed<w>f<f>, the table for floats."""
        if isinstance(fmt, BFP):  # fixed<w> is a BFP with one block, man_bits = w
            return fmt.man_bits
        if isinstance(fmt, FixedStatic):
            return fmt.width
        if isinstance(fmt, FloatCast):
            return self.float_widths[fmt.spec]
        raise ValueError(f"the cost model has no width for format {fmt.spec!r}")

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


@functools.cache
def _load_cached(name: str) -> CostModel:
    path = COST_DIR / f"{name}.yaml"
    if not path.is_file():
        choices = sorted(p.stem for p in COST_DIR.glob("*.yaml"))
        raise ValueError(f"unknown cost model {name!r}; choose one of {choices}")
    return CostModel.from_dict(yaml.safe_load(path.read_text()), name=name)


def _bits(fmt: Format) -> Fraction:
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
    record's formats or, where given, ``points`` (to re-price a step under another config)."""
    model = model or CostModel.load()
    f = _formats_in_force(record, points)
    b0, b1, b2, b3 = (_bits(f[p]) for p in POINTS)  # DRAM bits per value at q0..q3
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


def baseline_points(preset: str = DEFAULT_BASELINE) -> dict[str, str]:
    """q0..q3 of a conf/quant preset; a scheduled point counts at its first level."""
    config = at_first_level(load_quant_preset(preset))  # ValueError naming the presets if unknown
    points = {point: config[point] for point in POINTS}
    for spec in points.values():
        parse_format(spec)  # a bad spec fails here, naming the preset's format
    return points


def _exact_ratios(
    records: Sequence[GemmRecord], points: Points | None, baseline: str | Points, model: CostModel
) -> tuple[Fraction, Fraction]:
    base_points = baseline_points(baseline) if isinstance(baseline, str) else baseline
    cost = step_cost(records, points, model=model)
    base = step_cost(records, base_points, model=model)
    if base.arith == 0 or base.dram_bits == 0:
        raise ValueError("no GEMMs to price: the baseline cost is zero (were any recorded?)")
    return cost.arith / base.arith, cost.dram_bits / base.dram_bits


def ratios(
    records: Sequence[GemmRecord],
    points: Points | None = None,
    baseline: str | Points = DEFAULT_BASELINE,
    *,
    model: CostModel | None = None,
) -> tuple[float, float]:
    """(arithmetic, DRAM) cost of ``records`` under ``points`` over the same under ``baseline``
    (a conf/quant preset name or a points mapping)."""
    arith, dram = _exact_ratios(list(records), points, baseline, model or CostModel.load())
    return float(arith), float(dram)


def scheduled_cost(
    records: Sequence[GemmRecord],
    segments: Sequence[tuple[Points, int]],
    baseline: str | Points = DEFAULT_BASELINE,
    *,
    model: CostModel | None = None,
) -> dict:
    """A scheduled run's cost: the update-weighted mean of the ratios of the segments it ran,
    each ``(points in force, updates run with them)`` (docs/spec.md §4). With no updates at all, the
    first segment's ratios. This is result.json's ``cost``."""
    records, model = list(records), model or CostModel.load()
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
        "baseline": baseline if isinstance(baseline, str) else dict(baseline),
    }
