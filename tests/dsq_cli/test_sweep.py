"""`dsq sweep`: the grid, dry runs, failed jobs that do not stop the others, skipping finished
jobs on a rerun, and the joblib launcher giving the same results as the local one."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dsq_cli import sweep
from dsq_cli.cli import app

RUNNER = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cache = tmp_path_factory.mktemp("sweep-cache")
    return [
        "task=demo",
        "task.sizes.train=400",
        "task.sizes.valid=20",
        "task.sizes.test=20",
        "data.vocab_size=150",
        f"data.cache_dir={cache}",
        "model=transformer_small",
        "train.max_tokens=512",
        "train.max_updates=2",
        "train.validate_every=2",
        "eval.beam=1",
        "logger=none",
    ]


def results(root):
    return {
        p.parent.name: json.loads(p.read_text())
        for p in root.glob("*/result.json")
        if ".old-" not in p.parent.name
    }


def test_the_grid_is_the_product_of_the_sweep_overrides():
    grid = sweep.expand(["task=demo", "quant=fp32,dsq", "seed=range(1,3)"])
    assert grid == [
        ["task=demo", "quant=fp32", "seed=1"],
        ["task=demo", "quant=fp32", "seed=2"],
        ["task=demo", "quant=dsq", "seed=1"],
        ["task=demo", "quant=dsq", "seed=2"],
    ]


def test_dry_run_lists_the_jobs_without_running(tmp_path):
    args = ["sweep", "task=demo", "quant=fp32,dsq", "seed=1,2", f"run.root={tmp_path}"]
    result = RUNNER.invoke(app, [*args, "--dry-run"])
    assert result.exit_code == 0, result.output
    assert f"4 jobs under {tmp_path}" in result.output
    assert f"run.dir={tmp_path}/quant-dsq_seed-2" in result.output
    assert list(tmp_path.iterdir()) == []
    one = RUNNER.invoke(
        app, ["sweep", "task=demo", "quant=dsq", f"run.root={tmp_path}", "--dry-run"]
    )
    assert f"1 job under {tmp_path}" in one.output and f"run.dir={tmp_path}/job" in one.output
    # a key written as a sweep of one value names the folder as a wider sweep would
    chosen = RUNNER.invoke(
        app, ["sweep", "task=demo", "quant=choice(dsq)", f"run.root={tmp_path}", "--dry-run"]
    )
    assert f"run.dir={tmp_path}/quant-dsq" in chosen.output, chosen.output


def test_a_sweep_never_takes_another_sweeps_run_for_its_job(tmp_path):
    """Two one-job sweeps into one root both name their job ``job``: the second finds the first's
    run there and refuses (exit 2, one line naming the key that differs, nothing written) instead
    of skipping or continuing it as its own. The same sweep finds its run its own, also one made
    before a key was added to the config."""
    from omegaconf import OmegaConf

    from dsq_cli.config import compose

    run_dir = tmp_path / "job"
    run_dir.mkdir()
    stored = OmegaConf.create(OmegaConf.to_container(compose(["task=demo", "quant=amp_bf16"])))
    OmegaConf.save(stored, run_dir / "config.yaml")
    (run_dir / "result.json").write_text(json.dumps({"status": "completed"}))
    before = sorted(p.name for p in tmp_path.rglob("*"))

    refused = RUNNER.invoke(app, ["sweep", "task=demo", "quant=dsq", f"run.root={tmp_path}"])
    assert refused.exit_code == 2, refused.output
    assert refused.output.startswith(f"dsq: error: {run_dir} holds a run made with quant.q0=bf16")
    assert "(the job sets bfp8, from quant=dsq)" in refused.output
    assert refused.output.count("\n") == 1
    assert sorted(p.name for p in tmp_path.rglob("*")) == before

    (job,) = sweep.plan(["task=demo", "quant=amp_bf16", f"run.root={tmp_path}"])[3]
    assert sweep.other_settings(job) is None
    del stored.quant["engine"]  # a key this run's code did not have yet
    OmegaConf.save(stored, run_dir / "config.yaml")
    assert sweep.other_settings(job) is None
    stored.quant["q0"] = "bfp8"
    OmegaConf.save(stored, run_dir / "config.yaml")
    assert sweep.other_settings(job) == "quant.q0=bfp8 (the job sets bf16, from quant=amp_bf16)"
    (run_dir / "config.yaml").write_text("seed: 1\n")  # no quant key at all
    assert sweep.other_settings(job) is None


@pytest.mark.parametrize(
    "bad, message",
    [
        (["launcher=ray"], "unknown launcher 'ray'"),
        (["launcher=local", "launcher.n_jobs=2"], "launcher=local has no option(s) ['n_jobs']"),
        (["run.dir=/x"], "a sweep places each run itself"),
    ],
)
def test_bad_sweep_options_are_usage_errors(bad, message):
    result = RUNNER.invoke(app, ["sweep", "task=demo", *bad, "--dry-run"])
    assert result.exit_code == 2
    assert message in result.output


@pytest.mark.slow
def test_a_bad_job_fails_alone_and_a_rerun_skips_finished_jobs(tmp_path, tiny):
    # q1 of the fp32 preset is a single format, so the schedule override is invalid for that
    # job only; the dsq job runs.
    args = ["sweep", *tiny, "quant=fp32,dsq", "quant.q1.levels=[bfp2,bfp4]", f"run.root={tmp_path}"]
    first = RUNNER.invoke(app, args)
    assert first.exit_code == 1, first.output
    assert "quant-fp32  invalid" in first.output
    assert str(tmp_path / "quant-fp32.log") in first.output
    assert "1 ran and completed, 0 skipped (completed earlier), 1 failed" in first.output
    assert "| dsq* (q1.levels=" in first.output  # the table of the root follows
    assert results(tmp_path)["quant-dsq"]["status"] == "completed"

    again = RUNNER.invoke(app, args)
    assert "quant-dsq   skipped" in again.output
    assert "0 ran and completed, 1 skipped (completed earlier), 1 failed" in again.output


@pytest.mark.slow
def test_joblib_launcher_gives_the_same_results_as_local(tmp_path, tiny):
    local, parallel = tmp_path / "local", tmp_path / "joblib"
    grid = ["quant=dsq", "seed=1,2"]
    assert RUNNER.invoke(app, ["sweep", *tiny, *grid, f"run.root={local}"]).exit_code == 0
    result = RUNNER.invoke(
        app, ["sweep", *tiny, *grid, f"run.root={parallel}", "launcher=joblib", "launcher.n_jobs=2"]
    )
    assert result.exit_code == 0, result.output
    a, b = results(local), results(parallel)
    assert sorted(a) == sorted(b) == ["seed-1", "seed-2"]
    for name in a:
        for key in ("status", "bleu", "valid_loss", "updates", "cost"):
            assert a[name][key] == b[name][key], (name, key)


def test_slurm_launcher_composes_a_valid_submitit_config_without_a_cluster(tmp_path):
    options = {"partition": "gpu", "gpus_per_node": "2", "timeout_min": "720", "mem_gb": "32"}
    config = sweep.slurm_config(tmp_path, options)
    assert config["partition"] == "gpu" and config["gpus_per_node"] == 2
    assert config["timeout_min"] == 720 and config["submitit_folder"].startswith(str(tmp_path))
    script = sweep.slurm_sbatch(config, "dsq train task=demo")
    for line in ("#SBATCH --partition=gpu", "#SBATCH --gpus-per-node=2", "#SBATCH --time=720",
                 "#SBATCH --mem=32GB"):  # fmt: skip
        assert line in script
    args = ["sweep", "task=demo", "quant=fp32,dsq", "launcher=slurm", "launcher.partition=gpu"]
    result = RUNNER.invoke(app, [*args, f"run.root={tmp_path}", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "#SBATCH --partition=gpu" in result.output and "2 jobs under" in result.output


@pytest.mark.parametrize(
    "option, message",
    [
        ("launcher.timeout_min=abc", "could not be converted to Integer"),
        ("launcher.gpus=1", "launcher=slurm has no option(s) ['gpus']; its options:"),
        ("launcher.tasks_per_node=2", "set launcher.gpus_per_node=N and train.distributed_"),
    ],
)
def test_slurm_config_errors_name_the_key(option, message):
    result = RUNNER.invoke(app, ["sweep", "task=demo", "launcher=slurm", option, "--dry-run"])
    assert result.exit_code == 2
    assert message in result.output


def test_parallel_jobs_share_out_the_cores(tmp_path, monkeypatch):
    """Each joblib job gets OMP_NUM_THREADS = cores / n_jobs, unless the user set it."""
    import sys

    # stands in for `python -m dsq_cli.cli`: prints the thread setting it was started with
    probe = [sys.executable, "-c", "import os; print('threads', os.environ['OMP_NUM_THREADS'])"]
    job = sweep.Job("probe", [], tmp_path / "probe")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    sweep._run_job(job, probe, threads=3)
    assert job.log.read_text().strip() == "threads 3"
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # the user's own setting wins
    sweep._run_job(job, probe, threads=3)
    assert job.log.read_text().strip() == "threads 7"


@pytest.mark.slow  # trains four runs through the CLI
def test_an_unfinished_run_is_continued_from_its_checkpoint_or_set_aside(tmp_path, tiny):
    """A session that ends mid-study leaves a run 'running' (its process killed) with a
    checkpoint: --resume-unfinished continues it in place; without it, it is set aside and run
    again. One job (named `job`: nothing varies) is killed twice."""
    args = ["sweep", *tiny, "quant=dsq", "seed=1", f"run.root={tmp_path}"]
    assert RUNNER.invoke(app, args).exit_code == 0

    def killed():  # as if its process had been killed after its last checkpoint
        result = tmp_path / "job" / "result.json"
        result.write_text(json.dumps({**json.loads(result.read_text()), "status": "running"}))

    killed()
    resumed = RUNNER.invoke(app, [*args, "--resume-unfinished"])
    assert resumed.exit_code == 0, resumed.output
    assert "1 job: 1 ran and completed, 0 skipped (completed earlier), 0 failed" in resumed.output
    assert results(tmp_path)["job"]["status"] == "completed"
    assert results(tmp_path)["job"]["resumed"] is True
    assert not list(tmp_path.glob("job.old-*"))  # continued in place
    again = RUNNER.invoke(app, [*args, "--resume-unfinished"])
    assert again.exit_code == 0, again.output
    assert "1 job: 0 ran and completed, 1 skipped (completed earlier)" in again.output

    killed()
    rerun = RUNNER.invoke(app, args)
    assert rerun.exit_code == 0, rerun.output
    assert results(tmp_path)["job"]["resumed"] is False  # a new run from scratch
    assert len(list(tmp_path.glob("job.old-*"))) == 1  # the unfinished one kept aside
