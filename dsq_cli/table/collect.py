"""Finding the result.json files under the given paths and reading them into a `Table`: rows by
preset in the suite's order, a row per budget, columns by task, model and metric."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path

from dsq.presets import preset_differences
from dsq_cli.presets import PRESET_ORDER
from dsq_cli.run_config import EVAL_CHECKPOINTS
from dsq_cli.run_result import RunResult

from .cells import ADJUSTMENTS, ENDPOINTS, METRIC, Cell, Column, Run, Table


def find_result_files(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """Every result.json under ``paths`` (run directories, roots searched recursively, or
    result.json files). A directory holding a result.json is a run and is not searched further,
    which keeps the walk out of its checkpoints and wandb files."""
    found: dict[Path, None] = {}  # ordered and without duplicates
    paths = [Path(p) for p in paths]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise ValueError(f"no such file or directory: {', '.join(missing)}")
    for path in paths:
        if path.is_file():
            if path.name != "result.json":
                raise ValueError(f"{path} is not a result.json or a directory of runs")
            found[path.resolve()] = None
            continue
        for dirpath, dirnames, filenames in os.walk(path):
            if "result.json" in filenames:
                found[(Path(dirpath) / "result.json").resolve()] = None
                dirnames.clear()
            else:
                dirnames.sort()
    if not found:
        raise ValueError(f"no runs (result.json) under {', '.join(str(p) for p in paths)}")
    return sorted(found)


def read_runs(
    paths: Iterable[str | os.PathLike], checkpoint: str | None = None
) -> tuple[list[Run], list[str]]:
    """The readable runs under ``paths`` and a warning for each result.json skipped. With
    ``checkpoint`` (best | last) each run's metric is that model's (`RunResult.value_of`)
    instead of its own headline; a completed run that did not score it is skipped."""
    if checkpoint is not None and checkpoint not in EVAL_CHECKPOINTS:
        raise ValueError(
            f"--checkpoint must be {' or '.join(EVAL_CHECKPOINTS)}, got {checkpoint!r}"
        )
    warnings: list[str] = []
    found: list[Run] = []
    files = find_result_files(paths)
    for path in files:
        try:
            result = RunResult.read(path)
        except ValueError as err:
            warnings.append(f"skipped {path}: {err}")
            continue
        if checkpoint is not None:
            value = result.value_of(checkpoint)
            if result.completed and value is None:
                warnings.append(f"skipped {path}: it records no score of its {checkpoint} model")
                continue
            result = replace(result, value=value)
        found.append(
            Run(
                path=path,
                result=result,
                row=row_name(result.quant)
                + (" (checkpointed)" if RunResult.checkpointed(path.parent) else ""),
                task=result.task,
                model=result.model,
                metric=result.metric,
            )
        )
    if not found:
        raise ValueError(
            f"no readable result.json among the {len(files)} found "
            f"({len(warnings)} skipped: {warnings[0] if warnings else ''})"
        )
    return found, warnings


def row_name(quant: Mapping) -> str:
    """The preset, or ``preset* (q1=bfp3)`` for a run whose points were overridden, so that it
    is never averaged into the preset's own row."""
    preset = str(quant["preset"])
    if not quant["modified"]:  # RunResult reads it, through dsq.presets.record_quant
        return preset
    differences = preset_differences(quant)
    return f"{preset}* ({', '.join(differences)})" if differences else f"{preset}*"


def row_preset(row: str) -> str:
    """The preset a row belongs to: ``dsq`` for ``dsq* (q1=bfp3)`` and ``dsq (validate_every=40)``;
    a row other than its preset is a variant of it."""
    return row.split("*", 1)[0].split(" (", 1)[0]


def _row_order(row: str) -> tuple:
    preset = row_preset(row)
    known = preset in PRESET_ORDER
    rank = PRESET_ORDER.index(preset) if known else len(PRESET_ORDER)
    return (rank, preset, row != preset, row)


