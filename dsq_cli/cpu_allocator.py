"""Keep freed memory inside the process on CPU (glibc's malloc), so that a training step does not
fault its pages in again every update.

A step allocates and frees the same large tensors every update (activations, their gradients,
the quantizers' outputs). By default glibc maps large blocks afresh and hands the freed top of
its heap back to the system, so each update touches new pages and the kernel faults every one
in: about 76,000 page faults a step of `dsq bench step`'s model. With large blocks served from
the heap, freed memory kept and the heap grown 256 MiB at a time, 1,000 to 3,000 remain. Multi30k
trains 14% faster with it, fp32 and dsq alike (the bench step: fp32 5% to 8%, dsq 0.5% to 3.5%),
for 11% (fp32) to 23% (dsq) more peak resident memory (docs/benchmarks.md). CUDA tensors have
their own caching allocator and are unaffected. ``DSQ_CPU_ALLOCATOR=default`` leaves glibc's
settings alone (``keep``, or unset: the setting above; any other value is an error, so that a
typo cannot silently keep it on). Imports only the standard library.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

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
OPT_OUT = "DSQ_CPU_ALLOCATOR"
CHOICES = ("keep", "default")


def chosen_setting() -> str:
    """``keep`` or ``default``, from DSQ_CPU_ALLOCATOR (unset: ``keep``); ValueError, naming the
    choices, for any other value."""
    value = os.environ.get(OPT_OUT) or "keep"
    if value not in CHOICES:
        raise ValueError(
            f"{OPT_OUT} must be 'keep' or 'default' (glibc's own settings), got {value!r}; "
            "unset it to keep freed memory"
        )
    return value


def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep freed memory and serve large blocks from its heap (see the
    module's text). True when applied; False, with nothing changed, off glibc or when
    ``DSQ_CPU_ALLOCATOR=default``; ValueError for a value that is neither."""
    if chosen_setting() == "default":
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    kept = libc.mallopt(M_TRIM_THRESHOLD, KEEP_FREED) == 1
    padded = libc.mallopt(M_TOP_PAD, TOP_PAD) == 1
    served = any(libc.mallopt(M_MMAP_THRESHOLD, size) == 1 for size in MMAP_THRESHOLDS)
    if not (kept and padded and served):
        log.info("glibc refused part of the allocator setting: trim %s, top pad %s, mmap %s",
                 kept, padded, served)  # fmt: skip
    return kept and padded and served
