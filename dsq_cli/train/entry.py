"""`dsq train`: one run from a typed config to a finished run directory (docs/spec.md §5).

The order is the point: the task's family decides its data and trainer (`families`); the data is
prepared and checked, then the run directory is made (so bad input leaves nothing behind), then
the run is launched: in this process (`rank_run`), in N spawned processes (`launch`), or as one
process of a torchrun / srun launch. A stopped run continues with `load_resume`.
"""

from __future__ import annotations

import datetime as _dt
import logging
from dataclasses import dataclass
from pathlib import Path

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

from dsq.atomic_files import write_atomic
from dsq.formats.backends import requested_backend_refusal
from dsq_cli import runs
from dsq_cli.config import GROUPS, ConfigError, check_resume_from, to_plain, typed
from dsq_cli.run_config import RESUME_FROM, RunConfig
from dsq_cli.run_result import CORRUPT_CHECKPOINT, RunResult

from . import launch, ranks
from .families import family_of
from .rank_run import Outcome, run_rank, run_spawned_rank, started_result
from .recorder import UnreadableCheckpoint, load_checkpoint
from .stop import EXIT_CODES

log = logging.getLogger(__name__)


def resolve_device(requested: str) -> str:
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but torch sees no CUDA device; use train.device=cpu")
    return requested


def check_devices(world_size: int, device: str) -> None:
    """One device per rank on GPUs, and a quantizer backend named by DSQ_BACKEND that runs on
    ``device`` (before anything is written); CPU ranks share the cores."""
    refusal = requested_backend_refusal(device)
    if refusal is not None:
        raise ConfigError(refusal)
    if device != "cuda":
        return
    import torch

    if torch.cuda.device_count() < world_size:
        raise ConfigError(
            f"train.distributed_world_size={world_size} but torch sees "
            f"{torch.cuda.device_count()} CUDA devices; lower it or use train.device=cpu"
        )


def run_name(cfg: RunConfig) -> str:
    return cfg.run.name or f"{cfg.task.name}-{cfg.choices['quant']}-seed{cfg.seed}"


def prepare_data(cfg: RunConfig):
    """The task's data, checked and ready (DataError, a usage error, when it is not)."""
    return family_of(cfg).prepare(cfg)


@dataclass
class Resume:
    """A stopped run to continue (`load_resume`): its directory, the checkpoint it continues
    from and that checkpoint's contents."""

    run_dir: Path
    checkpoint: Path
    state: dict


def train(cfg: RunConfig, *, resume: Resume | None = None) -> Outcome:
    """Run ``cfg`` to the end; returns the outcome (never raises for a training failure).

    With ``train.distributed_world_size=N`` this process spawns N workers (one per device) and
    waits; under torchrun it is itself one of them."""
    family = family_of(cfg)
    device = resolve_device(cfg.train.device)
    world_size = cfg.train.distributed_world_size
    launched = ranks.from_environment()
    if not family.data_parallel and (world_size > 1 or launched is not None):
        raise ConfigError(
            f"{family.title} runs in one process; drop train.distributed_world_size and "
            "torchrun (data parallelism is for the translation tasks)"
        )
    if launched is not None:
        return _train_launched(cfg, resume, launched, device)
    check_devices(world_size, device)
    data = family.prepare(cfg)  # DataError (bad or missing data) before any run directory exists
    run_dir, state = _open_run_dir(cfg, resume)
    resume_from = None if resume is None else resume.checkpoint
    try:
        if world_size > 1:
            started = started_result(cfg, data, device, resume is not None)  # if rank 0 writes none
            codes = launch.spawn(world_size, device, run_spawned_rank,
                                 (cfg, str(run_dir), resume_from, device))  # fmt: skip
            return spawned_outcome(run_dir, codes, started)
        return run_rank(cfg, run_dir, device=device, resume_from=resume_from, data=data,
                        state=state)  # fmt: skip
    finally:
        runs.release(run_dir)


def _open_run_dir(cfg: RunConfig, resume: Resume | None) -> tuple[Path, dict | None]:
    """The run's directory, held by this process until it exits (`runs.hold`: a second process
    resuming the same run is refused), with its config.yaml written when the run is new. A
    resumed run's directory is rid of the temporary files of writes a kill interrupted."""
    if resume is not None:
        runs.hold(resume.run_dir)
        for stale in runs.remove_stale_temporaries(resume.run_dir):
            log.warning("removed %s, left by a write that a kill interrupted", stale)
        return resume.run_dir, resume.state
    run_dir = (
        runs.exact_run_dir(cfg.run.dir)
        if cfg.run.dir
        else runs.new_run_dir(cfg.run.root, run_name(cfg))
    )
    runs.hold(run_dir)
    write_atomic(run_dir / "config.yaml", config_yaml(cfg))
    return run_dir, None


