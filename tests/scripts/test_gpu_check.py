"""The CUDA checks of scripts/gpu_check.sh under pytest: marked ``cuda``, they skip where no CUDA
device is present. The script stays the one command for a GPU machine (it also times the kernels
and the training step); these tests call its check functions, so there is one implementation."""

from __future__ import annotations

import importlib.util
import json

import pytest
from helpers.paths import REPO
from helpers.runs import only_run, small
from typer.testing import CliRunner

from dsq_cli.cli import app

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def gpu_check():
    """scripts/gpu_check.py as a module (scripts/ is no package)."""
    pytest.importorskip("triton")
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.CUDA, "TRITON_INTERPRET=1 is set: gpu_check would check on CPU tensors"
    return module


def failures(gpu_check, check) -> list[str]:
    """The names of the checks that ``check`` reported as failed."""
    gpu_check.FAILS.clear()
    check()
    return list(gpu_check.FAILS)


@pytest.mark.slow  # compiles a Triton kernel per format and rounding
def test_triton_backend_equals_the_reference_bit_for_bit_on_cuda(gpu_check):
    assert failures(gpu_check, gpu_check.exactness) == []


def test_gemm_units_are_exact_on_integer_operands(gpu_check):
    assert failures(gpu_check, gpu_check.gemm_units_exactness) == []


@pytest.mark.slow  # trains
@pytest.mark.parametrize("quant", ["fp32", "dsq"])
def test_demo_trains_on_cuda(tmp_path, quant):
    """The trainer's CUDA path end to end, as gpu_check.sh runs it (a shorter run)."""
    root = tmp_path / "runs"
    args = small(tmp_path / "cache", root, f"quant={quant}", "train.device=cuda")
    result = CliRunner().invoke(app, ["train", *args])
    assert result.exit_code == 0, result.output
    res = json.loads((only_run(root) / "result.json").read_text())
    assert res["status"] == "completed"
    assert res["device"] == "cuda"
