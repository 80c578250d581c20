"""The table's cells as records: the CSV's rows, the JSON document and what wandb logs."""

from __future__ import annotations

from .cells import METRIC, PAPER_REFERENCE, Cell, Column, Table
from .intervals import (
    Interval,
)
from .post_move import post_move_records
from .text import legend_lines

CSV_COLUMNS = (
    "kind",
    "row",
    "preset",
    "modified",
    "task",
    "model",
    "metric",
    "n",
    "metric_mean",
    "metric_std",
    "level",
    "metric_low",
    "metric_high",
    "loss_n",
    "loss_mean",
    "loss_low",
    "loss_high",
    "against",
    "diff_n",
    "diff_mean",
    "diff_low",
    "diff_high",
    "loss_diff_n",
    "loss_diff_mean",
    "loss_diff_low",
    "loss_diff_high",
    "margin",
    "diff_equivalent",
    "loss_margin",
    "loss_diff_equivalent",
    "diff_equivalence_p",
    "loss_diff_equivalence_p",
    "arith_ratio",
    "dram_ratio",
    "arith_reduction",
    "dram_reduction",
    "stash_bits_mean",
    "baseline",
    "status",
    "note",
)


def _interval_fields(interval: Interval | None) -> dict:
    if interval is None:
        return {"n": 0, "mean": None, "low": None, "high": None}
    return {"n": interval.n, "mean": interval.mean, "low": interval.low, "high": interval.high}


def measure_records(table: Table, row: str, column: Column, cell: Cell) -> dict:
    """Per measure (the column's metric by its name, and ``best_valid_loss``): the mean, n, sd,
    interval and, with ``against``, the paired difference with its interval."""
    records = {}
    for measure in table.measures:
        interval = cell.interval(measure, table.level)
        record = interval.as_dict() if interval else {**_interval_fields(None), "sd": None}
        record["level"] = table.level
        if table.against is not None:
            diff = None
            if row != table.against:
                diff = table.difference(row, table.against, column, measure)
            p, adjusted = table.p_values(column, measure).get(row, (None, None))
            record["difference"] = {
                "against": table.against,
                "level": table.level,
                **(diff.as_dict() if diff else {**_interval_fields(None), "sd": None}),
                "p": p,
                "p_adjusted": adjusted if table.adjust != "none" else None,
            }
            if table.margins:
                record["difference"]["margin"] = table.margins[measure]
                record["difference"]["equivalent"] = table.equivalent(row, column, measure)
                tost, tost_adjusted = table.equivalence_p_values(column, measure).get(
                    row, (None, None)
                )
                record["difference"]["equivalence_p"] = tost
                record["difference"]["equivalence_p_adjusted"] = (
                    tost_adjusted if table.adjust != "none" else None
                )
        records[column.metric if measure == METRIC else table.loss] = record
    return records


def _cell_record(table: Table, row: str, column: Column, cell: Cell) -> dict:
    """The numbers of one cell, unrounded: a single completed run's are its result.json's."""
    quant = table.row_quant[row]
    completed = bool(cell.completed)
    arith = cell.cost_mean("arith_ratio")
    dram = cell.cost_mean("dram_ratio")
    metric = cell.interval(METRIC, table.level) if completed else None
    loss = cell.interval(table.loss, table.level) if completed else None
    record = {
        "row": row,
        "preset": quant["preset"],
        "modified": bool(quant.get("modified", "*" in row)),  # a budget row is not modified
        "task": column.task,
        "model": column.model,
        "metric": column.metric,
        "n": len(cell.completed),
        "metric_mean": cell.metric_mean,
        "metric_std": cell.metric_std,
        "level": table.level,
        "metric_low": metric.low if metric else None,
        "metric_high": metric.high if metric else None,
        "loss_n": loss.n if loss else 0,
        "loss_mean": loss.mean if loss else None,
        "loss_low": loss.low if loss else None,
        "loss_high": loss.high if loss else None,
        "against": table.against,
    }
    for prefix, measure in (("diff", METRIC), ("loss_diff", table.loss)):
        diff = None
        if table.against is not None and row != table.against:
            diff = table.difference(row, table.against, column, measure)
        for key, value in _interval_fields(diff).items():
            record[f"{prefix}_{key}"] = value
        record[f"{prefix}_equivalent"] = table.equivalent(row, column, measure)
        tost = table.equivalence_p_values(column, measure).get(row, (None, None))[0]
        record[f"{prefix}_equivalence_p"] = tost
    record["margin"] = table.margins[METRIC] if table.margins else None
    record["loss_margin"] = table.margins[table.loss] if table.margins else None
    record.update(
        {
            "arith_ratio": arith,
            "dram_ratio": dram,
            "arith_reduction": 1 / arith if arith else None,
            "dram_reduction": 1 / dram if dram else None,
            "stash_bits_mean": cell.stash_bits_mean,
            "baseline": "/".join(sorted({str(r.result.cost["baseline"]) for r in cell.runs})),
            "status": "completed" if completed else cell.note,
            "note": cell.note if completed else "",
        }
    )
    return record


