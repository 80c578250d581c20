"""``dsq table``: the paper's Table 1 from the result.json files of run directories
(docs/table.md).

Rows are quant presets in the suite's order (a run whose quant points differ from its preset
gets a row of its own right after it); columns are tasks, each with the metric, the arithmetic
and DRAM cost ratios and the mean stash bits. Only result.json is read, so the table works
without wandb and on runs copied from elsewhere.

One entry point: a `TableRequest` (the runs, the rows, the endpoint, the row compared against,
the margins, the checkpoint, the output format and the lists after the table) goes in,
`make_table` returns the `Table` and its text. The modules, each importing only those above it
in this list:

* ``intervals``: the statistics over seeds (intervals, paired differences, p-values, Holm);
* ``cells``: the table as data (`Run`, `Cell`, `Column`, `Table`);
* ``collect``: finding and reading result.json files into a `Table`;
* ``text``: numbers, intervals and legends as text;
* ``comparisons``: the paired differences from the ``--against`` row;
* ``post_move``: rising stashes against their static controls after their first move;
* ``records``: the table's cells as records (CSV, JSON, wandb);
* ``moves``: each run's schedule in words (``--moves``, ``--runs``);
* ``frontier``: the trade-off frontier (``--frontier``);
* ``render``: the four formats;
* ``wandb_log``: the table as a wandb run.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

from .cells import (
    ADJUSTMENTS,
    ENDPOINTS,
    LAST_LOSS,
    LOSS,
    METRIC,
    METRIC_LABELS,
    PAPER_REFERENCE,
    Cell,
    Column,
    Run,
    Table,
)
from .collect import (
    collect,
    find_result_files,
    read_runs,
    row_name,
    row_preset,
    split_margins,
    split_rows,
)
from .frontier import (
    FRONTIER_HEADING,
    dominators,
    frontier_lines,
    frontier_records,
    shared_seed_gains,
)
from .moves import RUNS_HEADING, periodic_span, point_stretches, run_grid, stash_moves
from .post_move import post_move_differences, post_move_records, static_controls
from .records import CSV_COLUMNS, as_json, cell_records
from .render import FORMATS, render
from .text import markdown_grid
from .wandb_log import log_to_wandb

__all__ = [
    "ADJUSTMENTS", "CSV_COLUMNS", "ENDPOINTS", "FORMATS", "FRONTIER_HEADING", "LAST_LOSS",
    "LOSS", "METRIC", "METRIC_LABELS", "PAPER_REFERENCE", "RUNS_HEADING", "Cell", "Column", "Run",
    "Table", "TableOutput", "TableRequest", "as_json", "cell_records", "collect", "dominators",
    "find_result_files", "frontier_lines", "frontier_records", "log_to_wandb", "make_table",
    "markdown_grid", "periodic_span", "point_stretches", "post_move_differences",
    "post_move_records", "read_runs", "render", "row_name", "row_preset", "run_grid",
    "shared_seed_gains", "split_margins", "split_rows", "stash_moves", "static_controls",
]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class TableRequest:
    """What ``dsq table`` is asked for: its options, as `collect` and the renderers take them.
    ``margins``: the metric's and the compared loss's; ``moves``, ``frontier`` and
    ``every_run`` add their lists after the table (markdown; the first two also json)."""

    paths: Sequence[str] = ("runs",)
    checkpoint: str | None = None
    fmt: str = "markdown"
    level: float = 0.95
    against: str | None = None
    rows: Sequence[str] | None = None
    margins: tuple[float, float] | None = None
    endpoint: str = "best-loss"
    adjust: str = "none"
    moves: bool = False
    frontier: bool = False
    every_run: bool = False

    def __post_init__(self):
        """The combinations no format can show, refused before any run is read."""
        if self.fmt not in FORMATS:
            raise ValueError(f"--format must be one of {', '.join(FORMATS)}, got {self.fmt!r}")
        if self.every_run and self.fmt != "markdown":
            raise ValueError(
                f"--runs adds a list to markdown; json carries each run under cells, and "
                f"{self.fmt} has no place for it: drop --runs or use --format markdown"
            )
        for flag, given in (("--moves", self.moves), ("--frontier", self.frontier)):
            if given and self.fmt not in ("markdown", "json"):
                raise ValueError(
                    f"{flag} adds a list to markdown or json; drop it or use --format markdown "
                    f"or json, not {self.fmt}"
                )
        if self.rows is not None and not self.rows:
            raise ValueError("--rows names no row; give them comma-separated, e.g. --rows fp32,dsq")


@dataclasses.dataclass(frozen=True)
class TableOutput:
    table: Table
    text: str  # in the request's format, with the lists it asked for


def make_table(request: TableRequest) -> TableOutput:
    """The table of ``request`` and its text."""
    table = collect(
        request.paths, request.checkpoint, level=request.level, against=request.against,
        rows=request.rows, margins=request.margins, endpoint=request.endpoint,
        adjust=request.adjust,
    )  # fmt: skip
    if request.fmt == "json":
        record = as_json(table)
        if request.moves:
            record["moves"] = stash_moves(table)
        if request.frontier:
            record["frontier"] = frontier_records(table)
        return TableOutput(table, json.dumps(record, indent=2) + "\n")
    text = render(table, request.fmt)
    if request.moves:
        lines = stash_moves(table) or ["(no run of a scheduled row)"]
        text += "\nStash moves (scheduled points, per run):\n\n" + "".join(
            f"- {m}\n" for m in lines
        )
    if request.frontier:
        lines = frontier_lines(table)
        text += f"\n{FRONTIER_HEADING}\n\n" + "".join(f"- {m}\n" for m in lines)
    if request.every_run:
        header, rows = run_grid(table)
        text += f"\n{RUNS_HEADING}\n\n" + "".join(
            f"{line}\n" for line in markdown_grid(header, rows)
        )
    return TableOutput(table, text)
