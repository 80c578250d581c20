"""The named quant presets (docs/spec.md §6) as typed values: ``QuantSpec``s, one registered unit
each.

    >>> import dsq
    >>> cfg = dsq.QuantConfig.from_preset("dsq")        # or QuantConfig.from_spec(get_preset(...))
    >>> dsq.presets.get_preset("stash_bfp").to_dict()   # as conf/quant/stash_bfp.yaml holds it

A new preset is one call, ``register_preset(NAME, QuantSpec(...))``, in this file (the suite's
``dsq train quant=NAME`` also needs conf/quant/NAME.yaml, Hydra's config group; the test
tests/dsq/test_presets.py fails until the file and the registered value hold the same mapping, so
the library owns the values). ``preset_differences`` says how a run's quant record differs from
its preset: a run with differences is not a run of the preset (its own row in Table 1).

The engine's ``QuantConfig.from_preset`` reads this registry, so it imports only the spec and
the policies below it (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dsq.engine.policies import DEFAULT_POLICY, policy_defaults
from dsq.engine.spec import (
    ATTENTION_RULES,
    POINTS,
    QUANT_KEYS,
    SAVED_DEFAULT,
    Ladder,
    QuantSpec,
    upgraded,
)
from dsq.formats import parse_format

PRESETS: dict[str, QuantSpec] = {}
# the preset every cost ratio is against, as in the paper's Table 1 (docs/spec.md §4)
COST_BASELINE = "fixed32"
# what a preset decides: every quant key but where the GEMMs run and how attention is computed
# (the same numbers on every unit and kernel, up to float32 summation order: docs/dsq.md, "GEMM
# units", "Attention in tiles"; an attention rule with values of its own, `ATTENTION_RULES`, is
# a difference all the same); the MLP in slices is not that under stash_scope=all
PRESET_KEYS = tuple(key for key in QUANT_KEYS if key not in ("gemm_unit", "attention"))


def register_preset(name: str, spec: QuantSpec) -> QuantSpec:
    """Make ``spec`` the preset ``name`` (``QuantConfig.from_preset(name)``); a name is
    registered once."""
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"preset {name!r}: expected a QuantSpec, got {type(spec).__name__}")
    if name in PRESETS:
        raise ValueError(f"quant preset {name!r} is registered already")
    PRESETS[name] = spec
    return spec


def get_preset(name: str) -> QuantSpec:
    """The preset ``name``; an unknown name is a ValueError listing them."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown quant preset {name!r}; choose one of {preset_names()}") from None


def preset_names() -> list[str]:
    return sorted(PRESETS)


def uniform(spec: str, **keywords) -> QuantSpec:
    """One format at every point."""
    return QuantSpec(spec, spec, spec, spec, **keywords)


# -- the presets ---------------------------------------------------------------------------------
# Table 1's rows, in its order (docs/spec.md §6): BFP blocks of 16 with 8-bit shared exponents.
register_preset("fp32", uniform("fp32"))  # no quantization anywhere
register_preset("fixed32", uniform("fixed32"))  # 32-bit dynamic fixed point: the cost baseline
register_preset("fixed16", uniform("fixed16"))  # 16-bit dynamic fixed point: the abstract's
register_preset("bfp16", uniform("bfp16"))
register_preset("bfp8", uniform("bfp8"))
register_preset("bfp6", uniform("bfp6"))
# fixed point with an 8-bit stash
register_preset("stash_fixed", QuantSpec("fixed16", "fixed8", "fixed16", "fixed16"))
# BFP arithmetic with a static 4-bit BFP stash
register_preset("stash_bfp", QuantSpec("bfp8", "bfp4", "bfp8", "fixed16"))
# the stash starts at 2 bits and rises one level each time the validation loss stalls
# (docs/spec.md §3): patience 1, min_delta 0
register_preset(
    "dsq",
    QuantSpec(
        "bfp8",
        Ladder(("bfp2", "bfp3", "bfp4", "bfp6", "bfp8"), params={"patience": 1, "min_delta": 0.0}),
        "bfp8",
        "fixed16",
    ),
)
# the paper's Table 1: the presets registered so far, in its order; every later one is shown after
# them, in the order registered here (dsq_cli's table rows and help lists read both)
TABLE1_PRESETS = tuple(PRESETS)

