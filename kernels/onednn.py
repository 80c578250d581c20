"""Exact GEMMs on the CPU's bf16 units: ``gemm_cpu.c`` (docs/dsq.md, "GEMM units").

Two kinds of kernels, built on first use with the machine's C compiler beside the quantizers
(``cpu.build``, cached under ``$DSQ_CACHE/c-kernels``):

* conversions of float32 tensors to bf16 that also check, in the same pass, that every value is
  a bf16 number the bf16 unit multiplies exactly (``to_bf16``; ``split_bf16`` for a value of up to
  16 significant bits, as an exact pair of bf16 numbers). They return None when a value does not
  fit, and the caller then runs the float32 GEMM;
* ``gemm_bf16``: oneDNN's matmul primitive with bf16 operands and a float32 result.

oneDNN comes from the PyPI packages ``onednn-cpu-gomp`` (the library, on GNU OpenMP: the
runtime torch ships, so both share one thread pool) and ``onednn-devel-cpu-gomp`` (its
headers), which ``make setup`` installs. Where they are missing, or the CPU has no bf16
instructions, ``unavailable_reason`` says why and the engine keeps float32 GEMMs.
Like ``cpu.py``, this module knows nothing of ``dsq_cli``.
"""

from __future__ import annotations

import ctypes
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
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


@functools.cache
def library() -> ctypes.CDLL:
    """The loaded GEMM kernels, linked against the installed oneDNN; BuildError if they cannot
    be built or loaded."""
    include, lib = onednn_paths()
    links = (f"-L{lib}", "-ldnnl", f"-Wl,-rpath,{lib}", "-lpthread")
    variants = (("-march=native", "-fopenmp"), ("-fopenmp",), ())
    built = cpu.build(SOURCE, variants, cpu.FLAGS + (f"-I{include}",), links, identity=str(lib))
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    built.dsq_to_bf16.restype, built.dsq_to_bf16.argtypes = i32, [p, p, i64]
    built.dsq_split_bf16.restype, built.dsq_split_bf16.argtypes = i32, [p, p, p, i64]
    built.dsq_gemm_bf16.restype = i32
    built.dsq_gemm_bf16.argtypes = [p, p, p, p, *([i64] * 10), i32]
    return built


@functools.cache
def _build_failure() -> str | None:
    try:
        library()
    except cpu.BuildError as err:
        return str(err)
    return None


def unavailable_reason() -> str | None:
    """Why the bf16 GEMMs cannot run on this machine's CPU, or None when they can."""
    missing = not (cpu_flags() & set(BF16_FLAGS))
    if missing:
        return f"the CPU has no bf16 dot-product instructions ({' or '.join(BF16_FLAGS)})"
    return _build_failure()


# ----------------------------------------------------------------------------- wrappers
def _dense_like(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, an empty tensor of ``dtype`` with x's strides), x first made contiguous unless its
    elements fill its memory in some order (a transposed view does): the conversion then walks
    the memory of both in the same order."""
    if not _fills_memory(x):
        x = x.contiguous()
    return x, torch.empty_strided(x.shape, x.stride(), dtype=dtype)


def _fills_memory(x: torch.Tensor) -> bool:
    expected = 1
    for size, stride in sorted(zip(x.shape, x.stride()), key=lambda pair: pair[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def to_bf16(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` (float32, CPU) as bf16 with x's layout, or None when a value is not a bf16 number
    the bf16 unit multiplies exactly (``gemm_cpu.c``'s ``fits_bf16``)."""
    _check_float32(x)
    x, out = _dense_like(x, torch.bfloat16)
    ok = library().dsq_to_bf16(x.data_ptr(), out.data_ptr(), x.numel())
    return out if ok else None


def split_bf16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(hi, lo), bf16 with x's layout and ``hi + lo == x`` exactly, or None when x holds a
    value of more than 16 significant bits or one the bf16 unit cannot take."""
    _check_float32(x)
    x, hi = _dense_like(x, torch.bfloat16)
    lo = torch.empty_strided(x.shape, x.stride(), dtype=torch.bfloat16)
    ok = library().dsq_split_bf16(x.data_ptr(), hi.data_ptr(), lo.data_ptr(), x.numel())
    return (hi, lo) if ok else None


def _check_float32(x: torch.Tensor) -> None:
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise TypeError(f"expected a float32 CPU tensor, got {x.dtype} on {x.device.type}")


def gemm_bf16(a, b, bias=None, out=None) -> torch.Tensor:
    """``a @ b (+ bias)`` in float32 from bf16 ``a`` [..., m, k] and ``b`` [..., k, n] (the same
    leading dimensions, any strides); ``out`` given: ``out += a @ b`` (contiguous float32)."""
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        raise TypeError(f"expected bf16 operands, got {a.dtype} and {b.dtype}")
    if a.shape[:-2] != b.shape[:-2] or a.shape[-1] != b.shape[-2]:
        raise ValueError(f"cannot multiply {tuple(a.shape)} by {tuple(b.shape)}")
    lead = a.shape[:-2]
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    a3, b3 = a.reshape(-1, m, k), b.reshape(-1, k, n)  # views where the layout allows
    accumulate = out is not None
    if out is None:
        out = torch.empty(*lead, m, n, dtype=torch.float32)
    elif not out.is_contiguous() or out.dtype != torch.float32:
        raise ValueError("out must be a contiguous float32 tensor")
    if bias is not None:
        if a3.shape[0] != 1 or bias.shape != (n,) or bias.dtype != torch.float32:
            raise ValueError("a bias is [n] float32, for an unbatched GEMM")
        bias = bias.contiguous()
    if out.numel() == 0:
        return out
    if k == 0:  # nothing to sum: oneDNN refuses an empty reduction
        if not accumulate:
            out.zero_()
            if bias is not None:
                out += bias
        return out
    status = library().dsq_gemm_bf16(
        a3.data_ptr(), b3.data_ptr(), out.data_ptr(),
        bias.data_ptr() if bias is not None else None,
        a3.shape[0], m, n, k, *a3.stride(), *b3.stride(), int(accumulate),
    )  # fmt: skip
    if status != 0:
        why = {1: "no CPU engine", 2: "the shape was refused", 3: "the execution failed"}
        raise RuntimeError(
            f"oneDNN bf16 GEMM {tuple(a.shape)} @ {tuple(b.shape)}: {why.get(status, status)}"
        )
    return out
