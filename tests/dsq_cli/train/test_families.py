"""The task families (dsq_cli.train.families): one registered unit per name of the one vocabulary
that task.family and model.family share; every conf file's family is one of them, the CLI asks
the family for its lines instead of comparing names, and a model of one family with a task of
another is a one-line usage error that writes nothing."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from typer.testing import CliRunner

from dsq_cli.cli import app
from dsq_cli.presets import CONF_DIR
from dsq_cli.run_config import FAMILY_NAMES
from dsq_cli.run_result import RunResult
from dsq_cli.train.families import FAMILIES, Glue, TaskFamily, Translation, register

CLI = Path(__file__).resolve().parents[3] / "dsq_cli" / "cli.py"


def _declared(group: str) -> dict[str, object]:
    """conf/<group>/<file>.yaml -> the family it declares (task: under task:, model: on top)."""
    found = {}
    for path in sorted((CONF_DIR / group).glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        found[path.name] = (doc["task"] if group == "task" else doc).get("family")
    return found


def test_the_registry_is_the_vocabulary():
    assert tuple(FAMILIES) == FAMILY_NAMES == ("translation", "glue", "lm")
    assert all(isinstance(f, TaskFamily) and f.name == name for name, f in FAMILIES.items())


@pytest.mark.parametrize("group", ["task", "model"])
def test_every_conf_file_declares_a_registered_family(group):
    declared = _declared(group)
    assert declared, group
    unknown = {name: family for name, family in declared.items() if family not in FAMILIES}
    assert unknown == {}, f"conf/{group}: families outside {sorted(FAMILIES)}"
    # every family has a task and a model to run it with
    assert set(declared.values()) == set(FAMILIES), group


def test_a_family_outside_the_vocabulary_cannot_be_registered():
    class Vision(Translation):
        name = "vision"  # type: ignore[assignment]

    with pytest.raises(TypeError, match="'vision' is not a Family"):
        register(Vision)
    with pytest.raises(TypeError, match="registered twice"):
        register(Glue)
    assert tuple(FAMILIES) == FAMILY_NAMES


def test_the_cli_compares_no_family_names():
    names = set(FAMILY_NAMES) | {"encoder"}
    tree = ast.parse(CLI.read_text())
    compared = [
        ast.unparse(node)
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare)
        for side in [node.left, *node.comparators]
        if isinstance(side, ast.Constant) and side.value in names
    ]
    assert compared == [], "cli.py asks family_of(cfg) instead"
    assert "family ==" not in CLI.read_text() and ".family" not in CLI.read_text()


def _result(metric: str, value: float, **evaluation) -> RunResult:
    return RunResult.from_dict(
        {
            "status": "completed",
            "task": "t",
            "metric": metric,
            "value": value,
            "quant": {"preset": "fp32", "q0": "fp32", "q1": "fp32", "q2": "fp32", "q3": "fp32"},
            "cost": {"arith_ratio": 1.0, "dram_ratio": 1.0, "baseline": "fixed32"},
            "valid_loss": 1.25,
            "updates": 7,
            "wall_seconds": 1.0,
            "stash_bits_mean": 32.0,
            "versions": {},
            **evaluation,
        }
    )


def test_each_family_reports_its_completed_run_in_one_line():
    checkpoints = {"best": {"update": 5, "bleu": 20.0}, "last": {"update": 7, "bleu": 19.5}}
    bleu = _result("bleu", 20.0, bleu=20.0, eval_split="test", copy_source_bleu=1.5,
                   eval_checkpoint="best", checkpoints=checkpoints)  # fmt: skip
    assert FAMILIES["translation"].completed_line(bleu) == (
        "completed: 7 updates, valid loss 1.250, test BLEU 20.00 (best model, update 5; last "
        "model, update 7: 19.50; copying the source scores 1.50)"
    )
    dev = {"best": {"update": 5, "accuracy": 0.9}, "last": {"update": 7, "accuracy": 0.875}}
    glue = _result("accuracy", 0.9, accuracy=0.9, final_dev=0.875, best_update=5,
                   eval_checkpoint="best", checkpoints=dev)  # fmt: skip
    assert FAMILIES["glue"].completed_line(glue) == (
        "completed: 7 updates, dev loss 1.250, best dev accuracy 0.9000 (update 5; final 0.8750)"
    )


def test_each_family_says_what_dsq_data_prepared():
    data = SimpleNamespace(
        source="cache", manifest={"sizes": {"train": 3, "valid": 1}, "vocab_size": 600}
    )
    assert FAMILIES["translation"].data_line("demo", data) == (
        "demo: cache (train 3, valid 1; vocabulary 600)"
    )
    assert FAMILIES["glue"].data_line("sst2", data) == "sst2: cache (train 3, valid 1)"


def test_dsq_cost_prices_translation_models_and_refuses_a_glue_encoder_in_one_line():
    assert CliRunner().invoke(app, ["cost", "--json"]).exit_code == 0
    result = CliRunner().invoke(app, ["cost", "task=sst2"])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert "dsq cost derives the translation transformers' GEMMs; a GLUE run (model=minilm)" in (
        result.output
    )


@pytest.mark.parametrize(
    "pair, says",
    [
        (["model=minilm"], "model=minilm is a glue model (model.family) but task demo is a "
                           "translation task (task.family); choose a translation model"),
        (["task=sst2", "model=transformer_tiny"], "model=transformer_tiny is a translation "
                                                  "model (model.family) but task sst2 is a glue"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("command", ["train", "cost"])
def test_a_model_of_another_family_is_one_line_exit_2_and_writes_nothing(
    tmp_path, pair, says, command
):
    root = tmp_path / "runs"
    args = [*pair, f"run.root={root}"] if command == "train" else pair
    result = CliRunner().invoke(app, [command, *args])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("dsq: error: ") and says in result.output, result.output
    assert result.output.count("\n") == 1, result.output
    assert not root.exists() and list(tmp_path.iterdir()) == []
