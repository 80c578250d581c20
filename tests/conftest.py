"""Fixtures and hooks shared by the tests (plain helper functions live in tests/helpers/).

Triton kernels run on CPU tensors under TRITON_INTERPRET=1; set it before anything imports
triton, unless a GPU is present (then the kernels run for real on CUDA tensors).
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` skip, with the reason, where no CUDA device is present."""
    if CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (on a GPU machine: scripts/gpu_check.sh)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
