"""Exact GEMMs on the CPU's bf16 units: ``gemm_cpu.c`` (docs/dsq.md, "GEMM units"), as the
torch custom ops ``torch.ops.dsq.to_bf16``, ``split_bf16`` and ``gemm_bf16``.

Two kinds of kernels, registered by ``gemm_ops.cpp`` and built on first use beside the
quantizers (``cpu.build``: torch's extension machinery, the same exactness flags, variants and
per-CPU cache under ``$DSQ_CACHE/c-kernels``), linked against the installed oneDNN:

* ``to_bf16``: a float32 tensor converted to bf16, checked in the same pass that every value is
  a bf16 number the bf16 unit multiplies exactly; None when one is not, and the caller then runs
  the float32 GEMM. It writes into a zero-padded tensor (``padded_size``), so that batches of
  every length share a few hundred GEMM shapes;
* ``split_bf16``: a float32 tensor of values of up to 16 significant bits as an exact pair hi +
  lo of bf16 tensors, padded and checked as ``to_bf16``'s, for a GEMM run as two bf16 GEMMs;
* ``gemm_bf16``: oneDNN's matmul primitive with bf16 operands and a float32 result, cached per
  shape and layout.

oneDNN comes from the PyPI packages ``onednn-cpu-gomp`` (the library, on GNU OpenMP: the
runtime torch ships, so both share one thread pool) and ``onednn-devel-cpu-gomp`` (its
headers), which ``make setup`` installs. Where they are missing, or the CPU has no bf16
instructions, ``unavailable_reason`` says why and the engine keeps float32 GEMMs.
Like ``cpu.py``, this module knows nothing of the formats above it.
"""

from __future__ import annotations

import functools
import importlib.metadata
from pathlib import Path

import torch

from . import cpu

SOURCE = Path(__file__).with_name("gemm_cpu.c")
DISTRIBUTIONS = ("onednn-cpu-gomp", "onednn-devel-cpu-gomp")
INSTALL_HINT = "pip install onednn-cpu-gomp==2023.2.0 onednn-devel-cpu-gomp==2023.2.0"
# CPU flags (Linux /proc/cpuinfo) of an instruction that multiplies bf16 and accumulates in
# float32: AVX512-BF16's vdpbf16ps, or AMX's tiles.
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def _installed_file(distribution: str, name: str) -> Path | None:
    """A file of an installed distribution, by its name (the first match), or None."""
    try:
        files = importlib.metadata.distribution(distribution).files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name == name:
            return Path(file.locate()).resolve()
    return None


