"""Runs survive faults (docs/training.md, "Faults and exit codes"): an unreadable checkpoint, a
torn line in the run's JSON-lines files, temporary files a kill left, a disk that fills while
checkpointing, a NaN loss in training and in validation, a resume that must bring back a moving
precision ladder, and resumes of what is not a resumable run. In each case the records up to the
last good checkpoint remain.

Runs here go through `dsq train`'s own path (the CLI, `entry`, `rank_run`, the run directory's
files) with the scripted trainer of helpers/scripted.py, or GLUE's trainer with a stand-in
encoder: a whole run takes about a second."""

from __future__ import annotations

import errno
import logging
import subprocess

import pytest
import torch
from helpers.runs import read_jsonl
from helpers.scripted import SCRIPTED, scripted_config, use_scripted_family
from typer.testing import CliRunner

import dsq.atomic_files
from dsq_cli import sweep
from dsq_cli.cli import app
from dsq_cli.config import compose
from dsq_cli.data.glue import GlueData
from dsq_cli.data.glue.reader import GlueExample
from dsq_cli.data.glue.tasks import get_glue_task
from dsq_cli.models.encoders import Encoder
from dsq_cli.run_result import RunResult
from dsq_cli.train import glue, load_resume, train
from dsq_cli.train.glue import GlueTrainer
from dsq_cli.train.rank_run import run_rank
from dsq_cli.train.recorder import load_checkpoint

RUNNER = CliRunner()
# The scripted runs' validation losses (every 2 updates): each validation improves, so
# checkpoint_best.pt is the latest validation's.
FALLING = [5.0 - 0.25 * k for k in range(12)]
INTERRUPTED_AT = 7  # a SIGTERM during update 7: checkpoint_last.pt at 7, checkpoint_best.pt at 6


@pytest.fixture
def family(monkeypatch):
    return use_scripted_family(monkeypatch, FALLING)


def dsq_train(*args):
    return RUNNER.invoke(app, ["train", *args])


def interrupted_run(family, run_dir):
    """A scripted run stopped by SIGTERM during update 7 (exit 143)."""
    family.interrupt_at = INTERRUPTED_AT
    outcome = train(scripted_config(run_dir))
    family.interrupt_at = None
    assert outcome.status == "interrupted" and outcome.exit_code == 143
    return run_dir


def records(run_dir, name="metrics.jsonl"):
    """A JSON-lines file of the run without its wall-clock times (which differ run to run)."""
    return [{k: v for k, v in r.items() if k != "wall_seconds"} for r in read_jsonl(run_dir / name)]


def straight_records(family, run_dir):
    """metrics.jsonl of the same run trained without a stop."""
    assert train(scripted_config(run_dir)).status == "completed"
    return records(run_dir)


def resume(run_dir, *overrides):
    cfg, resumed = load_resume(str(run_dir), [f"resume={run_dir}", *overrides])
    return train(cfg, resume=resumed)


# -- an unreadable checkpoint ---------------------------------------------------------------------


