"""A Hugging Face Trainer run's result.json (docs/spec.md §5), for ``dsq table`` beside the
suite's own runs: what ``DSQCallback`` (``dsq.integrations.hf``) recorded, priced as ``dsq train``
prices its runs (docs/cost-model.md)."""

from __future__ import annotations

from collections.abc import Mapping

from dsq.integrations.hf import DSQCallback
from dsq_cli import runs
from dsq_cli.config import quant_differences
from dsq_cli.cost.run_cost import run_cost, stash_bits_mean
from dsq_cli.run_result import RunResult


def run_result(callback: DSQCallback, *, task: str, preset: str, points: Mapping, metric: str,
               value: float, valid_loss: float | None, model: str, seed: int,
               wall_seconds: float, evaluation: Mapping | None = None) -> RunResult:  # fmt: skip
    """The completed run's result.json (write it with ``.write(run_dir)``): ``preset`` and
    ``points`` are the conf/quant preset the QuantConfig was made from, as in ``dsq train``;
    ``evaluation`` holds the task's metrics, and the precision changes join them
    (``level_changes``, in schedule.jsonl's record shape)."""
    history = callback.history
    return RunResult(
        status="completed",
        task=task,
        quant={
            "preset": preset,
            **points,
            "modified": quant_differences({"preset": preset, **points}) != [],
        },
        metric=metric,
        value=value,
        valid_loss=valid_loss,
        updates=history.updates,
        wall_seconds=round(wall_seconds, 3),
        cost=run_cost(history.gemm_shapes or [], history.segments),
        stash_bits_mean=stash_bits_mean(history.segments),
        versions=runs.versions(),
        model=model,
        seed=seed,
        bits_final=callback.cfg.current(),
        precision_segments=[{"points": p, "updates": n} for p, n in history.segments],
        evaluation=dict(evaluation or {}) | {"level_changes": list(history.changes)},
    )
