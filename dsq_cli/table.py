"""``dsq table``: Table 1 (docs/spec.md §6) from the result.json files of run directories
(docs/spec.md §5).

Rows are quant presets in docs/spec.md §6 order (a run whose quant points differ from its preset
gets a row of its own right after it); columns are tasks, each with the metric, the arithmetic and
DRAM cost ratios and the mean stash bits. Only result.json is read, so the table works without wandb
and on runs copied from elsewhere. docs/table.md describes the conventions.
"""

from __future__ import annotations

import csv
import functools
import io
import json
import math
import os
import re
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dsq.engine.config import POINTS
from dsq.engine.spec import saved_rules
from dsq.presets import preset_differences
from dsq_cli.intervals import (
    Interval,
    equivalence_p,
    holm,
    mean_interval,
    p_value,
    paired_differences,
    paired_interval,
)
from dsq_cli.presets import BASELINE_PRESET, PRESET_ORDER
from dsq_cli.run_config import EVAL_CHECKPOINTS
from dsq_cli.run_result import RunResult, metric_decimals, metric_sign

FORMATS = ("markdown", "csv", "latex", "json")
METRIC_LABELS = {
    "bleu": "BLEU",
    "accuracy": "Acc",
    "mcc": "MCC",
    "f1": "F1",
    "pearson": "Pearson",
    "spearman": "Spearman",
}
# The paper's headline (abstract, IWSLT17): DSQ against 16-bit fixed point at every point. Its
# body's Table 1 normalizes to fixed32 instead, as this table does (docs/spec.md §4).
PAPER_REFERENCE = {
    "source": "Yang et al., EMNLP Findings 2023, abstract",
    "task": "iwslt17",
    "row": "dsq",
    "baseline": "fixed16",
    "arith_reduction": 20.95,
    "dram_reduction": 2.55,
}
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


@dataclass(frozen=True)
class Run:
    """One readable result.json and the row and column it belongs to."""

    path: Path  # the result.json
    result: RunResult
    row: str
    task: str
    model: str | None
    metric: str

    @property
    def status(self) -> str:
        return self.result.status


# What a table compares rows by: the column's metric (result.json's ``value``; higher is better
# but for perplexity, `metric_sign`)
# and the best validation loss (lower is better). Intervals and paired differences are given for
# both (docs/table.md, "Intervals").
METRIC, LOSS, LAST_LOSS = "metric", "best_valid_loss", "last_valid_loss"
# the loss a table compares rows by (`--endpoint`): the best validation loss over the run, or
# the last model's, whose paired spread is smaller (docs/table.md, "Endpoints")
ENDPOINTS = {"best-loss": LOSS, "last-loss": LAST_LOSS, "post-move": LOSS}
LOSS_LABELS = {LOSS: "best valid loss", LAST_LOSS: "last-model valid loss"}
# how the p-values of one block of comparisons are adjusted for their number (`--adjust`)
ADJUSTMENTS = ("none", "holm")


def measure_of(run: Run, measure: str) -> float | None:
    if measure == METRIC:
        return run.result.value
    if measure == LAST_LOSS:
        return run.result.valid_loss_of("last")
    return run.result.best_valid_loss


