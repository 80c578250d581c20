"""`dsq train`: one run from a composed config to a finished run directory (SPEC 5).

Everything that can be checked is checked before the run directory exists (config, data), so
bad input leaves nothing behind. Then: config.yaml, result.json (``running``), training, and the
final result.json with its status: ``completed``, ``interrupted`` (Ctrl-C / SIGTERM, resumable
with ``resume=RUN_DIR``), ``diverged`` (NaN/Inf loss; the last good checkpoint stays) or
``failed`` (any other error, named in result.json and the log).
"""

from __future__ import annotations

import datetime as _dt
import logging
import signal
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf

from dsq_cli import runs
from dsq_cli.config import GROUPS, ConfigError, to_plain, validate

from . import distributed
from .common import (
    EXIT_CODES,
    Diverged,
    Interrupted,
    QuietRecorder,
    RunRecorder,
    StopRequest,
    load_checkpoint,
    run_log,
)

log = logging.getLogger(__name__)
RESUMABLE = ("interrupted", "failed", "diverged", "running")


@dataclass
class Outcome:
    status: str
    run_dir: Path
    result: dict
    exit_code: int
    main: bool = True  # False on ranks other than 0, which report nothing


def resolve_device(requested: str) -> str:
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but torch sees no CUDA device; use train.device=cpu")
    return requested


def run_name(cfg: DictConfig) -> str:
    if cfg.run.name:
        return str(cfg.run.name)
    return f"{cfg.task.name}-{cfg.choices.quant}-seed{cfg.seed}"


def load_resume(run_dir: str, overrides: list[str]) -> tuple[DictConfig, Path, dict]:
    """The stored config of ``run_dir`` with ``overrides`` merged on top, and its checkpoint."""
    path = Path(run_dir)
    config_path, result_path = path / "config.yaml", path / "result.json"
    if not config_path.is_file():
        raise ConfigError(f"resume={run_dir}: no config.yaml there; is it a dsq run directory?")
    import json

    status = json.loads(result_path.read_text()).get("status") if result_path.is_file() else None
    if status == "completed":
        raise ConfigError(f"resume={run_dir}: that run already completed; start a new run")
    checkpoint = path / "checkpoints" / "checkpoint_last.pt"
    if not checkpoint.is_file():
        raise ConfigError(
            f"resume={run_dir}: no checkpoints/checkpoint_last.pt (the run stopped before its "
            "first checkpoint); start it again instead"
        )
    cfg = OmegaConf.load(config_path)
    OmegaConf.set_struct(cfg, True)
    extra = _resume_overrides(cfg, [o for o in overrides if not o.startswith("resume=")])
    try:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(extra))
    except Exception as err:
        raise ConfigError(f"resume: bad override: {str(err).splitlines()[0]}") from None
    validate(cfg)
    if extra:  # config.yaml stays the fully resolved config the run actually uses
        runs.write_atomic(config_path, _config_yaml(cfg))
    return cfg, path, load_checkpoint(checkpoint)


# What a run is made of: its group choices and these keys (the model and data its checkpoint
# holds, the seed of its batch order and dropout, its directory) cannot change on resume.
FIXED_ON_RESUME = ("seed", "task", "model", "data", "run", "choices")


def _resume_overrides(cfg: DictConfig, overrides: list[str]) -> list[str]:
    """The overrides to merge into a stored config: those equal to the stored values (the command
    line the user typed first) are dropped; a real change of something fixed is refused."""
    kept = []
    for override in overrides:
        key, sep, value = override.partition("=")
        plain_key = key.lstrip("+~")
        if plain_key in GROUPS:
            stored = cfg.choices.get(plain_key)
            if sep and value == stored:
                continue
            raise ConfigError(
                f"resume continues the stored config: the run uses {plain_key}={stored}, so "
                f"{plain_key}= cannot change (start a new run)"
            )
        if plain_key.split(".")[0] in FIXED_ON_RESUME:
            stored = OmegaConf.select(cfg, plain_key, default="<unset>")
            if key == plain_key and sep and _same_value(override, plain_key, stored):
                continue
            raise ConfigError(
                f"resume continues the stored config: the run uses {plain_key}={_show(stored)}, "
                f"so {plain_key} cannot change (start a new run)"
            )
        kept.append(override)
    return kept


