"""Bring a study's finished runs into this checkout, then refresh docs/results.md's tables.

The Table 1 study (scripts/table1_cpu.sh) is best run in a clone of its own, so that code
edits in this checkout cannot change a run in the middle. This copies, from CLONE, the small
records (result.json, metrics.jsonl, schedule.jsonl, config.yaml) of every run under
results/table1-cpu, results/ablations, the convergence study's roots (scripts/convergence.sh),
the MX study's (scripts/mx_formats.sh) and the baselines' (scripts/baselines_multi30k.sh)
that has an outcome (completed or diverged; `dsq sweep`
runs the others again), and rewrites
each fenced block of docs/results.md that follows a marker ``<!-- dsq table ARGS -->`` to the
output of ``dsq table ARGS`` run from the repository root
(tests/scripts/test_results_records.py checks that every such block agrees with its command).

Usage: python scripts/study_records.py CLONE      (from the repository root)
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from dsq.atomic_files import write_atomic

RECORDS = ("result.json", "metrics.jsonl", "schedule.jsonl", "config.yaml")
OUTCOMES = ("completed", "diverged")
ROOTS = ("results/table1-cpu", "results/ablations", "results/convergence-budget",
         "results/convergence", "results/convergence-en-de-budget",
         "results/convergence-en-de", "results/convergence-dsq-rerun",
         "results/convergence-en-de-dsq-rerun", "results/mx-formats-multi30k",
         "results/baselines-multi30k", "results/checkpointed-multi30k", "results/lm-budget",
         "results/lm", "results/lm-stash-all", "results/lm-stash-all-derivative3",
         "results/lm-held-sliced", "results/lm-held-sdpa", "results/demo-rows")  # fmt: skip
MARKER = "<!-- dsq table results/table1-cpu -->"  # the one block docs/results.md must hold


def finished_runs(clone: Path):
    for root in ROOTS:
        for result in sorted((clone / root).rglob("result.json")):
            run = result.parent.relative_to(clone)
            if any(".old-" in part for part in run.parts):
                continue  # a run the sweep moved aside before running it again
            if json.loads(result.read_text()).get("status") in OUTCOMES:
                yield run


# A budget run's sweep job is named "job" (nothing varies in its sweep); its record is named
# after what it holds.
RECORD_NAMES = {"job": "fp32-seed1"}


def record_path(run: Path) -> Path:
    """Where the record of the clone's ``run`` goes in this checkout."""
    return run.with_name(RECORD_NAMES.get(run.name, run.name))


def copy_runs(clone: Path, repo: Path) -> list[Path]:
    copied = []
    for run in finished_runs(clone):
        changed = False
        for name in RECORDS:
            source, target = clone / run / name, repo / record_path(run) / name
            if source.exists() and (
                not target.exists() or target.read_bytes() != source.read_bytes()
            ):
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, target)
                changed = True
        if changed:
            copied.append(record_path(run))
    return copied


# a marker naming `dsq table`'s arguments, then the fenced block of its output; group 1 is the
# arguments, group 2 the table (tests/scripts/test_results_records.py reads them)
BLOCK = re.compile(r"<!-- dsq table ([^\n]*?) -->\n```\n(.*?)```\n", re.DOTALL)
ANY_MARKER = re.compile(r"<!-- dsq table\b[^\n]*")  # also one BLOCK would not match
WRITES = ("--plot", "--out", "--wandb")  # options that write files or runs, not the block


def table_blocks(text: str) -> list[tuple[str, str]]:
    """(arguments, block) of every marker; ValueError for a marker BLOCK does not match (no
    fenced block right after it, a fence with a language), or when Table 1's is missing."""
    blocks = BLOCK.findall(text)
    if len(ANY_MARKER.findall(text)) != len(blocks):
        matched = {m.start() for m in BLOCK.finditer(text)}
        bad = [m.group(0) for m in ANY_MARKER.finditer(text) if m.start() not in matched]
        raise ValueError(f"docs/results.md: {bad[0]!r} is not followed by a plain ``` block")
    if MARKER not in text:
        raise ValueError(f"docs/results.md has no {MARKER} and its block")
    return blocks


def table_args(args: str) -> list[str]:
    """A marker's arguments as `dsq table` gets them; options that write elsewhere refused."""
    words = shlex.split(args)
    writing = [w for w in words if w.split("=", 1)[0].startswith(WRITES)]
    if writing:
        raise ValueError(f"<!-- dsq table {args} -->: {writing[0]} writes elsewhere; drop it")
    return words


def refresh(text: str, table: Callable[[list[str]], str]) -> tuple[str, int]:
    """The text with every marked block replaced by ``table(arguments)``, and their count."""
    table_blocks(text)  # every marker has its block

    def block(match: re.Match) -> str:
        args = match.group(1)
        return f"<!-- dsq table {args} -->\n```\n{table(table_args(args))}```\n"

    return BLOCK.subn(block, text)


def dsq_table(repo: Path, words: list[str]) -> str:
    try:
        return subprocess.run(
            [sys.executable, "-m", "dsq_cli.cli", "table", *words],
            cwd=repo, check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
    except subprocess.CalledProcessError as err:
        raise SystemExit(f"dsq table {shlex.join(words)} failed: {err.stderr.strip()}") from None


def refresh_table_blocks(repo: Path) -> int:
    """Rewrite docs/results.md's marked blocks to their commands' output; how many there are."""
    doc = repo / "docs" / "results.md"
    try:
        text, count = refresh(doc.read_text(), lambda words: dsq_table(repo, words))
    except ValueError as err:
        raise SystemExit(str(err)) from None
    write_atomic(doc, text)
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
