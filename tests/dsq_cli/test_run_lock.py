"""One process trains a run at a time: the lock a training process holds on its run directory
(`runs.hold`), what another process sees of it (`runs.in_use`), a sweep that leaves a run in
training elsewhere alone, and a resume of such a run refused (docs/scaling.md, "Two sweeps over
one root")."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dsq.warn_once import warn_once
from dsq_cli import runs, sweep
from dsq_cli.config import ConfigError
from dsq_cli.train.entry import load_resume

HOLDER = (
    "import sys\n"
    "from dsq_cli import runs\n"
    "runs.hold(sys.argv[1]) if sys.argv[2] == 'run' else runs.lock_file(sys.argv[1])\n"
    "print('held', flush=True)\n"
    "sys.stdin.read()\n"  # holds until its stdin closes, then exits (dropping the lock)
)


@pytest.fixture
def held_elsewhere():
    """Starts a process that holds a run directory's lock; closing its stdin ends it."""
    holders = []

    def hold(path, what="run"):
        (path if what == "run" else path.parent).mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(path), what],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        holders.append(proc)
        assert proc.stdout.readline().strip() == "held"
        return proc

    yield hold
    for proc in holders:
        proc.stdin.close()
        proc.wait(timeout=30)


def end(proc):
    proc.stdin.close()
    proc.wait(timeout=30)


