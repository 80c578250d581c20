"""Which model is scored (docs/training.md, "Which model is scored"): translation scores BLEU on
the last model and on checkpoint_best.pt, once when they are one model; ``eval.checkpoint``
picks result.json's ``value``; GLUE books both from its validations. The trainers run here
without fairseq or data: their `bleu` and `dev_scores` are stand-ins that report which model
they saw."""

from __future__ import annotations

import logging

import pytest
import torch
from omegaconf import OmegaConf

from dsq.engine import QuantConfig
from dsq_cli.train.glue import GlueTrainer
from dsq_cli.train.recorder import RunRecorder, save_checkpoint
from dsq_cli.train.translation import TranslationTrainer

LADDER = {"q0": "fp32", "q1": {"levels": ["bfp2", "bfp4"], "patience": 1, "min_delta": 0.0},
          "q2": "fp32", "q3": "fp32", "stash_scope": "gemm"}  # fmt: skip


class _NoLogger:
    def log(self, record):
        pass

    def event(self, record):
        pass


def _quant_at(level: int) -> QuantConfig:
    quant = QuantConfig.from_dict(LADDER)
    state = quant.state_dict()
    state["q1"]["level"] = level
    quant.load_state_dict(state)
    return quant


class Scored(TranslationTrainer):
    """What `evaluate` reads, without fairseq: the final model is a weight of 3.0 trained to
    update 200 with q1 at bfp4; `bleu` scores 10 x the weight and notes what it saw."""

    def __init__(self, run_dir, headline: str, best_update: int | None, best_weight=2.0):
        self.recorder = RunRecorder(run_dir, _NoLogger())
        self.eval_cfg = OmegaConf.create({"split": "test", "checkpoint": headline})
        self.model = torch.nn.Linear(1, 1, bias=False)
        torch.nn.init.constant_(self.model.weight, 3.0)
        self.quant = _quant_at(1)
        self.progress = {"last_valid_loss": 2.5, "best_valid_loss": 2.25,
                         "best_valid_update": best_update}  # fmt: skip
        if best_update is None:
            self.progress["best_valid_loss"] = None
        self.seen: list[tuple[float, str]] = []
        if best_update not in (None, 200):
            best = torch.nn.Linear(1, 1, bias=False)
            torch.nn.init.constant_(best.weight, best_weight)
            save_checkpoint(self.recorder.best_checkpoint,
                            {"model": best.state_dict(), "num_updates": best_update,
                             "dsq_schedule": _quant_at(0).state_dict()})  # fmt: skip

    @property
    def updates(self) -> int:
        return 200

    def trained_model(self):
        return self.model

    def bleu(self, stop):
        weight = float(self.model.weight.detach())
        self.seen.append((weight, self.quant.current()["q1"]))
        scores = {"bleu": 10 * weight, "bleu_signature": "sig", "copy_source_bleu": 0.5,
                  "eval_split": "test", "eval_sentences": 2}  # fmt: skip
        return scores, [f"model {weight}", "second"]


def _read(path):
    return path.read_text().splitlines() if path.exists() else None


@pytest.mark.parametrize("headline, value, other", [("best", 20.0, "last"), ("last", 30.0, "best")])
def test_both_models_are_scored_and_eval_checkpoint_picks_the_value(tmp_path, headline, value,
                                                                    other):  # fmt: skip
    trainer = Scored(tmp_path, headline, best_update=160)
    evaluation = trainer.evaluate(stop=None)
    assert evaluation["value"] == evaluation["bleu"] == value
    assert evaluation["eval_checkpoint"] == headline
    assert evaluation["checkpoints"] == {
        "last": {"update": 200, "valid_loss": 2.5, "bleu": 30.0},
        "best": {"update": 160, "valid_loss": 2.25, "bleu": 20.0},
    }
    # the last model first, then checkpoint_best.pt with the formats in force at its validation
    assert trainer.seen == [(3.0, "bfp4e8b16"), (2.0, "bfp2e8b16")]
    # the final model and schedule are back afterwards
    assert float(trainer.model.weight.detach()) == 3.0
    assert trainer.quant.current()["q1"] == "bfp4e8b16"
    weights = {"best": 2.0, "last": 3.0}
    assert _read(tmp_path / "test.hyp") == [f"model {weights[headline]}", "second"]
    assert _read(tmp_path / f"test.{other}.hyp") == [f"model {weights[other]}", "second"]
    assert _read(tmp_path / f"test.{headline}.hyp") is None


@pytest.mark.parametrize("headline", ["best", "last"])
def test_a_best_that_is_the_last_validation_is_scored_once(tmp_path, headline):
    trainer = Scored(tmp_path, headline, best_update=200)
    evaluation = trainer.evaluate(stop=None)
    assert trainer.seen == [(3.0, "bfp4e8b16")]
    assert not (tmp_path / "checkpoints" / "checkpoint_best.pt").exists()  # never read
    assert evaluation["value"] == 30.0
    assert evaluation["checkpoints"]["best"] == {"update": 200, "valid_loss": 2.25, "bleu": 30.0}
    assert sorted(p.name for p in tmp_path.glob("*.hyp")) == ["test.hyp"]


def test_without_a_best_checkpoint_the_last_model_is_the_value(tmp_path, caplog):
    """A run resumed from a checkpoint older than the best's bookkeeping that never improved
    afterwards: no best is known; the value is the last model's, and the log says so."""
    trainer = Scored(tmp_path, "best", best_update=None)
    with caplog.at_level(logging.WARNING):
        evaluation = trainer.evaluate(stop=None)
    assert evaluation["value"] == 30.0 and evaluation["eval_checkpoint"] == "last"
    assert evaluation["checkpoints"]["best"] is None
    assert "no checkpoint_best.pt" in caplog.text


# -- GLUE: both from the validations it made --------------------------------------------------


class Glue(GlueTrainer):
    """GLUE's bookkeeping without a model: dev scores follow a script, one entry a validation."""

    def __init__(self, headline: str, script):
        self.headline, self.script = headline, list(script)
        self.progress = {"best_dev": None, "last_dev": None}
        self.dev_set = [None] * 872
        self._updates = 0

    def dev_scores(self):
        loss, accuracy = self.script.pop(0)
        return loss, {"accuracy": accuracy, "glue_score": accuracy, "value": accuracy}


@pytest.mark.parametrize("headline, value", [("best", 0.86), ("last", 0.85)])
def test_glue_books_both_checkpoints_and_follows_eval_checkpoint(headline, value):
    trainer = Glue(headline, [(0.5, 0.80), (0.37, 0.86), (0.40, 0.85)])
    for update in (100, 200, 300):
        trainer._updates = update
        trainer.validation_loss()
    evaluation = trainer.evaluate(stop=None)
    assert evaluation["value"] == evaluation["accuracy"] == value
    assert evaluation["eval_checkpoint"] == headline
    assert evaluation["checkpoints"] == {
        "last": {"update": 300, "valid_loss": 0.40, "accuracy": 0.85, "glue_score": 0.85},
        "best": {"update": 200, "valid_loss": 0.37, "accuracy": 0.86, "glue_score": 0.86},
    }
    # the fields GLUE runs wrote before stay as they were
    assert evaluation["best_update"] == 200
    assert evaluation["final_dev"] == {"accuracy": 0.85, "glue_score": 0.85, "value": 0.85}
    assert "valid_loss" not in evaluation and "update" not in evaluation
