"""Fixtures and hooks shared by the tests (plain helper functions live in tests/helpers/).

Triton kernels run on CPU tensors under TRITON_INTERPRET=1; set it before anything imports
triton, unless a GPU is present (then the kernels run for real on CUDA tensors).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# Oracles the tests compare with (torchao's MX quantizers), installed by the Makefile beside the
# venv's packages so that users' scripts never import them: on the tests' path only.
_ORACLES = Path(sys.prefix) / "oracles"
if _ORACLES.is_dir() and str(_ORACLES) not in sys.path:
    sys.path.append(str(_ORACLES))

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist each worker takes its share of the cores, and so do the processes it starts
# (OMP_NUM_THREADS): workers of as many threads as there are cores would oversubscribe them, and
# PyTorch processes that share cores that way slow each other down several times over
# (docs/benchmarks.md, "Runs that share the cores").
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    _THREADS = max(1, len(os.sched_getaffinity(0)) // _WORKERS)  # the cores this process may use
    torch.set_num_threads(_THREADS)
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` skip, with the reason, where no CUDA device is present."""
    if CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (on a GPU machine: scripts/gpu_check.sh)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
