"""`RunResult`: what a run's ``result.json`` holds, and the one way it is written and read.

The trainer writes it when a run starts (status ``running``) and again when it ends;
``dsq table``, ``dsq plot``, ``dsq sweep`` and ``dsq train``'s own summary read it, all through
this type. The fields and their meaning are in docs/spec.md §5 (run files); the evaluation fields
that depend on the task family (``bleu`` and its signature for translation; the GLUE metrics,
``best_update`` and ``final_dev`` for GLUE; ``eval_checkpoint`` and ``checkpoints``, the last and
the best model's scores, for both) sit in ``evaluation`` and are written at the top level of the
file beside the common ones.

A leaf of the reporting side: it imports only `runs` (atomic JSON writes without secrets).
"""

from __future__ import annotations

import dataclasses
import json
import math
import resource
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dsq import cost
from dsq.engine.config import POINTS
from dsq.presets import COST_BASELINE, record_quant
from dsq.records import FRACTION_METRICS, LOWER_IS_BETTER, METRICS  # noqa: F401 (read here)
from dsq_cli import runs

FILENAME = "result.json"
STATUSES = ("completed", "interrupted", "diverged", "failed", "running")
COST_KEYS = ("arith_ratio", "dram_ratio", "baseline")
# What a reader cannot do without (the rest has defaults for result.json files of older runs).
REQUIRED = ("status", "task", "quant", "metric", "value", "valid_loss", "updates",
            "wall_seconds", "cost", "stash_bits_mean", "versions")  # fmt: skip
# Written together once training has been summarised (``epochs`` set), None values included.
TRAINED = ("epochs", "budget", "best_valid_loss", "bits_final", "precision_segments", "patch",
           "memory", "gemm_units")  # fmt: skip
MIB = 2**20
# How ``error`` begins for a run whose checkpoint_last.pt cannot be read (empty, cut short, not
# a checkpoint): recorded by the resume that found it, so that `dsq sweep --resume-unfinished`
# reports the run failed instead of trying it again on every pass (docs/training.md, "Faults").
CORRUPT_CHECKPOINT = "corrupt checkpoint"


def metric_decimals(metric: str) -> int:
    """The decimals a metric is shown with: three for a fraction, so that runs a point of
    accuracy apart (an SST-2 dev example is about 0.1 point) do not print alike; two for BLEU
    and perplexity."""
    return 3 if metric in FRACTION_METRICS else 2


def metric_sign(metric: str) -> int:
    """+1 where a higher ``metric`` is better, -1 where a lower one is (`LOWER_IS_BETTER`): a
    difference times it is how much better."""
    return -1 if metric in LOWER_IS_BETTER else 1


def unpriced(baseline: str = COST_BASELINE) -> dict:
    """The cost of a run that has not recorded a training step yet (``dsq.cost.unpriced``)."""
    return cost.unpriced(baseline)


