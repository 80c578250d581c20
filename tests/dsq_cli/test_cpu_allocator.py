"""`apply_malloc_setting`: with ``keep`` a large block freed and allocated again is not faulted in
again; with ``release`` it is given back to the system as it is freed."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)

# 64 blocks of 4 MiB held at once, as a step holds its activations, allocated and freed four
# times: the page faults of the last three rounds, and the resident memory once they are freed
# over the resident memory before the first (in pages; /proc/self/statm's second field)
PROBE = """
import os, resource, sys, torch
from dsq_cli.cpu_allocator import apply_malloc_setting
os.environ["DSQ_CPU_ALLOCATOR"] = sys.argv[1]
applied = apply_malloc_setting()
resident = lambda: int(open("/proc/self/statm").read().split()[1])
start = resident()
blocks = [torch.ones(2**20) for _ in range(64)]; del blocks
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    blocks = [torch.ones(2**20) for _ in range(64)]; del blocks
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(applied, faults, resident() - start)
"""
PAGES = 64 * 1024  # the 64 blocks' pages of 4 KiB


def probe(setting: str) -> tuple[str, int, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, setting], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    applied, faults, kept = out.stdout.split()
    return applied, int(faults), int(kept)


def test_the_default_setting_leaves_glibc_alone(monkeypatch):
    from dsq_cli import cpu_allocator

    def no_mallopt(setting):
        raise AssertionError(f"{setting} applied")

    monkeypatch.setattr(cpu_allocator, "_apply", no_mallopt)
    monkeypatch.setenv("DSQ_CPU_ALLOCATOR", "default")
    assert cpu_allocator.apply_malloc_setting() == "default"


def test_a_setting_asked_for_by_name_that_cannot_apply_says_so(monkeypatch, caplog):
    """Off glibc (here: glibc said to be musl) nothing is applied: None, and a warning where
    DSQ_CPU_ALLOCATOR named the setting; unset, the default's absence is no news."""
    from dsq.warn_once import warn_once
    from dsq_cli import cpu_allocator

    warn_once.cache_clear()
    monkeypatch.setattr(cpu_allocator.platform, "libc_ver", lambda: ("musl", "1.2"))
    monkeypatch.setenv("DSQ_CPU_ALLOCATOR", "release")
    with caplog.at_level("WARNING"):
        assert cpu_allocator.apply_malloc_setting() is None
    assert "DSQ_CPU_ALLOCATOR=release does not apply here (not glibc's malloc)" in caplog.text
    caplog.clear()
    monkeypatch.delenv("DSQ_CPU_ALLOCATOR")
    with caplog.at_level("WARNING"):
        assert cpu_allocator.apply_malloc_setting() is None
    assert not caplog.records


@pytest.mark.slow  # spawns processes
def test_kept_blocks_are_reused_without_faulting_pages_in_again():
    applied, kept_faults, _ = probe("keep")
    assert applied == "keep"
    _, default_faults, _ = probe("default")
    # the control: by default a large share of the 3 x 64 x 1024 pages faults in anew (measured
    # 66,000 to 132,000 here); kept, 5,000 to 9,000
    assert default_faults > 3 * PAGES / 4
    assert kept_faults * 4 < default_faults


@pytest.mark.slow  # spawns processes
def test_released_blocks_go_back_to_the_system_as_they_are_freed():
    applied, faults, resident = probe("release")
    assert applied == "release"
    # every round maps its blocks afresh, and none of the 64 blocks stays resident once freed
    assert faults > 3 * PAGES * 0.9
    assert resident < PAGES / 16
    # the control: kept, the freed blocks stay in the process
    _, _, kept_resident = probe("keep")
    assert kept_resident > PAGES * 0.9


def test_a_mistyped_setting_is_an_error_not_a_silent_keep(monkeypatch):
    """Only `keep`, `default` and `release` are settings: anything else fails before a command
    runs (exit 2, one line naming the choices), instead of leaving the allocator setting on
    unnoticed."""
    from typer.testing import CliRunner

    from dsq_cli.cli import app
    from dsq_cli.cpu_allocator import apply_malloc_setting

    monkeypatch.setenv("DSQ_CPU_ALLOCATOR", "defualt")
    with pytest.raises(ValueError, match="must be 'keep', 'default'.*or 'release'.*'defualt'"):
        apply_malloc_setting()
    result = CliRunner().invoke(app, ["version"])
    assert result.exit_code == 2
    assert "DSQ_CPU_ALLOCATOR must be 'keep', 'default'" in result.output
    for setting in ("keep", "release"):
        monkeypatch.setenv("DSQ_CPU_ALLOCATOR", setting)
        assert CliRunner().invoke(app, ["version"]).exit_code == 0
