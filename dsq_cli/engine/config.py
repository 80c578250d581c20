"""QuantConfig: the four quantization points of docs/spec.md §2, controlled from one place.

Every DSQ layer holds a reference to the same ``QuantConfig``; stepping it after a validation
(``cfg.step(valid_loss, update)``) changes the format every layer uses from its next call on.
"""

from __future__ import annotations

from collections.abc import Mapping

from dsq_cli.formats import Format

from .schedule import LevelChange, Schedule

POINTS = ("q0", "q1", "q2", "q3")
POINT_HELP = {
    "q0": "forward GEMM inputs x and W (blocks along K)",
    "q1": "the stash: activations saved for backward, stored packed (blocks along N)",
    "q2": "backward GEMM inputs g and W for dx (blocks along M)",
    "q3": "the incoming gradient dy as fetched (blocks along N)",
}
STASH_SCOPES = ("gemm", "all")


def _as_schedule(point: str, value) -> Schedule:
    if isinstance(value, Schedule):
        return value
    if isinstance(value, (str, Format)):
        return Schedule([value if isinstance(value, str) else value.spec])
    if isinstance(value, Mapping):
        unknown = set(value) - {"levels", "patience", "min_delta"}
        if unknown or "levels" not in value:
            raise ValueError(
                f"{point}: a schedule is {{levels: [...], patience: N, min_delta: X}}, "
                f"got keys {sorted(value)}"
            )
        return Schedule(
            list(value["levels"]), int(value.get("patience", 1)), float(value.get("min_delta", 0.0))
        )
    raise ValueError(f"{point}: expected a format spec or a schedule, got {value!r}")


class QuantConfig:
    """The formats of the four DSQ points (each a spec string or a Schedule) and the stash scope."""

    def __init__(self, q0="fp32", q1="fp32", q2="fp32", q3="fp32", stash_scope: str = "gemm"):
        if stash_scope not in STASH_SCOPES:
            raise ValueError(f"stash_scope must be one of {STASH_SCOPES}, got {stash_scope!r}")
        self.schedules = {p: _as_schedule(p, v) for p, v in zip(POINTS, (q0, q1, q2, q3))}
        self.stash_scope = stash_scope

    @classmethod
    def from_dict(cls, config: Mapping) -> QuantConfig:
        """From a preset mapping (conf/quant/*.yaml): q0..q3 and stash_scope."""
        unknown = set(config) - set(POINTS) - {"stash_scope", "name"}
        if unknown:
            raise ValueError(
                f"unknown quantization point(s) {sorted(unknown)}; the points are {POINTS} "
                "(plus stash_scope)"
            )
        return cls(**{k: v for k, v in config.items() if k != "name"})

    def schedule(self, point: str) -> Schedule:
        if point not in self.schedules:
            raise ValueError(f"unknown quantization point {point!r}; the points are {POINTS}")
        return self.schedules[point]

    def format(self, point: str) -> Format:
        """The format in force at ``point``."""
        return self.schedule(point).format

    def step(self, valid_loss: float, update: int | None = None) -> list[tuple[str, LevelChange]]:
        """Step every schedule on one validation loss; return the changes it caused."""
        changes = []
        for point, schedule in self.schedules.items():
            before = len(schedule.changes)
            schedule.step(valid_loss, update)
            changes += [(point, c) for c in schedule.changes[before:]]
        return changes

    def current(self) -> dict[str, str]:
        """The spec in force at every point."""
        return {p: s.current for p, s in self.schedules.items()}

    def state_dict(self) -> dict:
        return {p: s.state_dict() for p, s in self.schedules.items()}

    def load_state_dict(self, state: Mapping) -> None:
        for point, schedule in self.schedules.items():
            schedule.load_state_dict(state[point])

    def __repr__(self) -> str:
        return f"QuantConfig({self.current()}, stash_scope={self.stash_scope!r})"
