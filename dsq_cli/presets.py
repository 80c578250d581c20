"""The quant presets of conf/quant/ (docs/spec.md §6), readable without Hydra."""

from __future__ import annotations

from pathlib import Path

import yaml

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


def load_quant_preset(name: str) -> dict:
    """The mapping of conf/quant/NAME.yaml (q0..q3, stash_scope)."""
    path = CONF_DIR / "quant" / f"{name}.yaml"
    if not path.is_file():
        choices = sorted(p.stem for p in (CONF_DIR / "quant").glob("*.yaml"))
        raise ValueError(f"unknown quant preset {name!r}; choose one of {choices}")
    return yaml.safe_load(path.read_text())
