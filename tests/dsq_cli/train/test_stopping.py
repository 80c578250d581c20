"""Stopping early (``train.stop_patience``, docs/training.md "Stopping early") and the best
validation's checkpoint, on a scripted trainer: the shared loop with a model of one Linear and
validation losses read from a list, so that every stop is known in advance."""

from __future__ import annotations

import json

import pytest
import yaml
from helpers.runs import only_run, read_jsonl, small
from helpers.scripted import FP32, Scripted
from typer.testing import CliRunner

from dsq_cli.cli import app
from dsq_cli.config import compose, to_plain
from dsq_cli.run_result import RunResult
from dsq_cli.train import loop
from dsq_cli.train.rank_run import trained_result
from dsq_cli.train.recorder import load_checkpoint
from dsq_cli.train.stop import Interrupted

# Validations every 2 updates. The best is 3.0 at update 6, equalled (no improvement) at 10,
# beaten by 2.9 at 12, equalled at 16: with patience 3 the run stops at update 18, the third
# validation in a row without a loss below 2.9.
LOSSES = [5.0, 4.0, 3.0, 3.5, 3.0, 2.9, 3.1, 2.9, 3.0, 1.0, 1.0, 1.0] + [0.5] * 20
IMPROVED_AT = [2, 4, 6, 12]
STOP_REASON = "validation loss has not improved for 3 validations (best 2.900 at update 12)"


def scripted(run_dir, losses=LOSSES, **options) -> Scripted:
    return Scripted.standalone(run_dir, losses, **options)


@pytest.fixture
def saved(monkeypatch):
    """Every checkpoint the loop writes: (file name, the update its model was trained to)."""
    writes: list[tuple[str, int]] = []
    original = loop.save_checkpoint

    def recording(path, state):
        writes.append((path.name, int(state["model"]["at"])))
        original(path, state)

    monkeypatch.setattr(loop, "save_checkpoint", recording)
    return writes


def test_patience_stops_at_the_third_validation_without_improvement(tmp_path, saved):
    trainer = scripted(tmp_path).run()
    assert trainer.updates == 18
    assert trainer.progress["stopped_early"] == {"update": 18, "reason": STOP_REASON}
    # no second validation at the end: the stop came at a validation
    assert trainer.validated == list(range(2, 19, 2))
    assert trainer.progress["validations_without_improvement"] == 3
    assert (trainer.progress["best_valid_loss"], trainer.progress["best_valid_update"]) == (2.9, 12)
    # checkpoint_best.pt is written at the improvements only, before checkpoint_last.pt
    assert [u for name, u in saved if name == "checkpoint_best.pt"] == IMPROVED_AT
    assert saved[:2] == [("checkpoint_best.pt", 2), ("checkpoint_last.pt", 2)]
    assert [u for name, u in saved if name == "checkpoint_last.pt"] == [*range(2, 19, 2), 18]
    best = load_checkpoint(tmp_path / "checkpoints" / "checkpoint_best.pt")
    assert best["num_updates"] == 12 and int(best["model"]["at"]) == 12


def test_result_json_budget_records_the_cap_and_the_stop(tmp_path):
    trainer = scripted(tmp_path).run()
    started = RunResult("completed", "demo", {"preset": "fp32", **FP32}, "bleu", value=1.0)
    result = trained_result(started, trainer)
    assert result.budget == {
        "total_updates": 40,
        "updates_per_epoch": 1000,
        "warmup_updates": 1,
        "validate_every": 2,
        "stop_patience": 3,
        "stopped_early": {"update": 18, "reason": STOP_REASON},
    }
    assert result.updates == 18 and result.stopped_early["update"] == 18
    assert RunResult.from_dict(result.to_dict()).budget == result.budget


def test_a_stall_at_the_cap_is_not_an_early_stop(tmp_path):
    trainer = scripted(tmp_path, max_updates=18).run()
    assert trainer.updates == 18 and trainer.progress["stopped_early"] is None


def test_patience_0_trains_to_the_cap(tmp_path):
    trainer = scripted(tmp_path, stop_patience=0).run()
    assert trainer.updates == 40 and trainer.progress["stopped_early"] is None
    assert trainer.validated == list(range(2, 41, 2))
    # 0.5 first at update 26; equal losses later are no improvement
    assert trainer.progress["best_valid_update"] == 26


