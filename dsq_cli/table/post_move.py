"""The post-move endpoint: a rising stash against its static controls, from the first move of
its schedule on (docs/table.md, "Endpoints")."""

from __future__ import annotations

import json
from collections.abc import Mapping

from dsq.engine.spec import saved_rules

from .cells import Cell, Run, Table
from .comparisons import equivalence_text, p_text
from .intervals import (
    equivalence_p,
    holm,
    inside,
    mean_interval,
    p_value,
)
from .text import interval_text

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
    """A record's ``quant.saved`` as the engine reads it, one spelling per format (``bfp8`` and
    ``bfp8e8b16`` are one rule); a record written before a kind existed reads with it filled in
    (``dsq.presets.record_quant``)."""
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
        record["equivalent"] = inside(interval, margin)
        record["equivalence_p"] = (
            equivalence_p(interval, margin) if interval and margin is not None else None
        )
    for key in ("p", "equivalence_p"):
        raw = [r[key] for r in records]
        for record, adjusted in zip(records, holm(raw) if table.adjust == "holm" else raw):
            record[f"{key}_adjusted"] = adjusted
    return records


def post_move_lines(table: Table) -> list[str]:
    lines = []
    for r in post_move_records(table):
        text = interval_text(r["interval"], 3, signed=True) if r["interval"] else "no pair moved"
        text += p_text(r["p"], r["p_adjusted"], table.adjust)
        if r["margin"] is not None:
            text += f"; within ±{r['margin']:g}: " + equivalence_text(
                r["equivalent"], r["equivalence_p"], r["equivalence_p_adjusted"], table.adjust
            )
        unmoved = ", ".join(map(str, r["unmoved"])) or "none"
        lines.append(f"{r['row']} - {r['control']}, {r['column']}: {text}; "
                     f"seeds without a move: {unmoved}")  # fmt: skip
    return lines