def cut_short(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {
    "empty": lambda path: path.write_bytes(b""),
    "truncated": cut_short,
    "garbage": lambda path: path.write_bytes(b"\x80\x02not a checkpoint at all\n" * 64),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_an_unreadable_checkpoint_is_one_line_and_resume_from_best_continues(
    tmp_path, family, damage
):
    """exit 2 and one line naming the file and the checkpoint to continue from; result.json says
    failed (the rest of it, the metrics and checkpoint_best.pt as they were); resume_from=best
    continues from update 6 and ends as a run never stopped."""
    straight = straight_records(family, tmp_path / "straight")
    run_dir = interrupted_run(family, tmp_path / "run")
    last = run_dir / "checkpoints" / "checkpoint_last.pt"
    metrics_before = (run_dir / "metrics.jsonl").read_text()
    DAMAGE[damage](last)

    refused = dsq_train(f"resume={run_dir}")
    assert refused.exit_code == 2, refused.output
    assert refused.output.count("\n") == 1
    assert refused.output.startswith(f"dsq: error: resume={run_dir}: corrupt checkpoint: {last} ")
    assert (
        f"{run_dir}/checkpoints/checkpoint_best.pt (update 6) can be read: continue from it with "
        f"`dsq train resume={run_dir} resume_from=best`"
    ) in refused.output
    result = RunResult.read(run_dir)
    assert result.status == "failed" and result.checkpoint_unreadable
    assert result.updates == INTERRUPTED_AT  # what the interrupted run recorded stays
    assert (run_dir / "metrics.jsonl").read_text() == metrics_before
    assert load_checkpoint(run_dir / "checkpoints" / "checkpoint_best.pt")["num_updates"] == 6

    resumed = dsq_train(f"resume={run_dir}", "resume_from=best")
    assert resumed.exit_code == 0, resumed.output
    result = RunResult.read(run_dir)
    assert result.status == "completed" and result.resumed and result.error is None
    assert records(run_dir) == straight  # update 7's records were dropped and trained again
    assert load_checkpoint(last)["num_updates"] == 12
    # resume_from chose the checkpoint of that resume only: config.yaml keeps last
    assert "resume_from: last" in (run_dir / "config.yaml").read_text()


def test_with_no_readable_checkpoint_left_the_run_is_to_be_started_again(tmp_path, family):
    run_dir = interrupted_run(family, tmp_path / "run")
    for name in ("last", "best"):
        (run_dir / "checkpoints" / f"checkpoint_{name}.pt").write_bytes(b"")
    refused = dsq_train(f"resume={run_dir}")
    assert refused.exit_code == 2 and refused.output.count("\n") == 1
    assert "checkpoint_last.pt is empty; the run has no other checkpoint that can be read: " in (
        refused.output
    )
    refused = dsq_train(f"resume={run_dir}", "resume_from=best")
    assert refused.exit_code == 2, refused.output
    assert f"corrupt checkpoint: {run_dir}/checkpoints/checkpoint_best.pt is empty" in (
        refused.output
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["resume_from=best"],
            "resume_from=best chooses the checkpoint of a resume; give it with ",
        ),
        (["resume_from=middle"], "resume_from must be last or best, got 'middle'"),
    ],
)
def test_resume_from_outside_a_resume_or_unknown_is_a_usage_error(tmp_path, args, message):
    root = tmp_path / "runs"
    result = dsq_train(*args, "logger=none", f"run.root={root}")
    assert result.exit_code == 2 and result.output.count("\n") == 1
    assert message in result.output
    assert not root.exists()


@pytest.mark.slow
def test_a_sweep_reports_a_run_with_an_unreadable_checkpoint_failed_and_tries_it_once(
    tmp_path, family, monkeypatch
):
    """--resume-unfinished tries the run once: `dsq train resume=` finds the checkpoint
    unreadable and records it; later passes report it failed with that reason and launch
    nothing, until --force sets it aside and runs the job afresh."""
    launched = []

    def in_process(command, stdout, stderr, env):  # `python -m dsq_cli.cli train ...`, here
        launched.append(command[3:])
        result = RUNNER.invoke(app, command[3:])
        stdout.write(result.output)
        return subprocess.CompletedProcess(command, result.exit_code)

    monkeypatch.setattr(sweep.subprocess, "run", in_process)
    root = tmp_path / "sweep"
    job = root / "job"  # nothing varies: the one job's name
    overrides = [*SCRIPTED, f"run.root={root}"]

    family.interrupt_at = INTERRUPTED_AT
    _, (first,) = sweep.run(overrides)
    assert first.status == "interrupted" and first.detail == "stopped by SIGTERM"
    family.interrupt_at = None
    (job / "checkpoints" / "checkpoint_last.pt").write_bytes(b"")

    for _ in range(2):  # the first pass tries it, the second does not
        _, (stuck,) = sweep.run(overrides, resume_unfinished=True)
        assert stuck.status == "failed", stuck
        assert stuck.detail.startswith(f"corrupt checkpoint: {job}/checkpoints/checkpoint_last.pt")
        assert "resume_from=best" in stuck.detail
        assert [c[1:] for c in launched[1:]] == [[f"resume={job}"]]  # once, on the first pass
        assert f"job  failed      {stuck.log}: corrupt checkpoint: " in sweep.summary([stuck])
        assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == [
            "job",
            "job.log",
        ]  # left as it is: not set aside

    _, (forced,) = sweep.run(overrides, resume_unfinished=True, force=True)
    assert forced.status == "completed"
    assert not launched[-1][-1].startswith("resume=")  # a new run, the old one kept aside
    assert len(list(root.glob("job.old-*"))) == 1


# -- torn lines, stale temporary files ------------------------------------------------------------


def test_a_torn_last_line_is_dropped_on_resume_with_a_warning(tmp_path, family, caplog):
    """A kill mid-write leaves half a line at the end of metrics.jsonl or schedule.jsonl; the
    resume drops it, says so, and the run ends as one never stopped."""
    straight = straight_records(family, tmp_path / "straight")
    run_dir = interrupted_run(family, tmp_path / "run")
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "loss": 1.0, "upd')
    with open(run_dir / "schedule.jsonl", "a") as f:
        f.write('{"from": "bfp2e8b16", "poi')
    with caplog.at_level(logging.WARNING):
        outcome = resume(run_dir)
    assert outcome.status == "completed", outcome.result.error
    assert records(run_dir) == straight
    assert records(run_dir, "schedule.jsonl") == []
    for name in ("metrics.jsonl", "schedule.jsonl"):
        assert f"{run_dir / name}: dropped its last line, cut short by a kill mid-write" in (
            caplog.text
        )


