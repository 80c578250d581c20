"""`apply_malloc_setting`: with ``keep`` a large block freed and allocated again is not faulted in
again; with ``release`` it is given back to the system as it is freed; with ``reuse`` blocks
of a size used again are not faulted in again, and no more than the cache's capacity stays."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)

# 64 blocks of 4 MiB (or as many as asked) held at once, as a step holds its activations,
# allocated and freed four times: the page faults of the last three rounds, and the resident
# memory once they are freed over the resident memory before the first (in pages;
# /proc/self/statm's second field)
PROBE = """
import os, resource, sys, torch
from dsq_cli.cpu_allocator import apply_malloc_setting
os.environ["DSQ_CPU_ALLOCATOR"] = sys.argv[1]
count = int(sys.argv[2])
applied = apply_malloc_setting()
resident = lambda: int(open("/proc/self/statm").read().split()[1])
start = resident()
blocks = [torch.ones(2**20) for _ in range(count)]; del blocks
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    blocks = [torch.ones(2**20) for _ in range(count)]; del blocks
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(applied, faults, resident() - start)
"""
PAGES = 64 * 1024  # the 64 blocks' pages of 4 KiB


def probe(setting: str, blocks: int = 64) -> tuple[str, int, int]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, setting, str(blocks)], capture_output=True, text=True
    )
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


def test_reuse_without_its_cache_applies_nothing(monkeypatch, caplog):
    """Where the block cache cannot be had, ``reuse`` leaves glibc as it was (not ``release``
    half applied) and says so."""
    from dsq.warn_once import warn_once
    from dsq_cli import cpu_allocator

    calls = []

    class Libc:
        def mallopt(self, *args):
            calls.append(args)
            return 1

    warn_once.cache_clear()
    monkeypatch.setattr(cpu_allocator.ctypes, "CDLL", lambda *_: Libc())
    monkeypatch.setattr(cpu_allocator, "_install_block_cache", lambda: "no compiler here")
    monkeypatch.setenv("DSQ_CPU_ALLOCATOR", "reuse")
    with caplog.at_level("WARNING"):
        assert cpu_allocator.apply_malloc_setting() is None
    assert calls == []
    assert "DSQ_CPU_ALLOCATOR=reuse does not apply here (no compiler here)" in caplog.text


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


@pytest.mark.slow  # spawns processes
def test_reused_blocks_are_not_faulted_in_again_and_at_most_the_capacity_stays():
    """``reuse`` keeps 256 MiB: the 64 blocks of 4 MiB stay for the next rounds, which fault
    nothing in anew; of 96 such blocks the last 64 freed stay and the rest go back."""
    from dsq.kernels import block_cache

    if block_cache.build_failure() is not None:  # pragma: no cover - no C++ compiler here
        pytest.skip(f"the block cache does not build here: {block_cache.build_failure()}")
    assert block_cache.CAPACITY == 64 * 4 * 2**20
    applied, faults, resident = probe("reuse")
    assert applied == "reuse"
    assert faults < PAGES / 8
    assert PAGES * 0.9 < resident < PAGES * 1.1
    _, faults, resident = probe("reuse", 96)
    assert resident < PAGES * 1.1  # 96 blocks' worth freed, 64 kept
    # each round faults in the 32 blocks given back the round before, and those only
    assert 3 * 32 * 1024 * 0.9 < faults < 3 * 32 * 1024 * 1.5


PEAK = """
import sys, torch
from dsq_cli.bench.step import allocated_during
if sys.argv[1] == "reuse":
    from dsq.kernels import block_cache
    block_cache.install()
def step():
    blocks = [torch.ones(2**20) for _ in range(8)]
    del blocks[:4]
    blocks += [torch.ones(2**20) for _ in range(2)]
step()  # the cache filled, as after a first step
print(allocated_during(step, torch.device("cpu")).peak)
"""


@pytest.mark.slow  # spawns processes
def test_the_allocators_peak_counts_tensors_only_whether_or_not_blocks_are_kept():
    """The profiler sees a kept block freed when its tensor is, and allocated when handed out
    again, as torch's own allocator reports it: `dsq bench memory`'s allocator peak is the same
    with ``reuse``."""
    from dsq.kernels import block_cache

    if block_cache.build_failure() is not None:  # pragma: no cover - no C++ compiler here
        pytest.skip(f"the block cache does not build here: {block_cache.build_failure()}")
    peaks = []
    for setting in ("release", "reuse"):
        out = subprocess.run([sys.executable, "-c", PEAK, setting], capture_output=True,
                             text=True)  # fmt: skip
        assert out.returncode == 0, out.stderr
        peaks.append(int(out.stdout.split()[-1]))
    assert peaks == [8 * 4 * 2**20] * 2


def test_a_mistyped_setting_is_an_error_not_a_silent_keep(monkeypatch):
    """Only `keep`, `default`, `release` and `reuse` are settings: anything else fails before a
    command runs (exit 2, one line naming the choices), instead of leaving the allocator setting
    on unnoticed."""
    from typer.testing import CliRunner

    from dsq_cli.cli import app
    from dsq_cli.cpu_allocator import apply_malloc_setting

    monkeypatch.setenv("DSQ_CPU_ALLOCATOR", "defualt")
    with pytest.raises(
        ValueError, match="must be 'keep', 'default'.*'release'.*or 'reuse'.*'defualt'"
    ):
        apply_malloc_setting()
    result = CliRunner().invoke(app, ["version"])
    assert result.exit_code == 2
    assert "DSQ_CPU_ALLOCATOR must be 'keep', 'default'" in result.output
    for setting in ("keep", "release"):
        monkeypatch.setenv("DSQ_CPU_ALLOCATOR", setting)
        assert CliRunner().invoke(app, ["version"]).exit_code == 0
