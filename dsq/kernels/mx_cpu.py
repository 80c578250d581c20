"""The C kernels of ``mx_cpu.c`` (the MX formats and NVFP4 on CPU tensors), as the torch custom
ops ``torch.ops.dsq.mx_*`` and ``torch.ops.dsq.nvfp4_*``.

Built, cached and loaded as ``cpu.py`` builds the BFP kernels (``cpu.build``: one build per CPU
and source text in ``$DSQ_CACHE/c-kernels``, an edited source builds a new folder, concurrent
first uses build once), from ``mx_ops.cpp``, which includes ``mx_cpu.c`` and registers the ops;
each op has a fake kernel here for torch.compile. Like ``cpu.py`` this module knows nothing of
the formats: its wrappers take float32 rows and the element type's parameters. The host glue is
``dsq/formats/mx_c.py``.
"""

from __future__ import annotations

import functools

import torch

from . import cpu

SOURCES = (cpu.HERE / "mx_ops.cpp", cpu.HERE / "mx_cpu.c", cpu.HERE / "op_checks.h")

_loaded: str | None = None


@functools.cache
def library() -> str:
    """The path of the loaded kernels, built first where this machine has no cached build;
    cpu.BuildError if they cannot be built or loaded."""
    global _loaded
    path = cpu.build("mx_ops", SOURCES)
    _register_fakes()
    _loaded = path
    return path


@functools.cache
def build_failure() -> str | None:
    """Why the kernels could not be built or loaded here, or None once they are loaded."""
    return cpu.failure_of(library)


def _ops():
    if _loaded is None:
        library()
    return torch.ops.dsq


# ----------------------------------------------------------------------------- fake kernels
def _element(op, block, bits, man_bits):
    cpu.need_range(op, "block", block, 1)
    if bits not in (4, 6, 8):
        raise ValueError(f"dsq::{op} needs bits of 4, 6 or 8, got {bits}")
    cpu.need_range(op, "man_bits", man_bits, 0, 6)


def _fake_mx_quantize(rows, block, bits, man_bits, emin, emax, max_normal, integer):
    cpu.need("dsq::mx_quantize", rows, torch.float32, 2)
    _element("mx_quantize", block, bits, man_bits)
    return torch.empty(rows.shape, dtype=torch.float32)


def _fake_mx_pack(rows, block, bits, man_bits, emin, emax, max_normal, integer):
    cpu.need("dsq::mx_pack", rows, torch.float32, 2)
    _element("mx_pack", block, bits, man_bits)
    r, n = rows.shape
    stream = torch.empty((r * n * bits + 7) // 8, dtype=torch.uint8)
    return stream, torch.empty(r * (-(-n // block)), dtype=torch.uint8)


def _fake_mx_decode(stream, scales, table, rows, n, block, bits):
    cpu.need("dsq::mx_decode", stream, torch.uint8)
    cpu.need("dsq::mx_decode", scales, torch.uint8)
    cpu.need("dsq::mx_decode", table, torch.float32, 1)
    _element("mx_decode", block, bits, 0)
    return torch.empty((rows, n), dtype=torch.float32)


def _fake_mx_quantize_and_pack(x, q, q_max, q_s, p, p_max, p_s):
    cpu.need("dsq::mx_quantize_and_pack", x, torch.float32, 3)
    for side in (q, p):
        _element("mx_quantize_and_pack", side[1], side[2], side[3])
    lead, n, k = x.shape
    stream = torch.empty((x.numel() * p[2] + 7) // 8, dtype=torch.uint8)
    scales = torch.empty(lead * k * (-(-n // p[1])), dtype=torch.uint8)
    return torch.empty((lead, n, k), dtype=torch.float32), stream, scales


def _fake_nvfp4_scale(x):
    cpu.need("dsq::nvfp4_scale", x, torch.float32)
    return torch.empty(1, dtype=torch.float32)


def _fake_nvfp4_quantize(rows, s):
    cpu.need("dsq::nvfp4_quantize", rows, torch.float32, 2)
    return torch.empty(rows.shape, dtype=torch.float32)


def _fake_nvfp4_pack(rows, s):
    cpu.need("dsq::nvfp4_pack", rows, torch.float32, 2)
    r, n = rows.shape
    stream = torch.empty((r * n * 4 + 7) // 8, dtype=torch.uint8)
    return stream, torch.empty(r * (-(-n // 16)), dtype=torch.uint8)


def _fake_nvfp4_decode(stream, scales, s, e2m1, e4m3, rows, n):
    cpu.need("dsq::nvfp4_decode", stream, torch.uint8)
    cpu.need("dsq::nvfp4_decode", scales, torch.uint8)
    return torch.empty((rows, n), dtype=torch.float32)


@functools.cache
def _register_fakes() -> None:
    for name, fake in globals().items():
        if name.startswith("_fake_"):
            torch.library.register_fake(f"dsq::{name.removeprefix('_fake_')}", fake)


# ----------------------------------------------------------------------------- wrappers
# ``element`` is (bits, man_bits, emin, emax, max_normal, integer): mx_cpu.c's Element.
def mx_quantize(rows: torch.Tensor, block: int, element: tuple) -> torch.Tensor:
    """The values of MX(element, block) of float32 ``rows`` [R, n], blocks along the rows."""
    return _ops().mx_quantize.default(rows, block, *element)


def mx_pack(rows: torch.Tensor, block: int, element: tuple):
    """(the element codes' stream, the scale codes [R * ceil(n / block)]) of ``rows``."""
    return _ops().mx_pack.default(rows, block, *element)


def mx_decode(stream, scales, table: torch.Tensor, rows: int, n: int, block: int, bits: int):
    """Values [rows, n] float32 of an MX stream; ``table`` [2^bits] float32, each code's value."""
    return _ops().mx_decode.default(stream, scales, table, rows, n, block, bits)


def mx_quantize_and_pack(x, q: tuple, q_max: float, q_s: float, p: tuple, p_max: float, p_s):
    """For x [L, N, K] float32 (K's stride 1): (values of side q along K, [L, N, K]; the stream
    of side p's codes along N, in the order [L, K, N]; p's scale codes). A side is (nvfp4,
    block, bits, man_bits, emin, emax, integer) with its largest normal and, for NVFP4, its
    tensor scale (mx_cpu.c's Side)."""
    return _ops().mx_quantize_and_pack.default(x, list(q), q_max, q_s, list(p), p_max, p_s)


def nvfp4_scale(x: torch.Tensor) -> torch.Tensor:
    """NVFP4's tensor scale of float32 ``x``, a tensor of one element."""
    return _ops().nvfp4_scale.default(x)


def nvfp4_quantize(rows: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return _ops().nvfp4_quantize.default(rows, s)


def nvfp4_pack(rows: torch.Tensor, s: torch.Tensor):
    return _ops().nvfp4_pack.default(rows, s)


def nvfp4_decode(stream, scales, s, e2m1, e4m3, rows: int, n: int) -> torch.Tensor:
    return _ops().nvfp4_decode.default(stream, scales, s, e2m1, e4m3, rows, n)