def _same_value(override: str, key: str, stored) -> bool:
    try:
        value = OmegaConf.select(OmegaConf.from_dotlist([override]), key)
    except Exception:
        return False
    value, stored = _plain(value), _plain(stored)
    return value == stored or str(value) == str(stored)


def _plain(value):
    """A config value as plain Python (nodes as lists and dicts)."""
    if isinstance(value, DictConfig | ListConfig):
        return OmegaConf.to_container(value)
    return value


def _show(value) -> str:
    return str(_plain(value))


def train(cfg: DictConfig, *, resume: tuple[Path, dict] | None = None) -> Outcome:
    """Run ``cfg`` to the end; returns the outcome (never raises for a training failure).

    With ``train.distributed_world_size=N`` this process spawns N workers (one per device) and
    waits; under torchrun it is itself one of them (`distributed`)."""
    family = task_family(cfg)
    device = resolve_device(str(cfg.train.device))
    world_size = int(cfg.train.distributed_world_size)
    launched = distributed.from_environment()
    if family == "glue" and (world_size > 1 or launched is not None):
        raise ConfigError(
            "GLUE fine-tuning runs in one process; drop train.distributed_world_size and "
            "torchrun (data parallelism is for the translation tasks)"
        )
    if launched is not None:
        return _train_launched(cfg, resume, launched, device)
    distributed.check_devices(world_size, device)
    data = prepare_data(cfg)  # DataError (bad or missing data) before any run directory exists
    run_dir, state = _open_run_dir(cfg, resume)
    if world_size > 1:
        codes = distributed.spawn(cfg, run_dir, resumed=resume is not None, device=device)
        return _spawned_outcome(run_dir, codes)
    return train_rank(cfg, run_dir, device=device, resumed=resume is not None, data=data,
                      state=state)  # fmt: skip


def task_family(cfg: DictConfig) -> str:
    """Which trainer a task needs: ``translation`` (fairseq) or ``glue`` (encoder fine-tuning)."""
    from dsq_cli.data.glue import GLUE_TASKS
    from dsq_cli.data.tasks import TASKS

    name = str(cfg.task.name)  # config.validate has checked that the model suits the task
    if name in TASKS:
        return "translation"
    if name in GLUE_TASKS:
        return "glue"
    raise ConfigError(
        f"task {name} has no trainer; translation: {sorted(TASKS)}, GLUE: {sorted(GLUE_TASKS)}"
    )


def prepare_data(cfg: DictConfig):
    """The task's data, checked and ready (DataError, a usage error, when it is not)."""
    if task_family(cfg) == "glue":
        from dsq_cli.data.glue import load_glue

        from .encoders import check_available

        check_available(cfg.model)  # the weights are there before any run directory is made
        return load_glue(cfg)
    from dsq_cli.data.prepare import prepare

    return prepare(cfg)


def _open_run_dir(cfg: DictConfig, resume) -> tuple[Path, dict | None]:
    if resume is not None:
        return resume
    run_dir = (
        runs.exact_run_dir(cfg.run.dir)
        if cfg.run.dir
        else runs.new_run_dir(cfg.run.root, run_name(cfg))
    )
    runs.write_atomic(run_dir / "config.yaml", _config_yaml(cfg))
    return run_dir, None