@pytest.mark.parametrize("interrupt_at", [15, 16, 18])
def test_a_resume_mid_patience_stops_where_an_uninterrupted_run_does(tmp_path, interrupt_at):
    """SIGTERM at update 15 (one validation without improvement counted), 16 (two) and 18 (the
    stopping validation itself): the resumed run stops at update 18 with the same reason, and
    validates each update once over both processes."""
    first = scripted(tmp_path, interrupt_at=interrupt_at)
    with pytest.raises(Interrupted):
        first.run()
    state = load_checkpoint(tmp_path / "checkpoints" / "checkpoint_last.pt")
    assert state["num_updates"] == interrupt_at
    resumed = scripted(tmp_path).run(state)
    assert resumed.updates == 18
    assert resumed.progress["stopped_early"] == {"update": 18, "reason": STOP_REASON}
    assert first.validated + resumed.validated == list(range(2, 19, 2))
    assert resumed.progress["best_valid_update"] == 12
    best = load_checkpoint(tmp_path / "checkpoints" / "checkpoint_best.pt")
    assert int(best["model"]["at"]) == 12


def test_the_budget_line_names_the_cap(tmp_path, caplog):
    with caplog.at_level("INFO"):
        scripted(tmp_path).run()
    text = caplog.text
    assert "stops early after 3 validations without improvement (40 updates is the cap)" in text
    assert f"stopped early at update 18: {STOP_REASON}; cap 40" in text


# -- the config keys ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.stop_patience=-1", "train.stop_patience must be a non-negative integer, got -1"),
        ("train.stop_patience=soon", "train.stop_patience must be a non-negative integer, got "),
        ("eval.checkpoint=middle", "eval.checkpoint must be best or last, got 'middle'"),
    ],
)
def test_bad_values_exit_2_with_one_line_and_no_run(tmp_path, override, message):
    root = tmp_path / "runs"
    result = CliRunner().invoke(app, ["train", override, "logger=none", f"run.root={root}"])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert result.output.count("\n") == 1
    assert not root.exists()


def test_the_defaults_are_off_and_best():
    cfg = compose([])
    assert cfg.train.stop_patience == 0 and cfg.eval.checkpoint == "best"


def test_a_run_from_before_the_keys_resumes_as_it_started(tmp_path):
    """A stored config.yaml without the keys gets the values its run was started under: no early
    stop, the final model scored; config.yaml is rewritten with them."""
    from dsq_cli.train import load_resume
    from dsq_cli.train.recorder import save_checkpoint

    plain = to_plain(compose(["task=demo", f"run.root={tmp_path}"]))
    del plain["train"]["stop_patience"], plain["eval"]["checkpoint"]
    run = tmp_path / "old-run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(plain))
    save_checkpoint(run / "checkpoints" / "checkpoint_last.pt", {"num_updates": 3})
    cfg, _ = load_resume(str(run), [f"resume={run}"])
    assert cfg.train.stop_patience == 0 and cfg.eval.checkpoint == "last"
    stored = yaml.safe_load((run / "config.yaml").read_text())
    assert stored["train"]["stop_patience"] == 0 and stored["eval"]["checkpoint"] == "last"
    cfg, _ = load_resume(str(run), [f"resume={run}", "train.stop_patience=4"])
    assert cfg.train.stop_patience == 4


# -- a demo run that stops early ----------------------------------------------------------------


@pytest.mark.slow
def test_a_demo_run_stops_early_and_scores_both_models(tmp_path):
    """lr 1e-12 leaves every weight as it was, so the validation loss repeats exactly: the best
    is the first validation's (update 2), and patience 2 ends the run at update 6 of 8, with no
    validation after the stop and both models scored."""
    root = tmp_path / "runs"
    args = small(tmp_path / "cache", root, "train.validate_every=2", "train.lr=1e-12",
                 "train.stop_patience=2")  # fmt: skip
    result = CliRunner().invoke(app, ["train", *args])
    assert result.exit_code == 0, result.output
    assert "stopped early at update 6: validation loss has not improved for 2 validations" in (
        result.output
    )
    run_dir = only_run(root)
    record = json.loads((run_dir / "result.json").read_text())
    assert record["status"] == "completed" and record["updates"] == 6
    assert record["budget"]["total_updates"] == 8 and record["budget"]["stop_patience"] == 2
    assert record["budget"]["stopped_early"]["update"] == 6
    valid = [m["update"] for m in read_jsonl(run_dir / "metrics.jsonl") if m["kind"] == "valid"]
    assert valid == [2, 4, 6]
    checkpoints = record["checkpoints"]
    assert (checkpoints["best"]["update"], checkpoints["last"]["update"]) == (2, 6)
    assert checkpoints["best"]["valid_loss"] == checkpoints["last"]["valid_loss"]
    assert record["eval_checkpoint"] == "best" and record["value"] == checkpoints["best"]["bleu"]
    assert (run_dir / "test.hyp").is_file() and (run_dir / "test.last.hyp").is_file()
    best = load_checkpoint(run_dir / "checkpoints" / "checkpoint_best.pt")
    assert best["num_updates"] == 2
