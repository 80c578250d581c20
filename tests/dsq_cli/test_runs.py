"""The run directory contract (docs/spec.md §5) and the no-secrets rule (docs/spec.md §7)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from dsq_cli import runs
from dsq_cli.run_result import RunResult, memory_record


def test_new_run_dirs_are_unique_and_never_reused(tmp_path):
    made = {runs.new_run_dir(tmp_path, "iwslt17 dsq") for _ in range(5)}
    assert len(made) == 5 and all(p.is_dir() and p.parent == tmp_path for p in made)
    assert all(p.name.startswith("iwslt17_dsq-") for p in made)


def test_exact_run_dir_refuses_an_existing_directory(tmp_path):
    path = runs.exact_run_dir(tmp_path / "a" / "run1")
    assert path.is_dir()
    with pytest.raises(ValueError, match="already exists"):
        runs.exact_run_dir(path)


def test_atomic_write_leaves_the_old_file_or_the_new_one(tmp_path, monkeypatch):
    target = tmp_path / "result.json"
    runs.write_json(target, {"status": "running"})

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError):
        runs.write_json(target, {"status": "completed"})
    assert json.loads(target.read_text()) == {"status": "running"}
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]  # no temporary left


def test_secrets_never_reach_run_files(tmp_path):
    env = {"WANDB_API_KEY": "abcdef123456", "HOME": "/root", "MY_TOKEN": "tok-999999"}
    config = {
        "logger": {"api_key": "abcdef123456", "project": "dsq"},
        "command": "WANDB_API_KEY=abcdef123456 dsq train",
        "env": {"WANDB_API_KEY": "abcdef123456", "HOME": "/root"},
        "notes": ["uses tok-999999"],
    }
    clean = runs.scrub_secrets(config, env)
    text = json.dumps(clean)
    assert "abcdef123456" not in text and "tok-999999" not in text
    assert clean["logger"] == {"project": "dsq"}
    assert clean["env"] == {"HOME": "/root"}
    os.environ["DSQ_TEST_SECRET_TOKEN"] = "s3cr3t-value"
    try:
        runs.append_jsonl(tmp_path / "metrics.jsonl", {"update": 1, "note": "s3cr3t-value"})
        runs.write_json(tmp_path / "result.json", {"DSQ_TEST_SECRET_TOKEN": "s3cr3t-value"})
    finally:
        del os.environ["DSQ_TEST_SECRET_TOKEN"]
    for name in ("metrics.jsonl", "result.json"):
        assert "s3cr3t-value" not in (tmp_path / name).read_text()


def test_versions_and_result_validation():
    v = runs.versions()
    assert v["python"] and v["torch"]
    result = {
        "status": "completed",
        "task": "demo",
        "metric": "bleu",
        "value": 12.3,
        "valid_loss": 3.2,
        "updates": 100,
        "wall_seconds": 60.0,
        "stash_bits_mean": 2.5,
        "quant": {"preset": "dsq", "q0": "bfp8", "q1": "bfp2", "q2": "bfp8", "q3": "fixed16"},
        "cost": {"arith_ratio": 0.05, "dram_ratio": 0.3, "baseline": "fixed32"},
        "versions": v,
    }
    assert RunResult.problems(result) == []
    bad = dict(result, status="done", metric="ppl")
    del bad["cost"]
    problems = RunResult.problems(bad)
    assert any("status" in p for p in problems) and any("metric" in p for p in problems)
    assert "missing key 'cost'" in problems


def test_memory_is_written_with_the_trained_fields_and_read_back(tmp_path):
    gemm = {"kind": "linear", "batch": 1, "n": 8, "k": 4, "m": 4, "formats": {}}
    gemms = [gemm | {"stash_bytes": 1000}, gemm | {"stash_bytes": 24}]
    memory = memory_record(gemms, cuda_peak_allocated=3 * 2**20)
    assert memory["stash_bytes_per_step"] == 1024
    assert memory["cuda_peak_allocated_mib"] == 3.0
    assert memory["peak_rss_mib"] > 10  # this process holds an interpreter and torch at least
    assert memory_record(None, None) | {"peak_rss_mib": 0} == {
        "peak_rss_mib": 0,
        "cuda_peak_allocated_mib": None,
        "stash_bytes_per_step": None,
    }
    quant = {"preset": "fp32", "version": 2, "q0": "fp32", "q1": "fp32", "q2": "fp32",
             "q3": "fp32", "modified": False}  # fmt: skip
    running = RunResult(status="running", task="demo", quant=quant, metric="bleu")
    assert "memory" not in running.to_dict()  # nothing summarised yet
    summarised = dataclasses.replace(running, status="interrupted", epochs=1)
    assert summarised.to_dict()["memory"] is None  # written with the trained fields
    result = dataclasses.replace(summarised, memory=memory)
    result.write(tmp_path)
    assert json.loads((tmp_path / "result.json").read_text())["memory"] == memory
    assert RunResult.read(tmp_path) == result
    assert result.summary()["memory"] == memory


def test_secret_names_are_whole_words_so_config_keys_survive():
    config = {"train": {"max_tokens": 4096, "sort_keys": True}, "api_key": "x", "hf_token": "y"}
    assert runs.scrub_secrets(config, environ={}) == {
        "train": {"max_tokens": 4096, "sort_keys": True}
    }
