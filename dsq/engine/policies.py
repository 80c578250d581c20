"""Precision policies (docs/dsq.md, "Precision policies"): the rule that decides which level of a
point's ladder of formats is in force at each update.

A policy is one small registered class (`register`) with a typed parameter dataclass. It sees
what its source's rule needs and answers with a level index of the ladder, or None (no change):

    start(total_updates, updates_done)   once before training (and again on resume)
    after_update(update, train_loss)     after every update; the answer applies from the next
    after_validation(update, valid_loss) after every validation; the answer applies from the next

Policies that are functions of the update count (``cyclic``, ``shape``) compute a bit width ``b``
from their source's formula, with ``b_min`` and ``b_max`` the bit widths of the ladder's first and
last levels (a level's bit width: sign plus significant bits, so ``bfpN`` is N bits, ``fixedW``
is W), and put in force the highest level whose bit width is at most ``b``. On a ladder with one
format per bit width (bfp3, bfp4, ..., bfp8) that is exactly the source's bit schedule.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

POLICIES: dict[str, type[Policy]] = {}
DEFAULT_POLICY = "plateau"


@dataclasses.dataclass(frozen=True)
class Move:
    """A policy's answer: put ``level`` in force; ``valid_loss`` or ``train_loss`` is the loss
    that triggered it (None for a policy of the update count)."""

    level: int
    valid_loss: float | None = None
    train_loss: float | None = None


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make a policy reachable by its ``name`` (``quant.q1.policy=NAME``)."""
    POLICIES[cls.name] = cls
    return cls


def policy_names() -> list[str]:
    return list(POLICIES)


def parameter_names(name: str) -> list[str]:
    return [f.name for f in dataclasses.fields(POLICIES[name].Params)]


def policy_defaults(name: str) -> dict[str, Any]:
    """The parameters of policy ``name`` at their defaults (an unknown name: none)."""
    if name not in POLICIES:
        return {}
    return {f.name: f.default for f in dataclasses.fields(POLICIES[name].Params)}


def all_parameter_names() -> set[str]:
    """Every parameter of every registered policy (the keys a ladder's mapping may hold)."""
    return {key for name in POLICIES for key in parameter_names(name)}


def make_policy(name: str, params: Mapping[str, Any], ladder_bits: Sequence[int]) -> Policy:
    """The policy ``name`` with ``params`` (unnamed ones at their defaults) on a ladder whose
    levels have bit widths ``ladder_bits``; a one-line ValueError for an unknown policy, a
    parameter that belongs to another policy, or a value out of range."""
    if name not in POLICIES:
        raise ValueError(f"unknown precision policy {name!r}; choose one of {policy_names()}")
    cls = POLICIES[name]
    own = parameter_names(name)
    for key in params:
        if key not in own:
            owners = [other for other in POLICIES if key in parameter_names(other)]
            whose = f"a parameter of policy {owners[0]}, not {name}" if owners else "no parameter"
            takes = ", ".join(own) if own else "no parameters"
            raise ValueError(f"{key} is {whose}; policy {name} takes {takes}")
    hints = typing.get_type_hints(cls.Params)
    values = {}
    for key, value in params.items():
        values[key] = _typed(name, key, value, hints[key])
    policy = cls(cls.Params(**values), list(ladder_bits))
    policy.check()
    return policy