def _train_launched(cfg, resume, rank: distributed.Rank, device: str) -> Outcome:
    """One process of a torchrun / srun launch: rank 0 prepares the data and makes the run
    directory, then tells the others where it is (or what was wrong)."""
    configured = int(cfg.train.distributed_world_size)
    if configured not in (1, rank.world_size):
        raise ConfigError(
            f"train.distributed_world_size={configured} but the launcher started "
            f"{rank.world_size} processes; drop the override or make them agree"
        )
    cfg.train.distributed_world_size = rank.world_size
    distributed.init_process_group(rank, device, "env://")
    try:
        data = state = run_dir = error = None
        if rank.is_main:
            try:
                data = prepare_data(cfg)
                run_dir, state = _open_run_dir(cfg, resume)
            except ValueError as err:  # ConfigError, DataError: one line for every rank
                error = err
        told = distributed.broadcast_from_main(
            ("error", str(error)) if error is not None else ("run_dir", str(run_dir))
        )
        if error is not None:
            raise error
        if told[0] == "error":
            raise ConfigError(told[1])
        return train_rank(cfg, Path(told[1]), rank=rank, device=device,
                          resumed=resume is not None, data=data, state=state)  # fmt: skip
    finally:
        distributed.destroy_process_group()


def _spawned_outcome(run_dir: Path, codes: dict[int, int | None]) -> Outcome:
    """The run's outcome from rank 0's result.json. A rank that failed or had to be killed while
    rank 0 was still training leaves it at ``running``: it is then recorded as ``failed``."""
    import json

    result_path = run_dir / "result.json"
    # rank 0 writes it as soon as its logger is up; one that died before leaves none
    result = json.loads(result_path.read_text()) if result_path.is_file() else {}
    main_code = codes[0]
    if result.get("status", "running") == "running" or main_code is None:
        bad = ", ".join(
            f"rank {r} exited with {code if code is not None else 'a signal'}"
            for r, code in codes.items()
            if code != 0
        )
        result.update(
            status="failed",
            error=f"distributed training failed: {bad} (see train.log and train.rankN.log)",
            finished_at=_dt.datetime.now().isoformat(timespec="seconds"),
        )
        runs.write_json(run_dir / "result.json", result)
        main_code = EXIT_CODES["failed"]
    return Outcome(str(result["status"]), run_dir, result, main_code)


def train_rank(
    cfg: DictConfig,
    run_dir: Path,
    *,
    device: str,
    resumed: bool,
    rank: distributed.Rank = distributed.SINGLE,
    data=None,
    state: dict | None = None,
) -> Outcome:
    """Train in this process, as ``rank`` of the data-parallel group. Rank 0 writes the run
    directory (SPEC 5) and the experiment logger; other ranks only their own log."""
    if data is None:
        data = prepare_data(cfg)  # a spawned worker: the parent prepared it; this reads the cache
    if state is None and resumed:
        state = load_checkpoint(run_dir / "checkpoints" / "checkpoint_last.pt")
    if not rank.is_main:
        with run_log(run_dir / f"train.rank{rank.rank}.log"):
            return _train_and_evaluate(cfg, data, device, QuietRecorder(run_dir), state, {}, rank)
    from .loggers import make_logger

    plain = to_plain(cfg)
    started_at = _dt.datetime.now().isoformat(timespec="seconds")
    with run_log(run_dir / "train.log"):
        experiment = make_logger(cfg.logger, run_dir, plain)
        recorder = RunRecorder(run_dir, experiment)
        base = _result_base(cfg, plain, data, device, started_at, resumed)
        recorder.result(base | {"status": "running"})
        outcome = _train_and_evaluate(cfg, data, device, recorder, state, base, rank)
        experiment.summary(_summary(outcome.result))
        experiment.finish(exit_code=outcome.exit_code)
    return outcome


def _config_yaml(cfg: DictConfig) -> str:
    import yaml

    return yaml.safe_dump(runs.scrub_secrets(to_plain(cfg)), sort_keys=False)


def _trainer_class(cfg):
    if task_family(cfg) == "glue":
        from .glue import GlueTrainer

        return GlueTrainer
    from .translation import TranslationTrainer

    return TranslationTrainer


