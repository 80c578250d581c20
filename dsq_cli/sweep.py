"""`dsq sweep`: a grid of `dsq train` jobs under one sweep root, then the Table 1 of that root.

Overrides use Hydra's sweep syntax (``quant=fp32,dsq seed=1,2 seed=range(1,4)``); the grid is
their cartesian product, expanded by Hydra's own override parser. Each job is one `dsq train`
process with ``run.dir=ROOT/<job name>``, its output in ``ROOT/<job name>.log``, so a job that
fails (bad override, divergence, crash) never stops the others, and a rerun of the same sweep
finds each finished job by its name and skips it.

Launchers (``launcher=`` in the sweep overrides): ``local`` runs the jobs one after another;
``joblib`` runs ``launcher.n_jobs`` at once on this machine; ``slurm`` submits them as a job
array through submitit, configured like hydra-submitit-launcher (``launcher.partition=gpu
launcher.gpus_per_node=1 launcher.timeout_min=720``: the keys of its ``SlurmQueueConf``).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import itertools
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from dsq_cli import runs
from dsq_cli.run_result import RunResult

LAUNCHERS = ("local", "joblib", "slurm")


@dataclasses.dataclass
class Job:
    name: str
    overrides: list[str]
    run_dir: Path
    # pending | skipped | busy (trained by another process) | completed | diverged |
    # interrupted | failed | invalid
    status: str = "pending"
    detail: str = ""
    resume: bool = False  # continue the job's unfinished run from its checkpoint

    @property
    def log(self) -> Path:
        return self.run_dir.with_name(self.run_dir.name + ".log")


def _launcher_options(overrides: Sequence[str]) -> tuple[str, dict, list[str]]:
    """Split ``launcher=...`` and ``launcher.KEY=...`` off the job overrides."""
    launcher, options, rest = "local", {}, []
    for override in overrides:
        key, _, value = override.partition("=")
        if key == "launcher":
            launcher = value
        elif key.startswith("launcher."):
            options[key.split(".", 1)[1]] = value
        else:
            rest.append(override)
    if launcher not in LAUNCHERS:
        raise ValueError(f"unknown launcher {launcher!r}; choose one of {list(LAUNCHERS)}")
    allowed = {"local": set(), "joblib": {"n_jobs"}, "slurm": set(slurm_keys())}[launcher]
    unknown = set(options) - allowed
    if unknown:
        raise ValueError(
            f"launcher={launcher} has no option(s) {sorted(unknown)}"
            + (f"; its options: {sorted(allowed)}" if allowed else "")
        )
    return launcher, options, rest


def slurm_keys() -> list[str]:
    """The options of hydra-submitit-launcher's Slurm queue (its ``SlurmQueueConf``)."""
    import dataclasses

    from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf

    return [f.name for f in dataclasses.fields(SlurmQueueConf) if f.name != "_target_"]


def slurm_config(root: Path, options: dict) -> dict:
    """The launcher config: SlurmQueueConf's defaults with the sweep's ``launcher.*`` values,
    type-checked by OmegaConf (``timeout_min=abc`` is an error naming the key)."""
    from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf
    from omegaconf import OmegaConf

    config = OmegaConf.structured(SlurmQueueConf)
    config.submitit_folder = str(root / ".submitit" / "%j")
    config.name = f"dsq-sweep-{root.name}"  # its default interpolates Hydra's job name
    try:
        config = OmegaConf.merge(
            config, OmegaConf.from_dotlist([f"{k}={v}" for k, v in options.items()])
        )
    except Exception as err:
        raise ValueError(f"launcher=slurm: {str(err).splitlines()[0]}") from None
    plain = OmegaConf.to_container(config, resolve=True)
    plain.pop("_target_", None)
    if plain.get("tasks_per_node", 1) != 1 or plain.get("nodes", 1) != 1:
        # Each array task runs one `dsq train`, which spawns its own ranks; several Slurm tasks
        # per job would each start a whole run of their own.
        raise ValueError(
            "launcher=slurm: a job is one `dsq train` process; for several GPUs per run set "
            "launcher.gpus_per_node=N and train.distributed_world_size=N "
            "(tasks_per_node and nodes stay 1; see docs/scaling.md)"
        )
    return plain


def slurm_sbatch(config: dict, command: str) -> str:
    """The sbatch script submitit would write for ``config``, rendered without a cluster: the
    check that the launcher config is valid (an unknown or mistyped key fails here)."""
    from submitit.slurm import slurm

    renames = slurm.SlurmExecutor._equivalence_dict()  # name -> job_name, timeout_min -> time
    params = {
        renames.get(key, key): value
        for key, value in config.items()
        if key not in ("submitit_folder", "max_num_timeout") and value is not None
    }
    if "mem" in params:
        params["mem"] = slurm._convert_mem(params["mem"])
    try:
        return slurm._make_sbatch_string(
            command=command, folder=config["submitit_folder"], **params
        )
    except (TypeError, ValueError) as err:
        raise ValueError(f"launcher=slurm: submitit refuses the config: {err}") from None