def filled_cells(table: Table):
    """(row, column, cell) for each cell that has runs, in table order."""
    for row in table.rows:
        for column in table.columns:
            cell = table.cell(row, column)
            if cell is not None:
                yield row, column, cell


def cell_records(table: Table) -> list[dict]:
    """One record per (row, column) that has runs, in table order."""
    return [_cell_record(table, row, column, cell) for row, column, cell in filled_cells(table)]


def reference_records(table: Table) -> list[dict]:
    paper = PAPER_REFERENCE
    records = [
        {
            "kind": "reference",
            "row": f"paper: {paper['row']} vs {paper['baseline']}",
            "task": paper["task"],
            "arith_reduction": paper["arith_reduction"],
            "dram_reduction": paper["dram_reduction"],
            "baseline": paper["baseline"],
            "note": paper["source"],
        }
    ]
    for ours in table.rebased():
        records.append(
            {
                "kind": "reference",
                "row": f"ours: {ours['row']} vs {ours['baseline']}",
                "task": ours["task"],
                "arith_reduction": ours["arith_reduction"],
                "dram_reduction": ours["dram_reduction"],
                "baseline": ours["baseline"],
                "note": f"column {ours['column']}",
            }
        )
    return records


def as_json(table: Table) -> dict:
    cells: dict[str, dict] = {}
    for row, column, cell in filled_cells(table):
        record = _cell_record(table, row, column, cell)
        record["measures"] = measure_records(table, row, column, cell)
        record["runs"] = [
            {
                "result": str(run.path),
                "seed": run.result.seed,
                "status": run.status,
                "value": run.result.value,
                "best_valid_loss": run.result.best_valid_loss,
                "last_valid_loss": run.result.valid_loss_of("last"),
                "arith_ratio": run.result.cost["arith_ratio"],
                "dram_ratio": run.result.cost["dram_ratio"],
                "stash_bits_mean": run.result.stash_bits_mean,
                "updates": run.result.updates,
                "wall_seconds": run.result.wall_seconds,
            }
            for run in cell.runs
        ]
        cells.setdefault(row, {})[column.label] = record
    return {
        "rows": [
            {"name": row, "preset": table.row_quant[row]["preset"], "quant": table.row_quant[row]}
            for row in table.rows
        ],
        "tasks": [
            {"column": c.label, "task": c.task, "model": c.model, "metric": c.metric}
            for c in table.columns
        ],
        "level": table.level,
        "against": table.against,
        # the metric's margin is in each column's metric (BLEU points, a GLUE fraction)
        "endpoint": table.loss,
        "adjust": table.adjust,
        "margins": {"metric": table.margins[METRIC], table.loss: table.margins[table.loss]}
        if table.margins
        else None,
        "cells": cells,
        # --endpoint post-move: each rising row minus each static control, as markdown's block
        "post_move": [_post_move_record(r, table.level) for r in post_move_records(table)]
        if table.post_move
        else None,
        "baselines": table.baselines,
        "reference": {"paper": dict(PAPER_REFERENCE), "ours": table.rebased()},
        "legend": legend_lines(table),
        "warnings": table.warnings,
    }


def _post_move_record(record: dict, level: float) -> dict:
    """One pair of the post-move block, its interval's keys present whether or not a pair moved
    (as a measure's record has them)."""
    interval = record["interval"]
    fields = interval.as_dict() if interval else {**_interval_fields(None), "sd": None,
                                                  "level": level}  # fmt: skip
    return {"row": record["row"], "control": record["control"], "column": record["column"],
            **fields, **{key: record[key] for key in ("p", "p_adjusted", "margin", "equivalent",
                         "equivalence_p", "equivalence_p_adjusted", "unmoved")}}  # fmt: skip
