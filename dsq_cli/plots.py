"""PNG plots: one run's precision and validation loss over updates (``dsq plot RUN_DIR``), and
the metric against the cost ratios across runs (``dsq table --plot FILE.png``).

Figures are built with ``matplotlib.figure.Figure`` and saved through the Agg canvas, never
through pyplot, so no display or global backend state is involved.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from dsq import cost
from dsq.atomic_files import atomic_path
from dsq.engine.accounting import GemmRecord
from dsq.engine.config import POINTS
from dsq.presets import COST_BASELINE
from dsq_cli.cost import baseline_points
from dsq_cli.run_result import RunResult, metric_decimals, metric_sign
from dsq_cli.table import METRIC_LABELS, PAPER_REFERENCE, Table, row_preset

POINT_ROLES = {
    "q0": "forward x, W",
    "q1": "stash",
    "q2": "backward W",
    "q3": "gradients",
}
# Overlapping lines (q0 and q2 are often the same format) stay visible: each point has its own
# colour, dash pattern and width, the widest drawn first.
POINT_STYLES = {
    "q0": {"color": "tab:blue", "linestyle": "-", "linewidth": 4.0, "alpha": 0.6},
    "q1": {"color": "tab:red", "linestyle": "-", "linewidth": 2.2},
    "q2": {"color": "tab:green", "linestyle": "--", "linewidth": 2.0},
    "q3": {"color": "tab:purple", "linestyle": ":", "linewidth": 2.4},
}
DPI = 120


def _figure(width: float, height: float, rows: int = 1, cols: int = 1, **kwargs):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False, **kwargs)
    return fig, axes


def _save(fig, out: str | os.PathLike) -> Path:
    out = Path(out)
    if out.suffix.lower() != ".png":
        raise ValueError(f"plots are PNG files; {str(out)!r} does not end in .png")
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:  # a reader never sees half a PNG
        fig.savefig(tmp, dpi=DPI, format="png")
    return out


def _read_jsonl(path: Path) -> list[dict]:
    """The JSON lines of ``path``; a torn last line (a run killed mid-write) is dropped."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, Mapping):
            records.append(record)
    return records


def _bits_per_value(spec: str) -> float:
    from dsq.formats import parse_format

    return parse_format(spec).bits_per_value


def bits_series(metrics: list[dict], schedule: list[dict]) -> dict[str, list[tuple[int, str]]]:
    """Per point, ``(update, spec)`` samples meaning "``spec`` was in force for the updates up to
    ``update``" (a logged line's ``bits``; a schedule change at update u adds ``(u, from)``), in
    update order and starting at update 0."""
    samples: dict[str, dict[int, str]] = {p: {} for p in POINTS}
    for record in metrics:
        bits = record.get("bits")
        if isinstance(bits, Mapping) and isinstance(record.get("update"), int):
            for point in POINTS:
                if point in bits:
                    samples[point][record["update"]] = str(bits[point])
    for change in schedule:
        point, update = change.get("point"), change.get("update")
        if point in samples and isinstance(update, int) and change.get("from"):
            samples[point].setdefault(update, str(change["from"]))
    series = {}
    for point, by_update in samples.items():
        if not by_update:
            continue
        ordered = sorted(by_update.items())
        if ordered[0][0] > 0:
            ordered.insert(0, (0, ordered[0][1]))
        series[point] = ordered
    return series


def _sequence(specs: list[str]) -> list[str]:
    """The distinct formats in the order they were used."""
    seen: list[str] = []
    for spec in specs:
        if not seen or seen[-1] != spec:
            seen.append(spec)
    return seen


