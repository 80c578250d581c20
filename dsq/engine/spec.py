"""QuantSpec: what a quant config asks for, as one frozen value (docs/dsq.md, "Presets and
specs").

A ``QuantSpec`` is the specification a user writes or a preset names (``dsq.presets``): the
format or ``Ladder`` of each of the four points (docs/spec.md §2), the stash scope, each point's
rounding, where the GEMMs run and the engine that trains. It is compared by content, and
``to_dict`` writes it as the mapping conf/quant/*.yaml and result.json's ``quant`` hold
(``from_dict`` reads it back, checking every key). What a run has in force as it trains (each
ladder's level and its policy's state, the stochastic rounding's generators) is not part of it:
that is ``QuantConfig``'s (config.py), built from a spec and saved in checkpoints.

A spec is checked when it is made: every format parses, every ladder rises in bits under a known
policy with that policy's parameters, and ``engine="autocast"`` asks for what autocast can run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch

from dsq.formats import Format, parse_format
from dsq.formats.base import ROUNDINGS

from .derivative_codes import BITS as DERIVATIVE_BITS
from .policies import DEFAULT_POLICY
from .schedule import Schedule
from .units import SETTINGS as GEMM_UNIT_SETTINGS

POINTS = ("q0", "q1", "q2", "q3")  # the four quantization points (docs/dsq.md); defined once, here
STASH_SCOPES = ("gemm", "all")
# How a config trains a model (docs/dsq.md, "Autocast: the baseline users run"): ``dsq``, the
# model patched with DSQ's layers; ``autocast``, the model as it is under ``torch.autocast`` in
# the points' 16-bit float, the mixed precision users run instead of dsq.
ENGINES = ("dsq", "autocast")
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# the keys of a quant config (a conf/quant preset, result.json's quant): the points, the stash
# scope, the rounding of each point, where its GEMMs run and the engine that trains
QUANT_KEYS = (
    *POINTS, "stash_scope", "rounding", "gemm_unit", "engine", "attention", "mlp", "saved"
)  # fmt: skip
# What stash_scope="all" holds of each kind of tensor autograd saves outside the GEMMs (docs/dsq.md,
# "What stash_scope=all holds"): the inputs of a normalization, of a pointwise activation, the
# other tensors of the graph (an elementwise product's operands, a softmax's output) and tensors
# that need no gradient (RoPE's cos and sin), and the input a checkpointed layer keeps in place of
# its activations (docs/dsq.md, "What the backward pass holds"). Each holds a format spec, "q1"
# (the stash point's format in force) or "keep" (as autograd saved it). A GEMM's input is always
# held in q1.
SAVED_KINDS = ("norm", "activation", "elementwise", "constant", "checkpoint")
SAVED_HOLDS = ("q1", "keep")
# An activation may also hold "derivative<k>": SiLU's and GELU's modules hold a k-bit code of
# their derivative instead of their input (docs/dsq.md, "Derivative codes"); any other activation
# module holds the activation default below, and the patch report names it.
DERIVATIVE_HOLDS = tuple(f"derivative{bits}" for bits in DERIVATIVE_BITS)
# Eight-bit blocks for what the derivatives read: the 2-bit stash everywhere did not train (a
# Llama LM and the demo barely learned); GEMM inputs, whose errors the DSQ schedule manages, stay
# in q1.
SAVED_DEFAULT = MappingProxyType(
    {
        "norm": "bfp8e8b16",
        "activation": "bfp8e8b16",
        "elementwise": "bfp8e8b16",
        "constant": "keep",
        # float32 until its quality is measured: holding it narrow rounds every layer's input
        "checkpoint": "keep",
    }
)
# How the attention products run (docs/dsq.md, "Attention in tiles"): ``tiled``, a block of query
# rows at a time, holding nothing sequence x sequence; ``explicit``, the definition, with the
# scores and probabilities whole. The same values up to float32 summation order. ``sdpa_bf16``, a
# rule of its own with other values: torch's fused kernel in bf16 on q0's Q, K and V, its
# products bf16 products (docs/dsq.md, "Attention in torch's fused kernel").
ATTENTION_KERNELS = ("tiled", "explicit", "sdpa_bf16")
# the settings of quant.attention whose values differ from the definition's: a run with one is a
# run of its own row, not its preset's
ATTENTION_RULES = ("sdpa_bf16",)
# How a Llama-style MLP runs (docs/dsq.md, "The MLP in slices"): ``whole``, its three DSQ layers
# on every token at once; ``sliced``, a slice of tokens at a time, holding only its input for the
# backward pass and running its forward again there. Under ``stash_scope=gemm`` the same values
# up to float32 summation order; under ``all`` the slices compute again what the rules would
# hold narrow. ``sliced`` needs nearest rounding at every point.
MLP_KINDS = ("whole", "sliced")
# The version `QuantSpec.to_dict` writes under "version" (docs/dsq.md, "Presets and specs").
# Version 1 is every mapping written before the key existed: run records then left out what
# their run did before a setting existed, which `upgraded` spells out.
SPEC_VERSION = 2


def sliced_mlp_rounding_error(stochastic: Sequence[str]) -> ValueError:
    """Why an MLP cannot run in slices with stochastic rounding at the points ``stochastic``."""
    return ValueError(
        f"quant.mlp=sliced quantizes a slice of tokens at a time, and stochastic rounding (at "
        f"{', '.join(stochastic)}) draws its noise for a whole tensor: round every point to "
        "nearest or set quant.mlp=whole"
    )


@dataclasses.dataclass(frozen=True)
class Ladder:
    """A point's ladder, as asked for: its formats (fewest bits first), the precision policy
    that moves along it (None: the default, ``plateau``, not named) and the parameters given to
    that policy (those not given stand at the policy's defaults). Written as a mapping,
    ``{levels: [...], policy: NAME, <its parameters>}`` (docs/dsq.md, "Precision policies")."""

    levels: tuple[str, ...]
    policy: str | None = None
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        levels = (self.levels,) if isinstance(self.levels, str) else tuple(self.levels)
        object.__setattr__(self, "levels", levels)
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))

    @classmethod
    def from_dict(cls, value: Mapping) -> Ladder:
        """``{levels: [...], policy: NAME, <its parameters>}``; ValueError without ``levels``."""
        if "levels" not in value:
            raise ValueError(
                f"a ladder is {{levels: [...], policy: NAME, <its parameters>}}, got keys "
                f'{sorted(value)} (docs/dsq.md, "Precision policies")'
            )
        params = {k: v for k, v in value.items() if k not in ("levels", "policy")}
        return cls(tuple(value["levels"]), value.get("policy"), params)

    @classmethod
    def of_schedule(cls, schedule: Schedule) -> Ladder:
        """What ``schedule`` was made from: its levels, its policy and every parameter."""
        policy = schedule.policy
        named = None if policy.name == DEFAULT_POLICY else policy.name
        return cls(tuple(schedule.levels), named, dataclasses.asdict(policy.params))

    def to_dict(self) -> dict:
        policy = {} if self.policy is None else {"policy": self.policy}
        return {"levels": list(self.levels), **policy, **self.params}

    def schedule(self) -> Schedule:
        """A new schedule of this ladder, at its first level."""
        return Schedule(list(self.levels), self.policy or DEFAULT_POLICY, **self.params)

    def __hash__(self) -> int:
        return hash((self.levels, self.policy, tuple(sorted(self.params.items()))))

    def __reduce__(self):  # pickle and deepcopy (a read-only mapping is neither): rebuilt anew
        return (type(self), (self.levels, self.policy, dict(self.params)))

    def __repr__(self) -> str:
        policy = "" if self.policy is None else f", policy={self.policy!r}"
        params = "".join(f", {k}={v!r}" for k, v in self.params.items())
        return f"Ladder({list(self.levels)!r}{policy}{params})"


PointSpec = str | Ladder


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """The formats of the four DSQ points (a format spec, or a ``Ladder`` for a point whose
    precision moves), the stash scope, each point's rounding (``{"q1": "stochastic"}``; points
    not named round to nearest) and where the GEMMs run (``gemm_unit``: ``auto``, the fastest
    unit exact for both operands, or ``fp32``; docs/dsq.md, "GEMM units"), and the engine that
    trains (``dsq`` or ``autocast``).

    A point may also be given as a ``Format``, a ``Schedule`` (recorded as its ladder, not its
    state) or a ladder's mapping; it is kept as a spec string or a ``Ladder``."""

    q0: PointSpec = "fp32"
    q1: PointSpec = "fp32"
    q2: PointSpec = "fp32"
    q3: PointSpec = "fp32"
    stash_scope: str = "gemm"
    rounding: Mapping[str, str] | None = None
    gemm_unit: str = "auto"
    engine: str = "dsq"
    attention: str = "tiled"
    mlp: str = "whole"
    saved: Mapping[str, str] | None = None

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KERNELS:
            raise ValueError(
                f"quant.attention={self.attention!r} is not an attention kernel; choose one of "
                f"{ATTENTION_KERNELS}"
            )
        if self.mlp not in MLP_KINDS:
            raise ValueError(f"quant.mlp={self.mlp!r} is not a way to run an MLP; choose one of "
                             f"{MLP_KINDS}")  # fmt: skip
        if self.engine not in ENGINES:
            raise ValueError(
                f"quant.engine={self.engine!r} is not an engine; choose one of {ENGINES}"
            )
        if self.stash_scope not in STASH_SCOPES:
            raise ValueError(f"stash_scope must be one of {STASH_SCOPES}, got {self.stash_scope!r}")
        if self.gemm_unit not in GEMM_UNIT_SETTINGS:
            raise ValueError(
                f"quant.gemm_unit={self.gemm_unit!r} is not a setting; choose one of "
                f"{GEMM_UNIT_SETTINGS}"
            )
        for point in POINTS:
            object.__setattr__(self, point, _point_spec(point, getattr(self, point)))
        schedules = self.schedules()  # every format and ladder checked here
        object.__setattr__(self, "rounding", MappingProxyType(_as_rounding(self.rounding)))
        object.__setattr__(self, "saved", saved_rules(self.saved, self.stash_scope))
        if self.engine == "autocast":
            self._check_autocast(schedules)
        stochastic = [p for p, mode in self.rounding.items() if mode != "nearest"]
        if self.mlp == "sliced" and stochastic:
            raise sliced_mlp_rounding_error(stochastic)

    def _check_autocast(self, schedules: Mapping[str, Schedule]) -> None:
        """``engine=autocast`` runs the model unpatched under ``torch.autocast``: one 16-bit
        float at every point, nothing scheduled, no stash of its own, nearest rounding."""
        specs = {s.current for s in schedules.values()}
        moving = [p for p, s in schedules.items() if s.moves]
        if len(specs) != 1 or next(iter(specs)) not in AUTOCAST_DTYPES or moving:
            current = {p: s.current for p, s in schedules.items()}
            raise ValueError(
                "quant.engine=autocast runs the unpatched model under torch.autocast: every point "
                f"must be one of {sorted(AUTOCAST_DTYPES)}, the same and static, got {current}"
            )
        if self.stash_scope != "gemm" or set(self.rounding.values()) != {"nearest"}:
            raise ValueError(
                "quant.engine=autocast keeps autograd's own saved tensors and rounds to nearest: "
                "stash_scope must be gemm and every rounding nearest"
            )
        if self.mlp != "whole":
            raise ValueError(
                "quant.engine=autocast runs the model's own MLPs: quant.mlp must be whole"
            )
        if self.attention == "sdpa_bf16":
            raise ValueError(
                "quant.engine=autocast runs the model's own attention: quant.attention=sdpa_bf16 "
                "is a rule of the dsq engine; leave quant.attention at tiled"
            )

    def schedules(self) -> dict[str, Schedule]:
        """A new schedule of every point, at its first level (a format: a ladder of one)."""
        return {point: _schedule(point, getattr(self, point)) for point in POINTS}

    def keywords(self) -> dict[str, Any]:
        """The spec's fields by name: the keywords ``QuantSpec`` and ``QuantConfig`` take."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, config: Mapping) -> QuantSpec:
        """From a preset's mapping (conf/quant/*.yaml, result.json's quant without its
        ``preset`` and ``modified``): q0..q3, stash_scope, rounding, gemm_unit, engine; a
        ``name`` key is ignored, any other is a ValueError. A ``version`` other than
        `SPEC_VERSION` is read as `upgraded` reads it; without one, the mapping is this
        version's (a preset, a user's config)."""
        version = config.get("version", SPEC_VERSION)
        if version != SPEC_VERSION:
            config = upgraded(config, version)
        config = {k: v for k, v in config.items() if k != "version"}
        unknown = set(config) - set(QUANT_KEYS) - {"name"}
        if unknown:
            raise ValueError(
                f"unknown quantization point(s) {sorted(unknown)}; the points are {POINTS} "
                "(plus stash_scope, rounding, gemm_unit, engine, attention, mlp and saved)"
            )
        return cls(**{k: v for k, v in config.items() if k != "name"})

    def to_dict(self) -> dict:
        """The mapping ``from_dict`` reads, as conf/quant's presets write it: the four points (a
        ladder as its mapping), stash_scope and every point's rounding; ``gemm_unit`` and
        ``engine`` only where they are not their defaults (auto, dsq), so that the record of a
        run of a preset has the preset's keys; and ``version``, `SPEC_VERSION`."""
        out: dict[str, Any] = {"version": SPEC_VERSION}
        out |= {point: _point_dict(getattr(self, point)) for point in POINTS}
        out["stash_scope"] = self.stash_scope
        out["rounding"] = dict(self.rounding)
        if self.gemm_unit != "auto":
            out["gemm_unit"] = self.gemm_unit
        if self.engine != "dsq":
            out["engine"] = self.engine
        if self.attention != "tiled":
            out["attention"] = self.attention
        if self.mlp != "whole":
            out["mlp"] = self.mlp
        if self.stash_scope == "all":
            out["saved"] = dict(self.saved)
        return out

    def __reduce__(self):  # pickle and deepcopy (a read-only mapping is neither): rebuilt anew
        fields = self.keywords() | {"rounding": dict(self.rounding), "saved": dict(self.saved)}
        return (type(self), tuple(fields.values()))

    def __hash__(self) -> int:
        points = tuple(getattr(self, p) for p in POINTS)
        rounding = tuple(self.rounding.items())
        return hash((points, self.stash_scope, rounding, self.gemm_unit, self.engine,
                     self.attention, self.mlp, tuple(self.saved.items())))  # fmt: skip

    def __repr__(self) -> str:
        fields = [f"{p}={getattr(self, p)!r}" for p in POINTS]
        fields.append(f"stash_scope={self.stash_scope!r}")
        if self.stash_scope == "all":
            fields.append(f"saved={dict(self.saved)!r}")
        stochastic = {p: m for p, m in self.rounding.items() if m != "nearest"}
        if stochastic:
            fields.append(f"rounding={stochastic!r}")
        if self.gemm_unit != "auto":
            fields.append(f"gemm_unit={self.gemm_unit!r}")
        if self.engine != "dsq":
            fields.append(f"engine={self.engine!r}")
        if self.mlp != "whole":
            fields.append(f"mlp={self.mlp!r}")
        return f"QuantSpec({', '.join(fields)})"


