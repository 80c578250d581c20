"""What a run's result.json records of its cost (docs/spec.md §5): the cost model applied over
the precision segments the run trained in, and the mean bits of its stash. `dsq train` and the
Hugging Face callback both record these, so a table prices their runs alike."""

from __future__ import annotations

from dsq.cost import scheduled_cost
from dsq.engine import GemmRecord
from dsq.formats import parse_format
from dsq_cli.presets import BASELINE_PRESET
from dsq_cli.run_result import unpriced

from .model import baseline_points

# Runs are priced against this baseline (docs/cost-model.md).
COST_BASELINE = BASELINE_PRESET


def run_cost(gemm_shapes: list[dict] | None, segments: list) -> dict:
    """docs/spec.md §4: the update-weighted cost over the levels used (``segments``: (points,
    updates) pairs), priced on one recorded training step's GEMMs."""
    if not gemm_shapes or not segments:
        return unpriced(COST_BASELINE)
    records = [GemmRecord.from_dict(g) for g in gemm_shapes]
    baseline = baseline_points(COST_BASELINE)
    cost = scheduled_cost(records, [(points, n) for points, n in segments], baseline)
    cost["baseline"] = COST_BASELINE  # result.json names the preset (docs/spec.md §5)
    cost["gemms_per_step"] = len(records) * 3  # the forward GEMM and two backward ones
    return cost


def stash_bits_mean(segments: list) -> float | None:
    """Update-weighted mean bits per value of the stash format (q1) over the run."""
    total = sum(updates for _, updates in segments)
    if not total:
        return None
    bits = sum(parse_format(points["q1"]).bits_per_value * n for points, n in segments)
    return bits / total
