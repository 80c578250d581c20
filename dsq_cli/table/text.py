"""Numbers, intervals and legends as the table prints them."""

from __future__ import annotations

from dsq.presets import COST_BASELINE
from dsq_cli.run_result import metric_decimals

from .cells import METRIC, METRIC_LABELS, PAPER_REFERENCE, Cell, Table
from .intervals import (
    Interval,
)


def ratio_text(ratio: float) -> str:
    """``0.0519 (19.3x)``: the fraction of the baseline's cost and how many times fewer."""
    if ratio == 0:
        return "0"
    return f"{ratio:.3g} ({1 / ratio:.3g}x)"


def decimals(metric: str, measure: str) -> int:
    """BLEU two decimals, GLUE's fractions three (`metric_decimals`), losses three."""
    return metric_decimals(metric) if measure == METRIC else 3


def interval_text(
    interval: Interval, digits: int, signed: bool = False, with_n: bool = True
) -> str:
    """``27.87 [23.42, 32.32] (n=2)``: the mean, its interval in brackets where there is one,
    and n where it is over more than one value (``with_n``); ``signed`` for differences
    (``+0.56``)."""
    sign = "+" if signed else ""
    text = f"{interval.mean:{sign}.{digits}f}"
    if interval.low is not None:
        text += f" [{interval.low:{sign}.{digits}f}, {interval.high:{sign}.{digits}f}]"
    return text + (f" (n={interval.n})" if with_n and interval.n > 1 else "")


def _metric_text(cell: Cell, level: float) -> str:
    digits = metric_decimals(cell.runs[0].metric)
    interval = cell.interval(METRIC, level)
    text = f"{interval.mean:.{digits}f}"
    notes = [cell.note] if cell.note else []
    stopped = sum(1 for r in cell.completed if r.result.stopped_early)
    if stopped:
        notes.insert(0, f"{stopped} stopped early")
    if interval.low is not None:
        text += f" [{interval.low:.{digits}f}, {interval.high:.{digits}f}]"
        notes.insert(0, f"n={interval.n}")
    return f"{text} ({'; '.join(notes)})" if notes else text


def cell_texts(cell: Cell | None, level: float = 0.95) -> list[str]:
    """Metric, arith, DRAM, stash bits as shown: numbers of completed runs, else the status."""
    if cell is None:
        return ["-"] * 4
    if not cell.completed:
        return [cell.note, "-", "-", "-"]
    return [
        _metric_text(cell, level),
        ratio_text(cell.cost_mean("arith_ratio")),
        ratio_text(cell.cost_mean("dram_ratio")),
        f"{cell.stash_bits_mean:.3g}",
    ]


def metric_label(metric: str) -> str:
    return METRIC_LABELS.get(metric, metric)


def _baseline_text(table: Table) -> str:
    return "/".join(table.baselines) or COST_BASELINE


def level_text(level: float) -> str:
    return f"{level * 100:.4g}%"


def legend_lines(table: Table) -> list[str]:
    baseline = _baseline_text(table)
    paper = PAPER_REFERENCE
    lines = [
        f"arith, DRAM: cost per training step as a fraction of {baseline} at every point "
        f"(result.json's cost ratios, docs/spec.md §4), and in brackets how many times fewer; "
        "lower is cheaper.",
        f"metric: mean over completed seeds and, in brackets, the {level_text(table.level)} "
        "interval of that mean (Student t on the seeds' sample standard deviation, n runs); "
        "runs that did not complete are counted beside it, or shown by status when none "
        "completed.",
        f"reference, paper ({paper['task'].upper()}, DSQ vs {paper['baseline']}): "
        f"{paper['arith_reduction']}x arithmetic, {paper['dram_reduction']}x DRAM.",
    ]
    for ours in table.rebased():
        lines.append(
            f"ours ({ours['column']}, dsq vs fixed16): {ours['arith_reduction']:.3g}x "
            f"arithmetic, {ours['dram_reduction']:.3g}x DRAM."
        )
    return lines


def markdown_escape(text: str) -> str:
    # Only the cell separator: a lone ``*`` (``dsq*``) cannot open emphasis, and ``_`` inside a
    # word (``stash_bfp``) is literal in GitHub markdown, so the raw text stays readable.
    return text.replace("|", "\\|")


def markdown_grid(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(markdown_escape(h) for h in header) + " |",
        "|" + "---|" + "---:|" * (len(header) - 1),
        *("| " + " | ".join(markdown_escape(t) for t in texts) + " |" for texts in rows),
    ]
