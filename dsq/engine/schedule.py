"""Time-adaptive precision (docs/dsq.md, "Precision policies"): a ladder of formats, rising in
bits, and the policy that decides which level is in force at each update.

The default policy, ``plateau``, is DSQ's rule: after every validation, if ``valid_loss < best -
min_delta`` the loss improved (``best`` moves, ``bad`` resets); otherwise ``bad`` grows, and when
it reaches ``patience`` and a higher level exists, the ladder moves one level up and starts
afresh (``bad = 0``, ``best = valid_loss``). The others (``cyclic``, ``pfq``, ``shape``) are in
`policies`. A level put in force after an update or a validation applies from the next update.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from dsq.formats import parse_format

from .policies import DEFAULT_POLICY, Move, make_policy


@dataclasses.dataclass(frozen=True)
class LevelChange:
    """One precision change: after ``update``, ``from_spec`` -> ``to_spec`` (level indices too);
    the loss that triggered it (validation loss for ``plateau``, the window's mean training loss
    for ``pfq``; None for a policy of the update count)."""

    update: int | None
    from_level: int
    to_level: int
    from_spec: str
    to_spec: str
    valid_loss: float | None
    train_loss: float | None = None
    policy: str = DEFAULT_POLICY


def level_bits(fmt) -> int:
    """A level's bit width for the policies of the update count: sign plus significant bits
    (``bfpN``: N, ``fixedW``: W)."""
    return fmt.significant_bits + 1


class Schedule:
    """An ascending ladder of formats and its policy (``plateau`` unless named), starting at the
    first level unless the policy says otherwise at `start`. ``params`` are the policy's
    (``patience=2`` for ``plateau``, ``periods=32`` for ``cyclic``)."""

    def __init__(self, levels, policy: str = DEFAULT_POLICY, **params) -> None:
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
        self.levels = [f.spec for f in formats]
        self.formats = formats
        self.policy = make_policy(policy, params, [level_bits(f) for f in formats])
        self.level = 0
        self.changes: list[LevelChange] = []

    @property
    def current(self) -> str:
        """The spec in force."""
        return self.levels[self.level]

    @property
    def format(self):
        return self.formats[self.level]

    @property
    def moves(self) -> bool:
        """Whether the level can ever change (a ladder of more than one format)."""
        return len(self.levels) > 1

    def start(self, total_updates: int, updates_done: int = 0) -> None:
        """Before training (and on resume, after `load_state_dict`): the run's planned updates,
        which the policies of the update count need, and the level in force for the next
        update. Setting it here is not a change: the run has not trained at any level yet, or
        (on resume) it sets the level the checkpoint already holds."""
        level = self.policy.start(total_updates, updates_done)
        if level is not None and self.moves:
            self.level = level

    def after_update(self, update: int, train_loss: float | None = None) -> str:
        """Tell the policy that ``update`` is done (with its training loss); the spec in force
        for the next update."""
        if self.moves:
            self._apply(self.policy.after_update(update, train_loss), update)
        return self.current

    def step(self, valid_loss: float, update: int | None = None) -> str:
        """Tell the policy a validation's loss; the spec in force for the next update."""
        valid_loss = float(valid_loss)
        if not math.isfinite(valid_loss):
            raise ValueError(
                f"validation loss is {valid_loss}: the run diverged; a schedule steps on finite "
                "losses only"
            )
        self._apply(self.policy.after_validation(update, valid_loss, self.level), update)
        return self.current

    def _apply(self, move: Move | None, update: int | None) -> None:
        if move is None or move.level == self.level:
            return
        self.changes.append(
            LevelChange(
                update,
                self.level,
                move.level,
                self.current,
                self.levels[move.level],
                move.valid_loss,
                move.train_loss,
                self.policy.name,
            )  # fmt: skip
        )
        self.level = move.level

    def state_dict(self) -> dict:
        return {
            "levels": list(self.levels),
            "level": self.level,
            "policy": self.policy.name,
            **self.policy.state_dict(),
            "changes": [dataclasses.asdict(c) for c in self.changes],
        }

    def load_state_dict(self, state: Mapping) -> None:
        if list(state["levels"]) != self.levels:
            raise ValueError(
                f"checkpoint schedule levels {state['levels']} differ from this run's "
                f"{self.levels}; resume with the same quant config"
            )
        policy = state.get("policy", DEFAULT_POLICY)  # checkpoints before policies: plateau's
        if policy != self.policy.name:
            raise ValueError(
                f"the checkpoint's ladder {self.levels} follows policy {policy}, this run's "
                f"{self.policy.name}; resume with the same quant config"
            )
        self.level = int(state["level"])
        self.policy.load_state_dict(state)
        self.changes = [LevelChange(**c) for c in state.get("changes", [])]

    def __repr__(self) -> str:
        return f"Schedule({self.levels}, policy={self.policy.describe()}, level={self.level})"
