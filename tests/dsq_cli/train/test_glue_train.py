"""`dsq train` on GLUE: a few updates of roberta_tiny (from scratch) and of the pretrained MiniLM
on the real SST-2, RTE and CoLA copies, their run files, resume after SIGTERM, usage errors, and
the GLUE columns of `dsq table`. Budgets are tiny: these check the machinery, not the accuracy
(docs/results.md has the real runs)."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
from helpers.encoders import write_roberta_release
from helpers.paths import SHARED_DATA
from helpers.runs import DSQ, only_run, read_jsonl, wait_for_update
from helpers.table_runs import result_json, write_run
from typer.testing import CliRunner

from dsq_cli.cli import app
from dsq_cli.run_result import RunResult

GLUE = SHARED_DATA / "glue"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (GLUE / "SST-2" / "train.tsv").is_file(), reason=f"GLUE copies not found under {GLUE}"
    ),
]
RUNNER = CliRunner()


def tiny(task: str, folder: str, root: Path, *extra: str) -> list[str]:
    """roberta_tiny on the first 64 training examples: 8 updates of 8, validated every 4."""
    return [
        f"task={task}",
        f"data.raw_dir={GLUE / folder}",
        "data.subset=64",
        "model=roberta_tiny",
        "model.max_length=48",
        "train.batch_size=8",
        "train.max_updates=8",
        "train.warmup_updates=2",
        "train.validate_every=4",
        "train.log_every=1",
        "logger=none",
        f"run.root={root}",
        *extra,
    ]


@pytest.fixture(scope="module")
def sst2_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("glue-runs")
    # min_delta=100: no validation counts as an improvement, so the stash rises at the second
    result = RUNNER.invoke(app, ["train", *tiny("sst2", "SST-2", root, "quant.q1.min_delta=100")])
    return result, only_run(root)


def test_sst2_run_writes_spec5_files_with_the_glue_metric(sst2_run):
    result, run_dir = sst2_run
    assert result.exit_code == 0, result.output
    assert "best dev accuracy" in result.output
    stored = json.loads((run_dir / "result.json").read_text())
    assert RunResult.problems(stored) == []
    assert stored["status"] == "completed" and stored["task"] == "sst2"
    assert stored["model"] == "roberta_tiny" and stored["metric"] == "accuracy"
    assert stored["updates"] == 8 and stored["eval_split"] == "dev"
    assert stored["eval_examples"] == 872

    valid = [m for m in read_jsonl(run_dir / "metrics.jsonl") if m["kind"] == "valid"]
    assert [m["update"] for m in valid] == [4, 8]
    best = max(valid, key=lambda m: m["dev_value"])
    # value: the best dev accuracy over the validations, and the update it came from
    assert stored["value"] == stored["accuracy"] == best["dev_accuracy"]
    assert stored["best_update"] == best["update"]
    assert stored["final_dev"]["accuracy"] == valid[-1]["dev_accuracy"]
    assert 0.0 <= stored["value"] <= 1.0
    assert [m["update"] for m in read_jsonl(run_dir / "metrics.jsonl")
            if m["kind"] == "train"] == list(range(1, 9))  # fmt: skip

    # the schedule stepped on dev loss: bfp2 -> bfp3 at the second validation
    changes = read_jsonl(run_dir / "schedule.jsonl")
    assert [(c["update"], c["from"], c["to"]) for c in changes] == [(8, "bfp2e8b16", "bfp3e8b16")]
    assert stored["stash_bits_mean"] == pytest.approx(2.5)  # 8 updates at bfp2 (2 + 8/16 bits)

    # every Linear (encoder and head) and both attention products of each layer ran quantized
    patch = stored["patch"]
    assert patch["excluded"] == [] and patch["attention_products"] == 4
    assert 0 < stored["cost"]["arith_ratio"] < 1 and 0 < stored["cost"]["dram_ratio"] < 1
    assert stored["cost"]["gemms_per_step"] == 3 * (14 + 4)  # 14 Linears, 4 products, 3 GEMMs each


def test_minilm_rte_pairs_and_cola_mcc_run_end_to_end(tmp_path):
    rte = ["train", *tiny("rte", "RTE", tmp_path / "rte", "model=minilm", "train.max_updates=2",
                          "train.validate_every=2")]  # fmt: skip
    result = RUNNER.invoke(app, rte)
    assert result.exit_code == 0, result.output
    stored = json.loads((only_run(tmp_path / "rte") / "result.json").read_text())
    assert stored["model"] == "minilm" and stored["metric"] == "accuracy"
    assert stored["eval_examples"] == 277 and 0 <= stored["value"] <= 1

    cola = ["train", *tiny("cola", "CoLA", tmp_path / "cola", "train.max_updates=2",
                           "train.validate_every=2")]  # fmt: skip
    result = RUNNER.invoke(app, cola)
    assert result.exit_code == 0, result.output
    stored = json.loads((only_run(tmp_path / "cola") / "result.json").read_text())
    assert stored["metric"] == "mcc" and stored["value"] == stored["mcc"]
    assert -1 <= stored["value"] <= 1 and stored["eval_examples"] == 1043


def test_roberta_base_from_a_release_format_checkpoint_fine_tunes_through_dsq_train(tmp_path):
    """A random RoBERTa saved as fairseq's roberta.base release stands in for the download."""
    write_roberta_release(tmp_path / "roberta_base")
    args = tiny("rte", "RTE", tmp_path / "runs", "model=roberta_base",
                f"model.checkpoint={tmp_path / 'roberta_base'}", "train.max_updates=2",
                "train.validate_every=2")  # fmt: skip
    result = RUNNER.invoke(app, ["train", *args])
    assert result.exit_code == 0, result.output
    stored = json.loads((only_run(tmp_path / "runs") / "result.json").read_text())
    assert stored["status"] == "completed" and stored["model"] == "roberta_base"
    assert stored["updates"] == 2 and stored["patch"]["attention_products"] == 4
    log = (only_run(tmp_path / "runs") / "train.log").read_text()
    assert f"fairseq RoBERTa from {tmp_path / 'roberta_base' / 'model.pt'}" in log