def upgraded(config: Mapping, version: int, *, by_library: bool = False) -> dict:
    """``config``, a quant mapping written at spec ``version`` (a run record without a
    ``version`` key is version 1), as `SPEC_VERSION` writes the same run: its keys and any
    other keys (a record's ``preset``, ``modified``) kept, ``version`` set. The one place an
    old record's omissions are read (docs/dsq.md, "Presets and specs").

    Version 1 to 2: a key a version-1 record lacks is what its run did before the setting
    existed: ``attention`` explicit (the tiled kernel came with the key), ``gemm_unit`` fp32
    (every quantized GEMM ran in float32 before the units), ``engine`` dsq, ``stash_scope``
    gemm, a point without a ``rounding`` nearest; and ``saved``, under ``stash_scope=all``,
    every kind in the stash (q1) where it is absent (``all`` before its rules), a kind it
    lacks at that kind's default. ``by_library``: the mapping is version 1's ``to_dict`` (the
    Hugging Face callback's result.json), which left out a setting at its default: ``gemm_unit``
    auto and ``attention`` tiled (the callback came after the GEMM units; a record it wrote in
    the day before the tiled kernel ran the explicit path, and reads as tiled: the key was
    not written either way)."""
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ValueError(f"quant version {version!r}: versions are whole numbers from 1")
    if version > SPEC_VERSION:
        raise ValueError(
            f"quant version {version} was written by a newer dsq (this one reads up to "
            f"{SPEC_VERSION}); upgrade dsq to read it"
        )
    out = dict(config)
    if version == 1:
        omitted = (("attention", "tiled"), ("gemm_unit", "auto")) if by_library else (
            ("attention", "explicit"), ("gemm_unit", "fp32"))  # fmt: skip
        for key, before in (*omitted, ("engine", "dsq"), ("stash_scope", "gemm")):
            out.setdefault(key, before)
        rounding = dict(out.get("rounding") or {})
        out["rounding"] = {p: rounding.get(p, "nearest") for p in POINTS}
        if out["stash_scope"] == "all":
            before_rules = dict.fromkeys(SAVED_KINDS, "q1") | {"checkpoint": "keep"}
            out["saved"] = (
                (dict(SAVED_DEFAULT) | dict(out["saved"])) if "saved" in out else before_rules
            )
    out["version"] = SPEC_VERSION
    return out


