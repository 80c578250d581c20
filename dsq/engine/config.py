"""QuantConfig: the four quantization points of docs/spec.md §2, controlled from one place.

Every DSQ layer holds a reference to the same ``QuantConfig``; stepping it after a validation
(``cfg.step(valid_loss, update)``) changes the format every layer uses from its next call on.
Each point also has a rounding mode (docs/dsq.md, "Rounding"): ``nearest`` (the default, the
paper's) or ``stochastic``, whose noise comes from one generator per device, seeded by the run
and saved in checkpoints (``noise_state``) so that a resumed run continues the same stream.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from dsq.formats import Format
from dsq.formats.base import ROUNDINGS

from .policies import DEFAULT_POLICY
from .schedule import LevelChange, Schedule
from .units import SETTINGS as GEMM_UNIT_SETTINGS

POINT_HELP = {
    "q0": "forward GEMM inputs x and W (blocks along K)",
    "q1": "the stash: activations saved for backward, stored packed (blocks along N)",
    "q2": "backward GEMM inputs g and W for dx (blocks along M)",
    "q3": "the incoming gradient dy as fetched (blocks along N)",
}
STASH_SCOPES = ("gemm", "all")
POINTS = ("q0", "q1", "q2", "q3")  # the four quantization points (docs/dsq.md); defined once, here
# How a config trains a model (docs/dsq.md, "Autocast: the baseline users run"): ``dsq``, the
# model patched with DSQ's layers; ``autocast``, the model as it is under ``torch.autocast`` in
# the points' 16-bit float, the mixed precision users run instead of dsq.
ENGINES = ("dsq", "autocast")
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# the keys of a quant config (a conf/quant preset, result.json's quant): the points, the stash
# scope, the rounding of each point, where its GEMMs run and the engine that trains
QUANT_KEYS = (*POINTS, "stash_scope", "rounding", "gemm_unit", "engine")


def _as_schedule(point: str, value) -> Schedule:
    if isinstance(value, Schedule):
        return value
    if isinstance(value, (str, Format)):
        return Schedule([value if isinstance(value, str) else value.spec])
    if isinstance(value, Mapping):
        if "levels" not in value:
            raise ValueError(
                f"{point}: a ladder is {{levels: [...], policy: NAME, <its parameters>}}, got "
                f'keys {sorted(value)} (docs/dsq.md, "Precision policies")'
            )
        params = {k: v for k, v in value.items() if k not in ("levels", "policy")}
        try:
            return Schedule(list(value["levels"]), value.get("policy", DEFAULT_POLICY), **params)
        except ValueError as err:
            raise ValueError(f"{point}: {err}") from None
    raise ValueError(f"{point}: expected a format spec or a schedule, got {value!r}")


def _as_rounding(rounding: Mapping | None) -> dict[str, str]:
    """Every point's rounding: ``nearest`` where ``rounding`` does not name the point."""
    rounding = dict(rounding or {})
    unknown = set(rounding) - set(POINTS)
    if unknown:
        raise ValueError(
            f"rounding: unknown point(s) {sorted(unknown)}; the points are {POINTS} "
            "(quant.rounding.q1=stochastic)"
        )
    for point, mode in rounding.items():
        if mode not in ROUNDINGS:
            raise ValueError(
                f"quant.rounding.{point}={mode!r} is not a rounding; choose one of {ROUNDINGS}"
            )
    return {p: str(rounding.get(p, "nearest")) for p in POINTS}


class QuantConfig:
    """The formats of the four DSQ points (each a spec string or a Schedule), the stash scope,
    each point's rounding (``{"q1": "stochastic"}``; unnamed points round to nearest) and where
    the GEMMs run (``gemm_unit``: ``auto``, the fastest unit exact for both operands, or
    ``fp32``; docs/dsq.md, "GEMM units")."""

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
    ):
        if engine not in ENGINES:
            raise ValueError(f"quant.engine={engine!r} is not an engine; choose one of {ENGINES}")
        if stash_scope not in STASH_SCOPES:
            raise ValueError(f"stash_scope must be one of {STASH_SCOPES}, got {stash_scope!r}")
        if gemm_unit not in GEMM_UNIT_SETTINGS:
            raise ValueError(
                f"quant.gemm_unit={gemm_unit!r} is not a setting; choose one of "
                f"{GEMM_UNIT_SETTINGS}"
            )
        self.gemm_unit = gemm_unit
        self.schedules = {p: _as_schedule(p, v) for p, v in zip(POINTS, (q0, q1, q2, q3))}
        self.stash_scope = stash_scope
        self.rounding = _as_rounding(rounding)
        self.seed = int(seed)
        self._generators: dict[str, torch.Generator] = {}
        self.engine = engine
        if engine == "autocast":
            self._check_autocast()

    def _check_autocast(self) -> None:
        """``engine=autocast`` runs the model unpatched under ``torch.autocast``: one 16-bit
        float at every point, nothing scheduled, no stash of its own, nearest rounding."""
        specs = {s.current for s in self.schedules.values()}
        moving = [p for p, s in self.schedules.items() if s.moves]
        if len(specs) != 1 or next(iter(specs)) not in AUTOCAST_DTYPES or moving:
            raise ValueError(
                "quant.engine=autocast runs the unpatched model under torch.autocast: every point "
                f"must be one of {sorted(AUTOCAST_DTYPES)}, the same and static, got "
                f"{self.current()}"
            )
        if self.stash_scope != "gemm" or set(self.rounding.values()) != {"nearest"}:
            raise ValueError(
                "quant.engine=autocast keeps autograd's own saved tensors and rounds to nearest: "
                "stash_scope must be gemm and every rounding nearest"
            )

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype ``engine=autocast`` trains in; None for the dsq engine."""
        if self.engine != "autocast":
            return None
        return AUTOCAST_DTYPES[self.schedules["q0"].current]

    @classmethod
    def from_dict(cls, config: Mapping, seed: int = 0) -> QuantConfig:
        """From a preset mapping (conf/quant/*.yaml): q0..q3, stash_scope and rounding.
        ``seed`` seeds the stochastic rounding noise (a run passes its own seed)."""
        unknown = set(config) - set(QUANT_KEYS) - {"name"}
        if unknown:
            raise ValueError(
                f"unknown quantization point(s) {sorted(unknown)}; the points are {POINTS} "
                "(plus stash_scope, rounding, gemm_unit and engine)"
            )
        return cls(**{k: v for k, v in config.items() if k != "name"}, seed=seed)

    def schedule(self, point: str) -> Schedule:
        if point not in self.schedules:
            raise ValueError(f"unknown quantization point {point!r}; the points are {POINTS}")
        return self.schedules[point]

    def format(self, point: str) -> Format:
        """The format in force at ``point``."""
        return self.schedule(point).format

    def rounding_of(self, point: str, device: torch.device) -> tuple[str, torch.Generator | None]:
        """(rounding, generator) for a quantizer at ``point`` on ``device``: the generator draws
        the stochastic rounding noise (None for nearest rounding)."""
        mode = self.rounding[point]
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
        return (
            f"QuantConfig({self.current()}, stash_scope={self.stash_scope!r}{rounding}{unit}"
            f"{engine})"
        )