@dataclasses.dataclass
class RunResult:
    """One run's result.json. ``quant`` is the preset name, its points as the run used them and
    ``modified`` (whether they differ from the stored preset); ``cost`` holds the update-weighted
    ratios to the baseline (docs/cost-model.md)."""

    status: str
    task: str
    quant: dict[str, Any]
    metric: str
    # the headline metric, of the model eval.checkpoint names (best | last): test BLEU, or the
    # GLUE dev value; result.json's `checkpoints` has both
    value: float | None = None
    valid_loss: float | None = None
    updates: int = 0
    wall_seconds: float = 0.0
    cost: dict[str, Any] = dataclasses.field(default_factory=unpriced)
    stash_bits_mean: float | None = None  # update-weighted bits per value of the stash (q1)
    versions: dict[str, str | None] = dataclasses.field(default_factory=dict)
    model: str | None = None
    seed: int | None = None
    device: str | None = None
    world_size: int = 1  # data-parallel ranks
    data: dict[str, Any] | None = None  # the prepared data's directory and manifest
    started_at: str | None = None
    finished_at: str | None = None
    resumed: bool = False
    error: str | None = None  # why the run did not complete
    # what training recorded (absent until a run ends)
    epochs: int | None = None
    # the Budget (total_updates is the cap), and stopped_early: {update, reason} or None
    budget: dict[str, Any] | None = None
    best_valid_loss: float | None = None
    bits_final: dict[str, str] | None = None
    precision_segments: list[dict[str, Any]] | None = None  # [{points, updates}, ...]
    patch: dict[str, Any] | None = None  # which modules the engine patched
    memory: dict[str, Any] | None = None  # what the run held (`memory_record`)
    # the quantized GEMMs run per GEMM kind and unit: {"linear.forward": {"bf16": 12800}, ...}
    gemm_units: dict[str, dict[str, int]] | None = None
    evaluation: dict[str, Any] = dataclasses.field(default_factory=dict)

    # -- reading and writing ----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The JSON object: the fields (those that are None when optional are left out) and the
        evaluation fields beside them."""
        out: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            if field.name == "evaluation":
                continue
            value = getattr(self, field.name)
            trained = field.name in TRAINED and self.epochs is not None
            if value is None and field.name not in REQUIRED and not trained:
                continue
            out[field.name] = value
        out.update(self.evaluation)
        return out

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> RunResult:
        """A result.json object; raises ``ValueError`` naming every problem (`problems`)."""
        problems = cls.problems(record)
        if problems:
            raise ValueError("; ".join(problems))
        names = {f.name for f in dataclasses.fields(cls)} - {"evaluation"}
        known = {k: v for k, v in record.items() if k in names}
        evaluation = {k: v for k, v in record.items() if k not in names}
        # as this version writes it; the library's records name transformers among their versions
        by_library = "transformers" in (record.get("versions") or {})
        known["quant"] = record_quant(known["quant"], by_library=by_library)
        return cls(**known, evaluation=evaluation)

    def write(self, run_dir: Path, *, in_place: bool = False) -> None:
        """Write result.json atomically; ``in_place``: over the old file (`runs.overwrite_json`,
        for a disk too full for an atomic write)."""
        write = runs.overwrite_json if in_place else runs.write_json
        write(Path(run_dir) / FILENAME, self.to_dict())

    @classmethod
    def read(cls, path: Path) -> RunResult:
        """``path``: a run directory or its result.json. ``ValueError`` when unreadable or
        malformed, with the reason."""
        path = Path(path)
        if path.is_dir():
            path = path / FILENAME
        try:
            record = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"unreadable ({err})") from None
        return cls.from_dict(record)

    @staticmethod
    def checkpointed(run_dir: Path) -> bool:
        """Whether the run recomputed its layers' activations in the backward pass
        (``train.activation_checkpointing``, read from the run's config.yaml): the same numbers,
        other memory and time, so a table keeps such runs in a row of their own."""
        import yaml

        try:
            config = yaml.safe_load((Path(run_dir) / "config.yaml").read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            return False
        train = config.get("train") if isinstance(config, Mapping) else None
        return isinstance(train, Mapping) and train.get("activation_checkpointing") is True

    @staticmethod
    def status_of(run_dir: Path) -> str | None:
        """The status a run directory's result.json records (None: none, or unreadable). Only
        the status is read: a finished run is finished even if other fields are malformed."""
        try:
            record = json.loads((Path(run_dir) / FILENAME).read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return None
        status = record.get("status") if isinstance(record, Mapping) else None
        return status if isinstance(status, str) else None

    # -- validation -------------------------------------------------------------------------
    @staticmethod
    def problems(record: Any) -> list[str]:
        """What is wrong with a result.json object (empty when it is a well-formed result)."""
        if not isinstance(record, Mapping):
            return ["not a JSON object"]
        problems = [f"missing key {k!r}" for k in REQUIRED if k not in record]
        status = record.get("status")
        if status is not None and status not in STATUSES:
            problems.append(f"status {status!r} is not one of {STATUSES}")
        metric = record.get("metric")
        if metric is not None and metric not in METRICS:
            problems.append(f"metric {metric!r} is not one of {METRICS}")
        quant = record.get("quant")
        if isinstance(quant, Mapping):
            problems += [f"quant lacks {k!r}" for k in ("preset", *POINTS) if k not in quant]
        elif "quant" in record:
            problems.append("quant must be a mapping with the preset name and the four points")
        cost = record.get("cost")
        if isinstance(cost, Mapping):
            problems += [f"cost lacks {k!r}" for k in COST_KEYS if k not in cost]
        elif "cost" in record:
            problems.append("cost must be a mapping with arith_ratio, dram_ratio and baseline")
        if problems or status != "completed":
            return problems
        # A completed run carries the numbers it is shown with.
        if not _is_number(record["value"]):
            problems.append(f"completed but value is {record['value']!r}")
        for key in ("arith_ratio", "dram_ratio"):
            if not _is_number(cost[key]):
                problems.append(f"completed but cost.{key} is {cost[key]!r}")
        if not _is_number(record["stash_bits_mean"]):
            problems.append(f"completed but stash_bits_mean is {record['stash_bits_mean']!r}")
        return problems

    # -- what readers ask -------------------------------------------------------------------
    @property
    def completed(self) -> bool:
        return self.status == "completed"

    @property
    def checkpoint_unreadable(self) -> bool:
        """Whether the run failed because its checkpoint_last.pt cannot be read."""
        return self.status == "failed" and (self.error or "").startswith(CORRUPT_CHECKPOINT)

    @property
    def preset(self) -> str:
        return str(self.quant["preset"])

    @property
    def stopped_early(self) -> dict[str, Any] | None:
        """``{update, reason}`` when the run ended at a validation before its cap."""
        return (self.budget or {}).get("stopped_early")

    def value_of(self, checkpoint: str | None) -> float | None:
        """The metric of the model ``checkpoint`` names: ``best`` or ``last`` (None: `value`,
        the run's own headline), from ``checkpoints``. A result.json written before it has: a
        GLUE run's best is its `value` and its last `final_dev`; a translation run scored only
        its last model, so its best is unknown (None)."""
        if checkpoint is None:
            return self.value
        entries = self.evaluation.get("checkpoints")
        if isinstance(entries, Mapping):
            entry = entries.get(checkpoint)
            return entry.get(self.metric) if isinstance(entry, Mapping) else None
        final_dev = self.evaluation.get("final_dev")
        if isinstance(final_dev, Mapping):
            return self.value if checkpoint == "best" else final_dev.get("value")
        return self.value if checkpoint == "last" else None

    def valid_loss_of(self, checkpoint: str) -> float | None:
        """The validation loss of the model ``checkpoint`` names (``best`` or ``last``), from
        ``checkpoints``; None where the run did not record it."""
        entries = self.evaluation.get("checkpoints")
        entry = entries.get(checkpoint) if isinstance(entries, Mapping) else None
        return entry.get("valid_loss") if isinstance(entry, Mapping) else None

    def summary(self) -> dict[str, Any]:
        """The headline numbers, for the experiment logger's run summary."""
        record = self.to_dict()
        keys = ("status", "value", "bleu", "valid_loss", "best_valid_loss", "updates", "cost",
                "wall_seconds", "stash_bits_mean", "copy_source_bleu", "bits_final",
                "memory")  # fmt: skip
        return {k: record[k] for k in keys if k in record}


def memory_record(gemm_shapes: list[dict] | None, cuda_peak_allocated: int | None) -> dict:
    """result.json's ``memory``, taken when training has been summarised:

    * ``peak_rss_mib``: this process's peak resident set size (``getrusage``'s ``ru_maxrss``,
      KiB on Linux, bytes on macOS), in MiB: the most host RAM the process ever held, for
      anything (the interpreter and libraries, the data, the model, training, evaluation), not
      only the training step; GPU memory is not in it. A data-parallel run: rank 0's process.
    * ``cuda_peak_allocated_mib``: ``cuda_peak_allocated`` in MiB, the CUDA allocator's peak of
      bytes in tensors on the run's device (``torch.cuda.max_memory_allocated``; the caching
      allocator's reserve and the CUDA context not included); None without CUDA.
    * ``stash_bytes_per_step``: the bytes the recorded training step packs into DSQ stashes for
      the backward pass, each GEMM counted once (with activation checkpointing a layer holds its
      own only around its backward; docs/dsq.md, "What the backward pass holds"): the sum of
      ``stash_bytes`` over ``gemm_shapes``, the GEMMs of the first
      update the process recorded (docs/spec.md §4; one rank's batch); None when no update was
      recorded.
    """
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_bytes = rss if sys.platform == "darwin" else rss * 1024
    return {
        "peak_rss_mib": round(rss_bytes / MIB, 1),
        "cuda_peak_allocated_mib": (
            None if cuda_peak_allocated is None else round(cuda_peak_allocated / MIB, 1)
        ),
        "stash_bytes_per_step": (
            None if gemm_shapes is None else sum(g["stash_bytes"] for g in gemm_shapes)
        ),
    }


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