# Beyond Table 1. dsq with its ladder starting at bfp3: on Multi30k it closes dsq's gap to fp32
# (docs/results.md, the ablations); `dsq` stays the paper's reading.
register_preset(
    "dsq_bfp3",
    QuantSpec(
        "bfp8",
        Ladder(("bfp3", "bfp4", "bfp6", "bfp8"), params={"patience": 1, "min_delta": 0.0}),
        "bfp8",
        "fixed16",
    ),
)
# Every point in bfloat16, the mixed precision readers of 2026 compare with, priced as a 16-bit
# float; then the same trained as users run it: the unpatched model under torch.autocast
# (docs/dsq.md, "Autocast: the baseline users run").
register_preset("bf16", uniform("bf16"))
register_preset("amp_bf16", uniform("bf16", engine="autocast"))
# The convergence study (docs/results.md, "Training to the stall"): bfp6, the CPU-scale frontier,
# with DSQ's rising stash (bfp3 up to bfp6: never more bits than bfp6 anywhere), and the static
# controls, each a rising preset with its stash held at one level for the whole run.
register_preset(
    "bfp6_rising_stash",
    QuantSpec(
        "bfp6",
        Ladder(("bfp3", "bfp4", "bfp6"), params={"patience": 1, "min_delta": 0.0}),
        "bfp6",
        "bfp6",
    ),
)
register_preset("bfp6_stash_bfp3", QuantSpec("bfp6", "bfp3", "bfp6", "bfp6"))
register_preset("bfp6_stash_bfp4", QuantSpec("bfp6", "bfp4", "bfp6", "bfp6"))
register_preset("dsq_stash_bfp3", QuantSpec("bfp8", "bfp3", "bfp8", "fixed16"))
# dsq's clean control: its points with the stash held at its first level, bfp2, for the whole run,
# so that it differs from dsq in the schedule alone (docs/results.md, "Protocol")
register_preset("dsq_stash_bfp2", QuantSpec("bfp8", "bfp2", "bfp8", "fixed16"))
# DSQ on the formats hardware runs (docs/formats.md, "MX formats", "NVFP4"): MXFP8 GEMM inputs
# and E5M2 gradients with a stash rising mxfp4 -> mxfp6 -> mxfp8; its static control, MXFP8
# everywhere (the recipe torchao and TransformerEngine train with); and NVFP4 forward.
register_preset(
    "mx_dsq",
    QuantSpec(
        "mxfp8_e4m3",
        Ladder(
            ("mxfp4_e2m1", "mxfp6_e3m2", "mxfp8_e4m3"), params={"patience": 1, "min_delta": 0.0}
        ),  # fmt: skip
        "mxfp8_e4m3",
        "mxfp8_e5m2",
    ),
)
register_preset("mxfp8", uniform("mxfp8_e4m3"))
register_preset(
    "nvfp4_dsq",
    QuantSpec(
        "nvfp4",
        Ladder(("nvfp4", "mxfp6_e3m2", "mxfp8_e4m3"), params={"patience": 1, "min_delta": 0.0}),
        "mxfp8_e4m3",
        "mxfp8_e5m2",
    ),
)
# nvfp4_dsq's static control: its points with the stash held at its first level, NVFP4, for the
# whole run (docs/results.md, "Protocol": the rising stash on a language model)
register_preset("nvfp4_dsq_stash_nvfp4", QuantSpec("nvfp4", "nvfp4", "mxfp8_e4m3", "mxfp8_e5m2"))


# -- how a run's quant record differs from its preset --------------------------------------------
def record_quant(quant: Mapping, *, by_library: bool = False) -> dict:
    """A run record's ``quant`` (result.json) as this version writes it: its points and settings
    `upgraded` from the record's ``version`` (a record without one is version 1, written before
    the key existed), and ``modified`` where the record predates it (whether the points differ
    from the preset's; True for a preset this version does not know). ``by_library``: the
    record was written by the library (the Hugging Face callback) rather than ``dsq train``
    (`upgraded` says what differs). Every reader of a record reads its quant through this."""
    out = upgraded(quant, quant.get("version", 1), by_library=by_library)
    if "modified" not in out:
        differences = preset_differences(out)
        out["modified"] = differences is None or bool(differences)
    return out