def _train_and_evaluate(cfg, data, device, recorder, state, base, rank) -> Outcome:
    trainer_class = _trainer_class(cfg)

    trainer = None
    status, error, evaluation = "completed", None, {}
    exit_code = 0
    with StopRequest() as stop:
        try:
            trainer = trainer_class(cfg, data, recorder, device, rank)
            if state is not None:
                recorder.truncate_after(int(state["num_updates"]))
            trainer.train(stop, state)
            if rank.is_main:  # the final model is the same on every rank
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
    result = dict(base)
    result.update(status=status, value=None)
    result.update(evaluation)
    if error:
        result["error"] = error
    if trainer is not None:
        try:
            result.update(_trained_fields(trainer))
        except Exception as err:  # e.g. a broken cost config: never leave "running" behind
            log.exception("summarising the run failed")
            status, exit_code = "failed", EXIT_CODES["failed"]
            result.update(status=status, error=f"summarising the run: {type(err).__name__}: {err}")
    result["finished_at"] = _dt.datetime.now().isoformat(timespec="seconds")
    recorder.result(result)
    return Outcome(status, recorder.dir, result, exit_code, main=rank.is_main)


def _trained_fields(trainer) -> dict:
    from .base import stash_bits_mean

    progress = trainer.progress
    return dict(
        updates=trainer.updates,
        epochs=trainer.epoch,
        budget=trainer.budget.as_dict(),
        valid_loss=progress["last_valid_loss"],
        best_valid_loss=progress["best_valid_loss"],
        wall_seconds=round(progress["wall_seconds"], 3),
        stash_bits_mean=stash_bits_mean(progress["segments"]),
        bits_final=trainer.quant.current(),
        precision_segments=[{"points": points, "updates": n} for points, n in progress["segments"]],
        cost=_run_cost(progress),
        patch=trainer.patch_report.as_dict() | {"summary": trainer.patch_report.summary()},
    )


def _run_cost(progress: dict) -> dict:
    """SPEC 4: the update-weighted cost over the levels used, priced on one recorded step."""
    from dsq_cli.cost import scheduled_cost
    from dsq_cli.engine.accounting import GemmRecord

    shapes, segments = progress.get("gemm_shapes"), progress["segments"]
    if not shapes or not segments:
        return {"arith_ratio": None, "dram_ratio": None, "baseline": "fixed32"}
    records = [
        GemmRecord(
            g["kind"], g["batch"], g["n"], g["k"], g["m"],
            tuple(sorted(g["formats"].items())), g["stash_bytes"],
        )
        for g in shapes
    ]  # fmt: skip
    cost = scheduled_cost(records, [(points, n) for points, n in segments], "fixed32")
    cost["gemms_per_step"] = len(records) * 3
    return cost


def _result_base(cfg, plain, data, device, started_at, resumed) -> dict:
    quant = {"preset": str(cfg.choices.quant), **plain["quant"]}
    quant["modified"] = _quant_modified(str(cfg.choices.quant), plain["quant"])
    return {
        "status": "running",
        "task": str(cfg.task.name),
        "model": str(cfg.model.name),
        "seed": int(cfg.seed),
        "quant": quant,
        "metric": str(cfg.task.metric),
        "value": None,
        "valid_loss": None,
        "updates": 0,
        "wall_seconds": 0.0,
        "cost": {"arith_ratio": None, "dram_ratio": None, "baseline": "fixed32"},
        "stash_bits_mean": None,
        "versions": runs.versions(),
        "device": device,
        "world_size": int(cfg.train.distributed_world_size),  # data-parallel ranks
        "data": {"dir": data.source, **data.manifest},
        "started_at": started_at,
        "resumed": resumed,
    }


def _quant_modified(preset: str, points: dict) -> bool:
    from dsq_cli.presets import load_quant_preset

    try:
        stored = load_quant_preset(preset)
    except ValueError:
        return True
    return any(stored.get(k) != v for k, v in points.items() if k != "modified")


def _summary(result: dict) -> dict:
    keys = ("status", "value", "bleu", "valid_loss", "best_valid_loss", "updates", "cost",
            "wall_seconds", "stash_bits_mean", "copy_source_bleu", "bits_final")  # fmt: skip
    return {k: result[k] for k in keys if k in result}
