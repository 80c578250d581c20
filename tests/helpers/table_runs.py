"""Synthetic run directories for `dsq table`'s tests: a result.json shaped like the full
Multi30k runs', written where `dsq table` finds it (tests/dsq_cli/test_table.py and the GLUE
trainer's table test)."""

from __future__ import annotations

import json
from pathlib import Path

POINTS = {
    "fp32": {"q0": "fp32", "q1": "fp32", "q2": "fp32", "q3": "fp32"},
    "fixed16": {"q0": "fixed16", "q1": "fixed16", "q2": "fixed16", "q3": "fixed16"},
    "stash_bfp": {"q0": "bfp8", "q1": "bfp4", "q2": "bfp8", "q3": "fixed16"},
    "dsq": {
        "q0": "bfp8",
        "q1": {
            "levels": ["bfp2", "bfp3", "bfp4", "bfp6", "bfp8"],
            "min_delta": 0.0,
            "patience": 1,
        },
        "q2": "bfp8",
        "q3": "fixed16",
    },
}
MODELS = {"multi30k": "transformer_tiny", "iwslt17": "transformer_iwslt"}


def result_json(preset, task, seed, status, value, arith, dram, stash_bits, points=None):
    points = points or POINTS[preset]
    return {
        "status": status,
        "task": task,
        "model": MODELS[task],
        "seed": seed,
        "quant": {
            "preset": preset,
            **points,
            "stash_scope": "gemm",
            "modified": points is not POINTS[preset],
        },
        "metric": "bleu",
        "value": value,
        "bleu": value,
        "valid_loss": None if status == "running" else 4.9,
        "updates": 0 if status == "running" else 640,
        "wall_seconds": 845.876 + (seed or 0),
        "cost": {"arith_ratio": arith, "dram_ratio": dram, "baseline": "fixed32"},
        "stash_bits_mean": stash_bits,
        "versions": {"python": "3.11.7", "torch": "2.13.0+cpu", "fairseq": "0.12.3.1"},
    }


def write_run(root: Path, result: dict) -> Path:
    name = f"{result['task']}-{result['quant']['preset']}-seed{result['seed']}"
    if result["quant"]["modified"]:
        name += "-modified"
    run_dir = root / result["task"] / name
    run_dir.mkdir(parents=True)
    (run_dir / "result.json").write_text(json.dumps(result, indent=2))
    return run_dir