def _typed(policy: str, key: str, value, hint) -> Any:
    """``value`` as the parameter's declared type (int, float, bool, str, or an optional one)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if value is None and type(None) in typing.get_args(hint):
        return None
    kind = args[0] if args else hint
    ok = (
        (kind is bool and isinstance(value, bool))
        or (kind is int and isinstance(value, int) and not isinstance(value, bool))
        or (kind is float and isinstance(value, (int, float)) and not isinstance(value, bool))
        or (kind is str and isinstance(value, str))
    )
    if not ok:
        raise ValueError(f"{key} of policy {policy} must be {kind.__name__}, got {value!r}")
    return float(value) if kind is float else value


def highest_level_within(ladder_bits: Sequence[int], bits: float) -> int:
    """The highest level whose bit width is at most ``bits`` (the first level if none is)."""
    level = 0
    for index, width in enumerate(ladder_bits):
        if width <= bits:
            level = index
    return level


class Policy:
    """The base: never moves. Subclasses set ``name`` and ``Params`` and override what they use."""

    name: ClassVar[str]
    Params: ClassVar[type]
    # whether `after_update` needs every update's training loss (a caller that sees none, such
    # as a Trainer callback, refuses the policy)
    needs_train_loss: ClassVar[bool] = False

    def __init__(self, params, ladder_bits: list[int]):
        self.params = params
        self.ladder_bits = ladder_bits

    def check(self) -> None:
        """Refuse parameter values out of range (one-line ValueError)."""

    def check_total(self, total_updates: int) -> None:
        """Refuse a run of ``total_updates`` the parameters do not fit (one-line ValueError);
        checked with the config where the cap is known, and again at `start`."""

    def start(self, total_updates: int, updates_done: int) -> int | None:
        return None

    def after_update(self, update: int, train_loss: float | None) -> Move | None:
        return None

    def after_validation(self, update: int, valid_loss: float, level: int) -> Move | None:
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: Mapping) -> None:
        pass

    def describe(self) -> str:
        values = ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(self.params).items())
        return f"{self.name}({values})"


def _positive_int(policy: str, key: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{key} of policy {policy} must be an integer >= 1, got {value!r}")


# -- DSQ's plateau rule --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PlateauParams:
    patience: int = 1  # validations without improvement before the next level
    min_delta: float = 0.0  # an improvement must beat the best loss by more than this


@register
class Plateau(Policy):
    """DSQ's rule (the paper's; docs/dsq.md, "The schedule"): after every validation, if
    ``valid_loss < best - min_delta`` the loss improved (``best`` moves, ``bad`` resets);
    otherwise ``bad`` grows, and when it reaches ``patience`` and a higher level exists, the
    ladder moves one level up and starts afresh (``bad = 0``, ``best = valid_loss``)."""

    name = "plateau"
    Params = PlateauParams

    def __init__(self, params: PlateauParams, ladder_bits: list[int]):
        super().__init__(params, ladder_bits)
        self.best = math.inf
        self.bad = 0

    def check(self) -> None:
        _positive_int(self.name, "patience", self.params.patience)
        if not math.isfinite(self.params.min_delta) or self.params.min_delta < 0:
            raise ValueError(
                f"min_delta must be a finite number >= 0, got {self.params.min_delta!r}"
            )

    def after_validation(self, update: int, valid_loss: float, level: int) -> Move | None:
        if valid_loss < self.best - self.params.min_delta:
            self.best = valid_loss
            self.bad = 0
            return None
        self.bad += 1
        if self.bad >= self.params.patience and level + 1 < len(self.ladder_bits):
            self.bad = 0
            self.best = valid_loss
            return Move(level + 1, valid_loss=valid_loss)
        return None

    def state_dict(self) -> dict:
        return {"best": self.best, "bad": self.bad}

    def load_state_dict(self, state: Mapping) -> None:
        self.best = float(state["best"])
        self.bad = int(state["bad"])


# -- policies of the update count ----------------------------------------------------------------
class _OfUpdateCount(Policy):
    """A bit width that is a function of ``i``, the number of updates made before the update it
    applies to (the sources' 0-based iteration), and of the run's total updates."""

    def __init__(self, params, ladder_bits: list[int]):
        super().__init__(params, ladder_bits)
        self.total: int | None = None

    def bits(self, i: int) -> float:
        raise NotImplementedError

    def level_at(self, i: int) -> int:
        return highest_level_within(self.ladder_bits, self.bits(i))

    def start(self, total_updates: int, updates_done: int) -> int:
        self.check_total(total_updates)
        self.total = int(total_updates)
        return self.level_at(updates_done)

    def after_update(self, update: int, train_loss: float | None) -> Move | None:
        if self.total is None:
            raise RuntimeError(f"policy {self.name}: start(total_updates) was not called")
        return Move(self.level_at(update))


@dataclasses.dataclass(frozen=True)
class CyclicParams:
    periods: int = 32  # cosine cycles in the run (CPT's CIFAR runs: 32)


@register
class Cyclic(_OfUpdateCount):
    """CPT (Fu et al., ICLR 2021; GATECH-EIC/CPT cpt_cifar/train.py, cyclic_adjust_precision):
    ``b(i) = rint(b_min + 0.5 (b_max - b_min) (1 + cos(pi (i mod T) / T + pi)))`` with
    ``T = int(total_updates / periods)``; rint rounds half to even, as numpy's does."""

    name = "cyclic"
    Params = CyclicParams

    def check(self) -> None:
        _positive_int(self.name, "periods", self.params.periods)

    def check_total(self, total_updates: int) -> None:
        if total_updates < self.params.periods:
            raise ValueError(
                f"policy cyclic: {self.params.periods} periods do not fit in {total_updates} "
                f"updates; set periods to at most {total_updates}"
            )

    def period(self) -> int:
        return int(self.total / self.params.periods)

    def bits(self, i: int) -> float:
        low, high = self.ladder_bits[0], self.ladder_bits[-1]
        period = self.period()
        return round(
            low + 0.5 * (high - low) * (1 + math.cos(math.pi * ((i % period) / period) + math.pi))
        )


@dataclasses.dataclass(frozen=True)
class ShapeParams:
    shape: str = "cos"  # cos | linear | exp | demon
    direction: str = "growth"  # growth | decay (decay periods alternate with growth ones)
    periods: int = 1  # periods in the run
    exponent: float = 4.0  # exp's rate
    flip_vertically: bool = False  # the decays' mirrored variant (exp and demon only)


SHAPES = ("cos", "linear", "exp", "demon")
DIRECTIONS = ("growth", "decay")


def _shape_value(shape: str, growth: bool, period: int, i: int, low: float, high: float,
                 exponent: float, flip: bool) -> float:  # fmt: skip
    """Wolfe & Kyrillidis's ``calc_<shape>_<growth|decay>`` (BetterPrecisionSchedules
    cpt_cifar/quant_scheds.py), before rounding, transcribed term for term."""
    if shape == "cos":
        z = float(i % period) / period
        if growth:
            return low + 0.5 * float(high - low) * (1.0 - math.cos(math.pi * z))
        return high - 0.5 * float(high - low) * (1.0 - math.cos(math.pi * z))
    if shape == "linear":
        mod = float(i % period)
        if growth:
            return low + (float(high - low) * (float(mod) / period))
        return high - (float(high - low) * (float(mod) / period))
    if shape == "exp":
        z = float(i % period) / period
        if growth:
            return high - float(high - low) * math.exp(-exponent * z)
        if flip:
            return low + float(high - low) * math.exp(-exponent * z)
        z = 1.0 - z
        return high - float(high - low) * math.exp(-exponent * z)
    # demon
    z = float(period - float(i % period)) / period
    if growth:
        return high - float(high - low) * (z / (1 - 0.9 + 0.9 * z))
    if flip:
        return low + float(high - low) * (z / (1 - 0.9 + 0.9 * z))
    z = 1.0 - z
    return high - float(high - low) * (z / (1 - 0.9 + 0.9 * z))


@register
class Shape(_OfUpdateCount):
    """Growth and decay shapes (Wolfe & Kyrillidis; wolfecameron/BetterPrecisionSchedules,
    cpt_cifar/quant_scheds.py and train.py's cyclic_adjust_precision): cosine, linear,
    exponential or demon, growing or decaying within each of ``periods`` periods of
    ``T = int(total_updates / periods) + 1`` updates; a decay runs in even periods (0, 2, ...)
    and grows in odd ones, as train.py does. Rounded half to even (numpy's rint)."""

    name = "shape"
    Params = ShapeParams

    def check(self) -> None:
        if self.params.shape not in SHAPES:
            raise ValueError(f"shape {self.params.shape!r} is not one of {SHAPES}")
        if self.params.direction not in DIRECTIONS:
            raise ValueError(f"direction {self.params.direction!r} is not one of {DIRECTIONS}")
        _positive_int(self.name, "periods", self.params.periods)
        if not math.isfinite(self.params.exponent) or self.params.exponent <= 0:
            raise ValueError(f"exponent must be a finite number > 0, got {self.params.exponent!r}")

    def period(self) -> int:
        return int(self.total / self.params.periods) + 1

    def bits(self, i: int) -> float:
        p = self.params
        period = self.period()
        growth = p.direction == "growth" or (i // period) % 2 == 1
        low, high = self.ladder_bits[0], self.ladder_bits[-1]
        return round(_shape_value(p.shape, growth, period, i, low, high, p.exponent,
                                  p.flip_vertically))  # fmt: skip


# -- FracTrain's progressive fractional quantization ---------------------------------------------
@dataclasses.dataclass(frozen=True)
class PfqParams:
    threshold: float = 0.15  # initial_threshold: the largest relative loss change of a plateau
    decay: float = 0.4  # the threshold is multiplied by this after turning points 1 and 2
    keep: int = 5  # window losses compared (the newest against the 4 before it)
    scale_windows: int = 10  # the scale is the mean of the first this many window losses
    turning_points: int | None = None  # moves allowed (default: to the ladder's top)


@register
class Pfq(Policy):
    """FracTrain's PFQ (Fu et al., NeurIPS 2020; GATECH-EIC/FracTrain fractrain_cifar/
    train_pfq.py, loss_diff_indicator): the training loss is averaged over each window between
    two validations (FracTrain's ``eval_every`` iterations); ``scale`` is the mean of the first
    ``scale_windows`` window losses; the last ``keep`` window losses are kept, and when all
    ``keep - 1`` ratios ``|L_i - L_now| / scale`` are at most ``threshold``, that is a turning
    point: the ladder moves one level up, the threshold is multiplied by ``decay`` after the
    first and second turning points, and the kept losses are cleared. FracTrain divides each
    window's loss sum by the epoch's batch count instead of the window's length; the ratios are
    the same, since the scale is divided alike."""

    name = "pfq"
    Params = PfqParams
    needs_train_loss = True

    def __init__(self, params: PfqParams, ladder_bits: list[int]):
        super().__init__(params, ladder_bits)
        self.threshold = params.threshold
        self.window_sum = 0.0
        self.window_updates = 0
        self.windows = 0
        self.scale_sum = 0.0
        self.scale = 1.0
        self.losses: list[float] = []
        self.turning = 0

    def check(self) -> None:
        p = self.params
        for key in ("threshold", "decay"):
            value = getattr(p, key)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"{key} of policy pfq must be a finite number > 0, got {value!r}")
        if p.keep < 2:
            raise ValueError(f"keep of policy pfq must be an integer >= 2, got {p.keep!r}")
        _positive_int(self.name, "scale_windows", p.scale_windows)
        most = len(self.ladder_bits) - 1
        if p.turning_points is not None and not 0 <= p.turning_points <= most:
            raise ValueError(
                f"turning_points of policy pfq must be between 0 and {most} (the ladder's "
                f"moves), got {p.turning_points!r}"
            )

    @property
    def allowed(self) -> int:
        tp = self.params.turning_points
        return len(self.ladder_bits) - 1 if tp is None else tp

    def after_update(self, update: int, train_loss: float | None) -> Move | None:
        if train_loss is None:
            raise ValueError("policy pfq needs every update's training loss")
        self.window_sum += float(train_loss)
        self.window_updates += 1
        return None

    def after_validation(self, update: int, valid_loss: float, level: int) -> Move | None:
        if self.window_updates == 0:  # a validation with no update since the last one
            return None
        window = self.window_sum / self.window_updates
        self.window_sum, self.window_updates = 0.0, 0
        self.windows += 1
        if self.windows <= self.params.scale_windows:
            self.scale_sum += window
            self.scale = self.scale_sum / self.windows
        if self.turning >= self.allowed:
            return None
        self.losses = (self.losses + [window])[-self.params.keep :]
        if len(self.losses) < self.params.keep:
            return None
        now = self.losses[-1]
        if any(abs(before - now) / self.scale > self.threshold for before in self.losses[:-1]):
            return None
        self.turning += 1
        if self.turning in (1, 2):
            self.threshold *= self.params.decay
        self.losses = []
        return Move(min(self.turning, len(self.ladder_bits) - 1), train_loss=window)

    def state_dict(self) -> dict:
        return {
            "threshold": self.threshold,
            "window_sum": self.window_sum,
            "window_updates": self.window_updates,
            "windows": self.windows,
            "scale_sum": self.scale_sum,
            "scale": self.scale,
            "losses": list(self.losses),
            "turning": self.turning,
        }

    def load_state_dict(self, state: Mapping) -> None:
        self.threshold = float(state["threshold"])
        self.window_sum = float(state["window_sum"])
        self.window_updates = int(state["window_updates"])
        self.windows = int(state["windows"])
        self.scale_sum = float(state["scale_sum"])
        self.scale = float(state["scale"])
        self.losses = [float(x) for x in state["losses"]]
        self.turning = int(state["turning"])
