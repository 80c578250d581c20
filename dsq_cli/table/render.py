"""The table in its four formats: markdown, CSV, LaTeX and JSON."""

from __future__ import annotations

import csv
import io
import json

from .cells import Table
from .comparisons import against_grid, against_heading
from .post_move import POST_MOVE_HEADING, POST_MOVE_MARGIN, post_move_lines
from .records import CSV_COLUMNS, as_json, cell_records, reference_records
from .text import cell_texts, legend_lines, markdown_escape, markdown_grid, metric_label

FORMATS = ("markdown", "csv", "latex", "json")


def render_markdown(table: Table) -> str:
    header = ["quant"]
    for column in table.columns:
        header += [
            f"{column.label} {metric_label(column.metric)}",
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
    lines += [f"- {markdown_escape(line)}" for line in legend_lines(table)]
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
                rf"({_latex_escape(metric_label(c.metric))})}}"
                for c in table.columns
            ]
        )
        + r" \\",
        "".join(rf"\cmidrule(lr){{{2 + 4 * i}-{5 + 4 * i}}}" for i in range(len(table.columns))),
        " & ".join(
            ["quant"]
            + [metric_label(c.metric) + " & arith & DRAM & stash bits" for c in table.columns]
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


def render_json(table: Table) -> str:
    return json.dumps(as_json(table), indent=2) + "\n"


RENDERERS = {
    "markdown": render_markdown,
    "csv": render_csv,
    "latex": render_latex,
    "json": render_json,
}


def render(table: Table, fmt: str) -> str:
    if fmt not in RENDERERS:
        raise ValueError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    return RENDERERS[fmt](table)