def plot_run(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Bits per value in force at q0..q3 and the validation loss over updates, as two panels
    sharing the update axis. Default output: RUN_DIR/plot.png."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"no such run directory: {run_dir}")
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise ValueError(f"{run_dir} is not a run directory: it has no metrics.jsonl")
    metrics = _read_jsonl(metrics_path)
    schedule = _read_jsonl(run_dir / "schedule.jsonl")
    series = bits_series(metrics, schedule)
    valid = [
        (r["update"], r["valid_loss"])
        for r in metrics
        if r.get("kind") == "valid" and r.get("valid_loss") is not None
    ]
    train = [
        (r["update"], r["loss"])
        for r in metrics
        if r.get("kind") == "train" and r.get("loss") is not None
    ]
    if not series and not valid and not train:
        raise ValueError(f"{metrics_path} holds no logged updates yet")
    result = _read_result(run_dir)
    last_update = max([u for u, _ in train + valid] + [s[-1][0] for s in series.values()])

    fig, axes = _figure(9, 6.5, rows=2, sharex=True, height_ratios=[1, 1.2])
    bits_ax, loss_ax = axes[0][0], axes[1][0]
    for point in POINTS:
        if point not in series:
            continue
        updates = [u for u, _ in series[point]] + [last_update]
        specs = [s for _, s in series[point]] + [series[point][-1][1]]
        label = f"{point} {POINT_ROLES[point]}: {' > '.join(_sequence(specs))}"
        bits_ax.step(
            updates,
            [_bits_per_value(s) for s in specs],
            where="pre",  # a sample holds for the updates up to it
            label=label,
            **POINT_STYLES[point],
        )
    bits_ax.set_ylabel("bits per value in force")
    top_bits = max((_bits_per_value(s) for v in series.values() for _, s in v), default=32)
    bits_ax.set_ylim(0, top_bits * 1.12)  # from zero, with the highest line clear of the frame
    bits_ax.grid(True, alpha=0.3)
    if series:  # beside the panel: inside it would hide the lines at the top
        bits_ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    bits_ax.set_title("precision at each quantization point", fontsize=10)

    if train:
        loss_ax.plot(*zip(*train), color="0.6", linewidth=1, label="train loss")
    if valid:
        loss_ax.plot(*zip(*valid), color="tab:orange", marker="o", label="validation loss")
    loss_ax.set_xlabel("updates")
    loss_ax.set_ylabel("loss")
    loss_ax.grid(True, alpha=0.3)
    loss_ax.set_title("loss", fontsize=10)

    changes = sorted({c["update"] for c in schedule if isinstance(c.get("update"), int)})
    for ax in (bits_ax, loss_ax):
        for update in changes:
            ax.axvline(update, color="0.5", linestyle=":", linewidth=1)
    if changes:
        loss_ax.plot([], [], color="0.5", linestyle=":", label="precision change")
    loss_ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    loss_ax.set_xlim(0, max(last_update, 1))
    fig.suptitle(_run_title(run_dir, result), fontsize=11)
    return _save(fig, out if out is not None else run_dir / "plot.png")


def _read_result(run_dir: Path) -> RunResult | None:
    try:
        return RunResult.read(run_dir)
    except ValueError:  # the plot needs only metrics.jsonl; the title does without
        return None


def _run_title(run_dir: Path, result: RunResult | None) -> str:
    title = run_dir.name
    if result is None:
        return title
    parts = [str(p) for p in (result.task, result.model) if p]
    parts.append(f"quant {result.preset}{'*' if result.quant.get('modified') else ''}")
    if result.completed:
        parts.append(f"{result.metric} {result.value:.{metric_decimals(result.metric)}f}")
    else:
        parts.append(result.status)
    return f"{title}\n{', '.join(parts)}" if parts else title


def _log_ratio_axis(ax, low: float, high: float) -> None:
    """A log x axis labelled in plain numbers at 1, 2, 5 x 10^k (0.02, 0.05, 0.1...), without
    the crowded minor labels matplotlib puts on short log ranges."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xscale("log")
    ax.set_xlim(low, high)
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: f"{x:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def frontier_points(table: Table) -> list[dict]:
    """One point per (row, column) with completed runs: the metric's mean and spread over its n
    completed runs and the mean cost ratios."""
    points = []
    for row in table.rows:
        for column in table.columns:
            cell = table.cell(row, column)
            if cell is None or not cell.completed:
                continue
            points.append(
                {
                    "row": row,
                    "column": column,
                    "metric_mean": cell.metric_mean,
                    "metric_std": cell.metric_std,
                    "n": len(cell.completed),
                    "arith_ratio": cell.cost_mean("arith_ratio"),
                    "dram_ratio": cell.cost_mean("dram_ratio"),
                }
            )
    return points


def point_labels(points: list[dict]) -> list[str]:
    """Each point's label: its row, and its n where the points beside it (one column's) do not
    all have the same number of runs. A point is a mean over its own seeds, so two points of
    unequal n are not compared over the same seeds (``dsq table --frontier`` compares rows over
    the seeds both completed); the label says so where it matters."""
    counts = {point["n"] for point in points}
    if len(counts) <= 1:
        return [point["row"] for point in points]
    return [f"{point['row']} (n={point['n']})" for point in points]


def row_styles(rows: list[str]) -> dict[str, tuple]:
    """Each row's (colour, marker): a colour of its own (tab10, or tab20 past ten rows), a dot for
    a preset's own row and a diamond for a variant of one (``dsq* (...)``, ``dsq (budget)``)."""
    from matplotlib import colormaps

    palette = colormaps["tab10" if len(rows) <= 10 else "tab20"].colors
    return {
        row: (palette[i % len(palette)], "o" if row == row_preset(row) else "D")
        for i, row in enumerate(rows)
    }


