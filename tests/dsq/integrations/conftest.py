"""Shared fixtures of the integration tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def fresh_accelerate():
    """accelerate's process-wide state reset before and after a test: an ``Accelerator`` refuses
    a mixed precision other than the one an earlier test in the same process set up."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield accelerate
    AcceleratorState._reset_state(reset_partial_state=True)
