"""`Trainer`: the training loop every task family shares, as a template the trainers fill in.

`Trainer.train` owns what happens around every update, the same for translation, GLUE and LM:

* the first update of a process records its GEMMs (`record_gemms`): their shapes price the run
  (docs/spec.md §4);
* after every update: its precision segment (the points in force, for the cost and the mean
  stash bits), a metrics.jsonl line every ``train.log_every`` updates, a validation and a
  checkpoint when due (`Budget`), the progress line, and a stop request agreed on by all ranks;
* after each validation: the DSQ schedule steps on the validation loss (docs/spec.md §3: the new
  formats apply from the next update), one schedule.jsonl line per precision change;
* at the end: a last validation unless the last update had one, the final checkpoint, and a
  parameter checksum every rank logs (replicas must agree).

A trainer subclass provides the model, its data order and its update:

    batches()            -> (batch, end_of_epoch) for every update left in the budget
    train_step(batch)    -> (loss, extra train-record fields); counts the update
    validation_loss()    -> (validation loss, extra valid-record fields)
    lr()                 -> the learning rate in force
    own_state() / load_own_state(state)   optimizer, lr schedule, data position
    trained_model()      -> the model without any data-parallel wrapper
    evaluate(stop)       -> result.json's evaluation fields (``value`` is the headline metric)

and in its constructor patches its model (`patch`) and plans its `Budget` (`plan`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

import torch

from dsq.engine import PatchReport, PrecisionHistory, QuantConfig, units
from dsq.engine.checkpointing import checkpoint_layers
from dsq.integrations import observe_model, quantize_model
from dsq_cli.run_config import RunConfig, TrainConfig

from . import ranks
from .budget import Budget
from .fairseq_compat import transformer_layers
from .progress_line import ProgressLine
from .recorder import RunRecorder, rng_state, save_checkpoint, set_rng_state
from .stop import Interrupted, StopRequest, check_finite

log = logging.getLogger(__name__)


class Trainer(ABC):
    """One run of one task family; `train` to the budget, then `evaluate`."""

    patch_report: PatchReport
    budget: Budget
    # Whether a validation that sets a new best loss writes checkpoint_best.pt (the model a
    # trainer scores as ``best``); GLUE's best is its best dev metric, booked without one.
    saves_best_checkpoint = False

    def __init__(
        self,
        train: TrainConfig,
        quant: QuantConfig,
        recorder: RunRecorder,
        device: str,
        rank: ranks.Rank,
    ):
        self.train_cfg, self.quant = train, quant
        self.recorder, self.device, self.rank = recorder, device, rank
        # Progress that a checkpoint carries (and a resumed run restores).
        self.progress: dict[str, Any] = {
            "best_valid_loss": None,
            "best_valid_update": None,  # the update of best_valid_loss (checkpoint_best.pt's)
            "last_valid_loss": None,
            "validations": 0,
            "validations_without_improvement": 0,  # in a row: train.stop_patience counts them
            "stopped_early": None,  # {"update", "reason"} once a run ends before its cap
            "segments": [],  # [points in force, updates trained with them] (PrecisionHistory)
            "wall_seconds": 0.0,
            "gemm_shapes": None,  # one training step's GEMMs, for the cost model (PrecisionHistory)
            "changes": [],  # the precision changes, as schedule.jsonl lines (PrecisionHistory)
            "gemm_units": {},  # the quantized GEMMs run, per GEMM kind and unit (units.tally)
        }
        self.history = PrecisionHistory(self.progress)
        # the status line on stderr; `train` makes the one that prints
        self.progress_line = ProgressLine(None, quiet=True)
        # the GEMMs counted before this process trained, and the tally when it started (`train`)
        self._units_before: dict = {}
        self._tally_at_start: dict | None = None
        self._best_due = False  # a validation set a new best: the next checkpoint writes it

    # -- what a trainer provides ----------------------------------------------------------------
    @classmethod
    @abstractmethod
    def from_run_config(cls, cfg: RunConfig, quant: QuantConfig, data, recorder: RunRecorder,
                        device: str, rank: ranks.Rank) -> Trainer:  # fmt: skip
        """The trainer of a run, given the sub-configs it needs from the whole config."""

    @property
    @abstractmethod
    def updates(self) -> int:
        """Updates made so far."""

    @property
    @abstractmethod
    def epoch(self) -> int:
        """The epoch being trained (from 1)."""

    @abstractmethod
    def batches(self) -> Iterator[tuple[Any, bool]]:
        """The batch of every update left in the budget, and whether it ends an epoch."""

    @abstractmethod
    def train_step(self, batch) -> tuple[float, dict]:
        """One update on ``batch``; its loss and extra fields for the train record."""

    @abstractmethod
    def validation_loss(self) -> tuple[float, dict]:
        """The validation loss of the model as it is now, and extra fields for its record."""

    @abstractmethod
    def lr(self) -> float:
        """The learning rate in force."""

    @abstractmethod
    def own_state(self) -> dict:
        """The trainer's own checkpoint state (optimizer, lr schedule, data position)."""

    @abstractmethod
    def load_own_state(self, state: dict) -> None:
        """Restore `own_state` (and the model) from a checkpoint."""

    @abstractmethod
    def trained_model(self) -> torch.nn.Module:
        """The model without any data-parallel wrapper."""

    @abstractmethod
    def evaluate(self, stop: StopRequest) -> dict:
        """result.json's evaluation fields; ``value`` is the run's headline metric."""

    def training_context(self) -> contextlib.AbstractContextManager:
        """A context the whole loop runs in (nothing by default)."""
        return contextlib.nullcontext()

    def patch(self, model: torch.nn.Module, exclude: list[str] | tuple = ()) -> None:
        """Make every Linear and attention product of ``model`` a DSQ layer driven by this run's
        `QuantConfig` (modules matching a glob of ``exclude`` stay as they are); `patch_report` says
        what was patched. Under the autocast engine (amp_bf16) the model stays as it is, and
        hooks note its GEMMs for the cost model (`observe_model`)."""
        if self.quant.engine == "autocast":
            observe_model(model, self.quant)
            self.patch_report = PatchReport(
                notes=[
                    f"not patched: the model trains under torch.autocast "
                    f"({self.quant.autocast_dtype}), quant.engine=autocast"
                ]  # fmt: skip
            )
        else:
            quantize_model(model, self.quant, exclude=exclude)
            self.patch_report = model.dsq_report
        if self.train_cfg.activation_checkpointing:
            layers = self.checkpointed_layers(model)
            patched = self.quant if self.quant.engine == "dsq" else None
            count = checkpoint_layers(layers, patched)
            self.patch_report.notes.append(f"{count} layers checkpointed")
        log.info(self.patch_report.summary())

    def checkpointed_layers(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The layers ``train.activation_checkpointing`` runs again in the backward pass: every
        fairseq transformer layer, encoder and decoder (both families' models are fairseq's)."""
        layers = transformer_layers(model)
        if not layers:
            raise ValueError(
                f"train.activation_checkpointing=true: {type(model).__name__} holds no fairseq "
                "transformer layer to checkpoint"
            )
        return layers

    def precision_context(self) -> contextlib.AbstractContextManager:
        """``torch.autocast`` in the config's 16-bit float under the autocast engine (amp_bf16),
        around each update and each validation; nothing under the dsq engine. Never around the
        whole loop: autocast keeps its 16-bit copies of the weights until its outermost context
        exits, so one context over many updates would run every forward on the first weights."""
        dtype = self.quant.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(torch.device(self.device).type, dtype=dtype)

    # -- the loop -------------------------------------------------------------------------------
    def plan(self, updates_per_epoch: int) -> Budget:
        """Fix the budget once the updates per epoch are known (in the constructor)."""
        self.budget = Budget.plan(self.train_cfg, updates_per_epoch)
        if self.rank.is_main:
            log.info(self.budget.describe())
        return self.budget

    def budget_left(self) -> bool:
        """Whether the planned updates are not all made yet and the run has not stopped early."""
        return self.updates < self.budget.total_updates and not self.progress["stopped_early"]

    def train(self, stop: StopRequest, resume_state: dict | None) -> None:
        """Train from the start, or from ``resume_state``, to the end of the budget."""
        if resume_state is not None:
            self.load_state_dict(resume_state)
        progress_line = ProgressLine(
            self.budget.total_updates, self.updates, quiet=not self.rank.is_main
        )
        self.progress_line = progress_line
        progress_line.note(self.budget.describe())
        self._started = time.monotonic()
        self._wall_before = float(self.progress["wall_seconds"])
        # GEMMs this process runs from here on, added to those of the checkpoint's processes
        self._units_before = dict(self.progress.get("gemm_units") or {})
        self._tally_at_start = units.tally()
        # the policies of the update count need the planned updates (a resumed run: its level)
        self.quant.start(self.budget.total_updates, self.updates)
        window: list[float] = []
        try:
            with self.training_context():
                for batch, end_of_epoch in self.batches():
                    loss, extra = self._recorded_step(batch)
                    self._count_update()
                    self._book_changes(self.quant.after_update(self.updates, loss))
                    window.append(loss)
                    self._stop_clock()
                    if self.updates % self.train_cfg.log_every == 0 or end_of_epoch:
                        self._log_train(window, extra)
                        window = []
                    if self._validation_due(end_of_epoch):
                        with progress_line.phase(f"validation at update {self.updates}"):
                            self.validate(step_schedule=True)
                        self.checkpoint()
                    progress_line.update(self.updates, loss, self.quant.current(), self.lr())
                    self._stop_if_requested(stop)
        finally:
            progress_line.close()
            self._stop_clock()
        self._finish()

    def _recorded_step(self, batch) -> tuple[float, dict]:
        """`train_step`; the first one of a process records the GEMMs that price the run."""
        with self.history.first_update(), self.precision_context():
            return self.train_step(batch)

    def _count_update(self) -> None:
        self.history.count_update(self.quant.current())

    def _stop_clock(self) -> None:
        """wall_seconds adds up across resumes (and so do the GEMM unit counts)."""
        self.progress["wall_seconds"] = self._wall_before + time.monotonic() - self._started
        self._count_units()

    def _count_units(self) -> None:
        """progress["gemm_units"]: the checkpoint's counts plus this process's GEMMs so far
        (training and validation); brought up to date before every checkpoint."""
        if self._tally_at_start is None:  # not training yet: nothing of this process to add
            return
        since_start = units.merge_tallies(units.tally(), units.negated(self._tally_at_start))
        self.progress["gemm_units"] = units.merge_tallies(self._units_before, since_start)

    def _log_train(self, window: list[float], extra: dict) -> None:
        """The train record: the mean loss since the last one, and the trainer's extra fields."""
        self.recorder.metrics(
            {
                "kind": "train",
                "update": self.updates,
                "epoch": self.epoch,
                "loss": sum(window) / len(window),
                **extra,
                "lr": self.lr(),
                "bits": self.quant.current(),
                "wall_seconds": round(self.progress["wall_seconds"], 3),
            }
        )

    def _validation_due(self, end_of_epoch: bool) -> bool:
        every = self.budget.validate_every
        if every > 0:
            return self.updates % every == 0
        return end_of_epoch

    def _stop_if_requested(self, stop: StopRequest) -> None:
        """Checkpoint and stop when a signal arrived; in a distributed run, when it arrived at
        any rank, so that all stop after the same update (one tiny all-reduce per update)."""
        signum = stop.signum or 0
        if self.rank.distributed:
            signum = ranks.max_over_ranks(signum)
        if signum:
            self.checkpoint()
            raise Interrupted(signum)

    def validate(self, step_schedule: bool) -> float:
        """Book a validation: best/last loss, the DSQ schedule step (the new formats apply from
        the next update), the metrics line, one schedule.jsonl line per precision change, and
        the early stop when ``train.stop_patience`` validations in a row did not improve."""
        with self.precision_context():
            valid_loss, record = self.validation_loss()
        check_finite("validation loss", valid_loss, self.updates)
        best = self.progress["best_valid_loss"]
        if best is None or valid_loss < best:  # improved: strictly below the best so far
            self.progress["best_valid_loss"] = valid_loss
            self.progress["best_valid_update"] = self.updates
            self.progress["validations_without_improvement"] = 0
            self._best_due = self.saves_best_checkpoint
        else:
            self.progress["validations_without_improvement"] += 1
        self.progress["last_valid_loss"] = valid_loss
        self.progress["validations"] += 1
        self.progress["validated_at"] = self.updates
        bits_before = self.quant.current()
        changes = self.quant.step(valid_loss, self.updates) if step_schedule else []
        # Every rank logs this line (rank R>0 in train.rankR.log): the ranks' schedules agree.
        log.info("validation at update %d: loss %.6f; stash q1 now %s", self.updates,
                 valid_loss, self.quant.current()["q1"])  # fmt: skip
        self.recorder.metrics(
            {
                "kind": "valid",
                "update": self.updates,
                "epoch": self.epoch,
                "valid_loss": valid_loss,
                **record,
                "best_valid_loss": self.progress["best_valid_loss"],
                "bits": bits_before,
            }
        )
        self._book_changes(changes)
        self._stop_if_stalled()
        return valid_loss

    def _book_changes(self, changes) -> None:
        """One log line and one schedule.jsonl line per precision change (in force from the next
        update)."""
        for record in self.history.book(changes, self.updates):
            log.info("DSQ %s: %s -> %s after update %d (%s)", record["point"], record["from"],
                     record["to"], self.updates, record["policy"])  # fmt: skip
            self.recorder.schedule_change(record)

    def _stop_if_stalled(self) -> None:
        """End the run after this validation (`budget_left` turns false) when the last
        ``stop_patience`` validations did not improve and updates are left under the cap. The
        decision sits in progress, so the checkpoint after this validation carries it."""
        patience, cap = self.budget.stop_patience, self.budget.total_updates
        stalled = self.progress["validations_without_improvement"]
        if not patience or stalled < patience or self.updates >= cap:
            return
        best, best_update = self.progress["best_valid_loss"], self.progress["best_valid_update"]
        at = f" at update {best_update}" if best_update is not None else ""
        reason = (f"validation loss has not improved for {stalled} validations "
                  f"(best {best:.3f}{at})")  # fmt: skip
        self.progress["stopped_early"] = {"update": self.updates, "reason": reason}
        log.info("stopped early at update %d: %s; cap %d", self.updates, reason, cap)

    def _finish(self) -> None:
        """One last validation unless the last update had one (a run that stopped early stopped
        at a validation), the final checkpoint, and the parameter checksum every rank logs."""
        if self.progress["validations"] == 0 or self.progress.get("validated_at") != self.updates:
            with self.progress_line.phase(f"validation at update {self.updates}"):
                self.validate(step_schedule=True)
        self.checkpoint()
        log.info("parameter checksum at update %d: %s", self.updates, self.parameter_checksum())

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """A checkpoint: the model, the trainer's own state, the schedule and its rounding noise,
        progress and RNG."""
        return {
            "model": self.trained_model().state_dict(),
            **self.own_state(),
            "num_updates": self.updates,
            "dsq_schedule": self.quant.state_dict(),
            "dsq_noise": self.quant.noise_state(),
            "progress": self.progress,
            "rng": rng_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.trained_model().load_state_dict(state["model"])
        self.load_own_state(state)
        self.quant.load_state_dict(state["dsq_schedule"])
        # the checkpoint holds the main rank's rounding noise; another rank restarts its own
        # stream from its seed (docs/dsq.md, "Rounding"); older checkpoints have none
        if self.rank.is_main:
            self.quant.load_noise_state(state.get("dsq_noise", {}))
        # over the fresh progress: a checkpoint written before a key existed starts it afresh
        self.progress = {**self.progress, **state["progress"]}
        self.history = PrecisionHistory(self.progress)
        set_rng_state(state["rng"])  # last: restoring the rest may draw random numbers

    def checkpoint(self) -> None:
        self._count_units()
        if self.rank.is_main:  # every rank holds the same state
            state = self.state_dict()
            # checkpoint_best.pt first: checkpoint_last.pt's progress, which a resume continues,
            # then never names a best update whose model is not on disk
            if self._best_due:
                save_checkpoint(self.recorder.best_checkpoint, state)
            save_checkpoint(self.recorder.last_checkpoint, state)
        self._best_due = False

    def parameter_checksum(self) -> str:
        """A digest of every parameter's bytes (replicas of one run must agree exactly)."""
        digest = hashlib.sha256()
        for name, tensor in sorted(self.trained_model().state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
        return digest.hexdigest()[:16]


class PlainTrainer(Trainer, ABC):
    """A trainer that holds its model, optimizer and learning-rate scheduler itself (GLUE, LM;
    translation's are fairseq's): ``self.model``, ``self.optimizer``, ``self.scheduler`` and
    ``self._updates``, set by the subclass's constructor."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    _updates: int

    def trained_model(self) -> torch.nn.Module:
        return self.model

    @property
    def updates(self) -> int:
        return self._updates

    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def step_on(self, loss: torch.Tensor) -> float:
        """The end of an update: the loss checked finite before anything uses it, its gradients
        (clipped at ``train.clip_norm``), the optimizer's and the schedule's step, the update
        counted; returns the loss's value."""
        loss_value = float(loss.detach())
        check_finite("training loss", loss_value, self.updates + 1)  # before the step uses it
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.train_cfg.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                           self.train_cfg.clip_norm)  # fmt: skip
        self.optimizer.step()
        self.scheduler.step()
        self._updates += 1
        return loss_value