def test_a_bad_line_before_the_last_fails_the_resume_naming_it(tmp_path, family):
    run_dir = interrupted_run(family, tmp_path / "run")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    lines[2] = lines[2][:10]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    outcome = resume(run_dir)
    assert outcome.status == "failed"
    assert f"{run_dir / 'metrics.jsonl'}:3: not a JSON object, and not the last line" in (
        outcome.result.error
    )


def test_stale_temporary_files_are_removed_when_the_run_starts_again(tmp_path, family, caplog):
    """A SIGKILL during an atomic write leaves its temporary file (a checkpoint's as large as the
    checkpoint); the next start of that run removes them, and only them."""
    run_dir = interrupted_run(family, tmp_path / "run")
    stale = [
        run_dir / "checkpoints" / ".checkpoint_last.pt.0badc0de.tmp",
        run_dir / ".result.json.12345678.tmp",
        run_dir / ".metrics.jsonl.abcdef01.tmp",
    ]
    for path in stale:
        path.write_bytes(b"half of a file")
    kept = [run_dir / "notes.tmp", run_dir / "checkpoints" / ".hidden.tmp"]
    for path in kept:
        path.write_text("not dsq's")
    with caplog.at_level(logging.WARNING):
        outcome = resume(run_dir)
    assert outcome.status == "completed", outcome.result.error
    assert not any(path.exists() for path in stale)
    assert all(path.exists() for path in kept)
    for path in stale:
        assert f"removed {path}, left by a write that a kill interrupted" in caplog.text
    assert load_checkpoint(run_dir / "checkpoints" / "checkpoint_last.pt")["num_updates"] == 12


# -- a save that fails -----------------------------------------------------------------------------


def test_a_full_disk_while_checkpointing_leaves_result_json_failed_with_the_reason(
    tmp_path, family, monkeypatch
):
    """From update 4 on no new file can be made (the disk is full): the checkpoint of the
    validation at 4 fails, and so does result.json's atomic write; result.json says failed,
    naming the file and the full disk, and the checkpoint of update 2 and every record stay."""
    create = dsq.atomic_files._create_temporary

    def disk_full_from_update_4(path):
        if family.trainers and family.trainers[-1].updates >= 4:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return create(path)

    monkeypatch.setattr(dsq.atomic_files, "_create_temporary", disk_full_from_update_4)
    run_dir = tmp_path / "run"
    outcome = train(scripted_config(run_dir))
    assert (outcome.status, outcome.exit_code) == ("failed", 1)
    result = RunResult.read(run_dir)
    assert result.status == "failed"
    assert result.error.startswith(
        f"CheckpointNotSaved: could not save {run_dir}/checkpoints/checkpoint_best.pt: "
        "[Errno 28] No space left on device"
    )
    assert result.updates == 4 and result.finished_at is not None
    assert load_checkpoint(run_dir / "checkpoints" / "checkpoint_last.pt")["num_updates"] == 2
    logged = [(r["kind"], r["update"]) for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert logged == [("train", 1), ("train", 2), ("valid", 2), ("train", 3), ("train", 4),
                      ("valid", 4)]  # fmt: skip
    assert not list(run_dir.rglob("*.tmp"))


def test_a_checkpoint_save_that_fails_midway_leaves_the_last_good_one(
    tmp_path, family, monkeypatch
):
    """torch's writer fails halfway through checkpoint_last.pt at update 6: result.json says
    failed, naming the file; the half-written temporary file is gone, checkpoint 4 stays."""
    from dsq_cli.train import recorder

    save = torch.save

    def fails_at_update_6(state, path):
        if state["num_updates"] == 6 and "checkpoint_last" in str(path):
            path.write_bytes(b"PK\x03\x04 half")
            raise RuntimeError("[enforce fail at inline_container.cc:778] . PytorchStreamWriter "
                               "failed writing file data/3: file write failed")  # fmt: skip
        save(state, path)

    monkeypatch.setattr(recorder.torch, "save", fails_at_update_6)
    run_dir = tmp_path / "run"
    outcome = train(scripted_config(run_dir))
    assert (outcome.status, outcome.exit_code) == ("failed", 1)
    error = RunResult.read(run_dir).error
    assert error.startswith(
        f"CheckpointNotSaved: could not save {run_dir}/checkpoints/checkpoint_last.pt: "
    )
    assert "PytorchStreamWriter failed writing file data/3: file write failed" in error
    assert load_checkpoint(run_dir / "checkpoints" / "checkpoint_last.pt")["num_updates"] == 4
    assert not list(run_dir.rglob("*.tmp"))


# -- NaN: in validation, in GLUE training ----------------------------------------------------------


@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_a_nan_or_infinite_validation_loss_ends_the_run_diverged_at_its_update(
    tmp_path, monkeypatch, bad
):
    use_scripted_family(monkeypatch, [5.0, 4.0, float(bad)] + FALLING)
    run_dir = tmp_path / "run"
    outcome = train(scripted_config(run_dir))
    assert (outcome.status, outcome.exit_code) == ("diverged", 3)
    result = RunResult.read(run_dir)
    assert result.status == "diverged" and result.error == f"validation loss is {bad} at update 6"
    assert result.updates == 6 and result.value is None
    assert load_checkpoint(run_dir / "checkpoints" / "checkpoint_last.pt")["num_updates"] == 4
    valid = [r["update"] for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "valid"]
    assert valid == [2, 4]  # the NaN validation is not booked


class TinyClassifier(torch.nn.Module):
    """Stands in for a GLUE encoder with its head: the mean of the token embeddings, one
    Linear."""

    def __init__(self, num_classes):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 8)
        self.head = torch.nn.Linear(8, num_classes)

    def forward(self, tokens, features_only=True, classification_head_name=None):
        return self.head(self.embed(tokens).mean(1)), None


