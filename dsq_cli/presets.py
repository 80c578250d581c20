"""The quant presets of conf/quant/ (docs/spec.md §6), readable without Hydra."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import yaml

from dsq_cli.run_result import POINTS

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
TABLE1_ORDER = (
    "fp32",
    "fixed32",
    "fixed16",
    "bfp16",
    "bfp8",
    "bfp6",
    "stash_fixed",
    "stash_bfp",
    "dsq",
)
# Presets of conf/quant/ that are not rows of the paper's Table 1, shown after them: a variant the
# ablations of docs/results.md found worth naming, and bf16, the baseline readers now compare with.
BEYOND_TABLE1 = ("dsq_bfp3", "bf16")
PRESET_ORDER = TABLE1_ORDER + BEYOND_TABLE1
QUANT_KEYS = (*POINTS, "stash_scope", "rounding")


def load_quant_preset(name: str) -> dict:
    """The mapping of conf/quant/NAME.yaml (q0..q3, stash_scope, rounding)."""
    path = CONF_DIR / "quant" / f"{name}.yaml"
    if not path.is_file():
        choices = sorted(p.stem for p in (CONF_DIR / "quant").glob("*.yaml"))
        raise ValueError(f"unknown quant preset {name!r}; choose one of {choices}")
    return yaml.safe_load(path.read_text())


def at_first_level(quant: Mapping) -> dict:
    """``quant`` (a preset's mapping) with every scheduled point (``{levels: [...], ...}``) at
    its first level: the formats a run starts with."""
    return {
        key: value["levels"][0] if isinstance(value, Mapping) and "levels" in value else value
        for key, value in quant.items()
    }


def _every_point_rounding(rounding: Mapping | None) -> dict:
    return {point: (rounding or {}).get(point, "nearest") for point in POINTS}


def _render_point(value) -> str:
    if isinstance(value, Mapping) and "levels" in value:
        return ">".join(str(level) for level in value["levels"])
    if isinstance(value, (list, tuple)):
        return ">".join(str(v) for v in value)
    return str(value)


def quant_differences(quant: Mapping) -> list[str] | None:
    """``point=value`` for each quant key of a run (``quant``: the preset name and its points)
    that differs from the stored preset; None when the preset is not in conf/quant/. A run with
    differences is not a run of its preset (its own row in Table 1)."""
    try:
        stored = load_quant_preset(str(quant["preset"]))
    except ValueError:
        return None
    differences = []
    for key in QUANT_KEYS:
        mine, theirs = quant.get(key), stored.get(key)
        if key == "rounding":  # a point not named rounds to nearest (runs from before rounding)
            mine, theirs = _every_point_rounding(mine), _every_point_rounding(theirs)
        if mine == theirs or (key == "stash_scope" and mine is None):
            continue
        if isinstance(mine, Mapping) and isinstance(theirs, Mapping):
            for sub in sorted(set(mine) | set(theirs)):
                if mine.get(sub) != theirs.get(sub):
                    differences.append(f"{key}.{sub}={_render_point(mine.get(sub))}")
        else:
            differences.append(f"{key}={_render_point(mine)}")
    return differences
