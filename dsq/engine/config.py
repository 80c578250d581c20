"""QuantConfig: the four quantization points of docs/spec.md §2, controlled from one place.

A ``QuantConfig`` is built from a ``QuantSpec`` (spec.py: what was asked for, frozen; ``cfg.spec``,
``cfg.to_dict()``) and holds what is in force as the run trains: each point's schedule (its
level, its policy's state, the changes so far) and the stochastic rounding's generators.
Every DSQ layer holds a reference to the same ``QuantConfig``; stepping it after a validation
(``cfg.step(valid_loss, update)``) changes the format every layer uses from its next call on.
Each point also has a rounding mode (docs/dsq.md, "Rounding"): ``nearest`` (the default, the
paper's) or ``stochastic``, whose noise comes from one generator per device, seeded by the run
and saved in checkpoints (``noise_state``) so that a resumed run continues the same stream.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from dsq.formats import Format, parse_format

from .schedule import LevelChange, Schedule
from .spec import (  # noqa: F401  (POINTS and the quant keys are defined in spec.py; named here too)
    AUTOCAST_DTYPES,
    DERIVATIVE_HOLDS,
    ENGINES,
    POINTS,
    QUANT_KEYS,
    SAVED_DEFAULT,
    STASH_SCOPES,
    QuantSpec,
)

POINT_HELP = {
    "q0": "forward GEMM inputs x and W (blocks along K)",
    "q1": "the stash: activations saved for backward, stored packed (blocks along N)",
    "q2": "backward GEMM inputs g and W for dx (blocks along M)",
    "q3": "the incoming gradient dy as fetched (blocks along N)",
}


class QuantConfig:
    """The four DSQ points as a run trains with them: built from a ``QuantSpec`` (``spec``) with
    the same keywords (each point a format spec, a ``Ladder``, a ``Schedule`` or a ladder's
    mapping), it holds each point's schedule and the stochastic rounding noise's generators,
    seeded with ``seed``. ``from_preset("dsq")`` builds one from a preset of ``dsq.presets``.

    A ``Schedule`` given for a point is the one the config steps (its state included); any other
    point gets a new schedule at its first level."""

    def __init__(
        self,
        q0="fp32",
        q1="fp32",
        q2="fp32",
        q3="fp32",
        stash_scope: str = "gemm",
        rounding: Mapping[str, str] | None = None,
        seed: int = 0,
        gemm_unit: str = "auto",
        engine: str = "dsq",
        attention: str = "tiled",
        mlp: str = "whole",
        saved: Mapping[str, str] | None = None,
    ):
        given = dict(zip(POINTS, (q0, q1, q2, q3)))
        self.spec = QuantSpec(
            **given, stash_scope=stash_scope, rounding=rounding, gemm_unit=gemm_unit,
            engine=engine, attention=attention, mlp=mlp, saved=saved,
        )  # fmt: skip
        self.schedules: dict[str, Schedule] = self.spec.schedules()
        self.schedules |= {p: v for p, v in given.items() if isinstance(v, Schedule)}
        self.seed = int(seed)
        self._generators: dict[str, torch.Generator] = {}

    @classmethod
    def from_spec(cls, spec: QuantSpec, seed: int = 0) -> QuantConfig:
        """A config of ``spec``, every point at its first level."""
        if not isinstance(spec, QuantSpec):
            raise TypeError(f"expected a QuantSpec, got {type(spec).__name__}")
        return cls(**spec.keywords(), seed=seed)

    @classmethod
    def from_dict(cls, config: Mapping, seed: int = 0) -> QuantConfig:
        """From a preset mapping (conf/quant/*.yaml; ``QuantSpec.from_dict``'s keys). ``seed``
        seeds the stochastic rounding noise (a run passes its own seed)."""
        return cls.from_spec(QuantSpec.from_dict(config), seed)

    @classmethod
    def from_preset(cls, name: str, seed: int = 0) -> QuantConfig:
        """From the preset ``name`` of ``dsq.presets`` (``dsq``, ``stash_bfp``, ``fp32``, ...);
        an unknown name is a ValueError listing them."""
        from dsq.presets import get_preset

        return cls.from_spec(get_preset(name), seed)

    def to_dict(self) -> dict:
        """The spec's mapping (``QuantSpec.to_dict``): what was asked for, not what is in force."""
        return self.spec.to_dict()

    @property
    def stash_scope(self) -> str:
        return self.spec.stash_scope

    @property
    def rounding(self) -> dict[str, str]:
        """Every point's rounding mode."""
        return dict(self.spec.rounding)

    @property
    def gemm_unit(self) -> str:
        return self.spec.gemm_unit

    @property
    def engine(self) -> str:
        return self.spec.engine

    @property
    def attention(self) -> str:
        return self.spec.attention

    @property
    def mlp(self) -> str:
        return self.spec.mlp

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype ``engine=autocast`` trains in; None for the dsq engine."""
        if self.engine != "autocast":
            return None
        return AUTOCAST_DTYPES[self.schedules["q0"].current]

    def schedule(self, point: str) -> Schedule:
        if point not in self.schedules:
            raise ValueError(f"unknown quantization point {point!r}; the points are {POINTS}")
        return self.schedules[point]

    def format(self, point: str) -> Format:
        """The format in force at ``point``."""
        return self.schedule(point).format

    def saved_format(self, kind: str | None) -> Format | None:
        """The format ``stash_scope="all"`` holds a saved tensor of ``kind`` in (`SAVED_KINDS`;
        None: a GEMM's input, held in q1), or None where it is kept as autograd saved it (every
        kind under ``stash_scope="gemm"``, which has no rules)."""
        what = "q1" if kind is None else self.spec.saved.get(kind, "keep")
        if what in DERIVATIVE_HOLDS:  # an activation module without a code of its derivative
            what = SAVED_DEFAULT["activation"]
        if what == "keep":
            return None
        return self.format("q1") if what == "q1" else parse_format(what)

    @property
    def derivative_code_bits(self) -> int | None:
        """The bits of the activations' derivative codes (``quant.saved.activation=derivative3``:
        3), None where activations hold no codes."""
        what = self.spec.saved.get("activation", "")
        return int(what.removeprefix("derivative")) if what in DERIVATIVE_HOLDS else None

    def rounding_of(self, point: str, device: torch.device) -> tuple[str, torch.Generator | None]:
        """(rounding, generator) for a quantizer at ``point`` on ``device``: the generator draws
        the stochastic rounding noise (None for nearest rounding)."""
        mode = self.spec.rounding[point]
        return mode, (self.generator(device) if mode == "stochastic" else None)

    def generator(self, device: torch.device | str) -> torch.Generator:
        """The noise generator of ``device``'s type, seeded with ``seed`` on first use; every
        stochastic point draws from it in the order the quantizers run."""
        kind = torch.device(device).type
        if kind not in self._generators:
            self._generators[kind] = torch.Generator(device=kind).manual_seed(self.seed)
        return self._generators[kind]

    def start(self, total_updates: int, updates_done: int = 0) -> None:
        """Before training (and on resume, after `load_state_dict`): give every policy the
        run's planned updates and let it set the level for the next update."""
        for schedule in self.schedules.values():
            schedule.start(total_updates, updates_done)

    def check_total(self, total_updates: int) -> None:
        """Refuse a run of at most ``total_updates`` that a point's policy does not fit."""
        for point, schedule in self.schedules.items():
            if schedule.moves:
                try:
                    schedule.policy.check_total(total_updates)
                except ValueError as err:
                    raise ValueError(f"{point}: {err}") from None

    def after_update(
        self, update: int, train_loss: float | None = None
    ) -> list[tuple[str, LevelChange]]:
        """Tell every policy that ``update`` is done; return the changes it caused (in force
        from the next update)."""
        return self._changes(lambda s: s.after_update(update, train_loss))

    def step(self, valid_loss: float, update: int | None = None) -> list[tuple[str, LevelChange]]:
        """Step every schedule on one validation loss; return the changes it caused."""
        return self._changes(lambda s: s.step(valid_loss, update))

    def _changes(self, act) -> list[tuple[str, LevelChange]]:
        changes = []
        for point, schedule in self.schedules.items():
            before = len(schedule.changes)
            act(schedule)
            changes += [(point, c) for c in schedule.changes[before:]]
        return changes

    def current(self) -> dict[str, str]:
        """The spec in force at every point."""
        return {p: s.current for p, s in self.schedules.items()}

    def state_dict(self) -> dict:
        """Each point's schedule state (level, best, bad, change log), for checkpoints."""
        return {p: s.state_dict() for p, s in self.schedules.items()}

    def load_state_dict(self, state: Mapping) -> None:
        for point, schedule in self.schedules.items():
            schedule.load_state_dict(state[point])

    def noise_state(self) -> dict:
        """The stochastic rounding generators' states (those used so far), for checkpoints."""
        return {kind: g.get_state() for kind, g in self._generators.items()}

    def load_noise_state(self, state: Mapping) -> None:
        """Continue the noise streams saved by ``noise_state``."""
        for kind, generator_state in state.items():
            self.generator(kind).set_state(generator_state)

    def __repr__(self) -> str:
        stochastic = [p for p, mode in self.rounding.items() if mode == "stochastic"]
        rounding = f", stochastic rounding at {stochastic}" if stochastic else ""
        unit = f", gemm_unit={self.gemm_unit!r}" if self.gemm_unit != "auto" else ""
        engine = f", engine={self.engine!r}" if self.engine != "dsq" else ""
        saved = f", saved={dict(self.spec.saved)!r}" if self.stash_scope == "all" else ""
        return (
            f"QuantConfig({self.current()}, stash_scope={self.stash_scope!r}{saved}{rounding}"
            f"{unit}{engine})"
        )