def config_yaml(cfg: DictConfig) -> str:
    """config.yaml: the fully resolved config the run uses, without secrets."""
    return yaml.safe_dump(runs.scrub_secrets(to_plain(cfg)), sort_keys=False)


def _train_launched(cfg: RunConfig, resume: Resume | None, rank: ranks.Rank,
                    device: str) -> Outcome:  # fmt: skip
    """One process of a torchrun / srun launch: rank 0 prepares the data and makes the run
    directory, then tells the others where it is (or what was wrong)."""
    configured = cfg.train.distributed_world_size
    if configured not in (1, rank.world_size):
        raise ConfigError(
            f"train.distributed_world_size={configured} but the launcher started "
            f"{rank.world_size} processes; drop the override or make them agree"
        )
    cfg.train.distributed_world_size = rank.world_size
    ranks.init_process_group(rank, device, "env://")
    try:
        data = run_dir = error = None
        if rank.is_main:
            try:
                data = prepare_data(cfg)
                run_dir, _ = _open_run_dir(cfg, resume)
            except ValueError as err:  # ConfigError, DataError: one line for every rank
                error = err
        told = ranks.broadcast_from_main(
            ("error", str(error)) if error is not None else ("run_dir", str(run_dir))
        )
        if error is not None:
            raise error
        if told[0] == "error":
            raise ConfigError(told[1])
        return run_rank(cfg, Path(told[1]), rank=rank, device=device,
                        resume_from=None if resume is None else resume.checkpoint, data=data,
                        state=None if resume is None else resume.state)  # fmt: skip
    finally:
        if run_dir is not None:
            runs.release(run_dir)
        ranks.destroy_process_group()


def spawned_outcome(run_dir: Path, codes: dict[int, int | None], started: RunResult) -> Outcome:
    """The run's outcome from rank 0's result.json. A rank that failed or had to be killed while
    rank 0 was still training leaves it at ``running`` (or, dying before its logger was up,
    leaves none: ``started`` stands in): it is then recorded as ``failed``."""
    try:
        result = RunResult.read(run_dir)
    except ValueError:
        result = started
    main_code = codes[0]
    if result.status == "running" or main_code is None:
        bad = ", ".join(
            f"rank {r} exited with {code if code is not None else 'a signal'}"
            for r, code in codes.items()
            if code != 0
        )
        result.status = "failed"
        result.error = f"distributed training failed: {bad} (see train.log and train.rankN.log)"
        result.finished_at = _dt.datetime.now().isoformat(timespec="seconds")
        result.write(run_dir)
        main_code = EXIT_CODES["failed"]
    return Outcome(result.status, run_dir, result, main_code)


# -- resuming ---------------------------------------------------------------------------------
UNSET = "<unset>"
# What a run is made of: its group choices and these keys (the model and data its checkpoint
# holds, the seed of its batch order and dropout, its directory) cannot change on resume.
FIXED_ON_RESUME = ("seed", "task", "model", "data", "run", "choices")
# Keys a run directory written by an older dsq lacks; resume may add them.
ADDABLE_ON_RESUME = ("task.family",)
# Keys a run directory written by an older dsq lacks, with the values that keep such a run as it
# started: no early stop, and the final model is the one scored; resume_from is never stored
# other than ``last`` (it chooses the checkpoint of one resume).
PREDATED_KEYS = {"train.stop_patience": 0, "eval.checkpoint": "last", "resume_from": "last",
                 "train.activation_checkpointing": False, "train.loss_chunk_tokens": 0}  # fmt: skip
# Keys that say how this process starts, not what the run is: they never reach config.yaml.
PER_RESUME_KEYS = ("resume", "resume_from")
# model.family in a run directory written before it shared task.family's names: absent meant a
# translation model, ``encoder`` a GLUE encoder. Resume renames it; the model is the same.
RENAMED_MODEL_FAMILIES = {UNSET: "translation", "encoder": "glue"}


