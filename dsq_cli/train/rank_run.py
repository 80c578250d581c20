"""The run of one rank: its trainer from start (or checkpoint) to a final result.json.

Rank 0 writes the run directory (docs/spec.md §5: result.json, metrics.jsonl, schedule.jsonl,
checkpoints, train.log) and feeds the experiment logger; a rank R>0 of a distributed run writes
only its own log, ``train.rankR.log``. Whatever happens in training ends as a status and an exit
code: ``completed`` (0), ``interrupted`` (Ctrl-C / SIGTERM, 128 + the signal; resumable with
``resume=RUN_DIR``), ``diverged`` (3: a NaN/Inf loss; the last good checkpoint stays) or
``failed`` (1: any other error, named in result.json and the log).
"""

from __future__ import annotations

import datetime as _dt
import logging
import signal
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from dsq.cost import stash_bits_mean
from dsq.engine import QuantConfig
from dsq.engine.spec import SPEC_VERSION
from dsq.presets import COST_BASELINE, preset_differences
from dsq_cli import runs
from dsq_cli.config import to_plain
from dsq_cli.cost.run_cost import run_cost
from dsq_cli.cpu_allocator import apply_malloc_setting
from dsq_cli.loggers import make_logger
from dsq_cli.run_config import RunConfig
from dsq_cli.run_result import RunResult, memory_record, unpriced

from . import ranks
from .fairseq_compat import quiet_library_warnings
from .families import family_of
from .loop import Trainer
from .recorder import QuietRecorder, RunRecorder, load_checkpoint, run_log
from .stop import EXIT_CODES, Diverged, Interrupted, StopRequest

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    status: str
    run_dir: Path
    result: RunResult
    exit_code: int
    main: bool = True  # False on ranks other than 0, which report nothing


def now() -> str:
    return _dt.datetime.now().isoformat(timespec="seconds")


def run_rank(
    cfg: RunConfig,
    run_dir: Path,
    *,
    device: str,
    resume_from: Path | None = None,
    rank: ranks.Rank = ranks.SINGLE,
    data=None,
    state: dict | None = None,
) -> Outcome:
    """Train in this process, as ``rank`` of the data-parallel group: a new run, or one resumed
    from the checkpoint ``resume_from`` (``state``: its contents, when already loaded)."""
    if device == "cpu":
        apply_malloc_setting()  # DSQ_CPU_ALLOCATOR (by default: reuse freed pages)
    if data is None:  # a spawned worker: the parent prepared the data; this reads the cache
        data = family_of(cfg).prepare(cfg)
    if state is None and resume_from is not None:
        state = load_checkpoint(Path(resume_from))
    started = started_result(cfg, data, device, resume_from is not None)
    if not rank.is_main:
        with run_log(run_dir / f"train.rank{rank.rank}.log"):
            return _train_and_evaluate(cfg, data, device, QuietRecorder(run_dir), state,
                                       started, rank)  # fmt: skip
    with run_log(run_dir / "train.log"):
        experiment = make_logger(cfg.logger, run_dir, to_plain(cfg))
        recorder = RunRecorder(run_dir, experiment)
        recorder.result(started)
        outcome = _train_and_evaluate(cfg, data, device, recorder, state, started, rank)
        experiment.summary(outcome.result.summary())
        experiment.finish(exit_code=outcome.exit_code)
    return outcome


def run_spawned_rank(rank: ranks.Rank, cfg: RunConfig, run_dir: str, resume_from: Path | None,
                     device: str) -> int:  # fmt: skip
    """`launch.spawn`'s target: one spawned worker's run; its exit code."""
    quiet_library_warnings()  # what `dsq train` set in the parent, which a spawned child lacks
    outcome = run_rank(cfg, Path(run_dir), rank=rank, device=device, resume_from=resume_from)
    return outcome.exit_code


