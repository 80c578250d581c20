"""Each run's schedule in words: when each scheduled point moved (``--moves``) and one line per
run (``--runs``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dsq.engine.config import POINTS
from dsq_cli.run_result import metric_decimals

from .cells import Run, Table
from .records import filled_cells
from .text import metric_label, ratio_text


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
    metrics = {metric_label(c.metric) for c in table.columns}
    label = metrics.pop() if len(metrics) == 1 else "metric"
    header += [f"{label}, best checkpoint", "last valid loss", f"{label}, last model"]
    header += ["arith", "DRAM"]
    rows = []
    for row, column, cell in filled_cells(table):
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
                ratio_text(result.cost["arith_ratio"]),
                ratio_text(result.cost["dram_ratio"]),
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