def budget_recipe(budget: Mapping | None) -> dict:
    """What of result.json's ``budget`` is the recipe a run followed: all but ``stopped_early``,
    which is where a run of the recipe happened to end (splitting seeds by it would keep the
    seeds that stalled apart from those that did not); ``stop_patience`` 0 is what a budget
    without the key meant, so it is left out."""
    recipe = {k: v for k, v in (budget or {}).items() if k != "stopped_early"}
    if not recipe.get("stop_patience"):
        recipe.pop("stop_patience", None)
    return recipe


def budget_rows(found: list[Run]) -> list[Run]:
    """The runs, each one trained on another budget (result.json's ``budget``: updates,
    validation interval, warm-up, stop_patience; `budget_recipe`) than most runs of its column
    moved to a row of its own, named after what differs: ``dsq (validate_every=40)``,
    ``dsq (stop_patience=4)``. The budget is part of the recipe (a scheduled stash moves only at
    validations; a run that may stop early is not a run of the full cap), so such runs are never
    averaged with the others. When no budget has more runs than every other, each run is named
    after the budget keys that vary in its column. Runs without a budget (running, failed before
    training began, or written before result.json had one) stay in their quant's row."""
    by_column: dict[tuple, dict[str, int]] = {}
    for run in found:
        if run.result.budget:
            key = json.dumps(budget_recipe(run.result.budget), sort_keys=True)
            counts = by_column.setdefault(_column_key(run), {})
            counts[key] = counts.get(key, 0) + 1
    out = []
    for run in found:
        budget = budget_recipe(run.result.budget)
        counts = by_column.get(_column_key(run), {})
        if not budget or len(counts) < 2:
            out.append(run)
            continue
        budgets = [json.loads(k) for k in counts]
        ranked = sorted(counts.values(), reverse=True)
        if ranked[0] > ranked[1]:  # one budget has the most runs: name the others after it
            usual = json.loads(max(counts, key=counts.get))
            keys = [k for k in sorted(set(budget) | set(usual)) if budget.get(k) != usual.get(k)]
        else:  # no majority: every run is named after what varies in its column
            keys = [k for k in sorted({k for b in budgets for k in b})
                    if len({json.dumps(b.get(k)) for b in budgets}) > 1]  # fmt: skip
        if keys:
            named = ", ".join(f"{k}={budget.get(k, '-')}" for k in keys)
            run = replace(run, row=f"{run.row} ({named})")
        out.append(run)
    return out


def _column_key(run: Run) -> tuple:
    return (run.task, run.model, run.metric)


def build_table(found: list[Run], warnings: list[str] | None = None) -> Table:
    """Group runs, each already named after its row (`budget_rows`), into rows and columns
    (task; model and metric too where a task has runs of several)."""
    models: dict[str, set] = {}
    metrics: dict[str, set] = {}
    for run in found:
        models.setdefault(run.task, set()).add(run.model)
        metrics.setdefault(run.task, set()).add(run.metric)
    columns: dict[tuple, Column] = {}
    cells: dict[tuple[str, str], Cell] = {}
    row_quant: dict[str, dict] = {}
    for run in found:
        key = _column_key(run)
        if key not in columns:
            extra = []
            if len(models[run.task]) > 1:
                extra.append(str(run.model))
            if len(metrics[run.task]) > 1:
                extra.append(run.metric)
            label = f"{run.task} ({', '.join(extra)})" if extra else run.task
            columns[key] = Column(key, label)
        cells.setdefault((run.row, columns[key].label), Cell()).runs.append(run)
        row_quant.setdefault(run.row, dict(run.result.quant))
    warnings = list(warnings or [])
    for (row, label), cell in cells.items():
        cell.runs.sort(key=lambda r: (r.result.seed is None, r.result.seed, r.path))
        seeds = [r.result.seed for r in cell.completed]
        if len(set(seeds)) != len(seeds):
            warnings.append(
                f"{row}, {label}: several completed runs share a seed; its runs are not paired "
                "with other rows'"
            )
    baselines = sorted({str(r.result.cost["baseline"]) for r in found})
    if len(baselines) > 1:
        warnings.append(
            f"cost ratios are against different baselines ({', '.join(baselines)}); "
            "they are not comparable across rows"
        )
    return Table(
        rows=sorted(row_quant, key=_row_order),
        columns=sorted(columns.values(), key=lambda c: c.label),
        cells=cells,
        row_quant=row_quant,
        baselines=baselines,
        warnings=warnings,
    )