@dataclass
class Cell:
    """The runs of one (row, column): numbers from the completed ones, the others counted."""

    runs: list[Run] = field(default_factory=list)

    @property
    def completed(self) -> list[Run]:
        return [r for r in self.runs if r.status == "completed"]

    @property
    def other_statuses(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for run in self.runs:
            if run.status != "completed":
                counts[run.status] = counts.get(run.status, 0) + 1
        return dict(sorted(counts.items()))

    def _mean(self, values: list[float]) -> float | None:
        return statistics.fmean(values) if values else None

    @property
    def metric_values(self) -> list[float]:
        return [r.result.value for r in self.completed]

    @property
    def metric_mean(self) -> float | None:
        return self._mean(self.metric_values)

    @property
    def metric_std(self) -> float | None:
        values = self.metric_values
        return statistics.stdev(values) if len(values) > 1 else None

    @property
    def runs_by_seed(self) -> dict[int, Run]:
        """The completed runs by seed, which pair with another row's runs of the same seed. Runs
        without a seed are left out; a cell with two runs of one seed pairs none (`Table.warnings`
        names it)."""
        seeds = [r.result.seed for r in self.completed]
        if len(set(seeds)) != len(seeds):
            return {}
        return {r.result.seed: r for r in self.completed if r.result.seed is not None}

    def by_seed(self, measure: str) -> dict[int, float]:
        """A measure (`Table.measures`) of each run of `runs_by_seed`, by seed: what
        `paired_interval` pairs. Runs that record no such measure are left out."""
        return {
            seed: value
            for seed, run in self.runs_by_seed.items()
            if (value := measure_of(run, measure)) is not None
        }

    def interval(self, measure: str, level: float) -> Interval | None:
        """The Student t interval of a measure's mean over the completed runs (None: no run
        records it)."""
        values = [v for r in self.completed if (v := measure_of(r, measure)) is not None]
        return mean_interval(values, level) if values else None

    def cost_mean(self, key: str) -> float | None:
        """Cost ratios are equal across seeds of a static preset; a scheduled preset's differ
        with the schedule each seed followed, so the cell holds their mean."""
        return self._mean([r.result.cost[key] for r in self.completed])

    @property
    def stash_bits_mean(self) -> float | None:
        return self._mean([r.result.stash_bits_mean for r in self.completed])

    @property
    def note(self) -> str:
        """What did not complete: ``+1 diverged`` beside numbers, ``diverged`` instead of them."""
        others = self.other_statuses
        if self.completed:
            return ", ".join(f"+{n} {status}" for status, n in others.items())
        return ", ".join(status if n == 1 else f"{n} {status}" for status, n in others.items())


@dataclass(frozen=True)
class Column:
    key: tuple[str, str | None, str]  # task, model, metric
    label: str

    @property
    def task(self) -> str:
        return self.key[0]

    @property
    def model(self) -> str | None:
        return self.key[1]

    @property
    def metric(self) -> str:
        return self.key[2]


@dataclass
class Table:
    rows: list[str]
    columns: list[Column]
    cells: dict[tuple[str, str], Cell]  # (row, column label) -> cell
    row_quant: dict[str, dict]  # row -> the quant mapping of its runs (preset, points, modified)
    baselines: list[str]
    warnings: list[str]
    level: float = 0.95  # of every interval the table shows
    against: str | None = None  # the row every other row's paired differences are from
    # measure -> the equivalence margin stated in advance (docs/table.md, "Intervals")
    margins: dict[str, float] | None = None
    loss: str = LOSS  # the loss measure rows are compared by (ENDPOINTS)
    adjust: str = "none"  # of the p-values of each block of comparisons (ADJUSTMENTS)
    post_move: bool = False  # also compare each rising row with its static controls after it moved

    @property
    def measures(self) -> tuple[str, str]:
        return (METRIC, self.loss)

    def p_values(self, column: Column, measure: str) -> dict[str, tuple[float | None, ...]]:
        """Each row's (p, adjusted p) of its paired difference from ``against`` in ``measure``:
        the block is one column's comparisons in one measure, adjusted as ``adjust`` says."""
        return self._block(column, measure, p_value)

    def equivalence_p_values(
        self, column: Column, measure: str
    ) -> dict[str, tuple[float | None, float | None]]:
        """Each row's (TOST p, adjusted TOST p) that its paired difference from ``against`` lies
        inside ± the margin, in the same block as ``p_values`` (empty without a margin)."""
        if self.against is None or not self.margins:
            return {}
        margin = self.margins[measure]
        return self._block(column, measure, lambda d: equivalence_p(d, margin))

    def _block(self, column: Column, measure: str, test) -> dict[str, tuple[float | None, ...]]:
        """``test`` of each row's paired difference from ``against``, raw and adjusted within
        the block."""
        rows = [row for row in self.rows if row != self.against]
        diffs = [self.difference(row, self.against, column, measure) for row in rows]
        raw = [test(d) if d else None for d in diffs]
        adjusted = holm(raw) if self.adjust == "holm" else raw
        return {row: (p, q) for row, p, q in zip(rows, raw, adjusted)}

    def cell(self, row: str, column: Column) -> Cell | None:
        return self.cells.get((row, column.label))

    def equivalent(self, row: str, column: Column, measure: str) -> bool | None:
        """Whether ``row``'s paired difference from ``against`` in ``measure`` has its interval
        inside ± the margin: two one-sided tests at (1 - level) / 2 each. None where there is
        no margin, no interval (under two pairs) or the row is ``against`` itself."""
        if self.against is None or not self.margins or row == self.against:
            return None
        diff = self.difference(row, self.against, column, measure)
        if diff is None or diff.low is None:
            return None
        return _inside(diff, self.margins[measure])

    def difference(self, row: str, other: str, column: Column, measure: str) -> Interval | None:
        """``row`` minus ``other`` in ``measure``, seed by seed, with its interval at the table's
        level: None where the two share no seed (or either has none completed)."""
        mine, theirs = self.cell(row, column), self.cell(other, column)
        if mine is None or theirs is None:
            return None
        return paired_interval(mine.by_seed(measure), theirs.by_seed(measure), self.level)

    def rebased(self) -> list[dict]:
        """Our dsq row against our fixed16 row, per task, in the paper's headline terms."""
        out = []
        for column in self.columns:
            dsq, fixed16 = self.cell("dsq", column), self.cell("fixed16", column)
            if not (dsq and fixed16 and dsq.completed and fixed16.completed):
                continue
            arith = fixed16.cost_mean("arith_ratio") / dsq.cost_mean("arith_ratio")
            dram = fixed16.cost_mean("dram_ratio") / dsq.cost_mean("dram_ratio")
            out.append(
                {
                    "task": column.task,
                    "column": column.label,
                    "row": "dsq",
                    "baseline": "fixed16",
                    "arith_reduction": arith,
                    "dram_reduction": dram,
                }
            )
        return out


# -- collecting -----------------------------------------------------------------------------


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
    modified = quant.get("modified")
    differences = preset_differences(quant)
    if modified is None:  # result.json written before the flag existed
        modified = differences is None or bool(differences)
    if not modified:
        return preset
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


# -- rendering ------------------------------------------------------------------------------


def _fmt_ratio(ratio: float) -> str:
    """``0.0519 (19.3x)``: the fraction of the baseline's cost and how many times fewer."""
    if ratio == 0:
        return "0"
    return f"{ratio:.3g} ({1 / ratio:.3g}x)"


def _decimals(metric: str, measure: str) -> int:
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
        _fmt_ratio(cell.cost_mean("arith_ratio")),
        _fmt_ratio(cell.cost_mean("dram_ratio")),
        f"{cell.stash_bits_mean:.3g}",
    ]


