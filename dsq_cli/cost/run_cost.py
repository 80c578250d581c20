"""What a run's result.json records of its cost (docs/spec.md §5): the library's ``run_cost``
(``dsq.cost``) against the suite's baseline preset, named in the record."""

from __future__ import annotations

from dsq import cost
from dsq.presets import COST_BASELINE

from .model import baseline_points

# Runs are priced against this baseline (docs/cost-model.md).


def run_cost(gemm_shapes: list[dict] | None, segments: list) -> dict:
    """docs/spec.md §4: the update-weighted cost over the levels used (``segments``: (points,
    updates) pairs), priced on one recorded training step's GEMMs (``dsq.cost.run_cost``)."""
    return cost.run_cost(
        gemm_shapes, segments, baseline_points(COST_BASELINE), baseline_name=COST_BASELINE
    )
