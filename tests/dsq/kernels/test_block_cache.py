"""The CPU block cache (`dsq.kernels.block_cache`): a freed block of a size it takes is handed to
the next allocation of exactly that size, other sizes pass by, at most its capacity is kept,
and values computed in reused blocks are the same. Each check runs in a fresh process: once
installed, the cache stays torch's CPU allocator for the rest of the process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dsq.kernels import block_cache

MIB = 1 << 20

SCRIPT = """
import json, os, torch
from dsq.kernels import block_cache
MIB = 1 << 20
a = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
expected = a @ a
b = a.bfloat16()
expected_bf16 = b @ b  # oneDNN's bf16 GEMM: a scratchpad taken by raw_allocate, of any size
before = block_cache.stats()
block_cache.install(smallest=MIB, largest=4 * MIB, capacity=8 * MIB)
stats = lambda: block_cache.stats().__dict__
found = {"before": before is None, "installed": stats()}
# twelve blocks of 1 MiB live at once, then freed: 8 of them (the capacity) are kept
blocks = [torch.empty(MIB // 4) for _ in range(12)]
del blocks
found["after_peak"] = stats()
# four blocks of 1 MiB, freed, then four of the same size: the same four blocks again
blocks = [torch.empty(MIB // 4) for _ in range(4)]
first = {t.data_ptr() for t in blocks}
del blocks
blocks = [torch.empty(MIB // 4) for _ in range(4)]
found["same_blocks"] = {t.data_ptr() for t in blocks} == first
del blocks
found["reused"] = stats()
# a size kept nowhere yet: a miss; once freed it is kept, the least recently freed of 1 MiB
# given back so that the kept fit the capacity
other = torch.empty(MIB // 4 + 16)
del other
found["other_size"] = stats()
# a block above the largest: served, and once freed not kept
large = torch.empty(2 * MIB)  # 8 MiB
found["while_large"] = stats()
del large
found["too_large"] = stats()
# sixteen blocks freed: 8 MiB stay kept
blocks = [torch.empty(MIB // 4) for _ in range(16)]
del blocks
found["after_sixteen"] = stats()
found["same_values"] = bool(torch.equal(a @ a, expected))
# raw_allocate gives a block of any size through the cache and frees it through its raw
# deleter: one the allocator before it gave goes back there
found["bf16_values"] = bool(torch.equal(b @ b, expected_bf16))
block_cache.install(smallest=MIB, largest=4 * MIB, capacity=8 * MIB)  # the same: nothing
# a forked child allocates through the cache (its lock released after the fork) and exits
child = os.fork()
if child == 0:
    os._exit(0 if torch.empty(MIB // 4).numel() == MIB // 4 else 1)
found["forked_child"] = os.waitpid(child, 0)[1]
try:
    block_cache.install(smallest=MIB, largest=4 * MIB, capacity=16 * MIB)
    found["other_settings"] = "accepted"
except ValueError as err:
    found["other_settings"] = str(err)
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def found():
    if block_cache.build_failure() is not None:  # pragma: no cover - no C++ compiler here
        pytest.skip(f"the block cache does not build here: {block_cache.build_failure()}")
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_nothing_is_installed_until_asked_and_then_nothing_is_kept_yet(found):
    assert found["before"]
    assert found["installed"]["kept"] == found["installed"]["hits"] == 0


def test_a_freed_block_is_kept_and_handed_to_the_next_of_its_size(found):
    assert found["after_peak"]["kept"] == 8 * MIB  # the capacity
    assert found["same_blocks"]
    assert found["reused"]["hits"] - found["after_peak"]["hits"] == 8
    assert found["reused"]["kept"] == 8 * MIB


def test_other_sizes_are_blocks_of_their_own_and_too_large_ones_are_never_kept(found):
    # the new size missed, and was kept in place of the two least recently freed of 1 MiB
    assert found["other_size"]["misses"] == found["reused"]["misses"] + 1
    assert found["other_size"]["kept"] == 7 * MIB + 64
    # the 8 MiB block is above the largest: no miss counted, nothing kept when it is freed
    assert found["while_large"] == found["other_size"]
    assert found["too_large"] == found["other_size"]


def test_at_most_the_capacity_is_kept(found):
    assert found["after_sixteen"]["kept"] == 8 * MIB
    assert max(s["most_kept"] for s in found.values() if isinstance(s, dict)) <= 8 * MIB


def test_values_computed_in_reused_blocks_are_the_same(found):
    assert found["same_values"]
    assert found["bf16_values"]


def test_a_forked_child_allocates_through_the_cache(found):
    assert found["forked_child"] == 0


def test_installing_again_with_other_settings_is_an_error(found):
    assert "installed already, with other settings" in found["other_settings"]


def test_bad_settings_are_a_one_line_error_before_anything_is_installed():
    if block_cache.build_failure() is not None:  # pragma: no cover - no C++ compiler here
        pytest.skip(f"the block cache does not build here: {block_cache.build_failure()}")
    with pytest.raises(ValueError, match="needs 0 < smallest <= largest"):
        block_cache.install(smallest=4 * MIB, largest=MIB)
    assert block_cache.stats() is None