def onednn_paths() -> tuple[Path, Path]:
    """(the folder holding ``dnnl.h``, the folder holding ``libdnnl.so``) of the installed
    oneDNN packages; BuildError naming the install command when either is missing."""
    header = _installed_file(DISTRIBUTIONS[1], "dnnl.h")
    shared = _installed_file(DISTRIBUTIONS[0], "libdnnl.so")
    if header is None or shared is None:
        raise cpu.BuildError(f"oneDNN is not installed ({INSTALL_HINT})")
    # the package ships both include/dnnl.h and include/oneapi/dnnl/dnnl.h; either folder works
    return header.parent, shared.parent


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux), empty where /proc/cpuinfo does not say."""
    for line in cpu._cpu_identity().splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


# AMD's family of Zen 5 (and later), whose EPYCs run AVX-512 on a full 512-bit datapath. There a
# bf16 GEMM of the benchmark's shapes runs 3.3x to 5x faster than a float32 one, so two bf16 GEMMs
# and the split beat one float32 GEMM (measured: 0.52x its time). On an earlier EPYC host of this
# project, whose bf16 GEMMs ran only 2x float32 (as Zen 4's would, family 0x19, which issues each
# 512-bit instruction as two halves), the pair cost 1.4x (docs/benchmarks.md, "GEMM units").
SPLIT_PAYS_AMD_FAMILY = 0x1A


@functools.cache
def cpu_vendor_family_model() -> tuple[str, int, str] | None:
    """(vendor_id, cpu family, model name) of the CPU (Linux /proc/cpuinfo), or None where it
    does not say."""
    fields = {}
    for line in cpu._cpu_lines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    try:
        return fields["vendor_id"], int(fields["cpu family"]), fields.get("model name", "")
    except (KeyError, ValueError):
        return None


def split_pays() -> bool:
    """Whether an exact pair of bf16 GEMMs (``split_bf16``) beats one float32 GEMM on this CPU:
    measured so on an AMD EPYC of family 26 (server Zen 5). Other CPUs keep float32 for such
    GEMMs until measured: the laptop parts of the same family issue AVX-512 at 256 bits, as
    Zen 4 does."""
    identity = cpu_vendor_family_model()
    if identity is None:
        return False
    vendor, family, model = identity
    return vendor == "AuthenticAMD" and family >= SPLIT_PAYS_AMD_FAMILY and "EPYC" in model


# the first includes the others (the build key hashes all three)
SOURCES = (Path(__file__).with_name("gemm_ops.cpp"), SOURCE, cpu.HERE / "op_checks.h")


@functools.cache
def library() -> str:
    """The path of the loaded GEMM kernels (``torch.ops.dsq.to_bf16``, ``split_bf16`` and
    ``gemm_bf16`` registered), linked against the installed oneDNN; BuildError if they cannot
    be built or loaded."""
    include, lib = onednn_paths()
    ldflags = (f"-L{lib}", "-ldnnl", f"-Wl,-rpath,{lib}", "-lpthread")
    path = cpu.build("gemm_ops", SOURCES, ldflags=ldflags, includes=(include,), identity=str(lib))
    _register_fakes()
    return path


def _fake_to_bf16(x, shape):
    return _fake_padded("dsq::to_bf16", x, shape)


def _fake_padded(op: str, x, shape):
    cpu.need(op, x, torch.float32, 3)
    order = sorted(range(3), key=lambda d: (-x.stride(d), d))  # outermost in memory first
    buffer = torch.empty([shape[d] for d in order], dtype=torch.bfloat16)
    return buffer.permute([order.index(d) for d in range(3)]), torch.empty((), dtype=torch.bool)


def _fake_split_bf16(x, shape):
    hi, ok = _fake_padded("dsq::split_bf16", x, shape)
    return hi, torch.empty_like(hi), ok


def _fake_gemm_bf16(a, b, bias=None):
    cpu.need("dsq::gemm_bf16", a, torch.bfloat16, 3)
    cpu.need("dsq::gemm_bf16", b, torch.bfloat16, 3)
    return torch.empty(a.shape[0], a.shape[1], b.shape[2], dtype=torch.float32)


@functools.cache
def _register_fakes() -> None:
    torch.library.register_fake("dsq::to_bf16", _fake_to_bf16)
    torch.library.register_fake("dsq::split_bf16", _fake_split_bf16)
    torch.library.register_fake("dsq::gemm_bf16", _fake_gemm_bf16)


@functools.cache
def _build_failure() -> str | None:
    return cpu.failure_of(library)


def unavailable_reason() -> str | None:
    """Why the bf16 GEMMs cannot run on this machine's CPU, or None when they can."""
    missing = not (cpu_flags() & set(BF16_FLAGS))
    if missing:
        return f"the CPU has no bf16 dot-product instructions ({' or '.join(BF16_FLAGS)})"
    return _build_failure()


# ----------------------------------------------------------------------------- wrappers
STEPS_PER_OCTAVE = 32


def padded_size(n: int) -> int:
    """``n`` rounded up to one of STEPS_PER_OCTAVE sizes per octave (n itself below 64; 2000 ->
    2016): every primitive is made for one shape, and a training run whose batches all differ in
    length then meets a few hundred shapes instead of thousands, for at most 1/32 more work."""
    step = 1 << max(0, n.bit_length() - 1 - STEPS_PER_OCTAVE.bit_length() + 1)
    return -(-n // step) * step


def to_bf16(x: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor | None:
    """``x`` [b, r, c] (float32, CPU, any strides) as bf16 inside a zero-padded tensor of
    ``shape`` (each side at least x's), laid out in x's memory order so that both are read and
    written in that order; None when a value is not a bf16 number the bf16 unit multiplies
    exactly (``gemm_cpu.c``'s ``fits_bf16``)."""
    library()
    padded, fits = torch.ops.dsq.to_bf16.default(x, list(shape))
    return padded if fits.item() else None


def split_bf16(x: torch.Tensor, shape: tuple[int, int, int]):
    """``x`` [b, r, c] (float32, CPU, any strides) as (hi, lo), bf16 tensors padded and laid out
    as `to_bf16`'s with ``hi + lo == x`` exactly; None when a value does not split into two bf16
    numbers the bf16 unit multiplies exactly (more than 16 significant bits, a part below 2^-63,
    or not finite)."""
    library()
    hi, lo, fits = torch.ops.dsq.split_bf16.default(x, list(shape))
    return (hi, lo) if fits.item() else None


def gemm_bf16(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None):
    """``a @ b (+ bias)`` as a new contiguous float32 tensor from bf16 ``a`` [batch, m, k] and
    ``b`` [batch, k, n] of any strides; ``bias`` [n] float32 only with batch 1."""
    library()
    return torch.ops.dsq.gemm_bf16.default(a, b, bias)