def preset_differences(quant: Mapping) -> list[str] | None:
    """``point=value`` for each quant key of a run's record (``quant``: the preset's name under
    ``preset`` and the run's keys, as result.json's ``quant``) that differs from the preset;
    None when no preset has that name. Formats compare as formats (``bfp8`` is
    ``bfp8e8b16``); a point's rounding not named is nearest; a kind of saved tensor not named
    holds its default, and each kind that differs is named on its own (``saved.norm=q1``, a
    format by its full spec), in the rules' order, so that two records of one setting read
    alike."""
    try:
        stored = get_preset(str(quant["preset"])).to_dict()
    except ValueError:
        return None
    differences = []
    for key in PRESET_KEYS:
        mine, theirs = quant.get(key), stored.get(key)
        if key == "rounding":  # a point not named rounds to nearest
            mine, theirs = _every_point_rounding(mine), _every_point_rounding(theirs)
        elif key == "saved":
            differences += _saved_differences(mine, theirs)
            continue
        elif key in _DEFAULTS:  # a setting left out stands at its default (to_dict leaves it out)
            mine, theirs = quant.get(key, _DEFAULTS[key]), stored.get(key, _DEFAULTS[key])
        if _same(mine, theirs):
            continue
        if isinstance(mine, Mapping) and isinstance(theirs, Mapping):
            differences += _ladder_differences(key, mine, theirs)
        else:
            differences.append(f"{key}={_render_point(mine)}")
    # how attention is computed is no preset's choice where every kernel gives the preset's
    # values, but a rule with values of its own is (quant.attention=sdpa_bf16)
    attention = quant.get("attention", QuantSpec.attention)
    if attention in ATTENTION_RULES and attention != stored.get("attention", QuantSpec.attention):
        differences.append(f"attention={attention}")
    return differences


def _saved_differences(mine: Mapping | None, theirs: Mapping | None) -> list[str]:
    mine, theirs = {**SAVED_DEFAULT, **(mine or {})}, {**SAVED_DEFAULT, **(theirs or {})}
    kinds = [*SAVED_DEFAULT, *sorted(set(mine) - set(SAVED_DEFAULT))]
    return [f"saved.{kind}={_canonical(mine.get(kind))}" for kind in kinds
            if _canonical(mine.get(kind)) != _canonical(theirs.get(kind))]  # fmt: skip


def _canonical(value):
    """A format spec as its format's canonical spec (anything else as it is)."""
    if not isinstance(value, str):
        return value
    try:
        return parse_format(value).spec
    except ValueError:
        return value


def _same(mine, theirs) -> bool:
    if isinstance(mine, Mapping) and isinstance(theirs, Mapping):
        return {**mine, "levels": _levels(mine)} == {**theirs, "levels": _levels(theirs)}
    return _canonical(mine) == _canonical(theirs)


def _levels(ladder: Mapping) -> list | None:
    levels = ladder.get("levels")
    if isinstance(levels, Sequence) and not isinstance(levels, str):
        return [_canonical(level) for level in levels]
    return levels


_DEFAULTS = {
    "stash_scope": QuantSpec.stash_scope, "engine": QuantSpec.engine, "mlp": QuantSpec.mlp
}  # fmt: skip


def _every_point_rounding(rounding: Mapping | None) -> dict:
    return {point: (rounding or {}).get(point, "nearest") for point in POINTS}


def _render_point(value) -> str:
    if isinstance(value, Mapping) and "levels" in value:
        return ">".join(str(level) for level in value["levels"])
    if isinstance(value, Sequence) and not isinstance(value, str):
        return ">".join(str(v) for v in value)
    return str(value)


def _ladder_differences(point: str, mine: Mapping, theirs: Mapping) -> list[str]:
    """How a run's ladder (``{levels, policy, <its parameters>}``) differs from the preset's.
    A parameter left out stands at its policy's default, so naming it changes nothing; under
    another policy the preset's parameters (the old policy's) do not apply, and only the new
    policy's parameters that differ from its defaults are named."""
    policy = mine.get("policy", DEFAULT_POLICY)
    same_policy = policy == theirs.get("policy", DEFAULT_POLICY)
    defaults = policy_defaults(policy)
    reference = {**defaults, **theirs} if same_policy else defaults
    differences = [] if same_policy else [f"{point}.policy={policy}"]
    if _levels(mine) != _levels(theirs):
        differences.append(f"{point}.levels={_render_point(mine.get('levels'))}")
    for sub in sorted(set(mine) | set(reference)):
        if sub in ("levels", "policy"):
            continue
        if {**defaults, **mine}.get(sub) != reference.get(sub):
            differences.append(f"{point}.{sub}={_render_point({**defaults, **mine}.get(sub))}")
    return differences
