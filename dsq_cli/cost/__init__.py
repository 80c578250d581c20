"""The SPEC 4 cost model: arithmetic and DRAM cost of training steps, as ratios to a baseline.

    >>> from dsq_cli.cost import ratios
    >>> ratios(recorder.gemms, {"q0": "bfp8", "q1": "bfp4", "q2": "bfp8", "q3": "fixed16"})
    (arith_ratio, dram_ratio)      # against fixed32 at every point

See ``dsq_cli/cost/model.py`` for the three GEMMs per record and the DRAM rule.
"""

from .model import (
    CostModel,
    CostTotals,
    GemmCost,
    StepCost,
    baseline_points,
    gemm_costs,
    ratios,
    scheduled_cost,
    step_cost,
)

__all__ = [
    "CostModel",
    "CostTotals",
    "GemmCost",
    "StepCost",
    "baseline_points",
    "gemm_costs",
    "ratios",
    "scheduled_cost",
    "step_cost",
]
