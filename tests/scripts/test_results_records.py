"""The committed study records (results/) are what docs/results.md shows: every block marked
``<!-- dsq table ARGS -->`` (Table 1's is `dsq table results/table1-cpu`) is that command's
output on those records, byte for byte. And every record (a directory with a result.json,
anywhere under results/) is the four small files only, and agrees with itself: result.json with
its config.yaml, metrics.jsonl and schedule.jsonl (file reads only, no dsq command)."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from dsq_cli.cli import app

REPO = Path(__file__).resolve().parents[2]
# the block scripts/study_records.py writes, found by its own pattern
_spec = importlib.util.spec_from_file_location(
    "study_records", REPO / "scripts" / "study_records.py"
)
study_records = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(study_records)


@pytest.mark.slow  # runs dsq table once per block of docs/results.md (about 30)
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


def test_a_studys_finished_runs_are_copied_under_the_names_of_their_records(tmp_path):
    """Only a finished run's four small files are brought in (not its checkpoints or log, not a
    run still training, not a run the sweep set aside), and a budget run's sweep job, named
    ``job``, arrives as the record of its row."""
    clone, repo = tmp_path / "clone", tmp_path / "repo"
    runs = {
        "results/convergence-en-de-budget/job": "completed",
        "results/convergence/seed3/quant-dsq": "completed",
        "results/convergence/seed3/quant-fp32": "running",
        "results/convergence/seed3/quant-bfp6.old-20261203-101010": "completed",
    }
    for run, status in runs.items():
        folder = clone / run
        (folder / "checkpoints").mkdir(parents=True)
        (folder / "result.json").write_text(json.dumps({"status": status}))
        for name in ("metrics.jsonl", "schedule.jsonl", "config.yaml", "train.log"):
            (folder / name).write_text(name)
    copied = study_records.copy_runs(clone, repo)
    assert sorted(map(str, copied)) == [
        "results/convergence-en-de-budget/fp32-seed1",
        "results/convergence/seed3/quant-dsq",
    ]
    for record in copied:
        assert sorted(p.name for p in (repo / record).iterdir()) == sorted(RECORD_FILES)
    assert study_records.copy_runs(clone, repo) == []  # nothing new the second time


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


# -- every record under results/, whatever study wrote it -------------------------------------
RESULTS = REPO / "results"
RECORD_FILES = {"result.json", "metrics.jsonl", "schedule.jsonl", "config.yaml"}
RECORDS = sorted(path.parent for path in RESULTS.rglob("result.json"))
WARMUP_SHARE, WARMUP_CAP, MIN_VALIDATIONS = 0.1, 4000, 10  # docs/training.md, "Budgets"


def _status(record: Path) -> str | None:
    return json.loads((record / "result.json").read_text()).get("status")


def _live(record: Path) -> bool:
    """A run that a study is writing into this checkout now (its checkpoints, log and wandb
    files are gitignored): not a record yet, so not checked until it completes."""
    return _status(record) == "running" and (record / "checkpoints").is_dir()


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _record_id(record: Path) -> str:
    return str(record.relative_to(RESULTS))


def test_results_hold_records_in_every_folder():
    """Every folder under results/ holds records, and every file is inside a record: a record
    is a directory with a result.json (the other tests read them all)."""
    assert len(RECORDS) >= 55, RECORDS  # the records of 5 folders when this test was written
    folders = sorted(p for p in RESULTS.iterdir() if p.is_dir())
    for folder in folders:
        assert any(r.is_relative_to(folder) for r in RECORDS), f"{folder}: no result.json"
    live_logs = {r.with_name(r.name + ".log") for r in RECORDS if _live(r)}  # dsq sweep's
    for path in RESULTS.rglob("*"):
        if path.is_file() and path not in live_logs:
            assert any(path.is_relative_to(r) for r in RECORDS), f"{path}: outside any record"


@pytest.mark.parametrize("record", RECORDS, ids=_record_id)
def test_the_records_are_the_small_files_only(record):
    """The four small files and nothing else: checkpoints, logs (train.log, test.hyp) and wandb
    files stay out of the repository; a study's leftovers (gitignored) go before its records
    count."""
    if _live(record):
        pytest.skip(f"{record}: a run in progress")
    found = {p.name + ("/" if p.is_dir() else "") for p in record.iterdir()}
    assert found == RECORD_FILES, f"{record}: {sorted(found - RECORD_FILES)} must go"


@pytest.mark.parametrize("record", RECORDS, ids=_record_id)
def test_a_record_is_self_consistent(record):
    """result.json agrees with the run's config.yaml (seed, preset and points, task, model, the
    budget derived from the train keys) and with its metrics.jsonl (the final validation loss,
    the updates, the validations) and schedule.jsonl (the precision segments)."""
    if _live(record):
        pytest.skip(f"{record}: a run in progress")
    result = json.loads((record / "result.json").read_text())
    config = yaml.safe_load((record / "config.yaml").read_text())
    metrics = _read_jsonl(record / "metrics.jsonl")
    changes = _read_jsonl(record / "schedule.jsonl")
    assert result["status"] == "completed"

    # what the run was
    assert result["seed"] == config["seed"]
    assert result["quant"]["preset"] == config["choices"]["quant"]
    points = {k: v for k, v in result["quant"].items() if k not in ("preset", "modified")}
    # quant.saved: result.json holds the rules in force (the defaults included), config.yaml the
    # ones the command line set
    unruled = {k: v for k, v in config["quant"].items() if k != "saved"}
    assert {k: v for k, v in points.items() if k != "saved"} == unruled
    if "saved" in points:  # stash_scope=all: its rules in force, the defaults included
        from dsq.engine.spec import QuantSpec

        assert QuantSpec.from_dict(points) == QuantSpec.from_dict(config["quant"])
    assert result["task"] == config["task"]["name"] and result["model"] == config["model"]["name"]
    assert result["world_size"] == config["train"]["distributed_world_size"]

    # the budget: the train keys, with auto and the caps resolved as Budget.plan does
    train, budget = config["train"], result["budget"]
    per_epoch, updates = budget["updates_per_epoch"], result["updates"]
    caps = [n for n in (train["max_updates"], train["max_epochs"] * per_epoch) if n]
    assert budget["total_updates"] == min(caps)
    total = budget["total_updates"]
    warmup = train["warmup_updates"]
    if warmup == "auto":
        warmup = min(WARMUP_CAP, max(1, round(WARMUP_SHARE * total)))
    assert budget["warmup_updates"] == warmup
    every = train["validate_every"]
    if every == "auto":
        every = min(per_epoch, max(1, math.ceil(total / MIN_VALIDATIONS)))
    assert budget["validate_every"] == every
    # stop_patience and stopped_early came with train.stop_patience (commit 7324617): a run
    # before it has neither in config.yaml nor in its budget, a run since has both
    if "stop_patience" in train:
        assert budget["stop_patience"] == train["stop_patience"]
        stopped = budget["stopped_early"]
    else:
        assert "stop_patience" not in budget and "stopped_early" not in budget
        stopped = None
    if stopped:  # at a validation under the cap
        assert budget["stop_patience"] and updates == stopped["update"] < total
    else:
        assert updates == total
    assert result["epochs"] == math.ceil(updates / per_epoch)

    # metrics.jsonl: training lines every log_every updates and at epoch ends, up to the last
    trained = [m["update"] for m in metrics if m["kind"] == "train"]
    log_every = train["log_every"]
    if updates % log_every == 0 or updates % per_epoch == 0:
        assert trained[-1] == updates
    else:
        assert updates - log_every < trained[-1] < updates
    # validations every validate_every updates (0: every epoch) and after the last update
    step = every or per_epoch
    expected = list(range(step, updates + 1, step))
    expected += [] if expected and expected[-1] == updates else [updates]
    valid = [m for m in metrics if m["kind"] == "valid"]
    validated = [m["update"] for m in valid]
    if result["resumed"]:  # a resumed run may repeat what it did after its last checkpoint
        validated = sorted(set(validated))
    assert validated == expected
    assert result["valid_loss"] == valid[-1]["valid_loss"]
    assert result["best_valid_loss"] == min(m["valid_loss"] for m in valid)
    assert result["best_valid_loss"] == valid[-1]["best_valid_loss"]

    # the precision segments: every update once, each boundary a change in schedule.jsonl
    segments = result["precision_segments"]
    assert sum(s["updates"] for s in segments) == updates
    assert all(s["updates"] > 0 for s in segments)
    ends = [sum(s["updates"] for s in segments[: i + 1]) for i in range(len(segments) - 1)]
    assert set(ends) <= {c["update"] for c in changes}
