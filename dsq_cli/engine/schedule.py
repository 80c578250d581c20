"""Time-adaptive precision (docs/spec.md §3): a schedule of formats that only rises.

After every validation: if ``valid_loss < best - min_delta`` the loss improved (``best`` moves,
``bad`` resets); otherwise ``bad`` grows, and when it reaches ``patience`` and a higher level
exists, the schedule moves one level up and starts afresh (``bad = 0``, ``best = valid_loss``).
"""

from __future__ import annotations

import dataclasses
import math

from dsq_cli.formats import parse_format


@dataclasses.dataclass(frozen=True)
class LevelChange:
    """One precision change: at ``update``, ``from_spec`` -> ``to_spec`` (level indices too)."""

    update: int | None
    from_level: int
    to_level: int
    from_spec: str
    to_spec: str
    valid_loss: float


class Schedule:
    """An ascending list of formats, starting at the first (docs/spec.md §3)."""

    def __init__(self, levels, patience: int = 1, min_delta: float = 0.0) -> None:
        if isinstance(levels, str):
            levels = [levels]
        levels = list(levels)
        if not levels:
            raise ValueError("a schedule needs at least one level, e.g. ['bfp2', 'bfp4']")
        formats = [parse_format(spec) for spec in levels]
        for lower, higher in zip(formats, formats[1:]):
            if higher.bits_per_value <= lower.bits_per_value:
                raise ValueError(
                    f"schedule levels must rise in bits per value: {higher.spec} "
                    f"({higher.bits_per_value:g} bits) follows {lower.spec} "
                    f"({lower.bits_per_value:g} bits); order them from fewest to most bits"
                )
        if not isinstance(patience, int) or isinstance(patience, bool) or patience < 1:
            raise ValueError(f"patience must be an integer >= 1, got {patience!r}")
        if not math.isfinite(min_delta) or min_delta < 0:
            raise ValueError(f"min_delta must be a finite number >= 0, got {min_delta!r}")
        self.levels = [f.spec for f in formats]
        self.formats = formats
        self.patience = patience
        self.min_delta = float(min_delta)
        self.level = 0
        self.best = math.inf
        self.bad = 0
        self.changes: list[LevelChange] = []

    @property
    def current(self) -> str:
        """The spec in force."""
        return self.levels[self.level]

    @property
    def format(self):
        return self.formats[self.level]

    def step(self, valid_loss: float, update: int | None = None) -> str:
        """Apply the docs/spec.md §3 rule to one validation loss; return the spec now in force."""
        valid_loss = float(valid_loss)
        if not math.isfinite(valid_loss):
            raise ValueError(
                f"validation loss is {valid_loss}: the run diverged; a schedule steps on finite "
                "losses only"
            )
        if valid_loss < self.best - self.min_delta:
            self.best = valid_loss
            self.bad = 0
            return self.current
        self.bad += 1
        if self.bad >= self.patience and self.level + 1 < len(self.levels):
            change = LevelChange(
                update,
                self.level,
                self.level + 1,
                self.current,
                self.levels[self.level + 1],
                valid_loss,
            )
            self.level += 1
            self.bad = 0
            self.best = valid_loss
            self.changes.append(change)
        return self.current

    def state_dict(self) -> dict:
        return {
            "levels": list(self.levels),
            "level": self.level,
            "best": self.best,
            "bad": self.bad,
            "changes": [dataclasses.asdict(c) for c in self.changes],
        }

    def load_state_dict(self, state: dict) -> None:
        if list(state["levels"]) != self.levels:
            raise ValueError(
                f"checkpoint schedule levels {state['levels']} differ from this run's "
                f"{self.levels}; resume with the same quant config"
            )
        self.level = int(state["level"])
        self.best = float(state["best"])
        self.bad = int(state["bad"])
        self.changes = [LevelChange(**c) for c in state.get("changes", [])]

    def __repr__(self) -> str:
        return (
            f"Schedule({self.levels}, patience={self.patience}, min_delta={self.min_delta}, "
            f"level={self.level})"
        )
