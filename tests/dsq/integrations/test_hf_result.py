"""A Hugging Face Trainer run's result.json comes from the library (``DSQCallback.run_result``):
priced as ``dsq train`` prices its runs, readable by ``dsq table``, its ``quant`` shaped as the
preset's record; and the examples with that result path load no module of the suite."""

from __future__ import annotations

import json

import pytest
import yaml
from helpers.imports import loaded_after
from helpers.paths import REPO
from typer.testing import CliRunner

pytest.importorskip("transformers")

from helpers.hf_runs import recorded  # noqa: E402

from dsq.engine import QuantConfig  # noqa: E402
from dsq_cli.cli import app  # noqa: E402
from dsq_cli.cost.run_cost import run_cost  # noqa: E402
from dsq_cli.run_result import RunResult  # noqa: E402

FIELDS = dict(task="toy-lm", metric="perplexity", value=2.5, valid_loss=0.92, model="gpt2-tiny",
              seed=1, wall_seconds=1.25, evaluation={"first_train_loss": 3.0})  # fmt: skip


def test_the_callbacks_result_is_a_result_json_priced_as_dsq_trains():
    callback = recorded()
    record = callback.run_result(preset="dsq", **FIELDS)
    assert RunResult.problems(record) == []
    # quant: the preset's record, as conf/quant/dsq.yaml holds it, not modified
    preset = yaml.safe_load((REPO / "dsq_cli" / "conf" / "quant" / "dsq.yaml").read_text())
    assert record["quant"] == {"preset": "dsq", **preset, "modified": False}
    history = callback.history
    assert record["cost"] == run_cost(history.gemm_shapes, history.segments)  # dsq train's
    assert record["cost"]["baseline"] == "fixed32" and record["cost"]["gemms_per_step"] == 3
    assert record["updates"] == 3 and record["bits_final"]["q1"] == "bfp3e8b16"
    assert record["stash_bits_mean"] == pytest.approx((2.5 + 3.5 * 2) / 3)
    assert [c["to"] for c in record["level_changes"]] == ["bfp3e8b16"]
    assert record["first_train_loss"] == 3.0 and record["versions"]["transformers"]


def test_dsq_table_reads_the_written_result(tmp_path):
    (tmp_path / "run").mkdir()
    path = recorded().write_result(tmp_path / "run", preset="dsq", **FIELDS)
    assert RunResult.problems(json.loads(path.read_text())) == []
    result = CliRunner().invoke(app, ["table", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "| dsq | " in result.stdout and "toy-lm perplexity" in result.stdout


def test_a_config_other_than_its_preset_is_a_modified_run():
    callback = recorded()
    callback.cfg = QuantConfig(**{**callback.cfg.spec.keywords(), "q3": "bfp8"})
    assert callback.run_result(preset="dsq", **FIELDS)["quant"]["modified"] is True


@pytest.mark.slow  # spawns a process that imports transformers
def test_the_examples_and_the_callbacks_result_load_no_module_of_the_suite(tmp_path):
    examples = "\n".join(
        f"spec = importlib.util.spec_from_file_location({name!r}, {str(path)!r})\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))"
        for name, path in [(p.stem, p) for p in sorted((REPO / "examples").glob("hf_*.py"))]
    )
    code = "\n".join([
        "import importlib.util, sys",
        examples,
        f"sys.path.insert(0, {str(REPO / 'tests')!r})",
        "from helpers.hf_runs import recorded",
        f"recorded().write_result({str(tmp_path)!r}, preset='dsq', **{FIELDS!r})",
    ])  # fmt: skip
    assert loaded_after(code, ("dsq_cli", "fairseq", "hydra", "omegaconf", "wandb")) == []
    assert RunResult.problems(json.loads((tmp_path / "result.json").read_text())) == []


def test_a_metric_dsq_table_does_not_read_is_refused():
    callback = recorded()
    with pytest.raises(ValueError, match="metric='loss': a result's metric is one dsq table"):
        callback.run_result(preset="dsq", **{**FIELDS, "metric": "loss"})


def test_a_policy_that_needs_every_training_loss_is_refused_by_the_callback():
    """The Trainer callback sees no step's training loss: a policy that needs it (pfq) is
    refused when training begins, naming the policies it can run."""
    from dsq.engine import Schedule
    from dsq.integrations.hf import DSQCallback

    ladder = Schedule(["bfp2", "bfp4"], policy="pfq")
    callback = DSQCallback(QuantConfig(q0="bfp8", q1=ladder, q2="bfp8", q3="fixed16"))
    with pytest.raises(ValueError, match="q1: policy pfq needs every step's training loss"):
        callback.on_train_begin(None, None, None)
    with pytest.raises(ValueError, match="use cyclic, plateau, shape here"):
        callback.on_train_begin(None, None, None)
