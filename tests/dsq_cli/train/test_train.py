"""`dsq train`: config errors, a short real run and its files, wandb, divergence, interrupt and
resume. Budgets are tiny (a few updates of a 2-layer model on a slice of the demo corpus)."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from helpers.runs import DSQ, one_thread, only_run, read_jsonl, small, wait_for_update
from typer.testing import CliRunner

from dsq_cli import runs
from dsq_cli.cli import app
from dsq_cli.run_result import RunResult
from dsq_cli.train.recorder import load_checkpoint

pytestmark = pytest.mark.slow  # trains, compiles or spawns processes (not in make test-fast)

RUNNER = CliRunner()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("dsq-cache")


def train(args):
    return RUNNER.invoke(app, ["train", *args])


# -- config errors: exit 2, one line, no run directory ------------------------------------------


@pytest.mark.parametrize(
    "override, message",
    [
        ("task=nope", "unknown task 'nope'; choose one of"),
        ("quant=int4", "unknown quant 'int4'; choose one of"),
        ("train.foo=1", "unknown config key 'train.foo'; keys there:"),
        ("quant.q1=bfp99", "invalid format spec 'bfp99'"),
        ("train.max_updates=-3", "train.max_updates must be a non-negative integer"),
        ("train.warmup_updates=-1", "train.warmup_updates must be a non-negative integer or auto"),
        ("train.validate_every=soon", "validate_every must be a non-negative integer or auto"),
        ("data.raw_dir=/no/such/dir", "data.raw_dir=/no/such/dir does not exist"),
        ("quant.q1.policy=sawtooth", "unknown precision policy 'sawtooth'; choose one of"),
        ("quant.q1.periods=3", "periods is a parameter of policy cyclic, not plateau"),
        ("quant.q1.policy=cyclic", "q1: policy cyclic: 32 periods do not fit in 8 updates"),
        ("quant.saved.norm=bf16", "set quant.stash_scope=all or drop quant.saved"),
    ],
)
def test_config_errors_exit_2_and_leave_no_run(tmp_path, cache_dir, override, message):
    root = tmp_path / "runs"
    if override.startswith("data.raw_dir"):
        args = ["task=multi30k", override, f"data.cache_dir={cache_dir}", f"run.root={root}"]
    else:
        args = small(cache_dir, root, override)
    result = train(args)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert result.output.count("\n") == 1  # one line, no traceback
    assert not root.exists() or not any(root.iterdir())


def test_a_checkpoint_rule_without_checkpointing_is_a_config_error(tmp_path, cache_dir):
    """quant.saved.checkpoint says what a checkpointed layer keeps: with no layer checkpointed
    it would be recorded and do nothing."""
    root = tmp_path / "runs"
    result = train(small(cache_dir, root, "quant.stash_scope=all", "+quant.saved.checkpoint=bfp8"))
    assert result.exit_code == 2, result.output
    assert "add train.activation_checkpointing=true, or drop the rule" in result.output
    assert not root.exists() or not any(root.iterdir())


def test_existing_run_dir_is_refused(tmp_path, cache_dir):
    taken = tmp_path / "taken"
    taken.mkdir()
    result = train(small(cache_dir, tmp_path / "runs", f"run.dir={taken}"))
    assert result.exit_code == 2
    assert "already exists" in result.output
    assert list(taken.iterdir()) == []


def test_print_config_resolves_groups_and_overrides(tmp_path, cache_dir):
    result = train(["--cfg", "task=multi30k", "quant=stash_bfp", "quant.q1=bfp3", "seed=7"])
    assert result.exit_code == 0, result.output
    assert "name: multi30k" in result.output
    assert "q1: bfp3" in result.output
    assert "seed: 7" in result.output
    assert "quant: stash_bfp" in result.output  # the group choices are recorded
    assert "name: transformer_tiny" in result.output  # multi30k's default model


def test_task_chooses_its_default_model_but_model_wins():
    from dsq_cli.config import compose

    assert compose([]).model.name == "transformer_small"
    assert compose(["task=iwslt17"]).model.name == "transformer_iwslt"
    assert compose(["task=iwslt17", "model=transformer_tiny"]).model.name == "transformer_tiny"


def test_schedule_override_on_a_plain_point_says_how():
    from dsq_cli.config import ConfigError, compose

    with pytest.raises(ConfigError, match=r"quant.q1=\{levels"):
        compose(["quant=bfp8", "quant.q1.levels=[bfp2,bfp4]"])
    cfg = compose(["quant=dsq", "quant.q1.levels=[bfp2,bfp4]"])
    assert list(cfg.quant.q1.levels) == ["bfp2", "bfp4"]


# -- one short run: every file of docs/spec.md §5, consistent with each other and with wandb ------


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, cache_dir):
    root = tmp_path_factory.mktemp("runs")
    secret = "wandb-secret-value-0123456789"
    os.environ["WANDB_API_KEY"] = secret
    try:
        # min_delta 100: after the first validation (which sets `best`) none counts as an
        # improvement, so the stash rises at every later one while a level is left.
        result = train(
            small(
                cache_dir,
                root,
                "train.validate_every=2",
                "logger=wandb",
                "logger.mode=offline",
                "quant.q1={levels: [bfp2, bfp3, bfp4], patience: 1, min_delta: 100}",
            )
        )
    finally:
        del os.environ["WANDB_API_KEY"]
    return result, only_run(root), secret


def test_short_run_completes_with_every_result_field(finished_run):
    result, run_dir, _ = finished_run
    assert result.exit_code == 0, result.output
    assert f"run: {run_dir}" in result.output
    res = json.loads((run_dir / "result.json").read_text())
    assert RunResult.problems(res) == []
    assert res["status"] == "completed"
    assert res["task"] == "demo" and res["metric"] == "bleu"
    assert res["quant"]["preset"] == "dsq" and res["quant"]["modified"] is True
    assert res["updates"] == 8
    assert res["value"] == res["bleu"] and 0 <= res["bleu"] <= 100
    assert res["bleu_signature"].startswith("nrefs:1|")
    assert res["wall_seconds"] > 0
    assert set(res["versions"]) >= {"python", "torch", "fairseq", "dsq_commit"}
    assert 0 < res["cost"]["arith_ratio"] < 1 and 0 < res["cost"]["dram_ratio"] < 1
    assert res["cost"]["baseline"] == "fixed32"
    memory = res["memory"]  # a CPU run; the first update packed its stashes in bfp2
    assert memory["peak_rss_mib"] > 0 and memory["cuda_peak_allocated_mib"] is None
    assert isinstance(memory["stash_bytes_per_step"], int) and memory["stash_bytes_per_step"] > 0
    for name in ("config.yaml", "metrics.jsonl", "schedule.jsonl", "train.log", "test.hyp"):
        assert (run_dir / name).is_file(), name
    assert (run_dir / "checkpoints" / "checkpoint_last.pt").is_file()


def test_metrics_and_schedule_agree_with_result(finished_run):
    _, run_dir, _ = finished_run
    res = json.loads((run_dir / "result.json").read_text())
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    train_lines = [m for m in metrics if m["kind"] == "train"]
    valid_lines = [m for m in metrics if m["kind"] == "valid"]
    (test_line,) = [m for m in metrics if m["kind"] == "test"]
    assert [m["update"] for m in train_lines] == list(range(1, 9))
    assert [m["update"] for m in valid_lines] == [2, 4, 6, 8]
    assert valid_lines[-1]["valid_loss"] == res["valid_loss"]
    assert min(m["valid_loss"] for m in valid_lines) == res["best_valid_loss"]
    assert test_line["bleu"] == res["bleu"]
    # Validations at 2 (sets best), 4 and 6 (each a level up), 8 (no level left).
    changes = read_jsonl(run_dir / "schedule.jsonl")
    assert [(c["update"], c["point"], c["from"], c["to"]) for c in changes] == [
        (4, "q1", "bfp2e8b16", "bfp3e8b16"),
        (6, "q1", "bfp3e8b16", "bfp4e8b16"),
    ]
    bits = ["bfp2e8b16"] * 4 + ["bfp3e8b16"] * 2 + ["bfp4e8b16"] * 2
    assert [m["bits"]["q1"] for m in train_lines] == bits
    assert res["bits_final"]["q1"] == "bfp4e8b16"
    assert res["stash_bits_mean"] == pytest.approx((2.5 * 4 + 3.5 * 2 + 4.5 * 2) / 8)
    assert [s["updates"] for s in res["precision_segments"]] == [4, 2, 2]


def test_wandb_offline_run_holds_the_same_final_numbers(finished_run):
    from helpers.wandb_records import summary_and_history

    _, run_dir, _ = finished_run
    res = json.loads((run_dir / "result.json").read_text())
    (run_file,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "*.wandb"))
    summary, history = summary_and_history(Path(run_file))
    assert summary["status"] == "completed"
    for key in ("bleu", "valid_loss", "best_valid_loss", "updates", "stash_bits_mean"):
        assert summary[key] == res[key], key
    assert summary["cost/arith_ratio"] == res["cost"]["arith_ratio"]
    assert summary["cost/dram_ratio"] == res["cost"]["dram_ratio"]
    logged_valid = [h["valid/valid_loss"] for h in history if "valid/valid_loss" in h]
    assert logged_valid[-1] == res["valid_loss"]
    assert any(h.get("schedule/q1_level") == 2 for h in history)


def test_no_secret_in_any_run_file(finished_run):
    _, run_dir, secret = finished_run
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path


def test_checkpoint_loads_with_weights_only(finished_run):
    _, run_dir, _ = finished_run
    path = run_dir / "checkpoints" / "checkpoint_last.pt"
    state = torch.load(path, map_location="cpu", weights_only=True)  # torch's safe loader
    assert state["num_updates"] == 8
    assert state["dsq_schedule"]["q1"]["level"] == 2
    assert load_checkpoint(path)["format"] == "dsq-checkpoint-1"


def test_fairseq_format_checkpoint_loads_without_disabling_safety(tmp_path):
    import argparse

    from dsq_cli.models.fairseq_checkpoint import load_fairseq_checkpoint

    path = tmp_path / "fairseq.pt"
    torch.save(
        {"args": argparse.Namespace(arch="roberta_base"), "model": {"w": torch.ones(2)}}, path
    )
    with pytest.raises(Exception, match="weights_only"):
        torch.load(path, weights_only=True)  # what fairseq's own loader runs into
    state = load_fairseq_checkpoint(path)
    assert state["args"].arch == "roberta_base"
    assert torch.equal(state["model"]["w"], torch.ones(2))


# -- faults -------------------------------------------------------------------------------------


def test_nan_loss_stops_as_diverged_and_keeps_the_last_good_checkpoint(
    tmp_path, cache_dir, monkeypatch
):
    from fairseq.trainer import Trainer

    original = Trainer.train_step
    calls = {"n": 0}

    def poisoned(self, samples, raise_oom=False):
        calls["n"] += 1
        if calls["n"] == 6:  # update 6: a weight turns NaN, so loss and gradients do too
            with torch.no_grad():
                next(self.model.parameters()).fill_(float("nan"))
        return original(self, samples, raise_oom)

    monkeypatch.setattr(Trainer, "train_step", poisoned)
    root = tmp_path / "runs"
    result = train(small(cache_dir, root, "train.validate_every=2"))
    assert result.exit_code == 3, result.output
    run_dir = only_run(root)
    res = json.loads((run_dir / "result.json").read_text())
    assert res["status"] == "diverged"
    assert "update 6" in res["error"]
    assert res["updates"] == 5 and res["value"] is None
    state = load_checkpoint(run_dir / "checkpoints" / "checkpoint_last.pt")
    assert state["num_updates"] == 4  # the last validated, finite state
    assert all(torch.isfinite(t).all() for t in state["model"].values() if t.is_floating_point())
    assert not (run_dir / "checkpoints" / "crash.pt").exists()


def test_sigterm_checkpoints_and_resume_matches_an_uninterrupted_run(tmp_path, cache_dir):
    # a stochastic stash: the resumed run must also continue the rounding noise's stream; stopped
    # in its second epoch (19 updates each): a later epoch's batches must be the same too
    args = small(cache_dir, tmp_path / "x", "train.max_updates=24", "train.validate_every=6",
                 "quant.rounding.q1=stochastic")  # fmt: skip
    # the uninterrupted run trains beside the one to be stopped, a thread each
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True,
             "env": one_thread()}  # fmt: skip
    straight = subprocess.Popen(
        [DSQ, "train", *[a for a in args if not a.startswith("run.root")],
         f"run.dir={tmp_path / 'straight'}"], **pipes,
    )  # fmt: skip
    stopped = tmp_path / "stopped"
    proc = subprocess.Popen(
        [DSQ, "train", *[a for a in args if not a.startswith("run.root")], f"run.dir={stopped}"],
        **pipes,
    )  # fmt: skip
    wait_for_update(stopped / "metrics.jsonl", 21, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err
    _, straight_err = straight.communicate(timeout=600)
    assert straight.returncode == 0, straight_err
    assert f"dsq train resume={stopped}" in err
    interrupted = json.loads((stopped / "result.json").read_text())
    assert interrupted["status"] == "interrupted"
    assert 21 <= interrupted["updates"] < 24
    assert [m["epoch"] for m in read_jsonl(stopped / "metrics.jsonl")][-1] == 2

    # a real change of what the run is made of is refused, naming the stored value
    for change, stored in [("logger=wandb", "logger=none"), ("seed=2", "seed=1"),
                           ("model.encoder_layers=5", "model.encoder_layers=")]:  # fmt: skip
        refused = train([f"resume={stopped}", change])
        assert refused.exit_code == 2, refused.output
        assert f"the run uses {stored}" in refused.output and "cannot change" in refused.output
        assert refused.output.count("\n") == 1

    # the command line the run was started with, repeated, is no change
    same = [a for a in args if not a.startswith("run.root")] + [f"run.dir={stopped}"]
    resumed = subprocess.run(
        [DSQ, "train", f"resume={stopped}", *same], capture_output=True, text=True, timeout=600,
        env=one_thread(),
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    a = json.loads((tmp_path / "straight" / "result.json").read_text())
    b = json.loads((stopped / "result.json").read_text())
    assert b["status"] == "completed" and b["resumed"] is True
    for key in ("updates", "valid_loss", "best_valid_loss", "bleu", "stash_bits_mean", "cost",
                "checkpoints"):  # fmt: skip
        assert a[key] == b[key], key
    for name in ("test.hyp", "test.last.hyp", "test.best.hyp"):
        straight_hyp = tmp_path / "straight" / name
        assert straight_hyp.is_file() == (stopped / name).is_file(), name
        if straight_hyp.is_file():
            assert straight_hyp.read_text() == (stopped / name).read_text(), name

    def losses(run_dir):
        return [(m["kind"], m["update"], m.get("loss", m.get("valid_loss")))
                for m in read_jsonl(run_dir / "metrics.jsonl")]  # fmt: skip

    assert losses(tmp_path / "straight") == losses(stopped)


def test_every_policy_continues_exactly_after_sigterm(tmp_path, cache_dir):
    # one run, a policy per point: q0 a decaying exp shape, q1 FracTrain's pfq (windows between
    # validations, thresholds loose enough to move in a tiny run), q2 CPT's cyclic; the plateau
    # policy is the test above's (quant=dsq). Stopped mid-run, resumed: the same level changes,
    # losses and result as a run never stopped.
    args = small(cache_dir, tmp_path / "x", "train.max_updates=12", "train.validate_every=2",
                 "quant.q0={levels: [bfp4, bfp6, bfp8], policy: shape, shape: exp, "
                 "direction: decay, periods: 2}",
                 "quant.q1.policy=pfq", "quant.q1.keep=2", "quant.q1.threshold=10",
                 "quant.q2={levels: [bfp4, bfp6, bfp8], policy: cyclic, periods: 3}")  # fmt: skip
    args = [a for a in args if not a.startswith("run.root")]
    # the uninterrupted run trains beside the one to be stopped (the suite's time)
    straight_dir = tmp_path / "straight"
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True,
             "env": one_thread()}  # fmt: skip
    straight = subprocess.Popen([DSQ, "train", *args, f"run.dir={straight_dir}"], **pipes)
    stopped = tmp_path / "stopped"
    proc = subprocess.Popen([DSQ, "train", *args, f"run.dir={stopped}"], **pipes)
    wait_for_update(stopped / "metrics.jsonl", 7, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert json.loads((stopped / "result.json").read_text())["updates"] < 12
    resumed = subprocess.run([DSQ, "train", f"resume={stopped}"], capture_output=True,
                             text=True, timeout=600, env=one_thread())  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    _, err = straight.communicate(timeout=600)
    assert straight.returncode == 0, err

    changes = read_jsonl(straight_dir / "schedule.jsonl")
    assert {c["policy"] for c in changes} == {"shape", "pfq", "cyclic"}, changes
    assert read_jsonl(stopped / "schedule.jsonl") == changes
    a = json.loads((straight_dir / "result.json").read_text())
    b = json.loads((stopped / "result.json").read_text())
    for key in ("updates", "valid_loss", "precision_segments", "stash_bits_mean", "cost"):
        assert a[key] == b[key], key
    assert [m.get("loss", m.get("valid_loss")) for m in read_jsonl(stopped / "metrics.jsonl")] == [
        m.get("loss", m.get("valid_loss")) for m in read_jsonl(straight_dir / "metrics.jsonl")
    ]


def test_resume_refuses_a_completed_run(finished_run):
    _, run_dir, _ = finished_run
    result = train([f"resume={run_dir}"])
    assert result.exit_code == 2
    assert "already completed" in result.output


def test_two_runs_started_at_once_get_two_directories(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        dirs = list(pool.map(lambda _: runs.new_run_dir(tmp_path, "same-name"), range(16)))
    assert len(set(dirs)) == 16


def test_a_failure_after_training_is_recorded_not_left_running(tmp_path, cache_dir, monkeypatch):
    from dsq_cli.train import rank_run

    def broken_cost(gemm_shapes, segments):
        raise ValueError("dram: expected keys [...]")

    monkeypatch.setattr(rank_run, "run_cost", broken_cost)
    root = tmp_path / "runs"
    result = train(small(cache_dir, root, "train.max_updates=2", "train.validate_every=2"))
    assert result.exit_code == 1, result.output
    res = json.loads((only_run(root) / "result.json").read_text())
    assert res["status"] == "failed"
    assert "summarising the run: ValueError: dram" in res["error"]


def test_a_runs_record_holds_the_rules_in_force_under_all_and_none_under_gemm():
    """result.json's quant: the rules with their defaults under stash_scope=all (no preset file
    writes them), nothing new for the paper's scope; the preset's own run is not modified."""
    from dsq.engine.spec import SAVED_DEFAULT
    from dsq_cli.presets import load_quant_preset
    from dsq_cli.train.rank_run import recorded_quant

    dsq = load_quant_preset("dsq")
    assert recorded_quant("dsq", dict(dsq)) == {"preset": "dsq", **dsq, "modified": False}
    record = recorded_quant("dsq", dsq | {"stash_scope": "all", "saved": {"norm": "bf16"}})
    assert record["saved"] == dict(SAVED_DEFAULT) | {"norm": "bf16"}
    assert record["modified"] is True
