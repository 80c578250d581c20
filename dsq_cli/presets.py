"""The quant presets (docs/spec.md §6) as the suite names and orders them. Their values are the
library's (``dsq.presets``); conf/quant/NAME.yaml holds the same mapping for Hydra's composition
(tests/dsq/test_presets.py keeps the two equal)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from dsq.presets import COST_BASELINE, get_preset

# the suite's Hydra configs ship inside the package (pyproject's package data), so an installed
# dsq_cli finds them beside itself
CONF_DIR = Path(__file__).resolve().parent / "conf"
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
# ablations of docs/results.md found worth naming, bf16 and amp_bf16 (torch.autocast), the
# baselines readers now compare with, bfp6 (the CPU-scale frontier) with DSQ's rising stash, the
# convergence study's design, the static-stash controls that study compares each rising stash
# with, and DSQ on the formats hardware runs (docs/formats.md, "MX formats", "NVFP4"): on MX,
# its MXFP8 control, and with NVFP4 forward and its static-stash control.
BEYOND_TABLE1 = (
    "dsq_bfp3",
    "bf16",
    "amp_bf16",
    "bfp6_rising_stash",
    "bfp6_stash_bfp3",
    "bfp6_stash_bfp4",
    "dsq_stash_bfp3",
    "dsq_stash_bfp2",
    "mx_dsq",
    "mxfp8",
    "nvfp4_dsq",
    "nvfp4_dsq_stash_nvfp4",
)
# the preset every cost ratio is against, as the paper's Table 1 (docs/spec.md §4)
BASELINE_PRESET = COST_BASELINE
PRESET_ORDER = TABLE1_ORDER + BEYOND_TABLE1


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