def slurm_executor(config: dict):
    """A submitit executor set up as hydra-submitit-launcher sets up its own; building it checks
    every parameter, without a cluster."""
    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
    from omegaconf import OmegaConf

    params = dict(config)
    folder = params.pop("submitit_folder")
    max_num_timeout = params.pop("max_num_timeout")
    executor = submitit.AutoExecutor(
        cluster="slurm", folder=folder, slurm_max_num_timeout=max_num_timeout
    )
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{k if k in base else f"slurm_{k}": v for k, v in params.items()})
    return executor


def _parse(overrides: Sequence[str]):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_overrides(list(overrides))
    except Exception as err:
        raise ValueError(f"bad sweep override: {str(err).splitlines()[0]}") from None


def expand(overrides: Sequence[str]) -> list[list[str]]:
    """The grid: one override list per job, in Hydra's sweep order (last key varies fastest)."""
    axes = []
    for override in _parse(overrides):
        key = override.get_key_element()
        if override.is_sweep_override():
            axes.append([f"{key}={value}" for value in override.sweep_string_iterator()])
        else:
            axes.append([override.input_line])
    return [list(combo) for combo in itertools.product(*axes)]


def swept_keys(overrides: Sequence[str]) -> set[str]:
    """The keys written as a sweep (``quant=a,b``, ``quant=choice(a)``, ``seed=range(1,3)``),
    whatever the number of their values."""
    return {o.get_key_element() for o in _parse(overrides) if o.is_sweep_override()}


def job_name(overrides: Sequence[str], varying: set[str]) -> str:
    """A readable, filesystem-safe name from the overrides that vary across the sweep."""
    parts = [o.replace("=", "-", 1) for o in overrides if o.split("=", 1)[0] in varying]
    # Only characters that need no quoting in a Hydra override (the job runs with run.dir=...).
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", "_".join(parts or ["job"])).strip("_")[:200]


def sweep_root(overrides: Sequence[str]) -> tuple[Path, list[str]]:
    """``run.root=DIR`` is the sweep root; without it, ``runs/sweep-<digest>``, the same for the
    same overrides, so that rerunning a sweep finds its finished jobs."""
    import hashlib

    roots = [o.split("=", 1)[1] for o in overrides if o.startswith("run.root=")]
    rest = [o for o in overrides if not o.startswith("run.root=")]
    if roots:
        return Path(roots[-1]), rest
    digest = hashlib.sha256("\n".join(sorted(rest)).encode()).hexdigest()[:10]
    return Path("runs") / f"sweep-{digest}", rest


def plan(overrides: Sequence[str]) -> tuple[Path, str, dict, list[Job]]:
    root, overrides = sweep_root(overrides)
    launcher, options, job_overrides = _launcher_options(overrides)
    if any(o.split("=", 1)[0] in ("run.dir", "resume") for o in job_overrides):
        raise ValueError("a sweep places each run itself (run.dir=ROOT/JOB); set run.root=ROOT")
    grid = expand(job_overrides)
    # a key that varies names the folders; so does one written as a sweep of one value
    # (quant=choice(dsq) runs in quant-dsq), which lets a sweep of one row sit in a root beside
    # others under the name a wider sweep would have given it
    varying = swept_keys(job_overrides) | {
        o.split("=", 1)[0] for column in zip(*grid) for o in column if len({c for c in column}) > 1
    }
    jobs = [Job(job_name(o, varying), o, root / job_name(o, varying)) for o in grid]
    names = [j.name for j in jobs]
    if len(set(names)) != len(names):
        raise ValueError("two jobs of this sweep would share a name; make the grid distinct")
    return root, launcher, options, jobs


