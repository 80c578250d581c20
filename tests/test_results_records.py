"""The committed study records (results/) are what docs/results.md shows: its Table 1 block is
`dsq table results/table1-cpu` of those records, byte for byte."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from typer.testing import CliRunner

from dsq_cli.cli import app

REPO = Path(__file__).resolve().parents[1]
# the block scripts/study_records.py writes, found by its own pattern
_spec = importlib.util.spec_from_file_location(
    "study_records", REPO / "scripts" / "study_records.py"
)
study_records = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(study_records)


def documented_tables() -> list[tuple[str, str]]:
    """(dsq table's arguments, the block that follows them) for every marked block."""
    text = (REPO / "docs" / "results.md").read_text()
    assert study_records.MARKER in text, f"docs/results.md has no {study_records.MARKER}"
    return study_records.BLOCK.findall(text)


def test_docs_table1_is_dsq_table_of_the_committed_records(monkeypatch):
    """Every marked block (Table 1, the ablations, the stash moves) is its command's output."""
    records = sorted((REPO / "results" / "table1-cpu").rglob("result.json"))
    assert records, "results/table1-cpu holds no result.json"
    blocks = documented_tables()
    assert "results/table1-cpu" in [args for args, _ in blocks]
    monkeypatch.chdir(REPO)
    for args, block in blocks:
        result = CliRunner().invoke(app, ["table", *args.split()])
        assert result.exit_code == 0, result.output
        assert result.stdout == block, f"docs/results.md's block of `dsq table {args}`"


def test_the_records_are_the_small_files_only():
    """Checkpoints, logs and wandb files stay out of the repository."""
    allowed = {"result.json", "metrics.jsonl", "schedule.jsonl", "config.yaml"}
    for root in ("table1-cpu", "ablations"):
        for path in (REPO / "results" / root).rglob("*"):
            if path.is_file():
                assert path.name in allowed, path
