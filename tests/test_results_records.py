"""The committed study records (results/) are what docs/results.md shows: every block marked
``<!-- dsq table ARGS -->`` (Table 1's is `dsq table results/table1-cpu`) is that command's
output on those records, byte for byte."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dsq_cli.cli import app

REPO = Path(__file__).resolve().parents[1]
# the block scripts/study_records.py writes, found by its own pattern
_spec = importlib.util.spec_from_file_location(
    "study_records", REPO / "scripts" / "study_records.py"
)
study_records = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(study_records)


def test_every_docs_table_is_dsq_table_of_the_committed_records(monkeypatch):
    """Table 1, and every other marked block (the ablations and their stash moves)."""
    records = sorted((REPO / "results" / "table1-cpu").rglob("result.json"))
    assert records, "results/table1-cpu holds no result.json"
    blocks = study_records.table_blocks((REPO / "docs" / "results.md").read_text())
    assert "results/table1-cpu" in [args for args, _ in blocks]
    monkeypatch.chdir(REPO)
    for args, block in blocks:
        result = CliRunner().invoke(app, ["table", *study_records.table_args(args)])
        assert result.exit_code == 0, result.output
        assert result.stdout == block, f"docs/results.md's block of `dsq table {args}`"


MARKED = f"""intro
{study_records.MARKER}
```
old table
```
text
<!-- dsq table --moves "runs/a b" runs/c -->
```
old
```
"""


def test_refresh_rewrites_every_marked_block_with_its_own_arguments():
    calls = []

    def table(words):
        calls.append(words)
        return f"table of {words}\n"

    text, count = study_records.refresh(MARKED, table)
    assert count == 2 and calls == [["results/table1-cpu"], ["--moves", "runs/a b", "runs/c"]]
    assert study_records.table_blocks(text) == [
        ("results/table1-cpu", "table of ['results/table1-cpu']\n"),
        ('--moves "runs/a b" runs/c', "table of ['--moves', 'runs/a b', 'runs/c']\n"),
    ]
    assert text.startswith("intro\n") and "\ntext\n" in text


@pytest.mark.parametrize(
    "broken, says",
    [
        (MARKED + "<!-- dsq table runs/d -->\n\n```\nx\n```\n", "runs/d"),  # a blank line
        (MARKED + "<!-- dsq table runs/e -->\n```text\nx\n```\n", "runs/e"),  # a language
        (MARKED.replace(study_records.MARKER, "<!-- dsq table results -->"), "no <!-- dsq"),
    ],
)
def test_a_marker_without_its_block_is_named(broken, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        study_records.refresh(broken, lambda words: "")


def test_a_marker_may_not_write_elsewhere():
    with pytest.raises(ValueError, match="--plot=x.png writes elsewhere"):
        study_records.refresh(MARKED.replace("--moves", "--plot=x.png"), lambda words: "")


def test_the_records_are_the_small_files_only():
    """Checkpoints, logs and wandb files stay out of the repository."""
    allowed = {"result.json", "metrics.jsonl", "schedule.jsonl", "config.yaml"}
    for root in ("table1-cpu", "ablations"):
        for path in (REPO / "results" / root).rglob("*"):
            if path.is_file():
                assert path.name in allowed, path
