"""The quant presets (docs/spec.md §6) as the suite names and orders them. Their values are the
library's (``dsq.presets``); conf/quant/NAME.yaml holds the same mapping for Hydra's composition
(tests/dsq/test_presets.py keeps the two equal)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from dsq.presets import PRESETS, TABLE1_PRESETS, get_preset

# the suite's Hydra configs ship inside the package (pyproject's package data), so an installed
# dsq_cli finds them beside itself
CONF_DIR = Path(__file__).resolve().parent / "conf"
# Table 1's rows, then every other preset, in the order dsq.presets registers them (each comment
# there says why a preset beyond Table 1 is named)
TABLE1_ORDER = TABLE1_PRESETS
PRESET_ORDER = tuple(PRESETS)
BEYOND_TABLE1 = PRESET_ORDER[len(TABLE1_ORDER) :]


def load_quant_preset(name: str) -> dict:
    """The preset's mapping (q0..q3, stash_scope, rounding; conf/quant/NAME.yaml's content), a
    new dict; an unknown name is a ValueError listing the presets."""
    return get_preset(name).to_dict()


def at_first_level(quant: Mapping) -> dict:
    """``quant`` (a preset's mapping) with every scheduled point (``{levels: [...], ...}``) at
    its first level: the formats a run starts with."""
    return {
        key: value["levels"][0] if isinstance(value, Mapping) and "levels" in value else value
        for key, value in quant.items()
    }