def load_resume(run_dir: str, overrides: list[str]) -> tuple[RunConfig, Resume]:
    """The stored config of ``run_dir`` with ``overrides`` merged on top, and the checkpoint it
    continues from: checkpoint_last.pt, or the one ``resume_from=`` names (`_resumed_state`)."""
    path = Path(run_dir)
    config_path = path / "config.yaml"
    if not path.is_dir():
        raise ConfigError(f"resume={run_dir}: no such directory; give a run directory")
    if not config_path.is_file():
        raise ConfigError(f"resume={run_dir}: no config.yaml there; is it a dsq run directory?")
    if RunResult.status_of(path) == "completed":
        raise ConfigError(f"resume={run_dir}: that run already completed; start a new run")
    launched = ranks.from_environment()  # under torchrun only rank 0 holds the run
    main = launched is None or launched.is_main
    if main and runs.in_use(path):
        raise ConfigError(
            f"resume={run_dir}: another process is training that run now (it holds "
            f"{runs.LOCK_NAME} there); wait for it to end, or stop it first"
        )
    which = _resume_from(overrides)
    checkpoint = runs.checkpoint_path(path, which)
    if not checkpoint.is_file():
        why = " (the run stopped before it wrote one)" if which == "last" else ""
        raise ConfigError(
            f"resume={run_dir}: no {checkpoint}{why}{_other_checkpoint(run_dir, which)}"
        )
    stored = OmegaConf.load(config_path)
    predated = [k for k in PREDATED_KEYS if OmegaConf.select(stored, k, default=UNSET) is UNSET]
    for key in predated:
        OmegaConf.update(stored, key, PREDATED_KEYS[key])
    old_family = OmegaConf.select(stored, "model.family", default=UNSET)
    renamed = isinstance(old_family, str) and old_family in RENAMED_MODEL_FAMILIES
    if renamed:
        OmegaConf.update(stored, "model.family", RENAMED_MODEL_FAMILIES[old_family])
    extra = _resume_overrides(
        stored, [o for o in overrides if o.partition("=")[0].lstrip("+") not in PER_RESUME_KEYS]
    )
    try:  # unknown keys are refused by the schema (`typed`), with the keys that exist
        merged = OmegaConf.merge(stored, OmegaConf.from_dotlist(extra))
    except Exception as err:
        raise ConfigError(f"resume: bad override: {str(err).splitlines()[0]}") from None
    if OmegaConf.select(merged, "task.family") is None:
        raise ConfigError(
            f"resume={run_dir}: its config.yaml predates task.family; say which trainer it "
            "needs: add task.family=translation (or task.family=glue for a GLUE task)"
        )
    cfg = typed(merged)
    state = _resumed_state(run_dir, which, record_failure=main)
    # config.yaml stays the fully resolved config the run actually uses
    if extra or predated or renamed:
        write_atomic(config_path, config_yaml(cfg))
    return cfg, Resume(path, checkpoint, state)


def _resume_from(overrides: list[str]) -> str:
    """The checkpoint this resume continues from: ``resume_from=`` (the last one given), else
    ``last``."""
    given = [value for key, _, value in (o.partition("=") for o in overrides)
             if key.lstrip("+") == "resume_from"]  # fmt: skip
    which = given[-1] if given else "last"
    check_resume_from(which)
    return which


def _resumed_state(run_dir: str, which: str, *, record_failure: bool) -> dict:
    """The contents of the run's checkpoint ``which``. One that cannot be read (empty, cut short,
    not a checkpoint) is a ConfigError naming it and offering the run's other checkpoint where
    that one loads. An unreadable checkpoint_last.pt also marks the run ``failed``
    (`CORRUPT_CHECKPOINT`; by rank 0 only, with ``record_failure``): it cannot continue as it
    stands, and `dsq sweep --resume-unfinished` must not try it again and again. The rest of
    result.json, the metrics and the other checkpoint stay as they were."""
    try:
        return load_checkpoint(runs.checkpoint_path(run_dir, which))
    except UnreadableCheckpoint as err:
        problem = f"{CORRUPT_CHECKPOINT}: {err}{_other_checkpoint(run_dir, which)}"
    if which == "last" and record_failure:
        _record_failure(Path(run_dir), problem)
    raise ConfigError(f"resume={run_dir}: {problem}")


def _other_checkpoint(run_dir: str, which: str) -> str:
    """What a resume refused for checkpoint ``which`` can do instead: continue from the run's
    next checkpoint that loads (last, then best: newest first), or start again."""
    for other in RESUME_FROM:
        path = runs.checkpoint_path(run_dir, other)
        if other == which or not path.is_file():
            continue
        try:
            update = load_checkpoint(path)["num_updates"]
        except UnreadableCheckpoint:
            continue
        return (f"; {path} (update {update}) can be read: continue from it with "
                f"`dsq train resume={run_dir} resume_from={other}`")  # fmt: skip
    return "; the run has no other checkpoint that can be read: start it again instead"


def _record_failure(run_dir: Path, error: str) -> None:
    """Mark the run of ``run_dir`` failed with ``error`` in its result.json, the rest of it
    kept (nothing to mark when it has none that can be read)."""
    try:
        result = RunResult.read(run_dir)
    except ValueError:
        return
    result.status, result.error = "failed", error
    result.write(run_dir)


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
            stored = OmegaConf.select(cfg, plain_key, default=UNSET)
            if key == plain_key and sep and stored is UNSET and plain_key in ADDABLE_ON_RESUME:
                kept.append(override)  # a key the stored config predates: adding it changes nothing
                continue
            if key == plain_key and sep and _same_value(override, plain_key, stored):
                continue
            raise ConfigError(
                f"resume continues the stored config: the run uses {plain_key}={_plain(stored)}, "
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
