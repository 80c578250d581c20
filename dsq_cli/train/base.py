"""What the translation and GLUE trainers share: the progress a checkpoint carries, the DSQ
schedule stepped after each validation, stop requests, and the precision segments that price a
run (SPEC 4).

A trainer subclass owns its model, data and loop; it calls `_count_update` after every update,
`_after_validation` with each validation loss, `_stop_if_requested` between updates and
`_finish` at the end. ``run.py`` reads ``updates``, ``epoch``, ``progress``, ``quant`` and
``patch_report`` and calls ``train`` and ``evaluate``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import time

from dsq_cli.engine import QuantConfig

from . import distributed
from .common import Diverged, Interrupted, RunRecorder, StopRequest, save_checkpoint

log = logging.getLogger(__name__)


# The defaults a run derives from its own length (docs/training.md, "Budgets"): warmup takes this
# share of the planned updates, capped at the paper's 4,000; validations (the only moments the
# DSQ schedule can step) come every epoch, and at least this many times in a run.
WARMUP_SHARE = 0.1
WARMUP_CAP = 4000
MIN_VALIDATIONS = 10
AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class Budget:
    """How a run trains, known before its first update: the total number of updates (from
    ``train.max_updates`` or ``train.max_epochs`` x updates per epoch, whichever ends first), the
    warmup and the validation interval, each resolved from ``auto`` against that total."""

    total_updates: int
    updates_per_epoch: int
    warmup_updates: int
    validate_every: int  # 0: at the end of every epoch

    @classmethod
    def plan(cls, train_cfg, updates_per_epoch: int) -> Budget:
        updates_per_epoch = max(1, updates_per_epoch)
        limits = []
        if train_cfg.max_updates:
            limits.append(int(train_cfg.max_updates))
        if train_cfg.max_epochs:
            limits.append(int(train_cfg.max_epochs) * updates_per_epoch)
        total = min(limits)
        warmup = train_cfg.warmup_updates
        if warmup == AUTO:
            warmup = min(WARMUP_CAP, max(1, round(WARMUP_SHARE * total)))
        elif int(warmup) > total:
            log.warning(
                "train.warmup_updates=%d is longer than the whole run (%d updates): the learning "
                "rate never reaches train.lr; set train.warmup_updates=auto (%d%% of the run) or "
                "a smaller number",
                int(warmup), total, round(100 * WARMUP_SHARE),
            )  # fmt: skip
        every = train_cfg.validate_every
        if every == AUTO:
            every = min(updates_per_epoch, max(1, math.ceil(total / MIN_VALIDATIONS)))
        return cls(total, updates_per_epoch, int(warmup), int(every))

    def describe(self) -> str:
        every = f"every {self.validate_every} updates" if self.validate_every else "every epoch"
        return (
            f"budget: {self.total_updates} updates ({self.updates_per_epoch} per epoch), "
            f"warmup {self.warmup_updates}, validation {every}"
        )

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def quant_config(cfg) -> QuantConfig:
    from omegaconf import OmegaConf

    return QuantConfig.from_dict(OmegaConf.to_container(cfg.quant, resolve=True))


class BaseTrainer:
    def __init__(self, cfg, recorder: RunRecorder, device: str, rank: distributed.Rank):
        self.cfg, self.recorder, self.device, self.rank = cfg, recorder, device, rank
        self.quant = quant_config(cfg)
        # Progress that a checkpoint carries (and a resumed run restores).
        self.progress = {
            "best_valid_loss": None,
            "last_valid_loss": None,
            "validations": 0,
            "segments": [],  # [points in force, updates trained with them]
            "wall_seconds": 0.0,
            "gemm_shapes": None,  # one training step's GEMMs, for the cost model
        }

    # -- what subclasses provide ----------------------------------------------------------------
    updates: int
    epoch: int
    budget: Budget  # set by the subclass once it knows its updates per epoch (``_plan``)

    def state_dict(self) -> dict:
        raise NotImplementedError

    def trained_model(self):
        """The model without any data-parallel wrapper."""
        raise NotImplementedError

    # -- shared ---------------------------------------------------------------------------------
    def _plan(self, updates_per_epoch: int) -> Budget:
        self.budget = Budget.plan(self.cfg.train, updates_per_epoch)
        if self.rank.is_main:
            log.info(self.budget.describe())
        return self.budget

    def _budget_left(self) -> bool:
        """Whether the planned updates are not all made yet (the Budget's total is the smaller
        of train.max_updates and train.max_epochs x updates per epoch)."""
        return self.updates < self.budget.total_updates

    def checkpoint(self) -> None:
        if self.rank.is_main:  # every rank holds the same state
            save_checkpoint(self.recorder.last_checkpoint, self.state_dict())

    def _count_update(self) -> None:
        points = self.quant.current()
        segments = self.progress["segments"]
        if segments and segments[-1][0] == points:
            segments[-1][1] += 1
        else:
            segments.append([points, 1])

    def _start_clock(self) -> None:
        """Start timing a stretch of training (wall_seconds adds up across resumes)."""
        self._started = time.monotonic()
        self._wall_before = float(self.progress["wall_seconds"])
        self._loss_window: list[float] = []

    def _stop_clock(self) -> None:
        self.progress["wall_seconds"] = self._wall_before + time.monotonic() - self._started

    def _after_update(self, loss, end_of_epoch, progress_bar, stop, log_train) -> None:
        """The bookkeeping after every update: its precision segment, a metrics line every
        ``train.log_every`` updates (``log_train`` gets the losses since the last one), a
        validation and checkpoint when due, the progress line, and a stop request."""
        self._count_update()
        self._loss_window.append(loss)
        self._stop_clock()
        if self.updates % int(self.cfg.train.log_every) == 0 or end_of_epoch:
            log_train(self._loss_window)
            self._loss_window = []
        if self._validation_due(end_of_epoch):
            self.validate(step_schedule=True)
            self.checkpoint()
        progress_bar.update(self.updates, loss, self.quant.current(), self._lr())
        self._stop_if_requested(stop)

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
            signum = distributed.max_over_ranks(signum)
        if signum:
            self.checkpoint()
            raise Interrupted(signum)

    def _after_validation(self, valid_loss: float, record: dict, step_schedule: bool) -> None:
        """Book a validation loss: best/last, the DSQ schedule step (SPEC 3: the new formats
        apply from the next update), the metrics line (``record`` adds the trainer's own
        fields) and one schedule.jsonl line per precision change."""
        if not math.isfinite(valid_loss):
            raise Diverged(f"validation loss is {valid_loss} at update {self.updates}")
        best = self.progress["best_valid_loss"]
        self.progress["best_valid_loss"] = valid_loss if best is None else min(best, valid_loss)
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
        for point, change in changes:
            log.info("DSQ %s: %s -> %s at update %d", point, change.from_spec, change.to_spec,
                     self.updates)  # fmt: skip
            self.recorder.schedule_change(
                {
                    "update": self.updates,
                    "point": point,
                    "from": change.from_spec,
                    "to": change.to_spec,
                    "from_level": change.from_level,
                    "to_level": change.to_level,
                    "valid_loss": change.valid_loss,
                }
            )

    def _finish(self, validate) -> None:
        """The end of training: one last validation unless the last update had one, the final
        checkpoint, and the parameter checksum every rank logs (replicas must agree)."""
        if self.progress["validations"] == 0 or self.progress.get("validated_at") != self.updates:
            validate(step_schedule=True)
        self.checkpoint()
        log.info("parameter checksum at update %d: %s", self.updates, self.parameter_checksum())

    def parameter_checksum(self) -> str:
        """A digest of every parameter's bytes (replicas of one run must agree exactly)."""
        digest = hashlib.sha256()
        for name, tensor in sorted(self.trained_model().state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
        return digest.hexdigest()[:16]


def gemm_as_dict(gemm) -> dict:
    return {
        "kind": gemm.kind,
        "batch": gemm.batch,
        "n": gemm.n,
        "k": gemm.k,
        "m": gemm.m,
        "formats": dict(gemm.formats),
        "stash_bytes": gemm.stash_bytes,
    }


def stash_bits_mean(segments: list) -> float | None:
    """Update-weighted mean bits per value of the stash format (q1) over the run."""
    from dsq_cli.formats import parse_format

    total = sum(updates for _, updates in segments)
    if not total:
        return None
    bits = sum(parse_format(points["q1"]).bits_per_value * n for points, n in segments)
    return bits / total