def _train_and_evaluate(cfg, data, device, recorder, state, started: RunResult,
                        rank: ranks.Rank) -> Outcome:  # fmt: skip
    trainer = None
    status, error, evaluation = "completed", None, {}
    exit_code = 0
    with StopRequest() as stop:
        try:
            # stochastic rounding noise: the run's seed, a stream of its own on every rank
            noise_seed = cfg.seed + 1_000_003 * rank.rank
            quant = QuantConfig.from_dict(to_plain(cfg.quant), seed=noise_seed)
            trainer = family_of(cfg).trainer.from_run_config(
                cfg, quant, data, recorder, device, rank
            )
            if state is not None:
                recorder.truncate_after(state["num_updates"])
            trainer.train(stop, state)
            if rank.is_main:  # the final model is the same on every rank
                with trainer.progress_line.phase("final evaluation"):
                    evaluation = trainer.evaluate(stop)
                test_record = {k: v for k, v in evaluation.items() if k != "value"}
                recorder.metrics({"kind": "test", "update": trainer.updates, **test_record})
        except Interrupted as err:
            status, error = "interrupted", str(err)
            exit_code = 128 + err.signum
        except Diverged as err:
            status, error = "diverged", str(err)
            exit_code = EXIT_CODES["diverged"]
            log.error("diverged: %s", err)
        except KeyboardInterrupt:  # a second signal, or Ctrl-C outside the update loop
            status, error = "interrupted", "stopped at once by a second signal"
            exit_code = 128 + (stop.signum or signal.SIGINT)
        except Exception as err:
            log.exception("training failed")
            status, error, exit_code = "failed", f"{type(err).__name__}: {err}", 1
    evaluation = dict(evaluation)
    result = replace(started, status=status, value=evaluation.pop("value", None), error=error,
                     evaluation=evaluation)  # fmt: skip
    if trainer is not None:
        try:
            result = trained_result(result, trainer)
        except Exception as err:  # e.g. a broken cost config: never leave "running" behind
            log.exception("summarising the run failed")
            status, exit_code = "failed", EXIT_CODES["failed"]
            result.status = status
            result.error = f"summarising the run: {type(err).__name__}: {err}"
    result.finished_at = now()
    if not _record_result(recorder, result):
        status, exit_code = "failed", EXIT_CODES["failed"]
        result.status = status
        result.error = f"{result.error + '; ' if result.error else ''}result.json not written"
    return Outcome(status, recorder.dir, result, exit_code, main=rank.is_main)


def _record_result(recorder: RunRecorder, result: RunResult) -> bool:
    """Write the run's final result.json; whether it got written. A full disk has no room for
    the atomic write's second copy (a failed checkpoint frees its own, but other writers may
    not): the result is then written over the old file, so that it never stays ``running``."""
    try:
        recorder.result(result)
        return True
    except OSError:
        log.exception("writing result.json failed; writing it in place")
    try:
        recorder.result(result, in_place=True)
        return True
    except OSError:
        log.exception("writing result.json in place failed too")
        return False


# -- what result.json says about the run ------------------------------------------------------
def recorded_quant(preset: str, points: dict) -> dict:
    """result.json's ``quant``: the preset's name, the run's quant keys and whether they differ
    from the preset's (``modified``); under ``stash_scope=all`` its rules in force, defaults
    included (``saved``), which no preset file writes."""
    if points.get("stash_scope") == "all":
        points = points | {"saved": QuantConfig.from_dict(points).to_dict()["saved"]}
    modified = preset_differences({"preset": preset, **points}) != []
    # the version of the mapping the run read (a quant file without one: this version's)
    return {"preset": preset, "version": SPEC_VERSION, **points, "modified": modified}


def started_result(cfg: RunConfig, data, device: str, resumed: bool) -> RunResult:
    """result.json as a run starts (status ``running``)."""
    return RunResult(
        status="running",
        task=cfg.task.name,
        model=cfg.model["name"],
        seed=cfg.seed,
        quant=recorded_quant(cfg.choices["quant"], to_plain(cfg.quant)),
        metric=cfg.task.metric,
        cost=unpriced(COST_BASELINE),
        versions=runs.versions(),
        device=device,
        world_size=cfg.train.distributed_world_size,
        data={"dir": data.source, **data.manifest},
        started_at=now(),
        resumed=resumed,
    )


def trained_result(result: RunResult, trainer: Trainer) -> RunResult:
    """``result`` with what the trainer recorded: progress, precision segments, cost, memory."""
    progress = trainer.progress
    segments = progress["segments"]
    device = torch.device(trainer.device)
    cuda_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return replace(
        result,
        updates=trainer.updates,
        epochs=trainer.epoch,
        # the plan (the cap, stop_patience) and whether the run stopped before its cap, and why
        budget={**trainer.budget.as_dict(), "stopped_early": progress["stopped_early"]},
        valid_loss=progress["last_valid_loss"],
        best_valid_loss=progress["best_valid_loss"],
        wall_seconds=round(progress["wall_seconds"], 3),
        stash_bits_mean=stash_bits_mean(segments),
        bits_final=trainer.quant.current(),
        precision_segments=[{"points": points, "updates": n} for points, n in segments],
        cost=run_cost(progress["gemm_shapes"], segments),
        patch=trainer.patch_report.as_dict() | {"summary": trainer.patch_report.summary()},
        memory=memory_record(progress["gemm_shapes"], cuda_peak),
        gemm_units=progress.get("gemm_units"),
    )
