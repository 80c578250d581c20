"""The suite's side of the cost model: the library's ``dsq.cost`` (docs/cost-model.md) with its
coefficients read from conf/cost/<name>.yaml and its baselines named by presets (dsq.presets).

``load_cost_model(name)`` reads conf/cost/NAME.yaml into the library's ``CostModel`` (an unknown
name is a ValueError listing them all; the key checks are ``CostModel.from_dict``'s), and
``baseline_points(preset)`` gives a preset's q0..q3. ``ratios`` and ``scheduled_cost`` are the
library's with ``baseline`` a preset name (default ``fixed32``) or a points mapping; the pure
parts (``gemm_costs``, ``step_cost``, the cost types) are the library's, re-exported here.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import yaml

from dsq import cost
from dsq.cost import (
    ARITHMETIC_MODELS,
    DRAM_SWITCHES,
    CostTotals,
    GemmCost,
    Points,
    StepCost,
    gemm_costs,
    step_cost,
)
from dsq.engine.accounting import GemmRecord
from dsq.engine.config import POINTS
from dsq.formats import parse_format
from dsq.presets import COST_BASELINE
from dsq_cli.presets import CONF_DIR, at_first_level, load_quant_preset

COST_DIR = CONF_DIR / "cost"

__all__ = [
    "ARITHMETIC_MODELS",
    "COST_DIR",
    "COST_BASELINE",
    "DRAM_SWITCHES",
    "POINTS",
    "CostModel",
    "CostTotals",
    "GemmCost",
    "Points",
    "StepCost",
    "baseline_points",
    "gemm_costs",
    "load_cost_model",
    "ratios",
    "scheduled_cost",
    "step_cost",
]


@functools.cache
def load_cost_model(name: str = "default") -> cost.CostModel:
    """The library's ``CostModel`` of conf/cost/NAME.yaml; an unknown name is a ValueError
    listing them all."""
    path = COST_DIR / f"{name}.yaml"
    if not path.is_file():
        choices = sorted(p.stem for p in COST_DIR.glob("*.yaml"))
        raise ValueError(f"unknown cost model {name!r}; choose one of {choices}")
    return cost.CostModel.from_dict(yaml.safe_load(path.read_text()), name=name)


CostModel = cost.CostModel  # the library's type; the suite adds only the loader above


def baseline_points(preset: str = COST_BASELINE) -> dict[str, str]:
    """q0..q3 of a preset (dsq.presets); a scheduled point counts at its first level."""
    config = at_first_level(load_quant_preset(preset))  # ValueError naming the presets if unknown
    points = {point: config[point] for point in POINTS}
    for spec in points.values():
        parse_format(spec)  # a bad spec fails here, naming the preset's format
    return points


def _points(baseline: str | Points) -> Points:
    return baseline_points(baseline) if isinstance(baseline, str) else baseline


def ratios(
    records: Sequence[GemmRecord],
    points: Points | None = None,
    baseline: str | Points = COST_BASELINE,
    *,
    model: cost.CostModel | None = None,
) -> tuple[float, float]:
    """``dsq.cost.ratios`` against ``baseline``, a conf/quant preset name or a points mapping."""
    return cost.ratios(records, points, _points(baseline), model=model)


def scheduled_cost(
    records: Sequence[GemmRecord],
    segments: Sequence[tuple[Points, int]],
    baseline: str | Points = COST_BASELINE,
    *,
    model: cost.CostModel | None = None,
) -> dict:
    """``dsq.cost.scheduled_cost`` against ``baseline``, a conf/quant preset name (recorded by
    name under ``baseline``) or a points mapping. This is result.json's ``cost``."""
    result = cost.scheduled_cost(records, segments, _points(baseline), model=model)
    if isinstance(baseline, str):
        result["baseline"] = baseline
    return result
