"""The table as data: a run (`Run`), the runs of a row and column (`Cell`), a column (`Column`)
and the whole table with its paired comparisons (`Table`); what rows are compared by."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

from dsq_cli.run_result import RunResult

from .intervals import (
    Interval,
    equivalence_p,
    holm,
    inside,
    mean_interval,
    p_value,
    paired_interval,
)

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
        return inside(diff, self.margins[measure])

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