def other_settings(job: Job) -> str | None:
    """Where the run already in ``job``'s directory was made with settings other than the job's
    overrides ("quant=amp_bf16 where the job sets dsq"), else None. Two sweeps into one root
    whose jobs share a name (a sweep of one job is named ``job``) would otherwise skip or
    continue the other's run as their own. Only the overridden keys are compared, and of a group
    (``quant=dsq``) only the keys both configs hold, so a run made before a key was added
    still counts as the job's (as one whose config lacks an overridden key altogether)."""
    from omegaconf import OmegaConf

    from dsq_cli.config import ConfigError, compose, to_plain

    stored_file = job.run_dir / "config.yaml"
    if not stored_file.is_file():
        return None
    try:
        wanted, stored = compose(job.overrides), OmegaConf.load(stored_file)
    except (ConfigError, ValueError):
        return None  # an invalid override fails the job itself (_check_job); a torn file, its run
    for override in job.overrides:
        key = override.partition("=")[0].lstrip("+~")
        have = OmegaConf.select(stored, key, default=_ABSENT)
        if have is _ABSENT:  # a key this run's code did not have
            continue
        found = _difference(key, to_plain(OmegaConf.select(wanted, key)), to_plain(have))
        if found:
            where, want, have = found
            return f"{where}={have} (the job sets {want}, from {override})"
    return None


_ABSENT = object()


def _difference(key: str, want, have) -> tuple[str, object, object] | None:
    """The first key under ``key`` where two configs differ, with both values; of two groups,
    only the keys both hold."""
    if isinstance(want, dict) and isinstance(have, dict):
        for sub in sorted(want.keys() & have.keys()):
            found = _difference(f"{key}.{sub}", want[sub], have[sub])
            if found:
                return found
        return None
    return (key, want, have) if want != have else None


def _check_job(job: Job) -> bool:
    """Compose the job's config here, in this process: an invalid override fails this job only,
    before anything is launched."""
    from dsq_cli.config import ConfigError, compose

    try:
        compose(job.overrides)
    except (ConfigError, ValueError) as err:
        job.status, job.detail = "invalid", str(err)
        job.log.write_text(f"dsq: error: {err}\n")
        return False
    return True


def _run_job(job: Job, dsq: Sequence[str], threads: int | None = None) -> Job:
    """One `dsq train` process; its stdout and stderr go to the job's log. ``threads``: the
    intra-op threads it may use (OMP_NUM_THREADS), unless the environment already says.

    The job is claimed first (a lock on ``.<name>.claim`` beside its run, for as long as this
    runs), so that two sweeps over one root never start, continue or log the same job: the one
    that finds it claimed, or started or finished by another process since it was planned,
    leaves it (``busy``, or ``skipped`` when it completed meanwhile)."""
    claim = job.run_dir.with_name(f".{job.name}.claim")
    if not runs.lock_file(claim):
        job.status, job.detail = "busy", "another sweep is running it now"
        return job
    try:
        if not _taken_meanwhile(job):
            _launch(job, dsq, threads)
    finally:
        runs.unlock_file(claim)
    return job


def _taken_meanwhile(job: Job) -> bool:
    """Whether another process started, continued or finished the job since it was planned
    (its status then says so)."""
    exists = job.run_dir.exists()
    status = RunResult.status_of(job.run_dir) if exists else None
    training = exists and runs.in_use(job.run_dir)
    if job.resume:
        taken = status == "completed" or training
    else:  # planned as a new run: its directory did not exist (or was set aside)
        taken = exists
    if not taken:
        return False
    if status == "completed" and not training:
        job.status, job.detail = "skipped", "completed by another process meanwhile"
    else:
        job.status, job.detail = "busy", "another process is training it now"
    return True