def _metric_label(metric: str) -> str:
    return METRIC_LABELS.get(metric, metric)


def _baseline_text(table: Table) -> str:
    return "/".join(table.baselines) or BASELINE_PRESET


def _level_text(level: float) -> str:
    return f"{level * 100:.4g}%"


def legend_lines(table: Table) -> list[str]:
    baseline = _baseline_text(table)
    paper = PAPER_REFERENCE
    lines = [
        f"arith, DRAM: cost per training step as a fraction of {baseline} at every point "
        f"(result.json's cost ratios, docs/spec.md §4), and in brackets how many times fewer; "
        "lower is cheaper.",
        f"metric: mean over completed seeds and, in brackets, the {_level_text(table.level)} "
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


def _md_escape(text: str) -> str:
    # Only the cell separator: a lone ``*`` (``dsq*``) cannot open emphasis, and ``_`` inside a
    # word (``stash_bfp``) is literal in GitHub markdown, so the raw text stays readable.
    return text.replace("|", "\\|")


def markdown_grid(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(_md_escape(h) for h in header) + " |",
        "|" + "---|" + "---:|" * (len(header) - 1),
        *("| " + " | ".join(_md_escape(t) for t in texts) + " |" for texts in rows),
    ]


def render_markdown(table: Table) -> str:
    header = ["quant"]
    for column in table.columns:
        header += [
            f"{column.label} {_metric_label(column.metric)}",
            "arith",
            "DRAM",
            "stash bits",
        ]
    rows = []
    for row in table.rows:
        texts = [row]
        for column in table.columns:
            texts += cell_texts(table.cell(row, column), table.level)
        rows.append(texts)
    lines = markdown_grid(header, rows)
    lines.append("")
    lines += [f"- {_md_escape(line)}" for line in legend_lines(table)]
    if table.against is not None:
        lines += ["", against_heading(table), ""]
        header, rows = against_grid(table)
        lines += markdown_grid(header, rows)
    if table.post_move:
        heading = POST_MOVE_HEADING + (POST_MOVE_MARGIN if table.margins else "")
        lines += ["", heading, ""]
        lines += [f"- {line}" for line in post_move_lines(table)] or [
            "- (no rising row with a static control)"
        ]
    return "\n".join(lines) + "\n"


# -- the post-move endpoint -------------------------------------------------------------------
POST_MOVE_HEADING = (
    "Post-move loss (each rising row minus each of its static controls, seed by seed: the "
    "lowest validation loss at the validations after the rising run's first stash move, over "
    "the same updates in both runs; mean, interval, n pairs, p of the paired t test; a lower "
    "loss is better; seeds whose rising run never moved are counted apart):"
)
POST_MOVE_MARGIN = (
    " Within the loss's margin: the interval inside ± it (two one-sided tests), with the TOST p,"
    " Holm-adjusted over this block where asked."
)


def _same_format(a, b) -> bool:
    from dsq.formats import parse_format

    try:
        return parse_format(str(a)).spec == parse_format(str(b)).spec
    except ValueError:
        return a == b


def static_controls(table: Table, row: str) -> list[str]:
    """The rows that hold ``row``'s points but its stash (q1, a ladder), which they keep at one
    of its levels for the whole run: its static controls (docs/results.md, "Protocol")."""
    quant = table.row_quant[row]
    ladder = quant.get("q1")
    if not (isinstance(ladder, Mapping) and "levels" in ladder):
        return []
    controls = []
    for other in table.rows:
        theirs = table.row_quant[other]
        level = theirs.get("q1")
        if other == row or isinstance(level, Mapping):
            continue
        if not any(_same_format(level, lv) for lv in ladder["levels"]):
            continue
        same = all(_same_format(theirs.get(p), quant.get(p)) for p in ("q0", "q2", "q3"))
        same &= theirs.get("stash_scope", "gemm") == quant.get("stash_scope", "gemm")
        same &= (theirs.get("rounding") or {}) == (quant.get("rounding") or {})
        same &= _saved_rules(theirs) == _saved_rules(quant)
        if same:
            controls.append(other)
    return controls


def _saved_rules(quant: Mapping) -> dict:
    """A record's ``quant.saved`` as the engine reads it: the defaults of the kinds it does not
    name (a record written before a kind existed held it so) and one spelling per format."""
    return dict(saved_rules(quant.get("saved"), quant.get("stash_scope", "gemm")))


def _valid_losses(run: Run) -> dict[int, float]:
    """The run's validation losses by update, from metrics.jsonl beside its result.json."""
    losses = {}
    path = run.path.with_name("metrics.jsonl")
    if path.exists():
        for line in path.read_text().splitlines():
            entry = json.loads(line) if line.strip() else {}
            if entry.get("kind") == "valid" and entry.get("valid_loss") is not None:
                losses[int(entry["update"])] = float(entry["valid_loss"])
    return losses


def first_move(run: Run) -> int | None:
    """The update after which the run's precision first moved (None: it never moved)."""
    segments = run.result.precision_segments or []
    return int(segments[0]["updates"]) if len(segments) > 1 else None


def post_move_differences(rising: Cell, control: Cell) -> tuple[dict[int, float], list[int]]:
    """(the rising row's post-move loss minus its control's, by seed; the seeds whose rising run
    never moved)."""
    theirs = control.runs_by_seed
    differences, unmoved = {}, []
    for seed, run in rising.runs_by_seed.items():
        if seed not in theirs:
            continue
        moved = first_move(run)
        if moved is None:
            unmoved.append(seed)
            continue
        mine, other = _valid_losses(run), _valid_losses(theirs[seed])
        updates = [u for u in mine if u > moved and u in other]
        if updates:
            differences[seed] = min(mine[u] for u in updates) - min(other[u] for u in updates)
    return differences, sorted(unmoved)


def post_move_records(table: Table) -> list[dict]:
    """Every (rising row, static control, column) pair: its paired interval, p and adjusted p
    (the block: all of them, adjusted as ``table.adjust`` says)."""
    records = []
    for row in table.rows:
        for control in static_controls(table, row):
            for column in table.columns:
                mine, theirs = table.cell(row, column), table.cell(control, column)
                if not (mine and theirs):
                    continue
                differences, unmoved = post_move_differences(mine, theirs)
                interval = (
                    mean_interval(list(differences.values()), table.level) if differences else None
                )
                records.append({"row": row, "control": control, "column": column.label,
                                "interval": interval, "unmoved": unmoved,
                                "p": p_value(interval) if interval else None})  # fmt: skip
    margin = table.margins[table.loss] if table.margins else None
    for record in records:
        interval = record["interval"]
        record["margin"] = margin
        record["equivalent"] = _inside(interval, margin)
        record["equivalence_p"] = (
            equivalence_p(interval, margin) if interval and margin is not None else None
        )
    for key in ("p", "equivalence_p"):
        raw = [r[key] for r in records]
        for record, adjusted in zip(records, holm(raw) if table.adjust == "holm" else raw):
            record[f"{key}_adjusted"] = adjusted
    return records


def _inside(interval: Interval | None, margin: float | None) -> bool | None:
    """Whether ``interval`` lies inside ± ``margin`` (None without either or below two pairs)."""
    if interval is None or interval.low is None or margin is None:
        return None
    return -margin < interval.low and interval.high < margin


def post_move_lines(table: Table) -> list[str]:
    lines = []
    for r in post_move_records(table):
        text = interval_text(r["interval"], 3, signed=True) if r["interval"] else "no pair moved"
        text += _p_text(r["p"], r["p_adjusted"], table.adjust)
        if r["margin"] is not None:
            text += f"; within ±{r['margin']:g}: " + _equivalence_text(
                r["equivalent"], r["equivalence_p"], r["equivalence_p_adjusted"], table.adjust
            )
        unmoved = ", ".join(map(str, r["unmoved"])) or "none"
        lines.append(f"{r['row']} - {r['control']}, {r['column']}: {text}; "
                     f"seeds without a move: {unmoved}")  # fmt: skip
    return lines


# -- paired differences -----------------------------------------------------------------------


def against_heading(table: Table) -> str:
    equivalence = ""
    if table.margins:
        equivalence = (
            "; equivalent: the interval lies inside ± the margin, i.e. two one-sided tests at "
            f"{_level_text((1 - table.level) / 2)} each, and not shown where it does not; TOST "
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
        f"seed; mean, {_level_text(table.level)} interval, n pairs, p of the paired t test that "
        f"the difference is 0; {_directions(table)}, a lower loss is better{equivalence}"
        f"{adjusted}):"
    )


def _directions(table: Table) -> str:
    """``a higher metric is better``, naming the metrics where lower is."""
    lower = sorted({_metric_label(c.metric) for c in table.columns if metric_sign(c.metric) < 0})
    if not lower:
        return "a higher metric is better"
    if all(metric_sign(c.metric) < 0 for c in table.columns):
        return f"a lower {' or '.join(lower)} is better"
    return f"a higher metric is better (a lower {' or '.join(lower)})"


def _equivalence_text(
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


def _p_text(p: float | None, adjusted: float | None, adjust: str) -> str:
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
        label = _metric_label(column.metric)
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
                digits = _decimals(column.metric, measure)
                p, adjusted = p_values[(column.label, measure)][row]
                texts.append(
                    interval_text(diff, digits, signed=True) + _p_text(p, adjusted, table.adjust)
                    if diff
                    else "-"
                )
            if table.margins:
                texts += [
                    _equivalence_text(
                        table.equivalent(row, column, m),
                        *equivalence_ps[(column.label, m)].get(row, (None, None)),
                        table.adjust,
                    )
                    for m in table.measures
                ]
        rows.append(texts)
    return header, rows


def _latex_escape(text: str) -> str:
    replacements = {
        "\\": r"\textbackslash{}",
        "&": r"\&",
        "%": r"\%",
        "$": r"\$",
        "#": r"\#",
        "_": r"\_",
        "{": r"\{",
        "}": r"\}",
        "~": r"\textasciitilde{}",
        "^": r"\textasciicircum{}",
        ">": r"$>$",
        "±": r"$\pm$",
    }
    return "".join(replacements.get(char, char) for char in text)


def render_latex(table: Table) -> str:
    """A booktabs tabular (``\\usepackage{booktabs}``), the legend as spanning footnote rows;
    with ``against``, a second tabular of the paired differences."""
    width = 1 + 4 * len(table.columns)
    lines = [
        r"\begin{tabular}{l" + "rrrr" * len(table.columns) + "}",
        r"\toprule",
        " & ".join(
            [""]
            + [
                rf"\multicolumn{{4}}{{c}}{{{_latex_escape(c.label)} "
                rf"({_latex_escape(_metric_label(c.metric))})}}"
                for c in table.columns
            ]
        )
        + r" \\",
        "".join(rf"\cmidrule(lr){{{2 + 4 * i}-{5 + 4 * i}}}" for i in range(len(table.columns))),
        " & ".join(
            ["quant"]
            + [_metric_label(c.metric) + " & arith & DRAM & stash bits" for c in table.columns]
        )
        + r" \\",
        r"\midrule",
    ]
    for row in table.rows:
        texts = [_latex_escape(row)]
        for column in table.columns:
            texts += [_latex_escape(t) for t in cell_texts(table.cell(row, column), table.level)]
        lines.append(" & ".join(texts) + r" \\")
    lines.append(r"\bottomrule")
    for line in legend_lines(table):
        lines.append(rf"\multicolumn{{{width}}}{{l}}{{\footnotesize {_latex_escape(line)}}} \\")
    lines.append(r"\end{tabular}")
    if table.against is not None:
        header, rows = against_grid(table)
        lines += [
            "",
            r"\begin{tabular}{l" + "r" * (len(header) - 1) + "}",
            r"\toprule",
            " & ".join(_latex_escape(h) for h in header) + r" \\",
            r"\midrule",
            *(" & ".join(_latex_escape(t) for t in texts) + r" \\" for texts in rows),
            r"\bottomrule",
            rf"\multicolumn{{{len(header)}}}{{l}}{{\footnotesize "
            rf"{_latex_escape(against_heading(table))}}} \\",
            r"\end{tabular}",
        ]
    return "\n".join(lines) + "\n"


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


def _filled_cells(table: Table):
    """(row, column, cell) for each cell that has runs, in table order."""
    for row in table.rows:
        for column in table.columns:
            cell = table.cell(row, column)
            if cell is not None:
                yield row, column, cell


def cell_records(table: Table) -> list[dict]:
    """One record per (row, column) that has runs, in table order."""
    return [_cell_record(table, row, column, cell) for row, column, cell in _filled_cells(table)]


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


def render_csv(table: Table) -> str:
    """Long form: one line per cell, then the reference lines (``kind`` tells them apart)."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for record in cell_records(table):
        writer.writerow({"kind": "result", **record})
    for record in reference_records(table):
        writer.writerow(record)
    return buffer.getvalue()


def as_json(table: Table) -> dict:
    cells: dict[str, dict] = {}
    for row, column, cell in _filled_cells(table):
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
        "baselines": table.baselines,
        "reference": {"paper": dict(PAPER_REFERENCE), "ours": table.rebased()},
        "legend": legend_lines(table),
        "warnings": table.warnings,
    }


def render_json(table: Table) -> str:
    return json.dumps(as_json(table), indent=2) + "\n"


RENDERERS = {
    "markdown": render_markdown,
    "csv": render_csv,
    "latex": render_latex,
    "json": render_json,
}


# -- schedules ------------------------------------------------------------------------------


def stash_moves(table: Table) -> list[str]:
    """One line per run of a row with a scheduled point (a ladder of levels, such as dsq's q1):
    the format in force over each stretch of updates (result.json's ``precision_segments``),
    where it moved, and the run's mean stash bits. A run that did not complete is named by its
    status first; one that recorded no update says so."""
    lines = []
    for row in table.rows:
        scheduled = [p for p in POINTS if isinstance(table.row_quant[row].get(p), Mapping)]
        if not scheduled:
            continue
        for column in table.columns:
            cell = table.cell(row, column)
            for run in cell.runs if cell else []:
                result = run.result
                seed = f"seed {result.seed}" if result.seed is not None else run.path.parent.name
                parts = [] if run.status == "completed" else [run.status]
                trained = sum(int(s["updates"]) for s in result.precision_segments or [])
                if trained:
                    parts += [_point_stretches(result.precision_segments, p) for p in scheduled]
                    bits = result.stash_bits_mean
                    parts.append(f"{bits:.3g} stash bits" if bits is not None else "stash bits -")
                else:
                    parts.append("no update recorded")
                lines.append(f"{row}, {column.label}, {seed}: " + "; ".join(parts))
    return lines


RUNS_HEADING = (
    "Every run (the stash's format, and where a schedule moved it: after which update, to "
    "what; the best validation loss and the update it came at; the metric of that best "
    "checkpoint and of the last model; cost ratios to the baseline, as above):"
)


def _moves_text(run: Run, row_quant: Mapping) -> str:
    """``bfp2e8b16, 800: bfp3e8b16, 960: bfp4e8b16`` for a scheduled stash (the format it
    started in, then each move: after which update, to what), ``cycles bfp2e8b16 .. bfp8e8b16
    every 35 updates`` for a periodic one, the stash's format for a static one. Other
    scheduled points are named before their own moves."""
    scheduled = [p for p in POINTS if isinstance(row_quant.get(p), Mapping)]
    segments = run.result.precision_segments or []
    if not any(int(s["updates"]) for s in segments):  # nothing trained, or not recorded
        stash = row_quant.get("q1")
        return stash if isinstance(stash, str) else "-"
    texts = []
    for point in scheduled or ["q1"]:
        stretches = point_stretches(segments, point)
        span = periodic_span(stretches)
        if span is not None and span[0] == 0 and span[1] == len(stretches):
            cycle, length = _cycle_phrase(stretches, span)
            text = f"{cycle} every {length} updates"
        else:
            moves = [f"{first - 1}: {fmt}" for fmt, first, _ in stretches[1:]]
            text = ", ".join([stretches[0][0], *moves])
        texts.append(text if point == "q1" else f"{point} {text}")
    return "; ".join(texts)


def _number(value: float | None, decimals: int) -> str:
    return "-" if value is None else f"{value:.{decimals}f}"


def run_grid(table: Table) -> tuple[list[str], list[list[str]]]:
    """One line per run, in the table's order of rows and then by seed: a header and the texts
    (`RUNS_HEADING`). A run that did not complete shows its status for its numbers."""
    header = ["row", "task", "seed", "stash (moves)", "best valid loss (update)"]
    metrics = {_metric_label(c.metric) for c in table.columns}
    label = metrics.pop() if len(metrics) == 1 else "metric"
    header += [f"{label}, best checkpoint", "last valid loss", f"{label}, last model"]
    header += ["arith", "DRAM"]
    rows = []
    for row, column, cell in _filled_cells(table):
        digits = metric_decimals(column.metric)
        for run in cell.runs:
            result = run.result
            seed = str(result.seed) if result.seed is not None else run.path.parent.name
            texts = [row, column.label, seed, _moves_text(run, table.row_quant[row])]
            if run.status != "completed":
                rows.append(texts + [run.status] + ["-"] * (len(header) - len(texts) - 1))
                continue
            entries = result.evaluation.get("checkpoints")
            entries = entries if isinstance(entries, Mapping) else {}
            best, last = entries.get("best") or {}, entries.get("last") or {}
            best_loss = best.get("valid_loss", result.best_valid_loss)
            at = f" ({best['update']})" if "update" in best else ""
            texts += [
                _number(best_loss, 3) + (at if best_loss is not None else ""),
                _number(result.value_of("best"), digits),
                _number(last.get("valid_loss"), 3),
                _number(result.value_of("last"), digits),
                _fmt_ratio(result.cost["arith_ratio"]),
                _fmt_ratio(result.cost["dram_ratio"]),
            ]
            rows.append(texts)
    return header, rows


def _point_stretches(segments: list[Mapping], point: str) -> str:
    """``q1 bfp2e8b16 for all 640 updates`` or ``q1 bfp2e8b16 1-240, bfp3e8b16 241-640 (moved
    after update 240)``: consecutive segments with the same format at ``point`` merged, segments
    of no update left out. A stretch of updates where the formats repeat with a period (a
    cyclic policy's) is one phrase, ``cycles bfp2e8b16 .. bfp8e8b16 (5 levels) every 35
    updates, 32 periods (updates 1-1120)`` (`periodic_span`). ``segments`` record at least one
    update."""
    stretches = point_stretches(segments, point)
    if len(stretches) == 1:
        return f"{point} {stretches[0][0]} for all {stretches[0][2]} updates"
    span = periodic_span(stretches)
    if span is None:
        parts = ", ".join(f"{fmt} {first}-{last}" for fmt, first, last in stretches)
        moves = ", ".join(str(last) for _, _, last in stretches[:-1])
        return f"{point} {parts} (moved after update {moves})"
    start, stop, period = span
    first, last = stretches[start][1], stretches[stop - 1][2]
    cycle, length = _cycle_phrase(stretches, span)
    cycle = (
        f"{cycle} ({period} levels) every {length} updates, "
        f"{(last - first + 1) / length:.3g} periods (updates {first}-{last})"
    )
    before = [f"{fmt} {a}-{b}" for fmt, a, b in stretches[:start]]
    after = [f"{fmt} {a}-{b}" for fmt, a, b in stretches[stop:]]
    return f"{point} " + ", ".join([*before, cycle, *after])


def _cycle_phrase(
    stretches: Sequence[tuple[str, int, int]], span: tuple[int, int, int]
) -> tuple[str, int]:
    """``cycles bfp2e8b16 .. bfp8e8b16`` for the periodic ``span`` of ``stretches``
    (`periodic_span`), and the updates of one period."""
    start, _, period = span
    levels = [fmt for fmt, _, _ in stretches[start : start + period]]
    length = stretches[start + period - 1][2] - stretches[start][1] + 1
    return f"cycles {levels[0]} .. {levels[-1]}", length


def point_stretches(segments: list[Mapping], point: str) -> list[tuple[str, int, int]]:
    """(format, first update, last update) of each stretch of updates over which ``point`` kept
    one format: consecutive segments with the same format merged, segments of no update left
    out."""
    stretches: list[tuple[str, int, int]] = []
    done = 0
    for segment in segments:
        fmt, count = segment["points"][point], int(segment["updates"])
        if count == 0:
            continue
        if stretches and stretches[-1][0] == fmt:
            stretches[-1] = (fmt, stretches[-1][1], done + count)
        else:
            stretches.append((fmt, done + 1, done + count))
        done += count
    return stretches


def periodic_span(stretches: Sequence[tuple[str, int, int]]) -> tuple[int, int, int] | None:
    """The longest run of ``stretches`` (format, first, last update) that repeats with a period
    of ``k`` stretches, each the same format for the same number of updates as the one ``k``
    before it, over at least two whole periods: ``(start, stop, k)``, stretches
    ``start:stop``; the shortest ``k`` among equally long runs. None where nothing repeats."""

    def same(i: int, j: int) -> bool:
        (fa, a0, a1), (fb, b0, b1) = stretches[i], stretches[j]
        return fa == fb and a1 - a0 == b1 - b0

    best = None
    n = len(stretches)
    for k in range(1, n // 2 + 1):
        j = 0
        while j + k < n:
            if not same(j, j + k):
                j += 1
                continue
            start = j
            while j + k < n and same(j, j + k):
                j += 1
            stop = j + k  # stretches start..stop repeat with period k
            if stop - start >= 2 * k and (best is None or stop - start > best[1] - best[0]):
                best = (start, stop, k)
    return best


# -- the trade-off frontier ---------------------------------------------------------------------
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
        label = f"{record['column']} {_metric_label(record['metric'])} against {record['cost']}"
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


def render(table: Table, fmt: str) -> str:
    if fmt not in RENDERERS:
        raise ValueError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    return RENDERERS[fmt](table)


# -- wandb ----------------------------------------------------------------------------------


def log_to_wandb(
    table: Table,
    project: str = "dsq",
    wandb_dir: str | os.PathLike = ".",
    plot_path: str | os.PathLike | None = None,
):
    """Log Table 1 (the CSV's columns) and the frontier plot as one wandb run (job_type
    ``table``): online with a login, offline otherwise (as ``logger.mode=auto``)."""
    import wandb

    from dsq_cli.loggers import wandb_mode

    Path(wandb_dir).mkdir(parents=True, exist_ok=True)
    run = wandb.init(
        project=project,
        job_type="table",
        dir=str(wandb_dir),
        mode=wandb_mode("auto"),
        config={"rows": table.rows, "columns": [c.label for c in table.columns]},
        settings=wandb.Settings(console="off", silent=True),
    )
    try:
        records = [{"kind": "result", **r} for r in cell_records(table)]
        records += reference_records(table)
        data = [[record.get(column) for column in CSV_COLUMNS] for record in records]
        values = {"table1": wandb.Table(columns=list(CSV_COLUMNS), data=data)}
        if plot_path is not None:
            values["frontier"] = wandb.Image(str(plot_path))
        run.log(values)
    finally:
        run.finish()
    return run
