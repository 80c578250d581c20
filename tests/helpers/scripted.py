"""A scripted trainer: the shared training loop (`loop.Trainer`) around a model of one Linear whose
k-th validation loss is read from a list, so that every stop and every move of a precision ladder
is known in advance; and a task family that makes `dsq train`'s own path (the CLI, `entry`,
`rank_run`, the run directory's files) train it in process, in about a second."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import torch
from omegaconf import OmegaConf

from dsq.engine import QuantConfig
from dsq_cli import runs
from dsq_cli.config import compose
from dsq_cli.train import entry, rank_run, ranks
from dsq_cli.train.loop import Trainer
from dsq_cli.train.recorder import RunRecorder
from dsq_cli.train.stop import StopRequest

FP32 = {"q0": "fp32", "q1": "fp32", "q2": "fp32", "q3": "fp32", "stash_scope": "gemm"}


class NoLogger:
    """An experiment logger that keeps nothing (the run directory is the record)."""

    def log(self, record):
        pass

    def event(self, record):
        pass


class Scripted(Trainer):
    """The loop's bookkeeping around a model that records the update it was trained to (the
    buffer ``at``); its k-th validation loss is ``losses[k]``. ``interrupt_at``: a SIGTERM
    arrives during that update."""

    saves_best_checkpoint = True

    def __init__(self, recorder, train, quant, losses, *, interrupt_at=None):
        super().__init__(train, quant, recorder, "cpu", ranks.SINGLE)
        self.model = torch.nn.Sequential(torch.nn.Linear(16, 16))
        self.model.register_buffer("at", torch.tensor(0))
        self.patch(self.model)
        self.losses, self.interrupt_at = losses, interrupt_at
        self._updates = 0
        self.validated: list[int] = []  # the updates this process validated at
        self.stop = StopRequest()
        self.plan(1000)

    @classmethod
    def standalone(cls, run_dir, losses, *, quant=FP32, interrupt_at=None, **train) -> Scripted:
        """A trainer writing to ``run_dir`` without a run config: ``train`` overrides the budget
        (40 updates, validation every 2, patience 3)."""
        budget = {"max_updates": 40, "max_epochs": 0, "warmup_updates": 1, "validate_every": 2,
                  "stop_patience": 3, "log_every": 1, "activation_checkpointing": False,
                  "loss_chunk_tokens": 0, **train}  # fmt: skip
        recorder = RunRecorder(run_dir, NoLogger())
        return cls(recorder, OmegaConf.create(budget), QuantConfig.from_dict(quant), losses,
                   interrupt_at=interrupt_at)  # fmt: skip

    @classmethod
    def from_run_config(cls, *args):
        raise NotImplementedError  # `ScriptedFamily` builds it

    @property
    def updates(self) -> int:
        return self._updates

    @property
    def epoch(self) -> int:
        return 1

    def batches(self):
        while self.budget_left():
            yield None, False

    def train_step(self, batch):
        self.model(torch.ones(4, 16)).sum().backward()
        self._updates += 1
        self.model.at.fill_(self._updates)
        if self._updates == self.interrupt_at:
            self.stop.signum = signal.SIGTERM  # as the handler sets it: stop after this update
        return 1.0, {}

    def validation_loss(self):
        self.validated.append(self.updates)
        return self.losses[self.progress["validations"]], {}

    def lr(self):
        return 1e-3

    def own_state(self):
        return {}

    def load_own_state(self, state):
        self._updates = state["num_updates"]

    def trained_model(self):
        return self.model

    def evaluate(self, stop):
        return {"value": 0.0}

    def train(self, stop, resume_state):
        self.stop = stop  # the run's: `interrupt_at` signals through it
        super().train(stop, resume_state)

    def run(self, resume_state=None):
        self.train(self.stop, resume_state)
        return self


class ScriptedFamily:
    """Stands in for a task family (`families.TaskFamily`): no data, and a `Scripted` trainer
    with this family's ``losses`` and ``interrupt_at`` (set them between runs). `trainers` holds
    every trainer it built, in order."""

    title = "scripted"
    data_parallel = False

    def __init__(self, losses):
        self.losses = losses
        self.interrupt_at = None
        self.trainers: list[Scripted] = []

    @property
    def trainer(self):
        return self  # `rank_run` asks ``family.trainer.from_run_config(...)``

    def prepare(self, cfg):
        return SimpleNamespace(source="scripted", manifest={})

    def from_run_config(self, cfg, quant, data, recorder, device, rank):
        trainer = Scripted(recorder, cfg.train, quant, self.losses, interrupt_at=self.interrupt_at)
        self.trainers.append(trainer)
        return trainer

    def completed_line(self, result):
        return f"completed: {result.updates} updates"


def use_scripted_family(monkeypatch, losses) -> ScriptedFamily:
    """Make every run of this test a `ScriptedFamily` run; the versions a run records are fixed
    (reading fairseq's would import it)."""
    import dsq_cli.train

    family = ScriptedFamily(losses)
    for module in (entry, rank_run, dsq_cli.train):
        monkeypatch.setattr(module, "family_of", lambda cfg: family)
    monkeypatch.setattr(runs, "versions", lambda: {"python": "3", "dsq_commit": None})
    return family


# A scripted run: 12 updates, a validation every 2, a train record every update, no experiment
# logger (task=demo only for the config's sake: no data is made).
SCRIPTED = ["task=demo", "logger=none", "quant=fp32", "train.max_updates=12",
            "train.validate_every=2", "train.log_every=1", "train.warmup_updates=1"]  # fmt: skip


def scripted_config(run_dir, *overrides):
    """The config of a scripted run (`SCRIPTED`) in exactly ``run_dir``."""
    return compose([*SCRIPTED, f"run.dir={run_dir}", *overrides])