def _launch(job: Job, dsq: Sequence[str], threads: int | None) -> None:
    env = os.environ.copy()
    if threads is not None:
        env.setdefault("OMP_NUM_THREADS", str(threads))
    if job.resume:  # its config is the run's own config.yaml; the log goes on
        command, mode = [*dsq, "train", f"resume={job.run_dir}"], "a"
    else:
        command, mode = [*dsq, "train", *job.overrides, f"run.dir={job.run_dir}"], "w"
    with open(job.log, mode) as log:
        proc = subprocess.run(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    status = RunResult.status_of(job.run_dir)
    job.status = status if status else "failed"
    if proc.returncode != 0:
        result = _result_of(job.run_dir)
        job.detail = (result and _first_line(result.error)) or f"exit {proc.returncode}"


def _result_of(run_dir: Path) -> RunResult | None:
    """A run's result.json (None: none, or unreadable)."""
    try:
        return RunResult.read(run_dir)
    except ValueError:
        return None


def _first_line(text: str | None) -> str | None:
    return text.strip().splitlines()[0] if text and text.strip() else None


def _set_aside(run_dir: Path) -> None:
    """A rerun never deletes a run: an unfinished or forced one is renamed out of the way."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir.rename(run_dir.with_name(f"{run_dir.name}.old-{stamp}"))


def resumable(run_dir: Path, status: str | None) -> bool:
    """A run (its result.json ``status``) that stopped before completing (interrupted, or still
    ``running`` because its process was killed) and holds a checkpoint to continue from."""
    return status in ("interrupted", "running") and runs.last_checkpoint(run_dir).is_file()


def unresumable(run_dir: Path, status: str | None) -> str | None:
    """Why a run cannot be continued as it stands: the error its resume recorded when it found
    checkpoint_last.pt unreadable (`RunResult.checkpoint_unreadable`); None for any other run.
    A sweep that continues unfinished runs reports it failed rather than trying it on every
    pass: continuing it needs a person's choice (``resume_from=best``, or ``--force`` to run it
    afresh)."""
    result = _result_of(run_dir) if status == "failed" else None
    return _first_line(result.error) if result and result.checkpoint_unreadable else None


def run(
    overrides: Sequence[str], *, force: bool = False, resume_unfinished: bool = False
) -> tuple[Path, list[Job]]:
    """Run the sweep's jobs, skipping those that completed earlier (unless ``force``). A job
    whose run stopped unfinished is set aside and run again, or, with ``resume_unfinished``,
    continued from its checkpoint (`resumable`); one whose checkpoint a resume found unreadable
    is then reported ``failed`` with that reason, left as it is (`unresumable`). A job whose run
    another live process trains (`runs.in_use`) is left to it: ``busy``."""
    root, launcher, options, jobs = plan(overrides)
    for job in jobs:
        other = other_settings(job)
        if other:
            raise ValueError(
                f"{job.run_dir} holds a run made with {other}, not this sweep's job; give the "
                "sweep its own run.root (a job is named by the overrides that vary in its sweep)"
            )
    root.mkdir(parents=True, exist_ok=True)
    todo = []
    for job in jobs:
        status = RunResult.status_of(job.run_dir) if job.run_dir.exists() else None
        if job.run_dir.exists() and runs.in_use(job.run_dir):
            # another sweep or `dsq train` is training it now: never run, resume or move it
            job.status, job.detail = "busy", "another process is training it now"
            continue
        if status == "completed" and not force:
            job.status, job.detail = "skipped", "completed earlier"
            continue
        stuck = unresumable(job.run_dir, status) if resume_unfinished and not force else None
        if stuck:
            job.status, job.detail = "failed", stuck
            continue
        if resume_unfinished and not force and resumable(job.run_dir, status):
            job.resume = True
        elif job.run_dir.exists():
            _set_aside(job.run_dir)
        if _check_job(job):
            todo.append(job)
    dsq = [sys.executable, "-m", "dsq_cli.cli"]
    if launcher == "slurm" and todo:
        executor = slurm_executor(slurm_config(root, options))
        # One array job; `dsq sweep` waits for it like Hydra's launcher does.
        submitted = executor.map_array(_run_job, todo, [dsq] * len(todo))
        for job, handle in zip(todo, submitted):
            try:
                done = handle.result()
                job.status, job.detail = done.status, done.detail
            except Exception as err:
                job.status, job.detail = "failed", f"slurm job {handle.job_id}: {err}"
    elif launcher == "joblib" and todo:
        from joblib import Parallel, delayed

        from dsq_cli.train.launch import threads_per_process

        n_jobs = int(options.get("n_jobs", 2))
        threads = threads_per_process(n_jobs)  # the cores shared out among the jobs
        # Threads are enough: each job is its own `dsq train` process.
        Parallel(n_jobs=n_jobs, prefer="threads")(
            delayed(_run_job)(job, dsq, threads) for job in todo
        )
    else:
        for job in todo:
            _run_job(job, dsq)
    return root, jobs


# the statuses of jobs that did not fail: the sweep exits 0 when every job has one of them
NOT_FAILED = ("completed", "skipped", "busy")


def summary(jobs: Sequence[Job]) -> str:
    width = max(len(j.name) for j in jobs)
    lines = [f"{'job'.ljust(width)}  status      log / note"]
    for job in jobs:
        note = job.detail
        if job.status not in NOT_FAILED:  # the log, and what went wrong where it is known
            note = f"{job.log}: {job.detail}" if job.detail else str(job.log)
        lines.append(f"{job.name.ljust(width)}  {job.status:<10}  {note}")
    failed = [j for j in jobs if j.status not in NOT_FAILED]
    ran = sum(j.status == "completed" for j in jobs)
    busy = sum(j.status == "busy" for j in jobs)
    lines.append(
        f"{len(jobs)} job{'s' * (len(jobs) != 1)}: {ran} ran and completed, "
        f"{sum(j.status == 'skipped' for j in jobs)} skipped (completed earlier), "
        + (f"{busy} left to another process training it now (run the sweep again after), "
           if busy else "")
        + f"{len(failed)} failed"
    )  # fmt: skip
    return "\n".join(lines)