def test_head_left_unquantized_when_asked(tmp_path):
    args = tiny("sst2", "SST-2", tmp_path, "model.quantize_head=false", "train.max_updates=1",
                "train.validate_every=1")  # fmt: skip
    result = RUNNER.invoke(app, ["train", *args])
    assert result.exit_code == 0, result.output
    patch = json.loads((only_run(tmp_path) / "result.json").read_text())["patch"]
    assert sorted(patch["excluded"]) == ["classification_heads.glue.dense",
                                         "classification_heads.glue.out_proj"]  # fmt: skip


def test_sigterm_then_resume_matches_an_uninterrupted_glue_run(tmp_path, sst2_run):
    _, straight = sst2_run
    run_dir = tmp_path / "stopped"
    args = [a for a in tiny("sst2", "SST-2", tmp_path, "quant.q1.min_delta=100")
            if not a.startswith("run.root")] + [f"run.dir={run_dir}"]  # fmt: skip
    proc = subprocess.Popen([DSQ, "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    wait_for_update(run_dir / "metrics.jsonl", 2, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert json.loads((run_dir / "result.json").read_text())["status"] == "interrupted"

    resumed = subprocess.run([DSQ, "train", f"resume={run_dir}"], capture_output=True,
                             text=True, timeout=600)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    a = json.loads((straight / "result.json").read_text())
    b = json.loads((run_dir / "result.json").read_text())
    assert b["resumed"] is True
    for key in ("updates", "value", "best_update", "final_dev", "valid_loss", "stash_bits_mean"):
        assert a[key] == b[key], key

    def losses(path):
        return [(m["kind"], m["update"], m.get("loss", m.get("valid_loss")))
                for m in read_jsonl(path / "metrics.jsonl")]  # fmt: skip

    assert losses(straight) == losses(run_dir)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["model=transformer_tiny"], "translation model (model.family) but task sst2 is a glue"),
        (["data.raw_dir=/no/such/dir"], "/no/such/dir"),
        (["train.distributed_world_size=2"], "GLUE fine-tuning runs in one process"),
        (["model=roberta_base", "model.checkpoint=/no/such/roberta"], "model.pt is missing"),
    ],
)
def test_usage_errors_exit_2_and_leave_no_run(tmp_path, extra, message):
    args = tiny("sst2", "SST-2", tmp_path / "runs", *extra)
    if "model=transformer_tiny" in extra:  # a translation model has no max_length key
        args.remove("model.max_length=48")
    result = RUNNER.invoke(app, ["train", *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not (tmp_path / "runs").exists()


def test_table_shows_glue_columns_beside_translation(sst2_run, tmp_path):
    _, glue_run = sst2_run
    translation = write_run(tmp_path, result_json("dsq", "multi30k", 1, "completed", 26.41,
                                                  0.052, 0.366, 2.5))  # fmt: skip
    result = RUNNER.invoke(app, ["table", str(glue_run), str(translation)])
    assert result.exit_code == 0, result.output
    header = next(line for line in result.output.splitlines() if line.startswith("|"))
    assert "multi30k BLEU" in header and "sst2 Acc" in header
    stored = json.loads((glue_run / "result.json").read_text())
    rows = [line for line in result.output.splitlines() if line.startswith("| dsq")]
    assert any(row.startswith("| dsq |") and "26.41" in row for row in rows)
    # the GLUE run changed quant.q1.min_delta, so it sits in a row of its own
    assert any(f"| {stored['value']:.3f} |" in row for row in rows)
