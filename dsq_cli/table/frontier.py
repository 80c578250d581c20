"""The trade-off frontier (``--frontier``): which rows no other beats in metric and cost, and
which dominances hold beyond the seeds' noise."""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable, Mapping
from typing import Any

from dsq_cli.run_result import metric_decimals, metric_sign

from .cells import METRIC, Cell, Table
from .intervals import (
    Interval,
    paired_differences,
)
from .text import interval_text, metric_label

# (cost key in result.json's `cost`, its name in the frontier's lines)
COSTS = (("arith_ratio", "arithmetic"), ("dram_ratio", "DRAM"))


FRONTIER_HEADING = (
    "Pareto frontier (rows compared two by two, by their mean metric and cost ratio over the "
    "seeds both completed; a row is dominated when another is at least as good and at least as "
    "cheap, and better or cheaper; beside each dominator, its metric minus the dominated row's, "
    "seed by seed, with its interval: the dominance holds where that interval lies above 0, else "
    "it is unresolved at this n):"
)


def dominators(
    rows: Mapping[str, Any], gains: Callable[[Any, Any], tuple[float, float]]
) -> dict[str, list[str]]:
    """Each row's dominators, in ``rows``' order: the rows at least as good and as cheap, and
    better or cheaper. ``gains(mine, theirs)`` gives how much better (by the metric's direction)
    and how much cheaper (cost) the other row is than this one, on one footing (for
    `frontier_records`, the seeds both completed). A row with none sits on the Pareto frontier;
    two equal rows do not dominate each other."""
    beaten: dict[str, list[str]] = {}
    for row, mine in rows.items():
        beaten[row] = []
        for other, theirs in rows.items():
            if other == row:
                continue
            better, cheaper = gains(mine, theirs)
            if better >= 0 and cheaper >= 0 and (better > 0 or cheaper > 0):
                beaten[row].append(other)
    return beaten


def shared_seed_gains(mine: Cell, theirs: Cell, key: str) -> tuple[float, float]:
    """How much better (metric) and cheaper (cost ratio ``key``) ``theirs`` is than ``mine``:
    the means of the per-seed differences over the seeds both completed, so that neither row
    gains or loses by a seed the other did not run. The metric's is the paired difference that
    `frontier_records` prints beside each dominance, computed alike. Rows that share no seed
    (or a cell that repeats one, which pairs none) are compared by their own means."""
    sign = metric_sign(mine.runs[0].metric)
    better = [sign * d for d in paired_differences(theirs.by_seed(METRIC), mine.by_seed(METRIC))]
    if not better:
        return (
            sign * (theirs.metric_mean - mine.metric_mean),
            mine.cost_mean(key) - theirs.cost_mean(key),
        )

    def costs(cell: Cell) -> dict[int, float]:
        return {seed: run.result.cost[key] for seed, run in cell.runs_by_seed.items()}

    cheaper = paired_differences(costs(mine), costs(theirs))
    return statistics.fmean(better), statistics.fmean(cheaper)


def frontier_records(table: Table) -> list[dict]:
    """Per column and cost ratio: the rows on the Pareto frontier of the column's metric (higher
    is better, lower for perplexity) against that ratio, each pair of rows compared by
    `shared_seed_gains`, and each dominated row with the rows that dominate it. Each dominance
    carries the paired difference (dominator minus dominated, seed by seed, at the table's level)
    and whether it ``holds``: that interval lies on the better side of 0. Otherwise it is
    unresolved at the seeds there are. Rows with no completed run are left out."""
    records = []
    for column in table.columns:
        cells = {row: cell for row in table.rows if (cell := table.cell(row, column))}
        done = {row: cell for row, cell in cells.items() if cell.completed}
        for key, name in COSTS:
            beaten = dominators(done, functools.partial(shared_seed_gains, key=key))
            dominated = []
            for row in done:
                if not beaten[row]:
                    continue
                by = []
                for other in beaten[row]:
                    diff = table.difference(other, row, column, METRIC)
                    # the interval lies on the dominator's better side of 0
                    holds = bool(
                        diff
                        and diff.low is not None
                        and (diff.low > 0 if metric_sign(column.metric) > 0 else diff.high < 0)
                    )
                    difference = diff.as_dict() if diff else None
                    by.append({"row": other, "difference": difference, "holds": holds})
                dominated.append({"row": row, "by": by})
            records.append(
                {
                    "column": column.label,
                    "metric": column.metric,
                    "cost": name,
                    "level": table.level,
                    "on_frontier": [row for row in done if not beaten[row]],
                    "dominated": dominated,
                }
            )
    return records


def frontier_lines(table: Table) -> list[str]:
    """`frontier_records` as lines: per column and cost ratio, the rows on the frontier, each
    dominated row with its dominators and, for each, the paired difference in the metric and
    whether the dominance holds at the table's level or is unresolved at this n."""
    lines = []
    for record in frontier_records(table):
        digits = metric_decimals(record["metric"])
        label = f"{record['column']} {metric_label(record['metric'])} against {record['cost']}"
        line = f"{label}: on the frontier {', '.join(record['on_frontier']) or '-'}"
        off = []
        for dominated in record["dominated"]:
            parts = []
            for by in dominated["by"]:
                diff = by["difference"]
                if diff is None:
                    parts.append(f"{by['row']} (no shared seed)")
                    continue
                text = interval_text(Interval(**diff), digits, signed=True, with_n=False)
                verdict = "holds" if by["holds"] else "unresolved"
                parts.append(f"{by['row']} ({text}, {verdict} at n={diff['n']})")
            off.append(f"{dominated['row']} by {', '.join(parts)}")
        lines.append(line + (f"; dominated: {'; '.join(off)}" if off else ""))
    return lines
