"""The training tests' tiny demo run (its overrides), the `dsq` executable, run readers."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

DSQ = str(Path(sys.executable).with_name("dsq"))


def one_thread() -> dict[str, str]:
    """The environment for `dsq train` processes that a test runs side by side: one intra-op
    thread each, so that two of them share a 2-core machine instead of spinning against each
    other's threads (GNU OpenMP waits busily). Every process a comparison reads runs with it,
    so that they all sum in the same order."""
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def small(cache_dir, root, *extra):
    """A demo run of a few updates on 600 sentence pairs."""
    return [
        "task=demo",
        "task.sizes.train=600",
        "task.sizes.valid=40",
        "task.sizes.test=40",
        "data.vocab_size=200",
        f"data.cache_dir={cache_dir}",
        "model=transformer_small",
        "train.max_tokens=1024",
        "train.max_updates=8",
        "train.validate_every=4",
        "train.log_every=1",
        "eval.beam=1",
        "logger=none",
        f"run.root={root}",
        *extra,
    ]


def only_run(root: Path) -> Path:
    (run_dir,) = [p for p in root.iterdir() if p.is_dir()]
    return run_dir


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for_update(metrics: Path, update: int, proc, timeout: float = 240) -> None:
    """Wait until ``proc`` has logged training update ``update`` (it must stay alive)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        if metrics.is_file():
            updates = [m["update"] for m in read_jsonl(metrics) if m["kind"] == "train"]
            if updates and max(updates) >= update:
                return
        time.sleep(0.2)
    raise AssertionError(f"no update {update} within {timeout} s")
