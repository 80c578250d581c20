"""One process trains a run at a time: the lock a training process holds on its run directory
(`runs.hold`), what another process sees of it (`runs.in_use`), a sweep that leaves a run in
training elsewhere alone, and a resume of such a run refused (docs/scaling.md, "Two sweeps over
one root")."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dsq_cli import runs, sweep
from dsq_cli.config import ConfigError
from dsq_cli.train.entry import load_resume

HOLDER = (
    "import sys\n"
    "from dsq_cli import runs\n"
    "runs.hold(sys.argv[1])\n"
    "print('held', flush=True)\n"
    "sys.stdin.read()\n"  # holds until its stdin closes, then exits (dropping the lock)
)


@pytest.fixture
def held_elsewhere():
    """Starts a process that holds a run directory's lock; closing its stdin ends it."""
    holders = []

    def hold(run_dir):
        run_dir.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(run_dir)],
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
        [sys.executable, "-c", HOLDER, str(run_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
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
