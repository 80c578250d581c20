"""`PrecisionHistory`: what a run trained with, kept the same way by ``dsq train``'s loop and by
the Hugging Face callback, so that both price and report a run alike (docs/cost-model.md).

It lives in a plain, checkpointable mapping (the loop's progress, the callback's state):

* ``segments``: ``[points in force, updates trained with them]``, in order; a change of any
  point starts a new segment. The cost model weights each segment by its updates.
* ``gemm_shapes``: the GEMMs of the run's first update (``GemmRecord.to_dict()``), recorded once;
  their shapes and the formats of each segment price the run.
* ``changes``: one record per precision change, in the shape of a schedule.jsonl line:
  ``{update, point, from, to, from_level, to_level, policy, valid_loss[, train_loss]}``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, MutableMapping

from .accounting import record_gemms
from .schedule import LevelChange


def change_record(point: str, change: LevelChange, update: int) -> dict:
    """A precision change as a schedule.jsonl line (in force from the update after ``update``)."""
    record = {
        "update": update,
        "point": point,
        "from": change.from_spec,
        "to": change.to_spec,
        "from_level": change.from_level,
        "to_level": change.to_level,
        "policy": change.policy,
        "valid_loss": change.valid_loss,
    }
    if change.train_loss is not None:
        record["train_loss"] = change.train_loss
    return record


class PrecisionHistory:
    """The segments, the first update's GEMMs and the precision changes of a run, kept in
    ``state`` (a mapping the owner checkpoints; missing keys are added empty)."""

    def __init__(self, state: MutableMapping | None = None) -> None:
        self.state = state if state is not None else {}
        self.state.setdefault("segments", [])
        self.state.setdefault("gemm_shapes", None)
        self.state.setdefault("changes", [])

    @property
    def segments(self) -> list[list]:
        return self.state["segments"]

    @property
    def gemm_shapes(self) -> list[dict] | None:
        return self.state["gemm_shapes"]

    @property
    def changes(self) -> list[dict]:
        return self.state["changes"]

    @property
    def updates(self) -> int:
        return sum(n for _, n in self.segments)

    @contextlib.contextmanager
    def first_update(self) -> Iterator[None]:
        """Around an update: records its GEMMs if none are recorded yet."""
        if self.gemm_shapes is not None:
            yield
            return
        with record_gemms() as recorded:
            yield
        self.state["gemm_shapes"] = [gemm.to_dict() for gemm in recorded.gemms]

    def count_update(self, points: dict[str, str]) -> None:
        """One update trained with ``points`` (the spec in force at each point)."""
        if self.segments and self.segments[-1][0] == points:
            self.segments[-1][1] += 1
        else:
            self.segments.append([dict(points), 1])

    def book(self, changes: Iterable[tuple[str, LevelChange]], update: int) -> list[dict]:
        """Keep ``changes`` (``QuantConfig.step`` or ``after_update``'s) made after ``update``;
        return their records."""
        records = [change_record(point, change, update) for point, change in changes]
        self.changes.extend(records)
        return records
