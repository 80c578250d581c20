"""The suite's cost model: the library's ``dsq.cost`` (docs/cost-model.md) with what reads conf/.

    >>> from dsq_cli.cost import ratios
    >>> ratios(recorder.gemms, {"q0": "bfp8", "q1": "bfp4", "q2": "bfp8", "q3": "fixed16"})
    (arith_ratio, dram_ratio)      # against the fixed32 preset at every point

    >>> from dsq_cli.cost import derive_records
    >>> derive_records(model_cfg, src_tokens=4096, src_len=32, vocab=10000, quant=quant)
    [GemmRecord(...), ...]          # one training step's GEMMs, without building the model

The three GEMMs per record, the DRAM rule and the default coefficients are the library's
(``dsq/cost.py``). Here: ``model.py`` loads conf/cost/<name>.yaml (``load_cost_model``) and
names baselines by preset (``baseline_points``, ``ratios``, ``scheduled_cost``);
``derive.py`` derives the GEMMs of a fairseq transformer, ``report.py`` is ``dsq cost``, and
``run_cost.py`` is what ``dsq train``'s result.json records of its cost (the library's
``dsq.cost.run_cost`` against the baseline preset).
"""

from .derive import DEFAULT_VOCAB, DerivedGemm, derive_gemms, derive_records, step_shape
from .model import (
    CostModel,
    CostTotals,
    GemmCost,
    StepCost,
    baseline_points,
    gemm_costs,
    load_cost_model,
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
    "load_cost_model",
    "ratios",
    "scheduled_cost",
    "step_cost",
]