def _point_spec(point: str, value) -> PointSpec:
    """A point's value as the spec keeps it: a format spec string or a ``Ladder``."""
    if isinstance(value, (str, Ladder)):
        return value
    if isinstance(value, Format):
        return value.spec
    if isinstance(value, Schedule):
        return Ladder.of_schedule(value)
    if isinstance(value, Mapping):
        try:
            return Ladder.from_dict(value)
        except ValueError as err:
            raise ValueError(f"{point}: {err}") from None
    raise ValueError(f"{point}: expected a format spec or a schedule, got {value!r}")


def _schedule(point: str, value: PointSpec) -> Schedule:
    if isinstance(value, str):
        return Schedule([value])
    try:
        return value.schedule()
    except ValueError as err:
        raise ValueError(f"{point}: {err}") from None


def _point_dict(value: PointSpec):
    return value if isinstance(value, str) else value.to_dict()


def saved_rules(saved: Mapping | None, stash_scope: str) -> Mapping[str, str]:
    """What each kind of saved tensor is held in (`SAVED_KINDS`): the defaults with ``saved``'s
    kinds over them under ``stash_scope="all"``, each format by its full spec (``bfp8`` and
    ``bfp8e8b16`` are one rule); nothing under ``gemm``, where the rules would not apply and are
    refused."""
    saved = dict(saved or {})
    if stash_scope != "all":
        if saved:
            raise ValueError(
                "quant.saved says what stash_scope=all holds of each saved tensor; set "
                "quant.stash_scope=all or drop quant.saved"
            )
        return MappingProxyType({})
    unknown = set(saved) - set(SAVED_KINDS)
    if unknown:
        raise ValueError(
            f"quant.saved: unknown kind(s) {sorted(unknown)}; the kinds are {SAVED_KINDS}"
        )
    held = dict(SAVED_DEFAULT) | {k: str(v) for k, v in saved.items()}
    for kind, what in held.items():
        if what in DERIVATIVE_HOLDS:
            if kind != "activation":
                raise ValueError(
                    f"quant.saved.{kind}={what}: derivative codes are held by activation "
                    f"modules only; set quant.saved.activation={what}"
                )
        elif what not in SAVED_HOLDS:
            try:
                held[kind] = parse_format(what).spec  # bfp8 and bfp8e8b16: one rule
            except ValueError as err:
                raise ValueError(
                    f"quant.saved.{kind}={what!r}: {err}; or one of {SAVED_HOLDS}"
                    + (f" or {', '.join(DERIVATIVE_HOLDS)}" if kind == "activation" else "")
                ) from None
    return MappingProxyType(held)


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
