"""``dsq cost``: the docs/spec.md §4 cost of one training step of a model config, without training.

The step's GEMMs come from ``derive_records`` (the model config and the batch shape), priced with
a quant config's points and with a baseline preset's, per GEMM kind and in total. A scheduled
point is priced at its first level (what a run starts at); the report adds the ratios at the last
levels (where a run ends if its schedules climb all the way). A run's own ``result.json`` holds
the update-weighted mean over the levels it actually used.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from fractions import Fraction

from dsq.cost import CostModel, gemm_costs
from dsq.engine.accounting import GemmRecord
from dsq.engine.config import POINTS, QuantConfig

from .derive import DEFAULT_VOCAB, MODEL_KEYS, as_quant_config, derive_records, step_shape
from .model import COST_BASELINE, baseline_points, load_cost_model

# the rows of the table, in the order the three GEMMs of each record kind run
GEMM_ROWS = (
    ("linear", "forward"),
    ("linear", "grad_x"),
    ("linear", "grad_w"),
    ("matmul", "forward"),
    ("matmul", "grad_a"),
    ("matmul", "grad_b"),
)
# the abstract's baseline (docs/spec.md §4's published anchor), reported beside the default fixed32
ABSTRACT_BASELINE = "fixed16"
DEFAULT_TOKENS = 4096
DEFAULT_SRC_LEN = 32


@dataclasses.dataclass
class _Sums:
    """One row: the GEMMs of one (kind, name), summed over every layer."""

    count: int = 0
    macs: int = 0
    arith: Fraction = Fraction(0)
    dram_bits: Fraction = Fraction(0)
    operands: set[tuple[str, str]] = dataclasses.field(default_factory=set)


def _price(
    records: Sequence[GemmRecord], points: Mapping[str, str], model: CostModel
) -> dict[tuple[str, str], _Sums]:
    rows = {row: _Sums() for row in GEMM_ROWS}
    for record in records:
        for gemm in gemm_costs(record, points, model=model):
            row = rows[(record.kind, gemm.name)]
            row.count += 1
            row.macs += gemm.macs
            row.arith += gemm.arith
            row.dram_bits += gemm.dram_bits
            row.operands.add(gemm.operands)
    return rows


def _total(rows: Mapping[tuple[str, str], _Sums]) -> _Sums:
    total = _Sums()
    for row in rows.values():
        total.count += row.count
        total.macs += row.macs
        total.arith += row.arith
        total.dram_bits += row.dram_bits
    return total


def _ratio(cost: Fraction, base: Fraction) -> float | None:
    return float(cost / base) if base else None


def _ratios(records, points, baseline_points_, model) -> dict:
    """Total (arith, DRAM) ratios of ``points`` over ``baseline_points_``, with the 'fewer'
    factors (their inverses) that the paper's abstract quotes."""
    cost = _total(_price(records, points, model))
    base = _total(_price(records, baseline_points_, model))
    arith, dram = cost.arith / base.arith, cost.dram_bits / base.dram_bits
    return {
        "arith_ratio": float(arith),
        "dram_ratio": float(dram),
        "arith_fewer": float(1 / arith),
        "dram_fewer": float(1 / dram),
    }


def cost_report(
    model_cfg: Mapping,
    quant: QuantConfig | Mapping,
    *,
    quant_name: str | None = None,
    baseline: str = COST_BASELINE,
    cost_model: str = "default",
    tokens: int = DEFAULT_TOKENS,
    src_len: int = DEFAULT_SRC_LEN,
    tgt_len: int | None = None,
    vocab: int = DEFAULT_VOCAB,
    vocab_from: str | None = None,
) -> dict:
    """The cost of one training step of ``model_cfg`` (conf/model keys) under ``quant`` (a
    ``QuantConfig`` or a conf/quant mapping) against the ``baseline`` preset, as a JSON-ready
    dict: ``total`` (MACs, arith, DRAM bits, the two ratios), ``gemms`` (one row per GEMM kind,
    summed over layers), ``last_level`` (None unless a point is scheduled) and ``against``
    (the same ratios against fixed16 when the baseline is fixed32). ``vocab_from`` says where
    ``vocab`` came from, for the header."""
    model = load_cost_model(cost_model)  # unknown names list the choices, before any work
    base_points = baseline_points(baseline)
    quant = as_quant_config(quant)
    shape = step_shape(tokens, src_len, tgt_len, vocab)
    first = quant.current()
    last = {p: quant.schedule(p).levels[-1] for p in POINTS}
    scheduled = {p: quant.schedule(p).levels for p in POINTS if len(quant.schedule(p).levels) > 1}
    records = derive_records(model_cfg, tokens, src_len, tgt_len, vocab, quant=quant)

    rows, base_rows = _price(records, first, model), _price(records, base_points, model)
    total, base_total = _total(rows), _total(base_rows)
    gemms = []
    for kind, name in GEMM_ROWS:
        row, base = rows[(kind, name)], base_rows[(kind, name)]
        if not row.count:
            continue
        gemms.append(
            {
                "kind": kind,
                "gemm": name,
                "count": row.count,
                "operands": [" x ".join(pair) for pair in sorted(row.operands)],
                "macs": row.macs,
                "arith": float(row.arith),
                "dram_bits": float(row.dram_bits),
                "arith_ratio": _ratio(row.arith, base.arith),
                "dram_ratio": _ratio(row.dram_bits, base.dram_bits),
            }
        )
    against = {}
    if baseline == COST_BASELINE:
        abstract_points = baseline_points(ABSTRACT_BASELINE)
        against[ABSTRACT_BASELINE] = _ratios(records, first, abstract_points, model)
    last_level = None
    if scheduled:
        last_level = {
            "points": last,
            baseline: _ratios(records, last, base_points, model),
            **{name: _ratios(records, last, baseline_points(name), model) for name in against},
        }
    return {
        "model": {"name": model_cfg.get("name"), **{k: model_cfg[k] for k in MODEL_KEYS}},
        "batch": {
            "tokens": tokens,
            "sentences": shape.sentences,
            "src_len": shape.src_len,
            "tgt_len": shape.tgt_len,
            "src_tokens": shape.src_tokens,
            "tgt_tokens": shape.tgt_tokens,
            "vocab": shape.vocab,
            "vocab_from": vocab_from,
        },
        "quant": {"name": quant_name, "points": first, "scheduled": scheduled},
        "baseline": {"name": baseline, "points": base_points},
        "cost_model": model.name,
        "total": {
            "count": total.count,
            "macs": total.macs,
            "arith": float(total.arith),
            "dram_bits": float(total.dram_bits),
            "baseline_arith": float(base_total.arith),
            "baseline_dram_bits": float(base_total.dram_bits),
            **_ratios(records, first, base_points, model),
        },
        "gemms": gemms,
        "last_level": last_level,
        "against": against,
    }


