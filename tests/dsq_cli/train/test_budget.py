"""The run's budget (docs/training.md, "Budgets"): the total number of updates is known before
the first one, and warmup and validation follow it unless the config sets them."""

from __future__ import annotations

import json
import logging
import subprocess

import pytest
from helpers.runs import DSQ, only_run, read_jsonl, small
from omegaconf import OmegaConf

from dsq_cli.train.budget import Budget


def plan(updates_per_epoch, **train):
    defaults = {"max_updates": 0, "max_epochs": 10, "warmup_updates": "auto",
                "validate_every": "auto"}  # fmt: skip
    return Budget.plan(OmegaConf.create(defaults | train), updates_per_epoch)


def test_the_total_is_whichever_limit_ends_first():
    assert plan(81).total_updates == 810  # 10 epochs x 81
    assert plan(81, max_updates=300).total_updates == 300
    assert plan(81, max_updates=5000).total_updates == 810
    assert plan(81, max_epochs=0, max_updates=123).total_updates == 123


def test_auto_warmup_is_a_tenth_of_the_run_capped_at_4000():
    assert plan(81).warmup_updates == 81
    assert plan(3).warmup_updates == 3
    assert plan(1, max_epochs=1).warmup_updates == 1  # never 0 for a one-update run
    assert plan(10_000, max_epochs=50).warmup_updates == 4000


def test_auto_validation_is_every_epoch_and_at_least_ten_times():
    assert plan(81).validate_every == 81  # 10 epochs: once per epoch is ten times
    assert plan(81, max_epochs=2).validate_every == 17  # ceil(162 / 10)
    assert plan(81, max_epochs=100).validate_every == 81
    assert plan(81, validate_every=0).validate_every == 0  # explicit: at the end of each epoch
    assert plan(81, validate_every=25).validate_every == 25


def test_a_warmup_longer_than_the_run_warns(caplog):
    with caplog.at_level(logging.WARNING):
        budget = plan(81, warmup_updates=4000)
    assert budget.warmup_updates == 4000  # the user's number is kept, but said to be wrong
    (record,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    message = record.getMessage()
    assert "train.warmup_updates=4000 is longer than the whole run (810 updates)" in message
    assert "train.warmup_updates=auto" in message
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        plan(81, warmup_updates=400)
    assert not caplog.records


def test_the_budget_says_where_its_total_comes_from():
    by_updates = plan(81, max_updates=500, max_epochs=100)
    assert "budget: 500 updates: train.max_updates (81 per epoch)" in by_updates.describe()
    by_epochs = plan(81, max_updates=0, max_epochs=10)
    assert by_epochs.total_updates == 810
    assert "810 updates: train.max_epochs=10 x 81; train.max_updates=0: no cap" in (
        by_epochs.describe()
    )
    assert "source" not in by_epochs.as_dict()  # the record keeps its fields


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("dsq-cache")


@pytest.mark.slow
def test_an_epoch_budget_shows_its_total_and_eta(tmp_path, cache_dir):
    """No train.max_updates: the total comes from the epoch's batches, and the progress line,
    result.json and the validations follow it. 200 training pairs make an epoch of 7 updates."""
    root = tmp_path / "runs"
    replaced = ("train.validate_every", "task.sizes.train")
    args = [a for a in small(cache_dir, root) if not a.startswith(replaced)]
    args += ["task.sizes.train=200", "train.max_updates=0", "train.max_epochs=2",
             "train.warmup_updates=auto", "train.validate_every=auto"]  # fmt: skip
    done = subprocess.run([DSQ, "train", *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads((only_run(root) / "result.json").read_text())
    budget = result["budget"]
    total = budget["total_updates"]
    assert total == 2 * budget["updates_per_epoch"] == result["updates"]
    assert budget["warmup_updates"] == max(1, round(total / 10))
    first = next(line for line in done.stderr.splitlines() if line.startswith("update "))
    # the first update is the warm-up: no rate or ETA from it (the progress-line tests time them)
    assert first.startswith(f"update 1/{total} |") and first.endswith("| warming up")
    validations = [m["update"] for m in read_jsonl(only_run(root) / "metrics.jsonl")
                   if m["kind"] == "valid"]  # fmt: skip
    every = budget["validate_every"]
    assert every == min(budget["updates_per_epoch"], -(-total // 10))
    assert validations[: total // every] == [every * (i + 1) for i in range(total // every)]
