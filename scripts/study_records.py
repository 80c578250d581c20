"""Bring a study's finished runs into this checkout, then refresh docs/results.md's Table 1 block.

The Table 1 study (scripts/table1_cpu.sh) is best run in a clone of its own, so that code
edits in this checkout cannot change a run in the middle. This copies, from CLONE, the small
records (result.json, metrics.jsonl, schedule.jsonl, config.yaml) of every run under
results/table1-cpu and results/ablations that has an outcome (completed or diverged; `dsq sweep`
runs the others again), and rewrites
each fenced block of docs/results.md that follows a marker ``<!-- dsq table ARGS -->`` to the
output of ``dsq table ARGS`` run from the repository root (tests/test_results_records.py checks
that every such block agrees with its command).

Usage: python scripts/study_records.py CLONE      (from the repository root)
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

RECORDS = ("result.json", "metrics.jsonl", "schedule.jsonl", "config.yaml")
OUTCOMES = ("completed", "diverged")
ROOTS = ("results/table1-cpu", "results/ablations")
MARKER = "<!-- dsq table results/table1-cpu -->"  # the one block docs/results.md must hold


def finished_runs(clone: Path):
    for root in ROOTS:
        for result in sorted((clone / root).rglob("result.json")):
            run = result.parent.relative_to(clone)
            if any(".old-" in part for part in run.parts):
                continue  # a run the sweep moved aside before running it again
            if json.loads(result.read_text()).get("status") in OUTCOMES:
                yield run


def copy_runs(clone: Path, repo: Path) -> list[Path]:
    copied = []
    for run in finished_runs(clone):
        changed = False
        for name in RECORDS:
            source, target = clone / run / name, repo / run / name
            if source.exists() and (
                not target.exists() or target.read_bytes() != source.read_bytes()
            ):
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, target)
                changed = True
        if changed:
            copied.append(run)
    return copied


# a marker naming `dsq table`'s arguments, then the fenced block of its output; group 1 is the
# arguments, group 2 the table (tests/test_results_records.py reads them)
BLOCK = re.compile(r"<!-- dsq table ([^\n]*?) -->\n```\n(.*?)```\n", re.DOTALL)


def dsq_table(repo: Path, args: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "dsq_cli.cli", "table", *args.split()],
        cwd=repo, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip


def refresh_table_blocks(repo: Path) -> int:
    """Rewrite every marked block to its command's output; how many there are."""
    doc = repo / "docs" / "results.md"
    text = doc.read_text()
    if MARKER not in text:
        raise SystemExit(f"docs/results.md has no fenced block after {MARKER}")

    def block(match: re.Match) -> str:
        args = match.group(1)
        return f"<!-- dsq table {args} -->\n```\n{dsq_table(repo, args)}```\n"

    text, count = BLOCK.subn(block, text)
    doc.write_text(text)
    return count


def main() -> None:
    if len(sys.argv) != 2 or not Path(sys.argv[1], "results").is_dir():
        raise SystemExit("usage: python scripts/study_records.py CLONE (a checkout with results/)")
    repo = Path(__file__).resolve().parents[1]
    for run in copy_runs(Path(sys.argv[1]).resolve(), repo):
        print(f"copied {run}")
    count = refresh_table_blocks(repo)
    print(f"docs/results.md: {count} dsq table blocks refreshed")


if __name__ == "__main__":
    main()
