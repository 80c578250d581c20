"""Each row's paired difference from the ``--against`` row, its p-values and equivalence verdicts,
as text (docs/table.md, "Intervals")."""

from __future__ import annotations

from dsq_cli.run_result import metric_sign

from .cells import LOSS_LABELS, METRIC, Table
from .text import decimals, interval_text, level_text, metric_label


def against_heading(table: Table) -> str:
    equivalence = ""
    if table.margins:
        equivalence = (
            "; equivalent: the interval lies inside ± the margin, i.e. two one-sided tests at "
            f"{level_text((1 - table.level) / 2)} each, and not shown where it does not; TOST "
            "p: the larger of the two one-sided tests' p-values"
        )
    adjusted = ""
    if table.adjust == "holm":
        adjusted = (
            "; Holm: the p-value adjusted by Holm's method within its block, one column's "
            "comparisons in one measure"
        )
    return (
        f"Paired differences from {table.against} (each row minus {table.against}, seed by "
        f"seed; mean, {level_text(table.level)} interval, n pairs, p of the paired t test that "
        f"the difference is 0; {_directions(table)}, a lower loss is better{equivalence}"
        f"{adjusted}):"
    )


def _directions(table: Table) -> str:
    """``a higher metric is better``, naming the metrics where lower is."""
    lower = sorted({metric_label(c.metric) for c in table.columns if metric_sign(c.metric) < 0})
    if not lower:
        return "a higher metric is better"
    if all(metric_sign(c.metric) < 0 for c in table.columns):
        return f"a lower {' or '.join(lower)} is better"
    return f"a higher metric is better (a lower {' or '.join(lower)})"


def equivalence_text(
    verdict: bool | None,
    p: float | None = None,
    adjusted: float | None = None,
    adjust: str = "none",
) -> str:
    if verdict is None:
        return "-"
    text = "equivalent" if verdict else "not shown"
    if p is None:
        return text
    return text + f", TOST p={p:.3f}" + (f", Holm {adjusted:.3f}" if adjust == "holm" else "")


def p_text(p: float | None, adjusted: float | None, adjust: str) -> str:
    if p is None:
        return ""
    text = f", p={p:.3f}"
    return text + (f", Holm {adjusted:.3f}" if adjust == "holm" else "")


def against_grid(table: Table) -> tuple[list[str], list[list[str]]]:
    """The rows' loss (the table's endpoint) and their paired differences from
    ``table.against``, per column: a header and one list of texts per row."""
    header = ["quant"]
    loss_label = LOSS_LABELS[table.loss]
    for column in table.columns:
        label = metric_label(column.metric)
        header += [
            f"{column.label} {loss_label}",
            f"{label} - {table.against}",
            f"loss - {table.against}",
        ]
        if table.margins:
            header += [
                f"{label} within ±{table.margins[METRIC]:g}",
                f"loss within ±{table.margins[table.loss]:g}",
            ]
    p_values = {(c.label, m): table.p_values(c, m) for c in table.columns for m in table.measures}
    equivalence_ps = {
        (c.label, m): table.equivalence_p_values(c, m)
        for c in table.columns
        for m in table.measures
    }
    rows = []
    for row in table.rows:
        texts = [row]
        for column in table.columns:
            cell = table.cell(row, column)
            loss = cell.interval(table.loss, table.level) if cell else None
            texts.append(interval_text(loss, 3) if loss else "-")
            for measure in table.measures:
                if row == table.against:
                    texts.append("-")
                    continue
                diff = table.difference(row, table.against, column, measure)
                digits = decimals(column.metric, measure)
                p, adjusted = p_values[(column.label, measure)][row]
                texts.append(
                    interval_text(diff, digits, signed=True) + p_text(p, adjusted, table.adjust)
                    if diff
                    else "-"
                )
            if table.margins:
                texts += [
                    equivalence_text(
                        table.equivalent(row, column, m),
                        *equivalence_ps[(column.label, m)].get(row, (None, None)),
                        table.adjust,
                    )
                    for m in table.measures
                ]
        rows.append(texts)
    return header, rows
