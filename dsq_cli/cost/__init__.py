"""The cost model (docs/spec.md §4): arithmetic and DRAM cost of training steps, as ratios to a
baseline.

    >>> from dsq_cli.cost import ratios
    >>> ratios(recorder.gemms, {"q0": "bfp8", "q1": "bfp4", "q2": "bfp8", "q3": "fixed16"})
    (arith_ratio, dram_ratio)      # against fixed32 at every point

    >>> from dsq_cli.cost import derive_records
    >>> derive_records(model_cfg, src_tokens=4096, src_len=32, vocab=10000, quant=quant)
    [GemmRecord(...), ...]          # one training step's GEMMs, without building the model

See ``dsq_cli/cost/model.py`` for the three GEMMs per record and the DRAM rule,
``derive.py`` for the GEMMs of a fairseq transformer, ``report.py`` for ``dsq cost``, and
``run_cost.py`` for what a run's result.json records (its update-weighted cost, stash bits).
"""

from .derive import DEFAULT_VOCAB, DerivedGemm, derive_gemms, derive_records, step_shape
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
    "DEFAULT_VOCAB",
    "CostModel",
    "DerivedGemm",
    "derive_gemms",
    "derive_records",
    "step_shape",
    "CostTotals",
    "GemmCost",
    "StepCost",
    "baseline_points",
    "gemm_costs",
    "ratios",
    "scheduled_cost",
    "step_cost",
]
