"""Data-parallel training on CPU (gloo): two ranks train the demo in step, stop together, resume,
and write one run directory; torchrun's processes do the same. Plus the launcher's guards."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.runs import DSQ, only_run, read_jsonl, small, wait_for_update

from dsq_cli.config import ConfigError, compose
from dsq_cli.run_result import RunResult
from dsq_cli.train import launch, ranks
from dsq_cli.train.entry import check_devices, spawned_outcome, train

pytestmark = pytest.mark.slow  # trains, compiles or spawns processes (not in make test-fast)

# quant.q1.min_delta=100: no validation counts as an improvement, so the stash rises one level
# at every validation (patience 1) and the ranks have schedule changes to agree on.
TWO_RANKS = ["train.distributed_world_size=2", "train.validate_every=2", "quant.q1.min_delta=100"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("dsq-cache")


def rank_lines(run_dir: Path, pattern: str) -> dict[str, list[str]]:
    """The log lines of every rank that match ``pattern``, timestamps cut off."""
    lines = {}
    for log in sorted(run_dir.glob("train*.log")):
        matches = [line.split(" | ", 1)[1] for line in log.read_text().splitlines()
                   if re.search(pattern, line)]  # fmt: skip
        lines[log.name] = matches
    return lines


def test_two_gloo_ranks_train_in_step_and_write_one_run_directory(tmp_path, cache_dir):
    root = tmp_path / "runs"
    args = small(cache_dir, root, "train.max_updates=4", *TWO_RANKS)
    done = subprocess.run([DSQ, "train", *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("run: ") == 1 and "completed: 4 updates" in done.stdout

    run_dir = only_run(root)  # one run directory for the two ranks
    assert sorted(p.name for p in run_dir.iterdir()) == [
        ".run.lock", "checkpoints", "config.yaml", "metrics.jsonl", "result.json",
        "schedule.jsonl", "test.hyp", "train.log", "train.rank1.log",
    ]  # fmt: skip
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "completed" and result["updates"] == 4
    # the first validation (update 2) sets the best loss; the second cannot beat it by 100
    assert result["bits_final"]["q1"] == "bfp3e8b16"
    changes = read_jsonl(run_dir / "schedule.jsonl")
    assert [(c["update"], c["to"]) for c in changes] == [(4, "bfp3e8b16")]
    # rank 0 alone logs metrics: each update and validation once
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["update"] for m in metrics if m["kind"] == "train"] == [1, 2, 3, 4]
    assert "distributed_world_size: 2" in (run_dir / "config.yaml").read_text()

    # Both ranks saw the same validation losses and took the same schedule steps...
    validations = rank_lines(run_dir, "validation at update")
    assert len(validations["train.log"]) == 2
    assert validations["train.log"] == validations["train.rank1.log"]
    assert validations["train.log"][-1].endswith("stash q1 now bfp3e8b16")
    # ...and their replicas ended bit for bit identical (gradients really were all-reduced).
    checksums = rank_lines(run_dir, "parameter checksum")
    assert len(checksums["train.log"]) == 1
    assert checksums["train.log"] == checksums["train.rank1.log"]


def test_sigterm_stops_both_ranks_after_one_update_and_resume_finishes(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    args = [a for a in small(cache_dir, tmp_path) if not a.startswith("run.root")]
    args += ["train.max_updates=8", *TWO_RANKS, f"run.dir={run_dir}"]
    proc = subprocess.Popen([DSQ, "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    wait_for_update(run_dir / "metrics.jsonl", 3, proc)
    proc.send_signal(signal.SIGTERM)  # to the launching process only: it passes it on
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err
    stopped = json.loads((run_dir / "result.json").read_text())
    assert stopped["status"] == "interrupted" and 3 <= stopped["updates"] < 8

    resumed = subprocess.run([DSQ, "train", f"resume={run_dir}"], capture_output=True,
                             text=True, timeout=600)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "completed" and result["updates"] == 8 and result["resumed"]
    assert result["bits_final"]["q1"] == "bfp6e8b16"  # validations at 2, 4, 6, 8: 3 levels up
    validations = rank_lines(run_dir, "validation at update")
    assert validations["train.log"] == validations["train.rank1.log"]
    # both runs append to the logs: each validation of the budget once (the resumed run starts
    # from the stop's checkpoint), in order, the last one the resumed run's
    log = validations["train.log"]
    assert [int(re.search(r"validation at update (\d+):", v)[1]) for v in log] == [2, 4, 6, 8]
    assert validations["train.log"][-1].endswith("stash q1 now bfp6e8b16")
    checksums = rank_lines(run_dir, "parameter checksum")
    assert "parameter checksum at update 8: " in checksums["train.log"][-1]
    assert checksums["train.log"][-1] == checksums["train.rank1.log"][-1]


def test_torchrun_processes_share_one_run_directory(tmp_path, cache_dir):
    root = tmp_path / "runs"
    args = [a for a in small(cache_dir, root, "train.max_updates=2", *TWO_RANKS)
            if not a.startswith("train.distributed_world_size")]  # fmt: skip
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-port", str(launch._free_port())]  # fmt: skip
    done = subprocess.run([*torchrun, "-m", "dsq_cli.cli", "train", *args],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("run: ") == 1  # rank 1 reports nothing
    run_dir = only_run(root)
    assert (run_dir / "train.rank1.log").is_file()
    assert "distributed_world_size: 2" in (run_dir / "config.yaml").read_text()
    assert json.loads((run_dir / "result.json").read_text())["status"] == "completed"
    validations = rank_lines(run_dir, "validation at update")
    assert len(validations["train.log"]) == 1  # at update 2, the last
    assert "validation at update 2: " in validations["train.log"][0]
    assert validations["train.log"] == validations["train.rank1.log"]
    checksums = rank_lines(run_dir, "parameter checksum")
    assert len(checksums["train.log"]) == 1
    assert "parameter checksum at update 2: " in checksums["train.log"][0]
    assert checksums["train.log"] == checksums["train.rank1.log"]


# -- guards --------------------------------------------------------------------------------------


def test_rank_from_torchrun_environment(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    assert ranks.from_environment() is None
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert ranks.from_environment() is None  # a one-process torchrun is a plain run
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert ranks.from_environment() == ranks.Rank(3, 4, 1)


def test_launcher_and_config_must_agree_on_the_world_size(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    cfg = compose(["task=demo", "train.distributed_world_size=3", f"run.root={tmp_path}"])
    with pytest.raises(ConfigError, match="launcher started 2 processes"):
        train(cfg)
    assert not any(tmp_path.iterdir())


def test_more_ranks_than_gpus_is_a_usage_error():
    check_devices(8, "cpu")  # CPU ranks share the cores
    with pytest.raises(ConfigError, match="CUDA devices; lower it"):
        check_devices(10**6, "cuda")


def test_a_failed_rank_does_not_leave_the_others_hanging(monkeypatch):
    """A rank that fails while another waits in a collective: the waiting one is stopped after
    the grace period instead of blocking for gloo's 30-minute timeout."""
    monkeypatch.setattr(launch, "GRACE_SECONDS", 0.5)
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=time.sleep, args=(60,)),
               context.Process(target=sys.exit, args=(1,))]  # fmt: skip
    for worker in workers:
        worker.start()
    started = time.monotonic()
    codes = launch._wait(workers)
    assert time.monotonic() - started < 30
    assert codes == {0: None, 1: 1}