def paper_dsq_ratios(baseline: str = COST_BASELINE, model: cost.CostModel | None = None) -> dict:
    """Where the paper's DSQ sits as a fraction of ``baseline``'s cost: the paper gives its
    reductions against fixed16 (``PAPER_REFERENCE``), so fixed16's ratios to ``baseline`` under
    the cost model (``model``: the one the table's runs were priced with, by default the
    library's ``DEFAULT_MODEL``, which ``dsq train`` prices with) divided by them. One config
    uniform over another prices alike at any GEMM shape unless the model moves activations at
    32 bits (``activations_fp32``); then this is a square GEMM's."""
    paper, square = PAPER_REFERENCE, GemmRecord("linear", 1, 256, 256, 256, (), 0)
    against = baseline_points(paper["baseline"])
    arith, dram = cost.ratios([square], against, baseline_points(baseline), model=model)
    return {
        "arith_ratio": arith / paper["arith_reduction"],
        "dram_ratio": dram / paper["dram_reduction"],
    }


def plot_frontier(
    table: Table, out: str | os.PathLike, *, cost_model: cost.CostModel | None = None
) -> Path:
    """The trade-off frontier: each task's metric against the arithmetic and the DRAM ratio
    (one panel each, one row of panels per task), a labelled point per Table 1 row, and a line
    where the paper's DSQ would sit (`paper_dsq_ratios` under ``cost_model``, by default the
    one runs are priced with)."""
    points = frontier_points(table)
    columns = [c for c in table.columns if any(p["column"] == c for p in points)]
    if not columns:
        raise ValueError("no completed runs to plot")
    styles = row_styles(table.rows)
    baseline = "/".join(table.baselines) or COST_BASELINE
    fig, axes = _figure(11, 4.2 * len(columns), rows=len(columns), cols=2)
    paper = PAPER_REFERENCE
    labelled: dict = {}  # axes -> (label, x, y) of its points, placed once the layout is known
    one_baseline = table.baselines[0] if len(table.baselines) == 1 else COST_BASELINE
    paper_x = paper_dsq_ratios(one_baseline, cost_model)
    for row_index, column in enumerate(columns):
        mine = [p for p in points if p["column"] == column]
        labels = point_labels(mine)  # one column's labels serve both its panels
        for col_index, (key, name) in enumerate(
            (("arith_ratio", "arithmetic"), ("dram_ratio", "DRAM traffic"))
        ):
            ax = axes[row_index][col_index]
            for point in mine:
                ax.errorbar(
                    point[key],
                    point["metric_mean"],
                    yerr=point["metric_std"],
                    fmt=styles[point["row"]][1],
                    markersize=7,
                    capsize=3,
                    color=styles[point["row"]][0],
                )
            ax.axvline(paper_x[key], color="0.4", linestyle="--", linewidth=1)
            ax.annotate(
                f"paper DSQ ({paper['task']}):\n{paper[key.replace('ratio', 'reduction')]}x "
                f"below {paper['baseline']}",
                (paper_x[key], 0.98),
                xycoords=("data", "axes fraction"),
                xytext=(4, 0),
                textcoords="offset points",
                verticalalignment="top",
                fontsize=7,
                color="0.3",
            )
            xs = [p[key] for p in mine] + [paper_x[key]]
            _log_ratio_axis(ax, min(xs) / 1.6, max(xs) * 1.8)  # room for the labels
            ax.margins(y=0.18)
            metric = METRIC_LABELS.get(column.metric, column.metric)
            ax.set_xlabel(f"{name} per step, fraction of {baseline} (log; left is cheaper)")
            better = "higher" if metric_sign(column.metric) > 0 else "lower"
            ax.set_ylabel(f"{column.label} {metric} ({better} is better)")
            ax.grid(True, which="both", alpha=0.3)
            ax.set_title(f"{column.label}: {metric} vs {name}", fontsize=10)
            missing = _not_shown(table, column)
            if missing:
                ax.text(0.99, 0.02, f"not shown: {missing}", transform=ax.transAxes,
                        ha="right", va="bottom", fontsize=7, color="0.3")  # fmt: skip
            labelled[ax] = [
                (label, p[key], p["metric_mean"]) for label, p in zip(labels, mine, strict=True)
            ]
    fig.suptitle(
        "Table 1 trade-off: metric against cost (each row's mean over its seeds)", fontsize=11
    )
    _place_labels(fig, labelled)
    return _save(fig, out)