def _si(value: float) -> str:
    """A count with an SI prefix and 4 significant digits: 1.234G."""
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.4g}{prefix}"
    return f"{value:.4g}"


def _ratio_line(name: str, ratios: Mapping) -> str:
    return (
        f"against {name}: arith {ratios['arith_ratio']:.4f} ({ratios['arith_fewer']:.2f}x fewer), "
        f"dram {ratios['dram_ratio']:.4f} ({ratios['dram_fewer']:.2f}x fewer)"
    )


def _short(spec: str) -> str:
    """The default BFP exponent and block size go without saying: bfp8e8b16 is bfp8."""
    return re.sub(r"e8b16(?!\d)", "", spec)


def _points_text(points: Mapping[str, str], only: Sequence[str] = POINTS) -> str:
    return ", ".join(f"{p} {_short(points[p])}" for p in only)


def format_report(report: Mapping) -> str:
    """The report as the table ``dsq cost`` prints."""
    m, batch, quant, base = report["model"], report["batch"], report["quant"], report["baseline"]
    lines = [
        f"dsq cost: one training step of {m['name'] or 'the model'}, derived from its config "
        "(nothing is trained)",
        f"model:    encoder {m['encoder_layers']} layers x {m['encoder_embed_dim']} "
        f"(ffn {m['encoder_ffn_embed_dim']}, {m['encoder_attention_heads']} heads), decoder "
        f"{m['decoder_layers']} layers x {m['decoder_embed_dim']} (ffn "
        f"{m['decoder_ffn_embed_dim']}, {m['decoder_attention_heads']} heads)",
        f"batch:    {batch['src_tokens']} source tokens = {batch['sentences']} sentences x "
        f"{batch['src_len']}, targets of {batch['tgt_len']}",
        f"output:   vocabulary {batch['vocab']}"
        + (f" ({batch['vocab_from']})" if batch.get("vocab_from") else ""),
        f"quant:    {quant['name'] or 'custom'}: {_points_text(quant['points'])}",
    ]
    for point, levels in quant["scheduled"].items():
        lines.append(
            f"          {point}: {' -> '.join(map(_short, levels))}, priced at the first "
            "(where a run starts)"
        )
    lines.append(
        f"baseline: {base['name']}: {_points_text(base['points'])}",
    )
    lines.append(f"costs:    conf/cost/{report['cost_model']}.yaml")
    header = (
        f"{'GEMM':<15} {'count':>5}  {'operands':<18} {'MACs':>8} {'arith':>8} "
        f"{'DRAM bits':>10}  {'arith ratio':>11}  {'DRAM ratio':>10}"
    )
    lines += ["", header, "-" * len(header)]

    def row_line(label, count, operands, row) -> str:
        return (
            f"{label:<15} {count:>5}  {operands:<18} {_si(row['macs']):>8} "
            f"{_si(row['arith']):>8} {_si(row['dram_bits']):>10}  {row['arith_ratio']:>11.4f}  "
            f"{row['dram_ratio']:>10.4f}"
        )

    for row in report["gemms"]:
        operands = _short(", ".join(row["operands"]))
        lines.append(row_line(f"{row['kind']} {row['gemm']}", row["count"], operands, row))
    lines.append("-" * len(header))
    total = report["total"]
    lines.append(row_line("total", total["count"], "", total))
    lines.append("")
    lines.append(_ratio_line(base["name"], total))
    for name, ratios in report["against"].items():
        lines.append(_ratio_line(name, ratios) + " (the abstract's baseline)")
    last = report["last_level"]
    if last is not None:
        scheduled = list(quant["scheduled"])
        lines.append(
            f"at the last levels ({_points_text(last['points'], scheduled)}), where a run ends "
            "if its schedules climb all the way:"
        )
        for name in (base["name"], *report["against"]):
            lines.append("  " + _ratio_line(name, last[name]))
        lines.append(
            "(a run's result.json prices the levels it actually used, weighted by updates)"
        )
    lines += [
        "",
        "arith: MACs x c(fa, fb), in fixed32 x fixed32 MACs; DRAM bits: read and written;",
        "ratio columns: each row over the same row under the baseline (docs/cost-model.md).",
    ]
    return "\n".join(lines)
