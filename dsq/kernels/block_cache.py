"""A CPU allocator for torch that keeps freed large blocks for reuse by the next block of the
same size (``block_cache.cpp``; docs/benchmarks.md, "The CPU allocator setting").

A training step frees and allocates blocks of a few sizes many times over: dsq's attention tiles,
an MLP's slices, the quantizers' outputs. Given back to the system as each is freed, every
block is faulted in afresh at its next use; kept in glibc's heap, blocks of differing sizes
fragment it. `install` makes this cache torch's CPU allocator for the rest of the process: a
freed block of `SMALLEST` to `LARGEST` bytes is kept, up to `CAPACITY` bytes in all (the least
recently freed given back first), and handed to the next allocation of exactly its size; the
process holds its tensors and at most those bytes besides. Blocks are reported to torch's
profiler as torch's own allocator reports them (allocated when handed out, freed when their
tensor is), so the profiler's memory records count tensors only.

Built, cached and loaded as ``cpu.py`` builds the BFP kernels (``cpu.build``). Imports only
torch and ``cpu``.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from . import cpu

SOURCES = (cpu.HERE / "block_cache.cpp",)
# Blocks from glibc's mmap threshold under DSQ_CPU_ALLOCATOR=release (256 KiB: smaller ones come
# from its heap, which reuses them) up to 64 MiB are kept, 256 MiB in all: a few of each size a
# step repeats (an attention tile's tensors are about 8 MiB each, an MLP slice's 4 MiB). 128
# MiB left the held Llama row's step 9% slower, 64 MiB 17% (docs/benchmarks.md).
SMALLEST = 256 << 10
LARGEST = 64 << 20
CAPACITY = 256 << 20
# C++ only: no compiler flags of the kernels' exactness argument are needed, but the same
# variants (the machine's own instruction set first) are tried
FLAGS = ("-O2",)


@functools.cache
def library() -> str:
    """The path of the loaded library (``torch.ops.dsq.cpu_block_cache_*`` registered), built
    first where this machine has no cached build; cpu.BuildError if it cannot be."""
    return cpu.build("block_cache", SOURCES, flags=FLAGS)


@functools.cache
def build_failure() -> str | None:
    """Why the library could not be built or loaded here, or None once it is loaded."""
    return cpu.failure_of(library)


@dataclasses.dataclass(frozen=True)
class CacheStats:
    """What the installed cache holds and has served: bytes kept now and at most at once,
    allocations served from it (hits) and those of a size it keeps that found none kept."""

    kept: int
    most_kept: int
    hits: int
    misses: int


def install(smallest: int = SMALLEST, largest: int = LARGEST, capacity: int = CAPACITY) -> None:
    """Put the cache in front of torch's CPU allocator for the rest of this process (see the
    module docstring). Again with the same settings: nothing; with others: ValueError.
    cpu.BuildError where the library cannot be built here."""
    library()
    torch.ops.dsq.cpu_block_cache_install(smallest, largest, capacity)


def stats() -> CacheStats | None:
    """The installed cache's `CacheStats`, or None where none is installed in this process."""
    library()
    found = torch.ops.dsq.cpu_block_cache_stats()
    return CacheStats(*found) if found else None
