"""`Budget`: how long a run trains at most, how it warms up, how often it validates and when it
stops early, known before its first update (docs/training.md, "Budgets")."""

from __future__ import annotations

import dataclasses
import logging
import math

from dsq_cli.run_config import TrainConfig

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
    warmup and the validation interval, each resolved from ``auto`` against that total.

    ``total_updates`` is a cap when ``stop_patience`` is set: the run may end at a validation
    before it (`Trainer.validate`). Warmup and the validation interval still follow the cap, so
    that a run's schedule does not depend on when it happens to stop."""

    total_updates: int
    updates_per_epoch: int
    warmup_updates: int
    validate_every: int  # 0: at the end of every epoch
    stop_patience: int = 0  # validations without improvement that end the run; 0: never
    # where the total comes from, for the lines that show it (not part of the record)
    source: str = dataclasses.field(default="", compare=False)

    @classmethod
    def plan(cls, train: TrainConfig, updates_per_epoch: int) -> Budget:
        updates_per_epoch = max(1, updates_per_epoch)
        limits = []
        if train.max_updates:
            limits.append(train.max_updates)
        if train.max_epochs:
            limits.append(train.max_epochs * updates_per_epoch)
        total = min(limits)
        if train.max_updates and total == train.max_updates:
            source = "train.max_updates"
        else:
            cap = "" if train.max_updates else "; train.max_updates=0: no cap"
            source = f"train.max_epochs={train.max_epochs} x {updates_per_epoch}{cap}"
        warmup = train.warmup_updates
        if warmup == AUTO:
            warmup = min(WARMUP_CAP, max(1, round(WARMUP_SHARE * total)))
        elif warmup > total:
            log.warning(
                "train.warmup_updates=%d is longer than the whole run (%d updates): the learning "
                "rate never reaches train.lr; set train.warmup_updates=auto (%d%% of the run) or "
                "a smaller number",
                warmup, total, round(100 * WARMUP_SHARE),
            )  # fmt: skip
        every = train.validate_every
        if every == AUTO:
            every = min(updates_per_epoch, max(1, math.ceil(total / MIN_VALIDATIONS)))
        return cls(total, updates_per_epoch, warmup, every, train.get("stop_patience", 0), source)

    def describe(self) -> str:
        every = f"every {self.validate_every} updates" if self.validate_every else "every epoch"
        origin = f": {self.source}" if self.source else ""
        text = (
            f"budget: {self.total_updates} updates{origin} ({self.updates_per_epoch} per epoch), "
            f"warmup {self.warmup_updates}, validation {every}"
        )
        if self.stop_patience:
            text += (
                f"; stops early after {self.stop_patience} validations without improvement "
                f"({self.total_updates} updates is the cap)"
            )
        return text

    def as_dict(self) -> dict:
        """result.json's ``budget`` (without `source`, which the numbers already say)."""
        record = dataclasses.asdict(self)
        del record["source"]
        return record