def unfinished_run(run_dir, status="running"):
    """A run directory as a killed or live training process leaves it: config, checkpoint,
    result.json saying ``status``."""
    (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    (run_dir / "checkpoints" / "checkpoint_last.pt").write_bytes(b"")
    (run_dir / "config.yaml").write_text("seed: 1\n")
    (run_dir / "result.json").write_text(json.dumps({"status": status}))


@pytest.mark.slow
def test_a_held_run_is_in_use_for_other_processes_until_its_holder_ends(tmp_path, held_elsewhere):
    run_dir = tmp_path / "run"
    assert not runs.in_use(tmp_path)  # no lock file: never trained
    holder = held_elsewhere(run_dir)
    assert runs.in_use(run_dir)
    with pytest.raises(runs.RunInUse, match="another process is training this run"):
        runs.hold(run_dir)
    end(holder)
    assert not runs.in_use(run_dir)  # the lock went with its process; the file stays, empty
    runs.hold(run_dir)  # now this process may train it
    try:
        assert not runs.in_use(run_dir)  # its own run is not "in use" to itself
        runs.hold(run_dir)  # holding again is a no-op
    finally:
        runs.release(run_dir)


def test_a_run_killed_without_releasing_is_free(tmp_path):
    """A SIGKILL leaves no lock behind: a killed run is continued, not mistaken for a live one."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir), "run"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert proc.stdout.readline().strip() == b"held"
    proc.kill()
    proc.wait(timeout=30)
    assert not runs.in_use(run_dir)


def test_a_sweep_leaves_a_run_trained_elsewhere_alone(tmp_path, held_elsewhere):
    root = tmp_path / "sweep"
    overrides = ["quant=fp32,dsq", f"run.root={root}"]
    live, done = root / "quant-fp32", root / "quant-dsq"
    unfinished_run(live)
    holder = held_elsewhere(live)
    unfinished_run(done, status="completed")
    for resume_unfinished in (True, False):  # neither continued, nor set aside and run again
        _, jobs = sweep.run(overrides, resume_unfinished=resume_unfinished)
        by_name = {job.name: job for job in jobs}
        assert by_name["quant-fp32"].status == "busy"
        assert by_name["quant-dsq"].status == "skipped"
        assert sorted(p.name for p in root.iterdir()) == ["quant-dsq", "quant-fp32"]
        assert json.loads((live / "result.json").read_text()) == {"status": "running"}
    report = sweep.summary(jobs)
    assert "quant-fp32  busy        another process is training it now" in report
    assert report.endswith(
        "2 jobs: 0 ran and completed, 1 skipped (completed earlier), 1 left to another process "
        "training it now (run the sweep again after), 0 failed"
    )
    assert all(job.status in sweep.NOT_FAILED for job in jobs)  # the sweep exits 0
    end(holder)
    # its holder gone, the same run is unfinished like any other: planned to be continued
    assert runs.in_use(live) is False and sweep.resumable(live, "running")


def test_resuming_a_run_trained_elsewhere_is_refused(tmp_path, held_elsewhere):
    run_dir = tmp_path / "run"
    unfinished_run(run_dir)
    holder = held_elsewhere(run_dir)
    with pytest.raises(ConfigError, match=r"another process is training that run now") as err:
        load_resume(str(run_dir), [f"resume={run_dir}"])
    assert "\n" not in str(err.value) and ".run.lock" in str(err.value)
    end(holder)


@pytest.mark.slow
def test_a_job_claimed_or_started_elsewhere_since_it_was_planned_is_left_alone(
    tmp_path, held_elsewhere
):
    """Two sweeps over one root both plan a job that does not exist yet: the second to reach it
    finds it claimed (or its run started, or finished) and leaves it, its log untouched."""
    never = ["/bin/false"]  # a launch would fail the job: none may happen
    job = sweep.Job("quant-fp32", [], tmp_path / "quant-fp32")
    holder = held_elsewhere(tmp_path / ".quant-fp32.claim", what="file")
    sweep._run_job(job, never)
    assert (job.status, job.detail) == ("busy", "another sweep is running it now")
    end(holder)

    unfinished_run(job.run_dir)  # started by another process since the plan, and live
    holder = held_elsewhere(job.run_dir)
    sweep._run_job(job, never)
    assert (job.status, job.detail) == ("busy", "another process is training it now")
    end(holder)
    unfinished_run(job.run_dir, status="completed")  # ... and finished since
    job.status = "pending"
    sweep._run_job(job, never)
    assert (job.status, job.detail) == ("skipped", "completed by another process meanwhile")
    resumed = sweep.Job("quant-fp32", [], job.run_dir, resume=True)  # planned to be continued
    sweep._run_job(resumed, never)
    assert resumed.status == "skipped"
    assert not job.log.exists()  # no launch, no log


def test_a_lock_asked_about_for_an_instant_does_not_refuse_the_trainer(tmp_path):
    """`in_use` takes a shared lock for an instant; a trainer taking the lock meanwhile waits
    for it rather than believing the run taken."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    asker = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time\n"
            "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
            "fcntl.flock(fd, fcntl.LOCK_SH)\n"
            "print('asking', flush=True)\n"
            "time.sleep(0.3)\n",
            str(run_dir / runs.LOCK_NAME),
        ],
        stdout=subprocess.PIPE,
    )
    assert asker.stdout.readline().strip() == b"asking"
    runs.hold(run_dir)  # within the retries' second
    runs.release(run_dir)
    asker.wait(timeout=30)


def test_a_file_system_without_locks_is_said_once_and_locks_nothing(tmp_path, monkeypatch, caplog):
    import errno
    import fcntl
    import logging

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    warn_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="dsq_cli.runs"):
        runs.hold(tmp_path)  # not refused: nothing can be locked here
        assert not runs.in_use(tmp_path / "other")
        runs.hold(tmp_path / ".")  # said once, however often
    runs.release(tmp_path)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "takes no locks (No locks available)" in said[0], said


def test_another_rank_of_a_torchrun_resume_does_not_ask_for_the_lock(
    tmp_path, held_elsewhere, monkeypatch
):
    """Under torchrun rank 0 holds the run (its own refusal reaches every rank); a rank that
    loads the stored config after rank 0 took the lock must not mistake it for another run's."""
    run_dir = tmp_path / "run"
    unfinished_run(run_dir)
    holder = held_elsewhere(run_dir)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    try:
        load_resume(str(run_dir), [f"resume={run_dir}"])
    except ConfigError as err:  # the toy config.yaml may be refused, but not for the lock
        assert "another process" not in str(err)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match="another process is training that run now"):
        load_resume(str(run_dir), [f"resume={run_dir}"])
    end(holder)
