"""How a CPU training step's large blocks are served: kept in glibc's heap for reuse (the default),
glibc's own settings, given back to the system as each is freed, or given back except those of a
size the step uses again.

A step allocates and frees the same large tensors every update (activations, their gradients,
the quantizers' outputs). Four settings, chosen by ``DSQ_CPU_ALLOCATOR`` (docs/benchmarks.md,
"The CPU allocator setting", measures them):

- ``keep`` (unset: this one): large blocks are served from the heap, up to 1 GiB freed is kept
  and the heap grows 256 MiB at a time, so an update reuses the pages of the last instead of
  faulting them in again (by default about 76,000 page faults a step of `dsq bench step`'s
  model; kept, 1,000 to 3,000). Multi30k trains 14% faster with it, fp32 and dsq alike, for 11%
  (fp32) to 23% (dsq) more peak resident memory.
- ``default``: glibc's own settings. glibc maps a large block on its own until the first such
  block is freed, then raises its threshold to that block's size (up to 32 MiB), so later blocks
  come from the heap, whose freed pieces of differing sizes it cannot always reuse: the process
  holds more than its tensors, and more the more temporaries of differing sizes a step makes.
- ``release``: a block of 256 KiB or more is, as a rule, mapped on its own and given back when
  freed (a fixed mmap threshold, which glibc then never raises; a free piece of the heap that
  fits may still serve one): the process's peak is its tensors' peak plus the libraries, at the
  price of faulting every large block in afresh.
- ``reuse``: ``release``, with a cache as torch's CPU allocator (`dsq.kernels.block_cache`)
  that keeps freed blocks of 256 KiB to 64 MiB, up to 256 MiB in all, for the next allocation
  of exactly their size: the blocks a step repeats (attention tiles, MLP slices) are faulted in
  once, and the process holds its tensors plus at most those 256 MiB. It needs the cache's C++
  library to build; where it cannot, the setting does not apply (a warning).

CUDA tensors have their own caching allocator and are unaffected. Any other value is an error,
so that a typo cannot silently leave a setting on. Imports only the standard library (and
`dsq.warn_once`, which does too), and `dsq.kernels.block_cache` (torch) for ``reuse`` only.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

from dsq.warn_once import warn_once

log = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
KEEP_FREED = 1 << 30  # keep up to 1 GiB freed at the top of the heap
TOP_PAD = 256 << 20  # grow the heap 256 MiB at a time
# serve blocks up to this size from the heap; glibc documents 32 MiB as the most it accepts on
# 64-bit machines, and newer versions take more, so the larger is tried first
MMAP_THRESHOLDS = (1 << 30, 32 << 20)
RELEASE_THRESHOLD = 256 << 10  # `release`: blocks from this size up are mapped on their own
SETTING = "DSQ_CPU_ALLOCATOR"
CHOICES = ("keep", "default", "release", "reuse")


def chosen_setting() -> str:
    """``keep``, ``default``, ``release`` or ``reuse``, from DSQ_CPU_ALLOCATOR (unset: ``keep``);
    ValueError, naming the choices, for any other value."""
    value = os.environ.get(SETTING) or "keep"
    if value not in CHOICES:
        raise ValueError(
            f"{SETTING} must be 'keep', 'default' (glibc's own settings), 'release' (large "
            f"blocks given back when freed) or 'reuse' (given back unless of a size used "
            f"again), got {value!r}; unset it to keep freed memory"
        )
    return value


def apply_malloc_setting() -> str | None:
    """Apply the chosen setting (see the module's text). Returns the setting in force: ``keep``,
    ``release`` or ``reuse`` as applied, ``default`` (nothing changed); None where the chosen one
    could not be applied (off glibc, glibc refused part of it, the block cache did not build),
    with a warning when DSQ_CPU_ALLOCATOR asked for it by name. ValueError for a value that is
    not a setting."""
    setting = chosen_setting()
    if setting == "default":
        return setting
    refused = _apply(setting)
    if refused is None:
        return setting
    if os.environ.get(SETTING):  # asked for by name: say that it does not hold
        warn_once(__name__, f"dsq: {SETTING}={setting} does not apply here ({refused}); the "
                            "process runs with its C library's malloc settings")  # fmt: skip
    else:
        log.info("the CPU allocator setting %s does not apply here (%s)", setting, refused)
    return None


def _apply(setting: str) -> str | None:
    """Apply ``keep``, ``release`` or ``reuse`` (mallopt, and the block cache for ``reuse``):
    None when it took, else why it did not."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "not glibc's malloc"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError as err:
        return f"the C library did not load: {err}"
    if setting in ("release", "reuse"):
        # the cache first: where it cannot be had, nothing of the setting applies
        refused = _install_block_cache() if setting == "reuse" else None
        if refused is None and libc.mallopt(M_MMAP_THRESHOLD, RELEASE_THRESHOLD) != 1:
            refused = f"glibc refused an mmap threshold of {RELEASE_THRESHOLD} bytes"
        return refused
    kept = libc.mallopt(M_TRIM_THRESHOLD, KEEP_FREED) == 1
    padded = libc.mallopt(M_TOP_PAD, TOP_PAD) == 1
    served = any(libc.mallopt(M_MMAP_THRESHOLD, size) == 1 for size in MMAP_THRESHOLDS)
    if kept and padded and served:
        return None
    return f"glibc refused part of it: trim {kept}, top pad {padded}, mmap threshold {served}"


def _install_block_cache() -> str | None:
    """The block cache installed in front of torch's CPU allocator: None, or why it is not."""
    from dsq.kernels import block_cache, cpu

    try:
        block_cache.install()
    except cpu.BuildError as err:
        return f"the block cache's library did not build: {err}"
    return None