def split_rows(text: str) -> list[str]:
    """``--rows``' row names: split at each comma not followed by a space, since one followed by
    a space belongs to a row's name (``dsq* (q1=bfp3, q3=bfp8)``, ``dsq (updates=640,
    validate_every=40)``)."""
    return [row.strip() for row in re.split(r",(?! )", text) if row.strip()]


def split_margins(text: str) -> tuple[float, float]:
    """``--margin``'s two margins, the metric's and the compared loss's (``0.5,0.02``)."""
    try:
        return tuple(float(m) for m in text.split(","))  # type: ignore[return-value]
    except ValueError:
        raise ValueError(
            "--margin is two finite positive numbers, the metric's and the best validation "
            f"loss's, e.g. --margin 0.5,0.02; got {text!r}"
        ) from None


def collect(
    paths: Iterable[str | os.PathLike],
    checkpoint: str | None = None,
    *,
    level: float = 0.95,
    against: str | None = None,
    rows: Iterable[str] | None = None,
    margins: tuple[float, float] | None = None,
    endpoint: str = "best-loss",
    adjust: str = "none",
) -> Table:
    """The table of the runs under ``paths``; ``level``: of its intervals; ``against``: a row
    the others are compared with seed by seed (`Table.difference`); ``rows``: only these rows
    (and ``against``), in the table's order, so that the frontier is the one among them;
    ``margins``: the equivalence margins in the metric and in best validation loss
    (`Table.equivalent`)."""
    if not 0 < level < 1:
        raise ValueError(f"--level is a confidence level between 0 and 1, got {level}")
    if endpoint not in ENDPOINTS:
        raise ValueError(f"--endpoint {endpoint!r}: choose one of {list(ENDPOINTS)}")
    if adjust not in ADJUSTMENTS:
        raise ValueError(f"--adjust {adjust!r}: choose one of {list(ADJUSTMENTS)}")
    if adjust != "none" and against is None and endpoint != "post-move":
        raise ValueError(
            "--adjust adjusts the p-values of comparisons: give --against ROW or "
            "--endpoint post-move"
        )
    if margins is not None:
        if against is None:
            raise ValueError("--margin tests equivalence to a row: give --against ROW with it")
        if len(margins) != 2 or not all(math.isfinite(m) and m > 0 for m in margins):
            raise ValueError(
                "--margin is two finite positive numbers, the metric's and the best "
                "validation loss's, e.g. --margin 0.5,0.02"
            )
    found, read_warnings = read_runs(paths, checkpoint)
    # rows are named among all the runs found (a budget row is named against its column's
    # usual budget), then --rows keeps some: the table, its warnings and baselines, of those
    found = budget_rows(found)
    table = build_table(found, read_warnings)
    for flag, names in (("--against", [against] if against else []), ("--rows", rows or [])):
        unknown = list(dict.fromkeys(row for row in names if row not in table.rows))
        if unknown:
            hint = ""
            if any(", " in row for row in unknown):
                hint = " (a comma followed by a space is read as part of a row's name)"
            raise ValueError(
                f"{flag} {', '.join(map(repr, unknown))} "
                f"{'is no row' if len(unknown) == 1 else 'are no rows'} of this table{hint}; "
                "its rows: " + ", ".join(table.rows)
            )
    if rows is not None:
        kept = {*rows, *([against] if against else [])}
        table = build_table([run for run in found if run.row in kept], read_warnings)
    if margins is not None and len({c.metric for c in table.columns}) > 1:
        raise ValueError(
            "--margin is in one metric's units, and this table has several ("
            + ", ".join(sorted({c.metric for c in table.columns}))
            + "); keep one with --rows or paths of one task"
        )
    loss = ENDPOINTS[endpoint]
    measure_margins = dict(zip((METRIC, loss), margins)) if margins is not None else None
    return replace(table, level=level, against=against, margins=measure_margins, loss=loss,
                   adjust=adjust, post_move=endpoint == "post-move")  # fmt: skip
