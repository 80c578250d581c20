"""`keep_freed_memory`: a large block freed and allocated again is not faulted in again."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)

# 64 blocks of 4 MiB held at once, as a step holds its activations: by default glibc hands the
# freed blocks back to the system (or maps them afresh), and every page faults in again
PROBE = """
import resource, sys, torch
from dsq_cli.cpu_allocator import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
blocks = [torch.ones(2**20) for _ in range(64)]; del blocks
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    blocks = [torch.ones(2**20) for _ in range(64)]; del blocks
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def page_faults(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    applied, faults = out.stdout.split()
    return applied, int(faults)


def test_the_opt_out_leaves_glibc_alone(monkeypatch):
    from dsq_cli.cpu_allocator import keep_freed_memory

    monkeypatch.setenv("DSQ_CPU_ALLOCATOR", "default")
    assert keep_freed_memory() is False


@pytest.mark.slow  # spawns processes
def test_freed_blocks_are_reused_without_faulting_pages_in_again():
    applied, kept = page_faults("keep")
    assert applied == "True"
    _, default = page_faults("default")
    # the control: by default a large share of the 3 x 64 x 1024 pages faults in anew (measured
    # 66,000 to 132,000 here); kept, 5,000 to 9,000
    assert default > 3 * 64 * 1024 / 4
    assert kept * 4 < default


def test_a_mistyped_setting_is_an_error_not_a_silent_keep(monkeypatch):
    """Only `keep` and `default` are settings: anything else fails before a command runs (exit
    2, one line naming the choices), instead of leaving the allocator setting on unnoticed."""
    from typer.testing import CliRunner

    from dsq_cli.cli import app
    from dsq_cli.cpu_allocator import keep_freed_memory

    monkeypatch.setenv("DSQ_CPU_ALLOCATOR", "defualt")
    with pytest.raises(ValueError, match="must be 'keep' or 'default'.*'defualt'"):
        keep_freed_memory()
    result = CliRunner().invoke(app, ["version"])
    assert result.exit_code == 2
    assert "DSQ_CPU_ALLOCATOR must be 'keep' or 'default'" in result.output
    monkeypatch.setenv("DSQ_CPU_ALLOCATOR", "keep")
    assert CliRunner().invoke(app, ["version"]).exit_code == 0