def test_a_run_whose_rank_0_was_killed_is_recorded_as_failed(tmp_path):
    started = RunResult(status="running", task="demo", quant={"preset": "fp32"}, metric="bleu")
    started.write(tmp_path)
    outcome = spawned_outcome(tmp_path, {0: None, 1: 1}, started)
    assert outcome.status == "failed" and outcome.exit_code == 1
    stored = json.loads((tmp_path / "result.json").read_text())
    assert stored["status"] == "failed"
    assert "rank 0 exited with a signal, rank 1 exited with 1" in stored["error"]


def test_cpu_ranks_share_the_cores():
    """Each of N spawned CPU ranks takes cores // N intra-op threads, at least one (a thread per
    core in every rank spins them against each other)."""
    assert [launch.threads_per_process(n, cores=2) for n in (1, 2, 3)] == [2, 1, 1]
    assert launch.threads_per_process(4, cores=16) == 4
    assert launch.threads_per_process(1) >= 1


LAUNCHER = """
import os, sys, time
from dsq_cli.train import launch


def rank(rank, pid_file):
    with open(pid_file + ".part", "w") as f:
        f.write(str(os.getpid()))
    os.replace(pid_file + ".part", pid_file)
    time.sleep(120)
    return 0


if __name__ == "__main__":
    launch.spawn(1, "cpu", rank, (sys.argv[1],))
"""


def _process_state(pid: int) -> tuple[str, str] | None:
    """(state, start time) of process ``pid`` (/proc/PID/stat), or None when there is none."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return fields[0], fields[19]


def _gone(pid: int, started: str) -> bool:
    """Whether the process ``pid`` that started at ``started`` has ended (a zombie that no one
    has reaped yet counts as ended; so does another process that reuses the pid)."""
    state = _process_state(pid)
    return state is None or state[1] != started or state[0] in ("Z", "X")


LINUX_ONLY = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's"
)


@LINUX_ONLY
def test_workers_die_with_a_launcher_killed_by_sigkill(tmp_path):
    """The launcher holds the run's lock; SIGKILLed, it cannot pass a signal on, so the kernel
    kills its workers (PR_SET_PDEATHSIG) instead of leaving them training in an unguarded run."""
    script, pid_file = tmp_path / "launcher.py", tmp_path / "worker.pid"
    script.write_text(LAUNCHER)
    parent = subprocess.Popen([sys.executable, str(script), str(pid_file)])
    worker = started = None
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists():
            assert parent.poll() is None and time.monotonic() < deadline, "no worker started"
            time.sleep(0.1)
        worker = int(pid_file.read_text())
        state = _process_state(worker)
        assert state is not None and state[0] not in ("Z", "X")
        started = state[1]
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while not _gone(worker, started) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(worker, started), "the worker outlived its SIGKILLed launcher"
    finally:
        parent.kill()
        parent.wait()
        if worker is not None and started is not None and not _gone(worker, started):
            os.kill(worker, signal.SIGKILL)


@LINUX_ONLY
def test_a_worker_whose_launcher_is_already_gone_exits_at_once():
    code = "from dsq_cli.train.launch import die_with_parent; die_with_parent(-1); print('alive')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 1 and "alive" not in done.stdout