class WordLengths:
    """Stands in for a tokenizer: a word's id is its length."""

    pad_index = 0

    def encode(self, text_a, text_b, max_length):
        words = f"{text_a} {text_b or ''}".split()
        return [1 + len(word) % 30 for word in words][:max_length]


def sst2_examples(n):
    return [GlueExample(f"{'good ' * (i % 3 + 1)}film" if i % 2 else "bad", None, i % 2)
            for i in range(n)]  # fmt: skip


@pytest.mark.parametrize("bad", ["nan", "inf"])
@pytest.mark.parametrize(
    "poisoned, error, updates, checkpoint",
    [
        ("train_step", "training loss is {} at update 3", 2, 2),
        ("dev_scores", "validation loss is {} at update 4", 4, 2),
    ],
)
def test_nan_or_inf_in_glue_ends_the_run_diverged_at_its_update(
    tmp_path, monkeypatch, poisoned, error, updates, checkpoint, bad
):
    """A GLUE run (its own trainer, a stand-in encoder) whose weights turn NaN before its third
    update, or before its second validation (update 4), or whose head then forbids class 0 (a
    logit of -inf: an infinite loss on every example of that class): diverged (exit 3), the
    error naming the loss and the update, the checkpoint of update 2 and the records before
    kept."""
    error = error.format(bad)
    monkeypatch.setattr(glue, "build_encoder", lambda model_cfg, num_classes: Encoder(
        TinyClassifier(num_classes), WordLengths(), "a stand-in"))  # fmt: skip
    original = getattr(GlueTrainer, poisoned)
    calls = {"n": 0}

    def poisoning(self, *args):
        calls["n"] += 1
        if calls["n"] == (3 if poisoned == "train_step" else 2):
            with torch.no_grad():
                if bad == "nan":
                    self.model.head.weight.fill_(float("nan"))
                else:
                    self.model.head.weight.zero_()
                    self.model.head.bias.copy_(torch.tensor([-float("inf"), 0.0]))
        return original(self, *args)

    monkeypatch.setattr(GlueTrainer, poisoned, poisoning)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = compose(["task=sst2", "model=roberta_tiny", "logger=none", "quant=fp32",
                   "train.max_updates=6", "train.batch_size=4", "train.validate_every=2",
                   "train.warmup_updates=1", "train.log_every=1",
                   f"run.dir={run_dir}"])  # fmt: skip
    data = GlueData(get_glue_task("sst2"), sst2_examples(16), sst2_examples(8), "in memory")
    monkeypatch.setattr("dsq_cli.runs.versions", lambda: {"python": "3"})
    outcome = run_rank(cfg, run_dir, device="cpu", data=data)
    assert (outcome.status, outcome.exit_code) == ("diverged", 3)
    result = RunResult.read(run_dir)
    assert result.status == "diverged" and result.error == error
    assert result.updates == updates and result.value is None
    state = load_checkpoint(run_dir / "checkpoints" / "checkpoint_last.pt")
    assert state["num_updates"] == checkpoint
    assert all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point())
    trained = [r["update"] for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert trained == list(range(1, updates + 1))


# -- a resume that restores a moving schedule ------------------------------------------------------

# q1 climbs a plateau ladder with patience 2: the validations at 2, 4, 6 do not improve on the
# first, so it moves to bfp4 after update 6 (best 5.0, bad 0); 8 does not improve (bad 1). The
# SIGTERM comes at update 9. A resume must continue at bfp4 with best 5.0 and bad 1: then the
# validation at 10 is the second without improvement and moves q1 to bfp8. A level, best or bad
# not restored would leave q1 at bfp2 or bfp4 after update 10.
LADDER = "quant.q1={levels: [bfp2, bfp4, bfp8], patience: 2}"
STALLING = [5.0, 5.0, 5.0, 5.5, 5.2, 5.0]


def test_a_resume_restores_a_moving_schedule(tmp_path, monkeypatch):
    family = use_scripted_family(monkeypatch, STALLING)
    straight_dir, run_dir = tmp_path / "straight", tmp_path / "run"
    assert train(scripted_config(straight_dir, LADDER)).status == "completed"
    moves = [(c["update"], c["to"]) for c in read_jsonl(straight_dir / "schedule.jsonl")]
    assert moves == [(6, "bfp4e8b16"), (10, "bfp8e8b16")]

    family.interrupt_at = 9
    assert train(scripted_config(run_dir, LADDER)).status == "interrupted"
    family.interrupt_at = None
    state = load_checkpoint(run_dir / "checkpoints" / "checkpoint_last.pt")
    assert state["num_updates"] == 9
    assert state["dsq_schedule"]["q1"]["level"] == 1  # bfp4
    q1 = state["dsq_schedule"]["q1"]
    assert (q1["policy"], q1["best"], q1["bad"]) == ("plateau", 5.0, 1)

    assert resume(run_dir).status == "completed"
    in_force = {r["update"]: r["bits"]["q1"] for r in read_jsonl(run_dir / "metrics.jsonl")
                if r["kind"] == "train"}  # fmt: skip
    assert in_force[10] == "bfp4e8b16" and in_force[11] == "bfp8e8b16"
    assert records(run_dir) == records(straight_dir)
    assert records(run_dir, "schedule.jsonl") == records(straight_dir, "schedule.jsonl")
    a, b = RunResult.read(straight_dir), RunResult.read(run_dir)
    assert a.precision_segments == b.precision_segments and a.bits_final == b.bits_final
    assert b.resumed is True
    final = [load_checkpoint(d / "checkpoints" / "checkpoint_last.pt")["dsq_schedule"]
             for d in (straight_dir, run_dir)]  # fmt: skip
    assert final[0] == final[1]


# -- resuming what is not a resumable run ----------------------------------------------------------


def test_resuming_a_directory_that_is_not_a_run_is_refused_in_one_line(tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("x")
    for target, message in [
        (notes, f"resume={notes}: no config.yaml there; is it a dsq run directory?"),
        (tmp_path / "nowhere", f"resume={tmp_path / 'nowhere'}: no such directory"),
    ]:
        result = dsq_train(f"resume={target}")
        assert result.exit_code == 2 and result.output.count("\n") == 1
        assert message in result.output
    assert sorted(p.name for p in notes.iterdir()) == ["todo.txt"]  # nothing written there


def test_resuming_a_run_without_a_checkpoint_is_refused_in_one_line(tmp_path, family):
    """A run killed before its first checkpoint: refused, nothing written; one killed between
    its first checkpoint_best.pt and checkpoint_last.pt: told to resume from best."""
    run_dir = interrupted_run(family, tmp_path / "run")
    result_before = (run_dir / "result.json").read_text()
    best = run_dir / "checkpoints" / "checkpoint_best.pt"
    best.rename(tmp_path / "best.pt")
    (run_dir / "checkpoints" / "checkpoint_last.pt").unlink()
    refused = dsq_train(f"resume={run_dir}")
    assert refused.exit_code == 2 and refused.output.count("\n") == 1
    assert (
        f"resume={run_dir}: no {run_dir}/checkpoints/checkpoint_last.pt (the run stopped before "
        "it wrote one); the run has no other checkpoint that can be read: start it again instead"
    ) in refused.output
    assert (run_dir / "result.json").read_text() == result_before
    (tmp_path / "best.pt").rename(best)
    refused = dsq_train(f"resume={run_dir}")
    assert refused.exit_code == 2
    assert f"{best} (update 6) can be read: continue from it with " in refused.output