def _not_shown(table: Table, column) -> str:
    """Rows of this column without a completed run, with their status (``dsq (running)``)."""
    return ", ".join(
        f"{row} ({cell.note})"
        for row in table.rows
        if (cell := table.cell(row, column)) is not None and not cell.completed
    )


# Where a label may sit, in points from its marker, nearest first; past the first ring a thin
# leader line ties the label to its point, so a dense cluster still has every label readable.
_NEAR_SPOTS = (
    (6, 3, "left", "bottom"),
    (6, -3, "left", "top"),
    (-6, 3, "right", "bottom"),
    (-6, -3, "right", "top"),
    (0, 8, "center", "bottom"),
    (0, -8, "center", "top"),
    (6, 14, "left", "bottom"),
    (6, -14, "left", "top"),
)
_FAR_SPOTS = tuple(
    (side * 12, up * dy, "left" if side > 0 else "right", "bottom" if up > 0 else "top")
    for dy in (26, 38, 50, 62)
    for side in (1, -1)
    for up in (1, -1)
)
LABEL_SPOTS = _NEAR_SPOTS + _FAR_SPOTS
LEADER = {"arrowstyle": "-", "color": "0.5", "linewidth": 0.6, "shrinkA": 0, "shrinkB": 3}


def _place_labels(fig, labelled: dict) -> None:
    """Label each point beside it without covering another point's label or marker: the nearest
    free spot of ``LABEL_SPOTS`` inside the panel, with a leader line past the first ring; where
    none is free, the nearest spot."""
    fig.draw_without_rendering()  # lay the figure out, so that pixel positions hold
    renderer = fig.canvas.get_renderer()
    for ax, items in labelled.items():
        centres = [ax.transData.transform((x, y)) for _, x, y in items]
        taken = [(cx - 4, cy - 4, cx + 4, cy + 4) for cx, cy in centres]
        frame = ax.get_window_extent(renderer)
        for text, x, y in items:
            for spot in LABEL_SPOTS:
                label, bounds = _annotate(ax, renderer, text, (x, y), spot)
                inside = frame.x0 <= bounds[0] and bounds[2] <= frame.x1 and bounds[3] <= frame.y1
                if inside and not any(_overlap(bounds, other) for other in taken):
                    break
                label.remove()
            else:  # no free spot: the nearest one, overlapping
                _, bounds = _annotate(ax, renderer, text, (x, y), LABEL_SPOTS[0])
            taken.append(bounds)


def _annotate(ax, renderer, text: str, xy: tuple, spot: tuple) -> tuple:
    """``text`` at ``spot`` from the point ``xy``: the annotation and its pixel bounds."""
    from matplotlib.text import Text

    dx, dy, ha, va = spot
    leader = LEADER if spot in _FAR_SPOTS else None
    label = ax.annotate(text, xy, xytext=(dx, dy), textcoords="offset points", ha=ha, va=va,
                        fontsize=8, arrowprops=leader)  # fmt: skip
    label.update_positions(renderer)
    box = Text.get_window_extent(label, renderer)  # the text's own box, without its leader
    return label, (box.x0, box.y0, box.x1, box.y1)


def _overlap(a: tuple, b: tuple) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]
